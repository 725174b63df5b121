"""Graph preparation passes: each is ``pass(gm) -> gm`` (in place), ending with lint + recompile when it changed the
graph (:func:`remove_identity_nodes`, the first, always: it also drops the captured graph's dead code).

Pipeline order in :func:`standardize`: remove identities -> write out addcmul / addcdiv -> functionalize weighted
modules -> fold stored computations and BatchNorm -> propagate tensor metadata -> constant MatMul as linear -> fold
constant affine ops.
"""
from __future__ import annotations

import contextlib
import logging
import operator
from collections import Counter
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Iterator, NamedTuple, Sequence

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.utils import _pytree as pytree

from fxq.errors import GraphError
from fxq.graph.attention import decompose_attention_functions
from fxq.graph.nodes import Interpreter, get_attr_value, redirect_later_readers, value_inputs, without_grad_first
from fxq.graph.op_types import WEIGHTED_FUNCTIONS, mutates_first_argument, op_type, out_of_place_form

__all__ = [
    "standardize",
    "remove_identity_nodes",
    "functionalize_padding_modules",
    "decompose_compound_arithmetic",
    "functionalize_weighted_modules",
    "fold_batchnorm",
    "fold_constant_affine",
    "matmul_to_linear",
    "propagate_tensor_meta",
    "reuse_node_name",
    "set_attr_value",
    "rewrite_out_of_place",
]

logger = logging.getLogger(__name__)


_CODE_DEFERRED: ContextVar[fx.GraphModule | None] = ContextVar("fxq_code_deferred", default=None)


@contextmanager
def _code_generated_once(gm: fx.GraphModule) -> Iterator[None]:
    """Passes run back to back without generating ``gm``'s code after each: nothing in between runs the module as a
    whole (tensor metadata propagates by interpreting the graph). Generating it costs ~10 ms per pass on
    MobileNetV2's 200 nodes."""
    token = _CODE_DEFERRED.set(gm)
    try:
        yield
    except BaseException:
        _CODE_DEFERRED.reset(token)
        with contextlib.suppress(Exception):  # the pass's own error is the one to see
            gm.recompile()
        raise
    _CODE_DEFERRED.reset(token)
    gm.recompile()


def _finish(gm: fx.GraphModule) -> fx.GraphModule:
    modules = dict(gm.named_modules())
    # an in-place op whose result nobody reads (``z.relu_()``) still does its work
    gm.graph.eliminate_dead_code(is_impure_node=lambda n: n.is_impure() or mutates_first_argument(n, modules))
    gm.graph.lint()
    gm.delete_all_unused_submodules()
    if _CODE_DEFERRED.get() is not gm:
        gm.recompile()
    return gm


def set_attr_value(gm: fx.GraphModule, target: str, value: Any) -> None:
    owner_path, _, name = target.rpartition(".")
    owner = gm.get_submodule(owner_path) if owner_path else gm
    if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter) and isinstance(
        getattr(owner, name, None), nn.Parameter
    ):
        value = nn.Parameter(value, requires_grad=getattr(owner, name).requires_grad)
    setattr(owner, name, value)


_COPYING_METHODS = ("clone", "contiguous")
_LAYOUT_STRICT = {"view": "reshape", "view_as": "reshape_as"}
_RESHAPING_METHODS = ("reshape", "reshape_as", "flatten")
_RESHAPING_FUNCTIONS = (torch.reshape, torch.flatten)
"""``x.contiguous()`` read only by reshaping ops computes what they compute on ``x`` (``view`` / ``view_as`` become
``reshape`` / ``reshape_as``, which copy when they must); read by anything else its layout may matter downstream
(strides flow through elementwise ops to the outputs, where the caller may ``.view`` them), so it stays."""


def _only_reshaped(node: fx.Node) -> bool:
    return all((u.op == "call_method" and u.target in (*_LAYOUT_STRICT, *_RESHAPING_METHODS)
                or u.op == "call_function" and u.target in _RESHAPING_FUNCTIONS) and u.args[0] is node
               for u in node.users)


def remove_identity_nodes(gm: fx.GraphModule) -> fx.GraphModule:
    """Drop identity-like nodes (``nn.Identity``, dropout in eval, ``contiguous``...) without changing what the
    model computes.

    Copies (``clone``, ``contiguous``) stay when the graph mutates anything in place: ``y = x.clone();
    y.relu_()`` must not turn into ``x.relu_()``. A ``contiguous`` goes only when reshaping ops alone read it
    (``view`` / ``view_as`` then become ``reshape`` / ``reshape_as``).
    """
    modules = dict(gm.named_modules())
    mutating = any(mutates_first_argument(n, modules) for n in gm.graph.nodes)
    for node in list(gm.graph.nodes):
        if node.op in ("call_module", "call_function", "call_method") and op_type(node, modules) == "Identity":
            if not node.args or not isinstance(node.args[0], fx.Node):
                continue
            copying = node.op == "call_method" and node.target in _COPYING_METHODS
            if copying and mutating:
                continue
            if copying and node.target == "contiguous":
                if not _only_reshaped(node):
                    continue
                for user in node.users:
                    if user.op == "call_method" and user.target in _LAYOUT_STRICT:
                        user.target = _LAYOUT_STRICT[str(user.target)]
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
    return _finish(gm)


_CONV_FUNCS = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONVT_FUNCS = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


def _functional_call(mod: nn.Module) -> tuple[Any, tuple, dict] | None:
    """(function, extra positional args after (x, w, b), kwargs) for a weighted module, or None."""
    if isinstance(mod, nn.Linear):
        return F.linear, (), {}
    if isinstance(mod, (nn.Conv1d, nn.Conv2d, nn.Conv3d)) and not isinstance(mod, nn.modules.conv._ConvTransposeNd):
        if mod.padding_mode != "zeros":
            return None
        return _CONV_FUNCS[mod.weight.dim() - 2], (mod.stride, mod.padding, mod.dilation, mod.groups), {}
    if isinstance(mod, nn.modules.conv._ConvTransposeNd):
        return (_CONVT_FUNCS[mod.weight.dim() - 2],
                (mod.stride, mod.padding, mod.output_padding, mod.groups, mod.dilation), {})
    return None


