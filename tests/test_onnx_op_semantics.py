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

import fxq
from fxq.backends.qdq.lowering import torch_onnx_export
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


# ------------------------------------------------------------------------------------------------ Resize
def _reference(model: onnx.ModelProto, xs: list[np.ndarray]) -> list[np.ndarray]:
    """onnx's own reference implementation, written from the spec independently of onnxruntime."""
    from onnx.reference import ReferenceEvaluator

    return ReferenceEvaluator(model).run(None, {i.name: x for i, x in zip(model.graph.input, xs)})


_EMPTY = np.zeros(0, np.float32)
_ROI = np.array([0, 0, 0.1, 0.2, 1, 1, 0.9, 0.7], np.float32)
RESIZE_CASES = {
    **{
        f"13-{mode}-{ctm}-{'x'.join(map(str, sc))}": (13, mode, ctm, {"roi": _ROI if ctm == "tf_crop_and_resize"
                                                                      else _EMPTY, "scales": np.array(sc, np.float32)}, {})
        for mode in ("nearest", "linear", "cubic")
        for ctm in ("half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric", "tf_crop_and_resize")
        for sc in ((1, 1, 2, 2), (1, 1, 0.7, 1.3))
    },
    **{
        f"13-nearest-{ctm}-{nm}-sizes": (13, "nearest", ctm, {"roi": _EMPTY, "scales": _EMPTY,
                                                             "sizes": np.array([1, 2, 7, 3], np.int64)}, {"nearest_mode": nm})
        for ctm in ("half_pixel", "asymmetric")
        for nm in ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil")
    },
    "13-cubic-a-0.5": (13, "cubic", "half_pixel", {"roi": _EMPTY, "scales": np.array((1, 1, 2, 1.5), np.float32)},
                       {"cubic_coeff_a": -0.5}),
    "13-cubic-exclude_outside": (13, "cubic", "half_pixel", {"roi": _EMPTY, "scales": np.array((1, 1, 2, 2), np.float32)},
                                 {"exclude_outside": 1}),
    "13-linear-pytorch_half_pixel-to-1": (13, "linear", "pytorch_half_pixel", {"roi": _EMPTY, "scales": _EMPTY,
                                          "sizes": np.array([1, 2, 1, 7], np.int64)}, {}),
    "11-nearest-tf_half_pixel_for_nn": (11, "nearest", "tf_half_pixel_for_nn", {"roi": _EMPTY, "scales":
                                        np.array((1, 1, 1.5, 2.5), np.float32)}, {}),
    **{
        f"19-axes-{mode}-{ctm}": (19, mode, ctm, {"roi": np.array([0.1, 0.2, 0.9, 0.7], np.float32)
                                                  if ctm == "tf_crop_and_resize" else _EMPTY,
                                                  "scales": np.array((1.7, 0.6), np.float32)},
                                  {"axes": [3, -2], "extrapolation_value": -3.0})
        for mode in ("nearest", "linear", "cubic")
        for ctm in ("half_pixel_symmetric", "asymmetric", "tf_crop_and_resize")
    },
    **{f"10-{mode}-{'x'.join(map(str, sc))}": (10, mode, None, {"scales": np.array(sc, np.float32)}, {})
       for mode in ("nearest", "linear") for sc in ((1, 1, 2, 2), (1, 1, 1.5, 0.6))},
}


def _resize_model(case: str) -> tuple[onnx.ModelProto, np.ndarray]:
    opset, mode, ctm, consts, attrs = RESIZE_CASES[case]
    if ctm is not None:
        attrs = {"coordinate_transformation_mode": ctm, **attrs}
    x = np.random.default_rng(0).standard_normal((1, 2, 4, 5)).astype(np.float32)
    return _model("Resize", opset, {"x": x}, consts, mode=mode, **attrs), x


@pytest.mark.parametrize("case", list(RESIZE_CASES))
def test_resize_matches_onnxruntime_and_reference(case: str) -> None:
    model, x = _resize_model(case)
    got = _ours(model, [x])
    for level in LEVELS:
        _assert_same(got, _ort(model, [x], level))
    # onnx's reference lacks Resize-10, axes and tf_half_pixel_for_nn, and maps align_corners / tf_crop_and_resize
    # coordinates with the unrounded output length where floor(length * scale) is not exact (onnxruntime and we
    # use the output's length)
    if case.startswith("13-") and not ("0.7x1.3" in case and ("align_corners" in case or "tf_crop" in case)):
        _assert_same(got, _reference(model, [x]))


