"""``Hardmax-1/11/13`` and ``OneHot-9/11/28``: index encodings onnx2torch 1.5.15 lacks.

``Hardmax`` before 13 coerces the input to 2-D at ``axis`` (``[prod(shape[:axis]), prod(shape[axis:])]``) and marks
the first maximum of each row of that view (default axis 1); from 13 it marks the first maximum along ``axis`` alone
(default -1). ``OneHot`` keeps a constant ``depth`` and ``values`` in the module; either may also come at run time.
"""
from __future__ import annotations

import torch
from onnx2torch.onnx_graph import OnnxGraph
from onnx2torch.onnx_node import OnnxNode
from onnx2torch.utils.common import OperationConverterResult
from torch import nn

from fxq.frontends.onnx.converters._common import const_or_run_time, index_from_end, result
from fxq.frontends.onnx.converters.registry import register_onnx_converter

__all__ = ["OnnxHardmax", "OnnxOneHot"]


class OnnxHardmax(nn.Module):
    """ONNX ``Hardmax``: 1 at the first maximum, 0 elsewhere.

    Args:
        axis: the dim searched (negative counts from the end).
        coerce_2d: opsets 1 and 11: search all of ``shape[axis:]`` at once (the input seen as 2-D at ``axis``).
    """

    def __init__(self, axis: int, coerce_2d: bool) -> None:
        super().__init__()
        self.axis = axis
        self.coerce_2d = coerce_2d

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.coerce_2d:
            return torch.zeros_like(x).scatter(self.axis, x.argmax(self.axis, keepdim=True), 1.0)
        rows = x.flatten(self.axis)  # the 2-D view's rows, the leading dims kept
        return torch.zeros_like(rows).scatter(-1, rows.argmax(-1, keepdim=True), 1.0).reshape_as(x)

    def extra_repr(self) -> str:
        return f"axis={self.axis}, coerce_2d={self.coerce_2d}"


@register_onnx_converter("Hardmax", (1, 11))
def _convert_hardmax_2d(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    return result(OnnxHardmax(int(node.attributes.get("axis", 1)), True), node, [node.input_values[0]])


@register_onnx_converter("Hardmax", 13)
def _convert_hardmax(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    return result(OnnxHardmax(int(node.attributes.get("axis", -1)), False), node, [node.input_values[0]])


class OnnxOneHot(nn.Module):
    """ONNX ``OneHot``: a new dim of size ``depth`` at ``axis`` holding ``values[1]`` where it equals the index
    (negative indices count from ``depth``; indices outside ``[-depth, depth - 1]`` give ``values[0]`` only).

    Args:
        axis: where the new dim goes in the output (negative counts from the output's end).
        depth: the size of the new dim; None = given to ``forward`` (first after the indices).
        values: ``[off, on]``; None = given to ``forward`` (after the depth, if that is given too).
    """

    def __init__(self, axis: int, depth: int | None, values: torch.Tensor | None) -> None:
        super().__init__()
        self.axis = axis
        self.depth = depth
        self.values: torch.Tensor | None
        self.register_buffer("values", values)

    def forward(self, indices: torch.Tensor, *given: torch.Tensor) -> torch.Tensor:
        n = self.depth if self.depth is not None else int(given[0].reshape(-1)[0])
        values = self.values if self.values is not None else given[-1]
        idx = index_from_end(indices.to(torch.int64), n)
        hit = idx.unsqueeze(-1) == torch.arange(n, device=idx.device)
        out = torch.where(hit, values[1], values[0])
        if self.axis == -1:
            return out
        last = out.dim() - 1  # torch.onnx writes a bad Transpose for negative dims
        return out.movedim(last, self.axis % out.dim())

    def extra_repr(self) -> str:
        return f"axis={self.axis}, depth={self.depth}"


@register_onnx_converter("OneHot", (9, 11, 28))
def _convert_one_hot(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    axis = int(node.attributes.get("axis", -1))
    depth_t = const_or_run_time(node, graph, 1, "depth")
    values = const_or_run_time(node, graph, 2, "values")
    depth = int(depth_t.reshape(-1)[0].item()) if depth_t is not None else None
    inputs = [node.input_values[0]]
    inputs += [node.input_values[1]] if depth is None else []
    inputs += [node.input_values[2]] if values is None else []
    return result(OnnxOneHot(axis, depth, values), node, inputs)
