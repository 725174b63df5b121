"""Recurrent models: nn.LSTM / nn.GRU and ONNX LSTM / GRU captured as one op per layer, quantized (X and per-gate,
per-channel W / R) on trt_int8 / ort_int8, exported as one ONNX LSTM / GRU node and checked in onnxruntime
(default session and ORT_DISABLE_ALL) against fxq's simulation; ONNX If folding and Loop refusal."""
from __future__ import annotations

import logging
import warnings

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

import fxq
from fxq.graph.info import QUANTIZERS_ATTR
from fxq.graph.trace import trace
from fxq.recurrent import RECURRENT_TARGETS

from _export_helpers import ort_session, relu_loop_body

PLATFORMS = ["trt_int8", "ort_int8"]
FEATURES, HIDDEN, FRAMES = 8, 16, 20


# ------------------------------------------------------------------------------------------------ models
class FrameTagger(nn.Module):
    """A VAD: one speech / non-speech decision per frame from a recurrent layer over feature frames."""

    def __init__(self, cls: type[nn.Module] = nn.LSTM, bidirectional: bool = False, layers: int = 1,
                 batch_first: bool = True) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.rnn = cls(FEATURES, HIDDEN, num_layers=layers, bidirectional=bidirectional, batch_first=batch_first)
        self.head = nn.Linear(HIDDEN * (2 if bidirectional else 1), 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = self.rnn(x)
        return self.head(y)


class KeywordSpotter(nn.Module):
    """Keyword spotting: one decision per utterance from the final hidden state of a 2-layer bidirectional GRU."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(FEATURES, HIDDEN, num_layers=2, bidirectional=True, batch_first=True)
        self.head = nn.Linear(2 * HIDDEN, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, h = self.rnn(x)
        return self.head(torch.cat([h[-2], h[-1]], dim=-1))


class WithStates(nn.Module):
    def __init__(self, cls: type[nn.Module]) -> None:
        super().__init__()
        self.rnn = cls(FEATURES, HIDDEN, batch_first=True)
        self.head = nn.Linear(HIDDEN, 2)

    def forward(self, x: torch.Tensor, h0: torch.Tensor, c0: torch.Tensor) -> torch.Tensor:
        y, _ = self.rnn(x, (h0, c0)) if isinstance(self.rnn, nn.LSTM) else self.rnn(x, h0)
        return self.head(y)


# ------------------------------------------------------------------------------------------------ data
def vad_batch(gen: torch.Generator, n: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic log-mel-like frames: speech segments raise bands 2..5 under heavy frame noise, so a frame's label
    is read best from its neighbours (what the recurrence is for)."""
    labels = torch.zeros(n, FRAMES, dtype=torch.long)
    for i in range(n):
        start = int(torch.randint(0, FRAMES - 6, (1,), generator=gen))
        length = int(torch.randint(4, 10, (1,), generator=gen))
        labels[i, start:start + length] = 1
    x = torch.randn(n, FRAMES, FEATURES, generator=gen) * 1.2
    x[:, :, 2:6] += labels.unsqueeze(-1).float() * 1.0
    return x, labels


def keyword_batch(gen: torch.Generator, n: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """An utterance holds the keyword when a rising then falling pattern on band 1 appears somewhere in it."""
    labels = torch.randint(0, 2, (n,), generator=gen)
    x = torch.randn(n, FRAMES, FEATURES, generator=gen) * 0.6
    pattern = torch.tensor([0.5, 1.5, 2.5, 1.5, 0.5])
    for i in range(n):
        at = int(torch.randint(0, FRAMES - 5, (1,), generator=gen))
        x[i, at:at + 5, 1] += pattern if labels[i] else -pattern
    return x, labels


def train(model: nn.Module, batch_fn, steps: int = 120, seed: int = 0) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        x, y = batch_fn(gen)
        loss = nn.functional.cross_entropy(model(x).reshape(-1, 2), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(-1) == y).float().mean())


def chunked_accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 4) -> float:
    """Accuracy in batches of the size a loaded ONNX file fixes."""
    with torch.no_grad():
        hits = [(model(x[i:i + batch]).argmax(-1) == y[i:i + batch]).float() for i in range(0, len(x), batch)]
    return float(torch.cat(hits).mean())


