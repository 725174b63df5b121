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

from _export_helpers import ort_session

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
            str(tmp_path / "out")]
    assert main(args + ["--input-shape", "2,3,32,32", "-q"]) == 0
    dims = onnx.load(str(tmp_path / "out" / "_ShuffleBN_11_trt_int8.onnx")).graph.input[0].type.tensor_type.shape.dim
    assert [d.dim_param for d in dims] == ["batch", "", "H", "W"]
    # without --input-shape the first calibration batch fixes them for loading, and says so; exports stay dynamic
    capsys.readouterr()
    (tmp_path / "out" / "_ShuffleBN_11_trt_int8.onnx").unlink()
    assert main(args) == 0
    assert "fixed from the first calibration batch (2,3,32,32)" in capsys.readouterr().err
    dims = onnx.load(str(tmp_path / "out" / "_ShuffleBN_11_trt_int8.onnx")).graph.input[0].type.tensor_type.shape.dim
    assert [d.dim_param for d in dims] == ["batch", "", "H", "W"]
    # data that cannot tell its shapes (raw .bin files): the error says how to give them
    raw = tmp_path / "raw"
    raw.mkdir()
    np.zeros(CALIB, np.float32).tofile(raw / "b0.bin")
    assert main(["quantize", str(files["shuffle_bn_11"]), "--calib", str(raw), "--out", str(tmp_path / "o2"),
                 "-q"]) == 1
    assert "--input-shape x=" in capsys.readouterr().err


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


def _tokens_file(path: Path) -> Path:
    """PP-OCR's recognizer pattern (paddle2onnx): a feature map flattened to tokens by a reshape whose shape is
    computed (``Concat(Shape(y)[0:2], [-1])``), then a head split by a reshape that reads the token count from
    ``Shape(v)[1]``. torch.onnx kept the traced, static sizes after fxq's marks, so its constant folding froze
    the token count and the exported file failed at every other width."""
    rng = np.random.RandomState(0)
    ints = {"zero": [0], "one": [1], "two": [2], "four": [4], "minus": [-1]}
    inits = [numpy_helper.from_array((rng.randn(8, 3, 3, 3) * 0.3).astype(np.float32), "w"),
             numpy_helper.from_array((rng.randn(8, 8) * 0.3).astype(np.float32), "m")]
    inits += [numpy_helper.from_array(np.array(v, np.int64), k) for k, v in ints.items()]
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1]),
             helper.make_node("Shape", ["y"], ["sy"]),
             helper.make_node("Slice", ["sy", "zero", "two"], ["nc"]),
             helper.make_node("Concat", ["nc", "minus"], ["flat"], axis=0),
             helper.make_node("Reshape", ["y", "flat"], ["t"]),
             helper.make_node("Transpose", ["t"], ["u"], perm=[0, 2, 1]),
             helper.make_node("MatMul", ["u", "m"], ["v"]),
             helper.make_node("Shape", ["v"], ["sv"]),
             helper.make_node("Cast", ["sv"], ["sv32"], to=TensorProto.INT32),
             helper.make_node("Slice", ["sv32", "one", "two"], ["tok32"]),
             helper.make_node("Cast", ["tok32"], ["tok"], to=TensorProto.INT64),
             helper.make_node("Concat", ["zero", "tok", "two", "four"], ["heads"], axis=0),
             helper.make_node("Reshape", ["v", "heads"], ["out"])]
    graph = helper.make_graph(nodes, "tokens", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                              ["n", 3, "?", "w"])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 12)])
    model.ir_version = 7
    onnx.save(model, path)
    return path


@pytest.mark.parametrize("platform", ["trt_int8", "ort_int8"])
def test_exported_token_count_follows_the_width(tmp_path, platform: str) -> None:
    gm = fxq.load_onnx(_tokens_file(tmp_path / "tokens.onnx"), input_shapes={"x": [1, 3, 4, 16]})
    gm = fxq.quantize(gm, [torch.randn(1, 3, 4, 16) for _ in range(2)], platform, progress=False)
    out = tmp_path / "q.onnx"
    fxq.export(gm, platform, out)
    model = onnx.load(out)
    assert [d.dim_param for d in model.graph.output[0].type.tensor_type.shape.dim][:2] == ["out_dim0", "out_dim1"]
    for level in (ort.GraphOptimizationLevel.ORT_ENABLE_ALL, ort.GraphOptimizationLevel.ORT_DISABLE_ALL):
        opts = ort.SessionOptions()
        opts.graph_optimization_level = level
        sess = ort.InferenceSession(str(out), opts, providers=["CPUExecutionProvider"])
        for shape in ((1, 3, 4, 16), (1, 3, 4, 24), (2, 3, 4, 8)):
            x = torch.randn(*shape)
            with torch.no_grad():
                sim = gm(x).numpy()
            got = sess.run(None, {"x": x.numpy()})[0]
            assert got.shape == sim.shape == (shape[0], 4 * shape[3], 2, 4)
            np.testing.assert_allclose(got, sim, atol=1e-5)  # shape ops only after the last Q/DQ: exact


