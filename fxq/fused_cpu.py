"""Fused CPU path of the ``fxq::`` ops: the torch reference itself, compiled by inductor into one loop.

The eager reference (:mod:`fxq.numeric.reference`) makes one pass over memory per torch op (about ten for the
linear fake-quant). For CPU tensors above a few thousand elements, once warmed up, the ops' CPU kernels instead
run the very same reference functions traced over symbolic sizes (``make_fx``) and compiled by inductor
(``torch._inductor.standalone_compile``), so there is still one definition of the math; the tests check the
compiled code bit for bit against eager. A compiled graph is called without dynamo's frame evaluation and, where
it can be, without AOTAutograd's runtime wrappers (inductor's generated ``call`` itself: about 3 us a call on
2 threads, against 10 through the wrappers and 18 for the eager ops on a 64-element tensor); the kernels check
what dynamo's guards would (dtype, layout, rank, parameter layout; the graph is keyed on them). Parameter
gradients keep the eager reduction (:meth:`fxq.numeric.opspec.OpSpec.reduce`): only the elementwise part is
compiled, because a compiled reduction would sum in another order.

When the fused path is taken (all must hold):

* ``FXQ_CPU_FUSED`` is not ``0`` (or :func:`cpu_fusion` turned it on);
* the tensor has at least ``FXQ_CPU_FUSED_MIN_NUMEL`` elements (default 2**12), or a larger tensor of its
  layout has compiled the graph already. Only tensors of ``min_numel`` elements or more compile: a process whose
  tensors are all small (a test suite of small models, a small QAT run) would compile a graph for every layout it
  meets (the README's test command ran 31 % longer on three of its files with a threshold of 2), while a model's
  few small quantizers (pooled features, logits) ride the graphs its activations compiled. The tensor is a
  contiguous float32 or float64 CPU tensor, and no tracing, compiling or dispatch mode is active;
* warm-up is over: compiling costs seconds (about 2 s for the first graph of a process with a warm
  inductor cache, 8-10 s cold, then 0.1-1 s per graph), so tensors first run eagerly until they
  have used ``FXQ_CPU_FUSED_WARMUP_S`` seconds (default 3) of eager time, and only then is anything
  compiled. Short runs never pay the compile; long runs pay it once, at most about twice the optimum.

Throughput: the fused forward reads and writes each element once, on torch's intra-op threads (inductor's
``dynamic_threads``: OpenMP sizes each kernel's parallel region at run time). On 2 threads it takes 1.3-1.7x an
allocating copy (``x.clone()``: 90 against 54 us for 1.2 M float32) plus ~12 us of Python per module call. Much of
the rest on large tensors is first-touch page faults of the fresh output, which torch's
``THP_MEM_ALLOC_ENABLE=1`` or glibc's ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` (set before
starting Python; see the README) remove.

Each (op, rounding, dtype, layout) gets its own compiled graph over dynamic shapes. Per-channel tensors
are viewed as ``(outer, channels, inner)`` with size-1 dimensions dropped, so any rank and axis maps to
one of a few graphs. A call a quantizer repeats on one shape (a model run batch after batch) is bound once the op's
graph exists (:func:`bind`): the binding's graph takes x at its own rank, with its dimensions of size 1 as constants
(one more graph per such pattern, a few per model), so the call needs no view in or out, and a :class:`BoundCall`
checks only what can change between calls; :class:`fxq.nn.FakeQuantize` calls it directly while its own state
stays as it was. Inside a model at batch 1 these steps were worth ~1.3 ms (encoder) and ~1.7 ms (MobileNetV2) a
forward. If compiling fails (no C++ compiler, unsupported platform), one warning is logged
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
from typing import Any, Callable, Iterable, Iterator

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
    "values_only",
    "fusable_layout",
    "plain_eager",
    "KERNELS",
    "BoundCall",
    "bind",
]

log = logging.getLogger(__name__)

ENV_ENABLE = "FXQ_CPU_FUSED"
ENV_MIN_NUMEL = "FXQ_CPU_FUSED_MIN_NUMEL"
ENV_WARMUP_S = "FXQ_CPU_FUSED_WARMUP_S"
DEFAULT_MIN_NUMEL = 1 << 12
DEFAULT_WARMUP_S = 3.0

_FUSED_DTYPES = (torch.float32, torch.float64)
# Pin the floating-point flags the bit-identity relies on (these are inductor's defaults today).
# ``dynamic_threads``: every kernel gets a parallel region sized by OpenMP at run time (torch's thread count of the
# moment). Without it inductor sizes the loops from the traced stand-ins (a few thousand elements) and writes
# serial kernels, so every call ran on one core whatever the tensor.
_INDUCTOR_OPTIONS = {
    "cpp.enable_unsafe_math_opt_flag": False,
    "cpp.enable_floating_point_contract_flag": "off",
    "cpp.dynamic_threads": True,
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
    """Process-wide state of the fused path: settings, warm-up clock, compiled graphs, plans, counters."""

    def __init__(self) -> None:
        self._settings = FusedCpuSettings()
        self._resolved: tuple[bool, int, float] | None = None
        self.lock = threading.Lock()
        self.plans: dict[tuple[Any, ...], _Plan | None] = {}
        self.eager_seconds = 0.0
        self.compiled: dict[tuple[Any, ...], Callable[..., Any]] = {}
        self.unbindable: set[tuple[Any, ...]] = set()  # own-rank graphs that failed to compile (see bind)
        self._broken: str | None = None
        self.off = False
        """The fused path is switched off or broken (a bound call's one check of it; bindings are made only on)."""
        self.stats = {"fused_calls": 0, "eager_calls": 0, "compiles": 0, "compile_seconds": 0.0, "direct_graphs": 0}

    @property
    def broken(self) -> str | None:
        """Why the fused path is off for good in this process (None: it is not)."""
        return self._broken

    @broken.setter
    def broken(self, value: str | None) -> None:
        self._broken = value
        self.off = value is not None or not self.resolved()[0]

    @property
    def settings(self) -> FusedCpuSettings:
        return self._settings

    @settings.setter
    def settings(self, value: FusedCpuSettings) -> None:
        self._settings = value
        self._resolved = None
        self.off = self._broken is not None or not self.resolved()[0]

    def resolved(self) -> tuple[bool, int, float]:
        """(enabled, min_numel, warm-up seconds): the settings with the environment read once per settings."""
        if self._resolved is None:
            self._resolved = self._settings.resolved()
        return self._resolved


_state = _State()


@contextlib.contextmanager
def cpu_fusion(
    enabled: bool = True, min_numel: int | None = None, warmup_seconds: float | None = None
) -> Iterator[FusedCpuSettings]:
    """Temporarily override the fused-path settings (process-wide); restores the previous ones on exit.

    Args:
        enabled: turn the fused path on or off.
        min_numel: smallest tensor that compiles a graph of the fused path (None: keep the current setting);
            smaller ones run on graphs compiled already. ``enabled=False`` keeps every tensor off the fused path.
        warmup_seconds: eager seconds on tensors the fused path takes before compiling (0: compile at once).

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
    """Counters since import: fused and eager calls of tensors the fused path takes, compiles and their seconds,
    compiled graphs called without their wrappers (:func:`_direct_call`)."""
    return dict(_state.stats, eager_seconds=_state.eager_seconds)


# --------------------------------------------------------------------------- eligibility and layout
_jit_tracing = torch._C._is_tracing
_dispatch_modes: Callable[[], int] = getattr(torch._C, "_len_torch_dispatch_stack", lambda: 0)


def _tracing_or_mode_active() -> bool:
    return torch.compiler.is_compiling() or _jit_tracing() or _dispatch_modes() > 0


_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
_ON_DEVICE: dict[str, Callable[[torch.Tensor], bool]] = {"cpu": lambda t: t.is_cpu, "cuda": lambda t: t.is_cuda}
"""Whether a tensor is on a device type, for the types on every call's path: ``t.device`` builds a device object
(~0.8 us), ``t.is_cpu`` reads a flag (~0.1 us)."""


def records_grad(tensors: Iterable[torch.Tensor | None]) -> bool:
    """Whether an op call on ``tensors`` (None entries skipped) records a gradient now: grad mode on and one of
    them requires grad (a training call: QAT's activations, learned scales)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def values_only(tensors: tuple[torch.Tensor, ...], device_type: str = "cpu") -> bool:
    """Whether an op call on these ``tensors`` (all on ``device_type``) needs nothing the dispatcher adds: no
    gradient to record, plain tensors, no tracing, compiling, dispatch or function mode, no functorch transform.
    Then calling the op's kernel (:data:`KERNELS` on CPU, a bound Triton launch on CUDA) directly gives the same
    values and skips the dispatcher's cost (about 10 us a call, more than the arithmetic of a small activation)."""
    return not records_grad(tensors) and plain_eager(tensors, device_type)


def plain_eager(tensors: tuple[torch.Tensor, ...], device_type: str = "cpu") -> bool:
    """Whether an op call on these ``tensors`` (all on ``device_type``) is plain eager torch: plain tensors or
    Parameters, no tracing, compiling, dispatch or function mode, no functorch transform. Then autograd may record
    the device's kernels (:data:`KERNELS` on CPU, the Triton kernels on CUDA) directly (:mod:`fxq.ops`): the custom
    op's dispatch and its autograd wrapper cost about 100 us a call on CPU, forward and backward together, as much
    as the arithmetic of a 200 K-element activation; on a GPU, where a small kernel takes microseconds, they were
    a third of a quantizer's host time."""
    on_device = _ON_DEVICE.get(device_type)
    for t in tensors:
        if type(t) not in _PLAIN_TYPES or not (on_device(t) if on_device else t.device.type == device_type):
            return False
    return not _watched()


def _watched() -> bool:
    """Whether anything watches op calls now: tracing, compiling, a dispatch or function mode, a functorch
    transform (then a call must go through the op)."""
    return _tracing_or_mode_active() or _function_modes() or functorch_transform() is not None


_function_modes = torch._C._is_torch_function_mode_enabled
functorch_transform = torch._C._functorch.peek_interpreter_stack
"""The innermost torch.func transform running now (grad, vmap...), or None."""


def fusable_layout(x: torch.Tensor, *params: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], bool] | None:
    """For a non-contiguous ``x`` of an elementwise values-only call (``params``: its scale and offset) that the
    fused path would take if ``x`` were contiguous: ``x`` laid out contiguously in its own stride order (a view of
    ``x`` when it is a permuted dense tensor, e.g. a transpose; else a copy, e.g. of a slice), the order that puts
    the result back (whose strides are then the ones the op's eager result would have) and whether it is a copy;
    or None. Heads of attention are both: transposed, and slices of one projection."""
    if not _fused_size(x) or x.dtype not in _FUSED_DTYPES or not values_only((x, *params)):
        return None
    order = stride_order(x)
    back = tuple(sorted(range(x.dim()), key=order.__getitem__))
    view = x.permute(order)
    return (view, back, False) if view.is_contiguous() else (view.contiguous(), back, True)


def stride_order(x: torch.Tensor) -> list[int]:
    """``x``'s dims from the largest stride to the smallest: ``x.permute`` of it is contiguous when ``x`` is a
    permuted dense tensor (channels-last, a transpose)."""
    return sorted(range(x.dim()), key=lambda d: -x.stride(d))


def _fused_size(x: torch.Tensor, small: bool = False) -> bool:
    """The fused path is on (not broken) and takes a tensor of ``x``'s size: ``min_numel`` elements or more, or with
    ``small`` any size (such a tensor only rides graphs compiled already, :func:`_small`)."""
    enabled, min_numel, _ = _state.resolved()
    return enabled and _state.broken is None and x.numel() >= (1 if small else max(min_numel, 1))


def _small(x: torch.Tensor) -> bool:
    """Whether ``x`` is below ``min_numel``. Such a tensor runs fused only on a graph that larger tensors of its
    layout had compiled: one compile per layout costs more than the calls of a process whose tensors are all small
    save (tests, toy models), but a model's few small quantizers (pooled features, logits) then cost a bound call
    instead of the eager ops one by one (in a transformer encoder at batch 1: 38-45 us against 100-230 us a call,
    their objects cold after the matrix products)."""
    return x.numel() < _state.resolved()[1]


def _canonical(x: torch.Tensor, numels: tuple[int, ...], axis: int) -> tuple[tuple[int, ...], int] | None:
    """A view shape of ``x`` and the channel axis in it; parameters broadcast the same way on both.

    Scalars (every parameter has one entry) view ``x`` as 1-D. Per channel: ``(outer, C, inner)`` with the
    size-1 ends dropped, so no dimension of size 1 makes the dynamic-shape graph specialise.
    """
    channels = max(numels)
    if channels == 1:
        return ((x.numel(),), 0) if x.numel() > 1 else None
    if x.dim() == 0 or any(n not in (1, channels) for n in numels):
        return None
    ax = axis % x.dim()
    if x.shape[ax] != channels:
        return None
    outer, inner = math.prod(x.shape[:ax]), math.prod(x.shape[ax + 1 :])
    shape = tuple(d for d in (outer, channels, inner) if d != 1)
    return shape, (0 if outer == 1 else 1)


def _eligible(x: torch.Tensor, grad: torch.Tensor | None, *params: torch.Tensor, small: bool = False) -> bool:
    """Large contiguous float32/float64 CPU ``x`` (and ``grad``, or any second operand, like it), plain
    tensors or a weight ``nn.Parameter`` as ``x``, nothing tracing. ``small``: of any size (see :func:`_small`)."""
    if not _fused_size(x, small):
        return False
    if grad is not None and (grad.dtype != x.dtype or grad.shape != x.shape or not grad.is_contiguous()):
        return False
    # a weight Parameter as x is only read here (the kernels detach it), so it is as plain as a tensor
    return _plain_cpu(x, params if grad is None else (*params, grad), _PLAIN_TYPES)


def _writable_cpu(x: torch.Tensor, *params: torch.Tensor) -> bool:
    """A plain contiguous float32/float64 CPU ``x`` with plain CPU parameters, nothing tracing."""
    return _plain_cpu(x, params, (torch.Tensor,))


def _plain_cpu(x: torch.Tensor, others: tuple[torch.Tensor, ...], x_types: tuple[type, ...]) -> bool:
    """A contiguous float32/float64 CPU ``x`` of one of ``x_types``, plain CPU tensors or ``nn.Parameter``s
    ``others`` (learned scales and offsets of LSQ / QAT: the kernels only read them, detached), nothing
    tracing."""
    if type(x) not in x_types or x.dtype not in _FUSED_DTYPES or not x.is_cpu or not x.is_contiguous():
        return False
    for t in others:  # a strided parameter (every other entry of a tensor) is not the layout the graph asserts
        if type(t) not in _PLAIN_TYPES or not t.is_cpu or not t.is_contiguous():
            return False
    return not _tracing_or_mode_active()


def _warmed_up() -> bool:
    return _state.eager_seconds >= _state.resolved()[2]


def _run_eager(fn: Callable[..., Any], *args: Any) -> Any:
    start = time.perf_counter()
    out = fn(*args)
    _state.eager_seconds += time.perf_counter() - start
    _state.stats["eager_calls"] += 1
    return out


# --------------------------------------------------------------------------- compiled graphs
_EXAMPLE_SIZES = (11, 13, 17, 3, 19, 2)
"""Sizes of the stand-in tensors a graph is traced on: distinct, above 1 and none of :data:`_EXAMPLE_INTS`, because
a graph traced over symbolic sizes assumes that numbers equal at tracing stay equal (a size and a clamp bound
included) and that no size is 0 or 1 (a dimension of size 1 in the plan is 1 in the stand-ins too: the graph is
made for it). Small after the third, so a rank-6 stand-in stays small."""
_EXAMPLE_INTS = (-5, 7)
"""Stand-ins for the integer attributes a graph takes as inputs (clamp bounds the stand-in data crosses)."""


def _inductor_options() -> dict[str, Any]:
    from torch._inductor import config as inductor_config

    return {k: v for k, v in _INDUCTOR_OPTIONS.items() if hasattr(inductor_config.cpp, k.split(".", 1)[1])}


def _unsaved_artifact(record: logging.LogRecord) -> bool:
    """Drop standalone_compile's warning that it cannot build a saveable artifact (it cannot when inductor's FX
    graph cache is off): fxq keeps its compiled graphs in memory and never saves them."""
    return "artifact generation failed" not in record.getMessage()


def _compile_graph(fn: Callable[..., Any], examples: list[Any], exact: bool) -> Callable[..., Any]:
    """``fn`` traced over symbolic sizes on ``examples`` and compiled by inductor, checked against ``fn`` on them.

    ``torch._inductor.standalone_compile`` of the traced aten graph gives a callable without dynamo's frame
    evaluation and guards: the callers check what a guard would (dtype, rank, layout; :class:`_Plan`). Where the
    graph's generated code can be called directly (:func:`_direct_call`), that is what is returned. The check on
    the stand-ins (bit for bit when ``exact``) catches a graph that got specialised on them."""
    from torch.fx.experimental.proxy_tensor import make_fx

    graph = make_fx(fn, tracing_mode="symbolic")(*_copies(examples))
    standalone_log = logging.getLogger("torch._inductor.standalone_compile")
    standalone_log.addFilter(_unsaved_artifact)
    try:
        compiled = torch._inductor.standalone_compile(graph, _copies(examples),
                                                      options={"config_patches": _inductor_options()})
    finally:
        standalone_log.removeFilter(_unsaved_artifact)
    ran = _copies(examples)
    got, want = compiled(*ran), fn(*_copies(examples))
    if exact:
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    else:
        torch.testing.assert_close(got, want, equal_nan=True)
    direct = _direct_call(compiled, examples, ran, got)
    if direct is None:
        return compiled
    _state.stats["direct_graphs"] += 1
    return direct


def _generated_call(compiled: Any) -> Callable[[list[Any]], Any] | None:
    """The ``call(args)`` function inductor generated for ``compiled`` (the ``current_callable`` of its
    ``CompiledFxGraph``, or of the function AOTAutograd's cache loads), found through the wrappers' closures and
    attributes; None where this torch builds it otherwise."""
    todo, seen = [getattr(compiled, "_compiled_fn", None)], set()
    while todo and len(seen) < 64:
        obj = todo.pop()
        if obj is None or id(obj) in seen:
            continue
        seen.add(id(obj))
        attrs = getattr(obj, "__dict__", None) or {}
        found = attrs.get("current_callable")
        if callable(found):
            return found
        for cell in getattr(obj, "__closure__", None) or ():
            try:
                todo.append(cell.cell_contents)
            except ValueError:  # an empty cell
                pass
        todo.extend(v for v in attrs.values() if callable(v) and not isinstance(v, type))
    return None


def _direct_call(compiled: Any, examples: list[Any], ran: list[Any], got: Any) -> Callable[..., Any] | None:
    """``compiled`` without AOTAutograd's runtime wrappers and inductor's call bookkeeping, which cost ~6 us a call,
    as much as the kernel on a 50 K-element activation: the generated ``call`` itself, plus the one thing of the
    wrappers' it needs: a graph that writes an input (the in-place twin) bumps that input's version counter, so
    autograd still refuses a backward through the overwritten values. Used only when, on copies of the stand-ins
    ``examples``, it has the wrapped call's effect: bit for bit the outputs ``got``, the same outputs that are
    inputs, its inputs left as the wrapped call left ``ran`` (values and versions); else None (the wrappers had
    other work to do, or this torch calls its graphs otherwise)."""
    try:
        call = _generated_call(compiled)
        if call is None:
            return None
        args = _copies(examples)
        out = call(list(args))
        written = [i for i, (a, r) in enumerate(zip(args, ran)) if isinstance(a, torch.Tensor)
                   and r._version > a._version]
        for i in written:
            torch.autograd.graph.increment_version(args[i])
        single = isinstance(got, torch.Tensor)
        mine, theirs = ([out[0]], [got]) if single else (list(out), list(got))
        same = (len(mine) == len(theirs) and all(_same_tensor(a, b) for a, b in zip(mine + args, theirs + ran))
                and _aliases(mine, args) == _aliases(theirs, ran))
    except Exception:  # another calling convention in this torch: keep the wrapped callable
        log.debug("fxq fused CPU: the generated call cannot be used directly", exc_info=True)
        return None
    if not same:
        return None

    if single and not written:  # the out-of-place graph of every bound call: the fewest steps

        def direct(*args: Any) -> Any:
            return call(list(args))[0]

        return direct

    def direct(*args: Any) -> Any:
        out = call(list(args))
        for i in written:
            torch.autograd.graph.increment_version(args[i])
        return out[0] if single else tuple(out)

    return direct


def _aliases(outputs: list[Any], inputs: list[Any]) -> list[list[bool]]:
    """For each output, which inputs it shares its storage with."""
    return [[isinstance(o, torch.Tensor) and isinstance(i, torch.Tensor) and o.data_ptr() == i.data_ptr()
             for i in inputs] for o in outputs]


_SAME_SIZE_INTS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _same_tensor(a: Any, b: Any) -> bool:
    """Both are tensors of one dtype, shape, strides, version and bit pattern, or both the same non-tensor."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor) and a == b
    if a.dtype != b.dtype or a.shape != b.shape or a.stride() != b.stride() or a._version != b._version:
        return False
    if a.is_floating_point():  # -0 / +0, inf / the largest float and NaN payloads differ in bits
        bits = _SAME_SIZE_INTS[a.element_size()]
        a, b = a.contiguous().view(bits), b.contiguous().view(bits)
    return torch.equal(a, b)


def _copies(args: list[Any]) -> list[Any]:
    return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]


def _compiled(key: tuple[Any, ...], build: Callable[[], tuple[Callable[..., Any], list[Any]]],
              exact: bool) -> Callable[..., Any]:
    """The graph for ``key``, compiled (and counted, logged) the first time."""
    fn = _state.compiled.get(key)
    if fn is None:
        with _state.lock:
            fn = _state.compiled.get(key)
            if fn is None:
                start = time.perf_counter()
                fn = _compile_graph(*build(), exact)
                _state.compiled[key] = fn
                seconds = time.perf_counter() - start
                _state.stats["compiles"] += 1
                _state.stats["compile_seconds"] += seconds
                log.info("fxq fused CPU graph %s compiled in %.1f s", key, seconds)
    return fn


_FAILED = object()
"""What :func:`_call_fused` returns when the fused path failed (then it stays off)."""


def _call_fused(key: tuple[Any, ...], build: Callable[[], tuple[Callable[..., Any], list[Any]]], *args: Any,
                exact: bool = True) -> Any:
    """Run the compiled graph for ``key`` on ``args``; :data:`_FAILED` if the fused path failed (then it stays off).

    ``build()`` gives the function to compile and stand-in arguments to trace it on (:func:`_compile_graph`); it
    is only called for a graph not compiled yet. The graphs run without autograd: their callers pass values and
    get values (the ops' autograd is outside them)."""
    fn = _state.compiled.get(key)
    try:
        if fn is None:
            fn = _compiled(key, build, exact)
        if torch.is_grad_enabled():
            with torch.no_grad():
                out = fn(*args)
        else:
            out = fn(*args)
    except Exception as exc:  # compiler missing or broken: never fail the op because of the fast path
        _state.broken = f"{type(exc).__name__}: {exc}"
        log.warning(
            "fxq fused CPU path disabled for this process (%s); running the eager torch reference. "
            "Set %s=0 to skip the attempt.",
            _state.broken.splitlines()[0][:300],
            ENV_ENABLE,
        )
        return _FAILED
    _state.stats["fused_calls"] += 1
    return out


def _graph_fn(fn: Callable[..., Any], n_tensors: int, template: tuple[Any, ...], runtime: tuple[int, ...],
              tail: tuple[Any, ...] = ()) -> Callable[..., Any]:
    """``fused(*tensors, *runtime_attrs) = fn(*tensors, *attrs, *tail)``: ``attrs`` is ``template`` with the entries
    at the ``runtime`` positions taken from the graph's inputs (dynamic numbers), the others constants of the graph.
    """

    def fused(*args):
        attrs = list(template)
        for i, v in zip(runtime, args[n_tensors:]):
            attrs[i] = v
        return fn(*args[:n_tensors], *attrs, *tail)

    return fused


def _into_input(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` writing its result into its first argument (an in-place twin, one pass)."""

    def fused(x, *args):
        return x.copy_(fn(x, *args))

    return fused


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

    def inputs(self, tensors: tuple[torch.Tensor, ...], params: tuple[torch.Tensor, ...]) -> list[Any]:
        """The graph's inputs: ``tensors`` (x, grad) viewed, parameters flattened, the runtime attributes.

        Detached where they require grad, so the graph's guards see the same kind of tensor every call."""
        out: list[Any] = []
        flat = len(self.shape) == 1  # view(-1) parses no size list: ~1 us less a call than view(shape)
        for t in tensors:
            t = t.detach() if t.requires_grad else t
            out.append(t.view(-1) if flat else t.view(self.shape))
        for p in params:
            p = p.detach() if p.requires_grad else p
            out.append(p if p.dim() == 1 else p.reshape(-1))
        out.extend(self.template[i] for i in self.runtime)
        return out

    def stand_ins(self, tensors: tuple[torch.Tensor, ...], params: tuple[torch.Tensor, ...]) -> list[Any]:
        """Stand-ins for :meth:`inputs` to trace the graph on (see :func:`_compile_graph`): the same ranks,
        dtypes and parameter layout, other sizes."""
        gen = torch.Generator().manual_seed(0)
        dims = tuple(1 if d == 1 else size for d, size in zip(self.shape, _EXAMPLE_SIZES))
        channels = dims[self.template[0]]
        out: list[Any] = [torch.randn(dims, generator=gen, dtype=t.dtype) * 4 for t in tensors]
        out += [torch.rand(1 if p.numel() == 1 else channels, generator=gen, dtype=p.dtype) + 0.05 for p in params]
        out += _EXAMPLE_INTS[: len(self.runtime)]
        return out

    def graph_fn(self, fn: Callable[..., Any], n_tensors: int, tail: tuple[Any, ...] = ()) -> Callable[..., Any]:
        """The function this plan's graph compiles: ``fn`` over the graph's inputs (see :func:`_graph_fn`)."""
        template = tuple(None if i in self.runtime else v for i, v in enumerate(self.template))
        return _graph_fn(fn, n_tensors, template, self.runtime, tail)


_PLAN_CACHE_SIZE = 4096


def _plan(spec: OpSpec, kind: str, x: torch.Tensor, params: tuple[torch.Tensor, ...],
          attrs: tuple[Any, ...]) -> _Plan | None:
    """The fused layout of ``spec``'s op on ``x``; None when there is none. Remembered per shape and
    attributes: a model calls each quantizer with the same few shapes, and planning costs more than the lookup."""
    cache_key = (kind, x.shape, x.dtype, *(p.shape for p in params), *(p.dtype for p in params), *attrs)
    try:
        return _state.plans[cache_key]
    except KeyError:
        pass
    plan = _make_plan(spec, kind, x, params, attrs)
    if len(_state.plans) >= _PLAN_CACHE_SIZE:
        _state.plans.clear()
    _state.plans[cache_key] = plan
    return plan


def _make_plan(spec: OpSpec, kind: str, x: torch.Tensor, params: tuple[torch.Tensor, ...],
               attrs: tuple[Any, ...]) -> _Plan | None:
    view = _canonical(x, tuple(p.numel() for p in params), attrs[0])
    if view is None:
        return None
    shape, vaxis = view
    key = (kind, x.dtype, *(p.dtype for p in params), len(shape), vaxis, *(p.numel() == 1 for p in params))
    return _attributed_plan(spec, key, shape, vaxis, attrs)


def _attributed_plan(spec: OpSpec, key: tuple[Any, ...], shape: tuple[int, ...], axis: int,
                     attrs: tuple[Any, ...]) -> _Plan:
    """The plan of a graph keyed ``key`` over tensors viewed as ``shape`` (channels on ``axis``): the op's attributes
    ``attrs`` typed, the runtime ones the graph's inputs, the others its constants (part of its key)."""
    runtime_names = _RUNTIME_ATTRS.get(spec.name, ())
    typed = [_TYPES[t](v) for (_, t), v in zip(spec.attrs, attrs)]
    template = (axis, *typed[1:])
    runtime = tuple(i for i, (name, _) in enumerate(spec.attrs) if name in runtime_names)
    constants = tuple(v for i, v in enumerate(template) if i > 0 and i not in runtime)
    return _Plan(key + constants, shape, template, runtime)


def _own_rank_plan(spec: OpSpec, x: torch.Tensor, params: tuple[torch.Tensor, ...],
                   attrs: tuple[Any, ...]) -> _Plan | None:
    """The fused layout of a bound call (:func:`bind`): ``x`` at its own shape, the graph made for its rank and its
    dimensions of size 1 (their sizes are constants of the graph, the others symbolic), so neither a view in nor
    one out is needed; for a bound call, which has one shape, they cost more than a small activation's arithmetic
    (measured inside a model: ~16 us a call, their objects cold in the caches). None where there is none."""
    numels = tuple(p.numel() for p in params)
    channels = max(numels)
    if not 0 < x.dim() <= len(_EXAMPLE_SIZES) or x.numel() <= 1 or any(n not in (1, channels) for n in numels):
        return None
    axis = attrs[0] % x.dim()
    if channels > 1 and x.shape[axis] != channels:
        return None
    ones = tuple(d == 1 for d in x.shape)
    key = ("own_rank", spec.name, x.dtype, *(p.dtype for p in params), ones, axis if channels > 1 else None,
           *(n == 1 for n in numels))
    return _attributed_plan(spec, key, tuple(x.shape), axis, attrs)


_TYPES: dict[str, Callable[[Any], Any]] = {"int": int, "float": float}


def _forward_kernel(spec: OpSpec) -> Callable[..., torch.Tensor]:
    """CPU kernel of ``spec``'s forward op: fused after warm-up where the fused path takes the tensor, else the
    reference."""
    ref = spec.forward

    n_tensors = spec.num_tensors

    def kernel(*args: Any) -> torch.Tensor:
        x, params = args[0], args[1:n_tensors]
        if not _eligible(x, None, *params, small=True):
            return ref(*args)
        plan, small = _plan(spec, spec.name, x, params, args[n_tensors:]), _small(x)
        if plan is None or not _warmed_up() or (small and plan.key not in _state.compiled):
            return ref(*args) if small else _run_eager(ref, *args)
        out = _call_fused(plan.key, lambda: (plan.graph_fn(ref, n_tensors), plan.stand_ins((x,), params)),
                          *plan.inputs((x,), params))
        return ref(*args) if out is _FAILED else out.view_as(x)

    return kernel


def _backward_kernel(spec: OpSpec) -> Callable[..., tuple[torch.Tensor, ...]]:
    """CPU kernel of ``spec``'s backward op: fused elementwise part, eager reduction."""
    ref = spec.backward

    def kernel(*args: Any) -> tuple[torch.Tensor, ...]:
        grad, x, params, attrs, needs = spec.split_backward(args)
        if not _eligible(x, grad, *params, small=True):
            return ref(*args)
        plan = _plan(spec, spec.backward_name, x, params, attrs)
        needs, small = tuple(bool(n) for n in needs), _small(x)
        if plan is None or not _warmed_up() or (small and plan.key + needs not in _state.compiled):
            return ref(*args) if small else _run_eager(ref, *args)
        out = _call_fused(plan.key + needs, lambda: (plan.graph_fn(spec.elementwise, 1 + spec.num_tensors, needs),
                                                     plan.stand_ins((grad, x), params)),
                          *plan.inputs((grad, x), params))
        return ref(*args) if out is _FAILED else spec.reduce(args, out)

    return kernel


def _inplace_fused(spec: OpSpec, args: tuple[Any, ...]) -> tuple[bool, bool]:
    """Overwrite ``args[0]`` with ``spec``'s op in one fused pass: (done, fusable). ``fusable``: the fused
    path takes this tensor (done or still warming up)."""
    x, params, attrs = spec.split(args)
    if type(x) is not torch.Tensor or not _eligible(x, None, *params):  # a Parameter is never overwritten
        return False, False
    plan = _plan(spec, f"{spec.name}_inplace", x, params, attrs)
    if plan is None:
        return False, False
    if not _warmed_up():
        return False, True
    done = _call_fused(plan.key, lambda: (_into_input(plan.graph_fn(spec.forward, spec.num_tensors)),
                                          plan.stand_ins((x,), params)),
                       *plan.inputs((x,), params))
    return done is not _FAILED, True


@dataclasses.dataclass(frozen=True)
class BoundCall:
    """One forward op call planned and compiled once, for the same call repeated on tensors of one shape (a
    quantizer of a model run batch after batch): :meth:`run` skips the dispatcher and the kernel's planning,
    which cost more than the compiled graph itself on small activations. Made by :func:`bind`."""

    tag: Any
    shape: torch.Size
    dtype: torch.dtype
    params: tuple[torch.Tensor, ...]
    param_shapes: tuple[torch.Size, ...]
    param_data: tuple[int, ...]
    plan: _Plan
    fn: Callable[..., Any]
    tail: tuple[Any, ...]
    """The graph's inputs after ``x``: the parameters as :meth:`_Plan.inputs` gives them (views of ``params``, whose
    storage ``param_data`` records), then the runtime attributes."""

    def run(self, x: torch.Tensor, params: tuple[torch.Tensor, ...], tag: Any) -> torch.Tensor | None:
        """The op's values on ``x``, or None when this binding does not hold for the call: another ``tag`` (the
        caller's attributes), other parameter tensors, shapes or storage, another kind, shape, dtype or layout of
        ``x``, the fused path switched off, or anything :func:`values_only` refuses (gradients, tracing, modes).
        Written as few Python steps as it can be: a model runs it for every quantizer, with its code and objects
        cold in the caches after the convolutions in between (measured in a transformer encoder: 5x the time of the
        same steps in a loop)."""
        if (type(x) is not torch.Tensor or x.requires_grad or x.shape != self.shape or x.dtype != self.dtype
                or not x.is_cpu or not x.is_contiguous() or (tag is not self.tag and tag != self.tag) or _state.off):
            return None  # x that requires grad: the graph takes values (the op detaches it), even without grad on
        for p, mine, shape, data in zip(params, self.params, self.param_shapes, self.param_data):
            if p is not mine or p.shape != shape or p.data_ptr() != data:
                return None
        # the same Parameter may have been made to require grad since
        if (torch.is_grad_enabled() and any(p.requires_grad for p in params)) or _watched():
            return None
        _state.stats["fused_calls"] += 1
        return self.fn(x, *self.tail)


def bind(spec: OpSpec, args: tuple[Any, ...], tag: Any) -> BoundCall | None:
    """A :class:`BoundCall` of ``spec``'s forward op for calls like ``args`` (tagged ``tag``), or None where the
    fused path does not take this call now (size and kind of tensor, warm-up, the op's own graph not compiled yet)
    or a graph of x's own rank cannot be had: ranks above 6 (their stand-ins would be large), or a compile that
    failed (that layout stays unbound, the fused path on). Compiles that graph the first time a layout is bound
    (checked on stand-ins, not run on x). A small ``x`` (:func:`_small`) compiles nothing: it binds to the op's own
    graph, through views, where its own-rank graph was not compiled for a larger tensor."""
    n = spec.num_tensors
    x, params = args[0], tuple(args[1:n])
    if type(x) is not torch.Tensor or not _eligible(x, None, *params, small=True) or not _warmed_up():
        return None
    if records_grad((x, *params)):
        return None  # training calls (QAT) go through the op's autograd every time: no planning for them
    flat = _plan(spec, spec.name, x, params, args[n:])
    if flat is None or flat.key not in _state.compiled or not values_only(args[:n]):
        return None  # the op's own graph first: a call the kernel never ran fused gets no graph of its own
    plan = _own_rank_plan(spec, x, params, args[n:])
    if plan is None or plan.key in _state.unbindable:
        return None
    if _small(x) and plan.key not in _state.compiled:  # it compiles nothing: the op's own graph, through views
        fn, shape, out_shape = _state.compiled[flat.key], flat.shape, x.shape
        return BoundCall(tag, x.shape, x.dtype, params, tuple(p.shape for p in params),
                         tuple(p.data_ptr() for p in params), flat,
                         lambda t, *tail: fn(t.view(shape), *tail).view(out_shape),
                         tuple(flat.inputs((x,), params)[1:]))
    try:
        fn = _compiled(plan.key, lambda: (plan.graph_fn(spec.forward, n), plan.stand_ins((x,), params)), True)
    except Exception:  # this layout only: the op's own graphs work (they ran), so the fused path stays on
        log.debug("fxq fused CPU: no graph of rank %d for %s; its calls stay unbound", x.dim(), plan.key,
                  exc_info=True)
        _state.unbindable.add(plan.key)
        return None
    return BoundCall(tag, x.shape, x.dtype, params, tuple(p.shape for p in params),
                     tuple(p.data_ptr() for p in params), plan, fn, tuple(plan.inputs((x,), params)[1:]))


def fake_quant_linear_inplace(*args: Any) -> bool:
    """Overwrite ``x`` with ``fxq::fake_quant_linear(x, ...)``: one fused pass, or the eager reference in place.

    For inference on values nobody else reads (no fresh outputs to allocate and fault in: the eager
    reference in place is several times faster than out of place, the fused pass ~1.5x faster than the
    out-of-place fused op). The fused pass is taken on the fused path's terms (contiguous tensors of at least
    ``min_numel`` elements, after warm-up; eager time on such tensors counts towards the warm-up). Returns False,
    ``x`` untouched, for tensors it does not handle (gradients, tracing, not a plain float CPU tensor): run the
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


def _squared_error(q: torch.Tensor, f: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    d = q - f
    return (d * d).sum(), (f * f).sum()


def squared_error_sums(q: torch.Tensor, f: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(sum((q - f)**2), sum(f**2))`` in one fused pass over both tensors, for the analysis metrics.

    None when the fused path does not apply (same gates as the fake-quant ops): compute them eagerly.
    The sums are float32 reductions in the compiled code's order (metrics, not bit-identical results).
    """
    if q.shape != f.shape or not _eligible(q, f) or not _warmed_up():
        return None

    def build() -> tuple[Callable[..., Any], list[torch.Tensor]]:
        gen = torch.Generator().manual_seed(0)
        return _squared_error, [torch.randn(_EXAMPLE_SIZES[0], generator=gen, dtype=q.dtype) for _ in range(2)]

    out = _call_fused(("squared_error", q.dtype), build, q.detach().view(-1), f.detach().view(-1), exact=False)
    return None if out is _FAILED else out


KERNELS: dict[str, Callable[..., Any]] = {}
"""The CPU kernel of every ``fxq::`` op (forward and backward), by qualified name."""
for _spec in OP_SPECS:
    KERNELS[_spec.qualname] = _forward_kernel(_spec)
    KERNELS[_spec.backward_qualname] = _backward_kernel(_spec)
_registered = False


def register_cpu_kernels() -> None:
    """Attach the CPU kernels above to the ``fxq::`` ops (idempotent). The reference stays their default."""
    global _registered
    with _state.lock:
        if _registered:
            return
        for op, kernel in KERNELS.items():
            torch.library.register_kernel(op, "cpu", kernel)
        _registered = True
