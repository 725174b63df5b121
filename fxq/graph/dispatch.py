"""Dispatch: which nodes run quantized on which platform, which stay FP32, which are shape/index math.

Dispatchers are registered by name (``conservative`` default, ``aggressive``, ``pointwise``, ``allin``)
and a user ``dispatching_table`` (node/module name or regex -> ``"fp32"``, a platform name, or a dict of
per-layer overrides) has the last word. Shape/index computations are never quantized, and neither is a node the
platform's exporter cannot run quantized (its :class:`~fxq.Capability`'s ``ops`` / ``op_rules``): it stays FP32,
so the simulation computes what the exported file does (logged, listed by :func:`fxq.summary`); a table entry that
forces such a node onto the platform is a :class:`~fxq.errors.ConfigError`.
"""
from __future__ import annotations

import logging
import re
from typing import Any, Callable

import torch
from torch import fx, nn

from fxq.errors import ConfigError
from fxq.graph.info import match_node_name, node_names
from fxq.graph.nodes import get_attr_value
from fxq.graph.op_types import op_type
from fxq.qconfig.base import COMPUTING_OPS, RECURRENT_OPS, SHAPE_OPS, Capability, Platform, get_platform
from fxq.registry import Registry, close_names

__all__ = ["dispatch", "DISPATCHERS", "register_dispatcher", "is_float_tensor", "shape_nodes", "Dispatch",
           "capability_problem", "UNEXPRESSIBLE_KEY"]

Dispatch = dict[fx.Node, "Platform | str"]
"""node -> Platform (quantized), "fp32", or "shape"."""

logger = logging.getLogger(__name__)

DISPATCHERS: Registry[Callable[..., bool]] = Registry("dispatcher")

UNEXPRESSIBLE_KEY = "fxq_unexpressible"
"""``gm.meta[UNEXPRESSIBLE_KEY]``: ``{node name: why}`` for the nodes dispatch kept FP32 because the platform's
exporter cannot run them quantized."""


def register_dispatcher(name: str, *, override: bool = False):
    """Register ``rule(node_type, platform, fed_by_quantized: bool) -> bool`` under ``name``.

    The rule decides, node by node in graph order, whether an op of ``node_type`` runs quantized on ``platform``;
    ``fed_by_quantized`` says whether one of its data inputs runs quantized. Shape / index math is excluded before
    the rule is asked, and the dispatching table has the last word.

    Example:
        >>> @fxq.register_dispatcher("convs_only")
        ... def convs_only(t, platform, fed):
        ...     return t == "Conv"
        >>> setting = fxq.QuantizationSetting(dispatcher="convs_only")
    """
    return DISPATCHERS.register(name, override=override)


def is_float_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def _data_inputs(node: fx.Node) -> list[fx.Node]:
    return [n for n in node.all_input_nodes if n.op != "get_attr"]


_VALUE_READERS = frozenset({"ArgMax", "ArgMin"})
"""Index ops that read their input's values, not its shape: what feeds them is data (a segmentation or CTC head
that ends in an argmax), however integer their output."""


def shape_nodes(gm: fx.GraphModule, modules: dict[str, nn.Module]) -> set[fx.Node]:
    """Nodes that compute shapes or indices (forward from shape ops and non-float values, backward
    from values consumed only by such nodes). A lookup in a stored float table (an embedding) is data whatever
    computed its indices: GPT-2's ``input_ids.view(-1, input_ids.shape[-1])`` made the whole model shape
    arithmetic, quantizing nothing."""
    shape: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        t = op_type(node, modules)
        val = node.meta.get("val")
        if t in SHAPE_OPS or ("val" in node.meta and not _has_float(val)):
            shape.add(node)
            continue
        if t == "Gather" and _reads_stored_floats(node, gm, modules):
            continue
        ins = _data_inputs(node)
        if ins and all(i in shape for i in ins):
            shape.add(node)
    for node in reversed(list(gm.graph.nodes)):
        if node.op in ("placeholder", "output", "get_attr") or node in shape or not node.users:
            continue
        if all(u in shape and op_type(u, modules) not in _VALUE_READERS for u in node.users):
            shape.add(node)
    return shape


_STARTING_OPS = COMPUTING_OPS | RECURRENT_OPS
"""Ops quantized without a quantized producer: the ones with weights."""


@register_dispatcher("conservative")
def _conservative(t: str, platform: Platform, fed_by_quantized: bool) -> bool:
    return t in platform.quantized_ops and (t in _STARTING_OPS or fed_by_quantized)


@register_dispatcher("aggressive")
def _aggressive(t: str, platform: Platform, fed_by_quantized: bool) -> bool:
    return (t in _STARTING_OPS and t in platform.quantized_ops) or fed_by_quantized


@register_dispatcher("pointwise")
def _pointwise(t: str, platform: Platform, fed_by_quantized: bool) -> bool:
    return t in _STARTING_OPS and t in platform.quantized_ops


@register_dispatcher("allin")
def _allin(t: str, platform: Platform, fed_by_quantized: bool) -> bool:
    return t in platform.quantized_ops


