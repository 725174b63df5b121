"""ONNX control flow before conversion: ``If`` with a condition that folds to a constant is replaced by the branch
it takes; ``Loop`` / ``Scan`` are refused with what to do.

Exporters write ``If`` for Python branches on sizes (``if x.shape[1] > 1``) and for scripted code; with the input
sizes known (the file's, or ``input_shapes=``) such a condition is a constant, and the branch taken is the whole
story. A condition that reads tensor values (not only shapes) cannot be folded: the loader refuses it, naming the
node. The condition is evaluated with onnx's reference evaluator on its constant cone, where each ``Shape`` /
``Size`` of a tensor whose dims shape inference knows is a constant.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Collection, Mapping, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from fxq.backends.qdq.onnx_graph import (
    all_tensor_names,
    drop_dead_nodes,
    initializers,
    producers,
    rename_tensors,
    unique_name,
)
from fxq.frontends.onnx.cleanup import clean
from fxq.frontends.onnx.cut import refusal
from fxq.frontends.onnx.shapes import infer_for_conversion, shape_value, source_dims, tensor_dims

__all__ = ["fold_constant_ifs", "refuse_loops"]

_LOG = logging.getLogger(__name__)
_REFUSED = ("Loop", "Scan")


@dataclasses.dataclass
class _Known:
    """What fixes sizes at load time: ``fixed``, the input dims given to the loader (``input_shapes``), and
    ``bound``, the size each symbolic dim name of the inputs takes with them (``batch`` -> 1), which inferred shapes
    downstream keep as names."""

    fixed: Mapping[str, Sequence[int]]
    bound: dict[str, int]

    @classmethod
    def of(cls, model: onnx.ModelProto, fixed: Mapping[str, Sequence[int]]) -> _Known:
        bound: dict[str, int] = {}
        for name, dims in source_dims(model).items():
            for d, size in zip(dims, fixed.get(name, ())):
                if isinstance(d, str) and d:
                    bound.setdefault(d, int(size))
        return cls(fixed, bound)


def _dims(infos: dict[str, onnx.ValueInfoProto], known: _Known, name: str) -> list[int | None] | None:
    """Dims of tensor ``name`` (None for an unknown one; None overall for an unknown rank)."""
    if name in known.fixed:
        return [int(d) for d in known.fixed[name]]
    dims = tensor_dims(infos[name]) if name in infos else None
    return None if dims is None else [d if isinstance(d, int) else known.bound.get(d) if isinstance(d, str) else None
                                      for d in dims]


def _static_dims(infos: dict[str, onnx.ValueInfoProto], known: _Known, name: str) -> list[int] | None:
    dims = _dims(infos, known, name)
    return None if dims is None or any(d is None for d in dims) else [int(d) for d in dims]  # type: ignore[arg-type]


def _gathered_dim(node: onnx.NodeProto, produced: dict[str, onnx.NodeProto], inits: dict[str, onnx.TensorProto],
                  infos: dict[str, onnx.ValueInfoProto], known: _Known) -> np.ndarray | None:
    """``Gather(Shape(t), i)`` when dim ``i`` of ``t`` is known though others are not (``x.shape[2]`` of a
    dynamic-batch input)."""
    if node.op_type != "Gather":
        return None
    shape = produced.get(node.input[0])
    if shape is None or shape.op_type != "Shape" or shape.attribute:
        return None
    index = inits.get(node.input[1])
    dims = _dims(infos, known, shape.input[0])
    if index is None or dims is None:
        return None
    picked = [dims[int(i)] for i in numpy_helper.to_array(index).reshape(-1)]
    if any(d is None for d in picked):
        return None
    return np.array(picked, dtype=np.int64).reshape(numpy_helper.to_array(index).shape)


def _fold(model: onnx.ModelProto, name: str, infos: dict[str, onnx.ValueInfoProto],
          known: _Known) -> tuple[np.ndarray | None, str, list[str]]:
    """The value of tensor ``name`` when it depends only on constants and known shapes, else (None, why, the graph
    inputs whose values it reads)."""
    graph = model.graph
    produced = producers(graph)
    inits = initializers(graph)
    feeds: dict[str, onnx.TensorProto] = {}
    cone: list[onnx.NodeProto] = []
    seen: set[str] = set()
    read_inputs: list[str] = []
    stack = [name]
    while stack:
        t = stack.pop()
        if t in seen or not t:
            continue
        seen.add(t)
        if t in inits:
            feeds[t] = inits[t]
            continue
        node = produced.get(t)
        if node is None:
            read_inputs.append(t)
            continue
        picked = _gathered_dim(node, produced, inits, infos, known)
        if picked is not None:
            feeds[t] = numpy_helper.from_array(picked, t)
            continue
        if node.op_type in ("Shape", "Size"):
            dims = _static_dims(infos, known, node.input[0])
            if dims is not None:
                feeds[t] = numpy_helper.from_array(shape_value(node, dims)[t], t)
                continue
            if node.input[0] in {i.name for i in graph.input}:
                return None, f"it reads the size of input {node.input[0]!r}, which the file leaves open", []
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
            return None, f"it is computed by control flow ({node.op_type} {node.name!r})", []
        cone.append(node)  # a Shape/Size of known dims was fed above
        stack.extend(node.input)
    if read_inputs:
        read_inputs.sort(key=[i.name for i in graph.input].index)
        return None, f"it reads the values of graph input(s) {', '.join(map(repr, read_inputs))}", read_inputs
    order = {id(n): i for i, n in enumerate(graph.node)}
    cone.sort(key=lambda n: order[id(n)])
    small = helper.make_model(
        helper.make_graph(cone, "condition", [], [helper.make_tensor_value_info(name, onnx.TensorProto.UNDEFINED,
                                                                                None)],
                          initializer=list(feeds.values())),
        opset_imports=list(model.opset_import), ir_version=model.ir_version)
    from onnx.reference import ReferenceEvaluator

    try:
        (value,) = ReferenceEvaluator(small).run(None, {})
    except Exception as exc:  # noqa: BLE001  (the evaluator raises many types)
        return None, f"evaluating it failed ({type(exc).__name__}: {exc})", []
    return np.asarray(value), "", []


def _holds_a_setting(dims: list | None) -> bool:
    """Whether an input declared with ``dims`` can be a setting (a scalar or a few numbers), not data."""
    return dims is not None and all(isinstance(d, int) and d > 0 for d in dims) and int(np.prod(dims)) <= 16


def _inline(graph: onnx.GraphProto, index: int, branch: onnx.GraphProto, if_node: onnx.NodeProto) -> None:
    """Replace ``graph.node[index]`` (``if_node``) by the nodes of ``branch``, its outputs named as the If's."""
    body = onnx.GraphProto()
    body.CopyFrom(branch)
    used = all_tensor_names(graph) | all_tensor_names(body)
    local = {o for n in body.node for o in n.output if o} | {t.name for t in body.initializer}
    outs = {o.name: target for o, target in zip(body.output, if_node.output)}
    mapping = {n: (outs[n] if n in outs else unique_name(f"{if_node.name or 'If'}/{n}", used)) for n in local}
    rename_tensors(body, mapping)
    nodes = list(body.node)
    for o, target in zip(body.output, if_node.output):  # an outer value passed through: an Identity makes it
        if o.name != target and target:
            nodes.append(helper.make_node("Identity", [o.name], [target], name=f"{if_node.name}/{target}_Identity"))
    for n in nodes:
        if n.name:
            n.name = unique_name(f"{if_node.name}/{n.name}" if if_node.name else n.name, used)
    graph.initializer.extend(body.initializer)
    rest = list(graph.node)
    graph.ClearField("node")
    graph.node.extend(rest[:index] + nodes + rest[index + 1:])