def test_resize_of_batch_and_channel_dims_follows_the_spec() -> None:
    """tf_crop_and_resize that also scales the channel dim: onnxruntime 1.23 differs from the spec and from onnx's
    reference here (max diff 2.08); we follow the spec, so load_onnx's own check against onnxruntime is off."""
    x = np.arange(40, dtype=np.float32).reshape(1, 2, 4, 5)
    model = _model("Resize", 13, {"x": x}, {"roi": _ROI, "scales": np.array((1, 2, 1, 0.5), np.float32)},
                   mode="nearest", coordinate_transformation_mode="tf_crop_and_resize", nearest_mode="floor")
    gm = load_onnx(model, verify=False)
    _assert_same([gm(torch.from_numpy(x)).numpy()], _reference(model, [x]))


def test_resize_sizes_computed_at_run_time() -> None:
    x = np.random.default_rng(2).standard_normal((1, 2, 4, 5)).astype(np.float32)
    sizes = np.array([1, 2, 6, 3], np.int64)
    model = _model("Resize", 13, {"x": x, "sizes": sizes}, {}, mode="linear", coordinate_transformation_mode="asymmetric")
    model.graph.node[0].input[:] = ["x", "", "", "sizes"]
    model.graph.output[0].type.tensor_type.elem_type = onnx.TensorProto.FLOAT
    xs = [x, sizes]
    got = _ours(model, xs)
    for level in LEVELS:
        _assert_same(got, _ort(model, xs, level))


@pytest.mark.parametrize("case,opset,one_node", [
    ("13-nearest-half_pixel-1x1x2x2", 13, True), ("13-linear-asymmetric-1x1x0.7x1.3", 17, True),
    ("13-cubic-exclude_outside", 13, True), ("19-axes-linear-asymmetric", 13, True),
    ("19-axes-cubic-half_pixel_symmetric", 19, True), ("10-nearest-1x1x2x2", 13, True),
    ("19-axes-cubic-half_pixel_symmetric", 17, False),  # no half_pixel_symmetric before opset 19
    ("10-nearest-1x1x1.5x0.6", 13, False),  # Resize-10 rounds up one dim and down the other: no nearest_mode says so
])
def test_resize_exports_back(tmp_path, case: str, opset: int, one_node: bool) -> None:
    """fxq's torch.onnx export writes the loaded Resize back as one Resize node with the node's attributes, or (when
    the opset's Resize cannot say it) as the resampling itself; either way with onnxruntime's results."""
    model, x = _resize_model(case)
    gm = load_onnx(model)
    path = tmp_path / "again.onnx"
    torch_onnx_export(gm, (torch.from_numpy(x),), str(path), opset=opset, input_names=["x"], output_names=["y"])
    again = onnx.load(str(path))
    again.ir_version = min(again.ir_version, ORT_MAX_IR)
    ops = [n.op_type for n in again.graph.node if n.op_type != "Constant"]
    assert (ops == ["Resize"]) == one_node, ops
    for level in LEVELS:
        _assert_same(_ort(again, [x], level), _ort(model, [x], level))


