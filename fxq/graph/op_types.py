"""Canonical op types: module, function and method forms of one operation get one ONNX-style name.

Platforms list op types by these names (``"Conv"``, ``"Gemm"``, ``"Add"``...), so ``nn.Conv2d`` and
``F.conv2d``, ``x + y`` and ``torch.add`` are quantized alike. Nodes that came from an ONNX file carry
their op type in ``node.meta["onnx"]``; that is used when the module/function is not known here.
"""
from __future__ import annotations

import copy
import functools
import inspect
import math
import operator
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import fx, nn

from fxq.graph.info import is_quantizer_node
from fxq.graph.nodes import get_attr_value

__all__ = ["LIFTED", "op_type", "register_op_type", "mutates_first_argument", "out_of_place_twin", "WEIGHTED_FUNCTIONS",
           "WEIGHT_ARGS", "weight_arg_nodes", "weight_bias_args", "conv_attrs", "weight_shape", "CLIP_BOUNDS",
           "clip_bounds", "stores_clip_bounds", "output_lower_bound", "output_bounded", "variance_args", "pad_fill"]

aten = torch.ops.aten

LIFTED: dict[Any, Callable[..., Any] | str] = {
    aten.conv1d.default: F.conv1d, aten.conv2d.default: F.conv2d, aten.conv3d.default: F.conv3d,
    aten.conv1d.padding: F.conv1d, aten.conv2d.padding: F.conv2d, aten.conv3d.padding: F.conv3d,
    aten.conv_transpose1d.default: F.conv_transpose1d, aten.conv_transpose2d.input: F.conv_transpose2d,
    aten.conv_transpose3d.input: F.conv_transpose3d,
    aten.linear.default: F.linear, aten.matmul.default: torch.matmul, aten.bmm.default: torch.bmm,
    aten.mm.default: torch.mm, aten.einsum.default: torch.einsum, aten.addmm.default: torch.addmm,
    aten.diff.default: torch.diff,
    aten.add.Tensor: torch.add, aten.sub.Tensor: torch.sub, aten.mul.Tensor: torch.mul, aten.div.Tensor: torch.div,
    aten.relu.default: torch.relu, aten.sigmoid.default: torch.sigmoid, aten.tanh.default: torch.tanh,
    aten.hardtanh.default: F.hardtanh, aten.hardswish.default: F.hardswish, aten.hardsigmoid.default: F.hardsigmoid,
    aten.gelu.default: F.gelu, aten.silu.default: F.silu, aten.leaky_relu.default: F.leaky_relu,
    aten.elu.default: F.elu, aten.clamp.default: torch.clamp, aten.softmax.int: torch.softmax,
    aten.layer_norm.default: F.layer_norm, aten.linalg_vector_norm.default: torch.linalg.vector_norm,
    aten.max_pool1d.default: F.max_pool1d, aten.max_pool2d.default: F.max_pool2d,
    aten.max_pool3d.default: F.max_pool3d,
    aten.avg_pool1d.default: F.avg_pool1d, aten.avg_pool2d.default: F.avg_pool2d,
    aten.avg_pool3d.default: F.avg_pool3d,
    aten.adaptive_avg_pool1d.default: F.adaptive_avg_pool1d,
    aten.adaptive_avg_pool2d.default: F.adaptive_avg_pool2d,
    aten.adaptive_avg_pool3d.default: F.adaptive_avg_pool3d,
    aten.mean.dim: torch.mean, aten.cat.default: torch.cat, aten.stack.default: torch.stack,
    aten.view.default: torch.reshape, aten.reshape.default: torch.reshape, aten._unsafe_view.default: torch.reshape,
    aten.flatten.using_ints: torch.flatten, aten.permute.default: torch.permute,
    aten.transpose.int: torch.transpose, aten.unsqueeze.default: torch.unsqueeze,
    aten.squeeze.dim: torch.squeeze, aten.roll.default: torch.roll, aten.flip.default: torch.flip,
    # sizes: torch.onnx's tracer records the sizes an aten op takes as constants, a method's or torch function's as
    # values computed from the input (``x.size(0)``), so a file exported with a dynamic batch stays batch-generic
    aten.sym_size.int: "size", aten.sym_numel.default: "numel", aten.sym_stride.int: "stride",
    aten.repeat.default: "repeat", aten.tile.default: "tile", aten.expand.default: "expand",
    aten.new_zeros.default: "new_zeros", aten.new_ones.default: "new_ones", aten.new_full.default: "new_full",
    aten.new_empty.default: "new_empty", aten.type_as.default: "type_as", aten.zeros_like.default: torch.zeros_like,
    aten.ones_like.default: torch.ones_like, aten.full_like.default: torch.full_like,
    aten.arange.default: torch.arange, aten.arange.start: torch.arange, aten.arange.start_step: torch.arange,
    aten.zeros.default: torch.zeros, aten.ones.default: torch.ones, aten.full.default: torch.full,
    aten.empty.memory_format: torch.empty, aten.narrow.default: torch.narrow,
    aten.split_with_sizes.default: torch.split, aten.split.Tensor: torch.split,
    aten.unbind.int: torch.unbind, aten.sum.dim_IntList: torch.sum, aten.sum.default: torch.sum,
    aten.amax.default: torch.amax, aten.amin.default: torch.amin, aten.pow.Tensor_Scalar: torch.pow,
    aten.max.dim: torch.max, aten.min.dim: torch.min, aten.max.default: torch.max, aten.min.default: torch.min,
    aten.max.other: torch.max, aten.min.other: torch.min,
    aten.scaled_dot_product_attention.default: F.scaled_dot_product_attention,
    aten.group_norm.default: F.group_norm, aten.rsqrt.default: torch.rsqrt,
    aten.var.correction: torch.var, aten.std.correction: torch.std, aten.var.dim: torch.var, aten.std.dim: torch.std,
    aten.repeat_interleave.self_int: torch.repeat_interleave, aten.neg.default: torch.neg,
}
"""aten overloads whose positional arguments are those of a torch function, or (a str) of a ``Tensor`` method
called on the first; the node keeps args and kwargs (:mod:`fxq.graph.export_capture` lifts them to those calls,
and they get the call's op type)."""

