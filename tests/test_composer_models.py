"""Composer's models, metrics and losses at Composer's paths: the same objects as lockstep's, the same
numbers as Composer 0.32.1 (tests/fixtures/composer/metrics.pt, made by
scripts/composer_reference/make_metrics_fixture.py), and a ComposerClassifier that trains and
evaluates under lockstep's Trainer at one and two ranks."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torchmetrics
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import lockstep
import lockstep.loss
import lockstep.loss.loss
import lockstep.loss.utils
import lockstep.metrics
import lockstep.metrics.metrics
import lockstep.metrics.nlp
import lockstep.models
import lockstep.models.base
import lockstep.models.tasks
import lockstep.models.tasks.classification
from lockstep.loggers import InMemoryLogger
from lockstep.models import ComposerClassifier
from lockstep.testing import run_distributed
from lockstep import Trainer
from tests.fixtures.numerics import for_this_machine

FIXTURE_PATH = for_this_machine(Path(__file__).parent / "fixtures" / "composer" / "metrics.pt")
LOSS_FUNCTIONS = {"cross_entropy": F.cross_entropy, "mse_loss": F.mse_loss}

# __all__ of composer.models, composer.metrics, composer.loss and composer.loss.utils in Composer 0.32.1
COMPOSER_MODELS = {"ComposerModel", "HuggingFaceModel", "write_huggingface_pretrained_from_composer_checkpoint",
                   "Initializer", "ComposerClassifier"}
COMPOSER_METRICS = {"MAP", "MIoU", "Dice", "CrossEntropy", "LossMetric", "BinaryF1Score", "LanguageCrossEntropy",
                    "MaskedAccuracy", "LanguagePerplexity"}
COMPOSER_LOSS = {"DiceLoss", "binary_cross_entropy_with_logits", "loss_registry", "soft_cross_entropy"}
COMPOSER_LOSS_UTILS = {"infer_target_type", "ensure_targets_one_hot", "check_for_index_targets"}


def _unpack(obj: Any, flat: dict[str, torch.Tensor]) -> Any:
    """The fixture with each ``("tensor:<dtype>", offset, shape)`` turned back into its tensor."""
    if isinstance(obj, tuple) and obj and isinstance(obj[0], str) and obj[0].startswith("tensor:"):
        _, offset, shape = obj
        size = int(torch.Size(shape).numel())
        return flat[obj[0].removeprefix("tensor:")][offset:offset + size].reshape(shape).clone()
    if isinstance(obj, dict):
        return {k: _unpack(v, flat) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_unpack(v, flat) for v in obj)
    return obj


def _load_fixture() -> dict[str, Any]:
    saved = torch.load(FIXTURE_PATH, weights_only=True)
    return _unpack(saved["fixture"], saved["flat"])


FIXTURE = _load_fixture()


# -- the names ---------------------------------------------------------------------------------------


def test_composer_model_is_lockstep_model_at_every_path() -> None:
    assert lockstep.ComposerModel is lockstep.Model
    assert lockstep.models.ComposerModel is lockstep.Model
    assert lockstep.models.base.ComposerModel is lockstep.Model
    assert "ComposerModel" in lockstep.__all__


def test_every_model_name_is_one_object_at_both_paths() -> None:
    assert set(lockstep.models.__all__) <= COMPOSER_MODELS
    assert {"ComposerModel", "ComposerClassifier"} <= set(lockstep.models.__all__)
    assert lockstep.models.ComposerClassifier is lockstep.models.tasks.ComposerClassifier
    assert lockstep.models.tasks.ComposerClassifier is lockstep.models.tasks.classification.ComposerClassifier
    assert issubclass(ComposerClassifier, lockstep.Model)


def test_every_metric_and_loss_name_is_one_object_at_both_paths() -> None:
    assert set(lockstep.metrics.__all__) == COMPOSER_METRICS - {"MAP"}
    for name in lockstep.metrics.__all__:
        home = lockstep.metrics.metrics if name in lockstep.metrics.metrics.__all__ else lockstep.metrics.nlp
        assert getattr(lockstep.metrics, name) is getattr(home, name), name
        assert issubclass(getattr(lockstep.metrics, name), torchmetrics.Metric), name
    assert set(lockstep.loss.__all__) == COMPOSER_LOSS
    for name in lockstep.loss.__all__:
        assert getattr(lockstep.loss, name) is getattr(lockstep.loss.loss, name), name
    assert set(lockstep.loss.utils.__all__) == COMPOSER_LOSS_UTILS
    assert lockstep.loss.loss_registry == {"binary_cross_entropy_with_logits":
                                           lockstep.loss.binary_cross_entropy_with_logits,
                                           "soft_cross_entropy": lockstep.loss.soft_cross_entropy}


def test_importing_lockstep_and_its_models_does_not_import_torchmetrics() -> None:
    # with transformers installed, importing torchmetrics takes over a second more on every rank
    code = ("import sys, lockstep, lockstep.models, lockstep.callbacks, lockstep.loggers; lockstep.ComposerModel; "
            "lockstep.Trainer; "
            "assert 'torchmetrics' not in sys.modules, 'torchmetrics was imported'; "
            "lockstep.models.ComposerClassifier; assert 'torchmetrics' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# -- the numbers, against Composer's ------------------------------------------------------------------


def _loss_function(case: dict[str, Any]) -> Any:
    if case["fn"] == "DiceLoss":
        return lockstep.loss.DiceLoss(**case["init"])
    return getattr(lockstep.loss, case["fn"], None) or getattr(lockstep.loss.utils, case["fn"])


@pytest.mark.parametrize("name", sorted(FIXTURE["losses"]))
def test_loss_is_bitwise_composers(name: str) -> None:
    case = FIXTURE["losses"][name]
    args = [a.clone().requires_grad_(i == 0 and a.is_floating_point()) for i, a in enumerate(case["args"])]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            out = _loss_function(case)(*args, **case["kwargs"])
        except Exception as e:  # noqa: BLE001 - compared with the class of Composer's error
            assert type(e).__name__ == case.get("error"), f"raised {e!r} where Composer gave {case.get('out')}"
            return
    assert "error" not in case, f"Composer raised {case['error']}, lockstep returned {out}"
    assert bool(caught) == case["warned"], [str(w.message) for w in caught]
    if isinstance(out, torch.Tensor):
        assert out.dtype == case["out"].dtype and torch.equal(out.detach(), case["out"]), (out, case["out"])
    else:
        assert out == case["out"]
    if "grad" in case:
        out.sum().backward()
        assert torch.equal(args[0].grad, case["grad"])


def _metric(case: dict[str, Any]) -> torchmetrics.Metric:
    init = dict(case["init"])
    if "loss_function" in init:
        init["loss_function"] = LOSS_FUNCTIONS[init["loss_function"]]
    return getattr(lockstep.metrics, case["metric"])(**init)


@pytest.mark.parametrize("name", sorted(FIXTURE["metrics"]))
def test_metric_states_and_value_are_bitwise_composers(name: str) -> None:
    case = FIXTURE["metrics"][name]
    metric = _metric(case)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # soft targets with less than 1 probability warn, as in Composer
        for preds, targets in case["updates"]:
            metric.update(preds, targets)
    value = metric.compute()
    states = metric.metric_state
    assert states.keys() == case["states"].keys()
    for key, expected in case["states"].items():
        assert states[key].dtype == expected.dtype and torch.equal(states[key], expected), key
    if isinstance(case["value"], torch.Tensor):
        assert value.dtype == case["value"].dtype and torch.equal(value, case["value"]), (value, case["value"])
    else:  # Dice gives a rounded Python float
        assert type(value) is type(case["value"]) and value == case["value"]


class _WithClasses(torch.nn.Linear):
    num_classes = 4


def _composer_classifier_cases() -> dict[str, dict[str, Any]]:
    acc = torchmetrics.classification.MulticlassAccuracy(num_classes=4, average="micro")
    f1 = torchmetrics.classification.MulticlassF1Score(num_classes=4)
    ce = lockstep.metrics.CrossEntropy()
    return {
        "default": {"num_classes": 4},
        "single": {"train_metrics": ce, "val_metrics": acc},
        "collection": {"train_metrics": torchmetrics.MetricCollection([acc, f1]),
                       "val_metrics": torchmetrics.MetricCollection({"acc": acc, "ce": ce})},
        "prefixed": {"num_classes": 4, "val_metrics": torchmetrics.MetricCollection([ce, f1], prefix="val_")},
    }


def test_classifier_names_its_metrics_as_composer() -> None:
    expected = FIXTURE["classifier"]["names"]
    for label, kwargs in _composer_classifier_cases().items():
        model = ComposerClassifier(torch.nn.Linear(5, 4), **kwargs)
        names = {"train": list(model.get_metrics(is_train=True)), "eval": list(model.get_metrics())}
        assert names == expected[label], label
    default = ComposerClassifier(torch.nn.Linear(5, 4), num_classes=4).get_metrics()
    assert isinstance(default["CrossEntropy"], lockstep.metrics.CrossEntropy)
    assert default["MulticlassAccuracy"].average == "micro" and default["MulticlassAccuracy"].num_classes == 4


def test_classifier_takes_num_classes_from_the_module_or_says_what_is_missing() -> None:
    record = FIXTURE["classifier"]
    with pytest.warns(UserWarning, match="num_classes=3"):
        assert ComposerClassifier(_WithClasses(5, 4), num_classes=3).num_classes == record["mismatch_num_classes"]
    assert ComposerClassifier(_WithClasses(5, 4)).num_classes == 4
    assert record["missing_num_classes"] == "ValueError"
    with pytest.raises(ValueError, match="pass num_classes=..., give the module a num_classes attribute"):
        ComposerClassifier(torch.nn.Linear(5, 4), val_metrics=lockstep.metrics.CrossEntropy())
    both = ComposerClassifier(torch.nn.Linear(5, 4), train_metrics=lockstep.metrics.CrossEntropy(),
                              val_metrics=lockstep.metrics.CrossEntropy())
    assert both.num_classes is None


def test_classifier_state_forward_and_loss_are_composers() -> None:
    record = FIXTURE["classifier"]
    module = torch.nn.Linear(4, 4)
    module.load_state_dict(record["weights"])
    model = ComposerClassifier(module, num_classes=4)
    batch = (FIXTURE["losses"]["sce_indices"]["args"][0], FIXTURE["losses"]["sce_indices"]["args"][1])
    assert list(model.state_dict()) == record["state_dict_keys"]  # so Composer's checkpoints load
    outputs = model(batch)
    assert torch.equal(outputs, record["outputs"])
    assert torch.equal(model.loss(outputs, batch), record["loss"])
    soft = F.one_hot(batch[1], 4).float()  # one-hot targets give the loss of class indices
    torch.testing.assert_close(model.loss(outputs, (batch[0], soft)), record["loss"], rtol=1e-6, atol=0)


# -- training and evaluation under the Trainer ------------------------------------------------------


def _data(n: int, seed: int) -> TensorDataset:
    """Inputs whose class is that of their largest score under a fixed linear map: learnable."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    rule = torch.linspace(-1, 1, 18).reshape(6, 3)
    return TensorDataset(x, (x @ rule).argmax(dim=1))


