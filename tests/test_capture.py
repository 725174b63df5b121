"""Capture paths: torch.export graphs quantize like symbolic traces; auto falls back; FP32 islands; TorchScript."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxq
from fxq.graph.capture import capture as capture_graph
from fxq.graph.info import iter_quantizers
from fxq.graph.quant_graph import QuantGraph

from _export_helpers import ort_session
from _models import KeypointScores


class Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        return self.relu(self.bn(self.conv(x)) + x)


class Net(nn.Module):
    """Conv-BN-ReLU stem, a residual block (in-place add/ReLU), pooling, concat, flatten, linear."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.block = Block(8)
        self.pool = nn.MaxPool2d(2)
        self.side = nn.Conv2d(8, 4, 1)
        self.fc = nn.Linear(12 * 4 * 4, 10)

    def forward(self, x):
        y = self.pool(self.block(self.stem(x)))
        y = torch.cat([y, self.side(y)], dim=1)
        return self.fc(torch.flatten(y, 1))


def _net() -> Net:
    torch.manual_seed(0)
    m = Net()
    for bn in (m.stem[1], m.block.bn):  # non-trivial statistics, so folding matters
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 2.0)
    return m.eval()


def _data(shape=(2, 3, 8, 8), n=2):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(*shape, generator=g) for _ in range(n)]


def _weighted(q) -> list[str]:
    return [r.node for r in fxq.summary(q).layers if r.weight is not None]


def test_export_path_quantizes_like_fx():
    model, data = _net(), _data()
    q_fx = fxq.quantize(model, data, "trt_int8", capture="fx", progress=False)
    q_ex = fxq.quantize(model, data, "trt_int8", capture="export", progress=False)
    q_ep = fxq.quantize(torch.export.export(model, (data[0],)), data, "trt_int8", progress=False)
    q_mod = fxq.quantize(torch.export.export(model, (data[0],)).module(), data, "trt_int8", progress=False)
    n_fx = len(list(iter_quantizers(q_fx)))
    assert n_fx > 0
    for q in (q_ex, q_ep, q_mod):
        assert len(list(iter_quantizers(q))) == n_fx  # ExportedProgram.module() used to get 0 quantizers
        assert len(_weighted(q)) == len(_weighted(q_fx)) == 4
        assert not any(n.target is F.batch_norm for n in q.graph.nodes)  # BN folded
    x = _data((3, 3, 8, 8), 1)[0]  # another batch size: the batch dimension stays dynamic
    with torch.no_grad():
        ref, out = q_fx(x), q_ex(x)
        assert torch.allclose(out, ref, atol=1e-5)
        assert (ref - model(x)).abs().max() > 0  # it is quantized
    assert set(_weighted(q_ex)) == {"stem_0", "block_conv", "side", "fc"}  # module paths, not aten names


class _AnchorCache(nn.Module):
    """A detection head's cache: anchors computed when the feature size changes, kept on the module."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list = []
        self.anchors = torch.empty(0)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        shapes = [list(y.shape[2:])]
        if self.shapes != shapes:  # a Python branch: symbolic tracing fails, torch.export captures it
            h, w = shapes[0]
            grid = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
            self.anchors, self.shapes = torch.stack(grid).float().sum(0) / (h + w), shapes
        return y + self.anchors


def test_state_a_torch_export_attempt_leaves_on_the_model_is_undone(monkeypatch):
    """torch.export (non-strict, torch 2.14) left RT-DETR's decoder anchors as fake tensors on the module it traced
    when an attempt did not restore what the forward cached; the next attempt lifted them as constants and every
    calibration run failed inside an observer ("Cannot access data pointer of Tensor (e.g. FakeTensor)"). Emulated
    here: each export attempt leaves fake anchors behind."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    real_export = torch.export.export

    def leaky_export(mod, *args, **kwargs):
        program = real_export(mod, *args, **kwargs)
        head = mod.get_submodule("1")
        head.anchors, head.shapes = FakeTensorMode().from_tensor(torch.zeros(8, 8)), [[8, 8]]
        return program

    monkeypatch.setattr(torch.export, "export", leaky_export)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), _AnchorCache()).eval()
    data = [torch.randn(1, 3, 8, 8) for _ in range(2)]
    q = fxq.quantize(model, data, "trt_int8", progress=False)
    assert q.meta["fxq_capture"] == "export"
    with torch.no_grad():
        assert torch.allclose(q(data[0]), model(data[0]), atol=0.05)