_FUNCTIONS: dict[Callable[..., Any], str] = {
    F.conv1d: "Conv", F.conv2d: "Conv", F.conv3d: "Conv",
    torch.conv1d: "Conv", torch.conv2d: "Conv", torch.conv3d: "Conv",
    F.conv_transpose1d: "ConvTranspose", F.conv_transpose2d: "ConvTranspose", F.conv_transpose3d: "ConvTranspose",
    F.linear: "Gemm", torch.addmm: "Gemm", F.instance_norm: "InstanceNormalization",
    torch.matmul: "MatMul", operator.matmul: "MatMul", torch.bmm: "MatMul", torch.mm: "MatMul",
    torch.einsum: "Einsum",
    operator.add: "Add", torch.add: "Add", operator.iadd: "Add",
    operator.sub: "Sub", torch.sub: "Sub", operator.mul: "Mul", torch.mul: "Mul", operator.imul: "Mul",
    operator.truediv: "Div", torch.div: "Div",
    torch.cat: "Concat", torch.concat: "Concat", torch.stack: "Concat",
    F.relu: "Relu", torch.relu: "Relu", torch.relu_: "Relu", F.relu_: "Relu", F.hardtanh_: "Clip",
    torch.sigmoid_: "Sigmoid", torch.tanh_: "Tanh", torch.clamp_: "Clip", F.relu6: "Clip", F.hardtanh: "Clip", torch.clamp: "Clip", torch.clip: "Clip",
    torch.sigmoid: "Sigmoid", F.sigmoid: "Sigmoid", F.hardswish: "HardSwish", F.hardsigmoid: "HardSigmoid",
    F.gelu: "Gelu", F.silu: "Silu", F.leaky_relu: "LeakyRelu", F.prelu: "PRelu", torch.tanh: "Tanh",
    F.tanh: "Tanh", F.elu: "Elu",
    F.softmax: "Softmax", torch.softmax: "Softmax", F.log_softmax: "LogSoftmax", torch.log_softmax: "LogSoftmax",
    F.softplus: "Softplus", F.local_response_norm: "LRN", F.selu: "Selu", torch.selu: "Selu",
    F.layer_norm: "LayerNormalization", F.group_norm: "GroupNormalization",
    F.normalize: "LpNormalization",
    F.batch_norm: "BatchNormalization",
    F.max_pool1d: "MaxPool", F.max_pool2d: "MaxPool", F.max_pool3d: "MaxPool",
    F.avg_pool1d: "AveragePool", F.avg_pool2d: "AveragePool", F.avg_pool3d: "AveragePool",
    F.adaptive_avg_pool1d: "GlobalAveragePool", F.adaptive_avg_pool2d: "GlobalAveragePool",
    F.adaptive_max_pool2d: "GlobalMaxPool", F.adaptive_avg_pool3d: "GlobalAveragePool",
    F.adaptive_max_pool3d: "GlobalMaxPool",
    torch.flatten: "Flatten", torch.reshape: "Reshape", torch.transpose: "Transpose", torch.permute: "Transpose",
    torch.swapaxes: "Transpose", torch.swapdims: "Transpose", torch.roll: "Roll", torch.flip: "Flip",
    operator.getitem: "Slice", torch.split: "Split", torch.chunk: "Split", torch.unbind: "Split",
    torch.tensor_split: "Split", torch.squeeze: "Squeeze", torch.unsqueeze: "Unsqueeze", F.interpolate: "Resize", F.pad: "Pad", torch.mean: "ReduceMean",
    torch.sum: "ReduceSum", torch.amax: "ReduceMax", torch.amin: "ReduceMin", torch.prod: "ReduceProd",
    torch.logsumexp: "ReduceLogSumExp", torch.maximum: "Max", torch.minimum: "Min",
    F.dropout: "Identity", torch.numel: "Shape", getattr: "Shape", torch.arange: "Range",
    torch.argmax: "ArgMax", torch.argmin: "ArgMin", torch.topk: "TopK", torch.nonzero: "NonZero",
    F.embedding: "Gather", operator.neg: "Neg", torch.neg: "Neg", operator.pow: "Pow", torch.pow: "Pow",
    torch.sqrt: "Sqrt", torch.exp: "Exp", torch.log: "Log", torch.abs: "Abs", torch.reciprocal: "Reciprocal",
    torch.rsqrt: "Rsqrt", torch.var: "Var", torch.std: "Std", torch.repeat_interleave: "RepeatInterleave",
    F.unfold: "Im2Col",
    F.fold: "Col2Im",
    torch.where: "Where", torch.masked_fill: "MaskedFill", torch.isnan: "IsNaN", torch.unflatten: "Reshape",
    torch.logical_and: "And", torch.logical_or: "Or", torch.logical_not: "Not", operator.and_: "And",
    operator.or_: "Or", operator.invert: "Not", torch.bitwise_and: "And", torch.bitwise_or: "Or",
    torch.bitwise_not: "Not",
}
_ELEMENTWISE_MATH = ("sin", "cos", "tan", "asin", "acos", "atan", "floor", "ceil")
"""Elementwise math functions typed by their ONNX name (``torch.cos`` / ``x.cos()`` / ``aten.cos``: ``Cos``);
an oriented-box head's angle (YOLO-OBB) reads cos and sin."""
for _name in _ELEMENTWISE_MATH:
    _FUNCTIONS[getattr(torch, _name)] = _name.capitalize()

