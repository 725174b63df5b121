"""FP32 islands for submodules no capture path reaches, TorchScript input, and the error when nothing works."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from torch import nn

import fxq
from fxq.graph.info import iter_quantizers


class Gate(nn.Module):
    """Python control flow on a tensor value: neither symbolic tracing nor torch.export captures it; torch.onnx
    (TorchScript-based) records the branch the example takes."""

    def __init__(self, act=torch.sigmoid) -> None:
        super().__init__()
        self.scale = nn.Conv2d(4, 4, 1)
        self.act = act

    def forward(self, x):
        if x.mean() > -100.0:
            return self.act(self.scale(x)) * x
        return x


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU())
        self.gate = Gate()
        self.tail = nn.Conv2d(4, 2, 3, padding=1)

    def forward(self, x):
        return self.tail(self.gate(self.head(x)))


def _data(shape=(1, 3, 8, 8), n=2):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(*shape, generator=g) for _ in range(n)]


def _model() -> Gated:
    torch.manual_seed(0)
    return Gated().eval()


def test_untraceable_submodule_becomes_an_fp32_island(caplog):
    with caplog.at_level(logging.WARNING, logger="fxq"):
        q = fxq.quantize(_model(), _data(), "trt_int8", progress=False)
    assert "'gate' stays FP32" in caplog.text
    islands = fxq.summary(q).fp32_islands
    assert list(islands) == ["gate"] and "control flow" in islands["gate"]
    assert "FP32 island gate" in str(fxq.summary(q))
    assert any(n.op == "call_module" and n.target == "gate" for n in q.graph.nodes)
    weighted = [r.node for r in fxq.summary(q).layers if r.weight is not None]
    assert weighted == ["head_0", "tail"]  # everything around the island is quantized
    assert not any(name.startswith("gate") for name, _ in iter_quantizers(q) if "weight" in name)


@pytest.mark.parametrize("platform", ["trt_int8", "ort_int8"])
def test_island_exports_as_float_ops_in_one_file(tmp_path, platform):
    ort = pytest.importorskip("onnxruntime")
    import onnx

    data = _data()
    q = fxq.quantize(_model(), data, platform, progress=False)
    paths = fxq.export(q, platform, tmp_path / "m.onnx")
    assert len(paths) == 1
    ops = [n.op_type for n in onnx.load(str(paths[0])).graph.node]
    assert "Sigmoid" in ops and "QuantizeLinear" in ops  # the island's float ops sit between Q/DQ pairs
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(str(paths[0]), opts, providers=["CPUExecutionProvider"])
    x = data[1]
    got = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]
    with torch.no_grad():
        want = q(x).numpy()
    assert np.abs(got - want).max() < 0.02 * np.abs(want).max()


class RootBranch(nn.Module):
    """The data-dependent branch is in the model's own forward: there is no submodule to keep FP32."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        y = self.conv(x)
        if y.sum() > 0:
            return y
        return -y


def test_model_no_path_captures_gives_one_error_per_path():
    with pytest.raises(fxq.TraceError) as e:
        fxq.prepare(RootBranch().eval(), "trt_int8", _data()[0])
    msg = str(e.value)
    assert "torch.fx symbolic tracing:" in msg and "torch.export:" in msg and "FP32 islands:" in msg
    assert "if y.sum() > 0:" in msg and "test_capture_islands.py:" in msg  # the source line, per path
    assert "What to do" in msg and "torch.where" in msg


