"""Layout ops whose attributes onnx2torch 1.5.15 handles in part: ``Flatten``, ``DepthToSpace``, ``SpaceToDepth``,
``GatherElements``, ``NonZero``.

- ``Flatten`` with ``axis=0`` (a ``[1, N]`` result) or ``axis`` = rank (``[N, 1]``) raised an IndexError at run time.
- ``DepthToSpace`` was refused in ``DCR`` mode, ONNX's default (TensorFlow's layout); ``SpaceToDepth`` had no
  converter.
- ``GatherElements`` with negative indices (counted from the end, as ONNX allows) raised an IndexError.
- ``NonZero`` came out as torch's ``[count, rank]`` where ONNX has ``[rank, count]``.
"""
from __future__ import annotations

import torch
from onnx2torch.onnx_graph import OnnxGraph
from onnx2torch.onnx_node import OnnxNode
from onnx2torch.utils.common import OperationConverterResult
from torch import nn

from fxq.frontends.onnx.converters._common import rank_of, result
from fxq.frontends.onnx.converters.registry import register_onnx_converter

__all__ = ["OnnxFlatten", "OnnxDepthToSpace", "OnnxSpaceToDepth", "OnnxGatherElements", "OnnxNonZero"]


class OnnxFlatten(nn.Module):
    """ONNX ``Flatten``: dims before ``axis`` into the first output dim, the rest into the second.

    Args:
        axis: non-negative (the converter resolves a negative one with the input's rank).
    """

    def __init__(self, axis: int) -> None:
        super().__init__()
        self.axis = axis

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.axis == 0:
            return x.reshape(1, -1)
        y = torch.flatten(x, end_dim=self.axis - 1)
        return y.reshape(y.shape[0], -1)

    def extra_repr(self) -> str:
        return f"axis={self.axis}"


@register_onnx_converter("Flatten", (1, 9, 11, 13), override=True)
def _convert_flatten(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    axis = int(node.attributes.get("axis", 1))
    rank = rank_of(graph, node.input_values[0])
    if axis == 1 and rank is not None and rank >= 2:
        return result(nn.Flatten(), node, [node.input_values[0]])  # the usual case, as onnx2torch writes it
    if axis < 0:
        if rank is None:
            raise NotImplementedError(f"Flatten: axis={axis} needs the input's rank, which shape inference lacks")
        axis += rank
    return result(OnnxFlatten(axis), node, [node.input_values[0]])


class OnnxDepthToSpace(nn.Module):
    """ONNX ``DepthToSpace`` on NCHW: ``DCR`` takes the block offsets from the outer channel bits, ``CRD`` (torch's
    ``pixel_shuffle``) from the inner ones."""

    def __init__(self, blocksize: int, mode: str) -> None:
        super().__init__()
        self.blocksize = blocksize
        self.mode = mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "CRD":
            return torch.pixel_shuffle(x, self.blocksize)
        bs = self.blocksize
        b, c, h, w = x.shape[0], x.shape[1], x.shape[2], x.shape[3]
        y = x.reshape(b, bs, bs, c // (bs * bs), h, w).permute(0, 3, 4, 1, 5, 2)
        return y.reshape(b, c // (bs * bs), h * bs, w * bs)

    def extra_repr(self) -> str:
        return f"blocksize={self.blocksize}, mode={self.mode!r}"


@register_onnx_converter("DepthToSpace", (1, 11, 13), override=True)
def _convert_depth_to_space(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    mode = node.attributes.get("mode", "DCR")  # onnx2torch decodes string attributes
    if mode not in ("DCR", "CRD"):
        raise NotImplementedError(f"DepthToSpace: mode={mode!r}")
    return result(OnnxDepthToSpace(int(node.attributes["blocksize"]), mode), node, [node.input_values[0]])


class OnnxSpaceToDepth(nn.Module):
    """ONNX ``SpaceToDepth`` on NCHW: each ``blocksize`` x ``blocksize`` block into channels, block offset outer."""

    def __init__(self, blocksize: int) -> None:
        super().__init__()
        self.blocksize = blocksize

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs = self.blocksize
        b, c, h, w = x.shape[0], x.shape[1], x.shape[2], x.shape[3]
        y = x.reshape(b, c, h // bs, bs, w // bs, bs).permute(0, 3, 5, 1, 2, 4)
        return y.reshape(b, c * bs * bs, h // bs, w // bs)

    def extra_repr(self) -> str:
        return f"blocksize={self.blocksize}"


@register_onnx_converter("SpaceToDepth", (1, 13))
def _convert_space_to_depth(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    return result(OnnxSpaceToDepth(int(node.attributes["blocksize"])), node, [node.input_values[0]])


class OnnxGatherElements(nn.Module):
    """``torch.gather`` with ONNX's negative indices (counted from the end of ``axis``)."""

    def __init__(self, axis: int) -> None:
        super().__init__()
        self.axis = axis

    def forward(self, x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        indices = indices.long()
        indices = torch.where(indices < 0, indices + x.shape[self.axis], indices)
        return torch.gather(x, self.axis, indices)

    def extra_repr(self) -> str:
        return f"axis={self.axis}"


@register_onnx_converter("GatherElements", (11, 13), override=True)
def _convert_gather_elements(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    return result(OnnxGatherElements(int(node.attributes.get("axis", 0))), node, list(node.input_values[:2]))


class OnnxNonZero(nn.Module):
    """ONNX ``NonZero``: the indices of the non-zero elements, one row per input dim (``[rank, count]``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nonzero(x).t()


@register_onnx_converter("NonZero", (9, 13), override=True)
def _convert_non_zero(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    return result(OnnxNonZero(), node, [node.input_values[0]])
