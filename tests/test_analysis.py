"""Analysis: graphwise / layerwise error, statistics and the report, on a small quantized CNN."""
from __future__ import annotations

import copy
import functools
import importlib.util
import math
import pathlib

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import fxq
from fxq.analysis.runner import GraphRunner
from fxq.errors import CalibrationError, ConfigError


class SmallCNN(nn.Module):
    """conv-bn-relu(inplace) -> conv -> += -> relu_ -> pool -> linear: in-place ops on purpose."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu(self.bn(self.c1(x)))
        z = self.c2(y)
        z += y
        z = torch.relu_(z)
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(z, 1), 1))


def _snr(q: torch.Tensor, f: torch.Tensor) -> float:
    return float(((q - f) ** 2).sum() / (f**2).sum())


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    model = SmallCNN().eval()
    with torch.no_grad():
        model.bn.running_mean.uniform_(-0.5, 0.5)
        model.bn.running_var.uniform_(0.5, 2.0)
    gen = torch.Generator().manual_seed(1)
    data = [torch.randn(4, 3, 16, 16, generator=gen) for _ in range(4)]
    gm = fxq.quantize(model, data, platform="trt_int8", progress=False)
    return model, gm, data


def test_runner_views_match_the_model(setup):
    model, gm, data = setup
    runner = GraphRunner(gm)
    x = data[0]
    with torch.no_grad():
        inputs = runner.bind(x)
        assert torch.equal(runner.run(inputs, fp32=False), gm(x))
        with fxq.fp32_mode(gm):
            fp32 = gm(x)
        assert torch.equal(runner.run(inputs, fp32=True), fp32)
        torch.testing.assert_close(fp32, model(x), rtol=1e-4, atol=1e-5)
    assert {n.name for n in runner.mutating} >= {"relu"}  # the inplace ReLU runs out of place


class _ViewThenReadAgain(nn.Module):
    """A quantized view of a value that is read again later, and an in-place op on a value read later."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 8 * 8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        a = self.fc(y.flatten(1))
        b = torch.relu_(y.clone())
        return a + y.mean() + b.sum()


def _record(seen: dict, node, value: torch.Tensor) -> None:
    seen[node] = value.clone()  # what the watcher was handed


@pytest.mark.parametrize("which", ["small_cnn", "aliases"])
def test_side_by_side_matches_separate_passes(setup, which, monkeypatch):
    """Lockstep views write into dead values only: same outputs, watched values, inputs and weights."""
    from fxq import fused_cpu
    from fxq.fused_cpu import cpu_fusion

    if which == "small_cnn":
        _, gm, data = setup
    else:
        torch.manual_seed(0)
        data = [torch.randn(2, 3, 8, 8) for _ in range(2)]
        gm = fxq.quantize(_ViewThenReadAgain().eval(), data, platform="trt_int8", progress=False)
    in_place = []
    real = fused_cpu.fake_quant_linear_inplace
    monkeypatch.setattr(fused_cpu, "fake_quant_linear_inplace", lambda *a: in_place.append(real(*a)) or in_place[-1])
    runner = GraphRunner(gm)
    x = data[0]
    x_before = x.clone()
    state = {k: v.clone() for k, v in gm.state_dict().items() if isinstance(v, torch.Tensor)}
    watched = [n for n in runner.nodes if n.op == "call_function" or n in runner.quantizers][::2]
    with cpu_fusion(min_numel=0, warmup_seconds=0), torch.no_grad():
        expected = [{}, {}]
        outs = [runner.run(runner.bind(x), fp32=fp32, watch={n: functools.partial(_record, seen, n) for n in watched})
                for fp32, seen in zip((True, False), expected)]
        got = [{}, {}]
        both = runner.run_side_by_side(runner.bind(x), fp32_watch={n: functools.partial(_record, got[0], n) for n in watched},
                                       quant_watch={n: functools.partial(_record, got[1], n) for n in watched})
    for out, want, seen, wanted in zip(both, outs, got, expected):
        assert torch.equal(out, want)
        assert seen.keys() == wanted.keys() and all(torch.equal(seen[n], wanted[n]) for n in seen)
    assert torch.equal(x, x_before)
    assert all(torch.equal(v, state[k]) for k, v in gm.state_dict().items() if k in state)
    if which == "small_cnn":
        assert any(in_place)  # some quantizer did write in place


