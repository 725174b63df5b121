"""``Reshape-19`` and later, with both ``allowzero`` values.

onnx2torch 1.5.15 converts ``Reshape-14`` for ``allowzero=0`` only; torch's default exporter writes ``allowzero=1``.
A 0 in ``shape`` copies the input's dimension when ``allowzero=0`` and means an empty dimension when ``allowzero=1``.
A constant ``shape`` is kept in the module (fx-traceable); a run-time ``shape`` is read in ``forward`` and, during
``torch.onnx`` export, written as an ONNX ``Reshape`` of that tensor (tracing ``shape.tolist()`` would freeze the
export at the traced size).
"""
from __future__ import annotations

import torch
from onnx2torch.onnx_graph import OnnxGraph
from onnx2torch.onnx_node import OnnxNode
from onnx2torch.utils.common import OperationConverterResult
from onnx2torch.utils.custom_export_to_onnx import DefaultExportToOnnx
from torch import nn

from fxq.frontends.onnx.converters._common import int_list, result
from fxq.frontends.onnx.converters.registry import register_onnx_converter

__all__ = ["OnnxReshape"]


class OnnxReshape(nn.Module):
    """``torch.reshape`` with ONNX's rules for 0 in the target shape.

    Args:
        shape: the constant target shape, or None when it is the second ``forward`` argument.
        allowzero: the ONNX attribute.
    """

    def __init__(self, shape: list[int] | None, allowzero: bool) -> None:
        super().__init__()
        self.shape = shape
        self.allowzero = allowzero
        self.copy_dims = [] if shape is None or allowzero else [i for i, s in enumerate(shape) if s == 0]

    def forward(self, x: torch.Tensor, shape: torch.Tensor | None = None) -> torch.Tensor:
        if self.shape is None and torch.onnx.is_in_onnx_export():
            return DefaultExportToOnnx.export(lambda: self._reshape(x, shape), "Reshape", x, shape,
                                              {"allowzero_i": 1} if self.allowzero else {})
        return self._reshape(x, shape)

    def _reshape(self, x: torch.Tensor, shape: torch.Tensor | None) -> torch.Tensor:
        if self.shape is not None:
            target = list(self.shape)
            copy_dims = self.copy_dims
        else:
            target = [int(v) for v in shape.tolist()]
            copy_dims = [] if self.allowzero else [i for i, s in enumerate(target) if s == 0]
        for i in copy_dims:
            target[i] = x.shape[i]
        return torch.reshape(x, target)

    def extra_repr(self) -> str:
        return f"shape={self.shape}, allowzero={self.allowzero}"


@register_onnx_converter("Reshape", (19, 21, 23, 24, 25))
def _convert_reshape(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    data, shape_name = node.input_values[0], node.input_values[1]
    allowzero = bool(node.attributes.get("allowzero", 0))
    if shape_name in graph.initializers:
        shape = int_list(graph.initializers[shape_name].to_torch())
        return result(OnnxReshape(shape, allowzero), node, [data])
    return result(OnnxReshape(None, allowzero), node, [data, shape_name])