_METHODS: dict[str, str] = {
    "add": "Add", "add_": "Add", "sub": "Sub", "mul": "Mul", "mul_": "Mul", "div": "Div", "matmul": "MatMul",
    "bmm": "MatMul", "relu": "Relu", "relu_": "Relu", "sigmoid": "Sigmoid", "tanh": "Tanh", "clamp": "Clip",
    "softmax": "Softmax", "log_softmax": "LogSoftmax", "pow": "Pow", "view": "Reshape", "reshape": "Reshape", "flatten": "Flatten", "permute": "Transpose",
    "transpose": "Transpose", "swapaxes": "Transpose", "swapdims": "Transpose", "contiguous": "Identity",
    "squeeze": "Squeeze", "unsqueeze": "Unsqueeze", "roll": "Roll", "flip": "Flip",
    "chunk": "Split", "split": "Split", "unbind": "Split", "tensor_split": "Split",
    "mean": "ReduceMean", "size": "Shape", "dim": "Shape", "numel": "Shape",
    "expand": "Expand", "repeat": "Tile", "argmax": "ArgMax", "argmin": "ArgMin", "topk": "TopK", "to": "Cast", "float": "Cast",
    "type_as": "Cast", "clone": "Identity", "detach": "Identity", "view_as": "Reshape", "reshape_as": "Reshape",
    "maximum": "Max", "minimum": "Min", "sum": "ReduceSum", "amax": "ReduceMax", "amin": "ReduceMin",
    "prod": "ReduceProd", "logsumexp": "ReduceLogSumExp", "neg": "Neg",
    "sqrt": "Sqrt", "exp": "Exp", "log": "Log", "abs": "Abs", "reciprocal": "Reciprocal",
    "rsqrt": "Rsqrt", "var": "Var", "std": "Std", "repeat_interleave": "RepeatInterleave",
    "unfold": "SlidingWindows",  # Tensor.unfold(dim, size, step); nn.Unfold / F.unfold is Im2Col
    "where": "Where", "masked_fill": "MaskedFill", "isnan": "IsNaN", "unflatten": "Reshape",
    "logical_and": "And", "logical_or": "Or", "logical_not": "Not", "bitwise_and": "And", "bitwise_or": "Or",
    "bitwise_not": "Not", "__and__": "And", "__or__": "Or", "__invert__": "Not",
    **{name: name.capitalize() for name in _ELEMENTWISE_MATH},
}