def test_failed_capture_leaves_a_training_model_alone():
    """The error path runs a copy (to name the parts that capture), never the caller's model in train mode."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))

        def forward(self, x):
            y = self.body(x)
            return y if y.sum() > 0 else -y

    model = Net().train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(fxq.TraceError, match="body"):
        fxq.prepare(model, "trt_int8", _data()[0])
    assert model.training
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k  # BatchNorm's running statistics untouched


def _tiny() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 2, 1)).eval()


def test_torchscript_input_is_refused_with_advice_that_works(tmp_path):
    x = _data()[0]
    scripted = torch.jit.script(_tiny())
    torch.jit.save(scripted, str(tmp_path / "m.pt"))
    loaded = torch.jit.load(str(tmp_path / "m.pt"))
    for model in (scripted, loaded, torch.jit.trace(_tiny(), x)):
        with pytest.raises(fxq.TraceError, match="TorchScript") as e:
            fxq.quantize(model, _data(), "trt_int8", progress=False)
        assert "torch.onnx.export" in str(e.value) and "fxq.load_onnx" in str(e.value)
    # the advice, followed: ONNX export of the script, then fxq.load_onnx
    torch.onnx.export(loaded, (x,), str(tmp_path / "m.onnx"), dynamo=False)
    q = fxq.quantize(fxq.load_onnx(str(tmp_path / "m.onnx")), _data(), "trt_int8", progress=False)
    assert len([r for r in fxq.summary(q).layers if r.weight is not None]) == 2
    with torch.no_grad():
        assert torch.allclose(q(x), _tiny()(x), atol=0.1)


class WithScriptedPart(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.head = nn.Conv2d(3, 4, 3, padding=1)
        self.scripted = torch.jit.script(nn.Sequential(nn.Conv2d(4, 4, 1), nn.ReLU()))
        self.tail = nn.Conv2d(4, 2, 1)

    def forward(self, x):
        return self.tail(self.scripted(self.head(x)))


def test_torchscript_submodule_stays_an_fp32_island_and_says_so(caplog):
    with caplog.at_level(logging.WARNING, logger="fxq"):
        q = fxq.quantize(WithScriptedPart().eval(), _data(), "trt_int8", progress=False)
    assert "'scripted' stays FP32" in caplog.text
    assert "TorchScript" in fxq.summary(q).fp32_islands["scripted"]
    assert [r.node for r in fxq.summary(q).layers if r.weight is not None] == ["head", "tail"]


# ----------------------------------------------------------------------------------------------- ncnn
class Mix(nn.Module):
    """An island of two inputs, with a branch on their values."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Conv2d(4, 4, 1)

    def forward(self, a, b):
        if a.amax() > b.amin():
            return torch.tanh(self.proj(a)) + 0.5 * b
        return a - b


class TwoIslands(nn.Module):
    """A two-input island, and an island inside a Sequential (path ``body.2``)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.side = nn.Conv2d(3, 4, 1)
        self.mix = Mix()
        self.body = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(), Gate(), nn.Conv2d(4, 2, 1))

    def forward(self, x):
        return self.body(self.mix(torch.relu(self.stem(x)), self.side(x)))


class Pair(nn.Module):
    """An island returning a tuple."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 1)

    def forward(self, x):
        if x.mean() > -100.0:
            y = self.conv(x)
            return torch.relu(y), torch.sigmoid(y)
        return x, x


