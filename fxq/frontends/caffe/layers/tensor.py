"""Layers that route or reshape blobs: Input, Eltwise, Concat, Split, Slice, Flatten, Reshape, ShuffleChannel,
Crop.

These become ``call_function`` / ``call_method`` nodes (``torch.add``, ``torch.cat``, ...) so later passes see
ordinary torch ops.
"""
from __future__ import annotations

import operator

import torch

from fxq.frontends.caffe.builder import LayerContext
from fxq.frontends.caffe.registry import register_caffe_layer

_PROD, _SUM, _MAX = 0, 1, 2


@register_caffe_layer("Input")
def input_layer(ctx: LayerContext) -> None:
    """``Input`` -> one graph input per top; ``input_param.shape`` gives one shape per top or one for all."""
    ctx.expect(bottoms=0, tops=(1, None))
    shapes = [list(s.dim) for s in ctx.layer.input_param.shape]
    n_tops = len(ctx.layer.top)
    if len(shapes) not in (0, 1, n_tops):
        raise ctx.error(f"has {len(shapes)} shapes for {n_tops} tops; give 1 or {n_tops}")
    for i in range(n_tops):
        ctx.add_input(i, shapes[i if len(shapes) == n_tops else 0] if shapes else None)


@register_caffe_layer("Eltwise")
def eltwise(ctx: LayerContext) -> None:
    """``Eltwise`` SUM (with optional ``coeff``s) -> ``torch.add``/``torch.sub``/``torch.mul`` chain;
    PROD -> ``torch.mul``; MAX -> ``torch.maximum``."""
    ctx.expect(bottoms=(2, None), tops=1)
    p = ctx.layer.eltwise_param
    xs = ctx.bottoms
    last = len(xs) - 1
    if p.operation == _SUM:
        coeffs = [float(c) for c in p.coeff] or [1.0] * len(xs)
        if len(coeffs) != len(xs):
            raise ctx.error(f"has {len(coeffs)} coeff(s) for {len(xs)} bottoms")
        acc = xs[0] if coeffs[0] == 1.0 else ctx.call_function(torch.mul, xs[0], coeffs[0], suffix="coeff0")
        for i in range(1, len(xs)):
            suffix = None if i == last else f"sum{i}"
            if coeffs[i] == 1.0:
                acc = ctx.call_function(torch.add, acc, xs[i], suffix=suffix)
            elif coeffs[i] == -1.0:
                acc = ctx.call_function(torch.sub, acc, xs[i], suffix=suffix)
            else:
                acc = ctx.call_function(torch.add, acc, xs[i], alpha=coeffs[i], suffix=suffix)
    elif p.operation in (_PROD, _MAX):
        if len(p.coeff):
            raise ctx.error("coeff is only allowed with operation SUM")
        fn = torch.mul if p.operation == _PROD else torch.maximum
        acc = xs[0]
        for i in range(1, len(xs)):
            acc = ctx.call_function(fn, acc, xs[i], suffix=None if i == last else f"part{i}")
    else:
        raise ctx.error(f"unknown operation {p.operation}")
    ctx.set_top(0, acc)


@register_caffe_layer("Concat")
def concat(ctx: LayerContext) -> None:
    """``Concat`` -> ``torch.cat`` along ``axis`` (or the deprecated ``concat_dim``)."""
    ctx.expect(bottoms=(1, None), tops=1)
    p = ctx.layer.concat_param
    rank = len(ctx.shape(ctx.bottom(0)))
    axis = int(p.concat_dim) if p.HasField("concat_dim") else ctx.canonical_axis(p.axis, rank)
    ctx.set_top(0, ctx.call_function(torch.cat, ctx.bottoms, dim=axis))


@register_caffe_layer("Split")
def split(ctx: LayerContext) -> None:
    """``Split``: every top is another name of the bottom; no node (recorded in ``gm.meta["caffe"]["aliases"]``)."""
    ctx.expect(bottoms=1, tops=(1, None))
    for i in range(len(ctx.layer.top)):
        ctx.alias_top(i)


