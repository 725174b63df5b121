"""ONNX Clip-11/12/13 with absent ("" name), constant and run-time bounds, against onnxruntime (both levels) and
numpy. onnx2torch 1.5.15 refused a Clip whose absent bound is spelled as the empty name, which torch.onnx writes for
``clamp(min=...)`` (``F.normalize``): every legacy export of Swin-V2 failed to load."""
from __future__ import annotations

import io

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper
from test_onnx_op_semantics import LEVELS, ORT_MAX_IR, _assert_same, _ort, _ours

import fxq

ort = pytest.importorskip("onnxruntime")

X = np.linspace(-3, 3, 24, dtype=np.float32).reshape(2, 3, 4)


def _clip_model(opset: int, lo: str, hi: str, *, dtype=np.float32) -> tuple[onnx.ModelProto, list[np.ndarray]]:
    """Clip(x, min, max): each bound ``"absent"`` (the empty name), ``"const"`` (an initializer), ``"node"`` (a
    Constant node) or ``"input"`` (a graph input: computed at run time)."""
    x = X.astype(dtype)
    values = {"min": np.array(-1.25, dtype), "max": np.array(2.0, dtype)}
    inputs = [helper.make_tensor_value_info("x", helper.np_dtype_to_tensor_dtype(x.dtype), list(x.shape))]
    feeds, inits, nodes, names = [x], [], [], []
    for kind, name in ((lo, "min"), (hi, "max")):
        if kind == "absent":
            names.append("")
            continue
        names.append(name)
        v = values[name]
        if kind == "const":
            inits.append(numpy_helper.from_array(v, name))
        elif kind == "node":
            nodes.append(helper.make_node("Constant", [], [name], value=numpy_helper.from_array(v, name)))
        else:
            inputs.append(helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(v.dtype), []))
            feeds.append(v)
    while names and names[-1] == "":
        names.pop()  # trailing optional inputs may also be left out
    if lo == "absent" and hi != "absent":
        names = ["", "max"]
    nodes.append(helper.make_node("Clip", ["x"] + names, ["y"], name="clip"))
    graph = helper.make_graph(nodes, "g", inputs,
                              [helper.make_tensor_value_info("y", helper.np_dtype_to_tensor_dtype(x.dtype), None)],
                              inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = ORT_MAX_IR
    return model, feeds


def _trailing_empty(model: onnx.ModelProto) -> onnx.ModelProto:
    """The same model with the absent max spelled as a trailing empty name (torch.onnx's form)."""
    node = next(n for n in model.graph.node if n.op_type == "Clip")
    while len(node.input) < 3:
        node.input.append("")
    return model


KINDS = ["absent", "const", "node", "input"]


@pytest.mark.parametrize("opset", [11, 12, 13])
@pytest.mark.parametrize("lo", KINDS)
@pytest.mark.parametrize("hi", KINDS)
def test_clip_bounds_match_onnxruntime_and_numpy(opset, lo, hi):
    model, feeds = _clip_model(opset, lo, hi)
    model = _trailing_empty(model)
    got = _ours(model, feeds)
    want = np.clip(X, -1.25 if lo != "absent" else None, 2.0 if hi != "absent" else None)
    np.testing.assert_array_equal(got[0], want)
    for level in LEVELS:
        _assert_same(got, _ort(model, feeds, level), tol=0)


def test_clip_min_above_max_gives_max_everywhere():
    model, feeds = _clip_model(13, "input", "input")
    feeds[1], feeds[2] = np.array(1.0, np.float32), np.array(-1.0, np.float32)
    got = _ours(model, feeds)
    np.testing.assert_array_equal(got[0], np.full_like(X, -1.0))
    for level in LEVELS:
        _assert_same(got, _ort(model, feeds, level), tol=0)


def test_integer_clip_with_run_time_bounds():
    model, feeds = _clip_model(12, "input", "absent", dtype=np.int64)
    model = _trailing_empty(model)
    got = _ours(model, feeds)
    assert got[0].dtype == np.int64
    for level in LEVELS:
        _assert_same(got, _ort(model, feeds, level), tol=0)


def test_constant_bounds_keep_the_modules_dispatch_knows():
    """ReLU6 stays nn.ReLU6 (quantized as an activation), an open upper bound with min 0 stays nn.ReLU."""
    for lo, hi, kind in ((0.0, 6.0, torch.nn.ReLU6), (0.0, None, torch.nn.ReLU)):
        inits = [numpy_helper.from_array(np.array(lo, np.float32), "lo")]
        names = ["x", "lo"]
        if hi is not None:
            inits.append(numpy_helper.from_array(np.array(hi, np.float32), "hi"))
            names.append("hi")
        else:
            names.append("")
        graph = helper.make_graph([helper.make_node("Clip", names, ["y"])], "g",
                                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])], inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
        model.ir_version = ORT_MAX_IR
        gm = fxq.load_onnx(model)
        assert any(isinstance(m, kind) for m in gm.modules()), list(gm.modules())


class _Normalize(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.proj(x), dim=-1) * 3.0  # clamp(min=eps): Clip(x, eps, "") in the legacy export


def test_legacy_export_of_normalize_loads_quantizes_and_exports(tmp_path):
    torch.manual_seed(0)
    model = _Normalize().eval()
    x = torch.randn(4, 8)
    buf = io.BytesIO()
    torch.onnx.export(model, (x,), buf, opset_version=17, dynamo=False, input_names=["x"], output_names=["y"])
    proto = onnx.load_from_string(buf.getvalue())
    assert any(n.op_type == "Clip" and "" in list(n.input) for n in proto.graph.node)  # the form that failed
    gm = fxq.load_onnx(proto)
    with torch.no_grad():
        torch.testing.assert_close(gm(x), model(x))
    q = fxq.quantize(gm, [(x,), (x + 0.1,)], platform="trt_int8", progress=False)
    files = fxq.export(q, "trt_int8", tmp_path / "m.onnx")
    with torch.no_grad():
        sim = q(x).numpy()
    for level in LEVELS:
        out = _ort(onnx.load(str(files[0])), [x.numpy()], level)[0]
        cos = float((out * sim).sum() / (np.linalg.norm(out) * np.linalg.norm(sim)))
        assert cos >= 0.999, (level, cos)