def functionalize_weighted_modules(gm: fx.GraphModule) -> fx.GraphModule:
    """Rewrite ``nn.Conv*/ConvTranspose*/Linear`` calls as ``F.conv*(x, self.<m>.weight, self.<m>.bias)``.

    The modules stay as parameter holders (state_dict keys do not change); every weight becomes a
    ``get_attr`` edge, so weight quantizers are inserted like any other quantizer. The node keeps its
    name and ``node.meta["module_path"]`` records the module it came from.
    """
    modules = dict(gm.named_modules())
    rewritten = False
    for node in list(gm.graph.nodes):
        if node.op != "call_module":
            continue
        mod = modules[node.target]
        spec = _functional_call(mod)
        if spec is None or len(node.args) != 1 or node.kwargs:
            continue
        fn, extra, kwargs = spec
        with gm.graph.inserting_before(node):
            w = gm.graph.get_attr(f"{node.target}.weight")
            b = gm.graph.get_attr(f"{node.target}.bias") if mod.bias is not None else None
            new = gm.graph.call_function(fn, (node.args[0], w, b, *extra), kwargs)
        _stand_in(gm, node, new)
        rewritten = True
    return _finish(gm) if rewritten else gm


def _stand_in(gm: fx.GraphModule, call: fx.Node, new: fx.Node) -> None:
    """``new`` (the function form of module call ``call``) in place of ``call``: its readers, meta, name, and
    ``meta["module_path"]`` (the module it came from)."""
    new.meta.update(call.meta)
    new.meta["module_path"] = call.target
    name = call.name
    call.replace_all_uses_with(new)
    gm.graph.erase_node(call)
    reuse_node_name(new, name)


_PADDING_MODES = ((nn.modules.padding._ConstantPadNd, "constant"), (nn.modules.padding._ReflectionPadNd, "reflect"),
                  (nn.modules.padding._ReplicationPadNd, "replicate"), (nn.modules.padding._CircularPadNd, "circular"))


def functionalize_padding_modules(gm: fx.GraphModule) -> fx.GraphModule:
    """Rewrite ``nn.ZeroPad2d`` / ``ConstantPad*`` / ``ReflectionPad*`` / ``ReplicationPad*`` / ``CircularPad*``
    calls as ``F.pad(x, padding, mode, value)``: one form of a pad for every platform and exporter (HF
    EfficientNet's stem pads with ``nn.ZeroPad2d``, which no exporter converted as a module)."""
    modules = dict(gm.named_modules())
    rewritten = False
    for node in list(gm.graph.nodes):
        mod = modules.get(str(node.target)) if node.op == "call_module" else None
        mode = next((m for cls, m in _PADDING_MODES if isinstance(mod, cls)), None)
        if mode is None or len(node.args) != 1 or node.kwargs:
            continue
        value = float(mod.value) if mode == "constant" else None
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(F.pad, (node.args[0], tuple(mod.padding), mode, value))
        _stand_in(gm, node, new)
        rewritten = True
    return _finish(gm) if rewritten else gm


_COMPOUND = {torch.addcmul: "mul", "addcmul": "mul", torch.addcdiv: "div", "addcdiv": "div",
             torch.addmm: "mm", "addmm": "mm", torch.diff: "diff", "diff": "diff"}
"""Several ops in one call: written out, each step is an op every platform and exporter knows."""


def decompose_compound_arithmetic(gm: fx.GraphModule) -> fx.GraphModule:
    """Write ``torch.addcmul`` / ``torch.addcdiv`` (timm's GlobalResponseNorm ends with ``addcmul(bias, weight, x)``)
    as ``input + t1 * t2 * value`` / ``input + value * t1 / t2``, ``torch.addmm(bias, x, W)`` (HF's GPT-2 ``Conv1D``)
    as ``x @ W + bias`` (a matmul by a stored matrix then becomes a linear layer, the bias folded in), and
    ``torch.diff`` (HF's packed-sequence check on position ids; torch.onnx has no symbolic for it) as the
    difference of two slices.

    ``addcdiv`` in the order torch's CPU kernel computes it (bit for bit). torch's ``addcmul`` / ``addmm`` kernels
    fuse the multiply-add, which no separate ops reproduce: written out they round once more (an ulp here and
    there), as the ops torch.onnx writes for them, and ncnn, compute them."""
    rewritten = False
    for node in list(gm.graph.nodes):
        kind = _COMPOUND.get(node.target) if node.op in ("call_function", "call_method") else None
        if kind is None:
            continue
        if not _written_out_form(node, kind):
            continue
        with gm.graph.inserting_before(node):
            total = _WRITERS[kind](gm.graph, node)
        total.meta.update(node.meta)
        node.replace_all_uses_with(total)
        gm.graph.erase_node(node)
        rewritten = True
    return _finish(gm) if rewritten else gm


def _addc_written_out(graph: fx.Graph, node: fx.Node) -> fx.Node:
    """``input + t1 * t2 * value`` / ``input + value * t1 / t2`` of ``addcmul`` / ``addcdiv``."""
    names = ("input", "value", "tensor1", "tensor2") if len(node.args) == 4 else ("input", "tensor1", "tensor2")
    a = dict(zip(names, node.args))  # four positional arguments: torch's deprecated addcmul(x, value, t1, t2)
    a.update(node.kwargs)
    value = a.get("value", 1)
    if _COMPOUND[node.target] == "mul":
        term = graph.call_function(operator.mul, (a["tensor1"], a["tensor2"]))
        term = term if value == 1 else graph.call_function(operator.mul, (term, value))
    else:
        scaled = a["tensor1"] if value == 1 else graph.call_function(operator.mul, (value, a["tensor1"]))
        term = graph.call_function(operator.truediv, (scaled, a["tensor2"]))
    return graph.call_function(operator.add, (a["input"], term))