def quantize(model: nn.Module, data: list, platform: str) -> torch.fx.GraphModule:
    setting = fxq.QuantizationSetting()
    setting.quantize_activation_setting.calib_algorithm = "minmax"
    return fxq.quantize(model, data, platform, setting=setting, progress=False)


def output_lsb(q: torch.fx.GraphModule) -> float:
    """Scale of the quantizer on the model output (the exported output is on that grid); 0 for a float output."""
    out = next(n for n in q.graph.nodes if n.op == "output").args[0]
    if not (out.op == "call_module" and str(out.target).startswith(QUANTIZERS_ATTR)):
        return 0.0
    return float(q.get_submodule(str(out.target)).scale.max())


def check_in_ort(q: torch.fx.GraphModule, platform: str, path, inputs: tuple[torch.Tensor, ...],
                 op: str) -> list[float]:
    """Export, check the file's structure, run it in both session modes; max |ORT - simulation| per mode."""
    (file,) = fxq.export(q, platform, path)
    model = onnx.load(str(file))
    producers = {o: n for n in model.graph.node for o in n.output}
    rnn = [n for n in model.graph.node if n.op_type == op]
    assert rnn, f"no {op} node in the export"
    for node in rnn:  # W and R arrive through DequantizeLinear, per channel along the gates*hidden axis
        for i in (1, 2):
            dq = producers[node.input[i]]
            assert dq.op_type == "DequantizeLinear"
            assert next(a.i for a in dq.attribute if a.name == "axis") == 1
    with torch.no_grad():
        ref = q(*inputs)
    refs = [ref] if isinstance(ref, torch.Tensor) else list(ref)
    diffs = []
    for optimize in (True, False):
        sess = ort_session(str(file), optimize)
        feed = {i.name: t.numpy() for i, t in zip(sess.get_inputs(), inputs)}
        outs = sess.run(None, feed)
        assert len(outs) == len(refs)
        diffs.append(max(float(np.abs(o - r.numpy()).max()) for o, r in zip(outs, refs)))
    return diffs


# ------------------------------------------------------------------------------------------------ capture
@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU], ids=["lstm", "gru"])
@pytest.mark.parametrize("bidirectional", [False, True], ids=["uni", "bi"])
@pytest.mark.parametrize("layers", [1, 2], ids=["1layer", "2layers"])
@pytest.mark.parametrize("batch_first", [False, True], ids=["seq_first", "batch_first"])
@pytest.mark.parametrize("states", [False, True], ids=["no_state", "state"])
def test_trace_is_one_op_per_layer_and_exact(cls, bidirectional, layers, batch_first, states):
    torch.manual_seed(0)
    rnn = cls(3, 4, num_layers=layers, bidirectional=bidirectional, batch_first=batch_first).eval()
    dirs = 2 if bidirectional else 1
    x = torch.randn(2, 5, 3) if batch_first else torch.randn(5, 2, 3)
    args = (x,)
    if states:
        h0 = torch.randn(layers * dirs, 2, 4)
        args = (x, (h0, torch.randn_like(h0))) if cls is nn.LSTM else (x, h0)
    gm = trace(nn.Sequential(rnn)) if not states else trace(_Call(rnn))
    ops = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in RECURRENT_TARGETS]
    assert len(ops) == layers
    assert not any(n.op == "call_module" for n in gm.graph.nodes)
    with torch.no_grad():
        want, got = rnn(*args), (gm(*args) if states else gm(x))
    flat = lambda t: [t] if isinstance(t, torch.Tensor) else [v for item in t for v in flat(item)]  # noqa: E731
    for a, b in zip(flat(want), flat(got)):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)


class _Call(nn.Module):
    def __init__(self, rnn: nn.Module) -> None:
        super().__init__()
        self.rnn = rnn

    def forward(self, x, state):
        return self.rnn(x, state)


def test_lstm_with_projection_stays_a_leaf(caplog):
    rnn = nn.LSTM(3, 4, proj_size=2)
    with caplog.at_level(logging.INFO, logger="fxq.recurrent.capture"):
        gm = trace(nn.Sequential(rnn))
    assert any(n.op == "call_module" for n in gm.graph.nodes)
    assert "proj_size" in caplog.text


