"""TensorRT export: the rule checker on good and deliberately broken models, legacy side files, source names."""
from __future__ import annotations

import io
import json
import re
import struct
import warnings

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

import fxq
from fxq.backends.tensorrt.check import check_tensorrt
from fxq.backends.tensorrt.legacy import cache_version, parse_calibration_cache
from fxq.graph.quant_graph import QuantGraph

from _export_helpers import SmallCNN, ort_session, quantize_model, small_quantized


@pytest.fixture(scope="module")
def trt_model():
    return small_quantized("trt_int8")


@pytest.fixture(scope="module")
def trt_export(trt_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("trt")
    return fxq.export(trt_model, "trt_int8", out / "model.onnx", legacy=True)


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    return m


def _node(model, op_type, pred=lambda n: True):
    return next(n for n in model.graph.node if n.op_type == op_type and pred(n))


def test_export_follows_tensorrt_rules(trt_export):
    model = onnx.load(trt_export[0])
    assert check_tensorrt(model) == []
    assert model.ir_version == 10 and model.opset_import[0].version == 13
    qs = [n for n in model.graph.node if n.op_type == "QuantizeLinear"]
    assert qs and all(len(n.input) == 3 for n in qs)
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    assert all(inits[n.input[2]].dtype == np.int8 and not inits[n.input[2]].any() for n in qs)
    for conv in (n for n in model.graph.node if n.op_type in ("Conv", "Gemm")):
        producers = {o: n for n in model.graph.node for o in n.output}
        assert producers[conv.input[0]].op_type == "DequantizeLinear"
        assert producers[conv.input[1]].op_type == "DequantizeLinear"
        assert int(next((a.i for a in producers[conv.input[1]].attribute if a.name == "axis"), 1)) == 0
    add = _node(model, "Add")
    producers = {o: n for n in model.graph.node for o in n.output}
    assert all(producers[i].op_type == "DequantizeLinear" for i in add.input)


def _remove_conv_input_qdq(model):
    conv = _node(model, "Conv")
    producers = {o: n for n in model.graph.node for o in n.output}
    dq = producers[conv.input[0]]
    q = producers[dq.input[0]]
    conv.input[0] = q.input[0]


def _nonzero_zero_point(model):
    q = _node(model, "QuantizeLinear", lambda n: not n.input[0].endswith("weight"))
    t = next(t for t in model.graph.initializer if t.name == q.input[2])
    t.CopyFrom(numpy_helper.from_array(np.array(3, dtype=np.int8), t.name))


def _weight_code_minus_128(model):
    q = _node(model, "QuantizeLinear", lambda n: n.input[0].endswith("weight"))
    w = next(t for t in model.graph.initializer if t.name == q.input[0])
    s = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == q.input[1]))
    arr = numpy_helper.to_array(w).copy()
    arr.reshape(arr.shape[0], -1)[0, 0] = -128 * s[0]
    w.CopyFrom(numpy_helper.from_array(arr, w.name))


def _per_axis_activation(model):
    q = _node(model, "QuantizeLinear", lambda n: not n.input[0].endswith("weight"))
    for name in (q.input[1], q.input[2]):
        t = next(t for t in model.graph.initializer if t.name == name)
        arr = numpy_helper.to_array(t)
        t.CopyFrom(numpy_helper.from_array(np.repeat(arr.reshape(1), 3), name))


def _residual_without_qdq(model):
    """Drop the Q/DQ of the skip branch (the MaxPool output), not of the conv branch TensorRT could fuse."""
    add = _node(model, "Add")
    producers = {o: n for n in model.graph.node for o in n.output}
    for i, name in enumerate(add.input):
        source = producers[producers[name].input[0]].input[0]
        if producers[source].op_type not in ("Conv", "Gemm"):
            add.input[i] = source
            return
    raise AssertionError("no skip branch found")


def _custom_op(model):
    relu = _node(model, "Relu")
    relu.domain = "com.example"


@pytest.mark.parametrize("breaker,message", [
    (_remove_conv_input_qdq, "has no Q/DQ"),
    (_nonzero_zero_point, "is not 0"),
    (_weight_code_minus_128, "[-127, 127]"),
    (_per_axis_activation, "per-axis"),
    (_residual_without_qdq, "residual input"),
    (_custom_op, "custom domain"),
], ids=["conv-input-fp32", "zero-point", "weight-128", "per-axis-activation", "residual-add", "custom-op"])
def test_checker_finds_broken_models(trt_export, breaker, message):
    model = _copy(onnx.load(trt_export[0]))
    breaker(model)
    problems = check_tensorrt(model)
    assert problems and any(message in p for p in problems), problems


def test_exporter_raises_on_violations_and_writes_nothing(trt_model, tmp_path, monkeypatch):
    import fxq.backends.tensorrt.check as trt_check

    monkeypatch.setattr(trt_check, "check_tensorrt", lambda model: ["Conv 'x': made-up violation"])
    with pytest.raises(fxq.ExportError, match="made-up violation"):
        fxq.export(trt_model, "trt_int8", tmp_path / "model.onnx")
    assert list(tmp_path.iterdir()) == []


