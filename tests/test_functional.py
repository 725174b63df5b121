"""fxq.functional against an independent float64 numpy reference written here (fxq's rounding is not used).

The reference models what fxq defines: ``v = x / s`` computed in the compute dtype (float32 for float32
inputs, float64 for float64 inputs and for integer ranges wider than 2**24), then ``v`` rounded exactly
under the policy, clamped with the offset, and scaled back. numpy's float32 division is IEEE, like torch's.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fxq.errors import ConfigError
from fxq.functional import (
    dequantize,
    fake_quantize,
    qparams_from_minmax,
    quantize_to_int,
    round_scale_to_power_of_2,
    round_with_policy,
)
from fxq.spec import MIN_SCALE, FloatFormat, QuantState, RoundingPolicy, TensorQuantConfig

R = RoundingPolicy
POLICIES = list(RoundingPolicy)
HALF_POLICIES = [p for p in POLICIES if p not in (R.UP, R.DOWN)]


# --------------------------------------------------------------------------- numpy reference
def ref_round(v: np.ndarray, policy: RoundingPolicy) -> np.ndarray:
    """Exact rounding of float64 ``v``: compares ``v`` with the midpoint ``floor(v) + 0.5``."""
    v = np.asarray(v, dtype=np.float64)
    f = np.floor(v)
    if policy is R.UP:
        return np.ceil(v)
    if policy is R.DOWN:
        return f
    with np.errstate(invalid="ignore"):
        mid = f + 0.5  # exact while |v| < 2**52; larger values are integers, handled below
        above, tie = v > mid, v == mid
        tie_up = {
            R.HALF_EVEN: np.mod(f, 2) == 1,
            R.HALF_UP: np.ones(v.shape, dtype=bool),
            R.HALF_DOWN: np.zeros(v.shape, dtype=bool),
            R.HALF_TOWARDS_ZERO: f < 0,
            R.HALF_FAR_FROM_ZERO: f >= 0,
            R.TO_NEAR_INT: f >= 0,
        }[policy]
    return np.where(v == f, v, np.where(above | (tie & tie_up), f + 1, f))


def _along(p: np.ndarray, ndim: int, axis: int) -> np.ndarray:
    if p.size == 1:
        return p.reshape(())
    shape = [1] * ndim
    shape[axis % ndim] = -1
    return p.reshape(shape)


def ref_linear(x, scale, offset, axis, qmin, qmax, policy, compute=None):
    """``(codes, fake-quantized values)`` of the linear quantizer, in numpy."""
    x = np.asarray(x)
    if compute is None:
        compute = np.float64 if (x.dtype == np.float64 or qmax - qmin > 2**24) else np.float32
    s = _along(np.asarray(scale, dtype=np.float32).astype(compute), x.ndim, axis)
    o = _along(np.asarray(offset, dtype=np.float64), x.ndim, axis)
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        v = x.astype(compute) / s
        q = np.clip(ref_round(v.astype(np.float64), policy) + o, qmin, qmax)
        deq = ((q - o) * s.astype(np.float64)).astype(compute)
    return q, deq


def fp8_grid(fmt: FloatFormat) -> np.ndarray:
    """All non-negative finite values of ``fmt``, ascending; index parity = mantissa parity."""
    m, emin = fmt.mantissa_bits, fmt.min_exponent
    values = [k * 2.0 ** (emin - m) for k in range(2**m)]  # zero and subnormals
    e = emin
    while True:
        normals = [(1 + j / 2**m) * 2.0**e for j in range(2**m)]
        values += [v for v in normals if v <= fmt.max_value]
        if normals[-1] >= fmt.max_value:
            break
        e += 1
    return np.array(values, dtype=np.float64)


def ref_fp8_round(v: np.ndarray, fmt: FloatFormat, policy: RoundingPolicy) -> np.ndarray:
    """Round float64 ``v`` (already clipped to the format's range) to the FP8 grid under ``policy``."""
    grid = fp8_grid(fmt)
    mag, neg = np.abs(v), np.signbit(v)
    hi = np.clip(np.searchsorted(grid, mag, side="left"), 0, grid.size - 1)
    lo = np.where(grid[hi] == mag, hi, hi - 1)
    d_lo, d_hi = mag - grid[lo], grid[hi] - mag
    # in magnitude terms: "towards +inf" is away from zero for positives, towards zero for negatives
    away = {
        R.HALF_EVEN: hi % 2 == 0,
        R.HALF_UP: ~neg,
        R.HALF_DOWN: neg,
        R.HALF_TOWARDS_ZERO: np.zeros(v.shape, dtype=bool),
        R.HALF_FAR_FROM_ZERO: np.ones(v.shape, dtype=bool),
        R.TO_NEAR_INT: np.ones(v.shape, dtype=bool),
        R.UP: ~neg,
        R.DOWN: neg,
    }[policy]
    if policy in (R.UP, R.DOWN):
        pick_hi = away & (d_hi > 0)
    else:
        pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & away)
    out = np.where(pick_hi | (d_lo == 0), grid[np.where(d_lo == 0, lo, hi)], grid[lo])
    return np.where(neg, -out, out)