_MODULES: dict[type, str] = {
    nn.Conv1d: "Conv", nn.Conv2d: "Conv", nn.Conv3d: "Conv",
    nn.ConvTranspose1d: "ConvTranspose", nn.ConvTranspose2d: "ConvTranspose", nn.ConvTranspose3d: "ConvTranspose",
    nn.Linear: "Gemm", nn.ReLU: "Relu", nn.ReLU6: "Clip", nn.Hardtanh: "Clip", nn.Sigmoid: "Sigmoid",
    nn.Hardswish: "HardSwish", nn.Hardsigmoid: "HardSigmoid", nn.GELU: "Gelu", nn.SiLU: "Silu",
    nn.LeakyReLU: "LeakyRelu", nn.PReLU: "PRelu", nn.Tanh: "Tanh", nn.ELU: "Elu", nn.Softmax: "Softmax",
    nn.LayerNorm: "LayerNormalization", nn.GroupNorm: "GroupNormalization", nn.BatchNorm1d: "BatchNormalization", nn.BatchNorm2d: "BatchNormalization",
    nn.BatchNorm3d: "BatchNormalization",
    nn.MaxPool1d: "MaxPool", nn.MaxPool2d: "MaxPool", nn.MaxPool3d: "MaxPool",
    nn.AvgPool1d: "AveragePool", nn.AvgPool2d: "AveragePool", nn.AvgPool3d: "AveragePool",
    nn.AdaptiveAvgPool1d: "GlobalAveragePool", nn.AdaptiveAvgPool2d: "GlobalAveragePool",
    nn.AdaptiveMaxPool2d: "GlobalMaxPool", nn.AdaptiveAvgPool3d: "GlobalAveragePool",
    nn.AdaptiveMaxPool3d: "GlobalMaxPool", nn.Flatten: "Flatten", nn.Upsample: "Resize",
    nn.Identity: "Identity", nn.Dropout: "Identity", nn.Dropout2d: "Identity", nn.Embedding: "Gather",
    nn.Dropout1d: "Identity", nn.Dropout3d: "Identity", nn.AlphaDropout: "Identity",
    nn.FeatureAlphaDropout: "Identity",
    nn.LocalResponseNorm: "LRN", nn.SELU: "Selu", nn.LogSoftmax: "LogSoftmax", nn.Softplus: "Softplus",
    nn.InstanceNorm1d: "InstanceNormalization",
    nn.InstanceNorm2d: "InstanceNormalization", nn.InstanceNorm3d: "InstanceNormalization", nn.Unfold: "Im2Col", nn.Fold: "Col2Im",
}

def _training_flag_at(index: int) -> Callable[[fx.Node], bool]:
    def is_training(node: fx.Node) -> bool:
        flag = node.args[index] if len(node.args) > index else node.kwargs.get("training", True)
        return flag is not False
    return is_training


_EVAL_IDENTITIES: dict[Callable[..., Any], Callable[[fx.Node], bool]] = {}
"""Functions that are the identity when called with ``training=False`` (traced from a model in eval mode), with
the test of a node's training flag; in training they keep their type ("Unknown" unless registered)."""
try:  # torchvision's stochastic depth (EfficientNet, ConvNeXt, Swin, MaxViT) is a torch.fx-wrapped function
    from torchvision.ops import stochastic_depth as _stochastic_depth

    _EVAL_IDENTITIES[_stochastic_depth] = _training_flag_at(3)
except ImportError:  # pragma: no cover - torchvision is a dependency
    pass

WEIGHTED_FUNCTIONS = frozenset(
    f for f, t in _FUNCTIONS.items() if t in ("Conv", "ConvTranspose", "Gemm") and f is not torch.addmm
)
"""Functions called as ``f(input, weight, bias, ...)``."""

WEIGHT_ARGS: dict[Any, tuple[int, ...]] = {}
"""Graph targets with weights at these positional args besides :data:`WEIGHTED_FUNCTIONS`' ``(x, weight, bias)``
(``fxq::lstm`` / ``fxq::gru``: ``W`` and ``R``), quantized per channel along axis 0 like a conv weight."""


def weight_arg_nodes(node: fx.Node) -> tuple[fx.Node, ...]:
    """The nodes ``node`` reads as weights through :data:`WEIGHT_ARGS` (empty for other nodes)."""
    if node.op != "call_function":
        return ()
    positions = WEIGHT_ARGS.get(node.target, ())
    return tuple(a for i, a in enumerate(node.args) if i in positions and isinstance(a, fx.Node))


def weight_bias_args(node: fx.Node) -> tuple[Any, Any]:
    """The ``weight`` and ``bias`` arguments of a call of :data:`WEIGHTED_FUNCTIONS` (``(None, None)`` otherwise)."""
    if node.op == "call_function" and node.target in WEIGHTED_FUNCTIONS:
        w = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
        b = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        return w, b
    return None, None


_CONV_ATTRS = ("stride", "padding", "dilation", "groups")


def conv_attrs(node: fx.Node) -> dict[str, Any]:
    """The stride / padding / dilation / groups a conv call (prepare's functional form) was made with: what
    :meth:`fxq.Platform.weight_config` reads."""
    attrs = dict(zip(("input", "weight", "bias", *_CONV_ATTRS), node.args))
    attrs.update(node.kwargs)
    return {k: attrs[k] for k in _CONV_ATTRS if k in attrs}