def test_quantized_graph_with_our_modules_saves_and_loads(tmp_path) -> None:
    """Conv -> Resize (resampled by hand) -> CumSum -> Conv, quantized, saved and loaded back: same outputs."""
    from _export_helpers import quantize_model

    rng = np.random.default_rng(0)
    w1, w2 = (numpy_helper.from_array(rng.standard_normal((4, c, 3, 3)).astype(np.float32) * 0.3, f"w{i}")
              for i, c in ((1, 3), (2, 4)))
    nodes = [helper.make_node("Conv", ["x", "w1"], ["a"], pads=[1, 1, 1, 1]),
             helper.make_node("Resize", ["a", "", "scales"], ["b"], mode="linear",
                              coordinate_transformation_mode="asymmetric"),
             helper.make_node("CumSum", ["b", "axis"], ["c"], reverse=1),
             helper.make_node("Conv", ["c", "w2"], ["y"], pads=[1, 1, 1, 1])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3, 8, 8])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 4, 16, 16])],
                              [w1, w2, numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales"),
                               numpy_helper.from_array(np.array(-1, np.int64), "axis")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = ORT_MAX_IR
    q = quantize_model(load_onnx(model), "trt_int8", shape=(2, 3, 8, 8))
    again = fxq.load(fxq.save(q, tmp_path / "q.fxq"))
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        assert torch.equal(q(x), again(x))


# --------------------------------------------------------------------------------------------------- Pad
PAD_CASES = [
    (opset, mode, pads)
    for opset in (11, 13, 18, 19)
    for mode in ("reflect", "edge", "constant") + (("wrap",) if opset >= 19 else ())
    for pads in ((0, 0, 1, 2, 0, 0, 2, 1), (0, 2, 0, 0, 0, 1, 0, 0), (1, 0, 0, 0, 2, 0, 0, 0) if mode != "reflect"
                 else (1, 0, 0, 0, 1, 0, 0, 0), (0, 1, -1, 2, 0, 0, 1, -2), (1, 1, 1, 1, 1, 1, 1, 1))
]


@pytest.mark.parametrize("opset,mode,pads", PAD_CASES, ids=[f"{o}-{m}-{p}" for o, m, p in PAD_CASES])
def test_pad_on_any_dim_matches_onnxruntime_and_numpy(opset: int, mode: str, pads: tuple[int, ...]) -> None:
    """reflect / edge / wrap on batch and channel dims and with crops (torch's F.pad pads only trailing dims)."""
    x = np.random.default_rng(0).standard_normal((2, 3, 4, 5)).astype(np.float32)
    model = _model("Pad", opset, {"x": x}, {"pads": np.array(pads, np.int64)}, mode=mode)
    got = _ours(model, [x])
    for level in LEVELS:
        _assert_same(got, _ort(model, [x], level))
    if min(pads) >= 0:
        np_mode = {"reflect": "reflect", "edge": "edge", "constant": "constant", "wrap": "wrap"}[mode]
        ref = np.pad(x, list(zip(pads[:4], pads[4:])), mode=np_mode)
        _assert_same(got, [ref])


@pytest.mark.parametrize("shape,pads", [((5,), (2, 3)), ((4, 5), (1, 2, 3, 1))])
def test_pad_edge_of_low_rank_and_integer_tensors(shape: tuple[int, ...], pads: tuple[int, ...]) -> None:
    for x in (np.random.default_rng(1).standard_normal(shape).astype(np.float32),
              np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)):
        model = _model("Pad", 13, {"x": x}, {"pads": np.array(pads, np.int64)}, mode="edge")
        got = _ours(model, [x])
        for level in LEVELS:
            _assert_same(got, _ort(model, [x], level))
        n = len(shape)
        _assert_same(got, [np.pad(x, list(zip(pads[:n], pads[n:])), mode="edge")])


# -------------------------------------------------------------------------------------------------- TopK
def _topk_reference(x: np.ndarray, k: int, axis: int, largest: bool) -> list[np.ndarray]:
    """ONNX TopK: the k largest (smallest) along axis; equal values in index order."""
    idx = np.argsort(-x if largest else x, axis=axis, kind="stable")
    idx = np.take(idx, np.arange(k), axis=axis)
    return [np.take_along_axis(x, idx, axis=axis), idx.astype(np.int64)]


TOPK_CASES = [(opset, k, axis, largest, dtype) for opset in (10, 11, 24) for k, axis in ((3, 1), (2, 0), (6, -1))
              for largest in ((1,) if opset == 10 else (0, 1)) for dtype in (np.float32, np.int64)
              if not (opset == 10 and dtype == np.int64)]


@pytest.mark.parametrize("opset,k,axis,largest,dtype", TOPK_CASES,
                         ids=[f"{o}-k{k}-axis{a}-largest{lg}-{np.dtype(d).name}" for o, k, a, lg, d in TOPK_CASES])
def test_topk_ties_come_in_index_order(opset: int, k: int, axis: int, largest: int, dtype) -> None:
    """Small integers: many equal values, whose indices torch.topk orders as it likes."""
    x = np.random.default_rng(0).integers(0, 3, (3, 6)).astype(dtype)
    attrs = {} if opset == 10 else {"largest": largest}
    model = _model("TopK", opset, {"x": x}, {"k": np.array([k], np.int64)}, n_out=2, axis=axis, **attrs)
    got = _ours(model, [x])
    for level in LEVELS:
        _assert_same(got, _ort(model, [x], level))
    _assert_same(got, _topk_reference(x, k, axis, bool(largest)))


