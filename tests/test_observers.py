"""Observers: a conformance suite every registered observer must pass, then each observer's behaviour."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import fxq
from fxq.errors import ConfigError, ObserverError
from fxq.functional import fake_quantize, qparams_from_minmax, quantize_to_int
from fxq.graph.quant_graph import QuantGraph
from fxq.nn import FakeQuantize
from fxq.observers import OBSERVERS, Observer, build_observer
from fxq.observers.histogram import count_indices, histogram_rows
from fxq.observers.kl import kl_threshold_bins
from fxq.observers.mse import expected_sq_error
from fxq.observers.percentile import PercentileObserver
from fxq.spec import MIN_SCALE, FloatFormat, QuantState, RoundingPolicy, TensorQuantConfig


# --------------------------------------------------------------------------- helpers
def calibrate(obs: Observer, batches: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``batches`` through ``obs`` once per pass, as fxq.calibrate does, and return its parameters."""
    for p in range(obs.passes):
        for b in batches:
            obs.observe(b)
        if p < obs.passes - 1:
            obs.next_pass()
    return obs.compute_qparams()


def accepted_config(name: str, **kw) -> TensorQuantConfig:
    """The first of (int8, FP8 E4M3) variants of ``kw`` that observer ``name`` accepts."""
    for extra in ({}, {"fp_format": "e4m3"}):
        try:
            cfg = TensorQuantConfig(observer=name, **kw, **extra)
            OBSERVERS.get(name)(cfg)
            return cfg
        except (ObserverError, ConfigError):
            continue
    pytest.skip(f"observer {name!r} accepts neither an int8 nor an FP8 config with {kw}")


def with_qparams(cfg: TensorQuantConfig, scale: torch.Tensor, offset: torch.Tensor) -> TensorQuantConfig:
    out = cfg.replace(state=QuantState.ACTIVATED)
    out.set_qparams(scale, offset)
    return out


def mse_of(cfg: TensorQuantConfig, scale, offset, x: torch.Tensor) -> float:
    return float((fake_quantize(x, with_qparams(cfg, scale, offset)) - x).double().pow(2).mean())


def run(name: str, cfg: TensorQuantConfig, batches, **options):
    return calibrate(OBSERVERS.get(name)(cfg, **options), batches)