def weight_shape(node: fx.Node, gm: nn.Module) -> tuple[int, ...] | None:
    """The shape of the weight a Conv / ConvTranspose / Gemm node reads, through any quantizer node on it (a module's
    own weight for a ``call_module``); None when it reads none or the shape is unknown."""
    if node.op == "call_module":
        value = getattr(get_attr_value(gm, str(node.target)), "weight", None)
    else:
        w, _ = weight_bias_args(node)
        while isinstance(w, fx.Node) and is_quantizer_node(w):
            w = w.args[0]
        if not isinstance(w, fx.Node):
            return None
        value = get_attr_value(gm, str(w.target)) if w.op == "get_attr" else w.meta.get("val")
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def register_op_type(target: Any, op_type_name: str) -> None:
    """Teach fxq the canonical type of a custom module class, function, or method name."""
    if isinstance(target, str):
        _METHODS[target] = op_type_name
    elif isinstance(target, type) and issubclass(target, nn.Module):
        _MODULES[target] = op_type_name
    else:
        _FUNCTIONS[target] = op_type_name


def op_type(node: fx.Node, modules: dict[str, nn.Module] | None = None) -> str:
    """The canonical op type of ``node`` ("Input", "Output", "Param" for placeholders/outputs/get_attr)."""
    if node.op == "placeholder":
        return "Input"
    if node.op == "output":
        return "Output"
    if node.op == "get_attr":
        return "Param"
    found: str | None = None
    if node.op == "call_function":
        found = _FUNCTIONS.get(node.target)
        is_training = _EVAL_IDENTITIES.get(node.target)  # type: ignore[arg-type]
        if found is None and is_training is not None and not is_training(node):
            found = "Identity"
        if found is None and getattr(node.target, "__name__", None) in ("conv2d", "conv1d", "conv3d"):
            found = "Conv"
    elif node.op == "call_method":
        found = _METHODS.get(node.target)
    elif node.op == "call_module" and modules is not None:
        mod = modules.get(node.target)
        if mod is not None:
            for cls in type(mod).__mro__:
                if cls in _MODULES:
                    found = _MODULES[cls] if _computes_as(type(mod), cls) else None
                    break
            if found in ("GlobalAveragePool", "GlobalMaxPool") and not _is_global(mod):
                found = "AveragePool" if found == "GlobalAveragePool" else "MaxPool"
    if found is None and (node.op == "call_function" and node.target in (torch.max, torch.min) or
                          node.op == "call_method" and node.target in ("max", "min")):
        found = _extreme_type(node)
    if found is None and (node.op == "call_function" and node.target in NORM_FUNCTIONS or
                          node.op == "call_method" and node.target == "norm"):
        found = _norm_type(node)
    if result_field(node) is not None:
        found = "Slice"  # ``x.max(1).values``: an item of the result, as ``x.max(1)[0]`` (not a ``.shape``)
    if found is None:
        for key in ("onnx", "caffe"):
            info = node.meta.get(key)
            if isinstance(info, dict) and info.get("op_type"):
                return str(info["op_type"])
    if found == "GlobalAveragePool" and node.op == "call_function":
        size = node.args[1] if len(node.args) > 1 else node.kwargs.get("output_size")
        if not _all_ones(size):
            found = "AveragePool"
    return found or "Unknown"


_RESULT_FIELDS = {"values": 0, "indices": 1}
"""The fields of torch's ``(values, indices)`` results (``max`` / ``min`` along a dim, ``topk``, ``sort``)."""


def result_field(node: fx.Node) -> int | None:
    """The item ``getattr(result, "values" / "indices")`` takes, None for another node."""
    if node.op == "call_function" and node.target is getattr and len(node.args) > 1:
        return _RESULT_FIELDS.get(node.args[1])  # type: ignore[call-overload]
    return None


def _extreme_type(node: fx.Node) -> str:
    """``torch.max`` / ``torch.min`` by their arguments: of two tensors, elementwise (``Max``); along a dim, the
    ``(values, indices)`` pair (``ReduceMaxWithIndices``); of one tensor alone, the reduction to one number."""
    name = "Max" if node.target in (torch.max, "max") else "Min"
    if "dim" in node.kwargs:
        return f"Reduce{name}WithIndices"
    second = node.args[1] if len(node.args) > 1 else node.kwargs.get("other")
    if second is None:
        return f"Reduce{name}"
    val = second.meta.get("val") if isinstance(second, fx.Node) else second
    # a dim is a Python int (a node of shape arithmetic at most); a node not yet described is taken for a tensor
    along_dim = isinstance(val, (int, torch.SymInt)) and not isinstance(val, bool)
    return f"Reduce{name}WithIndices" if along_dim else name


NORM_FUNCTIONS = (torch.norm, torch.linalg.vector_norm)


def norm_args(node: fx.Node) -> tuple[Any, Any, Any, bool]:
    """``(input, p, dim, keepdim)`` of ``torch.norm`` / ``x.norm`` / ``torch.linalg.vector_norm`` (one order of
    arguments for the three; ``p`` is ``ord`` for the last)."""
    a = list(node.args) + [None] * (4 - len(node.args))
    p = node.kwargs.get("p", node.kwargs.get("ord", a[1]))
    if p is None:
        p = 2 if node.target is torch.linalg.vector_norm else "fro"
    return a[0], p, node.kwargs.get("dim", a[2]), bool(node.kwargs.get("keepdim", a[3] or False))


