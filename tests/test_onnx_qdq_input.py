"""Quantized ONNX files as input: a QDQ file (onnxruntime's ``quantize_static``, fxq's own TensorRT export) loads
as the float model it quantizes, which fxq quantizes again for any platform; QOperator / dynamic files are refused
with advice that names the format."""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

import fxq

ort = pytest.importorskip("onnxruntime")
quantization = pytest.importorskip("onnxruntime.quantization")


class SmallNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                      nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.ReLU())
        self.fc = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x).mean((2, 3)))


def _data(n: int = 4) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, 3, 16, 16, generator=g) for _ in range(n)]


@pytest.fixture(scope="module")
def float_file(tmp_path_factory) -> tuple[nn.Module, Path]:
    torch.manual_seed(0)
    model = SmallNet().eval()
    with torch.no_grad():  # BatchNorm statistics that are not the identity
        model.features[1].running_mean.uniform_(-0.5, 0.5)
        model.features[1].running_var.uniform_(0.5, 2.0)
    path = tmp_path_factory.mktemp("qdq") / "float.onnx"
    torch.onnx.export(model, (_data(1)[0],), str(path), dynamo=False, opset_version=13, input_names=["x"],
                      output_names=["y"])
    return model, path


class _Reader(quantization.CalibrationDataReader):
    def __init__(self) -> None:
        self.items = iter([{"x": x.numpy()} for x in _data()])

    def get_next(self):  # noqa: ANN201  (onnxruntime's interface)
        return next(self.items, None)


def _ort_quantized(src: Path, dst: Path, fmt: object, per_channel: bool) -> Path:
    quantization.quantize_static(str(src), str(dst), _Reader(), quant_format=fmt, per_channel=per_channel,
                                 activation_type=quantization.QuantType.QInt8,
                                 weight_type=quantization.QuantType.QInt8)
    return dst


def _run(path: Path, x: torch.Tensor) -> np.ndarray:
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]


def _pairs_bypassed(proto: onnx.ModelProto, path: Path) -> Path:
    """The reference: the file itself, every QuantizeLinear -> DequantizeLinear pair bypassed by hand (a pair that
    is a graph output becomes an Identity), its weight DequantizeLinear nodes left to onnxruntime."""
    graph = proto.graph
    pairs = {n.output[0]: n.input[0] for n in graph.node if n.op_type == "QuantizeLinear"}
    bypass = {dq.output[0]: pairs[dq.input[0]] for dq in graph.node
              if dq.op_type == "DequantizeLinear" and dq.input[0] in pairs}
    outputs = {o.name for o in graph.output}
    for node in graph.node:
        if node.op_type == "DequantizeLinear" and node.output[0] in outputs & set(bypass):
            node.CopyFrom(helper.make_node("Identity", [bypass[node.output[0]]], [node.output[0]]))
        else:
            node.input[:] = [bypass.get(i, i) if i not in outputs else i for i in node.input]
    onnx.save(proto, str(path))
    return path


@pytest.mark.parametrize("per_channel", [False, True], ids=["per-tensor", "per-channel"])
def test_onnxruntime_qdq_file_loads_as_its_float_model(float_file, per_channel, tmp_path, caplog):
    """onnxruntime's QDQ file: weights (per tensor or per output channel) and int32 biases as DequantizeLinear of
    stored integers, activations as Q -> DQ pairs. Loaded, it computes the float graph over the deployed weights:
    exactly what the same file computes with its activation pairs taken out."""
    model, path = float_file
    qdq = _ort_quantized(path, tmp_path / "qdq.onnx", quantization.QuantFormat.QDQ, per_channel)
    proto = onnx.load(str(qdq))
    assert sum(n.op_type == "QuantizeLinear" for n in proto.graph.node) >= 3
    with caplog.at_level(logging.WARNING, logger="fxq.frontends.onnx.dequantize"):
        gm = fxq.load_onnx(qdq)  # its conversion check runs the float model in onnxruntime
    assert "is quantized (QDQ format): loaded as its float model" in caplog.text
    op_types = {n.meta.get("onnx", {}).get("op_type") for n in gm.graph.nodes}
    assert "Conv" in op_types and not op_types & {"QuantizeLinear", "DequantizeLinear"}
    bypassed = _pairs_bypassed(proto, tmp_path / "bypassed.onnx")
    for x in _data(2):
        with torch.no_grad():
            got = gm(x).numpy()
        np.testing.assert_allclose(got, _run(bypassed, x), rtol=1e-5, atol=1e-5)
    q = fxq.quantize(gm, _data(), "ncnn_int8", progress=False)  # and on to another platform
    files = fxq.export(q, "ncnn_int8", tmp_path / "ncnn")
    assert any(str(f).endswith(".param") for f in files)


