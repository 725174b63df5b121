"""ONNX ops and attributes onnx2torch refuses or gets wrong (batch B), loaded with load_onnx and run against
onnxruntime (default session and ORT_DISABLE_ALL) and, where written here, a float64 numpy reference:
ScatterElements / Scatter, ScatterND, GatherND batch_dims, auto_pad SAME_* / VALID on Conv, ConvTranspose, MaxPool and
AveragePool (also at a second input size), Resize antialias, Unique, Compress, ReverseSequence, Upsample-7 and
CenterCropPad; then save/load round trips and trt_int8 exports of the auto_pad and ScatterElements models."""
from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper
from test_onnx_op_semantics import LEVELS, ORT_MAX_IR, _assert_same, _model, _ort, _ours

import fxq
from fxq.frontends.onnx import load_onnx

ort = pytest.importorskip("onnxruntime")

RNG = np.random.default_rng(0)


def _f(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def _check(model: onnx.ModelProto, xs: list[np.ndarray], reference: list[np.ndarray] | None = None,
           tol: float = 1e-5) -> list[np.ndarray]:
    """fxq's outputs equal onnxruntime's at both optimization levels (and ``reference`` when given)."""
    got = _ours(model, xs)
    for level in LEVELS:
        _assert_same(got, _ort(model, xs, level), tol)
    if reference is not None:
        for g, r in zip(got, reference):
            np.testing.assert_allclose(g.astype(np.float64), r, rtol=tol, atol=tol)
    return got


# --------------------------------------------------------------------------------------------- ScatterElements
def _scatter_reference(data: np.ndarray, indices: np.ndarray, updates: np.ndarray, axis: int,
                       reduction: str) -> np.ndarray:
    out = data.astype(np.float64).copy()
    axis %= data.ndim
    for pos in np.ndindex(*indices.shape):
        target = list(pos)
        target[axis] = indices[pos] % data.shape[axis]
        u = float(updates[pos])
        t = tuple(target)
        out[t] = {"none": u, "add": out[t] + u, "mul": out[t] * u, "max": max(out[t], u),
                  "min": min(out[t], u)}[reduction]
    return out


@pytest.mark.parametrize("op, opset, reduction", [
    ("Scatter", 9, None), ("Scatter", 10, None),  # Scatter-11 is the deprecation (onnxruntime refuses it)
    ("ScatterElements", 11, None), ("ScatterElements", 13, None),
    ("ScatterElements", 16, "add"), ("ScatterElements", 16, "mul"), ("ScatterElements", 18, "max"),
    ("ScatterElements", 18, "min"), ("ScatterElements", 18, "none"),
])
@pytest.mark.parametrize("axis", [None, 1, -1])
def test_scatter_elements(op: str, opset: int, reduction: str | None, axis: int | None) -> None:
    data = _f(3, 5)
    ax = 0 if axis is None else axis
    # distinct positions along the axis per row (duplicates are undefined for "none"), some negative
    if ax == 0:
        indices = np.array([[0, -1, 1, 2, -3], [2, 0, -1, 0, 1]], np.int64)
    else:
        indices = np.array([[0, -1, 2], [4, -4, 0], [-5, 3, 1]], np.int64)
    updates = _f(*indices.shape)
    attrs = {} if axis is None else {"axis": axis}
    if reduction is not None:
        attrs["reduction"] = reduction
    model = _model(op, opset, {"data": data}, {"indices": indices, "updates": updates}, **attrs)
    ref = _scatter_reference(data, indices, updates, ax, reduction or "none")
    _check(model, [data], [ref])


def test_scatter_elements_all_inputs_at_run_time_and_duplicate_adds() -> None:
    data, updates = _f(4, 3), _f(4, 3)
    indices = np.array([[0, 0, 1], [0, 3, -1], [2, 2, 2], [-4, 1, 0]], np.int64)
    model = _model("ScatterElements", 18, {"data": data, "indices": indices, "updates": updates}, {},
                   reduction="add")
    _check(model, [data, indices, updates], [_scatter_reference(data, indices, updates, 0, "add")])


# ------------------------------------------------------------------------------------------------ ScatterND
def _scatter_nd_reference(data: np.ndarray, indices: np.ndarray, updates: np.ndarray, reduction: str) -> np.ndarray:
    out = data.astype(np.float64).copy()
    k = indices.shape[-1]
    for pos in np.ndindex(*indices.shape[:-1]):
        t = tuple(int(i) % n for i, n in zip(indices[pos], data.shape[:k]))
        u = updates[pos].astype(np.float64)
        out[t] = {"none": u, "add": out[t] + u, "mul": out[t] * u, "max": np.maximum(out[t], u),
                  "min": np.minimum(out[t], u)}[reduction]
    return out


@pytest.mark.parametrize("opset, reduction", [
    (11, None), (13, None), (16, "add"), (16, "mul"), (18, "max"), (18, "min"), (18, "none"),
])
@pytest.mark.parametrize("indices", [
    [[1], [-1]],  # whole slices of dim 0
    [[0, 2], [3, -1], [-4, 0]],  # rows of dims 0-1
    [[[1, 2, 0], [0, -1, 2]], [[3, 4, -1], [2, 0, 1]]],  # single elements, indices of rank 3
], ids=["slices", "rows", "elements"])
def test_scatter_nd(opset: int, reduction: str | None, indices: list) -> None:
    """onnx2torch's ScatterND wrote with a list of index lists (deprecated by torch: a later torch reads it as one
    index tensor) and had no reduction; fxq's converter against onnxruntime and a float64 reference."""
    data = _f(4, 5, 3)
    idx = np.array(indices, np.int64)
    updates = _f(*idx.shape[:-1], *data.shape[idx.shape[-1]:])
    attrs = {} if reduction is None else {"reduction": reduction}
    model = _model("ScatterND", opset, {"data": data}, {"indices": idx, "updates": updates}, **attrs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _check(model, [data], [_scatter_nd_reference(data, idx, updates, reduction or "none")])


def test_scatter_nd_duplicate_adds_at_run_time() -> None:
    data, updates = _f(4, 3), _f(3, 3)
    indices = np.array([[1], [1], [-3]], np.int64)
    model = _model("ScatterND", 16, {"data": data, "indices": indices, "updates": updates}, {}, reduction="add")
    _check(model, [data, indices, updates], [_scatter_nd_reference(data, indices, updates, "add")])


class _DetectHead(torch.nn.Module):
    """A YOLOv5-style head: slices of the output rewritten in place, which torch.onnx writes as ScatterND."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 21, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x).reshape(1, 3, 7, 4, 4).permute(0, 1, 3, 4, 2).sigmoid()
        y[..., 0:2] = y[..., 0:2] * 2 - 0.5
        y[..., 2:4] = (y[..., 2:4] * 2) ** 2 * 8
        return y


@pytest.mark.parametrize("opset", [11, 13, 17])
def test_detect_head_with_scatter_nd_quantizes_and_deploys(tmp_path, opset: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(1, 3, 4, 4)
    path = tmp_path / "head.onnx"
    torch.onnx.export(_DetectHead().eval(), (x,), path, opset_version=opset, dynamo=False, input_names=["x"],
                      output_names=["y"])
    assert "ScatterND" in {n.op_type for n in onnx.load(str(path)).graph.node}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gm = load_onnx(path)
        got = gm(x)
    np.testing.assert_allclose(got.detach().numpy(), _ort(onnx.load(str(path)), [x.numpy()], "default")[0], rtol=1e-5,
                               atol=1e-5)
    q = fxq.quantize(gm, [x, torch.randn(1, 3, 4, 4)], platform="trt_int8", progress=False)
    files = fxq.export(q, "trt_int8", tmp_path / "q.onnx")
    exported = onnx.load(str(next(f for f in files if f.suffix == ".onnx")))
    assert "ScatterND" in {n.op_type for n in exported.graph.node}
    with torch.no_grad():
        sim = q(x).numpy()
    for level in LEVELS:
        np.testing.assert_allclose(_ort(exported, [x.numpy()], level)[0], sim, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------- GatherND
def _gather_nd_reference(data: np.ndarray, indices: np.ndarray, b: int) -> np.ndarray:
    batch = data.shape[:b]
    out = []
    for bi in np.ndindex(*batch) if b else [()]:
        idx = indices[bi].reshape(-1, indices.shape[-1])
        out.append(np.stack([data[bi][tuple(i % s for i, s in zip(row, data.shape[b:]))] for row in idx]))
    return np.stack(out).reshape(indices.shape[:-1] + data.shape[b + indices.shape[-1]:]).astype(np.float64)


@pytest.mark.parametrize("opset", [11, 12, 13])
@pytest.mark.parametrize("batch_dims, data_shape, idx_shape", [
    (0, (3, 4, 2), (5, 2)), (0, (3, 4), (2, 2, 1)), (1, (2, 3, 4), (2, 2, 1)), (1, (2, 3, 4), (2, 2)),
    (2, (2, 3, 4, 5), (2, 3, 2, 1)), (2, (2, 3, 4, 5), (2, 3, 2)),
])
def test_gather_nd_batch_dims(opset: int, batch_dims: int, data_shape: tuple, idx_shape: tuple) -> None:
    if batch_dims and opset < 12:
        pytest.skip("batch_dims came with GatherND-12")
    data = _f(*data_shape)
    dims = data_shape[batch_dims:batch_dims + idx_shape[-1]]
    indices = np.stack([RNG.integers(-d, d, idx_shape[:-1]) for d in dims], -1).astype(np.int64)
    attrs = {"batch_dims": batch_dims} if batch_dims else {}
    model = _model("GatherND", opset, {"data": data}, {"indices": indices}, **attrs)
    _check(model, [data], [_gather_nd_reference(data, indices, batch_dims)])


def test_gather_nd_indices_at_run_time() -> None:
    data = _f(2, 3, 4)
    indices = np.array([[[2, -1]], [[0, 3]]], np.int64)
    model = _model("GatherND", 13, {"data": data, "indices": indices}, {}, batch_dims=1)
    _check(model, [data, indices], [_gather_nd_reference(data, indices, 1)])


# ------------------------------------------------------------------------------------------------- auto_pad
def _dynamic(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with symbolic batch and spatial dims on its first input, so it runs at other sizes."""
    dims = model.graph.input[0].type.tensor_type.shape.dim
    for i in [0] + list(range(2, len(dims))):
        dims[i].dim_param = f"d{i}"
    return model


AUTO_PAD_CASES = {
    "conv_upper_s2": ("Conv", {"auto_pad": "SAME_UPPER", "strides": [2, 2]}, (3, 2, 3, 3)),
    "conv_lower_s2_k4": ("Conv", {"auto_pad": "SAME_LOWER", "strides": [2, 2]}, (3, 2, 4, 4)),
    "conv_upper_group": ("Conv", {"auto_pad": "SAME_UPPER", "strides": [1, 2], "group": 2}, (4, 1, 3, 2)),
    "conv_upper_k1_s3": ("Conv", {"auto_pad": "SAME_UPPER", "strides": [3, 3]}, (3, 2, 1, 1)),
    "conv_lower_k2_s3": ("Conv", {"auto_pad": "SAME_LOWER", "strides": [3, 2], "kernel_shape": [2, 2]},
                         (3, 2, 2, 2)),
    "conv_valid_pads_ignored": ("Conv", {"auto_pad": "VALID", "strides": [2, 2]}, (3, 2, 3, 3)),
    "max_upper": ("MaxPool", {"auto_pad": "SAME_UPPER", "kernel_shape": [3, 3], "strides": [2, 2]}, None),
    "max_lower_ceil": ("MaxPool", {"auto_pad": "SAME_LOWER", "kernel_shape": [2, 3], "strides": [2, 2],
                                   "ceil_mode": 1}, None),
    "max_valid": ("MaxPool", {"auto_pad": "VALID", "kernel_shape": [3, 3], "strides": [2, 2]}, None),
    "avg_upper": ("AveragePool", {"auto_pad": "SAME_UPPER", "kernel_shape": [3, 3], "strides": [2, 2]}, None),
    "avg_lower_include": ("AveragePool", {"auto_pad": "SAME_LOWER", "kernel_shape": [2, 3], "strides": [2, 2],
                                          "count_include_pad": 1}, None),
    "avg_upper_include_s1": ("AveragePool", {"auto_pad": "SAME_UPPER", "kernel_shape": [3, 2],
                                             "count_include_pad": 1}, None),
    "avg_valid": ("AveragePool", {"auto_pad": "VALID", "kernel_shape": [3, 3], "strides": [2, 2]}, None),
}
OPSETS = {"Conv": (11, 22), "MaxPool": (8, 12, 22), "AveragePool": (10, 11, 19, 22)}


@pytest.mark.parametrize("case", sorted(AUTO_PAD_CASES))
def test_auto_pad_matches_onnxruntime_at_two_sizes(case: str) -> None:
    op, attrs, wshape = AUTO_PAD_CASES[case]
    for opset in OPSETS[op]:
        if op == "MaxPool" and opset < 10 and "ceil_mode" in attrs:
            continue
        consts = {"w": _f(*wshape)} if wshape else {}
        model = _dynamic(_model(op, opset, {"x": _f(1, 2, 9, 11)}, consts, **attrs))
        gm = load_onnx(model)
        for shape in [(1, 2, 9, 11), (2, 2, 14, 7), (1, 2, 5, 6)]:
            x = _f(*shape)
            with torch.no_grad():
                got = gm(torch.from_numpy(x)).numpy()
            for level in LEVELS:
                _assert_same([got], _ort(model, [x], level))


@pytest.mark.parametrize("opset", [11, 22])
@pytest.mark.parametrize("attrs", [
    {"auto_pad": "SAME_UPPER", "strides": [2, 2]}, {"auto_pad": "SAME_LOWER", "strides": [2, 2]},
    {"auto_pad": "SAME_UPPER", "strides": [2, 3], "output_padding": [1, 0]},
    {"auto_pad": "SAME_LOWER", "strides": [3, 3], "dilations": [2, 1]},
    {"auto_pad": "VALID", "strides": [2, 2]},
])
def test_conv_transpose_auto_pad_at_two_sizes(opset: int, attrs: dict) -> None:
    w, b = _f(2, 3, 3, 3), _f(3)
    model = _dynamic(_model("ConvTranspose", opset, {"x": _f(1, 2, 5, 4)}, {"w": w, "b": b}, **attrs))
    gm = load_onnx(model)
    for shape in [(1, 2, 5, 4), (2, 2, 3, 7)]:
        x = _f(*shape)
        with torch.no_grad():
            got = gm(torch.from_numpy(x)).numpy()
        for level in LEVELS:
            _assert_same([got], _ort(model, [x], level), 1e-4)


@pytest.mark.parametrize("op, wshape", [("Conv", (3, 2, 2, 2)), ("MaxPool", None)])
def test_same_pad_with_dilations_is_refused_naming_the_node(op: str, wshape: tuple | None) -> None:
    """onnxruntime refuses Conv and computes another size than the spec for MaxPool: no reference to match."""
    consts = {"w": _f(*wshape)} if wshape else {}
    model = _model(op, 12, {"x": _f(1, 2, 9, 11)}, consts, kernel_shape=[2, 2], dilations=[2, 2],
                   auto_pad="SAME_LOWER")
    with pytest.raises(fxq.FxqError, match=f"{op}_0.*dilations"):
        load_onnx(model)


def test_max_pool_indices_with_same_pad_is_refused_naming_the_node() -> None:
    model = _model("MaxPool", 12, {"x": _f(1, 2, 6, 6)}, {}, n_out=2, kernel_shape=[3, 3], auto_pad="SAME_UPPER")
    with pytest.raises(fxq.FxqError, match="MaxPool_0.*Indices with auto_pad"):
        load_onnx(model)


# --------------------------------------------------------------------------------------------------- Resize
@pytest.mark.parametrize("opset", [18, 19])
@pytest.mark.parametrize("mode, ctm, exclude, cubic_a", [
    ("linear", None, 0, None), ("linear", "align_corners", 0, None), ("linear", "asymmetric", 0, None),
    ("cubic", None, 0, None), ("cubic", "pytorch_half_pixel", 1, -0.5), ("cubic", "align_corners", 0, -0.5),
    ("nearest", None, 0, None),
])
@pytest.mark.parametrize("scales", [(0.5, 0.4), (0.7, 1.6), (0.34, 0.25), (2.0, 1.5)])
def test_resize_antialias(opset: int, mode: str, ctm: str | None, exclude: int, cubic_a: float | None,
                          scales: tuple[float, float]) -> None:
    attrs: dict = {"mode": mode, "antialias": 1}
    if ctm:
        attrs["coordinate_transformation_mode"] = ctm
    if exclude:
        attrs["exclude_outside"] = exclude
    if cubic_a is not None:
        attrs["cubic_coeff_a"] = cubic_a
    x = _f(1, 2, 9, 11)
    consts = {"roi": np.zeros(0, np.float32), "scales": np.array([1, 1, *scales], np.float32)}
    model = _model("Resize", opset, {"x": x}, consts, **attrs)
    if mode != "nearest":
        _check(model, [x], tol=1e-5)
        return
    # ONNX: antialias changes linear and cubic only; onnxruntime refuses it on nearest: compare with antialias=0
    plain = _model("Resize", opset, {"x": x}, consts, **{**attrs, "antialias": 0})
    got = _ours(model, [x])
    for level in LEVELS:
        _assert_same(got, _ort(plain, [x], level))


def test_resize_antialias_with_sizes_and_axes() -> None:
    x = _f(2, 3, 10, 12)
    model = _model("Resize", 18, {"x": x}, {"roi": np.zeros(0, np.float32), "scales": np.zeros(0, np.float32),
                                             "sizes": np.array([4, 5], np.int64)}, mode="linear", antialias=1,
                   axes=[-1, 2])
    _check(model, [x])


def test_resize_antialias_with_tf_crop_and_resize_is_refused() -> None:
    model = _model("Resize", 18, {"x": _f(1, 1, 8, 8)}, {"roi": np.array([0, 0, .1, .1, 1, 1, .9, .9], np.float32),
                                                        "scales": np.array([1, 1, .5, .5], np.float32)},
                   mode="linear", antialias=1, coordinate_transformation_mode="tf_crop_and_resize")
    with pytest.raises(fxq.FxqError, match="Resize_0.*antialias"):
        load_onnx(model)


# ------------------------------------------------------------------------------------ Unique, Compress, ...
def _unique_reference(x: np.ndarray, axis: int | None, sorted_: bool) -> list[np.ndarray]:
    y, first, inverse, counts = np.unique(x, return_index=True, return_inverse=True, return_counts=True, axis=axis)
    if not sorted_:
        order = np.argsort(first)
        rank = np.argsort(order)
        y = np.take(y, order, axis=0 if axis is None else axis)
        first, counts, inverse = first[order], counts[order], rank[inverse.reshape(-1)]
    return [y.astype(np.float64), first, inverse.reshape(-1), counts]


@pytest.mark.parametrize("sorted_", [None, 1, 0])
@pytest.mark.parametrize("axis", [None, 0, -1])
def test_unique(sorted_: int | None, axis: int | None) -> None:
    x = np.array([[2, 1, 2, 1], [3, 0, 3, 0], [2, 1, 2, 1]], np.float32)
    attrs = {k: v for k, v in (("sorted", sorted_), ("axis", axis)) if v is not None}
    model = _model("Unique", 11, {"x": x}, {}, n_out=4, **attrs)
    ref = _unique_reference(x, None if axis is None else axis % 2, sorted_ != 0)
    got = _check(model, [x])
    for g, r in zip(got, ref):
        np.testing.assert_array_equal(g, r.astype(g.dtype))


@pytest.mark.parametrize("opset", [9, 11])
@pytest.mark.parametrize("axis, cond", [(None, [1, 0, 1, 1, 0, 0, 1]), (0, [0, 1, 1]), (1, [1, 0]),
                                        (-1, [False, True, True, False]), (0, [1, 0])])
def test_compress(opset: int, axis: int | None, cond: list) -> None:
    if axis is not None and axis < 0 and opset < 11:
        pytest.skip("negative axis came with Compress-11")
    x = _f(3, 4)
    c = np.array(cond, bool)
    model = _model("Compress", opset, {"x": x}, {"c": c}, **({} if axis is None else {"axis": axis}))
    model.graph.output[0].type.tensor_type.elem_type = TensorProto.FLOAT  # onnx infers no type for Compress-9
    ref = np.compress(c, x, axis=axis).astype(np.float64)
    _check(model, [x], [ref])


@pytest.mark.parametrize("batch_axis, time_axis", [(None, None), (0, 1), (1, 0)])
def test_reverse_sequence(batch_axis: int | None, time_axis: int | None) -> None:
    b_ax = 1 if batch_axis is None else batch_axis
    x = _f(4, 4, 2) if b_ax == 1 else _f(4, 4, 2)
    lens = np.array([4, 1, 3, 2], np.int64)
    attrs = {k: v for k, v in (("batch_axis", batch_axis), ("time_axis", time_axis)) if v is not None}
    model = _model("ReverseSequence", 10, {"x": x}, {"lens": lens}, **attrs)
    ref = x.astype(np.float64).copy()
    for b, n in enumerate(lens):
        if b_ax == 1:
            ref[:n, b] = x[:n, b][::-1]
        else:
            ref[b, :n] = x[b, :n][::-1]
    _check(model, [x], [ref])


@pytest.mark.parametrize("mode", [None, "nearest", "linear"])
@pytest.mark.parametrize("scales", [[1.0, 1.0, 2.0, 3.0], [1.0, 1.0, 1.5, 2.5], [1.0, 2.0, 1.0, 1.0]])
def test_upsample_7(mode: str | None, scales: list[float]) -> None:
    x = _f(1, 2, 3, 4)
    model = _model("Upsample", 7, {"x": x}, {}, scales=scales, **({} if mode is None else {"mode": mode}))
    _check(model, [x])


@pytest.mark.parametrize("shape, axes", [([3, 6], [0, 1]), ([6, 2], [-3, -2]), ([1, 4, 5], None), ([5], [2])])
def test_center_crop_pad(shape: list[int], axes: list[int] | None) -> None:
    x = _f(5, 4, 2)
    model = _model("CenterCropPad", 18, {"x": x}, {"shape": np.array(shape, np.int64)},
                   **({} if axes is None else {"axes": axes}))
    ref = onnx.reference.ReferenceEvaluator(model).run(None, {"x": x})[0].astype(np.float64)
    _check(model, [x], [ref])


# ---------------------------------------------------------------------------------- save / load, exports
def _round_trip(gm: torch.fx.GraphModule, xs: list[torch.Tensor], path) -> None:
    fxq.save(gm, path)
    back = fxq.load(path)
    with torch.no_grad():
        want, got = gm(*xs), back(*xs)
    for w, g in zip(want if isinstance(want, tuple) else (want,), got if isinstance(got, tuple) else (got,)):
        torch.testing.assert_close(g, w)


def test_new_modules_save_and_load(tmp_path) -> None:
    x = _f(1, 2, 9, 11)
    models = {
        "same_conv": _model("Conv", 11, {"x": x}, {"w": _f(3, 2, 3, 3)}, auto_pad="SAME_UPPER", strides=[2, 2]),
        "same_avg": _model("AveragePool", 11, {"x": x}, {}, kernel_shape=[3, 3], auto_pad="SAME_LOWER"),
        "convt_crop": _model("ConvTranspose", 11, {"x": x}, {"w": _f(2, 3, 3, 3)}, auto_pad="SAME_UPPER",
                             strides=[2, 2]),
        "resize_aa": _model("Resize", 18, {"x": x}, {"roi": np.zeros(0, np.float32),
                                                     "s": np.array([1, 1, .5, .5], np.float32)},
                            mode="linear", antialias=1),
        "upsample7": _model("Upsample", 7, {"x": x}, {}, scales=[1.0, 1.0, 2.0, 2.0]),
        "scatter": _model("ScatterElements", 18, {"x": x}, {"i": np.zeros((1, 2, 1, 11), np.int64),
                                                           "u": _f(1, 2, 1, 11)}, axis=2, reduction="max"),
        "gather_nd": _model("GatherND", 12, {"x": x}, {"i": np.array([[[1, -1]]], np.int64)}, batch_dims=1),
        "unique": _model("Unique", 11, {"x": x}, {}, n_out=4),
        "compress": _model("Compress", 11, {"x": x}, {"c": np.array([1, 0, 1], bool)}, axis=2),
        "reverse": _model("ReverseSequence", 10, {"x": x[0, 0]}, {"l": np.array([1] * 11, np.int64)}),
        "crop_pad": _model("CenterCropPad", 18, {"x": x}, {"s": np.array([4, 13], np.int64)}, axes=[2, 3]),
    }
    for name, model in models.items():
        xs = [torch.from_numpy(np.random.default_rng(1).standard_normal(
            [d.dim_value for d in i.type.tensor_type.shape.dim]).astype(np.float32)) for i in model.graph.input]
        _round_trip(load_onnx(model), xs, tmp_path / f"{name}.fxq")


def _ort_file(path, x: np.ndarray, disable: bool) -> np.ndarray:
    opts = ort.SessionOptions()
    if disable:
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    return sess.run(None, {sess.get_inputs()[0].name: x})[0]


def _cosine(a: np.ndarray, b: torch.Tensor) -> float:
    return F.cosine_similarity(torch.from_numpy(a).flatten().double(), b.flatten().double(), dim=0).item()


def _export_and_compare(model: onnx.ModelProto, calib: tuple, sizes: list[tuple], tmp_path,
                        input_shapes: dict | None = None) -> onnx.ModelProto:
    src = tmp_path / "src.onnx"
    onnx.save(model, str(src))
    gm = fxq.load_onnx(src, input_shapes=input_shapes)
    torch.manual_seed(0)
    q = fxq.quantize(gm, [torch.randn(*calib) for _ in range(3)], platform="trt_int8", progress=False)
    out = next(p for p in fxq.export(q, "trt_int8", tmp_path / "q") if str(p).endswith(".onnx"))
    exported = onnx.load(str(out))
    assert {n.domain for n in exported.graph.node} <= {"", "ai.onnx"}
    for op in {n.op_type for n in exported.graph.node}:
        onnx.defs.get_schema(op, domain="")  # a standard ONNX op
    for shape in sizes:
        x = torch.randn(*shape)
        with torch.no_grad():
            ref = q(x)
        for disable in (False, True):
            got = _ort_file(out, x.numpy(), disable)
            assert got.shape == tuple(ref.shape) and _cosine(got, ref) >= 0.999, (shape, disable)
    return exported


def test_auto_pad_model_exports_to_trt_int8_at_two_sizes(tmp_path) -> None:
    rng = np.random.default_rng(0)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, "H", "W"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    inits = [numpy_helper.from_array((rng.standard_normal((8, 3, 3, 3)) * 0.3).astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "b"),
             numpy_helper.from_array((rng.standard_normal((8, 8, 2, 2)) * 0.3).astype(np.float32), "w2"),
             numpy_helper.from_array((rng.standard_normal((8, 8, 1, 1)) * 0.3).astype(np.float32), "w3")]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], auto_pad="SAME_UPPER", strides=[2, 2], name="conv"),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("MaxPool", ["r"], ["p"], kernel_shape=[3, 3], strides=[2, 2], auto_pad="SAME_LOWER",
                              name="pool"),
             helper.make_node("Conv", ["p", "w2"], ["c2"], auto_pad="SAME_LOWER", name="conv2"),
             # kernel 1 < stride 2: ONNX's total pad max(0, -1) at even sizes (a floor division in the export)
             helper.make_node("Conv", ["c2", "w3"], ["c3"], auto_pad="SAME_UPPER", strides=[2, 2], name="conv3"),
             helper.make_node("AveragePool", ["c3"], ["y"], kernel_shape=[3, 3], strides=[2, 2],
                              auto_pad="SAME_UPPER", name="avg")]
    model = helper.make_model(helper.make_graph(nodes, "g", [x], [y], inits),
                              opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = ORT_MAX_IR
    exported = _export_and_compare(model, (2, 3, 17, 17), [(2, 3, 17, 17), (1, 3, 20, 13), (3, 3, 8, 31),
                                                           (1, 3, 40, 36)],
                                   tmp_path, input_shapes={"x": [2, 3, 17, 17]})
    dims = exported.graph.input[0].type.tensor_type.shape.dim
    assert [d.HasField("dim_param") for d in dims] == [True, False, True, True]
    by_output = {o: n for n in exported.graph.node for o in n.output}
    convs = [n for n in exported.graph.node if n.op_type == "Conv"]
    assert len(convs) == 3 and all(by_output[c.input[1]].op_type == "DequantizeLinear" for c in convs)


def test_scatter_elements_model_exports_to_trt_int8(tmp_path) -> None:
    rng = np.random.default_rng(0)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 8, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    idx = np.stack([rng.permutation(8)[:4] - 4 for _ in range(2 * 3 * 8)]).reshape(2, 3, 8, 4).astype(np.int64)
    inits = [numpy_helper.from_array((rng.standard_normal((3, 3, 3, 3)) * 0.3).astype(np.float32), "w"),
             numpy_helper.from_array(idx, "idx"),
             numpy_helper.from_array(rng.standard_normal((2, 3, 8, 4)).astype(np.float32), "upd")]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1], name="conv"),
             helper.make_node("ScatterElements", ["c", "idx", "upd"], ["s"], axis=-1, reduction="add",
                              name="scatter"),
             helper.make_node("Relu", ["s"], ["y"], name="relu")]
    model = helper.make_model(helper.make_graph(nodes, "g", [x], [y], inits),
                              opset_imports=[helper.make_opsetid("", 16)])
    model.ir_version = ORT_MAX_IR
    exported = _export_and_compare(model, (2, 3, 8, 8), [(2, 3, 8, 8)], tmp_path)
    assert "ScatterElements" in {n.op_type for n in exported.graph.node}