def ref_fp8(x: np.ndarray, scale: float, fmt: FloatFormat, policy: RoundingPolicy) -> np.ndarray:
    s = np.float32(scale)
    v = np.clip(x.astype(np.float32) / s, -fmt.max_value, fmt.max_value)
    return (ref_fp8_round(v.astype(np.float64), fmt, policy).astype(np.float32) * s).astype(np.float32)


def assert_same(actual: torch.Tensor, expected: np.ndarray) -> None:
    np.testing.assert_array_equal(actual.detach().cpu().numpy().astype(np.float64), expected.astype(np.float64))


def config(**kw) -> TensorQuantConfig:
    kw.setdefault("state", QuantState.ACTIVATED)
    return TensorQuantConfig(**kw)


# --------------------------------------------------------------------------- rounding
def _rounding_probe(dtype) -> np.ndarray:
    eps = np.finfo(dtype).eps
    ties = np.arange(-10, 11) + 0.5
    near = np.concatenate([ties * (1 + eps), ties * (1 - eps), np.nextafter(ties, 0), np.nextafter(ties, 100)])
    special = [0.0, -0.0, 0.3, -0.3, 0.7, -0.7, 1e-30, -1e-30, 1e30, -1e30, 2.0**23 + 0.5, -(2.0**22) - 0.5]
    # v - floor(v) is inexact here: rounding written with it sent these to -1
    special += [-0.5 + 2.0**-25, -0.5 + 2.0**-24, -0.5 + 2.0**-54, -0.49999]
    rng = np.random.default_rng(1)
    return np.concatenate([ties, near, special, rng.normal(0, 20, 200)]).astype(dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.name)
def test_round_with_policy_matches_reference(policy, dtype):
    v = _rounding_probe(dtype)
    got = round_with_policy(torch.from_numpy(v), policy)
    assert got.dtype == torch.from_numpy(v).dtype
    assert_same(got, ref_round(v.astype(np.float64), policy))


TIES = {
    R.HALF_EVEN: [-2, -2, -0, 0, 2, 2],
    R.HALF_UP: [-2, -1, 0, 1, 2, 3],
    R.HALF_DOWN: [-3, -2, -1, 0, 1, 2],
    R.HALF_TOWARDS_ZERO: [-2, -1, 0, 0, 1, 2],
    R.HALF_FAR_FROM_ZERO: [-3, -2, -1, 1, 2, 3],
    R.TO_NEAR_INT: [-3, -2, -1, 1, 2, 3],
    R.UP: [-2, -1, 0, 1, 2, 3],
    R.DOWN: [-3, -2, -1, 0, 1, 2],
}


