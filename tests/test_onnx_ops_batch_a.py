"""ONNX ops onnx2torch 1.5.15 lacks and fxq converts (batch A): Trilu, Hardmax, OneHot, LpNormalization,
GlobalLpPool, LpPool, GroupNormalization, MeanVarianceNormalization, GridSample.

Each is loaded with load_onnx and run against onnxruntime (default session and ORT_DISABLE_ALL) and, where cheap, a
float64 numpy reference written here from the op's definition. Attribute sets include the attribute left out, so a
converter reading a missing attribute with the wrong default fails. Three small graphs with a MatMul or Conv go
through quantize -> export (trt_int8) and the exported file runs in onnxruntime as fxq's simulation does."""
from __future__ import annotations

import io

import numpy as np
import onnx
import pytest
import torch
from onnx import helper, numpy_helper
from test_onnx_op_semantics import LEVELS, ORT_MAX_IR, _assert_same, _ort, _ours
from test_onnx_op_semantics import _model as _one_node_model

import fxq
from fxq.backends.qdq.lowering import torch_onnx_export
from fxq.frontends.onnx import load_onnx

ort = pytest.importorskip("onnxruntime")

RNG = np.random.default_rng(0)


def _model(op: str, opset: int, inputs: dict[str, np.ndarray], consts: dict[str, np.ndarray], **attrs
           ) -> onnx.ModelProto:
    """One ``op`` node; an output onnx's shape inference leaves untyped (ops defined as functions) is typed as the
    first input."""
    model = _one_node_model(op, opset, inputs, consts, **attrs)
    first = helper.np_dtype_to_tensor_dtype(next(iter(inputs.values())).dtype)
    for out in model.graph.output:
        if not out.type.tensor_type.elem_type:
            out.type.tensor_type.elem_type = first
    return model


def _check(model: onnx.ModelProto, xs: list[np.ndarray], reference: np.ndarray | None = None,
           tol: float = 1e-5) -> None:
    """fxq's conversion equals onnxruntime at both optimization levels (and the float64 reference, if given)."""
    got = _ours(model, xs)
    for level in LEVELS:
        _assert_same(got, _ort(model, xs, level), tol)
    if reference is not None:
        assert got[0].shape == reference.shape
        np.testing.assert_allclose(got[0].astype(np.float64), reference, rtol=tol, atol=tol)


def _attrs(**kw) -> dict:
    """The attributes that are not None (None = left out of the node)."""
    return {k: v for k, v in kw.items() if v is not None}


# ------------------------------------------------------------------------------------------------- Trilu
@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.bool_])
@pytest.mark.parametrize("shape", [(5, 6), (2, 3, 6, 4)])
@pytest.mark.parametrize("k", [None, -2, 0, 1, 9])
@pytest.mark.parametrize("upper", [None, 0, 1])
def test_trilu(upper, k, shape, dtype) -> None:
    x = (RNG.standard_normal(shape) * 10).astype(dtype)
    consts = {} if k is None else {"k": np.array(k, np.int64)}
    want = (np.tril if upper == 0 else np.triu)(x.astype(np.float64), 0 if k is None else k)
    _check(_model("Trilu", 14, {"x": x}, consts, **_attrs(upper=upper)), [x], want)


def test_trilu_k_computed_at_run_time() -> None:
    x = RNG.standard_normal((2, 4, 5)).astype(np.float32)
    model = _model("Trilu", 14, {"x": x, "k": np.array(0, np.int64)}, {}, upper=0)
    gm = load_onnx(model, verify=False)
    for k in (-1, 2):
        kk = np.array(k, np.int64)
        got = gm(torch.from_numpy(x), torch.from_numpy(kk)).numpy()
        for level in LEVELS:
            _assert_same([got], _ort(model, [x, kk], level))


# ----------------------------------------------------------------------------------------------- Hardmax
def _hardmax_reference(x: np.ndarray, axis: int, coerce_2d: bool) -> np.ndarray:
    axis %= x.ndim
    if coerce_2d:
        rows = x.reshape(int(np.prod(x.shape[:axis])), -1)
        out = np.zeros(rows.shape)
        out[np.arange(rows.shape[0]), rows.argmax(1)] = 1  # argmax: the first maximum
        return out.reshape(x.shape)
    moved = np.moveaxis(x, axis, -1)
    out = np.zeros(moved.shape)
    np.put_along_axis(out, moved.argmax(-1)[..., None], 1, -1)
    return np.moveaxis(out, -1, axis)