def _norm_type(node: fx.Node) -> str | None:
    """A vector norm as the reduction it is (timm's GlobalResponseNorm: ``x.norm(p=2, dim=(1, 2), keepdim=True)``):
    p = 2 (or ``"fro"``) ``ReduceL2``, p = 1 ``ReduceL1``; None for other norms."""
    p = norm_args(node)[1]
    if p in ("fro", 2, 2.0):
        return "ReduceL2"
    return "ReduceL1" if p in (1, 1.0) else None


def _computes_as(subclass: type, cls: type) -> bool:
    """Whether a module of ``subclass`` computes what ``cls`` does: the same forward, or torch's own subclass
    (``SyncBatchNorm``). A user's ``GroupNormAct(nn.GroupNorm)`` kept whole adds an activation its type would
    hide from exporters."""
    return subclass.forward is cls.forward or subclass.__module__.startswith("torch.")


def _is_global(mod: nn.Module) -> bool:
    return _all_ones(getattr(mod, "output_size", None))


def _all_ones(size: Any) -> bool:
    """An adaptive pool's output size of 1 in every pooled dim (``1``, ``(1, 1)``, ``(1, 1, 1)``...)."""
    return size == 1 or (isinstance(size, (tuple, list)) and len(size) > 0 and all(v == 1 for v in size))


LAYOUT_FREE_OP_TYPES = frozenset({
    "Conv", "Relu", "Clip", "Sigmoid", "HardSwish", "HardSigmoid", "Gelu", "Silu", "LeakyRelu", "PRelu", "Tanh",
    "Elu", "Selu", "Softplus", "BatchNormalization", "MaxPool", "AveragePool", "GlobalAveragePool",
    "GlobalMaxPool", "Add", "Sub", "Mul", "Div", "Max", "Min", "Neg", "Abs", "Sqrt", "Exp", "Log", "Reciprocal",
    "Pow", "Concat", "Identity", "Flatten", "Resize",
})
"""Op types whose torch forms accept any memory layout of their inputs and never ``.view`` one (elementwise ops,
convolutions, pools, concat, flatten by reshape): they may read a channels-last tensor as it is. Values are the
same up to the last bits of vectorised transcendental functions (sigmoid, GELU, SiLU...) and of means (global
pooling): ~1e-7 relative. Any other op (``view``, a user's module) may depend on the layout, or fail on it."""


_INPLACE_OPERATORS: dict[Callable[..., Any], Callable[..., Any]] = {
    operator.iadd: operator.add,
    operator.isub: operator.sub,
    operator.imul: operator.mul,
    operator.itruediv: operator.truediv,
    operator.ifloordiv: operator.floordiv,
    operator.imod: operator.mod,
    operator.ipow: operator.pow,
    operator.iand: operator.and_,
    operator.ior: operator.or_,
    operator.ixor: operator.xor,
    operator.ilshift: operator.lshift,
    operator.irshift: operator.rshift,
    operator.imatmul: operator.matmul,
}


def out_of_place_twin(target: Any) -> Callable[..., Any] | None:
    """The non-mutating twin of an in-place function (``torch.relu_`` -> ``torch.relu``, ``+=`` -> ``+``)."""
    if target in _INPLACE_OPERATORS:
        return _INPLACE_OPERATORS[target]
    name = getattr(target, "__name__", "")
    if not name.endswith("_") or name.endswith("__"):
        return None
    for namespace in (torch.nn.functional, torch):
        if getattr(namespace, name, None) is target:
            return getattr(namespace, name[:-1], None)
    return None


def mutates_first_argument(node: fx.Node, modules: dict[str, nn.Module]) -> bool:
    """Whether ``node`` changes its first argument in place (``nn.ReLU(inplace=True)``, ``x += y``, ``relu_``)."""
    if node.op == "call_module":
        return getattr(modules.get(str(node.target)), "inplace", False) is True
    if node.op == "call_function":
        return (node.kwargs.get("inplace") is True or node.target is operator.setitem
                or out_of_place_twin(node.target) is not None)
    if node.op == "call_method":
        name = str(node.target)
        return name.endswith("_") and not name.endswith("__")
    return False


def out_of_place_form(node: fx.Node, modules: dict[str, nn.Module]) -> tuple[str, Any, bool] | None:
    """How to compute an in-place ``node`` without writing into its first argument: ``(op, target,
    inplace_off)`` — a non-in-place copy of the module (the model's own stays as it is), the out-of-place twin
    function or method, or the same target with ``inplace=False`` (``inplace_off``). None: there is no such
    form (``setitem``, ``fill_``...): write into a copy instead."""
    if node.op == "call_module":
        mod = copy.copy(modules[str(node.target)])
        mod.inplace = False
        return "call_module", mod, False
    if node.op == "call_function":
        if node.kwargs.get("inplace") is True:
            return "call_function", node.target, True
        twin = out_of_place_twin(node.target)
        return ("call_function", twin, False) if twin is not None else None
    if node.op == "call_method" and hasattr(torch.Tensor, str(node.target)[:-1]):
        return "call_method", str(node.target)[:-1], False
    return None


