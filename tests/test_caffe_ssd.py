"""The SSD fork's caffe layers (Normalize, Permute, PriorBox; DetectionOutput refused with the ``outputs=`` cut that
loads the network before it): a small SSD against float64 references written from the fork's C++ (loops, as
caffe computes), then quantized and deployed on TensorRT / NCNN. OpenCV's caffe importer, where installed, runs the
same files as a second reference."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_caffe_frontend import T, _rand, write_model

import fxq
from fxq.analysis.mismatch_ncnn import ncnn_mat

from _export_helpers import ncnn_net, ort_session

SSD = """
name: "tiny_ssd"
input: "data"
input_shape { dim: 1 dim: 3 dim: 32 dim: 32 }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 8 kernel_size: 3 pad: 1 stride: 2 } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "conv1_norm" type: "Normalize" bottom: "conv1" top: "conv1_norm"
        norm_param { across_spatial: false scale_filler { type: "constant" value: 20 } channel_shared: false } }
layer { name: "conv2" type: "Convolution" bottom: "conv1" top: "conv2"
        convolution_param { num_output: 8 kernel_size: 3 pad: 1 stride: 2 } }
layer { name: "relu2" type: "ReLU" bottom: "conv2" top: "conv2" }
layer { name: "conv2_norm" type: "Normalize" bottom: "conv2" top: "conv2_norm"
        norm_param { across_spatial: true channel_shared: true eps: 1e-6 } }
layer { name: "a_loc" type: "Convolution" bottom: "conv1_norm" top: "a_loc"
        convolution_param { num_output: 16 kernel_size: 3 pad: 1 } }
layer { name: "a_loc_perm" type: "Permute" bottom: "a_loc" top: "a_loc_perm" permute_param { order: 0 order: 2 order: 3 order: 1 } }
layer { name: "a_loc_flat" type: "Flatten" bottom: "a_loc_perm" top: "a_loc_flat" flatten_param { axis: 1 } }
layer { name: "a_conf" type: "Convolution" bottom: "conv1_norm" top: "a_conf"
        convolution_param { num_output: 8 kernel_size: 3 pad: 1 } }
layer { name: "a_conf_perm" type: "Permute" bottom: "a_conf" top: "a_conf_perm" permute_param { order: 0 order: 2 order: 3 order: 1 } }
layer { name: "a_conf_flat" type: "Flatten" bottom: "a_conf_perm" top: "a_conf_flat" flatten_param { axis: 1 } }
layer { name: "a_prior" type: "PriorBox" bottom: "conv1_norm" bottom: "data" top: "a_prior"
        prior_box_param { min_size: 6 max_size: 12 aspect_ratio: 2 flip: true clip: false
                          variance: 0.1 variance: 0.1 variance: 0.2 variance: 0.2 step: 2 offset: 0.5 } }
layer { name: "b_loc" type: "Convolution" bottom: "conv2_norm" top: "b_loc"
        convolution_param { num_output: 24 kernel_size: 3 pad: 1 } }
layer { name: "b_loc_perm" type: "Permute" bottom: "b_loc" top: "b_loc_perm" permute_param { order: 0 order: 2 order: 3 order: 1 } }
layer { name: "b_loc_flat" type: "Flatten" bottom: "b_loc_perm" top: "b_loc_flat" flatten_param { axis: 1 } }
layer { name: "b_conf" type: "Convolution" bottom: "conv2_norm" top: "b_conf"
        convolution_param { num_output: 12 kernel_size: 3 pad: 1 } }
layer { name: "b_conf_perm" type: "Permute" bottom: "b_conf" top: "b_conf_perm" permute_param { order: 0 order: 2 order: 3 order: 1 } }
layer { name: "b_conf_flat" type: "Flatten" bottom: "b_conf_perm" top: "b_conf_flat" flatten_param { axis: 1 } }
layer { name: "b_prior" type: "PriorBox" bottom: "conv2_norm" bottom: "data" top: "b_prior"
        prior_box_param { min_size: 12 max_size: 24 aspect_ratio: 2 aspect_ratio: 3 aspect_ratio: 2 flip: true
                          clip: true variance: 0.1 } }
layer { name: "mbox_loc" type: "Concat" bottom: "a_loc_flat" bottom: "b_loc_flat" top: "mbox_loc" concat_param { axis: 1 } }
layer { name: "mbox_conf" type: "Concat" bottom: "a_conf_flat" bottom: "b_conf_flat" top: "mbox_conf" concat_param { axis: 1 } }
layer { name: "mbox_prior" type: "Concat" bottom: "a_prior" bottom: "b_prior" top: "mbox_prior" concat_param { axis: 2 } }
layer { name: "conf_reshape" type: "Reshape" bottom: "mbox_conf" top: "conf_reshape"
        reshape_param { shape { dim: 0 dim: -1 dim: 2 } } }
