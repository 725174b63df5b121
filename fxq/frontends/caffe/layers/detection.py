"""The SSD fork's layers (weiliu89/caffe, branch ``ssd``): Normalize, Permute, PriorBox, and DetectionOutput refused.

SSD detectors from caffe zoos (OpenCV's res10 face detector, VGG-SSD, MobileNet-SSD) use them around ordinary
convolutions. ``Normalize`` becomes :class:`CaffeNormalize`, ``Permute`` a ``permute``, and a
``PriorBox`` the constant its boxes are for the loaded input size (they depend on sizes only).
``DetectionOutput`` (box decoding and NMS) is post-processing: the error names the ``outputs=`` cut that loads
the network before it.
"""
from __future__ import annotations

import math

import torch

from fxq.frontends.caffe.builder import LayerContext
from fxq.frontends.caffe.layers._common import require_rank
from fxq.frontends.caffe.modules import CaffeNormalize
from fxq.frontends.caffe.registry import register_caffe_layer


@register_caffe_layer("Normalize")
def normalize(ctx: LayerContext) -> None:
    """``Normalize`` -> :class:`CaffeNormalize` (op type ``Normalize``, ncnn's layer of that name)."""
    ctx.expect(bottoms=1, tops=1)
    shape = ctx.shape(ctx.bottom(0))
    require_rank(ctx, shape, 4)
    p = ctx.layer.norm_param
    size = 1 if p.channel_shared else shape[1]
    module = CaffeNormalize(size, p.across_spatial, p.eps)
    blobs = ctx.load_blobs([("scale", (size,))])
    if blobs is not None:
        with torch.no_grad():
            module.weight.copy_(blobs[0].reshape(-1))
    ctx.set_top(0, ctx.call_module(module, ctx.bottom(0), op_type="Normalize"))


@register_caffe_layer("Permute")
def permute(ctx: LayerContext) -> None:
    """``Permute`` -> ``x.permute(order)``; dims the order leaves out follow in their own order, as in caffe."""
    ctx.expect(bottoms=1, tops=1)
    rank = len(ctx.shape(ctx.bottom(0)))
    order = [int(d) for d in ctx.layer.permute_param.order]
    if len(set(order)) != len(order) or any(d >= rank for d in order):
        raise ctx.error(f"order {order} is not a permutation of the dims of a {rank}-D bottom")
    order += [d for d in range(rank) if d not in order]
    if order == list(range(rank)):
        ctx.alias_top(0)
        return
    ctx.set_top(0, ctx.call_method("permute", ctx.bottom(0), *order))