def in_place_form(node: fx.Node, modules: dict[str, nn.Module]) -> Callable[[], Callable[..., Any]] | None:
    """For a non-mutating ``node`` whose op takes an ``inplace`` flag: a maker of the callable that computes it by
    writing into its first argument, for a caller that knows nothing reads that value any more and that it holds
    no element twice. The maker copies the module when called (its ``training`` and bounds as they are then; the
    model's own module stays as it is). None: the op takes no such flag. ONNX-loaded activations are
    ``nn.ReLU6()``, ``nn.ReLU()``...: writing in place saves them a fresh output, whose pages cost more than the op
    on large tensors."""
    if mutates_first_argument(node, modules):
        return None
    if node.op == "call_module":
        mod = modules.get(str(node.target))
        if getattr(mod, "inplace", None) is not False or not type(mod).__module__.startswith("torch.nn."):
            return None

        def module_in_place() -> Callable[..., Any]:
            twin = copy.copy(mod)
            twin.inplace = True
            return twin

        return module_in_place
    if node.op == "call_function" and getattr(node.target, "__module__", None) == "torch.nn.functional":
        try:
            takes = "inplace" in inspect.signature(node.target).parameters
        except (TypeError, ValueError):
            return None
        target = node.target
        return (lambda: functools.partial(target, inplace=True)) if takes else None
    return None


def _register_recurrent() -> None:
    """Recurrent ops (:mod:`fxq.recurrent`) are one node with weight inputs; importing them also registers their
    ONNX forms (the ``nn.LSTM`` / ``nn.GRU`` decompositions are :mod:`fxq.recurrent.capture`'s)."""
    from fxq.recurrent.ops import RECURRENT_TARGETS

    _FUNCTIONS.update(RECURRENT_TARGETS)
    WEIGHT_ARGS.update({target: (1, 2) for target in RECURRENT_TARGETS})


_register_recurrent()


def _register_aten() -> None:
    """aten overloads, as ``torch.export`` graphs hold them: the ones in :data:`LIFTED` get the type of that call (a graph handed over unlifted is still typed), the rest a type of their own."""
    for overload, fn in LIFTED.items():
        found = _METHODS.get(fn) if isinstance(fn, str) else _FUNCTIONS.get(fn)
        if found is not None:
            _FUNCTIONS.setdefault(overload, found)
    for overload, name in {
        aten.nonzero.default: "NonZero", aten.topk.default: "TopK",
        aten.argmax.default: "ArgMax", aten.argmin.default: "ArgMin", aten.slice.Tensor: "Slice", aten.select.int: "Slice",
        aten.chunk.default: "Split", aten._to_copy.default: "Cast",
        aten.upsample_nearest2d.vec: "Resize", aten.upsample_bilinear2d.vec: "Resize",
        aten.constant_pad_nd.default: "Pad", aten.pad.default: "Pad", aten.exp.default: "Exp",
        aten.index.Tensor: "Gather", aten.embedding.default: "Gather", aten.relu6.default: "Clip",
        aten.squeeze.dims: "Squeeze", aten.mean.default: "ReduceMean", aten.sqrt.default: "Sqrt",
        aten.log.default: "Log", aten.abs.default: "Abs", aten.reciprocal.default: "Reciprocal",
        aten.where.self: "Where", aten.masked_fill.Scalar: "MaskedFill", aten.masked_fill.Tensor: "MaskedFill",
        aten.isnan.default: "IsNaN", aten.unflatten.int: "Reshape",
        aten.__and__.Tensor: "And", aten.__and__.Scalar: "And", aten.bitwise_and.Tensor: "And",
        aten.bitwise_and.Scalar: "And", aten.logical_and.default: "And",
        aten.__or__.Tensor: "Or", aten.__or__.Scalar: "Or", aten.bitwise_or.Tensor: "Or",
        aten.bitwise_or.Scalar: "Or", aten.logical_or.default: "Or",
        aten.bitwise_not.default: "Not", aten.logical_not.default: "Not",
        **{getattr(aten, name).default: name.capitalize() for name in _ELEMENTWISE_MATH},
    }.items():
        _FUNCTIONS.setdefault(overload, name)


_register_aten()


CLIP_BOUNDS = {  # function / method name -> (position, keyword) of its lower and upper bound
    "hardtanh": ((1, "min_val"), (2, "max_val")),
    "clamp": ((1, "min"), (2, "max")),
    "clip": ((1, "min"), (2, "max")),
}
_CLIP_DEFAULTS = {"hardtanh": (-1.0, 1.0), "relu6": (0.0, 6.0)}  # missing bounds: the function's defaults