def test_fxq_tensorrt_export_reloads_as_the_float_model(float_file, tmp_path):
    """fxq's own TensorRT file (weights behind Q -> DQ pairs) reloads as the float model it deploys: the float
    model it was exported from, over weights on their int8 grid."""
    model, path = float_file
    q = fxq.quantize(fxq.load_onnx(path), _data(), "trt_int8", progress=False)
    files = fxq.export(q, "tensorrt", tmp_path / "trt")
    onnx_file = next(f for f in files if str(f).endswith(".onnx"))
    gm = fxq.load_onnx(onnx_file)
    bypassed = _pairs_bypassed(onnx.load(str(onnx_file)), tmp_path / "bypassed.onnx")
    for x in _data(2):
        with torch.no_grad():
            got = gm(x).numpy()
        np.testing.assert_allclose(got, _run(bypassed, x), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got, model(x).detach().numpy(), rtol=0.01, atol=1e-3)  # the weights' rounding


def test_graph_output_of_a_pair_keeps_its_name(tmp_path):
    """A pair whose DequantizeLinear is a graph output: the output keeps its name; a pair read by another op than
    DequantizeLinear stays (and is refused by name)."""
    scale = numpy_helper.from_array(np.array(0.05, dtype=np.float32), "s")
    zero = numpy_helper.from_array(np.array(0, dtype=np.int8), "z")
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("QuantizeLinear", ["r", "s", "z"], ["rq"], name="q"),
             helper.make_node("DequantizeLinear", ["rq", "s", "z"], ["y"], name="dq")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
                              initializer=[scale, zero])
    gm = fxq.load_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]))
    x = torch.tensor([[-1.0, 0.013, 0.5, 3.0]])
    with torch.no_grad():
        torch.testing.assert_close(gm(x), x.relu())  # not rounded to 0.05's grid
    graph.output.append(helper.make_tensor_value_info("rq", TensorProto.INT8, [1, 4]))
    with pytest.raises(fxq.FrontendError, match=r"(?s)QuantizeLinear.*quantized in QDQ form, and these "
                                                r"DequantizeLinear / QuantizeLinear nodes are not what fxq folds.*an "
                                                r"integer graph output"):
        fxq.load_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]))


def test_qoperator_file_is_refused_with_its_format(float_file, tmp_path):
    model, path = float_file
    qop = _ort_quantized(path, tmp_path / "qop.onnx", quantization.QuantFormat.QOperator, False)
    with pytest.raises(fxq.FrontendError, match=r"(?s)QLinearConv.*already quantized \(.*QLinearConv.*\): fxq "
                                                r"quantizes float models.*Load the float model"):
        fxq.load_onnx(qop)


