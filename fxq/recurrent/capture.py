"""``nn.LSTM`` / ``nn.GRU`` traced as one ``fxq::lstm`` / ``fxq::gru`` node per layer, weights as graph inputs.

torch.fx keeps every ``torch.nn`` module whole, so a recurrent layer used to stay an FP32 leaf on every platform.
The decompositions here write each layer as the recurrent op of :mod:`fxq.recurrent.ops`, reading weights in ONNX
layout (``W_l<k>``, ``R_l<k>``, ``B_l<k>``: the module's own weights with the gates reordered and the directions
stacked, registered on the traced copy of the module), so weights are ``get_attr`` edges that platforms quantize
per gate and channel, and exporters write a single ONNX ``LSTM`` / ``GRU`` node per layer.

Covered: any ``num_layers``, ``bidirectional``, ``batch_first`` both ways, initial states given or not, batched
3-D input. Not covered (the module stays an FP32 leaf, with a log line): ``proj_size > 0`` (LSTM projections).
Packed sequences and unbatched 2-D input are not traceable as a leaf either; pad and batch them instead.
"""
from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from fxq.graph.decompose import register_decomposition
from fxq.recurrent.ops import GRU_TO_TORCH, LSTM_TO_TORCH

__all__ = ["onnx_layout", "ONNX_PARAM_NAMES"]

logger = logging.getLogger(__name__)

ONNX_PARAM_NAMES = ("W_l{}", "R_l{}", "B_l{}")
"""Names of the ONNX-layout parameters a decomposition registers on the module, per layer."""


def _inverse(order: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(order.index(k) for k in range(len(order)))


def _onnx_gates(t: torch.Tensor, to_torch: tuple[int, ...], hidden: int) -> torch.Tensor:
    """Rows of a torch-ordered ``[G*H, ...]`` block in ONNX gate order."""
    return torch.cat([t[g * hidden:(g + 1) * hidden] for g in _inverse(to_torch)], dim=0)


def onnx_layout(module: nn.LSTM | nn.GRU, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(w [D, G*H, I], r [D, G*H, H], b [D, 2*G*H])`` of one layer of ``module``, as :mod:`fxq.recurrent.ops` reads.

    Example:
        >>> w, r, b = onnx_layout(nn.LSTM(8, 16, bidirectional=True), 0)
        >>> tuple(w.shape), tuple(b.shape)
        ((2, 64, 8), (2, 128))
    """
    order = LSTM_TO_TORCH if isinstance(module, nn.LSTM) else GRU_TO_TORCH
    hidden = module.hidden_size
    params = module._parameters  # not getattr: while tracing, that returns proxies
    ws, rs, bs = [], [], []
    for suffix in ("", "_reverse")[: 2 if module.bidirectional else 1]:
        w_ih = params[f"weight_ih_l{layer}{suffix}"]
        w_hh = params[f"weight_hh_l{layer}{suffix}"]
        ws.append(_onnx_gates(w_ih, order, hidden))
        rs.append(_onnx_gates(w_hh, order, hidden))
        if module.bias:
            b_ih = _onnx_gates(params[f"bias_ih_l{layer}{suffix}"], order, hidden)
            b_hh = _onnx_gates(params[f"bias_hh_l{layer}{suffix}"], order, hidden)
            bs.append(torch.cat([b_ih, b_hh]))
        else:
            bs.append(w_ih.new_zeros(2 * len(order) * hidden))
    return torch.stack(ws), torch.stack(rs), torch.stack(bs)


def _layer_params(module: nn.LSTM | nn.GRU, layer: int) -> list[Any]:
    """The ONNX-layout parameters of ``layer``, registered on ``module`` (the traced copy) on first use; read
    through the module so the tracer records ``get_attr`` nodes."""
    names = [n.format(layer) for n in ONNX_PARAM_NAMES]
    if not all(n in module._parameters for n in names):
        grad = module._parameters["weight_ih_l0"].requires_grad
        with torch.no_grad():
            for name, value in zip(names, onnx_layout(module, layer)):
                module.register_parameter(name, nn.Parameter(value.detach().clone(), requires_grad=grad))
    return [getattr(module, n) for n in names]


def _direction(module: nn.Module) -> str:
    return "bidirectional" if module.bidirectional else "forward"


def _states(hx: Any, layer: int, dirs: int, layers: int) -> Any:
    if hx is None or layers == 1:
        return hx
    return hx[layer * dirs:(layer + 1) * dirs]


def _run_layers(module: nn.LSTM | nn.GRU, x: Any, h0: Any, c0: Any) -> tuple[Any, list[Any], list[Any]]:
    dirs = 2 if module.bidirectional else 1
    if module.batch_first:
        x = x.transpose(0, 1)
    hs, cs = [], []
    for layer in range(module.num_layers):
        w, r, b = _layer_params(module, layer)
        if isinstance(module, nn.LSTM):
            h, c = _states(h0, layer, dirs, module.num_layers), _states(c0, layer, dirs, module.num_layers)
            y, h, c = torch.ops.fxq.lstm(x, w, r, b, h, c, module.hidden_size, _direction(module))
            cs.append(c)
        else:
            h = _states(h0, layer, dirs, module.num_layers)
            y, h = torch.ops.fxq.gru(x, w, r, b, h, module.hidden_size, _direction(module), 1)
        hs.append(h)
        x = y.permute(0, 2, 1, 3).flatten(2)  # [T, D, N, H] -> [T, N, D*H]
    if module.batch_first:
        x = x.transpose(0, 1)
    return x, hs, cs


def _cat(states: list[Any]) -> Any:
    return states[0] if len(states) == 1 else torch.cat(states, dim=0)


@register_decomposition(nn.LSTM)
def _lstm(module: nn.LSTM, input: Any, hx: Any = None) -> Any:
    if module.proj_size > 0:
        logger.info("nn.LSTM with proj_size=%d stays a leaf (FP32): fxq's recurrent op has no projection",
                    module.proj_size)
        return NotImplemented
    h0, c0 = (None, None) if hx is None else (hx[0], hx[1])  # hx may be a proxy: no unpacking
    out, hs, cs = _run_layers(module, input, h0, c0)
    return out, (_cat(hs), _cat(cs))


@register_decomposition(nn.GRU)
def _gru(module: nn.GRU, input: Any, hx: Any = None) -> Any:
    out, hs, _ = _run_layers(module, input, hx, None)
    return out, _cat(hs)