def test_side_by_side_runs_quantizer_subclasses_as_they_are():
    """QAT quantizers compute with |scale| (LSQ): the runner must call their forward, not the base in-place one."""
    from fxq.fused_cpu import cpu_fusion

    torch.manual_seed(0)
    data = [torch.randn(2, 3, 12, 12) for _ in range(2)]
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3)).eval()
    qat = fxq.prepare_qat(model, "trt_int8", calib_data=data)
    with torch.no_grad():
        for fq in qat.fxq_quantizers.values():
            if isinstance(fq.scale, nn.Parameter):
                fq.scale.neg_()  # a learned LSQ scale may cross zero; QAT quantizers use its magnitude
    runner = GraphRunner(qat)
    with cpu_fusion(min_numel=0, warmup_seconds=0), fxq.analysis.runner.analysis_mode(qat):
        expected = qat(data[0])
        _, got = runner.run_side_by_side(runner.bind(data[0]))
    assert torch.equal(got, expected)


def test_overwrite_rule(setup):
    """A value may be written only by its last reader, and only while no live value shares its memory."""
    _, gm, _ = setup
    runner = GraphRunner(gm)
    q = next(n for n in runner.quantizers if n.args[0].op == "call_function" and len(n.args[0].users) == 1)
    arg = q.args[0]
    other = next(n for n in runner.nodes if n.op == "call_function" and n is not arg)
    t = torch.randn(4, 8)
    assert runner._may_overwrite(q, {arg: t}, set())
    assert not runner._may_overwrite(q, {arg: t}, None)  # overwriting not asked for
    assert not runner._may_overwrite(q, {arg: t, other: t[1:].view(-1)}, set())  # a live view
    assert not runner._may_overwrite(q, {arg: t, other: (t, 1)}, set())  # inside a live tuple
    assert not runner._may_overwrite(q, {arg: t}, {t.untyped_storage().data_ptr()})  # protected
    reads_input = next(iter(runner.placeholders[0].users))
    assert not runner._may_overwrite(reads_input, {runner.placeholders[0]: t}, set())  # a model input


@pytest.mark.parametrize("pool", [nn.MaxPool2d(3, 2, 1), nn.MaxPool2d(2, ceil_mode=True), nn.MaxPool2d(3, 1, 1, 2)],
                         ids=["resnet-stem", "ceil", "dilated"])
def test_runner_max_pool_is_exact(pool):
    """The runner pools over a channels-last copy (faster); the values must be the module's, NaN and ties included."""
    torch.manual_seed(0)
    data = [torch.randn(2, 3, 11, 11) for _ in range(2)]
    gm = fxq.quantize(nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), pool).eval(), data, "trt_int8", progress=False)
    runner = GraphRunner(gm)
    (node,) = runner.max_pools
    x = torch.randint(-3, 3, (2, 8, 9, 9)).float()  # ties everywhere
    x[0, 1, 2, 2], x[1, 3, 4, 5], x[1, 4] = float("nan"), float("inf"), -float("inf")
    with torch.no_grad():
        torch.testing.assert_close(runner._max_pool2d(node, (x,), {}), pool(x), rtol=0, atol=0, equal_nan=True)
        assert torch.equal(runner.run(runner.bind(data[0]), fp32=False), gm(data[0]))


def test_graphwise_records(setup):
    _, gm, data = setup
    report = fxq.graphwise_error_analyse(gm, data, method="snr", steps=4)
    assert isinstance(report, fxq.ErrorReport) and report.batches == 4
    assert sorted(r.name for r in report) == ["c1", "c2", "fc"]
    values = [r.value for r in report]
    assert values == sorted(values, reverse=True)  # worst first
    assert all(0 < v < 0.05 for v in values)
    assert report[0].name == max(report, key=lambda r: r.value).name
    table = str(report)
    assert table.splitlines()[2].split()[0] == report[0].name and "%" in table and "\u2588" in table
    assert report.as_dict()[report[0].name] == report[0].value
    # the FP32-only model has no error anywhere
    with fxq.fp32_mode(gm):
        clean = fxq.graphwise_error_analyse(gm, data, steps=4)
    assert all(r.value == 0.0 for r in clean) and clean.outputs[0].value == 0.0
    assert all(r.value > 0.0 for r in report) and report.outputs[0].value > 0.0


