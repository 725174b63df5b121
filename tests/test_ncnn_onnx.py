"""NCNN exports of models loaded from ONNX files (issue #13): the ops torch.onnx writes for transformers.

A Linear is ``MatMul(x, W)`` + ``Add(b)`` (an int8 ``InnerProduct`` on ncnn_int8), ``F.gelu`` is spelled out with
``Erf`` (ncnn has no Erf: a ``GELU`` layer), LayerNorm before opset 17 uses ``Pow``, and torchvision's attention
splits q / k / v with ``Gather``. Each model is exported with torch.onnx (legacy opsets and dynamo), loaded with
:func:`fxq.load_onnx`, quantized for ``ncnn_int8`` and exported; ncnn's FP32 file must match onnxruntime running the
source file (default session and ``ORT_DISABLE_ALL``) and its int8 file fxq's simulation (cosine >= 0.999).
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torchvision
from test_ncnn_gaps import check, run_ncnn
from torch import nn

import fxq
from fxq.backends import export
from fxq.backends.ncnn import ncnn_paths
from fxq.errors import ExportError

from _export_helpers import run_ort

pytest.importorskip("ncnn")


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """A ViT encoder block written out: LayerNorm, packed qkv Linear, attention as matmuls, residuals, GELU MLP."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).reshape(n, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = (q @ k.transpose(-2, -1)) * (d // self.heads) ** -0.5
        x = x + self.proj((a.softmax(-1) @ v).transpose(1, 2).reshape(n, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class HandGelu(nn.Module):
    """GELU written by hand in the other factor orders: ``(x * 0.5) * (1 + erf(x * 1/sqrt 2))`` and
    ``x * ((1 + erf(x / sqrt 2)) * 0.5)``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        h = (h * 0.5) * (1.0 + torch.erf(h * (1.0 / math.sqrt(2.0))))
        return self.fc2(h * ((1.0 + torch.erf(h / math.sqrt(2.0))) * 0.5))


def small_vit() -> nn.Module:
    torch.manual_seed(0)
    m = torchvision.models.VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=4, hidden_dim=64,
                                             mlp_dim=128)
    nn.init.normal_(m.heads.head.weight, std=0.02)  # torchvision starts the head at zero
    return m.eval()


def _to_onnx(model: nn.Module, shape: tuple[int, ...], path: Path, how: str) -> Path:
    torch.manual_seed(0)
    x = torch.randn(*shape)
    if how == "dynamo":
        torch.onnx.export(model.eval(), (x,), str(path), dynamo=True, verbose=False)
    else:
        torch.onnx.export(model.eval(), (x,), str(path), dynamo=False, opset_version=int(how))
    return path


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-30))


def check_onnx(model: nn.Module, shape: tuple[int, ...], tmp_path: Path, how: str) -> tuple[str, float]:
    """Export, load, quantize for ncnn_int8, export to ncnn and compare; returns the int8 .param text and cosine."""
    src = _to_onnx(model, shape, tmp_path / f"m{how}.onnx", how)
    gm = fxq.load_onnx(src)
    torch.manual_seed(1)
    q = fxq.quantize(gm, [torch.randn(*shape) for _ in range(2)], "ncnn_int8", progress=False)
    export(q, "ncnn", tmp_path / "out" / "m.param")
    files = ncnn_paths(tmp_path / "out" / "m.param")
    x = torch.randn(*shape)
    with torch.no_grad():
        sim = q(x)[0].numpy()
    fp32 = run_ncnn(files["fp32_param"], files["fp32_bin"], x, 1, int8=False)[0]
    for optimize in (True, False):
        ref = run_ort(src, x, optimize=optimize)[0]
        assert fp32.shape == ref.shape, (fp32.shape, ref.shape)
        assert np.abs(fp32 - ref).max() <= 1e-4 * max(1.0, float(np.abs(ref).max())), optimize
    int8 = run_ncnn(files["param"], files["bin"], x, 1, int8=True)[0]
    cos = _cosine(int8.reshape(sim.shape), sim)
    assert cos >= 0.999, cos
    return files["param"].read_text(), cos


def _layers(param: str, kind: str) -> list[str]:
    return [line.split()[1] for line in param.splitlines()[2:] if line.split()[0] == kind]


@pytest.mark.parametrize("how", ["13", "17", "dynamo"])
@pytest.mark.parametrize("build,shape,n_fc", [(Mlp, (1, 8, 16), 2), (Block, (1, 10, 32), 4)], ids=["mlp", "block"])
def test_matmul_gelu_layernorm_from_onnx(tmp_path: Path, build, shape, n_fc, how) -> None:
    """Every Linear is an int8 InnerProduct with its bias folded in (no Add left); GELU and LayerNorm are one
    layer each."""
    param, _ = check_onnx(build(), shape, tmp_path, how)
    table = (tmp_path / "out" / "m.table").read_text()
    fcs = _layers(param, "InnerProduct")
    assert len(fcs) == n_fc and all(re.search(rf"^{re.escape(fc)}_param_0 ", table, re.M) for fc in fcs), fcs
    assert len(_layers(param, "GELU")) == 1 and not _layers(param, "Erf")
    assert all(" 1=1 " in line for line in param.splitlines() if line.startswith("InnerProduct"))  # with bias
    assert not _layers(param, "MemoryData")  # no bias left as a separate Add of a stored tensor
    assert len(_layers(param, "LayerNorm")) == (2 if build is Block else 0)  # opset 13 spells it out: fused


def test_hand_written_erf_gelu_orders(tmp_path: Path) -> None:
    param, _ = check_onnx(HandGelu(), (1, 4, 16), tmp_path, "13")
    assert len(_layers(param, "GELU")) == 2 and not _layers(param, "Erf")


@pytest.mark.parametrize("how", ["14"])  # torchvision's attention (SDPA) exports from opset 14
def test_torchvision_vit_from_onnx(tmp_path: Path, how: str) -> None:
    """q / k / v taken with Gather from the packed projection, the class token with Gather of one index."""
    param, _ = check_onnx(small_vit(), (1, 3, 32, 32), tmp_path, how)
    assert len(_layers(param, "InnerProduct")) == 2 * 4 + 1 and not _layers(param, "Gather")
    assert len(_layers(param, "LayerNorm")) == 2 * 2 + 1 and len(_layers(param, "GELU")) == 2  # spelled out at 14


class PatchMerging(nn.Module):
    """Swin's patch merging: every other row and column of an NHWC value (strided slices), concatenated."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = [x[..., 0::2, 0::2, :], x[..., 1::2, 0::2, :], x[..., 0::2, 1::2, :], x[:, 1:7:2, 1::2, :]]
        return self.fc(torch.cat([p[:, :3] for p in parts], -1))


@pytest.mark.parametrize("how", ["13", "dynamo"])
def test_strided_slices_from_onnx(tmp_path: Path, how: str) -> None:
    param, _ = check_onnx(PatchMerging(), (1, 8, 6, 4), tmp_path, how)
    assert len(_layers(param, "Crop")) >= 8


class StridedConvOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return y[:, 1::2, ::2, 1:5:2] + y[:, :2, 1::2, ::3]


def test_strided_slices_of_a_torch_model(tmp_path: Path) -> None:
    """The same mechanism on a captured torch graph (getitem), dims of an NCHW value."""
    check(StridedConvOutput(), (1, 3, 4, 6), tmp_path / "net")


def small_swin() -> nn.Module:
    """torchvision's Swin with two stages (window attention with a shift, padding, patch merging) at 32 x 32."""
    from torchvision.models.swin_transformer import SwinTransformer

    torch.manual_seed(0)
    return SwinTransformer(patch_size=[4, 4], embed_dim=16, depths=[2, 2], num_heads=[1, 2], window_size=[3, 3],
                           num_classes=10).eval()


@pytest.mark.parametrize("how", ["17", "dynamo"])  # dynamo: ReduceMean-18 with its axes as an input
def test_torchvision_swin_from_onnx(tmp_path: Path, how: str) -> None:
    """Windows of 3 over 8 x 8 tokens: ONNX Pad with pads computed from shapes, q / k / v taken from the
    outermost dim of a 5-dim value, and patch merging's strided slices."""
    param, _ = check_onnx(small_swin(), (1, 3, 32, 32), tmp_path, how)
    assert len(_layers(param, "InnerProduct")) == 4 * 4 + 1 + 1 and _layers(param, "Padding")


class LoneErf(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.erf(self.fc(x))


class PickRows(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x[:, [0, 2]], x[:, :, [7, 1, 3, 5, 6, 0, 2, 4]]], 1) * 2.0


class PickSamples(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[[0, 0]] * 2.0


def test_gather_of_scattered_rows_from_onnx(tmp_path: Path) -> None:
    """Rows by stored indices that are no run (``x[:, [0, 2]]``, a permutation): Crops joined by a Concat."""
    param, _ = check_onnx(PickRows(), (1, 4, 8), tmp_path, "13")
    assert "Concat" in param


@pytest.mark.parametrize("model,shape,message", [
    (LoneErf(), (1, 4, 8), r"op Erf.*no converter for op type 'Erf'"),
    (PickSamples(), (1, 4, 8), r"op Gather.*gathers along the batch dimension"),
], ids=["erf-outside-gelu", "gather-of-samples"])
def test_refused_onnx_forms_name_the_node(tmp_path: Path, model: nn.Module, shape, message: str) -> None:
    gm = fxq.load_onnx(_to_onnx(model, shape, tmp_path / "m.onnx", "13"))
    q = fxq.quantize(gm, [torch.randn(*shape) for _ in range(2)], "ncnn_int8", progress=False)
    with pytest.raises(ExportError, match=message):
        export(q, "ncnn", tmp_path / "out" / "m.param")
    assert not (tmp_path / "out" / "m.param").exists()


class Powers(nn.Module):
    """ONNX Pow by stored exponents of a tensor with negative values (ncnn's own pow is wrong below 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return torch.cat([h ** 2, h ** 3, h ** 1, (h * h + 1.0) ** 0.5, (h * h + 1.0) ** -1.0], -1)


def test_pow_of_negative_values_from_onnx(tmp_path: Path) -> None:
    param, _ = check_onnx(Powers(), (1, 4, 8), tmp_path, "13")
    assert not re.search(r"^BinaryOp.* 0=6(\s|$)", param, re.M)  # no ncnn pow (op 6), wherever it ends the line
