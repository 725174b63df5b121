"""Shapes for conversion: the user's ``input_shapes``, onnx's shape inference and inference-only constant folding.

The converted graph keeps the file's nodes (``Shape`` and its arithmetic stay, so exports stay dynamic); only the
``value_info`` that converters read (ranks, static sizes) comes from an inference run at concrete input shapes,
on a skeleton copy where shape subgraphs that are constant at those shapes are folded with ``onnx.reference``.
"""
from __future__ import annotations

import logging
from typing import Mapping, Sequence

import numpy as np
import onnx
from onnx import numpy_helper

from fxq.errors import FrontendError
from fxq.frontends.onnx.cleanup import infer_shapes, light_copy

__all__ = ["Dims", "source_dims", "fix_input_shapes", "fix_input_values", "infer_for_conversion", "unknown_rank_nodes",
           "RANK_OPS"]

_LOG = logging.getLogger(__name__)

Dims = list  # list[int | str | None]: static size, symbolic dim_param, or unknown

RANK_OPS = frozenset({"BatchNormalization", "MaxPool", "AveragePool", "LpPool", "InstanceNormalization"})
"""Ops whose converters read their data input's rank (or sizes) from shape inference."""

_FOLD_MAX_ELEMENTS = 1 << 16  # constant inputs and outputs folded for inference only: shape-sized tensors
_FOLD_ROUNDS = 64
_NONDETERMINISTIC = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial",
                     "Bernoulli", "Dropout"}


def tensor_dims(info: onnx.ValueInfoProto) -> Dims | None:
    """Dims of a value info, or None when its rank is unknown."""
    t = info.type.tensor_type if info.type.HasField("tensor_type") else None
    if t is None or not t.HasField("shape"):
        return None
    return [int(d.dim_value) if d.HasField("dim_value") else (d.dim_param if d.HasField("dim_param") else None)
            for d in t.shape.dim]


def source_dims(model: onnx.ModelProto) -> dict[str, Dims]:
    """``{graph input: dims}`` as the file declares them (initializers excluded)."""
    inits = {t.name for t in model.graph.initializer}
    return {i.name: (tensor_dims(i) or []) for i in model.graph.input if i.name not in inits}


def _how(name: str, dims: Sequence[object]) -> str:
    shown = [d if isinstance(d, int) and d > 0 else ("N" if i == 0 else f"D{i}") for i, d in enumerate(dims)]
    return (f"load_onnx(path, input_shapes={{{name!r}: {shown}}}) (CLI: --input-shape "
            f"{name}={','.join(str(s) for s in shown)}), with the dims your data has")


def fix_input_shapes(model: onnx.ModelProto, input_shapes: Mapping[str, Sequence[int]] | Sequence[int] | None,
                     source: str) -> dict[str, list[int]]:
    """Check ``input_shapes`` against the file's inputs; returns ``{input: static dims}`` (empty when not given).

    A bare shape applies to a model's only input. Dims the file fixes must be given as in the file.

    Raises:
        FrontendError: unknown input names, wrong rank, non-positive dims or dims differing from the file's.
    """
    if input_shapes is None:
        return {}
    declared = source_dims(model)
    if not isinstance(input_shapes, Mapping):
        if len(declared) != 1:
            raise FrontendError(f"ONNX model {source!r} has {len(declared)} inputs {list(declared)}: give "
                                f"input_shapes as {{input name: shape}}")
        input_shapes = {next(iter(declared)): input_shapes}
    fixed: dict[str, list[int]] = {}
    for name, shape in input_shapes.items():
        if name not in declared:
            raise FrontendError(f"input_shapes names {name!r}, which is not an input of ONNX model {source!r}; "
                                f"its inputs are {list(declared)}")
        try:
            dims = [int(d) for d in shape]
        except (TypeError, ValueError):
            raise FrontendError(f"input_shapes[{name!r}] must be a list of ints, got {shape!r}") from None
        if any(d <= 0 or d != s for d, s in zip(dims, shape)) or not dims:
            raise FrontendError(f"input_shapes[{name!r}] = {list(shape)!r}: dims must be positive integers")
        file_dims = declared[name]
        if file_dims and len(file_dims) != len(dims):
            raise FrontendError(f"input_shapes[{name!r}] = {dims} has rank {len(dims)} but input {name!r} of "
                                f"{source!r} has rank {len(file_dims)} ({file_dims})")
        clash = [(i, f, d) for i, (f, d) in enumerate(zip(file_dims, dims)) if isinstance(f, int) and f > 0 and f != d]
        if clash:
            i, f, d = clash[0]
            raise FrontendError(f"input_shapes[{name!r}] = {dims} gives dim {i} as {d} but {source!r} fixes it to "
                                f"{f}; only symbolic or unknown dims can be chosen ({file_dims})")
        fixed[name] = dims
    return fixed