def test_ops_backpropagate():
    """QAT trains through the recurrent op: its gradients are torch's own (recomputed under autograd)."""
    torch.manual_seed(0)
    x = torch.randn(4, 2, 3, dtype=torch.double, requires_grad=True)
    w = torch.randn(2, 16, 3, dtype=torch.double, requires_grad=True)
    r = torch.randn(2, 16, 4, dtype=torch.double, requires_grad=True)
    b = torch.randn(2, 32, dtype=torch.double, requires_grad=True)
    h = torch.randn(2, 2, 4, dtype=torch.double, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *a: torch.ops.fxq.lstm(*a, None, 4, "bidirectional"), (x, w, r, b, h))
    wg = w[:, :12].detach().clone().requires_grad_()
    rg = r[:, :12].detach().clone().requires_grad_()
    bg = b[:, :24].detach().clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda *a: torch.ops.fxq.gru(*a, None, 4, "bidirectional", 0), (x, wg, rg, bg))


# ------------------------------------------------------------------------------------------------ trained models
@pytest.fixture(scope="module")
def vad() -> tuple[nn.Module, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    model = train(FrameTagger(nn.LSTM), vad_batch)
    gen = torch.Generator().manual_seed(123)
    x, y = vad_batch(gen, 256)
    calib = [vad_batch(gen, 32)[0] for _ in range(4)]
    return model, x, y, calib


@pytest.mark.parametrize("platform", PLATFORMS)
def test_trained_lstm_vad_quantizes_and_deploys(vad, platform, tmp_path):
    model, x, y, calib = vad
    float_acc = accuracy(model, x, y)
    assert float_acc > 0.85  # the task is learnt
    q = quantize(model, calib, platform)
    lstm = [n for n in q.graph.nodes if getattr(n.meta.get("fxq"), "op_type", None) == "LSTM"]
    assert len(lstm) == 1 and lstm[0].meta["fxq"].platform == platform
    weights = [q.get_submodule(f"{QUANTIZERS_ATTR}.{name}") for name in lstm[0].meta["fxq"].inputs.values()]
    assert sum(fq.config.per_channel and fq.config.channel_axis == 1 for fq in weights) == 2  # W and R
    q_acc = accuracy(q, x, y)
    assert abs(q_acc - float_acc) < 0.02, (float_acc, q_acc)
    diffs = check_in_ort(q, platform, tmp_path / "vad.onnx", (x[:32],), "LSTM")
    assert max(diffs) <= output_lsb(q) + 1e-6, diffs


@pytest.fixture(scope="module")
def kws() -> nn.Module:
    return train(KeywordSpotter(), keyword_batch, steps=40)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_trained_gru_keyword_spotter(kws, platform, tmp_path):
    model = kws
    gen = torch.Generator().manual_seed(7)
    x, y = keyword_batch(gen, 256)
    float_acc = accuracy(model, x, y)
    assert float_acc > 0.9
    q = quantize(model, [keyword_batch(gen)[0] for _ in range(4)], platform)
    assert sum(getattr(n.meta.get("fxq"), "op_type", None) == "GRU" for n in q.graph.nodes) == 2
    q_acc = accuracy(q, x, y)
    assert abs(q_acc - float_acc) < 0.03, (float_acc, q_acc)
    diffs = check_in_ort(q, platform, tmp_path / "kws.onnx", (x[:32],), "GRU")
    assert max(diffs) <= output_lsb(q) + 1e-6, diffs


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU], ids=["lstm", "gru"])
def test_initial_states_as_inputs(cls, tmp_path):
    torch.manual_seed(0)
    model = WithStates(cls).eval()
    batches = [(torch.randn(4, FRAMES, FEATURES), torch.randn(1, 4, HIDDEN), torch.randn(1, 4, HIDDEN))
               for _ in range(3)]
    q = quantize(model, batches, "ort_int8")
    diffs = check_in_ort(q, "ort_int8", tmp_path / "states.onnx", batches[0], cls.__name__.upper())
    assert max(diffs) <= output_lsb(q) + 1e-6, diffs


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("cls,bidirectional,layers,batch_first", [
    (nn.LSTM, True, 2, False), (nn.GRU, False, 1, True), (nn.GRU, True, 2, True)], ids=["lstm-bi-2", "gru", "gru-bi-2"])
