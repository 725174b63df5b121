"""Models loaded by the ONNX and caffe frontends go through ``fxq.quantize`` on TRT, PPL CUDA and NCNN INT8.

Sources: one small residual CNN exported by torch's legacy exporter (opset 13 with BatchNorm folded by the
exporter, opset 17 without constant folding so BatchNormalization nodes reach fxq) and by the dynamo exporter;
two caffe nets written here (VGG-ish and residual, both with caffe's BatchNorm + Scale pairs). Each source is
loaded and each (source, platform) quantized once per run; the tests check placement, name metadata,
accuracy and FP32 mode on those results.
"""
from __future__ import annotations

import contextlib
import io
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from google.protobuf import text_format
from torch import fx, nn

import fxq
from fxq.frontends.caffe import proto
from fxq.graph.info import NodeQuant
from fxq.graph.nodes import get_attr_value
from fxq.graph.quant_graph import QuantGraph
from fxq.spec import QuantState

from _models import noise_ratio, with_bn_statistics

PLATFORMS = ["trt_int8", "ppl_cuda_int8", "ncnn_int8"]
ONNX_SOURCES = ["onnx_legacy13", "onnx_legacy17", "onnx_dynamo"]
CAFFE_SOURCES = ["caffe_vgg", "caffe_resnet"]
SOURCES = ONNX_SOURCES + CAFFE_SOURCES
BATCH = 2  # the dynamo exporter bakes the batch size into Reshape: calibrate with the exported one


# ------------------------------------------------------------------------------------------ ONNX sources
class SmallResNet(nn.Module):
    """Conv-BN-ReLU stem, a residual block (ONNX Add), max pooling, a strided conv, global pooling, Gemm."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv3, self.bn3 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv4 = nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.fc = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        z = self.bn3(self.conv3(F.relu(self.bn2(self.conv2(y)))))
        y = F.max_pool2d(F.relu(y + z), 2)
        y = F.relu(self.conv4(y))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(y, 1), 1))


_EXPORTS = {
    "onnx_legacy13": dict(dynamo=False, opset_version=13),
    "onnx_legacy17": dict(dynamo=False, opset_version=17, do_constant_folding=False),
    "onnx_dynamo": dict(dynamo=True),
}


def _export_onnx(source: str, path) -> str:
    torch.manual_seed(0)
    model = with_bn_statistics(SmallResNet(), (4, 3, 16, 16))
    file = str(path / f"{source}.onnx")
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.randn(BATCH, 3, 16, 16),), file, input_names=["image"],
                          output_names=["logits"], **_EXPORTS[source])
    return file


# ------------------------------------------------------------------------------------------ caffe sources
CAFFE_VGG = """
name: "vggish"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 dim: 16 dim: 16 } } }
layer { name: "conv1/3x3" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: 8 kernel_size: 3 pad: 1 } }
layer { name: "conv1/bn" type: "BatchNorm" bottom: "conv1" top: "conv1" batch_norm_param { use_global_stats: true } }
layer { name: "conv1/scale" type: "Scale" bottom: "conv1" top: "conv1" scale_param { bias_term: true } }
layer { name: "conv1/relu" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1" pooling_param { pool: MAX kernel_size: 3 stride: 2 } }
layer { name: "conv2/3x3" type: "Convolution" bottom: "pool1" top: "conv2"
  convolution_param { num_output: 12 kernel_size: 3 pad: 1 bias_term: false } }
layer { name: "conv2/bn" type: "BatchNorm" bottom: "conv2" top: "conv2" }
layer { name: "conv2/scale" type: "Scale" bottom: "conv2" top: "conv2" scale_param { bias_term: true } }
layer { name: "conv2/relu" type: "ReLU" bottom: "conv2" top: "conv2" }
layer { name: "pool2" type: "Pooling" bottom: "conv2" top: "pool2" pooling_param { pool: AVE kernel_size: 2 stride: 2 } }
layer { name: "fc1" type: "InnerProduct" bottom: "pool2" top: "fc1" inner_product_param { num_output: 16 } }
layer { name: "fc1/relu" type: "ReLU" bottom: "fc1" top: "fc1" }
layer { name: "drop1" type: "Dropout" bottom: "fc1" top: "fc1" }
layer { name: "fc2" type: "InnerProduct" bottom: "fc1" top: "fc2" inner_product_param { num_output: 10 } }
"""

CAFFE_RESNET = """
name: "resnetish"
input: "data"
input_shape { dim: 2 dim: 3 dim: 16 dim: 16 }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: 8 kernel_size: 3 pad: 1 bias_term: false } }
layer { name: "bn_conv1" type: "BatchNorm" bottom: "conv1" top: "conv1" }
layer { name: "scale_conv1" type: "Scale" bottom: "conv1" top: "conv1" scale_param { bias_term: true } }
layer { name: "conv1_relu" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "res2a_branch2a" type: "Convolution" bottom: "conv1" top: "res2a_branch2a"
  convolution_param { num_output: 8 kernel_size: 3 pad: 1 bias_term: false } }
