"""``ScatterElements-11/13/16/18``, the deprecated ``Scatter-9/11``, ``ScatterND-11/13/16/18`` and
``GatherND-11/12/13`` with ``batch_dims``.

onnx2torch 1.5.15 has no ScatterElements or Scatter converter, and its GatherND raises at run time for
``batch_dims != 0``. Its ScatterND writes with a *list* of index lists, which torch deprecates (a UserWarning on
every call, and a later torch reads the list as one index tensor: another result, silently), and has no reduction.
Indices may be negative (counted from the end of the axis) in all of them; they are moved into range with ``where``
(torch's ``scatter`` / ``gather`` take non-negative indices only).
"""
from __future__ import annotations

from typing import Sequence

import torch
from onnx2torch.onnx_graph import OnnxGraph
from onnx2torch.onnx_node import OnnxNode
from onnx2torch.utils.common import OperationConverterResult, get_onnx_version
from onnx2torch.utils.custom_export_to_onnx import DefaultExportToOnnx, OnnxToTorchModuleWithCustomExport
from torch import nn

from fxq.frontends.onnx.converters._common import dim_of, index_from_end, result
from fxq.frontends.onnx.converters.registry import register_onnx_converter

__all__ = ["OnnxScatterElements", "OnnxScatterND", "OnnxGatherND"]

_REDUCE = {"add": "sum", "mul": "prod", "max": "amax", "min": "amin"}  # ONNX reduction -> scatter_reduce's


class OnnxScatterElements(nn.Module, OnnxToTorchModuleWithCustomExport):
    """ONNX ``ScatterElements`` / ``Scatter``: ``data`` with ``updates`` written (or reduced) at ``indices`` along
    ``axis``; ``include_self`` as ONNX: the reduction starts from the data's own element. Exported by torch.onnx as
    one ``ScatterElements`` node.

    Args:
        axis: the scattered dimension, negative counts from the end.
        reduction: ``none``, ``add``, ``mul``, ``max`` or ``min``.
    """

    def __init__(self, axis: int = 0, reduction: str = "none") -> None:
        super().__init__()
        self.axis = axis
        self.reduction = reduction

    def forward(self, data: torch.Tensor, indices: torch.Tensor, updates: torch.Tensor) -> torch.Tensor:
        if torch.onnx.is_in_onnx_export():
            attrs = _export_attrs(self.reduction, {"axis_i": self.axis})
            if attrs is not None:
                return DefaultExportToOnnx.export(lambda: self._scatter(data, indices, updates), "ScatterElements",
                                                  data, indices, updates, attrs)
        return self._scatter(data, indices, updates)

    def _scatter(self, data: torch.Tensor, indices: torch.Tensor, updates: torch.Tensor) -> torch.Tensor:
        index = index_from_end(indices.long(), data.shape[self.axis])
        if self.reduction == "none":
            return data.scatter(self.axis, index, updates)
        return data.scatter_reduce(self.axis, index, updates, _REDUCE[self.reduction], include_self=True)

    def extra_repr(self) -> str:
        return f"axis={self.axis}, reduction={self.reduction!r}"


