"""The first half of every ONNX export: fxq GraphModule -> marked copy -> ONNX model with named tensors."""
from __future__ import annotations

from typing import Any

from torch import fx

from fxq.backends.qdq.lowering import Lowered, dynamic_axes_for, example_inputs_for, lower
from fxq.backends.qdq.marking import build_marked_module

__all__ = ["lower_model"]


def lower_model(gm: fx.GraphModule, *, opset: int, example_inputs: Any = None, dynamic_batch: bool = False,
                requantize_passive: bool = True, raise_opset: bool = False) -> Lowered:
    """Export ``gm`` to ONNX at ``opset`` with quant marks left in place (see :mod:`fxq.backends.qdq`); with
    ``raise_opset``, at the higher opset an op of the model needs."""
    args = example_inputs_for(gm, example_inputs)
    marked = build_marked_module(gm, requantize_passive=requantize_passive)
    axes = dynamic_axes_for(gm, marked.input_names, marked.output_names, dynamic_batch)
    return lower(marked, args, opset, axes, raise_opset=raise_opset)