def fold_constant_ifs(model: onnx.ModelProto, source: str, fixed: Mapping[str, Sequence[int]] | None = None,
                      file_tensors: Collection[str] | None = None) -> int:
    """Replace every top-level ``If`` whose condition folds to a constant by its taken branch (in place).

    ``fixed``: input dims given to the loader (``input_shapes``), which count over the file's symbolic ones.
    ``file_tensors``: the node outputs of the file as read, which a suggested cut may name (:func:`refusal`).

    Returns:
        how many ``If`` nodes were folded (nested ones included: a taken branch's Ifs are folded in turn).

    Raises:
        FrontendError: an ``If`` whose condition reads run-time values, naming the node and what to do.
    """
    folded = 0
    while True:
        infos = {v.name: v for v in [*model.graph.value_info, *model.graph.input, *model.graph.output]}
        index = next((i for i, n in enumerate(model.graph.node) if n.op_type == "If"), None)
        if index is None:
            return folded
        node = model.graph.node[index]
        value, why, read_inputs = _fold(model, node.input[0], infos, _Known.of(model, fixed or {}))
        if value is None or value.size != 1:
            setting = ""
            declared = source_dims(model)
            read_inputs = [n for n in read_inputs if _holds_a_setting(declared.get(n))]
            if read_inputs:
                shown = ", ".join(f"{name!r}: ..." for name in read_inputs)
                flags = " ".join(f"--input-value {name}=..." for name in read_inputs)
                setting = (f"if {', '.join(map(repr, read_inputs))} selects a mode rather than carrying data (a "
                           f"sample rate, a flag), fix its value: load_onnx(..., input_values={{{shown}}}) (CLI: "
                           f"{flags}); ")
            raise refusal(
                f"cannot load ONNX model {source!r}: If node {node.name!r} branches on {node.input[0]!r}, which does "
                f"not fold to a constant ({why or 'not a single value'}); fxq takes an If only when its condition "
                f"is fixed at load time. What to do: {setting}if it depends on input sizes, pass load_onnx(..., "
                "input_shapes={...}); if it is Python code of yours, re-export the model with the branch decided "
                "(torch.onnx.export with dynamo=False traces Python ifs into the branch taken; scripted code, such "
                "as torchvision's NMS, stays an If)", model, [index], source, file_tensors)
        taken = bool(value.reshape(()))
        branch = next(helper.get_attribute_value(a) for a in node.attribute
                      if a.name == ("then_branch" if taken else "else_branch"))
        _LOG.info("If node %r: condition %r is %s at load time; taking its %s branch (%d nodes)", node.name,
                  node.input[0], taken, "then" if taken else "else", len(branch.node))
        _inline(model.graph, index, branch, node)
        drop_dead_nodes(model.graph)  # the condition's computation
        folded += 1
        if any(n.op_type == "If" for n in model.graph.node):  # the next condition may read the inlined nodes' sizes
            inferred = infer_for_conversion(clean(model, infer=False), fixed or {})
            if inferred is not model:
                model.CopyFrom(inferred)


def refuse_loops(model: onnx.ModelProto, source: str, file_tensors: Collection[str] | None = None) -> None:
    """Raise :class:`FrontendError` naming every top-level ``Loop`` / ``Scan`` node, with what to do instead."""
    loops = [i for i, n in enumerate(model.graph.node) if n.op_type in _REFUSED]
    found = [f"{model.graph.node[i].name or '<unnamed>'!r} ({model.graph.node[i].op_type})" for i in loops]
    if found:
        raise refusal(
            f"cannot load ONNX model {source!r}: node(s) {', '.join(found)} loop over a body graph, which fxq does "
            "not convert (a loop cannot be quantized as one graph). What to do: re-export with the loop unrolled "
            "(torch.onnx.export(..., dynamo=False) of the model traces Python loops into plain nodes for a fixed "
            "length), and write recurrent layers as nn.LSTM / nn.GRU, which export as single LSTM / GRU nodes "
            "that fxq converts and quantizes", model, loops, source, file_tensors)