def check_batch_dims(batch_dims: Mapping[str, int | None] | None, declared: Mapping[str, Sequence[object]],
                     source: str) -> dict[str, int | None]:
    """``load_onnx(batch_dims=...)`` checked against the file's inputs and outputs (``declared``: their declared
    dims by name), negative dims made positive, None kept (no batch dim); FrontendError naming what does not fit."""
    checked: dict[str, int | None] = {}
    for name, dim in (batch_dims or {}).items():
        if name not in declared:
            raise FrontendError(f"load_onnx({source!r}, batch_dims=...): {name!r} is not an input or output of the "
                                f"model; its inputs and outputs are {sorted(declared)}")
        if dim is None:
            checked[name] = None
            continue
        rank = len(declared[name])
        if rank == 0:
            raise FrontendError(f"load_onnx({source!r}, batch_dims=...): the file does not declare the rank of "
                                f"{name!r}, so no dim of it can be named; give the batch dims of tensors whose shapes "
                                "the file declares")
        if isinstance(dim, bool) or not isinstance(dim, int) or not -rank <= dim < rank:
            raise FrontendError(f"load_onnx({source!r}, batch_dims=...): {name!r} has rank {rank}; its batch dim "
                                f"must be an integer in [{-rank}, {rank - 1}], or None for no batch dim, got {dim!r}")
        checked[name] = dim % rank
    return checked


def fix_input_values(model: onnx.ModelProto, input_values: Mapping[str, object] | None,
                     source: str) -> dict[str, np.ndarray]:
    """Make the inputs ``input_values`` names constants of ``model`` (in place): each becomes an initializer holding
    its value, in the input's declared element type, and stops being an input. For inputs that select a mode
    rather than carry data (silero VAD's sample rate ``sr``, a flag): an ``If`` on them then folds at load time,
    and the loaded graph and its exports take only the other inputs. Returns ``{input: value}`` (empty when not
    given).

    Raises:
        FrontendError: unknown input names, a value the declared type or dims cannot hold, or no input left.
    """
    if not input_values:
        return {}
    if not isinstance(input_values, Mapping):
        raise FrontendError(f"input_values must be a mapping {{input name: value}}, got {type(input_values).__name__}")
    declared = source_dims(model)
    infos = {i.name: i for i in model.graph.input}
    fixed: dict[str, np.ndarray] = {}
    for name, value in input_values.items():
        if name not in declared:
            raise FrontendError(f"input_values names {name!r}, which is not an input of ONNX model {source!r}; its "
                                f"inputs are {list(declared)}")
        elem = infos[name].type.tensor_type.elem_type
        try:
            dtype = onnx.helper.tensor_dtype_to_np_dtype(elem)
            wanted = np.asarray(value)
            array = wanted.astype(dtype)
        except (TypeError, ValueError, KeyError) as exc:
            raise FrontendError(f"input_values[{name!r}] = {value!r} cannot be a tensor of input {name!r}'s type "
                                f"({onnx.TensorProto.DataType.Name(elem)}): {exc}") from None
        if wanted.dtype.kind in "fc" and dtype.kind in "iub" and not np.array_equal(array, wanted):
            raise FrontendError(f"input_values[{name!r}] = {value!r}: input {name!r} holds integers "
                                f"({onnx.TensorProto.DataType.Name(elem)}); give a whole number")
        dims = tensor_dims(infos[name])  # None: the file leaves the rank open
        if dims is not None and (len(dims) != array.ndim or any(isinstance(d, int) and d > 0 and d != n
                                                                for d, n in zip(dims, array.shape))):
            raise FrontendError(f"input_values[{name!r}] has shape {list(array.shape)} but input {name!r} of "
                                f"{source!r} is declared {dims}")
        fixed[name] = array
    if len(fixed) == len(declared):
        raise FrontendError(f"input_values fixes every input of ONNX model {source!r} ({list(declared)}): leave at "
                            "least one input for the data")
    kept = [i for i in model.graph.input if i.name not in fixed]
    model.graph.ClearField("input")
    model.graph.input.extend(kept)
    model.graph.initializer.extend(numpy_helper.from_array(v, k) for k, v in fixed.items())
    _LOG.info("ONNX model %s: input(s) %s fixed to constants (input_values)", source, list(fixed))
    return fixed