@pytest.mark.parametrize("policy, expected", [pytest.param(p, e, id=p.name) for p, e in TIES.items()])
def test_ties_after_scaling(policy, expected):
    """±0.5, ±1.5, ±2.5 after dividing by the scale, through fake_quantize and quantize_to_int."""
    scale = 0.25
    ties = torch.tensor([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5]) * scale
    cfg = config(scale=scale, rounding=policy)
    assert quantize_to_int(ties, cfg).tolist() == expected
    assert fake_quantize(ties, cfg).tolist() == [e * scale for e in expected]


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.name)
def test_negative_zero(policy):
    x = torch.tensor([-0.0, 0.0, -1e-12])
    for cfg in (config(scale=0.1, rounding=policy), config(scale=0.1, symmetric=False, offset=7, rounding=policy)):
        q = quantize_to_int(x, cfg)
        y = fake_quantize(x, cfg)
        assert q[:2].tolist() == [int(cfg.offset)] * 2
        assert y[:2].tolist() == [0.0, 0.0] and torch.isfinite(y).all()


# --------------------------------------------------------------------------- linear, per tensor
def _probe_values(scale: float, qmin: int, qmax: int, offset: int, rng) -> np.ndarray:
    lo, hi = (qmin - offset) * scale, (qmax - offset) * scale
    k = np.arange(qmin - offset - 3, qmax - offset + 4)
    k = k[:: max(1, k.size // 64)]
    values = [
        (k + 0.5) * scale, k * scale, (k + 0.49) * scale, (k - 0.51) * scale,  # ties and near-ties
        [lo, hi, lo - scale, hi + scale, lo * 10, hi * 10, -0.0, 0.0],  # both clip ends
        rng.uniform(lo * 1.2, hi * 1.2 + 1e-30, 64),
    ]
    return np.concatenate([np.asarray(v, dtype=np.float64).ravel() for v in values]).astype(np.float32)


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.name)
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 8, 12, 16])
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_linear_per_tensor_matches_reference(policy, bits, symmetric):
    rng = np.random.default_rng(bits)
    for scale in (0.25, 0.1, float(rng.uniform(1e-3, 10))):
        cfg = config(num_bits=bits, symmetric=symmetric, rounding=policy, scale=scale)
        if not symmetric:
            cfg.set_qparams(scale, int(rng.integers(cfg.quant_min, cfg.quant_max + 1)))
        offset = int(cfg.offset)
        x = _probe_values(float(np.float32(scale)), cfg.quant_min, cfg.quant_max, offset, rng)
        q_ref, y_ref = ref_linear(x, [scale], [offset], 0, cfg.quant_min, cfg.quant_max, policy)
        xt = torch.from_numpy(x)
        q = quantize_to_int(xt, cfg)
        assert q.dtype == torch.int32
        assert_same(q, q_ref)
        assert_same(fake_quantize(xt, cfg), y_ref)
        assert_same(dequantize(q, cfg), y_ref)


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.name)
def test_float64_inputs_compute_in_float64(policy):
    rng = np.random.default_rng(3)
    x = np.concatenate([rng.normal(0, 3, 300), (np.arange(-40, 40) + 0.5) * 0.1])
    cfg = config(rounding=policy, scale=0.1)
    _, y_ref = ref_linear(x, [0.1], [0], 0, -128, 127, policy, compute=np.float64)
    y = fake_quantize(torch.from_numpy(x), cfg)
    assert y.dtype == torch.float64
    assert_same(y, y_ref)


@pytest.mark.parametrize("policy", [R.HALF_EVEN, R.HALF_UP, R.UP, R.TO_NEAR_INT], ids=lambda p: p.name)
@pytest.mark.parametrize("scale", [1e30, 1e-30, MIN_SCALE, 2.0**-26], ids=["1e30", "1e-30", "MIN_SCALE", "2^-26"])
def test_huge_and_tiny_scales(policy, scale):
    x = np.array([0.0, -0.0, 1e-38, -1e-38, 1e-30, -3e-30, 1e-8, -2.5e-8, 1.0, -1.0, 1e30, -1e30, 3e38, -3e38],
                 dtype=np.float32)
    for symmetric in (True, False):
        cfg = config(rounding=policy, scale=scale, symmetric=symmetric)
        q_ref, y_ref = ref_linear(x, [scale], [0], 0, cfg.quant_min, cfg.quant_max, policy)
        xt = torch.from_numpy(x)
        y = fake_quantize(xt, cfg)
        assert torch.isfinite(y).all()
        assert_same(quantize_to_int(xt, cfg), q_ref)
        assert_same(y, y_ref)


