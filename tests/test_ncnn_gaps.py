"""NCNN exporter: forms that used to be refused or mis-exported, each run through the ``ncnn`` package.

Every model is quantized for ``ncnn_int8`` and exported; ncnn's FP32 files must match torch (max |diff| within
1e-4 of the output's range) and its int8 files (int8 inference on) fxq's simulation (cosine >= 0.9999).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import fx, nn

import fxq
from fxq.backends import export
from fxq.backends.ncnn import ncnn_paths
from fxq.errors import ExportError

ncnn = pytest.importorskip("ncnn")


def run_ncnn(param: Path, bin_: Path, x: torch.Tensor, n_out: int, *, int8: bool) -> list[np.ndarray]:
    net = ncnn.Net()
    o = net.opt
    o.use_vulkan_compute = False
    o.num_threads = 1
    o.use_int8_inference = int8
    o.use_fp16_storage = o.use_fp16_packed = o.use_fp16_arithmetic = o.use_bf16_storage = False
    assert net.load_param(str(param)) == 0 and net.load_model(str(bin_)) == 0
    ex = net.create_extractor()
    ex.input("in0", ncnn.Mat(np.ascontiguousarray(x[0].numpy())).clone())
    outs = []
    for k in range(n_out):
        ret, m = ex.extract(f"out{k}")
        assert ret == 0
        outs.append(np.array(m).copy())
    return outs


def _outputs(gm: fx.GraphModule, x: torch.Tensor) -> list[np.ndarray]:
    with torch.no_grad():
        out = gm(x)
    return [t.numpy()[0] for t in (out if isinstance(out, (tuple, list)) else [out])]


def check(model: nn.Module | fx.GraphModule, shape: tuple[int, ...], path: Path,
          sizes: tuple[tuple[int, ...], ...] = ()) -> tuple[fx.GraphModule, dict[str, Path]]:
    """Quantize, export, and compare ncnn with torch (FP32) and the simulation (int8) at ``shape`` and ``sizes``."""
    torch.manual_seed(0)
    gm = fxq.quantize(model, [torch.randn(*shape) for _ in range(2)], "ncnn_int8", progress=False)
    export(gm, "ncnn", path)
    files = ncnn_paths(path)
    for s in (shape, *sizes):
        x = torch.randn(*s)
        sim = _outputs(gm, x)
        with fxq.fp32_mode(gm):
            ref = _outputs(gm, x)
        fp32 = run_ncnn(files["fp32_param"], files["fp32_bin"], x, len(ref), int8=False)
        int8 = run_ncnn(files["param"], files["bin"], x, len(ref), int8=True)
        for k, (r, q, a, b) in enumerate(zip(ref, sim, fp32, int8)):
            assert a.reshape(r.shape).shape == r.shape and a.size == r.size, (s, k, a.shape, r.shape)
            assert np.abs(a.reshape(r.shape) - r).max() <= 1e-4 * max(1.0, float(np.abs(r).max())), (s, k)
            b = b.reshape(q.shape).astype(np.float64).ravel()
            q = q.astype(np.float64).ravel()
            assert b @ q / (np.linalg.norm(b) * np.linalg.norm(q) + 1e-30) >= 0.9999, (s, k)
    return gm, files


def _onnx(model: nn.Module, shape: tuple[int, ...], path: Path, opset: int = 13) -> fx.GraphModule:
    torch.onnx.export(model.eval(), (torch.randn(*shape),), str(path), dynamo=False, opset_version=opset)
    return fxq.load_onnx(path)


# ------------------------------------------------------------------------------------------ 1. scalar operands
class HandSwish(nn.Module):
    """Hard-swish by hand and every scalar form: ``x + 3``, ``x * 0.5``, ``3 - x``, ``x / 6``, ``6 / x``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.conv2 = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        y = y * torch.clamp(y + 3, 0, 6) / 6
        y = (3 - y) * 0.5 + 6 / (torch.sigmoid(y) + 1)
        return self.conv2(y - 1)