def test_variants_deploy(platform, cls, bidirectional, layers, batch_first, tmp_path):
    torch.manual_seed(0)
    model = FrameTagger(cls, bidirectional, layers, batch_first).eval()
    shape = (4, FRAMES, FEATURES) if batch_first else (FRAMES, 4, FEATURES)
    q = quantize(model, [torch.randn(shape) for _ in range(3)], platform)
    diffs = check_in_ort(q, platform, tmp_path / "m.onnx", (torch.randn(shape),), cls.__name__.upper())
    assert max(diffs) <= output_lsb(q) + 1e-6, diffs


def run_ncnn(files: list, x: torch.Tensor) -> np.ndarray:
    """The int8 ncnn model's output on one sequence (the first of ``x``)."""
    pytest.importorskip("ncnn")
    from test_ncnn_gaps import run_ncnn as run  # the ncnn tests' runner (CPU, no fp16)

    param, weights = (next(f for f in files if str(f).endswith(ext) and ".fp32." not in str(f))
                      for ext in (".param", ".bin"))
    return run(param, weights, x, 1, int8=True)[0]


def test_ncnn_keeps_recurrent_layers_fp32(vad, caplog, tmp_path):
    """ncnn_int8: the LSTM stays FP32 (logged) and is written as ncnn's own LSTM layer around the int8 head."""
    model, x, y, calib = vad
    with caplog.at_level(logging.INFO, logger="fxq.graph.dispatch"):
        q = quantize(model, calib[:2], "ncnn_int8")
    (lstm,) = [n for n in q.graph.nodes if getattr(n.meta.get("fxq"), "op_type", None) == "LSTM"]
    assert lstm.meta["fxq"].platform == "fp32" and not lstm.meta["fxq"].inputs
    assert "stays FP32" in caplog.text
    files = fxq.export(q, "ncnn_int8", tmp_path / "vad")
    param = next(f for f in files if str(f).endswith(".param") and ".fp32." not in str(f)).read_text()
    assert "\nLSTM " in param and "\nInnerProduct " in param
    with torch.no_grad():
        want = q(x[:1])[0].numpy()
    np.testing.assert_allclose(run_ncnn(files, x[:1]), want, atol=1e-4)


@pytest.mark.parametrize("cls,bidirectional,layers", [(nn.GRU, False, 1), (nn.GRU, True, 2), (nn.LSTM, True, 2)],
                         ids=["gru", "gru-bi-2", "lstm-bi-2"])
def test_ncnn_recurrent_variants(cls, bidirectional, layers, tmp_path):
    torch.manual_seed(0)
    model = FrameTagger(cls, bidirectional, layers).eval()
    q = quantize(model, [torch.randn(1, FRAMES, FEATURES) for _ in range(2)], "ncnn_int8")
    files = fxq.export(q, "ncnn_int8", tmp_path / "m")
    x = torch.randn(1, FRAMES, FEATURES)
    with torch.no_grad():
        want = q(x)[0].numpy()
    np.testing.assert_allclose(run_ncnn(files, x), want, atol=1e-4)


