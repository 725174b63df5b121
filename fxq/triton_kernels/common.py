"""Shared pieces of the Triton kernels: exact division, rounding policies, dtype rounding, layouts.

Every ``@triton.jit`` helper here reproduces one step of :mod:`fxq.numeric.reference` bit for bit:

* Division: on NVIDIA, Triton lowers ``a / b`` for float32 to ``div.full.f32`` (an approximation with
  up to 2 ulp error, not IEEE) and only float64 ``/`` to the IEEE ``div.rn.f64``. torch divides with
  IEEE round-to-nearest, so float32 division goes through ``tl.math.div_rn`` (``div.rn.f32``).
* FMA contraction: kernels are launched with ``enable_fp_fusion=False`` so that no ``a * b + c`` is fused
  into one rounding (the formulas have no such pair today; this keeps it true if they change).
* Round-half-even: torch's ``round`` (rint) is computed as ``(|v| + 2^p) - 2^p`` with ``p`` the mantissa
  width, which is exact under IEEE round-to-nearest-even for ``|v| < 2^p``; larger values are integers
  already. The sign of ``v`` is kept, so ``round(-0.3) == -0.0`` as in torch.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from fxq.fused_cpu import values_only
from fxq.numeric.opspec import OpSpec

log = logging.getLogger(__name__)

__all__ = [
    "BLOCK",
    "BoundLaunch",
    "ForwardLaunch",
    "NUM_WARPS",
    "KERNEL_DTYPES",
    "ChannelLayout",
    "channel_layout",
    "grid",
    "grad_fits",
    "op_binder",
    "op_forward",
    "op_backward",
]

BLOCK = 1024
NUM_WARPS = 4
KERNEL_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
"""Input dtypes the kernels handle; float16/bfloat16 round every step to the input dtype like torch."""


class ChannelLayout:
    """Where the per-channel parameter of a contiguous tensor lives: index = (flat // inner) % channels."""

    __slots__ = ("per_channel", "channels", "inner")

    def __init__(self, per_channel: bool, channels: int, inner: int) -> None:
        self.per_channel = per_channel
        self.channels = channels
        self.inner = inner

    @property
    def code(self) -> int:
        """The kernels' ``PER_CHANNEL`` constant (:func:`load_param`): 0 per tensor; per channel, 1 where a block's
        channel arithmetic fits 32 bits, 3 where moreover a block spans at most two channels, else 2."""
        if not self.per_channel:
            return 0
        if self.inner + BLOCK >= 2**31 or self.channels + BLOCK >= 2**31:
            return 2
        return 3 if self.inner >= BLOCK else 1


def channel_layout(x: torch.Tensor, numels: tuple[int, ...], axis: int) -> ChannelLayout | None:
    """Layout of parameters with ``numels`` entries broadcast along ``axis`` of ``x``; None if they do not fit.

    A parameter with one entry is a scalar (as in :func:`fxq.numeric.reference.broadcast_qparam`); the others must
    all have ``x.shape[axis]`` entries.
    """
    channels = max(numels)
    if channels == 1:
        return ChannelLayout(False, 1, 1)
    if x.dim() == 0 or any(n not in (1, channels) for n in numels):
        return None
    ax = axis % x.dim()
    if x.shape[ax] != channels:
        return None
    return ChannelLayout(True, channels, math.prod(x.shape[ax + 1 :]))


def grid(numel: int) -> tuple[int]:
    """One program per ``BLOCK`` elements."""
    return (triton.cdiv(numel, BLOCK),)


def per_channel_param(p: torch.Tensor, layout: ChannelLayout, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``p`` as a contiguous 1-D tensor of ``layout.channels`` entries (scalars expanded) on ``device``."""
    flat = p.detach().to(device=device, dtype=dtype).reshape(-1)
    if layout.per_channel and flat.numel() == 1:
        flat = flat.expand(layout.channels)
    return flat.contiguous()


def grad_fits(grad: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether a backward kernel takes ``grad`` with ``x``: same dtype and shape, contiguous."""
    return grad.dtype == x.dtype and grad.shape == x.shape and grad.is_contiguous()


LayoutFn = Callable[[tuple[Any, ...]], "ChannelLayout | None"]
"""The kernels' layout for an op's forward arguments, or None when they must take the torch reference."""


def op_forward(spec: OpSpec, layout: LayoutFn, launch: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """The implementation of ``spec``'s forward op: ``launch(*args, layout=...)``, the reference where no layout
    fits."""

    def run(*args: Any) -> torch.Tensor:
        fits = layout(args)
        return spec.forward(*args) if fits is None else launch(*args, layout=fits)

    run.__doc__ = f"``{spec.qualname}`` through the kernel; the torch reference for layouts it does not take."
    return run


def op_backward(spec: OpSpec, layout: LayoutFn, launch: Callable[..., tuple[Any, ...]]) -> Callable[..., Any]:
    """The implementation of ``spec``'s backward op: the elementwise kernel ``launch(*args, layout=...)``, then the
    reference's own reduction (:meth:`~fxq.numeric.opspec.OpSpec.reduce`); the reference where no layout fits."""

    def run(*args: Any) -> tuple[torch.Tensor, ...]:
        grad, x, params, attrs, _ = spec.split_backward(args)
        fits = layout((x, *params, *attrs))
        if fits is None or not grad_fits(grad, x):
            return spec.backward(*args)
        return spec.reduce(args, launch(*args, layout=fits))

    run.__doc__ = f"``{spec.backward_qualname}``: elementwise kernel, then the reference's own reduction."
    return run


class ForwardLaunch:
    """One forward kernel call, its arguments prepared: ``kernel[grid](x, *inputs, y, *scalars, **constexprs)``.

    The forward op and :func:`bind_forward` both launch through it, so a bound call runs the very kernel and
    arguments of the op. ``params`` are the op's parameter tensors and ``inputs`` their prepared forms (1-D,
    contiguous, on the kernel's device and dtype)."""

    __slots__ = ("kernel", "params", "inputs", "scalars", "constexprs")

    def __init__(self, kernel: Any, params: tuple[torch.Tensor, ...], inputs: tuple[torch.Tensor, ...],
                 scalars: tuple[Any, ...], constexprs: dict[str, Any]) -> None:
        self.kernel, self.params, self.inputs, self.scalars = kernel, params, inputs, scalars
        self.constexprs = constexprs  # in the kernel's signature order (a bound launch passes them by position)

    def launch(self, x: torch.Tensor, y: torch.Tensor) -> Any:
        """Write the op's values of ``x`` into ``y``; returns what Triton's launch returns (its compiled kernel on
        a GPU)."""
        return self.kernel[grid(x.numel())](x, *self.inputs, y, *self.scalars, **self.constexprs,
                                            num_warps=NUM_WARPS, enable_fp_fusion=False)

    def run(self, x: torch.Tensor) -> torch.Tensor:
        """The op's values of ``x`` in a new contiguous tensor (nothing launched for an empty ``x``)."""
        y = torch.empty_like(x, memory_format=torch.contiguous_format)
        if x.numel():
            self.launch(x, y)
        return y

    def positional(self, x: torch.Tensor, y: torch.Tensor) -> tuple[Any, ...]:
        """Every argument of the kernel in its signature's order (what a compiled kernel's launcher takes)."""
        return (x, *self.inputs, y, *self.scalars, *self.constexprs.values())


class BoundLaunch:
    """A forward op call prepared once, for the same quantizer call repeated on tensors of one shape (a quantizer
    of a model run batch after batch on a GPU, where a small kernel takes microseconds and the host's work decides
    the speed): :meth:`run` skips the op's dispatch, its checks, the layout and the parameters' preparation, and
    Triton's argument binding and cache lookup, by calling the compiled kernel's launcher with the same arguments.
    That launcher is checked once, at binding, to write the same bits as Triton's own launch; where it cannot be
    had or differs, :meth:`run` launches through Triton as the op does. Made by :func:`bind_forward`."""

    __slots__ = ("tag", "shape", "dtype", "device", "aligned", "params", "param_data", "param_shapes", "call",
                 "runner")

    def __init__(self, tag: Any, x: torch.Tensor, call: ForwardLaunch, runner: Callable[..., Any] | None) -> None:
        self.tag, self.shape, self.dtype, self.device = tag, x.shape, x.dtype, x.device
        self.aligned = _aligned(x)  # Triton compiles 16-byte aligned pointers into another kernel (vector loads)
        self.params = call.params
        self.param_data = tuple(p.data_ptr() for p in call.params)
        self.param_shapes = tuple(p.shape for p in call.params)  # the layout's channel count was read from them
        self.call, self.runner = call, runner

    def run(self, x: torch.Tensor, params: tuple[torch.Tensor, ...], tag: Any) -> torch.Tensor | None:
        """The op's values on ``x``, or None when this binding does not hold for the call: another ``tag`` (the
        caller's attributes), other parameter tensors, storage or shapes, another shape, dtype, device, layout or
        alignment of ``x``, or a call that needs the dispatcher (gradients, tracing, modes). Parameter values
        changed in place are read at each call."""
        if (x.shape != self.shape or x.dtype != self.dtype or x.device != self.device or tag != self.tag
                or not x.is_contiguous() or _aligned(x) != self.aligned):
            return None
        for p, mine, data, shape in zip(params, self.params, self.param_data, self.param_shapes):
            if p is not mine or p.data_ptr() != data or p.shape != shape:
                return None
        if not values_only((x, *params), self.device.type):
            return None
        y = torch.empty_like(x)
        if self.runner is None:
            self.call.launch(x, y)
        else:
            self.runner(*self.call.positional(x, y))
        return y


def bind_forward(call: ForwardLaunch, x: torch.Tensor, tag: Any) -> BoundLaunch | None:
    """A :class:`BoundLaunch` of ``call`` for calls like this one on ``x`` (tagged ``tag``), or None where a
    binding would not see later changes of the parameters (their prepared forms are copies, not views) or the
    call cannot be made now (an empty ``x``, a CUDA graph being captured). Launches the kernel once on ``x``
    to get the compiled kernel; the first binding of each compiled kernel in a process also runs its own
    launcher and keeps it only if it writes the same bits as Triton's launch."""
    if x.numel() == 0 or (x.is_cuda and torch.cuda.is_current_stream_capturing()):
        return None
    if any(p.data_ptr() != q.data_ptr() for p, q in zip(call.params, call.inputs)):
        return None
    expected = torch.empty_like(x)
    compiled = call.launch(x, expected)
    runner = None
    if compiled is not None and _launcher_agrees(compiled, call, x, expected):
        runner = compiled[_launch_grid(x.numel())]
    return BoundLaunch(tag, x, call, runner)


def op_binder(layout: LayoutFn, call: Callable[[tuple[Any, ...], ChannelLayout], ForwardLaunch]
              ) -> Callable[[tuple[Any, ...], Any], BoundLaunch | None]:
    """The binder of a forward op: ``binder(args, tag)``, a :class:`BoundLaunch` of ``call(args, layout)`` for
    calls like ``args``, or None where the kernel does not take them (as :func:`op_forward` runs the reference)."""

    def bind(args: tuple[Any, ...], tag: Any) -> BoundLaunch | None:
        fits = layout(args)
        return None if fits is None else bind_forward(call(args, fits), args[0], tag)

    return bind


_LAUNCHER_AGREES: dict[Any, bool] = {}
"""Whether each compiled kernel's own launcher was seen to write the bits of Triton's launch (checked once)."""


def _launcher_agrees(compiled: Any, call: ForwardLaunch, x: torch.Tensor, expected: torch.Tensor) -> bool:
    known = _LAUNCHER_AGREES.get(compiled)
    if known is not None:
        return known
    try:
        got = torch.empty_like(x)
        compiled[_launch_grid(x.numel())](*call.positional(x, got))
        agrees = bool(torch.equal(_bits(got), _bits(expected)))
        if not agrees:
            log.debug("%s: the compiled kernel's launcher wrote other values; bound calls launch through Triton",
                      getattr(compiled, "name", compiled))
    except Exception as exc:  # another Triton's launcher API: the op's own launch still holds
        log.debug("compiled kernel launcher unusable (%s: %s); bound calls launch through Triton",
                  type(exc).__name__, exc)
        agrees = False
    _LAUNCHER_AGREES[compiled] = agrees
    return agrees


def _aligned(t: torch.Tensor) -> bool:
    """Whether ``t``'s data is 16-byte aligned, which Triton specializes a pointer argument on."""
    return t.data_ptr() % 16 == 0


def _launch_grid(numel: int) -> tuple[int, int, int]:
    """:func:`grid` in the three dimensions a compiled kernel's launcher reads (Triton's launch pads it)."""
    return (*grid(numel), 1, 1)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bit patterns as integers (NaN equals NaN, -0 differs from 0)."""
    return t.view({8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()])


# --------------------------------------------------------------------------- jit helpers
@triton.jit
def div_exact(a, b, IS_FP64: tl.constexpr):
    """IEEE round-to-nearest ``a / b`` (see the module docstring for why ``/`` is not used for float32)."""
    if IS_FP64:
        out = a / b
    else:
        out = tl.math.div_rn(a, b)
    return out


@triton.jit
def bf16_round(v):
    """float32 ``v`` rounded to the nearest bfloat16 (ties to even), returned as float32.

    Written with integer bit operations rather than ``v.to(tl.bfloat16)``: the two agree on GPUs, but
    Triton's CPU interpreter truncates float32 -> bfloat16, and the tests run there.
    """
    bits = v.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # -65536 == 0xFFFF0000
    return tl.where(v != v, v, rounded.to(tl.float32, bitcast=True))


@triton.jit
def round_to(v, DT: tl.constexpr, NARROW: tl.constexpr):
    """Round a float32 intermediate to the 16-bit input dtype ``DT`` and back (no-op unless NARROW).

    torch computes float16/bfloat16 ops in float32 and rounds each result; float32 has enough precision
    (24 >= 2 * 11 + 2 bits) that this double rounding equals a correctly rounded 16-bit op.
    """
    if NARROW:
        if DT == tl.bfloat16:
            out = bf16_round(v)
        else:
            out = v.to(DT).to(tl.float32)
    else:
        out = v
    return out


@triton.jit
def rint(v, IS_FP64: tl.constexpr):
    """Round half to even, keeping the sign of ``v`` (torch.round)."""
    if IS_FP64:
        big = 4503599627370496.0  # 2**52
    else:
        big = 8388608.0  # 2**23
    a = tl.abs(v)
    t = (a + big) - big
    t = tl.where(v < 0, -t, t)
    return tl.where((a < big) & (v != 0.0), t, v)


@triton.jit
def round_with_policy(v, ROUNDING: tl.constexpr, IS_FP64: tl.constexpr):
    """:func:`fxq.numeric.reference.round_with_policy` for the policy code ``ROUNDING`` (RoundingPolicy int value).

    Ties are found exactly as ``|v - rint(v)| == 0.5`` and then go to ``floor(v) + tie_goes_up``.
    """
    if ROUNDING == 6:  # UP
        out = tl.ceil(v)
    elif ROUNDING == 7:  # DOWN
        out = tl.floor(v)
    else:
        nearest = rint(v, IS_FP64)
        if ROUNDING == 0:  # HALF_EVEN
            out = nearest
        else:
            tie = tl.abs(v - nearest) == 0.5
            f = tl.floor(v)
            if ROUNDING == 1:  # HALF_UP
                up = tl.full(v.shape, 1.0, v.dtype)
            elif ROUNDING == 2:  # HALF_DOWN
                up = tl.zeros(v.shape, v.dtype)
            elif ROUNDING == 3:  # HALF_TOWARDS_ZERO
                up = (f < 0).to(v.dtype)
            else:  # HALF_FAR_FROM_ZERO, TO_NEAR_INT
                up = (f >= 0).to(v.dtype)
            out = tl.where(tie, f + up, nearest)
    return out


@triton.jit
def load_param(p_ptr, mask, C, INNER, PER_CHANNEL: tl.constexpr, BLOCK: tl.constexpr):
    """The parameter value of each element of this program's block: ``p[(flat // INNER) % C]`` per channel,
    ``p[0]`` otherwise. ``PER_CHANNEL`` is :attr:`ChannelLayout.code`: with code 1 the block's first channel takes
    64-bit arithmetic once and each element 32-bit arithmetic (64-bit division is emulated on GPUs, and per element
    it made the per-channel kernels compute-bound on an H200); code 3, channels of at least a block, a comparison
    per element; code 2, for sizes that 32 bits do not hold, 64-bit throughout."""
    start = tl.program_id(0).to(tl.int64) * BLOCK
    if PER_CHANNEL == 1 or PER_CHANNEL == 3:
        within = (start % INNER).to(tl.int32) + tl.arange(0, BLOCK)  # < INNER + BLOCK: fits (codes 1, 3)
        first = ((start // INNER) % C).to(tl.int32)
        if PER_CHANNEL == 3:  # INNER >= BLOCK: the block ends in the next channel at the latest
            ch = tl.where(within >= INNER, first + 1, first)
            ch = tl.where(ch >= C, ch - C, ch)
        else:
            ch = (first + within // INNER) % C  # code 1: INNER and C hold 32 bits, so Triton passes them as i32
        out = tl.load(p_ptr + ch, mask=mask, other=1.0)
    elif PER_CHANNEL == 2:
        ch = ((start + tl.arange(0, BLOCK)) // INNER) % C
        out = tl.load(p_ptr + ch, mask=mask, other=1.0)
    else:
        out = tl.load(p_ptr)
    return out