class _GridListCache(nn.Module):
    """YOLOv5's Detect: per-level grids cached in a list, written in place when the feature size changes."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.grid, self.cache = nn.Conv2d(3, 6, 3, padding=1), [torch.empty(0)], {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        ny, nx = y.shape[2:4]
        if self.grid[0].shape[2:4] != y.shape[2:4]:
            yv, xv = torch.meshgrid(torch.arange(ny), torch.arange(nx), indexing="ij")
            self.grid[0] = torch.stack((xv, yv), 0).view(1, 2, ny, nx).float()
            self.cache["grid"] = self.grid[0] * 0.5
        return y[:, :2] + self.grid[0] + self.cache["grid"]


def test_a_cache_written_in_place_is_restored_with_its_real_items():
    """torch.export restores a module's attributes as copies of their containers; restoring the original list or
    dict instead (written in place while tracing) put fake tensors back: "We found a fake tensor in the exported
    program constant's list" (a regression of the first restore, found by review)."""
    torch.manual_seed(0)
    model = _GridListCache().eval()
    data = [torch.randn(1, 3, 8, 8) for _ in range(2)]
    q = fxq.quantize(model, data, "trt_int8", capture="export", progress=False)
    with torch.no_grad():
        assert torch.allclose(q(data[0]), model(data[0]), atol=0.2)  # outputs up to ~11: int8 steps of ~0.09
    assert type(model.grid[0]) is torch.Tensor and type(model.cache["grid"]) is torch.Tensor


def test_export_graph_exports_to_onnx_runtime(tmp_path):
    ort = pytest.importorskip("onnxruntime")
    model, data = _net(), _data()
    q = fxq.quantize(model, data, "ort_int8", capture="export", progress=False)
    path = fxq.export(q, "ort_int8", tmp_path / "m.onnx")[0]
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    x = data[0]
    got = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]
    with torch.no_grad():
        want = q(x).numpy()
    scale = np.abs(want).max()
    assert np.abs(got - want).max() < 0.05 * scale


class ShapeBranch(nn.Module):
    """Symbolic tracing cannot branch on a traced size; torch.export can (a guard on the example's shape)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        y = self.conv(x)
        if y.shape[-1] > 4:
            y = F.avg_pool2d(y, 2)
        return self.fc(y.mean((2, 3)))


def test_auto_falls_back_to_export_and_says_so(caplog):
    with caplog.at_level(logging.INFO, logger="fxq"):
        q = fxq.quantize(ShapeBranch().eval(), _data(), "trt_int8", progress=False)
    assert "torch.export" in caplog.text and "symbolic tracing failed" in caplog.text
    assert _weighted(q) == ["conv", "fc"]
    with pytest.raises(fxq.TraceError):
        fxq.prepare(ShapeBranch().eval(), "trt_int8", _data()[0], capture="fx")


class MaskedSum(nn.Module):
    """A data-dependent output shape (boolean-mask indexing) after quantizable convs."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        y = torch.relu(self.conv(x))
        picked = y[y > 0.1]
        return picked.sum() / (picked.numel() + 1)


def test_data_dependent_shapes_through_export():
    model, data = MaskedSum().eval(), _data()
    q = fxq.quantize(model, data, "trt_int8", capture="export", progress=False)
    assert _weighted(q) == ["conv"]
    with torch.no_grad():
        assert torch.allclose(q(data[0]), model(data[0]), rtol=0.05)


def test_prepare_qat_takes_an_exported_program():
    model, data = _net(), _data()
    qat = fxq.prepare_qat(torch.export.export(model, (data[0],)), "trt_int8", example_inputs=data[0])
    assert len(_weighted(qat)) == 4
    out = qat(data[0])
    out.sum().backward()
    assert any(p.grad is not None for p in qat.parameters())


def test_unknown_capture_is_a_config_error():
    with pytest.raises(fxq.ConfigError, match="capture"):
        fxq.prepare(_net(), "trt_int8", _data()[0], capture="dynamo")


def test_export_graph_writes_the_same_ncnn_files(tmp_path):
    model, data = _net(), _data()
    files = {}
    for capture in ("fx", "export"):
        q = fxq.quantize(model, data, "ncnn_int8", capture=capture, progress=False)
        paths = fxq.export(q, "ncnn_int8", tmp_path / f"{capture}.param")
        files[capture] = {p.suffix: p.read_bytes() for p in paths if ".fp32" not in p.name}
    layers = [[line.split()[0] for line in f[".param"].decode().splitlines()[2:]] for f in files.values()]
    assert layers[0] == layers[1] and "Convolution" in layers[0]
    assert files["fx"][".bin"] == files["export"][".bin"]  # same folded, quantized weights