layer { name: "bn2a_branch2a" type: "BatchNorm" bottom: "res2a_branch2a" top: "res2a_branch2a" }
layer { name: "scale2a_branch2a" type: "Scale" bottom: "res2a_branch2a" top: "res2a_branch2a"
  scale_param { bias_term: true } }
layer { name: "res2a_branch2a_relu" type: "ReLU" bottom: "res2a_branch2a" top: "res2a_branch2a" }
layer { name: "res2a_branch2b" type: "Convolution" bottom: "res2a_branch2a" top: "res2a_branch2b"
  convolution_param { num_output: 8 kernel_size: 3 pad: 1 bias_term: false } }
layer { name: "bn2a_branch2b" type: "BatchNorm" bottom: "res2a_branch2b" top: "res2a_branch2b" }
layer { name: "scale2a_branch2b" type: "Scale" bottom: "res2a_branch2b" top: "res2a_branch2b"
  scale_param { bias_term: true } }
layer { name: "res2a" type: "Eltwise" bottom: "conv1" bottom: "res2a_branch2b" top: "res2a" }
layer { name: "res2a_relu" type: "ReLU" bottom: "res2a" top: "res2a" }
layer { name: "res3a_branch1" type: "Convolution" bottom: "res2a" top: "res3a_branch1"
  convolution_param { num_output: 16 kernel_size: 1 stride: 2 bias_term: false } }
layer { name: "bn3a_branch1" type: "BatchNorm" bottom: "res3a_branch1" top: "res3a_branch1" }
layer { name: "scale3a_branch1" type: "Scale" bottom: "res3a_branch1" top: "res3a_branch1"
  scale_param { bias_term: true } }
layer { name: "res3a_branch2a" type: "Convolution" bottom: "res2a" top: "res3a_branch2a"
  convolution_param { num_output: 16 kernel_size: 3 pad: 1 stride: 2 bias_term: false } }
layer { name: "bn3a_branch2a" type: "BatchNorm" bottom: "res3a_branch2a" top: "res3a_branch2a" }
layer { name: "scale3a_branch2a" type: "Scale" bottom: "res3a_branch2a" top: "res3a_branch2a"
  scale_param { bias_term: true } }
layer { name: "res3a" type: "Eltwise" bottom: "res3a_branch1" bottom: "res3a_branch2a" top: "res3a"
  eltwise_param { operation: SUM coeff: 1 coeff: 0.5 } }
