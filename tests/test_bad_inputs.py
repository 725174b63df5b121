"""Every bad input gets a named FxqError (one line on the CLI): inconsistent calibration batches, bad steps, bad
command-line values and paths, hostile caffe files, hostile calibration folders (decompression bombs, pickles)."""
from __future__ import annotations

import logging
import os
import struct
import textwrap
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from google.protobuf import text_format
from torch import nn

import fxq
from fxq.cli import main
from fxq.errors import CalibrationError, ConfigError, FrontendError
from fxq.frontends.caffe import proto


class _Net(nn.Module):
    """Conv + adaptive pool + linear: accepts any H/W of its 3-channel input."""

    def __init__(self, adaptive: bool = True) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.adaptive = adaptive
        self.fc = nn.Linear(4 if adaptive else 4 * 8 * 8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        y = nn.functional.adaptive_avg_pool2d(y, 1) if self.adaptive else y
        return self.fc(torch.flatten(y, 1))


def _batches(*shapes: tuple[int, ...], dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    return [torch.randn(s).to(dtype) for s in shapes]


# ---------------------------------------------------------------------------------------- 1. calibration batches
def test_later_batch_with_another_dtype_names_batch_input_and_shapes():
    data = _batches((2, 3, 8, 8), (2, 3, 8, 8)) + _batches((2, 3, 8, 8), dtype=torch.float64)
    with pytest.raises(CalibrationError, match=r"batch 2, input: expected a float32 tensor of rank 4 like batch 0 "
                                               r"\[2, 3, 8, 8\], found float64 \[2, 3, 8, 8\]"):
        fxq.quantize(_Net().eval(), data, progress=False)


def test_later_batch_with_another_rank_or_other_inputs():
    with pytest.raises(CalibrationError, match=r"batch 1, input: .*rank 4.*found float32 \[3, 8, 8\]"):
        fxq.quantize(_Net().eval(), _batches((2, 3, 8, 8), (3, 8, 8)), progress=False)
    gm = fxq.prepare(_Net().eval(), "trt_int8", torch.randn(2, 3, 8, 8))
    with pytest.raises(CalibrationError, match=r"batch 1 has inputs \['input 0', 'input 1'\] but batch 0 had"):
        fxq.calibrate(gm, [(torch.randn(2, 3, 8, 8),), (torch.randn(2, 3, 8, 8), torch.randn(2))], progress=False)


def test_smaller_last_batch_and_other_sizes_the_model_accepts_are_fine(caplog):
    data = _batches((4, 3, 8, 8), (4, 3, 12, 10), (1, 3, 8, 8))
    with caplog.at_level(logging.INFO, logger="fxq.graph.data"):
        fxq.quantize(_Net().eval(), data, progress=False)
    notes = [r.getMessage() for r in caplog.records if r.name == "fxq.graph.data"]
    assert len(notes) == 1 and "batch 1, input, has shape [4, 3, 12, 10] but batch 0 [4, 3, 8, 8]" in notes[0]


def test_other_sizes_the_model_rejects_name_the_batch():
    data = _batches((2, 3, 8, 8), (1, 3, 8, 8), (2, 3, 9, 9))
    with pytest.raises(CalibrationError, match=r"calibration batch 2, input, has shape \[2, 3, 9, 9\] but batch 0 "
                                               r"\[2, 3, 8, 8\], and the model failed on it"):
        fxq.quantize(_Net(adaptive=False).eval(), data, progress=False)


def test_calibration_folder_batches_are_named_by_file(tmp_path):
    np.save(tmp_path / "0.npy", np.zeros((1, 3, 8, 8), np.float32))
    torch.save(torch.zeros(1, 3, 8, 8, dtype=torch.float16), tmp_path / "1.pt")  # .pt dtypes show only when loaded
    with pytest.raises(CalibrationError, match=r"batch 1 \(.*1\.pt\), input: expected a float32 .*found float16"):
        fxq.quantize(_Net().eval(), fxq.load_calibration_folder(tmp_path), progress=False)


@pytest.mark.parametrize("steps", [-1, 0, 1.5, True])
def test_non_positive_steps_are_config_errors(steps):
    data = _batches((2, 3, 8, 8))
    with pytest.raises(ConfigError, match=rf"steps={steps!r}: give a positive number"):
        fxq.quantize(_Net().eval(), data, steps=steps, progress=False)
    gm = fxq.prepare(_Net().eval(), "trt_int8", data[0])
    with pytest.raises(ConfigError, match="steps="):
        fxq.calibrate(gm, data, steps=steps, progress=False)


def test_analysis_steps_zero_is_a_config_error():
    data = _batches((2, 3, 8, 8))
    gm = fxq.quantize(_Net().eval(), data, progress=False)
    with pytest.raises(ConfigError, match="steps=0"):
        fxq.graphwise_error_analyse(gm, data, steps=0, progress=False)


# ---------------------------------------------------------------------------------------- 2. command line
MODEL_SOURCE = textwrap.dedent(
    """
    from torch import nn


    def build():
        return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).eval()


    def broken():
        raise RuntimeError("no weights here")
    """
)


@pytest.fixture
def work(tmp_path, monkeypatch):
    """tmp_path as the working directory, with ``bad_inputs_model.py`` and ``calib/`` (one .npy batch)."""
    import sys

    (tmp_path / "bad_inputs_model.py").write_text(MODEL_SOURCE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "calib").mkdir()
    np.save(tmp_path / "calib" / "0.npy", np.zeros((1, 3, 8, 8), np.float32))
    yield tmp_path
    sys.modules.pop("bad_inputs_model", None)


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("fxq: error: ") and "Traceback" not in err[0]
    return err[0]


@pytest.mark.parametrize("shape", ["1,3,x", "", "1,-3,8,8", "1,0,8,8", "1,,8", "=1,3,8,8", "1,3,8.5,8", "1,3,²,8"])
def test_bad_input_shape_is_a_one_line_usage_error(work, capsys, shape):
    assert main(["quantize", "bad_inputs_model:build", "--calib", "calib", "--input-shape", shape]) == 2
    line = _error_line(capsys)
    assert "argument --input-shape" in line and "[NAME=]N,C,H,W" in line


@pytest.mark.parametrize("argv", [
    ["analyse", "m:f", "--calib", "c", "--top", "0"],
    ["analyse", "m:f", "--calib", "c", "--top", "-3"],
    ["analyse", "m:f", "--calib", "c", "--analyse-steps", "0"],
    ["quantize", "m:f", "--calib", "c", "--steps", "-1"],
    ["quantize", "m:f", "--calib", "c", "--steps", "many"],
    ["quantize", "m:f", "--calib", "c", "--batch-size", "0"],
    ["quantize", "m:f", "--calib", "c", "--max-image-pixels", "0"],
    ["report", "m:f", "--calib", "c", "--top-k", "-1"],
    ["quantize", "m:f", "--calib", "c", "--dtype", "Tensor"],
])
def test_bad_numbers_are_one_line_usage_errors(capsys, argv):
    assert main(argv) == 2
    flag = next(a for a in argv if a.startswith("--") and a != "--calib")
    assert f"argument {flag}" in _error_line(capsys)


def test_input_shape_names_must_be_unique(work, capsys):
    argv = ["quantize", "bad_inputs_model:build", "--calib", "calib", "--input-shape", "a=1,3,8,8", "--input-shape",
            "a=1,3,4,4"]
    assert main(argv) == 1
    assert "same input name" in _error_line(capsys)


@pytest.mark.parametrize("case, expected", [
    (["quantize", "somedir"], "model 'somedir' is a folder"),
    (["quantize", "dir.onnx"], "model 'dir.onnx' is a folder"),
    (["quantize", "net.prototxt", "--caffemodel", "somedir"], "--caffemodel 'somedir' is a folder"),
    (["quantize", "bad_inputs_model:build", "--caffemodel", "w.caffemodel"], "--caffemodel 'w.caffemodel' applies "
                                                                             "only to a .prototxt model"),
    (["quantize", "bad_inputs_model:build", "--setting", "somedir"], "--setting 'somedir' is a folder"),
    (["quantize", "bad_inputs_model:build", "--setting", "nope.json"], "--setting file 'nope.json' not found"),
    (["quantize", "bad_inputs_model:build", "--setting", "binary.json"], "--setting file 'binary.json' cannot be "
                                                                         "read: not UTF-8 text"),
    (["quantize", "bad_inputs_model:build", "--setting", "list.json"], "--setting file 'list.json'"),
    (["quantize", "bad_inputs_model:build", "--out", "afile"], "--out 'afile' is a file"),
    (["analyse", "bad_inputs_model:build", "--json", "nowhere/x.json"], "--json 'nowhere/x.json': folder"),
    (["analyse", "bad_inputs_model:build", "--json", "somedir"], "--json 'somedir' is a folder"),
    (["analyse", "bad_inputs_model:build", "--data", "afile"], "--data 'afile' is a file"),
    (["quantize", "bad_inputs_model:broken"], "bad_inputs_model:broken() raised RuntimeError: no weights here"),
    (["quantize", "bad_inputs_model:build", "--max-image-pixels", "10"], None),
])
def test_bad_paths_name_the_argument(work, capsys, case, expected):
    (work / "somedir").mkdir()
    (work / "dir.onnx").mkdir()
    (work / "net.prototxt").write_text('input: "data"\n')
    (work / "afile").write_text("x")
    (work / "binary.json").write_bytes(b"\xff\xfe\x00{")
    (work / "list.json").write_text("[1, 2]")
    argv = [*case, "--calib", "calib", "-q"] if "--data" not in case else [*case, "--calib", "calib", "-q"]
    code = main(argv)
    if expected is None:  # a cap above the data's images is harmless
        assert code == 0
        return
    assert code == 1
    assert expected in _error_line(capsys)


# ---------------------------------------------------------------------------------------- 3. caffe files
NET = """name: "t"
layer { name: "in" type: "Input" top: "data" input_param { shape { dim: 1 dim: 3 dim: 8 dim: 8 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "c1" convolution_param { num_output: 4 kernel_size: 3 } }
"""


def _caffe(tmp_path: Path, text: str = NET) -> tuple[Path, Path]:
    prototxt, caffemodel = tmp_path / "net.prototxt", tmp_path / "net.caffemodel"
    prototxt.write_text(text)
    net = proto.NetParameter()
    text_format.Parse(NET, net)
    for layer in net.layer:
        if layer.name == "conv1":
            for shape in ((4, 3, 3, 3), (4,)):
                blob = layer.blobs.add()
                blob.shape.dim.extend(shape)
                blob.data.extend([0.1] * int(np.prod(shape)))
    caffemodel.write_bytes(net.SerializeToString())
    return prototxt, caffemodel


def test_caffe_files_swapped_or_binary(tmp_path):
    prototxt, caffemodel = _caffe(tmp_path)
    assert fxq.load_caffe(prototxt, caffemodel) is not None
    with pytest.raises(FrontendError, match=r"net\.caffemodel: not a text prototxt, it holds a binary caffemodel; "
                                            r".*swapped"):
        fxq.load_caffe(caffemodel, prototxt)
    with pytest.raises(FrontendError, match=r"net\.prototxt: not a valid caffemodel .*it is text: .*swapped"):
        fxq.load_caffe(prototxt, prototxt)
    noise = tmp_path / "noise.prototxt"
    noise.write_bytes(bytes(np.random.default_rng(0).integers(0, 256, 300, dtype=np.uint8)))
    with pytest.raises(FrontendError, match=r"noise\.prototxt: not a text prototxt, it holds binary data"):
        fxq.load_caffe(noise)
    utf16 = tmp_path / "utf16.prototxt"
    utf16.write_bytes(NET.encode("utf-16"))
    with pytest.raises(FrontendError, match=r"utf16\.prototxt: the prototxt is UTF-16 text; save it as UTF-8"):
        fxq.load_caffe(utf16)
    with pytest.raises(FrontendError, match="is a folder"):
        fxq.load_caffe(tmp_path)


def test_truncated_caffemodel_and_syntax_error_line(tmp_path):
    prototxt, caffemodel = _caffe(tmp_path)
    data = caffemodel.read_bytes()
    caffemodel.write_bytes(data[: len(data) // 2])
    with pytest.raises(FrontendError, match=r"net\.caffemodel: not a valid caffemodel .*truncated or corrupt"):
        fxq.load_caffe(prototxt, caffemodel)
    broken = tmp_path / "broken.prototxt"
    broken.write_text('name: "t"\nlayer {\n  name: "a"\n  type: "ReLU" bottom: "x" top: "x"\n  oops\n}\n')
    with pytest.raises(FrontendError, match=r"broken\.prototxt: not a valid caffe prototxt \(line 6, column"):
        fxq.load_caffe(broken)


@pytest.mark.parametrize("text, message", [
    ('input: "data"\ninput_dim: 1\ninput_dim: 3\ninput_dim: 100000\ninput_dim: 100000\n',
     r"input 'data' has shape \[1, 3, 100000, 100000\], 30000000000 elements, over the limit of 268435456"),
    (NET.replace("dim: 8 dim: 8", "dim: 100000 dim: 100000"), r"input 'data' has shape .* over the limit"),
    (NET.replace("dim: 8 dim: 8", "dim: -8 dim: 8"), r"input 'data' has a non-positive dimension .*\[1, 3, -8, 8\]"),
    ('input: "data"\ninput_dim: 1\ninput_dim: 0\ninput_dim: 8\ninput_dim: 8\n', r"non-positive dimension"),
    (NET + 'layer { name: "fc" type: "InnerProduct" bottom: "c1" top: "fc" '
           'inner_product_param { num_output: 100000000 } }\n',
     r"layer 'fc' \(InnerProduct\): its weight would have shape \(100000000, 144\)"),
])
def test_caffe_shapes_are_capped_before_allocation(tmp_path, text, message):
    prototxt = tmp_path / "big.prototxt"
    prototxt.write_text(text)
    with pytest.raises(FrontendError, match=message):
        fxq.load_caffe(prototxt)


def test_caffe_element_cap_can_be_raised_or_lowered(tmp_path):
    prototxt, _ = _caffe(tmp_path)
    with pytest.raises(FrontendError, match="over the limit of 100"):
        fxq.load_caffe(prototxt, max_elements=100)
    with pytest.raises(FrontendError, match="input 'data' has shape"):
        fxq.load_caffe(prototxt, input_shapes={"data": [1, 3, 2**15, 2**15]})
    assert fxq.load_caffe(prototxt, input_shapes={"data": [1, 3, 2**15, 2**15]}, max_elements=2**32) is not None


# ---------------------------------------------------------------------------------------- 4. calibration folders
def _png_header_only(path: Path, width: int, height: int) -> None:
    """A PNG whose IHDR declares ``width`` x ``height`` (a few dozen bytes on disk, no real pixel data)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\0" * 1024)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b""))


def test_decompression_bomb_and_huge_images_are_refused_from_the_header(tmp_path):
    bomb, huge = tmp_path / "bomb", tmp_path / "huge"
    bomb.mkdir()
    huge.mkdir()
    _png_header_only(bomb / "a.png", 100000, 100000)
    _png_header_only(huge / "a.png", 10000, 10000)
    with pytest.raises(CalibrationError, match=r"bomb/a\.png: the image has 10000000000 pixels, over the cap of "
                                               r"67108864 \(max_image_pixels\)"):
        fxq.load_calibration_folder(bomb)
    with pytest.raises(CalibrationError, match=r"huge/a\.png: the image has 10000x10000 = 100000000 pixels, over "
                                               r"the cap of 67108864"):
        fxq.load_calibration_folder(huge, input_shape=[1, 3, 8, 8])
    data = fxq.load_calibration_folder(huge, input_shape=[1, 3, 8, 8], max_image_pixels=10**8)  # raised cap
    with pytest.raises(CalibrationError, match=r"huge/a\.png: truncated PNG: 1024 of 300010000 bytes"):
        data[0]  # the header passes, the (fake) pixel data does not


def test_truncated_png_is_an_error_not_a_crash(tmp_path):
    """torchvision's PNG decoder crashes the process on short pixel data; fxq checks the data first."""
    from torchvision.io import write_png

    write_png((torch.rand(3, 64, 64) * 255).to(torch.uint8), str(tmp_path / "a.png"), compression_level=0)
    whole = (tmp_path / "a.png").read_bytes()
    assert fxq.load_calibration_folder(tmp_path)[0].shape == (1, 3, 64, 64)
    (tmp_path / "a.png").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(CalibrationError, match=r"a\.png: (truncated PNG|not a readable image)"):
        fxq.load_calibration_folder(tmp_path)[0]


def test_image_cap_applies_to_pillow_only_formats(tmp_path):
    from PIL import Image

    Image.fromarray(np.zeros((10, 12, 3), np.uint8)).save(tmp_path / "a.bmp")
    with pytest.raises(CalibrationError, match=r"a\.bmp: the image has 12x10 = 120 pixels, over the cap of 100"):
        fxq.load_calibration_folder(tmp_path, max_image_pixels=100)
    assert tuple(fxq.load_calibration_folder(tmp_path, max_image_pixels=120)[0].shape) == (1, 3, 10, 12)
    with pytest.raises(CalibrationError, match="max_image_pixels=0"):
        fxq.load_calibration_folder(tmp_path, max_image_pixels=0)


def test_corrupt_images(tmp_path):
    (tmp_path / "a.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really")
    with pytest.raises(CalibrationError, match=r"a\.png: not a readable image"):
        fxq.load_calibration_folder(tmp_path)
    (tmp_path / "a.png").unlink()
    (tmp_path / "b.jpg").write_bytes(bytes(range(256)))
    with pytest.raises(CalibrationError, match=r"b\.jpg: not a readable image"):
        fxq.load_calibration_folder(tmp_path)


UNPICKLED: list[str] = []


def _record_unpickling() -> str:
    UNPICKLED.append("ran")
    return "ran"


class _Payload:
    def __reduce__(self):
        return (_record_unpickling, ())


def test_pickled_and_non_numeric_npy_are_refused_without_unpickling(tmp_path):
    np.save(tmp_path / "a.npy", np.array([_Payload(), None], dtype=object), allow_pickle=True)
    with pytest.raises(CalibrationError, match=r"a\.npy: a \.npy of Python objects .*never unpickles"):
        fxq.load_calibration_folder(tmp_path)
    assert UNPICKLED == []
    (tmp_path / "a.npy").unlink()
    np.save(tmp_path / "s.npy", np.array(["a", "b"]))
    with pytest.raises(CalibrationError, match=r"s\.npy: a \.npy of dtype <U1; .*numeric"):
        fxq.load_calibration_folder(tmp_path)


def test_raw_size_mixed_dtypes_and_empty_folders(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    np.zeros(10, np.float32).tofile(raw / "x.bin")
    with pytest.raises(CalibrationError, match=r"x\.bin: 40 bytes is not a whole number of samples of shape "
                                               r"\[3, 2, 2\]"):
        fxq.load_calibration_folder(raw, input_shape=[1, 3, 2, 2])
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    np.save(mixed / "a.npy", np.zeros((1, 3, 4, 4), np.float32))
    np.save(mixed / "b.npy", np.zeros((1, 3, 4, 4), np.int64))
    with pytest.raises(CalibrationError, match=r"files hold different dtypes: float32 \(a\.npy\), int64 \(b\.npy\)"):
        fxq.load_calibration_folder(mixed)
    assert fxq.load_calibration_folder(mixed, dtype="float32")[1].dtype == torch.float32  # --dtype converts
    np.save(mixed / "c.npy", np.zeros((1, 3, 4, 4), np.float64))  # float64 loads as float32: no conflict with a.npy
    (mixed / "b.npy").unlink()
    assert len(fxq.load_calibration_folder(mixed)) == 2
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("not data")
    with pytest.raises(CalibrationError, match="is empty"):
        fxq.load_calibration_folder(empty)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root reads every file")
def test_unreadable_folder_and_file(tmp_path):
    np.save(tmp_path / "a.npy", np.zeros((1, 3, 4, 4), np.float32))
    (tmp_path / "a.npy").chmod(0)
    try:
        with pytest.raises(CalibrationError, match=r"a\.npy: calibration file is not readable"):
            fxq.load_calibration_folder(tmp_path)
    finally:
        (tmp_path / "a.npy").chmod(0o644)
    tmp_path.chmod(0o300)
    try:
        with pytest.raises(CalibrationError, match="cannot be listed"):
            fxq.load_calibration_folder(tmp_path)
    finally:
        tmp_path.chmod(0o755)
