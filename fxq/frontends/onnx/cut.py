"""Load part of an ONNX graph: ``load_onnx(path, outputs=[...])`` keeps what those tensors need.

Deployment engineers cut a detector before its post-processing (NMS, data-dependent ``If`` / ``Loop``): the network
runs int8 on the accelerator, the rest stays FP32 beside it. fxq cannot convert a branch on run-time values, so
when it meets one it names the cut that leaves it out (:func:`suggest_outputs`): the tensors that the part it
cannot take reads from the part before it.
"""
from __future__ import annotations

import difflib
from typing import Any, Callable, Collection, Hashable, Iterable, Sequence

import onnx

from fxq.backends.qdq.onnx_graph import drop_dead_nodes, node_reads, remove_initializers
from fxq.errors import FrontendError
from fxq.frontends.onnx.cleanup import infer_shapes
from fxq.qconfig.base import COMPUTING_OPS

__all__ = ["keep_outputs", "suggest_outputs", "refusal", "cut_advice", "cut_frontier", "follows_data_shaped"]

_DATA_SHAPED = ("NonZero", "NonMaxSuppression", "Unique", "Compress")
"""Ops whose output size depends on their input's values (a score threshold, NMS): a cut before the part fxq cannot
convert also leaves out those that feed it, so the loaded graph's outputs have sizes set by the input's."""

_SHAPE_ONLY = ("Shape", "Size")
"""Ops whose output depends on their input's dims, not its values: a tensor computed from them alone is fixed once
the input sizes are."""


def keep_outputs(model: onnx.ModelProto, outputs: Sequence[str], source: str) -> onnx.ModelProto:
    """A copy of ``model`` whose graph outputs are ``outputs`` (in that order), with only the nodes, initializers
    and inputs they need.

    Raises:
        FrontendError: a name that no node of the graph computes (with the closest names; graph inputs and
            initializers are named as such), a name given twice, an empty list, or an output whose element type
            shape inference cannot tell.
    """
    graph = model.graph
    outputs = list(outputs)
    if not outputs:
        raise FrontendError(f"load_onnx({source!r}, outputs=[]): name at least one tensor of the graph")
    twice = sorted({o for o in outputs if outputs.count(o) > 1})
    if twice:
        raise FrontendError(f"load_onnx({source!r}, outputs=...): {twice} given more than once; name each once")
    produced = {o for n in graph.node for o in n.output if o}
    inits = {t.name for t in graph.initializer}
    inputs = {i.name for i in graph.input} - inits
    stored = [o for o in outputs if o not in produced and (o in inputs or o in inits)]
    if stored:
        raise FrontendError(
            f"load_onnx({source!r}, outputs=...): {stored} are graph inputs or weights, not values a node computes; "
            "name node outputs (a cut keeps the nodes that compute them)")
    unknown = [o for o in outputs if o not in produced]
    if unknown:
        known = sorted(produced)
        hints = {u: difflib.get_close_matches(u, known, n=3, cutoff=0.5) for u in unknown}
        raise FrontendError(
            f"load_onnx({source!r}, outputs=...): {unknown} are not tensors of the graph"
            + "".join(f"; for {u!r} did you mean {h}" for u, h in hints.items() if h)
            + ". Tensor names are the node outputs of the file (Netron shows them)")
    typed = infer_shapes(model)
    infos = {v.name: v for v in [*typed.graph.value_info, *typed.graph.output, *typed.graph.input]}
    untyped = [o for o in outputs if o not in infos or not infos[o].type.tensor_type.elem_type]
    if untyped:
        raise FrontendError(f"load_onnx({source!r}, outputs=...): the type of tensor(s) {untyped} is unknown to ONNX "
                            "shape inference; name tensors before or after them")
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    g.ClearField("output")
    g.output.extend(infos[o] for o in outputs)
    needed = drop_dead_nodes(g)
    kept_inputs = [i for i in g.input if i.name in needed]
    g.ClearField("input")
    g.input.extend(kept_inputs)
    remove_initializers(g, {t.name for t in g.initializer} - needed)
    kept_infos = [v for v in g.value_info if v.name in needed]
    g.ClearField("value_info")
    g.value_info.extend(kept_infos)
    return out


