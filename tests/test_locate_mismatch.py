"""fxq.locate_mismatch and ``fxq verify``: exported ONNX and ncnn files against the simulation, tensor by tensor, in
codes."""
from __future__ import annotations

import copy
import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

import fxq
from fxq.analysis.mismatch import HISTOGRAM_BINS, MismatchReport
from fxq.cli import main
from fxq.graph.info import is_quantizer_node

from _export_helpers import small_quantized

PLATFORMS = ["trt_int8", "ort_int8"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, tuple]:
    """Per platform: (quantized model, exported .onnx path)."""
    out = {}
    for platform in PLATFORMS:
        gm = small_quantized(platform)
        folder = tmp_path_factory.mktemp(platform)
        files = fxq.export(gm, platform, folder / "small")
        out[platform] = (gm, next(Path(f) for f in files if str(f).endswith(".onnx")))
    return out


def _data(batches: int = 2) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(2, 3, 16, 16, generator=gen) for _ in range(batches)]


def _corrupt(path: Path, scale_name: str, factor: float = 1.5) -> onnx.ModelProto:
    m = onnx.load(str(path))
    for t in m.graph.initializer:
        if t.name == scale_name:
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t) * np.float32(factor), t.name))
            return m
    raise AssertionError(f"no initializer {scale_name}")


@pytest.mark.parametrize("platform", PLATFORMS)
def test_teacher_forced_identical(exported, platform):
    gm, path = exported[platform]
    report = fxq.locate_mismatch(gm, path, _data(), teacher_forced=True, optimize=False)
    assert isinstance(report, MismatchReport)
    assert [r.name for r in report][:3] == ["x", "stem_2", "pool"]  # graph order
    assert len(report) >= 8 and not report.unmatched
    assert report.identical == 1.0 and report.first_divergence is None
    assert all(r.histogram[3] == r.elements > 0 for r in report)
    assert "all" in str(report) and "identical" in str(report)
    d = report.to_dict()
    assert d["mode"] == "teacher-forced" and d["bins"] == list(HISTOGRAM_BINS) and d["first_divergence"] is None
    json.dumps(d)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_corrupted_scale_located(exported, platform):
    gm, path = exported[platform]
    bad = _corrupt(path, "relu_scale")  # the activation quantizer after conv1's ReLU
    forced = fxq.locate_mismatch(gm, bad, _data(), teacher_forced=True, optimize=False)
    names = [r.name for r in forced]
    assert forced.first_divergence is not None and forced.first_divergence.name == "relu"
    assert forced.first_divergence.max_diff >= 2
    i = names.index("relu")
    assert all(r.identical == 1.0 for r in forced[:i])
    # teacher forced: only relu and the consumer of its (mis-scaled) DequantizeLinear differ
    assert {r.name for r in forced.diverged()} == {"relu", "conv2"}
    free = fxq.locate_mismatch(gm, bad, _data(), teacher_forced=False, optimize=False)
    assert free.first_divergence.name == "relu"
    downstream = {r.name for r in free.diverged()}
    assert {"relu", "conv2", "relu_1"} <= downstream and len(downstream) > len(forced.diverged())
    text = str(forced)
    assert "first divergence: relu" in text and "<- first divergence" in text


def test_optimized_session_and_top(exported):
    gm, path = exported["ort_int8"]
    report = fxq.locate_mismatch(gm, path, _data(1), optimize=True, steps=1)
    assert report.batches == 1 and report.optimize and report.identical > 0.99
    assert "ORT_ENABLE_ALL" in report.table(limit=3)


def test_not_supported_and_bad_files(exported, tmp_path):
    gm, _ = exported["trt_int8"]
    with pytest.raises(fxq.FrontendError, match="not found"):
        fxq.locate_mismatch(gm, tmp_path / "model.param", _data(1))
    bad = tmp_path / "model.param"
    bad.write_text("not ncnn\n")
    (tmp_path / "model.bin").write_bytes(b"")
    with pytest.raises(fxq.FrontendError, match="magic"):
        fxq.locate_mismatch(gm, bad, _data(1))
    with pytest.raises(fxq.FrontendError, match="not found"):
        fxq.locate_mismatch(gm, tmp_path / "missing.onnx", _data(1))
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"not a model")
    with pytest.raises(fxq.FrontendError):
        fxq.locate_mismatch(gm, junk, _data(1))


