"""ONNX models over protobuf's 2 GiB limit: external data, and the tools that must not serialize the weights.

A protobuf message cannot be serialized past 2 GiB, so a model whose proto is larger than
:data:`EXTERNAL_DATA_THRESHOLD` is written as two files, following onnx's and onnxruntime's convention:

* ``model.onnx`` — the graph; every initializer of :data:`MIN_EXTERNAL_BYTES` or more raw bytes has
  ``data_location = EXTERNAL`` and ``external_data`` ``location`` / ``offset`` / ``length``;
* ``model.onnx.data`` (:func:`data_path`) — those tensors' raw bytes, back to back; tensors of 1 MiB or more start
  at a multiple of 64 KiB (so onnxruntime can map them). ``location`` is the data file's base name, relative to
  the ``.onnx``, so the pair can be moved together.

``onnx.load("model.onnx")``, ``onnxruntime.InferenceSession("model.onnx")`` and :func:`fxq.load_onnx` read the
pair. Whether a model is too large is :func:`proto_size` (weights counted from their dims: protobuf's
``ByteSize`` serializes the message). Everything fxq does with a model in memory that would serialize it goes
through this module:
:func:`ort_session` (onnxruntime from memory, the data passed as an in-memory file), :func:`check_model` (the
checker on a copy without the large tensors' data) and :func:`convert_version`.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Sequence

from fxq.errors import ExportError

__all__ = ["EXTERNAL_DATA_THRESHOLD", "MIN_EXTERNAL_BYTES", "PROTO_LIMIT", "proto_size", "too_large", "data_path",
           "external_copy", "split_external", "onnx_files", "ort_session", "check_model", "convert_version",
           "copy_fields", "light_copy", "infer_shapes", "LIGHT_MIN_ELEMENTS", "LIGHT_CHECK_BYTES"]

PROTO_LIMIT = 2**31 - 1
"""protobuf's hard limit on one serialized message."""

EXTERNAL_DATA_THRESHOLD = 2**31 - 2**26
"""Models whose proto is larger (1984 MiB) are written with external data. Read at each call, so tests may
monkeypatch it to a few bytes to exercise the external-data path on a small model."""

MIN_EXTERNAL_BYTES = 1024
"""Initializers with at least this many raw bytes go to the data file (onnx's own default)."""

LIGHT_MIN_ELEMENTS = 4096
"""Initializers this large become typed graph inputs in :func:`light_copy` (no shape tensor is this long)."""

LIGHT_CHECK_BYTES = 1 << 26
"""Models larger than this (64 MiB) are checked without their weights' bytes (:func:`check_model`)."""

_ALIGN_FROM = 1 << 20  # tensors this large start at a multiple of _ALIGNMENT (mmap granularity, 64 KiB)
_ALIGNMENT = 1 << 16
_IN_MEMORY = "fxq_in_memory.onnx.data"


def proto_size(model: Any) -> int:
    """About ``model.ByteSize()`` (within a few bytes a tensor), without serializing the weights as protobuf's own
    ``ByteSize`` does: raw initializers count their elements times their type's size (packed 4-bit types
    twice), everything else is measured."""
    import numpy as np
    import onnx

    rest = onnx.ModelProto()
    copy_fields(model, rest, skip="graph")
    copy_fields(model.graph, rest.graph, skip="initializer")
    total = rest.ByteSize()
    for t in model.graph.initializer:
        if t.HasField("raw_data") and t.data_type != onnx.TensorProto.STRING:
            n = int(np.prod(t.dims, dtype=np.int64))
            total += n * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize + 64 + len(t.name)
        else:
            total += t.ByteSize()
    return total


def too_large(model: Any) -> bool:
    """Whether ``model`` (a ModelProto) is over :data:`EXTERNAL_DATA_THRESHOLD` and needs external data."""
    return proto_size(model) > EXTERNAL_DATA_THRESHOLD


def data_path(onnx_path: str | os.PathLike) -> Path:
    """The external data file of ``onnx_path``: ``model.onnx`` -> ``model.onnx.data`` beside it."""
    p = Path(onnx_path)
    return p.with_name(p.name + ".data")


