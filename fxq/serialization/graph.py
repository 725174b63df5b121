"""The fx graph as data: one record per node (op, name, target by allowed name, args, meta)."""
from __future__ import annotations

import logging
import math
import re
from typing import Any

import torch
from torch import fx

from fxq.errors import FrontendError, NotSupportedError
from fxq.serialization.allowlist import (
    aten_refusal,
    check_identifier,
    check_method,
    check_node,
    check_path,
    function_name,
    resolve_function,
)
from fxq.serialization.codec import GRAPH_TAGS, TensorTable, Unencodable, decode, encode
from fxq.serialization.modules import Defined

__all__ = ["encode_graph", "decode_graph", "encode_meta", "decode_meta"]

logger = logging.getLogger(__name__)


def encode_meta(meta: dict[str, Any], table: TensorTable, where: str, tensor_spec_only: bool = True) -> dict[str, Any]:
    """Encodable meta entries (tensors as shape/dtype only when ``tensor_spec_only``: node values recorded while
    tracing); the others are dropped with a debug message."""
    out = {}
    for key, value in meta.items():
        try:
            out[key] = encode(value, table, f"{where}.{key}", tensor_spec_only=tensor_spec_only)
        except Unencodable as exc:
            logger.debug("%s: meta[%r] not saved (%s)", where, key, exc)
    return out


def _encode_target(node: fx.Node) -> Any:
    if node.op == "call_function":
        name = function_name(node.target)
        if name is None:
            why = aten_refusal(node.target) if isinstance(node.target, torch._ops.OpOverload) and \
                node.target.namespace == "aten" else None
            raise NotSupportedError(
                f"cannot save node {node.name!r}: function {getattr(node.target, '__qualname__', node.target)!r} is not "
                f"in fxq's allow-list (torch, torch.nn.functional, operator, math, torch.ops)"
                f"{f', because {why}' if why else ''}; register it with fxq.serialization.register_serializable(fn)"
            )
        return {"$function": name}
    if node.op == "call_method":
        return check_method(str(node.target))
    return str(node.target)


def encode_graph(gm: fx.GraphModule, table: TensorTable) -> list[dict[str, Any]]:
    if type(gm.graph._codegen) is not fx.graph.CodeGen:
        raise NotSupportedError("cannot save a GraphModule with a custom code generator (pytree inputs/outputs, "
                                "e.g. traced with concrete_args); trace it with plain tensor inputs")
    records = []
    for node in gm.graph.nodes:
        try:
            args = encode(node.args, table, f"const.{node.name}")
            kwargs = encode(node.kwargs, table, f"const.{node.name}")
        except Unencodable as exc:
            raise NotSupportedError(f"cannot save node {node.name!r} ({node.op} {node.target}): an argument holds "
                                    f"a {exc}") from None
        check_node(node.op, node.target, node.args)
        records.append({"name": node.name, "op": node.op, "target": _encode_target(node), "args": args,
                        "kwargs": kwargs, "meta": encode_meta(node.meta, table, f"node {node.name}")})
    return records


_OPS = frozenset({"placeholder", "get_attr", "call_function", "call_method", "call_module", "output"})
_CODEGEN_META = frozenset({"is_wrapped", "boxed_arg_indices"})
"""Node meta keys torch.fx's code generator acts on (``is_wrapped`` emits ``torch.fx.wrap`` calls)."""
_PLACEHOLDER = re.compile(r"\*{0,2}([A-Za-z_][A-Za-z0-9_]*)\Z")


def decode_meta(data: Any, table: TensorTable, where: str = "model", op: str | None = None) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise FrontendError(f"{where}: meta is a {type(data).__name__}, not an object")
    for key in data:
        if key == "is_wrapped" and op == "call_function" and data[key] is True:
            continue  # torch.fx.wrap'd function (caffe_interp): fx writes wrap("<its allowed name>")
        if key in _CODEGEN_META:
            raise NotSupportedError(f"{where}: meta[{key!r}] is not allowed in fxq files (it changes the code "
                                    f"torch.fx generates)")
    return {key: decode(value, table) for key, value in data.items()}