class ChannelSlices(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.head = nn.Conv2d(3, 6, 3, padding=1), nn.Conv2d(2, 4, 1)

    def forward(self, x):
        y = torch.relu(self.conv(x))
        return self.head(y[:, 1:3] + y[:, 4:6])


def test_export_graph_slices_write_the_same_ncnn_files(tmp_path):
    """aten.slice lifts to indexing, as symbolic tracing records it (the ncnn writer read aten.slice's ``dim`` as its
    index and refused the file)."""
    torch.manual_seed(0)
    model, data = ChannelSlices().eval(), _data((1, 3, 8, 8))
    files = {}
    for capture in ("fx", "export"):
        q = fxq.quantize(model, data, "ncnn_int8", capture=capture, progress=False)
        paths = fxq.export(q, "ncnn_int8", tmp_path / f"{capture}.param")
        files[capture] = {p.suffix: p.read_bytes() for p in paths if ".fp32" not in p.name}
    layers = [[(line.split()[0], [t for t in line.split() if "=" in t]) for line in f[".param"].decode().splitlines()[2:]]
              for f in files.values()]
    assert layers[0] == layers[1] and [t for t, _ in layers[0]].count("Crop") == 2  # node names aside
    assert files["fx"][".bin"] == files["export"][".bin"]


def test_batch_of_one_example_still_gives_a_batch_generic_graph():
    model = _net()
    data = _data((1, 3, 8, 8))
    q_fx = fxq.quantize(model, data, "trt_int8", capture="fx", progress=False)
    q_ex = fxq.quantize(model, data, "trt_int8", capture="export", progress=False)
    x = _data((4, 3, 8, 8), 1)[0]
    with torch.no_grad():
        assert torch.allclose(q_ex(x), q_fx(x), atol=1e-5)


def test_algorithms_and_analysis_see_the_same_graph():
    model, data = _net(), _data()
    setting = fxq.QuantizationSetting(equalization=True, bias_correct=True)
    qs = {c: fxq.quantize(model, data, "trt_int8", setting=setting, capture=c, progress=False) for c in ("fx", "export")}
    x = _data((3, 3, 8, 8), 1)[0]
    with torch.no_grad():
        assert torch.allclose(qs["fx"](x), qs["export"](x), atol=1e-5)
    reports = [str(fxq.graphwise_error_analyse(q, data)) for q in qs.values()]
    assert reports[0] == reports[1] and "block_conv" in reports[0]


def test_unfolded_batchnorm_is_a_module_like_the_fx_path():
    """fold_bn=False: torch.export's functional BatchNorm becomes a BatchNorm module again, so QAT trains it with batch
    statistics and freeze_bn finds it, as on the fx path."""
    model, data = _net(), _data()
    outs = []
    for capture in ("fx", "export"):
        qat = fxq.prepare_qat(model, "trt_int8", example_inputs=data[0], fold_bn=False, capture=capture)
        bns = sorted(n for n, m in qat.named_modules() if isinstance(m, nn.BatchNorm2d))
        assert bns == ["block.bn", "stem.1"]
        qat(data[0]).sum().backward()
        fxq.freeze_bn(qat)
        with torch.no_grad():
            outs.append(qat.eval()(data[1]))
    assert torch.allclose(outs[0], outs[1], atol=1e-5)


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU])
@pytest.mark.parametrize("batch_first, bidirectional", [(True, False), (False, True)])
def test_recurrent_layers_through_export_quantize_like_fx(cls, batch_first, bidirectional):
    """aten.lstm / aten.gru become one fxq::lstm / fxq::gru per layer: the fx path's graph, quantizers and values."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = cls(4, 8, num_layers=2, batch_first=batch_first, bidirectional=bidirectional)
            self.fc = nn.Linear(16 if bidirectional else 8, 2)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            y, h = self.rnn(x)
            return self.fc(y), (h[0] if cls is nn.LSTM else h)

    torch.manual_seed(0)
    model = Net().eval()
    x = torch.randn(3, 5, 4) if batch_first else torch.randn(5, 3, 4)
    by_fx = fxq.quantize(model, [x], "trt_int8", progress=False, capture="fx")
    by_export = fxq.quantize(model, [x], "trt_int8", progress=False, capture="export")
    ops = [n.target for n in by_export.graph.nodes if n.op == "call_function"]
    recurrent = torch.ops.fxq.lstm.default if cls is nn.LSTM else torch.ops.fxq.gru.default
    assert ops.count(recurrent) == 2
    assert torch.ops.aten.lstm.input not in ops and torch.ops.aten.gru.input not in ops
    assert len(list(iter_quantizers(by_export))) == len(list(iter_quantizers(by_fx)))
    weights = [sorted(i.param for i in QuantGraph(g).infos().values() if i.role == "weight") for g in (by_export, by_fx)]
    assert weights[0] == weights[1] and "rnn.W_l1" in weights[0]  # the same weights under the same names
    for a, b in zip(by_export(x), by_fx(x)):
        assert torch.equal(a, b)
    with fxq.fp32_mode(by_export):
        for a, b in zip(by_export(x), model(x)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


class BatchBuilt(nn.Module):
    """Values built from the batch size: a repeated grid, an expanded / tiled token, ``new_zeros``, ``arange``, a float of
    the size, ``chunk`` of a batch-concatenation, slicing / indexing by the size, and a view to ``(b, -1)``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.grid = nn.Parameter(torch.randn(1, 4, 8, 8) * 0.1, requires_grad=False)
        self.tok = nn.Parameter(torch.rand(1, 4, 1, 1) + 0.5, requires_grad=False)
        self.fc = nn.Linear(4 * 8 * 8, 5)

    def forward(self, x):
        b = x.shape[0]
        y = torch.relu(self.conv(x)) + self.grid.repeat(b, 1, 1, 1)
        y = y * self.tok.expand(b, -1, 8, 8) + y.new_zeros(b, 4, 8, 8) + self.tok.tile(b, 1, 8, 8) * 0.1
        y = y + torch.arange(b, dtype=torch.float32).view(b, 1, 1, 1) * (b * 0.02)
        first, second = torch.chunk(torch.cat([y, y * 0.5]), 2)
        y = first - second[:b] * 0.5 + y[b - 1] * 0.1
        return self.fc(y.reshape(y.shape[0], -1))


