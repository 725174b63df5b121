"""Quantized ONNX files (QDQ format) loaded as the float model they quantize.

A QDQ file (TensorRT's explicit quantization, onnxruntime's ``quantize_static``, fxq's own exports) is a float
graph with ``QuantizeLinear -> DequantizeLinear`` pairs on its activations and ``DequantizeLinear`` over integer
initializers for its weights. fxq quantizes float models for the platform the user picks, so on load:

* a ``DequantizeLinear`` of stored integer tensors becomes the float initializer it computes (the weight as the
  file deploys it);
* a ``QuantizeLinear`` whose output only ``DequantizeLinear`` nodes read is removed with them: their readers read
  the float tensor the pair rounded.

What stays (a ``QuantizeLinear`` read by other ops, scales computed at run time, block-wise or float8 / int4
encodings) is left to the converters, which refuse it by name; the QOperator and dynamic formats
(``QLinearConv``, ``ConvInteger``, ``DynamicQuantizeLinear``...) are refused with :func:`quantized_format_advice`.
"""
from __future__ import annotations

import logging

import numpy as np
import onnx
from onnx import numpy_helper

from fxq.frontends.onnx.cleanup import _constant_value, _replace_nodes, _used_names, nested_graphs

__all__ = ["QUANTIZED_OP_TYPES", "fold_qdq", "quantized_format_advice"]

_LOG = logging.getLogger(__name__)

_DOMAINS = ("", "ai.onnx", "com.microsoft")
_INTEGER_CODES = (np.int8, np.uint8, np.int16, np.uint16, np.int32)

QUANTIZED_OP_TYPES = frozenset({
    "QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "ConvInteger", "MatMulInteger", "QLinearConv",
    "QLinearMatMul", "QLinearAdd", "QLinearMul", "QLinearSigmoid", "QLinearLeakyRelu", "QLinearAveragePool",
    "QLinearGlobalAveragePool", "QLinearConcat", "QLinearSoftmax", "QLinearReduceMean", "QLinearWhere", "QGemm",
    "QAttention", "DynamicQuantizeLSTM", "DynamicQuantizeMatMul", "MatMulIntegerToFloat", "MatMulNBits",
})
"""Op types that only quantized files hold (the default domain's and onnxruntime's ``com.microsoft`` ones)."""


def _is(node: onnx.NodeProto, op_type: str) -> bool:
    return node.op_type == op_type and node.domain in _DOMAINS