def _fit_and_evaluate() -> dict[str, Any]:
    """Train a ComposerClassifier for 2 epochs, evaluating after each; what it logged and what the
    trained model gives over the whole eval set, computed directly. Runs on every rank."""
    from lockstep import dist

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    model = ComposerClassifier(module, num_classes=3)
    train, evaluation = _data(32, seed=1), _data(24, seed=2)
    logger = InMemoryLogger()
    # 4 samples a batch: 6 batches at one rank, 3 a rank at two; all the same size, so Composer's
    # CrossEntropy (a mean over batches) is the mean over samples
    trainer = Trainer(model=model, max_duration="2ep", progress_bar=False, loggers=[logger],
                      train_dataloader=DataLoader(train, batch_size=4, sampler=dist.get_sampler(train, shuffle=True)),
                      eval_dataloader=DataLoader(evaluation, batch_size=4,
                                                 sampler=dist.get_sampler(evaluation, shuffle=False)),
                      optimizers=torch.optim.SGD(model.parameters(), lr=0.1))
    trainer.fit()
    x, y = evaluation.tensors
    with torch.no_grad():
        logits = module(x)
    logged = {name: [v for _, v in series] for name, series in logger.data.items() if name.startswith("metrics/")}
    # state.eval_metrics is Composer's {label: {name: Metric}}: the values of the 'eval' evaluator's
    return {"eval_metrics": {name: float(m.compute()) for name, m in trainer.state.eval_metrics["eval"].items()},
            "logged": logged,
            "cross_entropy": float(F.cross_entropy(logits, y)),
            "accuracy": float((logits.argmax(dim=1) == y).double().mean()),
            "weights": [p.detach().clone() for p in module.parameters()]}


