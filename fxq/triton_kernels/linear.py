"""Triton kernels of the linear fake-quant (``fxq::fake_quant_linear`` and its backward).

Same formulas as :func:`fxq.numeric.reference.linear_fake_quantize_reference` and
:func:`fxq.numeric.reference.linear_fake_quantize_backward_elementwise`, step by step and in the same dtype;
the scale/offset gradients are reduced by the reference's own reduction
(:meth:`fxq.numeric.opspec.OpSpec.reduce`), so results are bit-identical. Kernels take contiguous inputs; per-channel parameters are
gathered at ``(flat_index // inner) % channels``.
"""
from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from fxq.errors import NotSupportedError
from fxq.numeric.opspec import LINEAR
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
    "linear_forward",
    "linear_backward_elementwise",
    "bind_fake_quant_linear",
    "fake_quant_linear_triton",
    "fake_quant_linear_backward_triton",
]


@triton.jit
def _load(x_ptr, s_ptr, o_ptr, offs, mask, C, INNER, PER_CHANNEL: tl.constexpr, IS_FP64: tl.constexpr,
          BLOCK: tl.constexpr):
    """x, scale and offset of each element, in the compute dtype (float64, else float32)."""
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    s = load_param(s_ptr, mask, C, INNER, PER_CHANNEL, BLOCK)
    o = load_param(o_ptr, mask, C, INNER, PER_CHANNEL, BLOCK)
    if not IS_FP64:
        x = x.to(tl.float32)
        s = s.to(tl.float32)
        o = o.to(tl.float32)
    return x, s, o


@triton.jit
def _codes(x, s, o, ROUNDING: tl.constexpr, IS_FP64: tl.constexpr, DT: tl.constexpr, NARROW: tl.constexpr):
    """``v = x / s``, ``r = round(v)`` and the unclamped code ``q = r + o``, each rounded like torch."""
    v = round_to(div_exact(x, s, IS_FP64), DT, NARROW)
    r = round_with_policy(v, ROUNDING, IS_FP64)
    q = round_to(r + o, DT, NARROW)
    return v, r, q


@triton.jit(do_not_specialize=["quant_min", "quant_max", "C", "INNER"])
def _linear_fwd_kernel(
    x_ptr,
    s_ptr,
    o_ptr,
    y_ptr,
    n,
    C,
    INNER,
    quant_min,
    quant_max,
    ROUNDING: tl.constexpr,
    PER_CHANNEL: tl.constexpr,
    IS_FP64: tl.constexpr,
    NARROW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    DT: tl.constexpr = y_ptr.dtype.element_ty
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x, s, o = _load(x_ptr, s_ptr, o_ptr, offs, mask, C, INNER, PER_CHANNEL, IS_FP64, BLOCK)
    _, _, q = _codes(x, s, o, ROUNDING, IS_FP64, DT, NARROW)
    q = tl.where(q < quant_min, quant_min, q)  # torch.clamp, NaN stays NaN
    q = tl.where(q > quant_max, quant_max, q)
    y = round_to(round_to(q - o, DT, NARROW) * s, DT, NARROW)
    tl.store(y_ptr + offs, y.to(DT), mask=mask)


@triton.jit(do_not_specialize=["quant_min", "quant_max", "C", "INNER"])
def _linear_bwd_kernel(
    g_ptr,
    x_ptr,
    s_ptr,
    o_ptr,
    gx_ptr,
    ps_ptr,
    po_ptr,
    n,
    C,
    INNER,
    quant_min,
    quant_max,
    ROUNDING: tl.constexpr,
    PER_CHANNEL: tl.constexpr,
    IS_FP64: tl.constexpr,
    NARROW: tl.constexpr,
    NEED_S: tl.constexpr,
    NEED_O: tl.constexpr,
    BLOCK: tl.constexpr,
):
    DT: tl.constexpr = gx_ptr.dtype.element_ty
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0)
    if not IS_FP64:
        g = g.to(tl.float32)
    x, s, o = _load(x_ptr, s_ptr, o_ptr, offs, mask, C, INNER, PER_CHANNEL, IS_FP64, BLOCK)
    v, r, q = _codes(x, s, o, ROUNDING, IS_FP64, DT, NARROW)
    below = q < quant_min
    above = q > quant_max
    inside = (below | above) == 0
    tl.store(gx_ptr + offs, tl.where(inside, g, 0.0).to(DT), mask=mask)
    if NEED_S:
        clipped = tl.where(below, round_to(quant_min - o, DT, NARROW), round_to(quant_max - o, DT, NARROW))
        ds = tl.where(inside, round_to(r - v, DT, NARROW), clipped)
        tl.store(ps_ptr + offs, round_to(g * ds, DT, NARROW).to(DT), mask=mask)
    if NEED_O:
        do = tl.where(inside, 0.0, -s)
        tl.store(po_ptr + offs, round_to(g * do, DT, NARROW).to(DT), mask=mask)


