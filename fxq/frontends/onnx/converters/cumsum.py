"""``CumSum-11`` and ``CumSum-14``: replaces onnx2torch 1.5.15's converter, which reads a missing ``reverse``
attribute as 1 (ONNX's default is 0), so every model that leaves it out (torch.onnx's export of ``torch.cumsum``)
got a reversed cumulative sum, and which lets integer data come out as int64 (``torch.cumsum`` promotes integers).

A constant ``axis`` (the usual case) is kept in the module, so ``forward`` takes the data only and traces with fx;
an axis computed at run time is passed in and read with ``int()`` when called.
"""
from __future__ import annotations

import torch
from onnx2torch.onnx_graph import OnnxGraph
from onnx2torch.onnx_node import OnnxNode
from onnx2torch.utils.common import OperationConverterResult
from torch import nn

from fxq.frontends.onnx.converters._common import const_input, int_list, result
from fxq.frontends.onnx.converters.registry import register_onnx_converter

__all__ = ["OnnxCumSum"]


class OnnxCumSum(nn.Module):
    """ONNX ``CumSum``: running sum along ``axis`` in the data's own dtype.

    Args:
        axis: the summed dimension (negative counts from the end); None = given to ``forward`` as a tensor.
        exclusive: ``y[i]`` sums the elements before ``i`` only (``y[0] = 0``).
        reverse: sum from the end of the axis towards its start.
    """

    def __init__(self, axis: int | None, exclusive: bool = False, reverse: bool = False) -> None:
        super().__init__()
        self.axis = axis
        self.exclusive = exclusive
        self.reverse = reverse

    def forward(self, x: torch.Tensor, axis: torch.Tensor | None = None) -> torch.Tensor:
        d = self.axis if axis is None else int(axis)
        if self.reverse:
            x = torch.flip(x, (d,))
        if self.exclusive and x.size(d):  # shift one place along the axis, a zero first: the sums skip the element
            x = torch.cat([torch.zeros_like(x.narrow(d, 0, 1)), x.narrow(d, 0, x.size(d) - 1)], dim=d)
        y = torch.cumsum(x, d, dtype=x.dtype)
        return torch.flip(y, (d,)) if self.reverse else y

    def extra_repr(self) -> str:
        return f"axis={self.axis}, exclusive={self.exclusive}, reverse={self.reverse}"


@register_onnx_converter("CumSum", (11, 14), override=True)
def _convert_cumsum(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    exclusive = bool(node.attributes.get("exclusive", 0))
    reverse = bool(node.attributes.get("reverse", 0))
    data, axis_name = node.input_values[0], node.input_values[1]
    try:
        axis_t = const_input(node, graph, 1, "axis")
    except NotImplementedError:  # computed at run time: read when called
        return result(OnnxCumSum(None, exclusive, reverse), node, [data, axis_name])
    (axis,) = int_list(axis_t)
    return result(OnnxCumSum(axis, exclusive, reverse), node, [data])