def suggest_outputs(model: onnx.ModelProto, blocking: Iterable[int]) -> list[str]:
    """The outputs of a cut that leaves out the ``blocking`` nodes (their indices in the graph), the ops with
    value-dependent output sizes that feed them (:data:`_DATA_SHAPED`), and everything computed from those
    (:func:`cut_frontier`): the tensors the left-out part reads from the kept part that nodes compute and that carry
    the input's values (not constants, not sizes of tensors), then the graph outputs the kept part computes. In file
    order; empty when nothing would be left."""
    nodes = list(model.graph.node)
    left_out = set(blocking) | _data_shaped_ancestors(nodes, set(blocking))
    producer = {o: i for i, n in enumerate(nodes) for o in n.output if o}
    inits = {t.name for t in model.graph.initializer}
    carries = {i.name for i in model.graph.input if i.name not in inits}  # tensors that carry the input's values
    for node in nodes:
        if node.op_type not in _SHAPE_ONLY and any(r in carries for r in node_reads(node)):
            carries.update(o for o in node.output if o)
    gone, read = cut_frontier(list(producer), lambda t: node_reads(nodes[producer[t]]) if t in producer else (),
                              [o for i in sorted(left_out) for o in nodes[i].output if o])
    suggested = [t for t in read if t in carries and t in producer]
    return suggested + [o.name for o in model.graph.output
                        if o.name in carries and o.name not in gone and o.name not in suggested]


def cut_frontier(order: Sequence[Hashable], reads: Callable[[Any], Iterable[Hashable]],
                 left_out: Iterable[Hashable]) -> tuple[set[Any], list[Any]]:
    """The part of a graph a cut leaves out, ``left_out`` and every value computed from it, and the values that part
    reads from the rest, in order of first read: the cut's outputs, besides the graph outputs it keeps. ``order``:
    the graph's values in topological order; ``reads``: what the node computing a value reads. One definition for
    the ONNX graph (:func:`suggest_outputs`) and for an exporter's fx graph (the ncnn writer's cut)."""
    gone = set(left_out)
    for v in order:
        if v not in gone and any(r in gone for r in reads(v)):
            gone.add(v)
    read: list[Any] = []
    for v in order:
        if v in gone:
            read += [r for r in reads(v) if r not in gone and r not in read]
    return gone, read


def follows_data_shaped(graph: onnx.GraphProto, blocking: Iterable[int]) -> bool:
    """Whether any of the ``blocking`` nodes (indices in ``graph``) reads, directly or not, an op whose output size
    depends on the input's values (:data:`_DATA_SHAPED`): a detector's post-processing, which a cut before it leaves
    to run beside."""
    return bool(_data_shaped_ancestors(list(graph.node), set(blocking)))


def _data_shaped_ancestors(nodes: list[onnx.NodeProto], blocking: set[int]) -> set[int]:
    """Indices of the :data:`_DATA_SHAPED` nodes that the ``blocking`` nodes read from, directly or not."""
    producer = {o: i for i, n in enumerate(nodes) for o in n.output if o}
    seen: set[int] = set()
    stack = list(blocking)
    while stack:
        for name in node_reads(nodes[stack.pop()]):
            i = producer.get(name)
            if i is not None and i not in seen:
                seen.add(i)
                stack.append(i)
    return {i for i in seen if nodes[i].op_type in _DATA_SHAPED}


def refusal(message: str, model: onnx.ModelProto, blocking: Iterable[int], source: str,
            file_tensors: Collection[str] | None = None) -> FrontendError:
    """A :class:`FrontendError` refusing the ``blocking`` nodes (indices): ``message`` plus, when something would be
    left, the cut that loads the graph without them and what follows from them; the cut's names are also its
    ``suggested_outputs`` attribute (empty when there is none). ``file_tensors``: the node outputs of the file as
    read; a cut naming anything else (a tensor of a folded If's branch, renamed when it was inlined) is not
    suggested, since ``outputs=`` could not find it."""
    names = suggest_outputs(model, blocking)
    if file_tensors is not None and not set(names) <= set(file_tensors):
        names = []
    if names and not _computes_quantizable(model, names):
        names = []  # the part before holds no layer to quantize (an If on an input that selects a mode)
    if names:
        message += "; or " + cut_advice(source, names, "(post-processing) in FP32 beside the quantized model")
    exc = FrontendError(message)
    exc.suggested_outputs = tuple(names)
    return exc


def _computes_quantizable(model: onnx.ModelProto, names: Sequence[str]) -> bool:
    """Whether the nodes computing ``names`` include a layer fxq quantizes (:data:`COMPUTING_OPS`)."""
    producer = {o: n for n in model.graph.node for o in n.output if o}
    stack, seen = list(names), set()
    while stack:
        node = producer.get(stack.pop())
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if node.op_type in COMPUTING_OPS:
            return True
        stack.extend(node_reads(node))
    return False


def cut_advice(source: str, names: Sequence[str], where: str) -> str:
    """The advice to load ``source`` only up to the tensors ``names`` (Python and CLI), the rest run ``where``."""
    return (f"load the part before it and run the rest {where}: "
            f"fxq.load_onnx({source!r}, outputs={list(names)!r}) (CLI: --outputs {','.join(names)})")
