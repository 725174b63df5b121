"""Convolution, Deconvolution and InnerProduct -> ``nn.Conv2d`` / ``nn.ConvTranspose2d`` / ``nn.Linear``."""
from __future__ import annotations

import math

import torch
from torch import nn

from fxq.frontends.caffe.builder import LayerContext
from fxq.frontends.caffe.layers._common import require_rank, spatial_pair
from fxq.frontends.caffe.registry import register_caffe_layer


def _load(ctx: LayerContext, weight: torch.Tensor, bias: torch.Tensor | None, weight_shape: tuple[int, ...],
          transpose: bool = False) -> None:
    """Copy the caffemodel's weight (and bias) blobs into ``weight`` / ``bias`` in place."""
    specs = [("weight", weight_shape)] + ([("bias", tuple(bias.shape))] if bias is not None else [])
    blobs = ctx.load_blobs(specs)
    if blobs is None:
        return
    with torch.no_grad():
        weight.copy_(blobs[0].t() if transpose else blobs[0])
        if bias is not None:
            bias.copy_(blobs[1])


def _convolution(ctx: LayerContext, transposed: bool, depthwise: bool = False) -> None:
    ctx.expect(bottoms=1, tops=1)
    x = ctx.bottom(0)
    shape = ctx.shape(x)
    p = ctx.layer.convolution_param
    require_rank(ctx, shape, 4)
    if ctx.canonical_axis(p.axis, len(shape)) != 1:
        raise ctx.error(f"supports only axis 1 (channels), got axis {p.axis}")
    kernel = spatial_pair(ctx, p, "kernel_size", None)
    stride = spatial_pair(ctx, p, "stride", 1)
    pad = spatial_pair(ctx, p, "pad", 0)
    dilation = spatial_pair(ctx, p, "dilation", 1)
    c_in, c_out = shape[1], int(p.num_output)
    groups = c_in if depthwise and not p.HasField("group") else int(p.group)
    if c_out <= 0:
        raise ctx.error("num_output must be positive")
    if groups <= 0 or c_in % groups or c_out % groups:
        raise ctx.error(f"group {groups} must divide both input channels {c_in} and num_output {c_out}")
    ctx.check_size("weight", (c_in, c_out // groups, *kernel) if transposed else (c_out, c_in // groups, *kernel))
    if transposed:
        module = nn.ConvTranspose2d(c_in, c_out, kernel, stride, pad, groups=groups, bias=p.bias_term,
                                    dilation=dilation)
        weight_shape = (c_in, c_out // groups, *kernel)  # caffe's deconv blob layout is torch's
    else:
        module = nn.Conv2d(c_in, c_out, kernel, stride, pad, dilation, groups, bias=p.bias_term)
        weight_shape = (c_out, c_in // groups, *kernel)
    _load(ctx, module.weight, module.bias, weight_shape)
    ctx.set_top(0, ctx.call_module(module, x))


@register_caffe_layer("Convolution")
def convolution(ctx: LayerContext) -> None:
    """``Convolution`` -> ``nn.Conv2d`` (group, dilation, pad/kernel/stride and their _h/_w forms, bias_term)."""
    _convolution(ctx, transposed=False)


@register_caffe_layer("DepthwiseConvolution")
@register_caffe_layer("ConvolutionDepthwise")
def depthwise_convolution(ctx: LayerContext) -> None:
    """MobileNet forks' ``DepthwiseConvolution`` / ``ConvolutionDepthwise``: a ``Convolution`` whose ``group`` is
    the input channels when the prototxt leaves it out."""
    _convolution(ctx, transposed=False, depthwise=True)


@register_caffe_layer("Deconvolution")
def deconvolution(ctx: LayerContext) -> None:
    """``Deconvolution`` -> ``nn.ConvTranspose2d``; caffe's output size is torch's with ``output_padding=0``."""
    _convolution(ctx, transposed=True)


@register_caffe_layer("InnerProduct")
def inner_product(ctx: LayerContext) -> None:
    """``InnerProduct`` -> (``torch.flatten`` from ``axis`` when needed) + ``nn.Linear``; ``transpose`` honoured."""
    ctx.expect(bottoms=1, tops=1)
    x = ctx.bottom(0)
    shape = ctx.shape(x)
    p = ctx.layer.inner_product_param
    axis = ctx.canonical_axis(p.axis, len(shape))
    k, n = math.prod(shape[axis:]), int(p.num_output)
    if n <= 0:
        raise ctx.error("num_output must be positive")
    ctx.check_size("weight", (n, k))
    module = nn.Linear(k, n, bias=p.bias_term)
    blob_shape = (k, n) if p.transpose else (n, k)
    _load(ctx, module.weight, module.bias, blob_shape, transpose=p.transpose)
    if axis != len(shape) - 1:
        x = ctx.call_function(torch.flatten, x, axis, suffix="flatten")
    ctx.set_top(0, ctx.call_module(module, x))
