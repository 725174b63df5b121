"""Helpers of the export tests: small quantized models, onnxruntime runs, and the fidelity measures.

Fidelity is measured two ways (see ``tests/test_export_onnx.py`` for why both):

* end to end — the exported model on onnxruntime against fxq's simulation, in LSBs of the output quantizer;
* segment by segment ("teacher forced") — every activation QuantizeLinear of the exported model is fed, on its
  upstream side, with fxq's own integer codes, so each quantized tensor is compared on identical inputs.
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np
import onnx
import torch
from torch import fx

import fxq
from fxq import onnx_data

from _models import with_bn_statistics


def quantize_model(model: torch.nn.Module, platform: str, shape=(2, 3, 64, 64), batches: int = 2, seed: int = 0,
                   **kw) -> fx.GraphModule:
    torch.manual_seed(seed)
    setting = fxq.QuantizationSetting()
    setting.quantize_activation_setting.calib_algorithm = "minmax"
    data = [torch.randn(*shape) for _ in range(batches)]
    return fxq.quantize(model.eval(), data, platform, setting=setting, progress=False, **kw)


def ncnn_net(param, bin_, *, int8: bool, packing: bool = True, lightmode: bool = True):
    """An ``ncnn.Net`` of ``param`` / ``bin_`` as the export tests run them: CPU, one thread, fp16 / bf16 off (ncnn's
    defaults round activations apart from the simulation), int8 inference as asked."""
    import ncnn

    net = ncnn.Net()
    o = net.opt
    o.use_vulkan_compute = False
    o.num_threads = 1
    o.use_int8_inference = int8
    o.use_packing_layout = packing
    o.use_fp16_storage = o.use_fp16_packed = o.use_fp16_arithmetic = o.use_bf16_storage = False
    o.lightmode = lightmode
    assert net.load_param(str(param)) == 0 and net.load_model(str(bin_)) == 0
    return net


def ort_session(model_or_path, optimize: bool = True):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.intra_op_num_threads = 1
    opts.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize
                                     else ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    return onnx_data.ort_session(model_or_path, opts)  # a path, or a ModelProto (over 2 GiB: data in memory)


def relu_loop_body() -> onnx.GraphProto:
    """The body of an ONNX ``Loop`` that applies Relu to its carried value (a Loop fxq refuses to convert)."""
    from onnx import TensorProto, helper

    return helper.make_graph(
        [helper.make_node("Identity", ["c_in"], ["c_out"]), helper.make_node("Relu", ["v_in"], ["v_out"])], "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("c_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("v_in", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("c_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("v_out", TensorProto.FLOAT, None)])


def run_ort(model_or_path, x: torch.Tensor, optimize: bool = True) -> np.ndarray:
    """The first output of the exported model on ``x`` (its single input), in onnxruntime."""
    sess = ort_session(model_or_path, optimize)
    return sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]


def fx_values(gm: fx.GraphModule, *args) -> dict[str, torch.Tensor]:
    """Every tensor value of one fxq forward pass, by fx node name."""
    values: dict[str, torch.Tensor] = {}

    class _Capture(fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            if isinstance(out, torch.Tensor):
                values[n.name] = out.detach().clone()
            return out

    with torch.no_grad():
        _Capture(gm).run(*args)
    return values


@dataclasses.dataclass
class EndToEnd:
    max_lsb: float
    within_1_lsb: float
    exact: float
    cosine: float


def end_to_end(reference: torch.Tensor, got: np.ndarray, lsb: float | None) -> EndToEnd:
    ref = reference.detach().double().reshape(-1)
    out = torch.from_numpy(np.asarray(got)).double().reshape(-1)
    cos = float(torch.nn.functional.cosine_similarity(ref, out, dim=0))
    if lsb is None:
        return EndToEnd(float("nan"), float("nan"), float("nan"), cos)
    d = (out - ref).abs() / lsb
    return EndToEnd(float(d.max()), float((d <= 1 + 1e-3).double().mean()), float((d <= 1e-3).double().mean()), cos)


@dataclasses.dataclass
class SegmentStats:
    tensors: int
    elements: int
    exact: float
    max_code_diff: int
    worst: str
    per_tensor: dict = dataclasses.field(default_factory=dict, repr=False)  # Q input -> fraction exact


def segment_check(model: onnx.ModelProto, gm: fx.GraphModule, args: tuple, optimize: bool = True) -> SegmentStats:
    """Every activation DequantizeLinear fed with fxq's codes, every activation Q's codes compared: the library's
    :func:`fxq.locate_mismatch` in teacher-forced mode, summed up."""
    report = fxq.locate_mismatch(gm, model, [args], teacher_forced=True, optimize=optimize, steps=1)
    total = sum(r.elements for r in report)
    same = sum(r.identical * r.elements for r in report)
    worst = max(report, key=lambda r: r.max_diff, default=None)
    return SegmentStats(len(report), total, same / max(total, 1), worst.max_diff if worst else 0,
                        worst.name if worst and worst.max_diff else "", {r.name: r.identical for r in report})


SHAPE = (2, 3, 32, 32)


@functools.lru_cache(maxsize=None)
def torchvision_quantized(arch: str, platform: str) -> fx.GraphModule:
    """ResNet-18 / MobileNetV2 with seeded random weights (data BN statistics), quantized once per process."""
    import torchvision

    torch.manual_seed(0)
    model = with_bn_statistics(getattr(torchvision.models, arch)(), SHAPE, batches=2)
    return quantize_model(model, platform, shape=SHAPE, batches=1)


class SmallCNN(torch.nn.Module):
    """Conv-BN-ReLU, MaxPool, a residual block, global pooling, Linear: every pattern the exporters handle."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        nn = torch.nn
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.pool = nn.MaxPool2d(2)
        self.conv1 = nn.Conv2d(8, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.relu = nn.ReLU()
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, classes))

    def forward(self, x):
        x = self.pool(self.stem(x))
        y = self.conv2(self.relu(self.conv1(x)))
        return self.head(self.relu(x + y))


def small_quantized(platform: str, **kw) -> fx.GraphModule:
    torch.manual_seed(0)
    return quantize_model(SmallCNN(), platform, shape=(2, 3, 16, 16), batches=2, **kw)


def output_lsb(gm: fx.GraphModule) -> float | None:
    """Scale of the quantizer on the model's output, or None when the output is not quantized."""
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    if isinstance(out, fx.Node) and out.op == "call_module" and str(out.target).startswith("fxq_quantizers."):
        fq = gm.get_submodule(str(out.target))
        if fq.config.is_quantizing:
            return float(fq.scale.reshape(-1)[0])
    return None
