"""The one numeric definition of fxq's quantization math, in plain torch, on tensors and plain numbers.

A backward is its elementwise part here and the reduction :func:`param_grads`; :mod:`fxq.numeric.opspec`
joins the two (``linear_fake_quantize_backward_reference``, ``float_fake_quantize_backward_reference``).

Every other implementation (the fused CPU graphs, the Triton kernels, the ``fxq::`` ops, the config-level
API in :mod:`fxq.functional`) runs or reproduces these functions and is tested bit for bit against them.
Nothing here knows about configs, ops or devices, so every layer above can import it.

Rounding is written as ``round_half_even(v)``, except at ties, which go to ``floor(v) + tie_goes_up``.
Ties are found as ``|v - round_half_even(v)| == 0.5``: that difference is exact in binary floating point
(Sterbenz), unlike ``v - floor(v)`` (inexact for small negative ``v``) or ``floor(v + 0.5)``.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from fxq.spec import RoundingPolicy

__all__ = [
    "round_with_policy",
    "broadcast_qparam",
    "linear_codes",
    "fp_grid_step",
    "fp_round_to_grid",
    "linear_fake_quantize_reference",
    "linear_fake_quantize_backward_elementwise",
    "float_fake_quantize_reference",
    "float_fake_quantize_backward_elementwise",
    "sum_to_param",
    "param_grads",
]


def round_with_policy(v: torch.Tensor, policy: RoundingPolicy | int, inplace: bool = False) -> torch.Tensor:
    """Round ``v`` to integers (same dtype) under ``policy``; ties are decided exactly.

    ``inplace``: UP, DOWN and HALF_EVEN round ``v`` itself (the other policies need ``v`` to find ties).
    """
    policy = RoundingPolicy(int(policy))
    if policy is RoundingPolicy.UP:
        return v.ceil_() if inplace else torch.ceil(v)
    if policy is RoundingPolicy.DOWN:
        return v.floor_() if inplace else torch.floor(v)
    if policy is RoundingPolicy.HALF_EVEN:
        return v.round_() if inplace else torch.round(v)  # ties to even
    nearest = torch.round(v)
    # v - nearest is exact; v - floor(v) is not (e.g. v = -0.5 + 2**-25 gives exactly 0.5 in float32)
    tie = (v - nearest).abs() == 0.5
    f = torch.floor(v)  # at a tie: v - 0.5, exactly
    if policy is RoundingPolicy.HALF_UP:
        tie_up = torch.ones_like(v, dtype=torch.bool)
    elif policy is RoundingPolicy.HALF_DOWN:
        tie_up = torch.zeros_like(v, dtype=torch.bool)
    elif policy is RoundingPolicy.HALF_TOWARDS_ZERO:
        tie_up = f < 0
    else:  # HALF_FAR_FROM_ZERO, TO_NEAR_INT: ties away from zero
        tie_up = f >= 0
    return torch.where(tie, f + tie_up.to(v.dtype), nearest)


def broadcast_qparam(p: torch.Tensor, x: torch.Tensor, axis: int) -> torch.Tensor:
    """View a 1-D per-channel (or 1-element) parameter so it broadcasts against ``x`` along ``axis``."""
    if p.numel() == 1:
        return p.reshape(())
    shape = [1] * x.dim()
    shape[axis % x.dim()] = -1
    return p.reshape(shape)


def linear_codes(x: torch.Tensor, s: torch.Tensor, o: torch.Tensor, quant_min: float, quant_max: float,
                 rounding: int, inplace: bool = False) -> torch.Tensor:
    """``clamp(round(x / s) + o, qmin, qmax)``: the integer grid, as floats of ``x``'s dtype.

    ``inplace``: the same operations, written into ``x`` where the rounding policy allows (see
    :func:`round_with_policy`); the result may or may not be ``x``.
    """
    if not inplace:
        return torch.clamp(round_with_policy(x / s, rounding) + o, quant_min, quant_max)
    return round_with_policy(x.div_(s), rounding, inplace=True).add_(o).clamp_(quant_min, quant_max)


def fp_grid_step(v: torch.Tensor, mantissa_bits: int, min_exponent: int) -> torch.Tensor:
    """Spacing of the FP8 grid around ``v`` (float32): 2^(max(exponent(v), emin) - mantissa_bits)."""
    bits = v.abs().view(torch.int32)
    exponent = torch.clamp(((bits >> 23) & 0xFF) - 127, min=min_exponent)
    step_bits = (exponent - mantissa_bits + 127) << 23
    return step_bits.view(torch.float32)


def fp_round_to_grid(v: torch.Tensor, mantissa_bits: int, min_exponent: int, rounding: int) -> torch.Tensor:
    """Round an already clamped ``v`` to the FP8 grid (its mantissa rounded under ``rounding``)."""
    step = fp_grid_step(v, mantissa_bits, min_exponent)
    return round_with_policy(v / step, rounding) * step


def sum_to_param(t: torch.Tensor, param: torch.Tensor, axis: int) -> torch.Tensor:
    """Sum a per-element gradient product over every axis but the channel axis, shaped like ``param``."""
    if param.numel() == 1:
        return t.sum().reshape(param.shape).to(param.dtype)
    ax = axis % t.dim()
    dims = [d for d in range(t.dim()) if d != ax]
    return t.sum(dim=dims).reshape(param.shape).to(param.dtype)


def param_grads(products: Sequence[torch.Tensor | None], params: Sequence[torch.Tensor],
                axis: int) -> tuple[torch.Tensor, ...]:
    """The parameters' gradients from the elementwise products (zeros where a product was not computed).

    The one reduction of every backward (reference, fused CPU, Triton), so their sums agree bit for bit.
    """
    return tuple(torch.zeros_like(p) if prod is None else sum_to_param(prod, p, axis)
                 for prod, p in zip(products, params))


# --------------------------------------------------------------------------- linear
def linear_fake_quantize_reference(
    x: Tensor, scale: Tensor, offset: Tensor, axis: int, quant_min: int, quant_max: int, rounding: int,
    inplace: bool = False,
) -> Tensor:
    """``(clamp(round(x / s) + o, qmin, qmax) - o) * s`` — the linear fake-quant, forward.

    ``inplace``: the same operations written into ``x`` (returned), for eager inference on values nobody
    else reads — no fresh buffer per operation, which is most of the eager cost on large CPU tensors.
    """
    s = broadcast_qparam(scale.to(x.dtype), x, axis)
    o = broadcast_qparam(offset.to(x.dtype), x, axis)
    if not inplace:
        return (linear_codes(x, s, o, quant_min, quant_max, rounding) - o) * s
    y = linear_codes(x, s, o, quant_min, quant_max, rounding, inplace=True).sub_(o).mul_(s)
    return y if y is x else x.copy_(y)


def linear_fake_quantize_backward_elementwise(
    grad: Tensor, x: Tensor, scale: Tensor, offset: Tensor, axis: int, quant_min: int, quant_max: int, rounding: int,
    need_scale_grad: bool, need_offset_grad: bool,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Elementwise part of the linear fake-quant's backward: straight-through gradient for x (zero outside
    the clip range), LSQ(+) terms for s and o.

    Inside the range: dx = g, ds = g * (round(x/s) - x/s), do = 0.
    Below (above): dx = 0, ds = g * (qmin - o) (resp. qmax - o), do = -g * s.
    Returns ``grad_x`` and the per-element products ``g * ds`` and ``g * do`` (None when not needed) whose
    sums (:func:`param_grads`) are the scale and offset gradients. The fused CPU path and the Triton
    kernels compute exactly these and leave the reduction to :func:`param_grads`.
    """
    s = broadcast_qparam(scale.to(x.dtype), x, axis)
    o = broadcast_qparam(offset.to(x.dtype), x, axis)
    v = x / s
    r = round_with_policy(v, rounding)
    q = r + o
    below = q < quant_min
    above = q > quant_max
    inside = ~(below | above)
    zero = torch.zeros_like(grad)
    grad_x = torch.where(inside, grad, zero)
    prod_scale = prod_offset = None
    if need_scale_grad:
        ds = torch.where(inside, r - v, torch.where(below, quant_min - o, quant_max - o))
        prod_scale = grad * ds
    if need_offset_grad:
        do = torch.where(inside, zero, -s.expand_as(grad))
        prod_offset = grad * do
    return grad_x, prod_scale, prod_offset


