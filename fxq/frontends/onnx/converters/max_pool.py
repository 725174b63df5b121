"""``MaxPool-8/10/11/12`` (and 22 through :mod:`versions`) with its second output, ``Indices``.

onnx2torch 1.5.15 builds a one-output ``nn.MaxPool`` whatever the node asks, so a node that also wants ``Indices``
(SegNet-style ``MaxUnpool`` models) lost that output: the converted graph returned the values where ONNX has two
tensors. Here such a node gets torch's indices, which count within each (N, C) plane, moved to ONNX's count over
the whole input (``storage_order=0``). A one-output node keeps onnx2torch's module; ``auto_pad`` SAME_UPPER /
SAME_LOWER pads with ``-inf`` at run time (:mod:`.auto_pad`).
"""
from __future__ import annotations

import torch
from onnx2torch.node_converters.registry import get_converter
from onnx2torch.onnx_graph import OnnxGraph
from onnx2torch.onnx_node import OnnxNode
from onnx2torch.utils.common import OperationConverterResult
from torch import nn

from fxq.frontends.onnx.converters._common import result
from fxq.frontends.onnx.converters.auto_pad import is_same_pad, same_pad_converter
from fxq.frontends.onnx.converters.registry import register_onnx_converter
from fxq.graph.op_types import register_op_type

__all__ = ["OnnxMaxPoolWithIndices", "OnnxGlobalMaxPool"]

_ONNX2TORCH_MAX_POOL = {v: get_converter(operation_type="MaxPool", version=v) for v in (8, 10, 11, 12)}


class OnnxMaxPoolWithIndices(nn.Module):
    """``pool`` (an ``nn.MaxPool1d/2d/3d``) returning (values, ONNX indices into the flattened input)."""

    def __init__(self, pool: nn.Module) -> None:
        super().__init__()
        self.pool = pool
        self.pool.return_indices = True

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        values, indices = self.pool(x)
        plane = x[0, 0].numel()
        planes = torch.arange(x.shape[0] * x.shape[1], device=x.device).reshape(x.shape[0], x.shape[1])
        offset = planes.reshape(planes.shape + (1,) * (x.dim() - 2)) * plane
        return values, indices + offset


def _max_pool(version: int):
    same = same_pad_converter(_ONNX2TORCH_MAX_POOL[version], value=float("-inf"))

    def convert(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
        wants_indices = len(node.output_values) > 1 and node.output_values[1] != ""
        if not wants_indices:
            return same(node, graph)  # SAME or unequal pads wrapped, else onnx2torch's
        if is_same_pad(node):
            raise NotImplementedError("MaxPool: Indices with auto_pad SAME_* (they would count the padding)")
        converted = _ONNX2TORCH_MAX_POOL[version](node, graph)
        pool = converted.torch_module
        if not isinstance(pool, (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d)):
            raise NotImplementedError("MaxPool: Indices with unequal begin/end pads (they would count the padding)")
        return result(OnnxMaxPoolWithIndices(pool), node, [node.input_values[0]])

    convert.__name__ = f"convert_max_pool_{version}"
    return convert


for _version in _ONNX2TORCH_MAX_POOL:
    register_onnx_converter("MaxPool", _version, override=True)(_max_pool(_version))


class OnnxGlobalMaxPool(nn.Module):
    """ONNX ``GlobalMaxPool``: the maximum over every spatial dim (all dims after N, C), kept as size 1."""

    output_size = 1  # as an adaptive pool to 1 says it (fxq's op types read it to tell global from windowed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.amax(dim=tuple(range(2, x.dim())), keepdim=True)


register_op_type(OnnxGlobalMaxPool, "GlobalMaxPool")


@register_onnx_converter("GlobalMaxPool", 1)
def _convert_global_max_pool(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    return result(OnnxGlobalMaxPool(), node, [node.input_values[0]])
