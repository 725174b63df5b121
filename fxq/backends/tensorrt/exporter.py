"""TensorRT exporter: explicit-quantization Q/DQ ONNX (TensorRT 10/11), plus optional legacy side files.

Files, from ``path`` = ``out/model.onnx``:

* ``model.onnx`` — Q/DQ ONNX: symmetric INT8 (zero-points present, 0), per-channel weights (axis 0,
  ConvTranspose axis 1) as FP32 initializer -> Q -> DQ (``weights="dq"``: INT8 initializer -> DQ),
  per-tensor activations, Q/DQ on the inputs of weighted ops and residual Adds, FP32 biases; FP8 E4M3 at
  opset 19 for ``trt_fp8`` models. Checked with :func:`fxq.backends.tensorrt.check.check_tensorrt`.
  With ``high_precision_dtype="fp16"`` (for strongly-typed TensorRT builds) every float tensor is FP16 instead:
  weights of FP32-dispatched ops, biases, constants, Q/DQ scales (so DequantizeLinear outputs FP16), at opset 19;
  the graph input and output stay FP32 with a Cast at the boundary (:mod:`fxq.backends.qdq.fp16`, whose
  :func:`~fxq.backends.qdq.fp16.fp16_simulation` is the matching simulation).
* with ``legacy=True`` (implicit quantization, TensorRT <= 10): ``model_fp32.onnx`` (same graph and tensor
  names, no Q/DQ, weights already on their grid), ``model.cache`` (calibration cache) and ``model.json``
  (PPQ's ``{"act_quant_info": {tensor: amax}}``).

Models over protobuf's 2 GiB limit (:data:`fxq.onnx_data.EXTERNAL_DATA_THRESHOLD`) keep their weights in external
data: each ``.onnx`` of the set gets a ``<name>.onnx.data`` beside it (``model.onnx.data``, and
``model_fp32.onnx.data`` with ``legacy=True``), written in the same atomic set (:mod:`fxq.onnx_data`).

FP32 biases are written as fxq simulates them; a default onnxruntime session rounds them to int32 codes of input
scale x weight scale, and where those overflow or come within reach of the fused kernels' wrapping int32 accumulator
(vanishing activations) the export logs a WARNING naming the nodes (:func:`fxq.backends.qdq.ort_bias.ort_bias_issues`).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from fxq.backends.base import register_exporter
from fxq.backends.qdq.template import QdqJob, QdqOnnxExporter
from fxq.errors import ExportError
from fxq.nn.fake_quantize import FakeQuantize

__all__ = ["TensorRTExporter", "activation_scales"]

logger = logging.getLogger(__name__)


def activation_scales(records: list, tensor_of: dict[str, str], grid_of: dict[str, tuple[str, str]],
                      quantizers: dict[str, FakeQuantize]) -> dict[str, float]:
    """ONNX tensor -> scale of every activation value on an INT8 grid: quantized tensors, passive-op
    outputs (sharing their input's grid) and outputs overlapped by a following activation's quantizer."""
    scales: dict[str, float] = {}
    for r in records:
        if r.role == "activation" and not r.constant:
            scales.setdefault(r.tensor, float(quantizers[r.quantizer].scale.reshape(-1)[0]))
    for fx_node, (qname, _) in grid_of.items():
        tensor = tensor_of.get(fx_node)
        fq = quantizers.get(qname)
        if tensor is not None and fq is not None and fq.config.is_quantizing:
            scales.setdefault(tensor, float(fq.scale.reshape(-1)[0]))
    return scales


@register_exporter("tensorrt")
class TensorRTExporter(QdqOnnxExporter):
    """Explicit-quantization ONNX for TensorRT (see module docstring).

    Options:
        opset: ONNX opset (default 13; 19 for FP8 models).
        weights: ``"qdq"`` (default: FP32 weight -> Q -> DQ) or ``"dq"`` (INT8 weight -> DQ).
        legacy: also write the FP32 ONNX, calibration cache and json for implicit quantization (TensorRT <= 10).
        trt_version: version in the cache header, an int (8601) or ``"8.6.1"`` (default 8601).
        check: run the TensorRT rule checker and raise on violations (default True).
        example_inputs: inputs to trace with (default: random tensors shaped like the calibration batch).
        dynamic_batch: make axis 0 of inputs and outputs dynamic.
        high_precision_dtype: ``"fp32"`` (default) or ``"fp16"``: the type of everything that is not quantized
            (opset 19 or more; graph input/output stay FP32 with Cast nodes; not with ``legacy=True``).
    """

    defaults = {"opset": None, "weights": "qdq", "legacy": False, "trt_version": 8601, "check": True,
                "example_inputs": None, "dynamic_batch": False, "high_precision_dtype": "fp32"}

    def check_values(self, options: dict[str, Any]) -> None:
        """The option values, and the pairs of them TensorRT cannot take together."""
        from fxq.backends.qdq.fp16 import HIGH_PRECISION_DTYPES

        weights, dtype, opset = options["weights"], options["high_precision_dtype"], options["opset"]
        if weights not in ("qdq", "dq"):
            raise ExportError(f"tensorrt: weights={weights!r}; use 'qdq' or 'dq'")
        if dtype not in HIGH_PRECISION_DTYPES:
            raise ExportError(f"tensorrt: high_precision_dtype={dtype!r}; allowed values are "
                              f"{', '.join(repr(d) for d in HIGH_PRECISION_DTYPES)}")
        fp16 = dtype == "fp16"
        if fp16 and options["legacy"]:
            raise ExportError("tensorrt: legacy=True (implicit quantization) writes FP32 side files; export with "
                              "high_precision_dtype='fp32' for legacy, or legacy=False for FP16")
        if fp16 and opset is not None and opset < 19:
            raise ExportError(f"tensorrt: high_precision_dtype='fp16' needs opset >= 19 (float16 Q/DQ scales), "
                              f"got opset={opset}")

    def companions(self, options: dict[str, Any]) -> dict[str, str]:
        return {"fp32": "_fp32.onnx", "cache": ".cache", "json": ".json"} if options["legacy"] else {}

    def choose_opset(self, quantizers: dict[str, FakeQuantize], options: dict[str, Any]) -> int:
        """The given opset, else 13, or 19 for FP8 models and FP16 float parts."""
        fp8 = any(fq.config.is_quantizing and fq.config.is_floating and fq.role != "bias"
                  for fq in quantizers.values())
        if options["legacy"] and fp8:
            raise ExportError("tensorrt: legacy=True writes INT8 calibration caches; this model is FP8")
        return options["opset"] or (19 if fp8 or options["high_precision_dtype"] == "fp16" else 13)

    def render(self, job: QdqJob) -> dict[Path, bytes | bytearray | str | None]:
        """Q/DQ on the lowered model, TensorRT's rules on it, and the legacy side files."""
        import onnx

        from fxq.backends.qdq.common import finalize, serialize
        from fxq.backends.qdq.fp16 import cast_float_parts, check_fp16_model
        from fxq.backends.qdq.insert import QdqPolicy, insert_qdq, strip_marks
        from fxq.backends.qdq.ort_bias import warn_fused_softmax, warn_ort_bias_issues, warn_u8s8_saturation
        from fxq.backends.tensorrt.check import check_tensorrt
        from fxq.backends.tensorrt.legacy import act_quant_json, calibration_cache

        lowered, quantizers, opset, options = job.lowered, job.quantizers, job.opset, job.options
        fp16 = options["high_precision_dtype"] == "fp16"
        fp32_model = None
        if options["legacy"]:  # the legacy cache's FP32 file: the lowered graph before Q/DQ go in
            fp32_model = onnx.ModelProto()
            fp32_model.CopyFrom(lowered.model)
        policy = QdqPolicy(weights=options["weights"], bias="fp32", clip_subrange=False)
        records = insert_qdq(lowered, quantizers, policy)
        qdq_model = finalize(lowered.model, opset, check=not fp16)
        if fp16:  # checked once, by the stricter full check of the typed model
            qdq_model = finalize(cast_float_parts(qdq_model), opset, check=False)
            check_fp16_model(qdq_model)
        # TensorRT's rules on the written graph
        problems = check_tensorrt(qdq_model)
        if problems and options["check"]:
            raise ExportError("the model breaks TensorRT's explicit-quantization rules (export with check=False to "
                              "write it anyway, with warnings):\n  " + "\n  ".join(problems))
        for p in problems:
            logger.warning("TensorRT rule: %s", p)
        warn_ort_bias_issues(qdq_model, "tensorrt")
        warn_fused_softmax(qdq_model, "tensorrt")
        warn_u8s8_saturation(qdq_model, "tensorrt")
        files: dict[Path, bytes | bytearray | str | None] = serialize(qdq_model, job.paths["main"])
        # legacy side files, keyed by the FP32 model's tensor names
        if options["legacy"]:
            lowered.model = fp32_model
            fp_records = strip_marks(lowered, quantizers)
            fp32_model = finalize(fp32_model, opset)
            scales = activation_scales(fp_records, lowered.tensor_of, lowered.marked.grid_of, quantizers)
            files.update(serialize(fp32_model, job.paths["fp32"]))
            files[job.paths["cache"]] = calibration_cache(scales, options["trt_version"])
            files[job.paths["json"]] = act_quant_json(scales)
        logger.info("tensorrt: %d quantized tensors, opset %d, %s float parts", len(records), opset,
                    options["high_precision_dtype"])
        return files
