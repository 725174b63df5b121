"""Ops that ONNX files spell out and ncnn has one layer for, rewritten in the export's own copy of the graph.

``torch.onnx.export`` writes ``F.gelu`` (exact form) before opset 20 as ``x * 0.5 * (1 + erf(x / sqrt(2)))``, and
ncnn has no ``Erf`` (its ``UnaryOp`` stops at trigonometry and rounding), so an ONNX-loaded ViT would not export.
The pattern is the definition of GELU, so it becomes one ``F.gelu`` node, which ncnn runs as ``GELU``. The
quantized model itself keeps its graph: only the exporter's copy is rewritten.
"""
from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx

from fxq.graph.nodes import get_attr_value
from fxq.graph.op_types import op_type

__all__ = ["fuse_erf_gelu"]

logger = logging.getLogger(__name__)

_SQRT2 = math.sqrt(2.0)


def fuse_erf_gelu(gm: fx.GraphModule) -> int:
    """Replace each ``x * 0.5 * (1 + erf(x / sqrt(2)))`` of ``gm`` (factors in any order, ``x * (1 / sqrt(2))``
    too) by ``F.gelu(x)``, in place; returns how many. An Erf outside this pattern is left as it is."""
    modules = dict(gm.named_modules())
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    count = 0
    for erf in [n for n in gm.graph.nodes if op_type(n, modules) == "Erf"]:
        match = _match(gm, modules, erf)
        if match is None:
            continue
        x, out, interior = match
        with gm.graph.inserting_after(out):
            gelu = gm.graph.call_function(F.gelu, (x,))
        gelu.meta["val"] = out.meta.get("val")
        if "onnx" in erf.meta:  # the ncnn layer is named after the ONNX Erf node
            gelu.meta["onnx"] = erf.meta["onnx"]
        out.replace_all_uses_with(gelu)
        for n in sorted(interior, key=order.__getitem__, reverse=True):
            gm.graph.erase_node(n)
        count += 1
    if count:
        gm.recompile()
        logger.debug("ncnn export: %d erf-spelled GELU(s) written as GELU layers", count)
    return count


def _match(gm: fx.GraphModule, modules: dict[str, Any], erf: fx.Node) -> tuple[fx.Node, fx.Node, list[fx.Node]] | None:
    """(x, the node computing the GELU, the nodes it replaces) of the GELU around ``erf``; None if not one."""

    def t(n: Any) -> str | None:
        return op_type(n, modules) if isinstance(n, fx.Node) else None

    def only_user(n: fx.Node) -> fx.Node | None:
        return next(iter(n.users)) if len(n.users) == 1 else None

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
        if other is x and not has_x:
            has_x = True
        elif s is not None:
            factor *= s
        elif isinstance(other, fx.Node) and t(other) == "Mul" and only_user(other) is m and not has_x and \
                (split(other) or (None, None))[0] is x and split(other)[1] is not None:
            has_x, factor = True, factor * split(other)[1]  # (x * 0.5) * (1 + erf)
            interior.append(other)
        else:
            return None
        interior.append(m)
        cur = m
        if has_x and math.isclose(factor, 0.5, rel_tol=1e-6):
            return x, cur, interior
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
