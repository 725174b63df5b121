"""NCNN exporter: forms that used to be refused or mis-exported, each run through the ``ncnn`` package.

Every model is quantized for ``ncnn_int8`` and exported; ncnn's FP32 files must match torch (max |diff| within
1e-4 of the output's range) and its int8 files (int8 inference on) fxq's simulation (cosine >= 0.9999).
"""
from __future__ import annotations

import itertools
import logging
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import fxq
from fxq.analysis.mismatch_ncnn import ncnn_mat
from fxq.backends import export
from fxq.backends.ncnn import NcnnInt8, ncnn_paths
from fxq.errors import ExportError
from fxq.graph.attention import apply_attention_mask

from _export_helpers import ncnn_net
from _models import KeypointScores

ncnn = pytest.importorskip("ncnn")


def run_ncnn(param: Path, bin_: Path, x: torch.Tensor, n_out: int, *, int8: bool, whole: bool = False
             ) -> list[np.ndarray]:
    """The outputs of the files on ``x[0]`` (one sample), or on ``x`` itself when ``whole`` (an unbatched input)."""
    net = ncnn_net(param, bin_, int8=int8)
    ex = net.create_extractor()
    ex.input("in0", ncnn_mat((x if whole else x[0]).numpy()))
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
          sizes: tuple[tuple[int, ...], ...] = (), capture: str = "auto") -> tuple[fx.GraphModule, dict[str, Path]]:
    """Quantize, export, and compare ncnn with torch (FP32) and the simulation (int8) at ``shape`` and ``sizes``."""
    torch.manual_seed(0)
    gm = fxq.quantize(model, [torch.randn(*shape) for _ in range(2)], "ncnn_int8", progress=False, capture=capture)
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
class _ConvPair(nn.Module):
    """Two convolutions with the op under test between them (its input and output quantized)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.conv2 = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 1)


class HandSwish(_ConvPair):
    """Hard-swish by hand and every scalar form: ``x + 3``, ``x * 0.5``, ``3 - x``, ``x / 6``, ``6 / x``."""

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


@pytest.mark.parametrize("form", ["torch", "onnx", "onnx-opset9"])
def test_unit_step_slices(tmp_path: Path, form: str) -> None:
    """Also ``Slice-1`` (opset < 10: bounds as attributes, held by the module)."""
    torch.manual_seed(0)
    model: Any = Sliced().eval()
    if form.startswith("onnx"):
        model = _onnx(model, (1, 3, 4, 5), tmp_path / "m.onnx", opset=9 if form == "onnx-opset9" else 13)
    check(model, (1, 3, 4, 5), tmp_path / "net")


class BatchSlice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)[1:3]


@pytest.mark.parametrize(("model", "shape", "message"), [
    (BatchSlice, (4, 8), r"slice slice\(1, 3, None\) of dim 0, the batch dimension, selects samples: ncnn runs one "
                         r"sample"),
], ids=["batch"])
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
    with caplog.at_level(logging.WARNING, logger="fxq.backends.ncnn.builder"):
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
    (documented in fxq.backends.ncnn.writer). If ncnn ever stops doing this, update the documentation."""
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


# ------------------------------------------------------------------------------------------ 8. grouped convs
class Grouped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 8, 3, groups=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


