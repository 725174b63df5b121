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
import operator
from typing import Any

import torch
from torch import nn

from fxq.graph.decompose import register_decomposition
from fxq.graph.nodes import get_attr_value
from fxq.recurrent.ops import GRU_TO_TORCH, LSTM_TO_TORCH, _gates

__all__ = ["onnx_layout", "lift_aten_recurrent", "ONNX_PARAM_NAMES"]

logger = logging.getLogger(__name__)

ONNX_PARAM_NAMES = ("W_l{}", "R_l{}", "B_l{}")
"""Names of the ONNX-layout parameters a decomposition registers on the module, per layer."""


def _inverse(order: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(order.index(k) for k in range(len(order)))


def onnx_layout(module: nn.LSTM | nn.GRU, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(w [D, G*H, I], r [D, G*H, H], b [D, 2*G*H])`` of one layer of ``module``, as :mod:`fxq.recurrent.ops` reads.

    Example:
        >>> w, r, b = onnx_layout(nn.LSTM(8, 16, bidirectional=True), 0)
        >>> tuple(w.shape), tuple(b.shape)
        ((2, 64, 8), (2, 128))
    """
    order = _inverse(LSTM_TO_TORCH if isinstance(module, nn.LSTM) else GRU_TO_TORCH)  # torch rows -> ONNX gates
    hidden = module.hidden_size
    params = module._parameters  # not getattr: while tracing, that returns proxies
    ws, rs, bs = [], [], []
    for suffix in ("", "_reverse")[: 2 if module.bidirectional else 1]:
        w_ih = params[f"weight_ih_l{layer}{suffix}"]
        w_hh = params[f"weight_hh_l{layer}{suffix}"]
        ws.append(_gates(w_ih, order, hidden))
        rs.append(_gates(w_hh, order, hidden))
        if module.bias:
            b_ih = _gates(params[f"bias_ih_l{layer}{suffix}"], order, hidden)
            b_hh = _gates(params[f"bias_hh_l{layer}{suffix}"], order, hidden)
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


def lift_aten_recurrent(gm: Any, node: Any) -> bool:
    """Rewrite an ``aten.lstm.input`` / ``aten.gru.input`` node of a torch.export graph (``gm``, in place) as the graph
    the decompositions above trace ``nn.LSTM`` / ``nn.GRU`` to: one ``fxq::lstm`` / ``fxq::gru`` per layer over
    ``W_l<k>`` / ``R_l<k>`` / ``B_l<k>`` registered on the module that held the weights, so both capture paths give
    the same quantizer and node names.

    Returns False (graph untouched) for forms the recurrent op does not cover (LSTM projections, an unknown arity).
    """

    lstm = node.target is torch.ops.aten.lstm.input
    if len(node.args) != 9 or any(u.target is not operator.getitem for u in node.users):
        return False
    x, hx, params, has_biases, num_layers, _dropout, _train, bidirectional, batch_first = node.args
    if not params or not all(getattr(p, "op", None) == "get_attr" for p in params):
        return False
    values = [get_attr_value(gm, str(p.target)) for p in params]
    dirs = 2 if bidirectional else 1
    if len(values) != (4 if has_biases else 2) * num_layers * dirs:
        return False  # proj_size adds a weight per direction
    cls = nn.LSTM if lstm else nn.GRU
    module = cls(int(values[0].shape[1]), int(values[1].shape[1]), num_layers, bias=bool(has_biases),
                 bidirectional=bool(bidirectional))  # only for onnx_layout's reading of the weights
    if any(p.shape != v.shape for p, v in zip(module.parameters(), values)):
        return False
    with torch.no_grad():
        for p, v in zip(module.parameters(), values):
            p.copy_(v)
        layouts = [onnx_layout(module, layer) for layer in range(num_layers)]
    path = str(params[0].target).rpartition(".")[0]
    owner = gm.get_submodule(path)
    h0, c0 = (hx[0], hx[1]) if lstm else (hx, None)
    graph = gm.graph
    get = operator.getitem
    hs, cs = [], []
    with graph.inserting_before(node):
        seq = graph.call_function(torch.transpose, (x, 0, 1)) if batch_first else x
        for layer in range(num_layers):
            names = [n.format(layer) for n in ONNX_PARAM_NAMES]
            for name, value in zip(names, layouts[layer]):
                owner.register_parameter(name, nn.Parameter(value, requires_grad=values[0].requires_grad))
            w, r, b = (graph.get_attr(f"{path}.{n}" if path else n) for n in names)
            span = slice(layer * dirs, (layer + 1) * dirs)
            h = h0 if num_layers == 1 else graph.call_function(get, (h0, span))
            if lstm:
                c = c0 if num_layers == 1 else graph.call_function(get, (c0, span))
                call = graph.call_function(torch.ops.fxq.lstm.default,
                                           (seq, w, r, b, h, c, module.hidden_size, _direction(module)))
                cs.append(graph.call_function(get, (call, 2)))
            else:
                call = graph.call_function(torch.ops.fxq.gru.default,
                                           (seq, w, r, b, h, module.hidden_size, _direction(module), 1))
            call.meta["module_path"] = path
            hs.append(graph.call_function(get, (call, 1)))
            y = graph.call_function(get, (call, 0))
            seq = graph.call_function(torch.flatten, (graph.call_function(torch.permute, (y, (0, 2, 1, 3))), 2))
        out = graph.call_function(torch.transpose, (seq, 0, 1)) if batch_first else seq
        results = [out] + [s if len(s) == 1 else graph.call_function(torch.cat, (s, 0)) for s in (hs, cs) if s]
    for user in list(node.users):
        user.replace_all_uses_with(results[user.args[1]])
        graph.erase_node(user)
    graph.erase_node(node)
    return True
