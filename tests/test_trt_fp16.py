"""TensorRT export with high_precision_dtype="fp16": FP16 float parts, FP32 boundary, and the FP16 simulation."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper

import fxq
from fxq.backends.qdq.fp16 import cast_float_parts, fp16_simulation
from fxq.backends.tensorrt.check import check_tensorrt

from _export_helpers import ort_session


class _Net(torch.nn.Module):
    """conv2 (FP32-dispatched) on the input, a quantized conv, nearest resize, LayerNorm, Linear, softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.conv2 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.conv1 = torch.nn.Conv2d(8, 8, 3, padding=1)
        self.norm = torch.nn.LayerNorm(8)
        self.fc = torch.nn.Linear(8, 10)

    def forward(self, x):
        x = F.relu(self.conv1(F.relu(self.conv2(x))))
        x = F.interpolate(x, scale_factor=2.0, mode="nearest")
        x = self.norm(x.mean((2, 3)))
        return F.softmax(self.fc(x), -1)


@pytest.fixture(scope="module")
def qmodel():
    s = fxq.QuantizationSetting()
    s.quantize_activation_setting.calib_algorithm = "minmax"
    s.dispatching_table = {"conv2": "fp32"}
    torch.manual_seed(0)
    data = [torch.randn(2, 3, 16, 16) for _ in range(2)]
    return fxq.quantize(_Net().eval(), data, "trt_int8", setting=s, progress=False)


@pytest.fixture(scope="module")
def exports(qmodel, tmp_path_factory):
    out = tmp_path_factory.mktemp("trt_fp16")
    p32 = fxq.export(qmodel, "trt_int8", out / "m32.onnx")[0]
    p16 = fxq.export(qmodel, "trt_int8", out / "m16.onnx", high_precision_dtype="fp16")[0]
    return p32, p16


def _run(path, x, optimize):
    sess = ort_session(path, optimize)
    return sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]


