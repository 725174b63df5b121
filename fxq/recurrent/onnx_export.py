"""ONNX forms of ``fxq::lstm`` / ``fxq::gru`` for torch's TorchScript exporter: one ``LSTM`` / ``GRU`` node each.

The op's inputs are ONNX's own (same layout, same gate order), so weight Q/DQ pairs feed the node directly.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.onnx import symbolic_helper

__all__: list[str] = []

_OPSET = 7  # LSTM-7 / GRU-7 carry every attribute written here; later versions only add layout / types


def _optional(g: Any, value: Any) -> Any:
    """``value``, or ONNX's empty input when the argument is None."""
    if value is None or symbolic_helper._is_none(value):
        none = g.op("prim::Constant")
        none.setType(torch._C.OptionalType.ofTensor())
        return none
    return value


@symbolic_helper.parse_args("v", "v", "v", "v", "v", "v", "i", "s")
def _lstm_symbolic(g: Any, x: Any, w: Any, r: Any, b: Any, h0: Any, c0: Any, hidden_size: int,
                   direction: str) -> Any:
    return g.op("LSTM", x, w, r, b, _optional(g, None), _optional(g, h0), _optional(g, c0),
                hidden_size_i=hidden_size, direction_s=direction, outputs=3)


@symbolic_helper.parse_args("v", "v", "v", "v", "v", "i", "s", "i")
def _gru_symbolic(g: Any, x: Any, w: Any, r: Any, b: Any, h0: Any, hidden_size: int, direction: str,
                  linear_before_reset: int) -> Any:
    return g.op("GRU", x, w, r, b, _optional(g, None), _optional(g, h0), hidden_size_i=hidden_size,
                direction_s=direction, linear_before_reset_i=linear_before_reset, outputs=2)


torch.onnx.register_custom_op_symbolic("fxq::lstm", _lstm_symbolic, _OPSET)
torch.onnx.register_custom_op_symbolic("fxq::gru", _gru_symbolic, _OPSET)
