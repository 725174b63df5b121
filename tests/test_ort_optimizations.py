"""QDQ exports in onnxruntime's default session (graph optimizations on) against fxq's simulation.

onnxruntime's ``WeightBiasQuantization`` pass (level 1, so already in ``ORT_ENABLE_BASIC``) rewrites the FP32 bias
of a Conv/Gemm with a dequantized input and a quantized output as int32 codes of input scale x weight scale.
A bias fxq simulates in FP32 (``trt_int8``) is then rounded to that grid: well under an output step on
ordinary models, but where activations vanish (input scale at the 1e-8 floor) the codes overflow int32 and the
session computes garbage. The exporters say so with a WARNING naming the nodes; the file stays what fxq
simulates (``ORT_DISABLE_ALL`` and a session without that pass reproduce it).

Its ``QDQSelectorActionTransformer`` (level 2) runs DQ -> Conv -> Q and DQ -> Gemm (-> Q) with int32 biases as
QLinearConv / QGemm, which add the bias codes in an int32 accumulator that wraps around: where the input scale is
at the floor with non-zero codes (ShuffleNet-V2's and S3D's classifiers at random init) the codes sit at the int32
limits and outputs jumped by 2^32 bias steps. fxq's int32 bias grid now stops short of the limits by what the
accumulator can add, so its own files do not wrap; the check still flags files where codes sit within that reach.
"""
from __future__ import annotations

import logging
import re

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import numpy_helper
from torch import nn

import fxq
from fxq.backends.onnxruntime import ort_bias_issues
from fxq.graph.quant_graph import QuantGraph

from _export_helpers import quantize_model
from _models import with_bn_statistics

ort = pytest.importorskip("onnxruntime")
pytestmark = pytest.mark.usefixtures("one_thread")

PLATFORMS = ("trt_int8", "ort_int8")


