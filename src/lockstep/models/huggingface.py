"""``HuggingFaceModel``: a Hugging Face ``transformers`` model as a lockstep Model, as Composer's.

Batches are dicts (``input_ids``, ``attention_mask``, ``labels``, ...) passed to the transformers
model as keywords (keys its ``forward`` does not take are dropped); the loss is the one the model
computes from ``labels``. Under FSDP the modules of the classes the model names in
``_no_split_modules`` (a GPT-2 ``GPT2Block``, a Llama ``LlamaDecoderLayer``, ...) are the FSDP
units, and, with ``fsdp_config={'activation_checkpointing': True}``, the checkpointed ones.

Needs the ``huggingface`` extra: ``pip install 'torch-lockstep[huggingface]'``.
"""

from __future__ import annotations

import inspect
import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lockstep.model import Model
from lockstep.optional import HUGGINGFACE_INSTALL_HINT

__all__ = ["HuggingFaceModel"]


class HuggingFaceModel(Model):
    """Wraps a ``transformers.PreTrainedModel`` for the Trainer (Composer's ``HuggingFaceModel``).

    Args:
        model: the transformers model; it computes its own loss when the batch has ``labels``.
        tokenizer: its tokenizer, saved with the model's config in each checkpoint (and used by
            :meth:`generate` and the ``Generate`` callback).
        use_logits: evaluation metrics get the logits (and the batch's labels, shifted for a causal
            LM) rather than the model's whole output.
        metrics: torchmetrics for training, named by class name; ``eval_metrics`` for evaluation
            (default: a copy of ``metrics``).
        shift_labels: shift the labels left by one for metrics (what a causal LM predicts); by
            default True for the model classes transformers registers as causal LMs.

    The parameters sit under ``model.`` (``model.transformer.h.0.attn.c_attn.weight``), as in
    Composer's checkpoints.
    """

    def __init__(self, model: nn.Module, tokenizer: Any = None, use_logits: bool | None = False,
                 metrics: Sequence[Any] | None = None, eval_metrics: Sequence[Any] | None = None,
                 shift_labels: bool | None = None) -> None:
        transformers = _import_transformers()
        if not isinstance(model, transformers.PreTrainedModel):
            raise TypeError(f"HuggingFaceModel wraps a transformers PreTrainedModel, got {type(model).__name__}")
        _check_tokenizer(tokenizer, transformers)
        super().__init__()
        self.model = model
        self.config = model.config
        self.tokenizer = tokenizer
        self.use_logits = bool(use_logits)
        self.model_forward_args = set(inspect.signature(model.forward).parameters)
        self.train_metrics = _by_name(metrics) if metrics is not None else None
        self.val_metrics = _by_name(eval_metrics) if eval_metrics is not None else _copied(self.train_metrics)
        causal = _is_causal_lm(model)
        self.shift_labels = causal if shift_labels is None else bool(shift_labels)
        if tokenizer is not None and self.config.vocab_size < len(tokenizer):
            raise ValueError(f"the tokenizer has {len(tokenizer)} tokens and the model's embeddings "
                             f"{self.config.vocab_size}: call model.resize_token_embeddings(len(tokenizer)) first")
        self.labels: torch.Tensor | None = None
        self._no_split = _classes_named(model, getattr(model, "_no_split_modules", None) or [])
        self._metadata: dict[str, Any] | None = None

    # -- what the Trainer calls ----------------------------------------------------------------

    def forward(self, batch: Any) -> Any:
        if not isinstance(batch, Mapping):
            raise TypeError(f"HuggingFaceModel takes dict batches (input_ids, attention_mask, labels, ...), got a "
                            f"{type(batch).__name__}: have the DataLoader yield dicts")
        return self.model(**{k: v for k, v in batch.items() if k in self.model_forward_args})

    def loss(self, outputs: Any, batch: Any) -> torch.Tensor:
        return outputs["loss"] if isinstance(outputs, Mapping) else outputs[0]  # a ModelOutput, or a tuple

    def eval_forward(self, batch: Any, outputs: Any = None) -> Any:
        if not (self.use_logits or batch.get("mode") == "icl_task"):
            return outputs if outputs is not None else self.forward(batch)
        batch = dict(batch)
        self.labels = labels = batch.pop("labels").clone()
        if self.shift_labels or batch.get("mode") == "icl_task":  # the token each position predicts
            labels[:, :-1] = labels[:, 1:].clone()
            labels[:, -1] = -100
        output = outputs if outputs is not None else self.forward(batch)
        if isinstance(output, Mapping):
            logits = output["logits"]
        else:  # a cached training output starts with the loss
            logits = output[1] if output[0].dim() == 0 else output[0]
        return logits.squeeze(1) if logits.dim() == 2 and logits.shape[1] == 1 else logits

    def get_metrics(self, is_train: bool = False) -> dict[str, Any]:
        return (self.train_metrics if is_train else self.val_metrics) or {}

    def update_metric(self, batch: Any, outputs: Any, metric: Any) -> None:
        labels = self.labels if self.labels is not None else batch["labels"]
        metric.update(outputs, labels.to(outputs.device) if isinstance(outputs, torch.Tensor) else labels)

    def num_tokens(self, batch: Any) -> int:
        """Composer's count: every position of ``input_ids`` (padding too)."""
        ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
        return int(ids.numel()) if isinstance(ids, torch.Tensor) else 0

    # -- FSDP ------------------------------------------------------------------------------------

    def fsdp_wrap_fn(self, module: nn.Module) -> bool:
        """The FSDP units: modules of the classes in the model's ``_no_split_modules``."""
        return isinstance(module, self._no_split)

    def activation_checkpointing_fn(self, module: nn.Module) -> bool:
        """The same modules are checkpointed when ``fsdp_config['activation_checkpointing']`` is on."""
        return isinstance(module, self._no_split)

    # -- generation and checkpoints --------------------------------------------------------------

    def generate(self, input_ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """The transformers model's ``generate``; every rank must call it together under FSDP (pass
        ``synced_gpus=True`` when the ranks may stop after different numbers of tokens)."""
        pad = getattr(self.tokenizer, "pad_token_id", None) if self.tokenizer is not None else None
        if pad is None and self.tokenizer is not None:
            pad = getattr(self.tokenizer, "eos_token_id", None)
        if pad is not None:
            kwargs.setdefault("pad_token_id", pad)
        from torch.distributed.fsdp import FSDPModule

        if not isinstance(self, FSDPModule):
            return self.model.generate(input_ids=input_ids, **kwargs)
        # generate() calls the transformers model, not this root FSDP unit's forward, whose hooks
        # would gather the parameters it holds itself (the embeddings): gather them around it
        self.unshard()
        try:
            return self.model.generate(input_ids=input_ids, **kwargs)
        finally:
            self.reshard()

    def get_metadata(self) -> dict[str, Any]:
        """The model's config (and the tokenizer's files) as Composer keeps them in a checkpoint's
        ``state['integrations']['huggingface']``: plain JSON-like data, computed once."""
        if self._metadata is None:
            config = json.loads(self.config.to_json_string())
            model_class = f"{type(self.model).__module__}.{type(self.model).__name__}"
            self._metadata = {"model": {"config": {"file_extension": ".json", "content": config, "class": model_class}},
                              "tokenizer": _tokenizer_files(self.tokenizer) if self.tokenizer is not None else {}}
        return self._metadata


def _import_transformers() -> Any:
    try:
        import transformers
    except ImportError as e:
        raise ImportError(f"HuggingFaceModel needs transformers: {HUGGINGFACE_INSTALL_HINT}") from e
    return transformers


def _check_tokenizer(tokenizer: Any, transformers: Any) -> None:
    """A tokenizer object or None; a name or path (which ``len`` and the checkpoint would take as
    the tokenizer) is a one-line TypeError saying how to make the object."""
    if tokenizer is None or isinstance(tokenizer, transformers.PreTrainedTokenizerBase):
        return
    if isinstance(tokenizer, (str, os.PathLike)):
        raise TypeError(f"HuggingFaceModel(tokenizer={str(tokenizer)!r}) takes a tokenizer object, not its name or "
                        f"path: pass tokenizer=AutoTokenizer.from_pretrained({str(tokenizer)!r})")
    raise TypeError(f"HuggingFaceModel(tokenizer=...) takes a transformers tokenizer (PreTrainedTokenizerBase), got a "
                    f"{type(tokenizer).__name__}: pass tokenizer=AutoTokenizer.from_pretrained(...)")


def _by_name(metrics: Sequence[Any] | Any) -> dict[str, Any]:
    metrics = [metrics] if not isinstance(metrics, Sequence) else metrics
    return {type(m).__name__: m for m in metrics}


def _copied(metrics: dict[str, Any] | None) -> dict[str, Any] | None:
    import copy
    return copy.deepcopy(metrics) if metrics is not None else None


def _is_causal_lm(model: nn.Module) -> bool:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return type(model).__name__ in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


def _classes_named(model: nn.Module, names: Sequence[str]) -> tuple[type, ...]:
    """The classes, among the model's own modules, whose names ``_no_split_modules`` lists."""
    wanted = set(names)
    return tuple({type(m) for m in model.modules() if type(m).__name__ in wanted})


def _tokenizer_files(tokenizer: Any) -> dict[str, Any]:
    """The tokenizer's saved files, as Composer keeps them: JSON as data, text as lines."""
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as folder:
        tokenizer.save_pretrained(folder)
        for path in sorted(Path(folder).iterdir()):
            if path.suffix == ".json":
                out[path.stem] = {"file_extension": ".json", "content": json.loads(path.read_text())}
            elif path.suffix == ".txt":
                out[path.stem] = {"file_extension": ".txt", "content": path.read_text().splitlines()}
    return out
