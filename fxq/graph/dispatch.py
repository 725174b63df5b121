"""Dispatch: which nodes run quantized on which platform, which stay FP32, which are shape/index math.

Dispatchers are registered by name (``conservative`` default, ``aggressive``, ``pointwise``, ``allin``)
and a user ``dispatching_table`` (node/module name or regex -> ``"fp32"``, a platform name, or a dict of
per-layer overrides) has the last word. Shape/index computations are never quantized.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import fx, nn

from fxq.errors import ConfigError
from fxq.graph.info import match_node_name
from fxq.graph.op_types import op_type
from fxq.qconfig.base import COMPUTING_OPS, SHAPE_OPS, Platform, get_platform
from fxq.registry import Registry

__all__ = ["dispatch", "DISPATCHERS", "register_dispatcher", "is_float_tensor", "shape_nodes", "Dispatch"]

Dispatch = dict[fx.Node, "Platform | str"]
"""node -> Platform (quantized), "fp32", or "shape"."""

DISPATCHERS: Registry[Callable[..., bool]] = Registry("dispatcher")


def register_dispatcher(name: str):
    """Register ``rule(node_type, platform, quantized_inputs: bool) -> bool`` under ``name``."""
    return DISPATCHERS.register(name)


def is_float_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def _data_inputs(node: fx.Node) -> list[fx.Node]:
    return [n for n in node.all_input_nodes if n.op != "get_attr"]


def shape_nodes(gm: fx.GraphModule, modules: dict[str, nn.Module]) -> set[fx.Node]:
    """Nodes that compute shapes or indices (forward from shape ops and non-float values, backward
    from values consumed only by such nodes)."""
    shape: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        t = op_type(node, modules)
        val = node.meta.get("val")
        if t in SHAPE_OPS or ("val" in node.meta and not _has_float(val)):
            shape.add(node)
            continue
        ins = _data_inputs(node)
        if ins and all(i in shape for i in ins):
            shape.add(node)
    for node in reversed(list(gm.graph.nodes)):
        if node.op in ("placeholder", "output", "get_attr") or node in shape or not node.users:
            continue
        if all(u in shape for u in node.users):
            shape.add(node)
    return shape


@register_dispatcher("conservative")
def _conservative(t: str, platform: Platform, fed_by_quantized: bool) -> bool:
    return t in platform.quantized_ops and (t in COMPUTING_OPS or fed_by_quantized)


@register_dispatcher("aggressive")
def _aggressive(t: str, platform: Platform, fed_by_quantized: bool) -> bool:
    return (t in COMPUTING_OPS and t in platform.quantized_ops) or fed_by_quantized


@register_dispatcher("pointwise")
def _pointwise(t: str, platform: Platform, fed_by_quantized: bool) -> bool:
    return t in COMPUTING_OPS and t in platform.quantized_ops


@register_dispatcher("allin")
def _allin(t: str, platform: Platform, fed_by_quantized: bool) -> bool:
    return t in platform.quantized_ops


def _table_lookup(node: fx.Node, table: dict[str, Any]) -> Any:
    key = match_node_name(node, table)
    return None if key is None else table[key]


def dispatch(
    gm: fx.GraphModule,
    platform: Platform,
    dispatcher: str = "conservative",
    dispatching_table: dict[str, Any] | None = None,
) -> Dispatch:
    """Decide, node by node, the platform each op runs on."""
    modules = dict(gm.named_modules())
    rule = DISPATCHERS.get(dispatcher)
    shape = set() if dispatcher == "allin" else shape_nodes(gm, modules)
    table = dispatching_table or {}
    variants: dict[str, Platform] = {}
    result: Dispatch = {}
    quantized: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        if node in shape or ("val" in node.meta and not _has_float(node.meta["val"])):
            result[node] = "shape"
            continue
        t = op_type(node, modules)
        fed = any(i in quantized for i in _data_inputs(node))
        chosen: Platform | str = platform if rule(t, platform, fed) else "fp32"
        override = _table_lookup(node, table) if table else None
        if override is not None:
            chosen = _resolve_override(override, platform, variants, node)
            if isinstance(chosen, Platform) and t not in chosen.quantized_ops and t not in chosen.input_quantized_ops:
                chosen = "fp32"
        result[node] = chosen
        if isinstance(chosen, Platform):
            quantized.add(node)
    return result


def _has_float(val: Any) -> bool:
    if isinstance(val, (tuple, list)):
        return any(_has_float(v) for v in val)
    return is_float_tensor(val)


def _resolve_override(value: Any, default: Platform, cache: dict[str, Platform], node: fx.Node) -> Platform | str:
    if isinstance(value, Platform):
        return value
    if isinstance(value, str):
        if value.lower() == "fp32":
            return "fp32"
        if value.lower() not in cache:
            cache[value.lower()] = get_platform(value)
        return cache[value.lower()]
    if isinstance(value, dict):
        key = repr(sorted(value.items()))
        if key not in cache:
            try:
                cache[key] = default.with_overrides(**value)
            except TypeError as exc:
                raise ConfigError(f"dispatching_table entry for node {node.name!r}: {exc}") from None
        return cache[key]
    raise ConfigError(
        f"dispatching_table value for node {node.name!r} must be 'fp32', a platform name or a dict of overrides, "
        f"got {value!r}"
    )