@pytest.mark.parametrize("form", ["torch", "onnx"])
def test_scalar_operands(tmp_path: Path, form: str) -> None:
    """ONNX stores the scalars as one-element initializers (and ``6 / x`` as Reciprocal * 6): BinaryOp with_scalar."""
    torch.manual_seed(0)
    model: Any = HandSwish().eval()
    if form == "onnx":
        model = _onnx(model, (1, 3, 8, 8), tmp_path / "m.onnx")
    _, files = check(model, (1, 3, 8, 8), tmp_path / "net")
    param = files["fp32_param"].read_text()
    assert "MemoryData" not in param and " 1=1 " in param  # scalars, no stored one-element tensors
    if form == "torch":
        assert "0=7 1=1 2=3.00000000e+00" in param and "0=8 1=1 2=6.00000000e+00" in param  # RSUB, RDIV


# ------------------------------------------------------------------------------------------ 2. ONNX PRelu
class Prelu(nn.Module):
    def __init__(self, slopes: int) -> None:
        super().__init__()
        self.conv, self.prelu, self.conv2 = nn.Conv2d(3, 4, 3, padding=1), nn.PReLU(slopes), nn.Conv2d(4, 4, 1)
        nn.init.uniform_(self.prelu.weight, -0.5, 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2(self.prelu(self.conv(x)))


@pytest.mark.parametrize("slopes", [4, 1], ids=["per-channel", "single"])
def test_onnx_prelu(tmp_path: Path, slopes: int) -> None:
    torch.manual_seed(0)
    gm = _onnx(Prelu(slopes), (1, 3, 8, 8), tmp_path / "m.onnx")
    _, files = check(gm, (1, 3, 8, 8), tmp_path / "net")
    assert "PReLU" in files["fp32_param"].read_text() and f" 0={slopes}" in files["fp32_param"].read_text()


# ------------------------------------------------------------------------------------------ 3. slices
class Sliced(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        y = self.conv(x)
        # dim 0 after a transpose is the channels: a non-batch dim 0; x[0:1] keeps the batch of 1
        return y[:, 1:4, :, 2:] + 1.0, y.transpose(0, 1)[2:5].transpose(0, 1), y[0:1, :, 1:3]


@pytest.mark.parametrize("form", ["torch", "onnx"])
def test_unit_step_slices(tmp_path: Path, form: str) -> None:
    torch.manual_seed(0)
    model: Any = Sliced().eval()
    if form == "onnx":
        model = _onnx(model, (1, 3, 4, 5), tmp_path / "m.onnx")
    check(model, (1, 3, 4, 5), tmp_path / "net")


class BatchSlice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)[1:3]


class StepSlice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)[:, :, ::2]


@pytest.mark.parametrize(("model", "shape", "message"), [
    (BatchSlice, (4, 8), r"slice slice\(1, 3, None\) of dim 0, the batch dimension, selects samples: ncnn runs one "
                         r"sample"),
    (StepSlice, (1, 3, 4, 4), r"slice slice\(None, None, 2\) of dim 2 \(size 4\) has step 2; ncnn's Crop takes "
                              r"unit-step ranges"),
], ids=["batch", "step"])
def test_inexpressible_slices_say_why(tmp_path: Path, model: Any, shape: tuple[int, ...], message: str) -> None:
    gm = fxq.quantize(model().eval(), [torch.randn(*shape)], "ncnn_int8", progress=False)
    with pytest.raises(ExportError, match=message):
        export(gm, "ncnn", tmp_path / "net")