# ------------------------------------------------------------------------------------------------ ONNX files
class StoredStartState(nn.Module):
    """An LSTM started from stored states (a CRNN text recognizer's export: ``initial_h`` / ``initial_c`` are
    constants of the file, as torch 1.x wrote the zeros it made in ``forward``)."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(FEATURES, HIDDEN, bidirectional=True, batch_first=True)
        self.register_buffer("h0", 0.3 * torch.randn(2, 1, HIDDEN))
        self.register_buffer("c0", 0.3 * torch.randn(2, 1, HIDDEN))
        self.head = nn.Linear(2 * HIDDEN, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x, (self.h0, self.c0))[0])


def test_onnx_lstm_with_stored_initial_states_on_ncnn(tmp_path):
    """Stored initial states become ncnn blobs of the LSTM's ``(D, H)`` state layout: they were refused as
    constants whose batch is not dim 0. Non-zero states, so a layout or value mistake shows."""
    torch.manual_seed(0)
    model = StoredStartState().eval()
    x = torch.randn(1, FRAMES, FEATURES)
    _torch_onnx(model, x, tmp_path / "crnn.onnx", dynamo=False)
    assert {i.name for i in onnx.load(str(tmp_path / "crnn.onnx")).graph.initializer} >= {"h0", "c0"}
    gm = fxq.load_onnx(tmp_path / "crnn.onnx")
    q = quantize(gm, [torch.randn(1, FRAMES, FEATURES) for _ in range(2)], "ncnn_int8")
    files = fxq.export(q, "ncnn_int8", tmp_path / "crnn")
    with torch.no_grad():
        want = q(x)[0].numpy()
    np.testing.assert_allclose(run_ncnn(files, x), want, atol=1e-4)


def _torch_onnx(model: nn.Module, x: torch.Tensor, path, dynamo: bool) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (x,), str(path), dynamo=dynamo, input_names=["features"], output_names=["logits"],
                          opset_version=18 if dynamo else 17, **({"verbose": False} if dynamo else {}))


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_onnx_lstm_file_loads_quantizes_and_deploys(vad, dynamo, tmp_path):
    model, x, y, calib = vad
    _torch_onnx(model, x[:4], tmp_path / "vad.onnx", dynamo)
    gm = fxq.load_onnx(tmp_path / "vad.onnx")  # verified against onnxruntime on load
    lstm = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in RECURRENT_TARGETS]
    assert len(lstm) == 1
    assert all(a.op == "get_attr" for a in lstm[0].args[1:4])  # W, R, B: weights the platforms quantize
    with torch.no_grad():
        torch.testing.assert_close(gm(x[:4]), model(x[:4]), rtol=0, atol=1e-5)
    float_acc = chunked_accuracy(model, x[:64], y[:64])
    for platform in PLATFORMS:
        q = quantize(gm, [c[:4] for c in calib], platform)
        assert abs(chunked_accuracy(q, x[:64], y[:64]) - float_acc) < 0.03, platform
        diffs = check_in_ort(q, platform, tmp_path / f"vad_{platform}.onnx", (x[:4],), "LSTM")
        assert max(diffs) <= output_lsb(q) + 1e-6, (platform, diffs)


def test_onnx_gru_file_both_reset_forms(tmp_path):
    """A hand-written GRU node with linear_before_reset=0 (TF / Keras exports; torch has no such kernel) and 1."""
    torch.manual_seed(0)
    for lbr in (0, 1):
        w = numpy_helper.from_array(np.random.RandomState(0).randn(2, 3 * 4, 3).astype(np.float32) * 0.5, "W")
        r = numpy_helper.from_array(np.random.RandomState(1).randn(2, 3 * 4, 4).astype(np.float32) * 0.5, "R")
        b = numpy_helper.from_array(np.random.RandomState(2).randn(2, 6 * 4).astype(np.float32) * 0.1, "B")
        graph = helper.make_graph(
            [helper.make_node("GRU", ["x", "W", "R", "B"], ["y", "y_h"], hidden_size=4, direction="bidirectional",
                              linear_before_reset=lbr, name="gru")],
            "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [6, 2, 3])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [6, 2, 2, 4]),
             helper.make_tensor_value_info("y_h", TensorProto.FLOAT, [2, 2, 4])], initializer=[w, r, b])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])
        gm = fxq.load_onnx(model)  # raises when it differs from onnxruntime
        x = torch.randn(6, 2, 3)
        sess = ort_session(model, False)
        want = sess.run(None, {"x": x.numpy()})
        got = gm(x)
        for a, g in zip(want, got):
            np.testing.assert_allclose(g.detach().numpy(), a, atol=1e-5)


def _with_if(model: onnx.ModelProto, cond_nodes: list, cond: str, dim: int = 2) -> onnx.ModelProto:
    """The model's output passed through an If: softmax when ``cond`` holds, negation otherwise."""
    graph = model.graph
    out = graph.output[0].name
    for node in graph.node:
        for i, o in enumerate(node.output):
            if o == out:
                node.output[i] = "pre_if"
    then_g = helper.make_graph([helper.make_node("Softmax", ["pre_if"], ["t"], axis=-1, name="sm")], "then", [],
                               [helper.make_tensor_value_info("t", TensorProto.FLOAT, None)])
    else_g = helper.make_graph([helper.make_node("Neg", ["pre_if"], ["e"], name="neg")], "else", [],
                               [helper.make_tensor_value_info("e", TensorProto.FLOAT, None)])
    graph.node.extend([*cond_nodes, helper.make_node("If", [cond], [out], then_branch=then_g, else_branch=else_g,
                                                     name="pick")])
    graph.initializer.extend([numpy_helper.from_array(np.array(2, dtype=np.int64), "two"),
                              numpy_helper.from_array(np.array(dim, dtype=np.int64), "dim"),
                              numpy_helper.from_array(np.array(FEATURES, dtype=np.int64), "n_features")])
    return model


