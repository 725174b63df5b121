"""ONNX Runtime exporter: QDQ ONNX that onnxruntime loads and runs (IR version 10, opset >= 13).

Every fxq quantizer becomes QuantizeLinear -> DequantizeLinear with its own scheme: uint8/int8 (asymmetric
zero-points included), per-channel weights as integer initializers + DequantizeLinear, passive biases as
int32 + DequantizeLinear, FP8 at opset 19, and 4-bit / 16-bit types at opset 21 (chosen automatically for
the low-bit platforms). Activation ranges narrower than their element type get a ``Clip`` before Q, which
reproduces fxq's clamp exactly. The written model is loaded by onnxruntime before anything is written.

onnxruntime runs the graph as written with optimizations off; with them on (the default) it fuses
DQ -> Conv/Gemm/Add -> Q groups into int8 kernels (QLinearConv, QGemm, QLinearAdd) where the output is
quantized. Those add an int32 bias to the integer accumulator (quantizing an FP32 bias themselves), which the
``ort_int8`` platform simulates, so both paths reproduce fxq's codes; models quantized for a platform with FP32
biases, and attention softmax (QLinearSoftmax's fixed-point table), can be one code off here and there
(see ``tests/test_export_onnx.py``).
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from torch import nn

from fxq.backends.base import Exporter, register_exporter
from fxq.errors import ExportError
from fxq.nn.fake_quantize import FakeQuantize

__all__ = ["OnnxRuntimeExporter", "auto_opset"]

logger = logging.getLogger(__name__)


def auto_opset(quantizers: dict[str, FakeQuantize], roles: dict[str, str]) -> int:
    """13, or 19 when a quantizer is FP8, or 21 when one needs a 4-bit or 16-bit element type."""
    opset = 13
    for name, fq in quantizers.items():
        cfg = fq.config
        if not cfg.is_quantizing or roles.get(name) == "bias":
            continue
        if cfg.is_floating:
            opset = max(opset, 19)
        elif cfg.num_bits <= 4 or cfg.num_bits > 8:
            opset = max(opset, 21)
    return opset


def _ort_load_check(data: bytes) -> None:
    try:
        import onnxruntime as ort
    except ImportError:  # the check is a courtesy where onnxruntime is installed
        logger.debug("onnxruntime is not installed: skipping the load check")
        return
    try:
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        ort.InferenceSession(data, opts, providers=["CPUExecutionProvider"])
    except Exception as exc:
        raise ExportError(f"onnxruntime {ort.__version__} cannot load the exported model: {exc}") from exc


@register_exporter("onnxruntime")
class OnnxRuntimeExporter(Exporter):
    """QDQ ONNX for ONNX Runtime (see module docstring).

    Options:
        opset: ONNX opset (default: :func:`auto_opset`; at least 21 when 4/16-bit types are needed).
        weights: ``"dq"`` (default: integer initializer -> DQ) or ``"qdq"`` (float -> Q -> DQ).
        check: load the model in onnxruntime before writing (default True).
        example_inputs: inputs to trace with (default: random tensors shaped like the calibration batch).
        dynamic_batch: make axis 0 of inputs and outputs dynamic.
    """

    options = ("opset", "weights", "check", "example_inputs", "dynamic_batch")

    def export(self, model: nn.Module, path: str | os.PathLike, *, opset: int | None = None, weights: str = "dq",
               check: bool = True, example_inputs: Any = None, dynamic_batch: bool = False) -> list[Path]:
        from fxq.backends.qdq.common import (
            finalize,
            plan_paths,
            quantized_graph,
            quantizer_tables,
            serialize,
            write_files,
        )
        from fxq.backends.qdq.insert import QdqPolicy, insert_qdq
        from fxq.backends.qdq.pipeline import lower_model

        # 1. inputs
        if weights not in ("qdq", "dq"):
            raise ExportError(f"onnxruntime: weights={weights!r}; use 'dq' or 'qdq'")
        gm = quantized_graph(model)
        paths = plan_paths(path, ".onnx")
        quantizers, roles = quantizer_tables(gm)
        needed = auto_opset(quantizers, roles)
        if opset is None:
            opset = needed
        elif opset < 13:
            raise ExportError(f"onnxruntime: opset {opset} < 13; per-channel QuantizeLinear needs opset 13")
        # 2. torch.onnx with marks, then Q/DQ from the quantizers' configs
        lowered = lower_model(gm, opset=opset, example_inputs=example_inputs, dynamic_batch=dynamic_batch)
        records = insert_qdq(lowered, quantizers, roles, QdqPolicy(weights=weights, bias="dq", clip_subrange=True))
        onnx_model = finalize(lowered.model, opset)
        data = serialize(onnx_model)
        # 3. onnxruntime must load it
        if check:
            _ort_load_check(data)
        logger.info("onnxruntime: %d quantized tensors, opset %d", len(records), opset)
        # 4. write as one atomic set (the folder is created if missing)
        return write_files({paths["main"]: data})
