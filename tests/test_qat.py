"""QAT: trainable GraphModule (LSQ / LSQ+ / EMA), loss goes down, convert matches, torch.compile without graph
breaks, DDP with two gloo processes, frozen BatchNorm, and the torchvision example."""
from __future__ import annotations

import importlib.util
import math
import pathlib

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

import fxq
from fxq.graph.quant_graph import QuantGraph
from fxq.nn import FakeQuantize
from fxq.qat import FrozenBatchNorm, QATBiasQuantize, QATFakeQuantize
from fxq.spec import QuantState

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


pytestmark = pytest.mark.usefixtures("one_thread")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(1, 8, 3, padding=1)
        self.b1 = nn.BatchNorm2d(8)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(torch.relu(self.b1(self.c1(x))), 2)
        x = x + torch.relu(self.c2(x))  # an aligned add on trt_int8
        return self.fc(F.max_pool2d(x, 2).flatten(1))


def _net() -> nn.Module:
    torch.manual_seed(0)
    return Net().eval()


def _batch(seed: int = 0, n: int = 16, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 16, 16, generator=g) * scale, torch.randint(0, 10, (n,), generator=g)


def _train(model: nn.Module, steps: int, x: torch.Tensor, y: torch.Tensor, lr: float = 1e-2) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses = []
    for _ in range(steps):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


# --------------------------------------------------------------------------- structure and training
@pytest.mark.parametrize("method", ["lsq", "lsq+", "ema"])
@pytest.mark.parametrize("platform", ["trt_int8", "academic_int4"])
def test_qat_trains_and_converts(platform, method):
    x, y = _batch()
    qat = fxq.prepare_qat(_net(), platform, x, method=method)
    assert qat.training
    quantizers = dict(qat.fxq_quantizers.items())
    assert all(isinstance(fq, FakeQuantize) for fq in quantizers.values())
    trainable = [fq for fq in quantizers.values() if isinstance(fq, QATFakeQuantize)]
    assert trainable
    assert all(isinstance(fq.scale, nn.Parameter) for fq in trainable)
    assert all(fq.scale.requires_grad == (method != "ema") for fq in trainable)  # EMA scales: set, not learned
    if method == "lsq+" and platform == "academic_int4":  # asymmetric activations learn their offsets
        assert any(isinstance(fq.offset, nn.Parameter) for fq in trainable)
    if platform == "trt_int8":  # the add's inputs share one quantizer module (alignment kept while training)
        groups = [g.members for g in QuantGraph(qat).alignment_groups() if g.kind == "largest"]
        assert groups and all(quantizers[a] is quantizers[b] for g in groups for a, b in zip(g, g[1:]))
    else:
        assert any(isinstance(fq, QATBiasQuantize) for fq in quantizers.values())
    before = {id(fq): fq.scale.detach().clone() for fq in trainable}
    losses = _train(qat, 25, x, y)
    assert losses[-1] < 0.7 * losses[0]
    moved = [not torch.equal(fq.scale.detach(), before[id(fq)]) for fq in trainable]
    assert all(moved) if method != "ema" else any(moved)  # learned (LSQ) or tracked (EMA); not just the weights
    if method != "ema":
        assert all(fq.scale.grad is not None and bool(fq.scale.grad.abs().sum() > 0) for fq in trainable)
    qat.eval()
    with torch.no_grad():
        out = qat(x)
        q = fxq.convert(qat)
        assert torch.allclose(q(x), out, atol=1e-5)
    assert not any(isinstance(fq.scale, nn.Parameter) for fq in q.fxq_quantizers.values())
    states = {fq.config.state for fq in q.fxq_quantizers.values()}
    assert QuantState.BAKED in states and QuantState.INITIAL not in states
    if method == "lsq+":  # zero points back on the integer grid
        for fq in q.fxq_quantizers.values():
            assert torch.equal(fq.offset, torch.round(fq.offset))