def _placeholder_target(target: Any, args: tuple, kwargs: dict) -> str:
    match = _PLACEHOLDER.match(target) if isinstance(target, str) else None
    if match is None:
        raise NotSupportedError(f"placeholder {target!r} is not allowed in fxq files (not a plain argument name)")
    check_identifier(match.group(1), "placeholder")
    if kwargs:
        raise NotSupportedError(f"placeholder {target!r}: keyword arguments are not allowed in fxq files")
    if len(args) > 1 or args and not (args[0] is None or type(args[0]) in (bool, int, str) or (
            type(args[0]) is float and math.isfinite(args[0]))):
        raise NotSupportedError(f"placeholder {target!r}: default value {args!r:.80} is not allowed in fxq files "
                                f"(only None, bool, int, float, str)")
    return target


def decode_graph(records: Any, table: TensorTable, defined: Defined) -> fx.Graph:
    """The graph of ``records``, every name checked, every target looked up in the allow-list or ``defined``."""
    if not isinstance(records, list):
        raise FrontendError(f"the graph is a {type(records).__name__}, not a list of nodes")
    graph = fx.Graph()
    nodes: dict[str, fx.Node] = {}
    for i, rec in enumerate(records):
        if not isinstance(rec, dict):
            raise FrontendError(f"graph node {i} is a {type(rec).__name__}, not an object")
        name, op, target = rec.get("name"), rec.get("op"), rec.get("target")
        check_identifier(name, "node name")
        if op not in _OPS:
            raise FrontendError(f"node {name!r} has op {op!r}, not one of {sorted(_OPS)}")
        if (op == "output") != (i == len(records) - 1):
            raise FrontendError(f"node {name!r}: the graph must end with its one output node")
        args = decode(rec.get("args"), table, nodes, GRAPH_TAGS)
        kwargs = rec.get("kwargs")
        if not isinstance(args, tuple) or not isinstance(kwargs, dict):
            raise FrontendError(f"node {name!r}: args must be a tuple and kwargs an object")
        kwargs = {check_identifier(k, f"node {name!r}: keyword"): decode(v, table, nodes, GRAPH_TAGS)
                  for k, v in kwargs.items()}
        if op == "call_function":
            if not isinstance(target, dict) or set(target) != {"$function"}:
                raise FrontendError(f"node {name!r}: call_function target {target!r:.80} is not a function name")
            target = resolve_function(target["$function"])
        elif op == "call_method":
            target = check_method(target)
            if not args:
                raise FrontendError(f"node {name!r}: call_method {target!r} has no tensor argument")
        elif op == "placeholder":
            target = _placeholder_target(target, args, kwargs)
        elif op == "output":
            if len(args) != 1 or kwargs:
                raise FrontendError(f"node {name!r}: the output node takes one argument")
            target = "output"
        else:  # get_attr, call_module: a path the file's module tree defines
            check_path(target, f"{op} target")
            if target not in (defined.modules if op == "call_module" else defined.attrs | defined.modules):
                raise NotSupportedError(f"node {name!r}: {op} target {target!r} is not defined by the file's modules")
            if op == "get_attr" and (args or kwargs):
                raise FrontendError(f"node {name!r}: get_attr takes no arguments")
        check_node(op, target, args)
        node = graph.create_node(op, target, args, kwargs, name=name)
        if node.name != name:
            raise FrontendError(f"node {name!r} could not keep its name (got {node.name!r}): names must be unique "
                                f"and not shadow Python builtins")
        node.meta = decode_meta(rec.get("meta", {}), table, f"node {name!r}", op)
        nodes[name] = node
    if not records:
        raise FrontendError("the graph has no output node")
    return graph
