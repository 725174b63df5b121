"""Normalisation layers: BatchNorm, Scale, LRN."""
from __future__ import annotations

import logging

import torch
from torch import nn

from fxq.frontends.caffe.builder import LayerContext
from fxq.frontends.caffe.layers._common import require_rank
from fxq.frontends.caffe.modules import (
    CaffeChannelScale1d,
    CaffeChannelScale2d,
    CaffeChannelScale3d,
    CaffeLRNWithinChannel,
    CaffeScale,
)
from fxq.frontends.caffe.registry import register_caffe_layer

logger = logging.getLogger(__name__)

_BATCH_NORMS = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}
_CHANNEL_SCALES = {2: CaffeChannelScale1d, 3: CaffeChannelScale1d, 4: CaffeChannelScale2d, 5: CaffeChannelScale3d}
_WITHIN_CHANNEL = 1


@register_caffe_layer("BatchNorm")
def batch_norm(ctx: LayerContext) -> None:
    """``BatchNorm`` -> ``nn.BatchNorm{1,2,3}d(affine=False)``; caffe's learned affine part is a separate ``Scale``.

    The stored mean and variance are divided by the moving-average factor in blob 2 (0 means 0).
    ``use_global_stats`` defaults to true (a TEST-phase net); ``false`` normalises with batch statistics.
    """
    ctx.expect(bottoms=1, tops=1)
    shape = ctx.shape(ctx.bottom(0))
    if len(shape) not in _BATCH_NORMS:
        raise ctx.error(f"supports 2-D to 5-D bottoms, got shape {list(shape)}")
    p = ctx.layer.batch_norm_param
    global_stats = p.use_global_stats if p.HasField("use_global_stats") else True
    channels = shape[1]
    module = _BATCH_NORMS[len(shape)](channels, eps=p.eps, momentum=1.0 - p.moving_average_fraction,
                                      affine=False, track_running_stats=global_stats)
    if not global_stats:
        logger.warning("%s: layer %r has use_global_stats: false, so it normalises with batch statistics",
                       ctx.builder.prototxt_label, ctx.name)
    blobs = ctx.load_blobs([("mean", (channels,)), ("variance", (channels,)), ("moving average factor", (1,))])
    if blobs is not None and global_stats:
        factor = float(blobs[2].reshape(-1)[0])
        scale = 0.0 if factor == 0.0 else 1.0 / factor
        with torch.no_grad():
            module.running_mean.copy_(blobs[0] * scale)
            module.running_var.copy_(blobs[1] * scale)
    ctx.set_top(0, ctx.call_module(module, ctx.bottom(0)))


@register_caffe_layer("Scale")
def scale(ctx: LayerContext) -> None:
    """``Scale``: a learned per-channel factor (axis 1, one axis) -> ``CaffeChannelScale{1,2,3}d`` (an exact,
    frozen BatchNorm, so it folds like one); any other axes, or a second bottom as the factor -> ``CaffeScale``.
    Both add the learned bias when ``bias_term`` is set."""
    ctx.expect(bottoms=(1, 2), tops=1)
    x = ctx.bottom(0)
    shape = ctx.shape(x)
    p = ctx.layer.scale_param
    axis = ctx.canonical_axis(p.axis, len(shape)) if shape else 0
    learned = len(ctx.bottoms) == 1
    if learned:
        end = len(shape) if p.num_axes == -1 else axis + p.num_axes
        if p.num_axes < -1 or end > len(shape):
            raise ctx.error(f"num_axes {p.num_axes} does not fit a {len(shape)}-D bottom from axis {axis}")
        param_shape = tuple(shape[axis:end])
    else:
        param_shape = ctx.shape(ctx.bottom(1))
        if param_shape and tuple(shape[axis: axis + len(param_shape)]) != param_shape:
            raise ctx.error(f"second bottom shape {list(param_shape)} does not match bottom shape "
                            f"{list(shape)} from axis {axis}")
    specs = ([("scale", param_shape)] if learned else []) + ([("bias", param_shape)] if p.bias_term else [])
    op_type = None
    if learned and axis == 1 and len(param_shape) == 1 and len(shape) in _CHANNEL_SCALES:
        module = _CHANNEL_SCALES[len(shape)](param_shape[0])
        params = [module.weight] + ([module.bias] if p.bias_term else [])
        if not p.bias_term:
            module.bias.requires_grad_(False)  # stays 0: the caffe layer has no bias
    else:
        view_shape = param_shape + (1,) * (len(shape) - axis - len(param_shape)) if param_shape else (1,)
        module = CaffeScale(param_shape, view_shape, learned_scale=learned, bias=p.bias_term)
        params = ([module.weight] if learned else []) + ([module.bias] if p.bias_term else [])
        op_type = "Mul" if not learned else None
    blobs = ctx.load_blobs(specs) if specs else None
    if blobs is not None:
        with torch.no_grad():
            for param, blob in zip(params, blobs):
                param.copy_(blob)
    ctx.set_top(0, ctx.call_module(module, *ctx.bottoms, op_type=op_type))


@register_caffe_layer("LRN")
def lrn(ctx: LayerContext) -> None:
    """``LRN`` ACROSS_CHANNELS -> ``nn.LocalResponseNorm`` (same formula for caffe's odd sizes);
    WITHIN_CHANNEL -> ``CaffeLRNWithinChannel``."""
    ctx.expect(bottoms=1, tops=1)
    require_rank(ctx, ctx.shape(ctx.bottom(0)), 4)
    p = ctx.layer.lrn_param
    if p.local_size % 2 != 1:
        raise ctx.error(f"local_size must be odd, got {p.local_size}")
    if p.norm_region == _WITHIN_CHANNEL:
        module = CaffeLRNWithinChannel(p.local_size, p.alpha, p.beta)
    else:
        module = nn.LocalResponseNorm(p.local_size, alpha=p.alpha, beta=p.beta, k=p.k)
    ctx.set_top(0, ctx.call_module(module, ctx.bottom(0), op_type="LRN"))