class Inception(nn.Module):
    """Stem, then an inception block: 1x1, 1x1 -> 3x3, MaxPool -> 1x1 and a bare MaxPool branch, concatenated,
    MaxPool, a second concat of a conv and a pool branch, global average pool, linear."""

    def __init__(self) -> None:
        super().__init__()

        def cbr(i: int, o: int, k: int = 1, s: int = 1) -> nn.Sequential:
            return nn.Sequential(nn.Conv2d(i, o, k, s, k // 2, bias=False), nn.BatchNorm2d(o), nn.ReLU())

        self.stem = cbr(3, 16, 3, 2)
        self.b1, self.b2 = cbr(16, 8), nn.Sequential(cbr(16, 8), cbr(8, 12, 3))
        self.b3 = nn.Sequential(nn.MaxPool2d(3, 1, 1), cbr(16, 8))
        self.b4 = nn.MaxPool2d(3, 1, 1)
        self.c1 = cbr(44, 24, 3)
        self.fc = nn.Linear(68, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = torch.cat([self.b1(x), self.b2(x), self.b3(x), self.b4(x)], 1)
        x = F.max_pool2d(x, 2)
        x = torch.cat([self.c1(x), F.max_pool2d(x, 3, 1, 1)], 1)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class Vanishing(nn.Module):
    """Conv -> ReLU whose output is ~1e-12 (its quantizer's scale sits at the 1e-8 floor), then Conv with a real
    bias -> ReLU, pooled, and a Linear with a bias reading the pooled value."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8, 4)
        with torch.no_grad():
            self.conv1.weight.mul_(1e-12)
            self.conv1.bias.zero_()
            self.conv2.bias.uniform_(0.05, 0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv2(F.relu(self.conv1(x))))
        return F.relu(self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)))


class Faint(nn.Module):
    """A Conv whose output is ~1e-6 (its quantizer's scale sits at the 1e-8 floor, its codes are not zero), pooled,
    then a Linear with a real bias: ShuffleNet-V2's classifier at random init."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.fc = nn.Conv2d(3, 16, 3, padding=1), nn.Linear(16, 8)
        with torch.no_grad():
            self.conv.weight.mul_(1e-6)
            self.conv.bias.zero_()
            self.fc.bias.uniform_(-0.5, 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(F.relu(self.conv(x)), 1), 1))


def _inception() -> nn.Module:
    torch.manual_seed(0)
    return with_bn_statistics(Inception().eval(), (4, 3, 32, 32), mix=0.5)


def _run(path, x: torch.Tensor, level: str, disabled: tuple[str, ...] = ()) -> np.ndarray:
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.intra_op_num_threads = 1
    opts.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"],
                                disabled_optimizers=list(disabled))
    return sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]


def _run_model(model: onnx.ModelProto, x: torch.Tensor, level: str) -> np.ndarray:
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return sess.run(["y"], {"x": x.numpy()})[0]


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    return 1.0 if na == nb == 0 else float(a @ b / (na * nb)) if na and nb else 0.0


def _export(model: nn.Module, platform: str, tmp_path, caplog, **options) -> tuple:
    q = quantize_model(model, platform, shape=(2, 3, 32, 32))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fxq.backends"):
        path = fxq.export(q, platform, tmp_path / f"{platform}.onnx", **options)[0]
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    torch.manual_seed(5)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        sim = q(x).numpy()
    return path, x, sim, warnings


@pytest.mark.parametrize("platform", PLATFORMS)
def test_inception_concat_of_pool_and_conv_branches_matches_in_every_session_mode(platform, tmp_path, caplog):
    path, x, sim, warnings = _export(_inception(), platform, tmp_path, caplog)
    assert not [w for w in warnings if "onnxruntime" in w], warnings
    assert ort_bias_issues(onnx.load(path)) == []
    for level in ("ORT_DISABLE_ALL", "ORT_ENABLE_BASIC", "ORT_ENABLE_ALL"):
        assert _cosine(_run(path, x, level), sim) >= 0.999, level


def test_vanishing_activations_trt_export_warns_and_names_the_nodes(tmp_path, caplog):
    torch.manual_seed(0)
    path, x, sim, warnings = _export(Vanishing().eval(), "trt_int8", tmp_path, caplog)
    found = [w for w in warnings if "WeightBiasQuantization" in w]
    assert len(found) == 1, warnings
    assert "'conv2.bias'" in found[0] and "beyond int32" in found[0] and "1e-08" in found[0], found[0]
    assert "calibrate with representative data" in found[0]
    issues = ort_bias_issues(onnx.load(path))
    assert any("conv2.bias" in i for i in issues) and not any("conv1.bias" in i for i in issues), issues
    # the file is what fxq simulates: as written, and in a default session without that one pass
    assert _cosine(_run(path, x, "ORT_DISABLE_ALL"), sim) >= 0.999
    for level in ("ORT_ENABLE_BASIC", "ORT_ENABLE_ALL"):
        assert _cosine(_run(path, x, level, ("WeightBiasQuantization",)), sim) >= 0.999, level


def test_vanishing_activations_ort_export_carries_int32_biases_and_matches(tmp_path, caplog):
    torch.manual_seed(0)
    path, x, sim, warnings = _export(Vanishing().eval(), "ort_int8", tmp_path, caplog)
    assert not [w for w in warnings if "WeightBiasQuantization" in w], warnings
    for level in ("ORT_DISABLE_ALL", "ORT_ENABLE_BASIC", "ORT_ENABLE_ALL"):
        assert _cosine(_run(path, x, level), sim) >= 0.999, level


def test_bias_rounding_check_on_a_hand_written_graph():
    """DQ -> Conv(FP32 bias) -> Relu -> Q: flagged only where the int32 codes overflow."""
    from onnx import TensorProto, helper, numpy_helper

    def model(s_in: float, branch: bool) -> onnx.ModelProto:
        inits = [numpy_helper.from_array(np.array(v, np.float32), n) for n, v in
                 (("s_in", s_in), ("s_w", [1e-2, 1e-2]), ("s_out", 1e-2), ("b", [0.5, -0.5]),
                  ("w", np.ones((2, 1, 1, 1))))]
        inits += [numpy_helper.from_array(np.array(0, np.int8), "z"), numpy_helper.from_array(np.zeros(2, np.int8), "zc")]
        nodes = [helper.make_node("QuantizeLinear", ["x", "s_in", "z"], ["xq"]),
                 helper.make_node("DequantizeLinear", ["xq", "s_in", "z"], ["xd"]),
                 helper.make_node("QuantizeLinear", ["w", "s_w", "zc"], ["wq"], axis=0),
                 helper.make_node("DequantizeLinear", ["wq", "s_w", "zc"], ["wd"], axis=0),
                 helper.make_node("Conv", ["xd", "wd", "b"], ["c"], name="conv"),
                 helper.make_node("Relu", ["c"], ["r"]),
                 helper.make_node("QuantizeLinear", ["r", "s_out", "z"], ["rq"]),
                 helper.make_node("DequantizeLinear", ["rq", "s_out", "z"], ["y"])]
        outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
        if branch:  # a second node reading the Conv output: onnxruntime leaves the bias alone
            nodes.append(helper.make_node("Sigmoid", ["c"], ["sig"]))
            outputs.append(helper.make_tensor_value_info("sig", TensorProto.FLOAT, None))
        inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 2, 2])]
        m = helper.make_model(helper.make_graph(nodes, "g", inputs, outputs, inits),
                              opset_imports=[helper.make_opsetid("", 13)])
        m.ir_version = 10
        return m

    x = torch.zeros(1, 1, 2, 2)
    for s_in, branch, flagged in ((1e-2, False, False), (1e-8, False, True), (1e-8, True, False)):
        m = model(s_in, branch)
        issues = ort_bias_issues(m)
        assert len(issues) == int(flagged), issues
        if flagged:
            assert "Conv 'conv'" in issues[0] and "'b'" in issues[0] and "'x'" in issues[0], issues
        # the check flags exactly what onnxruntime changes (here the overflowing +0.5 bias is lost)
        as_written = _run_model(m, x, "ORT_DISABLE_ALL")
        assert as_written.ravel()[0] == pytest.approx(0.5)
        assert bool(np.any(_run_model(m, x, "ORT_ENABLE_BASIC") != as_written)) == flagged


