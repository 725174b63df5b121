"""ONNX inputs and outputs whose batch is not dim 0 (a recurrent state ``[2, batch, H]`` beside ``x [batch, D]``,
as in silero VAD) on ncnn, which has no batch: the state's blob drops its batch dim, in and out, so the output
state feeds the next call as it is.

Where the file names its dims, the batch symbol of the first input says where each tensor's batch is; where it
does not (fixed or unnamed dims), the export refuses the batch slice and names ``load_onnx(batch_dims=...)``,
which, followed, exports. The files run in ncnn against fxq's simulation, state fed back over several steps.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import fxq

from _export_helpers import ncnn_net

ncnn = pytest.importorskip("ncnn")

H = 8


class StateNet(nn.Module):
    """One step of a recurrent cell with its two states stacked in one input / output, ``[2, batch, H]``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, H)
        self.rec = nn.Linear(H, H)
        self.head = nn.Linear(H, 1)

    def forward(self, x: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, c = state[0], state[1]
        y = torch.tanh(self.lin(x) + self.rec(h))
        c2 = c * 0.5 + y
        return torch.sigmoid(self.head(y)), torch.stack([y, c2])


def _export(path: Path, named: bool) -> Path:
    torch.manual_seed(0)
    axes = {"x": {0: "batch"}, "state": {1: "batch"}, "out": {0: "batch"}, "stateN": {1: "batch"}} if named else None
    torch.onnx.export(StateNet().eval(), (torch.randn(1, 16), torch.zeros(2, 1, H)), str(path), dynamo=False,
                      opset_version=13, input_names=["x", "state"], output_names=["out", "stateN"],
                      dynamic_axes=axes)
    return path


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(1, 16, generator=g), torch.randn(2, 1, H, generator=g) * 0.5) for _ in range(4)]


def _run_steps(gm: torch.fx.GraphModule, files: dict[str, Path], int8: bool) -> None:
    """Three steps in ncnn against the simulation (the float model for the FP32 files), each fed the simulation's
    last state as a blob: ncnn's output state has the input's blob shape. A state laid out wrong moves values by
    O(1) (tanh outputs in another order)."""
    param, bin_ = (files["param"], files["bin"]) if int8 else (files["fp32_param"], files["fp32_bin"])
    net = ncnn_net(param, bin_, int8=int8)
    g = torch.Generator().manual_seed(2)
    state = torch.randn(2, 1, H, generator=g) * 0.5
    blob_state = np.ascontiguousarray(state[:, 0].numpy())
    for _ in range(3):
        x = torch.randn(1, 16, generator=g)
        x_arr = np.ascontiguousarray(x[0].numpy())
        ex = net.create_extractor()
        ex.input("in0", ncnn.Mat(x_arr).clone())
        ex.input("in1", ncnn.Mat(blob_state).clone())
        out = np.array(ex.extract("out0")[1]).copy()
        new_state = np.array(ex.extract("out1")[1]).copy()
        assert new_state.shape == (2, H)  # the batch dim dropped, as from the input state
        with torch.no_grad(), (contextlib.nullcontext() if int8 else fxq.fp32_mode(gm)):
            ref_out, ref_state = gm(x, state)
        tol = 1e-3 if int8 else 1e-5  # int8: ncnn may requantize a code apart (none seen)
        np.testing.assert_allclose(out.reshape(-1), ref_out.numpy().reshape(-1), atol=tol)
        np.testing.assert_allclose(new_state, ref_state[:, 0].numpy(), atol=tol)
        assert new_state.shape == blob_state.shape  # ncnn's output state is its next input as it is
        state, blob_state = ref_state, np.ascontiguousarray(ref_state[:, 0].numpy())  # no drift between the two


def _files(stem: Path) -> dict[str, Path]:
    return {"param": stem.with_suffix(".param"), "bin": stem.with_suffix(".bin"),
            "fp32_param": Path(f"{stem}.fp32.param"), "fp32_bin": Path(f"{stem}.fp32.bin")}


