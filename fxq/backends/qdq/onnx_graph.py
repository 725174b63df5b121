"""Small editing helpers over an ``onnx.GraphProto``: names, producers, consumers, initializers, dtypes."""
from __future__ import annotations

from typing import Iterable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

__all__ = [
    "all_tensor_names",
    "rename_tensors",
    "producers",
    "consumers",
    "initializers",
    "unique_name",
    "int_initializer",
    "float_initializer",
    "INT_RANGES",
    "attr",
    "subgraphs",
    "outer_reads",
    "rename_outer_reads",
]

INT_RANGES: dict[int, tuple[int, int]] = {
    TensorProto.INT4: (-8, 7),
    TensorProto.UINT4: (0, 15),
    TensorProto.INT8: (-128, 127),
    TensorProto.UINT8: (0, 255),
    TensorProto.INT16: (-32768, 32767),
    TensorProto.UINT16: (0, 65535),
    TensorProto.INT32: (-(2**31), 2**31 - 1),
}
"""Value range of each integer element type Q/DQ can carry."""

_NUMPY_OF = {
    TensorProto.INT8: np.int8,
    TensorProto.UINT8: np.uint8,
    TensorProto.INT16: np.int16,
    TensorProto.UINT16: np.uint16,
    TensorProto.INT32: np.int32,
}


def all_tensor_names(graph: onnx.GraphProto) -> set[str]:
    names = {t.name for t in graph.initializer} | {i.name for i in graph.input} | {o.name for o in graph.output}
    for node in graph.node:
        names.update(n for n in node.input if n)
        names.update(n for n in node.output if n)
    return names


def rename_tensors(graph: onnx.GraphProto, mapping: dict[str, str]) -> None:
    """Rename tensors everywhere (node inputs/outputs, graph inputs/outputs, initializers, value_info, and the reads
    of If/Loop/Scan bodies that do not shadow them)."""
    if not mapping:
        return
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name in mapping:
                node.input[i] = mapping[name]
        for i, name in enumerate(node.output):
            if name in mapping:
                node.output[i] = mapping[name]
    for coll in (graph.input, graph.output, graph.value_info, graph.initializer):
        for item in coll:
            if item.name in mapping:
                item.name = mapping[item.name]
    rename_outer_reads(graph, mapping)


def producers(graph: onnx.GraphProto) -> dict[str, onnx.NodeProto]:
    return {out: node for node in graph.node for out in node.output if out}


def consumers(graph: onnx.GraphProto) -> dict[str, list[onnx.NodeProto]]:
    table: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            if name:
                table.setdefault(name, []).append(node)
    return table


def initializers(graph: onnx.GraphProto) -> dict[str, onnx.TensorProto]:
    return {t.name: t for t in graph.initializer}


def unique_name(base: str, used: set[str]) -> str:
    """``base``, or ``base_1``, ``base_2``... — the first one not in ``used`` (which is updated)."""
    name, i = base, 0
    while name in used:
        i += 1
        name = f"{base}_{i}"
    used.add(name)
    return name


def int_initializer(name: str, values: np.ndarray, elem_type: int) -> onnx.TensorProto:
    """An integer initializer of ``elem_type`` (INT4/UINT4 are packed two per byte by onnx)."""
    lo, hi = INT_RANGES[elem_type]
    values = np.asarray(values)
    if values.size and (values.min() < lo or values.max() > hi):
        raise ValueError(f"{name}: values outside [{lo}, {hi}] for {TensorProto.DataType.Name(elem_type)}")
    if elem_type in (TensorProto.INT4, TensorProto.UINT4):
        return helper.make_tensor(name, elem_type, list(values.shape), values.astype(np.int64).ravel().tolist())
    return numpy_helper.from_array(values.astype(_NUMPY_OF[elem_type]), name)