def _static_inputs(model: onnx.ModelProto, fixed: Mapping[str, list[int]]) -> dict[str, list[int]] | None:
    """Concrete shapes of every input: ``fixed`` or the file's static dims; None when some dim is open."""
    out: dict[str, list[int]] = {}
    for name, dims in source_dims(model).items():
        if name in fixed:
            out[name] = list(fixed[name])
        elif dims is not None and all(isinstance(d, int) and d > 0 for d in dims) and (dims or _is_scalar(model, name)):
            out[name] = list(dims)
        else:
            return None
    return out


def _is_scalar(model: onnx.ModelProto, name: str) -> bool:
    info = next(i for i in model.graph.input if i.name == name)
    return info.type.HasField("tensor_type") and info.type.tensor_type.HasField("shape")


def _set_dims(info: onnx.ValueInfoProto, dims: Sequence[int]) -> None:
    shape = info.type.tensor_type.shape
    shape.ClearField("dim")
    for d in dims:
        shape.dim.add().dim_value = int(d)


def _skeleton(model: onnx.ModelProto, shapes: Mapping[str, list[int]]) -> onnx.ModelProto:
    """A copy for inference: inputs fixed to ``shapes``, large initializers turned into typed graph inputs."""
    skel = light_copy(model)
    skel.graph.ClearField("value_info")
    for info in skel.graph.input:
        if info.name in shapes:
            _set_dims(info, shapes[info.name])
    return skel


def _infos(model: onnx.ModelProto) -> dict[str, onnx.ValueInfoProto]:
    g = model.graph
    return {v.name: v for v in list(g.input) + list(g.value_info) + list(g.output)}