def _written_out_form(node: fx.Node, kind: str) -> bool:
    """Whether ``node`` is in a form :func:`decompose_compound_arithmetic` writes out (any ``addcmul`` / ``addcdiv``):
    ``addmm(input, mat1, mat2, beta=, alpha=)`` (not torch's deprecated positional scalars); a ``diff`` whose input
    dtype is known (a bool difference is ``!=``, a number's ``-``: symbolic tracing records none, so it is written
    out once the shapes pass has run)."""
    if kind == "mm":
        return len(node.args) <= 3 and set(node.kwargs) <= {"input", "mat1", "mat2", "beta", "alpha"}
    return kind != "diff" or isinstance(node.meta.get("val"), torch.Tensor)


def _addmm_written_out(graph: fx.Graph, node: fx.Node) -> fx.Node:
    """``beta * input + alpha * (mat1 @ mat2)`` of ``torch.addmm`` / ``input.addmm(mat1, mat2)``."""
    a = dict(zip(("input", "mat1", "mat2"), node.args))
    a.update(node.kwargs)
    beta, alpha = a.get("beta", 1), a.get("alpha", 1)
    product = graph.call_function(torch.matmul, (a["mat1"], a["mat2"]))
    product = product if alpha == 1 else graph.call_function(operator.mul, (product, alpha))
    bias = a["input"] if beta == 1 else graph.call_function(operator.mul, (a["input"], beta))
    return product if beta == 0 else graph.call_function(operator.add, (product, bias))


def _diff_written_out(graph: fx.Graph, node: fx.Node) -> fx.Node:
    """``torch.diff(input, n, dim, prepend, append)``: ``x[1:] - x[:-1]`` along ``dim``, ``n`` times, after the
    prepended / appended values are concatenated (a bool input's difference is ``!=``, as torch's)."""
    a = dict(zip(("input", "n", "dim", "prepend", "append"), node.args))
    a.update(node.kwargs)
    dim = int(a.get("dim", -1))
    x = a["input"]
    if int(a.get("n", 1)) == 0:  # torch returns the input as it is, without prepend / append
        return x
    parts = [p for p in (a.get("prepend"), x, a.get("append")) if p is not None]
    if len(parts) > 1:
        x = graph.call_function(torch.cat, (parts, dim))
    lead = (slice(None),) * dim if dim >= 0 else (Ellipsis,)
    trail = () if dim >= 0 else (slice(None),) * (-dim - 1)
    val = node.meta.get("val")
    step = torch.ne if isinstance(val, torch.Tensor) and val.dtype == torch.bool else operator.sub
    for _ in range(int(a.get("n", 1))):
        hi = graph.call_function(operator.getitem, (x, (*lead, slice(1, None), *trail)))
        lo = graph.call_function(operator.getitem, (x, (*lead, slice(None, -1), *trail)))
        x = graph.call_function(step, (hi, lo))
    return x


_WRITERS = {"mul": _addc_written_out, "div": _addc_written_out, "mm": _addmm_written_out, "diff": _diff_written_out}
"""How :func:`decompose_compound_arithmetic` writes out each kind of :data:`_COMPOUND`."""


def reuse_node_name(node: fx.Node, name: str) -> None:
    """Give ``node`` the name of a node that was just erased (fx never frees names by itself)."""
    if any(n.name == name for n in node.graph.nodes):
        return
    namespace = node.graph._graph_namespace
    namespace._used_names.discard(name)
    node._rename(name)


def _weighted_parts(node: fx.Node) -> tuple[fx.Node, fx.Node | None] | None:
    """(weight get_attr, bias get_attr or None) of a functional conv/linear whose params are attributes."""
    if node.op != "call_function" or node.target not in WEIGHTED_FUNCTIONS:
        return None
    w = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
    b = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    if not (isinstance(w, fx.Node) and w.op == "get_attr"):
        return None
    if b is not None and not (isinstance(b, fx.Node) and b.op == "get_attr"):
        return None
    return w, b


def _sole_reader(src: fx.Node, node: fx.Node) -> bool:
    """Whether ``node`` is the only reader of ``src``'s values: others may read its shape or dtype (timm's
    ``_assert(x.ndim == 4)`` in every ``BatchNormAct2d``), which a fold into ``src`` keeps."""
    return all(u is node or all(i is not src for i in value_inputs(u)) for u in src.users)


class BatchNormStats(NamedTuple):
    """What folding or an exporter needs of an eval-mode BatchNorm, a module or ``F.batch_norm``'s arguments."""
    weight: torch.Tensor | None
    bias: torch.Tensor | None
    mean: torch.Tensor
    var: torch.Tensor
    eps: float


def _module_bn(node: fx.Node, modules: dict[str, nn.Module]) -> tuple[BatchNormStats, str] | None:
    bn = modules.get(str(node.target)) if node.op == "call_module" else None
    if not isinstance(bn, nn.modules.batchnorm._BatchNorm) or bn.training or bn.running_mean is None:
        return None
    w, b = (bn.weight, bn.bias) if bn.affine else (None, None)
    return BatchNormStats(w, b, bn.running_mean, bn.running_var, bn.eps), str(node.target)


_BN_ARGS = ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps")


def _functional_bn(gm: fx.GraphModule, node: fx.Node) -> tuple[BatchNormStats, str] | None:
    """``F.batch_norm(x, mean, var, w, b, training=False, momentum, eps)`` with attribute tensors (as torch.export
    writes eval-mode BatchNorm), named after its module path."""
    if node.op != "call_function" or node.target is not F.batch_norm:
        return None
    given = {**dict(zip(_BN_ARGS, node.args)), **node.kwargs}
    if given.get("training", False) is not False:
        return None
    tensors = {}
    for key in ("running_mean", "running_var", "weight", "bias"):
        arg = given.get(key)
        if arg is not None and not (isinstance(arg, fx.Node) and arg.op == "get_attr"):
            return None
        tensors[key] = get_attr_value(gm, str(arg.target)) if arg is not None else None
    if tensors["running_mean"] is None or tensors["running_var"] is None:
        return None
    stats = BatchNormStats(tensors["weight"], tensors["bias"], tensors["running_mean"], tensors["running_var"],
                     float(given.get("eps", 1e-5)))
    mean_node = given["running_mean"]
    return stats, str(mean_node.target).rpartition(".")[0] or node.name


