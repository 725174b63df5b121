"""``TopK-1/10/11``: equal values come out in index order, as ONNX specifies and onnxruntime does.

onnx2torch 1.5.15 calls ``torch.topk``, whose order among equal values is unspecified: on ties the indices output
differed from onnxruntime (by 4 positions on a 3x6 tensor of small integers). A stable sort keeps the lower index
first, for ``largest`` 1 and 0. onnx2torch's ``TopK-1`` also expected ``k`` as an input, where that version has it
as an attribute. ``sorted=0`` leaves the order free: there ``torch.topk(sorted=False)`` is kept, whose order
is onnxruntime's more often than a sorted one is (on a 3x50 input: the same order for k=20; for k=5 neither is).
Exported, the module is ``torch.topk`` again, which torch.onnx writes as one ``TopK`` (a stable sort is not
exportable) whose runtime keeps the ONNX order.
"""
from __future__ import annotations

import torch
from onnx2torch.onnx_graph import OnnxGraph
from onnx2torch.onnx_node import OnnxNode
from onnx2torch.utils.common import OperationConverterResult
from torch import nn

from fxq.frontends.onnx.converters._common import const_input, int_list, result
from fxq.frontends.onnx.converters.registry import register_onnx_converter

__all__ = ["OnnxTopK"]


class OnnxTopK(nn.Module):
    """The ``k`` largest (or smallest) values along ``axis`` and their indices, ties in index order.

    Args:
        axis: the dimension searched.
        largest: largest values first; smallest first when false.
        k: how many; None = given to ``forward`` as a tensor.
        sort: the ONNX ``sorted`` attribute.
    """

    def __init__(self, axis: int, largest: bool, k: int | None, sort: bool = True) -> None:
        super().__init__()
        self.axis = axis
        self.largest = largest
        self.k = k
        self.sort = sort

    def forward(self, x: torch.Tensor, k: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.k if k is None else int(k.reshape(-1)[0])
        if not self.sort or torch.onnx.is_in_onnx_export():  # exported as TopK: the runtime keeps the ONNX order
            values, indices = torch.topk(x, n, dim=self.axis, largest=self.largest, sorted=self.sort)
            return values, indices
        values, indices = torch.sort(x, dim=self.axis, descending=self.largest, stable=True)
        return values.narrow(self.axis, 0, n), indices.narrow(self.axis, 0, n)

    def extra_repr(self) -> str:
        return f"axis={self.axis}, largest={self.largest}, k={self.k}, sort={self.sort}"


@register_onnx_converter("TopK", (1, 10, 11), override=True)
def _convert_topk(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    axis = int(node.attributes.get("axis", -1))
    largest = bool(node.attributes.get("largest", 1))
    sort = bool(node.attributes.get("sorted", 1))
    data = node.input_values[0]
    if "k" in node.attributes:  # TopK-1
        return result(OnnxTopK(axis, largest, int(node.attributes["k"]), sort), node, [data])
    try:
        k_t = const_input(node, graph, 1, "K")
    except NotImplementedError:  # computed at run time: read when called
        return result(OnnxTopK(axis, largest, None, sort), node, [data, node.input_values[1]])
    (k,) = int_list(k_t)
    return result(OnnxTopK(axis, largest, k, sort), node, [data])