@pytest.fixture
def saved(exported, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    gm, path = exported["trt_int8"]
    fxq.save(gm, tmp_path / "small.fxq")
    data = tmp_path / "data"
    data.mkdir()
    for i, x in enumerate(_data()):
        np.save(data / f"{i}.npy", x.numpy())
    onnx.save(_corrupt(path, "relu_scale"), str(tmp_path / "bad.onnx"))
    return tmp_path, path


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("fxq: error:") and "\n" not in err, err
    return err


def test_cli_verify(saved, capsys):
    tmp, path = saved
    assert main(["verify", "small.fxq", str(path), "--data", "data", "--teacher-forced", "--no-optimize", "-q",
                 "--json", "r.json"]) == 0
    out = capsys.readouterr().out
    assert "teacher-forced" in out and "all" in out and "tensors identical" in out
    assert json.loads((tmp / "r.json").read_text())["first_divergence"] is None
    assert main(["verify", "small.fxq", "bad.onnx", "--data", "data", "--teacher-forced", "--no-optimize",
                 "--top", "3", "-q"]) == 0
    out = capsys.readouterr().out
    assert "first divergence: relu" in out and "more" in out


@pytest.mark.parametrize("argv, needle", [
    (["verify", "small.fxq", "missing.onnx", "--data", "data"], "not found"),
    (["verify", "small.fxq", "model.param", "--data", "data"], "not found"),
    (["verify", "missing.fxq", "bad.onnx", "--data", "data"], "not found"),
    (["verify", "small.fxq", "bad.onnx", "--data", "nowhere"], "nowhere"),
    (["verify", "small.fxq", "bad.onnx", "--data", "bad.onnx"], "is a file"),
    (["verify", "small.fxq", "small.fxq", "--data", "data"], "only ONNX"),
    (["verify", "bad.onnx", "bad.onnx", "--data", "data"], ".fxq"),
])
def test_cli_verify_bad_input(saved, capsys, argv, needle):
    assert main(argv) == 1
    assert needle in _error_line(capsys)


def test_cli_verify_usage(saved, capsys):
    assert main(["verify", "small.fxq", "bad.onnx"]) == 2  # --data is required
    assert "--data" in _error_line(capsys)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_onnx_sourced_model_names(tmp_path):
    """A model loaded from ONNX: Q inputs carry the source tensor names (the output one renamed by the export)."""
    from _export_helpers import SmallCNN, quantize_model

    torch.manual_seed(0)
    torch.onnx.export(SmallCNN().eval(), torch.randn(1, 3, 16, 16), str(tmp_path / "src.onnx"),
                      input_names=["image"], output_names=["logits"], dynamo=False)
    q = quantize_model(fxq.load_onnx(tmp_path / "src.onnx"), "trt_int8", shape=(1, 3, 16, 16))
    path = fxq.export(q, "trt_int8", tmp_path / "q")[0]
    report = fxq.locate_mismatch(q, path, [torch.randn(1, 3, 16, 16)], teacher_forced=True, optimize=False)
    assert not report.unmatched and report.identical == 1.0
    assert report[0].name == "image" and report[-1].op_type == "Gemm" and len(report) == 9


class _CosineWindowBlock(torch.nn.Module):
    """Swin-V2's attention pattern on one window: a position-bias MLP over a coordinate buffer (a value computed
    from parameters only, quantized as an activation), 16 * sigmoid of the gathered bias, cosine attention with a
    clamped and exponentiated logit scale, post-norm residuals."""

    def __init__(self, dim: int = 16, heads: int = 2, window: int = 3) -> None:
        super().__init__()
        self.heads = heads
        side = 2 * window - 1
        coords = torch.stack(torch.meshgrid(torch.arange(side) - (window - 1.0), torch.arange(side) - (window - 1.0),
                                            indexing="ij"), -1).unsqueeze(0) / (window - 1)
        self.register_buffer("table", torch.sign(coords) * torch.log2(coords.abs() + 1.0))
        pos = torch.stack(torch.meshgrid(torch.arange(window), torch.arange(window), indexing="ij")).flatten(1)
        rel = (pos[:, :, None] - pos[:, None, :]).permute(1, 2, 0) + (window - 1)
        self.register_buffer("index", (rel[..., 0] * side + rel[..., 1]).flatten())
        self.cpb = torch.nn.Sequential(torch.nn.Linear(2, 32), torch.nn.ReLU(), torch.nn.Linear(32, heads, bias=False))
        self.logit_scale = torch.nn.Parameter(torch.log(10 * torch.ones(heads, 1, 1)))
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)
        self.norm1 = torch.nn.LayerNorm(dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 2 * dim), torch.nn.GELU(), torch.nn.Linear(2 * dim, dim))
        self.norm2 = torch.nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (windows, tokens, dim)
        b, n, c = x.shape
        bias = self.cpb(self.table).view(-1, self.heads)[self.index].view(n, n, self.heads).permute(2, 0, 1)
        bias = 16 * torch.sigmoid(bias)
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        attn = torch.nn.functional.normalize(q, dim=-1) @ torch.nn.functional.normalize(k, dim=-1).transpose(-2, -1)
        attn = attn * torch.clamp(self.logit_scale, max=math.log(100.0)).exp() + bias
        y = self.proj((attn.softmax(-1) @ v).transpose(1, 2).reshape(b, n, c))
        x = x + self.norm1(y)
        return x + self.norm2(self.mlp(x))


