"""``GridSample-16/20/22`` as ``F.grid_sample``, which onnx2torch 1.5.15 lacks.

ONNX's modes map onto torch's one to one (``bilinear``/``linear``, ``nearest``, ``bicubic``/``cubic``; padding
``zeros``/``border``/``reflection``; ``align_corners``), with the same coordinate rules: nearest rounds half to even
and cubic uses a = -0.75 in both, checked against onnxruntime. torch samples 4-D inputs (2 spatial dims) in every
mode and 5-D ones with linear and nearest; other ranks (20+ allows any) and 5-D cubic are refused when loading
(where shape inference leaves the rank unknown, torch's own error says so when the graph runs).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from onnx2torch.onnx_graph import OnnxGraph
from onnx2torch.onnx_node import OnnxNode
from onnx2torch.utils.common import OperationConverterResult
from torch import nn

from fxq.errors import NotSupportedError
from fxq.frontends.onnx.converters._common import rank_of, result, text
from fxq.frontends.onnx.converters.registry import register_onnx_converter

__all__ = ["OnnxGridSample"]

_MODES = {"bilinear": "bilinear", "linear": "bilinear", "nearest": "nearest", "bicubic": "bicubic", "cubic": "bicubic"}
_PADDING = ("zeros", "border", "reflection")


def _check_rank(rank: int, mode: str, where: str) -> None:
    if rank == 4 or (rank == 5 and mode != "bicubic"):
        return
    what = "cubic sampling of a 5-D input" if rank == 5 else f"a {rank}-D input"
    raise NotSupportedError(
        f"{where}: {what} is not supported (torch's grid_sample samples 4-D inputs, and 5-D ones with linear or "
        "nearest mode only); reshape the input to 4-D around the GridSample, or use mode 'linear'/'nearest'")


class OnnxGridSample(nn.Module):
    """ONNX ``GridSample`` on a 4-D (or, linear/nearest, 5-D) input: ``F.grid_sample`` with the node's options."""

    def __init__(self, mode: str, padding_mode: str, align_corners: bool) -> None:
        super().__init__()
        self.mode = mode
        self.padding_mode = padding_mode
        self.align_corners = align_corners

    def forward(self, x: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        return F.grid_sample(x, grid.to(x.dtype), mode=self.mode, padding_mode=self.padding_mode,
                             align_corners=self.align_corners)

    def extra_repr(self) -> str:
        return f"mode={self.mode!r}, padding_mode={self.padding_mode!r}, align_corners={self.align_corners}"


@register_onnx_converter("GridSample", (16, 20, 22))
def _convert_grid_sample(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    a = node.attributes
    where = f"GridSample node {node.name!r}"
    mode = text(a.get("mode", "linear"))  # 16's default "bilinear" is 20's "linear"
    padding = text(a.get("padding_mode", "zeros"))
    if mode not in _MODES or padding not in _PADDING:
        raise NotSupportedError(f"{where}: mode={mode!r}, padding_mode={padding!r} are not ONNX values")
    rank = rank_of(graph, node.input_values[0])
    if rank is not None:
        _check_rank(rank, _MODES[mode], where)
    module = OnnxGridSample(_MODES[mode], padding, bool(a.get("align_corners", 0)))
    return result(module, node, list(node.input_values[:2]))