def float_initializer(name: str, values: np.ndarray | float, elem_type: int = TensorProto.FLOAT) -> onnx.TensorProto:
    """A float initializer; ``FLOAT8E4M3FN``/``FLOAT8E5M2`` hold zeros only (zero-points)."""
    arr = np.asarray(values, dtype=np.float32)
    if elem_type == TensorProto.FLOAT:
        return numpy_helper.from_array(arr, name)
    if bool(np.any(arr != 0)):
        raise ValueError(f"{name}: only zero FP8 constants are written here")
    return helper.make_tensor(name, elem_type, list(arr.shape), arr.ravel().tolist())


def attr(node: onnx.NodeProto, name: str, default: object = None) -> object:
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def drop_unused_initializers(graph: onnx.GraphProto, keep: Iterable[str] = ()) -> None:
    used = {n for node in graph.node for n in node.input} | {o.name for o in graph.output} | set(keep)
    remove_initializers(graph, {t.name for t in graph.initializer} - used)


def remove_initializers(graph: onnx.GraphProto, names: Iterable[str]) -> None:
    """Delete the named initializers in place. Rebuilding the list instead (``del [:]`` + ``extend``) copies every
    kept tensor, and protobuf frees the old bytes only with the whole model: the weights' memory doubles."""
    names = set(names)
    for i in reversed(range(len(graph.initializer))):
        if graph.initializer[i].name in names:
            del graph.initializer[i]


def subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    out = []
    for a in node.attribute:
        if a.type == onnx.AttributeProto.GRAPH:
            out.append(a.g)
        elif a.type == onnx.AttributeProto.GRAPHS:
            out.extend(a.graphs)
    return out


def _local_names(graph: onnx.GraphProto) -> set[str]:
    return ({i.name for i in graph.input} | {t.name for t in graph.initializer}
            | {o for n in graph.node for o in n.output if o})


def _body_reads(node: onnx.NodeProto) -> set[str]:
    """Names that ``node``'s If/Loop/Scan bodies (at any depth) read from outside them."""
    reads: set[str] = set()
    for sub in subgraphs(node):
        inner = {i for n in sub.node for i in n.input if i} | {o.name for o in sub.output} | outer_reads(sub)
        reads |= inner - _local_names(sub)
    return reads


def outer_reads(graph: onnx.GraphProto) -> set[str]:
    """Names that If/Loop/Scan bodies of ``graph`` (at any depth) read from ``graph``'s scope or above."""
    reads: set[str] = set()
    for node in graph.node:
        reads |= _body_reads(node)
    return reads


def node_reads(node: onnx.NodeProto) -> list[str]:
    """Every tensor ``node`` reads: its inputs, then what its If/Loop/Scan bodies read from outside (sorted)."""
    return [i for i in node.input if i] + sorted(_body_reads(node))


def drop_dead_nodes(graph: onnx.GraphProto) -> set[str]:
    """Remove the nodes none of whose outputs is read, directly or through later nodes, by the graph outputs (one
    pass from the end: file order is topological). Returns the names the kept nodes and the outputs read."""
    live = {o.name for o in graph.output}
    keep: list[bool] = []
    for node in reversed(graph.node):
        alive = any(o in live for o in node.output if o)
        keep.append(alive)
        if alive:
            live.update(node_reads(node))
    keep.reverse()
    if not all(keep):
        kept = [n for n, k in zip(graph.node, keep) if k]
        graph.ClearField("node")
        graph.node.extend(kept)
    return live


def rename_outer_reads(graph: onnx.GraphProto, moved: dict[str, str]) -> None:
    """Point reads of ``moved`` tensors inside If/Loop/Scan bodies (not shadowed there) at their new names."""
    if not moved:
        return
    for node in graph.node:
        for sub in subgraphs(node):
            local = _local_names(sub)
            here = {k: v for k, v in moved.items() if k not in local}
            for n in sub.node:
                for i, name in enumerate(n.input):
                    if name in here:
                        n.input[i] = here[name]
            for o in sub.output:
                if o.name in here:  # a body output that is an outer value: read it through an Identity
                    new = here[o.name]
                    sub.node.append(helper.make_node("Identity", [new], [o.name], name=f"{o.name}_outer_Identity"))
            rename_outer_reads(sub, here)
