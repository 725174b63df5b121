"""``Unique-11``, ``Compress-9/11``, ``ReverseSequence-10`` and ``CenterCropPad-18``, which onnx2torch 1.5.15 lacks.

``Unique`` and ``Compress`` have outputs whose size depends on the data: fx traces them as ordinary calls, and an
export through torch.onnx writes ``Unique`` (+ ``ScatterElements`` for the first indices: export opset 16 or newer) and
``NonZero`` + ``Gather``, whose output dims are dynamic, so the file runs at any count. ``CenterCropPad`` computes its
pads from the input's size when it runs (an export with dynamic axes keeps that arithmetic).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from onnx2torch.onnx_graph import OnnxGraph
from onnx2torch.onnx_node import OnnxNode
from onnx2torch.utils.common import OnnxMapping, OperationConverterResult
from torch import nn

from fxq.frontends.onnx.converters._common import const_input, int_list, rank_of, result
from fxq.frontends.onnx.converters.registry import register_onnx_converter

__all__ = ["OnnxUnique", "OnnxCompress", "OnnxReverseSequence", "OnnxCenterCropPad"]


class OnnxUnique(nn.Module):
    """ONNX ``Unique``: (unique values or slices, index of each one's first occurrence, inverse indices, counts).

    Args:
        axis: slices along this dim are compared; None = the flattened input.
        sorted: ascending order (ONNX's default); otherwise in the order of first occurrence.
    """

    def __init__(self, axis: int | None, sorted: bool = True) -> None:  # noqa: A002 (ONNX's name)
        super().__init__()
        self.axis = axis
        self.sorted = sorted

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.axis is None:
            x = x.reshape(-1)
        dim = 0 if self.axis is None else self.axis
        values, inverse, counts = torch.unique(x, sorted=True, return_inverse=True, return_counts=True, dim=dim)
        n = x.shape[dim]
        first = torch.full_like(counts, n).scatter_reduce(0, inverse, torch.arange(n, device=x.device), "amin")
        if not self.sorted:
            order = torch.argsort(first)
            rank = torch.argsort(order)
            values, first, counts, inverse = values.index_select(dim, order), first[order], counts[order], rank[inverse]
        return values, first, inverse, counts

    def extra_repr(self) -> str:
        return f"axis={self.axis}, sorted={self.sorted}"


@register_onnx_converter("Unique", 11)
def _convert_unique(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    axis = node.attributes.get("axis")
    module = OnnxUnique(None if axis is None else int(axis), bool(node.attributes.get("sorted", 1)))
    return OperationConverterResult(torch_module=module, onnx_mapping=OnnxMapping(
        inputs=(node.input_values[0],), outputs=node.output_values))


class OnnxCompress(nn.Module):
    """ONNX ``Compress``: the slices along ``axis`` (of the flattened input when None) whose ``condition`` is true;
    a condition shorter than the axis drops the slices past its end."""

    def __init__(self, axis: int | None) -> None:
        super().__init__()
        self.axis = axis

    def forward(self, x: torch.Tensor, condition: torch.Tensor) -> torch.Tensor:
        if self.axis is None:
            x = x.reshape(-1)
        keep = torch.nonzero(condition.reshape(-1)).reshape(-1)
        return x.index_select(0 if self.axis is None else self.axis, keep)

    def extra_repr(self) -> str:
        return f"axis={self.axis}"


@register_onnx_converter("Compress", (9, 11))
def _convert_compress(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    axis = node.attributes.get("axis")
    return result(OnnxCompress(None if axis is None else int(axis)), node, node.input_values[:2])


class OnnxReverseSequence(nn.Module):
    """ONNX ``ReverseSequence``: along ``time_axis``, the first ``lens[b]`` elements of each batch entry ``b``
    (on ``batch_axis``) in reverse order, the rest as they are."""

    def __init__(self, batch_axis: int = 1, time_axis: int = 0) -> None:
        super().__init__()
        self.batch_axis = batch_axis
        self.time_axis = time_axis

    def forward(self, x: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        t = torch.arange(x.shape[self.time_axis], device=x.device).reshape(-1, 1)  # [time, batch]
        lens = lens.long().reshape(1, -1)
        src = torch.where(t < lens, lens - 1 - t, t)
        if self.batch_axis < self.time_axis:
            src = src.transpose(0, 1)
        src = src.reshape(src.shape + (1,) * (x.dim() - 2)).expand_as(x)
        return x.gather(self.time_axis, src)

    def extra_repr(self) -> str:
        return f"batch_axis={self.batch_axis}, time_axis={self.time_axis}"


@register_onnx_converter("ReverseSequence", 10)
def _convert_reverse_sequence(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    module = OnnxReverseSequence(int(node.attributes.get("batch_axis", 1)), int(node.attributes.get("time_axis", 0)))
    return result(module, node, node.input_values[:2])


class OnnxCenterCropPad(nn.Module):
    """ONNX ``CenterCropPad``: each of ``axes`` cropped or zero-padded to ``shape`` around its centre; an odd
    difference leaves the extra element at the end for both.

    Args:
        shape: the target size of each of ``axes``.
        axes: non-negative dims (the input's rank is known at load time).
    """

    def __init__(self, shape: list[int], axes: list[int], rank: int) -> None:
        super().__init__()
        self.shape = list(shape)
        self.axes = list(axes)
        self.rank = rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pads: list = [0] * (2 * (self.rank - min(self.axes)))  # F.pad lists the last dim first
        for target, a in zip(self.shape, self.axes):
            size = x.shape[a]
            # (target - size) / 2 rounded towards zero (crop or pad), with // and % on positive numbers only:
            # torch.onnx writes // as Div, which truncates
            total = target + size
            begin = total // 2 - size + (total % 2) * (size > target)
            k = 2 * (self.rank - 1 - a)
            pads[k], pads[k + 1] = begin, target - size - begin
        return F.pad(x, pads)

    def extra_repr(self) -> str:
        return f"shape={self.shape}, axes={self.axes}"


@register_onnx_converter("CenterCropPad", 18)
def _convert_center_crop_pad(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    shape = int_list(const_input(node, graph, 1, "shape"))  # type: ignore[arg-type]
    rank = rank_of(graph, node.input_values[0])
    if rank is None:
        raise NotImplementedError("CenterCropPad: the input's rank is unknown to shape inference")
    axes = [int(a) % rank for a in node.attributes.get("axes", range(rank))]
    return result(OnnxCenterCropPad(shape, axes, rank), node, [node.input_values[0]])
