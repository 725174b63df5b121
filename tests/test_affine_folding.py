"""Constant affine ops after a conv / linear fold into it; ``x @ W`` by a constant matrix becomes a linear; a
constant added to an activation keeps a grid of its own; a softmax's input keeps its peaks.

PP-OCRv5's recognizer (paddle2onnx) is where each was found: PP-LCNetV3's conv -> Add(bias) -> Mul(scale) ->
Add(shift) chains were quantized at every step, with the bias rounded to the activation's grid (0.31 -> 0 at a
step of 1.04), and its CTC head ``MatMul`` + ``Add`` had its logits' winning values clipped by percentile
calibration. On 48 rendered lines the simulation read 16 (trt_int8) and 11 (ort_int8) as the FP32 file does;
after: 30 and 37 (``bench/ocr_text.py``).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper
from torch import nn

import fxq
from fxq.graph.op_types import op_type
from fxq.graph.quant_graph import QuantGraph

from _export_helpers import output_lsb, run_ort


def _types(gm: torch.fx.GraphModule) -> list[str]:
    modules = dict(gm.named_modules())
    return [op_type(n, modules) for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")
            and not n.name.startswith("fxq_quantizers")]


def _fp32_out(gm: torch.fx.GraphModule, x: torch.Tensor) -> torch.Tensor:
    with fxq.fp32_mode(gm), torch.no_grad():
        return gm(x)


class _AffineChain(nn.Module):
    """PP-LCNetV3's learnable affine block after a bias-free conv: ``conv -> + b[1,C,1,1] -> * s -> + t -> relu``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.b = nn.Parameter(torch.randn(1, 8, 1, 1))
        self.s = nn.Parameter(torch.tensor([0.7]))
        self.t = nn.Parameter(torch.tensor([0.2]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu((self.conv(x) + self.b) * self.s + self.t)


class _Reversed(nn.Module):
    """Constants on the left (``2.0 * fc(x)``, ``c + y``), a Sub, and a linear's output."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 5)
        self.c = nn.Parameter(torch.randn(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.c + 2.0 * self.fc(x) - 0.5)


class _ConvTransposeGroups(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(4, 6, 2, stride=2, groups=2)
        self.s = nn.Parameter(torch.rand(1, 6, 1, 1) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.up(x) * self.s)


@pytest.mark.parametrize("cls, shape, left", [
    (_AffineChain, (2, 3, 12, 12), ["Conv", "Relu"]),
    (_Reversed, (4, 6), ["Gemm", "Relu"]),
    (_ConvTransposeGroups, (2, 4, 5, 5), ["ConvTranspose", "Relu"]),
])
def test_constant_affine_ops_fold_into_the_conv_before(cls, shape, left):
    torch.manual_seed(0)
    model = cls().eval()
    data = [torch.randn(*shape) for _ in range(2)]
    q = fxq.quantize(model, data, "trt_int8", progress=False)
    assert _types(q) == left
    x = torch.randn(*shape)
    with torch.no_grad():
        want = model(x)
    torch.testing.assert_close(_fp32_out(q, x), want, rtol=1e-5, atol=1e-5)


class _NotFoldable(nn.Module):
    """A constant that varies along H (not one per channel), ``c - conv(x)``, and a conv output read twice."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = (nn.Conv2d(3, 4, 1) for _ in range(3))
        self.h = nn.Parameter(torch.randn(1, 1, 6, 1))
        self.k = nn.Parameter(torch.randn(1, 4, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.c(x)
        return (self.a(x) + self.h) + (self.k - self.b(x)) + y * self.k + y


def test_what_is_not_one_number_per_channel_stays_as_it_is():
    torch.manual_seed(0)
    model = _NotFoldable().eval()
    q = fxq.quantize(model, [torch.randn(2, 3, 6, 6) for _ in range(2)], "trt_int8", progress=False)
    assert _types(q).count("Conv") == 3 and _types(q).count("Sub") == 1 and _types(q).count("Mul") == 1
    assert _types(q).count("Add") == 4
    x = torch.randn(2, 3, 6, 6)
    with torch.no_grad():
        torch.testing.assert_close(_fp32_out(q, x), model(x), rtol=1e-5, atol=1e-5)


def test_two_folded_convs_whose_weights_share_an_owner_keep_their_own_bias(tmp_path: Path):
    """ONNX weights live in one ``initializers`` module: each folded bias needs its own attribute there."""
    path = tmp_path / "two.onnx"
    nodes, inits = [], []
    rng = np.random.default_rng(0)
    x = "x"
    for i in range(2):
        inits += [numpy_helper.from_array(rng.standard_normal((4, 4 if i else 3, 1, 1)).astype(np.float32), f"w{i}"),
                  numpy_helper.from_array(rng.standard_normal((1, 4, 1, 1)).astype(np.float32), f"b{i}")]
        nodes += [helper.make_node("Conv", [x, f"w{i}"], [f"c{i}"]), helper.make_node("Add", [f"c{i}", f"b{i}"],
                                                                                       [f"a{i}"]),
                  helper.make_node("Relu", [f"a{i}"], [f"r{i}"])]
        x = f"r{i}"
    graph = helper.make_graph(nodes, "two", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 5, 5])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, 4, 5, 5])], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), path)
    gm = fxq.load_onnx(path)
    q = fxq.quantize(gm, [torch.randn(1, 3, 5, 5) for _ in range(2)], "trt_int8", progress=False)
    assert "Add" not in _types(q)
    x = torch.randn(1, 3, 5, 5)
    np.testing.assert_allclose(_fp32_out(q, x).numpy(), run_ort(path, x), rtol=1e-5, atol=1e-5)