layer { name: "conf_softmax" type: "Softmax" bottom: "conf_reshape" top: "conf_softmax" softmax_param { axis: 2 } }
layer { name: "conf_flat" type: "Flatten" bottom: "conf_softmax" top: "conf_flat" flatten_param { axis: 1 } }
layer { name: "detection_out" type: "DetectionOutput" bottom: "mbox_loc" bottom: "conf_flat" bottom: "mbox_prior"
        top: "detection_out" include { phase: TEST }
        detection_output_param { num_classes: 2 share_location: true background_label_id: 0
                                 nms_param { nms_threshold: 0.45 top_k: 100 } code_type: CENTER_SIZE
                                 keep_top_k: 50 confidence_threshold: 0.01 } }
"""
OUTPUTS = ["mbox_loc", "conf_flat", "mbox_prior"]


def _weights(rng: np.random.Generator) -> dict[str, list[np.ndarray]]:
    conv = {"conv1": (8, 3), "conv2": (8, 8), "a_loc": (16, 8), "a_conf": (8, 8), "b_loc": (24, 8),
            "b_conf": (12, 8)}
    w = {name: [_rand(rng, o, i, 3, 3), _rand(rng, o, scale=0.1)] for name, (o, i) in conv.items()}
    w["conv1_norm"] = [(rng.uniform(5, 30, 8)).astype(np.float32)]
    w["conv2_norm"] = [np.array([7.5], dtype=np.float32)]
    return w


def normalize_ref(x: torch.Tensor, scale: np.ndarray, across_spatial: bool, eps: float) -> torch.Tensor:
    dims = (1, 2, 3) if across_spatial else (1,)
    norm = torch.sqrt((x * x).sum(dims, keepdim=True) + eps)
    return x / norm * T(np.broadcast_to(scale, (x.shape[1],)).copy()).reshape(1, -1, 1, 1)


def prior_box_ref(layer_h: int, layer_w: int, img_h: int, img_w: int, min_sizes, max_sizes, ratios_in, flip,
                  clip, variance, step_h=None, step_w=None, offset=0.5) -> np.ndarray:
    """SSD's PriorBoxLayer::Forward_cpu, loop for loop."""
    ratios = [1.0]
    for ar in ratios_in:
        if any(abs(ar - r) < 1e-6 for r in ratios):
            continue
        ratios.append(ar)
        if flip:
            ratios.append(1.0 / ar)
    step_w = img_w / layer_w if step_w is None else step_w
    step_h = img_h / layer_h if step_h is None else step_h
    boxes = []
    for h in range(layer_h):
        for w in range(layer_w):
            cx, cy = (w + offset) * step_w, (h + offset) * step_h
            for s, size in enumerate(min_sizes):
                min_size = int(size)  # the fork's `int min_size_ = min_sizes_[s];` (and max_size_)
                shapes = [(min_size, min_size)]
                if max_sizes:
                    shapes.append((math.sqrt(min_size * int(max_sizes[s])),) * 2)
                shapes += [(min_size * math.sqrt(ar), min_size / math.sqrt(ar)) for ar in ratios if abs(ar - 1) >= 1e-6]
                for bw, bh in shapes:
                    boxes += [(cx - bw / 2.0) / img_w, (cy - bh / 2.0) / img_h, (cx + bw / 2.0) / img_w,
                              (cy + bh / 2.0) / img_h]
    boxes = np.array(boxes)
    if clip:
        boxes = np.clip(boxes, 0.0, 1.0)
    variances = np.tile(variance if len(variance) == 4 else variance * 4, len(boxes) // 4)
    return np.stack([boxes, variances])[None]


def ssd_ref(x: torch.Tensor, w: dict[str, list[np.ndarray]]) -> dict[str, torch.Tensor]:
    def conv(t: torch.Tensor, name: str, stride: int = 1) -> torch.Tensor:
        return F.conv2d(t, T(w[name][0]), T(w[name][1]), stride=stride, padding=1)

    def head(t: torch.Tensor, name: str) -> torch.Tensor:
        return conv(t, name).permute(0, 2, 3, 1).flatten(1)

    c1 = conv(x, "conv1", 2).relu()
    n1 = normalize_ref(c1, w["conv1_norm"][0], False, 1e-10)
    c2 = conv(c1, "conv2", 2).relu()
    n2 = normalize_ref(c2, w["conv2_norm"][0], True, 1e-6)
    conf = torch.cat([head(n1, "a_conf"), head(n2, "b_conf")], 1)
    priors = np.concatenate([
        prior_box_ref(16, 16, 32, 32, [6.0], [12.0], [2.0], True, False, [0.1, 0.1, 0.2, 0.2], 2, 2),
        prior_box_ref(8, 8, 32, 32, [12.0], [24.0], [2.0, 3.0, 2.0], True, True, [0.1])], axis=2)
    return {"mbox_loc": torch.cat([head(n1, "a_loc"), head(n2, "b_loc")], 1),
            "conf_flat": conf.reshape(1, -1, 2).softmax(2).flatten(1), "mbox_prior": T(priors)}


@pytest.fixture(scope="module")
def ssd_files(tmp_path_factory) -> tuple[str, str, dict[str, list[np.ndarray]]]:
    weights = _weights(np.random.default_rng(0))
    prototxt, caffemodel = write_model(tmp_path_factory.mktemp("ssd"), "tiny_ssd", SSD, weights)
    return prototxt, caffemodel, weights


def _input(seed: int) -> torch.Tensor:
    return torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def test_detection_output_refused_with_the_cut_that_loads(ssd_files):
    prototxt, caffemodel, weights = ssd_files
    with pytest.raises(fxq.FrontendError, match=r"layer 'detection_out' \(DetectionOutput\): is SSD post-processing"
                       r".*Fix: load the network up to its inputs with fxq.load_caffe\(\.\.\., outputs=\['mbox_loc', "
                       r"'conf_flat', 'mbox_prior'\]\) \(CLI: --outputs mbox_loc,conf_flat,mbox_prior\)"):
        fxq.load_caffe(prototxt, caffemodel)
    gm = fxq.load_caffe(prototxt, caffemodel, outputs=OUTPUTS)
    assert gm.meta["caffe"]["outputs"] == OUTPUTS
    x = _input(1)
    with torch.no_grad():
        got = gm(x)
    want = ssd_ref(x.double(), weights)
    for name, value in zip(OUTPUTS, got):
        torch.testing.assert_close(value.double(), want[name], rtol=1e-5, atol=1e-5, msg=name)
    with pytest.raises(fxq.FrontendError, match=r"outputs \['nope'\] are not blobs of the net"):
        fxq.load_caffe(prototxt, caffemodel, outputs=["mbox_loc", "nope"])
    part = fxq.load_caffe(prototxt, caffemodel, outputs=["conv1_norm"])  # a cut keeps only what it needs
    assert not any(n.name.startswith(("conv2", "a_", "b_")) for n in part.graph.nodes)
    with torch.no_grad():
        torch.testing.assert_close(part(x).double(), normalize_ref(torch.relu(F.conv2d(
            x.double(), T(weights["conv1"][0]), T(weights["conv1"][1]), stride=2, padding=1)),
            weights["conv1_norm"][0], False, 1e-10), rtol=1e-5, atol=1e-5)


def test_opencv_runs_the_same_files(ssd_files):
    """OpenCV's own caffe importer (an independent implementation of the SSD layers) on the same files."""
    cv2 = pytest.importorskip("cv2")
    if not hasattr(cv2.dnn, "readNetFromCaffe"):
        pytest.skip("this OpenCV has no caffe importer (removed in 5.0)")
    prototxt, caffemodel, _ = ssd_files
    gm = fxq.load_caffe(prototxt, caffemodel, outputs=OUTPUTS)
    net = cv2.dnn.readNetFromCaffe(prototxt, caffemodel)
    x = _input(2)
    net.setInput(x.numpy())
    with torch.no_grad():
        for mine, theirs in zip(gm(x), net.forward(OUTPUTS)):
            theirs = theirs.reshape(-1)  # float32 convolutions in another order: 1e-5 of the logits' range
            np.testing.assert_allclose(mine.numpy().reshape(-1), theirs, rtol=0,
                                       atol=max(1e-5 * np.abs(theirs).max(), 5e-5))


@pytest.mark.parametrize("platform", ["trt_int8", "ncnn_int8"])
def test_quantized_ssd_deploys(ssd_files, platform, tmp_path):
    """Quantized, exported and run: the deployed file computes the simulation (the prior boxes a constant output,
    an ncnn MemoryData)."""
    prototxt, caffemodel, _ = ssd_files
    gm = fxq.load_caffe(prototxt, caffemodel, outputs=OUTPUTS)
    q = fxq.quantize(gm, [_input(s) for s in range(4)], platform, progress=False)
    x = _input(9)
    with torch.no_grad():
        sim = [o.numpy().reshape(-1) for o in q(x)]
    files = {str(f).split(".", 1)[1]: f for f in fxq.export(q, platform, tmp_path / "ssd", example_inputs=(x,))}
    if platform == "ncnn_int8":
        ex = ncnn_net(files["param"], files["bin"], int8=True).create_extractor()
        ex.input("in0", ncnn_mat(x[0].numpy()))
        got = [np.array(ex.extract(f"out{i}")[1]).reshape(-1) for i in range(3)]
    else:
        sess = ort_session(files["onnx"], optimize=False)
        got = [o.reshape(-1) for o in sess.run(None, {sess.get_inputs()[0].name: x.numpy()})]
    for name, mine, theirs in zip(OUTPUTS, sim, got):
        np.testing.assert_allclose(theirs, mine, rtol=1e-4, atol=1e-4, err_msg=name)


def test_cli_quantizes_the_cut_ssd(ssd_files, tmp_path, monkeypatch):
    """``fxq quantize net.prototxt --outputs ...``: the refusal's CLI form, followed, writes the ncnn files."""
    from fxq.cli import main

    prototxt, caffemodel, _ = ssd_files
    monkeypatch.chdir(tmp_path)
    (tmp_path / "calib").mkdir()
    for i in range(3):
        np.save(tmp_path / "calib" / f"{i}.npy", _input(i).numpy())
    args = ["quantize", prototxt, "--caffemodel", caffemodel, "--calib", "calib", "--platform", "ncnn_int8",
            "--out", "out", "-q"]
    assert main(args) == 1  # DetectionOutput refused, the cut named
    assert main([*args, "--outputs", ",".join(OUTPUTS)]) == 0
    assert any(p.suffix == ".param" for p in (tmp_path / "out").rglob("*"))


def test_prior_box_truncates_sizes_as_the_fork_does():
    """SSD512's fractional sizes (min 20.48, max 51.2): the fork's C++ truncates them to ints (OpenCV does not)."""
    from fxq.frontends.caffe.layers.detection import prior_boxes

    got = prior_boxes((8, 8), (64.0, 64.0), (8.0, 8.0), [20.48], [51.2], [2.0], True, False, 0.5, [0.1] * 4)
    want = prior_box_ref(8, 8, 64, 64, [20.48], [51.2], [2.0], True, False, [0.1])
    np.testing.assert_allclose(got.double().numpy(), want, rtol=0, atol=1e-6)
    assert abs(float(got[0, 0, 2]) - (4 + 10) / 64) < 1e-7  # xmax of the first box: centre 4 + 20 / 2


def test_data_of_another_size_than_the_priors_is_refused(ssd_files):
    """Prior boxes are a constant of the loaded size: data of another H x W is refused with the input_shapes
    that loads the net for it, which, followed, quantizes."""
    prototxt, caffemodel, _ = ssd_files
    gm = fxq.load_caffe(prototxt, caffemodel, outputs=OUTPUTS)
    big = [torch.rand(1, 3, 64, 64) for _ in range(2)]
    with pytest.raises(fxq.CalibrationError, match=r"input 'data': the batch has shape \(1, 3, 64, 64\), but layer\(s\) "
                       r"\['a_prior', 'b_prior'\] \(PriorBox\) hold boxes computed at load for shape \[1, 3, 32, 32\]"
                       r".*input_shapes=\{'data': \[1, 3, 64, 64\]\}\) \(CLI: --input-shape data=1,3,64,64\)"):
        fxq.quantize(gm, big, "trt_int8", progress=False)
    gm = fxq.load_caffe(prototxt, caffemodel, outputs=OUTPUTS, input_shapes={"data": [1, 3, 64, 64]})
    q = fxq.quantize(gm, big, "trt_int8", progress=False)
    with torch.no_grad():
        loc, _, prior = q(big[0])
    assert loc.shape[1] == prior.shape[2]  # one box per location of the larger feature maps


def test_constant_outputs_that_are_not_batch_shaped_keep_the_refusal(tmp_path):
    """Only a constant output with a batch of 1 becomes an ncnn MemoryData output; others are refused by name."""
    class WithAnchors(torch.nn.Module):
        def __init__(self, anchors: torch.Tensor) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 4, 1)
            self.register_buffer("anchors", anchors)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return self.conv(x), self.anchors

    x = torch.rand(1, 3, 8, 8)
    for anchors in (torch.rand(3, 2), torch.tensor(2.0)):
        q = fxq.quantize(WithAnchors(anchors).eval(), [x], "ncnn_int8", progress=False)
        with pytest.raises(fxq.ExportError, match=r"graph output 1 \('anchors'\) is not computed by an exported layer"):
            fxq.export(q, "ncnn_int8", tmp_path / "m")