# --------------------------------------------------------------------------- conformance
class ObserverConformance:
    """What every observer must do. Subclass and override the ``name`` fixture to check another one."""

    @pytest.fixture
    def name(self) -> str:
        raise NotImplementedError

    def test_registered(self, name):
        cls = OBSERVERS.get(name)
        assert issubclass(cls, Observer)
        assert cls.name == name
        assert cls.passes in (1, 2)
        cfg = accepted_config(name)
        assert isinstance(build_observer(cfg, where="layer1.out"), cls)

    def test_no_data_is_an_error(self, name):
        obs = OBSERVERS.get(name)(accepted_config(name), where="layer1.out")
        with pytest.raises(ObserverError, match=f"'{name}'.*layer1.out"):
            obs.compute_qparams()

    @pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
    def test_zero_range_gives_min_scale(self, name, symmetric):
        cfg = accepted_config(name, symmetric=symmetric)
        scale, offset = run(name, cfg, [torch.zeros(4, 8), torch.zeros(4, 8)])
        assert scale.tolist() == [np.float32(MIN_SCALE)]
        assert torch.isfinite(offset).all() and cfg.quant_min <= float(offset) <= cfg.quant_max
        fq = fake_quantize(torch.zeros(4, 8), with_qparams(cfg, scale, offset))
        assert torch.equal(fq, torch.zeros(4, 8))

    def test_zero_range_power_of_2(self, name):
        cfg = accepted_config(name, power_of_2=True)
        scale, _ = run(name, cfg, [torch.zeros(16)])
        assert scale.tolist() == [2.0**-26]  # the smallest power of two >= MIN_SCALE

    @pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
    def test_non_finite_data_is_an_error_naming_the_observer(self, name, bad):
        cfg = accepted_config(name)
        batches = [torch.randn(8, 16) for _ in range(3)]
        batches[1][3, 5] = bad
        obs = OBSERVERS.get(name)(cfg, where="head.softmax")
        with pytest.raises(ObserverError, match=f"observer '{name}' at 'head.softmax'.*NaN or Inf"):
            calibrate(obs, batches)

    def test_per_channel_scale_count(self, name):
        try:
            cfg = accepted_config(name, per_channel=True, channel_axis=1)
        except pytest.skip.Exception:
            with pytest.raises(ObserverError, match="per-tensor"):
                OBSERVERS.get(name)(TensorQuantConfig(per_channel=True, channel_axis=1))
            return
        x = torch.randn(4, 6, 5) * torch.arange(1, 7).reshape(1, 6, 1)
        scale, offset = run(name, cfg, [x, x * 0.5])
        assert scale.shape == (6,) and offset.shape == (6,)
        assert bool((scale > 0).all())
        cfg = with_qparams(cfg, scale, offset)
        cfg.check_channels(x.shape)
        assert torch.isfinite(fake_quantize(x, cfg)).all()

    @pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
    def test_passes_protocol_and_result_types(self, name, symmetric):
        cfg = accepted_config(name, symmetric=symmetric)
        batches = [torch.randn(8, 16) * 3 + 1 for _ in range(3)]
        obs = OBSERVERS.get(name)(cfg)
        if obs.passes == 2:
            for b in batches:
                obs.observe(b)
            with pytest.raises(ObserverError, match="next_pass"):
                obs.compute_qparams()
            obs.reset()
        scale, offset = calibrate(obs, batches)
        for t in (scale, offset):
            assert t.dtype == torch.float32 and t.dim() == 1 and t.numel() == 1 and t.device.type == "cpu"
        assert bool(torch.isfinite(scale).all() and (scale >= MIN_SCALE).all())
        assert float(offset) == round(float(offset)) and cfg.quant_min <= float(offset) <= cfg.quant_max
        assert torch.equal(torch.stack(calibrate(OBSERVERS.get(name)(cfg), batches)), torch.stack((scale, offset)))
        obs.reset()
        with pytest.raises(ObserverError, match="saw no data"):
            obs.compute_qparams()

    def test_usable_by_fake_quantize(self, name, device):
        cfg = accepted_config(name)
        fq = FakeQuantize(cfg, name="block.out").to(device)
        fq.set_mode("observe")
        batches = [torch.randn(8, 16, device=device) * 2 for _ in range(3)]
        for p in range(fq.observer.passes):
            for b in batches:
                assert torch.equal(fq(b), b)  # observing passes values through
            if p < fq.observer.passes - 1:
                fq.observer.next_pass()
        fq.compute_qparams()
        assert fq.state is QuantState.ACTIVATED and fq.scale.device.type == device
        fq.set_mode("quantize")
        x = torch.cat(batches)
        y = fq(x)
        assert y.shape == x.shape and torch.isfinite(y).all()
        assert torch.equal(fq(y), y)  # values already on the grid stay there
        assert float((y - x).abs().max()) <= float(x.abs().max())


class TestRegisteredObservers(ObserverConformance):
    @pytest.fixture(params=OBSERVERS.names())
    def name(self, request) -> str:
        return request.param


@pytest.mark.parametrize("name", [n for n in OBSERVERS.names() if OBSERVERS.get(n).passes == 2])
def test_nan_seen_only_in_the_second_pass_is_an_error(name):
    cfg = accepted_config(name)
    obs = OBSERVERS.get(name)(cfg)
    obs.observe(torch.randn(64))
    obs.next_pass()
    bad = torch.randn(64)
    bad[7] = math.nan
    obs.observe(bad)
    with pytest.raises(ObserverError, match=f"'{name}'.*NaN"):
        obs.compute_qparams()


def test_every_issue_observer_is_registered():
    assert {"minmax", "ema", "percentile", "kl", "mse", "isotone", "floating"} <= set(OBSERVERS.names())


@pytest.mark.parametrize(
    "name, kwargs, words",
    [
        ("kl", dict(per_channel=True), "per-tensor"),
        ("kl", dict(fp_format="e4m3"), "floating"),
        ("mse", dict(fp_format="e5m2"), "floating"),
        ("isotone", dict(per_channel=True), "per-tensor"),
        ("floating", dict(), "fp_format"),
    ],
)
def test_unsupported_configs_are_rejected_early(name, kwargs, words):
    with pytest.raises(ObserverError, match=words):
        OBSERVERS.get(name)(TensorQuantConfig(**kwargs))


