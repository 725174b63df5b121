"""The one numeric definition of fxq's quantization math, in plain torch.

Everything that quantizes (FakeQuantize, observers, exporters, the Triton kernels' tests) goes through
these functions. The Triton kernels in :mod:`fxq.triton_kernels` implement exactly the same formulas
and are tested bit for bit against this file.

Rounding is written as ``round_half_even(v)``, except at ties, which go to ``floor(v) + tie_goes_up``.
Ties are found as ``|v - round_half_even(v)| == 0.5``: that difference is exact in binary floating point
(Sterbenz), unlike ``v - floor(v)`` (inexact for small negative ``v``) or ``floor(v + 0.5)``.
"""
from __future__ import annotations

import torch

from fxq.spec import MIN_SCALE, RoundingPolicy, TensorQuantConfig, integer_range_for_compute

__all__ = [
    "round_with_policy",
    "quantize_to_int",
    "dequantize",
    "dequantize_linear",
    "fake_quantize",
    "linear_fake_quantize_reference",
    "float_fake_quantize_reference",
    "qparams_from_minmax",
    "round_scale_to_power_of_2",
    "broadcast_qparam",
    "representable_range",
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


def _linear_codes(x: torch.Tensor, s: torch.Tensor, o: torch.Tensor, quant_min: float, quant_max: float,
                  rounding: int, inplace: bool = False) -> torch.Tensor:
    """``clamp(round(x / s) + o, qmin, qmax)``: the integer grid, as floats of ``x``'s dtype.

    ``inplace``: the same operations, written into ``x`` where the rounding policy allows (see
    :func:`round_with_policy`); the result may or may not be ``x``.
    """
    if not inplace:
        return torch.clamp(round_with_policy(x / s, rounding) + o, quant_min, quant_max)
    return round_with_policy(x.div_(s), rounding, inplace=True).add_(o).clamp_(quant_min, quant_max)


def _fp_round_to_grid(v: torch.Tensor, mantissa_bits: int, min_exponent: int, rounding: int) -> torch.Tensor:
    """Round an already clamped ``v`` to the FP8 grid (its mantissa rounded under ``rounding``)."""
    step = _fp_grid_step(v, mantissa_bits, min_exponent)
    return round_with_policy(v / step, rounding) * step


def linear_fake_quantize_reference(
    x: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor,
    axis: int,
    quant_min: int,
    quant_max: int,
    rounding: int,
    inplace: bool = False,
) -> torch.Tensor:
    """``(clamp(round(x / s) + o, qmin, qmax) - o) * s`` — the linear fake-quant, forward.

    ``inplace``: the same operations written into ``x`` (returned), for eager inference on values nobody
    else reads — no fresh buffer per operation, which is most of the eager cost on large CPU tensors.
    """
    s = broadcast_qparam(scale.to(x.dtype), x, axis)
    o = broadcast_qparam(offset.to(x.dtype), x, axis)
    if not inplace:
        return (_linear_codes(x, s, o, quant_min, quant_max, rounding) - o) * s
    y = _linear_codes(x, s, o, quant_min, quant_max, rounding, inplace=True).sub_(o).mul_(s)
    return y if y is x else x.copy_(y)


def linear_fake_quantize_backward_elementwise(
    grad: torch.Tensor,
    x: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor,
    axis: int,
    quant_min: int,
    quant_max: int,
    rounding: int,
    need_scale_grad: bool,
    need_offset_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Elementwise part of :func:`linear_fake_quantize_backward_reference`.

    Returns ``grad_x`` and the per-element products ``g * ds`` and ``g * do`` (None when not needed) whose
    sums (:func:`_sum_to_param`) are the scale and offset gradients. The fused CPU path and the Triton
    kernels compute exactly these and leave the reduction to :func:`_sum_to_param`.
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


def linear_fake_quantize_backward_reference(
    grad: torch.Tensor,
    x: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor,
    axis: int,
    quant_min: int,
    quant_max: int,
    rounding: int,
    need_scale_grad: bool,
    need_offset_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Straight-through gradient for x (zero outside the clip range) and LSQ(+) gradients for s and o.

    Inside the range: dx = g, ds = g * (round(x/s) - x/s), do = 0.
    Below (above): dx = 0, ds = g * (qmin - o) (resp. qmax - o), do = -g * s.
    Parameter gradients are summed over every axis but the channel axis.
    """
    grad_x, prod_scale, prod_offset = linear_fake_quantize_backward_elementwise(
        grad, x, scale, offset, axis, quant_min, quant_max, rounding, need_scale_grad, need_offset_grad
    )
    grad_scale = torch.zeros_like(scale) if prod_scale is None else _sum_to_param(prod_scale, scale, axis)
    grad_offset = torch.zeros_like(offset) if prod_offset is None else _sum_to_param(prod_offset, offset, axis)
    return grad_x, grad_scale, grad_offset


def _sum_to_param(t: torch.Tensor, param: torch.Tensor, axis: int) -> torch.Tensor:
    if param.numel() == 1:
        return t.sum().reshape(param.shape).to(param.dtype)
    ax = axis % t.dim()
    dims = [d for d in range(t.dim()) if d != ax]
    return t.sum(dim=dims).reshape(param.shape).to(param.dtype)


def _fp_grid_step(v: torch.Tensor, mantissa_bits: int, min_exponent: int) -> torch.Tensor:
    """Spacing of the FP8 grid around ``v`` (float32): 2^(max(exponent(v), emin) - mantissa_bits)."""
    bits = v.abs().view(torch.int32)
    exponent = torch.clamp(((bits >> 23) & 0xFF) - 127, min=min_exponent)
    step_bits = (exponent - mantissa_bits + 127) << 23
    return step_bits.view(torch.float32)


def float_fake_quantize_reference(
    x: torch.Tensor,
    scale: torch.Tensor,
    axis: int,
    mantissa_bits: int,
    min_exponent: int,
    max_value: float,
    rounding: int,
) -> torch.Tensor:
    """FP8 fake-quant: clamp ``x / s`` to +/-max, round its mantissa under ``rounding``, scale back."""
    xf = x.float()
    s = broadcast_qparam(scale.float(), xf, axis)
    v = torch.clamp(xf / s, -max_value, max_value)
    return (_fp_round_to_grid(v, mantissa_bits, min_exponent, rounding) * s).to(x.dtype)


def float_fake_quantize_backward_elementwise(
    grad: torch.Tensor,
    x: torch.Tensor,
    scale: torch.Tensor,
    axis: int,
    mantissa_bits: int,
    min_exponent: int,
    max_value: float,
    rounding: int,
    need_scale_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Elementwise part of :func:`float_fake_quantize_backward_reference`: ``grad_x`` and ``g * ds`` (or None)."""
    xf = x.float()
    s = broadcast_qparam(scale.float(), xf, axis)
    v = xf / s
    inside = (v >= -max_value) & (v <= max_value)
    grad_x = torch.where(inside, grad, torch.zeros_like(grad))
    prod_scale = None
    if need_scale_grad:
        vc = torch.clamp(v, -max_value, max_value)
        ds = torch.where(inside, _fp_round_to_grid(vc, mantissa_bits, min_exponent, rounding) - v, vc)
        prod_scale = grad * ds
    return grad_x, prod_scale


def float_fake_quantize_backward_reference(
    grad: torch.Tensor,
    x: torch.Tensor,
    scale: torch.Tensor,
    axis: int,
    mantissa_bits: int,
    min_exponent: int,
    max_value: float,
    rounding: int,
    need_scale_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    grad_x, prod_scale = float_fake_quantize_backward_elementwise(
        grad, x, scale, axis, mantissa_bits, min_exponent, max_value, rounding, need_scale_grad
    )
    grad_scale = torch.zeros_like(scale) if prod_scale is None else _sum_to_param(prod_scale, scale, axis)
    return grad_x, grad_scale


# --------------------------------------------------------------------------- config-level API
def _compute_dtype(x: torch.Tensor, cfg: TensorQuantConfig) -> torch.dtype:
    if integer_range_for_compute(cfg):
        return torch.float64
    return x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32


def _require_qparams(cfg: TensorQuantConfig, x: torch.Tensor) -> None:
    from fxq.errors import ConfigError

    if cfg.scale is None:
        raise ConfigError(f"{cfg!r} has no scale yet: calibrate it (fxq.calibrate) or set_qparams() first")
    cfg.check_channels(x.shape)


def quantize_to_int(x: torch.Tensor, cfg: TensorQuantConfig) -> torch.Tensor:
    """Integer codes of ``x`` (int32; int64 beyond 31 bits). For FP8, the FP8 values as float32."""
    _require_qparams(cfg, x)
    dtype = _compute_dtype(x, cfg)
    xc = x.detach().to(dtype)
    if cfg.is_floating:
        fmt = cfg.fp_format
        s = broadcast_qparam(cfg.scale.to(x.device), xc, cfg.channel_axis)
        v = torch.clamp(xc.float() / s, cfg.quant_min, cfg.quant_max)
        return _fp_round_to_grid(v, fmt.mantissa_bits, fmt.min_exponent, cfg.rounding)
    s = broadcast_qparam(cfg.scale.to(x.device, dtype), xc, cfg.channel_axis)
    o = broadcast_qparam(cfg.offset.to(x.device, dtype), xc, cfg.channel_axis)
    q = _linear_codes(xc, s, o, cfg.quant_min, cfg.quant_max, cfg.rounding)
    return q.to(torch.int64 if cfg.num_bits > 31 else torch.int32)


def representable_range(cfg: TensorQuantConfig, scale: torch.Tensor | None = None,
                        offset: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Lowest and highest real value ``cfg`` represents, per channel: ``(qmin - o) * s``, ``(qmax - o) * s``.

    1-D float64 tensors on the CPU; ``scale``/``offset`` override the config's (e.g. a module's buffers).
    """
    scale = cfg.scale if scale is None else scale
    offset = cfg.offset if offset is None else offset
    s = scale.detach().double().cpu().reshape(-1)
    o = torch.zeros_like(s) if cfg.is_floating or offset is None else offset.detach().double().cpu().reshape(-1)
    return (cfg.quant_min - o) * s, (cfg.quant_max - o) * s


def dequantize(q: torch.Tensor, cfg: TensorQuantConfig, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Real values of integer (or FP8-grid) codes ``q``: ``(q - offset) * scale``."""
    _require_qparams(cfg, q)
    wide = torch.float64 if integer_range_for_compute(cfg) else torch.float32
    if cfg.is_floating:
        qf = q.to(wide)
        return (qf * broadcast_qparam(cfg.scale.to(q.device, wide), qf, cfg.channel_axis)).to(dtype)
    return dequantize_linear(q, cfg.scale, cfg.offset, cfg.channel_axis, dtype, wide)


def dequantize_linear(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, axis: int,
                      dtype: torch.dtype = torch.float32, compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``(q - offset) * scale`` in ``compute_dtype`` (the arithmetic of the fake-quant's last step), as ``dtype``."""
    qf = q.to(compute_dtype)
    s = broadcast_qparam(scale.to(q.device, compute_dtype), qf, axis)
    o = broadcast_qparam(offset.to(q.device, compute_dtype), qf, axis)
    return ((qf - o) * s).to(dtype)


def fake_quantize(
    x: torch.Tensor,
    cfg: TensorQuantConfig,
    scale: torch.Tensor | None = None,
    offset: torch.Tensor | None = None,
    *,
    overwrite: bool = False,
) -> torch.Tensor:
    """Quantize and dequantize ``x`` with ``cfg``; differentiable (STE for x, LSQ for scale/offset).

    ``scale``/``offset`` override the config's tensors (e.g. learnable parameters of a module).
    Runs the ``fxq::`` custom ops: the torch path on CPU, Triton kernels on CUDA.
    ``overwrite=True`` lets the result reuse ``x``'s memory (the fused CPU path then writes in place and
    returns ``x``): only for values nothing else reads, without gradients; same values either way.
    """
    from fxq import fused_cpu, ops

    scale = cfg.scale if scale is None else scale
    offset = cfg.offset if offset is None else offset
    if scale is None:
        _require_qparams(cfg, x)
    if cfg.per_channel:
        cfg.check_channels(x.shape)
    dtype = _compute_dtype(x, cfg)
    xc = x if x.dtype == dtype else x.to(dtype)
    scale = scale.to(xc.device)
    axis = cfg.channel_axis if cfg.per_channel else 0
    in_place = overwrite and xc is x and x.device.type == "cpu" and not (
        torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, scale, offset))
    )
    if cfg.is_floating:
        fmt = cfg.fp_format
        if in_place and fused_cpu.fake_quant_float_inplace(
            x, scale, axis, fmt.mantissa_bits, fmt.min_exponent, float(cfg.quant_max), int(cfg.rounding)
        ):
            return x
        y = ops.fake_quant_float(
            xc, scale, axis, fmt.mantissa_bits, fmt.min_exponent, float(cfg.quant_max), int(cfg.rounding)
        )
    else:
        offset = torch.zeros_like(scale) if offset is None else offset.to(xc.device)
        if in_place and fused_cpu.fake_quant_linear_inplace(
            x, scale, offset, axis, int(cfg.quant_min), int(cfg.quant_max), int(cfg.rounding)
        ):
            return x
        y = ops.fake_quant_linear(
            xc, scale, offset, axis, int(cfg.quant_min), int(cfg.quant_max), int(cfg.rounding)
        )
    return y if y.dtype == x.dtype else y.to(x.dtype)


# --------------------------------------------------------------------------- parameters
def round_scale_to_power_of_2(scale: torch.Tensor, policy: RoundingPolicy = RoundingPolicy.UP) -> torch.Tensor:
    """``2 ** round(log2(scale))`` under ``policy`` (UP by default, so nothing new gets clipped)."""
    exp = round_with_policy(torch.log2(scale.double()), policy)
    return torch.pow(2.0, exp).to(scale.dtype)


def qparams_from_minmax(
    min_val: torch.Tensor, max_val: torch.Tensor, cfg: TensorQuantConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and offset that map ``[min_val, max_val]`` onto ``cfg``'s grid (PPQ's minmax formulas).

    Symmetric signed: ``s = 2 * absmax / (qmax - qmin)``; symmetric unsigned: ``s = max / qmax``;
    floating: ``s = absmax / fp_max``; asymmetric: ``s = (max - min) / (qmax - qmin)`` over a range that
    contains 0, ``offset = qmin + round(-min / s)``. Scales never fall below ``MIN_SCALE``.
    """
    lo = torch.minimum(min_val.detach().double().reshape(-1), torch.zeros(()))
    hi = torch.maximum(max_val.detach().double().reshape(-1), torch.zeros(()))
    qmin, qmax = float(cfg.quant_min), float(cfg.quant_max)
    if cfg.is_floating:
        scale = torch.maximum(-lo, hi) / qmax
    elif cfg.symmetric:
        absmax = torch.maximum(-lo, hi)
        scale = hi / qmax if qmin >= 0 else 2 * absmax / (qmax - qmin)
    else:
        scale = (hi - lo) / (qmax - qmin)
    scale = torch.clamp(scale, min=MIN_SCALE)
    if cfg.power_of_2:
        scale = round_scale_to_power_of_2(scale)
    if cfg.symmetric or cfg.is_floating:
        offset = torch.zeros_like(scale)
    else:
        offset = torch.clamp(qmin + round_with_policy(-lo / scale, cfg.rounding), qmin, qmax)
    return scale.float(), offset.float()