def _check_evaluation(result: dict[str, Any], rank: int = 0) -> None:
    metrics = result["eval_metrics"]
    assert metrics.keys() == {"loss", "CrossEntropy", "MulticlassAccuracy"}
    # InMemoryLogger, as Composer's, keeps what every rank logs: the reduced metrics, the same on each
    # and the classifier's training metric, every batch, as in Composer
    assert result["logged"].keys() == {"metrics/eval/CrossEntropy", "metrics/eval/MulticlassAccuracy",
                                       "metrics/train/MulticlassAccuracy"}
    assert all(len(values) == 2 for name, values in result["logged"].items()
               if "/eval/" in name)  # one evaluation an epoch
    assert result["logged"]["metrics/eval/CrossEntropy"][-1] == metrics["CrossEntropy"]
    assert result["logged"]["metrics/eval/MulticlassAccuracy"][-1] == metrics["MulticlassAccuracy"]
    # batches of 4 evaluated apart and the whole set at once round differently in float32
    assert metrics["CrossEntropy"] == pytest.approx(result["cross_entropy"], rel=1e-6)
    assert metrics["loss"] == pytest.approx(result["cross_entropy"], rel=1e-6)
    assert metrics["MulticlassAccuracy"] == pytest.approx(result["accuracy"], abs=1e-7)  # k/24: one miss is 0.04


