"""Caffe layers of later BVLC versions and of common forks (MobileNet's ReLU6 / DepthwiseConvolution, ShuffleNet's
ShuffleChannel, FCN's Crop, ELU / Swish / AbsVal / BNLL / Exp / Log / Clip) against float64 references written
from caffe's definitions; a fork net deployed on ncnn; an unsupported layer that ends the net named with its cut."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_caffe_frontend import T, _rand, write_model

import fxq

ELEMENTWISE = """
name: "elementwise"
input: "data"
input_shape { dim: 1 dim: 4 dim: 5 dim: 6 }
layer { name: "relu6" type: "ReLU6" bottom: "data" top: "relu6" }
layer { name: "clip" type: "Clip" bottom: "data" top: "clip" clip_param { min: -0.5 max: 0.25 } }
layer { name: "elu" type: "ELU" bottom: "data" top: "elu" elu_param { alpha: 0.7 } }
layer { name: "swish" type: "Swish" bottom: "data" top: "swish" }
layer { name: "swish2" type: "Swish" bottom: "data" top: "swish2" swish_param { beta: 2 } }
layer { name: "abs" type: "AbsVal" bottom: "data" top: "abs" }
layer { name: "bnll" type: "BNLL" bottom: "data" top: "bnll" }
layer { name: "exp" type: "Exp" bottom: "data" top: "exp" }
layer { name: "exp2" type: "Exp" bottom: "data" top: "exp2" exp_param { base: 2 scale: 0.5 shift: 0.25 } }
layer { name: "log" type: "Log" bottom: "abs" top: "log" log_param { shift: 1 } }
layer { name: "log10" type: "Log" bottom: "abs" top: "log10" log_param { base: 10 scale: 2 shift: 0.5 } }
"""


def test_elementwise_layers_match_caffe_formulas(tmp_path):
    prototxt, _ = write_model(tmp_path, "elementwise", ELEMENTWISE, None)
    gm = fxq.load_caffe(prototxt)
    x = torch.randn(1, 4, 5, 6, generator=torch.Generator().manual_seed(0)) * 3
    names = gm.meta["caffe"]["outputs"]
    with torch.no_grad():
        got = dict(zip(names, gm(x)))
    d = x.double()
    a = d.abs()
    want = {
        "relu6": d.clamp(0, 6), "clip": d.clamp(-0.5, 0.25),
        "elu": torch.where(d > 0, d, 0.7 * (torch.exp(d) - 1)),
        "swish": d / (1 + torch.exp(-d)), "swish2": d / (1 + torch.exp(-2 * d)),
        "bnll": torch.where(d > 0, d + torch.log1p(torch.exp(-d)), torch.log1p(torch.exp(d))),
        "exp": torch.exp(d), "exp2": torch.pow(2.0, 0.25 + 0.5 * d),
        "log": torch.log(a + 1), "log10": torch.log10(0.5 + 2 * a),
    }
    assert set(want) <= set(got)
    for name, value in want.items():
        torch.testing.assert_close(got[name].double(), value, rtol=1e-5, atol=1e-6, msg=name)


FORK_NET = """
name: "fork_net"
input: "data"
input_shape { dim: 1 dim: 3 dim: 20 dim: 20 }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 8 kernel_size: 3 pad: 1 } }
layer { name: "relu1" type: "ReLU6" bottom: "conv1" top: "conv1" }
layer { name: "dw" type: "DepthwiseConvolution" bottom: "conv1" top: "dw"
        convolution_param { num_output: 8 kernel_size: 3 pad: 1 stride: 2 } }
layer { name: "shuffle" type: "ShuffleChannel" bottom: "dw" top: "shuffle" shuffle_channel_param { group: 2 } }
layer { name: "pw" type: "Convolution" bottom: "shuffle" top: "pw"
        convolution_param { num_output: 4 kernel_size: 1 } }
layer { name: "up" type: "Deconvolution" bottom: "pw" top: "up"
        convolution_param { num_output: 4 kernel_size: 4 stride: 2 bias_term: false } }