def _fold_round(skel: onnx.ModelProto, inferred: onnx.ModelProto) -> int:
    """Fold into ``skel`` the nodes whose inputs are constant at the fixed shapes; returns how many were folded."""
    from onnx.reference import ReferenceEvaluator

    graph = skel.graph
    infos = _infos(inferred)
    inits = {t.name: t for t in graph.initializer}
    known: set[str] = set(inits) | {""}
    seeds: dict[str, np.ndarray] = {}
    chosen: list[int] = []
    for idx, node in enumerate(graph.node):
        if node.op_type in ("Shape", "Size") and node.domain in ("", "ai.onnx") and node.input[0] in infos:
            dims = tensor_dims(infos[node.input[0]])
            if dims is not None and all(isinstance(d, int) for d in dims):
                seeds.update(shape_value(node, dims))
                known.update(node.output)
                chosen.append(idx)
            continue
        if (node.domain not in ("", "ai.onnx") or node.op_type in _NONDETERMINISTIC
                or any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute)):
            continue
        if node.input and all(i in known for i in node.input):
            chosen.append(idx)
            known.update(node.output)
    values: dict[str, np.ndarray] = dict(seeds)
    compute = [graph.node[i] for i in chosen if not set(graph.node[i].output) <= set(seeds)]
    if compute:
        needed = sorted({i for n in compute for i in n.input if i in inits})
        inputs = [onnx.helper.make_tensor_value_info(k, onnx.helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
                  for k, v in seeds.items()]
        made = sorted({o for n in compute for o in n.output if o})
        g = onnx.helper.make_graph(compute, "fold", inputs, [onnx.ValueInfoProto(name=o) for o in made],
                                   [inits[k] for k in needed])
        sub = onnx.helper.make_model(g, opset_imports=list(skel.opset_import), ir_version=skel.ir_version)
        try:
            outs = ReferenceEvaluator(sub).run(None, seeds)
        except Exception as exc:  # noqa: BLE001  (folding only helps inference: keep what is known)
            _LOG.debug("inference-only constant folding stopped: %s", exc)
            return 0
        values.update(zip(made, outs))
    values = {k: np.asarray(v) for k, v in values.items()
              if v is not None and np.asarray(v).size <= _FOLD_MAX_ELEMENTS and np.asarray(v).dtype.kind in "biuf"}
    outputs = {o.name for o in graph.output}
    folded = [i for i in chosen if graph.node[i].output and all(o in values for o in graph.node[i].output if o)
              and not any(o in outputs for o in graph.node[i].output)]  # graph outputs stay produced by nodes
    if not folded:
        return 0
    for i in folded:
        for o in graph.node[i].output:
            if o:
                graph.initializer.append(numpy_helper.from_array(values[o], o))
    drop = set(folded)
    keep = [n for i, n in enumerate(graph.node) if i not in drop]
    kept = [onnx.NodeProto() for _ in keep]
    for dst, src in zip(kept, keep):
        dst.CopyFrom(src)
    del graph.node[:]
    graph.node.extend(kept)  # still topological: folding only removes producers
    return len(folded)


def shape_value(node: onnx.NodeProto, dims: list[int]) -> dict[str, np.ndarray]:
    if node.op_type == "Size":
        return {node.output[0]: np.array(int(np.prod(dims, dtype=np.int64)), dtype=np.int64)}
    attrs = {a.name: a.i for a in node.attribute}
    rank = len(dims)
    start, end = attrs.get("start", 0), attrs.get("end", rank)
    start, end = (start + rank if start < 0 else start), (end + rank if end < 0 else end)
    return {node.output[0]: np.array(dims[max(0, start):min(rank, end)], dtype=np.int64)}


def _merge(sym: onnx.ValueInfoProto | None, fixed: onnx.ValueInfoProto) -> onnx.ValueInfoProto:
    """Per dim: the symbolic inference's size or name where it has one, else the concrete run's size."""
    fdims = tensor_dims(fixed)
    sdims = tensor_dims(sym) if sym is not None else None
    if fdims is None:
        return sym if sym is not None else fixed
    out = onnx.ValueInfoProto()
    out.CopyFrom(fixed)
    if sdims is not None and len(sdims) == len(fdims):
        for d, s in zip(out.type.tensor_type.shape.dim, sdims):
            if isinstance(s, str) and s and not s.startswith("unk__"):  # onnx names unknown dims unk__N
                d.dim_param = s
    return out


def infer_for_conversion(model: onnx.ModelProto, fixed: Mapping[str, list[int]]) -> onnx.ModelProto:
    """``model`` with the best ``value_info`` we can get; nodes and input declarations unchanged.

    Symbolic inference (with data propagation) always runs. When every input has concrete dims (the file's, or
    ``fixed``), inference also runs at those dims with constant shape subgraphs folded, and fills the ranks and
    sizes the symbolic run could not tell (sizes named by a symbolic dim keep their name).
    """
    sym = infer_shapes(model, in_place=True)
    shapes = _static_inputs(model, fixed)
    if shapes is None:
        return sym
    if not fixed and all(_static(v) for v in list(sym.graph.value_info) + list(sym.graph.output)):
        return sym  # static file, fully inferred: nothing to add
    sym_infos = {k: _copy(v) for k, v in _infos(sym).items()}  # ``sym`` is edited below
    skel = _skeleton(model, shapes)
    inferred = infer_shapes(skel)
    for _ in range(_FOLD_ROUNDS):
        if _fold_round(skel, inferred) == 0:
            break
        inferred = infer_shapes(skel)
    fixed_infos = _infos(inferred)
    fixed_infos.update({k: v for k, v in _folded_infos(skel).items() if k not in fixed_infos})
    graph_inputs = {i.name for i in model.graph.input}
    produced = {o for n in model.graph.node for o in n.output}
    merged = []
    for name in produced:
        info = fixed_infos.get(name)
        if info is None or not info.type.HasField("tensor_type"):
            if name in sym_infos and name not in {o.name for o in sym.graph.output}:
                merged.append(sym_infos[name])
            continue
        merged.append(_merge(sym_infos.get(name), info))
    out = sym  # ``model`` itself, inferred in place
    out.graph.ClearField("value_info")
    outputs = {o.name: o for o in out.graph.output}
    for info in sorted(merged, key=lambda v: v.name):
        if info.name in outputs and tensor_dims(outputs[info.name]) is None:
            outputs[info.name].CopyFrom(info)
        elif info.name not in outputs and info.name not in graph_inputs:
            out.graph.value_info.append(info)
    return out


def _copy(info: onnx.ValueInfoProto) -> onnx.ValueInfoProto:
    out = onnx.ValueInfoProto()
    out.CopyFrom(info)
    return out


def _static(info: onnx.ValueInfoProto) -> bool:
    dims = tensor_dims(info)
    return dims is not None and all(isinstance(d, int) for d in dims)


def _folded_infos(skel: onnx.ModelProto) -> dict[str, onnx.ValueInfoProto]:
    return {t.name: onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
            for t in skel.graph.initializer}


def unknown_rank_nodes(model: onnx.ModelProto) -> list[tuple[onnx.NodeProto, str]]:
    """Nodes of :data:`RANK_OPS` whose data input has no inferred rank: ``(node, tensor name)``."""
    infos = _infos(model)
    known = {t.name for t in model.graph.initializer}
    out = []
    for node in model.graph.node:
        if node.op_type in RANK_OPS and node.domain in ("", "ai.onnx") and node.input and node.input[0]:
            name = node.input[0]
            if name not in known and (name not in infos or tensor_dims(infos[name]) is None):
                out.append((node, name))
    return out


def symbolic_inputs(model: onnx.ModelProto) -> dict[str, Dims]:
    """Inputs with a symbolic or unknown dim (or unknown rank): ``{name: dims}``."""
    return {k: v for k, v in source_dims(model).items()
            if not v or any(not (isinstance(d, int) and d > 0) for d in v)}


def advice(model: onnx.ModelProto, source: str, nodes: list[tuple[onnx.NodeProto, str]]) -> str:
    """The FrontendError text for ranks shape inference cannot tell."""
    shown = "; ".join(f"{n.name or n.op_type!r} ({n.op_type}) reads {t!r}" for n, t in nodes[:5])
    more = f" and {len(nodes) - 5} more" if len(nodes) > 5 else ""
    open_inputs = symbolic_inputs(model)
    how = "; ".join(_how(k, v) for k, v in open_inputs.items())
    return (f"cannot convert ONNX model {source!r}: shape inference cannot tell the rank of the data input of "
            f"node(s) {shown}{more}, which their converters need. Input(s) "
            f"{', '.join(f'{k!r} {v}' for k, v in open_inputs.items())} have symbolic or unknown dims; fix them "
            f"for loading with {how}. The dims stay dynamic in exports where the file has them symbolic.")