def test_named_batch_symbol_places_each_tensors_batch(tmp_path: Path) -> None:
    gm = fxq.quantize(fxq.load_onnx(_export(tmp_path / "named.onnx", named=True)), _data(), "ncnn_int8",
                      progress=False)
    fxq.export(gm, "ncnn_int8", tmp_path / "named")
    params = (tmp_path / "named.param").read_text().splitlines()
    assert any(line.startswith("Input") and " in1 " in f"{line} " and f"0={H} 1=2" in line for line in params)
    for int8 in (True, False):
        _run_steps(gm, _files(tmp_path / "named"), int8)


def test_unnamed_dims_refused_with_advice_that_works(tmp_path: Path) -> None:
    path = _export(tmp_path / "fixed.onnx", named=False)
    gm = fxq.quantize(fxq.load_onnx(path), _data(), "ncnn_int8", progress=False)
    with pytest.raises(fxq.ExportError, match=r"slices the batch dimension.*batch_dims=\{'state': <its batch dim>\}"
                       r".*--batch-dim state=DIM"):
        fxq.export(gm, "ncnn_int8", tmp_path / "refused")
    assert not (tmp_path / "refused.param").exists()
    gm = fxq.quantize(fxq.load_onnx(path, batch_dims={"state": 1, "stateN": -2}), _data(), "ncnn_int8",
                      progress=False)
    fxq.export(gm, "ncnn_int8", tmp_path / "given")
    for int8 in (True, False):
        _run_steps(gm, _files(tmp_path / "given"), int8)


def test_output_state_refused_with_advice_that_works(tmp_path: Path) -> None:
    """The input's batch given alone: the output state, whose declared dims say nothing either, is refused with
    the ``batch_dims`` entry for it, by its ONNX name and dim, which, followed too, exports (silero VAD's files)."""
    path = _export(tmp_path / "fixed.onnx", named=False)
    gm = fxq.quantize(fxq.load_onnx(path, batch_dims={"state": 1}), _data(), "ncnn_int8", progress=False)
    with pytest.raises(fxq.ExportError, match=r"graph output 1, of shape \(2, 1, 8\).*Fix: load the model with "
                       r"fxq.load_onnx\(\.\.\., batch_dims=\{'stateN': 1\}\) \(CLI: --batch-dim stateN=1\)"):
        fxq.export(gm, "ncnn_int8", tmp_path / "refused")
    gm = fxq.quantize(fxq.load_onnx(path, batch_dims={"state": 1, "stateN": 1}), _data(), "ncnn_int8",
                      progress=False)
    fxq.export(gm, "ncnn_int8", tmp_path / "given")
    for int8 in (True, False):
        _run_steps(gm, _files(tmp_path / "given"), int8)