def test_32_bit_passive_uses_float64_and_int64():
    rng = np.random.default_rng(4)
    x = np.concatenate([rng.normal(0, 1e6, 200), [3e9, -3e9, 2.0**31, 0.5e-3 * 7]]).astype(np.float32)
    for policy in (R.HALF_EVEN, R.HALF_FAR_FROM_ZERO, R.DOWN):
        cfg = config(num_bits=32, state=QuantState.PASSIVE, scale=1e-3, rounding=policy)
        q_ref, y_ref = ref_linear(x, [1e-3], [0], 0, cfg.quant_min, cfg.quant_max, policy)
        y_ref = y_ref.astype(np.float32)  # computed in float64, returned in the input's dtype
        q = quantize_to_int(torch.from_numpy(x), cfg)
        assert q.dtype == torch.int64
        assert_same(q, q_ref)
        assert q.max().item() == 2**31 - 1 and q.min().item() == -(2**31)
        y = fake_quantize(torch.from_numpy(x), cfg)
        assert y.dtype == torch.float32
        assert_same(y, y_ref)
        assert_same(dequantize(q, cfg), y_ref)


def test_power_of_2_scales():
    rng = np.random.default_rng(5)
    x = rng.normal(0, 2, 500).astype(np.float32)
    for exponent in (-7, -1, 0, 3):
        scale = 2.0**exponent
        cfg = config(power_of_2=True, scale=scale, rounding=R.HALF_UP)
        _, y_ref = ref_linear(x, [scale], [0], 0, -128, 127, R.HALF_UP)
        assert_same(fake_quantize(torch.from_numpy(x), cfg), y_ref)
    s = torch.tensor([0.3, 0.25, 1e-8, 5.0, 1024.0])
    assert round_scale_to_power_of_2(s).tolist() == [2.0 ** math.ceil(math.log2(v)) for v in s.double().tolist()]
    assert round_scale_to_power_of_2(torch.tensor([0.3]), R.DOWN).tolist() == [0.25]


# --------------------------------------------------------------------------- linear, per channel
@pytest.mark.parametrize("axis", [0, 1, -1, 2])
@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.name)
def test_linear_per_channel_matches_reference(axis, policy):
    rng = np.random.default_rng(6)
    shape = (3, 4, 5)
    channels = shape[axis]
    scales = np.float32(2.0) ** rng.integers(-4, 2, channels) * rng.choice([1.0, 0.3, 0.77], channels)
    x = (rng.normal(0, 1, shape) * 40 * scales.max()).astype(np.float32)
    x.reshape(-1)[:12] = (np.arange(12) - 5.5) * 0.5  # some ties
    for symmetric in (True, False):
        cfg = config(per_channel=True, channel_axis=axis, symmetric=symmetric, rounding=policy, scale=scales)
        offsets = rng.integers(0, 256, channels) if not symmetric else np.zeros(channels)
        cfg.set_qparams(scales, offsets)
        q_ref, y_ref = ref_linear(x, scales, offsets, axis, cfg.quant_min, cfg.quant_max, policy)
        xt = torch.from_numpy(x)
        q = quantize_to_int(xt, cfg)
        assert_same(q, q_ref)
        assert_same(fake_quantize(xt, cfg), y_ref)
        assert_same(dequantize(q, cfg), y_ref)


