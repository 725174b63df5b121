"""ncnn layer converters for fxq's canonical op types (registered in :mod:`fxq.backends.ncnn.registry`).

Each converter reads its node (module, function or method form), checks that ncnn's layer computes the same
thing, and emits one or more layers. Parameter ids follow ncnn's operator reference. Converters registered
with ``any_batch_dim=True`` map torch dims to blob axes through ``b.ncnn_axis`` / ``b.batch_dim`` (transformer
graphs move a batch of 1 and fold it into the heads; see :mod:`fxq.backends.ncnn.builder`).
"""
from __future__ import annotations

import functools
import itertools
import math
import operator
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import fx, nn

from fxq.backends.ncnn.builder import NcnnBuilder, WeightInfo, fold_dims
from fxq.backends.ncnn.fuse import is_noop_reduce, reduce_args
from fxq.backends.ncnn.platforms import is_depthwise, is_matmul_by_matrix, pair
from fxq.backends.ncnn.registry import register_ncnn_converter
from fxq.backends.ncnn.writer import Int8Scales, drop_dim, shape_params
from fxq.graph.attention import apply_attention_mask
from fxq.graph.op_types import clip_bounds, pad_fill, result_field, variance_args
from fxq.graph.passes import batchnorm_stats
from fxq.spec import QUANTIZING_STATES

__all__: list[str] = []

_MISSING = object()


def _arg(node: fx.Node, index: int, name: str, default: Any = _MISSING) -> Any:
    if len(node.args) > index:
        return node.args[index]
    if name in node.kwargs:
        return node.kwargs[name]
    if default is _MISSING:
        raise ValueError(f"node {node.name} lacks argument {name!r}")
    return default


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().cpu().contiguous().numpy()


_BATCH_FIX = ("keep the batch dimension in place, or take the batch size from the input (x.shape[0], -1) instead "
              "of writing it into the model: the exporter runs the graph at batch 1, where a batch can move")


def _static(value: Any) -> Any:
    """The recorded number of a shape-arithmetic node (``x.shape[-1] ** -0.5``), else ``value`` itself.

    The exported model has static shapes, so such numbers are constants there (the builder skips their nodes).
    """
    if isinstance(value, fx.Node):
        val = value.meta.get("val")
        if isinstance(val, (int, float)) and not isinstance(val, bool):
            return val
    return value


def _const(b: NcnnBuilder, node: fx.Node, value: Any, what: str) -> Any:
    """``value`` with every node in it (``F.pad(x, (0, pad_w, 0, pad_h))``) replaced by its export-time number:
    the recorded number of shape arithmetic, or a shape-only value (:meth:`NcnnBuilder.shape_number`)."""

    def number(v: Any) -> Any:
        if not isinstance(v, fx.Node):
            return v
        if b.strip(v) in b.static_nodes:
            return b.shape_number(v, node, what)
        fixed = _static(v)
        if isinstance(fixed, fx.Node):
            raise b.fail(node, f"its {what} is computed in the graph", f"make {what} a Python constant")
        return fixed

    return fx.node.map_aggregate(value, number)


# --------------------------------------------------------------------------- weighted layers
_CONV_ARGS = ("stride", "padding", "dilation", "groups")  # F.conv2d's arguments after the bias
_DECONV_ARGS = ("stride", "padding", "output_padding", "groups", "dilation")  # F.conv_transpose2d's
_CONV_DEFAULTS = {"stride": 1, "padding": 0, "dilation": 1, "groups": 1, "output_padding": 0}


def _conv_args(b: NcnnBuilder, node: fx.Node, module_type: type, names: tuple[str, ...]
               ) -> tuple[Any, Any, Any, dict[str, Any]]:
    """``(input, weight, bias, {name: value})`` of a 2-D (transposed) convolution, module or function form."""
    mod = b.module(node)
    if mod is not None:
        if not isinstance(mod, module_type) or mod.padding_mode != "zeros":
            raise b.fail(node, f"module {type(mod).__name__} (padding_mode {getattr(mod, 'padding_mode', '?')!r}) "
                         f"is not a zero-padded {module_type.__name__}", "ncnn's layer is 2-D with zero padding")
        return node.args[0], mod.weight, mod.bias, {k: getattr(mod, k) for k in names}
    attrs = {k: _const(b, node, _arg(node, 3 + i, k, _CONV_DEFAULTS[k]), k) for i, k in enumerate(names)}
    return _arg(node, 0, "input"), _arg(node, 1, "weight"), _arg(node, 2, "bias", None), attrs


def _kernel_params(b: NcnnBuilder, node: fx.Node, x: Any, w: torch.Tensor, num_output: int,
                   a: dict[str, Any], bias: torch.Tensor | None) -> dict[int, Any]:
    """The params (De)Convolution share, padding (4 left, 15 right, 14 top, 16 bottom) aside."""
    if w.dim() != 4 or len(b.shape(x)) != 4:
        raise b.fail(node, f"it is a {w.dim() - 2}-D convolution", "only 2-D convolutions are exported")
    (sh, sw), (dh, dw) = pair(a["stride"]), pair(a["dilation"])
    return {0: num_output, 1: int(w.shape[3]), 11: int(w.shape[2]), 2: dw, 12: dh, 3: sw, 13: sh,
            5: int(bias is not None), 6: int(w.numel())}


def _triple(v: Any) -> tuple[int, int, int]:
    if isinstance(v, (list, tuple)):
        return (int(v[0]),) * 3 if len(v) == 1 else (int(v[0]), int(v[1]), int(v[2]))
    return (int(v),) * 3


def _conv3d(b: NcnnBuilder, node: fx.Node) -> None:
    """``Convolution3D`` / ``ConvolutionDepthWise3D``, FP32 in both files: ncnn has no int8 3-D convolution (no
    int8_scale_term), which ``ncnn_int8``'s capability declares, so prepare keeps the node FP32 and the exporter's
    pre-check refuses a model that quantizes it."""
    x, w_arg, bias_arg, a = _conv_args(b, node, nn.Conv3d, _CONV_ARGS)
    w = b.weight(w_arg, node)
    bias = b.param(bias_arg, node, "bias") if bias_arg is not None else None
    if isinstance(a["padding"], str):
        raise b.fail(node, f"its padding is {a['padding']!r}", "give 3-D convolutions numeric padding")
    (kd, kh, kw), (sd, sh, sw) = w.fp32.shape[2:], _triple(a["stride"])
    (dd, dh, dw), (pd, ph, pw) = _triple(a["dilation"]), _triple(a["padding"])
    groups = int(a["groups"])
    params = {0: int(w.fp32.shape[0]), 1: int(kw), 11: int(kh), 21: int(kd), 2: dw, 12: dh, 22: dd, 3: sw, 13: sh,
              23: sd, 4: pw, 15: pw, 14: ph, 16: ph, 24: pd, 17: pd, 5: int(bias is not None), 6: int(w.fp32.numel())}
    layer_type = "Convolution3D"
    if groups > 1:
        layer_type, params[7] = "ConvolutionDepthWise3D", groups
    tail = [("raw", _np(bias))] if bias is not None else []
    b.emit(node, layer_type, [b.blob(x, node)], params, [("tagged", _np(w.fp32))] + tail)


def _conv1d(b: NcnnBuilder, node: fx.Node) -> None:
    """``Convolution1D`` / ``ConvolutionDepthWise1D`` over a ``(C, L)`` blob, FP32 in both files: ncnn has no int8
    1-D convolution, which ``ncnn_int8``'s capability declares (prepare keeps the node FP32)."""
    x, w_arg, bias_arg, a = _conv_args(b, node, nn.Conv1d, _CONV_ARGS)
    w = b.weight(w_arg, node).fp32
    bias = b.param(bias_arg, node, "bias") if bias_arg is not None else None
    if len(b.shape(x)) - (b.batch_dim(x) is not None) != 2:
        raise b.fail(node, f"its input of shape {b.shape(x)} is not (N, C, L)", "give 1-D convolutions (N, C, L)")
    kernel, stride, dilation = int(w.shape[2]), _triple(a["stride"])[0], _triple(a["dilation"])[0]
    padding = a["padding"]
    if padding == "valid":
        left = right = 0
    elif padding == "same":
        total = dilation * (kernel - 1)
        left, right = total // 2, total - total // 2
    elif isinstance(padding, str):
        raise b.fail(node, f"its padding is {padding!r}", "give 1-D convolutions numeric padding")
    else:
        left = right = _triple(padding)[0]
    params = {0: int(w.shape[0]), 1: kernel, 2: dilation, 3: stride, 4: left, 15: right, 5: int(bias is not None),
              6: int(w.numel())}
    layer_type, groups = "Convolution1D", int(a["groups"])
    if groups > 1:
        layer_type, params[7] = "ConvolutionDepthWise1D", groups
    tail = [("raw", _np(bias))] if bias is not None else []
    b.emit(node, layer_type, [b.blob(x, node)], params, [("tagged", _np(w))] + tail)


@register_ncnn_converter("Conv", any_batch_dim=True)
def _conv(b: NcnnBuilder, node: fx.Node) -> None:
    x = _arg(node, 0, "input")
    windows = b.batch_dim(x) is None and len(b.shape(x)) == 4  # (N * windows, C, H, W): the batch folded in
    if not windows:
        b.check_batch_first(node)
    if isinstance(b.module(node), nn.Conv3d) or node.target is F.conv3d:
        _conv3d(b, node)
        return
    if isinstance(b.module(node), nn.Conv1d) or node.target in (F.conv1d, torch.conv1d):
        _conv1d(b, node)
        return
    x, w_arg, bias_arg, a = _conv_args(b, node, nn.Conv2d, _CONV_ARGS)
    w = b.weight(w_arg, node)
    padding, groups = a["padding"], int(a["groups"])
    bias = b.param(bias_arg, node, "bias") if bias_arg is not None else None
    params = _kernel_params(b, node, x, w.fp32, int(w.fp32.shape[0]), a, bias)
    if isinstance(padding, str):
        if padding == "valid":
            pt = pb = pl = pr = 0
        else:  # "same" (stride 1)
            th, tw = params[12] * (params[11] - 1), params[2] * (params[1] - 1)
            pt, pl = th // 2, tw // 2
            pb, pr = th - pt, tw - pl
    else:
        pt, pl = pair(padding)
        pb, pr = pt, pl
    params.update({4: pl, 15: pr, 14: pt, 16: pb})
    if windows:
        _conv_over_windows(b, node, x, w, bias, params, groups)
        return
    if groups > 1 and not is_depthwise(w.fp32.shape, groups):
        w_on = w.quantizing
        x_on = b.is_quantizer(x) and b.quantizer(x).config.state in QUANTIZING_STATES
        if w_on or x_on:
            _grouped_int8_conv(b, node, x, w, bias, params, groups)
            return
    _convolution(b, node, x, w, bias, params, groups, b.blob(x, node), final=True)


def _convolution(b: NcnnBuilder, node: fx.Node, x: Any, w: Any, bias: torch.Tensor | None, params: dict[int, Any],
                 groups: int, bottom: str, *, final: bool) -> str:
    """The ``Convolution`` / ``ConvolutionDepthWise`` layer of ``node`` over ``bottom`` (int8 where ``x`` and ``w``
    are quantized), the node's own layer when ``final``; returns its blob."""
    int8 = b.int8_scales(node, x, w, groups)
    layer_type = "Convolution"
    if groups > 1:
        layer_type, params[7] = "ConvolutionDepthWise", groups
    tail = [("raw", _np(bias))] if bias is not None else []
    weights = [("tagged", _np(w.fp32))] + tail
    int8_term = 1 if groups > 1 else 2
    layer = (b.emit(node, layer_type, [bottom], params, weights, int8=int8, int8_term=int8_term) if final
             else b.add_layer(node, layer_type, [bottom], params, weights, int8=int8, int8_term=int8_term))
    if int8 is not None:
        layer.int8_weights = [("tagged", _np(w.quantized()))] + tail
    return layer.tops[0]