def _head_file(path: Path, shared: bool = False) -> Path:
    """A CTC head as paddle2onnx writes it: ``MatMul`` by a stored matrix, ``Add`` of a stored bias, ``Softmax``
    (and, with ``shared``, a second MatMul reading the same matrix)."""
    rng = np.random.default_rng(1)
    inits = [numpy_helper.from_array(rng.standard_normal((16, 40)).astype(np.float32) * 0.5, "W"),
             numpy_helper.from_array(rng.standard_normal(40).astype(np.float32), "b")]
    nodes = [helper.make_node("MatMul", ["x", "W"], ["m"]), helper.make_node("Add", ["m", "b"], ["logits"]),
             helper.make_node("Softmax", ["logits"], ["y"], axis=-1)]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 10, 40])]
    if shared:
        nodes.append(helper.make_node("MatMul", ["x", "W"], ["m2"]))
        outputs.append(helper.make_tensor_value_info("m2", TensorProto.FLOAT, [1, 10, 40]))
    graph = helper.make_graph(nodes, "head", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 10, 16])],
                              outputs, inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), path)
    return path


@pytest.mark.parametrize("platform, exporter", [("trt_int8", "tensorrt"), ("ort_int8", "onnxruntime"),
                                                ("ncnn_int8", "ncnn")])
def test_a_matmul_by_a_stored_matrix_becomes_a_linear_with_its_bias_folded(tmp_path: Path, platform, exporter):
    path = _head_file(tmp_path / "head.onnx")
    gm = fxq.load_onnx(path)
    torch.manual_seed(0)
    data = [torch.randn(1, 10, 16) for _ in range(3)]
    q = fxq.quantize(gm, data, platform, progress=False)
    assert _types(q) == ["Gemm", "Softmax"]
    linear = next(n for n in q.graph.nodes if n.target is F.linear)
    assert len(linear.args) == 3 or "bias" in linear.kwargs  # the Add is the linear's bias now
    weight_q = next(fq for _, fq in QuantGraph(q).quantizers() if fq.role == "weight")
    assert weight_q.config.per_channel  # a MatMul's weight was one grid for the whole matrix
    x = torch.randn(1, 10, 16)
    np.testing.assert_allclose(_fp32_out(q, x).numpy(), run_ort(path, x), rtol=1e-5, atol=1e-6)
    files = [Path(f) for f in fxq.export(q, exporter, tmp_path / platform, example_inputs=(x,))]
    with torch.no_grad():
        sim = q(x).numpy()
    if exporter == "ncnn":
        from test_ncnn_gaps import run_ncnn

        param = next(f for f in files if f.suffix == ".param" and not f.name.endswith(".fp32.param"))
        got = run_ncnn(param, param.with_suffix(".bin"), x, 1, int8=True)[0].reshape(sim.shape)
        assert np.abs(got - sim).max() < 0.02
        return
    onnx_file = next(f for f in files if f.suffix == ".onnx")
    np.testing.assert_allclose(run_ort(onnx_file, x, optimize=False), sim, atol=1e-5)
    lsb = output_lsb(q) or 0.0  # a default session's QLinearSoftmax may be one code off (fxq warns at export)
    np.testing.assert_allclose(run_ort(onnx_file, x, optimize=True), sim, atol=1e-5 + 1.01 * lsb)