layer { name: "score" type: "Crop" bottom: "up" bottom: "data" top: "score" crop_param { axis: 2 offset: 1 } }
"""


def _fork_weights(rng: np.random.Generator) -> dict[str, list[np.ndarray]]:
    return {"conv1": [_rand(rng, 8, 3, 3, 3), _rand(rng, 8)], "dw": [_rand(rng, 8, 1, 3, 3), _rand(rng, 8)],
            "pw": [_rand(rng, 4, 8, 1, 1), _rand(rng, 4)], "up": [_rand(rng, 4, 4, 4, 4)]}


def _fork_ref(x: torch.Tensor, w: dict[str, list[np.ndarray]]) -> torch.Tensor:
    c1 = F.conv2d(x, T(w["conv1"][0]), T(w["conv1"][1]), padding=1).clamp(0, 6)
    dw = F.conv2d(c1, T(w["dw"][0]), T(w["dw"][1]), stride=2, padding=1, groups=8)
    shuffled = torch.stack([dw[:, [i * 4 + j for j in range(4) for i in range(2)][k]] for k in range(8)], 1)
    pw = F.conv2d(shuffled, T(w["pw"][0]), T(w["pw"][1]))
    up = F.conv_transpose2d(pw, T(w["up"][0]), stride=2)  # 22 x 22
    return up[:, :, 1:21, 1:21]


def test_fork_net_matches_reference_and_deploys_on_ncnn(tmp_path):
    """ReLU6, a DepthwiseConvolution without ``group`` (the input's channels), ShuffleChannel (channel
    ``i * C/g + j`` to ``j * g + i``) and FCN's Crop to the image; the FP32 ncnn file computes the graph, the int8
    file's codes are the simulation's within 1 LSB (float accumulation order)."""
    pytest.importorskip("ncnn")
    from fxq.analysis.mismatch_ncnn import ncnn_mat

    from _export_helpers import ncnn_net

    weights = _fork_weights(np.random.default_rng(0))
    prototxt, caffemodel = write_model(tmp_path, "fork_net", FORK_NET, weights)
    gm = fxq.load_caffe(prototxt, caffemodel)
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(1, 3, 20, 20, generator=gen) for _ in range(4)]
    with torch.no_grad():
        torch.testing.assert_close(gm(xs[0]).double(), _fork_ref(xs[0].double(), weights), rtol=1e-5, atol=1e-5)
    q = fxq.quantize(gm, xs[:3], "ncnn_int8", progress=False)
    files = {str(f).split(".", 1)[1]: f for f in fxq.export(q, "ncnn_int8", tmp_path / "fork", example_inputs=(xs[0],))}
    ex = ncnn_net(files["fp32.param"], files["fp32.bin"], int8=False).create_extractor()
    ex.input("in0", ncnn_mat(xs[3][0].numpy()))
    with torch.no_grad(), fxq.fp32_mode(q):
        want = q(xs[3])
    np.testing.assert_allclose(np.array(ex.extract("out0")[1]), want[0].numpy(), rtol=1e-5, atol=1e-5)
    report = fxq.locate_mismatch(q, files["param"], [xs[3]], teacher_forced=True)  # int8: codes, layer by layer
    assert len(report) >= 3 and max(r.max_diff for r in report) <= 1, report.table()


def test_unsupported_layer_at_the_end_names_the_cut(tmp_path):
    """A detector's own post-processing layer (YOLOv3 forks' ``Yolov3DetectionOutput``) ends the net: the error
    names the ``outputs=`` cut before it, which loads; an unsupported layer inside the net names no cut."""
    net = FORK_NET + """
layer { name: "detect" type: "Yolov3DetectionOutput" bottom: "score" bottom: "pw" top: "detections" }
"""
    weights = _fork_weights(np.random.default_rng(0))
    prototxt, caffemodel = write_model(tmp_path, "yolo_like", net, weights)
    with pytest.raises(fxq.FrontendError, match=r"type 'Yolov3DetectionOutput'.*It ends the net \(post-processing\?\)"
                       r": load the net before it with fxq.load_caffe\(\.\.\., outputs=\['score', 'pw'\]\) \(CLI: "
                       r"--outputs score,pw\)"):
        fxq.load_caffe(prototxt, caffemodel)
    gm = fxq.load_caffe(prototxt, caffemodel, outputs=["score", "pw"])
    assert gm.meta["caffe"]["outputs"] == ["score", "pw"]
    inner = FORK_NET.replace('type: "ShuffleChannel"', 'type: "ChannelShuffleOfAFork"')
    prototxt, caffemodel = write_model(tmp_path, "inner", inner, weights)
    with pytest.raises(fxq.FrontendError, match="ChannelShuffleOfAFork") as err:
        fxq.load_caffe(prototxt, caffemodel)
    assert "outputs=" not in str(err.value)


def test_exp_and_log_bases_are_checked(tmp_path):
    bad = ELEMENTWISE.replace("log_param { base: 10", "log_param { base: 1")
    prototxt, _ = write_model(tmp_path, "bad", bad, None)
    with pytest.raises(fxq.FrontendError, match=r"layer 'log10'.*base must be -1 \(e\) or positive and not 1"):
        fxq.load_caffe(prototxt)
    zero = ELEMENTWISE.replace('log_param { shift: 1 }', 'log_param { shift: 0 }')  # log(|x|) at x = 0: -inf
    prototxt, _ = write_model(tmp_path, "zero", zero, None)
    with torch.no_grad():
        out = dict(zip(fxq.load_caffe(prototxt).meta["caffe"]["outputs"], fxq.load_caffe(prototxt)(
            torch.zeros(1, 4, 5, 6))))
    assert bool(torch.isneginf(out["log"]).all()) and math.isclose(float(out["exp2"].mean()), 2 ** 0.25, rel_tol=1e-6)


def test_cut_advice_names_every_head_and_in_place_writes(tmp_path):
    """Two detection layers at two scales: the advice names both heads' bottoms; a layer writing its bottom in
    place names the rename that lets a cut end before it."""
    weights = _fork_weights(np.random.default_rng(0))
    two = FORK_NET + """
layer { name: "head_a" type: "YoloLayerOfAFork" bottom: "pw" top: "det_a" }
layer { name: "head_b" type: "YoloLayerOfAFork" bottom: "score" top: "det_b" }
"""
    prototxt, caffemodel = write_model(tmp_path, "two", two, weights)
    with pytest.raises(fxq.FrontendError, match=r"outputs=\['pw', 'score'\]\) \(CLI: --outputs pw,score\)"):
        fxq.load_caffe(prototxt, caffemodel)
    assert fxq.load_caffe(prototxt, caffemodel, outputs=["pw", "score"]).meta["caffe"]["outputs"] == ["pw", "score"]
    in_place = FORK_NET + """
layer { name: "region" type: "RegionOfAFork" bottom: "score" top: "score" }
"""
    prototxt, caffemodel = write_model(tmp_path, "in_place", in_place, weights)
    with pytest.raises(fxq.FrontendError, match=r"first give the top of \['region'\] a name of its own"):
        fxq.load_caffe(prototxt, caffemodel)
