"""Small helpers shared by the layer converters."""
from __future__ import annotations

from typing import Any, Sequence

from fxq.frontends.caffe.builder import LayerContext


def spatial_pair(ctx: LayerContext, param: Any, what: str, default: int | None) -> tuple[int, int]:
    """A (h, w) pair from caffe's ``what`` (repeated, 1 or 2 values) or its ``_h`` / ``_w`` fields
    (``kernel_size`` -> ``kernel_h`` / ``kernel_w``)."""
    values: Sequence[int] = getattr(param, what)
    fields = param.DESCRIPTOR.fields_by_name
    h_name, w_name = (f"{what.removesuffix('_size')}_{axis}" for axis in "hw")
    has_h = h_name in fields and param.HasField(h_name)
    has_w = w_name in fields and param.HasField(w_name)
    if has_h or has_w:
        if not (has_h and has_w):
            raise ctx.error(f"{h_name} and {w_name} must be given together")
        if len(values):
            raise ctx.error(f"give either {what} or {h_name}/{w_name}, not both")
        return int(getattr(param, h_name)), int(getattr(param, w_name))
    if len(values) == 0:
        if default is None:
            raise ctx.error(f"{what} is not set")
        return default, default
    if len(values) == 1:
        return int(values[0]), int(values[0])
    if len(values) == 2:
        return int(values[0]), int(values[1])
    raise ctx.error(f"{what} has {len(values)} values; only 2-D layers are supported")


def require_rank(ctx: LayerContext, shape: Sequence[int], rank: int) -> None:
    if len(shape) != rank:
        raise ctx.error(f"supports only {rank}-D bottoms, got shape {list(shape)}")
