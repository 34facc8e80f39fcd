"""Record what Composer 0.32.1's losses, metrics and ComposerClassifier produce on fixed inputs.

Runs in the reference environment (``bash scripts/composer_reference/setup.sh``), never in lockstep's:

    /tmp/composer-venv/bin/python scripts/composer_reference/make_metrics_fixture.py

Each case holds its own inputs, so that ``tests/test_composer_models.py`` replays it through
lockstep's objects without drawing random numbers:

* ``losses[name]``: ``fn`` (a name in ``composer.loss`` or ``composer.loss.utils``, or ``DiceLoss``
  with its ``init`` keywords), ``args``, ``kwargs``, and what it gave: ``out``, ``grad`` (of
  ``out.sum()`` by ``args[0]``, where ``with_grad`` asks for it), ``warned``, or ``error`` (the class name);
* ``metrics[name]``: the metric's class name, its ``init`` keywords (a loss function by name),
  ``updates`` (a list of argument pairs), then ``value`` (``compute()``) and ``states`` (its
  ``metric_state``, dtypes included);
* ``classifier``: the names ``ComposerClassifier.get_metrics`` gives for several metric arguments,
  whether it warned or raised, one loss on fixed weights, and the keys of its ``state_dict`` (which
  a checkpoint holds).

The file is ``{"flat": {dtype: 1-d tensor}, "fixture": ...}``, each tensor of the fixture written as
``("tensor:<dtype>", offset, shape)`` into ``flat[dtype]``.

With ``--this-machine`` it writes, instead, the copy for machines whose floating-point results are
this one's (``tests/fixtures/numerics.py``), beside the fixture under ``numerics/<tag>/``.
"""

from __future__ import annotations

import pathlib
import sys
import warnings
from typing import Any

import composer
import torch
import torchmetrics
from composer import loss as composer_loss
from composer import metrics as composer_metrics
from composer.loss import utils as composer_loss_utils
from composer.models import ComposerClassifier
from torch.nn import functional as F

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from tests.fixtures import numerics  # noqa: E402  (the repository, on the path above)

OUT = REPO / "tests" / "fixtures" / "composer" / "metrics.pt"
LOSS_FUNCTIONS = {"cross_entropy": F.cross_entropy, "mse_loss": F.mse_loss}


def tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    def randint(high: int, *shape: int) -> torch.Tensor:
        return torch.randint(0, high, shape, generator=g)

    soft = torch.softmax(randn(6, 4), dim=1)
    soft[2] = 0.0  # an ignored example: no probability at all
    pixel_targets = randint(3, 2, 4, 4)
    pixel_targets[0, 0, :2] = -1
    seg_absent = randint(2, 2, 4, 4)  # class 2 never a target
    tokens = randint(7, 2, 5)
    tokens[:, -2:] = -100
    binary = randint(2, 8)
    binary[:2] = 1
    return {
        "logits": randn(6, 4), "logits_b": randn(4, 4), "logits_c": randn(3, 4),
        "idx": randint(4, 6), "idx_b": randint(4, 4), "idx_c": randint(4, 3),
        "idx_ignored": torch.tensor([0, -100, 3, 1, -100, 2]), "idx_neg": torch.tensor([0, -1, 3, 1, 2, 2]),
        "soft": soft, "soft_full": torch.softmax(randn(6, 4), dim=1), "weight": torch.tensor([0.5, 1.0, 2.0, 0.25]),
        "pos_weight": torch.tensor([1.0, 2.0, 0.5, 3.0]),
        "seg": randn(2, 3, 4, 4), "seg_b": randn(2, 3, 4, 4), "seg_targets": pixel_targets,
        "seg_targets_b": randint(3, 2, 4, 4), "seg_absent": seg_absent,
        "seg_255": torch.where(pixel_targets < 0, 255, pixel_targets),
        "lm": randn(2, 5, 7), "lm_b": randn(2, 5, 7), "tokens": tokens, "tokens_b": randint(7, 2, 5),
        "tokens_pad0": torch.where(tokens < 0, 0, tokens),
        "bin_logits": randn(8, 2), "bin_logits_b": randn(8, 2), "binary": binary, "binary_b": randint(2, 8),
    }