def batchnorm_stats(gm: fx.GraphModule, node: fx.Node, modules: dict[str, nn.Module]
                    ) -> tuple[BatchNormStats, str] | None:
    """``node``'s statistics and module path when it is an eval-mode BatchNorm: a module (looked up in
    ``modules``), or ``F.batch_norm`` with attribute tensors (torch.export; timm's ``BatchNormAct2d`` traced)."""
    return _module_bn(node, modules) or _functional_bn(gm, node)


def fold_batchnorm(gm: fx.GraphModule) -> fx.GraphModule:
    """Fold eval-mode BatchNorm (module, or ``F.batch_norm`` with attribute statistics as torch.export writes it)
    into the preceding conv/linear/conv-transpose (functional form).

    Only when the conv output feeds nothing but the BatchNorm and the weight is not shared. The conv node's
    ``meta["folded_bn"]`` lists the folded modules in order (caffe's BatchNorm + Scale pair folds twice).
    """
    modules = dict(gm.named_modules())
    owners = _Owners(gm)
    folded = False
    for node in list(gm.graph.nodes):
        found = batchnorm_stats(gm, node, modules)
        if found is None:
            continue
        stats, bn_name = found
        src = node.args[0]
        if not isinstance(src, fx.Node) or not _sole_reader(src, node):
            continue
        parts = _weighted_parts(src)
        if parts is None:
            continue
        w_node, b_node = parts
        if not (owners.sole(w_node) and owners.sole(b_node)):
            continue
        _fold_one(gm, src, w_node, b_node, stats, bn_name, node, src)
        folded = True
    return _finish(gm) if folded else gm


_ROW_VIEWS = frozenset({"Reshape", "Flatten"})


def fold_batchnorm_through_row_views(gm: fx.GraphModule) -> fx.GraphModule:
    """Fold a BatchNorm over the rows of a linear layer's output into the linear: LeViT's ``LinearNorm`` runs
    ``bn(linear(x).flatten(0, 1)).reshape_as(x)``, a BatchNorm1d over ``(N * T, C)`` whose channels are the
    linear's output features. Needs ``meta["val"]``: the view must keep the last dim, and the BatchNorm's input
    must be 2-D (its channels that last dim)."""
    modules = dict(gm.named_modules())
    owners = _Owners(gm)
    folded = False
    for node in list(gm.graph.nodes):
        found = batchnorm_stats(gm, node, modules)
        view = node.args[0] if found is not None and node.args else None
        if not isinstance(view, fx.Node) or op_type(view, modules) not in _ROW_VIEWS or not _sole_reader(view, node):
            continue
        linear = view.args[0] if view.args else None
        if not isinstance(linear, fx.Node) or linear.target is not F.linear or not _sole_reader(linear, view):
            continue
        parts = _weighted_parts(linear)
        val, out = node.meta.get("val"), linear.meta.get("val")
        if parts is None or not isinstance(val, torch.Tensor) or not isinstance(out, torch.Tensor) or \
                val.dim() != 2 or val.shape[-1] != out.shape[-1] or val.numel() != out.numel() or \
                not (owners.sole(parts[0]) and owners.sole(parts[1])):
            continue
        _fold_one(gm, linear, parts[0], parts[1], *found, node, view)
        folded = True
    return _finish(gm) if folded else gm


@torch.no_grad()
def _fold_one(gm: fx.GraphModule, conv: fx.Node, w_node: fx.Node, b_node: fx.Node | None, bn: BatchNormStats,
              bn_name: str, bn_node: fx.Node, bn_input: fx.Node) -> None:
    """Fold ``bn`` into ``conv``'s weight and bias; ``bn_node``'s readers read ``bn_input`` (the conv, or a view of
    it) instead, and the BatchNorm node goes."""
    factor = (bn.weight if bn.weight is not None else torch.ones_like(bn.var)) / torch.sqrt(bn.var + bn.eps)
    shift = (bn.bias if bn.bias is not None else torch.zeros_like(bn.mean)) - bn.mean * factor
    _scale_shift(gm, conv, w_node, b_node, factor, shift)
    bn_node.replace_all_uses_with(bn_input)
    conv.meta["folded_bn"] = [*conv.meta.get("folded_bn", []), bn_name]
    gm.graph.erase_node(bn_node)