@pytest.mark.parametrize("platform", PLATFORMS)
def test_parameter_only_activations_compared(tmp_path, platform):
    """Activation quantizers on a value computed from parameters only (Swin-V2's position-bias MLP) keep their fx
    names in the file, so the locator compares them instead of listing them unmatched; the block exports
    faithfully (teacher-forced codes within one LSB, free-running output matching). ``fold_bn=False`` keeps the
    MLP a computation (folded, its output is one stored tensor)."""
    torch.manual_seed(0)
    model = _CosineWindowBlock().eval()
    gen = torch.Generator().manual_seed(3)
    calib = [torch.randn(4, 9, 16, generator=gen) for _ in range(2)]
    gm = fxq.calibrate(fxq.prepare(model, platform, calib[0], fold_bn=False), calib, progress=False)
    path = next(Path(f) for f in fxq.export(gm, platform, tmp_path / "block") if str(f).endswith(".onnx"))
    data = [torch.randn(4, 9, 16, generator=gen)]
    forced = fxq.locate_mismatch(gm, path, data, teacher_forced=True, optimize=False)
    assert not forced.unmatched
    cpb = [r for r in forced if r.node.startswith("cpb_")]
    assert {r.op_type for r in cpb} == {"Relu", "MatMul"} and all(r.identical == 1.0 for r in cpb)
    assert all(r.max_diff <= 1 for r in forced) and forced.identical > 0.999
    free = fxq.locate_mismatch(gm, path, data, teacher_forced=False, optimize=False)
    assert not free.unmatched and free.identical > 0.999


class _SameDifferenceTwice(torch.nn.Module):
    """``y - x`` written twice, as RAFT writes ``coords1 - coords0`` for the upsampled flow and the next step's
    flow: one copy feeds a conv, the other a concat with a wide-range tensor, so their quantizers differ while
    torch.onnx merges the two Subs into one tensor read by both Q/DQ pairs."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 3, 3, padding=1)
        self.a = torch.nn.Conv2d(3, 4, 1)
        self.b = torch.nn.Conv2d(6, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        first, second = y - x, y - x
        return self.a(first) + self.b(torch.cat([second, 20 * y], 1))


@pytest.mark.parametrize("platform", PLATFORMS)
def test_merged_computations_compared_on_their_own_grids(tmp_path, platform):
    """Each Q reading a merged tensor is compared with the quantizer of its own scale (before: the first copy's
    quantizer judged both, a false 100+ code mismatch that teacher forcing fed downstream)."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(3)
    calib = [torch.randn(2, 3, 8, 8, generator=gen) for _ in range(2)]
    gm = fxq.quantize(_SameDifferenceTwice().eval(), calib, platform=platform, progress=False)
    path = next(Path(f) for f in fxq.export(gm, platform, tmp_path / "twice") if str(f).endswith(".onnx"))
    readers = [n for n in onnx.load(str(path)).graph.node if n.op_type == "QuantizeLinear" and n.input[0] == "sub"]
    assert len(readers) == 2 and readers[0].input[1] != readers[1].input[1]  # one tensor, two grids
    for optimize in (False, True):
        forced = fxq.locate_mismatch(gm, path, [torch.randn(2, 3, 8, 8, generator=gen)], teacher_forced=True,
                                     optimize=optimize)
        assert all(r.max_diff <= 1 for r in forced) and forced.identical > 0.999, forced.table()


