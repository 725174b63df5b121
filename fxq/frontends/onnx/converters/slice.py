"""``Slice``: onnx2torch 1.5.15's modules, indexing with a tuple.

onnx2torch indexes with a *list* of slices, which torch deprecates: every call of every ``Slice`` (detector heads,
transformers, paddle2onnx files) printed a ``UserWarning`` saying that a later torch reads the list as a tensor
index ("an error or a different result"). Its ``Slice-1`` converter did not even build its module.
``OnnxSliceIndexed`` keeps onnx2torch's arguments, names and ONNX export and indexes with a tuple;
Slice-1 gets a module of its own.
"""
from __future__ import annotations

import torch
from onnx2torch.node_converters.slice import OnnxSlice, _get_slices
from onnx2torch.onnx_graph import OnnxGraph
from onnx2torch.onnx_node import OnnxNode
from onnx2torch.utils.common import OperationConverterResult, onnx_mapping_from_node
from onnx2torch.utils.custom_export_to_onnx import DefaultExportToOnnx
from torch import nn

from fxq.frontends.onnx.converters.registry import register_onnx_converter

__all__ = ["OnnxSliceIndexed", "OnnxSliceAttributes"]


def _sliced(x: torch.Tensor, flip_dims: list, leading: list, trailing: list) -> torch.Tensor:
    """``x`` flipped along ``flip_dims`` (negative steps), then indexed by the slices of the leading dims and those
    of the trailing (negative) dims."""
    if flip_dims:
        x = torch.flip(x, dims=flip_dims)
    if leading:
        x = x[tuple(leading)]
    if trailing:
        x = x[tuple(trailing)]
    return x


class OnnxSliceIndexed(OnnxSlice):
    """ONNX ``Slice-10/11/13`` (bounds as inputs) as onnx2torch's ``OnnxSlice``, indexing with a tuple."""

    def forward(self, input_tensor: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor,
                axes: torch.Tensor | None = None, steps: torch.Tensor | None = None) -> torch.Tensor:
        if axes is None and steps is not None:  # steps given without axes: the axes are 0, 1, ... (ONNX)
            axes = torch.arange(len(starts))

        def sliced() -> torch.Tensor:
            return _sliced(input_tensor, *_get_slices(starts, ends, axes, steps))

        if torch.onnx.is_in_onnx_export():
            optional = [t for t in (axes, steps) if t is not None]
            return DefaultExportToOnnx.export(sliced, "Slice", input_tensor, starts, ends, *optional, {})
        return sliced()


class OnnxSliceAttributes(nn.Module):
    """ONNX ``Slice-1``: bounds as attributes, unit steps (``axes`` None: the first ``len(starts)`` dims)."""

    def __init__(self, starts: list[int], ends: list[int], axes: list[int] | None = None) -> None:
        super().__init__()
        self.starts, self.ends = [int(v) for v in starts], [int(v) for v in ends]
        self.axes = None if axes is None else [int(v) for v in axes]

    def forward(self, input_tensor: torch.Tensor) -> torch.Tensor:
        axes = None if self.axes is None else torch.tensor(self.axes)
        return _sliced(input_tensor, *_get_slices(self.starts, self.ends, axes, None))

    def extra_repr(self) -> str:
        return f"starts={self.starts}, ends={self.ends}, axes={self.axes}"


@register_onnx_converter("Slice", 1, override=True)
def _convert_slice_attributes(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    attributes = node.attributes
    module = OnnxSliceAttributes(attributes["starts"], attributes["ends"], attributes.get("axes"))
    return OperationConverterResult(torch_module=module, onnx_mapping=onnx_mapping_from_node(node))


@register_onnx_converter("Slice", (10, 11, 13), override=True)
def _convert_slice(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    return OperationConverterResult(torch_module=OnnxSliceIndexed(), onnx_mapping=onnx_mapping_from_node(node))
