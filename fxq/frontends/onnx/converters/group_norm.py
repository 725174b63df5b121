"""``GroupNormalization-18/21`` and ``MeanVarianceNormalization-9/13``, which onnx2torch 1.5.15 lacks.

``GroupNormalization-18`` has one scale and bias per group, 21 one per channel (18's are repeated over each group's
channels, at load time when shape inference knows the channel count); 21's ``stash_type`` is the element type the
normalization (not the affine step) is computed in. ``MeanVarianceNormalization`` follows ONNX's function body:
``(x - mean) / (sqrt(mean(x^2) - mean^2) + 1e-9)`` over ``axes``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from onnx import helper
from onnx2torch.onnx_graph import OnnxGraph
from onnx2torch.onnx_node import OnnxNode
from onnx2torch.utils.common import OperationConverterResult
from torch import nn

from fxq.errors import NotSupportedError
from fxq.frontends.onnx.converters._common import const_input, dim_of, result
from fxq.frontends.onnx.converters.registry import register_onnx_converter

__all__ = ["OnnxGroupNormalization", "OnnxMeanVarianceNormalization"]


class OnnxGroupNormalization(nn.Module):
    """ONNX ``GroupNormalization``: ``F.group_norm`` with the node's per-channel scale and bias.

    Args:
        num_groups: groups the channels are split into.
        scale, bias: per channel, or per group when ``per_group`` (repeated over the channels when called).
        eps: added to the variance.
        stash: the dtype the normalization runs in (None: the input's, also when the input has that dtype).
    """

    def __init__(self, num_groups: int, scale: torch.Tensor, bias: torch.Tensor, eps: float, per_group: bool,
                 stash: torch.dtype | None) -> None:
        super().__init__()
        self.num_groups = num_groups
        self.eps = eps
        self.per_group = per_group
        self.stash = stash
        self.scale: torch.Tensor
        self.bias: torch.Tensor
        self.register_buffer("scale", scale)
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale, bias = self.scale, self.bias
        if self.per_group:
            scale = scale.repeat_interleave(x.shape[1] // self.num_groups)
            bias = bias.repeat_interleave(x.shape[1] // self.num_groups)
        if self.stash is None:
            return F.group_norm(x, self.num_groups, scale.to(x.dtype), bias.to(x.dtype), self.eps)
        y = F.group_norm(x.to(self.stash), self.num_groups, eps=self.eps).to(x.dtype)
        shape = (1, -1) + (1,) * (x.dim() - 2)
        return y * scale.to(x.dtype).reshape(shape) + bias.to(x.dtype).reshape(shape)

    def extra_repr(self) -> str:
        return f"num_groups={self.num_groups}, eps={self.eps}, per_group={self.per_group}, stash={self.stash}"


def _convert_group_normalization(node: OnnxNode, graph: OnnxGraph, version: int) -> OperationConverterResult:
    a = node.attributes
    groups = int(a["num_groups"])
    scale = const_input(node, graph, 1, "scale")
    bias = const_input(node, graph, 2, "bias")
    if scale is None or bias is None:
        raise NotSupportedError(f"GroupNormalization node {node.name!r}: scale and bias are required inputs")
    per_group = version < 21
    stash = None
    if not per_group:
        stash_type = int(a.get("stash_type", 1))
        try:
            stash = getattr(torch, helper.tensor_dtype_to_np_dtype(stash_type).name)
        except (KeyError, TypeError, AttributeError, ValueError):
            raise NotSupportedError(
                f"GroupNormalization node {node.name!r}: stash_type {stash_type} is not a torch dtype; "
                "use 1 (float32)") from None
    if stash is not None and stash_type == _elem_type(graph, node.input_values[0]):
        stash = None  # computed in the input's own dtype: one F.group_norm with the affine step
    channels = dim_of(graph, node.input_values[0], 1)
    if per_group and channels is not None:  # repeat once here rather than on every call
        scale = scale.repeat_interleave(channels // groups)
        bias = bias.repeat_interleave(channels // groups)
        per_group = False
    module = OnnxGroupNormalization(groups, scale, bias, float(a.get("epsilon", 1e-5)), per_group, stash)
    return result(module, node, [node.input_values[0]])


def _elem_type(graph: OnnxGraph, name: str) -> int | None:
    """ONNX element type of tensor ``name`` (graph input or inferred), or None when unknown."""
    info = graph.value_info.get(name)
    if info is None or not info.type.HasField("tensor_type"):
        return None
    return int(info.type.tensor_type.elem_type) or None


@register_onnx_converter("GroupNormalization", 18)
def _convert_group_normalization_18(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    return _convert_group_normalization(node, graph, 18)


@register_onnx_converter("GroupNormalization", 21)
def _convert_group_normalization_21(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    return _convert_group_normalization(node, graph, 21)


class OnnxMeanVarianceNormalization(nn.Module):
    """ONNX ``MeanVarianceNormalization``: zero mean and unit variance over ``axes`` (1e-9 added to the std)."""

    def __init__(self, axes: tuple[int, ...]) -> None:
        super().__init__()
        self.axes = axes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(self.axes, keepdim=True)
        var = (x * x).mean(self.axes, keepdim=True) - mean * mean
        return (x - mean) / (torch.sqrt(var) + 1e-9)

    def extra_repr(self) -> str:
        return f"axes={self.axes}"


@register_onnx_converter("MeanVarianceNormalization", (9, 13))
def _convert_mvn(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    axes = tuple(int(v) for v in node.attributes.get("axes", (0, 2, 3)))
    return result(OnnxMeanVarianceNormalization(axes), node, [node.input_values[0]])