def test_onnx_if_on_sizes_takes_its_branch(vad, tmp_path):
    """The VAD file with an If on the feature count (folds at load) -> the branch taken, quantized, deployed."""
    model, x, y, calib = vad
    _torch_onnx(model, x[:4], tmp_path / "vad.onnx", False)
    proto = _with_if(onnx.load(str(tmp_path / "vad.onnx")), [
        helper.make_node("Shape", ["features"], ["shape"], name="shape"),
        helper.make_node("Gather", ["shape", "two"], ["n"], axis=0, name="dim2"),
        helper.make_node("Equal", ["n", "n_features"], ["is_mel"], name="eq")], "is_mel")
    gm = fxq.load_onnx(proto)
    types = [n.meta.get("onnx", {}).get("op_type") for n in gm.graph.nodes]
    assert "Softmax" in types and "Neg" not in types and "If" not in types and "Equal" not in types
    with torch.no_grad():
        torch.testing.assert_close(gm(x[:4]), model(x[:4]).softmax(-1), rtol=0, atol=1e-5)
    q = quantize(gm, [c[:4] for c in calib], "ort_int8")
    diffs = check_in_ort(q, "ort_int8", tmp_path / "if.onnx", (x[:4],), "LSTM")
    assert max(diffs) <= 1e-5, diffs  # a float softmax over the quantized logits