@pytest.mark.parametrize(
    "name, options",
    [("percentile", dict(percentile=0.3)), ("percentile", dict(percentile=1.5)), ("ema", dict(momentum=1.0)),
     ("ema", dict(momentum=-0.1)), ("kl", dict(bins=1)), ("mse", dict(candidates=0)),
     ("isotone", dict(steps=0)), ("floating", dict(candidates=0))],
)
def test_invalid_options(name, options):
    cfg = TensorQuantConfig(fp_format="e4m3") if name == "floating" else TensorQuantConfig()
    with pytest.raises(ConfigError, match=name):
        OBSERVERS.get(name)(cfg, **options)


def test_reset_keeps_options():
    obs = OBSERVERS.get("percentile")(TensorQuantConfig(), percentile=0.99)
    obs.observe(torch.randn(100))
    obs.reset()
    assert obs.percentile == 0.99 and obs.num_observed == 0


# --------------------------------------------------------------------------- percentile
def _nearest_rank(x: torch.Tensor, p: float) -> tuple[float, float]:
    v, _ = torch.sort(x.reshape(-1))
    n = v.numel()
    rank = math.ceil(p * n - 1e-9)
    return float(v[n - rank]), float(v[rank - 1])


def test_percentile_nearest_rank():
    x = torch.arange(1, 10001, dtype=torch.float32)
    cfg = TensorQuantConfig(symmetric=False)
    scale, offset = run("percentile", cfg, [x[torch.randperm(x.numel())]])
    ref = qparams_from_minmax(torch.tensor([2.0]), torch.tensor([9999.0]), cfg)
    assert torch.equal(scale, ref[0]) and torch.equal(offset, ref[1])


@pytest.mark.parametrize("p, n", [(0.9999, 200_000), (0.99, 1000), (0.9, 100_000), (1.0, 5000)],
                         ids=["blocks", "topk", "kthvalue", "max"])
def test_percentile_paths_agree_with_sorting(p, n):
    x = torch.randn(n) ** 3
    lo, hi = _nearest_rank(x, p)
    cfg = TensorQuantConfig(symmetric=False)
    scale, offset = run("percentile", cfg, [x], percentile=p)
    ref = qparams_from_minmax(torch.tensor([lo]), torch.tensor([hi]), cfg)
    assert torch.equal(scale, ref[0]) and torch.equal(offset, ref[1])


