"""Ops that ONNX files spell out and ncnn has one layer for, rewritten in the export's own copy of the graph.

``torch.onnx.export`` writes ``F.gelu`` (exact form) before opset 20 as ``x * 0.5 * (1 + erf(x / sqrt(2)))``, and
ncnn has no ``Erf`` (its ``UnaryOp`` stops at trigonometry and rounding), so an ONNX-loaded ViT would not export.
The pattern is the definition of GELU, so it becomes one ``F.gelu`` node, which ncnn runs as ``GELU``. Before
opset 17 ``LayerNorm`` is nine ops (two ``ReduceMean``, ``Pow``, ``Sqrt``...), one ``F.layer_norm`` node here.
The quantized model itself keeps its graph: only the exporter's copy is rewritten.
"""
from __future__ import annotations

import logging
import math
import operator
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import fx

from fxq.backends.ncnn.islands import MODEL_NODE
from fxq.graph.nodes import get_attr_value
from fxq.graph.op_types import NORM_FUNCTIONS, norm_args, op_type

__all__ = ["drop_broadcast_expands", "fuse_erf_gelu", "fuse_layer_norm", "is_noop_reduce", "reduce_args", "FUSED_OPS"]

FUSED_OPS = frozenset({"Erf", "Sqrt", "Expand"})
"""Op types that mark a graph these rewrites may change (the exporter copies such a graph first)."""

logger = logging.getLogger(__name__)

_SQRT2 = math.sqrt(2.0)


def fuse_erf_gelu(gm: fx.GraphModule) -> int:
    """Replace each ``x * 0.5 * (1 + erf(x / sqrt(2)))`` of ``gm`` (factors in any order, ``x * (1 / sqrt(2))``
    too) by ``F.gelu(x)``, in place; returns how many. An Erf outside this pattern is left as it is."""
    return _rewrite(gm, "Erf", _match, F.gelu, "erf-spelled GELU")


def fuse_layer_norm(gm: fx.GraphModule) -> int:
    """Replace each ``(x - mean(x)) / sqrt(mean((x - mean(x)) ** 2) + eps) [* gamma] [+ beta]`` over the last dims
    of ``gm`` by ``F.layer_norm``, in place; returns how many."""
    return _rewrite(gm, "Sqrt", _match_layer_norm, F.layer_norm, "spelled-out LayerNorm")


_BROADCASTING = frozenset({"Add", "Sub", "Mul", "Div"})


def drop_broadcast_expands(gm: fx.GraphModule) -> int:
    """Read the input of each ``Expand`` whose every user is elementwise arithmetic whose other operand already
    has the result's shape (``F.normalize`` as torch.onnx writes it: ``x / Expand(Clip(ReduceL2(x)), Shape(x))``),
    in place; returns how many. The arithmetic broadcasts the smaller value to the same result (ncnn's
    ``BinaryOp`` does too), and ncnn has no layer that expands; other ``Expand`` nodes are left as they are."""
    modules = dict(gm.named_modules())
    count = 0
    for node in [n for n in gm.graph.nodes if op_type(n, modules) == "Expand"]:
        src = node.args[0] if node.args else None
        if not isinstance(src, fx.Node) or not node.users or not all(
                _broadcasts_to_itself(u, node, modules) for u in node.users):
            continue
        node.replace_all_uses_with(src)
        inputs = [a for a in node.all_input_nodes if a is not src]
        gm.graph.erase_node(node)
        for a in inputs:  # the target shape (Shape(x)), now unused
            if not a.users and a.op == "call_module" and op_type(a, modules) == "Shape":
                gm.graph.erase_node(a)
        count += 1
    if count:
        gm.recompile()
        logger.debug("ncnn export: %d Expand(s) left to the broadcasting of their arithmetic", count)
    return count


def _broadcasts_to_itself(user: fx.Node, expand: fx.Node, modules: dict[str, Any]) -> bool:
    """``user`` is two-operand arithmetic of ``expand`` and a value of ``user``'s own shape."""
    if op_type(user, modules) not in _BROADCASTING or len(user.args) != 2 or user.kwargs:
        return False
    others = [a for a in user.args if a is not expand]
    out = user.meta.get("val")
    if len(others) != 1 or not isinstance(others[0], fx.Node) or not isinstance(out, torch.Tensor):
        return False
    val = others[0].meta.get("val")
    return isinstance(val, torch.Tensor) and tuple(val.shape) == tuple(out.shape)


