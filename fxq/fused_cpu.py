"""Fused CPU path of the ``fxq::`` ops: the torch reference itself, compiled by inductor into one loop.

The eager reference (:mod:`fxq.numeric.reference`) makes one pass over memory per torch op (about ten for the
linear fake-quant). For large CPU tensors the ops' CPU kernels instead run ``torch.compile`` of the very
same reference functions, so there is still one definition of the math; the tests check the compiled
code bit for bit against eager. Parameter gradients keep the eager reduction
(:meth:`fxq.numeric.opspec.OpSpec.reduce`): only the elementwise part is compiled, because a compiled
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

from fxq.numeric.opspec import FLOAT, LINEAR, OP_SPECS, OpSpec

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


def _graph_factory(fn: Callable[..., Any], n_tensors: int, template: tuple[Any, ...], runtime: tuple[int, ...],
                   tail: tuple[Any, ...] = ()) -> Callable[[], Callable[..., Any]]:
    """A factory of ``fused(*tensors, *runtime_attrs) = fn(*tensors, *attrs, *tail)``.

    ``attrs`` is ``template`` with the entries at the ``runtime`` positions taken from the graph's inputs
    (dynamic numbers), the others constants of the graph.
    """

    def factory() -> Callable[..., Any]:
        def fused(*args):
            attrs = list(template)
            for i, v in zip(runtime, args[n_tensors:]):
                attrs[i] = v
            return fn(*args[:n_tensors], *attrs, *tail)

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


# --------------------------------------------------------------------------- op kernels (CPU)
_RUNTIME_ATTRS = {LINEAR.name: ("quant_min", "quant_max")}
"""Attributes an op's compiled graph takes as inputs; the others (axis, rounding, FP8 format) are its constants."""


@dataclasses.dataclass(frozen=True)
class _Plan:
    """How one call runs fused: the compiled graph's key, the view of the tensors, the graph's attributes."""

    key: tuple[Any, ...]
    shape: tuple[int, ...]
    template: tuple[Any, ...]
    runtime: tuple[int, ...]

    def inputs(self, tensors: tuple[torch.Tensor, ...], params: tuple[torch.Tensor, ...]) -> tuple[Any, ...]:
        """The graph's inputs: ``tensors`` (x, grad) viewed, parameters flattened, the runtime attributes."""
        views = tuple(t.detach().view(self.shape) for t in tensors)
        return (*views, *(p.detach().reshape(-1) for p in params), *(self.template[i] for i in self.runtime))

    def factory(self, fn: Callable[..., Any], n_tensors: int, tail: tuple[Any, ...] = ()) -> Callable[..., Any]:
        template = tuple(None if i in self.runtime else v for i, v in enumerate(self.template))
        return _graph_factory(fn, n_tensors, template, self.runtime, tail)


def _plan(spec: OpSpec, kind: str, x: torch.Tensor, params: tuple[torch.Tensor, ...],
          attrs: tuple[Any, ...]) -> _Plan | None:
    """The fused layout of ``spec``'s op on ``x``; None when there is none."""
    view = _canonical(x, tuple(p.numel() for p in params), attrs[0])
    if view is None:
        return None
    shape, vaxis = view
    runtime_names = _RUNTIME_ATTRS.get(spec.name, ())
    typed = [_TYPES[t](v) for (_, t), v in zip(spec.attrs, attrs)]
    template = (vaxis, *typed[1:])
    runtime = tuple(i for i, (name, _) in enumerate(spec.attrs) if name in runtime_names)
    constants = tuple(v for i, v in enumerate(template) if i > 0 and i not in runtime)
    key = (kind, x.dtype, *(p.dtype for p in params), len(shape), vaxis, *(p.numel() == 1 for p in params))
    return _Plan(key + constants, shape, template, runtime)


_TYPES: dict[str, Callable[[Any], Any]] = {"int": int, "float": float}


