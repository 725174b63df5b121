"""Clean-up passes on an ``onnx.ModelProto`` before onnx2torch sees it. Each pass edits the model in place.

- :func:`normalize_domains`: the default domain spelled ``"ai.onnx"`` becomes ``""`` (what onnx2torch looks up).
- :func:`drop_initializer_inputs`: old (IR < 4) models list initializers among the graph inputs too (moved to IR 4).
- :func:`fold_constants`: ``Constant`` nodes become initializers of the same name.
- :func:`fold_identities`: ``Identity(initializer) -> t`` (and ``Cast(initializer) -> t``) becomes an initializer
  ``t``. torch's legacy exporter routes de-duplicated constants through ``Identity`` (a conv bias
  ``Identity(onnx::Conv_194) -> onnx::Conv_197``), dynamo exports without constant folding cast constants, and
  onnx2torch's converters look such inputs up among the initializers only.
- :func:`fold_parameter_inputs`: a weight, bias or statistics input computed from initializers only
  (``weight_norm``'s ``g * v / ||v||``, written by torch's legacy exporter without constant folding) becomes an
  initializer: the converters take parameters from initializers only (``KeyError`` before), and fxq quantizes a
  weight it can see.
- :func:`drop_redundant_allowzero`: ``Reshape(allowzero=1)`` with a constant shape free of 0 means the same as
  ``allowzero=0``, the only form onnx2torch's ``Reshape-14`` converter takes (torch's default exporter writes 1).
- :func:`drop_unread_optional_outputs`: optional trailing outputs nothing reads (old exporters' Dropout masks).
- :func:`infer_shapes`: onnx's shape inference (with data propagation), so converters know ranks and sizes.

:func:`alias_dotted_domains` runs last, just before conversion (after the support check, so errors show the real
domains): onnx2torch puts a node's domain into its module name, where a dot is illegal.

Names are kept: a folded tensor keeps the name its consumers use, so node inputs still match the user's file.
Nodes whose output is a graph output are kept (onnx2torch needs every graph output produced by a node).
"""
from __future__ import annotations

import logging
from typing import Iterator

import numpy as np
import onnx
from onnx import numpy_helper

from fxq import onnx_data
from fxq.onnx_data import LIGHT_MIN_ELEMENTS, light_copy

__all__ = ["clean", "alias_dotted_domains", "normalize_domains", "drop_initializer_inputs", "fold_constants",
           "fold_identities", "fold_parameter_inputs", "drop_redundant_allowzero", "drop_unread_optional_outputs",
           "infer_shapes", "light_copy", "LIGHT_MIN_ELEMENTS"]

_LOG = logging.getLogger(__name__)
_DEFAULT_DOMAINS = ("", "ai.onnx")
_T = onnx.TensorProto
_PLAIN_CASTS = {_T.FLOAT, _T.DOUBLE, _T.FLOAT16, _T.BOOL, _T.INT8, _T.INT16, _T.INT32, _T.INT64, _T.UINT8, _T.UINT16,
                _T.UINT32, _T.UINT64}  # onnx serializes the model for shape inference: protobuf's 2 GB limit


def normalize_domains(model: onnx.ModelProto) -> None:
    """Spell the default domain ``""`` in opset imports and nodes (``"ai.onnx"`` is the same domain)."""
    for imp in model.opset_import:
        if imp.domain == "ai.onnx":
            imp.domain = ""
    for node in model.graph.node:
        if node.domain == "ai.onnx":
            node.domain = ""


_IR_INITIALIZERS_NOT_INPUTS = 4
"""The first IR version whose initializers need not be graph inputs too (before it, an initializer is only an
input's default value, and onnx's shape inference types no initializer that is not an input)."""


def drop_initializer_inputs(model: onnx.ModelProto) -> int:
    """Remove graph inputs that are initializers; returns how many. A model of an IR version before 4 (onnx-caffe2's
    and torch 0.3's files) is moved to IR 4, where that means what it meant: its initializers stay typed for shape
    inference."""
    inits = {t.name for t in model.graph.initializer}
    keep = [i for i in model.graph.input if i.name not in inits]
    dropped = len(model.graph.input) - len(keep)
    if dropped:
        del model.graph.input[:]
        model.graph.input.extend(keep)
    if model.ir_version < _IR_INITIALIZERS_NOT_INPUTS:  # folded Constants become initializers that are not inputs
        model.ir_version = _IR_INITIALIZERS_NOT_INPUTS
    return dropped