def test_graphwise_values_match_direct_computation(setup):
    _, gm, data = setup
    report = fxq.graphwise_error_analyse(gm, data, steps=None)
    noise = signal = 0.0
    c1_noise = c1_signal = 0.0
    x_q = gm.fxq_quantizers.x_q
    w_fp32 = gm.fxq_quantizers.c1_weight.fp32_backup
    with torch.no_grad():
        for x in data:
            q = gm(x)
            with fxq.fp32_mode(gm):
                f = gm(x)
            noise += float(((q - f) ** 2).sum())
            signal += float((f**2).sum())
            # c1 is measured at its raw output (the ReLU after it owns the output quantizer)
            cq = torch.conv2d(x_q(x), gm.c1.weight, gm.c1.bias, padding=1)
            cf = torch.conv2d(x, w_fp32, gm.c1.bias, padding=1)
            c1_noise += float(((cq - cf) ** 2).sum())
            c1_signal += float((cf**2).sum())
    assert report.outputs[0].value == pytest.approx(noise / signal, rel=1e-4)
    c1 = next(r for r in report if r.name == "c1")
    assert c1.measured_at == "c1"
    assert c1.value == pytest.approx(c1_noise / c1_signal, rel=1e-4)
    assert next(r for r in report if r.name == "fc").measured_at == "fxq_quantizers_fc_out"


class _CountConvs(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.convs = 0
        self.layouts: list[bool] = []  # per convolution: input and weight channels-last

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.convolution, torch.ops.aten.mkldnn_convolution):
            self.convs += 1
            x, w = args[:2]  # (a depthwise weight, one input channel each, is both layouts at once)
            self.layouts.append(not x.is_contiguous() and all(t.is_contiguous(memory_format=torch.channels_last)
                                                              for t in (x, w)))
        return func(*args, **(kwargs or {}))


def test_exactly_two_passes_per_batch(setup):
    _, gm, data = setup
    relu_calls = []
    handle = gm.relu.register_forward_hook(lambda *a: relu_calls.append(1))
    try:
        with _CountConvs() as counter:
            fxq.graphwise_error_analyse(gm, data, steps=3)
    finally:
        handle.remove()
    assert len(relu_calls) == 2 * 3
    assert counter.convs == 2 * 2 * 3  # two convs, two passes, three batches


def test_graphwise_fused_equals_eager(setup):
    """Forcing every tensor through the fused CPU path (in-place quantizers, fused metric sums) changes nothing."""
    from fxq.fused_cpu import cpu_fusion, fused_cpu_stats

    _, gm, data = setup
    with cpu_fusion(enabled=False):
        eager = fxq.graphwise_error_analyse(gm, data, steps=2, ops="quantized")
    before = fused_cpu_stats()["fused_calls"]
    with cpu_fusion(min_numel=0, warmup_seconds=0):
        fused = fxq.graphwise_error_analyse(gm, data, steps=2, ops="quantized")
    assert fused_cpu_stats()["fused_calls"] > before
    assert [r.name for r in fused] == [r.name for r in eager]
    for a, b in zip(list(fused) + fused.outputs, list(eager) + eager.outputs):
        assert a.value == pytest.approx(b.value, rel=1e-4, abs=1e-12), a.name


def test_other_metrics(setup):
    _, gm, data = setup
    cos = fxq.graphwise_error_analyse(gm, data, method="cosine", steps=2)
    values = [r.value for r in cos]
    assert values == sorted(values) and all(0.99 < v <= 1.0 + 1e-9 for v in values)
    mse = fxq.graphwise_error_analyse(gm, data, method="mse", steps=2, ops="quantized")
    assert len(mse) > 3 and all(r.value >= 0 for r in mse)
    assert {"relu", "add"} <= {r.name for r in mse}
    seed_style = fxq.graphwise_error_analyse(gm, dataloader=data, method="snr", steps=1, collate_fn=lambda b: b * 1)
    assert seed_style.batches == 1


