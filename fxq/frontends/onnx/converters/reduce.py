"""``Reduce*`` of every version: ``axes`` as an attribute (up to 13; ``ReduceSum`` up to 11) or an optional input.

onnx2torch 1.5.15 converts ``ReduceSum-13`` (the first with an ``axes`` input) but none of the other
``Reduce*-18`` (and ``ReduceMax/Min-20``, ``ReduceLogSum*-28``), which torch's default exporter writes. Its
``ReduceMax/Min/Prod`` up to 13 reduce one axis at a time after sorting the axes as written, so with
``keepdims=0`` and axes of both signs (``[-1, 1]``) the second reduction hit the wrong dim (a ``[3, 4]`` result for
``[2, 4]``); these versions are ours too.
``axes`` must be constant; the module keeps them, so ``forward`` takes the data tensor only and traces with fx.
"""
from __future__ import annotations

from typing import Callable

import onnx
import torch
from onnx2torch.onnx_graph import OnnxGraph
from onnx2torch.onnx_node import OnnxNode
from onnx2torch.utils.common import OperationConverterResult
from torch import nn

from fxq.frontends.onnx.converters._common import const_input, int_list, rank_of, result
from fxq.frontends.onnx.converters.registry import register_onnx_converter

__all__ = ["OnnxReduce"]


def _prod(x: torch.Tensor, dims: tuple[int, ...], keepdim: bool) -> torch.Tensor:
    for d in dims:  # torch.prod takes one dim: reduce keeping dims so later indices stay valid
        x = torch.prod(x, dim=d, keepdim=True)
    return x if keepdim else torch.squeeze(x, dims)


_REDUCERS: dict[str, Callable[[torch.Tensor, tuple[int, ...], bool], torch.Tensor]] = {
    "ReduceMean": lambda x, d, k: torch.mean(x, dim=d, keepdim=k),
    "ReduceMax": lambda x, d, k: torch.amax(x, dim=d, keepdim=k),
    "ReduceMin": lambda x, d, k: torch.amin(x, dim=d, keepdim=k),
    "ReduceProd": _prod,
    "ReduceL1": lambda x, d, k: torch.sum(torch.abs(x), dim=d, keepdim=k),
    "ReduceL2": lambda x, d, k: torch.sqrt(torch.sum(x * x, dim=d, keepdim=k)),
    "ReduceLogSum": lambda x, d, k: torch.log(torch.sum(x, dim=d, keepdim=k)),
    "ReduceLogSumExp": lambda x, d, k: torch.logsumexp(x, dim=d, keepdim=k),
    "ReduceSumSquare": lambda x, d, k: torch.sum(x * x, dim=d, keepdim=k),
    "ReduceSum": lambda x, d, k: torch.sum(x, dim=d, keepdim=k),
}

# op type -> since_versions with axes as an attribute
_ATTRIBUTE_VERSIONS: dict[str, tuple[int, ...]] = {
    **{op: (1, 11, 13) for op in ("ReduceMean", "ReduceProd", "ReduceL1", "ReduceL2", "ReduceLogSum",
                                  "ReduceLogSumExp", "ReduceSumSquare")},
    "ReduceMax": (1, 11, 12, 13),
    "ReduceMin": (1, 11, 12, 13),
    "ReduceSum": (1, 11),
}

# op type -> since_versions with axes as an input that onnx2torch lacks
_VERSIONS: dict[str, tuple[int, ...]] = {
    "ReduceMean": (18,),
    "ReduceMax": (18, 20),
    "ReduceMin": (18, 20),
    "ReduceProd": (18,),
    "ReduceL1": (18,),
    "ReduceL2": (18,),
    "ReduceLogSum": (18, 28),
    "ReduceLogSumExp": (18, 28),
    "ReduceSumSquare": (18,),
}


class OnnxReduce(nn.Module):
    """An ONNX ``Reduce*`` with fixed axes.

    Args:
        op_type: the ONNX op type, a key of the reducer table.
        dims: dimensions to reduce; None = all (resolved from the input's rank when called).
        keepdim: the ONNX ``keepdims`` attribute.
        noop: reduce nothing (empty axes with ``noop_with_empty_axes=1``).
    """

    def __init__(self, op_type: str, dims: tuple[int, ...] | None, keepdim: bool, noop: bool = False) -> None:
        super().__init__()
        self.op_type = op_type
        self.dims = dims
        self.keepdim = keepdim
        self.noop = noop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.noop:
            return x
        dims = self.dims if self.dims is not None else tuple(range(x.dim()))
        return _REDUCERS[self.op_type](x, dims, self.keepdim)

    def extra_repr(self) -> str:
        return f"{self.op_type}, dims={self.dims}, keepdim={self.keepdim}" + (", noop" if self.noop else "")


def _convert_reduce(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    data = node.input_values[0]
    if "axes" in node.attributes:
        axes_attr = node.attributes["axes"]
        if isinstance(axes_attr, onnx.AttributeProto):  # an empty list: onnx2torch hands it over unparsed
            axes_attr = onnx.helper.get_attribute_value(axes_attr)
        axes = [int(a) for a in axes_attr]
    else:
        axes_t = const_input(node, graph, 1, "axes")
        axes = int_list(axes_t) if axes_t is not None else []
    keepdim = bool(node.attributes.get("keepdims", 1))
    if not axes:
        if node.attributes.get("noop_with_empty_axes", 0):
            return result(OnnxReduce(node.operation_type, (), keepdim, noop=True), node, [data])
        rank = rank_of(graph, data)
        dims = tuple(range(rank)) if rank is not None else None
    else:
        dims = tuple(axes)
    return result(OnnxReduce(node.operation_type, dims, keepdim), node, [data])


for _op, _versions in _VERSIONS.items():
    register_onnx_converter(_op, _versions)(_convert_reduce)
for _op, _versions in _ATTRIBUTE_VERSIONS.items():
    register_onnx_converter(_op, _versions, override=True)(_convert_reduce)
