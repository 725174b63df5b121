"""The headline: deployed models compute what fxq simulated.

Seeded models (torchvision ResNet-18 at its random init; MobileNetV2 with BatchNorm statistics half-way between
the init and random data, so its signal neither vanishes nor turns chaotic) are quantized with the default
setting, exported, and run in the real runtimes:

* TRT_INT8 / ORT_INT8 Q/DQ ONNX in onnxruntime (graph optimizations off and on), 1000-class heads, 8 samples:
  within 1 LSB of the output quantizer on >= 99.9 % of the output elements (MobileNetV2: measured
  99.987-100 %). ResNet-18 at random init cannot meet that against *any* second implementation: a float
  convolution summed in another order moves a value that sits on a rounding midpoint to the other code, and
  with no normalisation in its residual stream every such 1-LSB flip spreads through the following blocks
  (mismatching codes grow ~6x per block, 0.001 % -> 11 %). The *same* fxq model run in float64 agrees with
  the float32 run on only 97.0-99.2 % of the outputs within 1 LSB (torch with channels-last inputs, oneDNN's
  other summation order: 98.3-98.7 %), while onnxruntime agrees on 98.7-99.3 %. So ResNet-18 is held to
  >= 98 % and <= 3 LSB, and the test checks that the float64 run indeed stays below 99.9 %.
  Per tensor, fed identical codes, every quantized tensor agrees within 1 LSB, and ORT_INT8 (int32 biases,
  as onnxruntime's int8 kernels run them) reproduces 100 % of the codes on both paths (test_export_onnx.py);
* NCNN_INT8 param/bin in ncnn (int8 inference): outputs are FP32 in NCNN, so cosine >= 0.9999 over the batch, and
  ncnn-vs-simulation noise at most 0.3x the simulation-vs-FP32 noise (catches a 3 % input-scale error on both).

The per-tensor (teacher-forced) comparisons live in test_export_onnx.py and test_export_ncnn.py.
"""
import copy

import numpy as np
import pytest
import torch
import torchvision

import fxq

from _export_helpers import ort_session
from _models import mobilenet_v2

ncnn = pytest.importorskip("ncnn")


def _mobilenet_v2() -> torch.nn.Module:
    return mobilenet_v2(num_classes=1000)


def _resnet18() -> torch.nn.Module:
    torch.manual_seed(0)
    return torchvision.models.resnet18().eval()


MODELS = {"resnet18": _resnet18, "mobilenet_v2": _mobilenet_v2}
WITHIN_ONE_LSB = {"resnet18": 0.98, "mobilenet_v2": 0.999}
_cache: dict = {}


def _model(name):
    if name not in _cache:
        g = torch.Generator().manual_seed(0)
        _cache[name] = (MODELS[name](), [torch.randn(2, 3, 64, 64, generator=g) for _ in range(4)])
    return _cache[name]


def _output_quantizer(q):
    out = next(n for n in q.graph.nodes if n.op == "output").args[0]
    return q.get_submodule(out.target) if out.op == "call_module" else None


@pytest.mark.parametrize("platform", ["trt_int8", "ort_int8"])
@pytest.mark.parametrize("name", list(MODELS))
def test_onnxruntime_matches_simulation(name, platform, tmp_path):
    model, data = _model(name)
    q = fxq.quantize(model, data, platform, progress=False)
    fq = _output_quantizer(q)
    assert fq is not None and fq.config.is_quantizing  # the classifier output is quantized on both platforms
    path = next(p for p in fxq.export(q, platform, tmp_path / "model.onnx") if str(p).endswith("model.onnx"))
    with torch.no_grad():
        sim = np.concatenate([q(x).numpy() for x in data])

    def within_one_lsb(out: np.ndarray) -> tuple[float, float]:
        lsb = np.abs(out - sim) / float(fq.scale)
        return float((lsb <= 1 + 1e-4).mean()), float(lsb.max())

    for optimize in (False, True):
        sess = ort_session(str(path), optimize=optimize)
        out = np.concatenate([sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0] for x in data])
        within, worst = within_one_lsb(out)
        assert within >= WITHIN_ONE_LSB[name] and worst <= 3 + 1e-4, (optimize, within, worst)
    if name == "resnet18":  # the model cannot agree with itself to 99.9 %: the same simulation in float64
        with torch.no_grad():
            q64 = copy.deepcopy(q).double()
            self_agreement, _ = within_one_lsb(np.concatenate([q64(x.double()).float().numpy() for x in data]))
        assert self_agreement < 0.999, self_agreement


@pytest.mark.parametrize("name", list(MODELS))
def test_ncnn_matches_simulation(name, tmp_path):
    from test_export_ncnn import run_ncnn

    model, data = _model(name)
    data = [x[:1] for x in data]
    q = fxq.quantize(model, data, "ncnn_int8", progress=False)
    files = fxq.export(q, "ncnn_int8", tmp_path / "net")
    param = next(f for f in files if str(f).endswith("net.param"))
    bin_ = next(f for f in files if str(f).endswith("net.bin"))
    outs = np.concatenate([o["out0"].ravel() for o in run_ncnn(param, bin_, data, int8=True)])
    with torch.no_grad():
        sim = np.concatenate([q(x).numpy().ravel() for x in data])
        with fxq.fp32_mode(q):
            fp32 = np.concatenate([q(x).numpy().ravel() for x in data])
    cosine = float(np.dot(outs, sim) / np.linalg.norm(outs) / np.linalg.norm(sim))
    assert cosine >= 0.9999, cosine

    def noise(a: np.ndarray, ref: np.ndarray) -> float:
        return float(((a - ref) ** 2).sum() / (ref ** 2).sum())

    # ncnn is much closer to the simulation than the simulation is to FP32 (measured 0.018x ResNet-18,
    # 0.20x MobileNetV2): a cosine alone let a 10 % error in every int8 input scale pass on MobileNetV2
    assert noise(outs, sim) <= 0.3 * noise(sim, fp32), (noise(outs, sim), noise(sim, fp32))