def _constant_value(node: onnx.NodeProto) -> onnx.TensorProto | None:
    """The tensor a ``Constant`` node produces, or None for forms we leave to onnx2torch (strings, sparse)."""
    if len(node.attribute) != 1:
        return None
    attr = node.attribute[0]
    if attr.name == "value":
        tensor = onnx.TensorProto()
        tensor.CopyFrom(attr.t)
        return tensor
    arrays = {
        "value_float": lambda: np.array(attr.f, dtype=np.float32),
        "value_floats": lambda: np.array(list(attr.floats), dtype=np.float32),
        "value_int": lambda: np.array(attr.i, dtype=np.int64),
        "value_ints": lambda: np.array(list(attr.ints), dtype=np.int64),
    }
    make = arrays.get(attr.name)
    return numpy_helper.from_array(make()) if make is not None else None


def _replace_nodes(graph: onnx.GraphProto, keep: list[onnx.NodeProto]) -> None:
    kept = [onnx.NodeProto() for _ in keep]
    for dst, src in zip(kept, keep):
        dst.CopyFrom(src)
    del graph.node[:]
    graph.node.extend(kept)


def fold_constants(model: onnx.ModelProto) -> int:
    """Turn default-domain ``Constant`` nodes into initializers; returns how many were folded."""
    graph = model.graph
    outputs = {o.name for o in graph.output}
    keep: list[onnx.NodeProto] = []
    folded = 0
    for node in graph.node:
        tensor = None
        if node.op_type == "Constant" and node.domain in _DEFAULT_DOMAINS and node.output[0] not in outputs:
            tensor = _constant_value(node)
        if tensor is None:
            keep.append(node)
            continue
        tensor.name = node.output[0]
        graph.initializer.append(tensor)
        folded += 1
    if folded:
        _replace_nodes(graph, keep)
    return folded


def _cast_array(node: onnx.NodeProto, value: np.ndarray) -> np.ndarray | None:
    """``Cast(value)`` for numeric and bool targets (numpy's conversions are ONNX's there); None otherwise."""
    to = next((a.i for a in node.attribute if a.name == "to"), None)
    if to not in _PLAIN_CASTS or value.dtype.kind not in "biuf":
        return None  # strings, complex, bfloat16, float8/float4/int4...: onnx2torch's business
    return value.astype(onnx.helper.tensor_dtype_to_np_dtype(to))


def fold_identities(model: onnx.ModelProto) -> int:
    """Turn default-domain ``Identity`` and ``Cast`` nodes of initializers into initializers; returns how many.

    A dynamo export with constant folding off writes ``Clip(x, Cast(min), Cast(max))``; onnx2torch reads such
    bounds from initializers only. Initializers left unused by the fold are removed.
    """
    graph = model.graph
    outputs = {o.name for o in graph.output}
    inits = {t.name: t for t in graph.initializer}
    keep: list[onnx.NodeProto] = []
    sources: set[str] = set()
    for node in graph.node:  # nodes are topologically sorted: chains fold front to back
        src = node.input[0] if node.op_type in ("Identity", "Cast") and node.domain in _DEFAULT_DOMAINS else None
        if src is None or src not in inits or node.output[0] in outputs:
            keep.append(node)
            continue
        if node.op_type == "Identity":
            tensor = onnx.TensorProto()
            tensor.CopyFrom(inits[src])
        else:
            cast = _cast_array(node, numpy_helper.to_array(inits[src]))
            if cast is None:
                keep.append(node)
                continue
            tensor = numpy_helper.from_array(cast)
        tensor.name = node.output[0]
        graph.initializer.append(tensor)
        inits[tensor.name] = graph.initializer[-1]
        sources.add(src)
    folded = len(graph.node) - len(keep)
    if folded:
        _replace_nodes(graph, keep)
        used = _used_names(graph) | outputs
        unused = [t for t in graph.initializer if t.name in sources and t.name not in used]
        for t in unused:
            graph.initializer.remove(t)
    return folded