@pytest.mark.parametrize("weights", ["dq", "qdq"])
def test_faint_input_to_an_int32_bias_leaves_the_accumulator_room(tmp_path, caplog, weights):
    """ort_int8: an input scale at the floor puts the fc's int32 bias codes at the int32 limits, where QGemm's
    accumulator wrapped (cosine 0.37 on ShuffleNet-V2). fxq's bias grid now stops short of the limits by the largest
    sum(input codes x weight codes), so every session mode computes the simulation and nothing is flagged. With
    ``weights="qdq"`` the weight codes are read through the file's QuantizeLinear of the FP32 weights."""
    torch.manual_seed(0)
    model = Faint().eval()
    path, x, sim, warnings = _export(model, "ort_int8", tmp_path, caplog, weights=weights)
    onnx_model = onnx.load(path)
    weight_q = [n for n in onnx_model.graph.node if n.op_type == "QuantizeLinear" and n.input[0].startswith("fc.weight")]
    assert bool(weight_q) == (weights == "qdq")
    assert not [w for w in warnings if "QDQSelectorActionTransformer" in w], warnings
    assert ort_bias_issues(onnx_model) == []
    dq = next(n for n in onnx_model.graph.node if n.op_type == "DequantizeLinear" and n.input[0].startswith("fc.bias"))
    codes = next(numpy_helper.to_array(t) for t in onnx_model.graph.initializer if t.name == dq.input[0])
    assert 2**30 < np.abs(codes.astype(np.int64)).max() < 2**31 - 1  # saturated, short of the limits by the reach
    for level in ("ORT_ENABLE_ALL", "ORT_ENABLE_BASIC", "ORT_DISABLE_ALL"):
        assert _cosine(_run(path, x, level), sim) >= 0.999, level


def test_bias_room_leaves_ordinary_biases_alone():
    """The room is taken from the limits, far from the codes of a model with ordinary activations."""
    q = quantize_model(_inception(), "ort_int8", shape=(2, 3, 32, 32))
    with torch.no_grad():
        for name, fq in QuantGraph(q).quantizers():
            if fq.role == "bias" and fq.config.is_quantizing:
                assert -(2**31) < fq.config.quant_min < -(2**30) and 2**30 < fq.config.quant_max < 2**31 - 1, name
                value = q.get_parameter(fq.param)
                torch.testing.assert_close(fxq.fake_quantize(value, fq.config.replace(quant_min=-(2**31),
                                                                                       quant_max=2**31 - 1)),
                                           fxq.fake_quantize(value, fq.config), rtol=0, atol=0)


