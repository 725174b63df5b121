"""ONNX Runtime exporter: QDQ ONNX that onnxruntime loads and runs (IR version 10, opset >= 13).

Every fxq quantizer becomes QuantizeLinear -> DequantizeLinear with its own scheme: uint8/int8 (asymmetric
zero-points included), per-channel weights as integer initializers + DequantizeLinear, passive biases as
int32 + DequantizeLinear, FP8 at opset 19, and 4-bit / 16-bit types at opset 21 (chosen automatically for
the low-bit platforms). Activation ranges narrower than their element type get a ``Clip`` before Q, which
reproduces fxq's clamp exactly. The written model is loaded by onnxruntime before anything is written.
A model over protobuf's 2 GiB limit (:data:`fxq.onnx_data.EXTERNAL_DATA_THRESHOLD`) is written as ``model.onnx``
plus its external data ``model.onnx.data``, one atomic set; the load check then gets the data from memory.

onnxruntime runs the graph as written with optimizations off; with them on (the default) it fuses
DQ -> Conv/Gemm/Add -> Q groups into int8 kernels (QLinearConv, QGemm, QLinearAdd) where the output is
quantized. Those add an int32 bias to the integer accumulator (quantizing an FP32 bias themselves), which the
``ort_int8`` platform simulates, so both paths reproduce fxq's codes; models quantized for a platform with FP32
biases, and attention softmax (QLinearSoftmax's fixed-point table), can be one code off here and there
(see ``tests/test_export_onnx.py``).

A default session also quantizes the FP32 bias of every Conv/Gemm that reads a dequantized input and whose output
is quantized (onnxruntime's ``WeightBiasQuantization`` pass): int32 codes of input scale x weight scale. Where
those codes overflow int32 (input scales at the 1e-8 floor: vanishing activations) or the rounding moves the bias
by half an output step, that session computes something else than fxq's simulation. The fused QLinearConv/QGemm
also add int32 bias codes (``ort_int8``'s own included) in an int32 accumulator that wraps around: codes saturated
at the int32 limits (a bias read through an input scale at the floor with non-zero input codes, e.g. ShuffleNet-V2's
classifier at random init) jump by 2^32 bias steps. :func:`ort_bias_issues` (:mod:`fxq.backends.qdq.ort_bias`)
finds those nodes and both QDQ exporters log them as a WARNING (``ORT_DISABLE_ALL`` runs the file as written).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from fxq.backends.base import register_exporter
from fxq.backends.qdq.ort_bias import (
    ort_bias_issues,
    warn_fused_softmax,
    warn_ort_bias_issues,
    warn_u8s8_saturation,
)
from fxq.backends.qdq.template import QdqJob, QdqOnnxExporter
from fxq.errors import ExportError
from fxq.nn.fake_quantize import FakeQuantize
from fxq.onnx_data import ort_session

__all__ = ["OnnxRuntimeExporter", "auto_opset", "ort_bias_issues", "warn_ort_bias_issues"]

logger = logging.getLogger(__name__)


def auto_opset(quantizers: dict[str, FakeQuantize]) -> int:
    """13, or 19 when a quantizer is FP8, or 21 when one needs a 4-bit or 16-bit element type."""
    opset = 13
    for fq in quantizers.values():
        cfg = fq.config
        if not cfg.is_quantizing or fq.role == "bias":
            continue
        if cfg.is_floating:
            opset = max(opset, 19)
        elif cfg.num_bits <= 4 or cfg.num_bits > 8:
            opset = max(opset, 21)
    return opset


def _ort_load_check(files: dict[Path, Any], main: Path) -> None:
    """onnxruntime loads the files about to be written, from memory (external data included)."""
    try:
        import onnxruntime as ort
    except ImportError:  # the check is a courtesy where onnxruntime is installed
        logger.debug("onnxruntime is not installed: skipping the load check")
        return
    try:
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        external = {p.name: data for p, data in files.items() if p != main and data is not None}
        ort_session(files[main], opts, external=external)
    except Exception as exc:
        raise ExportError(f"onnxruntime {ort.__version__} cannot load the exported model: {exc}") from exc


@register_exporter("onnxruntime")
class OnnxRuntimeExporter(QdqOnnxExporter):
    """QDQ ONNX for ONNX Runtime (see module docstring).

    Options:
        opset: ONNX opset (default: :func:`auto_opset`; at least 21 when 4/16-bit types are needed).
        weights: ``"dq"`` (default: integer initializer -> DQ) or ``"qdq"`` (float -> Q -> DQ).
        check: load the model in onnxruntime before writing (default True).
        example_inputs: inputs to trace with (default: random tensors shaped like the calibration batch).
        dynamic_batch: make axis 0 of inputs and outputs dynamic.
    """

    defaults = {"opset": None, "weights": "dq", "check": True, "example_inputs": None, "dynamic_batch": False}

    def check_values(self, options: dict[str, Any]) -> None:
        if options["weights"] not in ("qdq", "dq"):
            raise ExportError(f"onnxruntime: weights={options['weights']!r}; use 'dq' or 'qdq'")

    def choose_opset(self, quantizers: dict[str, FakeQuantize], options: dict[str, Any]) -> int:
        """The given opset (13 at least), else :func:`auto_opset`."""
        needed = auto_opset(quantizers)
        opset = options["opset"]
        if opset is None:
            return needed
        if opset < 13:
            raise ExportError(f"onnxruntime: opset {opset} < 13; per-channel QuantizeLinear needs opset 13")
        return opset

    def render(self, job: QdqJob) -> dict[Path, bytes | bytearray | str | None]:
        """Q/DQ from the quantizers' own configs; onnxruntime must load the result."""
        from fxq.backends.qdq.common import finalize, serialize
        from fxq.backends.qdq.insert import QdqPolicy, insert_qdq

        policy = QdqPolicy(weights=job.options["weights"], bias="dq", clip_subrange=True)
        records = insert_qdq(job.lowered, job.quantizers, policy)
        onnx_model = finalize(job.lowered.model, job.opset)
        warn_ort_bias_issues(onnx_model, "onnxruntime")
        warn_fused_softmax(onnx_model, "onnxruntime")
        warn_u8s8_saturation(onnx_model, "onnxruntime")
        files = serialize(onnx_model, job.paths["main"])
        if job.options["check"]:
            _ort_load_check(files, job.paths["main"])
        logger.info("onnxruntime: %d quantized tensors, opset %d", len(records), job.opset)
        return files
