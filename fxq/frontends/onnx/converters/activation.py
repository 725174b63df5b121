"""Activations onnx2torch 1.5.15 lacks: ``Gelu-20`` (torch's default exporter writes it for ``F.gelu``), ``Mish-18``
(YOLOv4-style detectors), ``ThresholdedRelu-10`` and ``Shrink-9`` — each as the torch module that computes it."""
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


@register_onnx_converter("Mish", 18)
def _convert_mish(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    return result(nn.Mish(), node, [node.input_values[0]])


@register_onnx_converter("ThresholdedRelu", 10)
def _convert_thresholded_relu(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    """``y = x if x > alpha else 0`` is ``nn.Threshold(alpha, 0)``."""
    return result(nn.Threshold(float(node.attributes.get("alpha", 1.0)), 0.0), node, [node.input_values[0]])


@register_onnx_converter("Shrink", 9)
def _convert_shrink(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    """``y = x - bias if x > lambd, x + bias if x < -lambd, else 0``: ``nn.Hardshrink`` for ``bias = 0``,
    ``nn.Softshrink`` for ``bias = lambd`` (the two forms models use)."""
    lambd = float(node.attributes.get("lambd", 0.5))
    bias = float(node.attributes.get("bias", 0.0))
    if bias == 0.0:
        return result(nn.Hardshrink(lambd), node, [node.input_values[0]])
    if bias == lambd:
        return result(nn.Softshrink(lambd), node, [node.input_values[0]])
    raise NotImplementedError(f"Shrink with bias={bias} other than 0 or lambd={lambd} (Hardshrink / Softshrink)")