PARAMETER_INPUTS: dict[str, tuple[int, ...]] = {
    "Conv": (1, 2), "ConvTranspose": (1, 2), "Gemm": (1, 2), "MatMul": (1,), "PRelu": (1,),
    "BatchNormalization": (1, 2, 3, 4), "InstanceNormalization": (1, 2), "LayerNormalization": (1, 2),
    "LSTM": (1, 2, 3, 7), "GRU": (1, 2, 3), "RNN": (1, 2, 3),  # W, R, B (and LSTM's peepholes P)
}
"""Inputs that hold a layer's parameters (weights, biases, statistics, slopes), by op type."""

_NO_FOLD = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli",
            "Dropout"}


def fold_parameter_inputs(model: onnx.ModelProto) -> int:
    """Compute the parameter inputs (:data:`PARAMETER_INPUTS`) that nodes derive from initializers only, with
    ``onnx.reference``, and make them initializers of the same name; returns how many. The deriving nodes go
    where nothing else reads them."""
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    producer = {o: n for n in graph.node for o in n.output if o}
    constant: dict[str, bool] = {"": True}

    def known(name: str) -> bool:
        return name in inits or name in constant

    def derived(name: str) -> bool:
        """From initializers only, through plain deterministic nodes (memoized). A walk with its own stack: asking
        about a weight computed deep in the network must not depend on Python's recursion limit (PP-OCRv5's
        recognizer asked ~1000 producers deep)."""
        stack = [(name, False)]
        while stack:
            cur, inputs_done = stack.pop()
            node = producer.get(cur)
            if inputs_done:  # every input is known now
                constant[cur] = all(i in inits or constant[i] for i in node.input)
                continue
            if known(cur):
                continue
            ok = node is not None and node.domain in _DEFAULT_DOMAINS and node.op_type not in _NO_FOLD and bool(
                node.input) and not any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
                                        for a in node.attribute)
            constant[cur] = False  # until its inputs say otherwise; a cycle cannot be constant
            if ok:
                stack.append((cur, True))
                stack.extend((i, False) for i in node.input if not known(i))
        return name in inits or constant[name]

    outputs = {o.name for o in graph.output}
    wanted = sorted({name for node in graph.node if node.domain in _DEFAULT_DOMAINS
                     for i in PARAMETER_INPUTS.get(node.op_type, ()) if i < len(node.input)
                     and (name := node.input[i]) and name not in inits and name not in outputs
                     and name in producer and len(producer[name].output) == 1 and derived(name)})  # (graph outputs stay node outputs)
    if not wanted:
        return 0
    needed: set[str] = set()
    stack = list(wanted)
    while stack:
        name = stack.pop()
        node = producer.get(name)
        if name in inits or node is None or id(node) in needed:
            continue
        needed.add(id(node))
        stack.extend(node.input)
    chain = [n for n in graph.node if id(n) in needed]
    used = sorted({i for n in chain for i in n.input if i in inits})
    sub = onnx.helper.make_model(
        onnx.helper.make_graph(chain, "parameters", [], [onnx.ValueInfoProto(name=w) for w in wanted],
                               [inits[k] for k in used]),
        opset_imports=list(model.opset_import), ir_version=model.ir_version)
    from onnx.reference import ReferenceEvaluator

    try:
        values = ReferenceEvaluator(sub).run(None, {})
    except Exception as exc:  # noqa: BLE001  (the converters then name the node they cannot take)
        _LOG.debug("computed parameters not folded: %s", exc)
        return 0
    for name, value in zip(wanted, values):
        tensor = numpy_helper.from_array(np.asarray(value), name)
        graph.initializer.append(tensor)
    keep = list(graph.node)
    while True:  # drop the deriving nodes nothing else reads (the wanted tensors are initializers now)
        read = ({i for n in keep for i in n.input} | outputs) - set(wanted)
        dead = [n for n in keep if id(n) in needed and not any(o in read for o in n.output)]
        if not dead:
            break
        keep = [n for n in keep if all(n is not d for d in dead)]
    _replace_nodes(graph, keep)
    read = _used_names(graph) | outputs
    for t in [t for t in graph.initializer if t.name in used and t.name not in read]:
        graph.initializer.remove(t)
    return len(wanted)


OPTIONAL_TRAILING_OUTPUTS = {"Dropout": 1, "MaxPool": 1, "BatchNormalization": 1, "LayerNormalization": 1}
"""Op type -> how many leading outputs stay: the outputs after them are optional by the op's schema (Dropout's mask,
MaxPool's indices, BatchNormalization's training statistics, LayerNormalization's mean / inverse std)."""