def test_simulation_failure_is_fxqs_not_the_datas(exported):
    """The simulation failing on a batch the FP32 model runs is fxq's GraphError naming the node; a batch the
    FP32 model cannot run either stays the data's CalibrationError."""
    gm, path = exported["trt_int8"]
    broken = copy.deepcopy(gm)
    node = next(n for n in broken.graph.nodes if is_quantizer_node(n) and n.args[0].op != "placeholder")
    fq = broken.get_submodule(str(node.target))

    def fail(*args, **kwargs):
        raise RuntimeError("simulated quantizer bug")

    fq.forward = fq.forward_ = fail
    with pytest.raises(fxq.GraphError, match=f"^node {node.name!r} failed.*fxq's own rewrite, not of your data"):
        fxq.locate_mismatch(broken, path, _data(1))
    with pytest.raises(fxq.CalibrationError, match="first mismatch analysis batch failed"):
        fxq.locate_mismatch(broken, path, [_data(1)[0].double()])


@pytest.fixture(scope="module")
def ncnn_exported(tmp_path_factory) -> tuple:
    """A small CNN quantized for ncnn_int8 and exported: (model, .param path)."""
    pytest.importorskip("ncnn")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),
                                torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 3),
                                torch.nn.Flatten(), torch.nn.Linear(4 * 14 * 14, 5)).eval()
    gm = fxq.quantize(model, _data(), "ncnn_int8", progress=False)
    stem = tmp_path_factory.mktemp("ncnn") / "small"
    fxq.export(gm, "ncnn", stem)
    return gm, stem.with_suffix(".param")


@pytest.mark.parametrize("teacher_forced", [False, True])
def test_ncnn_file_against_the_simulation(ncnn_exported, teacher_forced):
    gm, param = ncnn_exported
    report = fxq.locate_mismatch(gm, param, _data(), teacher_forced=teacher_forced)
    assert report.runtime == "ncnn int8" and report.batches == 2 and len(report) == 4
    assert report.identical == 1.0 and report.first_divergence is None, report.table()
    assert sum(r.elements for r in report) == 2 * 2 * (3 * 16 * 16 + 2 * 8 * 16 * 16 + 4 * 14 * 14)  # every sample
    assert "ncnn int8" in report.table()
    assert fxq.locate_mismatch(gm, param.with_suffix(".bin"), _data(1)).batches == 1  # the .bin names the pair


def test_ncnn_teacher_forcing_names_the_wrong_layer(ncnn_exported, tmp_path):
    """The second ReLU made leaky in the file: free-running, it and everything after it differ; teacher-forced,
    only it does."""
    gm, param = ncnn_exported
    text = param.read_text().splitlines()
    relus = [i for i, line in enumerate(text) if line.startswith("ReLU")]
    text[relus[1]] += " 0=0.5"
    bad = tmp_path / "bad.param"
    bad.write_text("\n".join(text) + "\n")
    (tmp_path / "bad.bin").write_bytes(param.with_suffix(".bin").read_bytes())
    second = text[relus[1]].split()[5]
    free = fxq.locate_mismatch(gm, bad, _data(1))
    forced = fxq.locate_mismatch(gm, bad, _data(1), teacher_forced=True)
    assert free.first_divergence.name == forced.first_divergence.name == second
    assert [r.name for r in forced.diverged()] == [second]
    assert len(free.diverged()) == 2