def test_per_channel_scale_count_mismatch_is_a_config_error():
    cfg = config(per_channel=True, channel_axis=1, scale=[1.0, 2.0, 3.0])
    with pytest.raises(ConfigError, match="3 scales for 4 channels"):
        fake_quantize(torch.zeros(2, 4), cfg)
    with pytest.raises(ConfigError, match="3 scales for 4 channels"):
        quantize_to_int(torch.zeros(2, 4), cfg)


def test_missing_scale_is_a_config_error():
    with pytest.raises(ConfigError, match="no scale"):
        fake_quantize(torch.zeros(3), TensorQuantConfig())


# --------------------------------------------------------------------------- FP8
def _fp8_probe(fmt: FloatFormat, rng) -> np.ndarray:
    grid = fp8_grid(fmt)
    mids = (grid[1:] + grid[:-1]) / 2  # exact ties between neighbours
    wide = np.exp2(rng.uniform(fmt.min_exponent - fmt.mantissa_bits - 3, math.log2(fmt.max_value) + 2, 400))
    wide *= rng.choice([-1.0, 1.0], wide.size)
    values = [grid, -grid, mids, -mids, np.nextafter(mids, 0), np.nextafter(mids, np.inf), wide,
              [fmt.max_value * 1.02, -fmt.max_value * 1.1, 1e30, -1e30, -0.0, 0.0, 1e-40, -1e-40]]
    return np.concatenate([np.asarray(v, dtype=np.float64) for v in values]).astype(np.float32)


@pytest.mark.parametrize("fmt", list(FloatFormat), ids=lambda f: f.name)
@pytest.mark.parametrize("scale", [1.0, 0.37, 2.0**-4])
def test_fp8_half_even_matches_ml_dtypes(fmt, scale):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    target = {FloatFormat.E4M3: ml_dtypes.float8_e4m3fn, FloatFormat.E5M2: ml_dtypes.float8_e5m2}[fmt]
    x = _fp8_probe(fmt, np.random.default_rng(7)) * np.float32(scale)
    s = np.float32(scale)
    with np.errstate(over="ignore"):
        v = np.clip(x / s, -fmt.max_value, fmt.max_value).astype(np.float32)
    expected = (v.astype(target).astype(np.float32) * s).astype(np.float32)
    cfg = config(fp_format=fmt, scale=scale)
    got = fake_quantize(torch.from_numpy(x), cfg).numpy()
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(expected))  # -0.0 stays -0.0
    # the grid reference below agrees with ml_dtypes, so it can be trusted for the other policies
    np.testing.assert_array_equal(ref_fp8(x, scale, fmt, R.HALF_EVEN), expected)


@pytest.mark.parametrize("fmt", list(FloatFormat), ids=lambda f: f.name)
@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.name)
def test_fp8_matches_grid_reference(fmt, policy):
    rng = np.random.default_rng(8)
    for scale in (1.0, 0.37):
        x = _fp8_probe(fmt, rng) * np.float32(scale)
        cfg = config(fp_format=fmt, scale=scale, rounding=policy)
        xt = torch.from_numpy(x)
        expected = ref_fp8(x, scale, fmt, policy)
        assert_same(fake_quantize(xt, cfg), expected)
        codes = quantize_to_int(xt, cfg)
        assert_same(dequantize(codes, cfg), expected)
        grid = fp8_grid(fmt)
        assert np.isin(np.abs(codes.numpy()), grid).all()


def test_fp8_subnormals():
    fmt = FloatFormat.E4M3
    step = 2.0**-9  # smallest subnormal of E4M3
    x = torch.tensor([step, 1.5 * step, 2.5 * step, 0.5 * step, 0.49 * step, -3.5 * step, 7.5 * step])
    cfg = config(fp_format=fmt, scale=1.0)
    assert (quantize_to_int(x, cfg) / step).tolist() == [1, 2, 2, 0, 0, -4, 8]
    up = config(fp_format=fmt, scale=1.0, rounding=R.UP)
    assert (quantize_to_int(x, up) / step).tolist() == [1, 2, 3, 1, 1, -3, 8]