layer { name: "res3a_relu" type: "ReLU" bottom: "res3a" top: "res3a" }
layer { name: "pool5" type: "Pooling" bottom: "res3a" top: "pool5" pooling_param { pool: AVE global_pooling: true } }
layer { name: "fc10" type: "InnerProduct" bottom: "pool5" top: "fc10" inner_product_param { num_output: 10 } }
"""


def _caffe_weights(prototxt: str, rng: np.random.Generator) -> dict[str, list[np.ndarray]]:
    """Random blobs for every learned layer of ``prototxt`` (shapes follow the layer parameters)."""
    net = proto.NetParameter()
    text_format.Parse(prototxt, net)
    channels, blobs = {"data": 3}, {}
    for layer in net.layer:
        if not layer.bottom:  # the Input layer
            continue
        c_in = c_out = channels[layer.bottom[0]]
        if layer.type == "Convolution":
            p = layer.convolution_param
            k, c_out = p.kernel_size[0], p.num_output
            w = rng.standard_normal((c_out, c_in, k, k)).astype(np.float32) * np.sqrt(2.0 / (c_in * k * k))
            blobs[layer.name] = [w] + ([_small(rng, c_out)] if p.bias_term else [])
        elif layer.type == "BatchNorm":
            var = rng.uniform(0.5, 2.0, c_in).astype(np.float32)
            blobs[layer.name] = [_small(rng, c_in), var, np.array([1.0], np.float32)]
        elif layer.type == "Scale":
            blobs[layer.name] = [rng.uniform(0.5, 1.5, c_in).astype(np.float32), _small(rng, c_in)]
        elif layer.type == "InnerProduct":
            c_out = layer.inner_product_param.num_output
            fan_in = {"fc1": 12 * 4 * 4, "fc2": 16, "fc10": 16}[layer.name]  # pool1 rounds up: 16 -> 8
            w = rng.standard_normal((c_out, fan_in)).astype(np.float32) / np.sqrt(fan_in)
            blobs[layer.name] = [w, _small(rng, c_out)]
        for top in layer.top:
            channels[top] = c_out
    return blobs


def _small(rng: np.random.Generator, n: int) -> np.ndarray:
    return (rng.standard_normal(n) * 0.1).astype(np.float32)


def write_caffe(path, name: str, prototxt: str, seed: int = 0) -> tuple[str, str]:
    """Write ``name.prototxt`` and a ``name.caffemodel`` with random blobs (fxq's caffe schema)."""
    net = proto.NetParameter()
    text_format.Parse(prototxt, net)
    blobs = _caffe_weights(prototxt, np.random.default_rng(seed))
    for layer in net.layer:
        for array in blobs.get(layer.name, []):
            blob = layer.blobs.add()
            blob.shape.dim.extend(array.shape)
            blob.data.extend(array.ravel().tolist())
    (path / f"{name}.prototxt").write_text(prototxt)
    (path / f"{name}.caffemodel").write_bytes(net.SerializeToString())
    return str(path / f"{name}.prototxt"), str(path / f"{name}.caffemodel")


# ------------------------------------------------------------------------------------------ session cache
_loaded: dict[str, tuple[fx.GraphModule, list[torch.Tensor]]] = {}
_quantized: dict[tuple[str, str], fx.GraphModule] = {}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("frontend_models")


def loaded(source: str, folder) -> tuple[fx.GraphModule, list[torch.Tensor]]:
    """(GraphModule from the frontend, two calibration batches), built once per test run."""
    if source not in _loaded:
        if source in ONNX_SOURCES:
            gm = fxq.load_onnx(_export_onnx(source, folder))
        else:
            text = CAFFE_VGG if source == "caffe_vgg" else CAFFE_RESNET
            gm = fxq.load_caffe(*write_caffe(folder, source, text))
        g = torch.Generator().manual_seed(1)
        _loaded[source] = (gm, [torch.randn(BATCH, 3, 16, 16, generator=g) for _ in range(2)])
    return _loaded[source]


def quantized(source: str, platform: str, folder) -> fx.GraphModule:
    """``fxq.quantize`` of a loaded source with the platform's defaults, once per test run."""
    if (source, platform) not in _quantized:
        gm, data = loaded(source, folder)
        _quantized[source, platform] = fxq.quantize(gm, data, platform, progress=False)
    return _quantized[source, platform]


def op_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if isinstance(n.meta.get("fxq"), NodeQuant)]


def by_type(gm: fx.GraphModule, op_type: str) -> list[fx.Node]:
    return [n for n in op_nodes(gm) if n.meta["fxq"].op_type == op_type]


def by_role(q: fx.GraphModule, role: str) -> dict[str, nn.Module]:
    infos = QuantGraph(q).infos()
    return {name: fq for name, fq in q.fxq_quantizers.items() if infos[name].role == role}


def source_name(node: fx.Node) -> str:
    """The ONNX node name / caffe layer name a node came from, read from the frontends' records directly (not
    through fxq's source_names, which the code under test uses)."""
    (name,) = [str(node.meta[k][f]) for k, f in (("onnx", "node_name"), ("caffe", "layer"))
               if isinstance(node.meta.get(k), dict) and node.meta[k].get(f)]
    return name


def weight_quantizer(q: fx.GraphModule, node: fx.Node) -> nn.Module | None:
    """The FakeQuantize of ``node``'s weight, or None."""
    infos = QuantGraph(q).infos()
    names = [v for v in node.meta["fxq"].inputs.values() if v and infos[v].role == "weight"]
    return q.fxq_quantizers[names[0]] if names else None


def weight_of(q: fx.GraphModule, node: fx.Node) -> torch.Tensor:
    """The (FP32) weight tensor ``node`` reads."""
    infos = QuantGraph(q).infos()
    (name,) = [v for v in node.meta["fxq"].inputs.values() if v and infos[v].role == "weight"]
    return get_attr_value(q, infos[name].param)