@pytest.mark.parametrize("platform", ["trt_int8", "ort_int8"])
def test_export_graph_exported_with_a_dynamic_batch_runs_at_other_batches(platform, tmp_path):
    """Sizes the lifted graph computes from the batch stay values in the file (``x.size(0)``, method / torch forms).
    torch.onnx's tracer recorded aten ops' sizes as the traced batch's constants: the file gave 2 rows at batch 1
    and failed at batch 3 (with ``aten.tile``, torch.onnx wrote an invalid file)."""
    pytest.importorskip("onnxruntime")
    from _export_helpers import output_lsb, run_ort

    torch.manual_seed(0)
    model, data = BatchBuilt().eval(), _data((2, 3, 8, 8))
    q = fxq.quantize(model, data, platform, capture="export", progress=False)
    q_fx = fxq.quantize(model, data, platform, capture="fx", progress=False)
    assert not any(isinstance(n.target, torch._ops.OpOverload) for n in q.graph.nodes)  # all lifted
    path = fxq.export(q, platform, tmp_path / "m.onnx", dynamic_batch=True)[0]
    for b in (1, 3):
        x = _data((b, 3, 8, 8), 1)[0]
        with torch.no_grad():
            sim = q(x)
            assert torch.equal(sim, q_fx(x))  # the lifted graph computes what symbolic tracing's does
        for optimize in (True, False):  # ORT's fused int8 kernels may round one code apart, as for the fx capture
            got = run_ort(path, x, optimize=optimize)
            assert got.shape == tuple(sim.shape)
            tolerance = output_lsb(q) * 1.001 if optimize else 1e-5
            np.testing.assert_allclose(got, sim.numpy(), atol=tolerance, err_msg=f"batch {b}, optimize={optimize}")


