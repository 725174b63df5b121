"""``Clip-11/12/13``: replaces onnx2torch 1.5.15's converter, which refused any Clip whose ``max`` (or ``min``) is
given as the empty name, the ONNX spelling of "absent" that torch.onnx writes for ``clamp(min=...)`` (``F.normalize``
in Swin-V2: every legacy export of it failed to load), and any bound computed at run time.

Constant bounds give the modules onnx2torch gives (``Identity``, ``ReLU``, ``ReLU6``, its ``OnnxClip``), so saved
models and dispatch see what they saw before; bounds computed at run time are inputs of :class:`OnnxClipRunTime`.
"""
from __future__ import annotations

import torch
from onnx2torch.node_converters.clip import OnnxClip
from onnx2torch.onnx_graph import OnnxGraph
from onnx2torch.onnx_node import OnnxNode
from onnx2torch.utils.common import OperationConverterResult
from torch import nn

from fxq.frontends.onnx.converters._common import const_or_run_time, has_input, result
from fxq.frontends.onnx.converters.registry import register_onnx_converter

__all__ = ["OnnxClipRunTime"]


class OnnxClipRunTime(nn.Module):
    """ONNX ``Clip`` with bounds computed at run time (``None``: that side is open). As ONNX and ``torch.clamp``
    both define, ``min > max`` gives ``max`` everywhere."""

    def __init__(self, has_min: bool, has_max: bool) -> None:
        super().__init__()
        self.has_min = has_min
        self.has_max = has_max

    def forward(self, x: torch.Tensor, *bounds: torch.Tensor) -> torch.Tensor:
        it = iter(bounds)
        lo = next(it) if self.has_min else None
        hi = next(it) if self.has_max else None
        return torch.clamp(x, lo, hi)

    def extra_repr(self) -> str:
        return f"has_min={self.has_min}, has_max={self.has_max}"


def _constant_clip(lo: float | None, hi: float | None) -> nn.Module:
    if lo is None and hi is None:
        return nn.Identity()
    if lo == 0 and hi is None:
        return nn.ReLU()
    if lo == 0 and hi == 6:
        return nn.ReLU6()
    return OnnxClip(min_val=lo, max_val=hi)


@register_onnx_converter("Clip", (11, 12, 13), override=True)
def _convert_clip(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    data = node.input_values[0]
    given = [i for i in (1, 2) if has_input(node, i)]
    values = {i: const_or_run_time(node, graph, i, ("min", "max")[i - 1]) for i in given}
    if all(v is not None for v in values.values()):  # constant or absent
        lo, hi = (float(values[i]) if i in values else None for i in (1, 2))
        return result(_constant_clip(lo, hi), node, [data])
    return result(OnnxClipRunTime(1 in given, 2 in given), node, [data] + [node.input_values[i] for i in given])
