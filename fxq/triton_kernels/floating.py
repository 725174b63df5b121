"""Triton kernels of the FP8 fake-quant (``fxq::fake_quant_float`` and its backward).

Same steps as :func:`fxq.numeric.reference.float_fake_quantize_reference` and
:func:`fxq.numeric.reference.float_fake_quantize_backward_elementwise`: float32 math, the grid step taken from
the exponent bits of the clamped value (an int32 bitcast, like the reference's ``view(torch.int32)``),
the input dtype restored at the end. The scale gradient is reduced by the reference's
:meth:`fxq.numeric.opspec.OpSpec.reduce`, so results are bit-identical.
"""
from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from fxq.errors import NotSupportedError
from fxq.numeric.opspec import FLOAT
from fxq.triton_kernels.common import (
    BLOCK,
    KERNEL_DTYPES,
    NUM_WARPS,
    ChannelLayout,
    ForwardLaunch,
    channel_layout,
    div_exact,
    grad_fits,
    grid,
    load_param,
    op_backward,
    op_binder,
    op_forward,
    per_channel_param,
    round_to,
    round_with_policy,
)

__all__ = [
    "float_forward",
    "float_backward_elementwise",
    "bind_fake_quant_float",
    "fake_quant_float_triton",
    "fake_quant_float_backward_triton",
]


