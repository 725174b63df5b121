"""fxq.locate_mismatch and ``fxq verify``: exported ONNX against the simulation, tensor by tensor, in codes."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from _export_helpers import small_quantized
from onnx import numpy_helper

import fxq
from fxq.analysis.mismatch import HISTOGRAM_BINS, MismatchReport
from fxq.cli import main

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
    with pytest.raises(fxq.NotSupportedError, match="ONNX"):
        fxq.locate_mismatch(gm, tmp_path / "model.param", _data(1))
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