# ------------------------------------------------------------------------------------------ 4. ceil-mode pooling
class CeilPool(nn.Module):
    def __init__(self, kernel: int, stride: int, padding: int) -> None:
        super().__init__()
        self.conv, self.conv2 = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 1)
        self.pool = nn.MaxPool2d(kernel, stride, padding, ceil_mode=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2(self.pool(self.conv(x)))


@pytest.mark.parametrize(("kernel", "stride", "padding"), [(3, 2, 0), (2, 2, 0), (3, 2, 1)])
def test_ceil_mode_pooling_at_other_sizes(tmp_path: Path, kernel: int, stride: int, padding: int) -> None:
    """Exported at 15x15 (no tail), run at 146x146 (torch: 73) and 21x20: ncnn's full padding is ceil mode."""
    torch.manual_seed(0)
    _, files = check(CeilPool(kernel, stride, padding).eval(), (1, 3, 15, 15), tmp_path / "net",
                     sizes=((1, 3, 146, 146), (1, 3, 21, 20)))
    assert " 5=0" in next(line for line in files["param"].read_text().splitlines() if line.startswith("Pooling"))


def test_ceil_mode_pooling_that_drops_a_window_warns(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """kernel < padding + stride: torch drops a last window starting in the padding; ncnn cannot follow."""
    torch.manual_seed(0)
    with caplog.at_level(logging.WARNING, logger="fxq.backends.ncnn_convert"):
        check(CeilPool(3, 3, 1).eval(), (1, 3, 16, 16), tmp_path / "net")
    assert "export-time input size (16, 16)" in caplog.text


# ------------------------------------------------------------------------------------------ 5. O-Net
class ONet(nn.Module):
    """MTCNN's O-Net (facenet-pytorch layout: permute before the dense layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 32, 3), nn.PReLU(32), nn.MaxPool2d(3, 2, ceil_mode=True),
            nn.Conv2d(32, 64, 3), nn.PReLU(64), nn.MaxPool2d(3, 2, ceil_mode=True),
            nn.Conv2d(64, 64, 3), nn.PReLU(64), nn.MaxPool2d(2, 2, ceil_mode=True),
            nn.Conv2d(64, 128, 2), nn.PReLU(128))
        self.dense5, self.prelu5 = nn.Linear(1152, 256), nn.PReLU(256)
        self.a, self.b, self.c = nn.Linear(256, 2), nn.Linear(256, 4), nn.Linear(256, 10)
        for m in self.modules():
            if isinstance(m, nn.PReLU):
                nn.init.uniform_(m.weight, 0.0, 0.5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = self.body(x).permute(0, 3, 2, 1).contiguous()
        x = self.prelu5(self.dense5(x.view(x.shape[0], -1)))
        return torch.softmax(self.a(x), dim=1), self.b(x), self.c(x)


@pytest.mark.parametrize("form", ["torch", "onnx"])
def test_onet(tmp_path: Path, form: str) -> None:
    torch.manual_seed(0)
    model: Any = ONet().eval()
    if form == "onnx":
        model = _onnx(model, (1, 3, 48, 48), tmp_path / "m.onnx")
    check(model, (1, 3, 48, 48), tmp_path / "net")


# ------------------------------------------------------------------------------------------ 6. int8 inference off
def test_int8_files_need_int8_inference_and_fp32_files_run_either_way(tmp_path: Path) -> None:
    """ncnn quantizes the weights of a layer with int8_scale_term (8=) at load time whatever the Option says, so
    the int8 files compute garbage with ``use_int8_inference = False``; that setting runs ``.fp32.param/.bin``
    (documented in fxq.backends.ncnn_writer). If ncnn ever stops doing this, update the documentation."""
    torch.manual_seed(0)
    gm, files = check(Prelu(4).eval(), (1, 3, 8, 8), tmp_path / "net")
    x = torch.randn(1, 3, 8, 8)
    with fxq.fp32_mode(gm):
        (ref,) = _outputs(gm, x)
    for int8 in (False, True):
        (out,) = run_ncnn(files["fp32_param"], files["fp32_bin"], x, 1, int8=int8)
        np.testing.assert_allclose(out, ref, atol=1e-5)
    (bad,) = run_ncnn(files["param"], files["bin"], x, 1, int8=False)
    assert not np.allclose(bad, ref, atol=1e-2)


# ------------------------------------------------------------------------------------------ 7. more converters
class Permutes(nn.Module):
    """Channel shuffle (view / transpose / contiguous / view) and ConvNeXt's permutes around a LayerNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.norm = nn.Conv2d(3, 8, 1), nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        n, c, h, w = y.shape
        y = y.view(n, 2, c // 2, h, w).transpose(1, 2).contiguous().view(n, c, h, w)
        z = self.norm(torch.permute(y, (0, 2, 3, 1)))
        return z.permute(0, 3, 1, 2) + y.transpose(2, 3).transpose(-1, -2)


@pytest.mark.parametrize("form", ["torch", "onnx"])
def test_permutes(tmp_path: Path, form: str) -> None:
    torch.manual_seed(0)
    model: Any = Permutes().eval()
    if form == "onnx":
        model = _onnx(model, (1, 3, 4, 5), tmp_path / "m.onnx", opset=17)
    _, files = check(model, (1, 3, 4, 5), tmp_path / "net")
    assert "Permute" in files["param"].read_text()


class Means(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        y = self.conv(x)
        v = y.mean((1, 2, 3))
        return y / y.mean(dim=(1, 2, 3), keepdim=True), y - v[:, None, None, None], y.mean().reshape(1, 1) + v[:, None]


def test_mean_over_all_dims(tmp_path: Path) -> None:
    torch.manual_seed(0)
    _, files = check(Means().eval(), (1, 3, 6, 5), tmp_path / "net")
    assert files["param"].read_text().count("Reduction") == 3 and " 1=1 " in files["param"].read_text()


class Broadcasts(nn.Module):
    """Div (and Sub) with every broadcast: per channel, per pixel, lower rank, stored tensors, both sides."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.w, self.v = nn.Parameter(torch.rand(4, 1, 1) + 0.5), nn.Parameter(torch.rand(5) + 0.5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = self.conv(x)
        pos = torch.sigmoid(y) + 0.5
        g = torch.sigmoid(y.mean((2, 3), keepdim=True)) + 0.5  # (1, 4, 1, 1)
        r = pos[:, :1]  # (1, 1, 6, 5)
        c = torch.sigmoid(y.mean(1)) + 0.5  # (1, 6, 5)
        row = torch.sigmoid(y.mean((1, 2))) + 0.5  # (1, 5)
        return (y / g, y / r, g / pos, y / c[:, None], y / self.w, y / self.v, y / row[:, None, None, :],
                pos[:, :, :1] / pos[..., :1], self.w - y)


@pytest.mark.parametrize("form", ["torch", "onnx"])
def test_div_broadcasting(tmp_path: Path, form: str) -> None:
    torch.manual_seed(0)
    model: Any = Broadcasts().eval()
    if form == "onnx":
        model = _onnx(model, (1, 3, 6, 5), tmp_path / "m.onnx")
    check(model, (1, 3, 6, 5), tmp_path / "net")


class Grouped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 8, 3, groups=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


def test_grouped_conv_exports_with_the_platforms_scales(tmp_path: Path) -> None:
    """ncnn's int8 ConvolutionDepthWise reads one weight scale per group: ncnn_int8 quantizes a grouped conv with
    several channels a group per tensor (RegNet/ResNeXt exported; per-channel scales were refused at export)."""
    gm, _ = check(Grouped().eval(), (1, 4, 8, 8), tmp_path / "net")
    conv = next(n for n in gm.graph.nodes if n.meta.get("fxq") is not None and n.meta["fxq"].op_type == "Conv")
    w_q = gm.get_submodule(str(conv.args[1].target))
    assert not w_q.config.per_channel


def test_grouped_conv_with_per_channel_scales_names_the_rule(tmp_path: Path) -> None:
    """Per-channel scales inside a group (forced by the user) are refused with the settings that make the layer
    expressible."""
    torch.manual_seed(0)
    gm = fxq.quantize(Grouped().eval(), [torch.randn(1, 4, 8, 8)], "ncnn_int8", progress=False)
    conv = next(n for n in gm.graph.nodes if n.meta.get("fxq") is not None and n.meta["fxq"].op_type == "Conv")
    w_q = gm.get_submodule(str(conv.args[1].target))
    weight = gm.get_parameter(str(conv.args[1].args[0].target)) if conv.args[1].args[0].op == "get_attr" else None
    assert weight is not None
    w_q.config = w_q.config.replace(per_channel=True, channel_axis=0)
    amax = weight.detach().abs().amax(dim=(1, 2, 3)).clamp_min(1e-8)
    w_q.scale = (amax / 127).reshape(-1)
    with pytest.raises(ExportError, match=r"one weight scale per group.*per_channel=False\) or dispatch it to fp32"):
        export(gm, "ncnn", tmp_path / "net")
