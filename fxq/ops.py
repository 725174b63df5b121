"""``fxq::`` custom ops: the fake-quant math as opaque torch ops, registered from one op-spec table.

Each entry of :data:`fxq.numeric.opspec.OP_SPECS` becomes two ops, ``fxq::<name>`` and
``fxq::<name>_backward``, with the torch reference (:mod:`fxq.numeric.reference`) as their default
implementation, a fake (meta) implementation, autograd through the backward op, the fused CPU kernels
(:mod:`fxq.fused_cpu`) and the Triton CUDA kernels (:mod:`fxq.triton_kernels`). Eager code and ``torch.fx``
graphs keep one node per quantizer and differentiate through it. Inside ``torch.compile``, for CPU tensors, the
wrappers hand dynamo one call of the reference instead (:func:`_traced`), which AOTAutograd traces into aten ops
(forward and backward) that inductor fuses with the ops around them: the same values, fewer memory passes. CUDA
tensors keep the op (its Triton kernel divides exactly; inductor's generated Triton division may be 1-2 ulp off
and flip rounding ties).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from fxq import fused_cpu
from fxq.numeric.opspec import FLOAT, LINEAR, OP_SPECS, OpSpec

__all__ = ["fake_quant_linear", "fake_quant_float"]


def _setup_context(spec: OpSpec, ctx: Any, inputs: tuple[Any, ...]) -> None:
    # a Function's apply adds the forward's defaults (the reference's ``inplace=False``) to its inputs
    x, params, attrs = spec.split(inputs[: spec.num_tensors + len(spec.attrs)])
    ctx.save_for_backward(x, *params)
    ctx.args = attrs


def _grads(ctx: Any, grad: Tensor, backward: Callable[..., tuple[Tensor, ...]]) -> tuple[Any, ...]:
    """Gradients of an op's inputs from ``backward`` (the backward op, or the reference when traced); None for the
    attributes (and the forward's defaults, which a Function's apply adds to its inputs)."""
    saved = ctx.saved_tensors
    needs = ctx.needs_input_grad[: len(saved)]
    grads = backward(grad.contiguous(), *saved, *ctx.args, *(bool(n) for n in needs[1:]))
    return (*(g if n else None for g, n in zip(grads, needs)), *(None,) * (len(ctx.needs_input_grad) - len(saved)))


def _define(spec: OpSpec) -> None:
    """Register ``spec``'s forward and backward ops as ``fxq::`` custom ops (fake implementation, autograd)."""
    forward = torch.library.custom_op(spec.qualname, spec.forward, mutates_args=(), schema=spec.schema())
    backward = torch.library.custom_op(
        spec.backward_qualname, spec.backward, mutates_args=(), schema=spec.backward_schema()
    )
    forward.register_fake(lambda x, *rest: torch.empty_like(x))
    backward.register_fake(lambda grad, x, *rest: tuple(torch.empty_like(t) for t in (x, *rest[: len(spec.params)])))
    backward_op = getattr(torch.ops.fxq, spec.backward_name)
    forward.register_autograd(
        lambda ctx, grad: _grads(ctx, grad, backward_op),
        setup_context=lambda ctx, inputs, output: _setup_context(spec, ctx, inputs),
    )


def _function(name: str, spec: OpSpec, forward_fn: Callable[..., Tensor],
              backward_fn: Callable[..., tuple[Tensor, ...]]) -> type[torch.autograd.Function]:
    """An ``autograd.Function`` of ``spec``'s op computing with ``forward_fn`` and ``backward_fn`` (the op's own
    signatures), named at creation: autograd names its graph node class after it (``<name>Backward``)."""

    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        _setup_context(spec, ctx, inputs)

    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        return _grads(ctx, grad, backward_fn)

    # forward and setup_context apart: torch.func's transforms take only such Functions
    return type(name, (torch.autograd.Function,),
                {"forward": staticmethod(forward_fn), "setup_context": staticmethod(setup_context),
                 "backward": staticmethod(backward)})


for _spec in OP_SPECS:
    _define(_spec)

_TRACED: dict[str, type[torch.autograd.Function]] = {
    spec.name: _function(f"_Traced_{spec.name}", spec, spec.forward, spec.backward) for spec in OP_SPECS}
"""The ops as the reference's own aten ops, for graphs that torch.compile builds. The ``fxq::`` op is opaque to
inductor: nothing fuses across it and its output is one more tensor in memory. Traced through instead, the reference
forward and backward (the same functions the op runs) become pointwise ops that inductor fuses with their neighbours
(bias add, ReLU, the next quantizer's division...). Values are those of the reference; the tests compare compiled
and eager bit for bit on CPU."""


def _traced(name: str, *args: Any) -> Tensor:
    """:data:`_TRACED`'s op, which dynamo records as one call: it does not speculate the autograd.Function's
    forward and backward at every quantizer (two thirds of dynamo's time on a QAT ResNet-18), and AOTAutograd
    traces the call into the same aten ops for inductor."""
    return _TRACED[name].apply(*args)


torch._dynamo.allow_in_graph(_traced)