def _rewrite(gm: fx.GraphModule, anchor: str, match: Callable[..., Any], target: Callable[..., Any], what: str
             ) -> int:
    """Replace each pattern ``match(gm, modules, node)`` finds around a node of op type ``anchor`` — (x, the node
    computing it, the nodes it replaces, more arguments) — by one ``target(x, *arguments)`` node, named after the
    anchor's ONNX node."""
    modules = dict(gm.named_modules())
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    count = 0
    for node in [n for n in gm.graph.nodes if op_type(n, modules) == anchor]:
        found = match(gm, modules, node)
        if found is None:
            continue
        x, out, interior, args = found
        with gm.graph.inserting_after(out):
            new = gm.graph.call_function(target, (x, *args))
        new.meta["val"] = out.meta.get("val")
        new.meta[MODEL_NODE] = out.meta.get(MODEL_NODE, out.name)
        if "onnx" in node.meta:
            new.meta["onnx"] = node.meta["onnx"]
        out.replace_all_uses_with(new)
        for n in sorted(interior, key=order.__getitem__, reverse=True):
            gm.graph.erase_node(n)
        count += 1
    if count:
        gm.recompile()
        logger.debug("ncnn export: %d %s(s) written as one layer each", count, what)
    return count


def _match(gm: fx.GraphModule, modules: dict[str, Any], erf: fx.Node
           ) -> tuple[fx.Node, fx.Node, list[fx.Node], tuple[()]] | None:
    """(x, the node computing the GELU, the nodes it replaces) of the GELU around ``erf``; None if not one."""

    def t(n: Any) -> str | None:
        return op_type(n, modules) if isinstance(n, fx.Node) else None

    def only_user(n: fx.Node) -> fx.Node | None:
        return next(iter(n.users)) if len(n.users) == 1 else None

    def same(a: Any, b: Any) -> bool:  # onnx2torch gives each reader of a Split output its own getitem
        return a is b or (isinstance(a, fx.Node) and isinstance(b, fx.Node) and a.target is operator.getitem
                          and b.target is operator.getitem and a.args == b.args)

    def split(n: fx.Node) -> tuple[Any, float | None] | None:
        """(other operand, scalar) of a binary node with one scalar operand (the scalar second for Div)."""
        if len(n.args) != 2 or n.kwargs:
            return None
        a, b = n.args
        if t(n) == "Div":
            return a, _scalar(gm, b)
        sa, sb = _scalar(gm, a), _scalar(gm, b)
        return (b, sa) if sa is not None else (a, sb)

    u = erf.args[0] if len(erf.args) == 1 and isinstance(erf.args[0], fx.Node) else None
    if u is None or only_user(u) is not erf or t(u) not in ("Div", "Mul"):
        return None
    x, c = split(u) or (None, None)
    if not isinstance(x, fx.Node) or c is None or not math.isclose(c if t(u) == "Div" else 1.0 / c, _SQRT2,
                                                                       rel_tol=1e-5):
        return None
    one = only_user(erf)
    if one is None or t(one) != "Add" or split(one) is None or split(one)[0] is not erf or split(one)[1] != 1.0:
        return None
    interior, cur, factor, has_x = [u, erf, one], one, 1.0, False
    for _ in range(2):  # the product of (1 + erf), x and 0.5: two Muls
        m = only_user(cur)
        if m is None or t(m) != "Mul" or len(m.args) != 2 or m.kwargs:
            return None
        (other,) = [a for a in m.args if a is not cur] or [None]
        s = _scalar(gm, other)
        if same(other, x) and not has_x:
            has_x = True
        elif s is not None:
            factor *= s
        elif isinstance(other, fx.Node) and t(other) == "Mul" and only_user(other) is m and not has_x and \
                same((split(other) or (None, None))[0], x) and split(other)[1] is not None:
            has_x, factor = True, factor * split(other)[1]  # (x * 0.5) * (1 + erf)
            interior.append(other)
        else:
            return None
        interior.append(m)
        cur = m
        if has_x and math.isclose(factor, 0.5, rel_tol=1e-6):
            return x, cur, interior, ()
    return None


def _scalar(gm: fx.GraphModule, value: Any) -> float | None:
    """``value`` as a number: a Python number, or a one-element stored tensor (an ONNX initializer)."""
    if isinstance(value, fx.Node) and value.op == "get_attr":
        value = get_attr_value(gm, str(value.target))
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point():
        return float(value.reshape(-1)[0])
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def reduce_args(node: fx.Node, modules: dict[str, Any], op: str = "ReduceMean") -> tuple[Any, bool] | None:
    """(dims, keepdim) of a ``Reduce*`` node of ONNX op type ``op`` (dims None or empty = all): from torch's
    ``x.mean`` / ``torch.sum`` / ``torch.amax``... (dim and keepdim in the same places), fxq's ``OnnxReduce``,
    onnx2torch's ``OnnxReduceStaticAxes`` / ``OnnxReduceSumStaticAxes``; None for a module of another op, a
    no-op one (``noop_with_empty_axes``) or one whose axes are a runtime input, which ncnn cannot take."""
    mod = modules.get(str(node.target)) if node.op == "call_module" else None
    if mod is None and op in ("ReduceL1", "ReduceL2") and (node.target == "norm" or node.target in NORM_FUNCTIONS):
        _, _, dims, keep = norm_args(node)
        return dims, keep
    if mod is None:
        dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        return dims, bool(node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))
    if is_noop_reduce(mod):
        return None
    if getattr(mod, "op_type", None) == op and hasattr(mod, "dims"):  # fxq's OnnxReduce
        return mod.dims, bool(mod.keepdim)
    if getattr(mod, "operation_type", None) == op and hasattr(mod, "axes"):  # onnx2torch, up to opset 13
        return mod.axes, bool(mod.keepdims)
    if op == "ReduceSum" and hasattr(mod, "_axes") and hasattr(mod, "_keepdims"):  # onnx2torch's ReduceSum-13
        return mod._axes, bool(mod._keepdims)
    return None


