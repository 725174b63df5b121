"""The skeleton of every ONNX exporter (TensorRT, ONNX Runtime, OpenPPL), as one ordered list of steps.

1. :meth:`QdqOnnxExporter.check_values` — the option values, before the model is read;
2. the model (:func:`~fxq.backends.qdq.common.quantized_graph`), the files (``companions``) and the generic
   capability pre-check (:func:`fxq.backends.capability.check_capabilities`);
3. :meth:`~QdqOnnxExporter.choose_opset`, then :func:`~fxq.backends.qdq.pipeline.lower_model` (torch.onnx with
   quant marks; when the user gave no opset, an op that torch.onnx writes only from a newer one raises it);
4. :meth:`~QdqOnnxExporter.render` — the backend's own part: Q/DQ or stripped marks, its checks, its file contents;
5. all files written as one atomic set (:meth:`fxq.backends.base.Exporter.export`); a ``.onnx`` over protobuf's
   2 GiB limit comes with its external data ``<name>.onnx.data`` (:func:`~fxq.backends.qdq.common.serialize`).

A backend subclasses :class:`QdqOnnxExporter`, sets ``defaults`` (its options and their values) and implements
:meth:`render`; the options it accepts are the keys of ``defaults`` plus nothing else.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, ClassVar

from torch import fx, nn

from fxq.backends.base import Exporter, FileContents
from fxq.backends.capability import check_capabilities
from fxq.graph.quant_graph import QuantGraph
from fxq.nn.fake_quantize import FakeQuantize

__all__ = ["QdqOnnxExporter", "QdqJob"]


@dataclasses.dataclass
class QdqJob:
    """What the shared steps hand to a backend's :meth:`QdqOnnxExporter.render`."""

    gm: fx.GraphModule
    paths: dict[str, Path]  # "main" and the companions' keys
    quantizers: dict[str, FakeQuantize]
    options: dict[str, Any]  # every option, defaults filled in
    opset: int
    lowered: Any  # fxq.backends.qdq.lowering.Lowered


class QdqOnnxExporter(Exporter):
    """Base of the ONNX exporters: the shared steps in :meth:`render_files`, the backend's part in the hooks."""

    defaults: ClassVar[dict[str, Any]] = {"opset": 13, "example_inputs": None, "dynamic_batch": False}
    requantize_passive: ClassVar[bool] = True  # lower passive ops' outputs with their input's quantizer marks

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.options = tuple(cls.defaults)

    def render_files(self, model: nn.Module, path: str | os.PathLike, **options: Any) -> FileContents:
        """Steps 1–4 of the module docstring; raises :class:`fxq.ExportError` (nothing is written)."""
        from fxq.backends.qdq.common import plan_paths, quantized_graph
        from fxq.backends.qdq.pipeline import lower_model

        opts = {**self.defaults, **options}
        self.check_values(opts)
        gm = quantized_graph(model)
        paths = plan_paths(path, ".onnx", self.companions(opts))
        quantizers = QuantGraph(gm).as_dict()
        check_capabilities(gm, self.name)
        opset = self.choose_opset(quantizers, opts)
        lowered = lower_model(gm, opset=opset, example_inputs=opts["example_inputs"],
                              dynamic_batch=opts["dynamic_batch"], requantize_passive=self.requantize_passive,
                              raise_opset=opts["opset"] is None)
        job = QdqJob(gm, paths, quantizers, opts, lowered.opset, lowered)
        return self.render(job)

    # ------------------------------------------------------------------ hooks
    def check_values(self, options: dict[str, Any]) -> None:
        """Raise :class:`fxq.ExportError` for an option value the backend cannot take (default: none)."""

    def companions(self, options: dict[str, Any]) -> dict[str, str]:
        """Files written beside the main ``.onnx``: ``{key: suffix replacing it}`` (default: none)."""
        return {}

    def choose_opset(self, quantizers: dict[str, FakeQuantize], options: dict[str, Any]) -> int:
        """The opset to lower at (default: the ``opset`` option)."""
        return int(options["opset"])

    def render(self, job: QdqJob) -> FileContents:
        """The backend's files, ``{path: content}``, every check passed."""
        raise NotImplementedError