class TwoStateNet(StateNet):
    """:class:`StateNet` returning its state twice, in two layouts' orders: two outputs of unnamed dims."""

    def forward(self, x: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        out, new = super().forward(x, state)
        return out, new, new.flip(0)


def test_every_output_a_fix_needs_is_named_in_one_advice(tmp_path: Path) -> None:
    """Two outputs whose batch is not dim 0 were advised one per export (a cut through RT-DETR's split attention
    heads has 18: eighteen rounds). Now one advice names them all, and followed once, it exports and runs."""
    import ast
    import re

    torch.manual_seed(0)
    path = tmp_path / "two.onnx"
    torch.onnx.export(TwoStateNet().eval(), (torch.randn(1, 16), torch.zeros(2, 1, H)), str(path), dynamo=False,
                      opset_version=13, input_names=["x", "state"], output_names=["out", "stateN", "stateM"])
    gm = fxq.quantize(fxq.load_onnx(path, batch_dims={"state": 1}), _data(), "ncnn_int8", progress=False)
    with pytest.raises(fxq.ExportError, match=r"--batch-dim stateN=1 --batch-dim stateM=1\)") as refused:
        fxq.export(gm, "ncnn_int8", tmp_path / "refused")
    advised = ast.literal_eval(re.search(r"batch_dims=(\{[^}]*\})", str(refused.value)).group(1))
    assert advised == {"stateN": 1, "stateM": 1}
    gm = fxq.quantize(fxq.load_onnx(path, batch_dims={"state": 1, **advised}), _data(), "ncnn_int8", progress=False)
    fxq.export(gm, "ncnn_int8", tmp_path / "given")
    x, state = _data()[0]
    with torch.no_grad():
        _, ref_n, ref_m = gm(x, state)
    net = ncnn_net(tmp_path / "given.param", tmp_path / "given.bin", int8=True)
    ex = net.create_extractor()
    ex.input("in0", ncnn.Mat(np.ascontiguousarray(x[0].numpy())).clone())
    ex.input("in1", ncnn.Mat(np.ascontiguousarray(state[:, 0].numpy())).clone())
    for k, ref in ((1, ref_n), (2, ref_m)):
        got = np.array(ex.extract(f"out{k}")[1]).copy()
        np.testing.assert_allclose(got, ref[:, 0].numpy(), atol=1e-3)


@pytest.mark.parametrize("dims, match", [
    ({"nope": 1}, r"'nope' is not an input or output of the model; its inputs and outputs are \['out', 'state', "),
    ({"state": 3}, r"'state' has rank 3; its batch dim must be an integer in \[-3, 2\], or None for no batch dim, got 3"),
    ({"state": "1"}, r"got '1'"),
])
def test_batch_dims_errors(tmp_path: Path, dims: dict, match: str) -> None:
    with pytest.raises(fxq.FrontendError, match=match):
        fxq.load_onnx(_export(tmp_path / "m.onnx", named=False), batch_dims=dims)


def test_cli_batch_dim(tmp_path: Path) -> None:
    from fxq import cli

    path = _export(tmp_path / "fixed.onnx", named=False)
    calib = tmp_path / "calib"
    for name, shape in (("x", (1, 16)), ("state", (2, 1, H))):
        (calib / name).mkdir(parents=True)
        for i in range(2):
            np.save(calib / name / f"{i}.npy", np.random.default_rng(i).standard_normal(shape).astype(np.float32))
    args = ["quantize", str(path), "--calib", str(calib), "--platform", "ncnn_int8", "--out", str(tmp_path / "out"),
            "-q"]
    assert cli.main(args + ["--batch-dim", "state=1", "--batch-dim", "stateN=1"]) == 0
    assert (tmp_path / "out" / "fixed_ncnn_int8.param").exists()
    assert cli.main(args + ["--batch-dim", "state"]) == 2


class TimeMajor(nn.Module):
    """A time-major detour, as around an ONNX LSTM: ``[B, C, T]`` to ``[T, B, C]``, a dim added and squeezed out at
    1 (LSTM's ``Y[T, dirs, B, H].squeeze(1)``), back to ``[B, C, T]`` for a conv. At B = T = 1 every dim but C has
    size 1, so only the squeeze's axes say where the batch went."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv1d(4, 8, 1), nn.Conv1d(8, 8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv1(x).permute(2, 0, 1)  # [T, B, C]
        y = torch.tanh(y).unsqueeze(1).squeeze(1)  # [T, 1, B, C] -> [T, B, C]
        return self.conv2(torch.relu(y.permute(1, 2, 0)))


@pytest.mark.parametrize("form", ["torch", "onnx"])
def test_squeeze_and_unsqueeze_follow_the_batch(tmp_path: Path, form: str) -> None:
    torch.manual_seed(0)
    model: Any = TimeMajor().eval()
    if form == "onnx":
        torch.onnx.export(model, (torch.randn(1, 4, 1),), str(tmp_path / "m.onnx"), dynamo=False, opset_version=13)
        model = fxq.load_onnx(tmp_path / "m.onnx")
    data = [torch.randn(1, 4, 1) for _ in range(2)]
    gm = fxq.quantize(model, data, "ncnn_int8", progress=False)
    fxq.export(gm, "ncnn_int8", tmp_path / "net")
    files = _files(tmp_path / "net")
    for int8 in (True, False):
        net = ncnn_net(files["param"] if int8 else files["fp32_param"], files["bin"] if int8 else files["fp32_bin"],
                       int8=int8)
        x = data[0]
        arr = np.ascontiguousarray(x[0].numpy())
        ex = net.create_extractor()
        ex.input("in0", ncnn.Mat(arr).clone())
        got = np.array(ex.extract("out0")[1]).copy()
        with torch.no_grad(), (contextlib.nullcontext() if int8 else fxq.fp32_mode(gm)):
            want = gm(x)[0].numpy()
        np.testing.assert_allclose(got.reshape(want.shape), want, atol=1e-3 if int8 else 1e-5)


class SqueezeOfAWideDim(nn.Module):
    """``squeeze(1)`` of a dim of size 4 does nothing (torch leaves it): the batch of 1, moved to dim 2 by a permute,
    stays there."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(3, 4, 1), nn.Conv2d(4, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv1(x).permute(2, 1, 0, 3).squeeze(1)  # [H, C, B, W], dim 1 of size 4 kept
        return self.conv2(torch.relu(y.permute(2, 1, 0, 3)))


def test_squeeze_of_a_dim_that_is_not_one_keeps_the_batch(tmp_path: Path) -> None:
    torch.manual_seed(0)
    data = [torch.randn(1, 3, 5, 6) for _ in range(2)]
    gm = fxq.quantize(SqueezeOfAWideDim().eval(), data, "ncnn_int8", progress=False)
    fxq.export(gm, "ncnn_int8", tmp_path / "net")
    files = _files(tmp_path / "net")
    net = ncnn_net(files["fp32_param"], files["fp32_bin"], int8=False)
    arr = np.ascontiguousarray(data[0][0].numpy())
    ex = net.create_extractor()
    ex.input("in0", ncnn.Mat(arr).clone())
    got = np.array(ex.extract("out0")[1]).copy()
    with torch.no_grad(), fxq.fp32_mode(gm):
        want = gm(data[0])[0].numpy()
    np.testing.assert_allclose(got.reshape(want.shape), want, atol=1e-5)


def test_the_first_inputs_given_batch_dim_names_the_batch_symbol(tmp_path: Path) -> None:
    """A time-major file (``x [seq, batch, D]``, ``h [1, batch, H]``): ``batch_dims={"x": 1}`` makes ``batch`` the
    symbol, so ``h`` and the outputs are found at their ``batch`` dims (not at ``seq``)."""
    import onnx
    from onnx import TensorProto, helper

    from fxq.graph.data import source_batch_dim

    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"]), helper.make_node("Relu", ["h"], ["h_out"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["seq", "batch", 8]),
         helper.make_tensor_value_info("h", TensorProto.FLOAT, [1, "batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["seq", "batch", 8]),
         helper.make_tensor_value_info("h_out", TensorProto.FLOAT, [1, "batch", 4])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), str(tmp_path / "t.onnx"))
    shapes = {"x": [3, 1, 8], "h": [1, 1, 4]}
    gm = fxq.load_onnx(tmp_path / "t.onnx", input_shapes=shapes, batch_dims={"x": 1})
    x_ph, h_ph = (n for n in gm.graph.nodes if n.op == "placeholder")
    assert (source_batch_dim(gm, x_ph), source_batch_dim(gm, h_ph)) == (1, 1)
    assert (source_batch_dim(gm, output=0), source_batch_dim(gm, output=1)) == (1, 1)
    plain = fxq.load_onnx(tmp_path / "t.onnx", input_shapes=shapes)  # without: dim 0's symbol, seq, is the batch's
    assert source_batch_dim(plain, next(n for n in plain.graph.nodes if n.op == "placeholder")) == 0


def _control_input_model() -> Any:
    """An ONNX image branch scaled per channel by a 1-D control input ``t [4]`` (no batch), which also gives an
    output of its own (``ts [4]``)."""
    import onnx
    from onnx import helper, numpy_helper

    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((4, 3, 3, 3)).astype(np.float32), "w")
    axes = numpy_helper.from_array(np.array([0, 2, 3], np.int64), "axes")
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("Unsqueeze", ["t", "axes"], ["t4"]), helper.make_node("Mul", ["r", "t4"], ["y"]),
             helper.make_node("Sigmoid", ["t"], ["ts"])]
    f = onnx.TensorProto.FLOAT
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", f, ["batch", 3, 8, 8]),
                                           helper.make_tensor_value_info("t", f, [4])],
                              [helper.make_tensor_value_info("y", f, ["batch", 4, 8, 8]),
                               helper.make_tensor_value_info("ts", f, [4])], [w, axes])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def test_an_input_without_batch_is_refused_with_advice_that_works(tmp_path: Path) -> None:
    model = _control_input_model()
    x, t = torch.randn(1, 3, 8, 8), torch.rand(4)
    q = fxq.quantize(fxq.load_onnx(model), [(x, t)], platform="ncnn_int8", progress=False)
    with pytest.raises(fxq.ExportError, match=r"node 't'.*shape \(4,\) has rank 0 without the batch dimension.*"
                                              r"batch_dims=\{'t': None\}\) \(CLI: --batch-dim t=none\)"):
        fxq.export(q, "ncnn_int8", tmp_path / "refused")
    q = fxq.quantize(fxq.load_onnx(model, batch_dims={"t": None, "ts": None}), [(x, t)], platform="ncnn_int8",
                     progress=False)
    fxq.export(q, "ncnn_int8", tmp_path / "m")
    with torch.no_grad():
        sim = q(x, t)
        with fxq.fp32_mode(q):
            fp32 = q(x, t)
    for int8 in (True, False):
        y, ts = sim if int8 else fp32
        stem = "m" if int8 else "m.fp32"
        net = ncnn_net(tmp_path / f"{stem}.param", tmp_path / f"{stem}.bin", int8=int8)
        ex = net.create_extractor()
        ex.input("in0", ncnn.Mat(x[0].numpy()).clone())
        ex.input("in1", ncnn.Mat(t.numpy()).clone())
        got_y, got_ts = (np.array(ex.extract(f"out{k}")[1]) for k in range(2))
        assert got_ts.shape == (4,)
        np.testing.assert_allclose(got_ts, ts.numpy(), atol=1e-6)
        np.testing.assert_allclose(got_y, y[0].numpy(), atol=1e-4 * max(1.0, float(y.abs().max())))


