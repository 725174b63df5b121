"""ONNX ops whose attributes or inputs change what they compute, loaded with load_onnx and run against onnxruntime
(default session and ORT_DISABLE_ALL) and, where written here, a float64 numpy reference.

Each graph is built with onnx.helper so every attribute combination is spelled out (defaults left out too: a
converter that reads a missing attribute with the wrong default shows up only then)."""
from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
import torch
from onnx import helper, numpy_helper
from torch import nn

from fxq.frontends.onnx import load_onnx

ort = pytest.importorskip("onnxruntime")

ORT_MAX_IR = 10
LEVELS = {"default": "ORT_ENABLE_ALL", "ORT_DISABLE_ALL": "ORT_DISABLE_ALL"}


def _model(op: str, opset: int, inputs: dict[str, np.ndarray], consts: dict[str, np.ndarray], n_out: int = 1,
           **attrs) -> onnx.ModelProto:
    """One ``op`` node; graph outputs typed by onnx's shape inference."""
    tdt = helper.np_dtype_to_tensor_dtype
    node = helper.make_node(op, list(inputs) + list(consts), [f"y{i}" for i in range(n_out)], name=f"{op}_0",
                            **attrs)
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info(k, tdt(v.dtype), list(v.shape)) for k, v in inputs.items()],
        [helper.make_tensor_value_info(f"y{i}", onnx.TensorProto.UNDEFINED, None) for i in range(n_out)],
        [numpy_helper.from_array(v, k) for k, v in consts.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = ORT_MAX_IR
    inferred = {v.name: v for v in onnx.shape_inference.infer_shapes(model).graph.output}
    for out in model.graph.output:
        out.type.tensor_type.elem_type = inferred[out.name].type.tensor_type.elem_type
    return model


def _ort(model: onnx.ModelProto, xs: list[np.ndarray], level: str) -> list[np.ndarray]:
    opts = ort.SessionOptions()
    opts.graph_optimization_level = getattr(ort.GraphOptimizationLevel, LEVELS[level])
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return sess.run(None, {i.name: x for i, x in zip(sess.get_inputs(), xs)})


def _ours(model: onnx.ModelProto, xs: list[np.ndarray]) -> list[np.ndarray]:
    gm = load_onnx(model)  # verify="auto": load_onnx's own check against onnxruntime runs too
    with torch.no_grad():
        got = gm(*(torch.from_numpy(x) for x in xs))
    return [g.numpy() for g in (got if isinstance(got, tuple) else (got,))]


def _assert_same(got: list[np.ndarray], want: list[np.ndarray], tol: float = 1e-5) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol)


# ------------------------------------------------------------------------------------------------ CumSum
def _cumsum_reference(x: np.ndarray, axis: int, exclusive: bool, reverse: bool) -> np.ndarray:
    """ONNX CumSum from its definition, summing in float64 element by element."""
    x64 = np.moveaxis(x.astype(np.float64), axis, -1)
    out = np.zeros_like(x64)
    n = x64.shape[-1]
    for i in range(n):
        idx = range(i + 1, n) if reverse and exclusive else range(i, n) if reverse else \
            range(i) if exclusive else range(i + 1)
        for j in idx:
            out[..., i] += x64[..., j]
    return np.moveaxis(out, -1, axis)


CUMSUM_CASES = [
    (exclusive, reverse, axis, axis_dtype, dtype)
    for exclusive in (None, 0, 1)  # None: attribute left out (default 0)
    for reverse in (None, 0, 1)
    for axis in (1, -1, -3)
    for axis_dtype in (np.int64, np.int32)
    for dtype in (np.float32, np.int32, np.int64)
    if not (axis == -3 and (axis_dtype, dtype) != (np.int64, np.float32))
]


@pytest.mark.parametrize(
    "exclusive,reverse,axis,axis_dtype,dtype", CUMSUM_CASES,
    ids=[f"ex{e}-rev{r}-axis{a}-{np.dtype(ad).name}-{np.dtype(d).name}" for e, r, a, ad, d in CUMSUM_CASES],
)
@pytest.mark.parametrize("opset", [11, 14])
def test_cumsum_matches_onnxruntime_and_reference(exclusive, reverse, axis, axis_dtype, dtype, opset) -> None:
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((3, 4, 5)) * 3).astype(dtype)
    attrs = {k: v for k, v in (("exclusive", exclusive), ("reverse", reverse)) if v is not None}
    model = _model("CumSum", opset, {"x": x}, {"axis": np.array(axis, axis_dtype)}, **attrs)
    got = _ours(model, [x])
    for level in LEVELS:
        _assert_same(got, _ort(model, [x], level))
    ref = _cumsum_reference(x, axis, bool(exclusive), bool(reverse))
    np.testing.assert_allclose(got[0].astype(np.float64), ref, rtol=1e-5, atol=1e-5)


def test_cumsum_axis_computed_at_run_time() -> None:
    x = np.random.default_rng(1).standard_normal((2, 6)).astype(np.float32)
    axis = np.array(-1, np.int64)
    model = _model("CumSum", 14, {"x": x, "axis": axis}, {}, reverse=1, exclusive=1)
    got = _ours(model, [x, axis])
    for level in LEVELS:
        _assert_same(got, _ort(model, [x, axis], level))
    np.testing.assert_allclose(got[0], _cumsum_reference(x, -1, True, True), rtol=1e-5, atol=1e-5)


class _CumSumNet(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cumsum(x, 1) * 2 + torch.cumsum(x, -1)


@pytest.mark.parametrize("opset", [13, 17])
def test_torch_onnx_export_of_cumsum_loads(tmp_path, opset: int) -> None:
    """torch.onnx (legacy) writes CumSum without ``reverse``: it must read as 0 (load_onnx's own check caught it)."""
    net, x = _CumSumNet().eval(), torch.randn(2, 5, 3)
    path = tmp_path / "cumsum.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(net, (x,), str(path), dynamo=False, opset_version=opset)
    gm = load_onnx(path)
    with torch.no_grad():
        torch.testing.assert_close(gm(x), net(x))
    model = onnx.load(str(path))
    model.ir_version = min(model.ir_version, ORT_MAX_IR)
    for level in LEVELS:
        np.testing.assert_allclose(gm(x).detach().numpy(), _ort(model, [x.numpy()], level)[0], rtol=1e-5, atol=1e-5)