class GroupedBlock(nn.Module):
    """conv-BN-ReLU, a grouped conv-BN-ReLU (RegNet / ResNeXt), a 1x1 projection."""

    def __init__(self, width: int, out: int, groups: int, kernel: int, stride: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 1), nn.BatchNorm2d(width), nn.ReLU())
        self.grouped = nn.Sequential(nn.Conv2d(width, out, kernel, stride, kernel // 2, groups=groups),
                                     nn.BatchNorm2d(out), nn.ReLU())
        self.proj = nn.Conv2d(out, 8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.grouped(self.stem(x)))


def _conv_weight_quantizer(gm: fx.GraphModule, groups: int) -> Any:
    conv = next(n for n in gm.graph.nodes if n.meta.get("fxq") is not None and n.meta["fxq"].op_type == "Conv"
                and (n.args[6] if len(n.args) > 6 else 1) == groups)
    return gm.get_submodule(str(conv.args[1].target))


@pytest.mark.parametrize("width,out,groups,kernel,stride", [
    (16, 16, 2, 3, 1),   # RegNetX: 8 output channels a group and more
    (48, 48, 6, 3, 2),   # RegNetY's first block: 8 channels a group, stride 2
    (32, 64, 2, 1, 1),   # 32 outputs a group
    (8, 64, 8, 3, 1),    # depth multiplier 8 (one input channel a group)
    (24, 24, 3, 5, 1),   # 5x5
    (32, 24, 2, 3, 1),   # 12 outputs a group (ncnn's own layer was right here)
], ids=["16g2", "48g6s2", "32to64g2", "mult8", "24g3k5", "12a-group"])
def test_int8_grouped_conv_runs_as_one_convolution_a_group(tmp_path: Path, width: int, out: int, groups: int,
                                                          kernel: int, stride: int) -> None:
    """ncnn's int8 ConvolutionDepthWise with several channels a group returns uninitialised memory on x86 (packing
    layout on, the default) when a group has a multiple of 8 output channels: it lays its output out for 4
    channels a pack while each group's Convolution writes 8 (AVX) or 16 a pack into a buffer of its own (RegNet:
    cosine ~0 at the first grouped conv, 0.62 for the network). The exporter writes Slice, one int8 Convolution a
    group (scales per output channel) and Concat; the FP32 files too. Depthwise convs stay ConvolutionDepthWise."""
    from _models import with_bn_statistics

    torch.manual_seed(0)
    model = with_bn_statistics(GroupedBlock(width, out, groups, kernel, stride).eval(), (4, 3, 12, 12), mix=0.5)
    gm, files = check(model, (1, 3, 12, 12), tmp_path / "net")
    for name in ("param", "fp32_param"):
        text = files[name].read_text()
        assert "ConvolutionDepthWise" not in text
        assert re.search(rf"^Slice\s+grouped_0_slice\s+1 {groups} .* -23300={groups}(,{width // groups}){{{groups}}} 1=0$",
                         text, re.M), text
        convs = re.findall(r"^Convolution\s+grouped_0_g\d+\s.* 0=(\d+) .*$", text, re.M)
        assert convs == [str(out // groups)] * groups
        assert re.search(rf"^Concat\s+grouped_0\s+{groups} 1 ", text, re.M)
        assert (" 8=2" in text) == (name == "param")
    w_q = _conv_weight_quantizer(gm, groups)
    assert w_q.config.per_channel  # one scale per output channel, as ncnn's int8 Convolution takes
    table = files["table"].read_text().splitlines()
    lines = [line for line in table if line.startswith("grouped_0_g")]
    assert len(lines) == 2 * groups  # weight and input scales of every group
    scales = np.array([float(v) for line in lines[:groups] for v in line.split()[1:]])
    np.testing.assert_allclose(scales, 1.0 / w_q.scale.double().numpy(), rtol=1e-6)
    assert w_q.config.num_bits == (6 if (kernel, stride) == (3, 1) else 8)  # ncnn's 3x3 s1 int8 Convolution


def test_grouped_conv_exports_with_the_platforms_scales(tmp_path: Path) -> None:
    """ncnn_int8 quantizes a grouped conv with several channels a group per output channel (6 bits when 3x3 s1 d1,
    like every conv ncnn runs as a Convolution), depthwise convs per channel at 8 bits."""
    gm, files = check(Grouped().eval(), (1, 4, 8, 8), tmp_path / "net")
    w_q = _conv_weight_quantizer(gm, 2)
    assert w_q.config.per_channel and w_q.config.num_bits == 6 and w_q.scale.numel() == 8
    dw = fxq.quantize(nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, groups=8)).eval(), [torch.randn(1, 8, 6, 6)],
                      "ncnn_int8", progress=False)
    w_dw = _conv_weight_quantizer(dw, 8)
    assert w_dw.config.per_channel and w_dw.config.num_bits == 8


def test_fp32_grouped_conv_stays_one_layer(tmp_path: Path) -> None:
    """A grouped conv dispatched to FP32 is one ConvolutionDepthWise (ncnn's FP32 kernel is right)."""
    s = fxq.QuantizationSetting()
    s.dispatching_table = {"grouped_0": "fp32"}
    torch.manual_seed(0)
    gm = fxq.quantize(GroupedBlock(16, 16, 2, 3, 1).eval(), [torch.randn(1, 3, 8, 8)], "ncnn_int8", s,
                      progress=False)
    export(gm, "ncnn", tmp_path / "net")
    text = ncnn_paths(tmp_path / "net")["param"].read_text()
    assert re.search(r"^ConvolutionDepthWise\s+grouped_0\s.* 7=2( |$)", text, re.M)
    assert "Slice" not in text


# ------------------------------------------------------------------------------------------ 9. depthwise 5x5
class MnasBlock(nn.Module):
    """MnasNet's inverted residual with 5x5 depthwise convs (stride 2, then stride 1 with the residual)."""

    def __init__(self, c: int = 48) -> None:
        super().__init__()

        def dw(stride: int) -> nn.Sequential:
            return nn.Sequential(nn.Conv2d(16, c, 1, bias=False), nn.BatchNorm2d(c), nn.ReLU(inplace=True),
                                 nn.Conv2d(c, c, 5, stride, 2, groups=c, bias=False), nn.BatchNorm2d(c),
                                 nn.ReLU(inplace=True), nn.Conv2d(c, 16, 1, bias=False), nn.BatchNorm2d(16))

        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1), nn.BatchNorm2d(16), nn.ReLU(inplace=True))
        self.down, self.same = dw(2), dw(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.down(self.stem(x))
        return y + self.same(y)


@pytest.mark.parametrize("packing", [False, True], ids=["pack1", "packed"])
def test_depthwise_5x5_int8(tmp_path: Path, packing: bool) -> None:
    """MnasNet's 5x5 depthwise int8 convs (ConvolutionDepthWise, 8=1, one scale a channel) compute fxq's integers:
    the network agrees at cosine 1 - 1e-9 with ncnn's pack-1 kernels. ncnn's x86 pack-8 depthwise int8 kernel
    (48 channels) dequantizes with _mm_rcp_ps, a ~12-bit reciprocal: a gain error up to 3.7e-4 a channel that no
    file or platform setting can express portably (ARM and pack 1 divide exactly). In a well-conditioned net that
    stays far below one int8 step; random nets with fully data-normalised BatchNorm statistics amplify it (the
    simulation itself moves to cosine 0.91 under such gains), so free-running zoo comparisons of MnasNet /
    MobileNet there are not a measure of the files."""
    from _models import with_bn_statistics

    torch.manual_seed(0)
    model = with_bn_statistics(MnasBlock().eval(), (4, 3, 16, 16), mix=0.5)
    gm, files = check(model, (1, 3, 16, 16), tmp_path / "net")
    assert len(re.findall(r"^ConvolutionDepthWise\s.* 1=5 .* 8=1", files["param"].read_text(), re.M)) == 2
    net = ncnn_net(files["param"], files["bin"], int8=True, packing=packing)
    for _ in range(3):
        x = torch.randn(1, 3, 16, 16)
        ex = net.create_extractor()
        ex.input("in0", ncnn_mat(x[0].numpy()))
        ret, out = ex.extract("out0")
        assert ret == 0
        got = np.array(out).astype(np.float64).ravel()
        (sim,) = _outputs(gm, x)
        sim = sim.astype(np.float64).ravel()
        cos = got @ sim / (np.linalg.norm(got) * np.linalg.norm(sim))
        assert cos >= (1 - 1e-9 if not packing else 0.9999), cos


# ------------------------------------------------------------------------------------------ shape arithmetic (ONNX)
class ShapeShuffle(nn.Module):
    """ShuffleNet's unit as torch.onnx (legacy) writes it with dynamic axes: ``chunk`` slices at bounds computed
    from Shape -> Gather -> Div -> Mul, the channel shuffle reshapes to Shape -> Gather -> Unsqueeze -> Concat."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.branch, self.conv2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(8, 8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        a, c = y.chunk(2, dim=1)
        y = torch.cat([a, self.branch(c)], 1)
        n, _, h, w = y.shape
        y = y.reshape(n, 2, -1, h, w).transpose(1, 2).reshape(n, -1, h, w)
        return self.conv2(y)


class Swapped(nn.Module):
    """A reshape to (N, C, W, H): two dims follow the input's size and neither is ncnn's same-named dim."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.conv2 = nn.Conv2d(3, 4, 1), nn.Conv2d(4, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        n, c, h, w = y.shape
        return self.conv2(y.reshape(n, c, w, h))


def _dynamic_onnx(model: nn.Module, shape: tuple[int, ...], path: Path) -> fx.GraphModule:
    torch.onnx.export(model.eval(), (torch.randn(*shape),), str(path), dynamo=False, opset_version=13,
                      input_names=["x"], dynamic_axes={"x": {0: "n", 2: "h", 3: "w"}})
    return fxq.load_onnx(path, input_shapes=list(shape))


def test_onnx_shape_arithmetic(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Shape-only subgraphs are export-time constants (no layers); the Reshapes keep (0) / infer (-1) the spatial
    dims, so the file also runs at another H x W."""
    torch.manual_seed(0)
    gm = _dynamic_onnx(ShapeShuffle(), (1, 3, 8, 8), tmp_path / "m.onnx")
    assert any(type(m).__name__ == "OnnxShape" for m in gm.modules())
    with caplog.at_level(logging.WARNING):
        _, files = check(gm, (1, 3, 8, 8), tmp_path / "net", sizes=((1, 3, 12, 16),))
    assert "input size" not in caplog.text
    param = files["fp32_param"].read_text()
    types = {line.split()[0] for line in param.splitlines()[2:]}
    assert types <= {"Input", "Convolution", "Crop", "Concat", "Reshape", "Permute", "Split"}, types
    # H and W follow the input (0, measured at a probe size); the channel groups do not and are written out
    assert re.search(r"^Reshape\s.* 0=0 1=0 2=2 11=4$", param, re.M), param
    assert re.search(r"^Reshape\s.* 0=0 1=0 2=8$", param, re.M), param


def test_onnx_shape_arithmetic_baked(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A target ncnn cannot express without the export-time H x W: exported at that size, with a warning."""
    torch.manual_seed(0)
    gm = _dynamic_onnx(Swapped(), (1, 3, 8, 12), tmp_path / "m.onnx")
    with caplog.at_level(logging.WARNING):
        check(gm, (1, 3, 8, 12), tmp_path / "net")
    assert "runs only at the export-time input size" in caplog.text


# ------------------------------------------------------------------------------------------ 3-D conv / pooling
class Video(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(3, 8, 3, padding=1)
        self.dw = nn.Conv3d(8, 8, (1, 3, 3), stride=(1, 2, 2), padding=(0, 1, 1), groups=8)
        self.pool, self.avg = nn.MaxPool3d((1, 2, 2)), nn.AvgPool3d(2, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.avg(self.pool(self.dw(torch.relu(self.conv(x)))))


def test_conv3d_pool3d(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """ncnn has no int8 3-D convolution: prepare keeps both convs FP32 (ncnn_int8's capability, logged once, listed
    by fxq.summary); Convolution3D / ConvolutionDepthWise3D and Pooling3D in both files."""
    torch.manual_seed(0)
    with caplog.at_level(logging.WARNING, logger="fxq.graph.dispatch"):
        gm = fxq.quantize(Video().eval(), [torch.randn(1, 3, 4, 16, 16) for _ in range(2)], "ncnn_int8",
                          progress=False)
    assert "2 node(s) stay FP32 on platform 'ncnn_int8'" in caplog.text and "no int8 3-D convolution" in caplog.text
    report = fxq.summary(gm)
    assert set(report.unexpressible) == {"conv", "dw"} and not report.counts["quantized"]
    assert "kept FP32, not expressible on ncnn_int8: 2" in str(report)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        export(gm, "ncnn", tmp_path / "net")
    assert "3-D" not in caplog.text  # nothing left for the exporter to drop
    files = ncnn_paths(tmp_path / "net")
    param = files["param"].read_text()
    assert "Convolution3D" in param and "ConvolutionDepthWise3D" in param and param.count("Pooling3D") == 2
    x = torch.randn(1, 3, 4, 16, 16)
    (sim,) = _outputs(gm, x)
    for key, int8 in (("fp32_param", False), ("param", True)):
        (got,) = run_ncnn(files[key], files[key.replace("param", "bin")], x, 1, int8=int8)
        assert got.shape == sim.shape
        assert np.abs(got - sim).max() <= 1e-4 * max(1.0, float(np.abs(sim).max()))


class Video2d(nn.Module):
    """A 3-D conv (FP32 on ncnn) feeding an int8 2-D conv."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(3, 8, 3, padding=1)
        self.head = nn.Conv2d(8, 6, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.conv(x)).mean(2))


def test_conv3d_simulation_matches_int8_file(tmp_path: Path) -> None:
    """The simulation used to quantize the 3-D conv the file runs in FP32 (max |diff| 1.6% of the output's range,
    cosine 0.99994); now the int8 file computes the simulation's values up to float rounding."""
    torch.manual_seed(0)
    gm = fxq.quantize(Video2d().eval(), [torch.randn(1, 3, 4, 8, 8) for _ in range(2)], "ncnn_int8", progress=False)
    layers = {r.node: r for r in fxq.summary(gm).layers}
    assert layers["conv"].platform == "fp32" and layers["head"].platform == "ncnn_int8" and layers["head"].weight
    export(gm, "ncnn", tmp_path / "net")
    files = ncnn_paths(tmp_path / "net")
    assert files["table"].read_text().count("head") == 2  # the head is an int8 layer: weight and input scales
    x = torch.randn(1, 3, 4, 8, 8)
    (sim,) = _outputs(gm, x)
    (got,) = run_ncnn(files["param"], files["bin"], x, 1, int8=True)
    assert np.abs(got.reshape(sim.shape) - sim).max() <= 1e-4 * float(np.abs(sim).max())


@pytest.mark.parametrize("entry", ["ncnn_int8", {"bit_width": 8}])
def test_table_forcing_conv3d_quantized_is_refused(entry: Any) -> None:
    setting = fxq.QuantizationSetting(dispatching_table={"conv": entry})
    with pytest.raises(fxq.ConfigError, match=r"setting\.dispatching_table\['conv'\] puts node 'conv' \(op Conv\) on "
                       r"platform 'ncnn_int8', whose exporter cannot run it quantized: ncnn has no int8 3-D "
                       r"convolution .*Fix: map 'conv' to 'fp32' in the table"):
        fxq.prepare(Video2d().eval(), "ncnn_int8", torch.randn(1, 3, 4, 8, 8), setting=setting)


class _SimulatedNcnn(NcnnInt8):
    """ncnn_int8's schemes without its capability (not registered): the simulation quantizes the 3-D conv."""

    name = "simulated_ncnn"
    capability = None


def test_export_refuses_a_quantized_conv3d(tmp_path: Path) -> None:
    torch.manual_seed(0)
    gm = fxq.quantize(Video2d().eval(), [torch.randn(1, 3, 4, 8, 8)], _SimulatedNcnn(), progress=False)
    assert fxq.summary(gm).layers[0].platform == "simulated_ncnn"
    with pytest.raises(ExportError, match=r"ncnn export: quantizer '\w+' on the value of node '\w+' feeds node 'conv' "
                       r"\(op Conv\), which ncnn cannot run quantized \(ncnn_int8: ncnn has no int8 3-D convolution "
                       r".*\)\. Fix: quantize for 'ncnn_int8'"):
        export(gm, "ncnn", tmp_path / "net")
    assert list(tmp_path.iterdir()) == []


def test_ops_outside_the_capability_stay_fp32(tmp_path: Path) -> None:
    """A platform override that quantizes Add's inputs on ncnn_int8: ncnn runs Add in FP32, so prepare keeps it FP32
    (the export used to fail on the Add's quantizers) and the int8 file matches the simulation."""
    ops = frozenset({"Conv", "Gemm", "Add"})
    platform = fxq.get_platform("ncnn_int8").with_overrides(quantized_ops=ops, input_quantized_ops=ops)
    model = nn.Sequential(HandSwish(), nn.Conv2d(4, 4, 1)).eval()  # HandSwish's adds are fed by its first conv
    torch.manual_seed(0)
    gm = fxq.quantize(model, [torch.randn(1, 3, 8, 8) for _ in range(2)], platform, progress=False)
    kept = fxq.summary(gm).unexpressible
    assert kept and all(why == "only Conv, Gemm, MatMul run quantized, not Add" for why in kept.values())
    export(gm, "ncnn", tmp_path / "net")
    files = ncnn_paths(tmp_path / "net")
    x = torch.randn(1, 3, 8, 8)
    (sim,) = _outputs(gm, x)
    (got,) = run_ncnn(files["param"], files["bin"], x, 1, int8=True)
    assert np.abs(got.reshape(sim.shape) - sim).max() <= 1e-4 * float(np.abs(sim).max())


class VideoHead(nn.Module):
    """r3d / mc3 / r2plus1d's head: 3-D conv, adaptive average pooling to 1x1x1, flatten, linear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(3, 8, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool3d((1, 1, 1))
        self.fc = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(torch.relu(self.conv(x))), 1))


def test_adaptive_pool3d(tmp_path: Path) -> None:
    """nn.AdaptiveAvgPool3d had no op type ('Unknown'), so the ncnn export of torchvision's video models failed; it
    is a global average pool, written as an adaptive Pooling3D."""
    from fxq.graph.op_types import op_type

    torch.manual_seed(0)
    gm = fxq.quantize(VideoHead().eval(), [torch.randn(1, 3, 4, 8, 8) for _ in range(2)], "ncnn_int8", progress=False)
    pool = next(n for n in gm.graph.nodes if n.op == "call_module" and n.target == "pool")
    assert op_type(pool, dict(gm.named_modules())) == "GlobalAveragePool"
    export(gm, "ncnn", tmp_path / "net")
    files = ncnn_paths(tmp_path / "net")
    assert "Pooling3D" in files["param"].read_text()
    x = torch.randn(1, 3, 4, 8, 8)
    with fxq.fp32_mode(gm):
        (ref,) = _outputs(gm, x)
    (got,) = run_ncnn(files["fp32_param"], files["fp32_bin"], x, 1, int8=False)
    assert np.abs(got.reshape(ref.shape) - ref).max() <= 1e-4 * max(1.0, float(np.abs(ref).max()))


# ------------------------------------------------------------------------------------------ 8. torchvision patterns
class NhwcBlock(nn.Module):
    """ConvNeXt's block: a depthwise conv, then LayerNorm and two Linear over the channels of the NHWC permute, a
    layer scale, the residual; then its LayerNorm2d (permute, F.layer_norm, permute back)."""

    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.stem, self.dw = nn.Conv2d(3, c, 1), nn.Conv2d(c, c, 3, padding=1, groups=c)
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(c), nn.Linear(c, 4 * c), nn.Linear(4 * c, c)
        self.scale = nn.Parameter(torch.rand(c, 1, 1) + 0.5)
        self.norm2d = nn.LayerNorm(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.stem(x)
        z = self.fc2(F.gelu(self.fc1(self.norm(self.dw(y).permute(0, 2, 3, 1)))))
        y = y + self.scale * z.permute(0, 3, 1, 2)
        return F.layer_norm(y.permute(0, 2, 3, 1), (8,), self.norm2d.weight, self.norm2d.bias).permute(0, 3, 1, 2)


def test_linear_over_nhwc_channels(tmp_path: Path) -> None:
    """InnerProduct flattens a 3-D blob whole: the Linear over the last dim of (N, H, W, C) is written as a
    Reshape to rows (H * W, C), an int8 InnerProduct, and a Reshape back whose outermost dim follows the input."""
    _, files = check(NhwcBlock().eval(), (2, 3, 6, 5), tmp_path / "net", sizes=((1, 3, 9, 5),))
    text = files["param"].read_text()
    assert text.count("InnerProduct") == 2 and text.count(" 8=2") == 3 and " 8=1" in text  # int8: all but LayerNorm
    assert re.search(r"Reshape\s+fc1_rows .* 0=8 1=-1$", text, re.M)


class ClassToken(nn.Module):
    """ViT's input: patch embedding, a class token expanded along the batch and concatenated in front, a position
    embedding added; one encoder MLP; the class token's features."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.proj = nn.Conv2d(3, d, 4, 4)
        self.cls = nn.Parameter(torch.randn(1, 1, d))
        self.pos = nn.Parameter(torch.randn(1, 5, d))
        self.norm, self.fc = nn.LayerNorm(d), nn.Linear(d, d)
        self.head = nn.Linear(d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        t = self.proj(x).reshape(n, self.cls.shape[-1], -1).permute(0, 2, 1)
        t = torch.cat([self.cls.expand(n, -1, -1), t], dim=1) + self.pos
        t = t + self.fc(self.norm(t))
        return self.head(t[:, 0])


def test_class_token_of_an_expanded_parameter(tmp_path: Path) -> None:
    """``cls.expand(n, -1, -1)`` is computed from a parameter and the input's batch size only: the exporter
    treated it as shape arithmetic and refused it as a Concat input; it is a MemoryData of its batch-1 value."""
    _, files = check(ClassToken().eval(), (2, 3, 8, 8), tmp_path / "net")
    text = files["param"].read_text()
    assert re.search(r"MemoryData\s+expand\s+0 1 expand 0=16 1=1$", text, re.M)
    assert re.search(r"Concat\s+cat\s+2 1 expand ", text, re.M)


class Windows(nn.Module):
    """MaxViT's window partition (rank-6 reshape and permute), relative attention inside each window (einsum),
    the grid swap (torch.swapaxes), and the departition back to (N, C, H, W)."""

    def __init__(self, c: int = 8, p: int = 2) -> None:
        super().__init__()
        self.p = p
        self.conv, self.qkv, self.out = nn.Conv2d(3, c, 1), nn.Linear(c, 3 * c), nn.Conv2d(c, c, 1)
        self.bias = nn.Parameter(torch.randn(2, p * p, p * p))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        b, c, h, w = y.shape
        p = self.p
        t = y.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 3, 5, 1).reshape(b, -1, p * p, c)
        qkv = torch.swapaxes(self.qkv(torch.swapaxes(t, -2, -3)), -2, -3)
        q, k, v = qkv.chunk(3, dim=-1)
        q, k, v = (z.reshape(b, -1, p * p, 2, c // 2).permute(0, 1, 3, 2, 4) for z in (q, k, v))
        a = torch.softmax(torch.einsum("b g h i d, b g h j d -> b g h i j", q, k) + self.bias, dim=-1)
        t = torch.einsum("bghij,bghjd->bghid", a, v).permute(0, 1, 3, 2, 4).reshape(b, -1, p * p, c)
        t = t.reshape(b, h // p, w // p, p, p, c).permute(0, 5, 1, 3, 2, 4).reshape(b, c, h, w)
        return self.out(t + y)


def test_window_partition_of_rank_6(tmp_path: Path) -> None:
    """A (N, C, H/p, p, W/p, p) value is a rank-5 blob, beyond ncnn's 4 dims: it is kept as a rank-4 blob of the
    same elements, and its permute is written as Reshape + Permute steps of at most 4 dim groups."""
    _, files = check(Windows().eval(), (2, 3, 8, 12), tmp_path / "net")
    text = files["param"].read_text()
    assert "permute_step0" in text and text.count("MatMul") == 2


def test_permute_steps_reach_every_order() -> None:
    """The Reshape + Permute plan of a permutation of up to 6 groups (breadth-first) and beyond (one group at a
    time) ends at that permutation, each step permuting at most 4 contiguous chunks."""
    from fxq.backends.ncnn.layers import _permute_steps

    def apply(steps: Any, m: int) -> tuple[int, ...]:
        seq = tuple(range(m))
        for cuts, perm in steps:
            chunks = [seq[lo:hi] for lo, hi in zip((0, *cuts), (*cuts, m))]
            assert 2 <= len(chunks) <= 4 and sorted(perm) == list(range(len(chunks)))
            seq = tuple(g for i in perm for g in chunks[i])
        return seq

    for m in range(1, 6):
        for target in itertools.permutations(range(m)):
            assert apply(_permute_steps(target), m) == target
    for target in [(1, 3, 2, 4, 0), (5, 4, 3, 2, 1, 0), (6, 0, 5, 1, 4, 2, 3), (7, 5, 3, 1, 6, 4, 2, 0)]:
        assert apply(_permute_steps(target), len(target)) == target
    assert len(_permute_steps((1, 3, 2, 4, 0))) == 2  # MaxViT's partition: two Permute layers


def _ncnn_permute(x: np.ndarray, order_type: int) -> np.ndarray:
    """ncnn's own Permute layer on ``x`` (rank 2 to 4, torch's outermost-first dims)."""
    keys = {2: "0={} 1={}", 3: "0={} 1={} 2={}", 4: "0={} 1={} 11={} 2={}"}[x.ndim].format(*x.shape[::-1])
    net = ncnn.Net()
    net.load_param_mem(f"7767517\n2 2\nInput in 0 1 in {keys}\nPermute p 1 1 in out 0={order_type}\n")
    net.load_model_mem(b"")
    ex = net.create_extractor()
    ex.input("in", ncnn_mat(x))
    _, out = ex.extract("out")
    return np.array(out)


def test_permute_order_type_matches_ncnn() -> None:
    """The one order_type formula gives, for every permutation of 2 to 4 dims, the Permute whose ncnn output is
    numpy's transpose."""
    from fxq.backends.ncnn.layers import permute_order_type

    for rank in (2, 3, 4):
        x = np.arange(math.prod(range(2, 2 + rank)), dtype=np.float32).reshape(tuple(range(2, 2 + rank)))
        for perm in itertools.permutations(range(rank)):
            np.testing.assert_array_equal(_ncnn_permute(x, permute_order_type(perm)), x.transpose(perm))


class HighRankSoftmax(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return torch.softmax(y.reshape(1, 2, 4, 2, 2, 3), dim=2).reshape(1, 8, 4, 3)


def test_high_rank_values_only_reshape_and_permute(tmp_path: Path) -> None:
    gm = fxq.quantize(HighRankSoftmax().eval(), [torch.randn(1, 3, 4, 3)], "ncnn_int8", progress=False)
    with pytest.raises(ExportError, match=r"node 'softmax' \(op Softmax.*has 5 dims besides the batch; ncnn blobs "
                                          r"have at most 4.*Fix: .*trt_int8 / ort_int8"):
        export(gm, "ncnn", tmp_path / "net")


class SsdL2Norm(nn.Module):
    """SSD300's L2Norm (F.normalize over the channels times a per-channel ``weight.view(1, -1, 1, 1)``: a
    reshape of a parameter the exporter took for a reshape of the batch) and its head's box layout."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.box = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 2 * 4, 3, padding=1)
        self.weight = nn.Parameter(torch.rand(8) * 20)
        self.fc = nn.Linear(8, 6)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.conv(x)
        y = self.weight.view(1, -1, 1, 1) * F.normalize(y, dim=1)
        n, _, h, w = y.shape
        boxes = self.box(y).view(n, -1, 4, h, w).permute(0, 3, 4, 1, 2).reshape(n, -1, 4)
        return boxes, F.normalize(self.fc(y.mean((2, 3))), dim=1)


def test_ssd_l2norm_and_box_layout(tmp_path: Path) -> None:
    _, files = check(SsdL2Norm().eval(), (2, 3, 6, 7), tmp_path / "net")
    text = files["param"].read_text()
    assert text.count("Normalize") == 2 and "MemoryData" in text


class _Unbatched(nn.Module):
    """An unbatched ``[3, H, W]`` image through what torchvision's detectors do to it: normalized by a per-channel
    mean and std, resized as a batch of one and taken back, padded, batched by a one-tensor concat; a conv; then an
    unbatched head: boxes clipped with max / min and their corners joined along a new dim."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.tensor([0.4, 0.5, 0.6]).reshape(3, 1, 1))
        self.register_buffer("std", torch.tensor([0.2, 0.25, 0.3]).reshape(3, 1, 1))
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.head = nn.Conv2d(4, 4, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = (x - self.mean) / self.std
        x = F.interpolate(x[None], scale_factor=0.5, mode="bilinear", align_corners=False)[0]
        x = torch.cat([F.pad(x, (0, 1, 0, 1))[None]], 0)
        features = torch.relu(self.conv(x))
        boxes = self.head(features).flatten(2)[0]  # [4, H * W]
        lo = torch.maximum(boxes[:2], torch.zeros(()) + 0.1)
        hi = torch.minimum(boxes[2:], torch.ones(()) * 2.0)
        return features, torch.cat([lo.unsqueeze(2), hi.unsqueeze(2)], 2)


@pytest.mark.parametrize("form", ["torch", "onnx"])
def test_unbatched_input_exports(tmp_path: Path, form: str, caplog: pytest.LogCaptureFixture) -> None:
    """A model whose input has no batch dimension (torchvision's detectors) exports for ncnn: its input is one blob
    of the whole ``[3, H, W]`` image and unbatched values inside stay whole; the files match torch (FP32) and the
    simulation (int8). (Before, the export took dim 0 as the batch and refused the first node.)"""
    torch.manual_seed(0)
    model = _Unbatched().eval()
    source = _onnx(model, (3, 16, 16), tmp_path / "m.onnx") if form == "onnx" else model
    gm = fxq.quantize(source, [torch.rand(3, 16, 16) for _ in range(2)], "ncnn_int8", progress=False)
    with caplog.at_level(logging.INFO, logger="fxq.backends.ncnn.builder"):
        export(gm, "ncnn", tmp_path / "net")
    assert "are unbatched" in caplog.text
    files = ncnn_paths(tmp_path / "net")
    assert re.search(r"^Input\s+in0\s+0 1 in0 0=16 1=16 2=3$", files["param"].read_text(), re.M)
    x = torch.rand(3, 16, 16)
    with torch.no_grad():
        sim = [t.numpy().ravel() for t in gm(x)]
        with fxq.fp32_mode(gm):
            ref = [t.numpy().ravel() for t in gm(x)]
    fp32 = run_ncnn(files["fp32_param"], files["fp32_bin"], x, 2, int8=False, whole=True)
    int8 = run_ncnn(files["param"], files["bin"], x, 2, int8=True, whole=True)
    for r, q, a, b in zip(ref, sim, fp32, int8):
        assert a.size == r.size and np.abs(a.ravel() - r).max() <= 1e-4 * max(1.0, float(np.abs(r).max()))
        b, q = b.ravel().astype(np.float64), q.astype(np.float64)
        assert b @ q / (np.linalg.norm(b) * np.linalg.norm(q)) >= 0.9999


class _MovedConcat(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x).transpose(0, 1)  # (T, 1, 5): the batch of 1 moved
        return torch.cat([y, y], dim=2).transpose(0, 1)


def test_concat_of_values_whose_batch_moved(tmp_path: Path) -> None:
    """Concat maps its dim past a batch of 1 that moved (it was refused: its converter took only batch-first
    values)."""
    check(_MovedConcat().eval(), (1, 8, 16), tmp_path / "net")


class _Thresholded(nn.Module):
    """A head whose outputs include a score threshold (``scores > 0.5``), which ncnn has no layer for, and boxes
    masked by it (their values are needed beside the ncnn model too)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.boxes = nn.Conv2d(3, 4, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        scores = torch.sigmoid(self.conv(x)).flatten(1)
        keep = scores > 0.5
        return self.conv(x).mean(1), keep, self.boxes(x).flatten(1) * keep


class _Flattened(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.fc = nn.Conv2d(3, 4, 3), nn.Linear(4 * 6 * 6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.conv(x))
        return self.fc(y.view(y.size(0), -1))


@pytest.mark.parametrize("batch", [2, 4])  # a Shape of rank 4, a reshape target of 2 parts
def test_batched_onnx_shape_arithmetic_is_not_taken_for_unbatched(tmp_path: Path, batch: int,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """A dynamic-batch ONNX file's ``Shape`` (length: the rank) and the reshape target built from it keep their
    size at batch 1: integer values are no evidence of an unbatched input (review finding: batches 2-4 were)."""
    path = tmp_path / "m.onnx"
    torch.onnx.export(_Flattened().eval(), (torch.randn(batch, 3, 8, 8),), str(path), dynamo=False,
                      opset_version=13, input_names=["x"], dynamic_axes={"x": {0: "n"}})
    with caplog.at_level(logging.INFO, logger="fxq.backends.ncnn.builder"):
        check(fxq.load_onnx(path), (batch, 3, 8, 8), tmp_path / "net")
    assert "unbatched" not in caplog.text


def test_op_without_ncnn_layer_names_the_cut_that_deploys(tmp_path: Path) -> None:
    """An ONNX-loaded model with a comparison among its outputs: the ncnn refusal names the cut without it (the
    comparison's input instead, the other outputs kept), as advice and as ``suggested_outputs``; following it gives
    ncnn files that match the simulation."""
    torch.manual_seed(0)
    path = tmp_path / "m.onnx"
    torch.onnx.export(_Thresholded().eval(), (torch.randn(1, 3, 8, 8),), str(path), dynamo=False, opset_version=13,
                      input_names=["x"], output_names=["mean", "keep", "kept_boxes"])
    calib = [torch.randn(1, 3, 8, 8) for _ in range(2)]
    gm = fxq.quantize(fxq.load_onnx(path), calib, "ncnn_int8", progress=False)
    with pytest.raises(ExportError, match=r"op Greater.*ncnn has no layer for it.*outputs=\['mean', ") as err:
        export(gm, "ncnn", tmp_path / "net")
    cut = err.value.suggested_outputs  # the mean, the scores and the boxes (the two the threshold part reads)
    assert cut[0] == "mean" and len(cut) == 3 and f"--outputs {','.join(cut)}" in str(err.value)
    gm = fxq.quantize(fxq.load_onnx(path, outputs=cut), calib, "ncnn_int8", progress=False)
    export(gm, "ncnn", tmp_path / "net")
    files = ncnn_paths(tmp_path / "net")
    x = torch.randn(1, 3, 8, 8)
    with torch.no_grad():
        sim = [t.numpy()[0].ravel() for t in gm(x)]
    got = run_ncnn(files["param"], files["bin"], x, 3, int8=True)
    assert [g.size for g in got] == [s.size for s in sim]
    for g, q in zip(got, sim):
        g, q = g.ravel().astype(np.float64), q.astype(np.float64)
        assert g @ q / (np.linalg.norm(g) * np.linalg.norm(q)) >= 0.9999
    native = fxq.quantize(_Thresholded().eval(), calib, "ncnn_int8", progress=False)
    with pytest.raises(ExportError, match="no converter") as err:  # no file to cut: no cut advice
        export(native, "ncnn", tmp_path / "native")
    assert err.value.suggested_outputs == () and "outputs=" not in str(err.value)


def _windows(x: torch.Tensor, size: int) -> torch.Tensor:
    """A function symbolic tracing keeps whole (registered with torch.fx.wrap below, as torchvision's Swin)."""
    return torch.roll(x, shifts=size // 2, dims=3)[..., :size] * 2


torch.fx.wrap("_windows")


def _scaled_windows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, size: int) -> torch.Tensor:
    """A wrapped function that also reads parameters: they are constants of its trace."""
    return F.linear(_windows(x, size).transpose(1, 3), weight, bias).transpose(1, 3)


torch.fx.wrap("_scaled_windows")


class _WrappedCall(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _scaled_windows(self.conv(_windows(x, 8)), self.fc.weight, self.fc.bias, 4)


def test_opaque_wrapped_functions_are_float_islands(tmp_path: Path) -> None:
    """A torch.fx.wrap'd function is one call of no op type; the ncnn export writes it as float layers, traced by
    torch.onnx on the values the network gives it (its parameter arguments constants of the trace), as FP32 island
    modules are. It was refused (torchvision's Swin on the native path). The ONNX route stays."""
    torch.manual_seed(0)
    model = _WrappedCall().eval()
    gm, files = check(model, (1, 3, 8, 16), tmp_path / "m")
    report = fxq.locate_mismatch(gm, files["param"], [torch.randn(1, 3, 8, 16)], teacher_forced=True)
    assert "_windows" in [r.name for r in report] and report.first_divergence is None, report.table()
    check(_onnx(model, (1, 3, 8, 16), tmp_path / "m.onnx", opset=17), (1, 3, 8, 16), tmp_path / "m_onnx")


def _lift(x: torch.Tensor, target_dim: int) -> tuple[torch.Tensor, int]:
    """As torchvision's MViT ``_unsqueeze``: a tensor and a number (its rank) from one wrapped call."""
    rank = x.dim()
    if rank == target_dim - 1:
        x = x.unsqueeze(1)
    return x, rank


def _lower(x: torch.Tensor, target_dim: int, rank: int) -> torch.Tensor:
    return x.squeeze(1) if rank == target_dim - 1 else x


torch.fx.wrap("_lift")
torch.fx.wrap("_lower")


class _TensorAndRank(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv1(x)
        n, c, h, w = y.shape
        z, rank = _lift(y.flatten(2).transpose(1, 2), 4)
        z = _lower(torch.relu(z), 4, rank)
        return self.conv2(z.transpose(1, 2).reshape(n, c, h, w))


def test_a_wrapped_function_returning_a_tensor_and_a_number(tmp_path: Path) -> None:
    """The number is a constant of the island's trace, put in its readers' arguments (here another wrapped call,
    whose island then takes only the tensor); it was refused ("returns tuple, not a tensor")."""
    torch.manual_seed(0)
    check(_TensorAndRank().eval(), (1, 3, 6, 6), tmp_path / "m")


def _doubled(x: torch.Tensor) -> tuple[torch.Tensor]:
    return (x * 2,)


torch.fx.wrap("_doubled")


class _OneItemTuple(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2(_doubled(self.conv1(x))[0])


def test_a_wrapped_function_returning_a_one_item_tuple(tmp_path: Path) -> None:
    """Its reader indexes the island's one output: the output itself was put in place of the tuple, so ``[0]``
    took the first row of the tensor."""
    torch.manual_seed(0)
    check(_OneItemTuple().eval(), (1, 3, 6, 6), tmp_path / "m")


class _Pieces(nn.Module):
    """``unbind`` and ``tensor_split`` (MViT's attention and its class token), as the pieces of a split."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(3, 6, 3, padding=1), nn.Conv2d(5, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv1(x)
        n, _, h, w = y.shape
        a, b, c = y.reshape(n, 3, 2, h, w).unbind(1)
        head, rest = torch.tensor_split(y, (1,), dim=1)
        return self.conv2(torch.cat([a * b + c, head, rest[:, 2:4]], 1))


def test_unbind_and_tensor_split_pieces(tmp_path: Path) -> None:
    torch.manual_seed(0)
    _, files = check(_Pieces().eval(), (1, 3, 6, 6), tmp_path / "m")
    assert "Crop" in files["fp32_param"].read_text()


def _gate(x: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(scale)


torch.fx.wrap("_gate")


class _KeywordFromTheNetwork(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return _gate(y, scale=y.mean((2, 3), keepdim=True))


def test_a_wrapped_function_with_a_keyword_from_the_network_is_refused_by_name(tmp_path: Path) -> None:
    q = fxq.quantize(_KeywordFromTheNetwork().eval(), [torch.randn(1, 3, 4, 4) for _ in range(2)], "ncnn_int8",
                     progress=False)
    with pytest.raises(ExportError, match=r"'_gate'.*inside a list, tuple or keyword argument"):
        export(q, "ncnn", tmp_path / "m")


class _Rolled(nn.Module):
    """Shifted windows as Swin writes them: ``torch.roll`` of a feature map along H and W, then back."""

    def __init__(self, shifts: Any, dims: Any) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 4, 1)
        self.shifts, self.dims = shifts, dims

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.roll(torch.relu(self.conv1(x)), shifts=self.shifts, dims=self.dims)
        return self.conv2(y).roll(1, 1)


@pytest.mark.parametrize("shifts,dims", [((-3, -3), (2, 3)), (5, 3), ((2, 9), (2, 3)), (0, 2)])
def test_roll(tmp_path: Path, shifts: Any, dims: Any) -> None:
    """torch.roll by constant shifts (negative, wrapping past the size, zero): Crops and a Concat per dim; the ncnn
    files match torch (fp32) and the simulation (int8) at the export size."""
    check(_Rolled(shifts, dims).eval(), (1, 3, 8, 12), tmp_path / "m")


def test_roll_without_dims_is_refused(tmp_path: Path) -> None:
    class Flat(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.roll(x, 2)

    q = fxq.quantize(nn.Sequential(nn.Conv2d(3, 4, 1), Flat()).eval(), [torch.randn(1, 3, 4, 4) for _ in range(2)],
                     "ncnn_int8", progress=False)
    with pytest.raises(ExportError, match=r"rolls the flattened tensor.*dims="):
        export(q, "ncnn_int8", tmp_path / "m")


class _SlicedRoll(nn.Module):
    """``torch.roll`` as the legacy ONNX exporter writes it: ``cat([x[..., s:], x[..., :s]])``, here by 0 along H
    (Swin3D's time dim when the window covers it): one piece is empty."""

    def __init__(self, shift_h: int, shift_w: int) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 4, 1)
        self.shift_h, self.shift_w = shift_h, shift_w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.conv1(x))
        y = torch.cat([y[:, :, self.shift_h:], y[:, :, :self.shift_h]], dim=2)
        y = torch.cat([y[:, :, :, self.shift_w:], y[:, :, :, :self.shift_w]], dim=3)
        return self.conv2(y)


@pytest.mark.parametrize("form", ["torch", "onnx"])
def test_empty_slices_are_left_out_of_a_concat(tmp_path: Path, form: str) -> None:
    """ncnn blobs cannot be empty: an empty slice has no blob and the Concat reading it takes the other pieces
    (it was refused: "slice ... is empty")."""
    torch.manual_seed(0)
    model: Any = _SlicedRoll(0, 5).eval()
    if form == "onnx":
        model = _onnx(model, (1, 3, 6, 8), tmp_path / "m.onnx")
    _, files = check(model, (1, 3, 6, 8), tmp_path / "net")
    assert files["fp32_param"].read_text().count("\nConcat ") == 1  # the W roll only


class _EmptyRead(nn.Module):
    def __init__(self, concat: bool) -> None:
        super().__init__()
        self.conv, self.concat = nn.Conv2d(3, 4, 1), concat

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.conv(x)
        empty = torch.cat([y[:, :0], y[:, 1:1]], 1) if self.concat else y[:, :, :0]
        return y, torch.sigmoid(empty)


@pytest.mark.parametrize(("concat", "source"), [(False, "getitem"), (True, "cat")], ids=["slice", "concat"])
def test_an_empty_value_read_by_another_op_is_refused_by_name(tmp_path: Path, concat: bool, source: str) -> None:
    """Also a Concat of empty pieces only: it is empty itself."""
    q = fxq.quantize(_EmptyRead(concat).eval(), [torch.randn(1, 3, 4, 4) for _ in range(2)], "ncnn_int8",
                     progress=False)
    with pytest.raises(ExportError, match=rf"node 'sigmoid'.*its input '{source}' is empty \(shape \(1, "):
        export(q, "ncnn_int8", tmp_path / "m")


class _WindowPad(nn.Module):
    """Swin's window padding: ``F.pad`` by amounts computed from the input's size (a tuple holding graph values)."""

    def __init__(self, window: int = 4) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 4, 1)
        self.window = window

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.conv1(x))
        pad_h = (self.window - y.shape[2] % self.window) % self.window
        pad_w = (self.window - y.shape[3] % self.window) % self.window
        return self.conv2(F.pad(y, (0, pad_w, 0, pad_h)))


def test_pads_computed_from_the_input_size(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The pads are export-time numbers of the file (they were refused: "int() argument must be ... not 'Node'"),
    with a warning that the file runs at the export size only, where they follow the input's size."""
    with caplog.at_level(logging.WARNING):
        _, files = check(_WindowPad().eval(), (1, 3, 6, 7), tmp_path / "net")
    assert "Padding" in files["fp32_param"].read_text()
    assert re.search(r"the pad of node pad is computed from the input's spatial size.*runs only at that input size",
                     caplog.text), caplog.text


class _OneTensorTwoRanks(nn.Module):
    """One stored tensor used with a [N, 8] value first, then with a [N, 8, H, 8] one (along W)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.fc = nn.Conv2d(3, 8, 3, padding=1), nn.Linear(8, 8)
        self.s = nn.Parameter(torch.randn(8))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.conv(x)
        return y * self.s, torch.relu(self.fc(y.mean((2, 3)))) + self.s  # relu: the add is not folded into fc


def test_a_stored_tensor_used_at_two_ranks_gets_a_blob_per_layout(tmp_path):
    """The MemoryData was made once, laid out for its first use (a 1-D blob), and handed to the second, where ncnn
    broadcast the 1-D blob along channels instead of W: the FP32 file was wrong."""
    _, files = check(_OneTensorTwoRanks().eval(), (1, 3, 8, 8), tmp_path / "m")
    param = files["fp32_param"].read_text()
    assert len(re.findall(r"^MemoryData ", param, flags=re.M)) == 2


def _bias_table(table: torch.Tensor, heads: int) -> torch.Tensor:
    """Swin-V2's relative position bias in small: a wrapped function of a value computed from stored tensors."""
    return 16 * torch.sigmoid(table.t().reshape(1, heads, -1, 1))


torch.fx.wrap("_bias_table")


class _ConstantThroughAnMlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.table = nn.Parameter(torch.randn(8, 2))
        self.mlp = nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x) + _bias_table(self.mlp(self.table), 4)


def test_a_wrapped_function_of_stored_tensors_is_a_constant_of_the_file(tmp_path: Path) -> None:
    """It reads no input, but the quantizers on the MLP keep it from being folded as shape arithmetic: the value
    is stored (a MemoryData: the simulation's in the int8 file, the float model's in the FP32 file), and the MLP
    is not written (it was refused)."""
    gm, files = check(_ConstantThroughAnMlp().eval(), (1, 3, 8, 8), tmp_path / "m")
    assert "InnerProduct" not in files["param"].read_text() and "MemoryData" in files["param"].read_text()


def _attend(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return x + bias.mean()


torch.fx.wrap("_attend")


def _merge(x: torch.Tensor, rest: list) -> torch.Tensor:
    return x + rest[0]


torch.fx.wrap("_merge")


class _IslandReadsAnMlp(_ConstantThroughAnMlp):
    """An island whose constant argument is a quantized MLP on a stored table: the MLP is not written."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _attend(self.conv(x), self.mlp(self.table))


class _NestedNetworkValue(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 4, 1), nn.Conv2d(3, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _merge(self.a(x), [self.b(x)])


def _ramp(h: int, w: int) -> torch.Tensor:
    return torch.arange(h * w, dtype=torch.float32).reshape(1, 1, h, w) / (h * w)


torch.fx.wrap("_ramp")


class _ShapeFunction(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x) + _ramp(x.shape[2], x.shape[3])


def test_wrapped_function_edge_cases(tmp_path: Path) -> None:
    """Review of the function islands: what only an island's constant arguments read is not written (the island
    bakes the simulation's value in, in both files: the int8 file is compared); a network value inside a list is
    refused by name (it was frozen as example data); a function of shapes only stays the writer's shape
    arithmetic (it was refused)."""
    torch.manual_seed(0)
    gm = fxq.quantize(_IslandReadsAnMlp().eval(), [torch.randn(1, 3, 8, 8) for _ in range(2)], "ncnn_int8",
                      progress=False)
    export(gm, "ncnn", tmp_path / "mlp")
    files = ncnn_paths(tmp_path / "mlp")
    assert "InnerProduct" not in files["param"].read_text()
    x = torch.randn(1, 3, 8, 8)
    (got,) = run_ncnn(files["param"], files["bin"], x, 1, int8=True)
    sim = _outputs(gm, x)[0]
    got, sim = got.reshape(sim.shape).astype(np.float64).ravel(), sim.astype(np.float64).ravel()
    assert got @ sim / (np.linalg.norm(got) * np.linalg.norm(sim)) >= 0.9999
    q = fxq.quantize(_NestedNetworkValue().eval(), [torch.randn(1, 3, 4, 4) for _ in range(2)], "ncnn_int8",
                     progress=False)
    with pytest.raises(ExportError, match=r"'_merge'.*inside a list, tuple or keyword"):
        export(q, "ncnn", tmp_path / "nested")
    check(_ShapeFunction().eval(), (1, 3, 8, 8), tmp_path / "ramp")


class _SequencePooler(nn.Module):
    """What Hugging Face models write: a softmax in float32 cast back to the input's dtype (a float32 -> float32
    Cast), and a pooler over the sequence (``nn.AdaptiveAvgPool1d(1)`` on (N, C, L), Swin's)."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2, self.head = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.pool = nn.AdaptiveAvgPool1d(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.l2(F.softmax(self.l1(x), dim=-1, dtype=torch.float32).to(x.dtype))
        return self.head(torch.flatten(self.pool(y.transpose(1, 2)), 1))


@pytest.mark.parametrize("form", ["torch", "onnx"])
def test_float_casts_and_sequence_pooling(tmp_path: Path, form: str) -> None:
    """Both were refused (no converter for 'Cast'; "only 2-D and 3-D adaptive pooling")."""
    torch.manual_seed(0)
    model: Any = _SequencePooler().eval()
    if form == "onnx":
        model = _onnx(model, (1, 8, 16), tmp_path / "m.onnx", opset=17)
    _, files = check(model, (1, 8, 16), tmp_path / "net")
    assert "Reduction" in files["fp32_param"].read_text()


class _AnchorHead(nn.Module):
    """A detector head decoding boxes on an anchor grid built from the feature map's size, as Ultralytics'
    ``make_anchors`` does: ``arange(w).type_as(feats)``, a meshgrid, ``feats.new_full(...)`` for the strides."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, stride=2, padding=1)

    def forward(self, x):
        y = self.conv(x)
        h, w = y.shape[2:]
        sx = torch.arange(w).type_as(y) + 0.5
        sy = torch.arange(h).type_as(y) + 0.5
        gy, gx = torch.meshgrid(sy, sx, indexing="ij")
        anchors = torch.stack((gx, gy), 0).view(2, -1)
        stride = y.new_full((1, h * w), 2.0)
        lt, rb = y[:, :4].flatten(2).chunk(2, 1)
        xy = (anchors - lt + anchors + rb) / 2 * stride
        return torch.cat((xy, y[:, 4:].flatten(2).sigmoid()), 1)


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_anchor_grids_are_constants_of_the_file(tmp_path: Path, capture: str) -> None:
    """The grid reads the feature map for its dtype and size only, so it is a constant of the ncnn file. The writer
    took ``type_as(feats)`` / ``new_full`` as network values, and torch.export's ``arange(4)`` (a call of constants
    only) as an op it has no converter for (Range): YOLO's native ncnn export stopped there."""
    gm, files = check(_AnchorHead().eval(), (1, 3, 8, 8), tmp_path / "m", capture=capture)
    assert gm.meta.get("fxq_capture", "fx") == capture
    assert "MemoryData" in files["param"].read_text()


def test_strided_writes_are_slices_and_concats(tmp_path: Path) -> None:
    """torch.export records the write as ``slice_scatter(..., step=3)``; a scatter has no ncnn layer, but a write
    into one place of every period is a reshape, slices and a concat."""
    gm, files = check(KeypointScores().eval(), (1, 3, 8, 8), tmp_path / "m", capture="export")
    assert not any(n.target is torch.scatter for n in gm.graph.nodes)


class _MaskedAttention(nn.Module):
    """One attention head over ``(N, L, D)`` tokens with SDPA and a mask: ``"causal"`` (fixed at export, masks
    positions), ``"keep_all"`` (Hugging Face's all-True bool mask of an unpadded batch, built from ``arange``) or
    ``"computed"`` (a float mask the network computes from the tokens)."""

    def __init__(self, mask: str) -> None:
        super().__init__()
        self.mask = mask
        self.qkv = nn.Linear(8, 24)
        self.scores = nn.Linear(8, 6)
        self.out = nn.Linear(8, 8)

    def forward(self, x):
        q, k, v = self.qkv(x).unsqueeze(1).chunk(3, dim=-1)
        if self.mask == "causal":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif self.mask == "keep_all":
            keep = (torch.arange(x.shape[1]) >= 0).view(1, 1, 1, -1).expand(x.shape[0], 1, x.shape[1], x.shape[1])
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=-torch.relu(self.scores(x)).unsqueeze(1))
        return self.out(y.squeeze(1))


@pytest.mark.parametrize("mask", ["causal", "keep_all", "computed"])
def test_attention_masks(tmp_path: Path, mask: str) -> None:
    """fxq's decomposed attention keeps a mask as its own step (AttentionMask), which the ncnn writer refused:
    native ViT and every model with SDPA and a mask stopped there."""
    gm, files = check(_MaskedAttention(mask).eval(), (1, 6, 8), tmp_path / "m")
    assert any(n.target is apply_attention_mask for n in gm.graph.nodes)
    layers = files["param"].read_text()
    assert ("MemoryData" in layers) == (mask == "causal")


class _Conv1dStack(nn.Module):
    """1-D convolutions as audio encoders have them (Wav2Vec2's feature extractor): plain, grouped with dilation and
    'same' padding, depthwise with a stride."""

    def __init__(self) -> None:
        super().__init__()
        self.plain = nn.Conv1d(4, 8, 3, padding=1)
        self.grouped = nn.Conv1d(8, 8, 3, padding="same", dilation=2, groups=2)
        self.depthwise = nn.Conv1d(8, 8, 5, stride=2, groups=8, bias=False)

    def forward(self, x):
        return self.depthwise(torch.relu(self.grouped(torch.relu(self.plain(x)))))


def test_conv1d(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """ncnn has Convolution1D (and its depthwise form) but no int8 path for them: the export refused every 1-D
    convolution, and only after calibration. They stay FP32 from prepare on, as for 3-D convolutions."""
    with caplog.at_level(logging.WARNING, logger="fxq"):
        _, files = check(_Conv1dStack().eval(), (1, 4, 32), tmp_path / "m")
    assert "no int8 1-D convolution" in caplog.text
    layers = files["param"].read_text()
    assert layers.count("Convolution1D") == 1 and layers.count("ConvolutionDepthWise1D") == 2


class _PiecesReadForShape(nn.Module):
    """Split pieces the model reads only for their sizes (YOLO's ``Split`` pieces read by ``Shape``)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)

    def forward(self, x):
        a, b, c = self.conv(x).split([2, 3, 3], 1)
        return a.flatten(1) * 2 + c.flatten(1).shape[1] + b.shape[1]


def test_layers_nothing_reads_are_left_out(tmp_path: Path) -> None:
    """The sizes are numbers of the file; the pieces' Crop and Flatten layers stayed in the .param, computing
    values nothing read."""
    _, files = check(_PiecesReadForShape().eval(), (1, 3, 8, 8), tmp_path / "m")
    layers = [line.split()[0] for line in files["param"].read_text().splitlines()[2:]]
    assert layers == ["Input", "Convolution", "Crop", "Flatten", "BinaryOp", "BinaryOp", "BinaryOp"], layers


class LogMelFloor(nn.Module):
    """openwakeword's melspectrogram: ``clamp(x, min=x.max() - 8)`` (a floor 8 below the loudest value), exported
    as ONNX ``Clip(x, ReduceMax(x) - 8)``: bounds the network computes, which ncnn's Clip cannot take."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.conv2 = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        y = torch.clamp(y, min=y.amax() - 2.0, max=y.amax() - 0.5)
        return self.conv2(y)


def test_clip_with_bounds_computed_at_run_time(tmp_path: Path) -> None:
    """ncnn export failed with an internal AttributeError (``OnnxClipRunTime`` has no ``min_val``); now BinaryOp
    max / min with the bound blobs, against torch and the simulation."""
    gm = _onnx(LogMelFloor(), (1, 3, 8, 8), tmp_path / "logmel.onnx")
    assert any(type(m).__name__ == "OnnxClipRunTime" for m in gm.modules())
    check(gm, (1, 3, 8, 8), tmp_path / "logmel.param")


# ------------------------------------------------------------------------------------------ reversed dims (Flip)
class Flipped(_ConvPair):
    """``torch.flip`` over two dims; exported to ONNX it is a ``Slice`` with steps -1 (openwakeword's silero VAD)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return self.conv2(torch.flip(y, dims=[-1, 1]) + y.flip(2, 3) * 0.5)  # the method's varargs form too


@pytest.mark.parametrize("form", ["torch", "onnx"])
def test_flip_is_ncnn_flip(tmp_path: Path, form: str) -> None:
    model: Any = Flipped().eval()
    if form == "onnx":
        model = _onnx(model, (1, 3, 8, 8), tmp_path / "m.onnx")
    _, files = check(model, (1, 3, 8, 8), tmp_path / "net")
    param = files["param"].read_text()
    assert re.search(r"^Flip\s.* -23300=2,0,2$", param, re.M)  # blob axes c and w
    assert re.search(r"^Flip\s.* -23300=2,1,2$", param, re.M)  # h and w, from x.flip(2, 3)


def test_reversed_part_of_a_dim(tmp_path: Path) -> None:
    """ONNX ``Slice`` starts 6, ends 1, step -1 (elements 6..2 reversed): a ``Crop`` of them, then a ``Flip``; a step
    of -2: every second of them (a split ``Reshape`` and ``Crop``), then a ``Flip``."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    def model(step: int) -> onnx.ModelProto:
        rng = np.random.default_rng(0)
        inits = [numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w"),
                 numpy_helper.from_array(rng.standard_normal((4, 4, 1, 1)).astype(np.float32), "w2")]
        inits += [numpy_helper.from_array(np.array(v, np.int64), n)
                  for n, v in (("starts", [6]), ("ends", [1]), ("axes", [3]), ("steps", [step]))]
        nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
                 helper.make_node("Slice", ["c", "starts", "ends", "axes", "steps"], ["s"]),
                 helper.make_node("Conv", ["s", "w2"], ["y"])]
        width = len(range(6, 1, step))
        graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, width])], inits)
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])

    _, files = check(fxq.load_onnx(model(-1)), (1, 3, 8, 8), tmp_path / "net")
    param = files["param"].read_text()
    assert re.search(r"^Crop\s.* -23309=1,2 -23310=1,7 -23311=1,2$", param, re.M)
    assert re.search(r"^Flip\s.* -23300=1,2$", param, re.M)
    _, files = check(fxq.load_onnx(model(-2)), (1, 3, 8, 8), tmp_path / "net2")  # elements 6, 4, 2
    param = files["param"].read_text()
    assert re.search(r"^Flip\s.* -23300=1,2$", param, re.M)


# ------------------------------------------------------------------------------------------ stored clip bounds (ONNX)
class Clamped(_ConvPair):
    """Clips whose bounds are numbers: a band, and F.normalize's ``clamp_min(eps)`` (Swin-V2's attention)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.clamp(self.conv(x), min=-0.25, max=0.75)
        return self.conv2(F.normalize(y, dim=1) + torch.clamp(y, min=0.1))


def test_onnx_clip_with_stored_bounds(tmp_path: Path) -> None:
    """onnx2torch's ``OnnxClip`` keeps the bounds as attributes: the ncnn Clip gets them (session 18's one reading of
    a clip's bounds lost them, and Swin-V2's ncnn file fell to cosine 0.03)."""
    _, files = check(_onnx(Clamped(), (1, 3, 8, 8), tmp_path / "m.onnx"), (1, 3, 8, 8), tmp_path / "net")
    clips = [line for line in files["param"].read_text().splitlines() if line.startswith("Clip")]
    assert clips and all(" 0=" in f"{line} " or " 1=" in f"{line} " for line in clips), clips


# ------------------------------------------------------------------------------------------ layers of old zoo files
class _ConvOpConv(_ConvPair):
    """conv -> ``op`` -> conv; ``op`` a module, or ``repeat`` counts (ncnn ``Tile``)."""

    def __init__(self, op: nn.Module | tuple[int, ...]) -> None:
        super().__init__()
        self.op = op if isinstance(op, nn.Module) else None
        self.repeats = None if isinstance(op, nn.Module) else tuple(op)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        y = y.repeat(*self.repeats) if self.repeats is not None else self.op(y)
        return self.conv2(y)


def _affine_instance_norm() -> nn.Module:
    norm = nn.InstanceNorm2d(4, affine=True)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-0.5, 0.5)
    return norm


@pytest.mark.parametrize("form", ["torch", "onnx"])
@pytest.mark.parametrize("op", ["lrn", "selu", "instance_norm", "tile"])
def test_lrn_selu_instance_norm_tile(tmp_path: Path, form: str, op: str) -> None:
    """Layers of onnx-caffe2's AlexNet / GoogLeNet (LRN) and of torch's operator exports: ncnn has each."""
    torch.manual_seed(0)
    inner = {"lrn": lambda: nn.LocalResponseNorm(3, alpha=1e-2, beta=0.75, k=2.0), "selu": nn.SELU,
             "instance_norm": _affine_instance_norm, "tile": lambda: (1, 1, 2, 3)}[op]()
    model = _ConvOpConv(inner).eval()
    source = model if form == "torch" else _onnx(model, (1, 3, 8, 6), tmp_path / "m.onnx")
    gm, files = check(source, (1, 3, 8, 6), tmp_path / "m")
    layer = {"lrn": "LRN", "selu": "SELU", "instance_norm": "InstanceNorm", "tile": "Tile"}[op]
    if not (op == "lrn" and form == "onnx"):  # torch.onnx writes LRN as pad / pool / pow ops
        assert any(line.split()[0] == layer for line in files["param"].read_text().splitlines()[2:])


def _onnx_conv_op_conv(op: Any, shape: tuple[int, ...], extra: list[Any] = ()) -> fx.GraphModule:
    """An ONNX file conv -> ``op`` (a NodeProto from ``c`` to ``p``, after the ``extra`` nodes) -> conv, loaded."""
    import onnx
    from onnx import helper, numpy_helper

    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((4, shape[1], 3, 3)).astype(np.float32) * 0.3, "w")
    w2 = numpy_helper.from_array(rng.standard_normal((2, 4, 1, 1)).astype(np.float32) * 0.3, "w2")
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]), *extra, op,
             helper.make_node("Conv", ["p", "w2"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, list(shape))],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)], [w, w2])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])
    model.ir_version = 7
    return fxq.load_onnx(model)


def test_onnx_lrn_node(tmp_path: Path) -> None:
    """An ONNX ``LRN`` node, as onnx-caffe2's AlexNet and GoogLeNet files have."""
    from onnx import helper

    lrn = helper.make_node("LRN", ["c"], ["p"], size=5, alpha=1e-2, beta=0.75, bias=2.0)
    _, files = check(_onnx_conv_op_conv(lrn, (1, 3, 9, 9)), (1, 3, 9, 9), tmp_path / "m")
    line = next(line.split() for line in files["param"].read_text().splitlines() if line.startswith("LRN"))
    assert "1=5" in line


def test_even_lrn_window_is_refused_by_name(tmp_path: Path) -> None:
    gm = fxq.quantize(_ConvOpConv(nn.LocalResponseNorm(4)).eval(), [torch.randn(1, 3, 8, 8)], "ncnn_int8",
                      progress=False)
    with pytest.raises(ExportError, match=r"node 'op'.*window size 4 is even.*Fix: use an odd local size"):
        export(gm, "ncnn", tmp_path / "m")


@pytest.mark.parametrize("kind", ["avg_exclude", "avg_include", "max"])
@pytest.mark.parametrize("pads", [[0, 0, 1, 1], [1, 0, 0, 2]])
def test_onnx_pools_with_asymmetric_pads(tmp_path: Path, kind: str, pads: list[int]) -> None:
    """onnx-caffe2's GoogLeNet and Inception-v2 pool with pads that differ at the start and end: ncnn's Pooling has
    a pad per side."""
    from onnx import helper

    attrs = {"count_include_pad": int(kind == "avg_include")} if kind != "max" else {}
    pool = helper.make_node("MaxPool" if kind == "max" else "AveragePool", ["c"], ["p"], kernel_shape=[3, 3],
                            strides=[2, 2], pads=pads, **attrs)
    _, files = check(_onnx_conv_op_conv(pool, (1, 3, 9, 9)), (1, 3, 9, 9), tmp_path / "m")
    line = next(line.split() for line in files["param"].read_text().splitlines() if line.startswith("Pooling"))
    assert ("0=0" in line) == (kind == "max")
    if kind != "max":
        assert f"6={int(kind == 'avg_include')}" in line


@pytest.mark.parametrize("n", [1, 2, 3])
def test_onnx_variadic_sum(tmp_path: Path, n: int) -> None:
    """onnx-caffe2's ResNet-50 and ShuffleNet add residuals with ``Sum``: one operand is itself, two a BinaryOp, more
    an Eltwise."""
    from onnx import helper

    extra = [helper.make_node("Relu", ["c"], ["r"]), helper.make_node("Sigmoid", ["c"], ["s"])]
    total = helper.make_node("Sum", ["c", "r", "s"][:n], ["p"])
    gm = _onnx_conv_op_conv(total, (1, 3, 9, 9), extra=extra)
    _, files = check(gm, (1, 3, 9, 9), tmp_path / "m")
    layers = [line.split()[0] for line in files["param"].read_text().splitlines()[2:]]
    assert ("Eltwise" in layers) == (n == 3)


def test_onnx_softmax11_over_a_tail_of_ones(tmp_path: Path) -> None:
    """Softmax-11 at axis 1 of SqueezeNet's ``[N, 1000, 1, 1]``: the flattened tail is one axis."""
    from onnx import helper

    extra = [helper.make_node("GlobalAveragePool", ["c"], ["g"])]
    gm = _onnx_conv_op_conv(helper.make_node("Softmax", ["g"], ["p"], axis=1), (1, 3, 9, 9), extra=extra)
    check(gm, (1, 3, 9, 9), tmp_path / "m")


class _LogSoftmaxHead(_ConvPair):
    """conv -> log-softmax over channels (a classifier's head, the output)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(self.conv(x) * 60.0, dim=1)


@pytest.mark.parametrize("form", ["torch", "onnx"])
def test_log_softmax_is_exact_where_log_of_softmax_underflows(tmp_path: Path, form: str) -> None:
    """ncnn has no log-softmax: max-shifted LogSumExp (logits scaled up so a softmax underflows to 0 somewhere)."""
    model = _LogSoftmaxHead().eval()
    source = model if form == "torch" else _onnx(model, (1, 3, 8, 6), tmp_path / "m.onnx")
    check(source, (1, 3, 8, 6), tmp_path / "m")


@pytest.mark.parametrize("op", ["softplus", "lrn_function"])
def test_softplus_and_functional_lrn(tmp_path: Path, op: str) -> None:
    class Model(_ConvPair):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.conv(x)
            y = F.softplus(y) if op == "softplus" else F.local_response_norm(y, 3, alpha=0.1, beta=0.75, k=2.0)
            return self.conv2(y)

    _, files = check(Model().eval(), (1, 3, 8, 6), tmp_path / "m")
    layer = "Softplus" if op == "softplus" else "LRN"
    assert any(line.split()[0] == layer for line in files["param"].read_text().splitlines()[2:])


@pytest.mark.parametrize("region", ["ACROSS_CHANNELS", "WITHIN_CHANNEL"])
def test_caffe_lrn(tmp_path: Path, region: str) -> None:
    from google.protobuf import text_format

    from fxq.frontends.caffe import proto

    prototxt = f"""
layer {{ name: "data" type: "Input" top: "data" input_param {{ shape {{ dim: 1 dim: 3 dim: 9 dim: 9 }} }} }}
layer {{ name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param {{ num_output: 4 kernel_size: 3 pad: 1 }} }}
layer {{ name: "lrn" type: "LRN" bottom: "conv" top: "lrn"
  lrn_param {{ local_size: 3 alpha: 0.2 beta: 0.6 k: 1.5 norm_region: {region} }} }}
layer {{ name: "conv2" type: "Convolution" bottom: "lrn" top: "out" convolution_param {{ num_output: 2 kernel_size: 1 }} }}
"""
    rng = np.random.default_rng(0)
    net = proto.NetParameter()
    text_format.Parse(prototxt, net, allow_unknown_field=True)
    weights = {"conv": [rng.standard_normal((4, 3, 3, 3)), rng.standard_normal(4)],
               "conv2": [rng.standard_normal((2, 4, 1, 1)), rng.standard_normal(2)]}
    for layer in net.layer:
        for array in weights.get(layer.name, []):
            blob = layer.blobs.add()
            blob.shape.dim.extend(array.shape)
            blob.data.extend((array * 0.3).astype(np.float32).ravel().tolist())
    (tmp_path / "m.prototxt").write_text(prototxt)
    (tmp_path / "m.caffemodel").write_bytes(net.SerializeToString())
    gm = fxq.load_caffe(str(tmp_path / "m.prototxt"), str(tmp_path / "m.caffemodel"))
    _, files = check(gm, (1, 3, 9, 9), tmp_path / "out")
    line = next(line.split() for line in files["param"].read_text().splitlines() if line.startswith("LRN"))
    assert f"0={int(region == 'WITHIN_CHANNEL')}" in line


@pytest.mark.parametrize("form", ["torch", "onnx"])
@pytest.mark.parametrize("pool", ["max", "avg", "avg_exclude"])
def test_pool1d(tmp_path: Path, form: str, pool: str) -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.conv2 = nn.Conv1d(3, 4, 3, padding=1), nn.Conv1d(4, 2, 1)
            self.pool = nn.MaxPool1d(3, 2, padding=1) if pool == "max" else nn.AvgPool1d(
                3, 2, padding=1, count_include_pad=pool == "avg")

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.conv2(self.pool(self.conv(x)))

    model = Model().eval()
    source = model if form == "torch" else _onnx(model, (1, 3, 11), tmp_path / "m.onnx")
    _, files = check(source, (1, 3, 11), tmp_path / "m")
    assert any(line.startswith("Pooling1D") for line in files["param"].read_text().splitlines())


class _Text(nn.Module):
    """Token ids -> embedding -> Linear -> ReLU (a text model's first layers)."""

    def __init__(self, max_norm: float | None = None) -> None:
        super().__init__()
        self.emb, self.lin = nn.Embedding(50, 16, max_norm=max_norm), nn.Linear(16, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(self.emb(ids)))


@pytest.mark.parametrize("form", ["torch", "export", "onnx"])
@pytest.mark.parametrize("shape", [(1, 7), (1, 3, 4)])
def test_embedding_lookup_of_computed_ids(tmp_path: Path, form: str, shape: tuple[int, ...]) -> None:
    """nn.Embedding / ONNX Gather of an initializer by the model's int ids is ncnn's Embed, which reads int32 ids.
    ``export``: captured by torch.export (HF BERT's path), whose ``aten.embedding(weight, ids)`` was refused as "only
    ONNX Gather (numpy.take) of stored indices ... are exported" until lifted to ``F.embedding(ids, weight)``."""
    torch.manual_seed(0)
    model = _Text().eval()
    ids = torch.randint(0, 50, shape)
    source: Any = model
    if form == "onnx":
        torch.onnx.export(model, (ids,), str(tmp_path / "m.onnx"), dynamo=False, opset_version=13)
        source = fxq.load_onnx(tmp_path / "m.onnx")
    gm = fxq.quantize(source, [ids, torch.randint(0, 50, shape)], "ncnn_int8", progress=False,
                      capture="export" if form == "export" else "auto")
    export(gm, "ncnn", tmp_path / "m")
    files = ncnn_paths(tmp_path / "m")
    assert any(line.startswith("Embed") for line in files["param"].read_text().splitlines())
    fresh = torch.randint(0, 50, shape)
    with torch.no_grad():
        sim = gm(fresh)[0].numpy()
        with fxq.fp32_mode(gm):
            ref = gm(fresh)[0].numpy()
    ids32 = fresh[0].numpy().astype(np.int32)
    for int8, want in ((True, sim), (False, ref)):
        stem = "" if int8 else "fp32_"
        net = ncnn_net(files[f"{stem}param"], files[f"{stem}bin"], int8=int8)
        ex = net.create_extractor()
        ex.input("in0", ncnn.Mat(ids32).clone())
        got = np.array(ex.extract("out0")[1]).reshape(want.shape)
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_embedding_with_max_norm_is_refused_by_name(tmp_path: Path) -> None:
    gm = fxq.quantize(_Text(max_norm=1.0).eval(), [torch.randint(0, 50, (1, 7))], "ncnn_int8", progress=False)
    with pytest.raises(ExportError, match=r"max_norm.*Fix: drop max_norm"):
        export(gm, "ncnn", tmp_path / "m")


class _TextEncoder(nn.Module):
    """Token ids -> embedding + learned positions -> two encoder layers -> a classifier on the first token."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(100, 32)
        self.pos = nn.Parameter(torch.randn(1, 12, 32) * 0.1)
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True), 2)
        self.head = nn.Linear(32, 5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(self.tok(ids) + self.pos)[:, 0])


@pytest.mark.parametrize("form", ["torch", "onnx"])
def test_text_encoder_from_token_ids(tmp_path: Path, form: str) -> None:
    torch.manual_seed(0)
    model = _TextEncoder().eval()
    ids = torch.randint(0, 100, (1, 12))
    source: Any = model
    if form == "onnx":
        torch.onnx.export(model, (ids,), str(tmp_path / "m.onnx"), dynamo=False, opset_version=17)
        source = fxq.load_onnx(tmp_path / "m.onnx")
    gm = fxq.quantize(source, [torch.randint(0, 100, (1, 12)) for _ in range(4)], "ncnn_int8", progress=False)
    export(gm, "ncnn", tmp_path / "m")
    files = ncnn_paths(tmp_path / "m")
    with torch.no_grad():
        sim = gm(ids)[0].numpy()
        with fxq.fp32_mode(gm):
            ref = gm(ids)[0].numpy()
    for int8, want in ((True, sim), (False, ref)):
        stem = "" if int8 else "fp32_"
        ex = ncnn_net(files[f"{stem}param"], files[f"{stem}bin"], int8=int8).create_extractor()
        ex.input("in0", ncnn_mat(ids[0].numpy().astype(np.int32)))
        np.testing.assert_allclose(np.array(ex.extract("out0")[1]), want, atol=1e-5)


@pytest.mark.parametrize("op, auto_pad, kernel", [("MaxPool", "SAME_UPPER", 2), ("MaxPool", "SAME_LOWER", 3),
                                                  ("AveragePool", "SAME_UPPER", 3)])
def test_onnx_same_pools_follow_the_input_size(tmp_path: Path, op: str, auto_pad: str, kernel: int) -> None:
    """keras2onnx's MTCNN pools with ``auto_pad=SAME_UPPER``: ncnn's pad_mode 2 / 3 pads from the input size at run
    time, so the file runs an image pyramid (other sizes than the calibration's, odd ones included)."""
    import onnx
    from onnx import helper, numpy_helper

    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32) * 0.3, "w")
    w2 = numpy_helper.from_array(rng.standard_normal((2, 4, 1, 1)).astype(np.float32) * 0.3, "w2")
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"]),
             helper.make_node(op, ["c"], ["p"], kernel_shape=[kernel, kernel], strides=[2, 2], auto_pad=auto_pad),
             helper.make_node("Conv", ["p", "w2"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT,
                                                                         ["n", 3, "h", "w"])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)], [w, w2])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    gm = fxq.load_onnx(model, input_shapes={"x": [1, 3, 12, 12]})
    follows = op == "MaxPool"  # an average leaving SAME pads out of its count is written for the export-time size
    _, files = check(gm, (1, 3, 12, 12), tmp_path / "m", sizes=((1, 3, 11, 17), (1, 3, 20, 9)) if follows else ())
    line = next(line.split() for line in files["param"].read_text().splitlines() if line.startswith("Pooling"))
    assert (f"5={2 if auto_pad == 'SAME_UPPER' else 3}" in line) == follows


class _NormalizedByPeak(_ConvPair):
    """Each sample divided by its peak: a reduction to the batch alone, reshaped to broadcast (basic-pitch's
    tf2onnx ``normalized_log``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.conv(x))
        peak = y.amax(dim=(1, 2, 3))
        return self.conv2(y / (peak.reshape(-1, 1, 1, 1) + 1.0))


@pytest.mark.parametrize("form", ["torch", "onnx"])
def test_reshape_of_a_value_of_the_batch_alone(tmp_path: Path, form: str) -> None:
    model = _NormalizedByPeak().eval()
    source = model if form == "torch" else _onnx(model, (1, 3, 8, 8), tmp_path / "m.onnx")
    check(source, (1, 3, 8, 8), tmp_path / "m")


def test_pow_of_two_computed_tensors_warns_of_negative_bases(tmp_path: Path, caplog: pytest.LogCaptureFixture
                                                             ) -> None:
    """torch 0.4's ``test_operator_pow``: ncnn's pow gives ~2.4e38 for a negative base (torch: NaN)."""
    class Model(_ConvPair):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.conv(x)
            return self.conv2(torch.sigmoid(y) ** torch.tanh(y))

    gm, _ = check(Model().eval(), (1, 3, 8, 8), tmp_path / "m")
    with caplog.at_level(logging.WARNING, logger="fxq"):
        export(gm, "ncnn", tmp_path / "again")
    assert any("negative base" in r.getMessage() for r in caplog.records)


# ------------------------------------------------------------------------------------------ review of session 20
def test_embedding_of_ids_computed_in_the_network_is_refused(tmp_path: Path) -> None:
    """ncnn computes ``ids + 1`` in float and its Embed reads int32 bits: such ids are refused, not looked up."""
    class Shifted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(12, 4)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.emb(ids + 1)

    gm = fxq.quantize(Shifted().eval(), [torch.tensor([[0, 2, 4, 6, 8]])], "ncnn_int8", progress=False)
    with pytest.raises(ExportError, match=r"node 'emb'.*ids computed in the network.*Fix: look up the input ids"):
        export(gm, "ncnn", tmp_path / "m")


def test_softplus_with_a_low_threshold_is_refused(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.Softplus(threshold=1.0)).eval()
    gm = fxq.quantize(model, [torch.randn(1, 3, 4, 4)], "ncnn_int8", progress=False)
    with pytest.raises(ExportError, match=r"threshold 1.0.*Fix: use a threshold of at least 15"):
        export(gm, "ncnn", tmp_path / "m")


def test_expand_to_a_size_that_follows_the_input_warns(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c = nn.Conv1d(6, 8, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            t = self.c(x)
            return torch.cat([t, t.amax(2, keepdim=True).expand(-1, -1, t.shape[2])], 1)

    torch.onnx.export(Model().eval(), (torch.randn(1, 6, 5),), str(tmp_path / "m.onnx"), dynamo=False,
                      opset_version=13, input_names=["x"], dynamic_axes={"x": {2: "length"}})
    gm = fxq.quantize(fxq.load_onnx(tmp_path / "m.onnx"), [torch.randn(1, 6, 5)], "ncnn_int8", progress=False)
    with caplog.at_level(logging.WARNING, logger="fxq"):
        export(gm, "ncnn", tmp_path / "m")
    assert any("follow the input's size" in r.getMessage() for r in caplog.records)


def test_pow_with_the_exponent_keyword(tmp_path: Path) -> None:
    class Model(_ConvPair):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.conv2(torch.pow(self.conv(x), exponent=2))

    check(Model().eval(), (1, 3, 8, 8), tmp_path / "m")


def test_softmax11_tail_of_ones_at_the_export_size_only_is_refused(tmp_path: Path) -> None:
    """Softmax-11 at axis 1 over ``[N, C, H, W]`` where H = W = 1 only at the calibration size: at other sizes the
    flattened tail is several axes, which one ncnn Softmax does not compute."""
    from onnx import helper

    model = _onnx_conv_op_conv(helper.make_node("Softmax", ["c"], ["p"], axis=1), (1, 3, 1, 1))
    model.meta["onnx"]["source_input_shapes"] = {"x": [1, 3, "h", "w"]}  # as a file with dynamic H, W declares
    gm = fxq.quantize(model, [torch.randn(1, 3, 1, 1)], "ncnn_int8", progress=False)
    with pytest.raises(ExportError, match=r"flattened tail of several axes \(at some input size\)"):
        export(gm, "ncnn", tmp_path / "m")


def test_integer_arithmetic_is_refused_by_name(tmp_path):
    """An Add of a stored int64 tensor (index arithmetic): ncnn computes in float, so the export names the tensor,
    its dtype and the fix instead of 'has no ncnn blob'."""
    from onnx import TensorProto, helper, numpy_helper

    init = numpy_helper.from_array(np.array([[1, 2], [3, 4]], dtype=np.int64), "offsets")
    graph = helper.make_graph([helper.make_node("Add", ["x", "offsets"], ["y"], name="add")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.INT64, [2, 2])],
                              [helper.make_tensor_value_info("y", TensorProto.INT64, [2, 2])], initializer=[init])
    gm = fxq.load_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]))
    q = fxq.quantize(gm, [torch.ones(2, 2, dtype=torch.int64)], "ncnn_int8", progress=False)
    with pytest.raises(ExportError, match=r"node 'add'.*its input '\w+' is a stored torch.int64 tensor: ncnn blobs "
                                          r"hold float values.*Fix: compute integer"):
        export(q, "ncnn_int8", tmp_path / "m")


# ------------------------------------------------------------------------------------------ elementwise math
class OrientedBoxAngle(_ConvPair):
    """An oriented-box head's angle (ultralytics' OBB: ``cos`` / ``sin`` of a predicted angle), with the other
    elementwise math ncnn's UnaryOp has: tan, asin, acos, atan, floor, ceil."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        angle = (torch.sigmoid(y) - 0.25) * math.pi
        a = torch.cat([angle.cos(), torch.sin(angle), torch.tan(angle * 0.5), torch.atan(y)], dim=1)
        t = torch.tanh(y)
        b = torch.asin(t * 0.9) + torch.acos(t * 0.9) + torch.floor(y * 4) + y.ceil()
        return self.conv2(a[:, :4] + a[:, 4:8] + a[:, 8:12] + a[:, 12:] + b)


@pytest.mark.parametrize("form", ["native", "onnx"])
def test_elementwise_math_is_ncnn_unary_ops(tmp_path: Path, form: str) -> None:
    """Refused before ("the ncnn writer has no converter for op type 'Cos'"; natively the op had no type at all):
    ncnn's UnaryOp has every one of them, checked against torch in FP32 and the simulation in int8."""
    model = OrientedBoxAngle().eval()
    if form == "onnx":
        model = _onnx(model, (1, 3, 8, 8), tmp_path / "m.onnx", opset=17)
    check(model, (1, 3, 8, 8), tmp_path / "m")


class PaddingModules(_ConvPair):
    """torch's padding modules (HF EfficientNet's stem: ``nn.ZeroPad2d``) between two convolutions, and the dropouts
    that are identities in eval."""

    def __init__(self) -> None:
        super().__init__()
        self.pads = nn.ModuleList([nn.ZeroPad2d((1, 0, 1, 0)), nn.ConstantPad2d(1, 0.5), nn.ReflectionPad2d(1),
                                   nn.ReplicationPad2d((0, 1, 1, 0))])
        self.drops = nn.Sequential(nn.Dropout1d(0.2), nn.Dropout3d(0.2), nn.AlphaDropout(0.2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        parts = [pad(y)[:, :, :8, :8] for pad in self.pads]
        return self.conv2(self.drops(parts[0] + parts[1] + parts[2] + parts[3]))


def test_padding_modules_are_pads(tmp_path: Path) -> None:
    """Refused before ("the ncnn writer has no converter for op type 'Unknown'", node ``padding``): each padding
    module is ``F.pad`` once prepared, an ncnn Padding (constant with its value, reflect, replicate), and the dropout
    modules are gone."""
    gm, _ = check(PaddingModules().eval(), (1, 3, 8, 8), tmp_path / "m")
    kinds = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert F.pad in kinds
    assert not [n for n in gm.graph.nodes if n.op == "call_module" and "pads" in str(n.target) or "drops" in str(
        n.target)]


class AudioFeatures(nn.Module):
    """wav2vec2's feature extractor: Conv1d over a waveform, GroupNorm of one group per channel over the time axis
    of ``(N, C, L)``, GELU; and a GroupNorm of groups of channels, and one of an ``(N, C)`` vector."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.norm = nn.Conv1d(1, 8, 10, stride=5), nn.GroupNorm(8, 8)
        self.conv2, self.norm2 = nn.Conv1d(8, 8, 3, stride=2), nn.GroupNorm(2, 8)
        self.fc, self.norm3 = nn.Linear(8, 8), nn.GroupNorm(4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm2(self.conv2(F.gelu(self.norm(self.conv(x)))))
        return self.norm3(self.fc(y.mean(dim=-1)))


def test_group_norm_of_sequences_and_vectors(tmp_path: Path) -> None:
    """Refused before ("the writer maps ncnn's GroupNorm onto (N, C, H, W) values only"): ncnn's GroupNorm takes
    the channels of a 1-D or 2-D blob too."""
    check(AudioFeatures().eval(), (1, 1, 200), tmp_path / "m")


class ValidAnchors(_ConvPair):
    """RT-DETR's decoder input: anchors computed from the feature size, a bool mask of the valid ones
    (``((a > eps) & (a < 1 - eps)).all(-1, keepdim=True)``), and ``mask * features``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        n, c, h, w = y.shape
        grid = torch.stack(torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij"), -1).float()
        anchors = ((grid + 0.5) / torch.tensor([h, w])).reshape(1, h * w, 2)
        valid = ((anchors > 0.1) & (anchors < 0.9)).all(-1, keepdim=True)
        tokens = y.flatten(2).transpose(1, 2) * valid
        return self.conv2(tokens.transpose(1, 2).reshape(n, c, h, w))


def test_a_bool_mask_computed_from_shapes_is_a_constant(tmp_path: Path) -> None:
    """Refused before ("computed from tensor shapes only ... not a tensor of the network"): a bool value fixed at
    export time is a MemoryData of 0 / 1, as torch's arithmetic promotes it."""
    check(ValidAnchors().eval(), (1, 3, 8, 8), tmp_path / "m", capture="export")


class InstanceNorms(_ConvPair):
    """RAFT's feature encoder: ``nn.InstanceNorm2d`` (affine), and ``F.instance_norm`` with and without weights."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.InstanceNorm2d(4, affine=True)
        self.gamma, self.beta = nn.Parameter(torch.rand(4) + 0.5), nn.Parameter(torch.randn(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.norm(self.conv(x)))
        y = F.instance_norm(y, weight=self.gamma, bias=self.beta) + F.instance_norm(y * 2.0)
        return self.conv2(y)


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_instance_norm_functions(tmp_path: Path, capture: str) -> None:
    """``F.instance_norm`` (and torch.export's ``aten.instance_norm``, which RAFT's capture holds: "no converter for
    op type 'Unknown'") is ncnn's InstanceNorm like the module form."""
    check(InstanceNorms().eval(), (1, 3, 8, 8), tmp_path / "m", capture=capture)
