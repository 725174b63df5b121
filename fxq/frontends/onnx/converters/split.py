"""``Split-2/11/13/18``: sizes from the ``split`` attribute (2, 11), the ``split`` input (13, 18; a constant or
computed at run time) or, new in 18, the ``num_outputs`` attribute.

With ``num_outputs`` (or no sizes at all) every chunk has ``ceil(dim / n)`` elements and the last one takes what is
left; before 18 the spec asks for equal parts, which that gives. onnx2torch 1.5.15's Split-2/11/13 return a tuple
even for a node with one output, which the converted graph then hands on as if it were the tensor (torchvision's
detectors, exported by torch.onnx, split a tensor into one piece: ``Squeeze`` got the tuple).
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

    def forward(self, x: torch.Tensor, split: torch.Tensor | None = None):
        if split is not None:  # sizes computed at run time: one slice per piece (exported as Slices on them)
            ends = torch.cumsum(split.reshape(-1), 0)
            starts = ends - split.reshape(-1)
            axis = self.axis % x.dim()
            parts = tuple(x[(slice(None),) * axis + (slice(starts[i], ends[i]),)] for i in range(self.chunks))
        elif self.sizes is not None:
            parts = torch.split(x, self.sizes, dim=self.axis)
        else:
            parts = torch.chunk(x, self.chunks, dim=self.axis)
        return parts[0] if self.chunks == 1 else parts

    def extra_repr(self) -> str:
        return f"axis={self.axis}, sizes={self.sizes}, chunks={self.chunks}"


@register_onnx_converter("Split", (2, 11, 13, 18), override=True)
def _convert_split(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    axis = int(node.attributes.get("axis", 0))
    data = node.input_values[0]
    n_out = len(node.output_values)
    if "split" in node.attributes:  # Split-2 / 11
        split_t: torch.Tensor | None = torch.as_tensor(list(node.attributes["split"]))
    else:
        try:
            split_t = const_input(node, graph, 1, "split")
        except NotImplementedError:  # computed at run time: read when called
            return result(OnnxSplit(axis, None, n_out), node, [data, node.input_values[1]])
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
