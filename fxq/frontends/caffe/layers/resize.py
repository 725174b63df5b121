"""Fork resize layers: Upsample (nearest, by scale) and Interp (bilinear, caffe's aligned corners)."""
from __future__ import annotations

from torch import nn

from fxq.frontends.caffe.builder import LayerContext
from fxq.frontends.caffe.layers._common import require_rank
from fxq.frontends.caffe.modules import CaffeInterp
from fxq.frontends.caffe.registry import register_caffe_layer


@register_caffe_layer("Upsample")
def upsample(ctx: LayerContext) -> None:
    """``Upsample`` with ``scale`` (or ``scale_h`` + ``scale_w``) -> ``nn.Upsample(mode="nearest")``.

    The SegNet form (a second bottom with max-pooling indices, or ``upsample_h``/``upsample_w``) is not supported.
    """
    ctx.expect(bottoms=1, tops=1)
    require_rank(ctx, ctx.shape(ctx.bottom(0)), 4)
    p = ctx.layer.upsample_param
    if p.HasField("upsample_h") or p.HasField("upsample_w"):
        raise ctx.error("upsample_h/upsample_w (SegNet unpooling) is not supported; use scale")
    if p.HasField("scale_h") or p.HasField("scale_w"):
        if not (p.HasField("scale_h") and p.HasField("scale_w")) or p.HasField("scale"):
            raise ctx.error("give either scale, or both scale_h and scale_w")
        factors = (float(p.scale_h), float(p.scale_w))
    elif p.HasField("scale"):
        factors = (float(p.scale), float(p.scale))
    else:
        raise ctx.error("upsample_param.scale is not set")
    if min(factors) <= 0:
        raise ctx.error(f"scale must be positive, got {factors}")
    module = nn.Upsample(scale_factor=factors, mode="nearest")
    ctx.set_top(0, ctx.call_module(module, ctx.bottom(0)))


@register_caffe_layer("Interp")
def interp(ctx: LayerContext) -> None:
    """``Interp`` -> ``CaffeInterp``: output size from a second bottom, or from shrink/zoom factors or
    height + width (caffe's order of precedence); non-positive ``pad_beg``/``pad_end`` crop first."""
    ctx.expect(bottoms=(1, 2), tops=1)
    require_rank(ctx, ctx.shape(ctx.bottom(0)), 4)
    p = ctx.layer.interp_param

    def given(name: str) -> int | None:
        return int(getattr(p, name)) if p.HasField(name) else None

    height, width, zoom, shrink = given("height"), given("width"), given("zoom_factor"), given("shrink_factor")
    if len(ctx.bottoms) == 1 and zoom is None and shrink is None and (height is None or width is None):
        raise ctx.error("needs zoom_factor, shrink_factor, height and width, or a second bottom")
    if (zoom is not None and zoom < 1) or (shrink is not None and shrink < 1):
        raise ctx.error("zoom_factor and shrink_factor must be >= 1")
    if p.pad_beg > 0 or p.pad_end > 0:
        raise ctx.error("only non-positive pad_beg/pad_end (cropping) are supported, as in caffe")
    module = CaffeInterp(height, width, zoom, shrink, p.pad_beg, p.pad_end)
    ctx.set_top(0, ctx.call_module(module, *ctx.bottoms, op_type="Resize"))