def _flags(x: torch.Tensor) -> tuple[bool, bool]:
    return x.dtype == torch.float64, x.dtype in (torch.float16, torch.bfloat16)


def linear_layout(
    x: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, axis: int, quant_min: int, quant_max: int
) -> ChannelLayout | None:
    """The kernels' layout for these inputs, or None when they must take the torch reference.

    float16/bfloat16 inputs need quant bounds that the dtype holds exactly (torch compares against the
    rounded bound but clamps to the exact one; the kernel does not model that corner).
    """
    if x.dtype not in KERNEL_DTYPES or not x.is_contiguous() or scale.numel() == 0 or offset.numel() == 0:
        return None
    if x.dtype in (torch.float16, torch.bfloat16):
        bounds = torch.tensor([quant_min, quant_max], dtype=torch.float64)
        if not torch.equal(bounds.to(x.dtype).to(torch.float64), bounds):
            return None
    return channel_layout(x, (scale.numel(), offset.numel()), axis)


def _forward_call(args: tuple[Any, ...], layout: ChannelLayout | None) -> ForwardLaunch:
    """The forward kernel's call on the arguments of ``fxq::fake_quant_linear`` (:func:`linear_forward`)."""
    x, (scale, offset), (axis, quant_min, quant_max, rounding) = LINEAR.split(args)
    layout = layout or linear_layout(x, scale, offset, axis, quant_min, quant_max)
    if layout is None:
        raise NotSupportedError(
            "linear_forward: the kernel takes contiguous float16/bfloat16/float32/float64 x with per-tensor or "
            "per-channel parameters; use fxq.numeric.reference.linear_fake_quantize_reference for other inputs"
        )
    is_fp64, narrow = _flags(x)
    inputs = tuple(per_channel_param(p, layout, x.device, x.dtype) for p in (scale, offset))
    constexprs = {"ROUNDING": int(rounding), "PER_CHANNEL": layout.code, "IS_FP64": is_fp64, "NARROW": narrow,
                  "BLOCK": BLOCK}
    return ForwardLaunch(_linear_fwd_kernel, (scale, offset), inputs,
                         (x.numel(), layout.channels, layout.inner, int(quant_min), int(quant_max)), constexprs)


def linear_forward(*args: Any, layout: ChannelLayout | None = None) -> torch.Tensor:
    """Launch the forward kernel on the arguments of ``fxq::fake_quant_linear`` (``x`` contiguous, dtype in
    ``KERNEL_DTYPES``) and return the fake-quantized x. ``layout``: :func:`linear_layout`'s, if known."""
    return _forward_call(args, layout).run(args[0])


def linear_backward_elementwise(
    *args: Any, layout: ChannelLayout | None = None
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Kernel version of :func:`fxq.numeric.reference.linear_fake_quantize_backward_elementwise` (same arguments,
    those of ``fxq::fake_quant_linear_backward``, and same outputs)."""
    grad, x, (scale, offset), (axis, quant_min, quant_max, rounding), needs = LINEAR.split_backward(args)
    need_scale_grad, need_offset_grad = needs
    layout = layout or linear_layout(x, scale, offset, axis, quant_min, quant_max)
    if layout is None or not grad_fits(grad, x):
        raise NotSupportedError(
            "linear_backward_elementwise: the kernel takes contiguous grad and x of one supported dtype and shape; "
            "use fxq.numeric.reference.linear_fake_quantize_backward_elementwise for other inputs"
        )
    gx = torch.empty_like(x, memory_format=torch.contiguous_format)
    ps = torch.empty_like(gx) if need_scale_grad else None
    po = torch.empty_like(gx) if need_offset_grad else None
    if x.numel() == 0:
        return gx, ps, po
    is_fp64, narrow = _flags(x)
    s = per_channel_param(scale, layout, x.device, x.dtype)
    o = per_channel_param(offset, layout, x.device, x.dtype)
    _linear_bwd_kernel[grid(x.numel())](
        grad, x, s, o, gx, gx if ps is None else ps, gx if po is None else po,
        x.numel(), layout.channels, layout.inner, int(quant_min), int(quant_max),
        ROUNDING=int(rounding), PER_CHANNEL=layout.code, IS_FP64=is_fp64, NARROW=narrow,
        NEED_S=bool(need_scale_grad), NEED_O=bool(need_offset_grad),
        BLOCK=BLOCK, num_warps=NUM_WARPS, enable_fp_fusion=False,
    )  # fmt: skip
    return gx, ps, po


# --------------------------------------------------------------------------- op implementations
def _layout(args: tuple[Any, ...]) -> ChannelLayout | None:
    return linear_layout(*args[:6])


fake_quant_linear_triton = op_forward(LINEAR, _layout, linear_forward)
bind_fake_quant_linear = op_binder(_layout, _forward_call)
"""A :class:`~fxq.triton_kernels.common.BoundLaunch` of ``fxq::fake_quant_linear`` for calls like ``args``."""
fake_quant_linear_backward_triton = op_backward(LINEAR, _layout, linear_backward_elementwise)