def test_converted_qat_model_saves_and_loads(tmp_path):
    x, y = _batch()
    qat = fxq.prepare_qat(_net(), "academic_int4", x)
    _train(qat, 3, x, y)
    q = fxq.convert(qat.eval())
    assert not any("fxq_quantizers" in name for name, _ in q.named_parameters())  # bias quantizers untied
    fxq.save(q, tmp_path / "q.fxq")
    again = fxq.load(tmp_path / "q.fxq")
    with torch.no_grad():
        assert torch.equal(again(x), q(x))


@pytest.mark.parametrize("method", ["lsq", "ema"])
def test_unconverted_qat_model_exports_as_it_computes(tmp_path, method):
    """A QAT model in the middle of training (learned scales still ``nn.Parameter``s, train mode) exports for
    TensorRT with a dynamic batch: the file computes what the model computes in eval mode, and the export leaves
    the model's state and modes as they were. It used to fail inside the Q/DQ inserter (``numpy()`` on a tensor
    that requires grad)."""
    ort = pytest.importorskip("onnxruntime")
    x, y = _batch()
    qat = fxq.prepare_qat(_net(), "trt_int8", x, method=method)
    _train(qat, 3, x, y, lr=1e-4)
    qat.train()
    before = {k: v.clone() for k, v in qat.state_dict().items() if isinstance(v, torch.Tensor)}
    fxq.export(qat, "trt_int8", tmp_path / "qat.onnx", dynamic_batch=True)
    after = qat.state_dict()
    assert [k for k, v in before.items() if not torch.equal(v, after[k])] == []
    assert all(m.training for m in qat.modules())
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(str(tmp_path / "qat.onnx"), opts, providers=["CPUExecutionProvider"])
    xs = x[:5]
    with torch.no_grad():
        sim = qat.eval()(xs).numpy()
    got = sess.run(None, {sess.get_inputs()[0].name: xs.numpy()})[0]
    assert got.shape == sim.shape
    assert float(np.abs(got - sim).max()) <= 1e-4 * max(1.0, float(np.abs(sim).max()))


def test_lsq_gradient_scale_leaves_the_forward_exact():
    """LSQ's gradient scale changes the scale's gradient only: the training forward quantizes with the learned
    scale itself, bit for bit what the frozen model computes (the detach idiom moved some scales by an ulp), and
    the scale's gradient is exactly ``grad_scale`` times the unscaled one."""
    from fxq.spec import TensorQuantConfig

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 8, 16, 16, generator=g) * 3
    cfg = TensorQuantConfig(num_bits=8, per_channel=True, channel_axis=1, state=QuantState.ACTIVATED,
                            scale=torch.rand(8, generator=g) * 0.05 + 0.01, offset=torch.zeros(8))
    grad_scale = 0.3  # large: the old idiom moved ~10 % of the scales by an ulp
    scaled = QATFakeQuantize(cfg, "w", grad_scale=grad_scale).make_learnable()
    plain = QATFakeQuantize(cfg, "w", grad_scale=1.0).make_learnable()
    moved = 0
    for trial in range(20):
        s = torch.rand(8, generator=g) * 0.1 + 1e-3
        moved += int(((s - s * grad_scale) + s * grad_scale != s).sum())
        for fq in (scaled, plain):
            with torch.no_grad():
                fq.scale.copy_(s)
            fq.scale.grad = None
        ys, yp = scaled(x), plain(x)
        want = fxq.functional.fake_quantize(x, cfg, s, torch.zeros(8))
        assert torch.equal(ys, want) and torch.equal(yp, want), trial
        (ys * x).sum().backward()
        (yp * x).sum().backward()
        assert torch.equal(scaled.scale.grad, plain.scale.grad * grad_scale), trial
    assert moved > 0  # the test data has scales the idiom would have moved


