"""Pooling -> ``nn.MaxPool2d`` / ``nn.AvgPool2d`` when they equal caffe exactly, else ``CaffePooling2d``.

Caffe rounds the output size up by default, then drops a last window that would start in the right padding, but
only when the layer has padding. Torch applies that drop in ceil mode with or without padding, and refuses
pad > kernel / 2. Both averages divide by the window clipped to ``[-pad, size + pad)``.
"""
from __future__ import annotations

from torch import nn

from fxq.frontends.caffe.builder import LayerContext
from fxq.frontends.caffe.layers._common import require_rank, spatial_pair
from fxq.frontends.caffe.modules import POOL_AVE, POOL_MAX, CaffePooling2d
from fxq.frontends.caffe.registry import register_caffe_layer

_MAX, _AVE, _STOCHASTIC = 0, 1, 2
_FLOOR = 1  # RoundMode.FLOOR


def torch_pooling_matches_caffe(kernel: tuple[int, int], stride: tuple[int, int], pad: tuple[int, int],
                                ceil_mode: bool) -> bool:
    """Whether ``nn.MaxPool2d``/``nn.AvgPool2d`` (count_include_pad) compute caffe's pooling for every input size."""
    if any(p > k // 2 for p, k in zip(pad, kernel)):
        return False  # torch refuses it
    if not ceil_mode or any(pad):
        return True  # floor: never clipped; padded ceil: both clip the same way
    return all(s <= k for s, k in zip(stride, kernel))  # unpadded ceil: torch's clip can only fire if s > k


@register_caffe_layer("Pooling")
def pooling(ctx: LayerContext) -> None:
    """``Pooling`` MAX / AVE, global or windowed, with caffe's ceil (default) or floor output rounding."""
    ctx.expect(bottoms=1, tops=1)
    x = ctx.bottom(0)
    require_rank(ctx, ctx.shape(x), 4)
    p = ctx.layer.pooling_param
    if p.pool == _STOCHASTIC:
        raise ctx.error("STOCHASTIC pooling is not supported")
    if p.global_pooling:
        module = nn.AdaptiveMaxPool2d(1) if p.pool == _MAX else nn.AdaptiveAvgPool2d(1)
        ctx.set_top(0, ctx.call_module(module, x))
        return
    kernel = spatial_pair(ctx, p, "kernel_size", None)
    stride = spatial_pair(ctx, p, "stride", 1)
    pad = spatial_pair(ctx, p, "pad", 0)
    if min(kernel) <= 0 or min(stride) <= 0:
        raise ctx.error(f"kernel {kernel} and stride {stride} must be positive")
    if any(pd >= k for pd, k in zip(pad, kernel)):
        raise ctx.error(f"pad {pad} must be smaller than the kernel {kernel}")
    if p.HasField("ceil_mode") and p.HasField("round_mode"):
        raise ctx.error("give either round_mode or ceil_mode, not both")
    ceil_mode = p.ceil_mode if p.HasField("ceil_mode") else p.round_mode != _FLOOR
    if torch_pooling_matches_caffe(kernel, stride, pad, ceil_mode):
        if p.pool == _MAX:
            module = nn.MaxPool2d(kernel, stride, pad, ceil_mode=ceil_mode)
        else:
            module = nn.AvgPool2d(kernel, stride, pad, ceil_mode=ceil_mode, count_include_pad=True)
    else:
        module = CaffePooling2d(POOL_MAX if p.pool == _MAX else POOL_AVE, kernel, stride, pad, ceil_mode)
    ctx.set_top(0, ctx.call_module(module, x, op_type="MaxPool" if p.pool == _MAX else "AveragePool"))