# --------------------------------------------------------------------------- floating (FP8)
def float_fake_quantize_reference(
    x: Tensor, scale: Tensor, axis: int, mantissa_bits: int, min_exponent: int, max_value: float, rounding: int
) -> Tensor:
    """FP8 fake-quant: clamp ``x / s`` to +/-max, round its mantissa under ``rounding``, scale back."""
    xf = x.float()
    s = broadcast_qparam(scale.float(), xf, axis)
    v = torch.clamp(xf / s, -max_value, max_value)
    return (fp_round_to_grid(v, mantissa_bits, min_exponent, rounding) * s).to(x.dtype)


def float_fake_quantize_backward_elementwise(
    grad: Tensor, x: Tensor, scale: Tensor, axis: int, mantissa_bits: int, min_exponent: int, max_value: float,
    rounding: int, need_scale_grad: bool,
) -> tuple[Tensor, Tensor | None]:
    """Elementwise part of the FP8 fake-quant's backward: ``grad_x`` (zero where ``x / s`` is clipped) and the
    LSQ term ``g * ds`` of the scale (or None)."""
    xf = x.float()
    s = broadcast_qparam(scale.float(), xf, axis)
    v = xf / s
    inside = (v >= -max_value) & (v <= max_value)
    grad_x = torch.where(inside, grad, torch.zeros_like(grad))
    prod_scale = None
    if need_scale_grad:
        vc = torch.clamp(v, -max_value, max_value)
        ds = torch.where(inside, fp_round_to_grid(vc, mantissa_bits, min_exponent, rounding) - v, vc)
        prod_scale = grad * ds
    return grad_x, prod_scale
