"""Small helpers our converters share: constant inputs, ranks from shape inference, the converter result."""
from __future__ import annotations

from typing import Any, Sequence

import torch
from onnx2torch.onnx_graph import OnnxGraph
from onnx2torch.onnx_node import OnnxNode
from onnx2torch.utils.common import OnnxMapping, OperationConverterResult, get_const_value

__all__ = ["const_input", "const_or_run_time", "has_input", "rank_of", "result", "int_list", "text",
           "index_from_end"]


def has_input(node: OnnxNode, index: int) -> bool:
    """Whether optional input ``index`` of ``node`` is given (present and not the empty name)."""
    return len(node.input_values) > index and node.input_values[index] != ""


def const_input(node: OnnxNode, graph: OnnxGraph, index: int, what: str) -> torch.Tensor | None:
    """The value of input ``index`` when it is an initializer or a ``Constant``; None when the input is absent.

    Raises:
        NotImplementedError: the input is computed at run time (our converters need it fixed at load time).
    """
    if not has_input(node, index):
        return None
    name = node.input_values[index]
    try:
        value: Any = get_const_value(name, graph)
    except KeyError:
        raise NotImplementedError(
            f"{node.operation_type}: input {index} ({what}, tensor {name!r}) is computed at run time; "
            "only constant (initializer) values are supported"
        ) from None
    return value if isinstance(value, torch.Tensor) else torch.as_tensor(value)


def const_or_run_time(node: OnnxNode, graph: OnnxGraph, index: int, what: str) -> torch.Tensor | None:
    """:func:`const_input`, but None (rather than raising) for an input computed at run time: for converters whose
    module then takes that input when called. Check :func:`has_input` first where absent differs from run time."""
    try:
        return const_input(node, graph, index, what)
    except NotImplementedError:
        return None


def text(value: Any) -> str:
    """A string attribute as ``str`` (onnx2torch hands some over as ``bytes``)."""
    return value.decode() if isinstance(value, bytes) else str(value)


def index_from_end(indices: torch.Tensor, size: torch.Tensor | int) -> torch.Tensor:
    """Negative indices counted from the end of a dim of ``size``, as ONNX allows (torch's scatter / gather take
    non-negative ones only)."""
    return torch.where(indices < 0, indices + size, indices)


def int_list(t: torch.Tensor) -> list[int]:
    """A 0-d or 1-d integer tensor as a Python list."""
    return [int(v) for v in t.reshape(-1).tolist()]


def rank_of(graph: OnnxGraph, name: str) -> int | None:
    """Rank of tensor ``name`` from shape inference, or None when unknown."""
    info = graph.value_info.get(name)
    if info is None or not info.type.HasField("tensor_type") or not info.type.tensor_type.HasField("shape"):
        return None
    return len(info.type.tensor_type.shape.dim)


def dim_of(graph: OnnxGraph, name: str, axis: int) -> int | None:
    """Static size of dimension ``axis`` of tensor ``name``, or None when unknown."""
    rank = rank_of(graph, name)
    if rank is None:
        return None
    dim = graph.value_info[name].type.tensor_type.shape.dim[axis % rank] if rank else None
    return int(dim.dim_value) if dim is not None and dim.HasField("dim_value") else None


def result(module: torch.nn.Module, node: OnnxNode, inputs: Sequence[str]) -> OperationConverterResult:
    """The converter result: ``module`` is called with the tensors named ``inputs``, in that order."""
    return OperationConverterResult(
        torch_module=module, onnx_mapping=OnnxMapping(inputs=tuple(inputs), outputs=node.output_values)
    )