def copy_fields(source: Any, target: Any, skip: str) -> None:
    """Copy every set field of protobuf message ``source`` but ``skip`` into ``target``."""
    for field, value in source.ListFields():
        if field.name == skip:
            continue
        if not isinstance(value, (str, bytes)) and hasattr(value, "extend"):  # a repeated field
            getattr(target, field.name).extend(value)
        elif field.message_type is not None:
            getattr(target, field.name).CopyFrom(value)
        else:
            setattr(target, field.name, value)


def external_copy(model: Any, location: str, data: bytearray | None = None) -> Any:
    """A copy of ``model`` whose initializers of :data:`MIN_EXTERNAL_BYTES`+ raw bytes point into ``location``.

    Their bytes are appended to ``data`` (the file's content, offsets from its current length) when it is given;
    without it, the copy just refers to a file that does not exist (for tools that read the graph only).
    ``model`` is not modified.
    """
    import onnx

    out = onnx.ModelProto()
    copy_fields(model, out, skip="graph")
    copy_fields(model.graph, out.graph, skip="initializer")
    offset = len(data) if data is not None else 0
    for t in model.graph.initializer:
        new = out.graph.initializer.add()
        raw = t.raw_data if t.data_location != onnx.TensorProto.EXTERNAL and t.HasField("raw_data") else b""
        if len(raw) < MIN_EXTERNAL_BYTES:
            new.CopyFrom(t)
            continue
        copy_fields(t, new, skip="raw_data")
        if len(raw) >= _ALIGN_FROM:
            offset += -offset % _ALIGNMENT
        if data is not None:
            data.extend(bytes(offset - len(data)))
            data.extend(raw)
        new.data_location = onnx.TensorProto.EXTERNAL
        for key, value in (("location", location), ("offset", offset), ("length", len(raw))):
            entry = new.external_data.add()
            entry.key, entry.value = key, str(value)
        offset += len(raw)
    return out


def split_external(model: Any, location: str) -> tuple[bytes, bytearray]:
    """(the serialized model with its large initializers in ``location``, that file's content); ``model`` is
    unchanged. :class:`ExportError` when even the graph without them is over protobuf's limit."""
    data = bytearray()
    stub = external_copy(model, location, data)
    if stub.ByteSize() > PROTO_LIMIT:
        raise ExportError(f"the exported model is over protobuf's 2 GiB limit even with every initializer of "
                          f"{MIN_EXTERNAL_BYTES}+ bytes in {location!r}: its graph itself (nodes, attributes, small "
                          f"constants) is too large; split the model into parts (fxq.parts) and export them apart")
    return stub.SerializeToString(), data


def onnx_files(model: Any, path: str | os.PathLike) -> dict[Path, bytes | bytearray]:
    """The files of ``model`` saved at ``path``: ``{path: proto}``, or with :func:`too_large` models
    ``{path: proto referring to model.onnx.data, data_path(path): data}``."""
    p = Path(path)
    if not too_large(model):
        return {p: model.SerializeToString()}
    extra = data_path(p)
    proto, data = split_external(model, extra.name)
    return {p: proto, extra: data} if data else {p: proto}  # no tensor large enough to move: one file


def ort_session(model: Any, options: Any = None, providers: Sequence[str] = ("CPUExecutionProvider",), *,
                external: Mapping[str, bytes | bytearray] | None = None) -> Any:
    """An onnxruntime ``InferenceSession`` of ``model``: a path (its external data read beside it), a serialized
    model (``external``: the in-memory content of the data files its tensors name), or a ModelProto, serialized
    whole or, when :func:`too_large`, with its large initializers handed over as an in-memory file.

    In-memory files are registered on ``options``; the session keeps their buffers alive."""
    import onnxruntime as ort

    if isinstance(model, (str, os.PathLike)):
        return ort.InferenceSession(os.fspath(model), options, providers=list(providers))
    if not isinstance(model, (bytes, bytearray)):
        if too_large(model):
            model, data = split_external(model, _IN_MEMORY)
            external = {_IN_MEMORY: data}
        else:
            model = model.SerializeToString()
    if external:
        options = options if options is not None else ort.SessionOptions()
        names = list(external)
        options.add_external_initializers_from_files_in_memory(names, [external[n] for n in names],
                                                               [len(external[n]) for n in names])
    sess = ort.InferenceSession(bytes(model), options, providers=list(providers))
    sess._fxq_external_data = external  # onnxruntime may read them after session creation: keep them alive
    return sess


