"""ONNX files whose network sits under control flow on a mode input (silero VAD: an ``If`` on the sample rate ``sr``):
``load_onnx(input_values=...)`` / ``--input-value`` make such inputs constants, the Ifs fold, and what follows in the
taken branches converts (nested Ifs, conditions on sizes the branch computes, recurrent weights computed from
initializers, reflect pads computed at run time). Each graph is built with ``onnx.helper`` after the shipped files."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh

import fxq

from _export_helpers import ort_session

pytestmark = pytest.mark.usefixtures("one_thread")

RNG = np.random.default_rng(0)
W16 = RNG.standard_normal((8, 4, 3, 3)).astype(np.float32)
W8 = RNG.standard_normal((8, 4, 3, 3)).astype(np.float32)


def _model(nodes, inputs, outputs, inits=(), opset=16) -> onnx.ModelProto:
    m = h.make_model(h.make_graph(nodes, "g", inputs, outputs, list(inits)), opset_imports=[h.make_opsetid("", opset)])
    onnx.checker.check_model(m)
    return m


def _conv_branch(name: str, weight: str) -> onnx.GraphProto:
    return h.make_graph([h.make_node("Conv", ["x", weight], [f"{name}_y"], pads=[1, 1, 1, 1])], name, [],
                        [h.make_tensor_value_info(f"{name}_y", T.FLOAT, None)])


def _mode_model() -> onnx.ModelProto:
    """The whole network under an If on the scalar input ``sr``."""
    return _model(
        [h.make_node("Equal", ["sr", "k16000"], ["cond"]),
         h.make_node("If", ["cond"], ["y"], then_branch=_conv_branch("then", "W16"),
                     else_branch=_conv_branch("else", "W8"))],
        [h.make_tensor_value_info("x", T.FLOAT, [1, 4, 8, 8]), h.make_tensor_value_info("sr", T.INT64, [])],
        [h.make_tensor_value_info("y", T.FLOAT, [1, 8, 8, 8])],
        [nh.from_array(W16, "W16"), nh.from_array(W8, "W8"), nh.from_array(np.array(16000, np.int64), "k16000")])


def _onnxruntime(model: onnx.ModelProto, feeds: dict) -> np.ndarray:
    import onnxruntime as ort

    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def _waveform_model_matches_onnxruntime(nodes, inits, shape):
    """``x [batch, n] -> y [batch, m]`` built from ``nodes``, loaded at ``shape``: (module, input, output), the output
    checked equal to onnxruntime's."""
    model = _model(nodes, [h.make_tensor_value_info("x", T.FLOAT, ["batch", "n"])],
                   [h.make_tensor_value_info("y", T.FLOAT, ["batch", "m"])], inits, opset=13)
    x = RNG.standard_normal(shape).astype(np.float32)
    gm = fxq.load_onnx(model, input_shapes={"x": list(shape)})
    with torch.no_grad():
        got = gm(torch.from_numpy(x)).numpy()
    np.testing.assert_array_equal(got, _onnxruntime(model, {"x": x}))
    return gm, x, got


def test_if_on_a_mode_input_names_input_values_and_no_empty_cut():
    """The refusal names the input and the fix; it suggests no cut, since the part before the If computes nothing
    to quantize (the cut it named was the condition itself)."""
    with pytest.raises(fxq.FrontendError, match=r"input_values=\{'sr': \.\.\.\}.*--input-value sr=") as err:
        fxq.load_onnx(_mode_model())
    assert err.value.suggested_outputs == ()
    assert "outputs=" not in str(err.value)