def test_ncnn_token_count_follows_the_width(tmp_path, caplog) -> None:
    """The ncnn file of the recognizer's pattern runs at widths other than the calibration's: the head split's
    token count (read from a rank-3 tensor's shape) is written as ncnn's inferred dim (-1), not baked in. The
    builder used to probe only rank-4 tensors' spatial dims, so it took this count for a constant."""
    ncnn = pytest.importorskip("ncnn")
    from test_export_ncnn import run_ncnn

    gm = fxq.load_onnx(_tokens_file(tmp_path / "tokens.onnx"), input_shapes={"x": [1, 3, 4, 16]})
    gm = fxq.quantize(gm, [torch.randn(1, 3, 4, 16) for _ in range(2)], "ncnn_int8", progress=False)
    gm.train()  # the probe runs in eval mode and gives the modules their own modes back
    fxq.export(gm, "ncnn_int8", tmp_path / "q")
    assert all(m.training for m in gm.modules())
    gm.eval()
    assert "export-time" not in caplog.text  # no "runs only at the export-time input size" warning either
    heads = [line.split() for line in (tmp_path / "q.param").read_text().splitlines() if line.startswith("Reshape")]
    assert ["0=4", "1=2", "2=-1"] == heads[-1][6:], heads
    assert ncnn is not None
    for width in (16, 24, 8):
        x = torch.randn(1, 3, 4, width)
        with torch.no_grad():
            sim = gm(x).numpy()[0]
        got = run_ncnn(tmp_path / "q.param", tmp_path / "q.bin", [x], int8=True)[0]["out0"]
        assert got.shape == sim.shape == (4 * width, 2, 4)
        assert np.abs(got - sim).max() <= 0.05 * np.abs(sim).max()  # int8 conv / matmul in ncnn's own kernels


def test_calibration_batches_may_vary_in_the_source_files_symbolic_dims(tmp_path) -> None:
    """A model loaded from a file whose width is symbolic takes batches of other widths (OCR text lines)."""
    gm = fxq.load_onnx(_tokens_file(tmp_path / "tokens.onnx"), input_shapes={"x": [1, 3, 4, 16]})
    gm = fxq.quantize(gm, [torch.randn(1, 3, 4, w) for w in (16, 24, 8)], "trt_int8", progress=False)
    with torch.no_grad():
        assert gm(torch.randn(2, 3, 4, 40)).shape == (2, 160, 2, 4)
    report = fxq.graphwise_error_analyse(gm, [torch.randn(1, 3, 4, 12)])  # analysis data of another width
    assert report.batches == 1 and len(list(report)) > 0
    fixed = fxq.load_onnx(_fixed_width(tmp_path), input_shapes={"x": [1, 3, 4, 16]})
    fixed = fxq.quantize(fixed, [torch.randn(1, 3, 4, 16)], "trt_int8", progress=False)
    with pytest.raises(fxq.CalibrationError, match=r"prepared for \(1, 3, 4, 16\) \(batch dimension free\)"):
        fxq.graphwise_error_analyse(fixed, [torch.randn(1, 3, 4, 12)])  # a file with a fixed width: refused


def _fixed_width(tmp_path: Path) -> Path:
    model = onnx.load(_tokens_file(tmp_path / "tokens.onnx"))
    for i, d in enumerate(model.graph.input[0].type.tensor_type.shape.dim):
        if i > 0:
            d.dim_value = [3, 4, 16][i - 1]
    path = tmp_path / "fixed.onnx"
    onnx.save(model, path)
    return path