def test_legacy_cache_and_json(trt_model, trt_export):
    main, fp32, cache, js = trt_export
    assert [p.name for p in trt_export] == ["model.onnx", "model_fp32.onnx", "model.cache", "model.json"]
    text = cache.read_text()
    lines = text.splitlines()
    assert re.fullmatch(r"TRT-\d+-EntropyCalibration2", lines[0]) and lines[0] == "TRT-8601-EntropyCalibration2"
    assert all(re.fullmatch(r".+: [0-9a-f]{8}", ln) for ln in lines[1:])
    _, scales = parse_calibration_cache(text)
    # the graph input's entry is the input quantizer's scale, as big-endian float32 bits
    x_q = next(n for n, i in QuantGraph(trt_model).infos().items() if i.source == "x")
    s = float(trt_model.fxq_quantizers[x_q].scale)
    assert lines[1] == f"x: {struct.pack('>f', s).hex()}" and scales["x"] == np.float32(s)
    doc = json.loads(js.read_text())
    assert list(doc) == ["act_quant_info"] and set(doc["act_quant_info"]) == set(scales)
    for name, amax in doc["act_quant_info"].items():
        assert amax == pytest.approx(scales[name] * 127, rel=1e-6)
    fp32_model = onnx.load(fp32)
    names = {o for n in fp32_model.graph.node for o in n.output} | {i.name for i in fp32_model.graph.input}
    assert set(scales) <= names
    assert not any(n.op_type in ("QuantizeLinear", "DequantizeLinear") for n in fp32_model.graph.node)
    assert {"relu", "pool", "conv2", "avgpool" if "avgpool" in scales else "head_0"} & set(scales)
    ort_session(fp32, False)  # loads


def test_cache_version_numbers():
    assert cache_version("8.6.1") == 8601 and cache_version("10.3.0") == 100300 and cache_version(8501) == 8501


def test_models_from_onnx_keep_their_names(tmp_path):
    torch.manual_seed(0)
    model = SmallCNN().eval()
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.randn(2, 3, 16, 16),), buf, dynamo=False, opset_version=13,
                          input_names=["images"], output_names=["logits"])
    source = onnx.load_from_string(buf.getvalue())
    gm = fxq.load_onnx(source)
    q = quantize_model(gm, "trt_int8", shape=(2, 3, 16, 16))
    main, fp32, cache, js = fxq.export(q, "trt_int8", tmp_path / "m.onnx", legacy=True)
    exported = onnx.load(main)
    assert [i.name for i in exported.graph.input] == ["images"]
    assert [o.name for o in exported.graph.output] == ["logits"]
    src_tensors = {o for n in source.graph.node for o in n.output} | {i.name for i in source.graph.input} | {
        t.name for t in source.graph.initializer}
    quantized = [n.input[0] for n in exported.graph.node if n.op_type == "QuantizeLinear"]
    assert sum(t in src_tensors for t in quantized) >= len(quantized) - 1  # the logits producer is renamed once
    _, scales = parse_calibration_cache(cache.read_text())
    assert set(scales) <= src_tensors
    assert check_tensorrt(exported) == []


def test_int8_weight_initializers_option(trt_model, tmp_path):
    """``weights="dq"``: INT8 weight initializers + DequantizeLinear, still within TensorRT's rules."""
    path = fxq.export(trt_model, "trt_int8", tmp_path / "dq.onnx", weights="dq")[0]
    model = onnx.load(path)
    assert check_tensorrt(model) == []
    int8 = [t for t in model.graph.initializer if t.data_type == onnx.TensorProto.INT8 and len(t.dims) == 4]
    assert int8 and all(numpy_helper.to_array(t).min() >= -127 for t in int8)


def test_fp32_conv_after_a_quantized_op_exports(tmp_path):
    """A conv dispatched to FP32 between quantized ops reads a dequantized input with float weights: TensorRT runs
    it in float after the DQ. The rule checker refused the export ('input is quantized but the weight has no
    Q/DQ'), so a dispatching table with a middle layer in FP32 could not be exported for TensorRT."""
    from _export_helpers import output_lsb, run_ort

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 3), torch.nn.ReLU(),
                                torch.nn.Conv2d(8, 4, 3)).eval()
    data = [torch.randn(2, 3, 16, 16) for _ in range(2)]
    setting = fxq.QuantizationSetting(dispatching_table={"2": "fp32"})
    qmodel = fxq.quantize(model, data, "trt_int8", setting, progress=False)
    path = fxq.export(qmodel, "trt_int8", tmp_path / "m.onnx")[0]
    with torch.no_grad():
        ref = qmodel(data[0]).numpy()
    assert not check_tensorrt(str(path))
    lsb = output_lsb(qmodel)
    for optimize, codes in ((False, 0), (True, 2)):  # as written: exact; fused int8 kernels: a code or two
        got = run_ort(path, data[0], optimize=optimize)
        assert float(np.abs(got - ref).max()) <= codes * lsb + 1e-6, optimize
