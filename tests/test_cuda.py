"""fxq end to end on a CUDA device: PTQ, QAT (eager and compiled), analysis, save / load and export of a model
that lives on the GPU, each against the same model on CPU.

Skipped without CUDA (CI has none). On a GPU: ``FXQ_TEST_TRITON_GPU=1 python -m pytest tests/test_cuda.py``
(without the variable, conftest runs Triton in its CPU interpreter, which cannot take CUDA tensors).
"""
from __future__ import annotations

import copy
import logging
import os

import pytest
import torch
from torch import nn

import fxq
from fxq.triton_kernels import cuda_kernel_in_use

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                       reason="Triton runs in its CPU interpreter here; set FXQ_TEST_TRITON_GPU=1"),
]


class SmallNet(nn.Module):
    """Conv-BN-ReLU, a depthwise conv, a residual add, pooling and a classifier: the ops of a mobile CNN."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.dw = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1, groups=16), nn.BatchNorm2d(16), nn.ReLU6())
        self.pw = nn.Conv2d(16, 16, 1)
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.stem(x)
        y = y + self.pw(self.dw(y))
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(y, 1), 1))


def _data(n: int = 4, device: str = "cpu") -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(8, 3, 32, 32, generator=g).to(device) for _ in range(n)]


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0))


def _on_cuda(module: nn.Module) -> bool:
    tensors = list(module.parameters()) + list(module.buffers())
    return bool(tensors) and all(t.device.type == "cuda" for t in tensors)


@pytest.mark.parametrize("platform", ["trt_int8", "trt_fp8", "ncnn_int8"])
def test_ptq_on_cuda_matches_cpu(platform: str) -> None:
    torch.manual_seed(0)
    model = SmallNet().eval()
    q_cpu = fxq.quantize(copy.deepcopy(model), _data(), platform, progress=False)
    q_gpu = fxq.quantize(copy.deepcopy(model).cuda(), _data(device="cuda"), platform, progress=False)
    assert _on_cuda(q_gpu), "quantization moved state off the GPU"
    op = "fxq::fake_quant_float" if platform == "trt_fp8" else "fxq::fake_quant_linear"
    assert cuda_kernel_in_use(op) == "triton"
    cpu_fq = {n: m for n, m in q_cpu.named_modules() if isinstance(m, fxq.FakeQuantize)}
    gpu_fq = {n: m for n, m in q_gpu.named_modules() if isinstance(m, fxq.FakeQuantize)}
    assert cpu_fq.keys() == gpu_fq.keys() and cpu_fq
    for name, fq in cpu_fq.items():  # calibration sees float outputs that differ in the last bits only
        torch.testing.assert_close(gpu_fq[name].scale.cpu(), fq.scale, rtol=1e-3, atol=1e-7, msg=name)
    x = _data(1)[0]
    with torch.no_grad():
        ref, out = q_cpu(x), q_gpu(x.cuda()).cpu()
        fp32 = model(x)
    assert _cosine(out, ref) > 0.9999
    assert _cosine(out, fp32) > 0.99


def test_qat_on_cuda_eager_and_compiled() -> None:
    torch.manual_seed(0)
    data = _data(device="cuda")
    qat = fxq.prepare_qat(SmallNet().cuda().train(), "trt_int8", data[0])
    assert _on_cuda(qat)
    opt = torch.optim.SGD(qat.parameters(), lr=1e-2, momentum=0.9)
    target = torch.randint(0, 10, (8,), device="cuda")
    losses = []
    for x in data:
        loss = nn.functional.cross_entropy(qat(x), target)
        opt.zero_grad()
        loss.backward()
        scale_grads = [p.grad for n, p in qat.named_parameters() if n.endswith("scale")]
        assert scale_grads and all(g is not None and torch.isfinite(g).all() for g in scale_grads)
        assert any(g.abs().sum() > 0 for g in scale_grads), "LSQ scales got no gradient on CUDA"
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert cuda_kernel_in_use("fxq::fake_quant_linear_backward") == "triton"

    qat.eval()
    compiled = torch.compile(copy.deepcopy(qat), fullgraph=True)
    with torch.no_grad():
        eager_out, compiled_out = qat(data[0]), compiled(data[0])
    # inductor's convolutions may differ from eager's in the last bits, which can move a code by one step
    assert _cosine(compiled_out, eager_out) > 0.99999


def test_analysis_on_cuda() -> None:
    torch.manual_seed(0)
    data = _data(device="cuda")
    gm = fxq.quantize(SmallNet().cuda().eval(), data, "trt_int8", progress=False)
    report = fxq.graphwise_error_analyse(gm, data, steps=2)
    assert len(report) >= 4
    assert all(torch.isfinite(torch.tensor(r.value)) for r in report)
    assert _on_cuda(gm)


def test_save_load_and_export_from_cuda(tmp_path) -> None:
    ort = pytest.importorskip("onnxruntime")
    torch.manual_seed(0)
    data = _data(device="cuda")
    gm = fxq.quantize(SmallNet().cuda().eval(), data, "trt_int8", progress=False)
    x = data[0]
    with torch.no_grad():
        expected = gm(x)
    fxq.save(gm, tmp_path / "m.fxq")
    loaded = fxq.load(tmp_path / "m.fxq", map_location="cuda")
    assert _on_cuda(loaded)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), expected, rtol=0, atol=0)

    files = fxq.export(gm, "trt_int8", tmp_path / "m.onnx")
    onnx_file = next(f for f in files if f.suffix == ".onnx")
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(str(onnx_file), options, providers=["CPUExecutionProvider"])
    (deployed,) = session.run(None, {session.get_inputs()[0].name: x.cpu().numpy()})
    assert _cosine(torch.from_numpy(deployed), expected.cpu()) > 0.9999
    assert _on_cuda(gm), "export moved the user's model off the GPU"


@pytest.mark.parametrize("op, args", [
    ("fake_quant_linear", lambda x, s: (x, s, torch.zeros_like(s), 1, -128, 127, 0)),
    ("fake_quant_float", lambda x, s: (x, s, 1, 3, -6, 448.0, 0)),
], ids=["linear", "float"])
def test_opcheck_on_cuda(op, args) -> None:
    """The ops' CUDA registrations (Triton kernels) against torch's custom-op checks: schema, fake tensors,
    autograd registration, and ``torch.compile`` with them opaque."""
    x = torch.randn(4, 6, device="cuda", requires_grad=True)
    scale = (torch.rand(6, device="cuda") * 0.01 + 1e-3).requires_grad_(True)
    torch.library.opcheck(getattr(torch.ops.fxq, op).default, args(x, scale))


def test_plain_eager_cuda_calls_skip_the_dispatcher() -> None:
    """Plain eager CUDA calls run the Triton kernels without the custom op's dispatch (a third of a quantizer's
    host time at batch 1): autograd records fxq's Function, values and gradients are the op's, bit for bit."""
    x = torch.randn(2, 16, 8, 8, device="cuda", requires_grad=True)
    scale = nn.Parameter(torch.rand(16, device="cuda") * 0.05 + 0.01)
    offset = torch.zeros(16, device="cuda")
    args = (1, -128, 127, 0)
    y = fxq.ops.fake_quant_linear(x, scale, offset, *args)
    assert type(y.grad_fn).__name__.startswith("_EagerCuda_fake_quant_linear")
    y.square().sum().backward()
    x2 = x.detach().clone().requires_grad_(True)
    s2 = nn.Parameter(scale.detach().clone())
    y2 = torch.ops.fxq.fake_quant_linear(x2, s2, offset, *args)
    y2.square().sum().backward()
    for got, want in ((y, y2), (x.grad, x2.grad), (scale.grad, s2.grad)):
        assert torch.equal(got, want)
    with torch.no_grad():
        assert torch.equal(fxq.ops.fake_quant_linear(x, scale, offset, *args), y2)


@pytest.mark.parametrize("platform", ["trt_int8", "trt_fp8"])
def test_repeated_inference_runs_bound_launches_with_the_ops_values(platform: str, caplog) -> None:
    """A quantized model run batch after batch on a GPU: from the third batch every quantizer runs its bound
    launch (the op's kernel without the op's dispatch and checks, through the compiled kernel's own launcher),
    with the values of the op path bit for bit."""
    from fxq import functional
    from fxq.triton_kernels.common import BoundLaunch

    gm = fxq.quantize(SmallNet().cuda().eval(), _data(device="cuda"), platform, progress=False)
    x = _data(1, device="cuda")[0]
    with torch.no_grad(), caplog.at_level(logging.DEBUG, logger="fxq.triton_kernels.common"):
        first = gm(x)  # op path
        assert torch.equal(gm(x), first)  # the same calls again: the bindings are made
        quantizers = [m for m in gm.modules() if isinstance(m, fxq.FakeQuantize) and m.quant_enabled
                      and m.config.is_quantizing and m.config.state.name not in ("BAKED", "PASSIVE_BAKED")]
        bound = [functional._BOUND.get(m.config) for m in quantizers]
        assert bound and all(isinstance(b, BoundLaunch) for b in bound), bound
        assert all(b.runner is not None for b in bound), f"a compiled kernel's launcher was not taken: {caplog.text}"
        again = gm(x)
        functional._BOUND.clear()
        assert torch.equal(again, first)
        assert torch.equal(gm(x), first)