@pytest.mark.parametrize("grad_scale", [1.0, 0.01])
def test_lsq_quantizer_under_torch_func(grad_scale):
    """``torch.func.grad`` through ``functional_call`` of an LSQ quantizer gives autograd's gradients: the call puts
    plain tensors where the learned parameters were, and the quantizer used to take them for fixed ones (no gradient
    scale, no sign guard: a 100x larger scale gradient here); the ops' autograd Functions now take the transform."""
    from fxq.spec import TensorQuantConfig

    cfg = TensorQuantConfig(num_bits=8, state=QuantState.ACTIVATED, scale=torch.tensor([0.05]), offset=torch.zeros(1))
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)) * 3
    fq = QATFakeQuantize(cfg, "a", grad_scale=grad_scale).make_learnable()
    params = {k: v.detach() for k, v in fq.named_parameters()}
    got = torch.func.grad(lambda p: (torch.func.functional_call(fq, p, (x,)) * x).sum())(params)
    (fq(x) * x).sum().backward()
    assert torch.equal(got["scale"], fq.scale.grad)


def test_ema_tracks_ranges_in_train_mode_only():
    x, _ = _batch()
    qat = fxq.prepare_qat(_net(), "trt_int8", x, method="ema", momentum=0.5)
    fq = qat.fxq_quantizers["x_q"]
    s0, m0 = fq.scale.clone(), fq.running_max.clone()  # initialized from the calibrated grid
    with torch.no_grad():
        qat.eval()
        qat(x * 4)
        assert torch.equal(fq.scale, s0)
        qat.train()
        qat(x * 4)
    assert fq.scale > s0 * 2  # halfway (momentum 0.5) to a 4x larger range
    assert torch.allclose(fq.running_max, 0.5 * (m0 + 4 * x.max()), rtol=1e-5)


# --------------------------------------------------------------------------- torch.compile
@pytest.mark.parametrize("platform, method", [("trt_int8", "lsq"), ("academic_int4", "ema")])
def test_compile_fullgraph_no_graph_breaks(platform, method):
    x, y = _batch()
    qat = fxq.prepare_qat(_net(), platform, x, method=method)
    explanation = torch._dynamo.explain(qat)(x)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    eager = fxq.prepare_qat(_net(), platform, x, method=method)
    compiled_model = fxq.prepare_qat(_net(), platform, x, method=method)
    compiled = torch.compile(compiled_model, fullgraph=True, backend="aot_eager")
    torch._dynamo.reset()
    for _ in range(2):  # forward, backward and an optimizer step match eager exactly
        le = _train(eager, 1, x, y)
        lc = _train(compiled, 1, x, y)
        assert le == pytest.approx(lc, rel=1e-5)
    for (n, a), (_, b) in zip(eager.state_dict().items(), compiled_model.state_dict().items()):
        if isinstance(a, torch.Tensor):
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-6), n


class _EagerOnlyBindings(dict):
    """A stand-in for ``fxq.functional._BOUND`` that a traced call must never read."""

    def get(self, key, default=None):
        if torch.compiler.is_compiling():
            raise AssertionError("a compiled graph read the eager bindings")
        return super().get(key, default)


@pytest.mark.parametrize("method", ["ema", "lsq"])
def test_compiled_graph_does_not_read_eager_bindings(monkeypatch, method):
    """Dynamo guarded the bound-call cache (a weak dict) key by key, and a key collected while it traced broke the
    guard (IndexError at compile, depending on what earlier work left in the cache): compiled code skips it."""
    import fxq.functional as functional

    monkeypatch.setattr(functional, "_BOUND", _EagerOnlyBindings())
    x, y = _batch()
    qat = fxq.prepare_qat(_net(), "academic_int4", x, method=method)
    torch._dynamo.reset()
    compiled = torch.compile(qat, fullgraph=True, backend="eager")
    compiled(x).sum().backward()  # training: fullgraph raises if the trace read the bindings
    qat.eval()
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), qat(x))
    quantized = fxq.quantize(_net().eval(), [x], "trt_int8", progress=False)
    torch._dynamo.reset()
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(quantized, fullgraph=True, backend="eager")(x), quantized(x))