@pytest.mark.parametrize("case", ["same_max_k1_s2", "same_avg", "center_crop_pad", "gather_nd", "reverse_sequence",
                                  "compress", "scatter"])
def test_torch_onnx_export_of_new_modules_runs_at_other_sizes(tmp_path, case: str) -> None:
    """fxq's exporters write these modules through torch.onnx: the file, with dynamic dims, computes what the
    module computes at sizes other than the traced one (pads and crops from Shape arithmetic)."""
    from fxq.backends.qdq.lowering import torch_onnx_export

    x = _f(2, 3, 6, 7)
    model = {
        "same_max_k1_s2": _model("MaxPool", 12, {"x": x}, {}, kernel_shape=[1, 1], strides=[2, 3],
                                 auto_pad="SAME_LOWER"),
        "same_avg": _model("AveragePool", 11, {"x": x}, {}, kernel_shape=[3, 2], strides=[2, 2], auto_pad="SAME_UPPER"),
        "center_crop_pad": _model("CenterCropPad", 18, {"x": x}, {"s": np.array([5, 6], np.int64)}, axes=[-2, -1]),
        "gather_nd": _model("GatherND", 13, {"x": x}, {"i": np.array([[[1, -1]], [[0, 2]]], np.int64)}, batch_dims=1),
        "reverse_sequence": _model("ReverseSequence", 10, {"x": x}, {"l": np.array([2, 1, 2], np.int64)}),
        "compress": _model("Compress", 11, {"x": x}, {"c": np.array([1, 0, 1], bool)}, axis=1),
        "scatter": _model("ScatterElements", 13, {"x": x}, {"i": -np.ones((2, 3, 1, 7), np.int64),
                                                           "u": _f(2, 3, 1, 7)}, axis=2),
    }[case]
    gm = load_onnx(model)
    path = tmp_path / f"{case}.onnx"
    dims = {"x": {2: "h", 3: "w"}} if case not in ("gather_nd", "reverse_sequence", "scatter") else {"x": {3: "w"}}
    torch_onnx_export(gm, (torch.from_numpy(x),), str(path), opset=17, input_names=["x"], output_names=["y"],
                      dynamic_axes=dims)
    for shape in [(2, 3, 6, 7), (2, 3, 9, 4) if 2 in dims["x"] else (2, 3, 6, 10)]:
        xs = _f(*shape)
        with torch.no_grad():
            want = gm(torch.from_numpy(xs)).numpy()
        for disable in (False, True):
            np.testing.assert_allclose(_ort_file(path, xs, disable), want, rtol=1e-6, atol=1e-6)