@triton.jit
def _fp_grid_step(v, mantissa_bits, min_exponent):
    """2^(max(exponent(v), min_exponent) - mantissa_bits) for float32 ``v`` (reference: ``fp_grid_step``)."""
    bits = tl.abs(v).to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, min_exponent)
    return ((exponent - mantissa_bits + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _fp_round(vc, mantissa_bits, min_exponent, ROUNDING: tl.constexpr):
    step = _fp_grid_step(vc, mantissa_bits, min_exponent)
    return round_with_policy(tl.math.div_rn(vc, step), ROUNDING, False) * step


@triton.jit(do_not_specialize=["C", "INNER", "mantissa_bits", "min_exponent"])
def _float_fwd_kernel(
    x_ptr,
    s_ptr,
    y_ptr,
    n,
    C,
    INNER,
    mantissa_bits,
    min_exponent,
    max_value,
    ROUNDING: tl.constexpr,
    PER_CHANNEL: tl.constexpr,
    NARROW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    DT: tl.constexpr = y_ptr.dtype.element_ty
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = load_param(s_ptr, mask, C, INNER, PER_CHANNEL, BLOCK)
    v = div_exact(x, s, False)
    v = tl.where(v < -max_value, -max_value, v)  # torch.clamp, NaN stays NaN
    v = tl.where(v > max_value, max_value, v)
    q = _fp_round(v, mantissa_bits, min_exponent, ROUNDING)
    tl.store(y_ptr + offs, round_to(q * s, DT, NARROW).to(DT), mask=mask)


@triton.jit(do_not_specialize=["C", "INNER", "mantissa_bits", "min_exponent"])
def _float_bwd_kernel(
    g_ptr,
    x_ptr,
    s_ptr,
    gx_ptr,
    ps_ptr,
    n,
    C,
    INNER,
    mantissa_bits,
    min_exponent,
    max_value,
    ROUNDING: tl.constexpr,
    PER_CHANNEL: tl.constexpr,
    NEED_S: tl.constexpr,
    BLOCK: tl.constexpr,
):
    DT: tl.constexpr = gx_ptr.dtype.element_ty
    PT: tl.constexpr = ps_ptr.dtype.element_ty  # torch's promotion of (grad dtype, float32)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = load_param(s_ptr, mask, C, INNER, PER_CHANNEL, BLOCK)
    v = div_exact(x, s, False)
    inside = (v >= -max_value) & (v <= max_value)
    tl.store(gx_ptr + offs, tl.where(inside, g, 0.0).to(DT), mask=mask)
    if NEED_S:
        vc = tl.where(v < -max_value, -max_value, v)
        vc = tl.where(vc > max_value, max_value, vc)
        q = _fp_round(vc, mantissa_bits, min_exponent, ROUNDING)
        ds = tl.where(inside, q - v, vc)
        tl.store(ps_ptr + offs, g.to(PT) * ds.to(PT), mask=mask)


def float_layout(x: torch.Tensor, scale: torch.Tensor, axis: int) -> ChannelLayout | None:
    """The kernels' layout for these inputs, or None when they must take the torch reference."""
    if x.dtype not in KERNEL_DTYPES or not x.is_contiguous() or scale.numel() == 0:
        return None
    return channel_layout(x, (scale.numel(),), axis)


def _forward_call(args: tuple[Any, ...], layout: ChannelLayout | None) -> ForwardLaunch:
    """The forward kernel's call on the arguments of ``fxq::fake_quant_float`` (:func:`float_forward`)."""
    x, (scale,), (axis, mantissa_bits, min_exponent, max_value, rounding) = FLOAT.split(args)
    layout = layout or float_layout(x, scale, axis)
    if layout is None:
        raise NotSupportedError(
            "float_forward: the kernel takes contiguous float16/bfloat16/float32/float64 x with per-tensor or "
            "per-channel scales; use fxq.numeric.reference.float_fake_quantize_reference for other inputs"
        )
    constexprs = {"ROUNDING": int(rounding), "PER_CHANNEL": layout.code,
                  "NARROW": x.dtype in (torch.float16, torch.bfloat16), "BLOCK": BLOCK}
    return ForwardLaunch(_float_fwd_kernel, (scale,), (per_channel_param(scale, layout, x.device, torch.float32),),
                         (x.numel(), layout.channels, layout.inner, int(mantissa_bits), int(min_exponent),
                          float(max_value)), constexprs)


def float_forward(*args: Any, layout: ChannelLayout | None = None) -> torch.Tensor:
    """Launch the FP8 forward kernel on the arguments of ``fxq::fake_quant_float`` (``x`` contiguous, dtype in
    ``KERNEL_DTYPES``). ``layout``: :func:`float_layout`'s, if known."""
    return _forward_call(args, layout).run(args[0])


def float_backward_elementwise(
    *args: Any, layout: ChannelLayout | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Kernel version of :func:`fxq.numeric.reference.float_fake_quantize_backward_elementwise` (same arguments,
    those of ``fxq::fake_quant_float_backward``, and same outputs)."""
    grad, x, (scale,), (axis, mantissa_bits, min_exponent, max_value, rounding), (need_scale_grad,) = (
        FLOAT.split_backward(args)
    )
    layout = layout or float_layout(x, scale, axis)
    if layout is None or not grad_fits(grad, x):
        raise NotSupportedError(
            "float_backward_elementwise: the kernel takes contiguous grad and x of one supported dtype and shape; "
            "use fxq.numeric.reference.float_fake_quantize_backward_elementwise for other inputs"
        )
    gx = torch.empty_like(x, memory_format=torch.contiguous_format)
    prod_dtype = torch.promote_types(grad.dtype, torch.float32)
    ps = torch.empty_like(gx, dtype=prod_dtype) if need_scale_grad else None
    if x.numel() == 0:
        return gx, ps
    s = per_channel_param(scale, layout, x.device, torch.float32)
    _float_bwd_kernel[grid(x.numel())](
        grad, x, s, gx, gx if ps is None else ps,
        x.numel(), layout.channels, layout.inner, int(mantissa_bits), int(min_exponent), float(max_value),
        ROUNDING=int(rounding), PER_CHANNEL=layout.code, NEED_S=bool(need_scale_grad),
        BLOCK=BLOCK, num_warps=NUM_WARPS, enable_fp_fusion=False,
    )  # fmt: skip
    return gx, ps


# --------------------------------------------------------------------------- op implementations
def _layout(args: tuple[Any, ...]) -> ChannelLayout | None:
    return float_layout(*args[:3])


fake_quant_float_triton = op_forward(FLOAT, _layout, float_forward)
bind_fake_quant_float = op_binder(_layout, _forward_call)
"""A :class:`~fxq.triton_kernels.common.BoundLaunch` of ``fxq::fake_quant_float`` for calls like ``args``."""
fake_quant_float_backward_triton = op_backward(FLOAT, _layout, float_backward_elementwise)