def test_a_matrix_two_matmuls_read_is_not_changed_under_the_other(tmp_path: Path):
    path = _head_file(tmp_path / "shared.onnx", shared=True)
    gm = fxq.load_onnx(path)
    q = fxq.quantize(gm, [torch.randn(1, 10, 16) for _ in range(2)], "trt_int8", progress=False)
    assert _types(q).count("Gemm") == 2
    x = torch.randn(1, 10, 16)
    with fxq.fp32_mode(q), torch.no_grad():
        got = q(x)
    import onnxruntime as ort

    want = ort.InferenceSession(str(path)).run(None, {"x": x.numpy()})
    for a, b in zip(got, want):
        np.testing.assert_allclose(a.numpy(), b, rtol=1e-5, atol=1e-5)


class _ShiftAfterActivation(nn.Module):
    """A small learned shift added after an activation (``relu(conv(x)) + t``, with 0.1 <= t <= 0.3 on a
    0..30 activation): it cannot fold into the conv."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.t = nn.Parameter(torch.linspace(0.1, 0.3, 4).reshape(1, 4, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(x)) * 10.0 + self.t


@pytest.mark.parametrize("platform, exporter", [("trt_int8", "tensorrt"), ("ort_int8", "onnxruntime")])
def test_a_constant_added_to_an_activation_keeps_its_own_grid(tmp_path: Path, platform, exporter):
    """Aligned to the activation's grid (a step of ~0.25 here), every shift rounded to 0 or one step: the whole
    output moved by up to half a step, coherently."""
    torch.manual_seed(0)
    model = _ShiftAfterActivation().eval()
    data = [torch.randn(2, 3, 8, 8) for _ in range(2)]
    q = fxq.quantize(model, data, platform, progress=False)
    quantizers = dict(QuantGraph(q).quantizers())
    shift_q = next(fq for name, fq in quantizers.items() if name.startswith("t_"))
    activation_q = next(fq for name, fq in quantizers.items() if name.startswith("mul"))
    step = float(activation_q.scale.reshape(-1)[0])
    with torch.no_grad():
        assert float((shift_q(model.t) - model.t).abs().max()) < 0.02 * step  # aligned: up to half a step
    x = data[0]
    with torch.no_grad():
        sim = q(x)
    files = fxq.export(q, exporter, tmp_path / platform, example_inputs=(x,))
    onnx_file = next(Path(f) for f in files if str(f).endswith(".onnx"))
    np.testing.assert_allclose(run_ort(onnx_file, x, optimize=False), sim.numpy(), atol=1e-4)
    np.testing.assert_allclose(run_ort(onnx_file, x, optimize=True), sim.numpy(), atol=1e-4 + step)


class _PeakyLogits(nn.Module):
    """A classifier over many classes with one clear winner per row, then a softmax or an argmax (as paddle2onnx
    exports end): the winners are fewer than the values the 99.99th percentile clips."""

    def __init__(self, reader: str = "softmax") -> None:
        super().__init__()
        self.fc = nn.Linear(32, 20000)
        self.reader = reader
        with torch.no_grad():
            self.fc.weight.normal_(0, 0.1)
            self.fc.weight[:32] = 5 * torch.eye(32)
            self.fc.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.fc(x)
        return logits.argmax(dim=-1) if self.reader == "argmax" else torch.softmax(logits, dim=-1)


@pytest.mark.parametrize("platform", ["trt_int8", "ort_int8"])
@pytest.mark.parametrize("reader", ["softmax", "argmax"])
def test_a_softmax_or_argmax_input_keeps_its_peaks_under_percentile(platform, reader):
    torch.manual_seed(0)
    model = _PeakyLogits(reader).eval()

    def batch() -> torch.Tensor:
        return 3 * F.one_hot(torch.randint(0, 32, (8,)), 32).float() + 0.1 * torch.randn(8, 32)

    data = [batch() for _ in range(2)]
    q = fxq.quantize(model, data, platform, progress=False)
    logits_q = next(fq for name, fq in QuantGraph(q).quantizers() if name.startswith("fc") and fq.role == "activation")
    x = batch()
    with torch.no_grad():
        sim, want, logits = q(x), model(x), model.fc(x)
    top = float(logits.max())  # ~15, against ~2.5 for the 99.99th percentile
    assert float(logits_q(logits).max()) > top - float(logits_q.scale.reshape(-1)[0])
    if reader == "softmax":
        assert float(sim.max(-1).values.min()) > 0.9 * float(want.max(-1).values.min())
    else:  # clipped, the winners tie at the clip and argmax takes the first of them
        assert torch.equal(sim, want)


# ---------------------------------------------------------------- what a fold may not touch (a review's findings)
class _SoftEmbed(nn.Module):
    """A table read by its own module (a lookup) and by a MatMul: the MatMul's copy is transposed, not the table."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)

    def forward(self, ids: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        return self.emb(ids) + p @ self.emb.weight


class _ReflectConv(nn.Module):
    """A reflect-padded conv stays a module and reads its weight; a functional conv of the same weight is scaled."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x) + F.conv2d(x, self.conv.weight, None, 1, 1) * 2.0


class _VectorLinear(nn.Module):
    """``F.linear`` by a 1-D weight gives one value per row: there is no channel to fold a constant into."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.w) * 0.5 + 1.0


@pytest.mark.parametrize("model, args", [
    (_SoftEmbed(), (torch.randint(0, 10, (4,)), torch.softmax(torch.randn(4, 10), -1))),
    (_ReflectConv(), (torch.randn(2, 3, 6, 6),)),
    (_VectorLinear(), (torch.randn(8, 8),)),  # batch == in_features: the last axis looks like 8 channels
], ids=["module-reads-the-table", "module-reads-the-weight", "linear-1d-weight"])
def test_a_fold_leaves_what_others_read_and_what_has_no_channels(model, args):
    model.eval()
    q = fxq.quantize(model, [args], "trt_int8", progress=False)
    with fxq.fp32_mode(q), torch.no_grad():
        torch.testing.assert_close(q(*args), model(*args), rtol=1e-5, atol=1e-5)


class _Accumulate(nn.Module):
    """``acc.add_(fc(x))`` writes into the stored tensor: it is state, not a constant to fold."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.register_buffer("acc", torch.zeros(1, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.acc.add_(self.fc(x))


def test_an_in_place_op_into_a_stored_tensor_is_not_folded():
    from fxq.graph.passes import standardize

    x = torch.randn(1, 4)
    gm = standardize(torch.fx.symbolic_trace(_Accumulate().eval()), (x,))
    assert "Add" in _types(gm)


def test_matmul_copies_and_folded_biases_are_quantized_as_weights_and_biases(tmp_path: Path):
    """The new ``get_attr``s of a rewrite are described (``meta["val"]``) like every other: a matrix two MatMuls
    read gets a weight quantizer on each linear's copy, and a bias folded into a bias-free conv a bias quantizer."""
    path = _head_file(tmp_path / "shared.onnx", shared=True)
    q = fxq.quantize(fxq.load_onnx(path), [torch.randn(1, 10, 16) for _ in range(2)], "trt_int8", progress=False)
    assert sum(1 for _, fq in QuantGraph(q).quantizers() if fq.role == "weight") == 2
    chain = fxq.quantize(_AffineChain().eval(), [torch.randn(2, 3, 8, 8)], "ort_int8", progress=False)
    assert [fq.role for _, fq in QuantGraph(chain).quantizers()].count("bias") == 1


# ---------------------------------------------------------------- a network that ends in an argmax is data
class _SegmentationHead(nn.Module):
    """PaddleSeg / paddle2onnx exports end in ``ArgMax`` over the classes: integer output, float network."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 5, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).argmax(dim=1)


def test_a_network_that_ends_in_an_argmax_is_quantized(tmp_path: Path):
    """Read backwards from its integer output, the whole network was 'shape arithmetic': nothing was quantized,
    silently, and its export was the FP32 model."""
    torch.manual_seed(0)
    model = _SegmentationHead().eval()
    data = [torch.randn(2, 3, 16, 16) for _ in range(3)]
    q = fxq.quantize(model, data, "trt_int8", progress=False)
    roles = [fq.role for _, fq in QuantGraph(q).quantizers()]
    assert roles.count("weight") == 2 and roles.count("activation") >= 2
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        assert float((q(x) == model(x)).float().mean()) > 0.95
    path = tmp_path / "seg.onnx"
    torch.onnx.export(model, (x,), str(path), dynamo=False, opset_version=13)
    loaded = fxq.quantize(fxq.load_onnx(path), data, "trt_int8", progress=False)
    assert sum(1 for _, fq in QuantGraph(loaded).quantizers() if fq.role == "weight") == 2
    files = fxq.export(loaded, "tensorrt", tmp_path / "seg_trt", example_inputs=(x,))
    onnx_file = next(Path(f) for f in files if str(f).endswith(".onnx"))
    with torch.no_grad():
        sim = loaded(x).numpy()
    np.testing.assert_array_equal(run_ort(onnx_file, x, optimize=False), sim)


class _IndexOutputs(nn.Module):
    def __init__(self, form: str) -> None:
        super().__init__()
        self.net, self.form = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 5, 1)), form

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.net(x)
        return y.argmin(1) if self.form == "argmin" else y.max(1)[1]


def test_argmin_reads_data_and_an_index_output_fxq_cannot_see_through_is_warned_about(caplog):
    torch.manual_seed(0)
    data = [torch.randn(2, 3, 8, 8) for _ in range(2)]
    q = fxq.quantize(_IndexOutputs("argmin").eval(), data, "trt_int8", progress=False)
    assert sum(1 for _, fq in QuantGraph(q).quantizers() if fq.role == "weight") == 2
    with caplog.at_level("WARNING", logger="fxq.graph.dispatch"):
        q = fxq.quantize(_IndexOutputs("max").eval(), data, "trt_int8", progress=False)
    assert not list(QuantGraph(q).quantizers())
    assert "no node will be quantized" in caplog.text and "net_0" in caplog.text


class _SharedLogits(nn.Module):
    """Logits read by a softmax only; features read by a max and by a linear (a CBAM-like pooling); scores
    returned and read by a smallest-k."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        f = self.b(x)
        c = self.c(f)
        return torch.softmax(self.a(x), -1), f.amax(-1), c, c.topk(2, largest=False)[0]


def test_only_a_tensor_read_for_its_peaks_alone_keeps_its_maximum(monkeypatch):
    """Shared with a linear, keeping a max's outliers would cost the linear its resolution; a smallest-k read
    wants the opposite."""
    import fxq.graph.calibrate as calibrate_module

    decide = calibrate_module._read_for_its_peaks
    flags: dict[str, bool] = {}
    monkeypatch.setattr(calibrate_module, "_read_for_its_peaks",
                        lambda graph, name, modules: flags.setdefault(name, decide(graph, name, modules)))
    fxq.quantize(_SharedLogits().eval(), [torch.randn(4, 8)], "trt_int8", progress=False)
    assert flags["a_out"] is True and flags["b_out"] is False and flags["c_out"] is False, flags
