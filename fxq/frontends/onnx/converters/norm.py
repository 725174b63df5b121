"""``LayerNormalization-17`` and ``GlobalAveragePool-1`` that do not depend on shape inference knowing all sizes.

onnx2torch 1.5.15 builds ``nn.LayerNorm(normalized_shape=<inferred dims from axis>)``, which is ``[0]`` when
inference left those dims unknown (Swin-T at opset 17), and averages over ``range(2, <inferred rank>)``, which is
every dim (a ``[1, 1, 1, 1]`` result: Swin-T at opset 13's ``addmm 1x1 and 768x1000``) when the rank is unknown.
Here the normalized shape comes from the scale tensor and the pooled dims from the input at run time.
"""
from __future__ import annotations

import torch
from onnx2torch.node_converters.global_average_pool import OnnxGlobalAveragePool
from onnx2torch.node_converters.layer_norm import OnnxLayerNorm
from onnx2torch.onnx_graph import OnnxGraph
from onnx2torch.onnx_node import OnnxNode
from onnx2torch.utils.common import OperationConverterResult, onnx_mapping_from_node
from torch import nn

from fxq.frontends.onnx.converters._common import rank_of, result
from fxq.frontends.onnx.converters.registry import register_onnx_converter

__all__: list[str] = []


@register_onnx_converter("GlobalAveragePool", 1, override=True)
def _convert_global_average_pool(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    return result(OnnxGlobalAveragePool(), node, [node.input_values[0]])


def _normalized_shape(node: OnnxNode, graph: OnnxGraph, axis: int, scale: torch.Tensor) -> list[int]:
    data = node.input_values[0]
    rank = rank_of(graph, data)
    count = -axis if axis < 0 else (rank - axis if rank is not None else None)
    if count is not None and scale.dim() == count:
        return list(scale.shape)
    if count is not None and rank is not None:
        dims = graph.value_info[data].type.tensor_type.shape.dim[rank - count:]
        if all(d.HasField("dim_value") and d.dim_value > 0 for d in dims):
            return [int(d.dim_value) for d in dims]
    raise NotImplementedError(f"LayerNormalization: the normalized dims (axis {axis}) are not known from the scale "
                              f"{list(scale.shape)} or from shape inference")


@register_onnx_converter("LayerNormalization", 17, override=True)
def _convert_layer_norm(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    axis = int(node.attributes.get("axis", -1))
    eps = float(node.attributes.get("epsilon", 1e-5))
    if len([o for o in node.output_values if o]) > 1:
        raise NotImplementedError("LayerNormalization: the Mean / InvStdDev outputs are not supported")
    params = node.input_values[1:]
    if not all(p in graph.initializers for p in params if p):
        return OperationConverterResult(torch_module=OnnxLayerNorm(axis=axis, epsilon=eps),
                                        onnx_mapping=onnx_mapping_from_node(node))
    scale = graph.initializers[params[0]].to_torch()
    shape = _normalized_shape(node, graph, axis, scale)
    module = nn.LayerNorm(shape, eps=eps, elementwise_affine=True)
    with torch.no_grad():
        module.weight.data = scale.expand(shape).clone()
        if len(params) > 1 and params[1]:
            module.bias.data = graph.initializers[params[1]].to_torch().expand(shape).clone()
        else:
            module.bias.data.zero_()
    return result(module, node, [node.input_values[0]])
