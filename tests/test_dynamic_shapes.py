"""ONNX files with symbolic dims: ``load_onnx(input_shapes=...)``, exports that stay dynamic, and the CLI."""
from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper
from torch import nn

import fxq
from fxq.backends.qdq.lowering import dynamic_axes_for
from fxq.cli import EXIT_PARTIAL, main
from fxq.errors import FrontendError

ort = pytest.importorskip("onnxruntime")

CALIB = (2, 3, 32, 32)
OTHER_SIZES = [(1, 3, 40, 48), (3, 3, 24, 56)]


class _FlattenBN(nn.Module):
    """``view(n, c, -1)`` then BatchNorm1d: torch writes the view's shape as Shape/Gather/Concat arithmetic."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 8, 3, 1, 1), nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        n, c = y.shape[:2]
        return self.bn(y.view(n, c, -1))


class _ShuffleBN(nn.Module):
    """Channel shuffle (reshape / transpose / reshape) then BatchNorm2d."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 8, 3, 1, 1), nn.BatchNorm2d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        n, c, h, w = y.shape
        y = y.view(n, 2, c // 2, h, w).transpose(1, 2).reshape(n, c, h, w)
        return F.relu(self.bn(y))


class _ReshapePool(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.pool = nn.Conv2d(3, 8, 3, 1, 1), nn.MaxPool2d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        n, c, h, w = y.shape
        return self.pool(y.reshape(n, c, h, w)).mean((2, 3))


def _torch_file(tmp_path: Path, model: nn.Module, opset: int) -> Path:
    path = tmp_path / f"{type(model).__name__}_{opset}.onnx"
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model.eval(), (torch.randn(1, 3, 32, 32),), str(path), dynamo=False, opset_version=opset,
                          input_names=["x"], dynamic_axes={"x": {0: "batch", 2: "H", 3: "W"}})
    return path


def _paddle_file(tmp_path: Path, opset: int = 11, div: bool = False) -> Path:
    """paddle2onnx's pattern: dims named "-1" / "?", a Reshape to a computed shape, then BatchNormalization.

    With ``div`` the shape goes through Div / Mul (data propagation stops there: only folding finds the rank).
    """
    rng = np.random.default_rng(0)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["-1", 3, "?", "?"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    inits = [numpy_helper.from_array(rng.standard_normal((8, 3, 3, 3)).astype(np.float32), "w"),
             numpy_helper.from_array(np.array(1, np.int64), "one")]
    inits += [numpy_helper.from_array(v.astype(np.float32), n) for n, v in
              (("g", rng.uniform(0.5, 1.5, 8)), ("b", rng.standard_normal(8)), ("m", rng.standard_normal(8)),
               ("v", rng.uniform(0.5, 1.5, 8)))]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1], name="conv"),
             helper.make_node("Shape", ["c"], ["s"], name="shape")]
    if div:
        nodes += [helper.make_node("Div", ["s", "one"], ["q"], name="div"),
                  helper.make_node("Mul", ["q", "one"], ["s2"], name="mul")]
    nodes += [helper.make_node("Reshape", ["c", "s2" if div else "s"], ["r"], name="reshape"),
              helper.make_node("BatchNormalization", ["r", "g", "b", "m", "v"], ["y"], name="bn")]
    model = helper.make_model(helper.make_graph(nodes, "paddle", [x], [y], inits),
                              opset_imports=[helper.make_opsetid("", opset)])
    path = tmp_path / f"paddle_{opset}_{int(div)}.onnx"
    onnx.save(model, str(path))
    return path


def _files(tmp_path: Path) -> dict[str, Path]:
    return {"flatten_bn_13": _torch_file(tmp_path, _FlattenBN(), 13),
            "shuffle_bn_11": _torch_file(tmp_path, _ShuffleBN(), 11),
            "reshape_pool_13": _torch_file(tmp_path, _ReshapePool(), 13),
            "paddle_11": _paddle_file(tmp_path),
            "paddle_div_11": _paddle_file(tmp_path, div=True),
            "paddle_19": _paddle_file(tmp_path, opset=19)}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    return _files(tmp_path_factory.mktemp("dyn"))


CASES = ["flatten_bn_13", "shuffle_bn_11", "reshape_pool_13", "paddle_11", "paddle_div_11", "paddle_19"]
FAILING = CASES[:-1]  # at opset 19 onnx's Reshape inference finds the rank from the Shape it reads


def _ort(path: Path | str, x: torch.Tensor, disable: bool = False) -> np.ndarray:
    opts = ort.SessionOptions()
    if disable:
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    return sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]


@pytest.mark.parametrize("case", FAILING)
def test_symbolic_file_needs_input_shapes_and_says_how(files, case: str) -> None:
    with pytest.raises(FrontendError) as info:
        fxq.load_onnx(files[case])
    text = str(info.value)
    assert "input_shapes={'x': [" in text and "--input-shape x=" in text and "rank" in text


@pytest.mark.parametrize("case", CASES)
def test_loads_with_input_shapes_and_runs_at_other_sizes(files, case: str) -> None:
    gm = fxq.load_onnx(files[case], input_shapes={"x": list(CALIB)})
    meta = gm.meta["onnx"]
    assert meta["input_shapes"] == {"x": list(CALIB)}
    assert meta["source_input_shapes"]["x"][1] == 3 and isinstance(meta["source_input_shapes"]["x"][2], str)
    for shape in [CALIB] + OTHER_SIZES:
        x = torch.randn(*shape)
        with torch.no_grad():
            np.testing.assert_allclose(gm(x).numpy(), _ort(files[case], x), rtol=1e-4, atol=1e-4)


