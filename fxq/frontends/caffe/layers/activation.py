"""Element-wise layers: ReLU, PReLU, Sigmoid, TanH, Power, Softmax, Dropout."""
from __future__ import annotations

import torch
from torch import nn

from fxq.frontends.caffe.builder import LayerContext
from fxq.frontends.caffe.modules import CaffePower
from fxq.frontends.caffe.registry import register_caffe_layer


def _unary(ctx: LayerContext, module: nn.Module, op_type: str | None = None) -> None:
    ctx.expect(bottoms=1, tops=1)
    ctx.set_top(0, ctx.call_module(module, ctx.bottom(0), op_type=op_type))


@register_caffe_layer("ReLU")
def relu(ctx: LayerContext) -> None:
    """``ReLU`` -> ``nn.ReLU``, or ``nn.LeakyReLU`` when ``negative_slope`` is non-zero."""
    slope = ctx.layer.relu_param.negative_slope
    _unary(ctx, nn.LeakyReLU(slope) if slope != 0.0 else nn.ReLU())


@register_caffe_layer("PReLU")
def prelu(ctx: LayerContext) -> None:
    """``PReLU`` -> ``nn.PReLU`` with one slope per channel (axis 1), or one shared slope."""
    ctx.expect(bottoms=1, tops=1)
    shape = ctx.shape(ctx.bottom(0))
    if len(shape) < 2 and not ctx.layer.prelu_param.channel_shared:
        raise ctx.error(f"needs a bottom with a channel axis, got shape {list(shape)}")
    channels = 1 if ctx.layer.prelu_param.channel_shared else shape[1]
    module = nn.PReLU(channels)
    blobs = ctx.load_blobs([("slope", (channels,))])
    if blobs is not None:
        with torch.no_grad():
            module.weight.copy_(blobs[0])
    ctx.set_top(0, ctx.call_module(module, ctx.bottom(0)))


@register_caffe_layer("Sigmoid")
def sigmoid(ctx: LayerContext) -> None:
    """``Sigmoid`` -> ``nn.Sigmoid``."""
    _unary(ctx, nn.Sigmoid())


@register_caffe_layer("TanH")
def tanh(ctx: LayerContext) -> None:
    """``TanH`` -> ``nn.Tanh``."""
    _unary(ctx, nn.Tanh())


@register_caffe_layer("Power")
def power(ctx: LayerContext) -> None:
    """``Power`` -> ``CaffePower``: ``(shift + scale * x) ** power``."""
    p = ctx.layer.power_param
    _unary(ctx, CaffePower(p.power, p.scale, p.shift), op_type="Pow")


@register_caffe_layer("Softmax")
def softmax(ctx: LayerContext) -> None:
    """``Softmax`` -> ``nn.Softmax`` over ``axis``."""
    ctx.expect(bottoms=1, tops=1)
    rank = len(ctx.shape(ctx.bottom(0)))
    _unary(ctx, nn.Softmax(dim=ctx.canonical_axis(ctx.layer.softmax_param.axis, rank)))


@register_caffe_layer("Dropout")
def dropout(ctx: LayerContext) -> None:
    """``Dropout`` -> ``nn.Dropout``: the identity in eval mode (the loaded model's mode), caffe's inverted
    dropout in train mode."""
    _unary(ctx, nn.Dropout(ctx.layer.dropout_param.dropout_ratio))
