"""Fused CPU path of the ``fxq::`` ops: the torch reference itself, compiled by inductor into one loop.

The eager reference (:mod:`fxq.functional`) makes one pass over memory per torch op (about ten for the
linear fake-quant). For large CPU tensors the ops' CPU kernels instead run ``torch.compile`` of the very
same reference functions, so there is still one definition of the math; the tests check the compiled
code bit for bit against eager. Parameter gradients keep the eager reduction
(:func:`fxq.functional._sum_to_param`): only the elementwise part is compiled, because a compiled
reduction would sum in another order.

When the fused path is taken (all must hold):

* ``FXQ_CPU_FUSED`` is not ``0`` (or :func:`cpu_fusion` turned it on);
* the tensor has at least ``FXQ_CPU_FUSED_MIN_NUMEL`` elements (default 2**18), is a contiguous float32
  or float64 CPU tensor, and no tracing, compiling or dispatch mode is active;
* warm-up is over: compiling costs seconds (about 5 s for the first graph of a process with a warm
  inductor cache, 15-20 s cold, then about 2 s per graph), so large tensors first run eagerly until they
  have used ``FXQ_CPU_FUSED_WARMUP_S`` seconds (default 3) of eager time, and only then is anything
  compiled. Short runs never pay the compile; long runs pay it once, at most about twice the optimum.

Throughput: the fused forward reads and writes each element once, so on large tensors it runs at the
speed of an allocating copy (``x.clone()``); most of the remaining cost is first-touch page faults of the
fresh output, which torch's ``THP_MEM_ALLOC_ENABLE=1`` (huge pages, set before starting Python) removes.

Each (op, rounding, dtype, layout) gets its own compiled graph over dynamic shapes. Per-channel tensors
are viewed as ``(outer, channels, inner)`` with size-1 dimensions dropped, so any rank and axis maps to
one of a few graphs. If compiling fails (no C++ compiler, unsupported platform), one warning is logged
and the process stays on the eager reference.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import threading
import time
import types
from typing import Any, Callable, Iterator

import torch

from fxq import functional as F

__all__ = [
    "cpu_fusion",
    "fused_cpu_stats",
    "register_cpu_kernels",
    "FusedCpuSettings",
    "fake_quant_linear_inplace",
    "fake_quant_float_inplace",
    "squared_error_sums",
]

log = logging.getLogger(__name__)

ENV_ENABLE = "FXQ_CPU_FUSED"
ENV_MIN_NUMEL = "FXQ_CPU_FUSED_MIN_NUMEL"
ENV_WARMUP_S = "FXQ_CPU_FUSED_WARMUP_S"
DEFAULT_MIN_NUMEL = 1 << 18
DEFAULT_WARMUP_S = 3.0

_FUSED_DTYPES = (torch.float32, torch.float64)
# Pin the floating-point flags the bit-identity relies on (these are inductor's defaults today).
_INDUCTOR_OPTIONS = {
    "cpp.enable_unsafe_math_opt_flag": False,
    "cpp.enable_floating_point_contract_flag": "off",
}


@dataclasses.dataclass
class FusedCpuSettings:
    """Overrides of the environment variables; None means: read the variable (see the module docstring)."""

    enabled: bool | None = None
    min_numel: int | None = None
    warmup_seconds: float | None = None

    def resolved(self) -> tuple[bool, int, float]:
        enabled = self.enabled if self.enabled is not None else os.environ.get(ENV_ENABLE, "1") != "0"
        min_numel = self.min_numel if self.min_numel is not None else _env_number(ENV_MIN_NUMEL, DEFAULT_MIN_NUMEL)
        warmup = self.warmup_seconds if self.warmup_seconds is not None else _env_number(ENV_WARMUP_S, DEFAULT_WARMUP_S)
        return enabled, int(min_numel), float(warmup)


def _env_number(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        log.warning("%s=%r is not a number; using %s", name, raw, default)
        return default


class _State:
    """Process-wide state of the fused path: settings, warm-up clock, compiled graphs, counters."""

    def __init__(self) -> None:
        self.settings = FusedCpuSettings()
        self.lock = threading.Lock()
        self.eager_seconds = 0.0
        self.compiled: dict[tuple[Any, ...], Callable[..., Any]] = {}
        self.broken: str | None = None  # why the fused path is off for good in this process
        self.stats = {"fused_calls": 0, "eager_calls": 0, "compiles": 0, "compile_seconds": 0.0}


_state = _State()


@contextlib.contextmanager
def cpu_fusion(
    enabled: bool = True, min_numel: int | None = None, warmup_seconds: float | None = None
) -> Iterator[FusedCpuSettings]:
    """Temporarily override the fused-path settings (process-wide); restores the previous ones on exit.

    Args:
        enabled: turn the fused path on or off.
        min_numel: smallest tensor that takes the fused path (None: keep the current setting).
        warmup_seconds: eager seconds on large tensors before compiling (0: compile at once).

    Example:
        >>> with cpu_fusion(min_numel=0, warmup_seconds=0):  # force small tensors through it
        ...     y = torch.ops.fxq.fake_quant_linear(x, s, o, 0, -128, 127, 0)
    """
    previous = _state.settings
    current = dataclasses.replace(previous, enabled=enabled)
    if min_numel is not None:
        current.min_numel = min_numel
    if warmup_seconds is not None:
        current.warmup_seconds = warmup_seconds
    _state.settings = current
    try:
        yield current
    finally:
        _state.settings = previous


def fused_cpu_stats() -> dict[str, float]:
    """Counters since import: fused and eager calls of large tensors, compiles and their seconds."""
    return dict(_state.stats, eager_seconds=_state.eager_seconds)


# --------------------------------------------------------------------------- eligibility and layout
def _tracing_or_mode_active() -> bool:
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return True
    dispatch_stack = getattr(torch._C, "_len_torch_dispatch_stack", None)
    return bool(dispatch_stack is not None and dispatch_stack() > 0)


def _canonical(x: torch.Tensor, numels: tuple[int, ...], axis: int) -> tuple[tuple[int, ...], int] | None:
    """A view shape of ``x`` and the channel axis in it; parameters broadcast the same way on both.

    Scalars (every parameter has one entry) view ``x`` as 1-D. Per channel: ``(outer, C, inner)`` with the
    size-1 ends dropped, so no dimension of size 1 makes the dynamic-shape graph specialise.
    """
    channels = max(numels)
    if channels == 1:
        return (x.numel(),), 0
    if x.dim() == 0 or any(n not in (1, channels) for n in numels):
        return None
    ax = axis % x.dim()
    if x.shape[ax] != channels:
        return None
    outer, inner = math.prod(x.shape[:ax]), math.prod(x.shape[ax + 1 :])
    shape = tuple(d for d in (outer, channels, inner) if d != 1)
    return shape, (0 if outer == 1 else 1)


def _eligible(x: torch.Tensor, grad: torch.Tensor | None, *params: torch.Tensor) -> bool:
    """Large contiguous float32/float64 CPU ``x`` (and ``grad``, or any second operand, like it), plain
    tensors or a weight ``nn.Parameter`` as ``x``, nothing tracing."""
    enabled, min_numel, _ = _state.settings.resolved()
    if not enabled or _state.broken is not None or x.numel() < max(min_numel, 1):
        return False
    if grad is not None and (grad.dtype != x.dtype or grad.shape != x.shape or not grad.is_contiguous()):
        return False
    if type(x) is torch.nn.Parameter:  # a weight: read only here (the kernels detach it), so as plain as a tensor
        x = x.detach()
    return _writable_cpu(x, *params, *(() if grad is None else (grad,)))


def _writable_cpu(x: torch.Tensor, *params: torch.Tensor) -> bool:
    """A plain contiguous float32/float64 CPU ``x`` with plain CPU parameters, nothing tracing."""
    if x.dtype not in _FUSED_DTYPES or not x.is_contiguous():
        return False
    if any(type(t) is not torch.Tensor or t.device.type != "cpu" for t in (x, *params)):
        return False
    return not _tracing_or_mode_active()


def _warmed_up() -> bool:
    _, _, warmup = _state.settings.resolved()
    return _state.eager_seconds >= warmup


def _run_eager(fn: Callable[..., Any], *args: Any) -> Any:
    start = time.perf_counter()
    out = fn(*args)
    _state.eager_seconds += time.perf_counter() - start
    _state.stats["eager_calls"] += 1
    return out


# --------------------------------------------------------------------------- compiled graphs
def _own_code(fn: Callable[..., Any], tag: str) -> Callable[..., Any]:
    """A copy of ``fn`` with its own code object.

    Dynamo keeps its compiled graphs, and its recompile limit, per code object; closures made by one
    factory share a code object, so each key gets a fresh one and never evicts another key's graph.
    """
    code = fn.__code__.replace(co_name=f"fxq_fused_{tag}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


def _inductor_options() -> dict[str, Any]:
    from torch._inductor import config as inductor_config

    return {k: v for k, v in _INDUCTOR_OPTIONS.items() if hasattr(inductor_config.cpp, k.split(".", 1)[1])}


def _compiled(key: tuple[Any, ...], factory: Callable[[], Callable[..., Any]]) -> Callable[..., Any]:
    fn = _state.compiled.get(key)
    if fn is None:
        with _state.lock:
            fn = _state.compiled.get(key)
            if fn is None:
                tag = "".join(c if c.isalnum() else "_" for c in "_".join(map(str, key)).replace("torch.", ""))
                fn = torch.compile(_own_code(factory(), tag), dynamic=True, fullgraph=True, options=_inductor_options())
                _state.compiled[key] = fn
    return fn


_FAILED = object()
"""What :func:`_call_fused` returns when the fused path failed (then it stays off)."""


def _call_fused(key: tuple[Any, ...], factory: Callable[[], Callable[..., Any]], *args: Any) -> Any:
    """Run the compiled graph for ``key``; :data:`_FAILED` if the fused path failed (then it stays off)."""
    fresh = key not in _state.compiled
    start = time.perf_counter()
    try:
        with torch.no_grad():
            out = _compiled(key, factory)(*args)
    except Exception as exc:  # compiler missing or broken: never fail the op because of the fast path
        _state.broken = f"{type(exc).__name__}: {exc}"
        log.warning(
            "fxq fused CPU path disabled for this process (%s); running the eager torch reference. "
            "Set %s=0 to skip the attempt.",
            _state.broken.splitlines()[0][:300],
            ENV_ENABLE,
        )
        return _FAILED
    if fresh:
        seconds = time.perf_counter() - start
        _state.stats["compiles"] += 1
        _state.stats["compile_seconds"] += seconds
        log.info("fxq fused CPU graph %s compiled in %.1f s", key, seconds)
    _state.stats["fused_calls"] += 1
    return out


def _linear_forward_factory(axis: int, rounding: int) -> Callable[[], Callable[..., Any]]:
    def factory() -> Callable[..., Any]:
        def fused(x, scale, offset, quant_min, quant_max):
            return F.linear_fake_quantize_reference(x, scale, offset, axis, quant_min, quant_max, rounding)

        return fused

    return factory


def _into_input(factory: Callable[[], Callable[..., Any]]) -> Callable[[], Callable[..., Any]]:
    """The graph of ``factory`` writing its result into its first argument (an in-place twin, one pass)."""

    def in_place_factory() -> Callable[..., Any]:
        fn = factory()

        def fused(x, *args):
            x.copy_(fn(x, *args))

        return fused

    return in_place_factory


def _linear_backward_factory(axis: int, rounding: int, need_s: bool, need_o: bool) -> Callable[[], Callable[..., Any]]:
    def factory() -> Callable[..., Any]:
        def fused(grad, x, scale, offset, quant_min, quant_max):
            return F.linear_fake_quantize_backward_elementwise(
                grad, x, scale, offset, axis, quant_min, quant_max, rounding, need_s, need_o
            )

        return fused

    return factory


def _float_forward_factory(axis: int, mantissa_bits: int, min_exponent: int, max_value: float, rounding: int):
    def factory() -> Callable[..., Any]:
        def fused(x, scale):
            return F.float_fake_quantize_reference(x, scale, axis, mantissa_bits, min_exponent, max_value, rounding)

        return fused

    return factory


def _float_backward_factory(
    axis: int, mantissa_bits: int, min_exponent: int, max_value: float, rounding: int, need_s: bool
) -> Callable[[], Callable[..., Any]]:
    def factory() -> Callable[..., Any]:
        def fused(grad, x, scale):
            return F.float_fake_quantize_backward_elementwise(
                grad, x, scale, axis, mantissa_bits, min_exponent, max_value, rounding, need_s
            )

        return fused

    return factory


# --------------------------------------------------------------------------- op kernels (CPU)
def fake_quant_linear_cpu(
    x: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, axis: int, quant_min: int, quant_max: int, rounding: int
) -> torch.Tensor:
    """CPU kernel of ``fxq::fake_quant_linear``: fused for large tensors after warm-up, else the reference."""
    ref = F.linear_fake_quantize_reference
    args = (x, scale, offset, axis, quant_min, quant_max, rounding)
    if not _eligible(x, None, scale, offset):
        return ref(*args)
    plan = _linear_plan("linear", x, scale, offset, axis, rounding)
    if plan is None or not _warmed_up():
        return _run_eager(ref, *args)
    key, shape, vaxis = plan
    out = _call_fused(
        key,
        _linear_forward_factory(vaxis, int(rounding)),
        x.detach().view(shape), scale.detach().reshape(-1), offset.detach().reshape(-1), int(quant_min), int(quant_max),
    )  # fmt: skip
    return ref(*args) if out is _FAILED else out.view(x.shape)


def _linear_plan(kind: str, x: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, axis: int,
                 rounding: int) -> tuple[tuple[Any, ...], tuple[int, ...], int] | None:
    """(compiled-graph key, view shape, view axis) of a linear fake-quant of ``x``; None: no fused layout."""
    view = _canonical(x, (scale.numel(), offset.numel()), axis)
    if view is None:
        return None
    shape, vaxis = view
    key = (kind, x.dtype, scale.dtype, offset.dtype, len(shape), vaxis, scale.numel() == 1, offset.numel() == 1)
    return key + (int(rounding),), shape, vaxis


def fake_quant_linear_inplace(
    x: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, axis: int, quant_min: int, quant_max: int, rounding: int
) -> bool:
    """Overwrite ``x`` with ``fxq::fake_quant_linear(x, ...)``: one fused pass, or the eager reference in place.

    For inference on values nobody else reads (no fresh outputs to allocate and fault in: the eager
    reference in place is several times faster than out of place, the fused pass ~1.5x faster than the
    out-of-place fused op). The fused pass is taken on the fused path's terms (large contiguous tensors,
    after warm-up; eager time on large tensors counts towards the warm-up). Returns False, ``x``
    untouched, for tensors it does not handle (gradients, tracing, not a plain float CPU tensor): run the
    op instead.
    """
    if x.requires_grad or not _writable_cpu(x, scale, offset):
        return False
    args = (x, scale, offset, axis, quant_min, quant_max, rounding, True)
    plan = _linear_plan("linear_inplace", x, scale, offset, axis, rounding)
    fusable = plan is not None and _eligible(x, None, scale, offset)
    if fusable and _warmed_up():
        key, shape, vaxis = plan
        done = _call_fused(
            key,
            _into_input(_linear_forward_factory(vaxis, int(rounding))),
            x.detach().view(shape), scale.detach().reshape(-1), offset.detach().reshape(-1), int(quant_min),
            int(quant_max),
        )  # fmt: skip
        if done is not _FAILED:
            return True
    with torch.no_grad():
        if fusable:
            _run_eager(F.linear_fake_quantize_reference, *args)
        else:
            F.linear_fake_quantize_reference(*args)
    return True


def fake_quant_linear_backward_cpu(
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
    """CPU kernel of ``fxq::fake_quant_linear_backward``: fused elementwise part, eager reduction."""
    ref = F.linear_fake_quantize_backward_reference
    args = (grad, x, scale, offset, axis, quant_min, quant_max, rounding, need_scale_grad, need_offset_grad)
    if not _eligible(x, grad, scale, offset):
        return ref(*args)
    plan = _linear_plan("linear_bwd", x, scale, offset, axis, rounding)
    if plan is None or not _warmed_up():
        return _run_eager(ref, *args)
    need_s, need_o = bool(need_scale_grad), bool(need_offset_grad)
    key, shape, vaxis = plan
    key += (need_s, need_o)
    out = _call_fused(
        key,
        _linear_backward_factory(vaxis, int(rounding), need_s, need_o),
        grad.detach().view(shape), x.detach().view(shape), scale.detach().reshape(-1), offset.detach().reshape(-1),
        int(quant_min), int(quant_max),
    )  # fmt: skip
    if out is _FAILED:
        return ref(*args)
    grad_x, prod_s, prod_o = out
    grad_scale = torch.zeros_like(scale) if prod_s is None else F._sum_to_param(prod_s.view(x.shape), scale, axis)
    grad_offset = torch.zeros_like(offset) if prod_o is None else F._sum_to_param(prod_o.view(x.shape), offset, axis)
    return grad_x.view(x.shape), grad_scale, grad_offset


def fake_quant_float_cpu(
    x: torch.Tensor,
    scale: torch.Tensor,
    axis: int,
    mantissa_bits: int,
    min_exponent: int,
    max_value: float,
    rounding: int,
) -> torch.Tensor:
    """CPU kernel of ``fxq::fake_quant_float``: fused for large tensors after warm-up, else the reference."""
    ref = F.float_fake_quantize_reference
    args = (x, scale, axis, mantissa_bits, min_exponent, max_value, rounding)
    if not _eligible(x, None, scale):
        return ref(*args)
    plan = _float_plan("float", x, scale, axis, mantissa_bits, min_exponent, max_value, rounding)
    if plan is None or not _warmed_up():
        return _run_eager(ref, *args)
    key, shape, vaxis, fmt = plan
    factory = _float_forward_factory(vaxis, *fmt, int(rounding))
    out = _call_fused(key, factory, x.detach().view(shape), scale.detach().reshape(-1))
    return ref(*args) if out is _FAILED else out.view(x.shape)


def _float_plan(kind: str, x: torch.Tensor, scale: torch.Tensor, axis: int, mantissa_bits: int, min_exponent: int,
                max_value: float, rounding: int):
    """(compiled-graph key, view shape, view axis, format) of a float fake-quant of ``x``; None: no fused layout."""
    view = _canonical(x, (scale.numel(),), axis)
    if view is None:
        return None
    shape, vaxis = view
    fmt = (int(mantissa_bits), int(min_exponent), float(max_value))
    return (kind, x.dtype, scale.dtype, len(shape), vaxis, scale.numel() == 1, *fmt, int(rounding)), shape, vaxis, fmt


def fake_quant_float_inplace(
    x: torch.Tensor,
    scale: torch.Tensor,
    axis: int,
    mantissa_bits: int,
    min_exponent: int,
    max_value: float,
    rounding: int,
) -> bool:
    """Overwrite ``x`` with ``fxq::fake_quant_float(x, ...)`` in one fused pass (FP8 formats).

    Fused path only (no in-place eager twin of the FP8 reference): False, ``x`` untouched, whenever the fused
    path does not apply; run the op instead.
    """
    if x.requires_grad or not _eligible(x, None, scale) or not _warmed_up():
        return False
    plan = _float_plan("float_inplace", x, scale, axis, mantissa_bits, min_exponent, max_value, rounding)
    if plan is None:
        return False
    key, shape, vaxis, fmt = plan
    done = _call_fused(key, _into_input(_float_forward_factory(vaxis, *fmt, int(rounding))), x.detach().view(shape),
                       scale.detach().reshape(-1))
    return done is not _FAILED


def fake_quant_float_backward_cpu(
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
    """CPU kernel of ``fxq::fake_quant_float_backward``: fused elementwise part, eager reduction."""
    ref = F.float_fake_quantize_backward_reference
    args = (grad, x, scale, axis, mantissa_bits, min_exponent, max_value, rounding, need_scale_grad)
    if not _eligible(x, grad, scale):
        return ref(*args)
    plan = _float_plan("float_bwd", x, scale, axis, mantissa_bits, min_exponent, max_value, rounding)
    if plan is None or not _warmed_up():
        return _run_eager(ref, *args)
    need_s = bool(need_scale_grad)
    key, shape, vaxis, fmt = plan
    key += (need_s,)
    out = _call_fused(
        key,
        _float_backward_factory(vaxis, *fmt, int(rounding), need_s),
        grad.detach().view(shape), x.detach().view(shape), scale.detach().reshape(-1),
    )  # fmt: skip
    if out is _FAILED:
        return ref(*args)
    grad_x, prod_s = out
    grad_scale = torch.zeros_like(scale) if prod_s is None else F._sum_to_param(prod_s.view(x.shape), scale, axis)
    return grad_x.view(x.shape), grad_scale


def _squared_error_factory() -> Callable[[], Callable[..., Any]]:
    def factory() -> Callable[..., Any]:
        def fused(q, f):
            d = q - f
            return (d * d).sum(), (f * f).sum()

        return fused

    return factory


def squared_error_sums(q: torch.Tensor, f: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(sum((q - f)**2), sum(f**2))`` in one fused pass over both tensors, for the analysis metrics.

    None when the fused path does not apply (same gates as the fake-quant ops): compute them eagerly.
    The sums are float32 reductions in the compiled code's order (metrics, not bit-identical results).
    """
    if q.shape != f.shape or not _eligible(q, f) or not _warmed_up():
        return None
    out = _call_fused(("squared_error", q.dtype), _squared_error_factory(), q.detach().view(-1), f.detach().view(-1))
    return None if out is _FAILED else out


_KERNELS = {
    "fxq::fake_quant_linear": fake_quant_linear_cpu,
    "fxq::fake_quant_linear_backward": fake_quant_linear_backward_cpu,
    "fxq::fake_quant_float": fake_quant_float_cpu,
    "fxq::fake_quant_float_backward": fake_quant_float_backward_cpu,
}
_registered = False


def register_cpu_kernels() -> None:
    """Attach the CPU kernels above to the ``fxq::`` ops (idempotent). The reference stays their default."""
    global _registered
    with _state.lock:
        if _registered:
            return
        for op, kernel in _KERNELS.items():
            torch.library.register_kernel(op, "cpu", kernel)
        _registered = True