def _conv_over_windows(b: NcnnBuilder, node: fx.Node, x: Any, w: Any, bias: torch.Tensor | None,
                       params: dict[int, Any], groups: int) -> None:
    """A 2-D convolution of ``(n, C, H, W)`` whose batch is folded into the ``n`` windows (EfficientViT-M's local
    window attention): ncnn convolves one ``(C, H, W)`` blob, so each window is padded on its own, the windows are
    stacked along the rows of one ``(C, n * H', W')`` blob, convolved unpadded, and each window's output rows cropped
    back out. A window's outputs read only its own padded rows, so this is the convolution of each window, int8
    where the model quantizes it."""
    n, c, h, width = b.shape(x)
    kh, dh, sh = params[11], params[12], params[13]
    pt, pb, pl, pr = params[14], params[16], params[4], params[15]
    hp = h + pt + pb
    if hp % sh or (groups > 1 and not is_depthwise(w.fp32.shape, groups)):
        raise b.fail(node, f"it convolves {n} windows of shape {(c, h, width)} folded into dim 0 with stride {sh} "
                     f"and groups {groups}; ncnn convolves one (C, H, W) blob, so the windows are stacked along the "
                     "rows, which takes a stride dividing the padded height and no grouped (non-depthwise) kernel",
                     "run the convolution before the windows are folded into the batch")
    h_out, w_out = b.shape(node)[2:]
    blob = b.blob(x, node)
    if pt or pb or pl or pr:
        blob = b.helper(node, "Padding", [blob], {0: pt, 1: pb, 2: pl, 3: pr})
    blob = b.helper(node, "Permute", [blob], {0: permute_order_type((1, 0, 2, 3))})  # (C, n, H', W')
    blob = b.helper(node, "Reshape", [blob], shape_params((c, n * hp, width + pl + pr)))
    params = {**params, 4: 0, 15: 0, 14: 0, 16: 0}
    blob = _convolution(b, node, x, w, bias, params, groups, blob, final=False)
    rows = (n * hp - dh * (kh - 1) - 1) // sh + 1  # the stacked output rows; window i's start at row i * hp / sh
    if rows < n * (hp // sh):
        blob = b.helper(node, "Padding", [blob], {1: n * (hp // sh) - rows})
    blob = b.helper(node, "Reshape", [blob], shape_params((params[0], n, hp // sh, w_out)))
    if h_out < hp // sh:
        blob = b.helper(node, "Crop", [blob], {9: [0], 10: [h_out], 11: [2]})
    b.emit(node, "Permute", [blob], {0: permute_order_type((1, 0, 2, 3))}, batch_dim=None)


def _grouped_int8_conv(b: NcnnBuilder, node: fx.Node, x: Any, w: Any, bias: torch.Tensor | None,
                       params: dict[int, Any], groups: int) -> None:
    """An int8 grouped conv that is not depthwise (RegNet, ResNeXt): ``Slice`` along the channels, one int8
    ``Convolution`` a group (per-output-channel weight scales, the conv's input scale), ``Concat``.

    ncnn's int8 ``ConvolutionDepthWise`` runs such a conv as one int8 ``Convolution`` a group too, but its x86
    kernel (packing layout on, the default) loses the groups' outputs when a group has a multiple of 8 output
    channels: it lays the output out for 4 channels a pack while the group's Convolution writes 8 (AVX) or 16
    (AVX-512) a pack into a buffer of its own, and the layer returns uninitialised memory (RegNet: cosine ~0 at
    the first grouped conv). Separate Convolution layers compute the same integers on every ncnn build, and take
    one weight scale per output channel.
    """
    int8 = b.int8_scales(node, x, w, 1)  # checks both quantizers; scales per output channel
    assert int8 is not None
    out_ch, in_g = int(w.fp32.shape[0]), int(w.fp32.shape[1])
    out_g = out_ch // groups
    name = b.layer_name(node)  # the Concat (the conv's value) carries the conv's name
    axis = b.ncnn_axis(node, 1, x)
    parts = b.add_layer(node, "Slice", [b.blob(x, node)], {0: [in_g] * groups, 1: axis}, n_tops=groups,
                        name=b.unique_layer_name(f"{name}_slice")).tops
    w_q = w.quantized()
    tops = []
    for g, part in enumerate(parts):
        rows = slice(g * out_g, (g + 1) * out_g)
        p = dict(params)
        p[0], p[6] = out_g, int(w.fp32[rows].numel())
        tail = [("raw", _np(bias[rows]))] if bias is not None else []
        scales = Int8Scales(weight=int8.weight[rows].copy(), bottom=int8.bottom)
        layer = b.add_layer(node, "Convolution", [part], p, [("tagged", _np(w.fp32[rows]))] + tail, int8=scales,
                            name=b.unique_layer_name(f"{name}_g{g}"))
        layer.int8_weights = [("tagged", _np(w_q[rows]))] + tail
        tops.append(layer.tops[0])
    b.emit(node, "Concat", tops, {0: axis}, name=name)


@register_ncnn_converter("ConvTranspose")
def _deconv(b: NcnnBuilder, node: fx.Node) -> None:
    """``Deconvolution`` / ``DeconvolutionDepthWise`` (groups > 1), always FP32: ncnn has no int8 deconvolution.

    torch's weight is ``(in, out / groups, kh, kw)``; ncnn's is ``(groups, out / groups, in / groups, kh, kw)``,
    not flipped (ncnn scatters ``input[i] * w[k]`` to ``output[i * stride + k * dilation]`` as torch does).
    Output padding (params 18 / 19, right / bottom) is read off the recorded shapes, so ``output_size=`` works.
    """
    x, w_arg, bias_arg, a = _conv_args(b, node, nn.ConvTranspose2d, _DECONV_ARGS)
    w = b.weight(w_arg, node).fp32
    groups = int(a["groups"])
    bias = b.param(bias_arg, node, "bias") if bias_arg is not None else None
    ph, pw = pair(a["padding"])
    params = _kernel_params(b, node, x, w, int(w.shape[1]) * groups, a, bias)
    params.update({4: pw, 15: pw, 14: ph, 16: ph})
    (in_h, in_w), (out_h, out_w) = b.shape(x)[2:], b.shape(node)[2:]
    for out, size, k, s, d, p, key in ((out_w, in_w, params[1], params[3], params[2], pw, 18),
                                       (out_h, in_h, params[11], params[13], params[12], ph, 19)):
        params[key] = out - ((size - 1) * s + d * (k - 1) + 1 - 2 * p)
        if params[key] < 0:
            raise b.fail(node, f"its recorded output size {out} is smaller than the transposed convolution gives "
                         "without output padding", "record the shapes again (fxq.prepare with example inputs)")
    c_in, per_group, kh, kw = (int(d) for d in w.shape)
    ncnn_w = w.reshape(groups, c_in // groups, per_group, kh, kw).transpose(1, 2)
    layer_type = "Deconvolution"
    if groups > 1:
        layer_type, params[7] = "DeconvolutionDepthWise", groups
    tail = [("raw", _np(bias))] if bias is not None else []
    b.emit(node, layer_type, [b.blob(x, node)], params, [("tagged", _np(ncnn_w))] + tail)


@register_ncnn_converter("Gemm", any_batch_dim=True, high_rank=True)
def _linear(b: NcnnBuilder, node: fx.Node) -> None:
    mod = b.module(node)
    if mod is not None and not hasattr(mod, "weight"):  # onnx2torch's OnnxGemm: B computed, or alpha / transA set
        raise b.fail(node, "an ONNX Gemm whose B operand is computed in the network or that transposes A / scales by "
                     "alpha (ncnn's InnerProduct multiplies by a stored weight)",
                     "multiply by a stored weight matrix (a Linear layer)")
    if mod is not None:
        x, w_arg, bias_arg = node.args[0], mod.weight, mod.bias
    elif node.target is F.linear:
        x, w_arg, bias_arg = _arg(node, 0, "input"), _arg(node, 1, "weight"), _arg(node, 2, "bias", None)
    else:
        raise b.fail(node, "only F.linear / nn.Linear are exported as InnerProduct", "use nn.Linear")
    bias = b.param(bias_arg, node, "bias") if bias_arg is not None else None
    _inner_product(b, node, x, b.weight(w_arg, node), bias)


def _inner_product(b: NcnnBuilder, node: fx.Node, x: Any, w: WeightInfo, bias: torch.Tensor | None) -> None:
    """``InnerProduct`` of ``x`` by the weight ``w`` (``(out, in)``, or ``(in, out)`` when ``w.out_axis`` is -1:
    a MatMul's matrix): ncnn multiplies a 1-D blob, or each row of a 2-D blob (``(N, T, F)`` -> rows T).

    A blob of rank 3 or 4 (ConvNeXt's ``Linear`` over the channels of an NHWC ``(N, H, W, C)`` value) would be
    flattened whole by ``InnerProduct``, so it is reshaped to rows ``(H * W, C)`` first and back to
    ``(H, W, out)`` after; the layer itself keeps the node's name (its int8 table lines). So is a value of more than
    4 dims besides the batch (Twins' ``(N, rows, cols, h, w, C)`` windows), back to its stored shape.
    """
    shape, bd = b.shape(x), b.batch_dim(x)
    in_blob, out_blob = b.blob_shape(x), drop_dim(b.shape(node), bd)  # the output keeps the input's batch dim
    out_blob = fold_dims(out_blob)  # more than 4 dims (Twins' windows): stored with the outer ones merged
    if not in_blob or (len(in_blob) > 4 and not b.high_rank(x)) or bd == len(shape) - 1:
        raise b.fail(node, f"its input of shape {shape} (batch dim {bd}) is a rank-{len(in_blob)} blob whose "
                     "last dim is not the features; ncnn's InnerProduct maps the last dim of a blob of rank 1 to 4",
                     "reshape the input to (N, ..., F) with the batch outside the last dim first")
    out_major = (lambda t: t) if w.out_axis == 0 else (lambda t: t.T)  # ncnn's weight is (out, in), row-major
    out_ch = int(w.fp32.shape[w.out_axis])
    int8 = b.int8_scales(node, x, w)
    params = {0: out_ch, 1: int(bias is not None), 2: int(w.fp32.numel())}
    tail = [("raw", _np(bias))] if bias is not None else []
    weights = [("tagged", _np(out_major(w.fp32)))] + tail
    if len(in_blob) <= 2:
        layer = b.emit(node, "InnerProduct", [b.blob(x, node)], params, weights, int8=int8)
    else:  # rows of the last dim, then the blob's own shape back (the outermost dim follows the input's size)
        name = b.layer_name(node)
        rows = b.add_layer(node, "Reshape", [b.blob(x, node)], {0: in_blob[-1], 1: -1},
                           name=b.unique_layer_name(f"{name}_rows")).tops[0]
        layer = b.add_layer(node, "InnerProduct", [rows], params, weights, int8=int8, name=name)
        b.emit(node, "Reshape", [layer.tops[0]], shape_params((-1, *out_blob[1:])),
               name=b.unique_layer_name(f"{name}_unrows"))
    if int8 is not None:
        layer.int8_weights = [("tagged", _np(out_major(w.quantized())))] + tail


@register_ncnn_converter("BatchNormalization")
def _batchnorm(b: NcnnBuilder, node: fx.Node) -> None:
    """``BatchNorm`` (0 channels, 1 eps; slope, mean, variance, bias) of a module or an ``F.batch_norm`` whose
    statistics are stored tensors, where no conv before it took it in."""
    found = batchnorm_stats(b.gm, node, b.modules)
    if found is None:
        raise b.fail(node, "only eval-mode BatchNorm with stored running statistics is exported",
                     "call model.eval() before quantizing")
    stats = found[0]
    c = int(stats.mean.numel())
    slope = stats.weight if stats.weight is not None else torch.ones(c)
    bias = stats.bias if stats.bias is not None else torch.zeros(c)
    weights = [("raw", _np(t)) for t in (slope, stats.mean, stats.var, bias)]
    b.emit(node, "BatchNorm", [b.blob(node.args[0], node)], {0: c, 1: float(stats.eps)}, weights)


# --------------------------------------------------------------------------- activations
def _unary(layer_type: str, params: dict[int, Any] | None = None):
    def convert(b: NcnnBuilder, node: fx.Node) -> None:
        b.emit(node, layer_type, [b.blob(node.args[0], node)], params)

    return convert


# elementwise activations read a value of more than 4 dims as stored (outer dims merged): the same elements
register_ncnn_converter("Relu", any_batch_dim=True, high_rank=True)(_unary("ReLU"))
# ONNX forms (onnx2torch modules; torch's own functions have no canonical type for these): ncnn UnaryOp types
for _onnx_type, _unary_type in (("Abs", 0), ("Neg", 1), ("Floor", 2), ("Ceil", 3), ("Sqrt", 5), ("Rsqrt", 6),
                                ("Exp", 7), ("Log", 8), ("Sin", 9), ("Cos", 10), ("Tan", 11), ("Asin", 12),
                                ("Acos", 13), ("Atan", 14), ("Reciprocal", 15)):
    register_ncnn_converter(_onnx_type, any_batch_dim=True, high_rank=True)(_unary("UnaryOp", {0: _unary_type}))


@register_ncnn_converter("Identity", any_batch_dim=True, high_rank=True)
def _identity(b: NcnnBuilder, node: fx.Node) -> None:
    """``contiguous`` / ``clone`` / ``detach`` / dropout: the input's blob, no layer."""
    x = node.args[0]
    b.alias(node, x, b.batch_dim(x))
register_ncnn_converter("Sigmoid", any_batch_dim=True, high_rank=True)(_unary("Sigmoid"))
register_ncnn_converter("Tanh", any_batch_dim=True, high_rank=True)(_unary("TanH"))
register_ncnn_converter("Silu", any_batch_dim=True, high_rank=True)(_unary("Swish"))
register_ncnn_converter("HardSwish", any_batch_dim=True, high_rank=True)(_unary("HardSwish", {0: 1.0 / 6.0, 1: 0.5}))


@register_ncnn_converter("HardSigmoid", any_batch_dim=True, high_rank=True)
def _hardsigmoid(b: NcnnBuilder, node: fx.Node) -> None:
    mod = b.module(node)  # torch: relu6(x + 3) / 6; ONNX (onnx2torch's module): alpha, beta attributes
    alpha, beta = getattr(mod, "alpha", 1.0 / 6.0), getattr(mod, "beta", 0.5)
    b.emit(node, "HardSigmoid", [b.blob(node.args[0], node)], {0: float(alpha), 1: float(beta)})


def _one_scalar(layer: str, name: str, default: float) -> Callable[[NcnnBuilder, fx.Node], None]:
    """A converter to ncnn ``layer`` whose param 0 is the op's scalar ``name`` (the module's attribute, or the
    function's second argument)."""

    def convert(b: NcnnBuilder, node: fx.Node) -> None:
        mod = b.module(node)
        value = getattr(mod, name) if mod is not None else _arg(node, 1, name, default)
        b.emit(node, layer, [b.blob(node.args[0], node)], {0: float(_const(b, node, value, name))})

    return convert


register_ncnn_converter("LeakyRelu", any_batch_dim=True, high_rank=True)(_one_scalar("ReLU", "negative_slope", 0.01))
register_ncnn_converter("Elu", any_batch_dim=True, high_rank=True)(_one_scalar("ELU", "alpha", 1.0))


@register_ncnn_converter("Selu", any_batch_dim=True, high_rank=True)
def _selu(b: NcnnBuilder, node: fx.Node) -> None:
    """``SELU`` (0 alpha, 1 lambda): torch's fixed constants, or ONNX's ``alpha`` / ``gamma``."""
    mod = b.module(node)
    alpha, gamma = float(getattr(mod, "alpha", 1.6732632423543772)), float(getattr(mod, "gamma", 1.0507009873554805))
    b.emit(node, "SELU", [b.blob(node.args[0], node)], {0: alpha, 1: gamma})


@register_ncnn_converter("LRN")
def _lrn(b: NcnnBuilder, node: fx.Node) -> None:
    """``LRN`` (0 region_type, 1 local_size, 2 alpha, 3 beta, 4 bias). Across channels (0) ncnn, torch, ONNX and
    caffe all compute ``x / (bias + alpha / size * sum of x^2 over the channel window) ** beta``; the window of an
    even size sits differently in each, so only odd sizes are exported. Caffe's WITHIN_CHANNEL (1) is the same over a
    size x size spatial window with bias 1."""
    mod = b.module(node)
    region = 0
    if mod is not None and not hasattr(mod, "k"):  # caffe's WITHIN_CHANNEL: the mean of x^2 over size x size
        size, alpha, beta, k, region = mod.size, mod.alpha, mod.beta, 1.0, 1  # (pads counted), as ncnn's region 1
    elif mod is not None:
        size, alpha, beta, k = mod.size, mod.alpha, mod.beta, mod.k
    else:
        size, alpha, beta, k = (_const(b, node, _arg(node, i, n, d), n) for i, (n, d) in
                                enumerate((("size", _MISSING), ("alpha", 1e-4), ("beta", 0.75), ("k", 1.0)), 1))
    x = node.args[0]
    if len(b.shape(x)) != 4 or b.batch_dim(x) != 0:
        raise b.fail(node, f"its input of shape {b.shape(x)} is not (N, C, H, W)", "apply LRN to 4-D image tensors")
    if int(size) % 2 == 0:
        raise b.fail(node, f"its window size {size} is even: ncnn centres the window differently from torch",
                     "use an odd local size")
    b.emit(node, "LRN", [b.blob(x, node)], {0: region, 1: int(size), 2: float(alpha), 3: float(beta), 4: float(k)})


@register_ncnn_converter("Normalize")
def _normalize(b: NcnnBuilder, node: fx.Node) -> None:
    """SSD's caffe ``Normalize`` (:class:`~fxq.frontends.caffe.modules.CaffeNormalize`) -> ncnn's ``Normalize``
    (0 across_spatial, 1 channel_shared, 2 eps, 3 scale size, 4 across_channel, 9 eps_mode 0: caffe's
    ``1 / sqrt(sum + eps)``); the scale is stored raw."""
    mod = b.module(node)
    x = node.args[0]
    if mod is None or not hasattr(mod, "across_spatial"):
        raise b.fail(node, "only the caffe frontend's Normalize module is exported as ncnn's Normalize",
                     "load the model with fxq.load_caffe")
    if len(b.shape(x)) != 4 or b.batch_dim(x) != 0:
        raise b.fail(node, f"its input of shape {b.shape(x)} is not (N, C, H, W)", "normalize 4-D image tensors")
    scale = mod.weight.detach().float().reshape(-1)
    b.emit(node, "Normalize", [b.blob(x, node)],
           {0: int(mod.across_spatial), 1: int(scale.numel() == 1), 2: float(mod.eps), 3: int(scale.numel()),
            4: 1, 9: 0}, [("raw", _np(scale))])


@register_ncnn_converter("InstanceNormalization")
def _instance_norm(b: NcnnBuilder, node: fx.Node) -> None:
    """``InstanceNorm`` (0 channels, 1 eps, 2 affine; gamma, beta) of an ``(N, C, H, W)`` or ``(N, C, L)`` tensor,
    normalized over H x W (L) per channel, as ``nn.InstanceNorm2d`` / ``1d`` / ``F.instance_norm`` without running
    statistics compute it (RAFT's feature encoder, captured by torch.export, has the function)."""
    mod = b.module(node)
    x = node.args[0]
    if mod is None and node.target is F.instance_norm:
        by_input = _arg(node, 5, "use_input_stats", True)
        weight, bias = _arg(node, 3, "weight", None), _arg(node, 4, "bias", None)
        eps = float(_const(b, node, _arg(node, 7, "eps", 1e-5), "eps"))
    elif isinstance(mod, nn.modules.instancenorm._InstanceNorm):
        by_input, eps = not mod.track_running_stats, float(mod.eps)
        weight, bias = (mod.weight, mod.bias) if mod.affine else (None, None)
    else:
        by_input = False
    if not by_input:
        raise b.fail(node, "only instance norms normalizing by the input's own statistics are exported",
                     "use nn.InstanceNorm2d(track_running_stats=False)")
    shape = b.shape(x)
    if len(shape) not in (3, 4) or b.batch_dim(x) != 0:
        raise b.fail(node, f"its input of shape {shape} is not (N, C, L) or (N, C, H, W)",
                     "apply it to batch-first 3-D or 4-D tensors")
    c = int(shape[1])
    affine = weight is not None or bias is not None
    weights = [("raw", _np(b.param(weight, node, "weight") if weight is not None else torch.ones(c))),
               ("raw", _np(b.param(bias, node, "bias") if bias is not None else torch.zeros(c)))] if affine else []
    params = {0: c, 1: eps, 2: int(affine)}
    if len(shape) == 4:
        b.emit(node, "InstanceNorm", [b.blob(x, node)], params, weights)
        return
    # (N, C, L), a 2-D blob that ncnn would take as one channel: as (C, 1, L) and back (torch.onnx writes
    # GroupNorm so: Reshape to (N, groups, -1), InstanceNormalization, Reshape back; PoolFormer's one group)
    planes = b.helper(node, "Reshape", [b.blob(x, node)], shape_params((c, 1, shape[2])))
    normed = b.helper(node, "InstanceNorm", [planes], params, weights)
    b.emit(node, "Reshape", [normed], shape_params((c, shape[2])))


@register_ncnn_converter("Tile", "Expand", any_batch_dim=True)
def _repeat(b: NcnnBuilder, node: fx.Node) -> None:
    """``x.repeat(...)`` / ONNX ``Tile``, and ``expand`` / ONNX ``Expand`` of size-1 dims (torch.onnx writes
    ``repeat`` as an Expand to the input's own shape, then a Tile): one ncnn ``Tile`` (0 axis, 1 tiles) per dim
    whose size grows, none for a dim that keeps its size; a batch only at batch 1 (:func:`_tiles`)."""
    x = node.args[0]
    rank, before, after = len(b.shape(x)), b.shape(x), b.shape(node)
    if len(after) != rank:
        raise b.fail(node, f"it turns a rank-{rank} tensor of shape {before} into shape {after} (a rank change)",
                     "repeat / expand with one count or size per dim of the input")
    if b.op(node) == "Expand" and any(m != n and m != 1 for m, n in zip(before, after)):
        raise b.fail(node, f"it expands shape {before} to {after}", "expand only dims of size 1")
    counts = [n // m for m, n in zip(before, after)]
    if any([o[d] // i[d] for d in range(rank)] != counts for i, o in b.probed_shapes(x, node)):
        b.warn_once(f"tile:{node.name}", "ncnn export: node %s repeats its input %s times, counts that follow the "
                    "input's size; written for the export-time size, so the file repeats that often at every size",
                    node.name, counts)
    _tile(b, node, x, {d: c for d, c in enumerate(counts) if c != 1})


def _tile(b: NcnnBuilder, node: fx.Node, x: fx.Node, counts: dict[int, int]) -> None:
    """``node`` is ``x`` repeated ``counts[d]`` times along each dim ``d``: one ncnn ``Tile`` (0 axis, 1 tiles) per
    dim."""
    if not counts:
        b.alias(node, x, b.batch_dim(x))
        return
    blob, axes, out_bd, stored = _tiles(b, node, x, counts)
    for axis, r in axes[:-1] if stored is None else axes:
        blob = b.helper(node, "Tile", [blob], {0: axis, 1: r})
    if stored is None:
        b.emit(node, "Tile", [blob], {0: axes[-1][0], 1: axes[-1][1]}, batch_dim=out_bd)
    else:
        b.emit(node, "Reshape", [blob], shape_params(stored), batch_dim=out_bd)


def _tiles(b: NcnnBuilder, node: fx.Node, x: fx.Node, counts: dict[int, int]
           ) -> tuple[str, list[tuple[int, int]], int | None, tuple[int, ...] | None]:
    """(the blob to tile, its (axis, tiles) per dim of ``counts``, the result's batch dim, the blob shape the tiled
    blob is reshaped to, if any). Repeating a batch of 1 (GCViT's global query, once per window:
    ``q.repeat_interleave(windows, dim=0)``; torch.onnx's ``repeat_interleave``, a Tile of a new axis of size 1)
    folds the copies into the batch: the result's blob keeps every dim, viewed around the repeated one when they
    are more than 4."""
    shape, bd, blob = b.shape(x), b.batch_dim(x), b.blob(x, node)
    if bd is None or bd not in counts:
        return blob, [(b.ncnn_axis(node, d, x), r) for d, r in counts.items()], bd, None
    if shape[bd] != 1 or (len(shape) > 4 and len(counts) > 1):
        raise b.fail(node, f"it repeats the batch dimension (dim {bd} of shape {shape})", b.batch_advice(x))
    if len(shape) <= 4:
        return b.helper(node, "Reshape", [blob], shape_params(shape)), list(counts.items()), None, None
    view = _around(drop_dim(shape, bd), bd, bd)  # a new axis of size 1 where the batch was
    return b.helper(node, "Reshape", [blob], shape_params(view)), [(1, counts[bd])], None, fold_dims(b.shape(node))


@register_ncnn_converter("SlidingWindows", any_batch_dim=True, high_rank=True)
def _sliding_windows(b: NcnnBuilder, node: fx.Node) -> None:
    """``x.unfold(dim, size, step)`` (HaloNet's windows with a halo): window ``i`` of ``dim`` taken as a new last
    dim. The value is viewed as (dims before, ``dim``, dims after): windows that do not overlap are a Reshape and a
    Permute; others each a Crop, moved last and joined by a Concat. The result is reshaped to its own layout."""
    x, dim, size, step = node.args[0], *(_const(b, node, _arg(node, i, k), k) for i, k in
                                         ((1, "dimension"), (2, "size"), (3, "step")))
    shape, bd = b.shape(x), b.batch_dim(x)
    d = int(dim) % len(shape)
    if d == bd:
        raise b.fail(node, f"it takes windows along the batch dimension (dim {d} of shape {shape})",
                     b.batch_advice(x))
    before, length, after = _around(drop_dim(shape, bd), b.ncnn_axis(node, d, x))
    n = (length - size) // step + 1
    blob = b.helper(node, "Reshape", [b.blob(x, node)], shape_params((before, length, after)))
    if size == step:
        blob = b.helper(node, "Crop", [blob], {9: [0], 10: [n * size], 11: [1]}) if n * size < length else blob
        blob = b.helper(node, "Reshape", [blob], shape_params((before, n, size, after)))
        blob = b.helper(node, "Permute", [blob], {0: permute_order_type((0, 1, 3, 2))})
    else:
        pieces = []
        for i in range(n):
            piece = b.helper(node, "Crop", [blob], {9: [i * step], 10: [i * step + size], 11: [1]})
            piece = b.helper(node, "Permute", [piece], {0: permute_order_type((0, 2, 1))})
            pieces.append(b.helper(node, "Reshape", [piece], shape_params((before, 1, after, size))))
        blob = pieces[0] if n == 1 else b.helper(node, "Concat", pieces, {0: 1})
    b.emit(node, "Reshape", [blob], shape_params(fold_dims(drop_dim(b.shape(node), bd))), batch_dim=bd)


def _window_params(b: NcnnBuilder, node: fx.Node, first: int) -> dict[int, Any]:
    """ncnn ``Unfold`` / ``Fold`` params of ``F.unfold`` / ``F.fold`` (their modules too): kernel, dilation, padding
    and stride, the arguments from position ``first`` on (after ``output_size`` for a fold)."""
    mod = b.module(node)
    names = ("kernel_size", "dilation", "padding", "stride")
    k, dil, pad, stride = ((getattr(mod, a) for a in names) if mod is not None else
                           (_const(b, node, _arg(node, first + i, a, d), a) for i, (a, d) in
                            enumerate(zip(names, (None, 1, 0, 1)))))
    (kh, kw), (dh, dw), (ph, pw), (sh, sw) = pair(k), pair(dil), pair(pad), pair(stride)
    return {1: kw, 11: kh, 2: dw, 12: dh, 3: sw, 13: sh, 4: pw, 15: pw, 14: ph, 16: ph}


def _batch_of_one_image(b: NcnnBuilder, node: fx.Node, x: fx.Node, rank: int, what: str) -> None:
    shape, bd = b.shape(x), b.batch_dim(x)
    if len(shape) != rank or bd != 0:
        raise b.fail(node, f"{what} of shape {shape} (batch dim {bd}); ncnn's layer takes one image of a batch",
                     f"give it a {rank}-D input whose dim 0 is the batch")


@register_ncnn_converter("Im2Col")
def _im2col(b: NcnnBuilder, node: fx.Node) -> None:
    """``nn.Unfold`` / ``F.unfold`` of ``(N, C, H, W)`` into ``(N, C * kh * kw, blocks)``: ncnn's ``Unfold``
    (any kernel, dilation, padding and stride), whose ``(C * kh * kw, blocks)`` rows are torch's."""
    x = node.args[0]
    _batch_of_one_image(b, node, x, 4, "an unfold")
    b.emit(node, "Unfold", [b.blob(x, node)], _window_params(b, node, 1))


@register_ncnn_converter("Col2Im")
def _col2im(b: NcnnBuilder, node: fx.Node) -> None:
    """``nn.Fold`` / ``F.fold`` of ``(N, C * kh * kw, blocks)`` into ``(N, C, H, W)``, overlaps summed (VOLO's outlook
    attention): ncnn's ``Fold``, the output size the one the model ran at export."""
    x = node.args[0]
    _batch_of_one_image(b, node, x, 3, "a fold")
    params = _window_params(b, node, 2)
    _, _, h, w = b.shape(node)
    b.emit(node, "Fold", [b.blob(x, node)], {**params, 20: int(w), 21: int(h)})


@register_ncnn_converter("RepeatInterleave", any_batch_dim=True)
def _repeat_interleave(b: NcnnBuilder, node: fx.Node) -> None:
    """``x.repeat_interleave(r, dim)``: each element ``r`` times in a row along ``dim``. Of a dim of size 1 it is a
    ``Tile``; else the blob is viewed as (dims before, the dim, 1, dims after), tiled along its size-1 axis and
    reshaped back."""
    x, repeats, dim = node.args[0], _arg(node, 1, "repeats"), _arg(node, 2, "dim", None)
    r = _const(b, node, repeats, "repeats")
    if dim is None or not isinstance(r, int) or isinstance(r, bool):
        raise b.fail(node, f"it repeats by {r!r} along dim {dim!r}", "repeat every element the same number of "
                     "times along one dim: x.repeat_interleave(int, dim=d)")
    shape, bd = b.shape(x), b.batch_dim(x)
    d = int(dim) % len(shape)
    if shape[d] == 1 or r == 1:
        _tile(b, node, x, {d: r} if r != 1 else {})
        return
    if d == bd:
        raise b.fail(node, f"it repeats the batch dimension (dim {d} of shape {shape}) element by element",
                     b.batch_advice(x))
    before, size, after = _around(drop_dim(shape, bd), b.ncnn_axis(node, d, x))
    blob = b.helper(node, "Reshape", [b.blob(x, node)], shape_params((before, size, 1, after)))
    blob = b.helper(node, "Tile", [blob], {0: 2, 1: r})
    b.emit(node, "Reshape", [blob], shape_params(drop_dim(b.shape(node), bd)))


@register_ncnn_converter("Gelu", any_batch_dim=True, high_rank=True)
def _gelu(b: NcnnBuilder, node: fx.Node) -> None:
    mod = b.module(node)
    approx = mod.approximate if mod is not None else node.kwargs.get("approximate", "none")
    b.emit(node, "GELU", [b.blob(node.args[0], node)], {0: int(approx == "tanh")})


@register_ncnn_converter("PRelu")
def _prelu(b: NcnnBuilder, node: fx.Node) -> None:
    """``PReLU`` (0 num_slope; slopes): one slope, or one per channel (dim 1, the blob's outermost axis).

    ``nn.PReLU`` / ``F.prelu`` hold slopes along dim 1; ONNX's ``PRelu`` (onnx2torch's module, no ``.weight``)
    takes its slope as an input broadcast numpy-style, e.g. ``(C, 1, 1)`` or ``(1,)``.
    """
    x, mod = node.args[0], b.module(node)
    torch_form = mod is None or hasattr(mod, "weight")
    slope = b.param(mod.weight if mod is not None and torch_form else _arg(node, 1, "weight"), node, "slope")
    shape = (1, *b.shape(x)[1:])
    if len(shape) < 2:
        raise b.fail(node, f"its input of shape {b.shape(x)} has no channel dim", "apply PReLU to (N, C, ...)")
    if torch_form and slope.numel() > 1:
        slope = slope.reshape(-1, *([1] * (len(shape) - 2)))  # F.prelu: weight along dim 1
    try:
        full = slope.expand(shape) if slope.dim() <= len(shape) else None
    except RuntimeError:
        full = None
    if full is None:
        raise b.fail(node, f"its slope of shape {tuple(slope.shape)} does not broadcast to the input {b.shape(x)}",
                     "give one slope or one per channel")
    per_channel = full.reshape(shape[1], -1)
    if bool((full == full.reshape(-1)[0]).all()):
        slopes = full.reshape(-1)[:1]
    elif bool((per_channel == per_channel[:, :1]).all()):
        slopes = per_channel[:, 0]
    else:
        raise b.fail(node, f"its slope of shape {tuple(slope.shape)} varies along dims other than the channels (dim 1)",
                     "ncnn's PReLU takes one slope or one per channel")
    b.emit(node, "PReLU", [b.blob(x, node)], {0: int(slopes.numel())}, [("raw", _np(slopes))])


@register_ncnn_converter("Clip", any_batch_dim=True)
def _clip(b: NcnnBuilder, node: fx.Node) -> None:
    """``Clip`` with fixed bounds; bounds the network computes (ONNX's ``Clip(x, ReduceMax(x) - 80)`` of a log-mel
    spectrogram) are ``BinaryOp`` max / min with their blobs (ncnn's Clip takes numbers only)."""
    lo, hi = clip_bounds(node, b.module(node))
    x = node.args[0]
    # a bound the network computes (not a stored tensor, not shape arithmetic) is a blob; others are numbers
    computed = [isinstance(v, fx.Node) and not b.is_constant(v) and b.strip(v) not in b.static_nodes for v in (lo, hi)]
    lo, hi = (v if c or not isinstance(v, fx.Node) or not b.is_constant(v)
              else float(b.param(v, node, "bound").reshape(-1)[0]) for v, c in zip((lo, hi), computed))
    if any(computed):
        steps = [(op, v, c) for op, v, c in ((_BINARY["Max"], lo, computed[0]), (_BINARY["Min"], hi, computed[1]))
                 if v is not None]
        # x and each computed bound in the result's layout (which a bound may change: SAM-like broadcasts)
        operands = {id(v): _broadcast_operands(b, node, x, v) for _, v, c in steps if c}
        layouts = {bd for _, bd in operands.values()}
        if len(layouts) > 1:
            raise b.fail(node, "its two computed bounds broadcast it to different layouts",
                         "clamp by one computed bound at a time (torch.maximum, then torch.minimum)")
        blob = next(iter(operands.values()))[0][0]
        for k, (op, v, c) in enumerate(steps):
            bottoms, params = ([blob, operands[id(v)][0][1]], {0: op}) if c else ([blob], {0: op, 1: 1, 2: float(v)})
            if k == len(steps) - 1:
                b.emit(node, "BinaryOp", bottoms, params, batch_dim=layouts.pop())
            else:
                blob = b.helper(node, "BinaryOp", bottoms, params)
        return
    params = {}
    if _const(b, node, lo, "min") is not None:
        params[0] = float(lo)
    if _const(b, node, hi, "max") is not None:
        params[1] = float(hi)
    b.emit(node, "Clip", [b.blob(x, node)], params)


def _softmax_dim(b: NcnnBuilder, node: fx.Node) -> int:
    """The one dim a (log-)softmax works along: the module's ``dim`` or the function's, or for ONNX's
    Softmax-1/11 (the input flattened at ``axis``) the one axis of size > 1 in that tail."""
    mod = b.module(node)
    rank = len(b.shape(node))
    if mod is not None and not hasattr(mod, "dim"):  # ONNX Softmax-1/11: softmax of the input flattened at axis
        dim = int(getattr(mod, "axis", -1)) % rank
        shape = b.shape(node.args[0])
        wide = {d for d in range(dim, rank) if shape[d] != 1}
        for (probed,) in b.probed_shapes(node.args[0]):  # a tail of ones at the export size only is no one axis
            wide |= {d for d in range(dim, rank) if probed[d] != 1}
        wide = sorted(wide)
        if len(wide) > 1:
            raise b.fail(node, "ONNX (log-)softmax before opset 13 over a flattened tail of several axes (at some "
                         "input size)", "use softmax on one axis")
        return wide[0] if wide else rank - 1  # SqueezeNet's [N, 1000, 1, 1] at axis 1: the tail is one axis
    dim = mod.dim if mod is not None else _arg(node, 1, "dim", None)
    if dim is None:
        raise b.fail(node, "softmax has no explicit dim", "pass dim=...")
    return int(dim)


@register_ncnn_converter("Softmax", any_batch_dim=True)
def _softmax(b: NcnnBuilder, node: fx.Node) -> None:
    if getattr(b.module(node), "is_log", False):  # onnx2torch's Softmax-1/11 module serves LogSoftmax too
        _log_softmax(b, node)
        return
    axis = b.ncnn_axis(node, _softmax_dim(b, node), node.args[0])
    b.emit(node, "Softmax", [b.blob(node.args[0], node)], {0: axis, 1: 1})


@register_ncnn_converter("LogSoftmax", any_batch_dim=True)
def _log_softmax(b: NcnnBuilder, node: fx.Node) -> None:
    """ncnn has no log-softmax: ``d - log(sum(exp(d)))`` with ``d = x - max(x)`` along the axis (Reduction max and
    LogSumExp keeping the axis, two BinaryOp subtractions), finite where ``log(softmax(x))`` would underflow."""
    x = node.args[0]
    axis = b.ncnn_axis(node, _softmax_dim(b, node), x)
    blob = b.blob(x, node)
    top = b.helper(node, "Reduction", [blob], {0: 4, 1: 0, 3: [axis], 4: 1, 5: 1})
    shifted = b.helper(node, "BinaryOp", [blob, top], {0: _BINARY["Sub"]})
    lse = b.helper(node, "Reduction", [shifted], {0: 10, 1: 0, 3: [axis], 4: 1, 5: 1})
    b.emit(node, "BinaryOp", [shifted, lse], {0: _BINARY["Sub"]})


@register_ncnn_converter("Softplus", any_batch_dim=True)
def _softplus(b: NcnnBuilder, node: fx.Node) -> None:
    """ncnn's ``Softplus`` is ``log(1 + exp(x))``: ONNX's, and torch's with ``beta`` 1 and a ``threshold`` (above
    which torch returns x) high enough that both agree within float rounding there."""
    mod = b.module(node)
    if mod is not None:
        beta, threshold = getattr(mod, "beta", 1.0), getattr(mod, "threshold", 20.0)
    else:
        beta, threshold = (_const(b, node, _arg(node, i, n, d), n) for i, (n, d) in
                           enumerate((("beta", 1.0), ("threshold", 20.0)), 1))
    if float(beta) != 1.0:
        raise b.fail(node, f"softplus with beta {beta}", "use beta=1, or scale the input and output around it")
    if float(threshold) < _SOFTPLUS_THRESHOLD:  # torch gives x above it, where log(1 + exp(x)) differs by exp(-x)
        raise b.fail(node, f"softplus with threshold {threshold} (torch returns x above it; ncnn does not switch)",
                     f"use a threshold of at least {_SOFTPLUS_THRESHOLD:g} (torch's default is 20)")
    b.emit(node, "Softplus", [b.blob(node.args[0], node)])


_SOFTPLUS_THRESHOLD = 15.0
"""Above this, ``log(1 + exp(x))`` and ``x`` agree within float32 rounding (``exp(-15)`` ~ 3e-7 of x ~ 15)."""


@register_ncnn_converter("LayerNormalization", any_batch_dim=True)
def _layernorm(b: NcnnBuilder, node: fx.Node) -> None:
    """``LayerNorm`` (0 affine_size, 1 eps, 2 affine; gamma, beta): ncnn normalizes the innermost w, w * h or
    w * h * d of a blob (affine_size tells which), so over fewer dims than the blob has unless it is 1-D."""
    mod = b.module(node)
    if mod is not None:
        x, norm_shape, weight, bias, eps = node.args[0], mod.normalized_shape, mod.weight, mod.bias, mod.eps
    else:  # F.layer_norm(input, normalized_shape, weight, bias, eps)
        x, norm_shape = _arg(node, 0, "input"), _const(b, node, _arg(node, 1, "normalized_shape"), "normalized_shape")
        weight, bias = _arg(node, 2, "weight", None), _arg(node, 3, "bias", None)
        eps = _const(b, node, _arg(node, 4, "eps", 1e-5), "eps")
    k = 1 if isinstance(norm_shape, int) else len(norm_shape)
    shape, bd, blob_rank = b.shape(x), b.batch_dim(x), len(b.blob_shape(x))
    if (bd is not None and bd >= len(shape) - k) or k > max(blob_rank - 1, 1):
        raise b.fail(node, f"it normalizes the last {k} dims of a tensor of shape {shape} (batch dim {bd}), a "
                     f"rank-{blob_rank} blob; ncnn's LayerNorm normalizes the innermost 1-3 axes of a blob, fewer "
                     "than its rank unless it is 1-D", "normalize over fewer trailing dims")
    size = math.prod(shape[len(shape) - k:])
    weights = []
    if weight is not None or bias is not None:
        gamma = b.param(weight, node, "weight") if weight is not None else torch.ones(size)
        beta = b.param(bias, node, "bias") if bias is not None else torch.zeros(size)
        weights = [("raw", _np(gamma)), ("raw", _np(beta))]
    b.emit(node, "LayerNorm", [b.blob(x, node)], {0: size, 1: float(eps), 2: int(bool(weights))}, weights)


@register_ncnn_converter("GroupNormalization")
def _groupnorm(b: NcnnBuilder, node: fx.Node) -> None:
    """``GroupNorm`` (0 groups, 1 channels, 2 eps, 3 affine; gamma, beta per channel) over the channels of an
    ``(N, C, ...)`` value: ``nn.GroupNorm``, ``F.group_norm``, ONNX ``GroupNormalization`` (a per-group scale
    repeated over its channels)."""
    mod = b.module(node)
    x = node.args[0]
    if isinstance(mod, nn.GroupNorm):
        groups, eps, weight, bias = mod.num_groups, mod.eps, mod.weight, mod.bias
    elif mod is not None and hasattr(mod, "num_groups") and hasattr(mod, "per_group"):  # OnnxGroupNormalization
        groups, eps, weight, bias = mod.num_groups, mod.eps, mod.scale, mod.bias
        if mod.per_group:
            channels = b.shape(x)[1]
            weight, bias = (t.repeat_interleave(channels // groups) for t in (weight, bias))
    elif mod is None:  # F.group_norm(input, num_groups, weight, bias, eps)
        groups = int(_const(b, node, _arg(node, 1, "num_groups"), "num_groups"))
        weight, bias = _arg(node, 2, "weight", None), _arg(node, 3, "bias", None)
        eps = _const(b, node, _arg(node, 4, "eps", 1e-5), "eps")
    else:
        raise b.fail(node, f"a group norm module of type {type(mod).__name__} is not one ncnn's writer reads",
                     "use nn.GroupNorm or F.group_norm")
    shape = b.shape(x)
    if len(shape) not in (2, 3, 4) or b.batch_dim(x) != 0:
        raise b.fail(node, f"it normalizes a value of shape {shape} (batch dim {b.batch_dim(x)}); ncnn's GroupNorm "
                     "takes the channels of an (N, C), (N, C, L) or (N, C, H, W) value", "group-normalize a value of "
                     "2 to 4 dims with the batch first")
    channels = shape[1]
    gamma = b.param(weight, node, "weight") if weight is not None else torch.ones(channels)
    beta = b.param(bias, node, "bias") if bias is not None else torch.zeros(channels)
    b.emit(node, "GroupNorm", [b.blob(x, node)], {0: int(groups), 1: channels, 2: float(eps), 3: 1},
           [("raw", _np(gamma)), ("raw", _np(beta))])


@register_ncnn_converter("LpNormalization", any_batch_dim=True)
def _l2_normalize(b: NcnnBuilder, node: fx.Node) -> None:
    """``F.normalize(x, p=2, dim=1, eps)`` (SSD's L2Norm) as ``Normalize`` (0 across_spatial, 4 across_channel,
    1 channel_shared, 2 eps, 9 eps_mode 1 = torch's ``x / max(||x||, eps)``, 3 scale_data_size; scale 1): over
    the channels at each position of (N, C, H, W), or over the whole (N, C) vector; along any other dim as a
    Reduction, a max and a division."""
    if b.module(node) is not None or node.target is not F.normalize:
        raise b.fail(node, "only F.normalize is exported as Normalize", "write the normalization as F.normalize")
    x = _arg(node, 0, "input")
    p_norm = float(_const(b, node, _arg(node, 1, "p", 2.0), "p"))
    dim, eps = (_const(b, node, _arg(node, i, k, d), k) for i, k, d in ((2, "dim", 1), (3, "eps", 1e-12)))
    rank = len(b.shape(x))
    if p_norm != 2.0:
        raise b.fail(node, f"it is an L{p_norm:g} normalization; ncnn has layers for the L2 norm only",
                     "normalize with p=2")
    if int(dim) % rank != 1 or rank not in (2, 4) or b.batch_dim(x) != 0:
        # along another dim (XCiT's / EdgeNeXt's cross-covariance attention: the tokens of (N, heads, C, T)):
        # x / max(||x||, eps) as a Reduction (8: L2) kept along that axis, a max with eps and a broadcast division;
        # Swin-V2's cosine attention normalizes (windows * N, heads, tokens, C), the batch folded into dim 0
        if int(dim) % rank == b.batch_dim(x):
            raise b.fail(node, f"it normalizes along dim {dim}, the batch dimension of shape {b.shape(x)}",
                         "normalize along another dim; ncnn blobs have no batch dimension")
        axis = b.ncnn_axis(node, int(dim), x)
        norm = b.helper(node, "Reduction", [b.blob(x, node)], {0: 8, 1: 0, 3: [axis], 4: 1, 5: 1})
        norm = b.helper(node, "BinaryOp", [norm], {0: 4, 1: 1, 2: float(eps)})
        b.emit(node, "BinaryOp", [b.blob(x, node), norm], {0: 3})
        return
    across_spatial, across_channel = (1, 0) if rank == 2 else (0, 1)
    params = {0: across_spatial, 4: across_channel, 1: 1, 2: float(eps), 9: 1, 3: 1}
    b.emit(node, "Normalize", [b.blob(x, node)], params, [("raw", np.ones(1, dtype=np.float32))])


@register_ncnn_converter("MatMul", any_batch_dim=True)
def _matmul(b: NcnnBuilder, node: fx.Node) -> None:
    """``MatMul`` of two blobs laid out alike: ncnn multiplies the two innermost axes, batched over the rest, where
    a size-1 dim broadcasts (multi-query attention: one key head for every query head).

    A product by a constant ``(K, N)`` matrix (ONNX's ``MatMul`` of a Linear layer) is an ``InnerProduct`` (int8
    when ``ncnn_int8`` quantized it), which takes in the bias of a following ``Add`` of a constant ``(N,)``."""
    lhs, rhs = _arg(node, 0, "input"), _arg(node, 1, "mat2" if "mat2" in node.kwargs else "other")
    if is_matmul_by_matrix(node):
        add, bias = _bias_add(b, node)
        _inner_product(b, node, lhs, b.weight(rhs, node, out_axis=-1), bias)
        if add is not None:
            b.alias(add, node, b.batch_dim(node))
        return
    blobs, bd = _matmul_operands(b, node, lhs, rhs)
    b.emit(node, "MatMul", blobs, {0: 0}, batch_dim=bd)


def _bias_add(b: NcnnBuilder, node: fx.Node) -> tuple[fx.Node | None, torch.Tensor | None]:
    """The only user of ``node`` when it adds a constant vector along the last dim (ONNX's ``MatMul`` + ``Add`` of a
    Linear layer), with that vector; (None, None) otherwise."""
    if len(node.users) != 1:
        return None, None
    (add,) = node.users
    others = [a for a in add.args if a is not node]
    if b.op(add) != "Add" or len(add.args) != 2 or len(others) != 1 or not b.is_constant(others[0]) \
            or b.shape(add) != b.shape(node):
        return None, None
    bias = b.param(others[0], add, "bias")
    n = b.shape(node)[-1]
    if bias.numel() != n or bias.shape[-1:] != (n,):
        return None, None
    return add, bias.reshape(n)


def _matmul_operands(b: NcnnBuilder, node: fx.Node, lhs: Any, rhs: Any) -> tuple[list[str], int | None]:
    """The blobs ``MatMul`` multiplies and the dim the product's blob leaves out: the operands' own where they leave
    out one batch dim outside the matrices; else, where each leaves out a dim of size 1 only (CSATv2's ``(1, 49) @
    (49, 1)``, whose blobs left out a row and a column), both reshaped to their whole shapes (a blob keeps torch's
    element order) and the product keeps every dim."""
    _check_matmul_operands(b, node, lhs, rhs, same_batch=False)
    (sa, ba), (sb, bb) = ((b.shape(t), b.batch_dim(t)) for t in (lhs, rhs))
    if ba == bb and (ba is None or ba < len(sa) - 2):
        _check_matmul_operands(b, node, lhs, rhs)
        return [b.blob(lhs, node), b.blob(rhs, node)], ba
    if any(bd is not None and shape[bd] != 1 for shape, bd in ((sa, ba), (sb, bb))) or len(sa) > 4:
        _check_matmul_operands(b, node, lhs, rhs)  # refused, naming the layouts
    blobs = [b.blob(t, node) if bd is None else b.helper(node, "Reshape", [b.blob(t, node)], shape_params(shape))
             for t, shape, bd in ((lhs, sa, ba), (rhs, sb, bb))]
    return blobs, None


def _check_matmul_operands(b: NcnnBuilder, node: fx.Node, lhs: Any, rhs: Any, same_batch: bool = True) -> None:
    """Refuse operands that are not two batched matrices of one rank (and, with ``same_batch``, of one layout)."""
    if not isinstance(lhs, fx.Node) or not isinstance(rhs, fx.Node):
        raise b.fail(node, "an operand is not a tensor", "multiply two tensors computed in the graph")
    (sa, ba), (sb, bb) = ((b.shape(t), b.batch_dim(t)) for t in (lhs, rhs))
    outer = all(m == n or (1 in (m, n) and (d != ba or not same_batch)) for d, (m, n) in enumerate(zip(sa[:-2], sb[:-2])))
    if len(sa) != len(sb) or len(sa) < 2 or not outer or (same_batch and (
            ba != bb or (ba is not None and ba >= len(sa) - 2))):
        raise b.fail(node, f"operands of shapes {sa} and {sb} (batch dims {ba}, {bb}) are not two batched matrices "
                     "of one layout; ncnn's MatMul multiplies blobs of one rank, broadcasting outer dims of size 1",
                     "broadcast or reshape the operands to shapes (..., M, K) @ (..., K, N) of one rank, their outer "
                     "dims equal or 1, with the batch outside the last two dims")


@register_ncnn_converter("Einsum", any_batch_dim=True)
def _einsum(b: NcnnBuilder, node: fx.Node) -> None:
    """A batched matrix product written as ``einsum`` (MaxViT's ``"B G H I D, B G H J D -> B G H I J"``):
    ``MatMul``, after a ``Permute`` of an operand's last two dims where the equation has them the other way
    (``I D, J D`` is ``x @ y.mT``). Other equations are refused."""
    mod = b.module(node)
    if mod is not None:  # onnx2torch's OnnxEinsum(equation)(*operands)
        equation, operands = getattr(mod, "equation", None), list(node.args)
    else:
        equation, operands = node.args[0], list(node.args[1:])
        if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
            operands = list(operands[0])
    terms, out = _einsum_terms(equation)
    if len(terms) != 2 or len(operands) != 2 or len(out) < 2:
        raise b.fail(node, f"einsum {equation!r} is not a product of two operands", _EINSUM_FIX)
    (lhs_t, rhs_t), (lhs, rhs) = terms, operands
    for t, x, other in ((lhs_t, lhs, rhs), (rhs_t, rhs, lhs)):
        bd = b.batch_dim(x) if isinstance(x, fx.Node) and not b.is_constant(x) else None
        if bd is not None and bd >= len(t) - 2:  # the batch is a matrix dim: no MatMul of blobs (they leave it out)
            if len(t) > 2:
                fix = ("permute the operand so its batch dim leads (e.g. .permute(1, 0, 2) of an (n, batch, c) value) "
                       "and write the einsum with that subscript first")
            elif b.is_constant(other) and len(b.shape(other)) == 2:
                fix = ("write it as a matmul (x @ w, or x @ w.T where the equation has w's subscripts the other way): "
                       "fxq makes a product by a stored matrix a linear layer, which ncnn runs")
            else:  # a (batch, c) operand: its batch is a matrix dim whichever way it is permuted
                fix = ("write it as a matmul with the batch outside the two matrix dims, both operands of one rank: "
                       "for a stored (h, c, k) table w, (x[:, None, None] @ w[None]).squeeze(2), of shape (batch, h, k)")

            raise b.fail(node, f"the batch dim of operand {x.name!r} (subscript {t[bd]!r} of {equation!r}) is one of "
                         "the two matrix dims of the product; ncnn's blobs leave the batch dim out, so no ncnn MatMul "
                         "computes it", fix)
    batch, (i, j) = out[:-2], out[-2:]
    shared = set(lhs_t[-2:]) & set(rhs_t[-2:])
    k = next(iter(shared)) if len(shared) == 1 else None
    # an operand may carry only the last batch subscripts (SAM's / MViT's relative positions: "bhwc,hkc->bhwk"),
    # a stored tensor that broadcasts over the others, as in torch.matmul
    broadcast = [t[:-2] != batch for t in (lhs_t, rhs_t)]
    if k is None or {i, k} != set(lhs_t[-2:]) or {k, j} != set(rhs_t[-2:]) or k in out or all(broadcast) or any(
            t[:-2] != batch[len(batch) - len(t) + 2:] or (wide and not b.is_constant(x))
            for t, x, wide in zip((lhs_t, rhs_t), operands, broadcast)):
        if _einsum_by_a_table(b, node, lhs_t, rhs_t, out, lhs, rhs):
            return
        raise b.fail(node, f"einsum {equation!r} is not a batched matrix product (..., i, k) x (..., k, j) (an "
                     "operand with fewer batch subscripts must be a stored tensor)", _EINSUM_FIX)
    if any(broadcast):
        like = rhs if broadcast[0] else lhs
        blobs = [b.constant(x, node, like) if wide else b.blob(x, node) for x, wide in zip(operands, broadcast)]
    else:
        _check_matmul_operands(b, node, lhs, rhs)
        blobs = [b.blob(lhs, node), b.blob(rhs, node)]
    rank = len(b.blob_shape(rhs if broadcast[0] else lhs))
    for n, (t, want) in enumerate(((lhs_t, (i, k)), (rhs_t, (k, j)))):
        if tuple(t[-2:]) != want:
            order = tuple(range(rank - 2)) + (rank - 1, rank - 2)
            blobs[n] = b.helper(node, "Permute", [blobs[n]], {0: permute_order_type(order)})
    b.emit(node, "MatMul", blobs, {0: 0}, batch_dim=b.batch_dim(rhs if broadcast[0] else lhs))


def _einsum_by_a_table(b: NcnnBuilder, node: fx.Node, lhs_t: str, rhs_t: str, out: str, lhs: Any, rhs: Any) -> bool:
    """A product by a stored table indexed by one of the output's other dims (SAM's / MViT-v2's relative positions
    along the width: ``"bhwc,wkc->bhwk"``, each column ``w`` times its own matrix): the computed operand permuted so
    that the table's dims lead its rows (``b w h c``), a ``MatMul`` by the table (permuted as stored, laid out with
    leading dims of 1), and the product permuted back. False where the equation is not of this form."""
    if not isinstance(lhs, fx.Node) or not b.is_constant(rhs) or b.is_constant(lhs) or len(set(out)) != len(out):
        return False
    k = [s for s in lhs_t if s in rhs_t and s not in out]
    j = out[-1]
    rows = [s for s in out[:-1] if s in lhs_t and s not in rhs_t]
    if len(k) != 1 or not rows or j in lhs_t or j not in rhs_t:
        return False
    k, i = k[0], rows[-1]
    batch = [s for s in out if s not in (i, j)]
    table_batch = [s for s in rhs_t if s not in (k, j)]
    if set(lhs_t) != set(batch) | {i, k} or len(lhs_t) != len(batch) + 2 or set(rhs_t) != set(table_batch) | {k, j} \
            or table_batch != batch[len(batch) - len(table_batch):]:
        return False
    bd = b.batch_dim(lhs)
    order = [lhs_t.index(s) for s in [*batch, i, k]]  # the computed operand as (batch..., i, k)
    back = [[*batch, i, j].index(s) for s in out]  # the product (batch..., i, j) as the output
    if bd is not None and (order[bd] != bd or back[bd] != bd):
        return False
    blob = b.blob(lhs, node)
    blob_order = [d - (bd is not None and d > bd) for d in order if d != bd]
    if blob_order != sorted(blob_order):
        blob = b.helper(node, "Permute", [blob], {0: permute_order_type(tuple(blob_order))})
    table = b.param(rhs, node, "einsum table").permute([rhs_t.index(s) for s in [*table_batch, k, j]])
    bottoms = [blob, b.memory_data(table.contiguous(), node, lhs, node)]  # the converter's own value: keyed by node
    blob_back = tuple(d - (bd is not None and d > bd) for d in back if d != bd)
    if blob_back == tuple(sorted(blob_back)):
        b.emit(node, "MatMul", bottoms, {0: 0}, batch_dim=bd)
    else:
        product = b.helper(node, "MatMul", bottoms, {0: 0})
        b.emit(node, "Permute", [product], {0: permute_order_type(blob_back)}, batch_dim=bd)
    return True


_EINSUM_FIX = "write it as torch.matmul (with .transpose(-1, -2) where needed)"


def _einsum_terms(equation: Any) -> tuple[list[str], str]:
    """The operands' subscripts and the output's of an explicit einsum equation (spaces ignored; no ``...``)."""
    text = str(equation).replace(" ", "")
    if "->" not in text or "." in text:
        return [], ""
    inputs, out = text.split("->")
    return inputs.split(","), out


# --------------------------------------------------------------------------- pooling
def _pool_args(b: NcnnBuilder, node: fx.Node) -> dict[str, Any]:
    mod = b.module(node)
    names = ("kernel_size", "stride", "padding", "dilation", "ceil_mode", "count_include_pad", "divisor_override")
    if mod is not None:
        got = {k: getattr(mod, k) for k in names if hasattr(mod, k)}
    else:
        is_max = node.target in (F.max_pool1d, F.max_pool2d)
        order = ("kernel_size", "stride", "padding", "dilation", "ceil_mode") if is_max else (
            "kernel_size", "stride", "padding", "ceil_mode", "count_include_pad", "divisor_override")
        got = {k: _arg(node, i + 1, k, None) for i, k in enumerate(order)}
    got = {k: v for k, v in got.items() if v is not None}
    got.setdefault("stride", got.get("kernel_size"))
    if not got.get("stride"):
        got["stride"] = got["kernel_size"]
    return got


@register_ncnn_converter("MaxPool", "AveragePool")
def _pool(b: NcnnBuilder, node: fx.Node) -> None:
    x = node.args[0]
    mod = b.module(node)
    is_max = b.op(node) == "MaxPool"
    if isinstance(mod, (nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d)) or node.target in (
            F.adaptive_avg_pool2d, F.adaptive_max_pool2d):
        _adaptive(b, node, 0 if is_max else 1)
        return
    if isinstance(mod, (nn.MaxPool3d, nn.AvgPool3d)) or node.target in (F.max_pool3d, F.avg_pool3d):
        _pool3d(b, node, is_max)
        return
    if isinstance(getattr(mod, "op", None), (nn.AvgPool2d, nn.MaxPool2d)) and (
            hasattr(mod, "pads") or hasattr(mod, "upper")):
        _pool_padded(b, node, mod, is_max)
        return
    if isinstance(mod, (nn.MaxPool1d, nn.AvgPool1d)) or node.target in (F.max_pool1d, F.avg_pool1d):
        _pool1d(b, node, is_max)
        return
    if len(b.shape(x)) != 4 or (mod is not None and not isinstance(mod, (nn.MaxPool2d, nn.AvgPool2d))) or (
            mod is None and node.target not in (F.max_pool2d, F.avg_pool2d)):
        raise b.fail(node, "only 2-D max / average pooling is exported", "use nn.MaxPool2d / nn.AvgPool2d")
    a = _pool_args(b, node)
    if a.get("return_indices") or getattr(mod, "return_indices", False):
        raise b.fail(node, "pooling returns indices", "ncnn pooling has no index output")
    if pair(a.get("dilation", 1)) != (1, 1):
        raise b.fail(node, "pooling is dilated", "ncnn pooling has no dilation")
    if a.get("divisor_override"):
        raise b.fail(node, "average pooling has divisor_override", "drop divisor_override")
    kh, kw = pair(a["kernel_size"])
    sh, sw = pair(a["stride"])
    ph, pw = pair(a.get("padding", 0))
    _, _, h, w = b.shape(x)
    _, _, oh, ow = b.shape(node)
    extra_h = (oh - 1) * sh + kh - (h + 2 * ph)  # > 0 only with ceil_mode: pad the tail
    extra_w = (ow - 1) * sw + kw - (w + 2 * pw)
    bottom, count_pads, whole_windows = b.blob(x, node), not is_max and bool(a.get("count_include_pad", True)), (
        kh >= ph + sh and kw >= pw + sw)  # torch's drop of a ceil window starting in the right padding cannot fire
    if a.get("ceil_mode") and count_pads and (ph or pw):
        # torch's average counts the explicit pads but never the ceil tail; ncnn's count_include_pad counts both or
        # neither: the pads become zeros of the blob (Padding: 0 top, 1 bottom, 2 left, 3 right, 4 constant,
        # 5 value), then the tail is left out of the count
        bottom = b.helper(node, "Padding", [bottom], {0: ph, 1: ph, 2: pw, 3: pw, 4: 0, 5: 0.0})
        ph = pw = 0
    if a.get("ceil_mode"):  # the ceil tail is never in an average's count (torch clips the window to the padding)
        count_pads = False
    params = {0: 0 if is_max else 1, 1: kw, 11: kh, 2: sw, 12: sh, 3: pw, 13: ph, 14: pw, 15: ph, 5: 1}
    if a.get("ceil_mode"):
        if whole_windows:
            # ncnn's full padding (pad_mode 0) pads the tail to a whole stride: ceil((n + 2p - k) / s) + 1 windows,
            # torch's ceil_mode at every input size
            params[5] = 0
        else:
            params.update({14: pw + max(extra_w, 0), 15: ph + max(extra_h, 0)})
            b.warn_once(f"ceil:{node.name}", "ncnn export: pooling %s (kernel %s, stride %s, padding %s) in ceil "
                        "mode is written with the tail padding of the export-time input size %s; torch's ceil_mode "
                        "drops a last window starting in the padding, which ncnn's full padding does not, so other "
                        "input sizes may get another number of output rows / columns", node.name, (kh, kw), (sh, sw),
                        (ph, pw), (h, w))
    if not is_max:
        params[6] = int(count_pads)
    b.emit(node, "Pooling", [bottom], params)


def _pool_padded(b: NcnnBuilder, node: fx.Node, mod: nn.Module, is_max: bool) -> None:
    """An ONNX pool whose pads differ at a dim's start and end (the loader's ``OnnxAsymmetricPad`` around an unpadded
    ``nn.MaxPool2d`` / ``nn.AvgPool2d``): ncnn's ``Pooling`` takes each side's pad (3 left, 14 right, 13 top,
    15 bottom), pads max pooling with the lowest float and leaves pads out of an average's count with 6
    avgpool_count_include_pad = 0. An ``auto_pad`` SAME pool (``OnnxSamePad``: keras2onnx's MTCNN) is 5 pad_mode
    2 / 3, which pads from the input size at run time, so the file takes other image sizes."""
    pool, x = mod.op, node.args[0]
    if len(b.shape(x)) != 4 or pool.ceil_mode or pair(pool.padding) != (0, 0) or pair(
            getattr(pool, "dilation", 1)) != (1, 1) or getattr(pool, "divisor_override", None):
        raise b.fail(node, "an asymmetrically padded pool in ceil mode, dilated or with a divisor override",
                     "pool without ceil_mode")
    (kh, kw), (sh, sw) = pair(pool.kernel_size), pair(pool.stride or pool.kernel_size)
    same = hasattr(mod, "upper")  # OnnxSamePad; else OnnxAsymmetricPad
    if same and (is_max or not mod.exclude_pad):  # ncnn's pad_mode 2 / 3 pads from the input size at run time
        params = {0: 0 if is_max else 1, 1: kw, 11: kh, 2: sw, 12: sh, 5: 2 if mod.upper else 3}
    else:  # explicit pads: the module's own (F.pad order, trailing zero pairs left out), SAME's at this size
        pads = mod.pads_for(torch.empty(b.shape(x), device="meta"))
        left, right, top, bottom = (list(pads) + [0] * 4)[:4]
        params = {0: 0 if is_max else 1, 1: kw, 11: kh, 2: sw, 12: sh, 3: left, 14: right, 13: top, 15: bottom, 5: 1}
        if same:  # ncnn leaves only explicit pads out of an average's count
            b.warn_once(f"same:{node.name}", "ncnn export: average pool %s with auto_pad SAME leaves its pads out of "
                        "the count, which ncnn does only for explicit pads: written with the pads of the export-time "
                        "input size %s; other sizes may pad differently", node.name, b.shape(x)[2:])
    if not is_max:
        params[6] = int(not mod.exclude_pad)
    b.emit(node, "Pooling", [b.blob(x, node)], params)


def _pool1d(b: NcnnBuilder, node: fx.Node, is_max: bool) -> None:
    """``Pooling1D`` (0 type, 1 kernel, 2 stride, 3 / 14 left / right pad, 5 pad_mode 1: explicit pads,
    6 count_include_pad) over an ``(N, C, L)`` tensor's ``(C, L)`` blob; no ceil mode or dilation."""
    a = _pool_args(b, node)
    x = node.args[0]
    one = lambda v: int(v[0] if isinstance(v, (tuple, list)) else v)  # noqa: E731
    if len(b.shape(x)) != 3 or b.batch_dim(x) != 0 or a.get("ceil_mode") or one(a.get("dilation", 1)) != 1 or \
            a.get("divisor_override") or a.get("return_indices") or getattr(b.module(node), "return_indices", False):
        raise b.fail(node, "1-D pooling of a tensor that is not (N, C, L), in ceil mode, dilated or with indices",
                     "pool (N, C, L) tensors without ceil_mode, dilation or indices")
    pad = one(a.get("padding", 0))
    params = {0: 0 if is_max else 1, 1: one(a["kernel_size"]), 2: one(a["stride"]), 3: pad, 14: pad, 5: 1}
    if not is_max:
        params[6] = int(bool(a.get("count_include_pad", True)))
    b.emit(node, "Pooling1D", [b.blob(x, node)], params)


def _pool3d(b: NcnnBuilder, node: fx.Node, is_max: bool) -> None:
    """``Pooling3D`` (valid padding, explicit pads; no ceil mode, dilation or divisor override)."""
    mod = b.module(node)
    if mod is not None:
        a = {k: getattr(mod, k, None) for k in ("kernel_size", "stride", "padding", "dilation", "ceil_mode",
                                               "count_include_pad", "divisor_override", "return_indices")}
    else:
        order = ("kernel_size", "stride", "padding", "dilation", "ceil_mode", "return_indices") if is_max else (
            "kernel_size", "stride", "padding", "ceil_mode", "count_include_pad", "divisor_override")
        a = {k: _arg(node, i + 1, k, None) for i, k in enumerate(order)}
    if a.get("ceil_mode") or a.get("return_indices") or a.get("divisor_override") or _triple(
            a.get("dilation") or 1) != (1, 1, 1):
        raise b.fail(node, "3-D pooling with ceil_mode, indices, dilation or divisor_override",
                     "use plain nn.MaxPool3d / nn.AvgPool3d")
    kd, kh, kw = _triple(a["kernel_size"])
    sd, sh, sw = _triple(a.get("stride") or a["kernel_size"])
    pd, ph, pw = _triple(a.get("padding") or 0)
    params = {0: 0 if is_max else 1, 1: kw, 11: kh, 21: kd, 2: sw, 12: sh, 22: sd, 3: pw, 14: pw, 13: ph, 15: ph,
              23: pd, 16: pd, 5: 1}
    if not is_max:
        cip = a.get("count_include_pad")
        params[6] = int(True if cip is None else bool(cip))
    b.emit(node, "Pooling3D", [b.blob(node.args[0], node)], params)


def _adaptive(b: NcnnBuilder, node: fx.Node, pool_type: int) -> None:
    """Adaptive pooling: ``Pooling`` for (N, C, H, W), ``Pooling3D`` for (N, C, D, H, W) (7 adaptive, 8/18/28 out
    w/h/d), so the output keeps its pooled dims as torch's does; (N, C, L) pooled to one value per channel (a
    pooler over a sequence) is a ``Reduction`` along L, keeping the dim."""
    x = node.args[0]
    if len(b.shape(x)) == 5:
        _, _, od, oh, ow = b.shape(node)
        b.emit(node, "Pooling3D", [b.blob(x, node)], {0: pool_type, 7: 1, 8: ow, 18: oh, 28: od})
        return
    if len(b.shape(x)) == 3 and b.shape(node)[-1] == 1:  # (N, C, L) to one value per channel: nn.AdaptiveAvgPool1d(1)
        b.emit(node, "Reduction", [b.blob(x, node)], {0: 3 if pool_type == 1 else 4, 1: 0,
                                                        3: [b.ncnn_axis(node, 2, x)], 4: 1, 5: 1})
        return
    if len(b.shape(x)) != 4:
        raise b.fail(node, "only 2-D and 3-D adaptive pooling, and 1-D pooling to one value, is exported",
                     "use a (N, C, H, W) or (N, C, D, H, W) input")
    _, _, oh, ow = b.shape(node)
    b.emit(node, "Pooling", [b.blob(x, node)], {0: pool_type, 7: 1, 8: ow, 18: oh})


@register_ncnn_converter("GlobalAveragePool", "GlobalMaxPool")
def _global_pool(b: NcnnBuilder, node: fx.Node) -> None:
    _adaptive(b, node, 1 if b.op(node) == "GlobalAveragePool" else 0)


@register_ncnn_converter("Cast", any_batch_dim=True, high_rank=True)
def _cast(b: NcnnBuilder, node: fx.Node) -> None:
    """ncnn holds every computed value as float32, bools as 0 / 1: a float32 value cast to float32
    (``softmax(..., dtype=torch.float32).to(q.dtype)``), a bool cast to bool, to integers or to float32 (a padding
    mask taken in as bools, then made additive) are the value itself. Casts of integers are refused: integer inputs
    are the int32 ids ``Embed`` reads, which float arithmetic cannot use; other casts (to half) change the values."""
    x = node.args[0]
    src, out = (b.strip(x).meta.get("val"), node.meta.get("val")) if isinstance(x, fx.Node) else (None, None)
    kinds = (_value_kind(src), _value_kind(out))
    if kinds not in _SAME_VALUE_CASTS:
        fix = ("take the mask in as bool values (attention_mask.bool()), which ncnn reads as 0 / 1 floats"
               if kinds == ("int", "bool") else
               "cast integers only in shape arithmetic, and keep network values float32")
        raise b.fail(node, f"it casts a {getattr(src, 'dtype', '?')} value to {getattr(out, 'dtype', '?')}; ncnn "
                     "computes in float32", fix)
    b.alias(node, x, b.batch_dim(x))


_SAME_VALUE_CASTS = {("float", "float"), ("bool", "bool"), ("bool", "int"), ("bool", "float")}
"""Casts whose values ncnn's float32 blobs hold alike on both sides."""


def _value_kind(value: Any) -> str | None:
    """``"float"`` (float32), ``"int"`` or ``"bool"`` for a tensor of that kind; None for other floats, complex
    values and non-tensors."""
    if not isinstance(value, torch.Tensor) or value.is_complex():
        return None
    if value.dtype == torch.bool:
        return "bool"
    if value.is_floating_point():
        return "float" if value.dtype == torch.float32 else None
    return "int"


_REDUCTION = {"ReduceSum": 0, "ReduceSumSquare": 2, "ReduceMean": 3, "ReduceMax": 4, "ReduceMin": 5, "ReduceProd": 6,
              "ReduceL1": 7, "ReduceL2": 8, "ReduceLogSum": 9, "ReduceLogSumExp": 10}
"""ONNX op type -> operation of ncnn's ``Reduction`` (1 asum is L1 too)."""


@register_ncnn_converter(*_REDUCTION, any_batch_dim=True, high_rank=True)
def _reduce(b: NcnnBuilder, node: fx.Node) -> None:
    """``Reduce*`` as ncnn's ``Reduction``; the spatial mean of (N, C, H, W) as global average ``Pooling``."""
    x = node.args[0]
    op = b.op(node)
    args = reduce_args(node, b.modules, op)
    if args is None and is_noop_reduce(b.module(node)):  # Reduce*-18 of empty axes, noop_with_empty_axes
        b.alias(node, x, b.batch_dim(x))
        return
    if args is None:
        raise b.fail(node, f"reduce module {type(b.module(node)).__name__} is not a {op} with static axes",
                     f"use {op} with constant axes")
    _reduce_into(b, node, x, op, args[0], args[1])


def _reduce_into(b: NcnnBuilder, node: fx.Node, x: fx.Node, op: str, dims: Any, keep: bool) -> None:
    """``node``'s blob: ``x`` reduced by ``op`` over ``dims`` (None: all), keeping them or not."""
    shape, bd = b.shape(x), b.batch_dim(x)
    dims = _reduced_dims(b, x, _const(b, node, dims, "dim"))
    if op == "ReduceMean" and len(shape) == 4 and bd == 0 and dims == [2, 3]:
        params = {0: 1, 7: 1, 8: 1, 18: 1} if keep else {0: 1, 4: 1}
        b.emit(node, "Pooling", [b.blob(x, node)], params)
        return
    if b.high_rank(x) and not {d for d in range(len(shape)) if d != bd} <= set(dims):  # not a reduce_all
        _reduce_high_rank(b, node, x, dims, keep, _REDUCTION[op])
        return
    params, out_bd = _reduction(b, node, x, dims, keep, _REDUCTION[op])
    b.emit(node, "Reduction", [b.blob(x, node)], params, batch_dim=out_bd)


def _reduce_high_rank(b: NcnnBuilder, node: fx.Node, x: fx.Node, dims: list[int], keep: bool, operation: int
                      ) -> None:
    """A reduction of a value of more than 4 dims besides the batch (Hiera's mask-unit attention pools its queries
    with ``q.view(B, heads, stride, -1, units, d).max(dim=2)``), over dims next to each other: the blob viewed as
    (dims before, the reduced dims, dims after), reduced along its middle axis, and reshaped to the result."""
    shape, bd = b.shape(x), b.batch_dim(x)
    kept = [d for d in range(len(shape)) if d != bd]
    at = [kept.index(d) for d in dims if d in kept]
    if bd in dims or not at or at != list(range(at[0], at[0] + len(at))):
        raise b.fail(node, f"it reduces dims {tuple(dims)} of shape {shape} (batch dim {bd}), a value of more than 4 "
                     "dims besides the batch, over dims that are not next to each other or over the batch",
                     "reduce next-to-each-other dims other than the batch, or reshape to at most 4 dims first")
    view = _around(drop_dim(shape, bd), at[0], at[-1] + 1)
    blob = b.helper(node, "Reshape", [b.blob(x, node)], shape_params(view))
    blob = b.helper(node, "Reduction", [blob], {0: operation, 1: 0, 3: [1], 4: 1, 5: 1})
    out_bd = bd if keep or bd is None else bd - sum(d < bd for d in dims)
    b.emit(node, "Reshape", [blob], shape_params(fold_dims(drop_dim(b.shape(node), out_bd))), batch_dim=out_bd)


def _reduced_dims(b: NcnnBuilder, x: fx.Node, dims: Any) -> list[int]:
    """The dims of ``x`` a reduction's ``dim`` argument names, sorted and non-negative (None or empty: all)."""
    rank = len(b.shape(x))
    return sorted({int(d) % rank for d in ((dims,) if isinstance(dims, int) else tuple(dims or range(rank)))})


def _reduction(b: NcnnBuilder, node: fx.Node, x: fx.Node, dims: list[int], keep: bool, operation: int
               ) -> tuple[dict[int, Any], int | None]:
    """The params of ncnn's ``Reduction`` of ``dims`` of ``x`` (0 operation, 1 reduce_all, 3 axes, 4 keepdims,
    5 fixbug0 = 1: axes count without the batch) and the result's batch dim. A reduction over every non-batch dim
    (``x.mean()``, ``x.sum((1, 2, 3))``; the batch of 1 too) is ``reduce_all``: one value. ncnn blobs have no
    batch, so a reduction over a batch larger than 1 is refused."""
    shape, bd = b.shape(x), b.batch_dim(x)
    what = f"the reduction ({b.op(node)})"
    rest = [d for d in range(len(shape)) if d != bd]
    if set(rest) <= set(dims):  # every value of the sample: ncnn's reduce_all (with the batch only at batch 1)
        if bd is not None and bd in dims and shape[bd] != 1:
            raise b.fail(node, f"{what} over dims {tuple(dims)} of shape {shape} reduces over the batch "
                         f"(dim {bd}, size {shape[bd]})", _BATCH_FIX)
        out_bd = bd if keep or (bd is not None and bd not in dims) else None
        return {0: operation, 1: 1, 4: int(keep), 5: 1}, out_bd
    if bd is not None and bd in dims:
        raise b.fail(node, f"{what} over dims {tuple(dims)} of shape {shape} reduces over the batch (dim {bd})",
                     "reduce the other dims; ncnn blobs have no batch dimension")
    out_bd = bd if keep or bd is None else bd - sum(d < bd for d in dims)
    return {0: operation, 1: 0, 3: [b.ncnn_axis(node, d, x) for d in dims], 4: int(keep), 5: 1}, out_bd


@register_ncnn_converter("Var", "Std", any_batch_dim=True)
def _variance(b: NcnnBuilder, node: fx.Node) -> None:
    """``torch.var`` / ``torch.std`` (timm's ``SimpleNorm``: ``x * rsqrt(x.var(-1) + eps)``) as ncnn layers: the
    mean of the squared deviations from the mean (two ``Reduction`` layers around a ``BinaryOp`` and a square),
    scaled by ``n / (n - correction)``, and a square root for ``std``."""
    x, dims, correction, keep = variance_args(node)
    dims = _reduced_dims(b, x, dims)
    count = math.prod(b.shape(x)[d] for d in dims)
    if count <= correction:
        raise b.fail(node, f"the {b.op(node).lower()} of {count} values with correction {correction} divides by "
                     f"{count - correction}", "reduce over more values, or lower the correction")
    blob = b.blob(x, node)
    mean_params, _ = _reduction(b, node, x, dims, True, _REDUCTION["ReduceMean"])
    centred = b.helper(node, "BinaryOp", [blob, b.helper(node, "Reduction", [blob], mean_params)],
                       {0: _BINARY["Sub"]})
    params, out_bd = _reduction(b, node, x, dims, keep, _REDUCTION["ReduceMean"])
    steps: list[tuple[str, dict[int, Any]]] = [("UnaryOp", {0: 4}), ("Reduction", params)]  # 4: square
    if correction:
        steps.append(("BinaryOp", {0: _BINARY["Mul"], 1: 1, 2: count / (count - correction)}))  # with a scalar
    if b.op(node) == "Std":
        steps.append(("UnaryOp", {0: 5}))  # 5: sqrt
    for layer, layer_params in steps[:-1]:
        centred = b.helper(node, layer, [centred], layer_params)
    b.emit(node, steps[-1][0], [centred], steps[-1][1], batch_dim=out_bd)


# --------------------------------------------------------------------------- tensor ops
_BINARY = {"Add": 0, "Sub": 1, "Mul": 2, "Div": 3, "Max": 4, "Min": 5, "Pow": 6, "Sum": 0, "And": 2, "Or": 4}
"""ncnn BinaryOp's op of each op type. Pow: ONNX's (LayerNorm spelled out before opset 17); Max / Min: of two
operands (ONNX's, ``torch.maximum`` / ``minimum``: box clipping); Sum: ONNX's (onnx-caffe2's residual adds); And /
Or: of bools held as 0 / 1 (:func:`_logical`)."""
_ELTWISE = {"Sum": 1, "Max": 2}
"""ncnn Eltwise's op_type of the ONNX ops that take any number of operands (PROD is Mul's, which ONNX has not)."""
_REVERSED = {0: 0, 1: 7, 2: 2, 3: 8, 4: 4, 5: 5, 6: 9}  # scalar (op) tensor -> ncnn op with the tensor first
_ONE_MINUS = {0: _REVERSED[_BINARY["Sub"]], 1: 1, 2: 1.0}
"""``BinaryOp`` params of ``1 - x``: a bool held as 0 / 1 negated (``~mask``, a select's other mask)."""


@register_ncnn_converter("Add", "Sub", "Mul", "Div", "Max", "Min", "Pow", "Sum", any_batch_dim=True, high_rank=True)
def _binary(b: NcnnBuilder, node: fx.Node) -> None:
    """``BinaryOp``: with a scalar (1 with_scalar, 2 b; ``3 - x`` / ``6 / x`` as RSUB / RDIV), which a stored
    one-element tensor (ONNX initializers) and shape arithmetic (``head_dim ** -0.5``) count as; else of two
    blobs brought to one rank (a stored tensor becomes a ``MemoryData``), where ncnn broadcasts size-1 axes.
    ONNX's variadic Sum / Max of one operand is that operand, of more than two equal-shaped computed tensors an
    ``Eltwise`` (0 op_type)."""
    op = _BINARY[b.op(node)]
    other = "exponent" if "exponent" in node.kwargs else "other"  # torch.pow(x, exponent=2)
    operands = len(node.args) + sum(k in ("input", other) for k in node.kwargs)
    if operands == 1 and b.op(node) in ("Sum", "Max", "Min") and isinstance(node.args[0], fx.Node):
        b.alias(node, node.args[0], b.batch_dim(node.args[0]))
        return
    if operands > 2 and b.op(node) in _ELTWISE and all(
            isinstance(a, fx.Node) and b.shape(a) == b.shape(node) for a in node.args):
        b.emit(node, "Eltwise", [b.blob(a, node) for a in node.args], {0: _ELTWISE[b.op(node)]})
        return
    if operands != 2:  # ONNX's Max / Min take any number
        raise b.fail(node, f"it takes {operands} operands", "take two operands at a time")
    lhs, rhs = (_scalar_operand(b, node, _static(_arg(node, i, k))) for i, k in ((0, "input"), (1, other)))
    if node.kwargs.get("alpha", 1) != 1 or node.kwargs.get("rounding_mode") is not None:
        raise b.fail(node, "alpha / rounding_mode are not 1 / None", "write the arithmetic explicitly")
    if isinstance(lhs, fx.Node) and isinstance(rhs, fx.Node):
        if op == _BINARY["Pow"]:
            b.warn_once(f"pow:{node.name}", "ncnn export: node %s raises a computed base to a computed exponent with "
                        "ncnn's pow, which gives about 2.4e38 for a negative base where torch gives NaN (or, for an "
                        "integer exponent, the power)", node.name)
        blobs, bd = _broadcast_operands(b, node, lhs, rhs)
        b.emit(node, "BinaryOp", blobs, {0: op}, batch_dim=bd)
    elif isinstance(lhs, fx.Node) and isinstance(rhs, (int, float)) and op == _BINARY["Pow"]:
        _power(b, node, lhs, float(rhs))
    elif isinstance(lhs, fx.Node) and isinstance(rhs, (int, float)):
        b.emit(node, "BinaryOp", [_operand(b, node, lhs)], {0: op, 1: 1, 2: float(rhs)})
    elif isinstance(rhs, fx.Node) and isinstance(lhs, (int, float)):
        b.emit(node, "BinaryOp", [_operand(b, node, rhs)], {0: _REVERSED[op], 1: 1, 2: float(lhs)})
    else:
        raise b.fail(node, f"operands {type(lhs).__name__} and {type(rhs).__name__} are not tensors / numbers",
                     "use tensor-tensor or tensor-scalar arithmetic")


_FLT_MAX = float(torch.finfo(torch.float32).max)
"""ncnn's stand-in for an attention mask's -inf (:func:`_attention_mask`, :func:`_finite_blob`): a row that keeps one
score computes the same softmax; a row masked entirely is uniform where torch gives NaN."""

_MASK_ARGS = ("scores", "attn_mask", "key_padding_mask", "bool_keeps", "causal", "heads_folded")


@register_ncnn_converter("AttentionMask", any_batch_dim=True)
def _attention_mask(b: NcnnBuilder, node: fx.Node) -> None:
    """fxq's own mask step of a decomposed attention (:func:`~fxq.graph.attention.apply_attention_mask`): masks
    fixed at export time (a causal mask, Hugging Face's all-True mask of an unpadded ViT) are summed into one
    ``MemoryData`` added to the scores, or nothing where they mask no position; one float mask the network
    computes is a ``BinaryOp`` add, one bool mask (ncnn holds it as 0 / 1: a padding mask taken in as bools)
    becomes -FLT_MAX where it masks first."""
    scores, masks, flags, total = _attention_mask_parts(b, node)
    if total is not None:
        if not total.any():
            b.alias(node, scores, b.batch_dim(scores))
            return
        if b.batch_dim(scores) is not None and total.shape[b.batch_dim(scores)] > 1:  # the same for every sample
            total = total.narrow(b.batch_dim(scores), 0, 1)
        mask = b.memory_data(total.float().clamp(min=-_FLT_MAX), node, scores, node)
        b.emit(node, "BinaryOp", [b.blob(scores, node), mask], {0: _BINARY["Add"]}, batch_dim=b.batch_dim(scores))
        return
    computed = [m for m in masks.values() if b.fixed_value(m) is None]
    val = b.strip(computed[0]).meta.get("val") if len(computed) == 1 else None
    if len(masks) == 1 and "attn_mask" in masks and not flags["causal"] and not flags["heads_folded"] and \
            isinstance(val, torch.Tensor) and (val.is_floating_point() or val.dtype == torch.bool):
        (blob, mask), bd = _broadcast_operands(b, node, scores, masks["attn_mask"])
        if val.dtype == torch.bool:  # 0 / 1: -FLT_MAX where it masks
            if flags["bool_keeps"]:
                mask = b.helper(node, "BinaryOp", [mask], {0: _BINARY["Sub"], 1: 1, 2: 1.0})
            mask = b.helper(node, "BinaryOp", [mask], {0: _BINARY["Mul"], 1: 1,
                                                       2: (1.0 if flags["bool_keeps"] else -1.0) * _FLT_MAX})
        b.emit(node, "BinaryOp", [blob, mask], {0: _BINARY["Add"]}, batch_dim=bd)
        return
    raise b.fail(node, "its attention mask is computed in the network and is not one mask to add "
                 f"({', '.join(masks)}{', causal' if flags['causal'] else ''})",
                 "give the attention one mask (bool, or additive float: 0 to keep, a large negative number to "
                 "mask)")


@register_ncnn_converter("IsNaN", any_batch_dim=True)
def _is_nan(b: NcnnBuilder, node: fx.Node) -> None:
    """ncnn has no NaN test. torch.onnx writes attention's probabilities as ``where(isnan(p), 0, p)`` (for rows
    masked entirely); a softmax of scores the network computes, plus masks fixed at export time that leave a finite
    score in every row, has no NaN (the network's own values are finite, as every ncnn layer takes them): its test
    is all False, a fixed value of the file (:meth:`NcnnBuilder.prove`) that the ``where`` then reads. Other NaN
    tests are refused."""
    x = b.strip(_arg(node, 0, "input"))
    why = _nan_possible(b, x)
    if why:
        raise b.fail(node, f"ncnn has no NaN test, and {why}",
                     "take the NaN test out of the exported network (a softmax over rows that keep a finite score "
                     "needs none), or export for 'ort_int8' / 'trt_int8'")
    b.prove(node, torch.zeros(b.shape(node), dtype=torch.bool))


def _nan_possible(b: NcnnBuilder, x: fx.Node) -> str | None:
    """Why ``x`` may hold a NaN, or None for a softmax of computed scores, masked at export time only, that keeps a
    finite score in every row along its dim. Walked up from the softmax: masks added (``Add`` of a fixed tensor,
    fxq's ``AttentionMask`` with fixed masks) and selects of a fixed value by a fixed condition (``masked_fill``
    with ``-inf``), down to the scores the network computes."""
    if b.op(x) != "Softmax" or getattr(b.module(x), "is_log", False):
        return f"its input {x.name!r} (op {b.op(x)}) is not a softmax that fxq can show to be free of NaN"
    shape = b.shape(x)
    finite = torch.ones(shape, dtype=torch.bool)  # positions that can hold a finite score
    pending = torch.ones(shape, dtype=torch.bool)  # positions still read from further up
    scores = b.strip(_arg(x, 0, "input"))
    while True:
        op, added = b.op(scores), None
        if op == "AttentionMask":
            inner, _, _, added = _attention_mask_parts(b, scores)
            if added is None:
                return f"its scores {scores.name!r} are masked by a mask the network computes"
            scores = b.strip(inner)
        elif op == "Add" and (parts := _mask_added(b, scores)) is not None:
            added, scores = parts
        elif op in ("Where", "MaskedFill"):
            picked = _fixed_select(b, scores)
            if picked is None:
                break
            chosen, value, scores = picked
            chosen = chosen.expand(shape) & pending
            value = value.float().expand(shape)
            if (chosen & (torch.isnan(value) | (value == math.inf))).any():
                return f"the select {scores.name!r} before softmax {x.name!r} puts NaN or +inf in its scores"
            finite = torch.where(chosen, finite & torch.isfinite(value), finite)
            pending = pending & ~chosen
            continue
        else:
            break
        added = added.float().expand(shape)
        if (pending & (torch.isnan(added) | (added == math.inf))).any():
            return f"a mask added to the scores of softmax {x.name!r} holds NaN or +inf"
        finite = finite & (~pending | torch.isfinite(added))
    if pending.any() and b.fixed_value(scores) is not None:
        return f"its scores {scores.name!r} are fixed at export time"
    if not finite.any(dim=_softmax_dim(b, x)).all():
        return (f"the masks fixed at export time on the scores of softmax {x.name!r} leave a row without a finite "
                "value")
    return None


def _mask_added(b: NcnnBuilder, node: fx.Node) -> tuple[torch.Tensor, fx.Node] | None:
    """(the fixed tensor, the other operand) of an ``Add`` of one tensor fixed at export time and one computed."""
    if len(node.args) != 2:
        return None
    fixed = [b.fixed_value(a) for a in node.args]
    kinds = [isinstance(v, torch.Tensor) for v in fixed]
    if kinds.count(True) != 1:
        return None
    k = kinds.index(True)
    return fixed[k], b.strip(node.args[1 - k])


def _select_args(node: fx.Node, op: str) -> tuple[Any, tuple[tuple[Any, bool], ...]]:
    """(condition, ((choice, taken where the condition is True), ...)) of a ``Where`` / ``MaskedFill`` node."""
    if op == "MaskedFill":
        x, cond, value = (_arg(node, i, k) for i, k in ((0, "input"), (1, "mask"), (2, "value")))
        return cond, ((value, True), (x, False))
    cond, on, off = (_arg(node, i, k) for i, k in ((0, "condition"), (1, "input"), (2, "other")))
    return cond, ((on, True), (off, False))


def _fixed_select(b: NcnnBuilder, node: fx.Node) -> tuple[torch.Tensor, torch.Tensor, fx.Node] | None:
    """(where the fixed choice is taken, its value, the computed choice) of a select by a condition fixed at export
    time between a fixed value and a computed one; None for any other select."""
    cond, choices = _select_args(node, b.op(node))
    c = b.fixed_value(cond)
    if not isinstance(c, torch.Tensor):
        return None
    fixed = [(side, picked, b.fixed_value(side) if isinstance(side, fx.Node) else side) for side, picked in choices]
    computed = [side for side, _, value in fixed if isinstance(side, fx.Node) and value is None]
    chosen = [(picked, value) for side, picked, value in fixed if value is not None]
    if len(computed) != 1 or len(chosen) != 1:
        return None
    picked, value = chosen[0]
    return (c.bool() if picked else ~c.bool()), torch.as_tensor(value), b.strip(computed[0])


@register_ncnn_converter("Where", "MaskedFill", any_batch_dim=True)
def _select(b: NcnnBuilder, node: fx.Node) -> None:
    """``torch.where`` / ``masked_fill`` with a condition fixed at export time (a causal mask, a NaN test that
    :func:`_is_nan` showed to be all False) as arithmetic: each computed choice times a ``MemoryData`` of 1 where it
    is chosen and 0 elsewhere, plus one ``MemoryData`` holding the fixed choices where they are chosen and 0 elsewhere
    (added, so a -inf fill stays -inf). Exact for finite values (a -inf in a computed choice reads -FLT_MAX where it
    is kept: :func:`_finite_blob`); a choice taken everywhere is its blob. A condition the network computes is a
    bool held as 0 / 1 (:func:`_computed_select`)."""
    cond, choices = _select_args(node, b.op(node))
    val = node.meta.get("val")
    if not (isinstance(val, torch.Tensor) and val.is_floating_point()):
        raise b.fail(node, "it selects non-float values; ncnn blobs hold float values",
                     "select float values, or compute integer values outside the exported network")
    c = b.fixed_value(cond)
    if not isinstance(c, torch.Tensor):
        _computed_select(b, node, cond, choices)
        return
    c = c.bool()
    fill, parts = torch.zeros(()), []
    for side, picked in choices:
        m = c if picked else ~c
        if not m.any():
            continue
        fixed = b.fixed_value(side)
        if isinstance(side, fx.Node) and fixed is None:
            _operand(b, node, side)  # refused unless it has the result's shape
            parts.append((side, None if m.all() else m, f"select_{int(picked)}"))
        else:
            fill = fill + torch.where(m, torch.as_tensor(fixed, dtype=torch.float32), torch.zeros(()))
    if not parts:  # every choice fixed: so is the result
        b.prove(node, fill.expand(b.shape(node)).clone())
        return
    like, bd = parts[0][0], b.batch_dim(parts[0][0])
    if len(parts) == 1 and parts[0][1] is None:  # one computed choice taken everywhere
        b.alias(node, like, bd)
        return
    terms: list[Any] = [b.blob(side, node) if m is None else (
        [_finite_blob(b, node, side), b.memory_data(m.float(), node, side, node, tag)], {0: _BINARY["Mul"]})
        for side, m, tag in parts]
    if fill.any():
        terms.append(b.memory_data(fill, node, like, node, "select_fill"))
    _emit_sum(b, node, terms, bd)


def _emit_sum(b: NcnnBuilder, node: fx.Node, terms: list[Any], batch_dim: int | None) -> None:
    """``node``'s blob: the sum of ``terms``, each a blob or a ``BinaryOp`` still to write (``(bottoms, params)``);
    the last layer written is the node's (a single term must be such a layer)."""
    if len(terms) == 1:
        b.emit(node, "BinaryOp", *terms[0], batch_dim=batch_dim)
        return
    blobs = [t if isinstance(t, str) else b.helper(node, "BinaryOp", *t) for t in terms]
    acc = blobs[0]
    for blob in blobs[1:-1]:
        acc = b.helper(node, "BinaryOp", [acc, blob], {0: _BINARY["Add"]})
    b.emit(node, "BinaryOp", [acc, blobs[-1]], {0: _BINARY["Add"]}, batch_dim=batch_dim)


def _finite_blob(b: NcnnBuilder, node: fx.Node, side: fx.Node) -> str:
    """``side``'s blob with -inf raised to -FLT_MAX, to be multiplied by a 0 / 1 mask: in ncnn ``-inf * 0`` is NaN (a
    choice masked with -inf earlier, then masked again). Where the choice is kept, a -inf reads -FLT_MAX: the same
    softmax for every row that keeps a finite score."""
    return b.helper(node, "BinaryOp", [b.blob(side, node)], {0: _BINARY["Max"], 1: 1, 2: -_FLT_MAX})


def _computed_select(b: NcnnBuilder, node: fx.Node, cond: Any, choices: tuple[tuple[Any, bool], ...]) -> None:
    """A select by a bool the network computes, which ncnn holds as 0 / 1 (DeBERTa's
    ``scores.masked_fill(~mask, finfo.min)`` by a padding mask taken in as bools): each choice times its 0 / 1 mask
    (``c`` or ``1 - c``), summed; a number chosen is its mask times the number. Exact for finite values; an
    infinite or NaN number (``masked_fill(m, -inf)``) would give ``inf * 0`` and is refused."""
    if not isinstance(cond, fx.Node) or _value_kind(b.strip(cond).meta.get("val")) != "bool":
        raise b.fail(node, "its condition is not a bool tensor", "select by a bool condition")
    numbers, computed = {}, []
    for side, picked in choices:
        fixed = b.fixed_value(side) if isinstance(side, fx.Node) else side
        if isinstance(fixed, torch.Tensor) and fixed.numel() == 1:
            fixed = float(fixed.reshape(-1)[0])
        if isinstance(fixed, (int, float)):
            if not math.isfinite(fixed):
                raise b.fail(node, f"it selects {fixed} by a condition the network computes; ncnn multiplies a 0 / 1 "
                             "mask by it, and 0 * inf is NaN", "select a finite number (torch.finfo(dtype).min "
                             "for a masked score)")
            numbers[picked] = float(fixed)
        elif isinstance(side, fx.Node) and fixed is None:
            _operand(b, node, side)  # refused unless it has the result's shape
            computed.append((side, picked))
        else:
            raise b.fail(node, "it selects a stored tensor by a condition the network computes",
                         "select computed tensors or numbers")
    if not computed:
        raise b.fail(node, "it selects between numbers by a condition the network computes",
                     "multiply the condition by the numbers instead")
    (_, mask), bd = _broadcast_operands(b, node, computed[0][0], cond)
    masks = {True: mask}

    def mask_of(picked: bool) -> str:
        if picked not in masks:  # 1 - c
            masks[picked] = b.helper(node, "BinaryOp", [mask], _ONE_MINUS)
        return masks[picked]

    terms: list[Any] = [([_finite_blob(b, node, side), mask_of(picked)], {0: _BINARY["Mul"]})
                        for side, picked in computed]
    terms += [([mask_of(picked)], {0: _BINARY["Mul"], 1: 1, 2: value}) for picked, value in numbers.items() if value]
    _emit_sum(b, node, terms, bd)


def _attention_mask_parts(b: NcnnBuilder, node: fx.Node
                          ) -> tuple[fx.Node, dict[str, fx.Node], dict[str, bool], torch.Tensor | None]:
    """(scores, masks, flags, total) of an ``AttentionMask`` node: ``total`` is what the masks add to the scores
    (-inf where they mask), when every mask is fixed at export time, else None."""
    a = {**dict(zip(_MASK_ARGS, node.args)), **node.kwargs}
    masks = {k: a[k] for k in ("attn_mask", "key_padding_mask") if a.get(k) is not None}
    flags = {k: bool(a.get(k, False)) for k in ("bool_keeps", "causal", "heads_folded")}
    fixed = {k: b.fixed_value(m) for k, m in masks.items()}
    total = None
    if all(isinstance(v, torch.Tensor) for v in fixed.values()):
        total = apply_attention_mask(torch.zeros(b.shape(a["scores"])), **fixed, **flags)
    return a["scores"], masks, flags, total


@register_ncnn_converter("And", "Or", "Not", any_batch_dim=True, high_rank=True)
def _logical(b: NcnnBuilder, node: fx.Node) -> None:
    """Logic of bool values, which ncnn holds as 0 / 1 (:func:`_cast`): and is a product, or a maximum, not
    ``1 - x``. The bitwise logic of integers has no ncnn form and is refused."""
    values = [a.meta.get("val") for a in node.all_input_nodes] + [node.meta.get("val")]
    if any(_value_kind(v) != "bool" for v in values):
        raise b.fail(node, "it computes bitwise logic of integers; ncnn holds values as float32",
                     "compute the logic on bool values, or outside the exported network")
    if b.op(node) == "Not":
        x = node.args[0]
        b.emit(node, "BinaryOp", [_operand(b, node, x)], _ONE_MINUS)
        return
    _binary(b, node)


def _power(b: NcnnBuilder, node: fx.Node, x: fx.Node, exponent: float) -> None:
    """``x ** exponent``: ncnn's ``BinaryOp`` pow gives garbage for a negative base (even for ``x ** 2``, the
    variance of a spelled-out LayerNorm), so the exponents that have a ``UnaryOp`` use it (2 square, 3 as
    ``x * x ** 2``, 0.5 sqrt, -1 reciprocal) and only the others are ``BinaryOp`` pow, right for positive x."""
    blob = _operand(b, node, x)
    if exponent == 1:
        b.alias(node, x, b.batch_dim(x))
    elif exponent == 2:
        b.emit(node, "UnaryOp", [blob], {0: 4})
    elif exponent == 3:
        b.emit(node, "BinaryOp", [blob, b.helper(node, "UnaryOp", [blob], {0: 4})], {0: _BINARY["Mul"]})
    elif exponent in _POWER_UNARY:
        b.emit(node, "UnaryOp", [blob], {0: _POWER_UNARY[exponent]})
    else:
        b.warn_once(f"pow:{node.name}", "ncnn export: node %s raises to the power %g with ncnn's pow, which is "
                    "right only for positive bases", node.name, exponent)
        b.emit(node, "BinaryOp", [blob], {0: _BINARY["Pow"], 1: 1, 2: exponent})


_POWER_UNARY = {0.5: 5, -1.0: 15}  # sqrt, reciprocal


def _scalar_operand(b: NcnnBuilder, node: fx.Node, value: Any) -> Any:
    """A one-element stored tensor whose broadcast leaves the other operand's shape as its number, else ``value``."""
    src = b.strip(value) if isinstance(value, fx.Node) else value
    if isinstance(src, fx.Node) and b.is_constant(src):
        t = b.param(src, node, "constant operand")
    elif isinstance(src, torch.Tensor):
        t = src.detach().float().cpu()
    else:
        return value
    if t.numel() != 1 or t.dim() > len(b.shape(node)):
        return value
    other = next((a for a in node.all_input_nodes if b.strip(a) is not src), None)
    if other is None or b.shape(other) != b.shape(node):
        return value
    return float(t.reshape(-1)[0])


def _operand(b: NcnnBuilder, node: fx.Node, arg: fx.Node) -> str:
    """The blob of a computed operand whose shape is the result's."""
    if b.shape(arg) != b.shape(node):
        raise b.fail(node, f"its operand of shape {b.shape(arg)} broadcasts to {b.shape(node)} with a scalar",
                     "expand the tensor operand first")
    return b.blob(arg, node)


def _full_operand(b: NcnnBuilder, node: fx.Node, lhs: fx.Node, rhs: fx.Node) -> fx.Node:
    """The operand whose layout the result keeps: a computed one of the result's rank (lhs first)."""
    rank = len(b.shape(node))
    for t in (lhs, rhs):
        if not b.is_constant(t) and len(b.shape(t)) == rank:
            return t
    raise b.fail(node, f"operands of shapes {b.shape(lhs)} and {b.shape(rhs)} broadcast to {b.shape(node)}, and "
                 "no tensor computed in the graph has the result's rank", "reshape an operand to the result's rank")


def _result_batch_dim(b: NcnnBuilder, node: fx.Node, lhs: Any, rhs: Any) -> int | None:
    """The dim a binary op's result blob leaves out: the full operand's (:func:`_full_operand`), unless that is a
    dim of size 1 which the other operand, computed in the graph too, makes larger (SAM's ``rel_h[..., None] +
    rel_w[..., None, :]``, whose blobs leave out their last and second-to-last dims): then the result's first dim of
    size 1, or none. A stored tensor larger along the batch stays refused (:meth:`NcnnBuilder.memory_data`)."""
    full = _full_operand(b, node, lhs, rhs)
    other = rhs if full is lhs else lhs
    bd, out_shape = b.batch_dim(full), b.shape(node)
    if bd is None or b.shape(full)[bd] != 1 or out_shape[bd] == 1 or not isinstance(other, fx.Node) or \
            b.fixed_value(other) is not None:
        return bd
    return next((d for d, n in enumerate(out_shape) if n == 1), None)


def _broadcast_operands(b: NcnnBuilder, node: fx.Node, lhs: fx.Node, rhs: fx.Node) -> tuple[list[str], int | None]:
    """Both operands as blobs of the result's rank, and the dim the result's blob leaves out (one answer for both,
    :func:`_result_batch_dim`): ncnn's BinaryOp broadcasts size-1 axes of equal-rank blobs either way (its implicit
    rules for blobs of lower rank differ from torch's, so none are left to it)."""
    full = _full_operand(b, node, lhs, rhs)
    out_shape, bd = b.shape(node), _result_batch_dim(b, node, lhs, rhs)
    blobs = []
    for t in (lhs, rhs):
        if t is full and b.batch_dim(t) == bd:
            blobs.append(b.blob(t, node))
            continue
        if b.is_constant(t):
            blobs.append(b.constant(t, node, like=full))
            continue
        shape, t_bd = b.shape(t), b.batch_dim(t)
        aligned = (1,) * (len(out_shape) - len(shape)) + shape
        # a blob that leaves out a dim of size 1 keeps torch's element order: any layout is a Reshape of it
        same_layout = t_bd == bd or (t_bd is not None and shape[t_bd] == 1) if len(shape) == len(out_shape) else \
            t_bd is None or shape[t_bd] == 1
        full_target = drop_dim(out_shape, bd)
        if len(full_target) > 4 and drop_dim(aligned, bd)[:-3] == full_target[:-3] and same_layout:
            # more than 4 dims (SAM's ``attn.view(B, h, w, h, w) + rel_h[..., None]``): both stored with the outer
            # dims merged, which the operands share, so ncnn broadcasts the last three as it would. A blob leaving
            # out a dim of size 1 keeps torch's element order, so its layout is the tensor's
            target = fold_dims(drop_dim(aligned, bd))
            blob = b.blob(t, node)
            if math.prod(target) != math.prod(b.stored_shape(t)):
                raise b.fail(node, f"its operand of shape {shape} broadcast to {out_shape} is not its blob reshaped",
                             "reshape the operands to one batch-first layout")
            blobs.append(blob if target == b.stored_shape(t) else
                         b.helper(node, "Reshape", [blob], shape_params(target)))
            continue
        if not same_layout:
            raise b.fail(node, f"its operands have shapes {b.shape(lhs)} and {b.shape(rhs)} with their batch "
                         f"dimensions at dims {b.batch_dim(lhs)} and {b.batch_dim(rhs)}",
                         "transpose / reshape the operands to one batch-first layout first")
        target = drop_dim(aligned, bd)
        blob = b.blob(t, node)
        if target != b.blob_shape(t):
            if math.prod(target) != math.prod(b.blob_shape(t)) or not 1 <= len(target) <= 4:
                raise b.fail(node, f"its operand of shape {shape} broadcast to {out_shape} is not a blob of rank "
                             "1 to 4 without the batch dimension", "reshape the operands to one batch-first layout")
            blob = b.helper(node, "Reshape", [blob], shape_params(target))
        blobs.append(blob)
    return blobs, bd


@register_ncnn_converter("Concat", any_batch_dim=True)
def _concat(b: NcnnBuilder, node: fx.Node) -> None:
    """``Concat`` (0 axis) of the non-empty values, of one layout; one value is itself (torchvision's detectors batch
    their one image so, along the batch). Values whose batch of 1 lies along the concat dim, or at different dims, are
    concatenated as blobs of their whole shape (box corners ``unsqueeze(2)``-ed and joined along dim 2)."""
    if node.target is torch.stack:
        _stack(b, node)
        return
    mod = b.module(node)
    if mod is not None:  # onnx2torch's OnnxConcat(axis)(*tensors)
        tensors, dim = list(node.args), int(mod.axis)
    else:
        tensors, dim = list(_arg(node, 0, "tensors")), int(_arg(node, 1, "dim", 0))
    tensors = [t for t in tensors if not b.is_empty(t)]  # ``torch.roll`` by 0 as slices: ``cat([x[:, 0:], x[:, :0]])``
    if not tensors:
        b.mark_empty(node)
        return
    if len(tensors) == 1:
        b.alias(node, tensors[0], b.batch_dim(tensors[0]))
        return
    layouts = {b.batch_dim(t) for t in tensors}
    rank = len(b.shape(node))
    if len(layouts) == 1 and dim % rank not in layouts:
        b.emit(node, "Concat", [b.blob(t, node) for t in tensors], {0: b.ncnn_axis(node, dim, tensors[0])})
        return
    batched = [t for t in tensors if b.batch_dim(t) is not None and b.shape(t)[b.batch_dim(t)] != 1]
    if batched or rank > 4:
        raise b.fail(node, f"it concatenates along dim {dim} values whose batch dimensions are at dims "
                     f"{[b.batch_dim(t) for t in tensors]} (shapes {[b.shape(t) for t in tensors]})",
                     "concatenate batch-first values along another dim")
    blobs = [b.blob(t, node) if b.batch_dim(t) is None
             else b.helper(node, "Reshape", [b.blob(t, node)], shape_params(b.shape(t))) for t in tensors]
    b.emit(node, "Concat", blobs, {0: dim % rank}, batch_dim=None)


def _stack(b: NcnnBuilder, node: fx.Node) -> None:
    """``torch.stack`` as the ``Concat`` of its values, each reshaped to its blob with a 1 at the new dim; a batch
    at or after the new dim moves one dim on, as in torch."""
    tensors, dim = list(_arg(node, 0, "tensors")), int(_arg(node, 1, "dim", 0))
    out_shape = b.shape(node)
    d = dim % len(out_shape)
    layouts = {b.batch_dim(t) for t in tensors}
    if len(layouts) != 1:
        raise b.fail(node, f"it stacks values whose batch dimensions are at dims {[b.batch_dim(t) for t in tensors]}",
                     "stack values of one layout")
    bd = layouts.pop()
    out_bd = None if bd is None else bd if bd < d else bd + 1
    piece = drop_dim(out_shape[:d] + (1,) + out_shape[d + 1:], out_bd)
    if len(piece) > 4:
        raise b.fail(node, f"its result of shape {out_shape} is a rank-{len(piece)} blob",
                     "stack values of at most three dims besides the batch")
    blobs = [b.helper(node, "Reshape", [b.blob(t, node)], shape_params(piece)) for t in tensors]
    b.emit(node, "Concat", blobs, {0: d if out_bd is None or d < out_bd else d - 1}, batch_dim=out_bd)


@register_ncnn_converter("Flatten", "Reshape", "Squeeze", "Unsqueeze", any_batch_dim=True, high_rank=True)
def _reshape(b: NcnnBuilder, node: fx.Node) -> None:
    """``Reshape`` (``Flatten`` to 1-D; nothing when the blob keeps its shape). A batch > 1 stays dim 0; a batch
    of 1 may merge into other dims (attention's ``(T, B * H, Dh)``): a blob keeps torch's element order, so any
    size-1 dim of the result can be the one its blob leaves out (the first is), or none. A result of more than 4
    dims besides the batch is the rank-4 blob of :meth:`NcnnBuilder.stored_shape` (for a permute to read)."""
    x = node.args[0]
    in_shape, out_shape, bd = b.shape(x), b.shape(node), b.batch_dim(x)
    if bd is not None and in_shape and in_shape[bd] != 1:
        out_bd = 0
        if bd != 0 or out_shape[:1] != in_shape[:1]:
            raise b.fail(node, f"reshape {in_shape} -> {out_shape} changes the batch dimension (size {in_shape[bd]})",
                         _BATCH_FIX)
    else:
        moved = _squeeze_batch_dim(b, node, in_shape, len(out_shape), bd)
        out_bd = moved if moved is not _MISSING else next((d for d, n in enumerate(out_shape) if n == 1), None)
    blob_shape = drop_dim(out_shape, out_bd)
    if not blob_shape:
        raise b.fail(node, f"reshape {in_shape} -> {out_shape} gives a rank-0 blob",
                     "ncnn blobs have rank 1 to 4 without the batch dimension")
    if blob_shape == b.blob_shape(x) or fold_dims(blob_shape) == b.stored_shape(x):
        b.alias(node, x, out_bd)
    elif len(blob_shape) == 1:
        b.emit(node, "Flatten", [b.blob(x, node)], batch_dim=out_bd)
    else:
        b.emit(node, "Reshape", [b.blob(x, node)], _reshape_params(b, node, x, out_bd), batch_dim=out_bd)


def _squeeze_batch_dim(b: NcnnBuilder, node: fx.Node, in_shape: tuple[int, ...], out_rank: int, bd: int | None
                       ) -> Any:
    """Where a squeeze / unsqueeze puts the input's batch dim ``bd`` (of size 1): its axes say which dims go or
    come, so the batch is followed exactly (an LSTM's ``Y[T, 1, B, H].squeeze(1)``, where the first size-1 dim of
    the result is not the batch); None where the squeeze drops it; ``_MISSING`` for other reshapes, a value without
    a batch, or axes not known here."""
    mod = b.module(node)
    kind = None
    if mod is not None:
        name = type(mod).__name__
        kind = "squeeze" if name.startswith("OnnxSqueeze") else "unsqueeze" if name.startswith("OnnxUnsqueeze") else None
        axes = getattr(mod, "axes", getattr(mod, "_axes", None)) if kind else None
        if axes is None and kind and len(node.args) > 1:
            axes = b.fixed_value(node.args[1])
    elif node.target in (torch.squeeze, torch.unsqueeze, "squeeze", "unsqueeze"):
        kind = getattr(node.target, "__name__", node.target)
        axes = _arg(node, 1, "dim", None)
    if kind is None or bd is None:
        return _MISSING
    if axes is None:  # squeeze of every size-1 dim: the batch of 1 too
        return None if kind == "squeeze" else _MISSING
    try:
        axes = [int(a) for a in (torch.as_tensor(_static(axes)).reshape(-1).tolist())]
    except (TypeError, ValueError, RuntimeError):
        return _MISSING
    if kind == "squeeze":  # torch's squeeze(d) leaves a dim of another size alone
        gone = {a % len(in_shape) for a in axes if in_shape[a % len(in_shape)] == 1}
        return None if bd in gone else bd - sum(a < bd for a in gone)
    added = {a % out_rank for a in axes}
    kept = [d for d in range(out_rank) if d not in added]
    return kept[bd] if bd < len(kept) else _MISSING


_NAMES = {1: "w", 2: "hw", 3: "chw", 4: "cdhw"}  # ncnn's names of a blob's dims, outermost first


def _reshape_params(b: NcnnBuilder, node: fx.Node, x: fx.Node, out_bd: int | None) -> dict[int, int]:
    """ncnn ``Reshape`` params of ``node`` (its blob leaves out torch dim ``out_bd``), written to follow the
    input's size where they can.

    Which dims follow it is measured: the blobs' shapes at the builder's probe sizes
    (:meth:`NcnnBuilder.probed_shapes`, the varying input dims doubled). A dim that follows is 0 (keep) where it
    equals the input blob's same-named ncnn dim (w, h, d, c) at every size, else the one -1 (inferred); a second
    one that follows can be neither and is baked in, with a warning. Without a probe (no varying input dims, or
    the model does not run at another size) the file runs at the export-time size only: the numbers are written.
    The input's outermost dim is never kept: with packing on, ncnn's x86 Reshape reads it in packs (a rank-4
    input's ``c`` of 24 kept as 3)."""
    in_bd = b.batch_dim(x)
    in_blob = b.stored_shape(x) or (1,)  # a value of the batch alone (a reduction over all else) is a 1-element blob
    out_blob = fold_dims(drop_dim(b.shape(node), out_bd))
    names, packed = _NAMES[len(out_blob)], _NAMES[len(in_blob)][0]  # packed: the input's outermost dim
    codes = list(out_blob)
    base_in, base_out = b.shape(x), b.shape(node)
    sizes = [(in_blob, out_blob)] + [
        (fold_dims(drop_dim(pi, in_bd)), fold_dims(drop_dim(po, out_bd))) for pi, po in b.probed_shapes(x, node)
        if (in_bd is None or pi[in_bd] == base_in[in_bd]) and (out_bd is None or po[out_bd] == base_out[out_bd])]
    sizes = [(i, o) for i, o in sizes if len(i) == len(in_blob) and len(o) == len(out_blob)]
    if len(sizes) == 1:  # no probe: nothing says the size varies, or the model runs at its export size only
        return shape_params(out_blob)
    follows = [any(o[i] != out_blob[i] for _, o in sizes) for i in range(len(out_blob))]
    for i, name in enumerate(names):
        if follows[i] and name != packed and all(dict(zip(_NAMES[len(inp)], inp)).get(name) == o[i]
                                                 for inp, o in sizes):
            codes[i] = 0
    left = [i for i in range(len(codes)) if follows[i] and codes[i] > 0]
    if left:
        codes[left.pop(0)] = -1
    if left:
        b.warn_once(f"baked:{node.name}", "ncnn export: reshape %s -> %s of node %s has dims %s that follow the "
                    "input's size but ncnn's Reshape can neither keep (0) nor infer (-1) them; the file runs only at "
                    "the export-time input size", base_in, base_out, node.name, [out_blob[i] for i in left])
    return shape_params(tuple(codes))


@register_ncnn_converter("Slice", any_batch_dim=True, high_rank=True)
def _getitem(b: NcnnBuilder, node: fx.Node) -> None:
    """``x[...]`` with ints, unit-step, strided or reversed (step -1) slices and ``...``, and the pieces of
    ``split`` / ``chunk`` / ``tensor_split`` / ``unbind``: a ``Crop`` (9 starts, 10 ends, 11 axes) of the blob, a
    ``Flip`` (0 axes) of the reversed dims, then a ``Reshape`` when an int index drops a non-batch dim."""
    src = node.args[0]
    field = result_field(node)
    index = _onnx_slice_index(b, node) if b.module(node) is not None else field if field is not None else node.args[1]
    val = src.meta.get("val") if isinstance(src, fx.Node) else None
    if isinstance(val, (tuple, list)) and b.op(src).endswith("WithIndices") and isinstance(index, int):
        if index % 2:
            raise b.fail(node, f"it takes the indices of {src.name!r} ({b.op(src)}); ncnn's Reduction gives the "
                         "values only", "take the values (x.max(dim)[0]), or argmax outside the exported model")
        dim = _arg(src, 1, "dim")
        keep = bool(_const(b, node, _arg(src, 2, "keepdim", False), "keepdim"))
        _reduce_into(b, node, src.args[0], b.op(src)[:-len("WithIndices")], [dim], keep)
        return
    if isinstance(val, (tuple, list)) and b.op(src) == "Split" and isinstance(index, int):
        x = _arg(src, 0, "input")
        split_mod = b.module(src)  # the ONNX frontend's Split (``axis``), else torch's split / chunk / tensor_split
        unbind = src.target in (torch.unbind, "unbind")  # pieces without the dim: x[:, i]
        dim_arg = (split_mod.axis if split_mod is not None and hasattr(split_mod, "axis")
                   else _arg(src, 1 if unbind else 2, "dim", 0))
        dim = int(_const(b, node, dim_arg, "dim")) % len(b.shape(x))
        if unbind:
            index = (slice(None),) * dim + (index % len(val),)
        else:
            sizes = [int(t.shape[dim]) for t in val]
            start = sum(sizes[:index % len(sizes)])
            index = (slice(None),) * dim + (slice(start, start + sizes[index]),)
    elif isinstance(val, torch.Tensor):
        x = src
        picked = _picked_along_one_dim(b, node, len(b.shape(x)), index)
        if picked is not None:
            _take_runs(b, node, x, picked[0], [int(i) % b.shape(x)[picked[0]] for i in picked[1]])
            return
    else:
        raise b.fail(node, f"it takes item {index!r} of {getattr(src, 'name', src)!r}, a {type(val).__name__} the "
                     "ncnn writer cannot split", "index tensors, or take the pieces of split / chunk")
    ranges, dropped, new_axes, steps = _index_ranges(b, node, b.shape(x), index, b.batch_dim(x))
    _crop(b, node, x, ranges, dropped, new_axes, steps)


@register_ncnn_converter("ReduceMaxWithIndices", "ReduceMinWithIndices", any_batch_dim=True, high_rank=True)
def _extremes_along_dim(b: NcnnBuilder, node: fx.Node) -> None:
    """``x.max(dim)`` / ``x.min(dim)``, the pair ``(values, indices)``: no blob of its own; :func:`_getitem` writes
    the values it takes as a ``Reduction`` (VOLO's ``aux.max(1)[0]``), and refuses the indices. The pair read whole
    (returned as it is) is refused."""
    whole = [u.name for u in node.users if not (u.op == "call_function" and (
        u.target is operator.getitem or result_field(u) is not None))]
    if whole:
        raise b.fail(node, f"{whole[0]!r} reads its (values, indices) pair whole", "take the values: x.max(dim)[0]")
    b.alias(node, node.args[0], b.batch_dim(node.args[0]))


@register_ncnn_converter("Split", any_batch_dim=True, high_rank=True)
def _split_whole(b: NcnnBuilder, node: fx.Node) -> None:
    """A split into one piece is its input (torchvision's detectors split the batch of one image so); the pieces of
    a split into several are taken by :func:`_getitem` (the split itself, a tuple, has no blob)."""
    b.alias(node, node.args[0], b.batch_dim(node.args[0]))


@register_ncnn_converter("Flip", any_batch_dim=True, high_rank=True)
def _flip(b: NcnnBuilder, node: fx.Node) -> None:
    """``torch.flip(x, dims)`` / ``x.flip(*dims)``: the slice of every element reversed along ``dims``
    (:func:`_getitem`'s ``Flip``; ncnn's Flip layer is in its 2025 releases and later)."""
    x = node.args[0]
    dims = _const(b, node, node.args[1:] if len(node.args) > 2 else _arg(node, 1, "dims"), "dims")  # x.flip(1, 3)
    dims = {int(d) % len(b.shape(x)) for d in ([dims] if isinstance(dims, int) else dims)}
    index = tuple(slice(None, None, -1) if d in dims else slice(None) for d in range(len(b.shape(x))))
    ranges, dropped, new_axes, steps = _index_ranges(b, node, b.shape(x), index, b.batch_dim(x))
    _crop(b, node, x, ranges, dropped, new_axes, steps)


@register_ncnn_converter("Roll", any_batch_dim=True)
def _roll(b: NcnnBuilder, node: fx.Node) -> None:
    """``torch.roll`` by constant shifts along given dims (Swin's shifted windows): per dim, its last ``shift``
    elements then the rest, two ``Crop`` s and a ``Concat``."""
    x = node.args[0]
    shifts = _const(b, node, _arg(node, 1, "shifts"), "shifts")
    dims = _const(b, node, _arg(node, 2, "dims", None), "dims")
    if dims is None or (isinstance(dims, (tuple, list)) and not dims):
        raise b.fail(node, "it rolls the flattened tensor (no dims)", "roll along given dims: torch.roll(x, s, dims=d)")
    shifts = [shifts] if isinstance(shifts, int) else list(shifts)
    dims = [dims] if isinstance(dims, int) else list(dims)
    shape = b.shape(x)
    moves = [(int(s) % shape[int(d)], int(d) % len(shape)) for s, d in zip(shifts, dims)]
    moves = [(s, d) for s, d in moves if s]
    if not moves:
        b.alias(node, x, b.batch_dim(x))
        return
    blob = b.blob(x, node)
    for k, (shift, dim) in enumerate(moves):
        axis, n = b.ncnn_axis(node, dim, x), shape[dim]
        tail = b.helper(node, "Crop", [blob], {9: [n - shift], 10: [n], 11: [axis]})
        head = b.helper(node, "Crop", [blob], {9: [0], 10: [n - shift], 11: [axis]})
        if k == len(moves) - 1:
            b.emit(node, "Concat", [tail, head], {0: axis})
        else:
            blob = b.helper(node, "Concat", [tail, head], {0: axis})


@register_ncnn_converter("Gather", any_batch_dim=True, high_rank=True)
def _gather(b: NcnnBuilder, node: fx.Node) -> None:
    """ONNX ``Gather`` (onnx2torch's ``OnnxGather``, ``numpy.take`` along ``axis``) of a computed tensor by
    stored indices: one index (ViT's class token ``x[:, 0]``, attention's ``q, k, v = qkv[0], qkv[1], qkv[2]``)
    or a run of consecutive ones in indices of any shape (dynamo's ``as_strided`` of a flattened value), as
    :func:`_getitem`'s ``Crop``; other stored indices as runs of rows (:func:`_take_runs`)."""
    mod = b.module(node)
    lookup = _embedding_lookup(b, node)
    if lookup is not None:
        _embed(b, node, *lookup)
        return
    if _index_is_reshape(b, node):
        _reshape(b, node)
        return
    if mod is None or not hasattr(mod, "_axis") or len(node.args) != 2:
        raise b.fail(node, "only ONNX Gather (numpy.take) of stored indices, and lookups of computed indices in a "
                     "stored table, are exported", "index with ints or slices, or keep the lookup outside the "
                     "exported model")
    x, idx_arg = node.args
    fixed = b.fixed_value(idx_arg) if isinstance(idx_arg, fx.Node) else None
    if fixed is None:
        raise b.fail(node, "its indices are computed in the graph and it does not look rows up in a stored 2-D "
                     "table", "gather with stored (constant) indices, or look rows of a stored table up")
    idx = torch.as_tensor(fixed)
    axis, shape = int(mod._axis) % len(b.shape(x)), b.shape(x)
    flat = [int(i) % shape[axis] for i in idx.reshape(-1).tolist()]
    if idx.dim() == 0:
        item: Any = flat[0]
    elif flat and flat == list(range(flat[0], flat[0] + len(flat))):  # indices of more dims: a Reshape after
        item = slice(flat[0], flat[0] + len(flat))
    else:
        _take_runs(b, node, x, axis, flat)
        return
    ranges, dropped, new_axes, _ = _index_ranges(b, node, shape, (slice(None),) * axis + (item,), b.batch_dim(x))
    _crop(b, node, x, ranges, dropped, new_axes)


def _index_is_reshape(b: NcnnBuilder, node: fx.Node) -> bool:
    """Whether ``node`` is torch's advanced indexing (``aten.index``) by stored index tensors that take the elements
    of its input in their own order: a reshape (Hugging Face's padding mask ``mask[batch_idx, kv_idx]`` over
    ``arange``s, shaped ``(N, 1, 1, T)``)."""
    if node.target is not torch.ops.aten.index.Tensor or len(node.args) != 2 or not isinstance(node.args[0], fx.Node):
        return False
    indices = [None if i is None else b.fixed_value(i) for i in node.args[1]]
    if not all(i is None or isinstance(i, torch.Tensor) and not i.is_floating_point() and i.dtype != torch.bool
               for i in indices):
        return False
    shape = b.shape(node.args[0])
    positions = torch.arange(math.prod(shape)).reshape(shape)[tuple(
        slice(None) if i is None else i.long() for i in indices)]
    return positions.numel() == math.prod(shape) and torch.equal(positions.reshape(-1), torch.arange(positions.numel()))


def _picked_along_one_dim(b: NcnnBuilder, node: fx.Node, rank: int, index: Any) -> tuple[int, list[int]] | None:
    """``(dim, indices)`` of an index that picks stored indices along one dim and takes every other whole
    (CSATv2's ``x[:, :, self.permutation]``, ``x[..., [2, 0, 1]]``); None for any other index."""
    items = list(index) if isinstance(index, tuple) else [index]

    def picks(item: Any) -> list[int] | None:
        value = b.fixed_value(item) if isinstance(item, fx.Node) else item
        if isinstance(value, torch.Tensor) and value.dim() == 1 and not value.is_floating_point() and \
                value.dtype not in (torch.bool, torch.uint8):  # torch reads a uint8 index as a mask
            return [int(i) for i in value.tolist()]
        if isinstance(value, list) and value and all(isinstance(i, int) and not isinstance(i, bool) for i in value):
            return list(value)
        return None

    lists = [(k, p) for k, item in enumerate(items) if (p := picks(item)) is not None]
    if len(lists) != 1:
        return None
    k, picked = lists[0]
    rest = items[:k] + items[k + 1:]
    if sum(item is Ellipsis for item in rest) > 1 or not all(
            item is Ellipsis or (isinstance(item, slice) and item == slice(None)) for item in rest):
        return None
    return (rank - len(items) + k if Ellipsis in items[:k] else k), picked  # after an Ellipsis: counted from the end


def _arithmetic_runs(flat: list[int]) -> list[tuple[int, int, int]]:
    """``flat`` as maximal runs ``(start, count, step)`` of a rising step, in order (a lone index: step 1)."""
    runs: list[tuple[int, int, int]] = []
    i = 0
    while i < len(flat):
        step = flat[i + 1] - flat[i] if i + 1 < len(flat) else 1
        count = 1
        if step >= 1:
            while i + count < len(flat) and flat[i + count] - flat[i + count - 1] == step:
                count += 1
        runs.append((flat[i], count, step if count > 1 else 1))
        i += count
    return runs


def _take_runs(b: NcnnBuilder, node: fx.Node, x: fx.Node, axis: int, flat: list[int]) -> None:
    """``node``: the elements ``flat`` of ``x`` along ``axis``, in order, shaped as the gather's result (torch.onnx's
    im2col before opset 18 gathers rows ``[[0, 4, 8, ...], [1, 5, 9, ...], ...]``: TNT's pixel embedding). The blob
    is viewed as (dims before, ``axis``, dims after); each rising run of indices is a ``Crop`` (strided ones by
    :func:`_strided_rows`), the runs joined by a ``Concat`` and reshaped to the result."""
    shape, bd = b.shape(x), b.batch_dim(x)
    if axis == bd:
        raise b.fail(node, f"it gathers along the batch dimension (dim {axis} of shape {shape})", b.batch_advice(x))
    view = _around(drop_dim(shape, bd), b.ncnn_axis(node, axis, x))
    rows = b.helper(node, "Reshape", [b.blob(x, node)], shape_params(view))
    pieces = []
    for start, count, step in _arithmetic_runs(flat):
        if step == 1:
            pieces.append(rows if (start, count) == (0, view[1]) else
                          b.helper(node, "Crop", [rows], {9: [start], 10: [start + count], 11: [1]}))
        else:
            pieces.append(_strided_rows(b, node, rows, view, start, count, step))
    blob = pieces[0] if len(pieces) == 1 else b.helper(node, "Concat", pieces, {0: 1})
    out_bd = bd if bd is None or bd < axis else bd + len(b.shape(node)) - len(shape)
    target = fold_dims(drop_dim(b.shape(node), out_bd))
    b.emit(node, "Reshape", [blob], shape_params(target), batch_dim=out_bd)


def _embedding_lookup(b: NcnnBuilder, node: fx.Node) -> tuple[torch.Tensor, fx.Node] | None:
    """``(table, ids)`` of an embedding lookup: rows of a stored 2-D table picked by computed integer ids
    (``nn.Embedding``, ``F.embedding``, ONNX ``Gather`` at axis 0 of an initializer); None for another gather."""
    mod = b.module(node)
    max_norm = None
    if isinstance(mod, nn.Embedding):
        table, ids, max_norm = mod.weight, node.args[0], mod.max_norm
    elif mod is None and node.target is F.embedding:
        ids, table, max_norm = _arg(node, 0, "input"), _arg(node, 1, "weight"), _arg(node, 3, "max_norm", None)
    elif mod is not None and hasattr(mod, "_axis") and len(node.args) == 2 and int(mod._axis) == 0:
        table, ids = node.args
    else:
        return None
    if max_norm is not None:
        raise b.fail(node, "an embedding with max_norm renormalizes rows it looks up", "drop max_norm")
    value = table if isinstance(table, torch.Tensor) else b.fixed_value(table)
    if not isinstance(value, torch.Tensor) or value.dim() != 2 or not isinstance(ids, fx.Node) or \
            b.fixed_value(ids) is not None:
        return None
    val = b.strip(ids).meta.get("val")
    if not isinstance(val, torch.Tensor) or val.is_floating_point():
        return None
    if not _from_input(b, ids):
        raise b.fail(node, "it looks up rows by ids computed in the network: ncnn's Embed reads the model's own "
                     "int32 ids, and ncnn computes arithmetic on them in float", "look up the input ids as they "
                     "are (shift the table's rows instead of the ids), or keep the lookup outside the exported model")
    return value, ids


_LAYOUT_OPS = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity"})


def _from_input(b: NcnnBuilder, value: fx.Node) -> bool:
    """Whether ``value`` is a graph input's values, through layout ops only: ncnn computes arithmetic in float, so
    ids computed from the input (``ids + 1``) would reach ``Embed``, which reads int32 bits, as floats."""
    src = b.strip(value)
    while src.op != "placeholder":
        if b.op(src) not in _LAYOUT_OPS or not src.args or not isinstance(src.args[0], fx.Node):
            return False
        src = b.strip(src.args[0])
    return True


def _embed(b: NcnnBuilder, node: fx.Node, table: torch.Tensor, ids: fx.Node) -> None:
    """``Embed`` (0 num_output, 1 input_dim, 2 bias_term, 3 weight_data_size): ncnn reads a 1-D blob of int32 ids
    and writes one row per id, a 2-D blob; ids of more dims are flattened first and the rows reshaped to the
    lookup's blob. ncnn clamps an id outside the table to its ends (torch raises)."""
    vocab, dim = (int(n) for n in table.shape)
    params, weights = {0: dim, 1: vocab, 2: 0, 3: vocab * dim}, [("tagged", _np(table))]
    out = b.blob_shape(node)
    if len(out) == 2:
        b.emit(node, "Embed", [b.blob(ids, node)], params, weights)
        return
    if not 1 <= len(out) <= 4:
        raise b.fail(node, f"its output of shape {b.shape(node)} is a rank-{len(out)} blob",
                     "look up a (N, T) or (T,) tensor of ids")
    flat = b.helper(node, "Reshape", [b.blob(ids, node)], {0: -1})  # ncnn's Embed reads a 1-D blob of ids
    b.emit(node, "Reshape", [b.helper(node, "Embed", [flat], params, weights)], shape_params(out))


def _onnx_slice_index(b: NcnnBuilder, node: fx.Node) -> tuple[slice, ...]:
    """The ONNX frontend's ``Slice`` as a torch index: bounds stored as tensors and given to the module
    (``OnnxSliceIndexed(x, starts, ends, axes=None, steps=None)``), or held by it (``Slice-1``)."""
    rank = len(b.shape(node.args[0]))
    mod = b.module(node)
    if isinstance(getattr(mod, "starts", None), list):  # Slice-1: attributes, unit steps
        starts, ends, axes, steps = mod.starts, mod.ends, mod.axes, None
    else:
        starts, ends, axes, steps = (
            [int(v) for v in b.param(a, node, "slice bound").reshape(-1).tolist()] if a is not None else None
            for a in (list(node.args[1:5]) + [None] * 4)[:4])
    if starts is None or ends is None:
        raise b.fail(node, "its starts / ends are not stored tensors", "give the ONNX Slice constant bounds")
    axes = [a % rank for a in (axes or range(len(starts)))]
    steps = steps or [1] * len(starts)
    index = [slice(None)] * rank
    for a, lo, hi, st in zip(axes, starts, ends, steps):
        index[a] = slice(lo, hi, st)
    return tuple(index)


def _index_ranges(b: NcnnBuilder, node: fx.Node, shape: tuple[int, ...], index: Any, batch_dim: int | None = None
                  ) -> tuple[list[tuple[int, int]], set[int], list[int], dict[int, int]]:
    """``[start, end)`` per dim of ``shape`` taken by ``index``, the dims an int index drops, per dim the
    number of new axes (``None``) the index puts before it, and the steps of the dims sliced with a step other
    than 1 (a negative one: the range is then that of the elements taken, from the lowest, to be reversed).

    ncnn's ``Crop`` takes non-empty unit-step ranges (:func:`_crop` takes strided ones apart). A slice of the
    batch dim that is empty here (the exporter takes shapes at batch 1: ``x[1:3]`` of a batch of 4) means the model
    picks samples, which ncnn cannot do.
    """
    items = list(index) if isinstance(index, tuple) else [index]
    used = len(items) - (Ellipsis in items) - sum(i is None for i in items)
    if sum(i is Ellipsis for i in items) > 1 or used > len(shape):
        raise b.fail(node, f"index {index!r} does not fit a tensor of shape {shape}", "index each dim once")
    if Ellipsis in items:
        at = items.index(Ellipsis)
        items[at:at + 1] = [slice(None)] * (len(shape) - used)
    items += [slice(None)] * (len(shape) - used - (Ellipsis in items))
    new_axes: list[int] = []
    while None in items:  # a new axis of size 1 before the next indexed dim
        at = items.index(None)
        new_axes.append(at)
        del items[at]
    ranges, dropped, steps = [], set(), {}
    for d, (item, size) in enumerate(zip(items, shape)):
        if isinstance(item, slice):
            start, stop, step = (_const(b, node, v, "slice bound") for v in (item.start, item.stop, item.step))
            lo, hi, step = slice(start, stop, step).indices(size)
            if step == -1:  # reversed: the elements lo, lo - 1, ..., hi + 1, a Crop of them and a Flip
                lo, hi = hi + 1, lo + 1
                if d != batch_dim:  # ncnn runs one sample: reversing the batch is reversing one
                    steps[d] = -1
            elif step == 0 or (step not in (1, -1) and d == batch_dim):
                raise b.fail(node, f"slice {item!r} of dim {d} (size {size}) has step {step}; ncnn's Crop takes "
                             "unit-step ranges, ncnn's Flip reverses, and another step of a non-batch dim is a "
                             "Reshape that splits the dim", "slice the batch dim with step 1 or -1 (or subsample "
                             "with a strided conv / pooling)")
            elif step < -1:  # every -step-th element from lo down: those from the lowest up, then a Flip
                count = len(range(lo, hi, step))
                lo, hi = (lo + (count - 1) * step, lo + 1) if count else (lo, lo)
                steps[d] = step
            elif step > 1:
                steps[d] = step
            if hi <= lo and d == batch_dim:
                raise b.fail(node, f"slice {item!r} of dim {d}, the batch dimension, selects samples: ncnn runs one "
                             f"sample (its blobs have no batch dim; exported at batch 1, dim {d} has size {size} "
                             "and the slice is empty)", "slice the other dims, or keep the samples in a non-batch "
                             "dim (e.g. x.reshape(1, N, ...)) before slicing")
            ranges.append((lo, max(lo, hi)))  # empty: the node has no blob (:meth:`NcnnBuilder.mark_empty`)
        elif isinstance(_static(item), int) and not isinstance(_static(item), bool):
            i = _static(item) % size
            ranges.append((i, i + 1))
            dropped.add(d)
        else:
            raise b.fail(node, f"index {item!r} of dim {d} is not an int, a slice or ... (a mask, or indices "
                         "along several dims, or computed in the network)", "index with ints, slices, None and ..., "
                         "or with stored integer indices along one dim, the others whole (x[:, :, [2, 0, 1]])")
    return ranges, dropped, [sum(a <= d for a in new_axes) for d in range(len(shape))], steps


def _crop(b: NcnnBuilder, node: fx.Node, x: fx.Node, ranges: list[tuple[int, int]], dropped: set[int],
          new_axes: list[int] | None = None, steps: dict[int, int] | None = None) -> None:
    """Take ``ranges`` of ``x`` (``Crop`` of the blob axes cut short; every ``steps[d]``-th element of dim ``d``),
    drop the ``dropped`` dims and add the new axes (``new_axes[d]`` of them before dim ``d``)."""
    if any(hi == lo for lo, hi in ranges):
        b.mark_empty(node)
        return
    shape, bd = b.shape(x), b.batch_dim(x)
    blob = b.blob(x, node)
    flips = sorted(d for d, step in (steps or {}).items() if step < 0)
    steps = {d: abs(step) for d, step in (steps or {}).items() if abs(step) > 1}
    if steps:
        blob, shape, ranges = _strided(b, node, x, blob, ranges, steps)
    cut = {d: r for d, r in enumerate(ranges) if r != (0, shape[d])}
    if bd is not None and bd in cut:
        raise b.fail(node, f"it slices the batch dimension (dim {bd} of shape {shape})", b.batch_advice(x))
    added = new_axes or [0] * len(shape)
    if bd is None:  # a value without a batch (an unbatched image): ``x[None]`` gives it one, its new dim 0
        out_bd = 0 if shape and added[0] else None
    else:
        out_bd = None if bd in dropped else bd - sum(d < bd for d in dropped) + added[bd]
    target = fold_dims(drop_dim(b.shape(node), out_bd))
    cropped = fold_dims(drop_dim(tuple(hi - lo for lo, hi in ranges), bd))
    if cut:
        crops = (_folded_crops(b, node, x, cut) if b.high_rank(x)
                 else [(lo, hi, b.ncnn_axis(node, d, x)) for d, (lo, hi) in cut.items()])
        params = {9: [c[0] for c in crops], 10: [c[1] for c in crops], 11: [c[2] for c in crops]}
        blob = b.emit(node, "Crop", [blob], params, batch_dim=out_bd).tops[0]
    if flips:
        if b.high_rank(x):
            raise b.fail(node, f"it reverses a tensor of shape {b.shape(x)}, of more than 4 dims besides the batch "
                         "(its outer dims merged in ncnn)", "reverse before the reshape that adds the dims")
        axes = [b.ncnn_axis(node, d, x) for d in flips]
        blob = b.emit(node, "Flip", [blob], {0: axes}, batch_dim=out_bd).tops[0]
    if cropped != target:
        if not 1 <= len(target) <= 4:
            raise b.fail(node, f"the result of shape {b.shape(node)} is a rank-{len(target)} blob",
                         "ncnn blobs have rank 1 to 4 without the batch dimension")
        b.emit(node, "Reshape", [blob], shape_params(target), batch_dim=out_bd)
    elif not cut and not steps and not flips:
        b.alias(node, x, out_bd)
    elif not cut and steps:
        b.emit(node, "Reshape", [blob], shape_params(target), batch_dim=out_bd)  # the strided blob as the node's


def _strided(b: NcnnBuilder, node: fx.Node, x: fx.Node, blob: str, ranges: list[tuple[int, int]],
             steps: dict[int, int]) -> tuple[str, tuple[int, ...], list[tuple[int, int]]]:
    """Every ``steps[d]``-th element of ``ranges[d]`` (Swin's patch merging ``x[:, 0::2, 1::2, :]``): the blob
    reshaped to ``(before, size / step, step, after)`` around dim ``d``, a ``Crop`` of one position of the step
    axis and of the rows, and the blob shape back with dim ``d`` shortened; returns the new blob, its torch shape
    and the ranges left for the unit-step ``Crop`` (the strided dims whole)."""
    if b.high_rank(x):
        raise b.fail(node, f"it slices a tensor of shape {b.shape(x)} with a step; such a value has more than 4 "
                     "dims besides the batch (its outer dims merged in ncnn)", "slice with a step before the "
                     "reshape that adds the dims")
    shape, bd = list(b.shape(x)), b.batch_dim(x)
    ranges = list(ranges)
    for d, step in steps.items():
        lo, hi = ranges[d]
        count = len(range(lo, hi, step))
        before, _, after = _around(drop_dim(tuple(shape), bd), b.ncnn_axis(node, d, x))
        if shape[d] % step == 0:
            blob = b.helper(node, "Reshape", [blob], shape_params((before, shape[d] // step, step, after)))
            blob = b.helper(node, "Crop", [blob], {9: [lo // step, lo % step],
                                                   10: [lo // step + count, lo % step + 1], 11: [1, 2]})
        else:  # LeViT's ``x[:, ::2]`` of 7 rows: the rows that fill whole steps split as above, the last one apart
            blob = _strided_rows(b, node, blob, (before, shape[d], after), lo, count, step)
        shape[d], ranges[d] = count, (0, count)
        blob = b.helper(node, "Reshape", [blob], shape_params(drop_dim(tuple(shape), bd)))
    return blob, tuple(shape), ranges


def _around(dims: tuple[int, ...], start: int, stop: int | None = None) -> tuple[int, int, int]:
    """A blob's ``dims`` merged into three: those before ``start``, ``start`` up to ``stop`` (the one dim by
    default; none when ``stop == start``), those after. Reshaped so, a blob of any rank has the dims an op works
    along as its middle axis."""
    stop = start + 1 if stop is None else stop
    return math.prod(dims[:start]), math.prod(dims[start:stop]), math.prod(dims[stop:])


def _strided_rows(b: NcnnBuilder, node: fx.Node, blob: str, view: tuple[int, int, int], lo: int, count: int,
                  step: int) -> str:
    """Rows ``lo, lo + step, ...`` (``count`` of them) of the middle axis of ``blob`` seen as ``view`` = (before,
    rows, after), whose row count ``step`` does not divide: the rows up to the last whole step as a split Reshape
    and a Crop, the last row a Crop of its own, joined by a Concat; returns a (before, count, after) blob."""
    before, _, after = view
    rows = b.helper(node, "Reshape", [blob], shape_params(view))
    whole = count if lo + count * step <= view[1] else count - 1  # rows whose whole step lies inside the axis
    pieces = []
    if whole:
        split = b.helper(node, "Crop", [rows], {9: [lo], 10: [lo + whole * step], 11: [1]})
        split = b.helper(node, "Reshape", [split], shape_params((before, whole, step, after)))
        split = b.helper(node, "Crop", [split], {9: [0], 10: [1], 11: [2]})
        pieces.append(b.helper(node, "Reshape", [split], shape_params((before, whole, after))))
    if whole < count:
        last = lo + whole * step
        pieces.append(b.helper(node, "Crop", [rows], {9: [last], 10: [last + 1], 11: [1]}))
    return pieces[0] if len(pieces) == 1 else b.helper(node, "Concat", pieces, {0: 1})


def _folded_crops(b: NcnnBuilder, node: fx.Node, x: fx.Node, cut: dict[int, tuple[int, int]]
                  ) -> list[tuple[int, int, int]]:
    """(start, end, blob axis) of each cut of a value of more than 4 blob dims, stored with its outer dims merged
    (:meth:`NcnnBuilder.stored_shape`): a cut of its outermost dim is a range of the merged axis (Swin's packed
    ``qkv[0]`` of ``(3, windows, heads, tokens, dim)``), a cut of its last three dims one of their axes."""
    shape, bd = b.shape(x), b.batch_dim(x)
    dims = [d for d in range(len(shape)) if d != bd]  # torch dims in blob order
    merged = len(dims) - 3  # blob dims folded into the stored blob's axis 0
    inner = math.prod(shape[d] for d in dims[1:merged])
    crops = []
    for d, (lo, hi) in cut.items():
        k = dims.index(d)
        if 0 < k < merged:
            raise b.fail(node, f"it slices dim {d} of a tensor of shape {shape}, which has more than 4 dims besides "
                         "the batch; ncnn blobs have at most 4 (the outer dims are merged), so only the outermost "
                         "and the last three dims can be sliced", "slice before the reshape that adds the dims")
        crops.append((lo * inner, hi * inner, 0) if k == 0 else (lo, hi, k - merged + 1))
    return crops


_PAD_TYPES = {"constant": 0, "replicate": 1, "reflect": 2}


@register_ncnn_converter("Pad", any_batch_dim=True)
def _pad(b: NcnnBuilder, node: fx.Node) -> None:
    """``Padding``: 0 top, 1 bottom, 2 left, 3 right, 4 type (0 constant, 1 replicate, 2 reflect), 5 value,
    7 front, 8 behind (the channels of a (C, H, W) blob). The padded dims are the last ones, of the blob too: the
    batch, where there is one, must come before them (an unbatched ``[3, H, W]`` image is the blob itself). A
    negative pad removes elements (NASNet's ``F.pad(x, (-1, 0, -1, 0))``): a ``Crop`` before the padding."""
    x, pads, mode, value = _pad_args(b, node)
    while len(pads) > 2 and not any(pads[-2:]):  # outer dims left as they are (MobileBERT's [0, 0, 0, 1, 0, 0])
        pads = pads[:-2]
    if not any(pads):  # Swin's window padding at a size the window divides: nothing to pad
        b.alias(node, x, b.batch_dim(x))
        return
    shape, bd, pairs = b.shape(x), b.batch_dim(x), len(pads) // 2
    rank, blob_rank = len(shape), len(shape) - (bd is not None)
    if (mode not in _PAD_TYPES or len(pads) % 2 or pairs > min(blob_rank, 3)
            or (bd is not None and bd >= rank - pairs)):
        raise b.fail(node, f"{mode!r} padding {pads} of a rank-{rank} tensor (batch dim {bd})", "ncnn's Padding "
                     "pads the last 1-3 non-batch dims of a tensor of rank 2-4 besides the batch (constant, "
                     "replicate or reflect)")
    blob = b.blob(x, node)
    cuts = {rank - 1 - k: (max(0, -pads[2 * k]), shape[rank - 1 - k] - max(0, -pads[2 * k + 1]))
            for k in range(pairs) if min(pads[2 * k:2 * k + 2]) < 0}
    if cuts:
        params = {9: [lo for lo, _ in cuts.values()], 10: [hi for _, hi in cuts.values()],
                  11: [b.ncnn_axis(node, d, x) for d in cuts]}
        if all(p <= 0 for p in pads):  # a crop only
            b.emit(node, "Crop", [blob], params)
            return
        blob = b.helper(node, "Crop", [blob], params)
    left, right, top, bottom, front, behind = [max(0, p) for p in pads] + [0] * (6 - len(pads))
    params = {0: top, 1: bottom, 2: left, 3: right, 4: _PAD_TYPES[mode],
              5: float(_const(b, node, value, "value") or 0.0)}
    if front or behind:
        params.update({7: front, 8: behind})
    b.emit(node, "Padding", [blob], params)


def _pad_args(b: NcnnBuilder, node: fx.Node) -> tuple[fx.Node, list[int], str, Any]:
    """(input, ``F.pad``'s pads, torch mode, fill value) of ``F.pad`` / ``aten.constant_pad_nd``, an ONNX Pad
    module holding its pads (in torch order) or fxq's ``OnnxPadRuntime`` (ONNX pads as an input, computed from shapes
    in Swin's windows)."""
    mod = b.module(node)
    fill = pad_fill(node, mod)
    value = float(b.param(fill, node, "fill value").reshape(-1)[0]) if isinstance(fill, fx.Node) else fill
    if mod is None:
        mode = "constant" if "constant_pad_nd" in str(node.target) else _arg(node, 2, "mode", "constant")
        return node.args[0], [int(p) for p in _const(b, node, _arg(node, 1, "pad"), "pad")], mode, value
    if hasattr(mod, "pads"):
        return node.args[0], [int(p) for p in mod.pads], mod.mode, value
    from fxq.frontends.onnx.converters.pad import torch_pads  # noqa: PLC0415  (only ONNX graphs hold this module)

    if not 2 <= len(node.args) <= 3 or not hasattr(mod, "mode"):
        raise b.fail(node, "an ONNX Pad with axes or without its pads", "pad with constant pads over all axes")
    onnx_pads = [int(p) for p in b.param(node.args[1], node, "pads").reshape(-1).tolist()]
    return node.args[0], torch_pads(onnx_pads, getattr(mod, "axes", None), len(b.shape(node.args[0]))), mod.mode, value


def permute_order_type(order: tuple[int, ...]) -> int:
    """ncnn ``Permute``'s ``order_type`` (param 0) for ``order``, a permutation of a blob's 2 to 4 dims in torch's
    outermost-first order: ncnn numbers a rank-r blob's orders like ``itertools.permutations(range(r))`` (the tests
    check it against ncnn's operator table and run every order of ranks 3 and 4 through ncnn)."""
    return list(itertools.permutations(range(len(order)))).index(tuple(order))


@register_ncnn_converter("Transpose", any_batch_dim=True, high_rank=True)
def _permute(b: NcnnBuilder, node: fx.Node) -> None:
    """``Permute`` (0 order_type: :func:`permute_order_type`) of a batch-less blob of rank 2 to 4; nothing when only
    a batch of 1 moves. A permutation of more
    than 4 blob dims (MaxViT's window partition) is a few ``Reshape`` + ``Permute`` pairs (:func:`_permute_steps`).
    """
    x = _arg(node, 0, "input")
    shape, bd = b.shape(x), b.batch_dim(x)
    dims = [int(_const(b, node, d, "the permutation")) % len(shape) for d in _permutation(b, node, len(shape))]
    out_bd = None if bd is None else dims.index(bd)
    if bd is not None and out_bd != bd and shape[bd] != 1:
        raise b.fail(node, f"permutation {tuple(dims)} of a tensor of shape {shape} moves its batch dimension "
                     f"(dim {bd}, size {shape[bd]}); ncnn blobs have no batch dimension, only a batch of 1 can move",
                     _BATCH_FIX)
    order = tuple(b.ncnn_axis(node, d, x) for d in dims if d != bd)
    if order == tuple(sorted(order)):
        b.alias(node, x, out_bd)
        return
    if len(order) > 4 or b.high_rank(x):
        _permute_high_rank(b, node, x, order, out_bd)
        return
    b.emit(node, "Permute", [b.blob(x, node)], {0: permute_order_type(order)}, batch_dim=out_bd)


def _permute_high_rank(b: NcnnBuilder, node: fx.Node, x: fx.Node, order: tuple[int, ...], out_bd: int | None
                       ) -> None:
    """A permutation ``order`` of a blob of more than 4 dims: dims of size 1 dropped and dims that stay neighbours
    merged, then :func:`_permute_steps` of at most 4 groups each, every step a ``Reshape`` to the groups and a
    ``Permute`` of them (a blob keeps torch's element order, so a reshape only regroups)."""
    in_blob = b.blob_shape(x)
    kept = [a for a in order if in_blob[a] != 1]
    runs: list[list[int]] = []  # input dims that stay neighbours, in output order
    for a in kept:
        if runs and a > runs[-1][-1] and all(in_blob[i] == 1 for i in range(runs[-1][-1] + 1, a)):
            runs[-1].append(a)
        else:
            runs.append([a])
    by_input = sorted(range(len(runs)), key=lambda r: runs[r][0])
    sizes = [math.prod(in_blob[a] for a in runs[r]) for r in by_input]
    target = tuple(by_input.index(r) for r in range(len(runs)))  # group (numbered in input order) per output place
    name = b.layer_name(node)
    blob = b.blob(x, node)
    current, stored = tuple(range(len(sizes))), b.stored_shape(x)
    for k, (cuts, perm) in enumerate(_permute_steps(target)):
        chunks = [current[lo:hi] for lo, hi in zip((0, *cuts), (*cuts, len(current)))]
        chunk_shape = tuple(math.prod(sizes[g] for g in c) for c in chunks)
        if chunk_shape != stored:
            blob = b.add_layer(node, "Reshape", [blob], shape_params(chunk_shape),
                               name=b.unique_layer_name(f"{name}_group{k}")).tops[0]
        blob = b.add_layer(node, "Permute", [blob], {0: permute_order_type(perm)},
                           name=b.unique_layer_name(f"{name}_step{k}")).tops[0]
        current = tuple(g for i in perm for g in chunks[i])
        stored = tuple(chunk_shape[i] for i in perm)
    out = fold_dims(drop_dim(b.shape(node), out_bd))
    b.emit(node, "Reshape", [blob], shape_params(out), batch_dim=out_bd, name=name)


@functools.lru_cache(maxsize=None)
def _permute_steps(target: tuple[int, ...]) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]:
    """The fewest permutes of at most 4 contiguous chunks that take ``(0, 1, ..., m - 1)`` to ``target``: per
    step the cut points of the current sequence and the order of its chunks (a breadth-first search; from 7 groups
    on, one step per misplaced group instead: it moves that group to its place)."""
    m = len(target)
    start = tuple(range(m))
    if m > 6:
        steps, current = [], start
        for i, g in enumerate(target):
            j = current.index(g)
            if j != i:
                cuts = tuple(c for c in (i, j, j + 1) if 0 < c < m)
                chunks = [current[lo:hi] for lo, hi in zip((0, *cuts), (*cuts, m))]
                at = int(i > 0)  # the chunk holding current[i:j]
                perm = tuple(range(at)) + (at + 1, at) + tuple(range(at + 2, len(chunks)))
                steps.append((cuts, perm))
                current = tuple(x for p in perm for x in chunks[p])
        return tuple(steps)
    moves = [(cuts, perm) for n in (2, 3, 4) for cuts in itertools.combinations(range(1, m), n - 1)
             for perm in itertools.permutations(range(n)) if perm != tuple(range(n))]
    parent: dict[tuple[int, ...], Any] = {start: None}
    frontier = [start]
    while target not in parent:
        nxt = []
        for seq in frontier:
            for cuts, perm in moves:
                chunks = [seq[lo:hi] for lo, hi in zip((0, *cuts), (*cuts, m))]
                new = tuple(x for p in perm for x in chunks[p])
                if new not in parent:
                    parent[new] = (seq, (cuts, perm))
                    nxt.append(new)
        frontier = nxt
    steps, seq = [], target
    while parent[seq] is not None:
        seq, step = parent[seq]
        steps.append(step)
    return tuple(steps[::-1])


def _permutation(b: NcnnBuilder, node: fx.Node, rank: int) -> list[Any]:
    """The dims of a transpose / permute in any of its forms: ``x.transpose(0, 1)``, ``torch.transpose``,
    ``x.permute(0, 2, 1)``, ``x.permute((0, 2, 1))``, ``torch.permute(x, dims=...)``, ``x.mT`` aside, and
    onnx2torch's ``OnnxTranspose`` (``perm``, reversed dims when absent)."""
    mod = b.module(node)
    if mod is not None:
        perm = getattr(mod, "perm", _MISSING)
        if perm is _MISSING:
            raise b.fail(node, f"transpose module {type(mod).__name__} has no 'perm'", "use permute / transpose")
        return list(range(rank))[::-1] if perm is None else list(perm)
    if node.target in ("transpose", torch.transpose, "swapaxes", torch.swapaxes, "swapdims", torch.swapdims):
        dims = list(range(rank))
        d0, d1 = (int(_const(b, node, _arg(node, i, k), k)) % rank for i, k in ((1, "dim0"), (2, "dim1")))
        dims[d0], dims[d1] = d1, d0
        return dims
    if len(node.args) > 2:  # x.permute(0, 2, 1)
        return list(node.args[1:])
    dims = _arg(node, 1, "dims")
    return [dims] if isinstance(dims, int) else list(_const(b, node, dims, "the permutation"))


_INTERP = {"nearest": 1, "nearest-exact": 1, "bilinear": 2, "bicubic": 3, "linear": 2, "cubic": 3}
"""torch / ONNX resize mode -> ncnn ``Interp`` resize_type (nearest-exact only for integer upscaling, where it
picks the same pixels as nearest)."""


def _resize_mode(b: NcnnBuilder, node: fx.Node) -> tuple[str, bool, Any]:
    """(mode, align_corners, scale factors or None) of a resize: ``nn.Upsample``, ``F.interpolate`` or the ONNX
    frontend's ``OnnxResizeExact`` where torch computes its coordinate rules (nearest asymmetric-floor, linear /
    cubic half_pixel or align_corners: what ncnn's ``Interp`` computes too)."""
    mod = b.module(node)
    if isinstance(mod, nn.Upsample):
        return mod.mode, bool(mod.align_corners), mod.scale_factor
    if mod is None:
        factor = _static(_arg(node, 2, "scale_factor", None))
        return _arg(node, 3, "mode", "nearest"), bool(_arg(node, 4, "align_corners", None)), factor
    torch_mode = getattr(mod, "torch_mode", None) if hasattr(mod, "_plan") else None
    if torch_mode is None or getattr(mod, "antialias", False):
        what = (f"mode {mod.mode!r}, coordinate_transformation_mode {mod.ctm!r}, nearest_mode {mod.nearest_mode!r}"
                if hasattr(mod, "ctm") else type(mod).__name__)
        raise b.fail(node, f"resize ({what}) has coordinate rules ncnn's Interp does not compute",
                     "ncnn resizes nearest (asymmetric, floor) and bilinear / bicubic (half_pixel or align_corners, "
                     "cubic_coeff_a -0.75, no antialias): export the model with one of those")

    def value(a: Any) -> torch.Tensor | None:
        fixed = b.fixed_value(a)
        return None if fixed is None else torch.as_tensor(fixed)

    roi, scales, sizes = (value(_arg(node, i, k, None)) for i, k in ((1, "roi"), (2, "scales"), (3, "sizes")))
    factor = None
    if (sizes is None or not sizes.numel()) and scales is not None and scales.numel():
        _, scale, _, _ = mod._plan(list(b.shape(node.args[0])), roi, scales, sizes)
        factor = tuple(scale[2:])
    return torch_mode[0], bool(torch_mode[1]), factor


@register_ncnn_converter("Resize")
def _resize(b: NcnnBuilder, node: fx.Node) -> None:
    """2-D resize as ncnn's ``Interp``. A resize by integer factors is written as its factors (params 1, 2), so the
    file resizes any input size as the model does (an FPN's 2x upsampling on every image size of a detector);
    any other as the output size seen at export (params 3, 4): ncnn's nearest then picks ``floor(y * in / out)``,
    as torch's nearest does (checked against ncnn, downsampling included)."""
    x = node.args[0]
    mode, align, factor = _resize_mode(b, node)
    if mode not in _INTERP or len(b.shape(x)) != 4:
        raise b.fail(node, f"resize mode {mode!r} on a rank-{len(b.shape(x))} tensor",
                     "ncnn's Interp does 2-D nearest / bilinear / bicubic")
    _, _, h, w = b.shape(x)
    _, _, oh, ow = b.shape(node)
    if mode == "nearest-exact" and (oh % h or ow % w):  # downsampling included (oh < h leaves a remainder)
        raise b.fail(node, "nearest resize with half-pixel centres that downsamples or scales by a non-integer factor",
                     "ncnn's nearest Interp picks floor(x * in / out): upsample by integer factors, or use "
                     "asymmetric / floor coordinates")
    factors = (factor, factor) if isinstance(factor, (int, float)) else factor
    if (factors is not None and len(factors) == 2 and all(float(f).is_integer() and f >= 1 for f in factors)
            and (oh, ow) == (h * int(factors[0]), w * int(factors[1]))):
        b.emit(node, "Interp", [b.blob(x, node)], {0: _INTERP[mode], 1: float(factors[0]), 2: float(factors[1]),
                                                   6: int(align)})
        return
    if any(tuple(shapes[0][2:]) != (oh, ow) for shapes in b.probed_shapes(node)):
        b.warn_once(f"resize {node.name}", "ncnn export: resize %r (%dx%d -> %dx%d, not by integer factors) is written "
                    "for its export-time output size; the file resizes other input sizes to %dx%d too", node.name, h,
                    w, oh, ow, oh, ow)
    b.emit(node, "Interp", [b.blob(x, node)], {0: _INTERP[mode], 3: oh, 4: ow, 6: int(align)})