def loss_cases(t: dict[str, torch.Tensor]) -> dict[str, dict[str, Any]]:
    sce, bce, ensure = "soft_cross_entropy", "binary_cross_entropy_with_logits", "ensure_targets_one_hot"
    return {
        "sce_indices": {"fn": sce, "args": [t["logits"], t["idx"]], "kwargs": {}},
        "sce_indices_ignored": {"fn": sce, "args": [t["logits"], t["idx_ignored"]], "kwargs": {}},
        "sce_indices_weight_sum": {"fn": sce, "args": [t["logits"], t["idx"]],
                                   "kwargs": {"weight": t["weight"], "reduction": "sum"}},
        "sce_pixels": {"fn": sce, "args": [t["seg"], t["seg_targets"]], "kwargs": {"ignore_index": -1}},
        "sce_soft": {"with_grad": True, "fn": sce, "args": [t["logits"], t["soft_full"]], "kwargs": {}},
        "sce_soft_partial": {"with_grad": True, "fn": sce, "args": [t["logits"], t["soft"]], "kwargs": {}},
        "sce_soft_weight": {"with_grad": True, "fn": sce, "args": [t["logits"], t["soft_full"]],
                            "kwargs": {"weight": t["weight"]}},
        "sce_soft_sum": {"fn": sce, "args": [t["logits"], t["soft"]], "kwargs": {"reduction": "sum"}},
        "sce_soft_none": {"fn": sce, "args": [t["logits"], t["soft"]], "kwargs": {"reduction": "none"}},
        "sce_soft_ignore_index": {"fn": sce, "args": [t["logits"], t["soft_full"]], "kwargs": {"ignore_index": 0}},
        "sce_soft_zero": {"fn": sce, "args": [t["logits"], torch.zeros(6, 4)], "kwargs": {}},
        "sce_soft_bad_reduction": {"fn": sce, "args": [t["logits"], t["soft_full"]], "kwargs": {"reduction": "max"}},
        "sce_bad_shape": {"fn": sce, "args": [t["logits"], t["soft_full"][:, :3]], "kwargs": {}},
        "bce_indices": {"fn": bce, "args": [t["logits"], t["idx"]], "kwargs": {}},
        "bce_soft_mean": {"with_grad": True, "fn": bce, "args": [t["logits"], t["soft_full"]],
                          "kwargs": {"reduction": "mean"}},
        "bce_pos_weight_unscaled": {"fn": bce, "args": [t["logits"], t["idx"]],
                                    "kwargs": {"pos_weight": t["pos_weight"], "scale_by_batch_size": False}},
        "bce_none": {"fn": bce, "args": [t["logits"], t["idx"]], "kwargs": {"reduction": "none",
                                                                            "weight": t["weight"]}},
        "one_hot": {"fn": ensure, "args": [t["seg"], t["seg_targets_b"]], "kwargs": {}},
        "one_hot_negative": {"fn": ensure, "args": [t["logits"], t["idx_neg"]], "kwargs": {}},
        "one_hot_wider": {"fn": ensure, "args": [t["logits"], t["idx"]], "kwargs": {"num_classes": 6}},
        "one_hot_too_few": {"fn": ensure, "args": [t["logits"], t["idx"] + 4], "kwargs": {}},
        "one_hot_float_indices": {"fn": ensure, "args": [t["logits"], t["idx"].float()], "kwargs": {}},
        "infer_type": {"fn": "infer_target_type", "args": [t["seg"], t["seg_targets"]], "kwargs": {}},
        "index_check": {"fn": "check_for_index_targets", "args": [t["idx"].int()], "kwargs": {}},
        **{f"dice_loss_{name}": {"fn": "DiceLoss", "with_grad": grad, "init": init, "args": [t["seg"], target],
                                 "kwargs": {}}
           for name, init, target, grad in [
               ("plain", {}, t["seg_targets_b"], False),
               ("softmax", {"softmax": True}, t["seg_targets"], True),
               ("sigmoid_squared_jaccard", {"sigmoid": True, "squared_pred": True, "jaccard": True},
                t["seg_targets_b"], True),
               ("batch_absent", {"softmax": True, "batch": True, "ignore_absent_classes": True}, t["seg_absent"],
                False),
               ("absent_sum", {"softmax": True, "ignore_absent_classes": True, "reduction": "sum"},
                t["seg_absent"], False),
               ("none", {"sigmoid": True, "reduction": "none"}, t["seg_targets_b"], False),
           ]},
        "dice_loss_both": {"fn": "DiceLoss", "init": {"sigmoid": True, "softmax": True},
                           "args": [t["seg"], t["seg_targets_b"]], "kwargs": {}},
    }