def test_faint_input_trt_export_warns_once_per_node(tmp_path, caplog):
    """trt_int8 (FP32 biases): WeightBiasQuantization's codes overflow; the node is named once."""
    torch.manual_seed(0)
    path, x, sim, warnings = _export(Faint().eval(), "trt_int8", tmp_path, caplog)
    found = [w for w in warnings if "onnxruntime" in w]
    assert len(found) == 1 and "WeightBiasQuantization" in found[0] and "'fc.bias'" in found[0], warnings
    assert len(ort_bias_issues(onnx.load(path))) == 1
    assert _cosine(_run(path, x, "ORT_DISABLE_ALL"), sim) >= 0.999


def _biased_graph(op: str, code: int, quantized_output: bool, fp32_bias: bool) -> onnx.ModelProto:
    """x -> Q/DQ (uint8) -> op(DQ int8 weights of 60, bias [code, -code - 1] x 1e-4: DQ of int32 codes, or FP32
    that WeightBiasQuantization turns into those codes) [-> Q/DQ] -> y. (Weights of 60 keep every pair of products
    of the top input code 255 within int16: x86 CPUs without VNNI saturate larger pairs, a separate effect,
    :func:`fxq.backends.qdq.ort_bias.u8s8_saturation_issues`.)"""
    from onnx import TensorProto, helper, numpy_helper

    wshape = {"Conv": (2, 3, 1, 1), "ConvTranspose": (3, 2, 1, 1), "Gemm": (2, 3)}[op]
    axis = 1 if op == "ConvTranspose" else 0
    inits = [numpy_helper.from_array(np.asarray(v, dt), n) for n, v, dt in (
        ("s_in", 1e-2, np.float32), ("z", 0, np.uint8), ("s_w", [1e-2, 1e-2], np.float32), ("zw", [0, 0], np.int8),
        ("s_b", [1e-4, 1e-4], np.float32), ("zb", [0, 0], np.int32), ("b", [code, -code - 1], np.int32),
        ("s_out", 0.1, np.float32), ("wq", np.full(wshape, 60), np.int8))]
    nodes = [helper.make_node("QuantizeLinear", ["x", "s_in", "z"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "s_in", "z"], ["xd"]),
             helper.make_node("DequantizeLinear", ["wq", "s_w", "zw"], ["wd"], axis=axis),
             helper.make_node(op, ["xd", "wd", "b" if fp32_bias else "bd"], ["c"], name="op",
                              **({"transB": 1} if op == "Gemm" else {}))]
    if fp32_bias:
        inits[6] = numpy_helper.from_array(np.asarray([code, -code - 1], np.float64).astype(np.float32) * 1e-4, "b")
    else:
        nodes.append(helper.make_node("DequantizeLinear", ["b", "s_b", "zb"], ["bd"], axis=0))
    if quantized_output:
        nodes += [helper.make_node("QuantizeLinear", ["c", "s_out", "z"], ["cq"]),
                  helper.make_node("DequantizeLinear", ["cq", "s_out", "z"], ["y"])]
    else:
        nodes.append(helper.make_node("Identity", ["c"], ["y"]))
    shape = [1, 3] if op == "Gemm" else [1, 3, 1, 1]
    m = helper.make_model(helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                                            [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits),
                          opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 10
    return m


@pytest.mark.parametrize("fp32_bias", [False, True])
@pytest.mark.parametrize("op,quantized_output,fused", [("Conv", True, True), ("Gemm", True, True),
                                                       ("Gemm", False, True), ("Conv", False, False),
                                                       ("ConvTranspose", True, False)])
def test_int32_bias_wrap_check_on_hand_written_graphs(op, quantized_output, fused, fp32_bias):
    """Flagged exactly where onnxruntime's fused kernel wraps: bias codes within 3 x 255 x 60 of the int32
    limits, inputs at the top of their range (a Conv without Q after it, and ConvTranspose, are not fused; an FP32
    bias becomes int32 codes only where the output is quantized)."""
    x = torch.full((1, 3) if op == "Gemm" else (1, 3, 1, 1), 2.55)
    fused = fused and (quantized_output or not fp32_bias)
    for code, near in ((2**31 - 1000, True), (2**31 - 1000 - 3 * 255 * 60, False), (10_000, False)):
        m = _biased_graph(op, code, quantized_output, fp32_bias)
        issues = ort_bias_issues(m)
        assert len(issues) == int(near and fused), (code, issues)
        if issues:
            assert f"{op} 'op'" in issues[0] and "'b'" in issues[0] and "2 of its 2" in issues[0], issues
            assert ("WeightBiasQuantization" in issues[0]) == fp32_bias, issues
        as_written = _run_model(m, x, "ORT_DISABLE_ALL")
        fused_out = _run_model(m, x, "ORT_ENABLE_ALL")  # an FP32 output may differ in its last bit
        assert (not np.allclose(fused_out, as_written, rtol=1e-5, atol=0)) == bool(issues), (code, fused_out)


class SqueezeInBranch(nn.Module):
    """``squeeze(0)`` of a quantized value: with a dynamic batch torch.onnx writes an If whose branches read it."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.conv2 = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2(torch.relu(self.conv(x))).squeeze(0)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_quantized_value_read_inside_an_if_branch(platform, tmp_path):
    """Q/DQ replaces a mark whose value an If body reads from the outer scope: the body follows the new name
    (before, the file was invalid: 'Nodes in a graph must be topologically sorted')."""
    torch.manual_seed(0)
    q = quantize_model(SqueezeInBranch(), platform, shape=(1, 3, 8, 8))
    path = fxq.export(q, platform, tmp_path / "m.onnx", dynamic_batch=True)[0]
    m = onnx.load(path)
    onnx.checker.check_model(m, full_check=True)
    assert any(n.op_type == "If" for n in m.graph.node)
    x = torch.randn(1, 3, 8, 8)
    with torch.no_grad():
        sim = q(x).numpy()
    for level in ("ORT_DISABLE_ALL", "ORT_ENABLE_ALL"):
        assert _cosine(_run(path, x, level), sim) >= 0.999, level


class FaintUp(nn.Module):
    """A faint conv (input scale of the next op at the floor), then a ConvTranspose with a real bias."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.up = nn.Conv2d(3, 64, 3, padding=1), nn.ConvTranspose2d(64, 2, 1)
        with torch.no_grad():
            self.conv.weight.abs_().mul_(1e-6)
            self.conv.bias.fill_(1e-6)
            self.up.weight.uniform_(0.5, 1.0)
            self.up.bias.fill_(0.4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(F.relu(self.conv(x)))


@pytest.mark.parametrize("per_channel", [False, True])
def test_bias_room_of_a_conv_transpose_sums_over_its_output_channels(per_channel):
    """A ConvTranspose weight is (C_in, C_out, k, k): output o accumulates column o. The room covers that sum with
    per-tensor weights too (it summed the rows, 25x too little)."""
    torch.manual_seed(0)
    q = quantize_model(FaintUp(), "ort_int8", shape=(2, 3, 16, 16), per_channel=per_channel)
    qg = QuantGraph(q)
    bias = next(fq for name, fq in qg.quantizers() if fq.role == "bias" and fq.param == "up.bias")
    weight = next(fq for name, fq in qg.quantizers() if fq.role == "weight" and fq.param == "up.weight")
    w = (weight.fp32_backup if weight.baked else q.get_parameter("up.weight")).detach().double()
    s = weight.scale.detach().double().reshape(1, -1, 1, 1) if per_channel else weight.scale.detach().double()
    codes = torch.clamp(torch.round(w / s), weight.config.quant_min, weight.config.quant_max)
    reach = float(codes.abs().sum(dim=(0, 2, 3)).max()) * 255  # uint8 input codes from a zero-point of 0
    assert 2**31 - 1 - bias.config.quant_max >= reach > 2**20


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.q, self.k, self.v, self.o = (nn.Linear(16, 16) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = torch.softmax(self.q(x) @ self.k(x).transpose(1, 2) / 4, dim=-1)
        return self.o(scores @ self.v(x))


@pytest.mark.parametrize("platform", ["ort_int8", "trt_int8"])
def test_softmax_fused_by_the_default_session_is_named(platform, tmp_path, caplog):
    """A default session runs DQ -> Softmax -> Q as QLinearSoftmax (a fixed-point exp table): the export names the
    softmax and the optimizer; disabling that optimizer runs the file as fxq simulates it (it warned about nothing)."""
    torch.manual_seed(1)
    calib = [torch.randn(2, 8, 16) for _ in range(2)]
    q = fxq.quantize(_Attention().eval(), calib, platform, progress=False)
    with caplog.at_level(logging.WARNING, logger="fxq.backends"):
        path = fxq.export(q, platform, tmp_path / "attention.onnx")[0]
    assert re.search(r"runs 1 softmax\(es\) \(softmax\) as QLinearSoftmax.*QDQSelectorActionTransformer",
                     caplog.text), caplog.text
    with torch.no_grad():
        sim = q(calib[1]).numpy()
    for level, disabled in (("ORT_DISABLE_ALL", ()), ("ORT_ENABLE_ALL", ("QDQSelectorActionTransformer",))):
        np.testing.assert_allclose(_run(path, calib[1], level, disabled), sim, rtol=0, atol=1e-6)
    if platform == "ort_int8":  # quantizes inputs of computing ops only: a softmax returned as is has no Q after it
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="fxq.backends"):
            fxq.export(fxq.quantize(nn.Sequential(nn.Linear(16, 16), nn.Softmax(-1)).eval(), calib, platform,
                                    progress=False), platform, tmp_path / "last.onnx")
        assert "QLinearSoftmax" not in caplog.text


def test_integer_reciprocal_scale():
    """The new scale's float32 reciprocal floors to k = floor(1 / s), or to k + 1 where s is one rounding below
    an integer reciprocal (float32(1 / 255) inverts to 254.99998: it stays 1 / 255); 1 / 7 needs one ulp less; the
    scale grows by under one part in k (the range stays covered)."""
    rng = np.random.default_rng(0)
    scales = torch.tensor(np.concatenate([rng.uniform(1e-4, 0.5, 2000), [1 / 7, 1 / 256, 1 / 255, 0.3 / 255]]),
                          dtype=torch.float32)
    snapped = fxq.functional.integer_reciprocal_scale(scales)
    k = torch.maximum(torch.floor(1.0 / scales), torch.floor(1.0 / torch.nextafter(scales, torch.zeros_like(scales))))
    assert torch.equal(torch.floor(1.0 / snapped), k)  # float32 throughout, as onnxruntime computes it
    assert [float(v) for v in torch.floor(1.0 / snapped[-4:-1])] == [7.0, 256.0, 255.0]
    assert bool((snapped >= scales * (1 - 1e-6)).all()) and bool((snapped <= scales * (1 + 1 / k) + 1e-12).all())
    assert float(fxq.functional.integer_reciprocal_scale(torch.tensor([1 / 256]))) == 1 / 256  # kept


@pytest.mark.parametrize("platform", ["ort_int8", "trt_int8"])
def test_fused_softmax_output_scale_is_an_integer_reciprocal(platform, tmp_path):
    """QLinearSoftmax multiplies by floor(1 / y_scale). ort_int8 calibrates the softmax output quantizer onto such a
    scale, so the default session and the graph as written share one grid: before, one output in 6 of this
    attention differed in a default session; now only exp-table rounding ties do (under 1 %). trt_int8 (deployed on
    TensorRT, which has no such kernel) keeps its calibrated scale. ORT_DISABLE_ALL stays exact for both."""
    torch.manual_seed(1)
    calib = [torch.randn(4, 16, 16) for _ in range(4)]
    q = fxq.quantize(_Attention().eval(), calib, platform, progress=False)
    name = next(n for n, _ in QuantGraph(q).quantizers("activation") if "softmax" in QuantGraph(q).source(n))
    scale = QuantGraph(q)[name].scale
    integer = torch.equal(torch.floor(1.0 / scale), 1.0 / scale.double()) or bool(
        (torch.floor(1.0 / scale) - 1.0 / scale.double()).abs().max() < 1e-4)
    assert integer == (platform == "ort_int8"), float(1 / scale)
    path = fxq.export(q, platform, tmp_path / "attention.onnx")[0]
    xs = [torch.randn(4, 16, 16) for _ in range(8)]
    with torch.no_grad():
        sim = np.concatenate([q(x).numpy() for x in xs])
    exact = np.concatenate([_run(path, x, "ORT_DISABLE_ALL", ()) for x in xs])
    np.testing.assert_allclose(exact, sim, rtol=0, atol=1e-6)
    fused = np.concatenate([_run(path, x, "ORT_ENABLE_ALL", ()) for x in xs])
    differ = float((np.abs(fused - sim) > 1e-5).mean())
    if platform == "ort_int8":
        assert differ < 0.01, differ


def test_realignment_snaps_the_softmax_scale_again():
    """apply_alignment (run again after LSQ / BRECQ learn scales) gives a moved softmax output scale an integer
    reciprocal again on ort_int8."""
    from fxq.graph.convert import apply_alignment

    torch.manual_seed(1)
    q = fxq.quantize(_Attention().eval(), [torch.randn(4, 16, 16) for _ in range(2)], "ort_int8", progress=False)
    qg = QuantGraph(q)
    fq = next(fq for n, fq in qg.quantizers("activation") if "softmax" in qg.source(n))
    fq.set_qparams(fq.scale.detach() * 1.003, fq.offset.detach().clone(), state=fq.config.state)
    assert float(torch.floor(1.0 / fq.scale)) != float(1.0 / fq.scale.double())
    apply_alignment(q)
    assert abs(float(torch.floor(1.0 / fq.scale)) - float(1.0 / fq.scale.double())) < 1e-4


def _matmul_graph(weights: np.ndarray, act_type: type = np.uint8) -> onnx.ModelProto:
    """x -> Q/DQ (``act_type``) -> MatMul(DQ int8 ``weights`` [K, N], scale 1) -> Q/DQ (int8, scale 16384) -> y."""
    from onnx import TensorProto, helper

    inits = [numpy_helper.from_array(np.asarray(v, dt), n) for n, v, dt in (
        ("s", 1.0, np.float32), ("z", 0, act_type), ("wq", weights, np.int8), ("ws", 1.0, np.float32),
        ("wz", 0, np.int8), ("ys", 16384.0, np.float32), ("yz", 0, np.int8))]
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"]),
             helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["wd"]),
             helper.make_node("MatMul", ["xd", "wd"], ["m"], name="mm"),
             helper.make_node("QuantizeLinear", ["m", "ys", "yz"], ["yq"]),
             helper.make_node("DequantizeLinear", ["yq", "ys", "yz"], ["y"])]
    m = helper.make_model(helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, weights.shape[0]])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits), opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 10
    return m