def test_onnx_if_on_values_and_loop_are_refused(vad, tmp_path):
    model, x, y, calib = vad
    _torch_onnx(model, x[:4], tmp_path / "vad.onnx", False)
    proto = _with_if(onnx.load(str(tmp_path / "vad.onnx")), [
        helper.make_node("ReduceMax", ["features"], ["peak"], keepdims=0, name="peak"),
        helper.make_node("Cast", ["peak"], ["peak_i"], to=TensorProto.INT64, name="cast"),
        helper.make_node("Greater", ["peak_i", "two"], ["loud"], name="gt")], "loud")
    with pytest.raises(fxq.FrontendError, match=r"If node 'pick'.*input_shapes"):
        fxq.load_onnx(proto)
    body = relu_loop_body()
    graph = helper.make_graph(
        [helper.make_node("Loop", ["trip", "go", "x"], ["y"], body=body, name="frames_loop")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
        initializer=[numpy_helper.from_array(np.array(3, dtype=np.int64), "trip"),
                     numpy_helper.from_array(np.array(True), "go")])
    with pytest.raises(fxq.FrontendError, match=r"'frames_loop' \(Loop\).*unrolled"):
        fxq.load_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


def test_save_load_and_qat(vad, tmp_path):
    """fxq.save / fxq.load keep the recurrent ops (both capture paths); QAT back-propagates into W / R."""
    model, x, y, calib = vad
    _torch_onnx(model, x[:4], tmp_path / "vad.onnx", False)
    for source in (model, fxq.load_onnx(tmp_path / "vad.onnx")):
        q = quantize(source, [c[:4] for c in calib], "trt_int8")
        fxq.save(q, tmp_path / "m.fxq")
        with torch.no_grad():
            torch.testing.assert_close(fxq.load(tmp_path / "m.fxq")(x[:4]), q(x[:4]), rtol=0, atol=0)
    qat = fxq.prepare_qat(model, "trt_int8", calib[0])
    nn.functional.cross_entropy(qat(x[:32]).reshape(-1, 2), y[:32].reshape(-1)).backward()
    grads = [p.grad for name, p in qat.named_parameters() if name.split(".")[-1] in ("W_l0", "R_l0")]
    assert len(grads) == 2 and all(g is not None and bool(g.abs().sum() > 0) for g in grads)


@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
def test_onnx_lstm_node_states_and_all_outputs(direction, tmp_path):
    """A hand-written LSTM node: initial states as graph inputs, all three outputs used, each direction; the loaded
    graph matches onnxruntime, and its quantized export runs in onnxruntime like the simulation."""
    dirs = 2 if direction == "bidirectional" else 1
    rng = np.random.RandomState(0)
    inits = [numpy_helper.from_array((rng.randn(*shape) * scale).astype(np.float32), name) for name, shape, scale in
             (("W", (dirs, 16, 3), 0.5), ("R", (dirs, 16, 4), 0.5), ("B", (dirs, 32), 0.1))]
    value = lambda name, shape: helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)  # noqa: E731
    graph = helper.make_graph(
        [helper.make_node("LSTM", ["x", "W", "R", "B", "", "h0", "c0"], ["y", "y_h", "y_c"], hidden_size=4,
                          direction=direction, name="lstm")],
        "g", [value("x", [6, 2, 3]), value("h0", [dirs, 2, 4]), value("c0", [dirs, 2, 4])],
        [value("y", [6, dirs, 2, 4]), value("y_h", [dirs, 2, 4]), value("y_c", [dirs, 2, 4])], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])
    gm = fxq.load_onnx(model)  # verified against onnxruntime on load
    torch.manual_seed(0)
    batches = [(torch.randn(6, 2, 3), torch.randn(dirs, 2, 4), torch.randn(dirs, 2, 4)) for _ in range(3)]
    q = quantize(gm, batches, "ort_int8")
    diffs = check_in_ort(q, "ort_int8", tmp_path / "lstm.onnx", batches[0], "LSTM")
    assert max(diffs) <= 1e-5, diffs  # Y: the LSTM's own float output over dequantized inputs and weights


def test_ops_pass_opcheck():
    """The custom ops' schemas, fake kernels and autograd registrations agree with their eager kernels."""
    torch.manual_seed(0)
    x, h = torch.randn(4, 2, 3), torch.randn(2, 2, 4)
    lstm_args = (x, torch.randn(2, 16, 3), torch.randn(2, 16, 4), torch.randn(2, 32), h, torch.randn(2, 2, 4), 4,
                 "bidirectional")
    torch.library.opcheck(torch.ops.fxq.lstm.default, lstm_args)
    gru_args = (x, torch.randn(1, 12, 3), torch.randn(1, 12, 4), torch.randn(1, 24), None, 4, "reverse", 0)
    torch.library.opcheck(torch.ops.fxq.gru.default, gru_args)


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_onnx_gru_keyword_spotter_file(kws, dynamo, tmp_path):
    """The trained 2-layer bidirectional GRU (final states used) through a torch.onnx file, on both platforms."""
    gen = torch.Generator().manual_seed(7)
    x, y = keyword_batch(gen, 64)
    _torch_onnx(kws, x[:4], tmp_path / "kws.onnx", dynamo)
    gm = fxq.load_onnx(tmp_path / "kws.onnx")
    assert sum(n.op == "call_function" and n.target in RECURRENT_TARGETS for n in gm.graph.nodes) == 2
    float_acc = chunked_accuracy(kws, x, y)
    for platform in PLATFORMS:
        q = quantize(gm, [keyword_batch(gen, 4)[0] for _ in range(4)], platform)
        assert abs(chunked_accuracy(q, x, y) - float_acc) < 0.05, platform
        diffs = check_in_ort(q, platform, tmp_path / f"kws_{platform}.onnx", (x[:4],), "GRU")
        assert max(diffs) <= output_lsb(q) + 1e-6, (platform, diffs)


