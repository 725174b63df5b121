"""Baked weights stored as their integer codes.

A baked model holds each quantized weight twice: the values on the grid (what forward reads) and the FP32
backup (for ``fp32_mode``, unbaking, NCNN's own weight quantization). Saving both as float32 made an fxq file
twice the size of the float model; the on-grid values are stored instead as their codes (int8 / uint8 /
int16, 1-2 bytes per weight) and rebuilt on load as ``(codes - offset) * scale``. A weight is packed only when
that rebuild reproduces it bit for bit, so loading never changes a value; anything else stays float.
"""
from __future__ import annotations

import logging
from typing import Any

import torch
from torch import fx

from fxq.errors import FrontendError
from fxq.functional import dequantize_linear, quantize_to_int
from fxq.graph.nodes import get_attr_value
from fxq.graph.quant_graph import QuantGraph
from fxq.serialization.codec import TensorTable, decode, encode

__all__ = ["pack_baked_parameters", "unpack_parameters"]

logger = logging.getLogger(__name__)

_CODE_DTYPES = (torch.int8, torch.uint8, torch.int16)


def _code_dtype(quant_min: int, quant_max: int) -> torch.dtype | None:
    for dtype in _CODE_DTYPES:
        info = torch.iinfo(dtype)
        if info.min <= quant_min and quant_max <= info.max:
            return dtype
    return None


def _rebuild(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, axis: int,
             dtype: torch.dtype) -> torch.Tensor:
    """The weight back from its codes, in the arithmetic fxq bakes with (float64 for float64 weights)."""
    return dequantize_linear(codes, scale, offset, axis, dtype, torch.float64 if dtype == torch.float64 else torch.float32)


def pack_baked_parameters(gm: fx.GraphModule, table: TensorTable) -> dict[str, dict[str, Any]]:
    """Replace the baked weights in ``table`` by their codes; returns what :func:`unpack_parameters` needs."""
    packed: dict[str, dict[str, Any]] = {}
    for name, fq in QuantGraph(gm).weights():
        cfg = fq.config
        if not fq.baked or cfg.is_floating:
            continue
        code_dtype = _code_dtype(cfg.quant_min, cfg.quant_max)
        param = get_attr_value(gm, fq.param)
        key = table.key_of(param)
        if code_dtype is None or key is None or key in packed or fq.scale is None or fq.offset is None:
            continue
        stored = table.get(key)
        axis = cfg.channel_axis if cfg.per_channel else 0
        codes = quantize_to_int(stored, cfg).to(code_dtype)
        if not torch.equal(_rebuild(codes, fq.scale.detach().cpu(), fq.offset.detach().cpu(), axis, stored.dtype),
                           stored):
            logger.debug("weight %r of quantizer %r is not on its grid; saved as %s", fq.param, name, stored.dtype)
            continue
        table.tensors[key] = codes
        packed[key] = {"scale": table.put(fq.scale, f"{name}.scale"), "offset": table.put(fq.offset, f"{name}.offset"),
                       "axis": axis, "dtype": encode(stored.dtype, table)}
    return packed


def unpack_parameters(packed: dict[str, Any], table: TensorTable) -> None:
    """Rebuild the weights :func:`pack_baked_parameters` stored as codes, in ``table``."""
    for key, rec in packed.items():
        if not isinstance(rec, dict) or not all(isinstance(rec.get(k), str) and rec[k] in table.tensors
                                                for k in ("scale", "offset")) or key not in table.tensors \
                or type(rec.get("axis")) is not int:
            raise FrontendError(f"packed weight {key!r}: damaged record {rec!r:.120}")
        codes, dtype = table.get(key), decode(rec.get("dtype"), table)
        if codes.dtype not in _CODE_DTYPES or not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise FrontendError(f"packed weight {key!r} holds {codes.dtype} codes for {dtype!r}")
        scale, offset = table.get(rec["scale"]), table.get(rec["offset"])
        axis = rec["axis"]
        if scale.numel() != offset.numel() or codes.dim() and not -codes.dim() <= axis < codes.dim() or \
                scale.numel() not in (1, codes.shape[axis] if codes.dim() else 1):
            raise FrontendError(f"packed weight {key!r}: {scale.numel()} scales for shape {list(codes.shape)} "
                                f"(axis {axis})")
        table.tensors[key] = _rebuild(codes, scale, offset, axis, dtype)