def test_topk_1_k_attribute_and_runtime_k() -> None:
    x = np.random.default_rng(3).integers(0, 4, (4, 7)).astype(np.float32)
    model = _model("TopK", 1, {"x": x}, {}, n_out=2, k=3)
    got = _ours(model, [x])
    for level in LEVELS:
        _assert_same(got, _ort(model, [x], level))
    k = np.array([2], np.int64)
    model = _model("TopK", 11, {"x": x, "k": k}, {}, n_out=2, axis=0, largest=0)
    got = _ours(model, [x, k])
    for level in LEVELS:
        _assert_same(got, _ort(model, [x, k], level))
    _assert_same(got, _topk_reference(x, 2, 0, False))


# -------------------------------------------------------------------------------------- Reduce* (attribute axes)
_NP_REDUCE = {"ReduceMax": np.max, "ReduceMin": np.min, "ReduceProd": np.prod, "ReduceSum": np.sum,
              "ReduceMean": np.mean, "ReduceL1": lambda x, **k: np.sum(np.abs(x), **k)}
REDUCE_CASES = [(op, opset, axes, keep) for op in _NP_REDUCE for opset in (11, 13) if (op, opset) != ("ReduceSum", 13)
                for axes, keep in (([-1, 1], 0), ([2, -4], 0), ([-1, 1], 1), (None, 0))]


@pytest.mark.parametrize("op,opset,axes,keep", REDUCE_CASES, ids=[f"{o}-{v}-{a}-keep{k}" for o, v, a, k in REDUCE_CASES])
def test_reduce_with_axes_of_both_signs(op: str, opset: int, axes: list[int] | None, keep: int) -> None:
    x = np.random.default_rng(0).uniform(0.5, 2.0, (2, 3, 4, 5)).astype(np.float32)
    attrs = {"keepdims": keep, **({"axes": axes} if axes is not None else {})}
    model = _model(op, opset, {"x": x}, {}, **attrs)
    got = _ours(model, [x])
    for level in LEVELS:
        _assert_same(got, _ort(model, [x], level))
    ref = _NP_REDUCE[op](x.astype(np.float64), axis=tuple(axes) if axes else None, keepdims=bool(keep))
    np.testing.assert_allclose(got[0], ref, rtol=1e-5)


# ------------------------------------------------------------------------------------------- ConvTranspose
CONV_T_CASES = {
    "output_shape-10x12": {"strides": [2, 2], "output_shape": [10, 12]},
    "output_shape-11x11": {"strides": [2, 2], "output_shape": [11, 11]},
    "output_shape-9x12": {"strides": [2, 2], "output_shape": [9, 12]},
    "SAME_LOWER": {"strides": [2, 2], "auto_pad": "SAME_LOWER"},
    "SAME_UPPER-stride1": {"auto_pad": "SAME_UPPER"},
    "unequal-pads": {"strides": [2, 2], "pads": [1, 0, 0, 0]},
    "pads-output_padding": {"strides": [2, 2], "pads": [1, 1, 1, 1], "output_padding": [1, 1]},
}


@pytest.mark.parametrize("case", list(CONV_T_CASES))
@pytest.mark.parametrize("group", [1, 2])
def test_conv_transpose_output_shape_auto_pad_and_unequal_pads(case: str, group: int) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 2, 5, 6)).astype(np.float32)
    per_group = 3 if group == 1 else 1  # output channels: per_group * group
    consts = {"w": rng.standard_normal((2, per_group, 3, 3)).astype(np.float32),
              "b": rng.standard_normal(per_group * group).astype(np.float32)}
    model = _model("ConvTranspose", 11, {"x": x}, consts, group=group, **CONV_T_CASES[case])
    got = _ours(model, [x])
    for level in LEVELS:
        _assert_same(got, _ort(model, [x], level))