@pytest.mark.parametrize("axis", [None, 0, 1, 2, -1])
@pytest.mark.parametrize("opset", [1, 11, 13])
def test_hardmax(opset, axis) -> None:
    """Before 13 the input is seen as 2-D at ``axis`` (default 1); from 13 one axis (default -1). Ties: the first."""
    x = RNG.integers(-3, 4, (2, 3, 4)).astype(np.float32)  # small integers: many ties
    if opset == 1 and axis == -1:
        pytest.skip("negative axes arrive in Hardmax-11")
    want_axis = axis if axis is not None else (1 if opset < 13 else -1)
    want = _hardmax_reference(x, want_axis, opset < 13)
    _check(_model("Hardmax", opset, {"x": x}, {}, **_attrs(axis=axis)), [x], want)


# ------------------------------------------------------------------------------------------------ OneHot
def _one_hot_reference(indices: np.ndarray, depth: int, values: np.ndarray, axis: int) -> np.ndarray:
    idx = indices.astype(np.int64)
    idx = np.where(idx < 0, idx + depth, idx)
    out = np.where(idx[..., None] == np.arange(depth), values[1], values[0]).astype(np.float64)
    return np.moveaxis(out, -1, axis)


@pytest.mark.parametrize("axis", [None, 0, 1, -1, -3])
@pytest.mark.parametrize("opset", [9, 11, 28])
def test_one_hot(opset, axis) -> None:
    """Negative indices count from depth; indices out of [-depth, depth - 1] give the off value only."""
    indices = np.array([[0, 2, -1], [5, -4, 1], [-5, 3, 3]], np.int64)
    values = np.array([-2, 7], np.float32)
    model = _model("OneHot", opset, {"i": indices}, {"depth": np.array(4, np.int64), "values": values},
                   **_attrs(axis=axis))
    _check(model, [indices], _one_hot_reference(indices, 4, values, -1 if axis is None else axis))


def test_one_hot_types_and_run_time_inputs() -> None:
    """Float indices with a one-element depth and int64 values, or with float depth and values; depth and values
    computed at run time."""
    indices = np.array([1.0, -1.0, 2.0, 7.0], np.float32)
    model = _model("OneHot", 11, {"i": indices}, {"depth": np.array([3], np.int64),
                                                  "values": np.array([0, 5], np.int64)}, axis=0)
    _check(model, [indices], _one_hot_reference(indices, 3, np.array([0, 5]), 0))
    model = _model("OneHot", 11, {"i": indices}, {"depth": np.array(3.0, np.float32),
                                                  "values": np.array([0.5, 5], np.float32)}, axis=0)
    _check(model, [indices], _one_hot_reference(indices, 3, np.array([0.5, 5]), 0))
    ints = indices.astype(np.int64)
    depth, values = np.array(3, np.int64), np.array([1.5, -1.0], np.float32)
    model = _model("OneHot", 11, {"i": ints, "depth": depth, "values": values}, {})
    gm = load_onnx(model, verify=False)
    got = gm(*(torch.from_numpy(v) for v in (ints, depth, values))).numpy()
    for level in LEVELS:
        _assert_same([got], _ort(model, [ints, depth, values], level))


# ---------------------------------------------------------------------------------------- LpNormalization
@pytest.mark.parametrize("axis", [None, 0, 1, -2])
@pytest.mark.parametrize("p", [None, 1, 2])
@pytest.mark.parametrize("opset", [1, 22])
def test_lp_normalization(opset, p, axis) -> None:
    """A zero norm gives zeros, as in onnxruntime."""
    x = RNG.standard_normal((2, 3, 4)).astype(np.float32)
    x[0, 1] = 0
    x[:, :, 2] = 0
    pp, ax = p or 2, -1 if axis is None else axis
    norm = (np.abs(x.astype(np.float64)) ** pp).sum(ax, keepdims=True) ** (1 / pp)
    want = x / np.where(norm == 0, 1, norm)
    _check(_model("LpNormalization", opset, {"x": x}, {}, **_attrs(p=p, axis=axis)), [x], want)


def test_lp_normalization_refuses_other_p() -> None:
    x = np.ones((2, 3), np.float32)
    with pytest.raises(fxq.FxqError, match="LpNormalization.*p=3"):
        load_onnx(_model("LpNormalization", 22, {"x": x}, {}, p=3))


