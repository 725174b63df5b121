"""The fx graph as data: one record per node (op, name, target by allowed name, args, meta)."""
from __future__ import annotations

import logging
from typing import Any

from torch import fx

from fxq.errors import NotSupportedError
from fxq.serialization.allowlist import check_method, check_node, function_name, resolve_function
from fxq.serialization.codec import TensorTable, Unencodable, decode, encode

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


def decode_meta(data: dict[str, Any], table: TensorTable) -> dict[str, Any]:
    return {key: decode(value, table) for key, value in data.items()}


def _encode_target(node: fx.Node) -> Any:
    if node.op == "call_function":
        name = function_name(node.target)
        if name is None:
            raise NotSupportedError(
                f"cannot save node {node.name!r}: function {getattr(node.target, '__qualname__', node.target)!r} is not "
                f"in fxq's allow-list (torch, torch.nn.functional, operator, math, torch.ops); register it with "
                f"fxq.serialization.register_serializable(fn)"
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


def decode_graph(records: list[dict[str, Any]], table: TensorTable) -> fx.Graph:
    graph = fx.Graph()
    nodes: dict[str, fx.Node] = {}
    for rec in records:
        op, target = rec["op"], rec["target"]
        if op == "call_function":
            target = resolve_function(target["$function"])
        elif op == "call_method":
            target = check_method(target)
        args = decode(rec["args"], table, nodes)
        kwargs = decode(rec["kwargs"], table, nodes)
        check_node(op, target, tuple(args))
        node = graph.create_node(op, target, tuple(args), dict(kwargs), name=rec["name"])
        if node.name != rec["name"]:
            raise NotSupportedError(f"node {rec['name']!r} could not keep its name (got {node.name!r})")
        node.meta = decode_meta(rec["meta"], table)
        nodes[node.name] = node
    return graph