@pytest.mark.parametrize("sr, weight", [(16000, W16), (8000, W8)])
def test_input_values_fold_the_branch_and_leave_the_input_out(tmp_path, sr, weight):
    x = RNG.standard_normal((1, 4, 8, 8)).astype(np.float32)
    gm = fxq.load_onnx(_mode_model(), input_values={"sr": sr})
    assert [str(n.target) for n in gm.graph.nodes if n.op == "placeholder"] == ["x"]
    assert gm.meta["onnx"]["input_values"] == {"sr": sr}
    with torch.no_grad():
        got = gm(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(got, _onnxruntime(_mode_model(), {"x": x, "sr": np.array(sr, np.int64)}),
                               rtol=1e-5, atol=1e-5)
    expected = torch.nn.functional.conv2d(torch.from_numpy(x), torch.from_numpy(weight), padding=1).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    q = fxq.quantize(gm, [torch.from_numpy(x)], "trt_int8", progress=False)
    path = fxq.export(q, "trt_int8", tmp_path / "m.onnx")[0]
    session = ort_session(path, optimize=False)
    assert [i.name for i in session.get_inputs()] == ["x"]
    with torch.no_grad():
        np.testing.assert_allclose(session.run(None, {"x": x})[0], q(torch.from_numpy(x)).numpy(), rtol=0, atol=1e-5)


@pytest.mark.parametrize("values, match", [
    ({"rate": 16000}, r"names 'rate', which is not an input.*inputs are \['x', 'sr'\]"),
    ({"sr": 16000.5}, r"holds integers"),
    ({"sr": [16000, 8000]}, r"has shape \[2\] but input 'sr'.*declared \[\]"),
    ({"sr": 16000, "x": np.zeros((1, 4, 8, 8))}, r"fixes every input"),
])
def test_input_values_errors(values, match):
    with pytest.raises(fxq.FrontendError, match=match):
        fxq.load_onnx(_mode_model(), input_values=values)


def test_nested_if_whose_condition_a_branch_constant_computes():
    """A taken branch holding a Constant node that feeds a second If's condition (silero VAD 16k op15): a bare
    IndexError at load before."""
    def scaled(name, k):
        return h.make_graph([h.make_node("Conv", ["x", "W16"], [f"{name}_c"], pads=[1, 1, 1, 1]),
                             h.make_node("Mul", [f"{name}_c", f"{name}_k"], [f"{name}_y"])], name, [],
                            [h.make_tensor_value_info(f"{name}_y", T.FLOAT, None)],
                            [nh.from_array(np.array(k, np.float32), f"{name}_k")])
    outer_then = h.make_graph([
        h.make_node("Constant", [], ["one"], value=nh.from_array(np.array(1, np.int64))),
        h.make_node("Equal", ["one", "one_i"], ["inner_cond"]),
        h.make_node("If", ["inner_cond"], ["t_y"], then_branch=scaled("a", 1.0), else_branch=scaled("b", 2.0)),
    ], "outer_then", [], [h.make_tensor_value_info("t_y", T.FLOAT, None)],
        [nh.from_array(np.array(1, np.int64), "one_i")])
    model = _model([h.make_node("If", ["outer_cond"], ["y"], then_branch=outer_then, else_branch=scaled("c", 3.0))],
                   [h.make_tensor_value_info("x", T.FLOAT, [1, 4, 8, 8])],
                   [h.make_tensor_value_info("y", T.FLOAT, [1, 8, 8, 8])],
                   [nh.from_array(W16, "W16"), nh.from_array(np.array(True), "outer_cond")], opset=15)
    x = RNG.standard_normal((1, 4, 8, 8)).astype(np.float32)
    gm = fxq.load_onnx(model)
    with torch.no_grad():
        np.testing.assert_allclose(gm(torch.from_numpy(x)).numpy(), _onnxruntime(model, {"x": x}), rtol=1e-5, atol=1e-5)


def test_if_on_the_rank_of_a_value_an_inlined_branch_computes():
    """silero VAD's decoder: after the sample-rate If is taken, a second If branches on the rank of a Squeeze whose
    axes are a Constant of the taken branch; shape inference must run on the inlined nodes first (it was refused as
    reading the input's values)."""
    inner = [h.make_graph([h.make_node(op, ["sq"], [f"{name}_y"])], name, [],
                          [h.make_tensor_value_info(f"{name}_y", T.FLOAT, None)]) for name, op in (("i_then", "Relu"),
                                                                                                  ("i_else", "Neg"))]
    then = h.make_graph([
        h.make_node("Conv", ["x", "W16"], ["c"], pads=[1, 1, 1, 1]),
        h.make_node("Constant", [], ["axes"], value=nh.from_array(np.array([0], np.int64))),
        h.make_node("Squeeze", ["c", "axes"], ["sq"]),
        h.make_node("Shape", ["sq"], ["shape"]), h.make_node("Size", ["shape"], ["rank"]),
        h.make_node("Constant", [], ["three"], value=nh.from_array(np.array(3, np.int64))),
        h.make_node("Equal", ["rank", "three"], ["is3"]),
        h.make_node("If", ["is3"], ["t_y"], then_branch=inner[0], else_branch=inner[1]),
    ], "then", [], [h.make_tensor_value_info("t_y", T.FLOAT, None)])
    other = h.make_graph([h.make_node("Conv", ["x", "W8"], ["e_c"], pads=[1, 1, 1, 1]),
                          h.make_node("Squeeze", ["e_c", "e_axes"], ["e_y"])], "else", [],
                         [h.make_tensor_value_info("e_y", T.FLOAT, None)],
                         [nh.from_array(np.array([0], np.int64), "e_axes")])
    model = _model([h.make_node("Equal", ["sr", "k16000"], ["cond"]),
                    h.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other)],
                   [h.make_tensor_value_info("x", T.FLOAT, [1, 4, 8, 8]), h.make_tensor_value_info("sr", T.INT64, [])],
                   [h.make_tensor_value_info("y", T.FLOAT, [8, 8, 8])],
                   [nh.from_array(W16, "W16"), nh.from_array(W8, "W8"),
                    nh.from_array(np.array(16000, np.int64), "k16000")])
    x = RNG.standard_normal((1, 4, 8, 8)).astype(np.float32)
    gm = fxq.load_onnx(model, input_values={"sr": 16000})
    with torch.no_grad():
        got = gm(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(got, _onnxruntime(model, {"x": x, "sr": np.array(16000, np.int64)}), rtol=1e-5,
                               atol=1e-5)
    assert got.min() >= 0  # the Relu branch: the squeezed value has rank 3


def test_lstm_weights_computed_from_initializers():
    """torch.onnx writes an LSTMCell as LSTM with W / R / B reordered from the stored weights by Slice + Concat:
    folded into initializers at load (the converter took only initializers)."""
    hidden, size, steps = 4, 3, 5
    raw = {k: RNG.standard_normal(shape).astype(np.float32) for k, shape in
           (("w", (4 * hidden, size)), ("r", (4 * hidden, hidden)), ("b", (8 * hidden,)))}
    nodes, inits = [], [nh.from_array(v, f"{k}_raw") for k, v in raw.items()]
    for k in ("w", "r"):  # gates (i, f, g, o) -> ONNX's (i, o, f, c)
        for j, (lo, hi) in enumerate(((0, 1), (3, 4), (1, 3))):
            inits += [nh.from_array(np.array([lo * hidden], np.int64), f"{k}_s{j}"),
                      nh.from_array(np.array([hi * hidden], np.int64), f"{k}_e{j}")]
            nodes.append(h.make_node("Slice", [f"{k}_raw", f"{k}_s{j}", f"{k}_e{j}"], [f"{k}_p{j}"]))
        nodes += [h.make_node("Concat", [f"{k}_p0", f"{k}_p1", f"{k}_p2"], [f"{k}_cat"], axis=0),
                  h.make_node("Unsqueeze", [f"{k}_cat", "zero"], [k.upper()])]
    nodes += [h.make_node("Unsqueeze", ["b_raw", "zero"], ["B"]),
              h.make_node("LSTM", ["x", "W", "R", "B"], ["Y", "Y_h"], hidden_size=hidden)]
    inits.append(nh.from_array(np.array([0], np.int64), "zero"))
    model = _model(nodes, [h.make_tensor_value_info("x", T.FLOAT, [steps, 1, size])],
                   [h.make_tensor_value_info("Y", T.FLOAT, [steps, 1, 1, hidden]),
                    h.make_tensor_value_info("Y_h", T.FLOAT, [1, 1, hidden])], inits)
    x = RNG.standard_normal((steps, 1, size)).astype(np.float32)
    gm = fxq.load_onnx(model)
    with torch.no_grad():
        got = gm(torch.from_numpy(x))
    np.testing.assert_allclose(got[0].numpy(), _onnxruntime(model, {"x": x}), rtol=1e-5, atol=1e-5)


def test_reflect_pad_with_pads_computed_at_run_time(tmp_path):
    """silero VAD's STFT: ``F.pad(x, (k, k), mode="reflect")`` on a 2-D waveform, with ``k`` computed from the
    input's length, writes Pad with pads as a tensor; onnx2torch's module gave F.pad a pair per dim (4 numbers for
    a 2-D tensor), which reflect mode refuses. fxq's module pads only the dims with pads, and saves."""
    nodes = [h.make_node("Shape", ["x"], ["shape"]),
             h.make_node("Gather", ["shape", "one"], ["n"]),
             h.make_node("Div", ["n", "k32"], ["k"]),
             h.make_node("Concat", ["zero", "k", "zero", "k"], ["pads"], axis=0),
             h.make_node("Pad", ["x", "pads"], ["y"], mode="reflect")]
    inits = [nh.from_array(np.array([1], np.int64), "one"), nh.from_array(np.array([32], np.int64), "k32"),
             nh.from_array(np.array([0], np.int64), "zero")]
    gm, x, got = _waveform_model_matches_onnxruntime(nodes, inits, [2, 512])
    assert got.shape == (2, 544)
    fxq.save(gm, tmp_path / "pad.fxq")
    with torch.no_grad():
        np.testing.assert_array_equal(fxq.load(tmp_path / "pad.fxq")(torch.from_numpy(x)).numpy(), got)


def test_cli_input_value(tmp_path):
    from fxq import cli

    onnx.save(_mode_model(), str(tmp_path / "vad.onnx"))
    calib = tmp_path / "calib"
    calib.mkdir()
    for i in range(2):
        np.save(calib / f"{i}.npy", RNG.standard_normal((1, 4, 8, 8)).astype(np.float32))
    assert cli.main(["quantize", str(tmp_path / "vad.onnx"), "--input-value", "sr=16000", "--calib", str(calib),
                     "--platform", "trt_int8", "--out", str(tmp_path / "out"), "-q"]) == 0
    exported = onnx.load(str(tmp_path / "out" / "vad_trt_int8.onnx"))
    assert [i.name for i in exported.graph.input] == ["x"]
    assert cli.main(["quantize", str(tmp_path / "vad.onnx"), "--input-value", "sr", "--calib", str(calib)]) == 2


def test_dict_batches_by_onnx_input_name_when_torch_renames_it():
    """An ONNX input named ``input`` (silero VAD's) is placeholder ``input_1`` in fx, taking keyword ``input``:
    batches keyed by the file's names calibrate (the CLI's per-input folders give such dicts)."""
    model = _model([h.make_node("Conv", ["input", "W16"], ["y"], pads=[1, 1, 1, 1])],
                   [h.make_tensor_value_info("input", T.FLOAT, [1, 4, 8, 8])],
                   [h.make_tensor_value_info("y", T.FLOAT, [1, 8, 8, 8])], [nh.from_array(W16, "W16")])
    gm = fxq.load_onnx(model)
    x = torch.from_numpy(RNG.standard_normal((1, 4, 8, 8)).astype(np.float32))
    q = fxq.quantize(gm, [{"input": x}], "trt_int8", progress=False)
    with torch.no_grad():
        assert torch.equal(q(x), q(**{"input": x}))


def test_if_on_a_symbolic_dim_that_input_shapes_fix():
    """openwakeword's silero VAD: an If on ``Gather(Shape(Pad(x, pads)), 0)``; shape inference keeps the file's
    name for that dim (``batch``), which ``input_shapes`` fixes: the condition folds (it was refused as reading the
    input's values)."""
    branches = [h.make_graph([h.make_node(op, ["p"], [f"{name}_y"])], name, [],
                             [h.make_tensor_value_info(f"{name}_y", T.FLOAT, None)])
                for name, op in (("one", "Relu"), ("many", "Neg"))]
    nodes = [h.make_node("Pad", ["x", "pads"], ["p"], mode="reflect"),
             h.make_node("Shape", ["p"], ["p_shape"]),
             h.make_node("Gather", ["p_shape", "zero_s"], ["batch"]),
             h.make_node("Equal", ["batch", "one_s"], ["single"]),
             h.make_node("If", ["single"], ["y"], then_branch=branches[0], else_branch=branches[1])]
    inits = [nh.from_array(np.array([0, 16, 0, 16], np.int64), "pads"), nh.from_array(np.array(0, np.int64), "zero_s"),
             nh.from_array(np.array(1, np.int64), "one_s")]
    _, _, got = _waveform_model_matches_onnxruntime(nodes, inits, [1, 512])
    assert got.min() >= 0  # the batch-of-one branch
