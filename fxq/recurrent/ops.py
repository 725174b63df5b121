"""``fxq::lstm`` / ``fxq::gru``: one graph node per recurrent layer, with ONNX semantics and ONNX weight layout.

A recurrent layer is kept as one op whose weights are inputs (``get_attr`` edges), so weight quantizers are
inserted like a conv's and every exporter writes one ONNX ``LSTM`` / ``GRU`` node. Decomposing into per-timestep
ops would unroll the sequence into the graph and the exported file.

Layout, exactly ONNX's, so that the exported weight is the graph's weight (DQ feeds the node directly) and
per-channel quantization along axis 1 is per gate and channel (shared by the two directions of a bidirectional
layer: ONNX per-axis Q/DQ has one axis):

* ``x``: ``[T, N, I]`` (ONNX ``layout=0``); ``w``: ``[D, G*H, I]``, ``r``: ``[D, G*H, H]`` (G = 4 for LSTM, gates
  i, o, f, c; G = 3 for GRU, gates z, r, h); ``b``: ``[D, 2*G*H]``; ``initial_h`` / ``initial_c``: ``[D, N, H]``
  or None (zeros).
* outputs: ``Y [T, D, N, H]``, ``Y_h [D, N, H]`` (and ``Y_c`` for LSTM), as ONNX defines them.

The computation runs through torch's own fused ``torch.lstm`` / ``torch.gru`` (gates reordered to torch's order),
except GRU with ``linear_before_reset=0``, which torch has no kernel for (a short loop over time).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor

__all__ = ["lstm", "gru", "DIRECTIONS", "LSTM_TO_TORCH", "GRU_TO_TORCH", "RECURRENT_TARGETS"]

DIRECTIONS = ("forward", "reverse", "bidirectional")
LSTM_TO_TORCH = (0, 2, 3, 1)
"""ONNX gate index of each torch LSTM gate: torch (i, f, g, o) from ONNX (i, o, f, c)."""
GRU_TO_TORCH = (1, 0, 2)
"""ONNX gate index of each torch GRU gate: torch (r, z, n) from ONNX (z, r, h)."""


def _gates(t: Tensor, order: tuple[int, ...], hidden: int) -> Tensor:
    """Rows of one direction's ``[G*H, ...]`` block reordered gate by gate."""
    return torch.cat([t[g * hidden:(g + 1) * hidden] for g in order], dim=0)


def _torch_params(w: Tensor, r: Tensor, b: Tensor, hidden: int, dirs: int, order: tuple[int, ...]) -> list[Tensor]:
    """torch's flat weight list ``[w_ih, w_hh, b_ih, b_hh] * dirs`` from the ONNX layout."""
    rows = len(order) * hidden
    params: list[Tensor] = []
    for d in range(dirs):
        params += [_gates(w[d], order, hidden), _gates(r[d], order, hidden),
                   _gates(b[d, :rows], order, hidden), _gates(b[d, rows:], order, hidden)]
    return params


def _state(s: Optional[Tensor], x: Tensor, dirs: int, hidden: int) -> Tensor:
    return s.contiguous() if s is not None else x.new_zeros(dirs, x.shape[1], hidden)


def _run(kernel: Callable[[Tensor], tuple[Tensor, ...]], x: Tensor, direction: str) -> tuple[Tensor, ...]:
    """Run ``kernel`` (torch layout out ``[T, N, D*H]``, states ``[D, N, H]``) for ``direction``; ONNX outputs."""
    if direction == "reverse":
        outs = kernel(x.flip(0))
        y = outs[0].flip(0)
    else:
        outs = kernel(x)
        y = outs[0]
    dirs = 2 if direction == "bidirectional" else 1
    y = y.reshape(y.shape[0], y.shape[1], dirs, -1).permute(0, 2, 1, 3).contiguous()
    return (y, *[s.contiguous() for s in outs[1:]])


def _lstm(x: Tensor, w: Tensor, r: Tensor, b: Tensor, initial_h: Optional[Tensor], initial_c: Optional[Tensor],
         hidden_size: int, direction: str) -> tuple[Tensor, Tensor, Tensor]:
    """ONNX ``LSTM`` (default activations, no peepholes, full-length sequences); see the module docstring."""
    dirs = 2 if direction == "bidirectional" else 1
    params = _torch_params(w, r, b, hidden_size, dirs, LSTM_TO_TORCH)
    hx = [_state(initial_h, x, dirs, hidden_size), _state(initial_c, x, dirs, hidden_size)]

    def kernel(seq: Tensor) -> tuple[Tensor, ...]:
        return torch.lstm(seq, hx, params, True, 1, 0.0, False, dirs == 2, False)

    return _run(kernel, x, direction)  # type: ignore[return-value]


