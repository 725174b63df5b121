"""Element-wise layers: ReLU, PReLU, Sigmoid, TanH, Power, Softmax, Dropout, ReLU6, Clip, ELU, Swish, AbsVal,
BNLL, Exp, Log."""
from __future__ import annotations

import math

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


@register_caffe_layer("ReLU6")
def relu6(ctx: LayerContext) -> None:
    """``ReLU6`` (MobileNet forks) -> ``nn.ReLU6``."""
    _unary(ctx, nn.ReLU6())


@register_caffe_layer("Clip")
def clip(ctx: LayerContext) -> None:
    """``Clip`` -> ``nn.Hardtanh(min, max)`` (op type Clip)."""
    p = ctx.layer.clip_param
    if not (p.HasField("min") and p.HasField("max")) or p.min > p.max:
        raise ctx.error(f"clip_param needs min <= max, got min {p.min if p.HasField('min') else None}, "
                        f"max {p.max if p.HasField('max') else None}")
    _unary(ctx, nn.Hardtanh(float(p.min), float(p.max)))


@register_caffe_layer("ELU")
def elu(ctx: LayerContext) -> None:
    """``ELU`` -> ``nn.ELU(alpha)``."""
    _unary(ctx, nn.ELU(float(ctx.layer.elu_param.alpha)))


@register_caffe_layer("Swish")
def swish(ctx: LayerContext) -> None:
    """``Swish`` -> ``nn.SiLU`` (``beta`` 1), else ``x * sigmoid(beta * x)``."""
    beta = float(ctx.layer.swish_param.beta)
    if beta == 1.0:
        _unary(ctx, nn.SiLU())
        return
    ctx.expect(bottoms=1, tops=1)
    x = ctx.bottom(0)
    gate = ctx.call_function(torch.sigmoid, ctx.call_function(torch.mul, x, beta, suffix="beta"), suffix="gate")
    ctx.set_top(0, ctx.call_function(torch.mul, x, gate))


@register_caffe_layer("AbsVal")
def abs_val(ctx: LayerContext) -> None:
    """``AbsVal`` -> ``torch.abs``."""
    ctx.expect(bottoms=1, tops=1)
    ctx.set_top(0, ctx.call_function(torch.abs, ctx.bottom(0)))


@register_caffe_layer("BNLL")
def bnll(ctx: LayerContext) -> None:
    """``BNLL`` -> ``nn.Softplus()``: ``log(1 + exp(x))`` (torch returns x above 20, 2e-9 from it)."""
    _unary(ctx, nn.Softplus())


def _affine(ctx: LayerContext, x: torch.fx.Node, scale: float, shift: float, what: str) -> torch.fx.Node:
    """``shift + scale * x`` as the nodes it needs (none for 1 and 0)."""
    if scale != 1.0:
        x = ctx.call_function(torch.mul, x, scale, suffix=f"{what}_scale")
    if shift != 0.0:
        x = ctx.call_function(torch.add, x, shift, suffix=f"{what}_shift")
    return x


def _log_base(ctx: LayerContext, base: float) -> float:
    """``ln(base)``, caffe's ``base: -1`` meaning e."""
    if base == -1.0:
        return 1.0
    if base <= 0.0 or base == 1.0:
        raise ctx.error(f"base must be -1 (e) or positive and not 1, got {base}")
    return math.log(base)


@register_caffe_layer("Exp")
def exp(ctx: LayerContext) -> None:
    """``Exp``: ``base ** (shift + scale * x)`` -> ``torch.exp`` of ``ln(base) * (shift + scale * x)``."""
    ctx.expect(bottoms=1, tops=1)
    p = ctx.layer.exp_param
    ln = _log_base(ctx, p.base)
    inner = _affine(ctx, ctx.bottom(0), float(p.scale) * ln, float(p.shift) * ln, "exponent")
    ctx.set_top(0, ctx.call_function(torch.exp, inner))


@register_caffe_layer("Log")
def log(ctx: LayerContext) -> None:
    """``Log``: ``log_base(shift + scale * x)`` -> ``torch.log`` of the affine part, divided by ``ln(base)``."""
    ctx.expect(bottoms=1, tops=1)
    p = ctx.layer.log_param
    ln = _log_base(ctx, p.base)
    y = ctx.call_function(torch.log, _affine(ctx, ctx.bottom(0), float(p.scale), float(p.shift), "argument"),
                          suffix=None if ln == 1.0 else "natural")
    if ln != 1.0:
        y = ctx.call_function(torch.mul, y, 1.0 / ln)
    ctx.set_top(0, y)
