"""fxq.load_caffe against independent references: each test writes its own prototxt and caffemodel (random weights,
serialised with fxq's schema or hand-encoded wire bytes) and checks the GraphModule against torch/numpy code
written here from caffe's layer formulas."""
from __future__ import annotations

import logging
import math
import struct

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from google.protobuf import text_format
from torch import nn

import fxq
from fxq.errors import FrontendError
from fxq.frontends.caffe import proto, supported_layer_types
from fxq.frontends.caffe.modules import CaffeChannelScale1d, CaffeChannelScale2d, CaffePooling2d, CaffeScale

FLT_MAX = float(np.finfo(np.float32).max)


# ----------------------------------------------------------------------------------------------------------------
# helpers: writing models, independent references


def _rand(rng: np.random.Generator, *shape: int, scale: float = 0.3) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def write_model(tmp_path, name: str, prototxt: str, blobs: dict[str, list[np.ndarray]] | None,
                legacy: tuple[str, ...] = ()) -> tuple[str, str | None]:
    """Write ``name.prototxt`` and, when ``blobs`` is given, ``name.caffemodel`` holding the parsed net plus blobs
    (``legacy`` layers store their blobs with num/channels/height/width instead of ``shape``)."""
    proto_path = tmp_path / f"{name}.prototxt"
    proto_path.write_text(prototxt)
    if blobs is None:
        return str(proto_path), None
    net = proto.NetParameter()
    text_format.Parse(prototxt, net, allow_unknown_field=True)
    for layer in net.layer:
        for array in blobs.get(layer.name, []):
            blob = layer.blobs.add()
            if layer.name in legacy:
                dims = (1,) * (4 - array.ndim) + array.shape
                blob.num, blob.channels, blob.height, blob.width = dims
            else:
                blob.shape.dim.extend(array.shape)
            blob.data.extend(array.ravel().tolist())
    model_path = tmp_path / f"{name}.caffemodel"
    model_path.write_bytes(net.SerializeToString())
    return str(proto_path), str(model_path)


def T(a: np.ndarray) -> torch.Tensor:  # noqa: N802 - short on purpose, used in every reference
    return torch.from_numpy(np.asarray(a, dtype=np.float64))


def ch(v: torch.Tensor) -> torch.Tensor:
    """A per-channel vector broadcast over N, C, H, W."""
    return v[None, :, None, None]


def caffe_pool_ref(x: torch.Tensor, method: str, kernel, stride, pad, ceil_mode: bool = True) -> torch.Tensor:
    """caffe's PoolingLayer::Forward_cpu, loop by loop."""
    (kh, kw), (sh, sw), (ph, pw) = kernel, stride, pad
    n, c, height, width = x.shape

    def out_size(size, k, s, p):
        span = (size + 2 * p - k) / s
        out = (math.ceil(span) if ceil_mode else math.floor(span)) + 1
        if (ph or pw) and (out - 1) * s >= size + p:
            out -= 1
        return out

    oh, ow = out_size(height, kh, sh, ph), out_size(width, kw, sw, pw)
    y = torch.empty(n, c, oh, ow, dtype=x.dtype)
    for i in range(oh):
        for j in range(ow):
            hstart, wstart = i * sh - ph, j * sw - pw
            if method == "MAX":
                hend, wend = min(hstart + kh, height), min(wstart + kw, width)
                hstart, wstart = max(hstart, 0), max(wstart, 0)
                region = x[:, :, hstart:hend, wstart:wend]
                if region.numel():
                    y[:, :, i, j] = region.amax(dim=(2, 3))
                else:
                    y[:, :, i, j] = -FLT_MAX
            else:
                hend, wend = min(hstart + kh, height + ph), min(wstart + kw, width + pw)
                pool_size = (hend - hstart) * (wend - wstart)
                hstart, wstart = max(hstart, 0), max(wstart, 0)
                hend, wend = min(hend, height), min(wend, width)
                y[:, :, i, j] = x[:, :, hstart:hend, wstart:wend].sum(dim=(2, 3)) / pool_size
    return y


def interp_ref(x: torch.Tensor, out_h: int, out_w: int) -> torch.Tensor:
    """caffe_cpu_interp2: bilinear, corners aligned."""
    n, c, in_h, in_w = x.shape
    rh = (in_h - 1) / (out_h - 1) if out_h > 1 else 0.0
    rw = (in_w - 1) / (out_w - 1) if out_w > 1 else 0.0
    y = torch.empty(n, c, out_h, out_w, dtype=x.dtype)
    for h2 in range(out_h):
        h1r = rh * h2
        h1 = int(h1r)
        h1p = 1 if h1 < in_h - 1 else 0
        lh1 = h1r - h1
        lh0 = 1 - lh1
        for w2 in range(out_w):
            w1r = rw * w2
            w1 = int(w1r)
            w1p = 1 if w1 < in_w - 1 else 0
            lw1 = w1r - w1
            lw0 = 1 - lw1
            y[:, :, h2, w2] = (lh0 * (lw0 * x[:, :, h1, w1] + lw1 * x[:, :, h1, w1 + w1p])
                               + lh1 * (lw0 * x[:, :, h1 + h1p, w1] + lw1 * x[:, :, h1 + h1p, w1 + w1p]))
    return y


def lrn_across_ref(x: torch.Tensor, size: int, alpha: float, beta: float, k: float) -> torch.Tensor:
    c = x.shape[1]
    pre = (size - 1) // 2
    scale = torch.full_like(x, k)
    for i in range(c):
        for j in range(i - pre, i - pre + size):
            if 0 <= j < c:
                scale[:, i] += alpha / size * x[:, j] ** 2
    return x * scale ** -beta


def lrn_within_ref(x: torch.Tensor, size: int, alpha: float, beta: float) -> torch.Tensor:
    pre = (size - 1) // 2
    sq = F.pad(x * x, (pre, pre, pre, pre))
    h, w = x.shape[2:]
    acc = torch.zeros_like(x)
    for di in range(size):
        for dj in range(size):
            acc += sq[:, :, di:di + h, dj:dj + w]
    return x * (1 + alpha * acc / size ** 2) ** -beta