class PairThenSharedGate(nn.Module):
    """A tuple-returning island, and one island module called twice."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Conv2d(3, 4, 3, padding=1)
        self.pair = Pair()
        self.gate = Gate()
        self.tail = nn.Conv2d(4, 2, 1)

    def forward(self, x):
        a, b = self.pair(self.head(x))
        return self.tail(self.gate(a) + self.gate(b))


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.reshape(-1).astype(np.float64), b.reshape(-1).astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.mark.parametrize("make, islands", [(_model, ["gate"]), (lambda: TwoIslands().eval(), ["mix", "body.2"]),
                                           (lambda: PairThenSharedGate().eval(), ["pair", "gate"])])
def test_island_exports_to_ncnn_as_float_layers(tmp_path, caplog, make, islands):
    pytest.importorskip("ncnn")
    from test_export_ncnn import run_ncnn

    torch.manual_seed(0)
    model = make()
    data = _data(shape=(2, 3, 8, 8))  # calibrated at batch 2: the islands are traced again at ncnn's batch 1
    q = fxq.quantize(model, data, "ncnn_int8", progress=False)
    assert list(fxq.summary(q).fp32_islands) == islands
    assert "exports write it as float ops" in str(fxq.summary(q))
    with caplog.at_level(logging.WARNING, logger="fxq"):
        fxq.export(q, "ncnn_int8", tmp_path / "m")
    for path in islands:
        assert f"FP32 island '{path}' is written as float ncnn layers" in caplog.text
    param = (tmp_path / "m.param").read_text()
    assert f"{islands[0]}/" in param  # the island's layers carry its path
    assert "8=2" in param  # the quantized convs around it are int8
    xs = [x[:1] for x in _data(shape=(1, 3, 8, 8), n=3)]
    got = run_ncnn(tmp_path / "m.param", tmp_path / "m.bin", xs, int8=True)
    fp32 = run_ncnn(tmp_path / "m.fp32.param", tmp_path / "m.fp32.bin", xs, int8=False)
    for x, g, f in zip(xs, got, fp32):
        with torch.no_grad():
            want = q(x)[0].numpy()
            with fxq.fp32_mode(q):
                want_fp32 = q(x)[0].numpy()
        assert _cosine(g["out0"], want) >= 0.999
        assert np.abs(g["out0"] - want).max() < 0.02 * np.abs(want).max()
        assert np.abs(f["out0"] - want_fp32).max() < 1e-4 * max(1.0, np.abs(want_fp32).max())


def test_island_op_ncnn_cannot_write_is_named_and_nothing_is_written(tmp_path):
    model = _model()
    model.gate = Gate(torch.sign)  # ncnn has no converter for Sign
    q = fxq.quantize(model, _data(), "ncnn_int8", progress=False)
    with pytest.raises(fxq.ExportError) as e:
        fxq.export(q, "ncnn_int8", tmp_path / "m")
    msg = str(e.value)
    assert "inside FP32 island 'gate'" in msg and "'Sign'" in msg and "control flow" in msg
    assert "trt_int8 / ort_int8" in msg
    assert list(tmp_path.iterdir()) == []


def test_ncnn_islands_traced_on_the_users_example(tmp_path, monkeypatch):
    """``example_inputs`` (its first sample: ncnn files are batch 1) is what the islands are traced on."""
    pytest.importorskip("ncnn")
    import fxq.parts

    seen = []
    real = fxq.parts.record_inputs

    def recording(gm, paths, batches, *args, **kwargs):
        seen.append(batches[0])
        return real(gm, paths, batches, *args, **kwargs)

    monkeypatch.setattr(fxq.parts, "record_inputs", recording)  # islands.py imports it when it runs
    q = fxq.quantize(_model(), _data(), "ncnn_int8", progress=False)
    mine = torch.full((2, 3, 8, 8), 0.25)
    fxq.export(q, "ncnn_int8", tmp_path / "m", example_inputs=mine)
    assert len(seen) == 1 and torch.equal(seen[0][0], mine[:1])


class GateOnceOrTwice(nn.Module):
    def __init__(self, calls: int) -> None:
        super().__init__()
        self.head = nn.Conv2d(3, 4, 1)
        self.gate = Gate()  # its 1x1 conv: 16 weights + 4 biases
        self.tail = nn.Conv2d(4, 2, 1)
        self.calls = calls

    def forward(self, x):
        y = self.head(x)
        for _ in range(self.calls):
            y = self.gate(y)
        return self.tail(y)


def test_island_called_twice_writes_each_call_once(tmp_path):
    """An island module called twice is two sets of float layers, each with its weights once in the .bin (ncnn
    layers never share weights: a plain conv called twice is two Convolution layers too), not a call's weights twice.
    """
    pytest.importorskip("ncnn")
    sizes, params = {}, {}
    for calls in (1, 2):
        torch.manual_seed(0)
        q = fxq.quantize(GateOnceOrTwice(calls).eval(), _data(), "ncnn_int8", progress=False)
        fxq.export(q, "ncnn_int8", tmp_path / f"m{calls}")
        sizes[calls] = {k: (tmp_path / f"m{calls}{k}").stat().st_size for k in (".bin", ".fp32.bin")}
        params[calls] = (tmp_path / f"m{calls}.param").read_text().splitlines()
    gate_conv_bytes = 4 + 4 * (16 + 4)  # ncnn's weight-data tag, then float32 weights and biases
    assert sizes[2][".bin"] - sizes[1][".bin"] == gate_conv_bytes
    assert sizes[2][".fp32.bin"] - sizes[1][".fp32.bin"] == gate_conv_bytes
    assert sizes[1][".fp32.bin"] == 4 + 4 * (12 + 4) + gate_conv_bytes + 4 + 4 * (8 + 2)  # head, gate, tail
    gate_convs = [f[1] for f in map(str.split, params[2]) if f[0] == "Convolution" and f[1].startswith("gate/")]
    assert gate_convs == ["gate/scale/Conv", "gate/scale/Conv_1"]
    layer_count = int(params[2][1].split()[0])
    assert layer_count == len(params[2]) - 2 == len(params[1]) - 2 + 4  # one more Split, Conv, Sigmoid, Mul