def _positions(indices: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """The row-major position of each index tuple (the last dim of ``indices``, negative counted from the end) in
    dims of ``sizes``: ScatterND's and GatherND's rows of the data flattened over those dims."""
    flat = torch.zeros_like(indices[..., 0])
    for j, size in enumerate(sizes):
        flat = flat * size + index_from_end(indices[..., j], size)
    return flat


def _export_attrs(reduction: str, attrs: dict[str, object]) -> dict[str, object] | None:
    """Attributes of the one scatter node torch.onnx writes for a scatter module (torch's own forms of a scatter are
    a scatter into zeros plus an Add, which TensorRT's rules read as a residual Add, or an If); None: the export
    opset lacks the node or its reduction."""
    try:
        opset = get_onnx_version()
    except AttributeError:  # torch's shim without the opset: fxq's exporters set it
        return None
    if opset < 11 or (reduction != "none" and opset < 16) or (reduction in ("max", "min") and opset < 18):
        return None
    return {**attrs, "reduction_s": reduction} if reduction != "none" else dict(attrs)


class OnnxScatterND(nn.Module, OnnxToTorchModuleWithCustomExport):
    """ONNX ``ScatterND``: ``data`` with the slices addressed by the last dim of ``indices`` replaced by (or reduced
    with) ``updates``. Exported by torch.onnx as one ``ScatterND`` node.

    The indexed dims are flattened, each index tuple becomes one row of the flattened data, and one indexed write
    (``none``) or ``scatter_reduce`` (``add``, ``mul``, ``max``, ``min``: from the data's own row, as ONNX) does
    every row. Indices may be negative.

    Args:
        reduction: ``none``, ``add``, ``mul``, ``max`` or ``min``.
    """

    def __init__(self, reduction: str = "none") -> None:
        super().__init__()
        self.reduction = reduction

    def forward(self, data: torch.Tensor, indices: torch.Tensor, updates: torch.Tensor) -> torch.Tensor:
        if torch.onnx.is_in_onnx_export():
            attrs = _export_attrs(self.reduction, {})
            if attrs is not None:
                return DefaultExportToOnnx.export(lambda: self._scatter(data, indices, updates), "ScatterND",
                                                  data, indices, updates, attrs)
        return self._scatter(data, indices, updates)

    def _scatter(self, data: torch.Tensor, indices: torch.Tensor, updates: torch.Tensor) -> torch.Tensor:
        k = indices.shape[-1]
        rows = _positions(indices.long().reshape(-1, k), data.shape[:k])
        table = data.reshape((-1, *data.shape[k:])).clone()
        values = updates.reshape((-1, *data.shape[k:])).to(data.dtype)
        if self.reduction == "none":
            table[rows] = values
        else:
            index = rows.reshape((-1,) + (1,) * (values.dim() - 1)).expand_as(values)
            table.scatter_reduce_(0, index, values, _REDUCE[self.reduction], include_self=True)
        return table.reshape(data.shape)

    def extra_repr(self) -> str:
        return f"reduction={self.reduction!r}"


@register_onnx_converter("ScatterND", (11, 13, 16, 18), override=True)
def _convert_scatter_nd(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    reduction = node.attributes.get("reduction", "none")
    if reduction not in ("none", *_REDUCE):
        raise NotImplementedError(f"ScatterND: reduction={reduction!r}")
    return result(OnnxScatterND(reduction), node, node.input_values[:3])


@register_onnx_converter("ScatterElements", (11, 13, 16, 18))
@register_onnx_converter("Scatter", (9, 11))
def _convert_scatter_elements(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    reduction = node.attributes.get("reduction", "none")
    if reduction not in ("none", *_REDUCE):
        raise NotImplementedError(f"ScatterElements: reduction={reduction!r}")
    module = OnnxScatterElements(int(node.attributes.get("axis", 0)), reduction)
    return result(module, node, node.input_values[:3])


class OnnxGatherND(nn.Module):
    """ONNX ``GatherND``: slices of ``data`` addressed by the last dim of ``indices``, the first ``batch_dims`` dims
    of both being a shared batch.

    The batch dims and the indexed dims are flattened, each index tuple becomes one position in the flattened
    indexed dims, and one advanced-indexing read takes every slice.
    """

    def __init__(self, batch_dims: int, depth: int) -> None:
        super().__init__()
        self.batch_dims = batch_dims
        self.depth = depth  # indices.shape[-1], fixed at load time so that fx traces the loop

    def forward(self, data: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        b, k = self.batch_dims, self.depth
        table = data.flatten(b, b + k - 1)  # [batch..., positions, rest...]
        if b:
            table = table.flatten(0, b - 1)
        else:
            table = table.unsqueeze(0)
        flat = _positions(indices.long().reshape(table.shape[0], -1, k), [data.shape[b + j] for j in range(k)])
        rows = torch.arange(table.shape[0], device=data.device).reshape(-1, 1)
        return table[rows, flat].reshape(indices.shape[:-1] + data.shape[b + k:])

    def extra_repr(self) -> str:
        return f"batch_dims={self.batch_dims}"


@register_onnx_converter("GatherND", (11, 12, 13), override=True)
def _convert_gather_nd(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    name = node.input_values[1]
    const = graph.initializers.get(name)
    depth = int(const.to_torch().shape[-1]) if const is not None else dim_of(graph, name, -1)
    if depth is None:
        raise NotImplementedError("GatherND: the last dim of indices is unknown to shape inference (pass "
                                  "input_shapes to load_onnx)")
    return result(OnnxGatherND(int(node.attributes.get("batch_dims", 0)), depth), node, node.input_values[:2])
