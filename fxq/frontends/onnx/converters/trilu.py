"""``Trilu-14``: the upper or lower triangle of the last two dims (HF causal masks), which onnx2torch 1.5.15 lacks.

A constant ``k`` (or none: 0) is kept in the module, so ``forward`` takes the data only and torch.onnx writes one
``Trilu`` back; a ``k`` computed at run time is passed in and read with ``int()`` when called.
"""
from __future__ import annotations

import torch
from onnx2torch.onnx_graph import OnnxGraph
from onnx2torch.onnx_node import OnnxNode
from onnx2torch.utils.common import OperationConverterResult
from torch import nn

from fxq.frontends.onnx.converters._common import const_or_run_time, has_input, int_list, result
from fxq.frontends.onnx.converters.registry import register_onnx_converter

__all__ = ["OnnxTrilu"]


class OnnxTrilu(nn.Module):
    """ONNX ``Trilu``: keeps the elements on and above (``upper``) or on and below the ``k``-th diagonal of the last
    two dims, zeroes the rest; batched over the leading dims.

    Args:
        upper: keep the upper triangle (ONNX's default) rather than the lower one.
        k: the diagonal (positive: above the main one); None = given to ``forward`` as a tensor.
    """

    def __init__(self, upper: bool = True, k: int | None = 0) -> None:
        super().__init__()
        self.upper = upper
        self.k = k

    def forward(self, x: torch.Tensor, k: torch.Tensor | None = None) -> torch.Tensor:
        diagonal = self.k if k is None else int(k)
        return torch.triu(x, diagonal) if self.upper else torch.tril(x, diagonal)

    def extra_repr(self) -> str:
        return f"upper={self.upper}, k={self.k}"


@register_onnx_converter("Trilu", 14)
def _convert_trilu(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    upper = bool(node.attributes.get("upper", 1))
    data = node.input_values[0]
    if not has_input(node, 1):
        return result(OnnxTrilu(upper, 0), node, [data])
    k_t = const_or_run_time(node, graph, 1, "k")
    if k_t is None:  # computed at run time: read when called
        return result(OnnxTrilu(upper, None), node, [data, node.input_values[1]])
    (k,) = int_list(k_t)
    return result(OnnxTrilu(upper, k), node, [data])