class _TransposedFeatures(torch.nn.Module):
    """A text recognizer's head: conv features [C, T] transposed to [T, C] before a Linear (ncnn: Permute ->
    int8 InnerProducts over a 2-D blob); the transposed blob is a non-contiguous tensor in the simulation."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv1d(3, 32, 1)
        self.fc = torch.nn.Linear(32, 16)
        self.classes = torch.nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classes(self.fc(torch.relu(self.conv(x)).transpose(1, 2)))


def test_ncnn_teacher_forcing_feeds_non_contiguous_values(tmp_path):
    """Teacher-forced values of a transposed tensor reach ncnn as they are: a view's contiguous copy was freed
    before ncnn copied it, and the Linear's first row then read the allocator's bytes (tens of codes off in a file
    that computes what the simulation computes)."""
    pytest.importorskip("ncnn")
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(3)
    data = [torch.randn(1, 3, 40, generator=gen) for _ in range(3)]
    gm = fxq.quantize(_TransposedFeatures().eval(), data[:2], "ncnn_int8", progress=False)
    fxq.export(gm, "ncnn", tmp_path / "head")
    report = fxq.locate_mismatch(gm, tmp_path / "head.param", data[2:], teacher_forced=True)
    assert len(report) >= 2 and max(r.max_diff for r in report) <= 1, report.table()


def test_ncnn_file_of_another_model_is_refused(ncnn_exported, tmp_path):
    gm, param = ncnn_exported
    other = fxq.quantize(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1)).eval(), _data(), "ncnn_int8", progress=False)
    with pytest.raises(fxq.ConfigError, match="not exported from this model"):
        fxq.locate_mismatch(other, param, _data(1))


def test_cli_verify_of_an_ncnn_file(ncnn_exported, tmp_path, monkeypatch, capsys):
    gm, param = ncnn_exported
    monkeypatch.chdir(tmp_path)
    fxq.save(gm, tmp_path / "small.fxq")
    (tmp_path / "data").mkdir()
    for i, x in enumerate(_data()):
        np.save(tmp_path / "data" / f"{i}.npy", x.numpy())
    assert main(["verify", "small.fxq", str(param), "--data", "data", "--teacher-forced", "-q", "--json",
                 "r.json"]) == 0
    out = capsys.readouterr().out
    assert "teacher-forced, ncnn int8" in out and "all 4 tensors identical" in out
    assert json.loads((tmp_path / "r.json").read_text())["runtime"] == "ncnn int8"


def test_the_fp32_ncnn_file_is_refused_by_name(ncnn_exported):
    gm, param = ncnn_exported
    with pytest.raises(fxq.ConfigError, match="FP32 file of this model's export"):
        fxq.locate_mismatch(gm, param.with_name("small.fp32.param"), _data(1))


class _SignBranch(torch.nn.Module):
    """Python control flow on the values: fxq keeps it an FP32 island, and ncnn gets the branch its example took."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.mean() > 0:
            return x * 2
        return -x


def test_an_ncnn_island_that_took_the_other_branch_is_named(tmp_path):
    """The comparison is against the model, not the exporter's traced view (which agrees with ncnn by
    construction): where the data takes the other branch, the island's value diverges (review)."""
    pytest.importorskip("ncnn")
    torch.manual_seed(0)
    model = torch.nn.Sequential(_SignBranch(), torch.nn.Conv2d(3, 4, 3)).eval()
    gm = fxq.quantize(model, [torch.randn(2, 3, 8, 8) + 3 for _ in range(2)], "ncnn_int8", progress=False)
    positive = torch.randn(1, 3, 8, 8) + 3
    fxq.export(gm, "ncnn", tmp_path / "m", example_inputs=positive)
    same = fxq.locate_mismatch(gm, tmp_path / "m.param", [positive], example_inputs=positive, teacher_forced=True)
    assert same.first_divergence is None and [r.name for r in same] == ["_0"]  # the island's value
    other = fxq.locate_mismatch(gm, tmp_path / "m.param", [positive - 6], example_inputs=positive,
                                teacher_forced=True)
    assert other.first_divergence.name == "_0" and other.first_divergence.identical < 0.5


class _NormThenLinear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.norm, self.fc2 = torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.norm(self.fc1(x)))


def test_ncnn_comparison_reads_a_fused_layer_norm_as_the_model_s_value(tmp_path):
    """ONNX opset 13 spells LayerNorm out; the ncnn export fuses it into one layer, a node of its own. Its blob is
    the value of the spelled-out LayerNorm's last op, and is compared as that (it was left out: not the model's
    node)."""
    pytest.importorskip("ncnn")
    torch.manual_seed(0)
    torch.onnx.export(_NormThenLinear().eval(), (torch.randn(1, 16),), str(tmp_path / "m.onnx"), dynamo=False,
                      opset_version=13)
    data = [torch.randn(1, 16) for _ in range(2)]
    gm = fxq.quantize(fxq.load_onnx(tmp_path / "m.onnx"), data, "ncnn_int8", progress=False)
    fxq.export(gm, "ncnn", tmp_path / "m")
    assert "LayerNorm" in (tmp_path / "m.param").read_text()
    report = fxq.locate_mismatch(gm, tmp_path / "m.param", data, teacher_forced=True)
    assert [r.op_type for r in report] == ["Input", "LayerNormalization"] and not report.unmatched, report.table()
    assert report.first_divergence is None, report.table()