def _cos(a, b) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_fp16_model_is_typed_and_valid(exports):
    model = onnx.load(exports[1])
    onnx.checker.check_model(model, full_check=True)
    assert check_tensorrt(model) == []
    assert model.opset_import[0].version == 19
    # no float32 initializers at all here (a Resize's scales would be the one exception; here they are a Constant)
    inits = {t.name: t for t in model.graph.initializer}
    assert not [n for n, t in inits.items() if t.data_type == TensorProto.FLOAT]
    assert inits["conv2.weight"].data_type == TensorProto.FLOAT16  # the FP32-dispatched conv
    assert inits["conv2.bias"].data_type == TensorProto.FLOAT16
    qdq = [n for n in model.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")]
    assert qdq and all(inits[n.input[1]].data_type == TensorProto.FLOAT16 for n in qdq)
    assert all(inits[n.input[2]].data_type == TensorProto.INT8 for n in qdq)
    # FP32 boundary with Casts
    assert [i.type.tensor_type.elem_type for i in model.graph.input] == [TensorProto.FLOAT]
    assert [o.type.tensor_type.elem_type for o in model.graph.output] == [TensorProto.FLOAT]
    first, last = model.graph.node[0], model.graph.node[-1]
    assert first.op_type == "Cast" and first.attribute[0].i == TensorProto.FLOAT16
    assert last.op_type == "Cast" and last.attribute[0].i == TensorProto.FLOAT
    resize = next(n for n in model.graph.node if n.op_type == "Resize")
    scales_node = next(n for n in model.graph.node if resize.input[2] in n.output)
    assert scales_node.op_type == "Constant" and scales_node.attribute[0].t.data_type == TensorProto.FLOAT
    # every tensor between the boundary Casts is float16 or integer
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    types = {v.name: v.type.tensor_type.elem_type for v in inferred.graph.value_info}
    floats32 = [n for n, t in types.items() if t == TensorProto.FLOAT]
    assert floats32 == [resize.input[2]]


def test_fp16_weights_keep_their_int8_codes(exports):
    m32, m16 = onnx.load(exports[0]), onnx.load(exports[1])

    def codes(model):
        inits = {t.name: numpy_helper.to_array(t).astype(np.float32) for t in model.graph.initializer}
        out = {}
        for q in (n for n in model.graph.node if n.op_type == "QuantizeLinear" and n.input[0] in inits):
            w, s = inits[q.input[0]], inits[q.input[1]]
            out[q.input[0]] = np.rint(w / s.reshape([-1] + [1] * (w.ndim - 1)))
        return out

    c32, c16 = codes(m32), codes(m16)
    assert set(c32) == set(c16) == {"conv1.weight", "fc.weight"}
    for name in c32:
        np.testing.assert_array_equal(c32[name], c16[name])


@pytest.mark.parametrize("optimize", [False, True], ids=["ORT_DISABLE_ALL", "default"])
def test_fp16_onnxruntime_matches_fp16_simulation(qmodel, exports, optimize):
    torch.manual_seed(1)
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        ref = qmodel(x)
        with fp16_simulation(qmodel) as sim_model:
            sim = sim_model(x).numpy()
        assert torch.equal(qmodel(x), ref)  # restored on exit
    y16 = _run(exports[1], x, optimize)
    y32 = _run(exports[0], x, optimize)
    assert y16.dtype == np.float32 and y16.shape == y32.shape
    assert _cos(y16, sim) >= 0.999
    assert _cos(y16, y32) >= 0.999
    lsb = float(qmodel.get_submodule(next(n for n, m in qmodel.named_modules()
                                          if isinstance(m, fxq.nn.FakeQuantize) and "softmax" in n)).scale)
    # FP16 storage moves values by ~1e-3 relative, which can flip a rounding of the int8 activations on the way
    # (a flip upstream moves the softmax output by up to two of its codes)
    assert np.abs(y16 - y32).max() <= 2 * lsb * 1.01
    assert np.abs(y16 - sim).max() <= 2 * lsb * 1.01


def test_fp16_int8_weight_initializers(qmodel, tmp_path):
    path = fxq.export(qmodel, "trt_int8", tmp_path / "m.onnx", high_precision_dtype="fp16", weights="dq")[0]
    model = onnx.load(path)
    onnx.checker.check_model(model, full_check=True)
    assert check_tensorrt(model) == []
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad(), fp16_simulation(qmodel) as sim_model:
        sim = sim_model(x).numpy()
    assert _cos(_run(path, x, False), sim) >= 0.999


@pytest.mark.parametrize("options, message", [
    ({"high_precision_dtype": "bf16"}, r"high_precision_dtype='bf16'; allowed values are 'fp32', 'fp16'"),
    ({"high_precision_dtype": "fp16", "opset": 13}, r"needs opset >= 19"),
    ({"high_precision_dtype": "fp16", "legacy": True}, r"legacy=True"),
])
def test_fp16_option_errors(qmodel, tmp_path, options, message):
    with pytest.raises(fxq.ExportError, match=message):
        fxq.export(qmodel, "trt_int8", tmp_path / "m.onnx", **options)
    assert not list(tmp_path.iterdir())


def _tiny_qdq(scale: float) -> onnx.ModelProto:
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
                              [numpy_helper.from_array(np.float32(scale), "s"),
                               numpy_helper.from_array(np.int8(0), "z")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])


def test_fp16_scale_out_of_range_is_an_export_error():
    model = cast_float_parts(_tiny_qdq(0.5))
    onnx.checker.check_model(model, full_check=True)
    with pytest.raises(fxq.ExportError, match="float16 cannot hold"):
        cast_float_parts(_tiny_qdq(1e-9))
    old = _tiny_qdq(0.5)
    old.opset_import[0].version = 13
    with pytest.raises(fxq.ExportError, match="opset >= 19"):
        cast_float_parts(old)