def _gru(x: Tensor, w: Tensor, r: Tensor, b: Tensor, initial_h: Optional[Tensor], hidden_size: int, direction: str,
        linear_before_reset: int) -> tuple[Tensor, Tensor]:
    """ONNX ``GRU`` (default activations, full-length sequences); see the module docstring."""
    dirs = 2 if direction == "bidirectional" else 1
    h0 = _state(initial_h, x, dirs, hidden_size)
    if not linear_before_reset:
        return _gru_reset_first(x, w, r, b, h0, hidden_size, direction)
    params = _torch_params(w, r, b, hidden_size, dirs, GRU_TO_TORCH)

    def kernel(seq: Tensor) -> tuple[Tensor, ...]:
        return torch.gru(seq, h0, params, True, 1, 0.0, False, dirs == 2, False)

    return _run(kernel, x, direction)  # type: ignore[return-value]


def _gru_reset_first(x: Tensor, w: Tensor, r: Tensor, b: Tensor, h0: Tensor, hidden: int,
                     direction: str) -> tuple[Tensor, Tensor]:
    """ONNX GRU with ``linear_before_reset=0``: ``h~ = tanh(W_h x + R_h (r * h) + Wb_h + Rb_h)``, step by step."""
    dirs = 2 if direction == "bidirectional" else 1
    rows = 3 * hidden
    ys, hs = [], []
    for d in range(dirs):
        wd, rd = w[d], r[d]
        wb, rb = b[d, :rows], b[d, rows:]
        rz, rr, rh = rd[:hidden], rd[hidden:2 * hidden], rd[2 * hidden:]
        xw = torch.nn.functional.linear(x, wd, wb)  # [T, N, 3H]
        steps = range(x.shape[0] - 1, -1, -1) if (direction == "reverse" or d == 1) else range(x.shape[0])
        h = h0[d]
        out: list[Tensor] = [h] * x.shape[0]
        for t in steps:
            xz, xr, xh = xw[t].split(hidden, dim=-1)
            z = torch.sigmoid(xz + h @ rz.t() + rb[:hidden])
            rg = torch.sigmoid(xr + h @ rr.t() + rb[hidden:2 * hidden])
            n = torch.tanh(xh + (rg * h) @ rh.t() + rb[2 * hidden:])
            h = (1 - z) * n + z * h
            out[t] = h
        ys.append(torch.stack(out))
        hs.append(h)
    return torch.stack(ys, dim=1), torch.stack(hs)


lstm = torch.library.custom_op("fxq::lstm", _lstm, mutates_args=())
gru = torch.library.custom_op("fxq::gru", _gru, mutates_args=())


@lstm.register_fake
def _(x, w, r, b, initial_h, initial_c, hidden_size, direction):
    dirs = 2 if direction == "bidirectional" else 1
    state = x.new_empty(dirs, x.shape[1], hidden_size)
    return x.new_empty(x.shape[0], dirs, x.shape[1], hidden_size), state, torch.empty_like(state)


@gru.register_fake
def _(x, w, r, b, initial_h, hidden_size, direction, linear_before_reset):
    dirs = 2 if direction == "bidirectional" else 1
    return x.new_empty(x.shape[0], dirs, x.shape[1], hidden_size), x.new_empty(dirs, x.shape[1], hidden_size)


# ---------------------------------------------------------------------------------------------------- autograd
def _autograd(op: Any, impl: Callable[..., tuple[Tensor, ...]], count: int) -> None:
    """Backward by recomputing the forward (``impl``, whose first ``count`` arguments are tensors) under autograd:
    QAT trains through the recurrent layer."""

    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.inputs = inputs

    def backward(ctx: Any, *grads: Tensor) -> tuple:
        tensors = [t.detach().requires_grad_(t.dtype.is_floating_point) if isinstance(t, Tensor) else t
                   for t in ctx.inputs[:count]]
        with torch.enable_grad():
            outs = impl(*tensors, *ctx.inputs[count:])
        wanted = [t for t in tensors if isinstance(t, Tensor) and t.requires_grad]
        got = torch.autograd.grad([o for o in outs], wanted, [g if g is not None else torch.zeros_like(o)
                                                                for g, o in zip(grads, outs)], allow_unused=True)
        it = iter(got)
        return (*[next(it) if isinstance(t, Tensor) and t.requires_grad else None for t in tensors],
                *[None] * (len(ctx.inputs) - count))

    op.register_autograd(backward, setup_context=setup_context)


_autograd(lstm, _lstm, 6)
_autograd(gru, _gru, 5)

RECURRENT_TARGETS: dict[Any, str] = {
    torch.ops.fxq.lstm: "LSTM", torch.ops.fxq.lstm.default: "LSTM",
    torch.ops.fxq.gru: "GRU", torch.ops.fxq.gru.default: "GRU",
}
"""Graph targets of the recurrent ops and their canonical op types."""
