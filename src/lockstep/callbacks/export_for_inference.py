"""ExportForInferenceCallback: export the trained model when ``fit`` ends (Composer's callback)."""

from __future__ import annotations

from typing import Any

from lockstep import dist
from lockstep.core.callback import Callback
from lockstep.utils.inference import ExportFormat, export_with_logger

__all__ = ["ExportForInferenceCallback"]


class ExportForInferenceCallback(Callback):
    """At FIT_END, rank 0 writes the model (the user's module, unwrapped) in ``save_format``
    (``'torchscript'`` or ``'onnx'``) to ``save_path`` (a local path, a name in
    ``save_object_store``, or an ``s3://`` URI); see :func:`lockstep.utils.inference.export_for_inference`."""

    def __init__(self, save_format: str | ExportFormat, save_path: str, save_object_store: Any = None,
                 sample_input: Any = None, transforms: Any = None) -> None:
        self.save_format = ExportFormat(save_format)
        self.save_path = str(save_path)
        self.save_object_store = save_object_store
        self.sample_input = sample_input
        self.transforms = transforms

    def fit_end(self, state: Any, logger: Any) -> None:
        if dist.get_global_rank() != 0:
            return
        sample = self.sample_input
        if sample is None and state.batch is not None:  # the last batch's inputs, as the model takes them
            sample = (state.batch,)
        export_with_logger(state.model, self.save_format, self.save_path, logger, self.save_object_store,
                           sample, transforms=self.transforms)
