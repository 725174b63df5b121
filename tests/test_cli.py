"""The ``fxq`` command line, end to end on small models and temporary calibration folders."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from fxq.cli import main

MODEL_SOURCE = textwrap.dedent(
    """
    import torch
    from torch import nn


    class Small(nn.Module):
        def __init__(self):
            super().__init__()
            self.c1 = nn.Conv2d(3, 8, 3, padding=1)
            self.bn = nn.BatchNorm2d(8)
            self.relu = nn.ReLU(inplace=True)
            self.c2 = nn.Conv2d(8, 8, 3, padding=1)
            self.fc = nn.Linear(8, 5)

        def forward(self, x):
            y = self.relu(self.bn(self.c1(x)))
            y = y + self.c2(y)
            return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(y, 1), 1))


    def build():
        torch.manual_seed(0)
        return Small().eval()


    def not_a_model():
        return 42
    """
)


@pytest.fixture
def work(tmp_path, monkeypatch):
    """tmp_path as the working directory, holding ``cli_small_model.py`` and ``calib/`` (3 .npy batches)."""
    (tmp_path / "cli_small_model.py").write_text(MODEL_SOURCE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    calib = tmp_path / "calib"
    calib.mkdir()
    rng = np.random.default_rng(0)
    for i in range(3):
        np.save(calib / f"batch{i}.npy", rng.standard_normal((2, 3, 16, 16)).astype(np.float32))
    yield tmp_path
    sys.modules.pop("cli_small_model", None)


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("fxq: error: ") and "Traceback" not in err[0]
    return err[0]


def test_platforms(capsys):
    assert main(["platforms"]) == 0
    out = capsys.readouterr().out
    assert "trt_int8" in out and "activation:" in out
    assert main(["platforms", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert {"trt_int8", "ncnn_int8"} <= set(rows)
    assert rows["trt_int8"]["expressible_ops"] == "any"  # Q/DQ goes before any op
    assert rows["ncnn_int8"]["expressible_ops"].startswith("Conv, Gemm, MatMul (Conv: 2-D only")  # the capability's ops


def test_quantize_python_factory(work, capsys):
    assert main(["quantize", "cli_small_model:build", "--calib", "calib", "--out", "out", "-q"]) == 0
    out = capsys.readouterr().out
    assert (work / "out" / "build_trt_int8.summary.txt").is_file()
    assert "wrote:" in out and "build_trt_int8.summary.txt" in out
    assert (work / "out" / "build_trt_int8.onnx").is_file()
    # a saved quantized model is analysed / exported as it is
    assert main(["analyse", "out/build_trt_int8.fxq", "--calib", "calib", "--analyse-steps", "1", "-q"]) == 0
    assert "graphwise error" in capsys.readouterr().out


def test_quantize_reports_output_fidelity_and_warns_when_poor(work, capsys, caplog, monkeypatch):
    """``fxq quantize`` says how far the quantized output is from FP32 (summary file and stdout) and warns, naming
    the layers, above ``POOR_OUTPUT_SNR``."""
    import logging

    import fxq.cli

    assert main(["quantize", "cli_small_model:build", "--calib", "calib", "--out", "out"]) == 0
    line = next(t for t in capsys.readouterr().out.splitlines() if t.startswith("output noise / signal"))
    assert float(line.split(": ")[1].split("%")[0]) < 100 * fxq.cli.POOR_OUTPUT_SNR
    assert line in (work / "out" / "build_trt_int8.summary.txt").read_text()
    monkeypatch.setattr(fxq.cli, "POOR_OUTPUT_SNR", 0.0)
    with caplog.at_level(logging.WARNING, logger="fxq.cli"):
        assert main(["quantize", "cli_small_model:build", "--calib", "calib", "--out", "out2", "-q"]) == 0
    assert "noise against FP32 on calibration data: it computes something else. The layers that hurt most" in caplog.text
    assert "--budget snr=0.05" in caplog.text


def test_saved_model_keeps_its_platform_and_needs_only_analysis_data(work, capsys):
    assert main(["quantize", "cli_small_model:build", "--calib", "calib", "--platform", "ncnn_int8", "--out", "out",
                 "--no-export", "-q"]) == 0
    saved = "out/build_ncnn_int8.fxq"
    assert main(["export", saved, "--out", "exp", "-q"]) == 0  # no --platform: the file's own (ncnn_int8)
    assert (work / "exp" / "build_ncnn_int8.param").is_file()
    capsys.readouterr()
    assert main(["analyse", saved, "--data", "calib", "--analyse-steps", "1", "-q"]) == 0  # no --calib needed
    assert "graphwise error" in capsys.readouterr().out
    assert main(["analyse", saved, "-q"]) == 1
    assert "--data DIR" in _error_line(capsys)
    assert main(["analyse", "cli_small_model:build", "-q"]) == 1
    assert "--calib DIR" in _error_line(capsys)


def test_data_steps_and_export_options_are_used(work, capsys):
    (work / "eval").mkdir()
    np.save(work / "eval" / "0.npy", np.random.default_rng(1).standard_normal((2, 3, 16, 16)).astype(np.float32))
    assert main(["analyse", "cli_small_model:build", "--calib", "calib", "--data", "eval", "--steps", "1",
                 "--json", "a.json", "-q"]) == 0
    assert json.loads((work / "a.json").read_text())["graphwise"]["batches"] == 1  # the one --data batch
    assert main(["quantize", "cli_small_model:build", "--calib", "calib", "--out", "out", "--export-option",
                 "legacy=true", "-q"]) == 0
    assert (work / "out" / "build_trt_int8.cache").is_file()  # TensorRT's legacy files only with legacy=true


def test_onnx_quantize_and_analyse(work, capsys):
    import cli_small_model

    torch.onnx.export(cli_small_model.build(), (torch.randn(1, 3, 16, 16),), str(work / "small.onnx"),
                      dynamo=False, input_names=["input"], output_names=["logits"])
    assert main(["quantize", "small.onnx", "--calib", "calib", "--out", "out", "--steps", "2", "-q"]) == 0
    assert (work / "out" / "small_trt_int8.summary.txt").is_file()
    assert (work / "out" / "small_trt_int8.onnx").is_file()
    capsys.readouterr()
    assert main(["analyse", "small.onnx", "--calib", "calib", "--analyse-steps", "2", "--json", "res.json", "-q"]) == 0
    out = capsys.readouterr().out
    assert "graphwise error" in out and "logits" in out  # the ONNX output name
    res = json.loads((work / "res.json").read_text())
    assert len(res["graphwise"]["layers"]) == 3 and res["graphwise"]["batches"] == 2
    # a raw .bin file needs the shape; a wrong one is reported with the file name
    np.zeros((2, 3, 16, 16), np.float32).tofile(work / "calib" / "batch3.bin")
    assert main(["quantize", "small.onnx", "--calib", "calib", "--no-export", "-q"]) == 0  # shape from the ONNX file
    assert main(["quantize", "small.onnx", "--calib", "calib", "--input-shape", "1,3,20,20", "-q"]) == 1
    assert "batch0.npy" in _error_line(capsys)


class _SkipJoin(torch.nn.Module):
    """A decoder's skip connection: a stride-2 branch upsampled and joined to the full-size one, so H and W must be
    even (a detector's FPN: multiples of its stride)."""

    def __init__(self) -> None:
        super().__init__()
        self.down, self.conv = torch.nn.Conv2d(3, 4, 3, 2, 1), torch.nn.Conv2d(3, 4, 3, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up = torch.nn.functional.interpolate(self.down(x), scale_factor=2.0, mode="nearest")
        return torch.cat([self.conv(x), up], dim=1)


def test_images_of_a_size_a_dynamic_file_cannot_take_get_advice_that_works(tmp_path, monkeypatch, capsys):
    """A file with symbolic H / W calibrated on a folder of 25x35 photos fails at its join; the advice names the CLI
    flag, which, followed, resizes the images and quantizes (ultralytics' dynamic YOLO files and odd photos)."""
    from PIL import Image

    monkeypatch.chdir(tmp_path)
    torch.onnx.export(_SkipJoin().eval(), (torch.randn(1, 3, 16, 16),), "skip.onnx", dynamo=False, opset_version=13,
                      input_names=["images"], dynamic_axes={"images": {0: "batch", 2: "height", 3: "width"}})
    (tmp_path / "photos").mkdir()
    rng = np.random.default_rng(0)
    for i in range(2):
        Image.fromarray(rng.integers(0, 255, (25, 35, 3), dtype=np.uint8)).save(tmp_path / "photos" / f"{i}.png")
    assert main(["quantize", "skip.onnx", "--calib", "photos", "--out", "out", "-q"]) == 1
    assert "Fix: give batches of the sizes the model takes" in (line := _error_line(capsys)) and "--input-shape" in line
    capsys.readouterr()
    assert main(["quantize", "skip.onnx", "--calib", "photos", "--out", "out", "-q", "--input-shape", "1,3,24,32"]) == 0
    assert (tmp_path / "out" / "skip_trt_int8.onnx").is_file()


def test_analyse_and_report(work, capsys):
    pytest.importorskip("matplotlib")
    args = ["cli_small_model:build", "--calib", "calib", "--analyse-steps", "2", "-q"]
    assert main(["analyse", *args, "--layerwise", "--method", "cosine", "--json", "a.json"]) == 0
    out = capsys.readouterr().out
    assert "graphwise error" in out and "layerwise error" in out and "COSINE" in out
    assert json.loads((work / "a.json").read_text())["layerwise"]["method"] == "cosine"
    assert main(["report", *args, "--out", "rep"]) == 0
    assert (work / "rep" / "report.html").is_file()
    assert (work / "rep" / "plots" / "graphwise.png").read_bytes()[:4] == b"\x89PNG"


def test_demo_fast(tmp_path, capsys):
    assert main(["demo", "--fast", "--out", str(tmp_path / "demo"), "-q"]) == 0
    out = capsys.readouterr().out
    assert "network snapshot" in out and "output SNR vs FP32" in out
    line = next(row for row in out.splitlines() if "output SNR vs FP32" in row)
    snr = float(line.split(":")[1].split("%")[0]) / 100
    assert 0 < snr < 0.05
    assert (tmp_path / "demo" / "resnet18_trt_int8.summary.txt").is_file()
    for suffix in (".onnx", ".cache", ".json"):  # TensorRT Q/DQ ONNX + the legacy calibration cache and json
        assert (tmp_path / "demo" / f"resnet18_trt_int8{suffix}").is_file()


def test_error_paths(work, capsys):
    assert main(["quantize", "missing.onnx", "--calib", "calib"]) == 1
    assert "missing.onnx" in _error_line(capsys)
    (work / "empty").mkdir()
    assert main(["quantize", "cli_small_model:build", "--calib", "empty"]) == 1
    assert "empty" in _error_line(capsys)
    assert main(["quantize", "cli_small_model:build", "--calib", "nowhere"]) == 1
    assert "does not exist" in _error_line(capsys)
    assert main(["quantize", "cli_small_model:build", "--calib", "calib", "--input-shape", "1,3,8,8"]) == 1
    assert "batch0.npy" in _error_line(capsys)
    bad = work / "bad"
    bad.mkdir()
    np.save(bad / "0.npy", np.zeros((1, 4, 16, 16), np.float32))
    assert main(["quantize", "cli_small_model:build", "--calib", "bad"]) == 1
    assert "first example batch failed in the model" in _error_line(capsys)
    assert main(["quantize", "cli_small_model:not_a_model", "--calib", "calib"]) == 1
    assert "nn.Module" in _error_line(capsys)
    assert main(["quantize", "model.prototxt", "--calib", "calib"]) == 1
    assert "model.prototxt" in _error_line(capsys)
    assert main(["quantize", "cli_small_model:build", "--calib", "calib", "--platform", "nope", "-q"]) == 1
    assert "trt_int8" in _error_line(capsys)  # the message lists the registered platforms
    assert main(["quantize"]) == 2  # usage error
    capsys.readouterr()
    assert main(["quantize", "missing.onnx", "--calib", "calib", "--verbose"]) == 1
    assert "Traceback" in capsys.readouterr().err


def test_python_m_fxq(tmp_path):
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-m", "fxq", "quantize", "missing.onnx", "--calib", str(tmp_path)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(root)})
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and proc.stderr.startswith("fxq: error:")


def test_capture_choice(work, capsys, monkeypatch):
    import fxq.graph.capture as capture_module

    exported = []
    real = capture_module._export
    monkeypatch.setattr(capture_module, "_export", lambda *a: exported.append(a) or real(*a))
    assert main(["quantize", "cli_small_model:build", "--calib", "calib", "--capture", "export", "--out", "out",
                 "--no-export", "-q"]) == 0
    assert "Conv" in (work / "out" / "build_trt_int8.summary.txt").read_text()
    assert exported  # the torch.export path ran, not symbolic tracing
    assert main(["quantize", "cli_small_model:build", "--calib", "calib", "--capture", "jit", "-q"]) == 2
    assert "--capture" in capsys.readouterr().err


def test_fallback_fp16_needs_a_budget(work, capsys):
    assert main(["quantize", "cli_small_model:build", "--calib", "calib", "--fallback", "fp16", "-q"]) == 1
    assert "--budget" in _error_line(capsys) and not (work / "fxq_out").exists()


def test_flat_folder_for_a_two_input_model_names_the_sub_folders(work, capsys):
    """A two-input ONNX file and a flat calibration folder: the error said "input shapes for ['a', 'b']" though the
    user gave none (the shapes were the model's); it now names the inputs and the sub-folders, and they work."""

    class TwoInputs(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 4, 3)

        def forward(self, a, b):
            return self.conv(a) + self.conv(b)

    torch.onnx.export(TwoInputs().eval(), (torch.randn(2, 3, 16, 16), torch.randn(2, 3, 16, 16)), "two.onnx",
                      dynamo=False, input_names=["a", "b"], output_names=["y"])
    assert main(["quantize", "two.onnx", "--calib", "calib", "--out", "out"]) != 0
    line = _error_line(capsys)
    assert "2 inputs are wanted (['a', 'b'])" in line and "input shapes" not in line, line
    assert f"({Path('calib') / 'a'}, {Path('calib') / 'b'})" in line, line
    for name in ("a", "b"):
        (work / "calib" / name).mkdir()
        for f in sorted((work / "calib").glob("*.npy")):
            np.save(work / "calib" / name / f.name, np.load(f))
    for f in (work / "calib").glob("*.npy"):
        f.unlink()
    assert main(["quantize", "two.onnx", "--calib", "calib", "--out", "out", "-q"]) == 0
    assert (work / "out" / "two_trt_int8.onnx").is_file()