def metric_cases(t: dict[str, torch.Tensor]) -> dict[str, dict[str, Any]]:
    batches = [(t["logits"], t["idx"]), (t["logits_b"], t["idx_b"]), (t["logits_c"], t["idx_c"])]
    lm = [(t["lm"], t["tokens"]), ({"logits": t["lm_b"]}, t["tokens_b"])]
    return {
        "cross_entropy": {"metric": "CrossEntropy", "init": {}, "updates": batches},
        "cross_entropy_mixed": {"metric": "CrossEntropy", "init": {"ignore_index": -1},
                                "updates": [(t["logits"], t["soft"]), (t["seg"], t["seg_targets"])]},
        "loss_metric": {"metric": "LossMetric", "init": {"loss_function": "cross_entropy"}, "updates": batches},
        "loss_metric_mse": {"metric": "LossMetric", "init": {"loss_function": "mse_loss"},
                            "updates": [(t["logits"], t["soft_full"])]},
        "miou": {"metric": "MIoU", "init": {"num_classes": 3},
                 "updates": [(t["seg"], t["seg_targets"]), (t["seg_b"], t["seg_targets_b"])]},
        "miou_255": {"metric": "MIoU", "init": {"num_classes": 3, "ignore_index": 255},
                     "updates": [(t["seg"], t["seg_255"])]},
        "miou_absent": {"metric": "MIoU", "init": {"num_classes": 4}, "updates": [(t["seg"], t["seg_absent"])]},
        "dice": {"metric": "Dice", "init": {"num_classes": 2},
                 "updates": [(t["seg"], t["seg_targets_b"]), (t["seg_b"], t["seg_absent"])]},
        "masked_accuracy": {"metric": "MaskedAccuracy", "init": {}, "updates": [lm[0], (t["lm_b"], t["tokens_b"])]},
        "masked_accuracy_ignore_0": {"metric": "MaskedAccuracy", "init": {"ignore_index": 0},
                                     "updates": [(t["lm"], t["tokens_pad0"])]},
        "language_cross_entropy": {"metric": "LanguageCrossEntropy", "init": {}, "updates": lm},
        "language_cross_entropy_ignore_0": {"metric": "LanguageCrossEntropy", "init": {"ignore_index": 0},
                                            "updates": [(t["lm"], t["tokens_pad0"])]},
        "language_perplexity": {"metric": "LanguagePerplexity", "init": {}, "updates": lm},
        "binary_f1": {"metric": "BinaryF1Score", "init": {},
                      "updates": [(t["bin_logits"], t["binary"]), (t["bin_logits_b"], t["binary_b"])]},
    }


def run_loss(case: dict[str, Any]) -> dict[str, Any]:
    name = case["fn"]
    if name == "DiceLoss":
        try:
            fn = composer_loss.DiceLoss(**case["init"])
        except Exception as e:  # noqa: BLE001 - the class of Composer's error is what is recorded
            return {"error": type(e).__name__}
    else:
        fn = getattr(composer_loss, name, None) or getattr(composer_loss_utils, name)
    args = [a.clone().requires_grad_(i == 0 and a.is_floating_point()) for i, a in enumerate(case["args"])]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            out = fn(*args, **case["kwargs"])
        except Exception as e:  # noqa: BLE001
            return {"error": type(e).__name__}
    result: dict[str, Any] = {"out": out.detach() if isinstance(out, torch.Tensor) else out,
                              "warned": bool(caught)}
    if isinstance(out, torch.Tensor) and out.requires_grad and case.get("with_grad", False):
        out.sum().backward()
        result["grad"] = args[0].grad
    return result