class FeatureAndHead(nn.Module):
    """Returns a feature map and the head computed from it: in the QDQ file, the feature map's DequantizeLinear is
    a graph output that the head's conv also reads."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 4, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        f = self.a(x)
        return f, self.b(f)


@pytest.mark.parametrize("exporter, platform, options", [
    ("tensorrt", "trt_int8", {}),
    ("onnxruntime", "ort_int8", {}),
    ("tensorrt", "trt_int8", {"high_precision_dtype": "fp16", "weights": "dq"}),  # float16 scales and weights
], ids=["trt", "ort", "trt-fp16-dq"])
def test_fxq_exports_with_an_output_that_is_also_read_reload(exporter, platform, options, tmp_path):
    torch.manual_seed(0)
    model = FeatureAndHead().eval()
    q = fxq.quantize(model, _data(), platform, progress=False)
    files = fxq.export(q, exporter, tmp_path / "m", **options)
    onnx_file = next(f for f in files if str(f).endswith(".onnx"))
    gm = fxq.load_onnx(onnx_file)
    bypassed = _pairs_bypassed(onnx.load(str(onnx_file)), tmp_path / "bypassed.onnx")
    x = _data(1)[0]
    sess = ort.InferenceSession(str(bypassed), providers=["CPUExecutionProvider"])
    feeds = {sess.get_inputs()[0].name: x.numpy()}
    with torch.no_grad():
        got = gm(x)
    for mine, want in zip(got, sess.run(None, feeds)):
        np.testing.assert_allclose(mine.float().numpy(), want.astype(np.float32), rtol=1e-3, atol=1e-3)


def _qdq_model(nodes: list, inputs: list, outputs: list, inits: list, opset: int = 13) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def test_chained_pairs_and_initializers_listed_as_inputs():
    """A requantization (Q -> DQ -> Q -> DQ) folds to its float input; a file listing its integer weight, scale
    and zero point among the graph inputs (keep_initializers_as_inputs) keeps only its real input."""
    s = numpy_helper.from_array(np.array(0.05, dtype=np.float32), "s")
    s2 = numpy_helper.from_array(np.array(0.1, dtype=np.float32), "s2")
    z = numpy_helper.from_array(np.array(0, dtype=np.int8), "z")
    wq = numpy_helper.from_array(np.array([[3, -7, 12], [1, 0, -2], [5, 5, -9], [8, -1, 4]], dtype=np.int8), "wq")
    ws = numpy_helper.from_array(np.array([0.02, 0.05, 0.01], dtype=np.float32), "ws")
    wz = numpy_helper.from_array(np.zeros(3, dtype=np.int8), "wz")
    value = helper.make_tensor_value_info
    model = _qdq_model(
        [helper.make_node("Relu", ["x"], ["r"]),
         helper.make_node("QuantizeLinear", ["r", "s", "z"], ["q1"]),
         helper.make_node("DequantizeLinear", ["q1", "s", "z"], ["d1"]),
         helper.make_node("QuantizeLinear", ["d1", "s2", "z"], ["q2"]),
         helper.make_node("DequantizeLinear", ["q2", "s2", "z"], ["d2"]),
         helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["w"], axis=1),
         helper.make_node("MatMul", ["d2", "w"], ["y"])],
        [value("x", TensorProto.FLOAT, [1, 4]), value("wq", TensorProto.INT8, [4, 3]),
         value("ws", TensorProto.FLOAT, [3]), value("wz", TensorProto.INT8, [3])],
        [value("y", TensorProto.FLOAT, [1, 3])], [s, s2, z, wq, ws, wz])
    gm = fxq.load_onnx(model)
    assert [n.name for n in gm.graph.nodes if n.op == "placeholder"] == ["x"]
    x = torch.tensor([[-1.0, 0.013, 0.5, 3.0]])
    w = torch.from_numpy(numpy_helper.to_array(wq).astype(np.float32) * numpy_helper.to_array(ws))
    with torch.no_grad():
        torch.testing.assert_close(gm(x), x.relu() @ w)  # float input, per-column (axis 1) weight


def test_float16_scale_and_scalar_weight():
    """From opset 19 a DequantizeLinear gives its scale's type (float16 here), and a scalar with a 1-element scale
    stays a scalar."""
    value = helper.make_tensor_value_info
    wq = numpy_helper.from_array(np.array([[4, -8, 16]], dtype=np.int8), "wq")
    ws = numpy_helper.from_array(np.array(0.125, dtype=np.float16), "ws")
    gq = numpy_helper.from_array(np.array(20, dtype=np.int8), "gq")
    gs = numpy_helper.from_array(np.array([0.1], dtype=np.float16), "gs")
    model = _qdq_model(
        [helper.make_node("DequantizeLinear", ["wq", "ws"], ["w"]),
         helper.make_node("DequantizeLinear", ["gq", "gs"], ["g"]),
         helper.make_node("Mul", ["x", "w"], ["xw"]),
         helper.make_node("Mul", ["xw", "g"], ["y"])],
        [value("x", TensorProto.FLOAT16, [1, 3])], [value("y", TensorProto.FLOAT16, [1, 3])], [wq, ws, gq, gs],
        opset=19)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": np.array([[1.0, 2.0, -3.0]], dtype=np.float16)})[0]
    gm = fxq.load_onnx(model)
    with torch.no_grad():
        got = gm(torch.tensor([[1.0, 2.0, -3.0]], dtype=torch.float16))
    assert got.dtype == torch.float16 and got.shape == (1, 3)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-3)