def _sorted_tails(rows: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
    v = np.sort(rows.double().numpy(), axis=1)
    return v[:, ::-1][:, :k], v[:, :k]


@pytest.mark.parametrize(
    "make",
    [
        lambda g: torch.randn(1, 200_003, generator=g),  # length not a multiple of the block
        lambda g: torch.relu(torch.randn(3, 100_000, generator=g)).clamp_max(1.5),  # ties at both extremes
        lambda g: torch.randint(-3, 4, (2, 70_000), generator=g).float(),  # few distinct values
        lambda g: torch.cat([torch.randn(1, 99_000, generator=g), 100 + torch.randn(1, 1_000, generator=g)], 1),
        lambda g: -torch.arange(150_000.0).reshape(1, -1),  # sorted: all winners in adjacent blocks
    ],
    ids=["odd-length", "relu6-ties", "few-values", "clustered-outliers", "sorted"],
)
@pytest.mark.parametrize("k", [1, 7, 121, 964])
def test_percentile_block_tails_are_exact(make, k):
    from fxq.observers.percentile import _tails

    rows = make(torch.Generator().manual_seed(k))
    top, bottom = _tails(rows, k)
    ref_top, ref_bottom = _sorted_tails(rows, k)
    np.testing.assert_array_equal(top.double().numpy(), ref_top)
    np.testing.assert_array_equal(bottom.double().numpy(), ref_bottom)


def test_percentile_clips_outliers():
    x = torch.randn(100_000)
    x[:5] = 1000.0
    s_pct, _ = run("percentile", TensorQuantConfig(), [x])
    s_max, _ = run("minmax", TensorQuantConfig(), [x])
    assert float(s_pct) < 0.01 * float(s_max)
    assert 3.0 < float(s_pct) * 127.5 < 5.0  # about the 99.99th percentile of N(0, 1)


def test_percentile_averages_batches():
    a = torch.arange(1, 10001, dtype=torch.float32)
    cfg = TensorQuantConfig(symmetric=False)
    scale, _ = run("percentile", cfg, [a, 3 * a])
    ref, _ = qparams_from_minmax(torch.tensor([(2.0 + 6.0) / 2]), torch.tensor([(9999.0 + 29997.0) / 2]), cfg)
    assert torch.equal(scale, ref)


def test_percentile_per_channel():
    x = torch.randn(5, 3, 400) * torch.tensor([1.0, 10.0, 100.0]).reshape(1, 3, 1)
    cfg = TensorQuantConfig(symmetric=False, per_channel=True, channel_axis=1)
    scale, offset = run("percentile", cfg, [x], percentile=0.99)
    bounds = [_nearest_rank(x[:, c], 0.99) for c in range(3)]
    ref = qparams_from_minmax(torch.tensor([b[0] for b in bounds]), torch.tensor([b[1] for b in bounds]), cfg)
    assert torch.equal(scale, ref[0]) and torch.equal(offset, ref[1])


# --------------------------------------------------------------------------- kl
def _kl_pseudocode(hist: np.ndarray, levels: int) -> int:
    """TensorRT's published loop, written directly: the kept-bin count with the smallest KL(P || Q)."""
    best = None
    for i in range(levels, hist.size + 1):
        p = hist[:i].astype(np.float64).copy()
        p[i - 1] += hist[i:].sum()
        sliced = hist[:i].astype(np.float64)
        q = np.zeros(i)
        m = i // levels
        for g in range(levels):
            a, b = g * m, (i if g == levels - 1 else (g + 1) * m)
            nonzero = sliced[a:b] > 0
            if nonzero.any():
                q[a:b][nonzero] = sliced[a:b].sum() / nonzero.sum()
        if p.sum() == 0 or q.sum() == 0:
            continue
        p, q = p / p.sum(), q / q.sum()
        support = p > 0
        if (q[support] == 0).any():
            continue  # infinite divergence
        kl = float(np.sum(p[support] * np.log(p[support] / q[support])))
        if best is None or kl < best[0] - 1e-12:
            best = (kl, i)
    return best[1]


@pytest.mark.parametrize("seed", range(6))
def test_kl_search_matches_the_published_pseudocode(seed):
    rng = np.random.default_rng(seed)
    levels = int(rng.integers(4, 24))
    data = np.abs(rng.laplace(size=int(rng.integers(200, 20000))))
    hist, _ = np.histogram(data, bins=160, range=(0, data.max()))
    assert kl_threshold_bins(torch.from_numpy(hist), levels) == _kl_pseudocode(hist, levels)


def _laplace_batches(n=4, size=50_000, seed=0):
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(n, size, generator=g) - 0.5
    return list(-torch.sign(u) * torch.log1p(-2 * u.abs()))  # Laplace(0, 1)


@pytest.mark.parametrize("name", ["kl", "mse"])
@pytest.mark.parametrize("bits, gain", [(8, 0.95), (4, 0.8)])
def test_clip_heavy_tail_and_beat_minmax_on_laplace(name, bits, gain):
    """200k Laplace samples reach about 12 b; the best 8-bit clip is about 10 b, so the gain is modest there."""
    batches = _laplace_batches()
    x = torch.cat(batches)
    cfg = TensorQuantConfig(num_bits=bits)
    s_ref, o_ref = run("minmax", cfg, batches)
    scale, offset = run(name, cfg, batches)
    assert float(scale) < 0.95 * float(s_ref)  # the tail is clipped
    assert mse_of(cfg, scale, offset, x) < gain * mse_of(cfg, s_ref, o_ref, x)


def test_kl_unsigned_and_asymmetric():
    x = torch.relu(torch.cat(_laplace_batches()))
    for cfg in (TensorQuantConfig(quant_min=0, quant_max=255), TensorQuantConfig(symmetric=False)):
        scale, offset = run("kl", cfg, [x])
        s_ref, o_ref = run("minmax", cfg, [x])
        assert float(offset) == 0 and float(scale) < float(s_ref)


# --------------------------------------------------------------------------- histograms
def test_histogram_rows_and_the_sync_free_count():
    rows = torch.tensor([[0.0, 0.5, 0.99, 1.0, 5.0, -3.0, math.nan], [2.0, 2.0, 2.5, 3.9, 4.0, 1.0, 2.1]])
    counts = histogram_rows(rows, torch.tensor([0.0, 2.0]), torch.tensor([0.25, 0.5]), 4)
    assert counts.tolist() == [[2, 0, 1, 3, 1], [4, 1, 0, 2, 0]]  # clipped into the end bins; NaN last
    index = torch.randint(0, 50, (1000,))
    assert torch.equal(count_indices(index, 64, sync_free=True), count_indices(index, 64, sync_free=False))


# --------------------------------------------------------------------------- mse
@pytest.mark.parametrize("policy", [RoundingPolicy.HALF_EVEN, RoundingPolicy.UP], ids=lambda p: p.name)
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_expected_error_matches_the_sampled_error(policy, symmetric):
    """The histogram model's expected error equals the real error of a sample it was built from."""
    x = torch.cat(_laplace_batches(2, 100_000, seed=3)) + (0 if symmetric else 2.0)
    lo, hi = float(x.min()), float(x.max())
    bins = 4096
    counts = torch.histc(x, bins, lo, hi).reshape(1, -1)
    cfg = TensorQuantConfig(num_bits=6, symmetric=symmetric, rounding=policy)
    fracs = torch.tensor([0.2, 0.5, 1.0], dtype=torch.float64)
    scale, offset = qparams_from_minmax(lo * fracs, hi * fracs, cfg)
    expected = expected_sq_error(
        counts, torch.tensor([lo]), torch.tensor([(hi - lo) / bins]), scale.reshape(1, -1), offset.reshape(1, -1),
        cfg.quant_min, cfg.quant_max, policy,
    )[0] / x.numel()
    for k in range(3):
        sampled = mse_of(cfg, scale[k : k + 1], offset[k : k + 1], x)
        assert abs(float(expected[k]) - sampled) < 0.03 * sampled, (k, float(expected[k]), sampled)


def test_mse_is_best_on_laplace():
    batches = _laplace_batches()
    x = torch.cat(batches)
    cfg = TensorQuantConfig(num_bits=6)
    errors = {name: mse_of(cfg, *run(name, cfg, batches), x) for name in ("mse", "kl", "percentile", "minmax")}
    assert errors["mse"] <= 1.01 * min(errors.values()), errors


def test_mse_asymmetric_skewed_data():
    g = torch.Generator().manual_seed(1)
    x = torch.empty(200_000).exponential_(generator=g) - 0.5
    cfg = TensorQuantConfig(symmetric=False, num_bits=4)
    s, o = run("mse", cfg, [x])
    s_ref, o_ref = run("minmax", cfg, [x])
    assert mse_of(cfg, s, o, x) < 0.7 * mse_of(cfg, s_ref, o_ref, x)
    assert float(o) > 0  # the negative end is still represented


def test_mse_per_channel():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(6, 3, 40, generator=g) * torch.arange(1, 7).reshape(6, 1, 1)
    w[:, 0, 0] *= 8  # one outlier per output channel
    cfg = TensorQuantConfig(per_channel=True, channel_axis=0, num_bits=4)
    s, o = run("mse", cfg, [w])
    s_ref, o_ref = run("minmax", cfg, [w])
    assert s.shape == (6,) and bool((s < s_ref).all())
    fq = fake_quantize(w, with_qparams(cfg, s, o))
    fq_ref = fake_quantize(w, with_qparams(cfg, s_ref, o_ref))
    per_row = (fq - w).pow(2).sum((1, 2))
    per_row_ref = (fq_ref - w).pow(2).sum((1, 2))
    assert bool((per_row < per_row_ref).all())


def test_mse_power_of_2_candidates_are_powers_of_2():
    cfg = TensorQuantConfig(power_of_2=True)
    s, _ = run("mse", cfg, _laplace_batches(2))
    assert math.log2(float(s)).is_integer()


# --------------------------------------------------------------------------- ema
def test_ema_moves_toward_new_data():
    cfg = TensorQuantConfig(symmetric=False)
    obs = OBSERVERS.get("ema")(cfg, momentum=0.5)
    obs.observe(torch.tensor([-1.0, 1.0]))
    hi = [1.0]
    for _ in range(6):
        obs.observe(torch.tensor([-1.0, 9.0]))
        obs.compute_qparams()
        hi.append(float(obs.max_val))
    assert hi == [9 - 8 * 0.5**k for k in range(7)]  # m <- 0.5 m + 0.5 * batch
    scale, _ = obs.compute_qparams()
    s_minmax, _ = run("minmax", cfg, [torch.tensor([-1.0, 1.0]), torch.tensor([-1.0, 9.0])])
    assert float(scale) < float(s_minmax)


def test_ema_momentum_zero_follows_the_last_batch():
    cfg = TensorQuantConfig(per_channel=True)
    last = torch.randn(3, 10)
    scale, _ = run("ema", cfg, [torch.randn(3, 10) * 5, last], momentum=0.0)
    ref, _ = run("minmax", cfg, [last])
    assert torch.equal(scale, ref)


# --------------------------------------------------------------------------- isotone
def _argmax_kept(cfg: TensorQuantConfig, scale, offset, probs: torch.Tensor) -> int:
    q = quantize_to_int(probs, with_qparams(cfg, scale, offset))
    top2 = torch.topk(q, 2, dim=-1).values
    return int((top2[:, 0] > top2[:, 1]).sum())


def _softmax_batches():
    g = torch.Generator().manual_seed(5)
    batches = []
    for _ in range(4):
        logits = torch.randn(512, 10, generator=g) * 2
        logits[:256, 1] = logits[:256, 0] + torch.rand(256, generator=g) * 0.05 + 0.001  # close runners-up
        logits[:256, 2:] -= 1.0
        logits[256:300, 3] += 12  # confident rows: probabilities near 1
        batches.append(torch.softmax(logits, dim=-1))
    return batches


@pytest.mark.parametrize(
    "kwargs", [dict(symmetric=False), dict(quant_min=0, quant_max=255), dict(num_bits=4, symmetric=False)],
    ids=["uint8-asym", "uint8-sym", "uint4"],
)
def test_isotone_keeps_more_argmaxes_than_minmax(kwargs):
    batches = _softmax_batches()
    probs = torch.cat(batches)
    cfg = TensorQuantConfig(**kwargs)
    s_iso, o_iso = run("isotone", cfg, batches)
    s_ref, o_ref = run("minmax", cfg, batches)
    kept_iso = _argmax_kept(cfg, s_iso, o_iso, probs)
    kept_ref = _argmax_kept(cfg, s_ref, o_ref, probs)
    assert kept_iso > kept_ref
    assert float(s_iso) < float(s_ref)
    # no candidate of the search grid does better
    for f in (0.75, 0.5, 0.3, 0.1):
        s, o = qparams_from_minmax(probs.min().reshape(1) * f, probs.max().reshape(1) * f, cfg)
        assert _argmax_kept(cfg, s, o, probs) <= kept_iso


def test_isotone_keeps_every_well_separated_argmax():
    probs = torch.softmax(torch.randn(300, 7) * 3, dim=-1)
    top2 = torch.topk(probs, 2, dim=-1).values
    probs = probs[(top2[:, 0] - top2[:, 1]) > 0.05]
    cfg = TensorQuantConfig(symmetric=False)
    scale, offset = run("isotone", cfg, [probs])
    assert _argmax_kept(cfg, scale, offset, probs) == probs.shape[0]
    # nothing to gain from a finer grid: the widest range that keeps everything is chosen
    assert torch.equal(scale, run("minmax", cfg, [probs])[0])


def test_isotone_single_column_falls_back_to_minmax():
    x = torch.rand(20, 1)
    cfg = TensorQuantConfig(symmetric=False)
    assert torch.equal(run("isotone", cfg, [x])[0], run("minmax", cfg, [x])[0])


# --------------------------------------------------------------------------- floating
@pytest.mark.parametrize("fmt", list(FloatFormat), ids=lambda f: f.name)
@pytest.mark.parametrize("per_channel", [False, True], ids=["per-tensor", "per-channel"])
def test_floating_picks_powers_of_2(fmt, per_channel):
    x = torch.randn(4, 3, 50) * torch.tensor([0.01, 1.0, 300.0]).reshape(1, 3, 1)
    cfg = TensorQuantConfig(fp_format=fmt, per_channel=per_channel, channel_axis=1)
    scale, offset = run("floating", cfg, [x])
    assert scale.numel() == (3 if per_channel else 1) and not offset.any()
    assert all(math.log2(s).is_integer() for s in scale.tolist())


@pytest.mark.parametrize("fmt", list(FloatFormat), ids=lambda f: f.name)
def test_floating_recovers_an_fp8_grid_exactly(fmt):
    """Values already on a power-of-2-scaled FP8 grid: the floating observer finds that scale."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    target = {FloatFormat.E4M3: ml_dtypes.float8_e4m3fn, FloatFormat.E5M2: ml_dtypes.float8_e5m2}[fmt]
    rng = np.random.default_rng(0)
    values = (rng.normal(0, 1, 4000) * fmt.max_value / 16).clip(-fmt.max_value / 4, fmt.max_value / 4)
    top = {FloatFormat.E4M3: 144.0, FloatFormat.E5M2: 20480.0}[fmt]  # on the grid; top / max is not a power of 2
    values[0] = top
    x = torch.from_numpy(values.astype(np.float32).astype(target).astype(np.float32)) * 2.0**-5
    assert float(x.abs().max()) == top * 2.0**-5
    cfg = TensorQuantConfig(fp_format=fmt)
    s, o = run("floating", cfg, [x])
    s_ref, o_ref = run("minmax", cfg, [x])
    assert mse_of(cfg, s, o, x) == 0.0
    assert mse_of(cfg, s_ref, o_ref, x) > 0.0


@pytest.mark.parametrize("fmt", list(FloatFormat), ids=lambda f: f.name)
def test_floating_beats_minmax_mse(fmt):
    batches = [b * 1e-3 for b in _laplace_batches(2)]
    x = torch.cat(batches)
    cfg = TensorQuantConfig(fp_format=fmt)
    s, o = run("floating", cfg, batches)
    pow2 = cfg.replace(power_of_2=True)
    assert mse_of(cfg, s, o, x) <= mse_of(pow2, *run("minmax", pow2, batches), x)
    assert mse_of(cfg, s, o, x) <= 1.1 * mse_of(cfg, *run("minmax", cfg, batches), x)


class _NonNegativeOutputs(torch.nn.Module):
    """Every op whose output cannot be negative, each read by a conv (so each gets an observed input quantizer)."""

    def __init__(self) -> None:
        super().__init__()
        self.convs = torch.nn.ModuleList(torch.nn.Conv2d(4, 4, 3, padding=1) for _ in range(7))
        self.relu6 = torch.nn.ReLU6()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.convs
        y = c[0](torch.relu(x))
        y = c[1](self.relu6(y))
        y = c[2](torch.clamp(y, min=0.0))
        y = c[3](torch.sigmoid(y) * 1.0)  # the sigmoid's own quantizer is the Mul's input
        y = c[4](torch.nn.functional.relu6(y) + y.clamp(0, 2))
        y = c[5](torch.softmax(y, dim=1))
        return c[6](y.clamp(min=-1.0))  # a negative floor: both tails observed


@pytest.mark.parametrize("platform", ["trt_int8", "ort_int8", "academic_int8"])
@pytest.mark.parametrize("algorithm", ["percentile", "minmax"])
def test_nonnegative_outputs_skip_the_lower_tail_with_identical_parameters(monkeypatch, platform, algorithm):
    """Observers of a ReLU / clip-at-0 / sigmoid / softmax output skip the lower tail (its statistics cannot move
    the range off 0): every scale and offset is the one the full statistics give."""
    import fxq.graph.calibrate as calibrate_module

    torch.manual_seed(0)
    model = _NonNegativeOutputs().eval()
    data = [torch.randn(2, 4, 24, 24) * 3 for _ in range(3)]
    setting = fxq.QuantizationSetting()
    setting.quantize_activation_setting.calib_algorithm = algorithm
    decide = calibrate_module._nonnegative_input
    flags: dict[str, bool] = {}
    monkeypatch.setattr(calibrate_module, "_nonnegative_input",
                        lambda graph, name, modules: flags.setdefault(name, decide(graph, name, modules)))
    fast = fxq.quantize(model, data, platform, setting=setting, progress=False)
    assert sum(flags.values()) >= 3 and not all(flags.values()), flags
    monkeypatch.setattr(calibrate_module, "_nonnegative_input", lambda *a: False)
    full = fxq.quantize(model, data, platform, setting=setting, progress=False)
    for (name, a), (_, b) in zip(QuantGraph(fast).quantizers(), QuantGraph(full).quantizers()):
        assert torch.equal(a.scale, b.scale) and torch.equal(a.offset, b.offset), name


class _Attention(torch.nn.Module):
    """Single-head attention whose softmax is peaky on few positions: the peaks are a tiny share of its values."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48)
        self.out = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        attn = torch.softmax(q @ k.transpose(-1, -2) * 2.0, dim=-1)
        return self.out(attn @ v)


def test_bounded_outputs_keep_their_extremes_under_percentile():
    """A softmax's output is bounded, so percentile calibration keeps its observed maximum: clipping at the
    99.99th percentile cut the attention's rare peak probabilities (PP-OCRv5's recognizer: a softmax clipped at
    0.052, its output 88 % noise -> 39 %)."""
    torch.manual_seed(0)
    model = _Attention().eval()
    data = [torch.randn(4, 64, 16) * 3 for _ in range(3)]
    q = fxq.quantize(model, data, "trt_int8", progress=False)
    softmax_fq = next(fq for name, fq in QuantGraph(q).quantizers() if name.startswith("softmax"))
    with torch.no_grad():
        peak = max(float(torch.softmax((lambda a: a[0] @ a[1].transpose(-1, -2) * 2.0)(
            model.qkv(x).chunk(3, dim=-1)[:2]), dim=-1).max()) for x in data)
    top = float(softmax_fq.scale.reshape(-1)[0]) * 127
    assert top >= peak * 0.99, (top, peak)  # within half a step of the peak (symmetric int8: absmax / 127.5)
    observer = PercentileObserver(TensorQuantConfig(), percentile=0.99)
    values = torch.cat([torch.zeros(9990), torch.ones(10)])
    observer.nonnegative = observer.bounded = True
    observer.observe(values)
    scale, _ = observer.compute_qparams()
    want, _ = qparams_from_minmax(torch.tensor([0.0]), torch.tensor([1.0]), TensorQuantConfig())
    assert torch.allclose(scale, want)  # the maximum; unbounded, the 99th percentile would be 0


def test_an_entropy_threshold_inside_the_bulk_is_warned_about(caplog):
    """KL calibration is meant to cut a tail; on a spiky histogram (PP-OCRv5's detector on rendered pages: a
    threshold of 0.46 for a tensor of mean 2.4, every probability then 0) it cut the bulk, silently."""
    torch.manual_seed(0)
    spikes = (torch.rand(10) * 8 + 0.8).repeat_interleave(20000)
    spiky = torch.cat([torch.randn(200000) * 1.7 + 2.4, spikes, torch.tensor([14.5])])
    padded = torch.cat([torch.relu(spiky), torch.zeros(16_000_000)])  # a sparse ReLU map: zeros do not hide it
    for data, warned in ((spiky, True), (padded, True), (torch.randn(200000), False)):
        caplog.clear()
        observer = build_observer(TensorQuantConfig(observer="kl"), where="t")
        for p in range(observer.passes):
            observer.observe(data)
            if p + 1 < observer.passes:
                observer.next_pass()
        with caplog.at_level("WARNING", logger="fxq.observers.kl"):
            scale, _ = observer.compute_qparams()
        assert ("clips" in caplog.text) is warned, caplog.text


@pytest.mark.parametrize("name", ["kl", "mse"])
def test_a_batch_with_a_bin_past_float32_counting_is_counted_exactly(name):
    """``histc`` counts in float32: 2**24 + 3 zeros (a large ReLU map) made the NaN count read off the total
    non-zero, and calibration refused the data as NaN."""
    data = torch.cat([torch.zeros(2 ** 24 + 3), torch.linspace(0.1, 4.0, 1000)])
    observer = build_observer(TensorQuantConfig(observer=name), where="t")
    for p in range(observer.passes):
        observer.observe(data)
        if p + 1 < observer.passes:
            observer.next_pass()
    scale, _ = observer.compute_qparams()
    assert torch.isfinite(scale).all() and float(scale.reshape(-1)[0]) > 0
    assert int(observer.hist[0, -1]) == 0 and int(observer.hist.sum()) == data.numel()


@pytest.mark.parametrize("n", [10_000, 500_000])  # k = 100 (block tails) and 5000 (kthvalue) at p = 0.99
def test_a_tensor_read_for_its_peaks_keeps_its_max_and_ranks_only_its_lower_tail(n):
    torch.manual_seed(0)
    x = torch.randn(2, n // 2) ** 3
    ranked, peaks = (PercentileObserver(TensorQuantConfig(per_channel=True, channel_axis=0), percentile=0.99)
                     for _ in range(2))
    peaks.keeps_max = True
    for observer in (ranked, peaks):
        observer.observe(x)
    torch.testing.assert_close(peaks._sum_hi, x.amax(dim=1))
    torch.testing.assert_close(peaks._sum_lo, ranked._sum_lo)
    assert bool((ranked._sum_hi < peaks._sum_hi).all())
