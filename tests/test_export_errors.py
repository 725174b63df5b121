"""Bad input: every failure is an ExportError raised before anything is written, and writes are atomic."""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import fxq

from _export_helpers import SmallCNN, quantize_model, small_quantized

EXPORTS = [("trt_int8", "tensorrt"), ("ort_int8", "onnxruntime"), ("ppl_cuda_int8", "openppl")]


@pytest.fixture(scope="module")
def models():
    return {p: small_quantized(p) for p, _ in EXPORTS}


@pytest.mark.parametrize("platform,exporter", EXPORTS, ids=[e for _, e in EXPORTS])
def test_missing_directory_is_created(models, tmp_path, platform, exporter):
    written = fxq.export(models[platform], exporter, tmp_path / "new" / "deeper" / "model.onnx")
    assert written[0] == tmp_path / "new" / "deeper" / "model.onnx"
    assert sorted(p.name for p in (tmp_path / "new" / "deeper").iterdir()) == sorted(p.name for p in written)


def test_missing_directory_not_created_when_the_export_fails(tmp_path):
    gm = fxq.prepare(SmallCNN().eval(), "trt_int8", torch.randn(2, 3, 16, 16))
    with pytest.raises(fxq.ExportError, match="not calibrated"):
        fxq.export(gm, "tensorrt", tmp_path / "new" / "model.onnx")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("platform,exporter", EXPORTS + [("ncnn_int8", "ncnn")],
                         ids=[e for _, e in EXPORTS] + ["ncnn"])
def test_parent_is_a_file(tmp_path, platform, exporter):
    (tmp_path / "afile").write_text("x")
    gm = small_quantized(platform)
    for path in (tmp_path / "afile" / "model.onnx", tmp_path / "afile" / "sub" / "model.onnx"):
        with pytest.raises(fxq.ExportError, match=r"cannot create output folder .*afile.* is a file, not a folder; "
                                                  r"remove it or choose another output path"):
            fxq.export(gm, exporter, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


@pytest.mark.parametrize("platform,exporter", EXPORTS, ids=[e for _, e in EXPORTS])
def test_unwritable_directory(models, tmp_path, platform, exporter, monkeypatch):
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if os.fspath(p) == os.fspath(tmp_path) else
                        real_access(p, mode))  # root ignores permission bits: simulate a read-only folder
    with pytest.raises(fxq.ExportError, match="not writable"):
        fxq.export(models[platform], exporter, tmp_path / "model.onnx")
    assert list(tmp_path.iterdir()) == []


def test_path_is_a_directory(models, tmp_path):
    with pytest.raises(fxq.ExportError, match="is a directory"):
        fxq.export(models["trt_int8"], "tensorrt", tmp_path)
    with pytest.raises(fxq.ExportError, match="is a directory; give a file stem"):
        fxq.export(small_quantized("ncnn_int8"), "ncnn", tmp_path)
    (tmp_path / "m.json").mkdir()  # a companion file's name taken by a folder
    with pytest.raises(fxq.ExportError, match=r"m\.json' is an existing directory; remove it"):
        fxq.export(models["ppl_cuda_int8"], "openppl", tmp_path / "m")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.json"]


@pytest.mark.parametrize("platform,exporter", EXPORTS, ids=[e for _, e in EXPORTS])
def test_uncalibrated_model(tmp_path, platform, exporter):
    gm = fxq.prepare(SmallCNN().eval(), platform, torch.randn(2, 3, 16, 16))
    with pytest.raises(fxq.ExportError, match="not calibrated"):
        fxq.export(gm, exporter, tmp_path / "model.onnx")
    assert list(tmp_path.iterdir()) == []


def test_not_an_fxq_model(tmp_path):
    with pytest.raises(fxq.ExportError, match="GraphModule"):
        fxq.export(SmallCNN(), "tensorrt", tmp_path / "m.onnx")
    gm = torch.fx.symbolic_trace(SmallCNN())
    with pytest.raises(fxq.ExportError, match="fxq.prepare"):
        fxq.export(gm, "onnxruntime", tmp_path / "m.onnx")


def test_unknown_option(models, tmp_path):
    with pytest.raises(fxq.ExportError, match="unknown option"):
        fxq.export(models["trt_int8"], "tensorrt", tmp_path / "m.onnx", flavour="spicy")


class _Unexportable(nn.Module):
    """A conv followed by an op the TorchScript ONNX exporter has no symbolic for."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        return torch.special.i1(self.conv(x))


def test_op_the_backend_cannot_express(tmp_path):
    gm = quantize_model(_Unexportable(), "ort_int8", shape=(1, 3, 8, 8))
    with pytest.raises(fxq.ExportError, match="special_i1"):
        fxq.export(gm, "onnxruntime", tmp_path / "m.onnx")
    assert list(tmp_path.iterdir()) == []


def test_scheme_the_backend_cannot_express(models, tmp_path):
    # asymmetric uint8 activations are not TensorRT INT8
    with pytest.raises(fxq.ExportError, match="symmetric"):
        fxq.export(models["ort_int8"], "tensorrt", tmp_path / "m.onnx")
    # NCNN rounds half away from zero; ONNX QuantizeLinear rounds half to even
    ncnn = small_quantized("ncnn_int8")
    with pytest.raises(fxq.ExportError, match="half to even"):
        fxq.export(ncnn, "onnxruntime", tmp_path / "m.onnx")
    assert list(tmp_path.iterdir()) == []


def test_failed_export_keeps_the_previous_file(models, tmp_path):
    target = tmp_path / "model.onnx"
    target.write_bytes(b"previous")
    gm = fxq.prepare(SmallCNN().eval(), "trt_int8", torch.randn(2, 3, 16, 16))
    with pytest.raises(fxq.ExportError):
        fxq.export(gm, "tensorrt", target)
    assert target.read_bytes() == b"previous"
    fxq.export(models["trt_int8"], "tensorrt", target)
    assert target.read_bytes() != b"previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]  # no temp files left


def test_atomic_writes_get_normal_permissions(tmp_path):
    import os
    import stat

    from fxq.io import atomic_write_text

    path = atomic_write_text(tmp_path / "x.txt", "hello")
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~mask