@pytest.mark.parametrize("case", [c for c in CONV_T_CASES if c.startswith("output_shape")])
@pytest.mark.parametrize("input_shapes", [None, {"x": [1, 2, 5, 6]}])
def test_conv_transpose_output_shape_on_a_symbolic_input(tmp_path, case: str, input_shapes) -> None:
    """``output_shape`` on a graph input of symbolic size: ONNX computes the pads from the size at run time, so
    the converted module crops to ``output_shape`` at every input size. It used to be refused, with advice
    (``input_shapes``) that did not help: the input's declaration stays symbolic. The conv is quantized, the
    ``.fxq`` file loads, and the trt_int8 file follows the simulation at other sizes."""
    rng = np.random.default_rng(0)
    consts = {"w": rng.standard_normal((2, 3, 3, 3)).astype(np.float32),
              "b": rng.standard_normal(3).astype(np.float32)}
    model = _model("ConvTranspose", 11, {"x": np.zeros((1, 2, 5, 6), np.float32)}, consts, **CONV_T_CASES[case])
    for i, d in enumerate(model.graph.input[0].type.tensor_type.shape.dim):
        d.dim_param = ["n", "c", "h", "w"][i]  # every dim symbolic (c too: shape inference learns it from w)
    path = tmp_path / "ct.onnx"
    onnx.save(model, path)
    gm = load_onnx(path, input_shapes=input_shapes)
    sizes = [(1, 2, 5, 6), (2, 2, 6, 7), (1, 2, 7, 8)]  # sizes whose pads are >= 0 (a crop of the full output)
    for shape in sizes:
        x = rng.standard_normal(shape).astype(np.float32)
        with torch.no_grad():
            got = [gm(torch.from_numpy(x)).numpy()]
        for level in LEVELS:
            _assert_same(got, _ort(model, [x], level))
    calib = [torch.from_numpy(rng.standard_normal((1, 2, 5, 6)).astype(np.float32)) for _ in range(2)]
    q = fxq.quantize(gm, calib, "trt_int8", progress=False)
    fxq.save(q, tmp_path / "q.fxq")
    q = fxq.load(tmp_path / "q.fxq")
    fxq.export(q, "trt_int8", tmp_path / "q.onnx", dynamic_batch=True)
    exported = onnx.load(tmp_path / "q.onnx")
    producers = {o: n for n in exported.graph.node for o in n.output}
    conv_t = [n for n in exported.graph.node if n.op_type == "ConvTranspose"]
    assert len(conv_t) == 1 and producers[conv_t[0].input[1]].op_type == "DequantizeLinear"  # its weight: int8
    out_dq = producers[exported.graph.output[0].name]
    while out_dq.op_type != "DequantizeLinear":  # the crop (Pad) reads the conv's quantized output
        out_dq = producers[out_dq.input[0]]
    step = float(next(numpy_helper.to_array(t) for t in exported.graph.initializer if t.name == out_dq.input[1]))
    for shape in sizes:
        x = rng.standard_normal(shape).astype(np.float32)
        with torch.no_grad():
            sim = q(torch.from_numpy(x)).numpy()
        for level in LEVELS:
            diff = np.abs(_ort(exported, [x], level)[0] - sim)
            assert diff.max() <= 1.001 * step and (diff > 1e-6).mean() <= 0.01, (shape, level)  # rounding ties


class _SqueezeExcite(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.fc = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.conv(x))
        return (y * torch.sigmoid(self.fc(y.mean((2, 3), keepdim=True)))).mean((2, 3))


@pytest.mark.parametrize("opset", [13, 18])
def test_onnx_reduce_mean_exports_to_ncnn(tmp_path, opset: int) -> None:
    """ReduceMean read from ONNX (attribute axes at 13, input at 18) is fxq's OnnxReduce; ncnn's exporter reads it."""
    from _export_helpers import quantize_model

    path = tmp_path / "se.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(_SqueezeExcite().eval(), (torch.randn(1, 3, 16, 16),), str(path), dynamo=False,
                          opset_version=opset)
    q = quantize_model(load_onnx(path), "ncnn_int8", shape=(1, 3, 16, 16))
    files = fxq.export(q, "ncnn_int8", tmp_path / "se")
    param = next(p for p in files if str(p).endswith("se.param")).read_text()
    assert param.count("Pooling") == 2  # both spatial means as global average pooling