_EAGER_CPU: dict[str, type[torch.autograd.Function]] = {
    spec.name: _function(f"_EagerCpu_{spec.name}", spec, fused_cpu.KERNELS[spec.qualname],
                         fused_cpu.KERNELS[spec.backward_qualname]) for spec in OP_SPECS}
"""The ops' CPU kernels (:data:`fxq.fused_cpu.KERNELS`) recorded by autograd directly, for plain eager calls that
need gradients (QAT, LSQ): the values and gradients of the op, without its dispatch and its autograd wrapper, which
cost about as much as the arithmetic of a mid-sized activation."""


def _call(spec: OpSpec, *args: Any) -> Tensor:
    """``torch.ops.fxq.<name>`` eagerly (fused CPU loop, Triton on CUDA); on CPU inside ``torch.compile``, the
    reference's aten ops, so inductor fuses them (bit-identical: inductor's C++ divides exactly). CUDA stays on
    the op's Triton kernel, which divides exactly where inductor's Triton code would not. A plain eager call
    (nothing tracing, plain tensors) skips the dispatcher: one that only needs values runs the device's kernel
    directly, and one that needs gradients records the device's kernels in autograd directly
    (:data:`_EAGER_CPU`, :data:`_EAGER_CUDA`)."""
    device = args[0].device.type
    if device == "cpu":
        if torch.compiler.is_compiling():
            return _traced(spec.name, *args)
        kernels, functions = fused_cpu.KERNELS, _EAGER_CPU
    elif device == "cuda" and _EAGER_CUDA:
        kernels, functions = _CUDA_KERNELS, _EAGER_CUDA
    else:
        return getattr(torch.ops.fxq, spec.name)(*args)
    tensors = args[: spec.num_tensors]
    if fused_cpu.plain_eager(tensors, device):
        if fused_cpu.records_grad(tensors):
            return functions[spec.name].apply(*args)
        return kernels[spec.qualname](*args)
    if device == "cpu" and fused_cpu.functorch_transform() is not None:
        return _traced(spec.name, *args)  # torch.func's grad cannot differentiate the custom op's own autograd
    return getattr(torch.ops.fxq, spec.name)(*args)


def fake_quant_linear(
    x: Tensor, scale: Tensor, offset: Tensor, axis: int, quant_min: int, quant_max: int, rounding: int
) -> Tensor:
    """Linear fake-quant ``fxq::fake_quant_linear`` (see :func:`_call` for eager vs compiled)."""
    return _call(LINEAR, x, scale, offset, axis, quant_min, quant_max, rounding)


def fake_quant_float(
    x: Tensor, scale: Tensor, axis: int, mantissa_bits: int, min_exponent: int, max_value: float, rounding: int
) -> Tensor:
    """FP8 fake-quant ``fxq::fake_quant_float`` (see :func:`_call` for eager vs compiled)."""
    return _call(FLOAT, x, scale, axis, mantissa_bits, min_exponent, max_value, rounding)


def bind(spec: OpSpec, args: tuple[Any, ...], tag: Any) -> Any:
    """A bound call of ``spec``'s forward op for calls like ``args`` (tagged ``tag``), which a caller repeating the
    same call on tensors of one shape runs with ``bound.run(x, params, tag)`` (None from it: make the call again):
    on CPU the fused graph (:func:`fxq.fused_cpu.bind`), on CUDA the Triton kernel's launch
    (:class:`fxq.triton_kernels.common.BoundLaunch`). None where neither takes the call."""
    device = args[0].device.type
    if device == "cpu":
        return fused_cpu.bind(spec, args, tag)
    binder = _CUDA_BINDERS.get(spec.qualname)
    if device != "cuda" or binder is None or not fused_cpu.values_only(args[: spec.num_tensors], "cuda"):
        return None  # training calls (QAT) go through autograd every time
    return binder(args, tag)


_CUDA_KERNELS: dict[str, Callable[..., Any]] = {}
"""The CUDA kernel of each op (qualified name): Triton, or the reference where Triton fails to load."""
_CUDA_BINDERS: dict[str, Callable[..., Any]] = {}
"""The CUDA binder of each forward op (qualified name): :func:`fxq.triton_kernels.cuda_binders`."""
_EAGER_CUDA: dict[str, type[torch.autograd.Function]] = {}
"""The ops' CUDA kernels recorded by autograd directly, as :data:`_EAGER_CPU` on CPU (filled at import; the kernels
import triton on their first CUDA call, else run the reference)."""


def _register_device_kernels() -> None:
    """Register the fused CPU kernels and the Triton CUDA kernels (both fall back to the reference)."""
    fused_cpu.register_cpu_kernels()
    try:
        from fxq.triton_kernels import cuda_binders, cuda_kernels, register_cuda_kernels
    except ImportError:  # triton missing or not built for this platform
        return
    register_cuda_kernels()
    _CUDA_KERNELS.update(cuda_kernels())
    _CUDA_BINDERS.update(cuda_binders())
    _EAGER_CUDA.update({spec.name: _function(f"_EagerCuda_{spec.name}", spec, _CUDA_KERNELS[spec.qualname],
                                             _CUDA_KERNELS[spec.backward_qualname]) for spec in OP_SPECS})


_register_device_kernels()