@torch.no_grad()
def _scale_shift(gm: fx.GraphModule, conv: fx.Node, w_node: fx.Node, b_node: fx.Node | None,
                 factor: torch.Tensor, shift: torch.Tensor) -> None:
    """Make ``conv`` compute ``conv(x) * factor + shift`` (per output channel) by rewriting its weight and bias."""
    w = get_attr_value(gm, w_node.target)
    factor, shift = factor.to(w.dtype), shift.to(w.dtype)
    if conv.target in _CONVT_FUNCS.values():
        groups = conv.args[6] if len(conv.args) > 6 else conv.kwargs.get("groups", 1)
        cin, cout_g = w.shape[0], w.shape[1]
        f = factor.reshape(groups, 1, cout_g, *([1] * (w.dim() - 2)))
        new_w = (w.reshape(groups, cin // groups, cout_g, *w.shape[2:]) * f).reshape(w.shape)
    else:
        new_w = w * factor.reshape(-1, *([1] * (w.dim() - 1)))
    old_b = get_attr_value(gm, b_node.target) if b_node is not None else torch.zeros_like(shift)
    new_b = old_b * factor + shift
    set_attr_value(gm, w_node.target, new_w.detach().clone())  # a Parameter stays one, trainable as it was
    if b_node is not None:
        set_attr_value(gm, b_node.target, new_b.detach().clone())
        return
    owner_path = w_node.target.rpartition(".")[0]
    owner = gm.get_submodule(owner_path) if owner_path else gm
    attr = "bias" if getattr(owner, "bias", "absent") is None else "fxq_folded_bias"
    suffix = 0
    while attr != "bias" and hasattr(owner, attr):  # several convs' weights in one owner (ONNX initializers)
        suffix += 1
        attr = f"fxq_folded_bias_{suffix}"
    setattr(owner, attr, nn.Parameter(new_b.detach().clone(), requires_grad=w.requires_grad))
    target = f"{owner_path}.{attr}" if owner_path else attr
    with gm.graph.inserting_before(conv):
        b_new = gm.graph.get_attr(target)
    args = list(conv.args)
    if len(args) > 2:
        args[2] = b_new
        conv.args = tuple(args)
    else:
        conv.kwargs = {**conv.kwargs, "bias": b_new}


class _Owners:
    """Who reads each stored tensor, counted once per pass, so that :meth:`sole` is a few lookups rather than a walk
    over every node and parameter (a walk per conv cost MobileNetV2's BatchNorm folding 20 of its 47 ms).

    Counts are taken when the pass starts. A fold replaces the value of a name it solely owns (a fresh tensor:
    counted 0, sole) or stores its result under a new name (not counted: checked by a fresh count). The tensors
    counted stay referenced, so no new tensor can take the identity of one counted twice.
    """

    def __init__(self, gm: fx.GraphModule) -> None:
        self.gm = gm
        self.reads = Counter(str(n.target) for n in gm.graph.nodes if n.op == "get_attr")
        self.called = {str(n.target) for n in gm.graph.nodes if n.op == "call_module"}
        self._tensors = [t for _, t in (*gm.named_parameters(remove_duplicate=False),
                                        *gm.named_buffers(remove_duplicate=False))]
        self.names = Counter(id(t) for t in self._tensors)

    def sole(self, attr: fx.Node | None) -> bool:
        """Whether ``attr`` (a ``get_attr``) is read once, by one node: rewriting its tensor changes nothing else
        (no other ``get_attr`` of it, no module call that reads it as its own, no other name tied to the tensor)."""
        if attr is None:
            return True
        target = str(attr.target)
        if target not in self.reads:  # stored by this pass (a folded bias): counted afresh
            return _Owners(self.gm).sole(attr)
        parts = target.split(".")
        return (len(attr.users) == 1 and self.reads[target] == 1
                and not any(".".join(parts[:i]) in self.called for i in range(1, len(parts)))
                and self.names[id(get_attr_value(self.gm, target))] <= 1)


_AFFINE_OPS = ("Add", "Sub", "Mul")


def _constant_operand(gm: fx.GraphModule, node: fx.Node, src: fx.Node,
                      modules: dict[str, nn.Module]) -> tuple[str, torch.Tensor, fx.Node | None] | None:
    """(op type, constant, its get_attr) when ``node`` is ``src + c``, ``c + src``, ``src - c``, ``src * c`` or
    ``c * src`` for a constant ``c`` (a stored tensor or a number)."""
    t = op_type(node, modules)
    if t not in _AFFINE_OPS or node.kwargs or len(node.args) != 2:
        return None
    if node.args[0] is not src and mutates_first_argument(node, modules):  # ``c.add_(conv(x))`` writes into c
        return None
    if node.args[0] is src:
        other = node.args[1]
    elif node.args[1] is src and t != "Sub":
        other = node.args[0]
    else:
        return None
    if isinstance(other, (int, float)) and not isinstance(other, bool):
        return t, torch.tensor(float(other)), None
    if isinstance(other, fx.Node) and other.op == "get_attr":
        value = get_attr_value(gm, str(other.target))
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return t, value.detach(), other
    return None


def _per_channel(value: torch.Tensor, out: torch.Tensor, axis: int) -> torch.Tensor | None:
    """``value`` as one number per channel of ``out`` (channels on ``axis``), when broadcasting it against ``out``
    varies it along that axis only; None otherwise."""
    if value.dim() > out.dim():
        return None
    shape = [1] * (out.dim() - value.dim()) + list(value.shape)
    channels = out.shape[axis]
    if any(size != 1 for i, size in enumerate(shape) if i != axis % out.dim()) or shape[axis] not in (1, channels):
        return None
    return value.reshape(-1).expand(channels) if value.numel() == 1 else value.reshape(channels)


_MATMUL_FUNCTIONS = (torch.matmul, operator.matmul, torch.mm)


def _constant_matrix(gm: fx.GraphModule, node: fx.Node, modules: dict[str, nn.Module]) -> fx.Node | None:
    """The ``get_attr`` of the constant 2-D matrix ``W`` when ``node`` computes ``x @ W`` (and nothing else)."""
    if node.kwargs or len(node.args) != 2 or op_type(node, modules) != "MatMul":
        return None
    if not (node.op == "call_module" or (node.op == "call_method" and node.target == "matmul")
            or (node.op == "call_function" and node.target in _MATMUL_FUNCTIONS)):
        return None
    x, w = node.args
    if not (isinstance(x, fx.Node) and x.op != "get_attr" and isinstance(w, fx.Node) and w.op == "get_attr"):
        return None
    value = get_attr_value(gm, str(w.target))
    return w if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() == 2 else None


def matmul_to_linear(gm: fx.GraphModule) -> fx.GraphModule:
    """Rewrite ``x @ W`` by a constant matrix (an ONNX MatMul initializer, as paddle2onnx and torch.onnx write a
    fully connected layer) as ``F.linear(x, W.T)``: platforms then quantize ``W`` per output channel as a Gemm's
    weight, and a bias added after it folds in (:func:`fold_constant_affine`) instead of being quantized apart."""
    modules = dict(gm.named_modules())
    owners = _Owners(gm)
    rewritten = False
    for node in list(gm.graph.nodes):
        w = _constant_matrix(gm, node, modules)
        if w is None:
            continue
        stored = get_attr_value(gm, str(w.target))
        target = str(w.target) if owners.sole(w) else f"{node.name}_weight"
        set_attr_value(gm, target, nn.Parameter(stored.detach().t().contiguous(), requires_grad=stored.requires_grad))
        with gm.graph.inserting_before(node):
            weight = w if target == w.target else gm.graph.get_attr(target)
            linear = gm.graph.call_function(F.linear, (node.args[0], weight))
        linear.meta = dict(node.meta)
        node.replace_all_uses_with(linear)
        gm.graph.erase_node(node)
        reuse_node_name(linear, node.name)
        rewritten = True
    return _finish(gm) if rewritten else gm


def _output_channels(conv: fx.Node, weight: torch.Tensor, out: torch.Tensor) -> tuple[int, int | None]:
    """(axis, count) of ``conv``'s output channels, as its weight says; count None when the output does not
    have them there (a linear with a 1-D weight has none)."""
    if conv.target is F.linear:
        axis, channels = -1, (weight.shape[0] if weight.dim() == 2 else None)
    elif conv.target in _CONVT_FUNCS.values():
        groups = conv.args[6] if len(conv.args) > 6 else conv.kwargs.get("groups", 1)
        axis, channels = (1 if out.dim() == weight.dim() else 0), weight.shape[1] * int(groups)
    else:
        axis, channels = (1 if out.dim() == weight.dim() else 0), weight.shape[0]
    if channels is None or out.dim() == 0 or out.shape[axis] != channels:
        return axis, None
    return axis, channels


def fold_constant_affine(gm: fx.GraphModule) -> fx.GraphModule:
    """Fold ``conv(x) + c``, ``conv(x) - c`` and ``conv(x) * c`` into the conv / linear before it, for a constant
    ``c`` that is one number or one per output channel (a bias kept apart, a learned scale / shift).

    What onnxruntime (Conv + Add / Mul fusion), TensorRT and ncnn do to such chains before they run them: quantized
    unfolded, each step of a conv -> Add -> Mul -> Add chain (PP-LCNetV3's learnable affine blocks) would round
    once more, and a bias would round to the grid of the activation it is added to. Needs ``meta["val"]``
    (:func:`propagate_tensor_meta`): the constant may not broadcast the conv's output to another shape.
    """
    modules = dict(gm.named_modules())
    owners = _Owners(gm)
    folded = False
    for node in list(gm.graph.nodes):
        if len(node.all_input_nodes) == 0:
            continue
        src = node.all_input_nodes[0] if node.all_input_nodes[0].op != "get_attr" else node.all_input_nodes[-1]
        parts = _weighted_parts(src)
        found = _constant_operand(gm, node, src, modules) if parts is not None and _sole_reader(src, node) else None
        out, result = src.meta.get("val"), node.meta.get("val")
        if found is None or not isinstance(out, torch.Tensor) or not isinstance(result, torch.Tensor) or (
                result.shape != out.shape or result.dtype != out.dtype):
            continue
        if not (owners.sole(parts[0]) and owners.sole(parts[1])):
            continue
        t, value, attr = found
        axis, channels = _output_channels(src, get_attr_value(gm, str(parts[0].target)), out)
        per_channel = _per_channel(value, out, axis) if channels is not None else None
        if per_channel is None or per_channel.numel() != channels:
            continue
        per_channel = per_channel.to(out.dtype)
        ones, zeros = torch.ones_like(per_channel), torch.zeros_like(per_channel)
        factor, shift = {"Mul": (per_channel, zeros), "Add": (ones, per_channel), "Sub": (ones, -per_channel)}[t]
        _scale_shift(gm, src, parts[0], parts[1], factor, shift)
        node.replace_all_uses_with(src)
        src.meta["folded_affine"] = [*src.meta.get("folded_affine", []), node.name]
        gm.graph.erase_node(node)
        if attr is not None and not attr.users:
            gm.graph.erase_node(attr)
        folded = True
    return _finish(gm) if folded else gm


def propagate_tensor_meta(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> fx.GraphModule:
    """Record each node's output value description in ``node.meta["val"]`` (fake tensors, no compute).

    Falls back to one real forward pass when a module cannot run on fake tensors. An exception from a node
    carries that node's name in ``exc.fxq_node``.
    """
    try:
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        fake_inputs = [mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in example_inputs]
        with _meta_failures_unlogged():
            _FakeProp(gm, mode).propagate(*fake_inputs)
    except Exception as exc:  # data-dependent modules: run for real
        logger.debug("fake tensor propagation failed (%s); using a real forward pass", exc)
        without_grad_first(lambda: _RealProp(gm).run(*example_inputs))
    return gm


_FAKE_TENSOR_LOG = logging.getLogger("torch._subclasses.fake_tensor")


def _drop_meta_failure(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("failed while attempting to run meta")


@contextmanager
def _meta_failures_unlogged() -> Iterator[None]:
    """torch logs an ERROR with a traceback for every op whose meta kernel fails (a shape mismatch in a batch the
    model cannot take): fxq falls back or names the node itself, so that log only printed ~45 lines of torch's
    stack to the user's stderr before fxq's own one-line error."""
    _FAKE_TENSOR_LOG.addFilter(_drop_meta_failure)
    try:
        yield
    finally:
        _FAKE_TENSOR_LOG.removeFilter(_drop_meta_failure)


class _FakeProp(Interpreter, FakeTensorProp):  # fresh list arguments (see Interpreter)
    pass


class _RealProp(Interpreter):
    def run_node(self, n: fx.Node) -> Any:
        try:
            result = super().run_node(n)
        except Exception as exc:
            if not hasattr(exc, "fxq_node"):
                try:
                    exc.fxq_node = n.name  # type: ignore[attr-defined]
                except AttributeError:  # an exception type without a __dict__
                    pass
            raise
        # kept without its autograd record: the values live as long as the graph
        n.meta["val"] = pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, result)
        return result


class _GraphSnapshot:
    """The graph as traced, over the same modules and tensors: run only to tell whether a failure after fxq's
    rewrites is fxq's (the traced graph runs the batch) or the data's (it does not either)."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.graph = fx.Graph()
        self.graph.output(self.graph.graph_copy(gm.graph, {}))
        self.owners: dict[str, Any] = {}
        for n in self.graph.nodes:
            if n.op == "call_module":
                self.owners[str(n.target)] = gm.get_submodule(str(n.target))
            elif n.op == "get_attr":
                self.owners[str(n.target)] = get_attr_value(gm, str(n.target))

    def runs(self, example_inputs: Sequence[Any]) -> bool:
        try:
            with torch.no_grad():
                fx.GraphModule(self.owners, self.graph)(*example_inputs)
        except Exception:
            return False
        return True


_FACTORIES = frozenset({torch.zeros, torch.ones, torch.full, torch.arange, torch.eye, torch.linspace})
"""Calls that make a tensor from constant arguments alone (ConViT's relative indices: ``zeros``, ``arange``...)."""
_LARGEST_FOLD = 1 << 24
"""Elements of the largest value :func:`fold_stored_computations` stores (an expand of a small tensor to a huge one
stays a computation)."""
_VIEWS = frozenset({"Slice", "Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze", "Expand", "Identity",
                    "Split"})
_FAILED = object()


def _written(graph: fx.Graph, modules: dict[str, nn.Module]) -> set[fx.Node]:
    """The values an op changes in place, directly or through views (``self.state[:, :].copy_(x)``); not a value
    computed for its in-place ops alone (Swin-V2's position MLP: ``nn.ReLU(inplace=True)`` after a Linear, then
    ``.mul_(s)``): a chain of in-place ops, each the only reader of the one before, on a fresh value that no other
    op sees. An in-place op returns the value it wrote, so a write into its result writes the whole chain."""
    out: set[fx.Node] = set()
    for node in graph.nodes:
        if not (node.args and isinstance(node.args[0], fx.Node) and mutates_first_argument(node, modules)):
            continue
        chain = [node.args[0]]
        while chain[-1].args and isinstance(chain[-1].args[0], fx.Node) and mutates_first_argument(chain[-1], modules):
            chain.append(chain[-1].args[0])
        root = chain[-1]
        if (root.op in ("call_function", "call_method", "call_module") and op_type(root, modules) not in _VIEWS
                and all(len(value.users) == 1 for value in chain)):
            continue
        for value in chain:
            while isinstance(value, fx.Node) and value not in out:
                out.add(value)
                view = op_type(value, modules) in _VIEWS and value.args
                value = value.args[0] if view else None
    return out


def _run_alone(node: fx.Node, values: dict[fx.Node, Any], modules: dict[str, nn.Module]) -> Any:
    """``node``'s value from its inputs' ``values``, or ``_FAILED``: it raised, or it draws random numbers (two runs
    under other seeds differ; the caller's random state is left as it was)."""
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), values.__getitem__)
    writes = mutates_first_argument(node, modules) and isinstance(args[0], torch.Tensor)

    def run() -> Any:
        # an in-place op writes into a copy, once per run: the value it writes is its own (:func:`_written`)
        call = (args[0].clone(), *args[1:]) if writes else args
        if node.op == "call_function":
            return node.target(*call, **kwargs)
        if node.op == "call_method":
            return getattr(call[0], str(node.target))(*call[1:], **kwargs)
        return modules[str(node.target)](*call, **kwargs)

    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            first = run()
            torch.manual_seed(1)
            second = run()
    except Exception:  # noqa: BLE001 - what cannot run alone stays a computation of the graph
        return _FAILED
    return first if _same(first, second) else _FAILED


def _same(a: Any, b: Any) -> bool:
    """Whether two runs gave the same value (NaN where the other has NaN counts as the same)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and (
            torch.equal(a, b) or (a.is_floating_point() and torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def _trainable_sources(node: fx.Node, modules: dict[str, nn.Module]) -> set[str]:
    """The trainable module (its path) a folded call runs, if any: stored tensors are followed through ``sources``."""
    if node.op == "call_module" and any(p.requires_grad for p in modules[str(node.target)].parameters()):
        return {str(node.target)}
    return set()


@torch.no_grad()
def fold_stored_computations(gm: fx.GraphModule) -> fx.GraphModule:
    """Compute once what the graph computes from stored tensors alone, and store the result.

    timm's ``StdConv2d`` (BiT, ResNetV2 hybrids, NFNets) standardizes its weight with ``F.batch_norm(training=True)``
    on every call, which torch.onnx cannot write; a relative-position MLP runs on stored coordinates; ConViT builds
    its relative indices from ``zeros`` / ``arange`` (:data:`_FACTORIES`, the calls folded without inputs). Folded, a
    weight quantizer sees the weight the conv uses, exporters write an initializer, and the simulation stops
    recomputing it. A value computed from trainable parameters is stored as a trainable parameter (as BatchNorm
    folding leaves a conv's weight) and the parameters it replaces leave the model; it stays a computation when
    those parameters are read elsewhere too (tied weights: training would untie them). Values written in place
    (through views too), random draws, and results over 16 M elements stay computations. QAT that should keep
    training the computation itself (a standardized weight staying standardized) prepares with ``fold_bn=False``.
    """
    graph = gm.graph
    modules = dict(gm.named_modules())
    written = _written(graph, modules)
    values: dict[fx.Node, Any] = {}
    sources: dict[fx.Node, set[str]] = {}
    for node in graph.nodes:
        if node in written:
            continue
        if node.op == "get_attr":
            values[node] = value = get_attr_value(gm, str(node.target))
            sources[node] = {str(node.target)} if isinstance(value, nn.Parameter) and value.requires_grad else set()
            continue
        if node.op not in ("call_function", "call_method", "call_module") or not (
                node.all_input_nodes or node.target in _FACTORIES) or any(i not in values for i in node.all_input_nodes):
            continue
        result = _run_alone(node, values, modules)
        if result is _FAILED:
            continue
        values[node] = result
        sources[node] = set().union(_trainable_sources(node, modules), *(sources[i] for i in node.all_input_nodes))
    read_live = {str(n.target) for n in graph.nodes if (n.op == "get_attr" and any(u not in values for u in n.users))
                 or (n.op == "call_module" and n not in values)}

    def tied(path: str) -> bool:  # read by something that stays a computation (or its owner module is called)
        return any(t == path or t.startswith(path + ".") or path.startswith(t + ".") for t in read_live)

    folded: set[str] = set()
    count = 0
    for node in list(graph.nodes):
        value = values.get(node)
        if node.op == "get_attr" or not isinstance(value, torch.Tensor) or value.numel() > _LARGEST_FOLD or all(
                u in values for u in node.users) or any(tied(p) for p in sources[node]):
            continue
        name = f"fxq_stored_{node.name}"
        while hasattr(gm, name):
            name += "_"
        stored = value.detach().clone()
        if sources[node] and stored.is_floating_point():
            gm.register_parameter(name, nn.Parameter(stored))
        else:
            gm.register_buffer(name, stored)
        with graph.inserting_before(node):
            attr = graph.get_attr(name)
        attr.meta.update({k: v for k, v in node.meta.items() if k in ("val", "tensor_meta", "stack_trace")})
        node.replace_all_uses_with(attr)
        folded |= sources[node]
        count += 1
    if not count:
        return gm
    for node in reversed(list(graph.nodes)):
        if node in values and not node.users:
            graph.erase_node(node)
    read = {str(n.target) for n in graph.nodes if n.op == "get_attr"}
    called = {str(n.target) for n in graph.nodes if n.op == "call_module"}
    for path in folded - read:  # a replaced parameter would sit unread (DDP refuses unused parameters)
        owner_path, _, attr_name = path.rpartition(".")
        if any(owner_path == c or owner_path.startswith(c + ".") for c in called):
            continue  # its module (or one around it) still runs and reads it
        owner = gm.get_submodule(owner_path) if owner_path else gm
        if attr_name in owner._parameters:
            delattr(owner, attr_name)
    logger.debug("%d values computed from stored tensors alone folded into stored tensors", count)
    return _finish(gm)


def standardize(gm: fx.GraphModule, example_inputs: Sequence[Any] | None = None,
                fold_bn: bool = True) -> fx.GraphModule:
    """The preparation pipeline every model goes through before dispatch.

    Raises:
        GraphError: fxq's own rewrites broke a graph that runs ``example_inputs`` as traced (naming the node);
            a batch the traced graph cannot run either raises torch's error as it is (the caller names the data).
    """
    snapshot = _GraphSnapshot(gm) if example_inputs is not None else None
    with _code_generated_once(gm):
        decompose_attention_functions(gm)  # SDPA -> matmul / float mask / softmax / matmul, quantizable
        remove_identity_nodes(gm)
        decompose_compound_arithmetic(gm)
        functionalize_weighted_modules(gm)
        functionalize_padding_modules(gm)
        if fold_bn:
            fold_stored_computations(gm)  # first: a StdConv's weight becomes stored, and its BatchNorm then folds
            fold_batchnorm(gm)
        if example_inputs is not None:
            try:
                propagate_tensor_meta(gm, example_inputs)
                # these need the shapes (a diff its input's dtype); what they add or rewrite then needs them again
                before = [(n.op, n.target) for n in gm.graph.nodes]
                decompose_compound_arithmetic(gm)
                if fold_bn:
                    fold_batchnorm_through_row_views(fold_constant_affine(matmul_to_linear(gm)))  # a bias Add first
                if [(n.op, n.target) for n in gm.graph.nodes] != before:
                    propagate_tensor_meta(gm, example_inputs)
            except Exception as exc:
                if snapshot is None or not snapshot.runs(example_inputs):
                    raise
                node = getattr(exc, "fxq_node", None)
                where = f"node {node!r}" if node else "the graph"
                raise GraphError(
                    f"fxq's graph preparation (identity removal, addcmul / addcdiv written out, functionalized "
                    f"weights, BatchNorm and constant "
                    f"affine folding, MatMul by a stored matrix as a linear) broke "
                    f"{where}: the traced model runs this batch, the prepared graph does not ({type(exc).__name__}: "
                    f"{str(exc).splitlines()[0] if str(exc) else ''}). This is fxq's fault, not the data's; please "
                    f"report it. Meanwhile try fold_bn=False, or keep the module around {where} whole with "
                    f"leaf_modules=[...]"
                ) from exc
    return gm


def rewrite_out_of_place(graph: fx.Graph, modules: dict[str, Any]) -> dict[fx.Node, fx.Node]:
    """Rewrite ``graph`` so that no node writes into an existing value; returns ``{value: node now holding it}``.

    For sub-graphs whose values outlive a run (cached block inputs, probed outputs) or alias each other (a
    disabled quantizer returns its input): ``nn.ReLU(inplace=True)``, ``x += y``, ``relu_()`` become their
    out-of-place forms (a module gets a non-in-place copy in ``modules``, under a new target); ops without one
    (``setitem``, ``fill_``) write into a clone. Later readers of the written value read the new node, so
    the graph computes what it did. A write through a view (``x.view(-1).add_(1)``) is not followed.
    """
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    moved: dict[fx.Node, fx.Node] = {}
    for n in nodes:
        if not n.args or not isinstance(n.args[0], fx.Node) or not mutates_first_argument(n, modules):
            continue
        written = n.args[0]
        new_value = n if _drop_in_place(n, modules) else None
        if new_value is None:  # no out-of-place form: write into a copy
            with graph.inserting_before(n):
                new_value = graph.call_method("clone", (written,))
            n.args = (new_value, *n.args[1:])
        redirect_later_readers(written, new_value, n, order)
        moved[written] = new_value
    return moved


def _drop_in_place(n: fx.Node, modules: dict[str, Any]) -> bool:
    """Turn ``n`` into its out-of-place form where there is one (True)."""
    form = out_of_place_form(n, modules)
    if form is None:
        return False
    op, target, inplace_off = form
    if op == "call_module":
        modules[f"{n.target}__out_of_place"] = target
        target = f"{n.target}__out_of_place"
    n.target = target
    if inplace_off:
        n.kwargs = {**n.kwargs, "inplace": False}
    return True