class _BranchOnBatch(nn.Module):
    """Code that depends on the batch size: torch.export keeps the example's batch (1) fixed."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        y = self.conv(x)
        return y * 2 if x.shape[0] == 1 else y


def test_dynamic_batch_of_a_fixed_batch_capture_is_refused(tmp_path):
    """A file with a dynamic batch from such a graph ran at batch 3 and silently computed the batch-1 branch."""
    torch.manual_seed(0)
    q = fxq.quantize(_BranchOnBatch().eval(), [torch.randn(1, 3, 8, 8) for _ in range(2)], "trt_int8",
                     capture="export", progress=False)
    assert q.meta["fxq_fixed_batch"] == {"x": 1}
    with pytest.raises(fxq.ExportError, match=r"fixed batch \('x' at batch 1\).*Fix: export with dynamic_batch=False"):
        fxq.export(q, "trt_int8", tmp_path / "m.onnx", dynamic_batch=True)
    assert not list(tmp_path.iterdir())
    assert fxq.export(q, "trt_int8", tmp_path / "m.onnx")  # the advice works


class IndexedWrites(KeypointScores):
    """Writes into slices (YOLO pose's ``y[:, 2::3] = y[:, 2::3].sigmoid()``, then more) and a dtype cast (Hugging
    Face's ``mask.to(torch.bool)``): torch.export records ``slice_scatter`` / ``select_scatter`` / ``copy`` /
    ``fill`` / ``_to_copy``, none of which torch.onnx can write."""

    def forward(self, x):
        y = super().forward(x)
        y[:, :2] = y[:, :2] * 2
        y[:, 4:6] = y[:, 4:6] + 1
        y[:, -1] = y[:, 0] - 1
        y[:, -2] = y[:, 1] + 1
        y[..., -3:] = 0.5
        keep = (x[:, :1] > 0).to(torch.bool)
        return y, torch.where(keep, x[:, :1], 0.0)


def test_indexed_writes_and_casts_export_and_match(tmp_path, caplog):
    """The file computes what the simulation does; a value read for its shape only (``x[..., -3:] = 0.5``:
    ``full_like``) has no Q/DQ to lose, so nothing warns that one was dropped."""
    model = IndexedWrites().eval()
    x = torch.randn(2, 3, 8, 8)
    gm = capture_graph(model, (x,))
    left = {str(n.target) for n in gm.graph.nodes if n.op == "call_function" and "aten" in str(n.target)}
    assert not left & {"aten._to_copy.default", "aten.copy.default", "aten.slice_scatter.default",
                       "aten.select_scatter.default", "aten.fill.Scalar"}, left
    with torch.no_grad():
        for want, got in zip(model(x), gm(x)):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    calib = [torch.randn(2, 3, 8, 8) for _ in range(2)]
    for platform in ("trt_int8", "ort_int8"):
        qmodel = fxq.quantize(model, calib, platform=platform)
        with caplog.at_level(logging.WARNING, logger="fxq"):
            files = fxq.export(qmodel, platform, tmp_path / platform / "m.onnx")
        assert "has no Q/DQ" not in caplog.text
        path = next(f for f in files if str(f).endswith(".onnx"))
        with torch.no_grad():
            want = [t.numpy() for t in qmodel(calib[1])]
        for optimize in (False, True):
            session = ort_session(path, optimize=optimize)
            got = session.run(None, {session.get_inputs()[0].name: calib[1].numpy()})
            for w, g in zip(want, got):
                if not optimize:
                    np.testing.assert_allclose(g, w, rtol=0, atol=1e-6, err_msg=platform)
                else:  # ORT's fused int8 kernels round once where Q/DQ rounds twice: a code here and there
                    off = np.abs(g - w) > 1e-6
                    assert off.mean() < 0.01 and np.abs(g - w).max() < 0.05 * np.abs(w).max(), platform


class ComputedFills(nn.Module):
    """Slices filled with a computed number (``y[..., :1] = x.mean()``, ``.fill_(x.amax())``): torch.export
    records ``fill_.Tensor``, as some torch releases also record a constant fill (``y[...] = 0.5``)."""

    def forward(self, x):
        y = torch.relu(x) * 2
        y[..., :1] = x.mean()
        y[..., 1:2].fill_(x.amax())
        y[..., -1:] = 0.25
        return y


def test_fills_of_tensors_lift_and_export(tmp_path):
    model = ComputedFills().eval()
    x = torch.randn(2, 3, 6, 6)
    gm = capture_graph(model, (x,), capture="export")
    left = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert not {t for t in left if "fill" in t}, left
    torch.testing.assert_close(gm(x), model(x), rtol=0, atol=0)
    calib = [torch.randn(2, 3, 6, 6) for _ in range(2)]
    qmodel = fxq.quantize(model, calib, platform="trt_int8", capture="export", progress=False)
    path = fxq.export(qmodel, "trt_int8", tmp_path / "m.onnx")[0]
    with torch.no_grad():
        want = qmodel(calib[1]).numpy()
    session = ort_session(path, optimize=False)
    np.testing.assert_allclose(session.run(None, {session.get_inputs()[0].name: calib[1].numpy()})[0], want,
                               rtol=0, atol=1e-6)


def test_an_op_torch_onnx_cannot_write_is_named_without_opset_advice(tmp_path):
    """An op torch.onnx has no form for at any opset: the error names it and the fx node, advises no opset change,
    and does not carry torch's partial ONNX graph."""

    class Unwritable(nn.Module):
        def forward(self, x):
            return torch.special.zeta(x, 2.0) + 1

    gm = fxq.prepare(Unwritable().eval(), "trt_int8", example_inputs=torch.rand(1, 4) + 1.5)
    fxq.calibrate(gm, [torch.rand(1, 4) + 1.5])
    fxq.convert(gm)
    with pytest.raises(fxq.ExportError) as info:
        fxq.export(gm, "trt_int8", tmp_path / "m.onnx")
    text = str(info.value)
    assert "zeta" in text and "opset=" not in text and "graph(" not in text and len(text) < 1000, text


class _KeywordInputs(nn.Module):
    """Inputs given by keyword, as Hugging Face batches are (``model(**batch)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 4)

    def forward(self, input_values=None, attention_mask=None):
        return self.fc(input_values) * attention_mask.unsqueeze(-1).to(torch.float32)


def test_keyword_inputs_keep_a_dynamic_batch(tmp_path):
    """torch.export was given its dynamic-batch spec as ``(args, kwargs)``, which it refuses for keyword inputs: every
    model fed dicts was captured at the calibration batch, and its files ran at that batch only."""
    pytest.importorskip("onnxruntime")

    torch.manual_seed(0)
    batches = [{"input_values": torch.randn(2, 5, 6), "attention_mask": torch.ones(2, 5, dtype=torch.long)}
               for _ in range(2)]
    q = fxq.quantize(_KeywordInputs().eval(), batches, "ort_int8", capture="export", progress=False)
    assert "fxq_fixed_batch" not in q.meta
    path = fxq.export(q, "ort_int8", tmp_path / "m.onnx", dynamic_batch=True)[0]
    session = ort_session(path)
    x, mask = torch.randn(3, 5, 6), torch.tensor([[1] * 5, [1, 1, 0, 0, 0], [0] * 5])
    got = session.run(None, {"input_values": x.numpy(), "attention_mask": mask.numpy()})[0]
    with torch.no_grad():
        np.testing.assert_allclose(got, q(input_values=x, attention_mask=mask).numpy(), atol=1e-5)


class _SkipsAnInput(nn.Module):
    """A keyword input after one the batch leaves out (GPT-2's ``forward(input_ids, past_key_values=None,
    attention_mask=None)``): the dict's values given in order put the mask into the cache's place."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 4)

    def forward(self, input_values, cache=None, attention_mask=None):
        del cache  # a stand-in for an input the batch leaves out
        return self.fc(input_values) * attention_mask.unsqueeze(-1)


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_dict_batches_are_keyword_inputs(capture):
    torch.manual_seed(0)
    model = _SkipsAnInput().eval()
    batches = [{"input_values": torch.randn(2, 5, 6), "attention_mask": (torch.rand(2, 5) > 0.3).float()}
               for _ in range(2)]
    for q in (fxq.quantize(model, batches, "trt_int8", capture=capture, progress=False),
              fxq.prepare_qat(model, "trt_int8", example_inputs=batches[0], capture=capture)):
        with torch.no_grad(), fxq.fp32_mode(q):
            torch.testing.assert_close(q(**batches[1]), model(**batches[1]))


class _Box:
    def __init__(self, value: torch.Tensor) -> None:
        self.value = value


class _ReturnsAnObject(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 4)

    def forward(self, x):
        y = self.fc(x)
        return y, _Box(y)


def test_an_output_torch_export_cannot_flatten_is_named_with_the_fix():
    """Hugging Face's ``DynamicCache`` in the output: the error named torch's pytree internals, not the class and
    what to do (``use_cache=False``, or register the class)."""
    with pytest.raises(fxq.TraceError) as info:
        fxq.prepare(_ReturnsAnObject().eval(), "trt_int8", example_inputs=torch.randn(2, 6), capture="export")
    text = str(info.value)
    assert "_Box" in text and "register_pytree_node" in text and "use_cache=False" in text, text