# ------------------------------------------------------------------------ Flatten, DepthToSpace, GatherElements
LAYOUT_CASES = {
    **{f"Flatten-{opset}-axis{axis}": ("Flatten", opset, (2, 3, 4, 5), {"axis": axis})
       for opset in (1, 11, 13) for axis in (0, 1, 2, 4, -1, -4) if not (opset == 1 and axis < 0)},
    "Flatten-13-1d-axis1": ("Flatten", 13, (5,), {"axis": 1}),
    **{f"DepthToSpace-{opset}-{mode}": ("DepthToSpace", opset, (2, 8, 2, 3),
                                        {"blocksize": 2, **({"mode": mode} if mode else {})})
       for opset, mode in ((1, None), (11, None), (13, "DCR"), (13, "CRD"))},
    "SpaceToDepth-1": ("SpaceToDepth", 1, (2, 3, 4, 6), {"blocksize": 2}),
    "SpaceToDepth-13": ("SpaceToDepth", 13, (2, 3, 4, 6), {"blocksize": 2}),
}


@pytest.mark.parametrize("case", list(LAYOUT_CASES))
def test_layout_ops_match_onnxruntime_and_reference(case: str) -> None:
    op, opset, shape, attrs = LAYOUT_CASES[case]
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    model = _model(op, opset, {"x": x}, {}, **attrs)
    got = _ours(model, [x])
    for level in LEVELS:
        _assert_same(got, _ort(model, [x], level))
    _assert_same(got, _reference(model, [x]))


@pytest.mark.parametrize("axis", [0, 2, -1])
@pytest.mark.parametrize("runtime", [False, True])
def test_gather_elements_negative_indices(axis: int, runtime: bool) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 4, 5)).astype(np.float32)
    idx = rng.integers(-x.shape[axis], x.shape[axis], (2, 3, 4, 5)).astype(np.int32 if runtime else np.int64)
    inputs, consts = ({"x": x, "i": idx}, {}) if runtime else ({"x": x}, {"i": idx})
    model = _model("GatherElements", 13, inputs, consts, axis=axis)
    xs = list(inputs.values())
    got = _ours(model, xs)
    for level in LEVELS:
        _assert_same(got, _ort(model, xs, level))
    _assert_same(got, [np.take_along_axis(x, np.where(idx < 0, idx + x.shape[axis], idx), axis=axis)])


@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.bool_])
def test_non_zero_is_rank_by_count(dtype) -> None:
    x = (np.random.default_rng(0).standard_normal((2, 3, 4)) > 0.3).astype(dtype)
    model = _model("NonZero", 13, {"x": x}, {})
    got = _ours(model, [x])
    for level in LEVELS:
        _assert_same(got, _ort(model, [x], level))
    _assert_same(got, [np.stack(np.nonzero(x)).astype(np.int64)])


@pytest.mark.parametrize("opset", [8, 12, 22])
@pytest.mark.parametrize("attrs", [{"kernel_shape": [2, 2], "strides": [2, 2]},
                                   {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}],
                         ids=["k2s2", "k3s2p1"])
def test_max_pool_indices_output(opset: int, attrs: dict) -> None:
    """Both outputs, the indices counted over the whole input as ONNX does (torch counts within each plane)."""
    x = np.random.default_rng(0).standard_normal((2, 3, 6, 7)).astype(np.float32)
    model = _model("MaxPool", opset, {"x": x}, {}, n_out=2, **attrs)
    got = _ours(model, [x])
    for level in LEVELS:
        _assert_same(got, _ort(model, [x], level))
    np.testing.assert_array_equal(x.reshape(-1)[got[1]], got[0])  # each index points at its value


@pytest.mark.parametrize("largest", [0, 1])
def test_topk_unsorted_picks_the_same_elements(largest: int) -> None:
    """``sorted=0``: any order is right; the same elements as onnxruntime's, each index with its value. (load_onnx's
    own check compares in order, so it is off here: onnxruntime's order for k=5 is neither sorted nor torch's.)"""
    x = np.random.default_rng(0).standard_normal((3, 50)).astype(np.float32)
    model = _model("TopK", 11, {"x": x}, {"k": np.array([5], np.int64)}, n_out=2, axis=1, largest=largest, sorted=0)
    with torch.no_grad():
        values, indices = (t.numpy() for t in load_onnx(model, verify=False)(torch.from_numpy(x)))
    for level in LEVELS:
        want_values, want_indices = _ort(model, [x], level)
        np.testing.assert_array_equal(np.sort(indices, 1), np.sort(want_indices, 1))
    np.testing.assert_array_equal(np.take_along_axis(x, indices, 1), values)


