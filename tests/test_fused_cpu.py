"""The fused CPU path: compiled reference == eager reference, bit for bit; and it is only taken when asked.

Every compiled graph costs seconds, so the bit-identity tests force a few small tensors through a
handful of graphs (``cpu_fusion(min_numel=0, warmup_seconds=0)``); the rest checks the gates cheaply.
"""
from __future__ import annotations

import logging
import os
import threading
import time

import pytest
import torch

import fxq.ops  # registers torch.ops.fxq and the CPU kernels
from fxq import functional as F
from fxq import fused_cpu
from fxq.fused_cpu import FusedCpuSettings, cpu_fusion, fused_cpu_stats
from fxq.spec import FloatFormat, RoundingPolicy

_BITS = {torch.float64: torch.int64, torch.float32: torch.int32}
op = torch.ops.fxq


def assert_bit_identical(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Same dtype/shape, torch.equal off NaN, NaN where NaN, and equal bit patterns off zero."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    nan = expected.isnan()
    assert torch.equal(actual.isnan(), nan), what
    a, e = actual[~nan], expected[~nan]
    assert torch.equal(a, e), f"{what}: {int((a != e).sum())} values differ"
    zero = e == 0
    assert torch.equal(a[~zero].view(_BITS[a.dtype]), e[~zero].view(_BITS[e.dtype])), what


def _x(shape: tuple[int, ...], scale: torch.Tensor, axis: int, spread: float) -> torch.Tensor:
    """Random values with exact ties (+-0.5, +-1.5, +-2.5 steps), +-0, NaN, +-inf and clipped values."""
    x = torch.randn(shape) * spread
    s = F.broadcast_qparam(scale, x, axis).expand(shape).reshape(-1)
    flat = x.view(-1)
    specials = torch.tensor([0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 0.0, -0.0, 1e6, -1e6])
    idx = torch.randperm(flat.numel())[: 2 * specials.numel()]
    flat[idx] = specials.repeat(2) * s[idx]
    flat[:4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.5 + 2**-25])
    return x


@pytest.fixture
def forced():
    """Every tensor takes the fused path, compiled at once."""
    with cpu_fusion(min_numel=0, warmup_seconds=0):
        yield


def _fused_calls() -> int:
    return int(fused_cpu_stats()["fused_calls"])


# (name, shape, axis, channels, rounding, dtype): per-tensor, per-channel 3-D view, per-channel 2-D view
LINEAR_CASES = [
    ("tensor-half_even", (6, 50), 0, 1, RoundingPolicy.HALF_EVEN, torch.float32),
    ("axis1-towards_zero", (2, 5, 7, 3), 1, 5, RoundingPolicy.HALF_TOWARDS_ZERO, torch.float32),
    ("axis0-half_up-f64", (9, 40), 0, 9, RoundingPolicy.HALF_UP, torch.float64),
]


@pytest.mark.parametrize("case", LINEAR_CASES, ids=[c[0] for c in LINEAR_CASES])
def test_fused_linear_matches_eager(forced, case):
    _, shape, axis, channels, rounding, dtype = case
    scale = torch.pow(2.0, -(torch.arange(channels) % 4) - 1.0)
    offset = torch.randint(0, 30, (channels,)).float()
    x = _x(shape, scale, axis, 40.0).to(dtype)
    g = torch.randn(shape, dtype=dtype)
    args = (axis, 0, 255, int(rounding))
    before = _fused_calls()
    y = op.fake_quant_linear(x, scale, offset, *args)
    gx, gs, go = op.fake_quant_linear_backward(g, x, scale, offset, *args, True, True)
    assert _fused_calls() == before + 2, "the fused path was not taken"
    assert_bit_identical(y, F.linear_fake_quantize_reference(x, scale, offset, *args), "y")
    x_in_place = x.clone()
    assert fused_cpu.fake_quant_linear_inplace(x_in_place, scale, offset, *args)
    assert_bit_identical(x_in_place, y, "in place")
    want = F.linear_fake_quantize_backward_reference(g, x, scale, offset, *args, True, True)
    for name, a, e in zip(("grad_x", "grad_scale", "grad_offset"), (gx, gs, go), want):
        assert_bit_identical(a, e, name)


def test_fused_float_matches_eager(forced):
    fmt = FloatFormat.E4M3
    scale = torch.rand(5) * 0.01 + 1e-3
    x = _x((4, 5, 9), scale, 1, 1.0)
    g = torch.randn(4, 5, 9)
    args = (1, fmt.mantissa_bits, fmt.min_exponent, fmt.max_value, int(RoundingPolicy.HALF_EVEN))
    before = _fused_calls()
    y = op.fake_quant_float(x, scale, *args)
    gx, gs = op.fake_quant_float_backward(g, x, scale, *args, True)
    assert _fused_calls() == before + 2
    assert_bit_identical(y, F.float_fake_quantize_reference(x, scale, *args), "y")
    x_in_place = x.clone()
    assert fused_cpu.fake_quant_float_inplace(x_in_place, scale, *args)
    assert_bit_identical(x_in_place, y, "in place")
    want = F.float_fake_quantize_backward_reference(g, x, scale, *args, True)
    assert_bit_identical(gx, want[0], "grad_x")
    assert_bit_identical(gs, want[1], "grad_scale")


def test_fused_path_through_autograd(forced):
    """FakeQuantize-style use: the op's autograd calls the backward op, which is fused too."""
    x = torch.randn(6, 50, requires_grad=True)
    scale = torch.tensor([0.125], requires_grad=True)
    offset = torch.tensor([0.0])
    y = op.fake_quant_linear(x, scale, offset, 0, -128, 127, int(RoundingPolicy.HALF_EVEN))
    (y * torch.arange(300.0).view(6, 50)).sum().backward()
    with cpu_fusion(enabled=False):
        x2, s2 = x.detach().clone().requires_grad_(True), scale.detach().clone().requires_grad_(True)
        y2 = op.fake_quant_linear(x2, s2, offset, 0, -128, 127, int(RoundingPolicy.HALF_EVEN))
        (y2 * torch.arange(300.0).view(6, 50)).sum().backward()
    assert_bit_identical(y.detach(), y2.detach())
    assert_bit_identical(x.grad, x2.grad)
    assert_bit_identical(scale.grad, s2.grad)


