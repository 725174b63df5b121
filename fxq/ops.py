"""``fxq::`` custom ops: the fake-quant math as opaque torch ops.

The default (CPU and any device) implementation is the torch reference in :mod:`fxq.functional`;
:mod:`fxq.triton_kernels` registers CUDA kernels for the same ops. Each op has a fake implementation
and autograd, so eager code and ``torch.fx`` graphs keep one node per quantizer and differentiate through it.
Inside ``torch.compile`` the wrappers hand dynamo the reference's own aten ops instead (forward and backward),
which inductor fuses with the ops around them: the same values, fewer memory passes.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from fxq import functional as F

__all__ = ["fake_quant_linear", "fake_quant_float"]


# --------------------------------------------------------------------------- linear
@torch.library.custom_op("fxq::fake_quant_linear", mutates_args=())
def _fake_quant_linear(
    x: Tensor, scale: Tensor, offset: Tensor, axis: int, quant_min: int, quant_max: int, rounding: int
) -> Tensor:
    return F.linear_fake_quantize_reference(x, scale, offset, axis, quant_min, quant_max, rounding)


@_fake_quant_linear.register_fake
def _(x, scale, offset, axis, quant_min, quant_max, rounding):
    return torch.empty_like(x)


@torch.library.custom_op("fxq::fake_quant_linear_backward", mutates_args=())
def _fake_quant_linear_backward(
    grad: Tensor,
    x: Tensor,
    scale: Tensor,
    offset: Tensor,
    axis: int,
    quant_min: int,
    quant_max: int,
    rounding: int,
    need_scale_grad: bool,
    need_offset_grad: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    return F.linear_fake_quantize_backward_reference(
        grad, x, scale, offset, axis, quant_min, quant_max, rounding, need_scale_grad, need_offset_grad
    )


@_fake_quant_linear_backward.register_fake
def _(grad, x, scale, offset, axis, quant_min, quant_max, rounding, need_scale_grad, need_offset_grad):
    return torch.empty_like(x), torch.empty_like(scale), torch.empty_like(offset)


def _linear_setup_context(ctx, inputs, output):
    x, scale, offset, axis, quant_min, quant_max, rounding = inputs
    ctx.save_for_backward(x, scale, offset)
    ctx.args = (axis, quant_min, quant_max, rounding)


def _linear_grads(ctx, grad, backward):
    """Gradients of the linear fake-quant's inputs from ``backward`` (the op, or the reference when traced)."""
    x, scale, offset = ctx.saved_tensors
    need_x, need_s, need_o = ctx.needs_input_grad[:3]
    gx, gs, go = backward(grad.contiguous(), x, scale, offset, *ctx.args, bool(need_s), bool(need_o))
    return (gx if need_x else None), (gs if need_s else None), (go if need_o else None), None, None, None, None


def _linear_backward(ctx, grad):
    return _linear_grads(ctx, grad, torch.ops.fxq.fake_quant_linear_backward)


_fake_quant_linear.register_autograd(_linear_backward, setup_context=_linear_setup_context)


# --------------------------------------------------------------------------- floating (FP8)
@torch.library.custom_op("fxq::fake_quant_float", mutates_args=())
def _fake_quant_float(
    x: Tensor, scale: Tensor, axis: int, mantissa_bits: int, min_exponent: int, max_value: float, rounding: int
) -> Tensor:
    return F.float_fake_quantize_reference(x, scale, axis, mantissa_bits, min_exponent, max_value, rounding)


@_fake_quant_float.register_fake
def _(x, scale, axis, mantissa_bits, min_exponent, max_value, rounding):
    return torch.empty_like(x)


@torch.library.custom_op("fxq::fake_quant_float_backward", mutates_args=())
def _fake_quant_float_backward(
    grad: Tensor,
    x: Tensor,
    scale: Tensor,
    axis: int,
    mantissa_bits: int,
    min_exponent: int,
    max_value: float,
    rounding: int,
    need_scale_grad: bool,
) -> tuple[Tensor, Tensor]:
    return F.float_fake_quantize_backward_reference(
        grad, x, scale, axis, mantissa_bits, min_exponent, max_value, rounding, need_scale_grad
    )