def _warn_weighted_ops_taken_for_shapes(gm: fx.GraphModule, modules: dict[str, nn.Module], shape: set[fx.Node]) -> None:
    """Say so when every conv / linear of the model is taken for shape arithmetic: it then quantizes nothing,
    which a model whose outputs are indices computed from its values (``y.max(1)[1]``, ``y > 0.5``) would do
    silently."""
    weighted = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr")
                and op_type(n, modules) in COMPUTING_OPS]
    if not weighted or not all(n in shape for n in weighted):
        return
    readers = [u.name for u in gm.graph.nodes if u in shape and "val" in u.meta and not _has_float(u.meta["val"])
               and any("val" in i.meta and _has_float(i.meta["val"]) for i in _data_inputs(u))]
    logger.warning(
        "no node will be quantized: all %d conv / linear nodes (%s, ...) compute only values read as integers or "
        "shapes (read by %s), which fxq leaves in FP32 as index arithmetic. If they are the network, end it before "
        "the integer read (return the scores, take the argmax / threshold outside), or use "
        "setting.dispatcher = 'allin'", len(weighted), weighted[0].name, readers[:3] or "the outputs")


def capability_problem(node: fx.Node, t: str, cap: Capability | None, gm: nn.Module) -> str | None:
    """Why an exporter of capability ``cap`` cannot run ``node`` (of op type ``t``) quantized; None: it can (or no
    capability is declared)."""
    if cap is None or not cap.restricts_ops:
        return None
    return cap.op_problem(t, node, gm)


def _check_table_keys(gm: fx.GraphModule, table: dict[str, Any]) -> None:
    """Invalid regexes are errors; a key that names no node is a warning with the closest node names."""
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    all_names = sorted({name for n in nodes for name in node_names(n)})
    exact = set(all_names)
    for key in table:
        if key in exact:
            continue
        try:
            rx = re.compile(key)
        except re.error as exc:
            raise ConfigError(f"setting.dispatching_table key {key!r} is neither a node name nor a valid regex "
                              f"({exc}); escape it with re.escape or fix the pattern") from None
        if not any(rx.fullmatch(name) for name in all_names):
            near = close_names(key, all_names)
            logger.warning("setting.dispatching_table entry %r matches no node%s; keys match node names, module "
                           "paths and original ONNX / caffe names exactly or as a full regex", key,
                           near or " (no close node names)")


def dispatch(
    gm: fx.GraphModule,
    platform: Platform,
    dispatcher: str = "conservative",
    dispatching_table: dict[str, Any] | None = None,
) -> Dispatch:
    """Decide, node by node, the platform each op runs on."""
    modules = dict(gm.named_modules())
    rule = DISPATCHERS.require(dispatcher, "setting.dispatcher")
    shape = set() if dispatcher == "allin" else shape_nodes(gm, modules)
    _warn_weighted_ops_taken_for_shapes(gm, modules, shape)
    table = dispatching_table or {}
    if table:
        _check_table_keys(gm, table)
    variants: dict[str, Platform] = {}
    kept: dict[str, str] = {}
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
        key = match_node_name(node, table) if table else None
        if key is not None:
            chosen = _resolve_override(key, table[key], platform, variants)
            if isinstance(chosen, Platform) and t not in chosen.quantized_ops and t not in chosen.input_quantized_ops:
                chosen = "fp32"
        if isinstance(chosen, Platform) and (chosen.quantizes_inputs(t) or chosen.quantizes_output(t)):
            why = capability_problem(node, t, chosen.capability, gm)
            if why is not None and key is not None:
                raise ConfigError(
                    f"setting.dispatching_table[{key!r}] puts node {node.name!r} (op {t}) on platform "
                    f"{chosen.name!r}, whose exporter cannot run it quantized: {why}. "
                    f"Fix: map {node.name!r} to 'fp32' in the table, or narrow the entry so it does not match it")
            if why is not None:
                chosen = "fp32"
                kept[node.name] = why
        result[node] = chosen
        if isinstance(chosen, Platform):
            quantized.add(node)
        elif t in RECURRENT_OPS:
            logger.info("%s node %r stays FP32 on platform %r (it does not quantize %s: weights and inputs kept in "
                        "float, an FP32 island)", t, node.name, platform.name, t)
    if kept:
        gm.meta[UNEXPRESSIBLE_KEY] = kept
        logger.warning("%d node(s) stay FP32 on platform %r: its exporter cannot run them quantized, so the simulation "
                       "keeps them FP32 as the exported file does: %s", len(kept), platform.name,
                       "; ".join(f"{name} ({why})" for name, why in kept.items()))
    return result


def _reads_stored_floats(node: fx.Node, gm: fx.GraphModule, modules: dict[str, nn.Module]) -> bool:
    """Whether ``node`` reads a stored float tensor: a float parameter or buffer of its module, or a float
    ``get_attr`` argument."""
    stored = [get_attr_value(gm, str(a.target)) for a in node.all_input_nodes if a.op == "get_attr"]
    if node.op == "call_module":
        mod = modules[str(node.target)]
        stored += [*mod.parameters(recurse=False), *mod.buffers(recurse=False)]
    return any(isinstance(t, torch.Tensor) and t.is_floating_point() for t in stored)


def _has_float(val: Any) -> bool:
    if isinstance(val, (tuple, list)):
        return any(_has_float(v) for v in val)
    return is_float_tensor(val)


def _resolve_override(key: str, value: Any, default: Platform, cache: dict[str, Platform]) -> Platform | str:
    where = f"setting.dispatching_table[{key!r}]"
    if isinstance(value, Platform):
        return value
    if isinstance(value, str):
        if value.lower() == "fp32":
            return "fp32"
        if value.lower() not in cache:
            cache[value.lower()] = get_platform(value)
        return cache[value.lower()]
    if isinstance(value, dict):
        ck = repr(sorted(value.items()))  # one Platform per distinct override: fusion needs the same object
        if ck not in cache:
            Platform.check_overrides(value, where)
            cache[ck] = default.with_overrides(**value, where=f"{where} on platform {default.name!r}")
        return cache[ck]
    raise ConfigError(f"{where} must be 'fp32', a platform name or a dict of overrides, got {value!r}")