# --------------------------------------------------------------------------- DDP
def _ddp_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    import warnings

    from torch.nn.parallel import DistributedDataParallel as DDP

    import fxq as _fxq

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        for method in ("lsq", "ema"):
            calib, _ = _batch(seed=0)  # same initialization data on every rank
            qat = _fxq.prepare_qat(_net(), "trt_int8", calib, method=method)
            with warnings.catch_warnings():  # newer torch renames broadcast_buffers; 2.11 knows only this name
                warnings.simplefilter("ignore", FutureWarning)
                ddp = DDP(qat, broadcast_buffers=False)  # buffers agree only if the quantizers all-reduce
            opt = torch.optim.SGD(ddp.parameters(), lr=1e-2)
            for step in range(2):
                x, y = _batch(seed=100 + 10 * rank + step, scale=1.0 + 2 * rank)  # different ranges per rank
                loss = F.cross_entropy(ddp(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
            state = {k: v.detach().clone() for k, v in qat.state_dict().items() if isinstance(v, torch.Tensor)}
            torch.save(state, f"{out_dir}/{method}_rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_ddp_two_processes_gloo(tmp_path):
    mp.spawn(_ddp_worker, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    for method in ("lsq", "ema"):
        r0 = torch.load(tmp_path / f"{method}_rank0.pt")
        r1 = torch.load(tmp_path / f"{method}_rank1.pt")
        assert r0.keys() == r1.keys()
        for key in r0:
            assert torch.allclose(r0[key], r1[key], rtol=1e-6, atol=1e-7), (method, key)
    # EMA saw rank 1's 3x wider inputs through the all-reduce: the input range grew on both ranks
    init = fxq.prepare_qat(_net(), "trt_int8", _batch(seed=0)[0], method="ema")
    assert float(r0["fxq_quantizers.x_q.running_max"]) > 1.2 * float(init.fxq_quantizers["x_q"].running_max)


# --------------------------------------------------------------------------- BatchNorm
def test_fold_bn_false_and_freeze_bn():
    x, y = _batch()
    qat = fxq.prepare_qat(_net(), "academic_int8", x, fold_bn=False)
    assert isinstance(qat.b1, nn.BatchNorm2d) and qat.b1.training
    keys = set(qat.state_dict())
    _train(qat, 3, x, y, lr=1e-3)
    fxq.freeze_bn(qat)
    assert isinstance(qat.b1, FrozenBatchNorm) and set(qat.state_dict()) == keys
    mean = qat.b1.running_mean.clone()
    qat.train()
    with torch.no_grad():
        out_train = qat(x)
        qat.eval()
        assert torch.allclose(qat(x), out_train)
    assert torch.equal(qat.b1.running_mean, mean)
    _train(qat.train(), 2, x, y, lr=1e-3)  # BN affine parameters still learn, statistics stay
    assert torch.equal(qat.b1.running_mean, mean)


def test_grouped_conv_transpose_int32_bias():
    """Its C_out / groups weight scales serve every group's outputs: the QAT bias grid is PTQ's."""
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ConvTranspose2d(4, 8, 2, stride=2, groups=2))
    x = torch.randn(4, 1, 8, 8)
    qat = fxq.prepare_qat(model, "ort_int8", x)
    bias_q = [fq for name, fq in qat.fxq_quantizers.items() if name.endswith("_bias")][-1]  # the ConvTranspose's
    assert bias_q.scale.numel() == 8
    qat(x).sum().backward()
    fxq.convert(qat.eval())(x)


def test_prepare_qat_errors():
    with pytest.raises(fxq.ConfigError, match="method"):
        fxq.prepare_qat(_net(), "trt_int8", _batch()[0], method="sgd")
    with pytest.raises(fxq.ConfigError, match="example_inputs"):
        fxq.prepare_qat(_net(), "trt_int8")


# --------------------------------------------------------------------------- example
def test_qat_torchvision_example(tmp_path):
    spec = importlib.util.spec_from_file_location("qat_torchvision", EXAMPLES / "qat_torchvision.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.__doc__
    result = mod.main(["--fast", "--backend", "aot_eager", "--out", str(tmp_path)])
    assert len(result["losses"]) == 4 and all(math.isfinite(v) for v in result["losses"])
    assert result["written"] and all(pathlib.Path(p).exists() for p in result["written"])