def light_copy(model: Any) -> Any:
    """A copy of ``model`` for shape inference and the checker: initializers of :data:`LIGHT_MIN_ELEMENTS` or more
    elements become typed graph inputs, so their data is neither copied nor serialized (what onnx's inference
    costs on a model with weights is mostly that serialization). Shape tensors are small and keep their values
    for data propagation."""
    import numpy as np
    import onnx

    light = onnx.ModelProto()
    copy_fields(model, light, skip="graph")
    graph, source = light.graph, model.graph
    copy_fields(source, graph, skip="initializer")
    inputs = {i.name for i in source.input}
    for t in source.initializer:
        if int(np.prod(t.dims, dtype=np.int64)) < LIGHT_MIN_ELEMENTS:
            graph.initializer.append(t)
        elif t.name not in inputs:
            graph.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    return light


def infer_shapes(model: Any, *, in_place: bool = False, data_prop: bool = False) -> Any:
    """onnx's shape inference run on :func:`light_copy` of ``model`` (no weight serialized, models over 2 GB
    included): ``model`` itself (``in_place``) or a copy of it, with the inferred ``value_info``, output types and
    subgraph shapes. Raises onnx's error when inference fails (callers decide whether that matters)."""
    import onnx

    inferred = onnx.shape_inference.infer_shapes(light_copy(model), data_prop=data_prop)
    out = model
    if not in_place:
        out = onnx.ModelProto()
        out.CopyFrom(model)
    graph = out.graph
    graph.ClearField("value_info")
    graph.value_info.extend(inferred.graph.value_info)
    for mine, theirs in zip(graph.output, inferred.graph.output):
        mine.CopyFrom(theirs)
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for n in graph.node for a in n.attribute):
        graph.ClearField("node")  # subgraphs carry their own inferred value_info
        graph.node.extend(inferred.graph.node)
    return out


def check_model(model: Any, *, full_check: bool = False) -> None:
    """``onnx.checker.check_model``. A model of more than :data:`LIGHT_CHECK_BYTES` is checked as
    :func:`light_copy` (its large tensors typed graph inputs), with their sizes checked here: the checker
    serializes a model it is given, and the C++ side parses that copy again, so checking in place costs two
    copies of the weights (and the checker wants a model over 2 GiB's external files on disk)."""
    import numpy as np
    import onnx

    if proto_size(model) <= LIGHT_CHECK_BYTES:
        onnx.checker.check_model(model, full_check=full_check)
        return
    onnx.checker.check_model(light_copy(model), full_check=full_check)
    packed_4bit = {getattr(onnx.TensorProto, name, -1) for name in ("INT4", "UINT4", "FLOAT4E2M1")}
    for t in model.graph.initializer:
        if (int(np.prod(t.dims, dtype=np.int64)) < LIGHT_MIN_ELEMENTS or t.data_location == onnx.TensorProto.EXTERNAL
                or not t.HasField("raw_data") or t.data_type == onnx.TensorProto.STRING):
            continue  # checked in the light copy, or not in memory, or not raw (the checker saw it above)
        n = int(np.prod(t.dims, dtype=np.int64))
        packed = t.data_type in packed_4bit  # two values a byte
        want = (n + 1) // 2 if packed else n * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
        if len(t.raw_data) != want:
            raise onnx.checker.ValidationError(f"initializer {t.name!r}: {len(t.raw_data)} raw bytes, its dims "
                                               f"{list(t.dims)} and type need {want}")


def convert_version(model: Any, opset: int) -> Any:
    """``onnx.version_converter.convert_version``; a :func:`too_large` model is converted without its large
    tensors' data (they keep their names and types), which is put back afterwards."""
    from onnx import version_converter

    if not too_large(model):
        return version_converter.convert_version(model, opset)
    converted = version_converter.convert_version(external_copy(model, _IN_MEMORY), opset)
    originals = {t.name: t for t in model.graph.initializer}
    for t in converted.graph.initializer:
        if any(e.key == "location" and e.value == _IN_MEMORY for e in t.external_data):
            t.CopyFrom(originals[t.name])
    return converted