def _stored(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """The graph's initializers and default-domain ``Constant`` tensors, by name."""
    graph = model.graph
    values = {t.name: t for t in graph.initializer}
    for node in graph.node:
        tensor = _constant_value(node) if _is(node, "Constant") else None
        if tensor is not None:
            values[node.output[0]] = tensor
    out = {}
    for name, tensor in values.items():
        if tensor.data_location == onnx.TensorProto.EXTERNAL and not tensor.raw_data:
            continue  # external data not loaded: not ours to read
        try:
            out[name] = numpy_helper.to_array(tensor)
        except Exception:  # noqa: BLE001  (an encoding numpy_helper cannot read: left as it is)
            continue
    return out


def _dequantized(node: onnx.NodeProto, stored: dict[str, np.ndarray]) -> np.ndarray | None:
    """What ``DequantizeLinear`` ``node`` computes from stored tensors, in its output type (``output_dtype``, else
    the scale's: float16 files stay float16); None where its codes, scale or zero point are not stored, or are in
    an encoding this fold does not take (block-wise, float8, int4)."""
    names = list(node.input) + [""] * (3 - len(node.input))
    x, scale, zero = (stored.get(n) if n else None for n in names[:3])
    if x is None or scale is None or (names[2] and zero is None):
        return None
    if x.dtype.type not in _INTEGER_CODES or scale.dtype.kind != "f":
        return None
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    if attrs.get("block_size", 0):
        return None
    out_type = attrs.get("output_dtype", 0)
    dtype = onnx.helper.tensor_dtype_to_np_dtype(out_type) if out_type else scale.dtype
    zero = np.zeros((), dtype=np.float64) if zero is None else zero.astype(np.float64)
    scale = scale.astype(np.float64)
    if scale.ndim == 1 and x.ndim > 0:  # per-axis: the scale and zero point run along `axis`
        axis = attrs.get("axis", 1) % x.ndim
        shape = [1] * x.ndim
        shape[axis] = scale.shape[0]
        scale, zero = scale.reshape(shape), (zero.reshape(shape) if zero.ndim == 1 else zero)
    value = (x.astype(np.float64) - zero) * scale
    return value.reshape(x.shape).astype(dtype)  # a scalar's 1-element scale keeps it a scalar


def fold_qdq(model: onnx.ModelProto, source: str) -> int:
    """Load a QDQ file as its float model (module docstring), in place; returns how many Q/DQ nodes went.

    Weight ``DequantizeLinear`` nodes become initializers; an activation ``QuantizeLinear`` whose readers are all
    ``DequantizeLinear`` goes with them, their readers reading its float input (through chains of pairs: a
    requantization). A graph output computed by a removed ``DequantizeLinear`` keeps its name through an
    ``Identity``. Logs what it did, since the file's own scales are not kept: fxq calibrates again."""
    graph = model.graph
    if not any(_is(n, "DequantizeLinear") for n in graph.node):
        return 0
    stored = _stored(model)
    readers: dict[str, list[onnx.NodeProto]] = {}
    for g in nested_graphs(graph):
        for node in g.node:
            for name in node.input:
                readers.setdefault(name, []).append(node)
    outputs = {o.name for o in graph.output}
    top = {id(n) for n in graph.node}
    gone: set[int] = set()
    operands: set[str] = set()  # the removed nodes' stored inputs: dropped below if nothing else reads them
    weights = pairs = 0
    renamed: dict[str, str] = {}
    kept_outputs: list[tuple[str, str]] = []  # (graph output a removed DequantizeLinear computed, its float source)
    for node in graph.node:
        if _is(node, "DequantizeLinear"):
            value = None if node.output[0] in outputs else _dequantized(node, stored)
            if value is not None:
                graph.initializer.append(numpy_helper.from_array(value, node.output[0]))
                operands.update(n for n in node.input if n)
                gone.add(id(node))
                weights += 1
        elif _is(node, "QuantizeLinear") and node.output[0] not in outputs:
            users = readers.get(node.output[0], [])
            if users and all(_is(u, "DequantizeLinear") and id(u) in top for u in users):
                gone.add(id(node))
                operands.update(n for n in list(node.input[1:]) if n in stored)
                for dq in users:
                    gone.add(id(dq))
                    operands.update(n for n in list(dq.input[1:]) if n in stored)
                    renamed[dq.output[0]] = node.input[0]
                    if dq.output[0] in outputs:
                        kept_outputs.append((dq.output[0], node.input[0]))
                pairs += 1
    if not gone:
        return 0

    def resolved(name: str) -> str:
        while name in renamed:
            name = renamed[name]
        return name

    removed = {o for n in graph.node if id(n) in gone for o in n.output}
    identities = [onnx.helper.make_node("Identity", [resolved(src)], [out], name=f"{out}_float")
                  for out, src in kept_outputs]
    _replace_nodes(graph, [n for n in graph.node if id(n) not in gone] + identities)
    for g in nested_graphs(graph):
        for node in g.node:
            node.input[:] = [resolved(n) if n in renamed else n for n in node.input]
        if g is not graph:  # a branch that returns an outer value directly (If outputs bind by position)
            for out in g.output:
                if out.name in renamed:
                    out.name = resolved(out.name)
    # stale records of what went: the integer tensors' value_info (types that no longer hold), and initializers
    # nothing reads any more with their graph-input entries (files that list initializers as inputs)
    infos = [v for v in graph.value_info if v.name not in removed]
    del graph.value_info[:]
    graph.value_info.extend(infos)
    read = _used_names(graph) | outputs
    unread = operands - read
    if unread:
        stay = [t for t in graph.initializer if t.name not in unread]
        del graph.initializer[:]
        graph.initializer.extend(stay)
        inputs = [i for i in graph.input if i.name not in unread]
        del graph.input[:]
        graph.input.extend(inputs)
    _LOG.warning("ONNX model %s is quantized (QDQ format): loaded as its float model, %d stored weight(s) "
                 "dequantized and %d QuantizeLinear -> DequantizeLinear pair(s) removed; the file's own scales are not "
                 "kept, so quantizing it calibrates again", source, weights, pairs)
    return len(gone)


def quantized_format_advice(op_types: set[str]) -> str | None:
    """The advice for a file whose unconverted ops are quantized-only ops (``op_types``); None if none are."""
    found = sorted(op_types & QUANTIZED_OP_TYPES)
    if not found:
        return None
    if set(found) <= {"QuantizeLinear", "DequantizeLinear"}:
        return (f"What to do: this file is quantized in QDQ form, and these {' / '.join(found)} nodes are not what "
                "fxq folds on load (a QuantizeLinear read only by DequantizeLinear nodes, or a DequantizeLinear of "
                "stored integers with stored scales): an integer graph output, scales computed at run time, a "
                "block-wise, float8 or int4 encoding. Load the float model this file was quantized from.")
    return (f"What to do: this file is already quantized ({', '.join(found)}): fxq quantizes float models, and "
            "loads a QDQ file (QuantizeLinear -> DequantizeLinear pairs, weights as DequantizeLinear of stored "
            "integers) as its float model, but not onnxruntime's QOperator or dynamic formats. Load the float "
            "model this file was quantized from (or a QDQ export of it).")