@pytest.mark.real_ort_kernels
@pytest.mark.parametrize("act_type", [np.uint8, np.int8], ids=["uint8", "int8"])
def test_u8s8_pair_saturation_found_where_onnxruntime_saturates(act_type):
    """Neighbouring int8 weight codes (along K, pairs 2i / 2i + 1) of one sign that sum past 128 are named by
    ``u8s8_saturation_issues``; pairs that do not (a 0 beside each 127, 7-bit codes, opposite signs) are not. On a
    CPU that saturates (x86 without VNNI: ``cpu_saturates_u8s8``) a default session computes exactly the named
    graph otherwise; on any CPU it computes the others as written."""
    from fxq.backends.qdq.ort_bias import cpu_saturates_u8s8, u8s8_saturation_issues

    k = 64
    pattern = np.array([0, 127, 127, 0] * (k // 4))
    cases = {"all 127": (np.full((k, 4), 127), True),
             "127 beside 0": (np.stack([pattern] * 4, 1), False),
             "127 beside 0, shifted": (np.stack([np.roll(pattern, 1)] * 4, 1), True),
             "7-bit": (np.full((k, 4), 63), False),
             "opposite signs": (np.stack([np.array([127, -127] * (k // 2))] * 4, 1), False)}
    x = torch.full((1, k), 255.0 if act_type is np.uint8 else 100.0)  # both near the top of their kernel's u8 range
    saturates = cpu_saturates_u8s8()
    for name, (w, named) in cases.items():
        m = _matmul_graph(w.astype(np.int8), act_type)
        issues = u8s8_saturation_issues(m)
        assert bool(issues) == named, (name, issues)
        if named:
            assert "MatMul 'mm'" in issues[0], issues
        as_written = _run_model(m, x, "ORT_DISABLE_ALL")
        default = _run_model(m, x, "ORT_ENABLE_ALL")
        if not named or saturates is False:
            np.testing.assert_array_equal(default, as_written, err_msg=name)
        elif saturates:
            assert not np.array_equal(default, as_written), name


def test_cpu_saturation_read_from_cpu_flags():
    from fxq.backends.qdq.ort_bias import cpu_saturates_u8s8

    assert cpu_saturates_u8s8("processor : 0\nflags : fpu sse2 avx avx2 fma\n") is True
    assert cpu_saturates_u8s8("flags : fpu avx2 avx512f avx512_vnni\n") is False
    assert cpu_saturates_u8s8("flags : fpu avx2 avx_vnni\n") is False
    assert cpu_saturates_u8s8("flags : fpu sse2\n") is False  # no AVX2: other kernels
    assert cpu_saturates_u8s8("model name : something\n") is None


def test_saturation_warned_on_such_cpus_and_reduce_range_avoids_it(tmp_path, caplog, monkeypatch):
    """Exported on a CPU that saturates, a Linear whose weights hold large neighbours is named in one WARNING with
    the fix; quantized for ``ort_int8_reduce_range`` (what the warning says) its file has no such pair, and a
    default onnxruntime session computes it as fxq simulates, on this machine whatever its CPU."""
    from fxq.backends.qdq import ort_bias

    monkeypatch.setattr(ort_bias, "cpu_saturates_u8s8", lambda cpuinfo=None: True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8)).eval()
    with torch.no_grad():
        model[0].weight.copy_(torch.rand(32, 64) * 0.5 + 0.5)  # one sign, large neighbours

    def export(platform: str) -> tuple:
        q = quantize_model(model, platform, shape=(2, 64))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="fxq.backends"):
            path = fxq.export(q, platform, tmp_path / f"{platform}.onnx")[0]
        x = torch.rand(2, 64) * 4
        with torch.no_grad():
            sim = q(x).numpy()
        return path, x, sim, [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]

    path, _, _, warnings = export("ort_int8")
    found = [w for w in warnings if "without VNNI" in w]
    assert len(found) == 1 and "ort_int8_reduce_range" in found[0] and "Gemm" in found[0], warnings
    path, x, sim, warnings = export("ort_int8_reduce_range")
    assert not [w for w in warnings if "without VNNI" in w], warnings
    assert not ort_bias.u8s8_saturation_issues(onnx.load(path))
    assert _cosine(_run(path, x, "ORT_ENABLE_ALL"), sim) >= 0.9999


def test_fp32_weights_count_with_the_codes_a_default_session_gives_them():
    """An FP32 Gemm weight between a DequantizeLinear and a QuantizeLinear (OpenPPL's files, emulated with Q/DQ
    activations) becomes per-tensor int8 codes in a default session (``WeightBiasQuantization``): named where those
    codes hold saturating neighbours."""
    from onnx import TensorProto, helper

    from fxq.backends.qdq.ort_bias import u8s8_saturation_issues

    def graph(weight: np.ndarray) -> onnx.ModelProto:
        inits = [numpy_helper.from_array(np.asarray(v, dt), n) for n, v, dt in (
            ("s", 0.1, np.float32), ("z", 0, np.uint8), ("w", weight, np.float32), ("ys", 1.0, np.float32))]
        nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"]),
                 helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"]),
                 helper.make_node("Gemm", ["xd", "w"], ["m"], name="fc", transB=1),
                 helper.make_node("QuantizeLinear", ["m", "ys", "z"], ["yq"]),
                 helper.make_node("DequantizeLinear", ["yq", "ys", "z"], ["y"])]
        return helper.make_model(helper.make_graph(
            nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits))

    assert "Gemm 'fc'" in u8s8_saturation_issues(graph(np.ones((4, 8))))[0]
    assert u8s8_saturation_issues(graph(np.tile([1.0, 0.0], (4, 4)))) == []


def test_saturation_reads_raw_int8_codes_only():
    """The kernel multiplies the raw int8 codes: a -128 code counts (full-range int8 weights), and uint8 weight
    codes, which take the u8u8 kernels, do not."""
    from fxq.backends.qdq.ort_bias import u8s8_saturation_issues

    w = np.full((64, 4), -127, np.int8)
    w[5, 2] = -128
    assert "MatMul 'mm'" in u8s8_saturation_issues(_matmul_graph(w))[0]
    m = _matmul_graph(np.zeros((64, 4), np.int8))
    for t in m.graph.initializer:
        if t.name == "wq":
            t.CopyFrom(numpy_helper.from_array(np.full((64, 4), 200, np.uint8), "wq"))
        elif t.name == "wz":
            t.CopyFrom(numpy_helper.from_array(np.asarray(128, np.uint8), "wz"))
    assert u8s8_saturation_issues(m) == []