def test_onnx_if_on_sizes_of_a_dynamic_file(vad, tmp_path):
    """Dynamic batch and time: an If on the (fixed) feature count folds as is; one on the time length folds once
    ``input_shapes`` fixes it, and is refused with that advice before."""
    model, x, y, calib = vad
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (x[:4],), str(tmp_path / "vad.onnx"), dynamo=False, input_names=["features"],
                          output_names=["logits"], opset_version=17,
                          dynamic_axes={"features": {0: "batch", 1: "time"}, "logits": {0: "batch", 1: "time"}})
    on_dim = lambda dim: _with_if(onnx.load(str(tmp_path / "vad.onnx")), [  # noqa: E731
        helper.make_node("Shape", ["features"], ["shape"], name="shape"),
        helper.make_node("Gather", ["shape", "dim"], ["n"], axis=0, name="pick_dim"),
        helper.make_node("Equal", ["n", "n_features"], ["cond"], name="eq")], "cond", dim)
    gm = fxq.load_onnx(on_dim(2))
    assert "Softmax" in [n.meta.get("onnx", {}).get("op_type") for n in gm.graph.nodes]
    with torch.no_grad():
        torch.testing.assert_close(gm(x[:3]), model(x[:3]).softmax(-1), rtol=0, atol=1e-5)
    with pytest.raises(fxq.FrontendError, match=r"If node 'pick'.*input_shapes"):
        fxq.load_onnx(on_dim(1))
    gm = fxq.load_onnx(on_dim(1), input_shapes={"features": [4, FEATURES, FEATURES]})  # time == 8: then branch
    with torch.no_grad():
        torch.testing.assert_close(gm(x[:4, :FEATURES]), model(x[:4, :FEATURES]).softmax(-1), rtol=0, atol=1e-5)


class LastState(nn.Module):
    """A decision from the final hidden state only (ncnn then needs zero initial states to output it)."""

    def __init__(self, cls: type[nn.Module]) -> None:
        super().__init__()
        self.rnn = cls(FEATURES, HIDDEN, batch_first=True)
        self.head = nn.Linear(HIDDEN, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, state = self.rnn(x)
        h = state[0] if isinstance(state, tuple) else state
        return self.head(h[-1])


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU], ids=["lstm", "gru"])
def test_ncnn_final_state_output(cls, tmp_path):
    torch.manual_seed(0)
    q = quantize(LastState(cls).eval(), [torch.randn(1, FRAMES, FEATURES) for _ in range(2)], "ncnn_int8")
    files = fxq.export(q, "ncnn_int8", tmp_path / "m")
    assert "MemoryData" in next(f for f in files if str(f).endswith(".param")).read_text()
    x = torch.randn(1, FRAMES, FEATURES)
    with torch.no_grad():
        want = q(x)[0].numpy()
    np.testing.assert_allclose(run_ncnn(files, x).reshape(-1), want.reshape(-1), atol=1e-4)


class RowLSTM(nn.Module):
    """Sequencer's row mixing: every row of the image one sequence, the rows folded into the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn, self.fc = nn.LSTM(4, 4, batch_first=True, bidirectional=True), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, h, w, c = x.shape
        y, _ = self.rnn(x.reshape(b * h, w, c))
        return self.fc(y).reshape(b, h, w, -1)


def test_sequences_folded_into_the_batch_are_refused_for_ncnn_with_a_fix_that_fits(tmp_path):
    """The writer exports at batch 1 already: the old advice ('export at batch 1') could not help."""
    q = fxq.quantize(RowLSTM().eval(), [torch.randn(1, 3, 5, 4)], "ncnn_int8", progress=False)
    with pytest.raises(fxq.ExportError, match=r"runs 3 sequences at once .* deploy with trt_int8 / ort_int8"):
        fxq.export(q, "ncnn_int8", tmp_path / "m")
    fxq.export(fxq.quantize(RowLSTM().eval(), [torch.randn(1, 3, 5, 4)], "ort_int8", progress=False), "ort_int8",
               tmp_path / "m.onnx")  # the platform the fix names takes it