# -------------------------------------------------------------------- ops onnx2torch 1.5.15 refuses at load
def _mish(x):
    return x * np.tanh(np.log1p(np.exp(x)))


MISSING_CASES = [
    ("Mish", 18, {}, _mish),
    ("ThresholdedRelu", 10, {"alpha": 0.3}, lambda x: np.where(x > 0.3, x, 0)),
    ("Shrink", 9, {"lambd": 0.4}, lambda x: np.where(np.abs(x) > 0.4, x, 0)),
    ("Shrink", 9, {"lambd": 0.4, "bias": 0.4}, lambda x: np.where(x > 0.4, x - 0.4, np.where(x < -0.4, x + 0.4, 0))),
    ("GlobalMaxPool", 1, {}, lambda x: x.max(axis=tuple(range(2, x.ndim)), keepdims=True)),
]


@pytest.mark.parametrize("op,opset,attrs,reference", MISSING_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(MISSING_CASES)])
@pytest.mark.parametrize("shape", [(2, 3, 5, 4), (1, 2, 3, 4, 5)], ids=["4d", "5d"])
def test_ops_onnx2torch_lacks(op, opset, attrs, reference, shape) -> None:
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    model = _model(op, opset, {"x": x}, {}, **attrs)
    got = _ours(model, [x])
    for level in LEVELS:
        _assert_same(got, _ort(model, [x], level))
    _assert_same(got, [reference(x.astype(np.float64)).astype(np.float32)])


def test_shrink_with_another_bias_is_refused_naming_it() -> None:
    x = np.zeros((2, 3), np.float32)
    with pytest.raises(fxq.FxqError, match="Shrink"):
        load_onnx(_model("Shrink", 9, {"x": x}, {}, lambd=0.5, bias=0.2))


def test_global_max_pool_quantizes_and_round_trips(tmp_path) -> None:
    """A CNN with GlobalMaxPool from an ONNX file: quantized (op type GlobalMaxPool), saved and loaded the same."""
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveMaxPool2d(1), nn.Flatten(), nn.Linear(4, 2)).eval()
    x = torch.randn(1, 3, 8, 8)
    path = tmp_path / "gmp.onnx"
    torch_onnx_export(net, (x,), str(path), opset=13, input_names=["x"], output_names=["y"])
    model = onnx.load(str(path))
    (pool,) = [n for n in model.graph.node if n.op_type == "MaxPool"]  # torch writes a 6x6 MaxPool for it
    pool.op_type = "GlobalMaxPool"
    del pool.attribute[:]
    onnx.save(model, str(path))
    q = fxq.quantize(load_onnx(str(path)), [torch.randn(2, 3, 8, 8) for _ in range(2)], "trt_int8", progress=False)
    from fxq.graph.op_types import op_type

    modules = dict(q.named_modules())
    assert "GlobalMaxPool" in {op_type(n, modules) for n in q.graph.nodes if n.op == "call_module"}
    again = fxq.load(fxq.save(q, tmp_path / "gmp.fxq"))
    with torch.no_grad():
        assert torch.equal(again(x), q(x))


def test_exclusive_cumsum_over_an_empty_axis() -> None:
    x = np.zeros((3, 0), np.float32)
    model = _model("CumSum", 14, {"x": x}, {"axis": np.array(1, np.int64)}, exclusive=1)
    got = _ours(model, [x])
    for level in LEVELS:
        _assert_same(got, _ort(model, [x], level))


def test_flatten_of_an_input_of_unknown_rank() -> None:
    """Shape inference cannot tell the rank: ONNX's rule (a 1-D input becomes [n, 1]) still holds at run time."""
    node = helper.make_node("Flatten", ["x"], ["y"], axis=1)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = ORT_MAX_IR
    gm = load_onnx(model, verify=False)
    for x in (np.arange(5, dtype=np.float32), np.ones((2, 3, 4), np.float32)):
        with torch.no_grad():
            got = gm(torch.from_numpy(x)).numpy()
        _assert_same([got], _ort(model, [x], "default"))