def _forward_kernel(spec: OpSpec) -> Callable[..., torch.Tensor]:
    """CPU kernel of ``spec``'s forward op: fused for large tensors after warm-up, else the reference."""
    ref = spec.forward

    def kernel(*args: Any) -> torch.Tensor:
        x, params, attrs = spec.split(args)
        if not _eligible(x, None, *params):
            return ref(*args)
        plan = _plan(spec, spec.name, x, params, attrs)
        if plan is None or not _warmed_up():
            return _run_eager(ref, *args)
        out = _call_fused(plan.key, plan.factory(ref, spec.num_tensors), *plan.inputs((x,), params))
        return ref(*args) if out is _FAILED else out.view(x.shape)

    return kernel


def _backward_kernel(spec: OpSpec) -> Callable[..., tuple[torch.Tensor, ...]]:
    """CPU kernel of ``spec``'s backward op: fused elementwise part, eager reduction."""
    ref = spec.backward

    def kernel(*args: Any) -> tuple[torch.Tensor, ...]:
        grad, x, params, attrs, needs = spec.split_backward(args)
        if not _eligible(x, grad, *params):
            return ref(*args)
        plan = _plan(spec, spec.backward_name, x, params, attrs)
        if plan is None or not _warmed_up():
            return _run_eager(ref, *args)
        needs = tuple(bool(n) for n in needs)
        factory = plan.factory(spec.elementwise, 1 + spec.num_tensors, needs)
        out = _call_fused(plan.key + needs, factory, *plan.inputs((grad, x), params))
        return ref(*args) if out is _FAILED else spec.reduce(args, out)

    return kernel


def _inplace_fused(spec: OpSpec, args: tuple[Any, ...]) -> tuple[bool, bool]:
    """Overwrite ``args[0]`` with ``spec``'s op in one fused pass: (done, fusable). ``fusable``: the fused
    path takes this tensor (done or still warming up)."""
    x, params, attrs = spec.split(args)
    if not _writable_cpu(x, *params) or not _eligible(x, None, *params):  # a Parameter is never overwritten
        return False, False
    plan = _plan(spec, f"{spec.name}_inplace", x, params, attrs)
    if plan is None:
        return False, False
    if not _warmed_up():
        return False, True
    factory = _into_input(plan.factory(spec.forward, spec.num_tensors))
    done = _call_fused(plan.key, factory, *plan.inputs((x,), params))
    return done is not _FAILED, True


def fake_quant_linear_inplace(*args: Any) -> bool:
    """Overwrite ``x`` with ``fxq::fake_quant_linear(x, ...)``: one fused pass, or the eager reference in place.

    For inference on values nobody else reads (no fresh outputs to allocate and fault in: the eager
    reference in place is several times faster than out of place, the fused pass ~1.5x faster than the
    out-of-place fused op). The fused pass is taken on the fused path's terms (large contiguous tensors,
    after warm-up; eager time on large tensors counts towards the warm-up). Returns False, ``x``
    untouched, for tensors it does not handle (gradients, tracing, not a plain float CPU tensor): run the
    op instead. ``args``: those of the op.
    """
    x, params, _ = LINEAR.split(args)
    if x.requires_grad or not _writable_cpu(x, *params):
        return False
    done, fusable = _inplace_fused(LINEAR, args)
    if done:
        return True
    with torch.no_grad():
        if fusable:
            _run_eager(LINEAR.forward, *args, True)
        else:
            LINEAR.forward(*args, True)
    return True


def fake_quant_float_inplace(*args: Any) -> bool:
    """Overwrite ``x`` with ``fxq::fake_quant_float(x, ...)`` in one fused pass (FP8 formats).

    Fused path only (no in-place eager twin of the FP8 reference): False, ``x`` untouched, whenever the fused
    path does not apply; run the op instead. ``args``: those of the op.
    """
    if args[0].requires_grad:
        return False
    return _inplace_fused(FLOAT, args)[0]


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


_KERNELS: dict[str, Callable[..., Any]] = {}
for _spec in OP_SPECS:
    _KERNELS[_spec.qualname] = _forward_kernel(_spec)
    _KERNELS[_spec.backward_qualname] = _backward_kernel(_spec)
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
