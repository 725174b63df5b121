"""TensorRT exporter: explicit-quantization Q/DQ ONNX (TensorRT 10/11), plus optional legacy side files.

Files, from ``path`` = ``out/model.onnx``:

* ``model.onnx`` — Q/DQ ONNX: symmetric INT8 (zero-points present, 0), per-channel weights (axis 0,
  ConvTranspose axis 1) as FP32 initializer -> Q -> DQ (``weights="dq"``: INT8 initializer -> DQ),
  per-tensor activations, Q/DQ on the inputs of weighted ops and residual Adds, FP32 biases; FP8 E4M3 at
  opset 19 for ``trt_fp8`` models. Checked with :func:`fxq.backends.trt_check.check_tensorrt`.
  With ``high_precision_dtype="fp16"`` (for strongly-typed TensorRT builds) every float tensor is FP16 instead:
  weights of FP32-dispatched ops, biases, constants, Q/DQ scales (so DequantizeLinear outputs FP16), at opset 19;
  the graph input and output stay FP32 with a Cast at the boundary (:mod:`fxq.backends.qdq.fp16`, whose
  :func:`~fxq.backends.qdq.fp16.fp16_simulation` is the matching simulation).
* with ``legacy=True`` (implicit quantization, TensorRT <= 10): ``model_fp32.onnx`` (same graph and tensor
  names, no Q/DQ, weights already on their grid), ``model.cache`` (calibration cache) and ``model.json``
  (PPQ's ``{"act_quant_info": {tensor: amax}}``).

FP32 biases are written as fxq simulates them; a default onnxruntime session rounds them to int32 codes of input
scale x weight scale, and where those overflow (vanishing activations) the export logs a WARNING naming the nodes
(:func:`fxq.backends.onnxruntime.ort_bias_issues`).
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from torch import nn

from fxq.backends.base import Exporter, register_exporter
from fxq.errors import ExportError
from fxq.graph.info import quantizer_infos
from fxq.nn.fake_quantize import FakeQuantize
from fxq.spec import FloatFormat, RoundingPolicy

__all__ = ["TensorRTExporter", "activation_scales"]

logger = logging.getLogger(__name__)


def _check_configs(quantizers: dict[str, FakeQuantize], roles: dict[str, str], sources: dict[str, str]) -> bool:
    """TensorRT's rules on fxq configs (before any export work). Returns True if the model uses FP8."""
    fp8 = False
    for name, fq in quantizers.items():
        cfg = fq.config
        role = roles[name]
        if not cfg.is_quantizing or role == "bias":
            continue  # TensorRT takes float biases: passive biases are written with their fake-quantized values
        where = f"quantizer {name!r} ({role} of {sources.get(name, '?')!r})"
        if cfg.is_floating:
            if cfg.fp_format is not FloatFormat.E4M3:
                raise ExportError(f"{where}: TensorRT FP8 is E4M3, got {cfg.fp_format.name}")
            fp8 = True
        elif not cfg.symmetric or cfg.num_bits != 8 or cfg.quant_min < -128 or cfg.quant_max > 127:
            raise ExportError(f"{where}: TensorRT INT8 is symmetric int8, got {cfg!r}; quantize for 'trt_int8'")
        if role == "activation":
            if cfg.per_channel:
                raise ExportError(f"{where}: TensorRT quantizes activations per tensor; disable per-channel "
                                  f"activation quantization")
            if not cfg.is_floating and (cfg.quant_min, cfg.quant_max) != (-128, 127):
                raise ExportError(f"{where}: TensorRT activations use [-128, 127], got "
                                  f"[{cfg.quant_min}, {cfg.quant_max}]")
            if cfg.rounding is not RoundingPolicy.HALF_EVEN:
                raise ExportError(f"{where}: TensorRT rounds half to even, the config rounds {cfg.rounding.name}; "
                                  f"quantize with rounding=HALF_EVEN")
    return fp8


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
class TensorRTExporter(Exporter):
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

    options = ("opset", "weights", "legacy", "trt_version", "check", "example_inputs", "dynamic_batch",
               "high_precision_dtype")

    def export(self, model: nn.Module, path: str | os.PathLike, *, opset: int | None = None, weights: str = "qdq",
               legacy: bool = False, trt_version: int | str = 8601, check: bool = True, example_inputs: Any = None,
               dynamic_batch: bool = False, high_precision_dtype: str = "fp32") -> list[Path]:
        import onnx

        from fxq.backends.onnxruntime import warn_ort_bias_issues
        from fxq.backends.qdq.common import (
            finalize,
            plan_paths,
            quantized_graph,
            quantizer_tables,
            serialize,
            write_files,
        )
        from fxq.backends.qdq.fp16 import HIGH_PRECISION_DTYPES, cast_float_parts, check_fp16_model
        from fxq.backends.qdq.insert import QdqPolicy, insert_qdq, strip_marks
        from fxq.backends.qdq.pipeline import lower_model
        from fxq.backends.trt_check import check_tensorrt
        from fxq.backends.trt_legacy import act_quant_json, calibration_cache

        # 1. inputs: model, destination, configs
        if weights not in ("qdq", "dq"):
            raise ExportError(f"tensorrt: weights={weights!r}; use 'qdq' or 'dq'")
        if high_precision_dtype not in HIGH_PRECISION_DTYPES:
            raise ExportError(f"tensorrt: high_precision_dtype={high_precision_dtype!r}; allowed values are "
                              f"{', '.join(repr(d) for d in HIGH_PRECISION_DTYPES)}")
        fp16 = high_precision_dtype == "fp16"
        if fp16 and legacy:
            raise ExportError("tensorrt: legacy=True (implicit quantization) writes FP32 side files; export with "
                              "high_precision_dtype='fp32' for legacy, or legacy=False for FP16")
        if fp16 and opset is not None and opset < 19:
            raise ExportError(f"tensorrt: high_precision_dtype='fp16' needs opset >= 19 (float16 Q/DQ scales), "
                              f"got opset={opset}")
        gm = quantized_graph(model)
        paths = plan_paths(path, ".onnx", {"fp32": "_fp32.onnx", "cache": ".cache", "json": ".json"} if legacy else {})
        quantizers, roles = quantizer_tables(gm)
        sources = {k: v.source for k, v in quantizer_infos(gm).items()}
        fp8 = _check_configs(quantizers, roles, sources)
        if legacy and fp8:
            raise ExportError("tensorrt: legacy=True writes INT8 calibration caches; this model is FP8")
        opset = opset or (19 if fp8 or fp16 else 13)
        # 2. torch.onnx with marks, then Q/DQ
        lowered = lower_model(gm, opset=opset, example_inputs=example_inputs, dynamic_batch=dynamic_batch)
        fp32_model = onnx.ModelProto()
        fp32_model.CopyFrom(lowered.model)
        records = insert_qdq(lowered, quantizers, roles, QdqPolicy(weights=weights, bias="fp32", clip_subrange=False))
        qdq_model = finalize(lowered.model, opset, check=not fp16)
        if fp16:  # checked once, by the stricter full check of the typed model
            qdq_model = finalize(cast_float_parts(qdq_model), opset, check=False)
            check_fp16_model(qdq_model)
        # 3. TensorRT's rules
        problems = check_tensorrt(qdq_model)
        if problems and check:
            raise ExportError("the model breaks TensorRT's explicit-quantization rules (export with check=False to "
                              "write it anyway, with warnings):\n  " + "\n  ".join(problems))
        for p in problems:
            logger.warning("TensorRT rule: %s", p)
        warn_ort_bias_issues(qdq_model, "tensorrt")
        files: dict[Path, bytes | str] = {paths["main"]: serialize(qdq_model)}
        # 4. legacy side files, keyed by the FP32 model's tensor names
        if legacy:
            lowered.model = fp32_model
            fp_records = strip_marks(lowered, quantizers, roles)
            fp32_model = finalize(fp32_model, opset)
            scales = activation_scales(fp_records, lowered.tensor_of, lowered.marked.grid_of, quantizers)
            files[paths["fp32"]] = serialize(fp32_model)
            files[paths["cache"]] = calibration_cache(scales, trt_version)
            files[paths["json"]] = act_quant_json(scales)
        logger.info("tensorrt: %d quantized tensors, opset %d, %s float parts", len(records), opset,
                    high_precision_dtype)
        # 5. write, all files as one atomic set (the folder is created if missing)
        return write_files(files)