def drop_unread_optional_outputs(model: onnx.ModelProto) -> int:
    """Remove the optional trailing outputs (:data:`OPTIONAL_TRAILING_OUTPUTS`) that no node reads and that are not
    graph outputs, as if the exporter had not named them; returns how many. Old exporters name them all (onnx-caffe2's
    Dropout masks); a converter then had to produce values nobody uses."""
    graph = model.graph
    read = _used_names(graph) | {o.name for o in graph.output}  # If / Loop bodies may read outer values
    dropped = 0
    for node in graph.node:
        keep = OPTIONAL_TRAILING_OUTPUTS.get(node.op_type) if node.domain in _DEFAULT_DOMAINS else None
        if keep is None or len(node.output) <= keep:
            continue
        outs = list(node.output)
        while len(outs) > keep and (not outs[-1] or outs[-1] not in read):
            outs.pop()
            dropped += 1
        if len(outs) < len(node.output):
            del node.output[:]
            node.output.extend(outs)
    return dropped


def drop_redundant_allowzero(model: onnx.ModelProto) -> int:
    """Remove ``allowzero=1`` from Reshape nodes whose constant shape has no 0; returns how many."""
    inits = {t.name: t for t in model.graph.initializer}
    changed = 0
    for node in model.graph.node:
        if node.op_type != "Reshape" or node.domain not in _DEFAULT_DOMAINS or len(node.input) < 2:
            continue
        attrs = [a for a in node.attribute if a.name == "allowzero" and a.i == 1]
        shape = inits.get(node.input[1])
        if attrs and shape is not None and 0 not in numpy_helper.to_array(shape).reshape(-1).tolist():
            node.attribute.remove(attrs[0])
            changed += 1
    return changed


def nested_graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """``graph`` and every graph its If / Loop / Scan nodes hold, nested ones included (a stack, no recursion)."""
    stack = [graph]
    while stack:
        g = stack.pop()
        yield g
        for node in g.node:
            for attr in node.attribute:
                stack.extend(([attr.g] if attr.HasField("g") else []) + list(attr.graphs))


def _used_names(graph: onnx.GraphProto) -> set[str]:
    """Every tensor name a node reads, subgraphs (If/Loop bodies) included."""
    return {name for g in nested_graphs(graph) for node in g.node for name in node.input}


def infer_shapes(model: onnx.ModelProto, *, in_place: bool = False) -> onnx.ModelProto:
    """:func:`fxq.onnx_data.infer_shapes` with data propagation (``model`` itself when ``in_place``, else a copy);
    unchanged, with a warning logged, when inference fails."""
    try:
        return onnx_data.infer_shapes(model, in_place=in_place, data_prop=True)
    except Exception as exc:  # noqa: BLE001  (inference is a help, not a requirement)
        _LOG.warning("ONNX shape inference failed (%s); converting without inferred shapes", exc)
        return model


def alias_dotted_domains(model: onnx.ModelProto) -> dict[str, str]:
    """Rename dotted custom domains (``com.example`` -> ``com_example``) in place; returns ``{alias: domain}``."""
    from fxq.frontends.onnx.converters.registry import domain_alias

    aliases: dict[str, str] = {}
    for imp in model.opset_import:
        alias = domain_alias(imp.domain)
        if alias != imp.domain:
            aliases[alias] = imp.domain
            imp.domain = alias
    back = {v: k for k, v in aliases.items()}
    for node in model.graph.node:
        if node.domain in back:
            node.domain = back[node.domain]
    return aliases


def clean(model: onnx.ModelProto, *, infer: bool = True) -> onnx.ModelProto:
    """All clean-up passes in order; ``model`` is edited in place and returned (shape-inferred when ``infer``)."""
    normalize_domains(model)
    dropped = drop_initializer_inputs(model)
    constants = fold_constants(model)
    identities = fold_identities(model)
    parameters = fold_parameter_inputs(model)
    allowzero = drop_redundant_allowzero(model)
    unread = drop_unread_optional_outputs(model)
    _LOG.debug(
        "ONNX clean-up: %d initializer inputs dropped, %d Constant and %d Identity/Cast folded, %d computed "
        "parameters folded, %d allowzero dropped, %d unread optional outputs dropped", dropped, constants,
        identities, parameters, allowzero, unread,
    )
    return infer_shapes(model, in_place=True) if infer else model