def test_classifier_trains_and_evaluates_in_one_process() -> None:
    result = _fit_and_evaluate()
    _check_evaluation(result)
    assert result["logged"]["metrics/eval/CrossEntropy"][-1] < result["logged"]["metrics/eval/CrossEntropy"][0]


def _two_ranks() -> dict[str, Any]:
    from lockstep import dist

    result = _fit_and_evaluate()
    # each rank updates with every other batch of a fixture case; compute() sums the states over ranks
    synced = {}
    for name in ("cross_entropy", "miou", "masked_accuracy", "language_perplexity", "binary_f1", "dice"):
        case = FIXTURE["metrics"][name]
        metric = _metric(case)
        for preds, targets in case["updates"][dist.get_global_rank()::2]:
            metric.update(preds, targets)
        synced[name] = metric.compute()
    return {**result, "synced": synced}


@pytest.mark.timeout(240)
def test_classifier_trains_and_evaluates_at_two_ranks() -> None:
    results = run_distributed(_two_ranks, world_size=2, timeout=200)
    for rank, result in enumerate(results):
        _check_evaluation(result, rank)
        for name, value in result["synced"].items():
            # the ranks' partial sums are added in another order than one process's running sum
            torch.testing.assert_close(torch.as_tensor(value), torch.as_tensor(FIXTURE["metrics"][name]["value"]),
                                       rtol=1e-6, atol=0, msg=name)
    assert results[0]["eval_metrics"] == results[1]["eval_metrics"]
    for a, b in zip(results[0]["weights"], results[1]["weights"]):
        assert torch.equal(a, b)