def test_cli_batch_dim_none() -> None:
    from fxq import cli

    assert cli._parse_batch_dim("t=none") == ("t", None)
    assert cli._parse_batch_dim("state=1") == ("state", 1)


def _scaled_by_its_size_model() -> Any:
    """``y = x / size(scale) * scale`` with ``scale [k]`` declared without a batch (put first, so the batch symbol
    must come from the next input)."""
    import onnx
    from onnx import helper

    f = onnx.TensorProto.FLOAT
    nodes = [helper.make_node("Shape", ["scale"], ["s"]), helper.make_node("Cast", ["s"], ["sf"], to=f),
             helper.make_node("Div", ["x", "sf"], ["y0"]), helper.make_node("Mul", ["y0", "scale"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("scale", f, ["k"]),
                                           helper.make_tensor_value_info("x", f, ["batch", "k"])],
                              [helper.make_tensor_value_info("y", f, ["batch", "k"])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def test_unbatched_input_keeps_its_size_when_calibrated_at_batch_two(tmp_path: Path) -> None:
    """The exporter takes the graph at batch 1: an input declared without a batch keeps its whole shape there (its
    size was cut to 1, and shape-derived constants with it), and the batch symbol comes from a batched input."""
    from fxq.graph.data import source_batch_dim

    gm = fxq.load_onnx(_scaled_by_its_size_model(), batch_dims={"scale": None})
    dims = {n.name: source_batch_dim(gm, n) for n in gm.graph.nodes if n.op == "placeholder"}
    assert dims == {"scale": None, "x": 0} and source_batch_dim(gm, output=0) == 0
    q = fxq.quantize(gm, [(torch.rand(4), torch.randn(2, 4))] * 2, "ncnn_int8", progress=False)
    fxq.export(q, "ncnn_int8", tmp_path / "m")
    s, x = torch.rand(4) + 0.5, torch.randn(1, 4)
    ex = ncnn_net(tmp_path / "m.fp32.param", tmp_path / "m.fp32.bin", int8=False).create_extractor()
    ex.input("in0", ncnn.Mat(s.numpy()).clone())
    ex.input("in1", ncnn.Mat(x[0].numpy()).clone())
    with fxq.fp32_mode(q), torch.no_grad():
        want = q(s, x)[0].numpy()
    np.testing.assert_allclose(np.array(ex.extract("out0")[1]), want, rtol=1e-5, atol=1e-6)