def test_weight_parameters_take_the_fused_path(forced):
    """QAT's weight quantizers read an ``nn.Parameter``: fused forward and backward, values of the reference; the
    parameter itself is never written."""
    w = torch.nn.Parameter(torch.randn(8, 3, 3, 3))
    w0 = w.detach().clone()
    scale = torch.rand(8, requires_grad=True) * 0.05 + 0.01
    scale.retain_grad()
    offset = torch.zeros(8)
    args = (0, -127, 127, int(RoundingPolicy.HALF_EVEN))
    before = _fused_calls()
    y = op.fake_quant_linear(w, scale, offset, *args)
    (y * torch.arange(float(w.numel())).view(w.shape)).sum().backward()
    assert _fused_calls() == before + 2, "the fused path was not taken"
    assert torch.equal(w.detach(), w0)
    with cpu_fusion(enabled=False):
        w2 = torch.nn.Parameter(w0.clone())
        s2 = scale.detach().clone().requires_grad_(True)
        y2 = op.fake_quant_linear(w2, s2, offset, *args)
        (y2 * torch.arange(float(w.numel())).view(w.shape)).sum().backward()
    assert_bit_identical(y.detach(), y2.detach())
    assert_bit_identical(w.grad, w2.grad)
    assert_bit_identical(scale.grad, s2.grad)


def test_learned_scale_and_offset_parameters_take_the_fused_path(forced):
    """LSQ and QAT learn a quantizer's scale and offset as ``nn.Parameter``s (``make_learnable``): fused forward
    and backward, values and gradients of the reference, the parameters never written. The kernels used to
    accept only plain tensors there, so every learned quantizer ran the eager reference."""
    x = torch.randn(4, 6, 9, 9, requires_grad=True)
    scale = torch.nn.Parameter(torch.tensor([0.04]))
    offset = torch.nn.Parameter(torch.tensor([3.0]))
    args = (-1, 0, 255, int(RoundingPolicy.HALF_EVEN))
    weights = torch.arange(float(x.numel())).view(x.shape).remainder(7)
    before = _fused_calls()
    y = op.fake_quant_linear(x, scale, offset, *args)
    (y * weights).sum().backward()
    assert _fused_calls() == before + 2, "the fused path was not taken"
    assert scale.item() == pytest.approx(0.04) and offset.item() == 3.0
    with cpu_fusion(enabled=False):
        x2 = x.detach().clone().requires_grad_(True)
        s2, o2 = (torch.nn.Parameter(t.detach().clone()) for t in (scale, offset))
        y2 = op.fake_quant_linear(x2, s2, o2, *args)
        (y2 * weights).sum().backward()
    assert_bit_identical(y.detach(), y2.detach())
    for got, want in ((x.grad, x2.grad), (scale.grad, s2.grad), (offset.grad, o2.grad)):
        assert_bit_identical(got, want)


