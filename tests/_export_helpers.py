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
from onnx import TensorProto, numpy_helper
from torch import fx

import fxq

from _models import with_bn_statistics

INT_TYPES = {TensorProto.INT8: (np.int8, -128, 127), TensorProto.UINT8: (np.uint8, 0, 255)}


def quantize_model(model: torch.nn.Module, platform: str, shape=(2, 3, 64, 64), batches: int = 2, seed: int = 0,
                   **kw) -> fx.GraphModule:
    torch.manual_seed(seed)
    setting = fxq.QuantizationSetting()
    setting.quantize_activation_setting.calib_algorithm = "minmax"
    data = [torch.randn(*shape) for _ in range(batches)]
    return fxq.quantize(model.eval(), data, platform, setting=setting, progress=False, **kw)


def ort_session(model_or_path, optimize: bool = True):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.intra_op_num_threads = 1
    opts.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize
                                     else ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    data = model_or_path.SerializeToString() if isinstance(model_or_path, onnx.ModelProto) else str(model_or_path)
    return ort.InferenceSession(data, opts, providers=["CPUExecutionProvider"])


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


def _codes(x: np.ndarray, scale: np.ndarray, zp: np.ndarray, elem: int) -> np.ndarray:
    dtype, lo, hi = INT_TYPES[elem]
    q = np.rint(x.astype(np.float32) / scale.astype(np.float32)) + zp.astype(np.float32)
    return np.clip(q, lo, hi).astype(dtype)


@dataclasses.dataclass
class SegmentStats:
    tensors: int
    elements: int
    exact: float
    max_code_diff: int
    worst: str
    per_tensor: dict = dataclasses.field(default_factory=dict, repr=False)  # Q output -> fraction exact


def segment_check(model: onnx.ModelProto, gm: fx.GraphModule, args: tuple, optimize: bool = True) -> SegmentStats:
    """Feed every activation DequantizeLinear with fxq's codes and compare every activation Q's codes.

    Only per-tensor int8/uint8 activation Q/DQ are cut; names of Q inputs are fx node names (or the graph
    input), as the exporters write them for models built in torch.
    """
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    inits = {t.name: numpy_helper.to_array(t) for t in g.initializer}
    values = fx_values(gm, *args)
    for i, inp in zip([n for n in gm.graph.nodes if n.op == "placeholder"], args):
        values[i.name] = inp
    feeds, compare = {}, {}
    for node in list(g.node):
        if node.op_type != "QuantizeLinear" or node.input[0] in inits:
            continue
        x_name, codes = node.input[0], node.output[0]
        scale, zp = inits[node.input[1]], inits[node.input[2]]
        elem = next(t.data_type for t in g.initializer if t.name == node.input[2])
        if x_name not in values or scale.ndim != 0 or elem not in INT_TYPES:
            continue
        ref = _codes(values[x_name].numpy(), scale, zp, elem)
        fed = codes + "__fed"
        for user in g.node:
            if user.op_type == "DequantizeLinear" and user.input[0] == codes:
                user.input[0] = fed
        g.input.append(onnx.helper.make_tensor_value_info(fed, elem, list(ref.shape)))
        g.output.append(onnx.helper.make_tensor_value_info(codes, elem, list(ref.shape)))
        feeds[fed] = ref
        compare[codes] = ref
    sess = ort_session(m, optimize)
    feed = {i.name: a.numpy() for i, a in zip(model.graph.input, args)}
    feed.update(feeds)
    in_names = {i.name for i in sess.get_inputs()}  # a cut may leave a graph input unused
    feed = {k: v for k, v in feed.items() if k in in_names}
    names = [o.name for o in sess.get_outputs() if o.name in compare]
    outs = dict(zip(names, sess.run(names, feed)))
    total = same = 0
    worst, worst_name = 0, ""
    per_tensor = {}
    for name, ref in compare.items():
        got = outs[name].astype(np.int64)
        diff = np.abs(got - ref.astype(np.int64))
        total += diff.size
        same += int((diff == 0).sum())
        per_tensor[name] = float((diff == 0).mean())
        if diff.max() > worst:
            worst, worst_name = int(diff.max()), name
    return SegmentStats(len(compare), total, same / max(total, 1), worst, worst_name, per_tensor)


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