def run_metric(case: dict[str, Any]) -> dict[str, Any]:
    init = dict(case["init"])
    if "loss_function" in init:
        init["loss_function"] = LOSS_FUNCTIONS[init["loss_function"]]
    metric = getattr(composer_metrics, case["metric"])(**init)
    for preds, targets in case["updates"]:
        metric.update(preds, targets)
    return {"value": metric.compute(), "states": {k: v.clone() for k, v in metric.metric_state.items()}}


def classifier(t: dict[str, torch.Tensor]) -> dict[str, Any]:
    acc = torchmetrics.classification.MulticlassAccuracy(num_classes=4, average="micro")
    f1 = torchmetrics.classification.MulticlassF1Score(num_classes=4)
    ce = composer_metrics.CrossEntropy()

    class WithClasses(torch.nn.Linear):
        num_classes = 4

    names: dict[str, Any] = {}
    for label, kwargs in [
        ("default", {"num_classes": 4}),
        ("single", {"train_metrics": ce, "val_metrics": acc}),
        ("collection", {"train_metrics": torchmetrics.MetricCollection([acc, f1]),
                        "val_metrics": torchmetrics.MetricCollection({"acc": acc, "ce": ce})}),
        ("prefixed", {"num_classes": 4, "val_metrics": torchmetrics.MetricCollection([ce, f1], prefix="val_")}),
    ]:
        model = ComposerClassifier(torch.nn.Linear(5, 4), **kwargs)
        names[label] = {"train": list(model.get_metrics(is_train=True)), "eval": list(model.get_metrics())}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mismatched = ComposerClassifier(WithClasses(5, 4), num_classes=3)
    try:
        ComposerClassifier(torch.nn.Linear(5, 4), val_metrics=acc)
        missing = "no error"
    except Exception as e:  # noqa: BLE001
        missing = type(e).__name__
    g = torch.Generator().manual_seed(3)
    module = torch.nn.Linear(4, 4)
    weights = {k: torch.randn(v.shape, generator=g) for k, v in module.state_dict().items()}
    module.load_state_dict(weights)
    model = ComposerClassifier(module, num_classes=4)
    batch = (t["logits"], t["idx"])
    outputs = model(batch)
    return {"names": names, "mismatch_num_classes": mismatched.num_classes, "mismatch_warned": bool(caught),
            "missing_num_classes": missing, "weights": weights, "outputs": outputs.detach(),
            "state_dict_keys": list(model.state_dict()),
            "loss": model.loss(outputs, batch).detach()}


def pack(obj: Any, flat: dict[str, list[torch.Tensor]], refs: dict[int, tuple]) -> Any:
    """``obj`` with each tensor replaced by ``("tensor:<dtype>", offset, shape)`` into ``flat[dtype]``;
    a tensor met twice is stored once."""
    if isinstance(obj, torch.Tensor):
        if id(obj) not in refs:
            dtype = str(obj.dtype).removeprefix("torch.")
            parts = flat.setdefault(dtype, [])
            refs[id(obj)] = (sys.intern(f"tensor:{dtype}"), sum(p.numel() for p in parts), tuple(obj.shape))
            parts.append(obj.detach().reshape(-1))
        return refs[id(obj)]
    if isinstance(obj, dict):
        return {k: pack(v, flat, refs) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(pack(v, flat, refs) for v in obj)
    return obj


def main() -> None:
    out = numerics.this_machines(OUT) if "--this-machine" in sys.argv[1:] else OUT
    t = tensors(seed=0)
    fixture = {
        "versions": {"composer": composer.__version__, "torch": str(torch.__version__),
                     "torchmetrics": torchmetrics.__version__},
        "losses": {name: {**case, **run_loss(case)} for name, case in loss_cases(t).items()},
        "metrics": {name: {**case, **run_metric(case)} for name, case in metric_cases(t).items()},
        "classifier": classifier(t),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    # ~100 tensors of a few numbers each cost ~200 bytes apiece in a torch.save; one flat tensor per
    # dtype and references into it make the file 15 KB instead of 45
    flat: dict[str, list[torch.Tensor]] = {}
    packed = pack(fixture, flat, {})
    torch.save({"flat": {dtype: torch.cat(parts) for dtype, parts in flat.items()}, "fixture": packed}, out)
    print(f"wrote {out} ({out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