# ------------------------------------------------------------------------------------------ GlobalLpPool
@pytest.mark.parametrize("p", [None, 1, 2, 3])
@pytest.mark.parametrize("opset", [1, 2, 22])
@pytest.mark.parametrize("shape", [(2, 3, 5, 6), (2, 3, 7), (1, 2, 3, 4, 2)])
def test_global_lp_pool(shape, opset, p) -> None:
    """Version 1's p is a float attribute, later ones an int; onnxruntime runs version 2 only (numpy checks all)."""
    x = RNG.standard_normal(shape).astype(np.float32)
    attrs = {} if p is None else {"p": float(p) if opset == 1 else p}
    model = _model("GlobalLpPool", opset, {"x": x}, {}, **attrs)
    pp = p or 2
    want = (np.abs(x.astype(np.float64)) ** pp).sum(tuple(range(2, x.ndim)), keepdims=True) ** (1 / pp)
    if opset == 2:
        _check(model, [x], want)
    else:
        np.testing.assert_allclose(_ours(model, [x])[0], want, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------ LpPool
POOL_CASES = [
    dict(kernel_shape=[3, 2]),
    dict(kernel_shape=[3, 3], strides=[2, 2]),
    dict(kernel_shape=[2, 3], pads=[1, 0, 0, 2], strides=[2, 1]),
    dict(kernel_shape=[3, 3], auto_pad="SAME_UPPER", strides=[2, 2]),
    dict(kernel_shape=[2, 2], auto_pad="SAME_LOWER"),
    dict(kernel_shape=[2, 4], auto_pad="SAME_LOWER", strides=[3, 2]),
    dict(kernel_shape=[1, 1], auto_pad="SAME_UPPER", strides=[3, 4]),
    dict(kernel_shape=[3, 3], auto_pad="VALID", strides=[2, 2]),
]
POOL_CASES_18 = [
    dict(kernel_shape=[3, 2], dilations=[2, 2]),
    dict(kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1),
    dict(kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1, pads=[1, 1, 1, 1]),
    dict(kernel_shape=[3, 3], strides=[3, 2], ceil_mode=1, dilations=[2, 1], pads=[0, 1, 2, 0]),
    dict(kernel_shape=[3, 3], auto_pad="VALID", strides=[2, 2], ceil_mode=1),
]
LP_POOL = [(opset, c) for opset in (2, 11, 18, 22) for c in POOL_CASES + (POOL_CASES_18 if opset >= 18 else [])]


@pytest.mark.parametrize("p", [None, 1, 3])
@pytest.mark.parametrize("opset,case", LP_POOL, ids=[f"{o}-{i}" for i, (o, _) in enumerate(LP_POOL)])
def test_lp_pool(opset, case, p) -> None:
    x = RNG.standard_normal((2, 3, 7, 9)).astype(np.float32)
    _check(_model("LpPool", opset, {"x": x}, {}, **case, **_attrs(p=p)), [x])


@pytest.mark.parametrize("shape,case", [
    ((2, 3, 7), dict(kernel_shape=[3], strides=[2], ceil_mode=1)),
    ((1, 2, 5, 6, 4), dict(kernel_shape=[2, 3, 2], strides=[2, 2, 1], pads=[1, 0, 0, 0, 1, 1])),
])
def test_lp_pool_1d_and_3d(shape, case) -> None:
    x = RNG.standard_normal(shape).astype(np.float32)
    _check(_model("LpPool", 18, {"x": x}, {}, **case), [x])


def test_lp_pool_version_1_float_p() -> None:
    """LpPool-1 (p a float attribute): against a float64 window sum (onnxruntime has no version-1 kernel)."""
    x = RNG.standard_normal((1, 2, 4, 5)).astype(np.float32)
    got = _ours(_model("LpPool", 1, {"x": x}, {}, kernel_shape=[2, 3], p=3.0), [x])[0]
    x64 = np.abs(x.astype(np.float64)) ** 3
    want = np.array([[[[x64[n, c, i:i + 2, j:j + 3].sum() for j in range(3)] for i in range(3)]
                      for c in range(2)] for n in range(1)]) ** (1 / 3)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("auto_pad", ["SAME_UPPER", "SAME_LOWER"])
def test_lp_pool_same_pads_follow_the_input_size(auto_pad) -> None:
    """A graph loaded with open spatial dims gives onnxruntime's results on inputs of several sizes."""
    x = RNG.standard_normal((1, 2, 7, 9)).astype(np.float32)
    model = _model("LpPool", 18, {"x": x}, {}, kernel_shape=[3, 2], strides=[2, 3], auto_pad=auto_pad)
    dims = model.graph.input[0].type.tensor_type.shape.dim
    for d, name in zip(dims[2:], ("h", "w")):
        d.ClearField("dim_value")
        d.dim_param = name
    del model.graph.output[0].type.tensor_type.shape.dim[:]
    gm = load_onnx(model)
    for shape in ((1, 2, 7, 9), (1, 2, 8, 4), (1, 2, 5, 11)):
        xs = RNG.standard_normal(shape).astype(np.float32)
        got = gm(torch.from_numpy(xs)).numpy()
        for level in LEVELS:
            _assert_same([got], _ort(model, [xs], level))


def test_lp_pool_same_with_dilations_is_refused() -> None:
    """onnxruntime pads SAME for the undilated kernel (not the spec's output size): refused, naming the fix."""
    x = np.ones((1, 1, 7, 7), np.float32)
    model = _model("LpPool", 18, {"x": x}, {}, kernel_shape=[3, 3], auto_pad="SAME_UPPER", dilations=[2, 2])
    with pytest.raises(fxq.FxqError, match="LpPool.*SAME_UPPER.*dilations.*explicit pads"):
        load_onnx(model)


# ------------------------------------------------------------------------------------ GroupNormalization
def _group_norm_reference(x: np.ndarray, groups: int, scale: np.ndarray, bias: np.ndarray, eps: float
                          ) -> np.ndarray:
    x64 = x.astype(np.float64).reshape(x.shape[0], groups, -1)
    y = (x64 - x64.mean(-1, keepdims=True)) / np.sqrt(x64.var(-1, keepdims=True) + eps)
    shape = (1, -1) + (1,) * (x.ndim - 2)
    return y.reshape(x.shape) * scale.reshape(shape) + bias.reshape(shape)


@pytest.mark.parametrize("eps", [None, 0.1])
@pytest.mark.parametrize("groups", [1, 2, 3, 6])
@pytest.mark.parametrize("opset", [18, 21])
def test_group_normalization(opset, groups, eps) -> None:
    """18: scale and bias per group (repeated over its channels); 21: per channel. Data of variance ~1e-4, so
    that epsilon (default 1e-5) shows."""
    x = (RNG.standard_normal((2, 6, 4, 5)) * 0.01 + 0.02).astype(np.float32)
    n = groups if opset == 18 else 6
    scale, bias = RNG.standard_normal(n).astype(np.float32), RNG.standard_normal(n).astype(np.float32)
    per_channel = (scale, bias) if opset == 21 else (np.repeat(scale, 6 // groups), np.repeat(bias, 6 // groups))
    want = _group_norm_reference(x, groups, *per_channel, 1e-5 if eps is None else eps)
    model = _model("GroupNormalization", opset, {"x": x}, {"scale": scale, "bias": bias},
                   **_attrs(num_groups=groups, epsilon=eps))
    _check(model, [x], want, tol=2e-5)


@pytest.mark.parametrize("stash_type", [None, 1, 10])
def test_group_normalization_float16(stash_type) -> None:
    """float16 data (values near 300: squares overflow float16) with stash_type left out (float32), float32 and
    float16."""
    x = (RNG.standard_normal((2, 4, 30)) * 50 + 300).astype(np.float16)
    scale, bias = RNG.standard_normal(4).astype(np.float16), RNG.standard_normal(4).astype(np.float16)
    model = _model("GroupNormalization", 21, {"x": x}, {"scale": scale, "bias": bias}, num_groups=2,
                   **_attrs(stash_type=stash_type))
    want = _group_norm_reference(x, 2, scale.astype(np.float64), bias.astype(np.float64), 1e-5)
    _check(model, [x], want, tol=4e-3)


@pytest.mark.parametrize("opset", [18, 21])
def test_group_normalization_with_unknown_channel_count(opset) -> None:
    """The channel count unknown when loading (18's per-group scale is repeated when called), 3-D input."""
    x = RNG.standard_normal((2, 6, 5)).astype(np.float32)
    n = 3 if opset == 18 else 6
    scale, bias = RNG.standard_normal(n).astype(np.float32), RNG.standard_normal(n).astype(np.float32)
    model = _model("GroupNormalization", opset, {"x": x}, {"scale": scale, "bias": bias}, num_groups=3,
                   **({"stash_type": 1} if opset == 21 else {}))
    for d, name in zip(model.graph.input[0].type.tensor_type.shape.dim, ("n", "c", "l")):
        d.ClearField("dim_value")
        d.dim_param = name
    del model.graph.output[0].type.tensor_type.shape.dim[:]
    gm = load_onnx(model)
    got = gm(torch.from_numpy(x)).numpy()
    for level in LEVELS:
        _assert_same([got], _ort(model, [x], level), 2e-5)


# ----------------------------------------------------------------------------- MeanVarianceNormalization
@pytest.mark.parametrize("axes", [None, [1], [2, 3], [0, 1, 2, 3], [-1]])
@pytest.mark.parametrize("opset", [9, 13])
def test_mean_variance_normalization(opset, axes) -> None:
    x = (RNG.standard_normal((2, 3, 4, 5)) * 2 + 3).astype(np.float32)
    ax = tuple(axes or (0, 2, 3))
    x64 = x.astype(np.float64)
    want = (x64 - x64.mean(ax, keepdims=True)) / (x64.std(ax, keepdims=True) + 1e-9)
    _check(_model("MeanVarianceNormalization", opset, {"x": x}, {}, **_attrs(axes=axes)), [x], want, tol=2e-5)


# -------------------------------------------------------------------------------------------- GridSample
def _grids() -> dict[str, np.ndarray]:
    """Random positions (some outside [-1, 1]) and a lattice hitting exact half-pixel ties of nearest rounding."""
    ticks = np.meshgrid(np.linspace(-1, 1, 11), np.linspace(-1, 1, 9))
    return {"random": RNG.uniform(-1.3, 1.3, (2, 4, 7, 2)).astype(np.float32),
            "ties": np.stack(ticks, -1)[None].repeat(2, 0).astype(np.float32)}


GRID_CASES = [(opset, mode, pad, ac)
              for opset in (16, 20, 22)
              for mode in ((None, "bilinear", "nearest", "bicubic") if opset == 16 else (None, "linear", "nearest",
                                                                                           "cubic"))
              for pad in (None, "border", "reflection") for ac in (None, 1)]


@pytest.mark.parametrize("grid", ["random", "ties"])
@pytest.mark.parametrize("opset,mode,pad,ac", GRID_CASES, ids=["-".join(map(str, c)) for c in GRID_CASES])
def test_grid_sample(opset, mode, pad, ac, grid) -> None:
    x = RNG.standard_normal((2, 3, 5, 6)).astype(np.float32)
    g = _grids()[grid]
    model = _model("GridSample", opset, {"x": x, "grid": g}, {}, **_attrs(mode=mode, padding_mode=pad,
                                                                           align_corners=ac))
    _check(model, [x, g], tol=2e-5)


@pytest.mark.parametrize("mode", [None, "nearest"])
@pytest.mark.parametrize("opset", [20, 22])
def test_grid_sample_5d(opset, mode) -> None:
    x = RNG.standard_normal((1, 2, 3, 4, 5)).astype(np.float32)
    g = RNG.uniform(-1.2, 1.2, (1, 2, 3, 4, 3)).astype(np.float32)
    _check(_model("GridSample", opset, {"x": x, "grid": g}, {}, **_attrs(mode=mode)), [x, g], tol=2e-5)


@pytest.mark.parametrize("shape,grid,mode,match", [
    ((1, 2, 3, 4, 5), (1, 2, 3, 4, 3), "cubic", "cubic sampling of a 5-D input"),
    ((1, 2, 6), (1, 4, 1), "linear", "a 3-D input"),
])
def test_grid_sample_refusals_name_the_node(shape, grid, mode, match) -> None:
    x, g = np.zeros(shape, np.float32), np.zeros(grid, np.float32)
    with pytest.raises(fxq.FxqError, match=f"GridSample_0.*{match}"):
        load_onnx(_model("GridSample", 20, {"x": x, "grid": g}, {}, mode=mode))


# ---------------------------------------------------------------------------------- fxq.save / fxq.load
SAVE_CASES = {
    "Trilu": (14, {"x": (2, 5, 5)}, {"k": np.array(1, np.int64)}, {"upper": 0}),
    "Hardmax": (11, {"x": (2, 3, 4)}, {}, {"axis": 1}),
    "OneHot": (11, {"i": (2, 3)}, {"d": np.array(5, np.int64), "v": np.array([0, 3], np.float32)}, {"axis": 1}),
    "LpNormalization": (22, {"x": (2, 3, 4)}, {}, {"p": 1, "axis": 1}),
    "GlobalLpPool": (2, {"x": (2, 3, 4, 4)}, {}, {"p": 3}),
    "LpPool": (18, {"x": (2, 3, 7, 7)}, {}, {"kernel_shape": [3, 2], "auto_pad": "SAME_LOWER", "ceil_mode": 1}),
    "LpPool-dilated": (18, {"x": (2, 3, 7, 7)}, {}, {"kernel_shape": [3, 2], "dilations": [2, 1], "strides": [2, 2],
                                                     "pads": [1, 0, 0, 1], "p": 1}),
    "GroupNormalization": (18, {"x": (2, 4, 3, 3)}, {"s": np.arange(2, dtype=np.float32),
                                                     "b": np.ones(2, np.float32)}, {"num_groups": 2}),
    "MeanVarianceNormalization": (13, {"x": (2, 3, 4, 4)}, {}, {"axes": [1, 2]}),
    "GridSample": (20, {"x": (1, 2, 4, 5), "g": (1, 3, 3, 2)}, {}, {"mode": "cubic", "padding_mode": "border"}),
}


def _save_case(case: str) -> tuple[onnx.ModelProto, list[np.ndarray]]:
    opset, shapes, consts, attrs = SAVE_CASES[case]
    xs = [RNG.integers(-2, 3, s).astype(np.int64) if n == "i" else RNG.uniform(-1, 1, s).astype(np.float32)
          for n, s in shapes.items()]
    return _model(case.split("-")[0], opset, dict(zip(shapes, xs)), consts, **attrs), xs


@pytest.mark.parametrize("op", list(SAVE_CASES))
def test_modules_round_trip_through_fxq_files(tmp_path, op) -> None:
    model, xs = _save_case(op)
    gm = load_onnx(model)
    again = fxq.load(fxq.save(gm, tmp_path / f"{op}.fxq"))
    assert type(dict(again.named_modules())[_converted_name(gm)]) is type(dict(gm.named_modules())[_converted_name(gm)])
    ts = [torch.from_numpy(x) for x in xs]
    with torch.no_grad():
        assert torch.equal(again(*ts), gm(*ts))


@pytest.mark.parametrize("op", list(SAVE_CASES))
def test_modules_export_back_to_standard_onnx(op) -> None:
    """torch.onnx (TorchScript exporter, as fxq's exporters use it) writes each module as standard ONNX ops that
    compute what the module does."""
    model, xs = _save_case(op)
    gm = load_onnx(model)
    buffer = io.BytesIO()
    torch_onnx_export(gm, tuple(torch.from_numpy(x) for x in xs), buffer, opset=17,
                      input_names=[i.name for i in model.graph.input], output_names=["y"])
    again = onnx.load_from_string(buffer.getvalue())
    again.ir_version = min(again.ir_version, ORT_MAX_IR)
    assert {n.domain for n in again.graph.node} <= {"", "ai.onnx"}
    with torch.no_grad():
        want = gm(*(torch.from_numpy(x) for x in xs)).numpy()
    for level in LEVELS:
        _assert_same(_ort(again, xs, level), [want], 1e-5)


def _converted_name(gm: torch.fx.GraphModule) -> str:
    (node,) = [n for n in gm.graph.nodes if n.op == "call_module"]
    return str(node.target)


# ------------------------------------------------------------------------ quantize -> export -> onnxruntime
def _graph_model(nodes: list, inputs: dict[str, tuple[int, ...]], output: str, inits: dict[str, np.ndarray],
                 opset: int) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(k, onnx.TensorProto.FLOAT, list(s)) for k, s in inputs.items()],
        [helper.make_tensor_value_info(output, onnx.TensorProto.FLOAT, None)],
        [numpy_helper.from_array(v, k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = ORT_MAX_IR
    return model


def _attention_with_trilu() -> tuple[onnx.ModelProto, tuple[int, ...]]:
    """Causal self-attention: scores masked by Trilu twice (lower triangle of the scores kept, a Trilu'd constant
    of -1e4 added above the diagonal, as HF masks are built), softmax, then the values."""
    d, t = 8, 6
    w = {f"w{n}": (RNG.standard_normal((d, d)) * 0.4).astype(np.float32) for n in "qkvo"}
    nodes = [helper.make_node("MatMul", ["x", f"w{n}"], [n]) for n in "qkv"] + [
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["q", "kt"], ["s"]),
        helper.make_node("Trilu", ["s"], ["s_low"], upper=0),
        helper.make_node("Trilu", ["neg", "one"], ["mask"]),
        helper.make_node("Add", ["s_low", "mask"], ["masked"]),
        helper.make_node("Softmax", ["masked"], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "v"], ["a"]),
        helper.make_node("MatMul", ["a", "wo"], ["y"]),
    ]
    inits = {**w, "neg": np.full((t, t), -1e4, np.float32), "one": np.array(1, np.int64)}
    return _graph_model(nodes, {"x": (2, t, d)}, "y", inits, 14), (2, t, d)


def _conv_norm_net() -> tuple[onnx.ModelProto, tuple[int, ...]]:
    """Conv -> GroupNormalization-21 -> Relu -> Conv -> LpNormalization over channels."""
    c = 6
    inits = {"w1": (RNG.standard_normal((c, 3, 3, 3)) * 0.3).astype(np.float32),
             "w2": (RNG.standard_normal((4, c, 1, 1)) * 0.3).astype(np.float32),
             "scale": RNG.uniform(0.5, 1.5, c).astype(np.float32), "bias": RNG.uniform(-0.2, 0.2, c).astype(np.float32)}
    nodes = [helper.make_node("Conv", ["x", "w1"], ["a"], pads=[1, 1, 1, 1]),
             helper.make_node("GroupNormalization", ["a", "scale", "bias"], ["b"], num_groups=3),
             helper.make_node("Relu", ["b"], ["r"]),
             helper.make_node("Conv", ["r", "w2"], ["c"]),
             helper.make_node("LpNormalization", ["c"], ["y"], axis=1)]
    return _graph_model(nodes, {"x": (2, 3, 8, 8)}, "y", inits, 21), (2, 3, 8, 8)


def _conv_grid_sample_net() -> tuple[onnx.ModelProto, tuple[int, ...]]:
    """Conv -> GridSample at fixed positions (bilinear, border) -> Conv."""
    inits = {"w1": (RNG.standard_normal((4, 3, 3, 3)) * 0.3).astype(np.float32),
             "w2": (RNG.standard_normal((4, 4, 1, 1)) * 0.3).astype(np.float32),
             "grid": RNG.uniform(-1.1, 1.1, (2, 6, 5, 2)).astype(np.float32)}
    nodes = [helper.make_node("Conv", ["x", "w1"], ["a"], pads=[1, 1, 1, 1]),
             helper.make_node("GridSample", ["a", "grid"], ["b"], padding_mode="border"),
             helper.make_node("Conv", ["b", "w2"], ["y"])]
    return _graph_model(nodes, {"x": (2, 3, 8, 8)}, "y", inits, 20), (2, 3, 8, 8)


@pytest.mark.parametrize("build", [_attention_with_trilu, _conv_norm_net, _conv_grid_sample_net])
def test_quantized_graph_exports_and_runs_in_onnxruntime(tmp_path, build) -> None:
    """load_onnx -> quantize (trt_int8) -> save/load -> export: standard ONNX ops only, and the file computes
    what fxq's simulation does (cosine >= 0.999 at both optimization levels)."""
    model, shape = build()
    torch.manual_seed(0)
    data = [torch.randn(shape) for _ in range(4)]
    q = fxq.quantize(load_onnx(model), data, "trt_int8", progress=False)
    q = fxq.load(fxq.save(q, tmp_path / "q.fxq"))
    path = fxq.export(q, "trt_int8", tmp_path / "q.onnx")[0]
    exported = onnx.load(str(path))
    assert {n.domain for n in exported.graph.node} <= {"", "ai.onnx"}
    assert any(n.op_type == "QuantizeLinear" for n in exported.graph.node)
    x = torch.randn(shape)
    with torch.no_grad():
        want = q(x).numpy().ravel().astype(np.float64)
    for level in LEVELS:
        got = _ort(exported, [x.numpy()], level)[0].ravel().astype(np.float64)
        cosine = got @ want / (np.linalg.norm(got) * np.linalg.norm(want))
        assert cosine >= 0.999, (level, cosine)