def prior_boxes(layer_hw: tuple[int, int], image_hw: tuple[float, float], step_hw: tuple[float, float],
                min_sizes: list[float], max_sizes: list[float], aspect_ratios: list[float], flip: bool, clip: bool,
                offset: float, variance: list[float]) -> torch.Tensor:
    """SSD's prior boxes, ``[1, 2, H * W * num_priors * 4]``: normalized ``(xmin, ymin, xmax, ymax)`` in channel 0
    and their variances in channel 1. Per position (rows, then columns), per min size: the square of the min size,
    the square of ``sqrt(min * max)`` when max sizes are given, then one box per aspect ratio other than 1 (each
    ratio once, with its inverse when ``flip``). As the fork's C++ does, min and max sizes are truncated to ints."""
    ratios = [1.0]
    for ar in aspect_ratios:
        if all(abs(ar - r) >= 1e-6 for r in ratios):
            ratios.append(ar)
            if flip:
                ratios.append(1.0 / ar)
    (layer_h, layer_w), (img_h, img_w), (step_h, step_w) = layer_hw, image_hw, step_hw
    sizes: list[tuple[float, float]] = []  # (box width, box height) at one position
    for i, size in enumerate(min_sizes):
        min_size = float(int(size))  # the fork truncates the sizes to int (SSD512's 20.48 is 20; OpenCV does not)
        sizes.append((min_size, min_size))
        if max_sizes:
            side = math.sqrt(min_size * int(max_sizes[i]))
            sizes.append((side, side))
        for ar in ratios:
            if abs(ar - 1.0) >= 1e-6:
                sizes.append((min_size * math.sqrt(ar), min_size / math.sqrt(ar)))
    ys = (torch.arange(layer_h, dtype=torch.float64) + offset) * step_h
    xs = (torch.arange(layer_w, dtype=torch.float64) + offset) * step_w
    cy, cx = (t.reshape(-1, 1) for t in torch.meshgrid(ys, xs, indexing="ij"))
    half = torch.tensor(sizes, dtype=torch.float64) / 2  # (num_priors, 2): half width, half height
    boxes = torch.stack([(cx - half[:, 0]) / img_w, (cy - half[:, 1]) / img_h,
                         (cx + half[:, 0]) / img_w, (cy + half[:, 1]) / img_h], dim=-1).reshape(-1)
    if clip:
        boxes = boxes.clamp(0.0, 1.0)
    variances = torch.tensor(variance, dtype=torch.float64).repeat(boxes.numel() // 4)
    return torch.stack([boxes, variances]).to(torch.float32).unsqueeze(0)


@register_caffe_layer("PriorBox")
def prior_box(ctx: LayerContext) -> None:
    """``PriorBox`` -> the constant of :func:`prior_boxes` for the loaded sizes: the feature map's (bottom 0) and
    the image's (bottom 1, or ``img_size`` / ``img_h`` / ``img_w``). The boxes follow the input size only through
    ``load_caffe(input_shapes=...)``: load at the size the detector runs (data of another size is refused)."""
    ctx.expect(bottoms=2, tops=1)
    p = ctx.layer.prior_box_param
    feature, image = ctx.shape(ctx.bottom(0)), ctx.shape(ctx.bottom(1))
    require_rank(ctx, feature, 4)
    require_rank(ctx, image, 4)
    min_sizes, max_sizes = [float(v) for v in p.min_size], [float(v) for v in p.max_size]
    if not min_sizes or any(v <= 0 for v in min_sizes):
        raise ctx.error(f"needs positive min_size values, got {min_sizes}")
    if max_sizes and (len(max_sizes) != len(min_sizes) or any(m <= n for m, n in zip(max_sizes, min_sizes))):
        raise ctx.error(f"max_size {max_sizes} must give one value above each min_size {min_sizes}")
    variance = [float(v) for v in p.variance] or [0.1]
    if len(variance) == 1:
        variance *= 4
    if len(variance) != 4 or any(v <= 0 for v in variance):
        raise ctx.error(f"variance {variance} must be 1 or 4 positive values")
    if p.HasField("img_h") or p.HasField("img_w"):
        img_hw = (float(p.img_h), float(p.img_w))
    elif p.HasField("img_size"):
        img_hw = (float(p.img_size), float(p.img_size))
    else:
        img_hw = (float(image[2]), float(image[3]))
    if p.HasField("step_h") or p.HasField("step_w"):
        step_hw = (float(p.step_h), float(p.step_w))
    elif p.HasField("step"):
        step_hw = (float(p.step), float(p.step))
    else:
        step_hw = (img_hw[0] / feature[2], img_hw[1] / feature[3])
    if min(img_hw) <= 0 or min(step_hw) <= 0:
        raise ctx.error(f"image size {img_hw} and step {step_hw} must be positive")
    boxes = prior_boxes((feature[2], feature[3]), img_hw, step_hw, min_sizes, max_sizes,
                        [float(v) for v in p.aspect_ratio], p.flip, p.clip, float(p.offset), variance)
    ctx.builder.sized_by_input.append(ctx.name)  # prepare refuses data of another size (fxq.graph.data)
    ctx.set_top(0, ctx.constant(boxes))


@register_caffe_layer("DetectionOutput")
def detection_output(ctx: LayerContext) -> None:
    """``DetectionOutput`` (decode the boxes, per-class NMS, keep the top k) is refused, naming the cut that loads
    the network before it; the deployed runtime or the host decodes its inputs (ncnn's own DetectionOutput
    layer, TensorRT's NMS plugins, a few lines of numpy)."""
    bottoms = [str(b) for b in ctx.layer.bottom]
    raise ctx.error(f"is SSD post-processing (box decoding and NMS), which fxq does not convert. Fix: load the "
                    f"network up to its inputs with fxq.load_caffe(..., outputs={bottoms}) (CLI: --outputs "
                    f"{','.join(bottoms)}), quantize and deploy that, and decode its outputs after the runtime")
