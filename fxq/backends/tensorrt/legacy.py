"""TensorRT <= 10 implicit-quantization side files: the calibration cache and PPQ's json of activation ranges.

Both key per-tensor symmetric INT8 activation ranges by ONNX tensor name (the names of the FP32 model
written beside them). TensorRT's scale is ``amax / 127``: the cache stores that scale as the big-endian
bits of a float32 (8 hex digits), the json stores ``amax = scale * 127``.
"""
from __future__ import annotations

import json
import struct

__all__ = ["calibration_cache", "act_quant_json", "cache_version", "parse_calibration_cache"]

CACHE_ALGORITHM = "EntropyCalibration2"


def cache_version(trt_version: int | str) -> int:
    """The number in the cache header: an int as given, or ``"8.6.1"`` -> 8601 (major*1000 + minor*100 + patch;
    TensorRT 10 and later count the major version in ten-thousands: ``"10.3.0"`` -> 100300)."""
    if isinstance(trt_version, int) and not isinstance(trt_version, bool):
        return trt_version
    parts = [int(p) for p in str(trt_version).split(".")[:3]] + [0, 0]
    major, minor, patch = parts[:3]
    return major * (10000 if major >= 10 else 1000) + minor * 100 + patch


def calibration_cache(scales: dict[str, float], trt_version: int | str = 8601) -> str:
    """``TRT-<ver>-EntropyCalibration2`` then ``<tensor>: <hex of float32 scale>`` per tensor."""
    lines = [f"TRT-{cache_version(trt_version)}-{CACHE_ALGORITHM}"]
    for name, scale in scales.items():
        lines.append(f"{name}: {struct.pack('>f', float(scale)).hex()}")
    return "\n".join(lines) + "\n"


def parse_calibration_cache(text: str) -> tuple[str, dict[str, float]]:
    """(header, tensor -> scale) of a calibration cache (for tests and tools)."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    table = {}
    for ln in lines[1:]:
        name, _, hexval = ln.rpartition(": ")
        table[name] = struct.unpack(">f", bytes.fromhex(hexval))[0]
    return lines[0], table


def act_quant_json(scales: dict[str, float]) -> str:
    """PPQ's TensorRT json: ``{"act_quant_info": {tensor: amax}}`` with amax = scale * 127."""
    return json.dumps({"act_quant_info": {name: float(s) * 127.0 for name, s in scales.items()}}, indent=2) + "\n"