@pytest.mark.parametrize("fused", [True, False])
def test_eager_autograd_records_the_cpu_kernels(fused: bool):
    """``fxq.ops`` in plain eager code with gradients (QAT, LSQ) records the CPU kernels in autograd directly, not
    the custom op (its dispatch and autograd wrapper cost ~100 us a call): same values and gradients, bit for bit,
    fused or not; under a dispatch mode (tracing) the custom op is recorded as before."""
    from torch.utils._python_dispatch import TorchDispatchMode

    x = torch.randn(4, 6, 9, 9, requires_grad=True)
    scale = torch.nn.Parameter(torch.rand(6) * 0.05 + 0.01)
    offset = torch.zeros(6)
    args = (1, -128, 127, int(RoundingPolicy.HALF_EVEN))
    weights = torch.arange(float(x.numel())).view(x.shape).remainder(5)
    with cpu_fusion(enabled=fused, min_numel=0, warmup_seconds=0):
        y = fxq.ops.fake_quant_linear(x, scale, offset, *args)
        (y * weights).sum().backward()
        assert type(y.grad_fn).__name__.startswith("_EagerCpu_fake_quant_linear")
        x2 = x.detach().clone().requires_grad_(True)
        s2 = torch.nn.Parameter(scale.detach().clone())
        y2 = op.fake_quant_linear(x2, s2, offset, *args)  # the custom op, through the dispatcher
        (y2 * weights).sum().backward()
        assert "GeneratedBackwardFor_fxq_fake_quant_linear" in type(y2.grad_fn).__name__
    assert_bit_identical(y.detach(), y2.detach())
    assert_bit_identical(x.grad, x2.grad)
    assert_bit_identical(scale.grad, s2.grad)

    class _Seen(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    with _Seen() as seen:
        fxq.ops.fake_quant_linear(x, scale, offset, *args)
    assert any("fxq.fake_quant_linear" in o for o in seen.ops), seen.ops


def test_overwrite_keeps_gradients(forced):
    """``overwrite=True`` never takes the in-place (no-autograd) path while a gradient is wanted."""
    from fxq.spec import TensorQuantConfig

    x = torch.randn(8, 8)
    scale = torch.tensor([0.05]).mul(2).requires_grad_(True)  # a computed scale, a plain tensor
    y = F.fake_quantize(x, TensorQuantConfig(), scale, torch.tensor([0.0]), overwrite=True)
    y.sum().backward()
    assert scale.grad is not None and y is not x
    with torch.no_grad():
        x2 = x.clone()
        assert F.fake_quantize(x2, TensorQuantConfig(), scale, torch.tensor([0.0]), overwrite=True) is x2


def test_squared_error_sums(forced):
    """The analysis metric's fused sums against float64 numpy (a reduction: close, not bit-identical)."""
    g = torch.Generator().manual_seed(0)
    f = torch.randn(3, 1000, generator=g) * 10
    q = f + torch.randn(3, 1000, generator=g) * 0.01
    noise, signal = fused_cpu.squared_error_sums(q, f)
    qd, fd = q.double().numpy(), f.double().numpy()
    assert float(noise) == pytest.approx(float(((qd - fd) ** 2).sum()), rel=1e-5)
    assert float(signal) == pytest.approx(float((fd**2).sum()), rel=1e-5)
    assert fused_cpu.squared_error_sums(q, f.t()) is None  # shapes differ: the caller computes eagerly


# --------------------------------------------------------------------------- gates (no compiling)
def test_in_place_declines_without_touching_x():
    """Gradients or a non-contiguous x: False, and x keeps its values."""
    scale, offset = torch.tensor([0.1]), torch.tensor([0.0])
    args = (0, -128, 127, int(RoundingPolicy.HALF_EVEN))
    for x in (torch.randn(8, 8, requires_grad=True), torch.randn(8, 8).t()):
        before = x.detach().clone()
        with cpu_fusion(min_numel=0, warmup_seconds=0):
            assert not fused_cpu.fake_quant_linear_inplace(x, scale, offset, *args)
        assert torch.equal(x.detach(), before)


@pytest.mark.parametrize("rounding", list(RoundingPolicy), ids=lambda r: r.name)
def test_in_place_eager_reference_is_bit_identical(rounding):
    """Small tensors or before warm-up: the eager reference runs in place, nothing compiles, same bits."""
    scale, offset = torch.tensor([0.25, 0.5, 1.0]), torch.tensor([3.0, 0.0, -2.0])
    x = _x((4, 3, 5), scale, 1, 20.0)
    args = (1, -128, 127, int(rounding))
    want = F.linear_fake_quantize_reference(x, scale, offset, *args)
    for settings in ({"min_numel": 1 << 20, "warmup_seconds": 0}, {"min_numel": 0, "warmup_seconds": 1e9}):
        compiles, y = fused_cpu_stats()["compiles"], x.clone()
        with cpu_fusion(**settings):
            assert fused_cpu.fake_quant_linear_inplace(y, scale, offset, *args)
        assert fused_cpu_stats()["compiles"] == compiles
        assert_bit_identical(y, want, rounding.name)



def test_small_tensors_do_not_compile(monkeypatch):
    """The default threshold keeps small models on the eager reference: nothing compiles, nothing counts."""
    monkeypatch.setattr(fused_cpu._state, "compiled", {})
    stats = fused_cpu_stats()
    with cpu_fusion(min_numel=fused_cpu.DEFAULT_MIN_NUMEL, warmup_seconds=0):
        op.fake_quant_linear(torch.randn(32, 32), torch.tensor([0.1]), torch.tensor([0.0]), 0, -128, 127, 0)
    after = fused_cpu_stats()
    assert after["compiles"] == stats["compiles"] and after["fused_calls"] == stats["fused_calls"]


@pytest.mark.parametrize("per_channel", [False, True])
def test_small_tensors_ride_graphs_compiled_for_larger_ones(monkeypatch, per_channel):
    """A model's few small quantizers (pooled features, logits) run on the graph a large tensor of their layout
    compiled, bit for bit, and bind to an own-rank graph that exists; they never compile one themselves."""
    from fxq import functional
    from fxq.spec import QuantState, TensorQuantConfig

    monkeypatch.setattr(fused_cpu._state, "compiled", {})
    monkeypatch.setattr(fused_cpu._state, "plans", {})
    channels = 16 if per_channel else 1
    scale, offset = torch.rand(channels) * 0.1 + 0.01, torch.zeros(channels)
    args = (1 if per_channel else 0, -128, 127, 0)
    small, large = torch.randn(2, channels, 8) * 3, torch.randn(2, channels, 4096) * 3

    def run(x):
        return op.fake_quant_linear(x, scale, offset, *args)

    with torch.no_grad(), cpu_fusion(min_numel=fused_cpu.DEFAULT_MIN_NUMEL, warmup_seconds=0):
        before = fused_cpu_stats()
        assert_bit_identical(run(small), F.linear_fake_quantize_reference(small, scale, offset, *args), "eager")
        assert fused_cpu_stats()["fused_calls"] == before["fused_calls"]  # nothing compiled yet: the eager ops
        run(large)
        compiles = fused_cpu_stats()["compiles"]
        for n in (2, 3, 8, 17, 33):  # vector tails of many lengths (n = 1 would drop a dimension: another layout)
            x = torch.randn(2, channels, n) * 3
            calls = fused_cpu_stats()["fused_calls"]
            assert_bit_identical(run(x), F.linear_fake_quantize_reference(x, scale, offset, *args), str(n))
            assert fused_cpu_stats()["fused_calls"] == calls + 1
        assert fused_cpu_stats()["compiles"] == compiles
    # the backward (QAT) alike: a small one rides the backward graph a large one compiled
    s_ = scale.clone().requires_grad_()

    def grads(x, fused):
        x = x.clone().requires_grad_()
        s_.grad = None
        with cpu_fusion(enabled=fused, min_numel=fused_cpu.DEFAULT_MIN_NUMEL, warmup_seconds=0):
            (op.fake_quant_linear(x, s_, offset, *args) * x.detach()).sum().backward()
        return x.grad, s_.grad

    grads(large, True)
    calls, compiles = fused_cpu_stats()["fused_calls"], fused_cpu_stats()["compiles"]
    for got, want in zip(grads(small, True), grads(small, False)):
        assert_bit_identical(got, want, "backward")
    assert fused_cpu_stats()["fused_calls"] == calls + 2  # forward and backward
    with torch.no_grad(), cpu_fusion(min_numel=fused_cpu.DEFAULT_MIN_NUMEL, warmup_seconds=0):
        # binding: a repeated small call binds to the op's own graph through views (no own-rank graph of its own),
        # or to the own-rank graph a large tensor of its layout compiled
        cfg = TensorQuantConfig(num_bits=8, scale=scale, offset=offset, per_channel=per_channel,
                                channel_axis=1, state=QuantState.ACTIVATED)
        want = F.linear_fake_quantize_reference(small, scale, offset, *args)
        for _ in range(3):
            y = F.fake_quantize(small, cfg)
        bound = functional._BOUND[cfg]
        assert bound.shape == small.shape and bound.plan.key[0] != "own_rank"
        assert fused_cpu_stats()["compiles"] == compiles
        calls = fused_cpu_stats()["fused_calls"]
        assert_bit_identical(bound.run(small, bound.params, bound.tag), want, "bound through views")
        assert fused_cpu_stats()["fused_calls"] == calls + 1
        for _ in range(3):
            F.fake_quantize(large, cfg)
        compiles = fused_cpu_stats()["compiles"]
        for _ in range(3):
            y = F.fake_quantize(small, cfg)
        bound = functional._BOUND[cfg]
        assert bound.shape == small.shape and bound.plan.key[0] == "own_rank"
        assert fused_cpu_stats()["compiles"] == compiles
        assert_bit_identical(y, want, "bound")


def test_warmup_runs_eager_first():
    stats = fused_cpu_stats()
    with cpu_fusion(min_numel=0, warmup_seconds=1e9):
        y = op.fake_quant_linear(torch.randn(32, 32), torch.tensor([0.1]), torch.tensor([0.0]), 0, -128, 127, 0)
    after = fused_cpu_stats()
    assert after["eager_calls"] == stats["eager_calls"] + 1 and after["compiles"] == stats["compiles"]
    assert after["eager_seconds"] > stats["eager_seconds"]
    assert y.shape == (32, 32)


def test_unsupported_inputs_take_the_reference():
    stats = fused_cpu_stats()
    with cpu_fusion(min_numel=0, warmup_seconds=0):
        x = torch.randn(40, 30).t()  # non-contiguous
        op.fake_quant_linear(x, torch.tensor([0.1]), torch.tensor([0.0]), 0, -128, 127, 0)
        op.fake_quant_linear(torch.randn(40, 30).half(), torch.tensor([0.1]), torch.tensor([0.0]), 0, -128, 127, 0)
        with pytest.raises(RuntimeError):  # channel mismatch: the reference's own error
            op.fake_quant_linear(torch.randn(4, 7), torch.rand(5) + 0.1, torch.zeros(5), 1, -128, 127, 0)
    assert fused_cpu_stats()["fused_calls"] == stats["fused_calls"]


def test_env_switch(monkeypatch):
    monkeypatch.setenv(fused_cpu.ENV_ENABLE, "0")
    monkeypatch.setenv(fused_cpu.ENV_MIN_NUMEL, "123")
    monkeypatch.setenv(fused_cpu.ENV_WARMUP_S, "0.5")
    assert FusedCpuSettings().resolved() == (False, 123, 0.5)
    monkeypatch.setenv(fused_cpu.ENV_ENABLE, "1")
    monkeypatch.setenv(fused_cpu.ENV_WARMUP_S, "soon")
    assert FusedCpuSettings().resolved() == (True, 123, fused_cpu.DEFAULT_WARMUP_S)
    assert FusedCpuSettings(enabled=False, min_numel=7).resolved()[:2] == (False, 7)


def test_cpu_fusion_restores_settings():
    before = fused_cpu._state.settings
    with cpu_fusion(enabled=False, min_numel=5) as settings:
        assert settings.enabled is False and settings.min_numel == 5
        assert fused_cpu._state.settings is settings
    assert fused_cpu._state.settings is before


@pytest.mark.parametrize(
    "shape,axis,numels,expected",
    [
        ((4, 5, 6), 0, (1, 1), ((120,), 0)),
        ((4, 5, 6), 0, (4, 1), ((4, 30), 0)),
        ((4, 5, 6), 1, (5, 5), ((4, 5, 6), 1)),
        ((4, 5, 6), -1, (6, 6), ((20, 6), 1)),
        ((1, 5, 1), 1, (5, 1), ((5,), 0)),
        ((4, 5, 6), 1, (5, 4), None),
        ((4, 5, 6), 1, (6, 6), None),
    ],
)
def test_canonical_views(shape, axis, numels, expected):
    assert fused_cpu._canonical(torch.empty(shape), numels, axis) == expected


def test_compile_failure_falls_back_once(monkeypatch, caplog):
    def broken_compile(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(torch._inductor, "standalone_compile", broken_compile)
    monkeypatch.setattr(fused_cpu._state, "broken", None)
    monkeypatch.setattr(fused_cpu._state, "compiled", {})
    x, s, o = torch.randn(10, 10), torch.tensor([0.1]), torch.tensor([0.0])
    with cpu_fusion(min_numel=0, warmup_seconds=0), caplog.at_level(logging.WARNING, logger="fxq.fused_cpu"):
        y1 = op.fake_quant_linear(x, s, o, 0, -128, 127, 0)
        y2 = op.fake_quant_linear(x, s, o, 0, -128, 127, 0)
    assert torch.equal(y1, F.linear_fake_quantize_reference(x, s, o, 0, -128, 127, 0)) and torch.equal(y1, y2)
    assert caplog.text.count("fused CPU path disabled") == 1
    assert fused_cpu._state.broken is not None


def test_one_graph_serves_every_size_and_bound(forced):
    """A graph is traced over symbolic sizes on stand-ins of distinct sizes: later calls with equal outer and inner
    sizes, other channel counts or other clamp bounds reuse it and still match the reference bit for bit."""
    scale, offset = torch.rand(5) * 0.2 + 0.05, torch.randint(0, 9, (5,)).float()
    cases = [((2, 5, 7, 3), 1, 0, 255), ((3, 5, 3), 1, -128, 127), ((6, 5, 6), 1, -3, 4), ((4, 8, 4), 1, 0, 15)]
    compiles = None
    for shape, axis, qmin, qmax in cases:
        s, o = (scale, offset) if shape[axis] == 5 else (torch.rand(8) * 0.2 + 0.05, torch.zeros(8))
        x = _x(shape, s, axis, 30.0)
        y = op.fake_quant_linear(x, s, o, axis, qmin, qmax, int(RoundingPolicy.HALF_EVEN))
        assert_bit_identical(y, F.linear_fake_quantize_reference(x, s, o, axis, qmin, qmax, 0), str(shape))
        if compiles is None:
            compiles = fused_cpu_stats()["compiles"]
    assert fused_cpu_stats()["compiles"] == compiles


def test_eager_values_skip_the_dispatcher_only_when_nothing_watches():
    """``fxq.ops`` calls the CPU kernel directly for plain values; with autograd or a dispatch mode the op runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    x, s, o = torch.randn(4, 4), torch.tensor([0.1]), torch.tensor([0.0])
    assert fused_cpu.values_only((x, s, o))
    assert not fused_cpu.values_only((x.requires_grad_(), s, o))
    with torch.no_grad():
        assert fused_cpu.values_only((x, s, o))
    with Seen() as seen:
        assert not fused_cpu.values_only((x.detach(), s, o))
        fxq.ops.fake_quant_linear(x.detach(), s, o, 0, -128, 127, 0)
    assert any("fxq.fake_quant_linear" in name for name in seen.ops)
    y = fxq.ops.fake_quant_linear(x, s, o, 0, -128, 127, 0)
    assert y.grad_fn is not None


def test_bound_calls_hold_only_while_nothing_changed(forced):
    """A quantizer's repeated call skips the checks through a binding; any change of attributes, parameters,
    shape, autograd or the fused switch takes the full path again, and values are the reference's every time."""
    from fxq import functional
    from fxq.spec import QuantState, TensorQuantConfig

    cfg = TensorQuantConfig(num_bits=8, scale=torch.tensor([0.1]), state=QuantState.ACTIVATED)
    scale, offset = cfg.scale, cfg.offset
    x = torch.randn(64, 80) * 20

    def check(y, x, s, o, qmin, qmax):
        assert_bit_identical(y, F.linear_fake_quantize_reference(x, s, o, 0, qmin, qmax, 0))

    with torch.no_grad():
        check(F.fake_quantize(x, cfg, scale, offset), x, scale, offset, -128, 127)
        assert cfg not in functional._BOUND  # bound when the call repeats
        check(F.fake_quantize(x, cfg, scale, offset), x, scale, offset, -128, 127)
        assert cfg in functional._BOUND
        before = _fused_calls()
        check(F.fake_quantize(x, cfg, scale, offset), x, scale, offset, -128, 127)
        assert _fused_calls() == before + 1
        cfg.quant_min, cfg.quant_max = -8, 7  # other attributes: the binding does not hold
        check(F.fake_quantize(x, cfg, scale, offset), x, scale, offset, -8, 7)
        scale.copy_(torch.tensor([0.25]))  # the same parameter updated in place: still the binding, new values
        check(F.fake_quantize(x, cfg, scale, offset), x, scale, offset, -8, 7)
        learned = torch.nn.Parameter(torch.tensor([0.2]))  # a learned scale, evaluated without gradients
        check(F.fake_quantize(x, cfg, learned, offset), x, learned.detach(), offset, -8, 7)
        check(F.fake_quantize(x, cfg, learned, offset), x, learned.detach(), offset, -8, 7)
        learned.data = torch.tensor([0.125])  # the same Parameter on new storage: the binding does not hold
        check(F.fake_quantize(x, cfg, learned, offset), x, learned.detach(), offset, -8, 7)
        x3 = (torch.randn(80, 64) * 20).t()  # a 64x80 view laid out the other way: values in x's own strides
        y3 = F.fake_quantize(x3, cfg, scale, offset)
        check(y3, x3, scale, offset, -8, 7)
        assert y3.stride() == x3.stride()
        other = torch.tensor([0.5])
        check(F.fake_quantize(x, cfg, other, offset), x, other, offset, -8, 7)
        x2 = torch.randn(32, 80) * 20
        check(F.fake_quantize(x2, cfg, scale, offset), x2, scale, offset, -8, 7)
        with cpu_fusion(enabled=False):
            calls = _fused_calls()
            check(F.fake_quantize(x2, cfg, scale, offset), x2, scale, offset, -8, 7)
            assert _fused_calls() == calls
    xg = x2.clone().requires_grad_()
    y = F.fake_quantize(xg, cfg, scale, offset)
    assert y.grad_fn is not None
    y.sum().backward()
    assert xg.grad is not None
    learned = torch.nn.Parameter(torch.tensor([0.2]))  # bound while evaluated without gradients, then trained
    with torch.no_grad():
        for _ in range(2):
            check(F.fake_quantize(x2, cfg, learned, offset), x2, learned.detach(), offset, -8, 7)
    y = F.fake_quantize(x2, cfg, learned, offset)
    assert y.grad_fn is not None
    y.sum().backward()
    assert learned.grad is not None


@pytest.mark.parametrize("shape,other,axis,channels,dtype,fmt", [
    ((1, 8, 5, 7), (1, 9, 6, 4), 1, 1, torch.float32, None),
    ((3, 1, 9), (6, 1, 4), 0, 1, torch.float64, None),
    ((2, 5, 7, 3), (4, 5, 2, 6), -3, 5, torch.float32, None),
    ((1, 24, 1, 1), (1, 24, 1, 1), 1, 24, torch.float32, None),
    ((4, 3, 2, 5, 2, 3), (2, 4, 3, 5, 3, 2), 4, 1, torch.float32, None),
    ((2, 5, 7, 3), (3, 5, 4, 2), 1, 5, torch.float32, FloatFormat.E4M3),
])
def test_bound_calls_run_a_graph_of_the_tensors_own_rank(forced, shape, other, axis, channels, dtype, fmt):
    """A bound call runs a graph made for x's rank and dimensions of size 1: no view in, none out (the result is a
    tensor of its own, laid out as x), the reference's bits; binding runs nothing more on x; another shape with the
    same dimensions of size 1 takes the same graph."""
    from fxq import functional
    from fxq.spec import QuantState, TensorQuantConfig

    scale = torch.rand(channels) * (0.01 if fmt else 0.2) + 0.05
    cfg = TensorQuantConfig(num_bits=8, per_channel=channels > 1, channel_axis=axis, fp_format=fmt, scale=scale,
                            state=QuantState.ACTIVATED)

    def want(x):
        if fmt is not None:
            return F.float_fake_quantize_reference(x, cfg.scale.to(dtype), axis, fmt.mantissa_bits, fmt.min_exponent,
                                                   fmt.max_value, 0)
        return F.linear_fake_quantize_reference(x, cfg.scale.to(dtype), cfg.offset.to(dtype), axis, -128, 127, 0)

    compiles = None
    for size in (shape, other):
        x = _x(size, cfg.scale, axis, 1.0 if fmt else 30.0).to(dtype)
        with torch.no_grad():
            F.fake_quantize(x, cfg)  # a call of a new shape runs unbound; its repetition binds
            before = _fused_calls()
            F.fake_quantize(x, cfg)
            assert _fused_calls() == before + 1  # the op ran fused once; binding ran nothing more on x
            assert cfg in functional._BOUND
            before = _fused_calls()
            y = F.fake_quantize(x, cfg)
        assert _fused_calls() == before + 1
        assert_bit_identical(y, want(x), str(size))
        assert y._base is None and y.shape == x.shape and y.stride() == x.stride()
        if compiles is None:
            compiles = fused_cpu_stats()["compiles"]
    assert fused_cpu_stats()["compiles"] == compiles


def test_a_call_whose_shape_changes_every_time_is_never_bound(forced):
    """Text of varying length: binding would plan (and compile) for every call; only a repeated call binds."""
    from fxq import functional
    from fxq.spec import QuantState, TensorQuantConfig

    cfg = TensorQuantConfig(num_bits=8, scale=torch.tensor([0.1]), state=QuantState.ACTIVATED)
    lengths = (40, 41, 40, 42, 43, 40)
    with torch.no_grad():
        for n in lengths:
            x = torch.randn(1, n, 64) * 20
            y = F.fake_quantize(x, cfg)
            assert_bit_identical(y, F.linear_fake_quantize_reference(x, cfg.scale, cfg.offset, 0, -128, 127, 0))
            assert cfg not in functional._BOUND
        F.fake_quantize(x, cfg)
    assert cfg in functional._BOUND


def test_a_training_call_is_not_counted_as_a_repeat(forced):
    """QAT calls record gradients and are never bound: they must not pay for the repeat bookkeeping either."""
    from fxq import functional
    from fxq.spec import QuantState, TensorQuantConfig

    cfg = TensorQuantConfig(num_bits=8, scale=torch.tensor([0.1]), state=QuantState.ACTIVATED)
    x = (torch.randn(2, 64) * 20).requires_grad_()
    for _ in range(3):
        F.fake_quantize(x, cfg).sum().backward()
    assert cfg not in functional._LAST_UNBOUND and cfg not in functional._BOUND
    learned = cfg.scale.clone().requires_grad_()  # LSQ: the input needs no gradient, the scale does
    for _ in range(3):
        F.fake_quantize(x.detach(), cfg, learned).sum().backward()
    assert cfg not in functional._LAST_UNBOUND and cfg not in functional._BOUND
    with torch.no_grad():
        F.fake_quantize(x, cfg), F.fake_quantize(x, cfg)
    assert cfg in functional._BOUND


def test_a_quantizer_takes_no_shortcut_to_a_binding_of_another_shape(forced):
    """A call of a new shape runs unbound: its quantizer must not keep a shortcut to the binding of the shape before
    (it would fail at every call of the new shape, and be made again)."""
    from fxq.nn.fake_quantize import FakeQuantize
    from fxq.spec import QuantState, TensorQuantConfig

    fq = FakeQuantize(TensorQuantConfig(num_bits=8, scale=torch.tensor([0.1]), state=QuantState.ACTIVATED))
    a, b = torch.randn(1, 40, 64), torch.randn(1, 41, 64)
    with torch.no_grad():
        fq(a), fq(a), fq(a)
        assert fq._shortcut is not None and fq._shortcut.bound.shape == a.shape
        fq(b)
        assert fq._shortcut is None
        fq(b), fq(b)
        assert fq._shortcut is not None and fq._shortcut.bound.shape == b.shape


def test_a_graph_of_own_rank_that_fails_leaves_the_fused_path_on(forced, monkeypatch):
    """A bound call's own graph that cannot be compiled leaves that layout unbound; every call still fuses."""
    from fxq import functional
    from fxq.spec import QuantState, TensorQuantConfig

    monkeypatch.setattr(fused_cpu._state, "broken", None)
    monkeypatch.setattr(fused_cpu._state, "compiled", {})
    monkeypatch.setattr(fused_cpu._state, "unbindable", set())
    real = fused_cpu._compile_graph

    def only_flat(fn, examples, exact):
        if examples[0].dim() == 4:
            raise RuntimeError("inductor cannot compile this")
        return real(fn, examples, exact)

    monkeypatch.setattr(fused_cpu, "_compile_graph", only_flat)
    cfg = TensorQuantConfig(num_bits=8, scale=torch.tensor([0.1]), state=QuantState.ACTIVATED)
    x = torch.randn(2, 3, 8, 8) * 20
    with torch.no_grad():
        for _ in range(3):
            before = _fused_calls()
            y = F.fake_quantize(x, cfg)
            assert _fused_calls() == before + 1
            assert_bit_identical(y, F.linear_fake_quantize_reference(x, cfg.scale, cfg.offset, 0, -128, 127, 0))
    assert fused_cpu._state.broken is None and not fused_cpu._state.off
    assert cfg not in functional._BOUND and len(fused_cpu._state.unbindable) == 1


def test_a_subclass_that_overrides_quantize_is_never_skipped(forced):
    """The shortcut stands for this class's ``_quantize``: a subclass's own ``_quantize`` runs at every call."""
    from fxq.nn.fake_quantize import FakeQuantize
    from fxq.spec import QuantState, TensorQuantConfig

    class Counting(FakeQuantize):
        calls = 0

        def _quantize(self, x, overwrite):
            Counting.calls += 1
            return super()._quantize(x, overwrite)

    fq = Counting(TensorQuantConfig(num_bits=8, scale=torch.tensor([0.1]), state=QuantState.ACTIVATED))
    with torch.no_grad():
        for _ in range(4):
            fq(torch.randn(16, 40))
    assert Counting.calls == 4 and fq._shortcut is None


def test_a_config_pickled_before_its_revision_counter_still_quantizes(forced):
    """A config unpickled from a file saved before ``revision`` existed has none in its dict: the class's 0."""
    from fxq.nn.fake_quantize import FakeQuantize
    from fxq.spec import QuantState, TensorQuantConfig

    fq = FakeQuantize(TensorQuantConfig(num_bits=8, scale=torch.tensor([0.1]), state=QuantState.ACTIVATED))
    del fq.config.__dict__["revision"]
    x = torch.randn(16, 40) * 20
    with torch.no_grad():
        for _ in range(3):
            assert_bit_identical(fq(x), F.linear_fake_quantize_reference(x, fq.scale, fq.offset, 0, -128, 127, 0))
    assert fq._shortcut is not None


def test_a_quantizers_shortcut_holds_only_while_nothing_changed(forced):
    """A quantizer runs its bound call directly while its mode, config, parameters and their homes are as they
    were; each change below takes the full path, and every value is the reference's."""
    import copy

    from fxq.nn.fake_quantize import FakeQuantize
    from fxq.spec import QuantState, TensorQuantConfig

    fq = FakeQuantize(TensorQuantConfig(num_bits=8, scale=torch.tensor([0.1]), state=QuantState.ACTIVATED))
    x = torch.randn(16, 40) * 20

    def check(y, scale, qmin=-128, qmax=127, dtype=torch.float32):
        want = F.linear_fake_quantize_reference(x.to(dtype), scale.to(dtype), torch.zeros(1, dtype=dtype), 0, qmin,
                                                qmax, 0)
        assert_bit_identical(y, want)

    with torch.no_grad():
        check(fq(x), fq.scale)
        check(fq(x), fq.scale)
        assert fq._shortcut is not None
        before = _fused_calls()
        check(fq(x), fq.scale)
        assert _fused_calls() == before + 1  # the shortcut ran the bound call
        fq.set_mode("observe")  # the observer sees x, which passes through
        assert torch.equal(fq(x), x) and fq.observer.compute_qparams()[0].item() > 0
        fq.set_mode("quantize")
        check(fq(x), fq.scale)
        check(fq(x), fq.scale)
        fq.config.state = QuantState.BAKED  # the config changed under the module: values pass through
        assert torch.equal(fq(x), x)
        fq.config.state = QuantState.ACTIVATED
        check(fq(x), fq.scale)
        check(fq(x), fq.scale)
        fq.config.quant_min, fq.config.quant_max = -8, 7
        check(fq(x), fq.scale, -8, 7)
        check(fq(x), fq.scale, -8, 7)
        swapped = torch.tensor([0.5])  # torch swaps the tensor in the module's dict, not through setattr
        check(torch.func.functional_call(fq, {"scale": swapped}, (x,)), swapped, -8, 7)
        check(fq(x), fq.scale, -8, 7)
        fq.scale = torch.tensor([0.25])
        check(fq(x), fq.scale, -8, 7)
        check(fq(x), fq.scale, -8, 7)
        twin = copy.deepcopy(fq)
        assert twin._shortcut is None
        check(twin(x), twin.scale, -8, 7)
        fq.double()  # new buffers, written into the dict
        y = fq(x.double())
        assert y.dtype == torch.float64
        check(y, fq.scale, -8, 7, torch.float64)


def test_a_model_through_its_shortcuts_gives_the_references_bits(forced):
    """A quantized model run batch after batch (its quantizers' shortcuts to own-rank graphs) gives the eager
    reference's output bit for bit, at batch 1 (size-1 dims) and 3."""
    import fxq

    from _export_helpers import small_quantized

    gm = small_quantized("trt_int8")
    for batch in (1, 3):
        x = torch.randn(batch, 3, 32, 32)
        with torch.no_grad():
            with cpu_fusion(enabled=False):
                want = gm(x)
            got = [gm(x) for _ in range(3)]
        assert any(isinstance(m, fxq.FakeQuantize) and m._shortcut is not None for m in gm.modules())
        for y in got:
            assert_bit_identical(y, want, f"batch {batch}")


def test_compiled_quantizer_never_reads_its_shortcut(forced):
    """A trace skips the shortcut (eager bookkeeping): a new one made by an eager call of another shape does not
    make the compiled module compile again."""
    from torch._dynamo.testing import CompileCounter

    from fxq.nn.fake_quantize import FakeQuantize
    from fxq.spec import QuantState, TensorQuantConfig

    fq = FakeQuantize(TensorQuantConfig(num_bits=8, scale=torch.tensor([0.1]), state=QuantState.ACTIVATED))
    x = torch.randn(16, 40) * 20
    counter = CompileCounter()
    torch._dynamo.reset()
    compiled = torch.compile(fq, backend=counter, fullgraph=True)
    with torch.no_grad():
        fq(x), fq(x)
        assert fq._shortcut is not None
        want = compiled(x)
        fq(x[:8]), fq(x[:8])  # another binding, another shortcut
        assert torch.equal(compiled(x), want) and torch.equal(fq(x), want)
    assert counter.frame_count == 1


def test_compiling_with_the_fx_graph_cache_off_logs_nothing():
    """With inductor's FX graph cache off (``TORCHINDUCTOR_FX_GRAPH_CACHE=0``), ``standalone_compile`` warns that it
    cannot build a saveable artifact: fxq never saves one, so the user must not see that warning."""
    from torch._inductor import config as inductor_config

    class Records(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.WARNING)
            self.messages: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.messages.append(record.getMessage())

    seen = Records()
    torch_log = logging.getLogger("torch._inductor.standalone_compile")  # torch's loggers do not propagate to root
    torch_log.addHandler(seen)
    x = torch.randn(64, 3)
    # torch's own patch, not pytest's monkeypatch: pytest 9.2 restores a module attribute that is not in the module's
    # __dict__ (torch's config entries) by deleting it, which hides the entry from every later compile
    try:
        with inductor_config.patch(fx_graph_cache=False):
            compiled = fused_cpu._compile_graph(lambda t: (t * 3.0).relu(), [x], exact=True)
    finally:
        torch_log.removeHandler(seen)
    assert torch.equal(compiled(x.clone()), (x * 3.0).relu())
    assert not seen.messages
    assert isinstance(inductor_config.fx_graph_cache, bool)  # the setting is torch's again


def _thread_cpu_ticks() -> dict[int, int]:
    """CPU time (clock ticks: user + system) of each thread of this process, from ``/proc``."""
    ticks = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended
            continue
        ticks[int(tid)] = int(fields[11]) + int(fields[12])
    return ticks


@pytest.mark.skipif(not os.path.isdir("/proc/self/task") or torch.get_num_threads() < 2,
                    reason="needs Linux /proc and two intra-op threads")
def test_fused_kernels_use_torch_threads(forced):
    """A compiled graph runs on torch's intra-op threads: inductor sized its loops from the small traced stand-ins
    and wrote serial kernels, so a large quantizer ran on one core (measured: the kernel 1.9x slower on 2 threads).
    Seen from /proc: while the main thread runs the kernel, another thread of the process works too."""
    x = torch.randn(1 << 22)
    s, o = torch.tensor([0.05]), torch.tensor([0.0])
    op.fake_quant_linear(x, s, o, 0, -128, 127, int(RoundingPolicy.HALF_EVEN))  # compile
    time.sleep(0.5)  # OpenMP workers of earlier parallel regions stop spinning
    main = threading.get_native_id()
    before = _thread_cpu_ticks()
    start = time.process_time()
    while time.process_time() - start < 1.0:
        op.fake_quant_linear(x, s, o, 0, -128, 127, int(RoundingPolicy.HALF_EVEN))
    after = _thread_cpu_ticks()
    worked = {tid: after[tid] - before.get(tid, 0) for tid in after}
    others = sum(t for tid, t in worked.items() if tid != main)
    assert others >= worked[main] // 4, f"only the calling thread computed: ticks per thread {worked}"


@pytest.mark.parametrize("layout", ["transposed", "sliced", "sliced-transposed"])
@pytest.mark.parametrize("overwrite", [False, True])
def test_non_contiguous_values_take_the_fused_path(forced, layout, overwrite):
    """Attention heads reach their quantizers transposed and sliced out of one projection: per-tensor values-only
    calls lay them out contiguously in their own stride order and run fused (they ran the eager reference, six
    passes). Bit for bit the reference, with the strides the eager op gives."""
    from fxq.spec import QuantState, TensorQuantConfig

    cfg = TensorQuantConfig(num_bits=8, scale=torch.tensor([0.05]), state=QuantState.ACTIVATED)
    base = _x((3, 40, 96), torch.tensor([0.05]), 0, 3.0)
    make = {"transposed": lambda: base.clone().transpose(0, 1),
            "sliced": lambda: base.clone()[:, :, 16:80],
            "sliced-transposed": lambda: base.clone()[:, :, :48].transpose(1, 2)}[layout]
    with cpu_fusion(enabled=False):
        expected = F.fake_quantize(make(), cfg)
    x = make()
    assert not x.is_contiguous()
    before = _fused_calls()
    with torch.no_grad():
        got = F.fake_quantize(x, cfg, overwrite=overwrite)
    assert _fused_calls() > before, "the non-contiguous tensor ran the eager reference"
    assert_bit_identical(got, expected, layout)
    assert got.stride() == expected.stride()
    if not overwrite:
        assert_bit_identical(x, make(), "x was changed")
    weight = torch.nn.Parameter(make(), requires_grad=False)
    with torch.no_grad():
        assert_bit_identical(F.fake_quantize(weight, cfg, overwrite=overwrite), expected, layout)
    assert_bit_identical(weight.detach(), make(), "a Parameter was overwritten")


_DIRECT_CALLS = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 14)
"""Whether this torch's generated call was checked to be found through its wrappers (older ones keep them)."""


def _fresh_graph(monkeypatch) -> tuple[torch.Tensor, ...]:
    """Inputs of a linear fake-quant whose graph this test compiles anew (the process's graphs set aside)."""
    monkeypatch.setattr(fused_cpu._state, "compiled", {})
    monkeypatch.setattr(fused_cpu._state, "plans", {})
    s, o = torch.tensor([0.1]), torch.tensor([3.0])
    return _x((64, 9), s, 0, 20.0), s, o


def test_compiled_graphs_are_called_without_their_wrappers(forced, monkeypatch):
    """A graph is called through inductor's generated ``call``, skipping AOTAutograd's runtime wrappers and
    inductor's bookkeeping (~6 us a call, as much as the kernel on a 50 K-element activation); values unchanged. The
    in-place twin's generated code writes its input itself, as its wrappers would."""
    if not _DIRECT_CALLS:
        pytest.skip("the generated call is found through the wrappers of torch 2.14; older ones keep their wrappers")
    x, s, o = _fresh_graph(monkeypatch)
    args = (0, 0, 255, int(RoundingPolicy.HALF_EVEN))
    direct = fused_cpu_stats()["direct_graphs"]
    want = F.linear_fake_quantize_reference(x, s, o, *args)
    assert_bit_identical(op.fake_quant_linear(x, s, o, *args), want)
    assert fused_cpu_stats()["direct_graphs"] == direct + 1
    assert next(iter(fused_cpu._state.compiled.values())).__name__ == "direct"
    y = x.clone()
    assert fused_cpu.fake_quant_linear_inplace(y, s, o, *args)
    assert_bit_identical(y, want, "in place")
    assert fused_cpu_stats()["direct_graphs"] == direct + 2


def _reference_call(args: list) -> list:
    """A stand-in for a generated call: the linear fake-quant's values in a new tensor (writes nothing)."""
    x, s, o, qmin, qmax = args
    return [F.linear_fake_quantize_reference(x, s, o, 0, qmin, qmax, int(RoundingPolicy.HALF_EVEN))]


@pytest.mark.parametrize("generated", ["wrong values", "writes nothing"])
def test_a_generated_call_without_the_wrapped_effect_is_not_used(forced, monkeypatch, generated):
    """The generated call is used only after it had the wrapped graph's effect on the stand-ins: one giving other
    values (another calling convention in another torch), or, for the in-place twin, one that leaves the input as
    it was (the wrappers applied the write), leaves the wrapped graph in place."""
    x, s, o = _fresh_graph(monkeypatch)
    monkeypatch.setattr(fused_cpu, "_generated_call", lambda compiled: (
        (lambda args: [args[0] * 2]) if generated == "wrong values" else _reference_call))
    direct = fused_cpu_stats()["direct_graphs"]
    args = (0, -128, 127, int(RoundingPolicy.HALF_EVEN))
    want = F.linear_fake_quantize_reference(x, s, o, *args)
    if generated == "wrong values":
        assert_bit_identical(op.fake_quant_linear(x, s, o, *args), want)
    else:
        y = x.clone()
        assert fused_cpu.fake_quant_linear_inplace(y, s, o, *args)
        assert_bit_identical(y, want, "in place")
    assert fused_cpu_stats()["direct_graphs"] == direct
    assert getattr(next(iter(fused_cpu._state.compiled.values())), "__name__", "") != "direct"


def test_an_overwritten_input_still_stops_a_backward_through_it(forced, monkeypatch):
    """The in-place twin called directly bumps its input's version counter, as AOTAutograd's wrappers do: a backward
    through the overwritten values is refused, not silently run on the new ones (review of the direct call)."""
    x, s, o = _fresh_graph(monkeypatch)
    w = torch.randn(x.shape, requires_grad=True)
    h = x * w  # autograd saved x for w's gradient
    assert fused_cpu.fake_quant_linear_inplace(x, s, o, 0, 0, 255, int(RoundingPolicy.HALF_EVEN))
    direct = getattr(next(iter(fused_cpu._state.compiled.values())), "__name__", "") == "direct"
    assert direct or not _DIRECT_CALLS
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        h.sum().backward()


def test_direct_call_check_compares_bits():
    """The check of the generated call compares bit patterns: -0 is not +0, inf is not the largest float."""
    big = torch.finfo(torch.float32).max
    assert fused_cpu._same_tensor(torch.tensor([1.0, float("nan")]), torch.tensor([1.0, float("nan")]))
    assert not fused_cpu._same_tensor(torch.tensor([-0.0]), torch.tensor([0.0]))
    assert not fused_cpu._same_tensor(torch.tensor([float("inf")]), torch.tensor([big]))
    assert fused_cpu._same_tensor(torch.tensor(3.0, dtype=torch.float64), torch.tensor(3.0, dtype=torch.float64))
    assert fused_cpu._same_tensor(torch.tensor([1, 2]), torch.tensor([1, 2])) and fused_cpu._same_tensor(None, None)


def test_a_strided_parameter_takes_the_reference(forced):
    """A per-channel scale that is every other entry of a tensor is not the layout a graph asserts: the reference
    runs, and the fused path stays on for the process (it was switched off by inductor's stride assertion)."""
    x = torch.randn(8, 6) * 10
    s, o = (torch.rand(12) + 0.05)[::2], torch.zeros(12)[::2]
    y = op.fake_quant_linear(x, s, o, 1, 0, 255, 0)
    assert_bit_identical(y, F.linear_fake_quantize_reference(x, s, o, 1, 0, 255, 0))
    assert fused_cpu._state.broken is None
