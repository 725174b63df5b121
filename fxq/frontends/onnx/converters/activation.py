"""``Gelu-20`` (new in opset 20; torch's default exporter writes it for ``F.gelu``)."""
from __future__ import annotations

from onnx2torch.onnx_graph import OnnxGraph
from onnx2torch.onnx_node import OnnxNode
from onnx2torch.utils.common import OperationConverterResult
from torch import nn

from fxq.frontends.onnx.converters._common import result
from fxq.frontends.onnx.converters.registry import register_onnx_converter

__all__: list[str] = []


@register_onnx_converter("Gelu", 20)
def _convert_gelu(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    approximate = node.attributes.get("approximate", "none")
    if approximate not in ("none", "tanh"):
        raise NotImplementedError(f"Gelu: approximate={approximate!r} is not one of 'none', 'tanh'")
    return result(nn.GELU(approximate=approximate), node, [node.input_values[0]])