class _BatchOfTwo(torch.nn.Module):
    """The batch size written into a reshape, as in a file exported at batch 2 with a Reshape to [2, 8]: the graph
    runs batches of 2 samples only."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 2, 3, stride=2, padding=1)
        self.fc = torch.nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.conv(x)).view(2, -1))


def _pairs(batches: int = 2) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randn(2, 3, 4, 4, generator=gen) for _ in range(batches)]


@pytest.fixture(scope="module")
def batch_of_two(tmp_path_factory) -> dict[str, tuple]:
    """Per platform: (the quantized _BatchOfTwo, its exported .onnx or .param)."""
    out = {}
    for platform in [*PLATFORMS, "ncnn_int8"]:
        if platform == "ncnn_int8" and importlib.util.find_spec("ncnn") is None:
            continue
        torch.manual_seed(0)
        gm = fxq.quantize(_BatchOfTwo().eval(), _pairs(), platform, progress=False)
        folder = tmp_path_factory.mktemp(platform)
        files = fxq.export(gm, "ncnn" if platform == "ncnn_int8" else platform, folder / "two")
        out[platform] = (gm, next(Path(f) for f in files if str(f).endswith((".onnx", "two.param"))))
    return out


@pytest.mark.parametrize("platform", [*PLATFORMS, "ncnn_int8"])
@pytest.mark.parametrize("per_sample", [False, True], ids=["batches-of-2", "single-samples"])
def test_a_batch_size_baked_into_the_graph_is_the_batch_compared(batch_of_two, platform, per_sample):
    """The comparison runs the batch the graph takes: ncnn's one sample at a time is simulated at the model's
    batch of 2 and compared sample by sample, and data of single samples (a folder of images) is regrouped into the
    file's batch of 2. Before, one sample went through the simulation alone and failed (the view gives [2, 4], the
    Linear takes 8 features; a source ONNX Reshape to [2, 8]: "shape '[2, 8]' is invalid for input of size 8"),
    reported as the data's fault."""
    if platform not in batch_of_two:
        pytest.skip("ncnn is not installed")
    gm, path = batch_of_two[platform]
    data = [x[i:i + 1] for x in _pairs(3) for i in range(2)] if per_sample else _pairs(3)
    report = fxq.locate_mismatch(gm, path, data, steps=None)
    assert report.first_divergence is None and report.identical == 1.0, report.table()
    x = next(r for r in report if r.op_type == "Input")
    assert x.elements == 6 * 3 * 4 * 4  # every sample compared once
    assert report.batches == (6 if platform == "ncnn_int8" and per_sample else 3)


def test_cli_verify_regroups_single_samples_into_the_file_s_batch(batch_of_two, tmp_path, monkeypatch, capsys):
    gm, path = batch_of_two["trt_int8"]
    monkeypatch.chdir(tmp_path)
    fxq.save(gm, tmp_path / "two.fxq")
    (tmp_path / "data").mkdir()
    for i, x in enumerate(x[j:j + 1] for x in _pairs() for j in range(2)):
        np.save(tmp_path / "data" / f"{i}.npy", x.numpy())
    assert main(["verify", "two.fxq", str(path), "--data", "data", "-q"]) == 0
    out = capsys.readouterr().out
    assert "2 batches" in out and "all 4 tensors identical" in out, out


def test_a_file_whose_fixed_batch_the_model_does_not_run_is_fxq_s_comparison_failing(batch_of_two, tmp_path):
    """A file whose inputs fix another batch than the model runs: the comparison cannot feed both, and says so
    instead of blaming the data (which the model runs)."""
    gm, path = batch_of_two["trt_int8"]
    m = onnx.load(str(path))
    m.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 1
    with pytest.raises(fxq.ConfigError, match=r"batches of 1 only .*your data is not the cause.*export it again"):
        fxq.locate_mismatch(gm, m, _pairs())
    with pytest.raises(fxq.CalibrationError, match=r"takes batches of 2 only .* has 1 sample"):
        fxq.locate_mismatch(gm, path, [_pairs()[0][:1]])