def test_fp8_range_per_channel():
    x = torch.tensor([[500.0, -1000.0, 1.0], [0.3, -0.3, 2.0]])
    cfg = config(fp_format="e4m3", per_channel=True, scale=[1.0, 0.5])
    y = fake_quantize(x, cfg)
    assert y[0].tolist() == [448.0, -448.0, 1.0]
    assert y[1].tolist() == [ref_fp8(np.array([0.3, -0.3, 2.0]), 0.5, FloatFormat.E4M3, R.HALF_EVEN)[i]
                             for i in range(3)]


# --------------------------------------------------------------------------- consistency
CONSISTENCY = [
    pytest.param(dict(), id="int8"),
    pytest.param(dict(symmetric=False, scale=0.05, offset=100), id="uint8-offset"),
    pytest.param(dict(num_bits=4, rounding=R.HALF_DOWN, scale=0.3), id="int4-half-down"),
    pytest.param(dict(per_channel=True, channel_axis=1, scale=[0.1, 0.2, 0.05, 1.0]), id="per-channel"),
    pytest.param(dict(num_bits=32, state=QuantState.PASSIVE, scale=1e-4), id="int32-passive"),
    pytest.param(dict(fp_format="e4m3", scale=0.01), id="e4m3"),
    pytest.param(dict(fp_format="e5m2", scale=0.5, rounding=R.HALF_FAR_FROM_ZERO), id="e5m2"),
]


@pytest.mark.parametrize("kwargs", CONSISTENCY)
def test_quantize_dequantize_equals_fake_quantize(kwargs):
    kwargs = {"scale": 0.1, **kwargs}
    cfg = config(**kwargs)
    x = torch.randn(5, 4) * 8
    torch.testing.assert_close(dequantize(quantize_to_int(x, cfg), cfg), fake_quantize(x, cfg), rtol=0, atol=0)


# --------------------------------------------------------------------------- gradients
@pytest.mark.parametrize("policy", [R.HALF_EVEN, R.HALF_TOWARDS_ZERO, R.UP], ids=lambda p: p.name)
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_straight_through_gradient_is_zero_outside_range(policy, symmetric):
    scale, offset = 0.1, (0 if symmetric else 10)
    cfg = config(scale=scale, symmetric=symmetric, rounding=policy)
    cfg.set_qparams(scale, offset)
    x_np = np.concatenate([np.linspace(-30, 30, 601), [-12.86, 12.74, 12.76, -12.84]]).astype(np.float32)
    x = torch.tensor(x_np, requires_grad=True)
    g = torch.rand(x.shape) + 0.5
    fake_quantize(x, cfg).backward(g)
    s = np.float32(scale)
    r = ref_round((x_np / s).astype(np.float64), policy) + offset
    inside = (r >= cfg.quant_min) & (r <= cfg.quant_max)
    assert 0 < inside.sum() < inside.size
    assert_same(x.grad, np.where(inside, g.numpy(), 0.0))


