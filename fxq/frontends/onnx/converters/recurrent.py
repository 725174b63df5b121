"""ONNX ``LSTM`` / ``GRU`` (onnx2torch 1.5.15 has neither) as :class:`fxq.recurrent.modules.RecurrentLayer`.

Covered: forward / reverse / bidirectional, default activations, ``layout=0``, constant ``W`` / ``R`` / ``B``,
optional ``initial_h`` / ``initial_c`` (constant or computed), GRU with either ``linear_before_reset``. Refused
with the reason (the loader names the node): ``sequence_lens`` (variable lengths), peepholes ``P``, ``clip``,
``input_forget``, other activations, ``layout=1``.
"""
from __future__ import annotations

import torch
from onnx2torch.onnx_graph import OnnxGraph
from onnx2torch.onnx_node import OnnxNode
from onnx2torch.utils.common import OperationConverterResult

from fxq.frontends.onnx.converters._common import const_input, has_input, result, text
from fxq.frontends.onnx.converters.registry import register_onnx_converter
from fxq.recurrent.modules import RecurrentLayer

__all__: list[str] = []

_DEFAULT_ACTIVATIONS = {"LSTM": ["Sigmoid", "Tanh", "Tanh"], "GRU": ["Sigmoid", "Tanh"]}
_GATES = {"LSTM": 4, "GRU": 3}


def _check_attributes(node: OnnxNode, kind: str, dirs: int) -> None:
    attrs = node.attributes
    acts = [text(a) for a in attrs.get("activations", [])]
    if acts and [a.lower() for a in acts] != [a.lower() for a in _DEFAULT_ACTIVATIONS[kind] * dirs]:
        raise NotImplementedError(f"{kind}: activations {acts} are not supported (only the defaults "
                                  f"{_DEFAULT_ACTIVATIONS[kind]}); re-export the layer with standard activations")
    if attrs.get("clip") is not None:
        raise NotImplementedError(f"{kind}: clip={attrs['clip']} is not supported; re-export without cell clipping")
    if int(attrs.get("input_forget", 0)):
        raise NotImplementedError(f"{kind}: input_forget=1 (coupled input/forget gates) is not supported")
    if int(attrs.get("layout", 0)):
        raise NotImplementedError(f"{kind}: layout=1 (batch-major) is not supported; export with layout=0 and "
                                  "Transpose nodes around the layer (torch.onnx does this for batch_first=True)")


def _convert(node: OnnxNode, graph: OnnxGraph, kind: str) -> OperationConverterResult:
    direction = text(node.attributes.get("direction", "forward"))
    dirs = 2 if direction == "bidirectional" else 1
    _check_attributes(node, kind, dirs)
    w = const_input(node, graph, 1, "W")
    r = const_input(node, graph, 2, "R")
    assert w is not None and r is not None  # required inputs; const_input raises when they are computed
    hidden = int(node.attributes.get("hidden_size", r.shape[-1]))
    b = const_input(node, graph, 3, "B")
    if b is None:
        b = torch.zeros(dirs, 2 * _GATES[kind] * hidden)
    if has_input(node, 4):
        raise NotImplementedError(f"{kind}: sequence_lens (variable-length sequences) is not supported; pad the "
                                  "batch to one length and export without sequence lengths")
    if kind == "LSTM" and has_input(node, 7):
        p = const_input(node, graph, 7, "P")
        if p is not None and bool(p.ne(0).any()):
            raise NotImplementedError("LSTM: peephole weights P are not supported")
    states = [i for i in ((5, 6) if kind == "LSTM" else (5,)) if has_input(node, i)]
    outputs = [o for o in node.output_values]
    while outputs and not outputs[-1]:
        outputs.pop()
    module = RecurrentLayer(kind, w.float(), r.float(), b.float(), direction, has_h=5 in states,
                            has_c=6 in states, num_outputs=max(len(outputs), 1),
                            linear_before_reset=int(node.attributes.get("linear_before_reset", 0)))
    return result(module, node, [node.input_values[0], *[node.input_values[i] for i in states]])


@register_onnx_converter("LSTM", (7, 14, 22))
def _convert_lstm(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    return _convert(node, graph, "LSTM")


@register_onnx_converter("GRU", (7, 14, 22))
def _convert_gru(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    return _convert(node, graph, "GRU")