@register_caffe_layer("Slice")
def slice_layer(ctx: LayerContext) -> None:
    """``Slice`` -> one ``x[..., a:b]`` node per top, cut at ``slice_point``s or into equal parts."""
    ctx.expect(bottoms=1, tops=(1, None))
    x = ctx.bottom(0)
    shape = ctx.shape(x)
    p = ctx.layer.slice_param
    axis = int(p.slice_dim) if p.HasField("slice_dim") else ctx.canonical_axis(p.axis, len(shape))
    n_tops, size = len(ctx.layer.top), shape[axis]
    points = [int(v) for v in p.slice_point]
    if points:
        if len(points) != n_tops - 1 or points != sorted(points) or points[0] <= 0 or points[-1] >= size:
            raise ctx.error(f"slice_point {points} does not cut axis {axis} (size {size}) into {n_tops} parts")
    else:
        if size % n_tops:
            raise ctx.error(f"axis {axis} (size {size}) does not split evenly into {n_tops} tops")
        points = [size // n_tops * i for i in range(1, n_tops)]
    bounds = [0, *points, None]
    for i in range(n_tops):
        index = (slice(None),) * axis + (slice(bounds[i], bounds[i + 1]),)
        ctx.set_top(i, ctx.call_function(operator.getitem, x, index, suffix=str(i)))


@register_caffe_layer("Flatten")
def flatten(ctx: LayerContext) -> None:
    """``Flatten`` -> ``torch.flatten(x, axis, end_axis)``."""
    ctx.expect(bottoms=1, tops=1)
    rank = len(ctx.shape(ctx.bottom(0)))
    p = ctx.layer.flatten_param
    start, end = ctx.canonical_axis(p.axis, rank), ctx.canonical_axis(p.end_axis, rank)
    ctx.set_top(0, ctx.call_function(torch.flatten, ctx.bottom(0), start, end))


@register_caffe_layer("Reshape")
def reshape(ctx: LayerContext) -> None:
    """``Reshape`` -> ``x.reshape(...)``: ``0`` copies the bottom's dimension (as ``x.size(i)``, so the batch size
    stays free), ``-1`` is inferred; ``axis`` / ``num_axes`` limit the replaced range."""
    ctx.expect(bottoms=1, tops=1)
    x = ctx.bottom(0)
    shape = ctx.shape(x)
    p = ctx.layer.reshape_param
    rank = len(shape)
    start = p.axis if p.axis >= 0 else rank + p.axis + 1
    if not 0 <= start <= rank:
        raise ctx.error(f"axis {p.axis} is out of range for a {rank}-D bottom")
    end = rank if p.num_axes == -1 else start + p.num_axes
    if p.num_axes < -1 or end > rank:
        raise ctx.error(f"num_axes {p.num_axes} does not fit a {rank}-D bottom from axis {start}")
    spec = [int(d) for d in p.shape.dim]
    if spec.count(-1) > 1 or any(d < -1 for d in spec):
        raise ctx.error(f"shape {spec} may hold at most one -1 and no other negative value")
    # Each output dim: an int, or the index of the bottom dim it copies.
    dims: list[tuple[str, int]] = [("copy", i) for i in range(start)]
    for j, d in enumerate(spec):
        if d == 0:
            if start + j >= rank:
                raise ctx.error(f"shape dim {j} copies bottom axis {start + j}, which does not exist")
            dims.append(("copy", start + j))
        else:
            dims.append(("int", d))
    dims += [("copy", i) for i in range(end, rank)]
    args = []
    infer_one = -1 not in spec  # let torch infer one copied dim instead of reading its size
    for kind, value in dims:
        if kind == "int":
            args.append(value)
        elif infer_one:
            args.append(-1)
            infer_one = False
        else:
            args.append(ctx.call_method("size", x, value, suffix=f"size{value}"))
    ctx.set_top(0, ctx.call_method("reshape", x, *args))


@register_caffe_layer("ShuffleChannel")
def shuffle_channel(ctx: LayerContext) -> None:
    """``ShuffleChannel`` (ShuffleNet forks, ``group`` g) -> ``x.reshape(-1, g, C / g, H, W).transpose(1, 2)``
    back to ``(N, C, H, W)``: channel ``i * C / g + j`` goes to ``j * g + i``."""
    ctx.expect(bottoms=1, tops=1)
    x = ctx.bottom(0)
    shape = ctx.shape(x)
    groups = int(ctx.layer.shuffle_channel_param.group)
    if len(shape) != 4 or groups <= 0 or shape[1] % groups:
        raise ctx.error(f"group {groups} must divide the channels of a 4-D bottom, got shape {list(shape)}")
    _, c, h, w = shape
    grouped = ctx.call_method("reshape", x, -1, groups, c // groups, h, w, suffix="groups")
    swapped = ctx.call_method("transpose", grouped, 1, 2, suffix="swap")
    ctx.set_top(0, ctx.call_method("reshape", swapped, -1, c, h, w))


@register_caffe_layer("Crop")
def crop(ctx: LayerContext) -> None:
    """``Crop``: bottom 0 cut to bottom 1's shape from ``axis`` on, at ``offset`` (one for every axis, or one per
    axis; 0 without) -> a slice (FCN's score maps cut to the image)."""
    ctx.expect(bottoms=2, tops=1)
    shape, like = ctx.shape(ctx.bottom(0)), ctx.shape(ctx.bottom(1))
    if len(shape) != len(like):
        raise ctx.error(f"bottoms of shapes {list(shape)} and {list(like)} have different ranks")
    p = ctx.layer.crop_param
    axis = ctx.canonical_axis(p.axis, len(shape))
    offsets = [int(o) for o in p.offset]
    n = len(shape) - axis
    if len(offsets) not in (0, 1, n):
        raise ctx.error(f"has {len(offsets)} offsets for {n} cropped axes; give 0, 1 or {n}")
    offsets = offsets * n if len(offsets) == 1 else offsets or [0] * n
    index = [slice(None)] * axis
    for i, off in enumerate(offsets):
        size = like[axis + i]
        if off + size > shape[axis + i]:
            raise ctx.error(f"offset {off} + size {size} passes axis {axis + i} of bottom 0 (size {shape[axis + i]})")
        index.append(slice(off, off + size))
    ctx.set_top(0, ctx.call_function(operator.getitem, ctx.bottom(0), tuple(index)))