@pytest.mark.parametrize("policy", [R.HALF_EVEN, R.HALF_UP, R.DOWN], ids=lambda p: p.name)
@pytest.mark.parametrize("per_channel", [False, True], ids=["per-tensor", "per-channel"])
def test_lsq_scale_and_offset_gradients(policy, per_channel):
    """LSQ(+): ds = round(v) - v inside, qmin - o below, qmax - o above; do = -s outside, 0 inside."""
    rng = np.random.default_rng(9)
    x_np = (rng.normal(0, 1, (3, 200)) * np.array([[4.0], [10.0], [40.0]])).astype(np.float32)
    g_np = rng.uniform(0.5, 1.5, x_np.shape).astype(np.float32)
    scales = np.array([0.05, 0.1, 0.2] if per_channel else [0.1], dtype=np.float32)
    offsets = np.array([100.0, 128.0, 30.0] if per_channel else [128.0], dtype=np.float32)
    cfg = config(symmetric=False, per_channel=per_channel, channel_axis=0, scale=scales, offset=offsets,
                 rounding=policy)
    scale = torch.tensor(scales, requires_grad=True)
    offset = torch.tensor(offsets, requires_grad=True)
    y = fake_quantize(torch.from_numpy(x_np), cfg, scale=scale, offset=offset)
    (y * torch.from_numpy(g_np)).sum().backward()

    s = _along(scales, 2, 0).astype(np.float64)
    o = _along(offsets, 2, 0).astype(np.float64)
    v = (x_np / _along(scales, 2, 0)).astype(np.float64)
    r = ref_round(v, policy)
    q = r + o
    below, above = q < 0, q > 255
    inside = ~(below | above)
    ds = np.where(inside, r - v, np.where(below, 0 - o, 255 - o)) * g_np
    do = np.where(inside, 0.0, -s) * g_np
    reduce = (lambda t: t.sum(axis=1)) if per_channel else (lambda t: np.array([t.sum()]))
    assert below.any() and above.any()
    np.testing.assert_allclose(scale.grad.numpy(), reduce(ds), rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(offset.grad.numpy(), reduce(do), rtol=1e-4, atol=1e-4)


def test_fp8_straight_through_gradient():
    x = torch.tensor([-1000.0, -448.0, -3.0, 0.0, 5.0, 447.0, 449.0, 1e6], requires_grad=True)
    fake_quantize(x, config(fp_format="e4m3", scale=1.0)).sum().backward()
    assert x.grad.tolist() == [0, 1, 1, 1, 1, 1, 0, 0]


# --------------------------------------------------------------------------- properties
@st.composite
def linear_cases(draw):
    bits = draw(st.integers(2, 16))
    symmetric = draw(st.booleans())
    policy = draw(st.sampled_from(POLICIES))
    pow2 = draw(st.booleans())
    if pow2:
        scale = 2.0 ** draw(st.integers(-12, 6))
    else:
        scale = float(np.float32(draw(st.floats(1e-4, 50.0, allow_nan=False))))
    cfg = config(num_bits=bits, symmetric=symmetric, rounding=policy, power_of_2=pow2, scale=scale)
    if not symmetric:
        cfg.set_qparams(scale, draw(st.integers(cfg.quant_min, cfg.quant_max)))
    span = float(np.float32(1.5 * scale * 2**bits))
    values = draw(st.lists(st.floats(-span, span, width=32), min_size=1, max_size=48))
    return cfg, torch.tensor(values, dtype=torch.float32)


PROPERTY_SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY_SETTINGS
@given(linear_cases())
def test_property_idempotent(case):
    """fq(fq(x)) == fq(x). For UP/DOWN only with power-of-2 scales: ``fl(q * s) / s`` can land a hair
    above (below) ``q`` when ``s`` is not a power of two, and ceil (floor) moves it a whole step."""
    cfg, x = case
    if cfg.rounding in (R.UP, R.DOWN) and not cfg.power_of_2:
        return
    y = fake_quantize(x, cfg)
    assert torch.equal(fake_quantize(y, cfg), y)


@PROPERTY_SETTINGS
@given(linear_cases())
def test_property_error_bound_inside_range(case):
    """|x - fq(x)| <= s/2 inside the grid's range (<= s for UP/DOWN), up to float32 rounding."""
    cfg, x = case
    s, o = float(cfg.scale), float(cfg.offset)
    lo, hi = (cfg.quant_min - o) * s, (cfg.quant_max - o) * s
    inside = (x >= lo) & (x <= hi)
    bound = s if cfg.rounding in (R.UP, R.DOWN) else s / 2
    err = (fake_quantize(x, cfg) - x).abs().double()
    slack = 4 * 2.0**-24 * (x.abs().double() + s)
    assert bool((err[inside] <= bound + slack[inside]).all())


@PROPERTY_SETTINGS
@given(linear_cases())
def test_property_monotone(case):
    cfg, x = case
    xs, _ = torch.sort(x)
    y = fake_quantize(xs, cfg)
    assert bool((y[1:] >= y[:-1]).all())


@PROPERTY_SETTINGS
@given(
    st.sampled_from(list(FloatFormat)),
    st.sampled_from(POLICIES),
    st.integers(-8, 8),
    st.lists(st.floats(-1e6, 1e6, width=32), min_size=1, max_size=48),
)
def test_property_fp8_idempotent_and_monotone(fmt, policy, exponent, values):
    cfg = config(fp_format=fmt, scale=2.0**exponent, rounding=policy)
    x, _ = torch.sort(torch.tensor(values, dtype=torch.float32))
    y = fake_quantize(x, cfg)
    assert torch.equal(fake_quantize(y, cfg), y)
    assert bool((y[1:] >= y[:-1]).all())


# --------------------------------------------------------------------------- parameters
def test_qparams_from_minmax_formulas():
    lo, hi = torch.tensor([-2.0, -1.0, 0.0]), torch.tensor([1.0, 3.0, 0.0])
    s, o = qparams_from_minmax(lo, hi, TensorQuantConfig())
    np.testing.assert_allclose(s.numpy(), np.float32([4 / 255, 6 / 255, MIN_SCALE]))  # 2*absmax/(qmax-qmin)
    assert o.tolist() == [0, 0, 0]
    s, o = qparams_from_minmax(lo, hi, TensorQuantConfig(symmetric=False))
    np.testing.assert_allclose(s.numpy(), np.float32([3 / 255, 4 / 255, MIN_SCALE]))
    assert o.tolist() == [round(2 / (3 / 255)), round(1 / (4 / 255)), 0]
    s, _ = qparams_from_minmax(lo, hi, TensorQuantConfig(quant_min=0, quant_max=255))  # unsigned symmetric
    np.testing.assert_allclose(s.numpy(), np.float32([1 / 255, 3 / 255, MIN_SCALE]))
    s, _ = qparams_from_minmax(lo, hi, TensorQuantConfig(fp_format="e4m3"))
    np.testing.assert_allclose(s.numpy(), np.float32([2 / 448, 3 / 448, MIN_SCALE]))
    s, _ = qparams_from_minmax(lo, hi, TensorQuantConfig(power_of_2=True))
    assert s.tolist() == [2.0**-5, 2.0**-5, 2.0**-26]  # 4/255 and 6/255 round up to 1/32
    s, o = qparams_from_minmax(torch.tensor([1.0]), torch.tensor([2.0]), TensorQuantConfig(symmetric=False))
    assert o.tolist() == [0] and s.tolist() == [np.float32(2 / 255)]  # the range always contains 0


# --------------------------------------------------------------------------- the seeds' QLinear example
@pytest.mark.parametrize("bits, qmin, qmax", [(8, -128, 127), (9, -128, 128)])
def test_seed_qlinear_example(bits, qmin, qmax):
    v = torch.arange(1, 11, dtype=torch.float32)
    cfg = config(num_bits=bits, quant_min=qmin, quant_max=qmax, scale=2.0, rounding="ROUND_HALF_EVEN")
    assert quantize_to_int(v, cfg).tolist() == [0, 1, 2, 2, 2, 3, 4, 4, 4, 5]
    assert fake_quantize(v, cfg).tolist() == [0, 2, 4, 4, 4, 6, 8, 8, 8, 10]
    assert dequantize(quantize_to_int(v, cfg), cfg).tolist() == [0, 2, 4, 4, 4, 6, 8, 8, 8, 10]
    assert torch.equal(quantize_to_int(v, cfg).float(), torch.clip(torch.round(v / 2), qmin, qmax))


def test_seed_range_minus128_128_needs_9_bits():
    """PPQ's tutorial pairs num_of_bits=8 with [-128, 128]: 257 codes do not fit in 8 bits."""
    with pytest.raises(ConfigError, match="does not fit in 8 bits"):
        TensorQuantConfig(num_bits=8, quant_min=-128, quant_max=128)