def is_noop_reduce(mod: Any) -> bool:
    """A reduce module of empty axes with ``noop_with_empty_axes`` (fxq's ``OnnxReduce``, onnx2torch's
    ReduceSum-13): it passes its input through."""
    return bool(getattr(mod, "noop", False)) or (
        bool(getattr(mod, "_noop_with_empty_axes", 0)) and not getattr(mod, "_axes", None))


def _match_layer_norm(gm: fx.GraphModule, modules: dict[str, Any], sqrt: fx.Node
                      ) -> tuple[fx.Node, fx.Node, list[fx.Node], tuple[Any, ...]] | None:
    """(x, the node computing the LayerNorm, the nodes it replaces, F.layer_norm's other arguments) of the
    LayerNorm around ``sqrt``; None if not one."""

    def t(n: Any) -> str | None:
        return op_type(n, modules) if isinstance(n, fx.Node) else None

    def users(n: fx.Node) -> list[fx.Node]:
        return list(n.users)

    def operands(n: fx.Node) -> list[Any]:
        return list(n.args) if len(n.args) == 2 and not n.kwargs else []

    def trailing(mean: fx.Node, rank: int) -> int | None:
        """How many last dims ``mean`` averages (keeping them), or None."""
        got = reduce_args(mean, modules) if t(mean) == "ReduceMean" else None
        if got is None or not got[1] or got[0] is None:
            return None
        dims = sorted({int(d) % rank for d in ((got[0],) if isinstance(got[0], int) else got[0])})
        return len(dims) if dims == list(range(rank - len(dims), rank)) else None

    var_eps = sqrt.args[0] if len(sqrt.args) == 1 and isinstance(sqrt.args[0], fx.Node) else None
    if var_eps is None or t(var_eps) != "Add" or len(sqrt.users) != 1 or len(var_eps.users) != 1:
        return None
    (var,) = [a for a in operands(var_eps) if isinstance(a, fx.Node) and t(a) == "ReduceMean"] or [None]
    eps = next((_scalar(gm, a) for a in operands(var_eps) if a is not var), None)
    if var is None or eps is None or len(var.users) != 1:
        return None
    sq = var.args[0]
    if t(sq) != "Pow" or len(sq.users) != 1 or len(operands(sq)) != 2 or _scalar(gm, sq.args[1]) != 2.0:
        return None
    centred = sq.args[0]
    if t(centred) != "Sub" or len(operands(centred)) != 2:
        return None
    x, mean = centred.args
    (div,) = [u for u in users(centred) if u is not sq] or [None]
    if (len(centred.users) != 2 or div is None or t(div) != "Div" or operands(div) != [centred, sqrt] or
            not isinstance(x, fx.Node) or t(mean) != "ReduceMean" or mean.args[:1] != (x,) or len(mean.users) != 1):
        return None
    val = x.meta.get("val")
    rank = getattr(val, "ndim", 0)
    k = trailing(mean, rank) if rank else None
    if k is None or trailing(var, rank) != k:
        return None
    shape = tuple(int(d) for d in val.shape[rank - k:])
    interior, out, affine = [mean, centred, sq, var, var_eps, sqrt, div], div, []
    for want in ("Mul", "Add"):  # gamma, then beta: stored tensors of the normalized shape
        nxt = next(iter(out.users)) if len(out.users) == 1 else None
        other = [a for a in operands(nxt) if a is not out] if nxt is not None and t(nxt) == want else []
        param = other[0] if len(other) == 1 else None
        if not (isinstance(param, fx.Node) and param.op == "get_attr"
                and tuple(get_attr_value(gm, str(param.target)).shape) == shape):
            break
        affine.append(param)
        interior.append(nxt)
        out = nxt
    weight = affine[0] if affine else None
    bias = affine[1] if len(affine) > 1 else None
    return x, out, interior, (list(shape), weight, bias, eps)