def test_layerwise(setup):
    _, gm, data = setup
    x = data[0]
    with torch.no_grad():
        before = gm(x)
    modes = {n: fq.mode for n, fq in gm.fxq_quantizers.items()}
    net = fxq.layerwise_error_analyse(gm, data, steps=2)
    assert net.kind == "layerwise" and net.measured == "network"
    assert sorted(r.name for r in net) == ["c1", "c2", "fc"]
    assert all(r.value > 0 and r.outputs and set(r.outputs) == {"output"} for r in net)
    graphwise_out = fxq.graphwise_error_analyse(gm, data, steps=2).outputs[0].value
    assert max(r.value for r in net) <= graphwise_out * 1.5  # one layer alone is not worse than all together
    # only that layer is quantized: c1 alone is far below all together (measured 0.005x; 1x if the layers after it
    # were quantized too), and the layers' errors add up to about the whole (measured 0.81x)
    assert next(r for r in net if r.name == "c1").value < 0.1 * graphwise_out
    assert 0.5 * graphwise_out < sum(r.value for r in net) < 1.5 * graphwise_out
    # measured at the layer: c1 alone = quantized input and weight, nothing else
    own = fxq.layerwise_error_analyse(gm, data, steps=1, measure="layer")
    with torch.no_grad():
        cq = torch.conv2d(gm.fxq_quantizers.x_q(x), gm.c1.weight, gm.c1.bias, padding=1)
        cf = torch.conv2d(x, gm.fxq_quantizers.c1_weight.fp32_backup, gm.c1.bias, padding=1)
    assert next(r for r in own if r.name == "c1").value == pytest.approx(_snr(cq, cf), rel=1e-4)
    # nothing changed in the model
    with torch.no_grad():
        assert torch.equal(gm(x), before)
    assert modes == {n: fq.mode for n, fq in gm.fxq_quantizers.items()}


def test_statistics(setup):
    _, gm, data = setup
    stats = fxq.statistics(gm, data, steps=2, bins=32)
    names = [s.name for s in stats]
    assert "x_q" in names and "c1_weight" in names and "fc_out" in names
    x_q = stats.by_name("x_q")
    assert x_q.role == "activation" and x_q.fp32.count == 2 * 4 * 3 * 16 * 16
    assert len(x_q.edges) == 33 and len(x_q.fp32_hist) == 32
    assert sum(x_q.fp32_hist) == x_q.fp32.count == sum(x_q.quant_hist)  # outliers of later batches: edge bins
    assert 0.0 <= x_q.clipped < 0.01
    assert x_q.quantized.max <= x_q.grid[1] + 1e-6 and x_q.quantized.min >= x_q.grid[0] - 1e-6
    w = stats.by_name("c1_weight")
    backup = gm.fxq_quantizers.c1_weight.fp32_backup
    assert w.fp32.min == pytest.approx(float(backup.min())) and w.fp32.max == pytest.approx(float(backup.max()))
    assert w.quantized.count == backup.numel() and sum(w.quant_hist) == backup.numel()
    assert "c1_weight" in str(stats)


def test_statistics_clipped_mean_std_and_non_finite(setup):
    """``clipped`` is the share of FP32 values outside the grid; mean / std are the data's; inf / NaN values
    are left out of the histograms and moments instead of making the histogram range infinite."""
    _, gm, data = setup
    gm = copy.deepcopy(gm)
    fq = gm.fxq_quantizers.x_q
    fq.set_qparams(fq.scale / 4, fq.offset, state=fq.config.state)  # a grid that clips the inputs
    lo, hi = fq.scale.item() * fq.config.quant_min, fq.scale.item() * fq.config.quant_max
    x = torch.cat(data[:2])
    x_q = fxq.statistics(gm, data, steps=2).by_name("x_q")
    assert x_q.clipped == pytest.approx(float(((x < lo) | (x > hi)).double().mean()), abs=1e-9)
    assert x_q.clipped > 0.05
    assert x_q.fp32.mean == pytest.approx(float(x.double().mean()), abs=1e-6)
    assert x_q.fp32.std == pytest.approx(float(x.double().std(unbiased=False)), rel=1e-5)
    bad = [d.clone() for d in data[:2]]
    bad[0][0, 0, 0, :3] = torch.tensor([float("inf"), float("-inf"), float("nan")])
    x_q = fxq.statistics(gm, bad, steps=2).by_name("x_q")
    assert x_q.fp32.count == x.numel() - 3 and sum(x_q.fp32_hist) == x_q.fp32.count
    assert x_q.fp32.max < float("inf") and len(x_q.edges) > 2


