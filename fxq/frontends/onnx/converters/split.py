"""``Split-18``: sizes from the ``split`` input or, new in 18, the ``num_outputs`` attribute.

With ``num_outputs`` every chunk has ``ceil(dim / num_outputs)`` elements and the last one takes what is left.
"""
from __future__ import annotations

import math

import torch
from onnx2torch.onnx_graph import OnnxGraph
from onnx2torch.onnx_node import OnnxNode
from onnx2torch.utils.common import OperationConverterResult
from torch import nn

from fxq.frontends.onnx.converters._common import const_input, dim_of, int_list, result
from fxq.frontends.onnx.converters.registry import register_onnx_converter

__all__ = ["OnnxSplit"]


class OnnxSplit(nn.Module):
    """Split along ``axis`` into ``sizes`` (when known) or ``chunks`` ceil-sized pieces.

    A single-output split returns the tensor itself, as onnx2torch expects of one-output nodes.
    """

    def __init__(self, axis: int, sizes: list[int] | None, chunks: int) -> None:
        super().__init__()
        self.axis = axis
        self.sizes = sizes
        self.chunks = chunks

    def forward(self, x: torch.Tensor):
        if self.sizes is not None:
            parts = torch.split(x, self.sizes, dim=self.axis)
        else:
            parts = torch.chunk(x, self.chunks, dim=self.axis)
        return parts[0] if self.chunks == 1 else parts

    def extra_repr(self) -> str:
        return f"axis={self.axis}, sizes={self.sizes}, chunks={self.chunks}"


@register_onnx_converter("Split", 18)
def _convert_split(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    axis = int(node.attributes.get("axis", 0))
    data = node.input_values[0]
    n_out = len(node.output_values)
    split_t = const_input(node, graph, 1, "split")
    if split_t is not None:
        sizes: list[int] | None = int_list(split_t)
    else:
        n = int(node.attributes.get("num_outputs", n_out))
        if n != n_out:
            raise NotImplementedError(f"Split: num_outputs={n} but the node has {n_out} outputs")
        dim = dim_of(graph, data, axis)
        if dim is None:
            sizes = None  # torch.chunk has the same ceil semantics when the size is only known at run time
        else:
            step = math.ceil(dim / n)
            sizes = [min(step, max(dim - i * step, 0)) for i in range(n)]
    if sizes is not None and len(sizes) != n_out:
        raise NotImplementedError(f"Split: {len(sizes)} sizes for {n_out} outputs")
    return result(OnnxSplit(axis, sizes, n_out), node, [data])