# ------------------------------------------------------------------------------------------ every source x platform
@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("source", SOURCES)
def test_quantized_output_close_and_fp32_mode_reproduces(source, platform, model_dir):
    gm, data = loaded(source, model_dir)
    q = quantized(source, platform, model_dir)
    assert not [n for n, fq in q.fxq_quantizers.items() if fq.config.state.name in ("INITIAL", "PASSIVE_INIT")]
    x = data[1]
    with torch.no_grad():
        ref, out = gm(x), q(x)
        assert noise_ratio(out, ref) < 0.01
        with fxq.fp32_mode(q):
            torch.testing.assert_close(q(x), ref, atol=1e-5, rtol=1e-5)
        assert torch.equal(q(x), out)  # quantized again after the FP32 block


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("source", SOURCES)
def test_source_names_survive_on_op_nodes(source, platform, model_dir):
    gm, _ = loaded(source, model_dir)
    q = quantized(source, platform, model_dir)
    key = "onnx" if source in ONNX_SOURCES else "caffe"
    assert q.meta[key] == gm.meta[key]  # graph-level name mapping (inputs, outputs...) for the exporters
    before = {n.name: n.meta[key] for n in gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr")}
    modules = dict(gm.named_modules())
    folded = {n.name for n in gm.graph.nodes if n.op == "call_module"
              and isinstance(modules[n.target], (nn.modules.batchnorm._BatchNorm, nn.Dropout))}
    ops = op_nodes(q)
    assert ops
    for node in ops:
        assert node.meta[key] == before[node.name], node.name  # same node name, same source record
    assert {n.name for n in ops} == set(before) - folded
    if key == "onnx":
        convs = by_type(q, "Conv")
        assert convs and all(n.meta["onnx"]["op_type"] == "Conv" and n.meta["onnx"]["params"]["weight"]
                             for n in convs)


# ------------------------------------------------------------------------------------------ placement per platform
@pytest.mark.parametrize("source", SOURCES)
def test_trt_placement(source, model_dir):
    q = quantized(source, "trt_int8", model_dir)
    for node in by_type(q, "Conv") + by_type(q, "Gemm"):
        assert node.meta["fxq"].platform == "trt_int8"
        wq = weight_quantizer(q, node)
        out_channels = weight_of(q, node).shape[0]
        assert wq.config.per_channel and wq.config.channel_axis == 0 and wq.scale.numel() == out_channels
        assert wq.config.quant_min == -127 and wq.config.quant_max == 127
    assert not by_role(q, "bias")  # TensorRT keeps biases FP32
    for fq in by_role(q, "activation").values():
        assert not fq.config.per_channel and fq.config.quant_min == -128
    adds = by_type(q, "Add")
    if source != "caffe_vgg":  # the ONNX Add / caffe Eltwise: dispatched, every input quantized
        assert adds
    for add in adds:
        nq = add.meta["fxq"]
        assert nq.platform == "trt_int8" and len(nq.inputs) == 2 and all(nq.inputs.values())
    for relu in by_type(q, "Relu"):  # conv/add -> relu fused: the producer's output is the relu's quantizer
        producer = relu.all_input_nodes[0].meta["fxq"]
        if producer.op_type in ("Conv", "Gemm", "Add"):
            assert producer.output_state is QuantState.OVERLAPPED and producer.output == relu.meta["fxq"].output
    for pool in by_type(q, "MaxPool"):
        assert pool.meta["fxq"].output_state is QuantState.PASSIVE


@pytest.mark.parametrize("source", SOURCES)
def test_ncnn_quantizes_only_conv_and_gemm_inputs(source, model_dir):
    q = quantized(source, "ncnn_int8", model_dir)
    infos = QuantGraph(q).infos()
    consumers = {c for name in by_role(q, "activation") for c in infos[name].consumers}
    types = {n.meta["fxq"].op_type for n in op_nodes(q) if n.name in consumers}
    assert types <= {"Conv", "Gemm"} and "Conv" in types
    for node in op_nodes(q):
        nq = node.meta["fxq"]
        assert nq.output is None  # outputs stay FP32
        assert nq.quantized == (nq.op_type in ("Conv", "Gemm")), node.name
    for fq in by_role(q, "activation").values():
        assert fq.config.quant_min == -127 and fq.config.rounding.name == "HALF_FAR_FROM_ZERO"
    assert all(fq.config.per_channel for fq in by_role(q, "weight").values())


@pytest.mark.parametrize("source", SOURCES)
def test_ppl_biases_are_passive(source, model_dir):
    q = quantized(source, "ppl_cuda_int8", model_dir)
    biases = by_role(q, "bias")
    with_bias = [n for n in by_type(q, "Conv") + by_type(q, "Gemm") if n.args[2] is not None]
    assert biases and len(biases) == len(with_bias)  # folded BatchNorm gives bias-free convs a bias
    for fq in biases.values():
        assert fq.config.state is QuantState.PASSIVE_BAKED and fq.config.num_bits == 32
        data_q, weight_q = fq.derived_from
        torch.testing.assert_close(fq.scale, q.fxq_quantizers[data_q].scale * q.fxq_quantizers[weight_q].scale)
    assert {n.meta["fxq"].platform for n in by_type(q, "Add")} <= {"ppl_cuda_int8"}


# ------------------------------------------------------------------------------------------ frontend specifics
def test_batchnorm_and_scale_folded(model_dir):
    """caffe's BatchNorm + Scale pairs and ONNX BatchNormalization fold into the conv before quantization."""
    for source in ("caffe_resnet", "onnx_legacy17"):
        gm, data = loaded(source, model_dir)
        norms = [n for n in gm.graph.nodes if n.op == "call_module"
                 and isinstance(gm.get_submodule(n.target), nn.modules.batchnorm._BatchNorm)]
        assert len(norms) == (10 if source == "caffe_resnet" else 3)  # caffe's Scale is a frozen BatchNorm
        q = quantized(source, "trt_int8", model_dir)
        assert not [n for n in q.graph.nodes if n.op == "call_module"
                    and isinstance(q.get_submodule(n.target), nn.modules.batchnorm._BatchNorm)]
        convs = by_type(q, "Conv")
        assert all(n.args[2] is not None for n in convs)  # the fold gave every conv a bias
        if source == "caffe_resnet":
            assert {n.name for n in convs} == {"conv1", "res2a_branch2a", "res2a_branch2b", "res3a_branch1",
                                               "res3a_branch2a"}
            assert convs[0].meta["folded_bn"] == ["bn_conv1", "scale_conv1"]  # both layers recorded


def test_onnx_dict_batches_keyed_by_input_name(model_dir):
    gm, data = loaded("onnx_legacy13", model_dir)
    assert gm.meta["onnx"]["inputs"] == ["image"]
    q = fxq.quantize(gm, [{"image": x} for x in data], "trt_int8", progress=False)
    ref = quantized("onnx_legacy13", "trt_int8", model_dir)
    for name, fq in ref.fxq_quantizers.items():
        assert torch.equal(q.fxq_quantizers[name].scale, fq.scale), name


@pytest.mark.parametrize("source", ["onnx_legacy13", "onnx_dynamo", "caffe_vgg"])
def test_dispatching_table_by_source_name(source, model_dir):
    gm, data = loaded(source, model_dir)
    ref = quantized(source, "trt_int8", model_dir)
    convs = by_type(ref, "Conv")
    names = [source_name(n) for n in convs]
    if source == "onnx_legacy13":
        assert names[1] == "/conv2/Conv" and convs[1].name != names[1]  # the exporter's node name, not fx's
    if source == "caffe_vgg":
        assert names[1] == "conv2/3x3" and convs[1].name == "conv2_3x3"
    gemm = by_type(ref, "Gemm")[-1]
    # exact source name -> fp32; regex over source names -> per-layer overrides
    table = {names[1]: "fp32", f"{source_name(gemm)[:-1]}.": {"bit_width": 4}}
    q = fxq.quantize(gm, data, "ort_int8", fxq.QuantizationSetting(dispatching_table=table), progress=False)
    conv2 = next(n for n in op_nodes(q) if n.name == convs[1].name)
    assert conv2.meta["fxq"].platform == "fp32" and weight_quantizer(q, conv2) is None
    conv1 = next(n for n in op_nodes(q) if n.name == convs[0].name)
    assert conv1.meta["fxq"].platform == "ort_int8" and weight_quantizer(q, conv1).config.num_bits == 8
    last = next(n for n in op_nodes(q) if n.name == gemm.name)
    assert weight_quantizer(q, last).config.num_bits == 4 and weight_quantizer(q, last).config.quant_max == 7


@pytest.mark.parametrize("source", ["onnx_legacy13", "caffe_vgg"])
def test_analysis_names_layers_as_in_the_file(source, model_dir):
    _, data = loaded(source, model_dir)
    q = quantized(source, "trt_int8", model_dir)
    report = fxq.graphwise_error_analyse(q, data, steps=1)
    nodes = {n.name: n for n in q.graph.nodes}
    assert report and all(r.source == source_name(nodes[r.name]) for r in report)
    shown = "/conv2/Conv" if source == "onnx_legacy13" else "conv2/3x3"
    assert shown in str(report)