def test_write_report(setup, tmp_path):
    pytest.importorskip("matplotlib")
    _, gm, data = setup
    page = fxq.write_report(gm, data, tmp_path / "rep", steps=2, layerwise=True, top_k=2)
    assert page == tmp_path / "rep" / "report.html"
    text = page.read_text()
    pngs = sorted((tmp_path / "rep" / "plots").glob("*.png"))
    assert {p.name for p in pngs} >= {"graphwise.png", "layerwise.png"} and len(pngs) == 4
    for p in pngs:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 2000
        assert f"plots/{p.name}" in text
    md = fxq.write_report(gm, data, tmp_path / "md", steps=1, fmt="md", top_k=1)
    assert md.name == "report.md" and "![graphwise" in md.read_text()
    assert not list((tmp_path / "rep").glob(".*tmp"))  # atomic writes leave no temp files


def test_errors(setup):
    model, gm, data = setup
    with pytest.raises(ConfigError, match="unknown error metric"):
        fxq.graphwise_error_analyse(gm, data, method="psnr")
    with pytest.raises(CalibrationError, match="empty"):
        fxq.graphwise_error_analyse(gm, [])
    with pytest.raises(ConfigError, match="not op nodes"):
        fxq.layerwise_error_analyse(gm, data, ops=["nope"])
    with pytest.raises(ConfigError, match="measure"):
        fxq.layerwise_error_analyse(gm, data, measure="middle")
    prepared = fxq.prepare(model, "trt_int8", data[0])
    with pytest.raises(ConfigError, match="not calibrated"):
        fxq.graphwise_error_analyse(prepared, data)
    with pytest.raises(CalibrationError):
        fxq.graphwise_error_analyse(gm, [torch.randn(2, 5, 16, 16)])


def test_metric_math():
    from fxq.analysis.metrics import MetricAccumulator

    acc = MetricAccumulator("snr")
    f = torch.tensor([3.0, 4.0])
    acc.reference(f)
    acc.compare(torch.tensor([3.0, 5.0]))
    assert acc.value == pytest.approx(1 / 25)
    cos = MetricAccumulator("cosine")
    cos.reference(torch.zeros(2, 3))
    cos.compare(torch.zeros(2, 3))
    assert cos.value == 1.0
    assert math.isnan(MetricAccumulator("mse").value)
    # exact values on a 2-sample batch: MSE over all elements, cosine per sample then averaged
    f2, q2 = torch.tensor([[1.0, 0.0], [3.0, 4.0]]), torch.tensor([[0.0, 1.0], [3.0, 4.0]])
    expected = {"mse": 2 / 4, "cosine": (0.0 + 1.0) / 2, "snr": 2 / 26}
    for method, value in expected.items():
        acc = MetricAccumulator(method)
        acc.reference(f2)
        acc.compare(q2)
        assert acc.value == pytest.approx(value), method