_NONNEGATIVE = frozenset({"Relu", "Sigmoid", "Softmax"})
_BOUNDED = frozenset({"Sigmoid", "Softmax", "HardSigmoid", "Tanh"})


def stores_clip_bounds(module: nn.Module | None) -> bool:
    """Whether a clip module holds its bounds as ``min_val`` / ``max_val`` (nn.Hardtanh, ReLU6, onnx2torch's
    OnnxClip), not as further arguments (the ONNX frontend's run-time Clip, ``has_min`` / ``has_max``)."""
    return module is not None and hasattr(module, "min_val") and not hasattr(module, "has_min")


def clip_bounds(node: fx.Node, module: nn.Module | None = None) -> tuple[Any, Any]:
    """``(lower, upper)`` of a clip node (op type ``Clip``, ``module`` its module for ``call_module``): numbers,
    nodes for bounds the graph computes (the ONNX frontend's ``OnnxClipRunTime``), None for an open side."""
    if stores_clip_bounds(module):  # as in a traced island's F.normalize (OnnxClip)
        return module.min_val, module.max_val
    if module is not None:  # a run-time Clip module: its bounds are its further arguments
        bounds = iter(node.args[1:])
        return (next(bounds) if getattr(module, "has_min", False) else None,
                next(bounds) if getattr(module, "has_max", False) else None)
    name = str(getattr(node.target, "__name__", node.target)).rstrip("_")
    low, high = _CLIP_DEFAULTS.get(name, (None, None))
    if name == "relu6":
        return low, high
    ((i_low, k_low), (i_high, k_high)) = CLIP_BOUNDS.get(name, ((1, "min"), (2, "max")))
    pick = lambda i, k, d: node.args[i] if len(node.args) > i else node.kwargs.get(k, d)  # noqa: E731
    return pick(i_low, k_low, low), pick(i_high, k_high, high)


def pad_fill(node: fx.Node, module: nn.Module | None = None) -> Any:
    """The fill value of a ``Pad`` node (``module`` its module for ``call_module``): a number, a node (ONNX's
    ``constant_value`` input), or None (0). ``F.pad`` / ``aten.pad`` take it 4th, ``aten.constant_pad_nd`` 3rd;
    fxq's ``OnnxPad`` holds it as ``value``, onnx2torch's as ``constant_value``."""
    if module is None:
        at = 2 if "constant_pad_nd" in str(node.target) else 3
        return node.args[at] if len(node.args) > at else node.kwargs.get("value")
    if hasattr(module, "pads"):
        return getattr(module, "value", getattr(module, "constant_value", None))
    return node.args[2] if len(node.args) > 2 else None


def variance_args(node: fx.Node) -> tuple[Any, Any, float, bool]:
    """``(input, dim, correction, keepdim)`` of a ``Var`` / ``Std`` node, in any of torch's spellings:
    ``torch.var(x, unbiased)``, ``x.var(dim, unbiased, keepdim)``, ``x.var(dim, correction=0, keepdim=True)``."""
    rest, kwargs = list(node.args[1:]), node.kwargs
    dim, correction, keep = None, 1.0, False
    if rest and isinstance(rest[0], bool):
        correction = float(rest.pop(0))
    elif rest:
        dim = rest.pop(0)
        if rest:
            correction = float(rest.pop(0))
        if rest:
            keep = bool(rest.pop(0))
    if "unbiased" in kwargs:
        correction = float(kwargs["unbiased"])
    if kwargs.get("correction") is not None:
        correction = float(kwargs["correction"])
    return node.args[0], kwargs.get("dim", dim), correction, bool(kwargs.get("keepdim", keep))


def output_bounded(node: fx.Node, modules: dict[str, nn.Module]) -> bool:
    """Whether the op itself bounds ``node``'s output at both ends (a softmax, sigmoid or hard-sigmoid in [0, 1], a
    tanh in [-1, 1], a clip at two finite bounds)."""
    kind = op_type(node, modules)
    if kind in _BOUNDED:
        return True
    if kind != "Clip":
        return False
    bounds = clip_bounds(node, modules.get(str(node.target)) if node.op == "call_module" else None)
    return all(isinstance(b, (int, float)) and not isinstance(b, bool) and math.isfinite(b) for b in bounds)


def output_lower_bound(node: fx.Node, modules: dict[str, nn.Module]) -> float | None:
    """The least value ``node``'s output can take, where the op itself fixes one (a ReLU's 0, a clip's minimum, a
    sigmoid's or softmax's 0); None for every other op."""
    kind = op_type(node, modules)
    if kind in _NONNEGATIVE:
        return 0.0
    if kind != "Clip":
        return None
    low, _ = clip_bounds(node, modules.get(str(node.target)) if node.op == "call_module" else None)
    return float(low) if isinstance(low, (int, float)) and not isinstance(low, bool) else None