class _UnfusedSoftmax(torch.nn.Module):
    """Attention probabilities read by an op onnxruntime has no int8 kernel for (``torch.where`` on NaN, as the dynamo
    exporter writes attention): in the deployed file onnxruntime rewrites the MatMul's int8 Q/DQ to uint8 and leaves
    the Softmax float; with every Q output exposed (graph outputs are not rewritten) it fuses QLinearSoftmax, whose
    table exp puts codes one off. ViT-style files exported with dynamo=True showed this in ``fxq verify``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = torch.softmax(x @ x.transpose(-1, -2), -1)
        return torch.where(torch.isnan(p), torch.zeros_like(p), p)


def _exposed_outputs_differ(path: Path, x: torch.Tensor) -> bool:
    """Whether the file with its activation Q outputs exposed gives other outputs at ORT_ENABLE_ALL than the file."""
    from _export_helpers import run_ort

    m = onnx.load(str(path))
    weights = {t.name for t in m.graph.initializer}
    for n in list(m.graph.node):
        if n.op_type == "QuantizeLinear" and n.input[0] not in weights:
            m.graph.output.append(onnx.helper.make_tensor_value_info(n.output[0], onnx.TensorProto.INT8, None))
    return not np.array_equal(run_ort(m, x), run_ort(str(path), x))


@pytest.mark.parametrize("teacher_forced", [False, True])
def test_the_verdict_is_about_the_file_as_it_runs(tmp_path, monkeypatch, teacher_forced):
    """A file whose outputs, run as deployed (ORT_ENABLE_ALL), are the simulation's is not reported as diverging,
    though exposing its Q outputs changes onnxruntime's fusions; the rows come from a session that gives the file's
    outputs bit for bit and say which. A file that does differ (a wrong softmax scale) is still located."""
    from _export_helpers import run_ort

    gen = torch.Generator().manual_seed(3)
    data = [torch.randn(2, 8, 16, generator=gen) for _ in range(4)]
    gm = fxq.quantize(_UnfusedSoftmax().eval(), data[:2], "trt_int8", progress=False)
    path = fxq.export(gm, "trt_int8", tmp_path / "attn.onnx")[0]
    with torch.no_grad():
        deployed_matches = all(np.array_equal(run_ort(str(path), x), gm(x).numpy()) for x in data[2:])
    report = fxq.locate_mismatch(gm, path, data[2:], teacher_forced=teacher_forced)
    if deployed_matches:  # onnxruntime 1.32 on x86: the deployed file keeps the Softmax float, as the simulation
        assert report.first_divergence is None and not report.diverged(), report.table()
        assert "first divergence" not in report.table()
    assert report.outputs_identical == deployed_matches and report.faithful, report.table()
    if _exposed_outputs_differ(path, data[2]):
        assert report.session != "ORT_ENABLE_ALL" and "ORT_ENABLE_ALL asked" in report.table()
        assert any("fuses differently" in n for n in report.notes)
    assert report.to_dict()["session"] == report.session

    # a first batch on which exposing changes nothing at the outputs (all-zero attention logits: uniform
    # probabilities), then one that shows it: the rows move down and the first batch is compared again there
    late = fxq.locate_mismatch(gm, path, [torch.zeros(2, 8, 16), data[3]], teacher_forced=teacher_forced)
    assert late.batches == 2 and late.session == report.session and late.faithful, late.table()
    with monkeypatch.context() as m:  # inputs too large to keep: the earlier batch is left out, and that is said
        m.setattr("fxq.analysis.mismatch._REPLAY_BYTES", 0)
        short = fxq.locate_mismatch(gm, path, [torch.zeros(2, 8, 16), data[3]], teacher_forced=teacher_forced)
    dropped = [n for n in short.notes if "rows cover the last 1 batch(es): 1 earlier" in n]
    assert short.session == late.session and short.batches == (1 if dropped else 2), short.table()

    bad = _corrupt(path, "softmax_scale")
    located = fxq.locate_mismatch(gm, bad, data[2:], teacher_forced=teacher_forced)
    assert located.outputs_identical is False and located.first_divergence is not None, located.table()
    assert located.first_divergence.name == "softmax" and located.first_divergence.max_diff >= 2