def test_analyse_errors_example(tmp_path):
    pytest.importorskip("matplotlib")
    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "analyse_errors.py"
    spec = importlib.util.spec_from_file_location("analyse_errors", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.__doc__ and callable(mod.main)
    res = mod.main(["--fast", "--out", str(tmp_path / "report")])
    assert res["report"].is_file() and len(list((tmp_path / "report" / "plots").glob("*.png"))) == 4
    assert len(res["graphwise"]) == len(res["layerwise"]) == 21  # ResNet-18: 20 convs + fc
    assert 0 < res["graphwise"].outputs[0].value < 0.05


def _break_one_quantizer(gm) -> tuple[str, list[str]]:
    """Make the first activation quantizer fed by an op raise (its quantized pass only: the FP32 view skips it);
    return its node name and its users' (the layer view runs it inside the op that reads it)."""
    runner = GraphRunner(gm)
    for node, fq in runner.quantizers.items():
        info = runner.quantizer_info(node)
        if info is not None and info.role == "activation" and node.args[0].op != "placeholder":
            def broken(*args, **kwargs):
                raise RuntimeError("simulated quantizer bug")

            fq.forward = broken  # instance attributes: the copy's own module only
            fq.forward_ = broken
            return node.name, [u.name for u in node.users]
    raise AssertionError("no activation quantizer after an op")


def _assert_fxqs_fault(exc_info, nodes: list[str]) -> None:
    msg = str(exc_info.value)
    assert not isinstance(exc_info.value, CalibrationError)
    assert msg.startswith(tuple(f"node {n!r} failed" for n in nodes)), msg
    assert "fxq's own" in msg and "report" in msg and "simulated quantizer bug" in msg
    assert "batch failed in the model" not in msg and "fix the data" not in msg


@pytest.mark.parametrize("tool", ["graphwise", "layerwise", "statistics"])
def test_quantized_view_failure_is_fxqs_not_the_datas(setup, tool):
    """A node failing in the quantized view only (the FP32 view ran the batch) is fxq's GraphError naming it;
    a batch the FP32 model cannot run is still the data's CalibrationError."""
    _, gm, data = setup
    broken = copy.deepcopy(gm)
    node, users = _break_one_quantizer(broken)
    run = {"graphwise": fxq.graphwise_error_analyse, "statistics": fxq.statistics,
           "layerwise": functools.partial(fxq.layerwise_error_analyse, measure="network")}[tool]
    with pytest.raises(fxq.GraphError) as exc_info:
        run(broken, data[:1], progress=False)
    _assert_fxqs_fault(exc_info, users if tool == "layerwise" else [node])
    with pytest.raises(CalibrationError, match="first analysis batch failed"):  # float64: FP32 fails too
        run(broken, [data[0].double()], progress=False)


def test_calibration_failure_of_the_rewrite_is_fxqs(setup):
    model, _, data = setup
    prepared = fxq.prepare(model, "trt_int8", data[0])
    node, _ = _break_one_quantizer(prepared)
    with pytest.raises(fxq.GraphError) as exc_info:
        fxq.calibrate(prepared, data[:2], progress=False)
    _assert_fxqs_fault(exc_info, [node])
    with pytest.raises(CalibrationError, match="first calibration batch failed"):
        fxq.calibrate(fxq.prepare(model, "trt_int8", data[0]), [data[0].double()], progress=False)


class _ConvThenView(nn.Module):
    """conv -> ReLU6 (no inplace flag, as ONNX-loaded activations are) -> depthwise conv -> .view -> linear: the
    view fails on a channels-last tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.act = nn.ReLU6()
        self.c2 = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.fc = nn.Linear(8 * 6 * 6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.c2(self.act(self.c1(x)))
        return self.fc(y.view(y.shape[0], -1))


def test_channels_last_runner(monkeypatch):
    """The error analyses run 2-D convolutions channels-last; an op that is not layout-free (here ``.view``) gets
    its input contiguous again, and the errors equal those of the plain runner up to the convolutions' sums."""
    torch.manual_seed(0)
    data = [torch.randn(4, 3, 6, 6) for _ in range(3)]
    gm = fxq.quantize(_ConvThenView().eval(), data, "trt_int8", progress=False)
    runner = GraphRunner(gm, channels_last=True)
    assert len(runner.convs) == 2 and {n.target for n in runner.restore} == {"view"}
    with _CountConvs() as counter, torch.no_grad():
        plain = [runner.run(runner.bind(x), fp32=fp32) for x in data[:1] for fp32 in (True, False)]
    assert counter.layouts == [True] * 4  # input and weight channels-last, both views
    with torch.no_grad():
        for got, want in zip(plain, [GraphRunner(gm).run(GraphRunner(gm).bind(data[0]), fp32=f) for f in (True, False)]):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    fast = fxq.graphwise_error_analyse(gm, data, steps=3, ops="quantized")
    from fxq.analysis import error

    made = []
    monkeypatch.setattr(error, "GraphRunner", lambda model, channels_last: made.append(GraphRunner(model)) or made[-1])
    exact = fxq.graphwise_error_analyse(gm, data, steps=3, ops="quantized")
    assert made and not made[0].convs
    assert [r.name for r in fast] and {r.name: r.value for r in fast} == pytest.approx(
        {r.name: r.value for r in exact}, rel=1e-3, abs=1e-9)


def test_side_by_side_activation_writes_into_its_dead_input():
    """An activation without ``inplace=True`` (ONNX-loaded ``Clip`` -> ``nn.ReLU6()``) writes into the conv output
    it alone reads in the lockstep run (a fresh output costs page faults on large tensors); values unchanged."""
    torch.manual_seed(0)
    data = [torch.randn(2, 3, 6, 6) for _ in range(2)]
    gm = fxq.quantize(_ConvThenView().eval(), data, "trt_int8", progress=False)
    runner = GraphRunner(gm)
    act = next(n for n in runner.nodes if n.op == "call_module" and isinstance(runner.modules[n.target], nn.ReLU6))
    assert act in runner.in_place and runner.modules[act.target].inplace is False  # the model's module untouched
    ptrs: dict = {}

    def watch(view):
        return {n: lambda v, n=n: ptrs.setdefault((view, n.name), v.untyped_storage().data_ptr()) for n in (conv, act)}

    conv = act.args[0]
    with torch.no_grad():
        outs = runner.run_side_by_side(runner.bind(data[0]), fp32_watch=watch("fp32"), quant_watch=watch("quant"))
        want = runner.run(runner.bind(data[0]), fp32=True), runner.run(runner.bind(data[0]), fp32=False)
    for view in ("fp32", "quant"):
        assert ptrs[view, act.name] == ptrs[view, conv.name]
    assert all(torch.equal(a, b) for a, b in zip(outs, want))


def test_metrics_of_channels_last_values_take_the_fused_sums(monkeypatch):
    """Two values permuted alike (channels-last) are summed in memory order: the fused pass, not a strided copy."""
    from fxq import fused_cpu
    from fxq.analysis.metrics import MetricAccumulator

    f = torch.randn(2, 8, 5, 5).contiguous(memory_format=torch.channels_last)
    q = (f + 0.01 * torch.randn_like(f)).contiguous(memory_format=torch.channels_last)
    handed = []
    real = fused_cpu.squared_error_sums
    monkeypatch.setattr(fused_cpu, "squared_error_sums", lambda a, b: handed.append(
        a.is_contiguous() and b.is_contiguous()) or real(a, b))
    acc = MetricAccumulator("snr")
    acc.reference(f)
    acc.compare(q)
    assert handed == [True]
    assert acc.value == pytest.approx(_snr(q, f), rel=1e-5)


class _LayoutTraps(nn.Module):
    """Readers of convolution outputs that a channels-last value would break or change: a ``flatten(y, 2)`` then
    ``.view``, a channel shuffle by ``stack`` + ``.view``, a ReLU on an ``expand`` (elements held twice)."""

    def __init__(self, trap: str) -> None:
        super().__init__()
        self.trap = trap
        self.a, self.b = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(3, 4, 3, padding=1)
        self.c = nn.Conv2d(8, 4, 3, padding=1)
        self.act = nn.ReLU()
        self.fc = nn.Linear(4 * 36, 3)
        self.pool = nn.MaxPool2d(2, return_indices=True)
        self.fc2 = nn.Linear(4 * 9, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.trap == "flatten":
            y = torch.flatten(self.a(x), 2)
            return self.fc(y.view(y.shape[0], -1))
        if self.trap == "stack":
            s = torch.stack([self.a(x), self.b(x)], 2)
            return self.c(s.view(s.shape[0], 8, 6, 6))
        if self.trap == "expand":
            return self.c(self.act(self.a(x)[:, :1].expand(-1, 8, -1, -1)))
        if self.trap == "pool_indices":  # a layout-free op giving a tuple: not a carrier of 4-D values
            y, _ = self.pool(self.a(x))
            return self.fc2(y.reshape(y.shape[0], -1)) + self.fc2(y.view(y.shape[0], -1))
        if self.trap == "keywords":  # no positional argument to read a rank from
            return self.c(torch.cat(tensors=[self.a(x), self.b(x)], dim=1))
        if self.trap == "writes":  # in-place ops on a conv output read again later; an activation by keyword
            y = self.a(x)
            z = y.clamp_(-0.5, 0.5)
            return self.fc(z.view(z.shape[0], -1)) + y.sigmoid_().sum() + nn.functional.relu(input=self.b(x)).sum()
        y = self.a(x).permute(0, 2, 3, 1)  # "permute": fed channels-last inputs, the model's own conv gives NHWC
        return self.fc(y.reshape(y.shape[0], -1)) + self.fc(y.view(y.shape[0], -1))


@pytest.mark.parametrize("trap", ["flatten", "stack", "expand", "permute", "pool_indices", "keywords", "writes",
                                  "weights"])
def test_channels_last_runner_traps(trap):
    """Each trap runs through both analyses, with the errors of the plain runner (found by a review: the first
    three failed with 'view size is not compatible' or an internal-overlap error, the last on channels-last data)."""
    torch.manual_seed(0)
    data = [torch.randn(2, 3, 6, 6) for _ in range(2)]
    if trap == "permute":
        data = [x.contiguous(memory_format=torch.channels_last) for x in data]
    model = _LayoutTraps("permute" if trap == "weights" else trap).eval()
    if trap == "weights":  # channels-last weights: the model's own conv outputs are channels-last (plain inputs)
        model = model.to(memory_format=torch.channels_last)
    gm = fxq.quantize(model, data, "trt_int8", progress=False)
    from fxq.analysis import error

    for analyse in (fxq.graphwise_error_analyse, fxq.layerwise_error_analyse):
        fast = analyse(gm, data, steps=2, ops="quantized").as_dict()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(error, "GraphRunner", lambda model, channels_last: GraphRunner(model))
            exact = analyse(gm, data, steps=2, ops="quantized").as_dict()
        assert fast and fast == pytest.approx(exact, rel=1e-3, abs=1e-9, nan_ok=True)
    runner, plain = GraphRunner(gm, channels_last=True), GraphRunner(gm)
    if trap == "weights":
        assert not runner.convs  # nothing planned
    else:
        assert runner.convs and bool(runner.restore) == (trap != "keywords")  # (permute: off at run time)
    with torch.no_grad():
        for a, b in zip(runner.run_side_by_side(runner.bind(data[0])), plain.run_side_by_side(plain.bind(data[0]))):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_in_place_activation_follows_the_model_s_mode():
    """The in-place twin is made when called: a model handed over in train mode is analysed in eval mode (RReLU's
    slope fixed), the same error twice, as the plain runner gives (the twin once kept train mode: random slopes)."""
    torch.manual_seed(0)
    data = [torch.randn(2, 3, 6, 6) for _ in range(2)]
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.RReLU(0.1, 0.3), nn.Conv2d(4, 4, 3, padding=1)).eval()
    gm = fxq.quantize(model, data, "trt_int8", progress=False)
    gm.train()
    values = [fxq.graphwise_error_analyse(gm, data, steps=2).as_dict() for _ in range(2)]
    assert values[0] == values[1]
    assert gm.training


def test_channels_last_weight_copies_stay_bounded_and_fresh():
    """One channels-last copy per conv and view, however many batches run on weights computed anew (unbaked), and
    none left stale after baking changes a weight in place (refresh)."""
    from fxq.graph.convert import bake_parameters, unbake_parameters

    torch.manual_seed(0)
    data = [torch.randn(2, 3, 6, 6) for _ in range(2)]
    gm = fxq.quantize(_ConvThenView().eval(), data, "trt_int8", progress=False)
    runner = GraphRunner(gm, channels_last=True)
    unbake_parameters(gm)
    runner.refresh()
    with torch.no_grad():
        for _ in range(5):
            runner.run_side_by_side(runner.bind(data[0]))
    assert len(runner._cl_weights) <= 2 * len(runner.convs)
    with torch.no_grad():
        bake_parameters(gm)
        runner.refresh()
        runner.run_side_by_side(runner.bind(data[0]))  # copies of the baked weights
        for p in (gm.c1.weight, *runner.fp32_params.values()):
            p.data.mul_(0.5)  # the same tensors written through .data (as baking does): no version bump
        runner.refresh()
        plain = GraphRunner(gm)
        for fp32 in (True, False):
            torch.testing.assert_close(runner.run(runner.bind(data[0]), fp32=fp32),
                                       plain.run(plain.bind(data[0]), fp32=fp32), rtol=1e-4, atol=1e-4)


def test_channels_last_analysis_under_inference_mode():
    torch.manual_seed(0)
    data = [torch.randn(2, 3, 6, 6) for _ in range(2)]
    with torch.inference_mode():
        gm = fxq.quantize(_ConvThenView().eval(), data, "trt_int8", progress=False)
        report = fxq.graphwise_error_analyse(gm, data, steps=2).as_dict()
        runner, plain = GraphRunner(gm, channels_last=True), GraphRunner(gm)
        assert runner.convs
        for a, b in zip(runner.run_side_by_side(runner.bind(data[0])), plain.run_side_by_side(plain.bind(data[0]))):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert len(report) == 3 and all(math.isfinite(v) for v in report.values())