def test_one_shape_for_a_single_input_model(files) -> None:
    gm = fxq.load_onnx(files["paddle_11"], input_shapes=list(CALIB))
    assert gm.meta["onnx"]["input_shapes"] == {"x": list(CALIB)}


@pytest.mark.parametrize("shapes, match", [
    ({"y": [1, 3, 32, 32]}, r"'y'.*not an input.*\['x'\]"),
    ({"x": [1, 3, 32]}, r"rank 3.*rank 4"),
    ({"x": [1, 4, 32, 32]}, r"dim 1 as 4.*fixes it to 3"),
    ({"x": [1, 3, 0, 32]}, r"positive"),
])
def test_bad_input_shapes(files, shapes: dict, match: str) -> None:
    with pytest.raises(FrontendError, match=match):
        fxq.load_onnx(files["paddle_11"], input_shapes=shapes)


@pytest.mark.parametrize("platform", ["trt_int8", "ort_int8"])
@pytest.mark.parametrize("case", ["shuffle_bn_11", "paddle_11", "paddle_19"])
def test_exports_keep_the_source_dynamic_dims(files, tmp_path, case: str, platform: str) -> None:
    """Calibrated at 32x32 with input_shapes; the deployed file runs at other sizes and batches like fxq."""
    gm = fxq.load_onnx(files[case], input_shapes={"x": list(CALIB)})
    q = fxq.quantize(gm, [torch.randn(*CALIB) for _ in range(3)], platform=platform, progress=False)
    out = next(p for p in fxq.export(q, platform, tmp_path / case) if str(p).endswith(".onnx"))
    dims = onnx.load(str(out)).graph.input[0].type.tensor_type.shape.dim
    assert [d.HasField("dim_param") for d in dims] == [True, False, True, True]
    for shape in OTHER_SIZES:
        x = torch.randn(*shape)
        with torch.no_grad():
            ref = q(x)
        for disable in (False, True):
            got = torch.from_numpy(_ort(out, x, disable))
            cos = F.cosine_similarity(got.flatten().double(), ref.flatten().double(), dim=0).item()
            assert got.shape == ref.shape and cos >= 0.999, (shape, disable, cos)


def test_dynamic_axes_names() -> None:
    gm = torch.fx.symbolic_trace(nn.Identity())
    gm.meta["onnx"] = {"input_shapes": {"x": [1, 3, 32, 32]},
                       "source_input_shapes": {"x": ["-1", 3, "?", None], "y": ["batch", "seq"]}}
    axes = dynamic_axes_for(gm, ["x", "y"], ["out"], dynamic_batch=False)
    assert axes == {"x": {0: "x_dim0", 2: "x_dim2", 3: "x_dim3"}, "y": {0: "batch", 1: "seq"}}


def _write_calib(folder: Path) -> None:
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i in range(2):
        np.save(folder / f"b{i}.npy", rng.standard_normal(CALIB).astype(np.float32))


def test_cli_quantize_torch_export_without_output_names(tmp_path) -> None:
    """torch.onnx.export without input/output names (numbered outputs) and with dynamic batch/H/W."""
    import torchvision

    path = tmp_path / "r18.onnx"
    model = torchvision.models.resnet18(num_classes=10).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.randn(1, 3, 32, 32),), str(path), dynamo=False, opset_version=13,
                          dynamic_axes={"input.1": {0: "n", 2: "h", 3: "w"}})
    _write_calib(tmp_path / "calib")
    assert main(["quantize", str(path), "--calib", str(tmp_path / "calib"), "--out", str(tmp_path / "out"),
                 "-q"]) == 0
    exported = tmp_path / "out" / "r18_trt_int8.onnx"
    assert (tmp_path / "out" / "r18_trt_int8.fxq").is_file()
    q = fxq.load(tmp_path / "out" / "r18_trt_int8.fxq")
    x = torch.randn(1, 3, 48, 40)
    with torch.no_grad():
        ref = q(x)
    got = torch.from_numpy(_ort(exported, x))
    assert F.cosine_similarity(got.flatten().double(), ref.flatten().double(), dim=0).item() >= 0.999


def test_cli_input_shape_fixes_symbolic_dims(files, tmp_path, capsys) -> None:
    _write_calib(tmp_path / "calib")
    args = ["quantize", str(files["shuffle_bn_11"]), "--calib", str(tmp_path / "calib"), "--out",
            str(tmp_path / "out"), "-q"]
    assert main(args) == 1
    assert "--input-shape x=" in capsys.readouterr().err
    assert main(args + ["--input-shape", "2,3,32,32"]) == 0
    dims = onnx.load(str(tmp_path / "out" / "_ShuffleBN_11_trt_int8.onnx")).graph.input[0].type.tensor_type.shape.dim
    assert [d.dim_param for d in dims] == ["batch", "", "H", "W"]


def test_cli_failed_save_does_not_stop_the_exports(files, tmp_path, monkeypatch, capsys) -> None:
    _write_calib(tmp_path / "calib")

    def broken_save(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(fxq, "save", broken_save)
    code = main(["quantize", str(files["shuffle_bn_11"]), "--calib", str(tmp_path / "calib"), "--out",
                 str(tmp_path / "out"), "--input-shape", "x=2,3,32,32"])
    err = capsys.readouterr().err
    assert code == EXIT_PARTIAL == 3
    assert "could not write the saved model" in err and "No space left on device" in err
    assert (tmp_path / "out" / "_ShuffleBN_11_trt_int8.onnx").is_file()
    assert not (tmp_path / "out" / "_ShuffleBN_11_trt_int8.fxq").exists()