@_fake_quant_float_backward.register_fake
def _(grad, x, scale, axis, mantissa_bits, min_exponent, max_value, rounding, need_scale_grad):
    return torch.empty_like(x), torch.empty_like(scale)


def _float_setup_context(ctx, inputs, output):
    x, scale, axis, mantissa_bits, min_exponent, max_value, rounding = inputs
    ctx.save_for_backward(x, scale)
    ctx.args = (axis, mantissa_bits, min_exponent, max_value, rounding)


def _float_grads(ctx, grad, backward):
    """Gradients of the floating fake-quant's inputs from ``backward`` (the op, or the reference when traced)."""
    x, scale = ctx.saved_tensors
    need_x, need_s = ctx.needs_input_grad[:2]
    gx, gs = backward(grad.contiguous(), x, scale, *ctx.args, bool(need_s))
    return (gx if need_x else None), (gs if need_s else None), None, None, None, None, None


def _float_backward(ctx, grad):
    return _float_grads(ctx, grad, torch.ops.fxq.fake_quant_float_backward)


_fake_quant_float.register_autograd(_float_backward, setup_context=_float_setup_context)


# --------------------------------------------------------------------------- the form torch.compile sees
class _LinearFakeQuantTraced(torch.autograd.Function):
    """The linear fake-quant as the reference's own aten ops, for graphs that torch.compile builds.

    The ``fxq::`` op is opaque to inductor: nothing fuses across it and its output is one more tensor in memory.
    Traced through instead, the reference forward and backward (:mod:`fxq.functional`, the same functions the
    op runs) become pointwise ops that inductor fuses with their neighbours (bias add, ReLU, the next
    quantizer's division...). Values are those of the reference; the tests compare compiled and eager bit for bit.
    """

    @staticmethod
    def forward(ctx: Any, *inputs: Any) -> Tensor:
        _linear_setup_context(ctx, inputs, None)
        return F.linear_fake_quantize_reference(*inputs)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        return _linear_grads(ctx, grad, F.linear_fake_quantize_backward_reference)


class _FloatFakeQuantTraced(torch.autograd.Function):
    """:class:`_LinearFakeQuantTraced` for the floating (FP8) fake-quant."""

    @staticmethod
    def forward(ctx: Any, *inputs: Any) -> Tensor:
        _float_setup_context(ctx, inputs, None)
        return F.float_fake_quantize_reference(*inputs)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        return _float_grads(ctx, grad, F.float_fake_quantize_backward_reference)


def fake_quant_linear(
    x: Tensor, scale: Tensor, offset: Tensor, axis: int, quant_min: int, quant_max: int, rounding: int
) -> Tensor:
    """Linear fake-quant: ``torch.ops.fxq.fake_quant_linear`` eagerly (fused CPU loop, Triton on CUDA); the
    reference's aten ops inside ``torch.compile`` (:class:`_LinearFakeQuantTraced`), so inductor fuses them."""
    if torch.compiler.is_compiling():
        return _LinearFakeQuantTraced.apply(x, scale, offset, axis, quant_min, quant_max, rounding)
    return torch.ops.fxq.fake_quant_linear(x, scale, offset, axis, quant_min, quant_max, rounding)


def fake_quant_float(
    x: Tensor, scale: Tensor, axis: int, mantissa_bits: int, min_exponent: int, max_value: float, rounding: int
) -> Tensor:
    """FP8 fake-quant: ``torch.ops.fxq.fake_quant_float`` eagerly, the reference's aten ops inside torch.compile."""
    if torch.compiler.is_compiling():
        return _FloatFakeQuantTraced.apply(x, scale, axis, mantissa_bits, min_exponent, max_value, rounding)
    return torch.ops.fxq.fake_quant_float(x, scale, axis, mantissa_bits, min_exponent, max_value, rounding)


def _register_device_kernels() -> None:
    """Register the fused CPU kernels and the Triton CUDA kernels (both fall back to the reference)."""
    from fxq.fused_cpu import register_cpu_kernels

    register_cpu_kernels()
    try:
        from fxq.triton_kernels import register_cuda_kernels
    except ImportError:  # triton missing or not built for this platform
        return
    register_cuda_kernels()


_register_device_kernels()