def test_doubled_dim_probes_all_at_once_else_one_by_one() -> None:
    """The one probing policy of the exporters (QDQ marks, ncnn reshapes): the inputs repeated along every dynamic
    dim at once; where the model does not run there (a recognizer whose height is symbolic in its file but fixed in
    its code), each dim alone, keeping the sizes that run."""
    from fxq.graph.data import doubled_dim_probes

    x = torch.zeros(1, 3, 4, 5)
    seen: list[tuple[int, ...]] = []

    def runs_only_at_height_4(args: tuple) -> tuple[int, ...] | None:
        seen.append(tuple(args[0].shape))
        return tuple(args[0].shape) if args[0].shape[2] == 4 else None

    assert doubled_dim_probes((x,), [(0, 2), (0, 3)], runs_only_at_height_4) == [(1, 3, 4, 10)]
    assert seen == [(1, 3, 8, 10), (1, 3, 8, 5), (1, 3, 4, 10)]
    assert doubled_dim_probes((x,), [(0, 2), (0, 3)], lambda a: a[0].shape) == [(1, 3, 8, 10)]  # all at once: done
    assert doubled_dim_probes((x,), [], runs_only_at_height_4) == []


@pytest.mark.parametrize("platform", ["trt_int8", "ort_int8"])
def test_exports_keep_the_output_dim_names_of_the_source_file(tmp_path, platform):
    """A file whose input and output dims are both named ``batch`` exports with both named ``batch`` (the output's
    was ``logits_dim0``), and runs at another batch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5)).eval()
    src = tmp_path / "m.onnx"
    torch.onnx.export(model, (torch.randn(1, 3, 8, 8),), str(src), dynamo=False, input_names=["images"],
                      output_names=["logits"], dynamic_axes={"images": {0: "batch"}, "logits": {0: "batch"}})
    q = fxq.quantize(fxq.load_onnx(src), [torch.randn(2, 3, 8, 8) for _ in range(2)], platform, progress=False)
    path = fxq.export(q, platform, tmp_path / f"{platform}.onnx")[0]
    graph = onnx.load(str(path)).graph
    dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in list(graph.input) + list(graph.output)}
    assert dims == {"images": ["batch", 3, 8, 8], "logits": ["batch", 5]}, dims
    x = torch.randn(3, 3, 8, 8)
    session = ort_session(path, optimize=False)
    with torch.no_grad():
        np.testing.assert_allclose(session.run(None, {"images": x.numpy()})[0], q(x).numpy(), rtol=0, atol=1e-5)


class _BoundedLength(nn.Module):
    """A positional table of 10 rows read up to the sequence length: the model runs at T = 6 but not at twice it,
    so the export's probe of a doubled size fails."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.out, self.pos = nn.Linear(8, 8), nn.Linear(8, 8), nn.Parameter(torch.randn(1, 10, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        t = y.shape[1]
        z = torch.relu(y + self.pos[:, :t]).reshape(y.shape[0], t, 2, 4).transpose(1, 2)
        return self.out(z.reshape(y.shape[0], 2, t * 4).reshape(y.shape[0], t, 8))


@pytest.mark.parametrize("platform", ["ort_int8", "trt_int8"])
def test_a_dynamic_dim_the_size_probe_cannot_double_stays_dynamic(tmp_path, platform: str) -> None:
    """The export's name marks take the sizes fxq ran only where a doubled size told which follow the dynamic axes;
    given every size as static here, torch.onnx froze the file's Shape reads at T = 6."""
    torch.manual_seed(0)
    torch.onnx.export(_BoundedLength().eval(), (torch.randn(1, 6, 8),), str(tmp_path / "src.onnx"), dynamo=False,
                      opset_version=17, input_names=["x"], output_names=["y"],
                      dynamic_axes={"x": {1: "T"}, "y": {1: "T"}})
    gm = fxq.quantize(fxq.load_onnx(tmp_path / "src.onnx"), [torch.randn(1, 6, 8) for _ in range(2)], platform,
                      progress=False)
    fxq.export(gm, platform, tmp_path / "m.onnx")
    session = ort_session(tmp_path / "m.onnx")
    for t in (4, 6, 8):
        x = torch.randn(1, t, 8)
        got = session.run(None, {"x": x.numpy()})[0]
        with torch.no_grad():
            np.testing.assert_allclose(got, gm(x).numpy(), atol=1e-4)