def prelu_ref(x: torch.Tensor, slope: torch.Tensor) -> torch.Tensor:
    return torch.clamp_min(x, 0) + slope * torch.clamp_max(x, 0)


def run(gm: torch.fx.GraphModule, *inputs: torch.Tensor) -> dict[str, torch.Tensor]:
    """The GraphModule's outputs by caffe blob name."""
    with torch.no_grad():
        out = gm(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    return dict(zip(gm.meta["caffe"]["outputs"], outs))


def assert_matches(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name, value in want.items():
        torch.testing.assert_close(got[name].double(), value, rtol=1e-5, atol=1e-5, msg=f"blob {name}")


def check_structure(gm: torch.fx.GraphModule, tmp_path) -> None:
    """Meta on every node, relative names only, lint-clean, and re-traceable with the same result."""
    gm.graph.lint()
    for node in gm.graph.nodes:
        meta = node.meta["caffe"]
        assert set(meta) >= {"layer", "type", "bottom", "top", "produces"}, node.name
    assert set(gm.meta["caffe"]) >= {"inputs", "outputs", "input_shapes"}
    assert str(tmp_path) not in repr(gm.meta) + repr([n.meta for n in gm.graph.nodes])
    shapes = gm.meta["caffe"]["input_shapes"]
    inputs = [torch.randn(shapes[name]) for name in gm.meta["caffe"]["inputs"]]
    retraced = torch.fx.symbolic_trace(gm)
    with torch.no_grad():
        a, b = gm(*inputs), retraced(*inputs)
    for x, y in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
        torch.testing.assert_close(x, y)


# ----------------------------------------------------------------------------------------------------------------
# net 1: VGG-ish — conv, BatchNorm + Scale, ReLU in place, pooling with ceil rounding, InnerProduct, Softmax

VGG = """
name: "vggish"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 dim: 16 dim: 16 } } }
layer { name: "conv1/3x3" type: "Convolution" bottom: "data" top: "conv1"
  param { lr_mult: 1 decay_mult: 1 } param { lr_mult: 2 decay_mult: 0 }
  convolution_param { num_output: 8 kernel_size: 3 pad: 1 weight_filler { type: "xavier" } engine: CAFFE } }
layer { name: "bn1" type: "BatchNorm" bottom: "conv1" top: "conv1"
  batch_norm_param { use_global_stats: true eps: 0.001 } }
layer { name: "scale1" type: "Scale" bottom: "conv1" top: "conv1" scale_param { bias_term: true } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
  pooling_param { pool: MAX kernel_size: 3 stride: 2 } }
layer { name: "conv2" type: "Convolution" bottom: "pool1" top: "conv2"
  convolution_param { num_output: 12 kernel_h: 3 kernel_w: 1 pad_h: 2 pad_w: 0 stride_h: 1 stride_w: 2
                      dilation: 2 group: 4 bias_term: false } }
layer { name: "relu2" type: "ReLU" bottom: "conv2" top: "conv2" relu_param { negative_slope: 0.1 } }
layer { name: "pool2" type: "Pooling" bottom: "conv2" top: "pool2"
  pooling_param { pool: AVE kernel_size: 3 stride: 2 pad: 1 } }
layer { name: "fc1" type: "InnerProduct" bottom: "pool2" top: "fc1" inner_product_param { num_output: 16 } }
layer { name: "relu3" type: "ReLU" bottom: "fc1" top: "fc1" }
layer { name: "drop1" type: "Dropout" bottom: "fc1" top: "fc1" dropout_param { dropout_ratio: 0.5 } }
layer { name: "fc2" type: "InnerProduct" bottom: "fc1" top: "fc2"
  inner_product_param { num_output: 10 transpose: true } }
layer { name: "prob" type: "Softmax" bottom: "fc2" top: "prob" }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "fc2" bottom: "label" top: "loss" include { phase: TRAIN } }
layer { name: "acc" type: "Accuracy" bottom: "fc2" bottom: "label" top: "acc" exclude { phase: TEST } }
"""


def vgg_weights(rng: np.random.Generator) -> dict[str, list[np.ndarray]]:
    return {
        "conv1/3x3": [_rand(rng, 8, 3, 3, 3), _rand(rng, 8)],
        "bn1": [_rand(rng, 8), rng.uniform(0.5, 2.0, 8).astype(np.float32) * 0.5, np.array([0.5], np.float32)],
        "scale1": [rng.uniform(0.5, 1.5, 8).astype(np.float32), _rand(rng, 8)],
        "conv2": [_rand(rng, 12, 2, 3, 1)],
        "fc1": [_rand(rng, 16, 180, scale=0.1), _rand(rng, 16)],
        "fc2": [_rand(rng, 16, 10), _rand(rng, 10)],
    }


def vgg_ref(x: torch.Tensor, w: dict[str, list[np.ndarray]]) -> dict[str, torch.Tensor]:
    y = F.conv2d(x, T(w["conv1/3x3"][0]), T(w["conv1/3x3"][1]), padding=1)
    mean, var, factor = w["bn1"]
    y = (y - ch(T(mean / factor[0]))) / torch.sqrt(ch(T(var / factor[0])) + 1e-3)
    y = torch.relu(y * ch(T(w["scale1"][0])) + ch(T(w["scale1"][1])))
    y = caffe_pool_ref(y, "MAX", (3, 3), (2, 2), (0, 0))
    assert y.shape[-2:] == (8, 8)  # ceil rounding: floor would give 7
    y = F.conv2d(y, T(w["conv2"][0]), None, stride=(1, 2), padding=(2, 0), dilation=2, groups=4)
    y = torch.where(y > 0, y, 0.1 * y)
    y = caffe_pool_ref(y, "AVE", (3, 3), (2, 2), (1, 1))
    y = torch.relu(y.flatten(1) @ T(w["fc1"][0]).T + T(w["fc1"][1]))
    y = y @ T(w["fc2"][0]) + T(w["fc2"][1])  # transpose: true stores the weight as (K, N)
    return {"prob": torch.softmax(y, dim=1)}


def test_vggish_matches_reference(tmp_path):
    w = vgg_weights(np.random.default_rng(1))
    prototxt, model = write_model(tmp_path, "vgg", VGG, w, legacy=("fc1",))
    gm = fxq.load_caffe(prototxt, model)
    x = torch.randn(2, 3, 16, 16)
    assert_matches(run(gm, x), vgg_ref(x.double(), w))
    # structure: one submodule per layer, named after it; standard torch modules where they are exact
    modules = dict(gm.named_children())
    assert isinstance(modules["conv1_3x3"], nn.Conv2d) and modules["conv2"].groups == 4
    assert isinstance(modules["bn1"], nn.BatchNorm2d) and not modules["bn1"].affine
    assert isinstance(modules["scale1"], CaffeChannelScale2d)  # a frozen BatchNorm2d: folds like one
    assert isinstance(modules["pool1"], nn.MaxPool2d) and isinstance(modules["pool2"], nn.AvgPool2d)
    assert isinstance(modules["relu2"], nn.LeakyReLU) and isinstance(modules["drop1"], nn.Dropout)
    assert "loss" not in modules and "acc" not in modules  # TRAIN-only layers are dropped
    assert not gm.training
    meta = gm.meta["caffe"]
    assert meta["inputs"] == ["data"] and meta["outputs"] == ["prob"]
    assert meta["input_shapes"] == {"data": [2, 3, 16, 16]}
    assert meta["source"] == {"prototxt": "vgg.prototxt", "caffemodel": "vgg.caffemodel"}
    relu1 = next(n for n in gm.graph.nodes if n.name == "relu1")
    assert relu1.meta["caffe"] == {"layer": "relu1", "type": "ReLU", "bottom": ["conv1"], "top": ["conv1"],
                                   "produces": ["conv1"]}
    check_structure(gm, tmp_path)
    gm.train()  # the per-channel Scale keeps its meaning in train mode (no batch statistics)
    y = torch.randn(4, 8, 3, 3)
    torch.testing.assert_close(gm.scale1(y), y * ch(torch.from_numpy(w["scale1"][0])) + ch(torch.from_numpy(w["scale1"][1])))


def test_other_batch_size_and_input_shapes_override(tmp_path):
    w = vgg_weights(np.random.default_rng(2))
    prototxt, model = write_model(tmp_path, "vgg", VGG, w)
    gm = fxq.load_caffe(prototxt, model, input_shapes={"data": (5, 3, 16, 16)})
    assert gm.meta["caffe"]["input_shapes"] == {"data": [5, 3, 16, 16]}
    x = torch.randn(3, 3, 16, 16)  # the graph does not bake the batch size in
    assert_matches(run(gm, x), vgg_ref(x.double(), w))


# ----------------------------------------------------------------------------------------------------------------
# net 2: residual — net-level input, Split, PReLU, Eltwise SUM/coeffs/PROD/MAX, Concat, Slice, in-place ReLU

RESIDUAL = """
name: "residual"
input: "data"
input_shape { dim: 2 dim: 4 dim: 6 dim: 6 }
layer { name: "conv_a" type: "Convolution" bottom: "data" top: "conv_a"
  convolution_param { num_output: 6 kernel_size: 1 bias_term: false } }
layer { name: "split" type: "Split" bottom: "conv_a" top: "a1" top: "a2" }
layer { name: "conv_b" type: "Convolution" bottom: "a1" top: "conv_b"
  convolution_param { num_output: 6 kernel_size: 3 pad: 1 } }
layer { name: "prelu_b" type: "PReLU" bottom: "conv_b" top: "conv_b" }
layer { name: "conv_c" type: "Convolution" bottom: "a2" top: "conv_c" convolution_param { num_output: 6 kernel_size: 1 } }
layer { name: "prelu_c" type: "PReLU" bottom: "conv_c" top: "conv_c" prelu_param { channel_shared: true } }
layer { name: "sum" type: "Eltwise" bottom: "conv_b" bottom: "conv_c" top: "sum"
  eltwise_param { operation: SUM coeff: 2.0 coeff: -0.5 } }
layer { name: "sum3" type: "Eltwise" bottom: "sum" bottom: "a1" bottom: "a2" top: "sum3"
  eltwise_param { coeff: 1 coeff: -1 coeff: 1 } }
layer { name: "plain_sum" type: "Eltwise" bottom: "sum3" bottom: "a2" top: "plain_sum" }
layer { name: "prod" type: "Eltwise" bottom: "plain_sum" bottom: "conv_b" top: "prod" eltwise_param { operation: PROD } }
layer { name: "emax" type: "Eltwise" bottom: "prod" bottom: "sum" top: "emax" eltwise_param { operation: MAX } }
layer { name: "relu_e" type: "ReLU" bottom: "emax" top: "emax" }
layer { name: "cat" type: "Concat" bottom: "emax" bottom: "sum3" top: "cat" }
layer { name: "slice" type: "Slice" bottom: "cat" top: "s1" top: "s2" top: "s3"
  slice_param { axis: 1 slice_point: 3 slice_point: 8 } }
layer { name: "relu_s1" type: "ReLU" bottom: "s1" top: "s1" }
layer { name: "cat2" type: "Concat" bottom: "s1" bottom: "s3" top: "cat2" concat_param { axis: 1 } }
layer { name: "cat3" type: "Concat" bottom: "s2" bottom: "s2" top: "cat3" concat_param { axis: -1 } }
layer { name: "halves" type: "Slice" bottom: "cat3" top: "t1" top: "t2" slice_param { axis: 3 } }
"""


def residual_weights(rng: np.random.Generator) -> dict[str, list[np.ndarray]]:
    return {
        "conv_a": [_rand(rng, 6, 4, 1, 1)],
        "conv_b": [_rand(rng, 6, 6, 3, 3), _rand(rng, 6)],
        "prelu_b": [_rand(rng, 6)],
        "conv_c": [_rand(rng, 6, 6, 1, 1), _rand(rng, 6)],
        "prelu_c": [np.array([0.2], np.float32)],
    }


def residual_ref(x: torch.Tensor, w: dict[str, list[np.ndarray]]) -> dict[str, torch.Tensor]:
    a = F.conv2d(x, T(w["conv_a"][0]))
    b = prelu_ref(F.conv2d(a, T(w["conv_b"][0]), T(w["conv_b"][1]), padding=1), ch(T(w["prelu_b"][0])))
    c = prelu_ref(F.conv2d(a, T(w["conv_c"][0]), T(w["conv_c"][1])), T(w["prelu_c"][0]))
    s = 2.0 * b - 0.5 * c
    s3 = s - a + a
    prod = (s3 + a) * b
    emax = torch.relu(torch.maximum(prod, s))
    cat = torch.cat([emax, s3], dim=1)
    s1, s2, s3_ = cat[:, :3], cat[:, 3:8], cat[:, 8:]
    cat3 = torch.cat([s2, s2], dim=3)
    return {"cat2": torch.cat([torch.relu(s1), s3_], dim=1), "t1": cat3[..., :6], "t2": cat3[..., 6:]}


def test_residual_matches_reference(tmp_path):
    w = residual_weights(np.random.default_rng(3))
    prototxt, model = write_model(tmp_path, "res", RESIDUAL, w)
    gm = fxq.load_caffe(prototxt, model)
    x = torch.randn(2, 4, 6, 6)
    assert_matches(run(gm, x), residual_ref(x.double(), w))
    meta = gm.meta["caffe"]
    assert meta["inputs"] == ["data"] and meta["outputs"] == ["cat2", "t1", "t2"]  # production order
    assert meta["aliases"] == {"a1": "conv_a", "a2": "conv_a"}
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert {torch.add, torch.sub, torch.mul, torch.maximum, torch.cat} <= targets
    sum_nodes = [n for n in gm.graph.nodes if n.meta["caffe"]["layer"] == "sum"]
    assert [n.meta["caffe"]["produces"] for n in sum_nodes] == [[], ["sum"]]  # coeff multiply, then the add
    assert gm.prelu_c.weight.shape == (1,) and gm.prelu_b.weight.shape == (6,)
    check_structure(gm, tmp_path)


# ----------------------------------------------------------------------------------------------------------------
# net 3: misc — Deconvolution, Power, LRN (both regions), Upsample, Interp (4 ways), Sigmoid/TanH, pooling corner
# cases, global pooling, Flatten, Reshape, Dropout

MISC = """
name: "misc"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 6 dim: 5 dim: 5 } } }
layer { name: "deconv" type: "Deconvolution" bottom: "data" top: "deconv"
  convolution_param { num_output: 4 kernel_size: 3 stride: 2 pad: 1 group: 2 } }
layer { name: "power" type: "Power" bottom: "deconv" top: "power" power_param { power: 2 scale: 0.5 shift: 1 } }
layer { name: "lrn_a" type: "LRN" bottom: "power" top: "lrn_a" lrn_param { local_size: 3 alpha: 0.1 beta: 0.75 k: 2 } }
layer { name: "lrn_w" type: "LRN" bottom: "lrn_a" top: "lrn_w"
  lrn_param { local_size: 3 alpha: 0.2 beta: 0.6 norm_region: WITHIN_CHANNEL } }
layer { name: "up" type: "Upsample" bottom: "lrn_w" top: "up" upsample_param { scale: 2 } }
layer { name: "sig" type: "Sigmoid" bottom: "up" top: "sig" }
layer { name: "pool_ave" type: "Pooling" bottom: "sig" top: "pool_ave"
  pooling_param { pool: AVE kernel_size: 3 stride: 2 pad: 1 } }
layer { name: "interp" type: "Interp" bottom: "pool_ave" top: "interp" interp_param { zoom_factor: 2 } }
layer { name: "tanh" type: "TanH" bottom: "interp" top: "interp" }
layer { name: "gmax" type: "Pooling" bottom: "interp" top: "gmax" pooling_param { pool: MAX global_pooling: true } }
layer { name: "gave" type: "Pooling" bottom: "interp" top: "gave" pooling_param { pool: AVE global_pooling: true } }
layer { name: "flat" type: "Flatten" bottom: "gmax" top: "flat" }
layer { name: "flat2" type: "Flatten" bottom: "gave" top: "flat2" flatten_param { axis: 1 end_axis: 2 } }
layer { name: "resh" type: "Reshape" bottom: "gave" top: "resh" reshape_param { shape { dim: 0 dim: 2 dim: -1 } } }
layer { name: "drop" type: "Dropout" bottom: "resh" top: "resh" }
layer { name: "interp_hw" type: "Interp" bottom: "interp" top: "interp_hw" interp_param { height: 7 width: 5 } }
layer { name: "interp_sh" type: "Interp" bottom: "interp" top: "interp_sh"
  interp_param { shrink_factor: 2 pad_beg: -1 pad_end: -1 } }
layer { name: "interp_ref" type: "Interp" bottom: "pool_ave" bottom: "interp_hw" top: "interp_ref" }
layer { name: "pool_bigpad" type: "Pooling" bottom: "sig" top: "pool_bigpad"
  pooling_param { pool: MAX kernel_size: 3 stride: 2 pad: 2 } }
layer { name: "pool_floor" type: "Pooling" bottom: "sig" top: "pool_floor"
  pooling_param { pool: AVE kernel_size: 3 stride: 2 pad: 2 round_mode: FLOOR } }
layer { name: "pool_nopad" type: "Pooling" bottom: "sig" top: "pool_nopad"
  pooling_param { pool: AVE kernel_size: 3 stride: 4 ceil_mode: true } }
"""


def misc_weights(rng: np.random.Generator) -> dict[str, list[np.ndarray]]:
    return {"deconv": [_rand(rng, 6, 2, 3, 3), _rand(rng, 4)]}


def misc_ref(x: torch.Tensor, w: dict[str, list[np.ndarray]]) -> dict[str, torch.Tensor]:
    y = F.conv_transpose2d(x, T(w["deconv"][0]), T(w["deconv"][1]), stride=2, padding=1, groups=2)
    assert y.shape[-2:] == (9, 9)
    y = (1 + 0.5 * y) ** 2
    y = lrn_across_ref(y, 3, 0.1, 0.75, 2.0)
    y = lrn_within_ref(y, 3, 0.2, 0.6)
    sig = torch.sigmoid(y.repeat_interleave(2, dim=2).repeat_interleave(2, dim=3))
    pool_ave = caffe_pool_ref(sig, "AVE", (3, 3), (2, 2), (1, 1))
    assert pool_ave.shape[-2:] == (10, 10)
    interp = torch.tanh(interp_ref(pool_ave, 19, 19))
    gave = interp.mean(dim=(2, 3), keepdim=True)
    interp_hw = interp_ref(interp, 7, 5)
    return {
        "flat": interp.amax(dim=(2, 3)),
        "flat2": gave.flatten(1, 2),
        "resh": gave.reshape(2, 2, -1),
        "interp_sh": interp_ref(interp[:, :, 1:18, 1:18], 9, 9),
        "interp_ref": interp_ref(pool_ave, 7, 5),
        "pool_bigpad": caffe_pool_ref(sig, "MAX", (3, 3), (2, 2), (2, 2)),
        "pool_floor": caffe_pool_ref(sig, "AVE", (3, 3), (2, 2), (2, 2), ceil_mode=False),
        "pool_nopad": caffe_pool_ref(sig, "AVE", (3, 3), (4, 4), (0, 0)),
        "_interp_hw": interp_hw,
    }


def test_misc_matches_reference(tmp_path):
    w = misc_weights(np.random.default_rng(4))
    prototxt, model = write_model(tmp_path, "misc", MISC, w)
    gm = fxq.load_caffe(prototxt, model)
    x = torch.randn(2, 6, 5, 5)
    want = misc_ref(x.double(), w)
    want.pop("_interp_hw")  # consumed by interp_ref, so not a net output
    assert_matches(run(gm, x), want)
    modules = dict(gm.named_children())
    assert isinstance(modules["deconv"], nn.ConvTranspose2d) and isinstance(modules["lrn_a"], nn.LocalResponseNorm)
    assert isinstance(modules["up"], nn.Upsample) and isinstance(modules["gmax"], nn.AdaptiveMaxPool2d)
    assert isinstance(modules["pool_ave"], nn.AvgPool2d)
    assert isinstance(modules["pool_bigpad"], CaffePooling2d)  # pad > kernel / 2: torch refuses it
    check_structure(gm, tmp_path)


# ----------------------------------------------------------------------------------------------------------------
# net 4: Scale in all its forms, InnerProduct from axis 2, BatchNorm on 3-D blobs, two net inputs

SCALES = """
input: "x"
input_shape { dim: 2 dim: 3 dim: 4 dim: 5 }
input: "s"
input_shape { dim: 3 dim: 4 }
layer { name: "sc_2b" type: "Scale" bottom: "x" bottom: "s" top: "y1" scale_param { bias_term: true } }
layer { name: "sc_ax" type: "Scale" bottom: "x" top: "y2" scale_param { axis: -2 num_axes: 2 } }
layer { name: "sc_scalar" type: "Scale" bottom: "x" top: "y3" scale_param { num_axes: 0 bias_term: true } }
layer { name: "ip" type: "InnerProduct" bottom: "x" top: "ip" inner_product_param { num_output: 6 axis: 2 } }
layer { name: "bn" type: "BatchNorm" bottom: "ip" top: "ip" batch_norm_param { eps: 0.01 } }
layer { name: "sc_ch" type: "Scale" bottom: "ip" top: "ip" }
"""


def test_scale_forms_match_reference(tmp_path):
    rng = np.random.default_rng(11)
    w = {
        "sc_2b": [_rand(rng, 3, 4)],
        "sc_ax": [_rand(rng, 4, 5)],
        "sc_scalar": [_rand(rng, 1), _rand(rng, 1)],
        "ip": [_rand(rng, 6, 20), _rand(rng, 6)],
        "bn": [_rand(rng, 3), rng.uniform(0.5, 2, 3).astype(np.float32), np.array([2.0], np.float32)],
        "sc_ch": [_rand(rng, 3)],
    }
    w["sc_scalar"] = [a.reshape(()) for a in w["sc_scalar"]]  # num_axes 0: a 0-D blob
    prototxt, model = write_model(tmp_path, "scales", SCALES, w)
    gm = fxq.load_caffe(prototxt, model)
    x, s = torch.randn(2, 3, 4, 5), torch.randn(3, 4)
    xd, sd = x.double(), s.double()
    ip = xd.flatten(2) @ T(w["ip"][0]).T + T(w["ip"][1])
    mean, var, factor = w["bn"]
    ip = (ip - T(mean / 2.0)[None, :, None]) / torch.sqrt(T(var / 2.0)[None, :, None] + 0.01)
    want = {
        "y1": xd * sd[None, :, :, None] + T(w["sc_2b"][0])[None, :, :, None],
        "y2": xd * T(w["sc_ax"][0]),
        "y3": xd * T(w["sc_scalar"][0]) + T(w["sc_scalar"][1]),
        "ip": ip * T(w["sc_ch"][0])[None, :, None],
    }
    assert_matches(run(gm, x, s), want)
    assert gm.meta["caffe"]["inputs"] == ["x", "s"]
    assert isinstance(gm.sc_2b, CaffeScale) and isinstance(gm.sc_ax, CaffeScale)
    assert isinstance(gm.sc_ch, CaffeChannelScale1d) and isinstance(gm.bn, nn.BatchNorm1d)
    assert not gm.sc_ch.bias.requires_grad and not gm.sc_ch.bias.any()  # no bias_term: a frozen zero bias
    sc_2b = next(n for n in gm.graph.nodes if n.target == "sc_2b")
    assert sc_2b.meta["caffe"]["op_type"] == "Mul"
    check_structure(gm, tmp_path)


# ----------------------------------------------------------------------------------------------------------------
# pooling corner cases, one layer each, against caffe's loop

POOL_CASES = [
    # (method, kernel, stride, pad, extra params, input HxW, torch module expected)
    ("MAX", (3, 3), (2, 2), (0, 0), "", (8, 8), nn.MaxPool2d),
    ("AVE", (3, 3), (2, 2), (1, 1), "", (8, 8), nn.AvgPool2d),
    ("AVE", (2, 2), (2, 2), (1, 1), "", (7, 7), nn.AvgPool2d),  # last window clipped away (pad rule)
    ("MAX", (3, 2), (2, 3), (1, 0), "", (9, 7), nn.MaxPool2d),  # pad_h only: caffe clips both axes
    ("AVE", (3, 3), (1, 1), (2, 2), "", (6, 6), CaffePooling2d),  # pad > kernel/2
    ("MAX", (3, 3), (2, 2), (1, 1), "round_mode: FLOOR", (8, 8), nn.MaxPool2d),
    ("AVE", (3, 3), (2, 2), (1, 1), "ceil_mode: false", (8, 8), nn.AvgPool2d),
    ("MAX", (2, 2), (4, 4), (0, 0), "", (7, 7), CaffePooling2d),  # caffe keeps a window torch drops
    ("AVE", (1, 1), (3, 3), (0, 0), "", (8, 7), CaffePooling2d),
]


def _pool_params(kernel, stride, pad, extra) -> str:
    return (f"kernel_h: {kernel[0]} kernel_w: {kernel[1]} stride_h: {stride[0]} stride_w: {stride[1]} "
            f"pad_h: {pad[0]} pad_w: {pad[1]} {extra}")


@pytest.mark.parametrize("method,kernel,stride,pad,extra,size,module_type", POOL_CASES,
                         ids=[f"{c[0]}-k{c[1][0]}{c[1][1]}-s{c[2][0]}{c[2][1]}-p{c[3][0]}{c[3][1]}-{c[4] or 'ceil'}"
                              .replace(" ", "").replace(":", "") for c in POOL_CASES])
def test_pooling_matches_caffe_formula(tmp_path, method, kernel, stride, pad, extra, size, module_type):
    text = f"""
    input: "x" input_dim: 2 input_dim: 3 input_dim: {size[0]} input_dim: {size[1]}
    layer {{ name: "pool" type: "Pooling" bottom: "x" top: "y"
      pooling_param {{ pool: {method} {_pool_params(kernel, stride, pad, extra)} }} }}
    """
    prototxt, model = write_model(tmp_path, "pool", text, {})
    gm = fxq.load_caffe(prototxt, model)
    assert type(gm.pool) is module_type
    x = torch.randn(2, 3, *size)
    want = caffe_pool_ref(x.double(), method, kernel, stride, pad, ceil_mode="FLOOR" not in extra and
                          "false" not in extra)
    assert_matches(run(gm, x), {"y": want})


# ----------------------------------------------------------------------------------------------------------------
# prototxt only, formats, errors


def test_prototxt_only_loads_with_random_weights_and_warns(tmp_path, caplog):
    prototxt, _ = write_model(tmp_path, "vgg", VGG, None)
    with caplog.at_level(logging.WARNING, logger="fxq"):
        gm = fxq.load_caffe(prototxt)
    assert "no caffemodel" in caplog.text
    out = gm(torch.randn(2, 3, 16, 16))
    assert out.shape == (2, 10) and torch.isfinite(out).all()
    torch.testing.assert_close(out.sum(dim=1), torch.ones(2))
    assert gm.conv1_3x3.weight.shape == (8, 3, 3, 3)  # input channels learned from the Input shape
    assert torch.equal(gm.bn1.running_var, torch.ones(8)) and torch.equal(gm.scale1.weight, torch.ones(8))
    assert gm.meta["caffe"]["source"]["caffemodel"] is None


def test_unknown_fields_are_skipped(tmp_path):
    text = VGG.replace('top: "pool1"', 'top: "pool1" some_fork_param { mode: FANCY nested { a: 1 } } engine: X')
    prototxt, model = write_model(tmp_path, "vgg", text, vgg_weights(np.random.default_rng(5)))
    assert fxq.load_caffe(prototxt, model).meta["caffe"]["outputs"] == ["prob"]


def test_unknown_layer_type_names_file_layer_type_and_supported(tmp_path):
    text = VGG.replace('name: "prob" type: "Softmax"', 'name: "fancy1" type: "FancyLayer"')
    prototxt, _ = write_model(tmp_path, "fancy", text, None)
    with pytest.raises(FrontendError) as info:
        fxq.load_caffe(prototxt)
    message = str(info.value)
    assert "fancy.prototxt" in message and "'fancy1'" in message and "'FancyLayer'" in message
    assert all(t in message for t in supported_layer_types()) and "Convolution" in message


def test_v1_layers_are_refused(tmp_path):
    text = """
    name: "old"
    input: "data" input_dim: 1 input_dim: 3 input_dim: 8 input_dim: 8
    layers { name: "conv1" type: CONVOLUTION bottom: "data" top: "conv1" blobs_lr: 1
             convolution_param { num_output: 4 kernel_size: 3 } }
    """
    prototxt, _ = write_model(tmp_path, "v1", text, None)
    with pytest.raises(FrontendError, match=r"V1.*'conv1'.*upgrade_net_proto_text"):
        fxq.load_caffe(prototxt)


def test_missing_layer_weights_name_the_layer(tmp_path):
    w = vgg_weights(np.random.default_rng(6))
    del w["conv2"]
    prototxt, model = write_model(tmp_path, "vgg", VGG, w)
    with pytest.raises(FrontendError, match=r"vgg\.caffemodel.*no weights for layer 'conv2'"):
        fxq.load_caffe(prototxt, model)


def test_missing_blob_names_the_layer(tmp_path):
    w = vgg_weights(np.random.default_rng(7))
    w["conv1/3x3"] = w["conv1/3x3"][:1]  # bias blob missing, bias_term is true
    prototxt, model = write_model(tmp_path, "vgg", VGG, w)
    with pytest.raises(FrontendError, match=r"'conv1/3x3'.*1 blob\(s\), expected 2"):
        fxq.load_caffe(prototxt, model)


def test_misshaped_blob_names_the_layer(tmp_path):
    w = vgg_weights(np.random.default_rng(8))
    w["fc1"][0] = _rand(np.random.default_rng(0), 16, 181)
    prototxt, model = write_model(tmp_path, "vgg", VGG, w)
    with pytest.raises(FrontendError, match=r"'fc1'.*blob 0 \(weight\) has shape \(16, 181\), expected \(16, 180\)"):
        fxq.load_caffe(prototxt, model)


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_corrupt_caffemodel_names_the_file(tmp_path, damage):
    prototxt, model = write_model(tmp_path, "vgg", VGG, vgg_weights(np.random.default_rng(9)))
    data = open(model, "rb").read()
    broken = data[: len(data) // 2] if damage == "truncated" else b"\x0a\xff\xff\xff\xff\x0f" + data[:40]
    with open(model, "wb") as f:
        f.write(broken)
    with pytest.raises(FrontendError, match=r"vgg\.caffemodel: not a valid caffemodel"):
        fxq.load_caffe(prototxt, model)


def test_other_errors_name_what_is_wrong(tmp_path):
    bad_syntax, _ = write_model(tmp_path, "syntax", 'layer { name: "a" type: "ReLU" ', None)
    with pytest.raises(FrontendError, match=r"syntax\.prototxt: not a valid caffe prototxt"):
        fxq.load_caffe(bad_syntax)
    no_shape, _ = write_model(tmp_path, "noshape", 'layer { name: "in" type: "Input" top: "data" }', None)
    with pytest.raises(FrontendError, match=r"input 'data' has no shape.*input_shapes"):
        fxq.load_caffe(no_shape)
    gm = fxq.load_caffe(no_shape, input_shapes={"data": [1, 2]})
    assert gm.meta["caffe"]["outputs"] == ["data"]
    with pytest.raises(FrontendError, match=r"'label'.*not inputs of the net"):
        fxq.load_caffe(no_shape, input_shapes={"data": [1, 2], "label": [1]})
    dangling, _ = write_model(tmp_path, "dangling", VGG.replace('bottom: "pool1"', 'bottom: "pool9"'), None)
    with pytest.raises(FrontendError, match=r"layer 'conv2' \(Convolution\): bottom blob 'pool9'"):
        fxq.load_caffe(dangling)


# ----------------------------------------------------------------------------------------------------------------
# the schema's field numbers, proven with hand-encoded protobuf wire bytes (independent of our descriptors)


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _vi(field: int, n: int) -> bytes:
    return _varint(field << 3) + _varint(n)


def _ld(field: int, payload: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def _s(field: int, text: str) -> bytes:
    return _ld(field, text.encode())


def _f32(field: int, x: float) -> bytes:
    return _varint(field << 3 | 5) + struct.pack("<f", x)


def _packed_f32(field: int, xs) -> bytes:
    return _ld(field, struct.pack(f"<{len(xs)}f", *xs))


def _packed_varints(field: int, ns) -> bytes:
    return _ld(field, b"".join(_varint(n) for n in ns))


def test_wire_format_field_numbers():
    conv = _s(1, "conv") + _s(2, "Convolution") + _s(3, "data") + _s(4, "conv") + _ld(106, (
        _vi(1, 4) + _vi(2, 0) + _vi(3, 1) + _vi(4, 3) + _vi(5, 2) + _vi(6, 2) + _vi(9, 1) + _vi(10, 2)
        + _vi(11, 3) + _vi(12, 5) + _vi(13, 1) + _vi(14, 2) + _vi(16, 1) + _vi(18, 2)))
    conv += _ld(8, _vi(1, 1)) + _ld(9, _vi(1, 0) + _vi(2, 3) + _s(4, "st") + _s(5, "nst")) + _vi(10, 1)
    conv += _ld(6, _s(1, "w") + _f32(3, 2.0) + _f32(4, 0.5)) + _f32(5, 1.5) + _vi(11, 1)
    conv += _ld(7, _ld(7, _packed_varints(1, [2, 3])) + _packed_f32(5, [1, 2, 3, 4, 5, 6]) + _packed_f32(6, [9]))
    conv += _ld(7, _vi(1, 1) + _vi(2, 1) + _vi(3, 1) + _vi(4, 2) + _f32(5, 7.0) + _f32(5, 8.0))  # legacy, unpacked
    conv += _ld(7, _ld(8, struct.pack("<2d", 0.25, -0.5)))
    pool = _s(1, "pool") + _ld(121, _vi(1, 1) + _vi(2, 3) + _vi(3, 2) + _vi(4, 1) + _vi(5, 3) + _vi(6, 2)
                               + _vi(7, 1) + _vi(8, 2) + _vi(9, 1) + _vi(10, 0) + _vi(12, 1) + _vi(13, 1))
    misc = _s(1, "misc") + b"".join([
        _ld(117, _vi(1, 10) + _vi(2, 0) + _vi(5, 2) + _vi(6, 1)),
        _ld(139, _vi(1, 1) + _f32(2, 0.9) + _f32(3, 0.01)),
        _ld(142, _vi(1, 2) + _vi(2, 3) + _vi(4, 1)),
        _ld(110, _vi(1, 2) + _packed_f32(2, [0.5, -1.0]) + _vi(3, 0)),
        _ld(104, _vi(1, 3) + _vi(2, (-1) & ((1 << 64) - 1))),
        _ld(126, _vi(1, 2) + _vi(2, 3) + _vi(2, 5) + _vi(3, 2)),
        _ld(125, _vi(2, 3)),
        _ld(123, _f32(1, 0.1)),
        _ld(131, _vi(2, 1)),
        _ld(118, _vi(1, 7) + _f32(2, 0.5) + _f32(3, 0.25) + _vi(4, 1) + _f32(5, 3.0)),
        _ld(122, _f32(1, 3.0) + _f32(2, 4.0) + _f32(3, 5.0)),
        _ld(133, _ld(1, _packed_varints(1, [0, -1 & ((1 << 64) - 1), 4])) + _vi(2, 1) + _vi(3, 2)),
        _ld(135, _vi(1, 2) + _vi(2, 3)),
        _ld(143, _ld(1, _packed_varints(1, [1, 3, 8, 8]))),
        _ld(108, _f32(1, 0.3)),
    ])
    v1 = _s(4, "old") + _s(2, "in") + _s(3, "out") + _ld(6, _packed_f32(5, [1.0]))
    net = (_s(1, "wire") + _s(3, "data") + b"".join(_vi(4, d) for d in (1, 3, 8, 8))
           + _ld(8, _packed_varints(1, [1, 3, 8, 8])) + _vi(5, 1) + _ld(6, _vi(1, 0) + _vi(2, 4) + _s(3, "x"))
           + _vi(7, 1) + _ld(2, v1) + _ld(100, conv) + _ld(100, pool) + _ld(100, misc))

    msg = proto.NetParameter()
    msg.ParseFromString(net)
    assert msg.name == "wire" and list(msg.input) == ["data"] and list(msg.input_dim) == [1, 3, 8, 8]
    assert list(msg.input_shape[0].dim) == [1, 3, 8, 8] and msg.force_backward and msg.debug_info
    assert msg.state.phase == 0 and msg.state.level == 4 and list(msg.state.stage) == ["x"]
    assert msg.layers[0].name == "old" and list(msg.layers[0].bottom) == ["in"] and list(msg.layers[0].top) == ["out"]
    assert list(msg.layers[0].blobs[0].data) == [1.0]

    c = msg.layer[0]
    assert (c.name, c.type, list(c.bottom), list(c.top)) == ("conv", "Convolution", ["data"], ["conv"])
    cp = c.convolution_param
    assert (cp.num_output, cp.bias_term, list(cp.pad), list(cp.kernel_size), cp.group, list(cp.stride)) == \
        (4, False, [1], [3], 2, [2])
    assert (cp.pad_h, cp.pad_w, cp.kernel_h, cp.kernel_w, cp.stride_h, cp.stride_w, cp.axis, list(cp.dilation)) == \
        (1, 2, 3, 5, 1, 2, 1, [2])
    assert c.include[0].phase == 1 and c.exclude[0].phase == 0 and c.exclude[0].min_level == 3
    assert list(c.exclude[0].stage) == ["st"] and list(c.exclude[0].not_stage) == ["nst"] and c.phase == 1
    assert (c.param[0].name, c.param[0].lr_mult, c.param[0].decay_mult) == ("w", 2.0, 0.5)
    assert list(c.loss_weight) == [1.5] and list(c.propagate_down) == [True]
    b0, b1, b2 = c.blobs
    assert list(b0.shape.dim) == [2, 3] and list(b0.data) == [1, 2, 3, 4, 5, 6] and list(b0.diff) == [9]
    assert (b1.num, b1.channels, b1.height, b1.width, list(b1.data)) == (1, 1, 1, 2, [7.0, 8.0])
    assert list(b2.double_data) == [0.25, -0.5]

    pp = msg.layer[1].pooling_param
    assert (pp.pool, list(pp.kernel_size), list(pp.stride), list(pp.pad)) == (1, [3], [2], [1])
    assert (pp.kernel_h, pp.kernel_w, pp.stride_h, pp.stride_w, pp.pad_h, pp.pad_w) == (3, 2, 1, 2, 1, 0)
    assert pp.global_pooling and pp.round_mode == 1

    m = msg.layer[2]
    ip = m.inner_product_param
    assert (ip.num_output, ip.bias_term, ip.axis, ip.transpose) == (10, False, 2, True)
    bn = m.batch_norm_param
    assert bn.use_global_stats and bn.moving_average_fraction == pytest.approx(0.9) and bn.eps == pytest.approx(0.01)
    assert (m.scale_param.axis, m.scale_param.num_axes, m.scale_param.bias_term) == (2, 3, True)
    ep = m.eltwise_param
    assert (ep.operation, list(ep.coeff), ep.stable_prod_grad) == (2, [0.5, -1.0], False)
    assert (m.concat_param.concat_dim, m.concat_param.axis) == (3, -1)
    assert (m.slice_param.slice_dim, list(m.slice_param.slice_point), m.slice_param.axis) == (2, [3, 5], 2)
    assert m.softmax_param.axis == 3 and m.relu_param.negative_slope == pytest.approx(0.1)
    assert m.prelu_param.channel_shared
    lrn = m.lrn_param
    assert (lrn.local_size, lrn.alpha, lrn.beta, lrn.norm_region, lrn.k) == (7, 0.5, 0.25, 1, 3.0)
    assert (m.power_param.power, m.power_param.scale, m.power_param.shift) == (3.0, 4.0, 5.0)
    rp = m.reshape_param
    assert (list(rp.shape.dim), rp.axis, rp.num_axes) == ([0, -1, 4], 1, 2)
    assert (m.flatten_param.axis, m.flatten_param.end_axis) == (2, 3)
    assert list(m.input_param.shape[0].dim) == [1, 3, 8, 8]
    assert m.dropout_param.dropout_ratio == pytest.approx(0.3)


def test_hand_encoded_caffemodel_loads(tmp_path):
    """A caffemodel written byte by byte (unpacked floats, legacy 4-D blob shapes, a V1 layer) feeds load_caffe."""
    rng = np.random.default_rng(10)
    weight, bias = _rand(rng, 2, 3, 3, 3), _rand(rng, 2)
    scale = _rand(rng, 2)

    def legacy_blob(array: np.ndarray) -> bytes:
        dims = (1,) * (4 - array.ndim) + array.shape
        return b"".join(_vi(i + 1, d) for i, d in enumerate(dims)) + b"".join(_f32(5, v) for v in array.ravel())

    conv = _s(1, "conv") + _s(2, "Convolution") + _ld(7, legacy_blob(weight)) + _ld(7, legacy_blob(bias))
    v1_scale = _s(4, "scale") + _ld(6, _ld(7, _packed_varints(1, [2])) + _packed_f32(5, scale.tolist()))
    (tmp_path / "hand.caffemodel").write_bytes(_ld(100, conv) + _ld(2, v1_scale))
    (tmp_path / "hand.prototxt").write_text("""
    layer { name: "in" type: "Input" top: "data" input_param { shape { dim: 1 dim: 3 dim: 5 dim: 5 } } }
    layer { name: "conv" type: "Convolution" bottom: "data" top: "conv" convolution_param { num_output: 2 kernel_size: 3 } }
    layer { name: "scale" type: "Scale" bottom: "conv" top: "out" }
    """)
    gm = fxq.load_caffe(tmp_path / "hand.prototxt", tmp_path / "hand.caffemodel")
    x = torch.randn(1, 3, 5, 5)
    want = F.conv2d(x.double(), T(weight), T(bias)) * ch(T(scale))
    assert_matches(run(gm, x), {"out": want})
