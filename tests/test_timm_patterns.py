"""Patterns found by running timm's architectures through ``bench/zoo.py --families timm`` (files nobody here
wrote), each rebuilt small and run to a deployed file, against the simulation in the runtime.
"""
from __future__ import annotations

import re
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import fxq
from fxq.analysis.mismatch_ncnn import ncnn_mat
from fxq.graph.capture import capture
from fxq.graph.op_types import op_type
from fxq.graph.passes import standardize
from fxq.graph.trace import trace

from _export_helpers import ncnn_net, run_ort

ncnn = pytest.importorskip("ncnn")


def _ncnn_vs_simulation(gm: torch.fx.GraphModule, path: Path, x: torch.Tensor) -> float:
    """Cosine of the int8 files' output (one sample) against the simulation's; the FP32 files against FP32."""
    files = fxq.export(gm, "ncnn_int8", path)
    param, bin_, _, fp32_param, fp32_bin = files
    with torch.no_grad():
        sim = gm(x)[0].numpy()
        with fxq.fp32_mode(gm):
            ref = gm(x)[0].numpy()
    got = {}
    for int8, (p, b) in ((True, (param, bin_)), (False, (fp32_param, fp32_bin))):
        ex = ncnn_net(p, b, int8=int8).create_extractor()
        ex.input("in0", ncnn_mat(x[0].numpy()))
        ret, m = ex.extract("out0")
        assert ret == 0
        got[int8] = np.array(m).reshape(sim.shape).astype(np.float64)
    np.testing.assert_allclose(got[False], ref, atol=1e-4 * max(1.0, float(np.abs(ref).max())))
    return _cosine(got[True], sim)


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-30))


def _deployed_vs_simulation(gm: torch.fx.GraphModule, platform: str, tmp_path: Path, x: torch.Tensor) -> float:
    """Cosine of the exported file (ncnn's int8 files, else the ONNX file in onnxruntime with ORT_DISABLE_ALL)
    against the simulation on ``x``."""
    if platform == "ncnn_int8":
        return _ncnn_vs_simulation(gm, tmp_path / "m", x)
    fxq.export(gm, platform, tmp_path / "m.onnx")
    with torch.no_grad():
        sim = gm(x).numpy()
    return _cosine(run_ort(tmp_path / "m.onnx", x, optimize=False), sim)


def _in_form(model: nn.Module, example: torch.Tensor, form: str, tmp_path: Path) -> nn.Module:
    """``model`` itself (``native``), or loaded from the file torch's legacy exporter writes at opset 17."""
    if form == "native":
        return model
    torch.onnx.export(model, (example,), str(tmp_path / "m.onnx"), dynamo=False, opset_version=17)
    return fxq.load_onnx(tmp_path / "m.onnx")


def _ncnn_cosine(model: nn.Module, shape: tuple[int, ...], tmp_path: Path, form: str = "native") -> float:
    """:func:`_ncnn_vs_simulation` of ``model`` (itself or loaded from its ONNX file, :func:`_in_form`) quantized for
    ncnn_int8 on two random batches of ``shape``, on a third."""
    data = [torch.randn(*shape) for _ in range(2)]
    gm = fxq.quantize(_in_form(model, data[0], form, tmp_path), data, "ncnn_int8", progress=False)
    return _ncnn_vs_simulation(gm, tmp_path / "m", torch.randn(*shape))


class UnfoldedTransformer(nn.Module):
    """MobileViT's block: the image cut into 2x2 patches, the batch folded with the patch position into dim 0
    (``(B * 4, H * W / 4, C)``), a pre-norm MLP with its residual, and the image put back."""

    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.conv_in, self.conv_out = nn.Conv2d(3, c, 3, padding=1), nn.Conv2d(c, c, 1)
        self.norm = nn.LayerNorm(c)
        self.fc1, self.fc2 = nn.Linear(c, 2 * c), nn.Linear(2 * c, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv_in(x)
        b, c, h, w = y.shape
        t = y.reshape(b * c * h // 2, 2, w // 2, 2).transpose(1, 2).reshape(b, c, h * w // 4, 4)
        t = t.transpose(1, 3).reshape(b * 4, h * w // 4, c)
        t = t + self.fc2(torch.nn.functional.silu(self.fc1(self.norm(t))))
        t = t.reshape(b, 4, h * w // 4, c).transpose(1, 3).reshape(b * c * h // 2, w // 2, 2, 2)
        return self.conv_out(t.transpose(1, 2).reshape(b, c, h, w))


@pytest.mark.parametrize("form", ["native", "onnx"])
def test_linear_over_a_folded_batch_keeps_its_blob_shape(tmp_path: Path, form: str) -> None:
    """The Linear's rows were reshaped back to (rows, features), not to the input's (B * 4, N, C) blob: the
    residual Add then broadcast a 2-D blob against a 3-D one and ncnn asked for tens of GB."""
    torch.manual_seed(0)
    model = UnfoldedTransformer().eval()
    assert _ncnn_cosine(model, (1, 3, 8, 8), tmp_path, form) >= 0.999


class CeilAvgPool(nn.Module):
    """ResNet-D's average-pool shortcut (timm's ``avg_down``: ``AvgPool2d(2, 2, ceil_mode=True,
    count_include_pad=False)``) and its other forms, between two convolutions."""

    def __init__(self, kernel: int, stride: int, padding: int, include_pad: bool) -> None:
        super().__init__()
        self.conv, self.conv2 = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 1)
        self.pool = nn.AvgPool2d(kernel, stride, padding, ceil_mode=True, count_include_pad=include_pad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2(self.pool(self.conv(x)))


@pytest.mark.parametrize(("kernel", "stride", "padding", "include_pad"),
                         [(2, 2, 0, False), (2, 2, 0, True), (3, 2, 1, False), (3, 2, 1, True)])
@pytest.mark.parametrize("form", ["native", "onnx"])
def test_average_pooling_in_ceil_mode(tmp_path: Path, kernel: int, stride: int, padding: int, include_pad: bool,
                                      form: str) -> None:
    """Refused before ("changes the window count at the border"). torch divides a window by its part inside the
    input (and the explicit pads, when counted), never the ceil tail: the files run at odd sizes other than the
    export's, FP32 against torch and int8 against the simulation."""
    torch.manual_seed(0)
    model: nn.Module = CeilAvgPool(kernel, stride, padding, include_pad).eval()
    data = [torch.randn(1, 3, 15, 15) for _ in range(2)]
    if form == "onnx":
        torch.onnx.export(model, (data[0],), str(tmp_path / "m.onnx"), dynamo=False, opset_version=13,
                          input_names=["x"], dynamic_axes={"x": {2: "h", 3: "w"}})
        model = fxq.load_onnx(tmp_path / "m.onnx")
    gm = fxq.quantize(model, data, "ncnn_int8", progress=False)
    for size in ((15, 15), (9, 12), (16, 16)):
        assert _ncnn_vs_simulation(gm, tmp_path / "m", torch.randn(1, 3, *size)) >= 0.9999, size


class BatchNormAct(nn.BatchNorm2d):
    """timm's ``BatchNormAct2d``: a BatchNorm subclass whose forward asserts the rank, then calls ``F.batch_norm``
    and the activation (symbolic tracing enters it: a ``getattr(x, 'ndim')`` reader beside the batch norm)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch._assert(x.ndim == 4, "expected a 4-D input")
        x = torch.nn.functional.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                                           False, 0.1, self.eps)
        return torch.relu(x)


@torch.no_grad()
def _trained_looking(bn: nn.modules.batchnorm._BatchNorm) -> None:
    """Statistics and affine terms away from the identity, so a fold that drops or misplaces them shows."""
    bn.running_mean.uniform_(-1, 1)
    bn.running_var.uniform_(0.5, 2)
    bn.weight.uniform_(0.5, 2)
    bn.bias.uniform_(-1, 1)


class ConvBnAct(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 8, 3, padding=1, bias=False), BatchNormAct(8)
        self.conv2 = nn.Conv2d(8, 4, 1)
        _trained_looking(self.bn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2(self.bn(self.conv(x)))


class AddBnAct(ConvBnAct):
    """The batch norm after a residual add (DenseNet / pre-activation style): nothing to fold it into."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return self.conv2(self.bn(y + torch.relu(y)))


@pytest.mark.parametrize("model_type", [ConvBnAct, AddBnAct])
def test_batch_norm_read_for_its_rank_too_folds(tmp_path: Path, model_type: type) -> None:
    """The rank check read the conv's output, so the conv had two users and its batch norm was not folded: an extra
    quantization point, and ncnn refused the functional batch norm ("only BatchNorm modules"), which it now
    writes where nothing folds it (after an add)."""
    torch.manual_seed(0)
    model = model_type().eval()
    data = [torch.randn(1, 3, 8, 8) for _ in range(2)]
    gm = fxq.quantize(model, data, "ncnn_int8", progress=False)
    left = [n for n in gm.graph.nodes if n.target is torch.nn.functional.batch_norm]
    assert len(left) == (model_type is AddBnAct)
    x = torch.randn(1, 3, 8, 8)
    with torch.no_grad(), fxq.fp32_mode(gm):
        torch.testing.assert_close(gm(x), model(x), atol=1e-5, rtol=1e-5)
    assert _ncnn_vs_simulation(gm, tmp_path / "m", x) >= 0.9999


class Stacked(nn.Module):
    """``torch.stack`` of two branches at ``dim`` (CoaT's and CSATv2's feature stacks), then a reduction that
    reads the stacked axis."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim
        self.a, self.b = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(3, 4, 1)
        self.out = nn.Conv2d(4, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = torch.stack([self.a(x), torch.relu(self.b(x))], dim=self.dim)
        w = torch.softmax(s, dim=self.dim)
        y = (s * w).sum(dim=self.dim)
        return self.out(y)


@pytest.mark.parametrize("dim", [0, 1, 2, 4, -1])
def test_stack(tmp_path: Path, dim: int) -> None:
    """ncnn refused ``torch.stack`` ("adds a dimension": use cat on unsqueezed tensors, in the user's model)."""
    torch.manual_seed(0)
    gm = fxq.quantize(Stacked(dim).eval(), [torch.randn(1, 3, 6, 6) for _ in range(2)], "ncnn_int8",
                      progress=False)
    assert _ncnn_vs_simulation(gm, tmp_path / "m", torch.randn(1, 3, 6, 6)) >= 0.9999


class OptionalArgs(nn.Module):
    """timm's ``VisionTransformer.forward(x, attn_mask=None, is_causal=False)``: arguments a caller leaves out."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(8, 24), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False,
                scale: float = 1.0) -> torch.Tensor:
        q, k, v = self.qkv(x).reshape(x.shape[0], x.shape[1], 3, 2, 4).permute(2, 0, 3, 1, 4).unbind(0)
        if attn_mask is not None:
            q = q + attn_mask
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal)
        return self.proj(y.transpose(1, 2).reshape(x.shape) * scale)


def test_arguments_left_out_are_captured_as_their_defaults(tmp_path: Path) -> None:
    """Traced as inputs, ``attn_mask`` / ``is_causal`` were placeholders without a tensor: every ONNX export
    failed ("input 'attn_mask' has no recorded shape"). They are now the constants the caller's call gives."""
    torch.manual_seed(0)
    model = OptionalArgs().eval()
    data = [torch.randn(2, 5, 8) for _ in range(2)]
    gm = fxq.quantize(model, data, "trt_int8", progress=False)
    assert [n.target for n in gm.graph.nodes if n.op == "placeholder"] == ["x"]
    x = torch.randn(2, 5, 8)
    with torch.no_grad(), fxq.fp32_mode(gm):
        torch.testing.assert_close(gm(x), model(x), atol=1e-5, rtol=1e-5)
    fxq.export(gm, "trt_int8", tmp_path / "m.onnx")
    with torch.no_grad():
        sim = gm(x).numpy()
    np.testing.assert_allclose(run_ort(tmp_path / "m.onnx", x, optimize=False), sim, atol=1e-4)
    got = run_ort(tmp_path / "m.onnx", x).astype(np.float64).ravel()  # its QLinearSoftmax: a code off (warned)
    assert got @ sim.ravel() / (np.linalg.norm(got) * np.linalg.norm(sim)) >= 0.999


def test_a_given_concrete_arg_leaves_no_placeholder() -> None:
    """``concrete_args={"is_causal": True}`` (a user's own): its placeholder and torch.fx's check of its value go."""
    torch.manual_seed(0)
    model = OptionalArgs().eval()
    gm = fxq.quantize(model, [torch.randn(2, 5, 8)], "trt_int8", concrete_args={"is_causal": True},
                      progress=False)
    assert [n.target for n in gm.graph.nodes if n.op == "placeholder"] == ["x"]
    assert not [n for n in gm.graph.nodes if n.target is torch._assert]
    x = torch.randn(2, 5, 8)
    with torch.no_grad(), fxq.fp32_mode(gm):
        torch.testing.assert_close(gm(x), model(x, is_causal=True), atol=1e-5, rtol=1e-5)


class LinearAttention(nn.Module):
    """EfficientViT's ReLU linear attention (timm's ``LiteMLA``): ``v`` padded with ones, so the last channel of
    ``q @ (k^T @ v)`` is the normalizer, and the output ``out[..., :-1] / (out[..., -1:] + 1e-15)``."""

    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Conv2d(3, 3 * c, 1), nn.Conv2d(c, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, _, h, w = x.shape
        q, k, v = torch.relu(self.qkv(x)).reshape(b, 3, -1, h * w).transpose(-1, -2).unbind(1)
        v = torch.nn.functional.pad(v, (0, 1), mode="constant", value=1.0)
        out = q @ (k.transpose(-1, -2) @ v)
        out = out[..., :-1] / (out[..., -1:] + 1e-15)
        return self.proj(out.transpose(-1, -2).reshape(b, -1, h, w))


@pytest.mark.parametrize("platform", ["trt_int8", "ort_int8", "ncnn_int8"])
def test_a_divisor_stays_fp32(tmp_path: Path, platform: str) -> None:
    """The normalizer's Add output was quantized: where q is all zero (ReLU), ``0 + 1e-15`` rounded to 0 and the
    simulation divided 0 by 0 (NaN) where the float model and the exported file did not."""
    torch.manual_seed(0)
    model = LinearAttention().eval()
    with torch.no_grad():
        model.qkv.bias.fill_(-0.5)  # many all-zero query rows, as in the random-init model
    data = [torch.randn(1, 3, 8, 8) for _ in range(2)]
    gm = fxq.quantize(model, data, platform, progress=False)
    div = next(n for n in gm.graph.nodes if n.meta.get("fxq") is not None and n.meta["fxq"].op_type == "Div")
    assert div.args[1].name not in div.meta["fxq"].inputs and div.args[1].meta["fxq"].output is None
    x = torch.randn(1, 3, 8, 8)
    with torch.no_grad():
        sim = gm(x).numpy()
        with fxq.fp32_mode(gm):
            ref = gm(x).numpy()
    assert np.isfinite(sim).all() and _cosine(sim, ref) > 0.99
    assert _deployed_vs_simulation(gm, platform, tmp_path, x) >= 0.999  # a ratio: a rounding tie a code apart


class GroupNorms(nn.Module):
    """The group norms timm's CPUBone / LowFormer use (nn.GroupNorm, F.group_norm, one group: LayerNorm2d-like)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.conv2, self.conv3 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 1), nn.Conv2d(8, 4, 1)
        self.gn = nn.GroupNorm(4, 8)
        self.w, self.b = nn.Parameter(torch.rand(8) + 0.5), nn.Parameter(torch.randn(8) * 0.1)
        with torch.no_grad():
            self.gn.weight.uniform_(0.5, 1.5)
            self.gn.bias.uniform_(-0.2, 0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.gn(self.conv(x)))
        y = torch.nn.functional.group_norm(self.conv2(y), 1, self.w, self.b, 1e-6)
        return self.conv3(torch.nn.functional.group_norm(y, 2))


@pytest.mark.parametrize("form", ["native", "export"])
def test_group_norm(tmp_path: Path, form: str) -> None:
    """Untyped before (``Unknown``: nothing read it, ncnn had no converter; torch.export's ``aten.group_norm``
    stayed aten): now typed ``GroupNormalization`` and written as ncnn's ``GroupNorm``."""
    torch.manual_seed(0)
    model: nn.Module = GroupNorms().eval()
    data = [torch.randn(1, 3, 8, 8) for _ in range(2)]
    gm = fxq.quantize(model, data, "ncnn_int8", progress=False, capture="export" if form == "export" else "auto")
    mods = dict(gm.named_modules())
    assert sum(op_type(n, mods) == "GroupNormalization" for n in gm.graph.nodes) == 3
    assert _ncnn_vs_simulation(gm, tmp_path / "m", torch.randn(1, 3, 8, 8)) >= 0.9999


class ExportedAttention(nn.Module):
    """Ops torch.export leaves as aten overloads the lift did not know (MobileViT / NesT / CrossViT / ConViT once
    symbolic tracing fails on their shape branches): ``unbind``, ``scaled_dot_product_attention``, ``sum`` over
    dims, ``pow`` by a scalar, ``amax``."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(8, 24), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).reshape(x.shape[0], x.shape[1], 3, 2, 4).permute(2, 0, 3, 1, 4).unbind(0)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(x.shape)
        norm = y.pow(2).sum(dim=-1, keepdim=True) + y.amax(dim=-1, keepdim=True)
        return self.proj(y) + norm


def test_aten_ops_of_exported_graphs_are_lifted(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = ExportedAttention().eval()
    data = [torch.randn(1, 5, 8) for _ in range(2)]
    gm = fxq.quantize(model, data, "trt_int8", progress=False, capture="export")
    mods = dict(gm.named_modules())
    assert gm.meta["fxq_capture"] == "export"
    assert not [n.target for n in gm.graph.nodes if n.op == "call_function" and op_type(n, mods) == "Unknown"]
    quantized = [n for n in gm.graph.nodes if n.meta.get("fxq") is not None and n.meta["fxq"].op_type == "MatMul"
                 and n.meta["fxq"].inputs]
    assert len(quantized) == 2  # the attention was decomposed: q @ k^T and p @ v run quantized
    x = torch.randn(1, 5, 8)
    fxq.export(gm, "trt_int8", tmp_path / "m.onnx")
    with torch.no_grad():
        sim = gm(x).numpy()
    assert _cosine(run_ort(tmp_path / "m.onnx", x, optimize=False), sim) >= 0.9999


class StdConv(nn.Conv2d):
    """timm's ``StdConv2d`` (BiT, ResNetV2 hybrids): the weight standardized by ``F.batch_norm(training=True)`` on
    each call, which torch.onnx cannot write (``aten::_native_batch_norm_legit``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = torch.nn.functional.batch_norm(self.weight.reshape(1, self.out_channels, -1), None, None,
                                           training=True, momentum=0.0, eps=1e-6).reshape_as(self.weight)
        return torch.nn.functional.conv2d(x, w, self.bias, self.stride, self.padding)


class StoredInputs(nn.Module):
    """A standardized conv, and a relative-position MLP run on stored coordinates (timm's ``vit_srelpos``)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = StdConv(3, 8, 3, padding=1)
        coords = torch.stack(torch.meshgrid(torch.arange(4.0), torch.arange(4.0), indexing="ij")).reshape(2, 16)
        self.register_buffer("coords", coords.T.contiguous())
        self.mlp = nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 8))
        self.out = nn.Conv2d(8, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)  # (N, 8, 4, 4)
        bias = self.mlp(self.coords).T.reshape(1, 8, 4, 4)
        return self.out(y + bias)


@pytest.mark.parametrize("platform", ["trt_int8", "ncnn_int8"])
def test_values_computed_from_stored_tensors_alone_are_stored(tmp_path: Path, platform: str) -> None:
    """torch.onnx refused the standardized weight and ncnn the MLP over constant coordinates; both are now computed
    once at preparation, as a trainable parameter (the weight) and a buffer-derived parameter of the MLP."""
    torch.manual_seed(0)
    model = StoredInputs().eval()
    data = [torch.randn(1, 3, 4, 4) for _ in range(2)]
    gm = fxq.quantize(model, data, platform, progress=False)
    stored = {n.target for n in gm.graph.nodes if n.op == "get_attr" and str(n.target).startswith("fxq_stored")}
    assert len(stored) == 2 and all(isinstance(getattr(gm, t), nn.Parameter) for t in stored)
    assert not [n for n in gm.graph.nodes if n.target is torch.nn.functional.batch_norm]
    x = torch.randn(1, 3, 4, 4)
    with torch.no_grad(), fxq.fp32_mode(gm):
        torch.testing.assert_close(gm(x), model(x), atol=1e-5, rtol=1e-5)
    assert _deployed_vs_simulation(gm, platform, tmp_path, x) >= 0.9999


class Noisy(nn.Module):
    """Random draws from stored tensors (a Gumbel gate, Poisson noise) and an in-place write into a copy."""

    def __init__(self) -> None:
        super().__init__()
        self.w, self.logits = nn.Parameter(torch.randn(4)), nn.Parameter(torch.zeros(4, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = torch.nn.functional.gumbel_softmax(self.logits, hard=True)[:, 0]
        return x * gate + torch.poisson(self.w.abs()) + self.w.clone().relu_()


class Written(nn.Module):
    """A stored state read, then written through a view (``state[:, :].copy_(x)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.state = nn.Parameter(torch.zeros(2, 4), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        prev = self.state * 1.0
        self.state[:, :].copy_(x)
        return x + prev


class Tied(nn.Module):
    """An encoder weight read again, transposed, by the decoder."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 8) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(torch.relu(torch.nn.functional.linear(x, self.w)), self.w.t())


@pytest.mark.parametrize("model_type", [Noisy, Written, Tied])
def test_what_is_not_a_stored_value(model_type: type) -> None:
    """Random draws differ run to run (two seeds tell them), a written state changes, and a tied weight stored as
    its own parameter would train apart from the original."""
    torch.manual_seed(0)
    model = model_type().eval()
    x = torch.randn(2, 8 if model_type is Tied else 4)
    gm = capture(model, (x,))
    standardize(gm)
    assert not [n for n in gm.graph.nodes if str(n.target).startswith("fxq_stored")]


def test_a_stored_parameter_leaves_no_unread_one() -> None:
    """The StdConv weight folded into a stored parameter: the original, which nothing reads any more, is gone
    (DistributedDataParallel refuses parameters that no step reads), while the conv's bias stays."""
    torch.manual_seed(0)
    gm = fxq.prepare_qat(StoredInputs(), "trt_int8", example_inputs=torch.randn(1, 3, 4, 4))
    read = {str(n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    called = {str(n.target) for n in gm.graph.nodes if n.op == "call_module"}
    unread = [name for name, _ in gm.named_parameters()
              if name not in read and not any(name.startswith(c + ".") for c in called)]
    assert unread == [] and "conv.bias" in dict(gm.named_parameters())


def test_a_norm_subclass_with_its_own_forward_is_not_typed_as_its_base() -> None:
    """timm-style ``GroupNormAct(nn.GroupNorm)`` kept whole: its activation would vanish from an ncnn GroupNorm."""

    class GroupNormAct(nn.GroupNorm):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.silu(super().forward(x))

    gm = trace(nn.Sequential(GroupNormAct(2, 4), nn.GroupNorm(2, 4)), leaf_modules=[GroupNormAct])
    mods = dict(gm.named_modules())
    assert [op_type(n, mods) for n in gm.graph.nodes if n.op == "call_module"] == ["Unknown", "GroupNormalization"]


class CrossCovariance(nn.Module):
    """XCiT's / EdgeNeXt's cross-covariance attention: q and k L2-normalized along the tokens (the last dim of
    (N, heads, C, T)), then a C x C attention."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(8, 24), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).reshape(b, t, 3, 2, 4).permute(2, 0, 3, 4, 1).unbind(0)
        q, k = torch.nn.functional.normalize(q, dim=-1), torch.nn.functional.normalize(k, dim=-1)
        attn = (q @ k.transpose(-2, -1)).softmax(dim=-1)
        return self.proj((attn @ v).permute(0, 3, 1, 2).reshape(b, t, c))


def test_l2_normalization_along_the_last_dim(tmp_path: Path) -> None:
    """ncnn's Normalize takes the channels only: refused before ("along dim -1 of a rank-4 tensor")."""
    torch.manual_seed(0)
    gm = fxq.quantize(CrossCovariance().eval(), [torch.randn(1, 6, 8) for _ in range(2)], "ncnn_int8",
                      progress=False)
    assert _ncnn_vs_simulation(gm, tmp_path / "m", torch.randn(1, 6, 8)) >= 0.9999


class CosineWindowAttention(nn.Module):
    """Swin-V2's cosine attention: the image cut into 4 windows folded into the batch (``(4 * N, tokens, C)``),
    q and k L2-normalized along their last dim, so the normalized value has no batch dim of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(8, 24), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, h, w, c = x.shape
        windows = x.reshape(b, 2, h // 2, 2, w // 2, c).permute(0, 1, 3, 2, 4, 5).reshape(4 * b, h * w // 4, c)
        q, k, v = self.qkv(windows).reshape(4 * b, h * w // 4, 3, 2, 4).permute(2, 0, 3, 1, 4).unbind(0)
        q, k = torch.nn.functional.normalize(q, dim=-1), torch.nn.functional.normalize(k, dim=-1)
        attn = (q @ k.transpose(-2, -1) * 10.0).softmax(dim=-1)
        out = self.proj((attn @ v).transpose(1, 2).reshape(4 * b, h * w // 4, c))
        return out.reshape(b, 2, 2, h // 2, w // 2, c).permute(0, 1, 3, 2, 4, 5).reshape(b, h, w, c)


def test_l2_normalization_of_a_value_with_the_batch_folded_in(tmp_path: Path) -> None:
    """Refused before: the converter asked for a batch-first value."""
    torch.manual_seed(0)
    gm = fxq.quantize(CosineWindowAttention().eval(), [torch.randn(1, 4, 4, 8) for _ in range(2)], "ncnn_int8",
                      progress=False)
    assert _ncnn_vs_simulation(gm, tmp_path / "m", torch.randn(1, 4, 4, 8)) >= 0.9999


class BuiltIndices(nn.Module):
    """ConViT's relative indices, built on every call from ``zeros`` / ``arange`` / ``repeat_interleave``, then
    read by a linear layer (ncnn has no layer for ``repeat_interleave``)."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Linear(3, 8)
        self.conv = nn.Conv2d(3, 8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ind = torch.arange(4).view(1, -1) - torch.arange(4).view(-1, 1)
        dx = ind.repeat(4, 4)
        dy = ind.repeat_interleave(4, dim=0).repeat_interleave(4, dim=1)
        rel = torch.zeros(1, 16, 16, 3)
        rel[:, :, :, 2] = dx ** 2 + dy ** 2
        rel[:, :, :, 1] = dy
        rel[:, :, :, 0] = dx
        bias = self.pos(rel).mean(dim=2).transpose(1, 2).reshape(1, 8, 4, 4)
        return self.conv(x) + bias


def test_indices_built_from_factories_are_stored(tmp_path: Path) -> None:
    """Symbolic tracing runs such calls itself (constants of the graph); torch.export, which captures ConViT (its
    shape branch stops tracing), keeps each ``arange`` / ``zeros`` as a call."""
    torch.manual_seed(0)
    model = BuiltIndices().eval()
    gm = fxq.quantize(model, [torch.randn(1, 3, 4, 4) for _ in range(2)], "ncnn_int8", progress=False,
                      capture="export")
    assert [n for n in gm.graph.nodes if str(n.target).startswith("fxq_stored")]
    assert not [n for n in gm.graph.nodes if "repeat_interleave" in str(n.target)]
    x = torch.randn(1, 3, 4, 4)
    with torch.no_grad(), fxq.fp32_mode(gm):
        torch.testing.assert_close(gm(x), model(x), atol=1e-5, rtol=1e-5)
    assert _ncnn_vs_simulation(gm, tmp_path / "m", x) >= 0.9999


class LinearNorm(nn.Module):
    """LeViT's ``LinearNorm``: a BatchNorm1d over the rows of a linear layer's output, ``(N * T, C)``."""

    def __init__(self, bias: bool = False) -> None:
        super().__init__()
        self.linear, self.bn = nn.Linear(8, 16, bias=bias), nn.BatchNorm1d(16)
        self.out = nn.Linear(16, 4)
        _trained_looking(self.bn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        return self.out(torch.relu(self.bn(y.flatten(0, 1)).reshape_as(y)))


@pytest.mark.parametrize("platform", ["trt_int8", "ncnn_int8"])
@pytest.mark.parametrize(("form", "bias"), [("native", False), ("onnx", False), ("onnx", True)])
def test_batch_norm_over_a_linear_layers_rows_folds(tmp_path: Path, platform: str, form: str, bias: bool) -> None:
    """Left unfolded before: one more quantization point on trt_int8, and ncnn refused a BatchNorm whose input has
    no batch dim (the batch folded into the rows). In the ONNX form the linear's output is also read by a
    ``Shape`` node (``reshape_as``), which reads no values, and a bias comes as an ``Add`` after the ``MatMul``."""
    torch.manual_seed(0)
    model = LinearNorm(bias).eval()
    source = _in_form(model, torch.randn(1, 5, 8), form, tmp_path)
    gm = fxq.quantize(source, [torch.randn(1, 5, 8) for _ in range(2)], platform, progress=False)
    assert len([n for n in gm.graph.nodes if n.meta.get("folded_bn")]) == 1
    assert "BatchNormalization" not in {op_type(n, dict(gm.named_modules())) for n in gm.graph.nodes}
    x = torch.randn(1, 5, 8)
    with torch.no_grad(), fxq.fp32_mode(gm):
        torch.testing.assert_close(gm(x), model(x), atol=1e-5, rtol=1e-5)
    assert _deployed_vs_simulation(gm, platform, tmp_path, x) >= 0.9999


@pytest.mark.parametrize("groups", [1, 2])
def test_group_norm_as_torch_onnx_writes_it(tmp_path: Path, groups: int) -> None:
    """torch.onnx writes GroupNorm as Reshape to (N, groups, -1), InstanceNormalization, Reshape back, Mul, Add
    (PoolFormer's one-group norm): ncnn refused the 3-D InstanceNormalization."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.gn, self.out = nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(groups, 8), nn.Conv2d(8, 4, 1)
            with torch.no_grad():
                self.gn.weight.uniform_(0.5, 1.5)
                self.gn.bias.uniform_(-0.2, 0.2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(torch.relu(self.gn(self.conv(x))))

    torch.manual_seed(0)
    data = [torch.randn(1, 3, 8, 8) for _ in range(2)]
    torch.onnx.export(Net().eval(), (data[0],), str(tmp_path / "m.onnx"), dynamo=False, opset_version=17)
    gm = fxq.quantize(fxq.load_onnx(tmp_path / "m.onnx"), data, "ncnn_int8", progress=False)
    assert _ncnn_vs_simulation(gm, tmp_path / "m", torch.randn(1, 3, 8, 8)) >= 0.9999


class VarArgs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, *extra: torch.Tensor, scale: float = 2.0) -> torch.Tensor:
        return self.lin(x) * scale + sum(extra)


class Flag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, use_relu: bool) -> torch.Tensor:
        return torch.relu(self.lin(x)) if use_relu else self.lin(x)


def test_defaults_after_var_args_and_concrete_args_the_batches_pass(tmp_path: Path) -> None:
    """torch.fx puts ``*args`` last among its placeholders, Python's signature before the keyword-only ones; and a
    concrete arg that the batches still pass stays an input (the batches call the model as before)."""
    torch.manual_seed(0)
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    model: nn.Module = VarArgs().eval()
    gm = fxq.quantize(model, [(x, y)], "trt_int8", progress=False)
    assert len([n for n in gm.graph.nodes if n.op == "placeholder"]) == 2
    with torch.no_grad(), fxq.fp32_mode(gm):
        torch.testing.assert_close(gm(x, y), model(x, y), atol=1e-5, rtol=1e-5)
    fxq.export(gm, "trt_int8", tmp_path / "m.onnx")
    gm = fxq.quantize(model, [(x,)], "trt_int8", progress=False)  # ``*extra`` left empty: no input
    fxq.export(gm, "trt_int8", tmp_path / "m.onnx")
    model = Flag().eval()
    gm = fxq.quantize(model, [(x, True)], "trt_int8", concrete_args={"use_relu": True}, progress=False)
    with torch.no_grad(), fxq.fp32_mode(gm):
        torch.testing.assert_close(gm(x, True), model(x, True), atol=1e-5, rtol=1e-5)


class GatedGelu(nn.Module):
    """MambaOut's gated block: a split, the exact GELU of one piece, times the other."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, i = torch.split(self.fc1(x), [8, 8], dim=-1)
        return self.fc2(torch.nn.functional.gelu(g) * i)


def test_an_erf_gelu_of_a_split_output(tmp_path: Path) -> None:
    """torch.onnx writes the GELU as x * 0.5 * (1 + erf(x / sqrt 2)); onnx2torch reads the Split's output once per
    reader, so the pattern's two x's were different getitem nodes and ncnn met an Erf it has no layer for."""
    torch.manual_seed(0)
    x = torch.randn(1, 5, 8)
    torch.onnx.export(GatedGelu().eval(), (x,), str(tmp_path / "m.onnx"), dynamo=False, opset_version=17)
    gm = fxq.quantize(fxq.load_onnx(tmp_path / "m.onnx"), [x, torch.randn(1, 5, 8)], "ncnn_int8", progress=False)
    assert _ncnn_vs_simulation(gm, tmp_path / "m", torch.randn(1, 5, 8)) >= 0.9999


class SamePoolStem(nn.Module):
    """BiT's stem (timm's ``create_pool2d('max', padding='same')``): ``F.pad(x, (0, 1, 0, 1), value=-inf)``, then
    an unpadded max pool."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.out = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.pad(torch.relu(self.conv(x)), (0, 1, 0, 1), value=-float("inf"))
        return self.out(torch.nn.functional.max_pool2d(y, 3, 2))


@pytest.mark.parametrize("form", ["native", "onnx"])
@pytest.mark.parametrize("platform", ["ncnn_int8", "trt_int8", "ort_int8"])
def test_an_infinite_padding_value(tmp_path: Path, platform: str, form: str) -> None:
    """The ncnn writer wrote ``5=-inf``; ncnn reads digits only and refused the whole file. And a pad of ``-inf``
    stays passive: given a quantizer of its own (as a finite constant is), its range was infinite and calibration
    failed (NASNet, PNASNet)."""
    torch.manual_seed(0)
    data = [torch.randn(1, 3, 8, 8) for _ in range(2)]
    gm = fxq.quantize(_in_form(SamePoolStem().eval(), data[0], form, tmp_path), data, platform, progress=False)
    assert _deployed_vs_simulation(gm, platform, tmp_path, torch.randn(1, 3, 8, 8)) >= 0.9999


@pytest.mark.parametrize("platform", ["trt_int8", "ort_int8"])
def test_padding_with_ones_gets_its_own_grid(tmp_path: Path, platform: str) -> None:
    """EfficientViT pads v with ones (``F.pad(v, (0, 1), value=1.0)``), the normalizer's column. Passive, the pad
    kept v's grid: the simulation carried exact ones where the file rounded them into v's range (|v| < 0.2 here),
    and the MatMul after it differed by up to 117 codes (cosine 0.889 on EfficientViT-B0)."""
    torch.manual_seed(0)
    model = LinearAttention().eval()
    with torch.no_grad():
        model.qkv.weight.mul_(0.1)
        model.qkv.bias.fill_(0.01)
    data = [torch.randn(1, 3, 8, 8) for _ in range(2)]
    gm = fxq.quantize(model, data, platform, progress=False)
    pad = next(n for n in gm.graph.nodes if n.meta.get("fxq") is not None and n.meta["fxq"].op_type == "Pad")
    assert pad.meta["fxq"].output_state.name == "ACTIVATED"
    assert _deployed_vs_simulation(gm, platform, tmp_path, torch.randn(1, 3, 8, 8)) >= 0.999


class SimpleNorm(nn.Module):
    """timm's ``SimpleNorm`` (ConvNeXt-RMS, MobileNetV5): channels-last ``x * rsqrt(x.var(-1) + eps) * w``, and
    the other spellings of a variance: ``torch.std`` with ``correction``, ``torch.var`` over two dims unbiased."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.conv, self.out, self.form = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 4, 1), form
        self.weight = nn.Parameter(torch.rand(8) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x).permute(0, 2, 3, 1)
        if self.form == "var":
            y = y * torch.rsqrt(y.var(-1, keepdim=True) + 1e-6) * self.weight
        elif self.form == "std":
            y = (y - y.mean(-1, keepdim=True)) / (torch.std(y, dim=-1, keepdim=True, correction=0) + 1e-6)
        else:
            y = y * torch.rsqrt(torch.var(y, dim=(1, 2), unbiased=True, keepdim=True) + 1e-6) * self.weight
        return self.out(y.permute(0, 3, 1, 2))


@pytest.mark.parametrize("capture_with", ["fx", "export"])
@pytest.mark.parametrize("form", ["var", "std", "two_dims"])
def test_variance_and_rsqrt_in_ncnn(tmp_path: Path, form: str, capture_with: str) -> None:
    """ncnn refused ``var`` and ``rsqrt`` (untyped ops): they are now a mean of squared deviations scaled by
    ``n / (n - correction)`` and ncnn's rsqrt UnaryOp; torch.export's ``aten.var.correction`` / ``rsqrt`` lift."""
    torch.manual_seed(0)
    model = SimpleNorm(form).eval()
    gm = fxq.quantize(model, [torch.randn(1, 3, 6, 6) for _ in range(2)], "ncnn_int8", progress=False,
                      capture=capture_with)
    mods = dict(gm.named_modules())
    assert {"Var" if form != "std" else "Std"} <= {op_type(n, mods) for n in gm.graph.nodes}
    assert _ncnn_vs_simulation(gm, tmp_path / "m", torch.randn(1, 3, 6, 6)) >= 0.9999


class NegativePad(nn.Module):
    """NASNet's factorized reduction: ``F.pad(x, (-1, 0, -1, 0))`` drops the first row and column (here with
    another side padded too)."""

    def __init__(self, pads: tuple[int, ...]) -> None:
        super().__init__()
        self.conv, self.out, self.pads = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 4, 1), pads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(torch.nn.functional.pad(self.conv(x), self.pads)))


@pytest.mark.parametrize("form", ["native", "onnx"])
@pytest.mark.parametrize("pads", [(-1, 0, -1, 0), (1, -2, 0, 1), (0, 1, -1, -1)])
def test_negative_padding_crops_in_ncnn(tmp_path: Path, pads: tuple[int, ...], form: str) -> None:
    torch.manual_seed(0)
    model = NegativePad(pads).eval()
    assert _ncnn_cosine(model, (1, 3, 7, 7), tmp_path, form) >= 0.9999


class StridedRows(nn.Module):
    """LeViT's subsampling attention: ``x.view(B, res, res, C)[:, ::2, ::2]`` at res 7, a step that does not divide
    the rows (and other starts and steps)."""

    def __init__(self, index: tuple[slice, ...]) -> None:
        super().__init__()
        self.fc, self.out, self.index = nn.Linear(4, 8), nn.Linear(8, 4), index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.fc(x))[self.index])


@pytest.mark.parametrize("form", ["native", "onnx"])
@pytest.mark.parametrize("index", [
    (slice(None), slice(None, None, 2), slice(None, None, 2)),  # 7 -> 4 (the last row alone)
    (slice(None), slice(1, None, 3), slice(0, 5, 2)),  # 7 -> 2 rows (1, 4), 3 columns of the first 5
    (slice(None), slice(None, None, 3), slice(None)),  # 7 -> 3 (0, 3, 6)
    (slice(None), slice(2, 7, 4), slice(None, None, 7)),  # 7 -> 2 (2, 6), one column
], ids=["levit", "start", "three", "one"])
def test_a_step_that_does_not_divide_the_rows(tmp_path: Path, index: tuple[slice, ...], form: str) -> None:
    """Refused before: ncnn's strided slice was a Reshape that splits the dim, which needs the step to divide it."""
    torch.manual_seed(0)
    model = StridedRows(index).eval()
    assert _ncnn_cosine(model, (1, 7, 7, 4), tmp_path, form) >= 0.9999


class GlobalQuery(nn.Module):
    """GCViT's global query, one window's worth per image, repeated once per window of the image folded into the
    batch (``q.repeat_interleave(windows, dim=0)``); and grouped-query attention's keys and values repeated per
    head group (``k.repeat_interleave(2, dim=1)``), a dim larger than 1."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.kv, self.proj = nn.Linear(8, 16), nn.Linear(8, 8), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, h, w, c = x.shape
        windows = x.reshape(b, 2, h // 2, 2, w // 2, c).permute(0, 1, 3, 2, 4, 5).reshape(4 * b, h * w // 4, c)
        q = self.q(x[:, :h // 2, :w // 2])  # (N, h / 2, w / 2, 16)
        q = q.repeat_interleave(4 * b // q.shape[0], dim=0).reshape(4 * b, h * w // 4, 4, 4).transpose(1, 2)
        kv = self.kv(windows).reshape(4 * b, h * w // 4, 2, 4).transpose(1, 2).repeat_interleave(2, dim=1)
        attn = (q @ kv.transpose(-2, -1)).softmax(dim=-1)  # (windows, 4 heads, tokens, tokens)
        out = self.proj((attn @ kv).transpose(1, 2).reshape(4 * b, h * w // 4, 16))
        return out.reshape(b, 2, 2, h // 2, w // 2, c).permute(0, 1, 3, 2, 4, 5).reshape(b, h, w, c)


@pytest.mark.parametrize("form", ["native", "onnx"])
def test_repeat_interleave_in_ncnn(tmp_path: Path, form: str) -> None:
    """ncnn refused ``repeat_interleave`` (an untyped op): of a batch of 1 it is a ``Tile`` whose copies are the
    windows folded into the batch, of a larger dim a ``Tile`` of a new axis after it, merged back."""
    torch.manual_seed(0)
    assert _ncnn_cosine(GlobalQuery().eval(), (1, 4, 4, 8), tmp_path, form) >= 0.9999


class MultiQueryAttention(nn.Module):
    """MobileNetV5's multi-query attention: 4 query heads against one key / value head, broadcast by the MatMuls
    (``(N, 4, T, d) @ (N, 1, d, T)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.kv, self.proj = nn.Linear(8, 16), nn.Linear(8, 8), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, _ = x.shape
        q = self.q(x).reshape(n, t, 4, 4).transpose(1, 2)
        k, v = self.kv(x).reshape(n, t, 2, 1, 4).permute(2, 0, 3, 1, 4).unbind(0)  # (N, 1, T, 4) each
        attn = (q @ k.transpose(-2, -1)).softmax(dim=-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(n, t, 16))


@pytest.mark.parametrize("form", ["native", "onnx"])
def test_matmul_broadcasting_a_head_in_ncnn(tmp_path: Path, form: str) -> None:
    """Refused before ("not two equally batched matrices"): ncnn's MatMul broadcasts outer dims of size 1."""
    torch.manual_seed(0)
    assert _ncnn_cosine(MultiQueryAttention().eval(), (1, 6, 8), tmp_path, form) >= 0.9999


class InplacePositionMLP(nn.Module):
    """timm's Swin-V2 continuous position bias: an MLP with ``nn.ReLU(inplace=True)`` over stored coordinates, an
    in-place scale of its output, gathered by a stored index (torch.fx records a plain tensor attribute as a
    ``_tensor_constant``). ``ends``: the MLP ends in a Linear, or in the in-place ReLU (a chain of two in-place
    ops), or the ReLU's value is read again after the scale (the chain is not the ops' own)."""

    def __init__(self, ends: str = "linear") -> None:
        super().__init__()
        self.conv, self.ends = nn.Conv2d(3, 2, 3, padding=1), ends
        layers = [nn.Linear(2, 8), nn.ReLU(inplace=True), nn.Linear(8, 2)]
        self.mlp = nn.Sequential(*(layers if ends == "linear" else [nn.Linear(2, 2), nn.ReLU(inplace=True)]))
        self.register_buffer("coords", torch.linspace(-1, 1, 18).reshape(9, 2))
        self.index = torch.arange(16) % 9

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.mlp(self.coords)
        bias = hidden.mul_(2.0)
        if self.ends == "shared":
            bias = bias + hidden
        return self.conv(x) + bias[self.index].T.reshape(1, 2, 4, 4)


@pytest.mark.parametrize("platform", ["trt_int8", "ncnn_int8"])
@pytest.mark.parametrize("ends", ["linear", "relu", "shared"])
def test_in_place_ops_on_their_own_values_are_folded(tmp_path: Path, platform: str, ends: str) -> None:
    """The in-place ReLU (and the scale) marked the Linear's output as written, so the MLP stayed a computation of
    the graph, quantized each call; ncnn refused its gather by a stored index. A chain of in-place ops folds whole:
    folded up to its first op only, the rest wrote into the stored value on every call."""
    torch.manual_seed(0)
    model = InplacePositionMLP(ends).eval()
    data = [torch.randn(1, 3, 4, 4) for _ in range(2)]
    gm = fxq.quantize(model, data, platform, progress=False)
    folded = not [n for n in gm.graph.nodes if n.op == "call_module" and "mlp" in str(n.target)]
    assert folded == (ends != "shared")
    x = torch.randn(1, 3, 4, 4)
    with torch.no_grad(), fxq.fp32_mode(gm):
        for _ in range(3):  # each in-place op ran once, and nothing stored is written
            torch.testing.assert_close(gm(x), model(x), atol=1e-5, rtol=1e-5)
    if ends == "linear":
        assert _deployed_vs_simulation(gm, platform, tmp_path, x) >= 0.9999


class WindowConvs(nn.Module):
    """EfficientViT-M's local window attention: the image cut into 4 windows folded into the batch, then
    convolutions of each window: a 1x1, a depthwise 5x5 (padding 2) and a strided 3x3; the windows put back."""

    def __init__(self) -> None:
        super().__init__()
        self.conv_in, self.out = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 4, 1)
        self.qkv, self.dw = nn.Conv2d(8, 8, 1), nn.Conv2d(8, 8, 5, padding=2, groups=8)
        self.down = nn.Conv2d(8, 8, 3, stride=2, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv_in(x)
        b, c, h, w = y.shape
        windows = y.reshape(b, c, 2, h // 2, 2, w // 2).permute(0, 2, 4, 1, 3, 5).reshape(4 * b, c, h // 2, w // 2)
        z = self.down(torch.relu(self.dw(self.qkv(windows))))  # (4 * N, C, h / 4, w / 4)
        z = z.reshape(b, 2, 2, c, h // 4, w // 4).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h // 2, w // 2)
        return self.out(z)


@pytest.mark.parametrize("form", ["native", "onnx"])
def test_convolutions_of_windows_folded_into_the_batch(tmp_path: Path, form: str) -> None:
    """Refused before ("needs a batch-first value"): each window is padded on its own, the windows stacked along
    the rows of one blob, convolved int8, and each window's rows cropped back out."""
    torch.manual_seed(0)
    data = [torch.randn(1, 3, 8, 8) for _ in range(2)]
    gm = fxq.quantize(_in_form(WindowConvs().eval(), data[0], form, tmp_path), data, "ncnn_int8", progress=False)
    assert _ncnn_vs_simulation(gm, tmp_path / "m", torch.randn(1, 3, 8, 8)) >= 0.9999
    table = Path(fxq.export(gm, "ncnn_int8", tmp_path / "n")[2]).read_text().splitlines()
    assert len([ln for ln in table if "_param_0 " in ln]) == 5  # all 5 convolutions int8 (weight scales)


class RelativePositionEinsum(nn.Module):
    """SAM's / MViT-v2's decomposed relative positions: the query times a table gathered per query row, an einsum
    whose second operand carries only the last batch subscript (``"bhwc,hkc->bhwk"``; MViT's has heads too:
    ``"byhwc,hkc->byhwk"``), and per query column, indexed by the output's row dim (``"bhwc,wkc->bhwk"``)."""

    def __init__(self, heads: int) -> None:
        super().__init__()
        self.q, self.out, self.heads = nn.Linear(8, 8 * heads), nn.Linear(4 * heads, 8), heads
        self.rel_pos = nn.Parameter(torch.randn(7, 8) * 0.5)
        self.register_buffer("index", torch.arange(4)[:, None] - torch.arange(4)[None, :] + 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, h, w, _ = x.shape
        table = self.rel_pos[self.index]  # (h, k, c), from stored tensors alone
        q = self.q(x)
        if self.heads == 1:
            rel = torch.einsum("bhwc,hkc->bhwk", q, table) + torch.einsum("bhwc,wkc->bhwk", q, table)
        else:
            q = q.reshape(n, h, w, self.heads, 8).permute(0, 3, 1, 2, 4)
            rel = torch.einsum("byhwc,hkc->byhwk", q, table) + torch.einsum("byhwc,wkc->byhwk", q, table)
            rel = rel.permute(0, 2, 3, 1, 4)
        return self.out(rel.reshape(n, h, w, -1))


@pytest.mark.parametrize("form", ["native", "onnx"])
@pytest.mark.parametrize("heads", [1, 2])
def test_an_einsum_by_a_table_broadcast_over_the_batch(tmp_path: Path, heads: int, form: str) -> None:
    """Refused before ("not a batched matrix product"): the table is a stored tensor, laid out like the query with
    leading dims of 1, which ncnn's MatMul broadcasts; per column, the query is permuted to put the columns first,
    and the product back."""
    torch.manual_seed(0)
    assert _ncnn_cosine(RelativePositionEinsum(heads).eval(), (1, 4, 4, 8), tmp_path, form) >= 0.9999


class BatchAsMatrixDimEinsum(nn.Module):
    """An einsum whose computed operand has its batch dim among the product's two matrix dims: a linear layer
    written as ``"bc,kc->bk"``, a ``(n, batch, c)`` value times a stored matrix (``"nbc,ck->nbk"``, its result
    put back batch-first), or a ``(batch, c)`` value times a stored ``(h, c, k)`` table. ``followed``: the same model
    written as the refusal's fix says."""

    def __init__(self, form: str, followed: bool) -> None:
        super().__init__()
        self.lin, self.form, self.followed = nn.Linear(8, 8), form, followed
        self.w = nn.Parameter({"linear": torch.randn(5, 8), "table": torch.randn(3, 8, 5)}.get(form, torch.randn(8, 5)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if self.form == "linear":
            return y @ self.w.T if self.followed else torch.einsum("bc,kc->bk", y, self.w)
        if self.form == "table":  # a (batch, c) value times a stored (h, c, k) table
            if self.followed:
                return (y[:, None, None] @ self.w[None]).squeeze(2)
            return torch.einsum("bc,hck->hbk", y, self.w).permute(1, 0, 2)
        if self.followed:
            return torch.einsum("bnc,ck->bnk", y, self.w)
        return torch.einsum("nbc,ck->nbk", y.permute(1, 0, 2), self.w).permute(1, 0, 2)


@pytest.mark.parametrize("form, fix", [("linear", "x @ w"), ("rows", "permute the operand so its batch dim leads"),
                                       ("table", "(x[:, None, None] @ w[None]).squeeze(2)")])
def test_an_einsum_with_the_batch_as_a_matrix_dim_is_refused_with_a_fix_that_works(tmp_path: Path, form: str,
                                                                                    fix: str) -> None:
    """The refusal named the constant's layout before ("store the constant with the tensor's rank"), which no
    stored tensor satisfies, or, for a rank-2 operand, "the batch outside the last two dims"; now it names the batch
    subscript and a rewrite, which exports and matches the simulation."""
    torch.manual_seed(0)
    shape = (2, 4, 8) if form == "rows" else (2, 8)
    data = [torch.randn(*shape) for _ in range(2)]
    gm = fxq.quantize(BatchAsMatrixDimEinsum(form, followed=False).eval(), data, "ncnn_int8", progress=False)
    with pytest.raises(fxq.ExportError, match=r"batch dim of operand .*subscript 'b'.*" + re.escape(fix)):
        fxq.export(gm, "ncnn_int8", tmp_path / "refused")
    assert _ncnn_cosine(BatchAsMatrixDimEinsum(form, followed=True).eval(), shape, tmp_path) >= 0.9999


class MaskUnitPooling(nn.Module):
    """Hiera's mask-unit attention: queries pooled over the query stride of a 6-D view,
    ``q.view(B, heads, stride, tokens, units, d).amax(dim=2)`` (or a mean)."""

    def __init__(self, reduce: str) -> None:
        super().__init__()
        self.fc, self.out, self.reduce = nn.Linear(8, 8), nn.Linear(8, 8), reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x).view(x.shape[0], 2, 2, 4, 2, 4)
        if self.reduce == "all":  # every dim besides the batch: ncnn's reduce_all
            return self.out(x * y.mean(dim=(1, 2, 3, 4, 5)).reshape(-1, 1, 1))
        y = y.amax(dim=2) if self.reduce == "max" else y.mean(dim=(2, 3), keepdim=True)
        return self.out(y.reshape(x.shape[0], -1, 8))


@pytest.mark.parametrize("form", ["native", "onnx"])
@pytest.mark.parametrize("reduce", ["max", "mean", "all"])
def test_a_reduction_of_more_than_four_dims(tmp_path: Path, reduce: str, form: str) -> None:
    """Refused before ("only reshapes and permutes of such values are exported"); over every dim besides the batch
    it is a reduce_all, whatever the layout."""
    torch.manual_seed(0)
    assert _ncnn_cosine(MaskUnitPooling(reduce).eval(), (1, 16, 8), tmp_path, form) >= 0.9999


class WindowLinear(nn.Module):
    """Twins' locally-grouped attention: a Linear over the channels of the image viewed as windows,
    ``(N, rows, cols, h, w, C)``, a value of 5 dims besides the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.qkv, self.out = nn.Conv2d(3, 8, 3, padding=1), nn.Linear(8, 12), nn.Linear(12, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x).permute(0, 2, 3, 1)  # (N, H, W, C)
        n, h, w, c = y.shape
        windows = y.reshape(n, 2, h // 2, 2, w // 2, c).transpose(2, 3)
        z = torch.relu(self.qkv(windows))  # (N, 2, 2, h / 2, w / 2, 12)
        return self.out(z.transpose(2, 3).reshape(n, h, w, 12))


@pytest.mark.parametrize("form", ["native", "onnx"])
def test_a_linear_layer_over_more_than_four_dims(tmp_path: Path, form: str) -> None:
    """Refused before ("has 5 dims besides the batch"): a Linear maps the last dim alone, so the value is its rows."""
    torch.manual_seed(0)
    assert _ncnn_cosine(WindowLinear().eval(), (1, 3, 4, 4), tmp_path, form) >= 0.9999


class HaloWindows(nn.Module):
    """HaloNet's keys and values: each block's window with a halo, ``F.pad(x, halo).unfold(2, win, block)
    .unfold(3, win, block)``, then attention of each block's pixels over its window."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.kv, self.out = nn.Conv2d(3, 8, 1), nn.Conv2d(3, 8, 1), nn.Conv2d(8, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, _, h, w = x.shape  # blocks of 2 x 2, windows of 4 x 4
        kv = torch.nn.functional.pad(self.kv(x), [1, 1, 1, 1]).unfold(2, 4, 2).unfold(3, 4, 2)
        kv = kv.reshape(n, 8, h // 2 * w // 2, 16).permute(0, 2, 3, 1)  # (N, blocks, 16, C)
        q = self.q(x).reshape(n, 8, h // 2, 2, w // 2, 2).permute(0, 2, 4, 3, 5, 1).reshape(n, h // 2 * w // 2, 4, 8)
        attn = (q @ kv.transpose(-2, -1)).softmax(dim=-1)  # (N, blocks, 4, 16)
        y = (attn @ kv).reshape(n, h // 2, w // 2, 2, 2, 8).permute(0, 5, 1, 3, 2, 4).reshape(n, 8, h, w)
        return self.out(y)


@pytest.mark.parametrize("platform", ["trt_int8", "ort_int8"])
def test_unfold_after_a_pad_exports(tmp_path: Path, platform: str) -> None:
    """torch.onnx refused ``unfold`` ("input size not accessible"): the export's name mark on the pad gave the pad's
    value a type without sizes (torch.onnx knows no shape past that Pad). The marks now carry the sizes fxq runs."""
    torch.manual_seed(0)
    data = [torch.randn(1, 3, 4, 4) for _ in range(2)]
    gm = fxq.quantize(HaloWindows().eval(), data, platform, progress=False)
    assert _deployed_vs_simulation(gm, platform, tmp_path, torch.randn(1, 3, 4, 4)) >= 0.9999


def test_unfold_after_a_pad_in_ncnn(tmp_path: Path) -> None:
    """ncnn refused ``unfold`` (an untyped op): windows that overlap are each a Crop moved last, joined by a
    Concat."""
    torch.manual_seed(0)
    assert _ncnn_cosine(HaloWindows().eval(), (1, 3, 4, 4), tmp_path) >= 0.9999


class PixelEmbed(nn.Module):
    """TNT's pixel embedding: ``nn.Unfold(kernel_size=4, stride=4)`` of the image into 4 x 4 blocks (as channels,
    one column per block), and non-overlapping ``x.unfold(-1, 2, 2)`` windows of its rows."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.fc = nn.Conv2d(3, 4, 3, padding=1), nn.Linear(64, 8)
        self.unfold = nn.Unfold(kernel_size=4, stride=4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        blocks = self.unfold(self.conv(x)).transpose(1, 2)  # (N, blocks, 4 * 4 * 4)
        pairs = blocks.unfold(-1, 2, 2)  # (N, blocks, 32, 2)
        return self.fc(blocks + pairs.flip(-1).reshape(blocks.shape))


def test_unfold_of_blocks_that_tile_the_image_in_ncnn(tmp_path: Path) -> None:
    torch.manual_seed(0)
    assert _ncnn_cosine(PixelEmbed().eval(), (1, 3, 8, 8), tmp_path) >= 0.9999


class TanhGelu(nn.Module):
    """MobileNetV5's activation: ``F.gelu(approximate="tanh")``, which torch.onnx writes before opset 20 as
    ``0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x * x * x)))``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.out = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.nn.functional.gelu(self.conv(x), approximate="tanh"))


def test_the_add_inside_a_spelled_out_tanh_gelu_is_no_residual(tmp_path: Path) -> None:
    """The TensorRT check refused the file: the Add of x and 0.044715 * x^3 has one dequantized input, and was
    taken for a residual Add whose other input lacks Q/DQ."""
    torch.manual_seed(0)
    data = [torch.randn(1, 3, 8, 8) for _ in range(2)]
    gm = fxq.quantize(TanhGelu().eval(), data, "trt_int8", progress=False)
    assert _deployed_vs_simulation(gm, "trt_int8", tmp_path, torch.randn(1, 3, 8, 8)) >= 0.9999


class PoolToSeven(nn.Module):
    """CSATv2's ``nn.AdaptiveAvgPool2d((7, 7))`` of a map 7 does not divide (here 10 x 12), and the functional
    form to a size larger than the input along one dim."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.pool, self.out = nn.Conv2d(3, 8, 3, padding=1), nn.AdaptiveAvgPool2d((7, 7)), nn.Conv2d(8, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.out(torch.relu(self.pool(self.conv(x))))  # (N, 4, 7, 7)
        return torch.nn.functional.adaptive_avg_pool2d(y, (3, 9))


@pytest.mark.parametrize("platform", ["trt_int8", "ort_int8"])
def test_adaptive_pooling_to_a_size_that_does_not_divide(tmp_path: Path, platform: str) -> None:
    """torch.onnx refused it ("output size that are not factor of input size"): the export writes the mean of each
    window's rows, then of its columns."""
    torch.manual_seed(0)
    data = [torch.randn(1, 3, 10, 12) for _ in range(2)]
    gm = fxq.quantize(PoolToSeven().eval(), data, platform, progress=False)
    assert _deployed_vs_simulation(gm, platform, tmp_path, torch.randn(1, 3, 10, 12)) >= 0.9999


class DecomposedRelPosAttention(nn.Module):
    """SAM's attention with decomposed relative positions: the scores viewed as ``(B * heads, h, w, h, w)`` plus
    the row and column terms broadcast along the key columns / rows, values of 5 dims besides the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(8, 24), nn.Linear(8, 8)
        self.rel_pos = nn.Parameter(torch.randn(7, 4) * 0.5)
        self.register_buffer("index", torch.arange(4)[:, None] - torch.arange(4)[None, :] + 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, h, w, _ = x.shape
        q, k, v = self.qkv(x).reshape(n, h * w, 3, 2, 4).permute(2, 0, 3, 1, 4).reshape(3, n * 2, h * w, 4).unbind(0)
        table = self.rel_pos[self.index]  # (4, 4, 4): (h or w, keys, c)
        r_q = q.reshape(n * 2, h, w, 4)
        rel_h = torch.einsum("bhwc,hkc->bhwk", r_q, table)
        rel_w = torch.einsum("bhwc,wkc->bhwk", r_q, table)
        attn = (q @ k.transpose(-2, -1)).view(n * 2, h, w, h, w) + rel_h[:, :, :, :, None] + rel_w[:, :, :, None, :]
        attn = attn.view(n * 2, h * w, h * w).softmax(dim=-1)
        out = (attn @ v).view(n, 2, h, w, 4).permute(0, 2, 3, 1, 4).reshape(n, h, w, 8)
        return self.proj(out)


@pytest.mark.parametrize("form", ["native", "onnx"])
def test_a_broadcast_add_of_more_than_four_dims(tmp_path: Path, form: str) -> None:
    """Refused before (an Add of values of more than 4 dims): both are stored with their outer dims merged, which
    they share, so ncnn's BinaryOp broadcasts their last three dims as torch does."""
    torch.manual_seed(0)
    assert _ncnn_cosine(DecomposedRelPosAttention().eval(), (1, 4, 4, 8), tmp_path, form) >= 0.9999


def test_a_fill_value_held_by_an_onnx_pad_module(tmp_path: Path) -> None:
    """An old file's ``Pad`` (opset 9: pads and value as attributes) is fxq's ``OnnxPad`` module, which holds the
    fill as ``value``; preparation read onnx2torch's ``constant_value`` only and left the ones passive."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal((4, 3, 1, 1)) * 0.1).astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal((4, 4, 1, 1)).astype(np.float32), "w2")]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"]),
             helper.make_node("Pad", ["c"], ["p"], pads=[0, 0, 0, 0, 0, 0, 0, 1], value=1.0, mode="constant"),
             helper.make_node("Conv", ["p", "w2"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 4, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 4, 5])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 9)])
    model.ir_version = 8
    onnx.save(model, tmp_path / "old.onnx")
    gm = fxq.quantize(fxq.load_onnx(tmp_path / "old.onnx"), [torch.randn(1, 3, 4, 4) for _ in range(2)], "trt_int8",
                      progress=False)
    pad = next(n for n in gm.graph.nodes if n.meta.get("fxq") is not None and n.meta["fxq"].op_type == "Pad")
    assert pad.meta["fxq"].output_state.name == "ACTIVATED"
    assert _deployed_vs_simulation(gm, "trt_int8", tmp_path, torch.randn(1, 3, 4, 4)) >= 0.9999


class OutlookFold(nn.Module):
    """VOLO's outlook attention in small: values unfolded into 3x3 windows, weighted, and folded back to the input's
    own ``(H, W)``, read from the input at run time (torch 2.14's ``col2im`` symbolic needs a constant size)."""

    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.v, self.attn, self.proj = nn.Conv2d(3, c, 1), nn.Conv2d(3, 9, 1), nn.Conv2d(c, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, _, h, w = x.shape
        v = nn.functional.unfold(self.v(x), 3, padding=1).reshape(n, -1, 9, h * w)
        a = self.attn(x).softmax(dim=1).reshape(n, 1, 9, h * w)
        out = nn.functional.fold((v * a).reshape(n, -1, h * w), output_size=(h, w), kernel_size=3, padding=1)
        return self.proj(out)


@pytest.mark.parametrize("platform", ["trt_int8", "ort_int8"])
def test_fold_to_a_size_read_at_run_time_exports(platform, tmp_path):
    torch.manual_seed(0)
    gm = fxq.quantize(OutlookFold().eval(), [torch.randn(2, 3, 10, 12) for _ in range(2)], platform, progress=False)
    x = torch.randn(2, 3, 10, 12)
    assert _deployed_vs_simulation(gm, platform, tmp_path, x) >= 0.9999
    with torch.no_grad():
        sim = gm(x).numpy()
    assert _cosine(run_ort(tmp_path / "m.onnx", x), sim) >= 0.999  # the default session too
    fxq.export(gm, platform, tmp_path / "dynamic.onnx", dynamic_batch=True)
    with torch.no_grad():
        sim = gm(x[:1]).numpy()
    assert _cosine(run_ort(tmp_path / "dynamic.onnx", x[:1], optimize=False), sim) >= 0.9999


def test_a_users_own_col2im_symbolic_is_the_one_used(tmp_path):
    from fxq.backends.qdq import lowering

    calls = []

    def users(g, *args):
        calls.append(1)
        return lowering._col2im_symbolic(g, *args)

    gm = fxq.quantize(OutlookFold().eval(), [torch.randn(1, 3, 6, 6)], "trt_int8", progress=False)
    torch.onnx.register_custom_op_symbolic("aten::col2im", users, 18)
    try:
        fxq.export(gm, "trt_int8", tmp_path / "m.onnx")
        assert calls  # fxq's went in only where the user had none
        assert lowering._user_registered("aten::col2im", 18)
    finally:
        torch.onnx.unregister_custom_op_symbolic("aten::col2im", 18)
    assert not lowering._user_registered("aten::col2im", 18)  # fxq's export left torch's own in place


class OverlappingUnfold(nn.Module):
    """Windows that overlap, padded, strided and dilated (an im2col a conv would do): ncnn's own ``Unfold``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.fc = nn.Conv2d(3, 4, 3, padding=1), nn.Linear(4 * 6, 8)
        self.unfold = nn.Unfold(kernel_size=(2, 3), dilation=(1, 2), padding=(1, 2), stride=(2, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.unfold(self.conv(x)).transpose(1, 2))


@pytest.mark.parametrize("model", [OverlappingUnfold, OutlookFold])
def test_unfold_and_fold_in_ncnn(model, tmp_path: Path) -> None:
    """nn.Unfold with any windows (ncnn's ``Unfold``) and VOLO's fold back to the image (ncnn's ``Fold``)."""
    torch.manual_seed(0)
    assert _ncnn_cosine(model().eval(), (1, 3, 7, 9), tmp_path) >= 0.9999


class TokenMaxHead(nn.Module):
    """VOLO's head: the class token's logits plus half the largest logit over the other tokens (``aux.max(1)[0]``);
    also ``.values`` of a min along a dim, ``torch.max`` of two tensors and of one tensor alone."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.aux = nn.Linear(8, 5), nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cls, aux = self.fc(x[:, 0]), self.aux(x[:, 1:])
        out = cls + 0.5 * aux.max(1)[0] + 0.25 * aux.min(dim=1, keepdim=True).values[:, 0]
        return torch.max(out, cls) + 0.1 * torch.max(aux)


def test_max_and_min_along_a_dim_in_ncnn(tmp_path: Path) -> None:
    """``max`` / ``min`` along a dim were op type Unknown; their values are a Reduction, two tensors' a Max."""
    torch.manual_seed(0)
    gm = fxq.prepare(TokenMaxHead().eval(), "ncnn_int8", torch.randn(1, 6, 8))
    types = {n.name: op_type(n, dict(gm.named_modules())) for n in gm.graph.nodes}
    assert {types[k] for k in ("max_1", "min_1", "max_2", "max_3")} == {
        "ReduceMaxWithIndices", "ReduceMinWithIndices", "Max", "ReduceMax"}
    assert _ncnn_cosine(TokenMaxHead().eval(), (1, 6, 8), tmp_path) >= 0.9999


def test_max_and_min_captured_by_torch_export_in_ncnn(tmp_path: Path) -> None:
    """torch.export's ``aten.max.dim`` / ``aten.min.dim`` / ``aten.max.default`` had no type (RT-DETR's decoder,
    native: "no converter for op type 'Unknown'"): lifted to ``torch.max`` / ``torch.min``."""
    torch.manual_seed(0)
    data = [torch.randn(1, 6, 8) for _ in range(2)]
    gm = fxq.quantize(TokenMaxHead().eval(), data, "ncnn_int8", progress=False, capture="export")
    assert not [n for n in gm.graph.nodes if isinstance(n.target, torch._ops.OpOverload)]
    assert _ncnn_vs_simulation(gm, tmp_path / "m", torch.randn(1, 6, 8)) >= 0.9999


class TokenArgMax(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + x.max(1, keepdim=True)[1].float()


def test_the_indices_of_a_max_are_refused_by_name_in_ncnn(tmp_path: Path) -> None:
    gm = fxq.quantize(nn.Sequential(nn.Linear(8, 8), TokenArgMax()).eval(), [torch.randn(1, 6, 8)], "ncnn_int8",
                      progress=False)
    with pytest.raises(fxq.ExportError, match="takes the indices of .*ReduceMaxWithIndices"):
        fxq.export(gm, "ncnn_int8", tmp_path / "m")


@pytest.mark.parametrize("platform", ["trt_int8", "ort_int8"])
def test_max_and_min_along_a_dim_export_onnx(platform, tmp_path: Path) -> None:
    torch.manual_seed(0)
    gm = fxq.quantize(TokenMaxHead().eval(), [torch.randn(2, 6, 8) for _ in range(2)], platform, progress=False)
    assert _deployed_vs_simulation(gm, platform, tmp_path, torch.randn(2, 6, 8)) >= 0.9999


@pytest.mark.parametrize("model", [PixelEmbed, OverlappingUnfold])
def test_unfold_written_as_gathers_in_ncnn(model, tmp_path: Path) -> None:
    """torch.onnx writes an unfold before opset 18 as Pad and Gathers of rows by 2-D indices (``[[0, 4, 8, ...],
    [1, 5, 9, ...], ...]``, TNT's ONNX file): each rising run of rows a Crop, joined and reshaped."""
    torch.manual_seed(0)
    assert _ncnn_cosine(model().eval(), (1, 3, 8, 8), tmp_path, form="onnx") >= 0.9999


@given(st.lists(st.integers(0, 40), max_size=30))
def test_arithmetic_runs_rebuild_the_indices(flat):
    from fxq.backends.ncnn.layers import _arithmetic_runs

    runs = _arithmetic_runs(flat)
    assert [start + i * step for start, count, step in runs for i in range(count)] == flat
    assert all(step >= 1 and count >= 1 for _, count, step in runs)


class DecomposedRelPos(nn.Module):
    """SAM's attention bias from decomposed relative positions: heads folded into the batch (``B * nH``), the two
    einsums' results unsqueezed at different dims and added, both broadcasting (``(B * nH, h, w, h, 1) + (B * nH,
    h, w, 1, w)``)."""

    def __init__(self, heads: int = 2, dim: int = 16, hw: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.rh = nn.Parameter(torch.randn(hw, hw, dim // heads))
        self.rw = nn.Parameter(torch.randn(hw, hw, dim // heads))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, h, w, _ = x.shape
        n = h * w
        qkv = self.qkv(x.reshape(b, n, -1)).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.reshape(3, b * self.heads, n, -1).unbind(0)
        r_q = q.reshape(b * self.heads, h, w, -1)
        rel_h = torch.einsum("bhwc,hkc->bhwk", r_q, self.rh)
        rel_w = torch.einsum("bhwc,wkc->bhwk", r_q, self.rw)
        bias = self.combine(rel_h.unsqueeze(4), rel_w.unsqueeze(3)).reshape(-1, n, n)
        attn = (q @ k.transpose(-2, -1) + bias).softmax(-1)
        out = (attn @ v).view(b, self.heads, n, -1).transpose(1, 2).reshape(b, n, -1)
        return self.proj(out).view(b, h, w, -1)

    def combine(self, rel_h: torch.Tensor, rel_w: torch.Tensor) -> torch.Tensor:
        return rel_h + rel_w


def test_two_broadcasting_values_of_size_1_dims_add_in_ncnn(tmp_path: Path) -> None:
    """The operands' blobs leave out different size-1 dims (their new dims 4 and 3: the batch is folded into
    ``B * nH``), each of which the other makes larger: the result keeps every dim, and the Add had been refused."""
    torch.manual_seed(0)
    assert _ncnn_cosine(DecomposedRelPos().eval(), (1, 4, 4, 16), tmp_path) >= 0.9999


class Permuted(nn.Module):
    """CSATv2's ``x[:, :, self.permutation]`` (a zigzag order of DCT coefficients), by a stored index tensor, by a
    Python list and after an Ellipsis."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.fc = nn.Conv2d(3, 4, 1), nn.Linear(8, 8)
        self.register_buffer("permutation", torch.tensor([0, 1, 4, 5, 2, 3, 6, 7]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x).flatten(2)  # (N, 4, 8)
        return self.fc(y[:, :, self.permutation] + y[..., [7, 6, 5, 4, 3, 2, 1, 0]]) + y[:, [3, 1, 2, 0]]


def test_indexing_by_stored_indices_in_ncnn(tmp_path: Path) -> None:
    torch.manual_seed(0)
    assert _ncnn_cosine(Permuted().eval(), (1, 3, 2, 4), tmp_path) >= 0.9999


class TwoScales(nn.Module):
    """CrossViT's second branch: the image resized bicubic to another size; plus a bilinear resize by a factor and a
    nearest one, each into a conv."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(3, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(nn.functional.interpolate(x, size=(6, 6), mode="bicubic", align_corners=False))
        z = self.b(nn.functional.interpolate(x, scale_factor=1.5, mode="bilinear", align_corners=True))
        w = self.c(nn.functional.interpolate(x, size=(6, 6), mode="nearest"))
        return y + z + w


@pytest.mark.parametrize("platform", ["trt_int8", "ncnn_int8"])
def test_resizes_captured_by_torch_export(platform, tmp_path: Path) -> None:
    """torch.export records F.interpolate as aten.upsample_<mode>.vec; lifted back, every exporter reads it."""
    torch.manual_seed(0)
    model, x = TwoScales().eval(), torch.randn(1, 3, 4, 4)
    gm = capture(model, (x,), capture="export")
    assert not [n for n in gm.graph.nodes if "upsample" in str(n.target)]
    with torch.no_grad():
        torch.testing.assert_close(gm(x), model(x))
    q = fxq.quantize(model, [torch.randn(1, 3, 4, 4) for _ in range(2)], platform, progress=False, capture="export")
    assert _deployed_vs_simulation(q, platform, tmp_path, x) >= 0.9999


def test_an_export_raised_to_the_opset_it_needs_prints_nothing(tmp_path, capfd):
    """The first try (opset 13) fails on col2im; torch 2.14's exporter then printed its whole TorchScript graph to
    stdout (its ONNX log is on for every export). fxq keeps that for the debug log and exports at opset 18."""
    gm = fxq.quantize(OutlookFold().eval(), [torch.randn(1, 3, 6, 6)], "trt_int8", progress=False)
    capfd.readouterr()
    fxq.export(gm, "trt_int8", tmp_path / "m.onnx")
    out, _ = capfd.readouterr()
    assert "graph" not in out and not out.strip()
    import onnx

    assert max(o.version for o in onnx.load(tmp_path / "m.onnx").opset_import if o.domain in ("", "ai.onnx")) >= 18


class ResponseNorm(nn.Module):
    """ConvNeXt-V2's / CSATv2's GlobalResponseNorm (channels last): ``x.norm(p=2, dim=(1, 2), keepdim=True)``, and
    an L1 norm by ``torch.linalg.vector_norm``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.fc = nn.Conv2d(3, 8, 3, padding=1), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x).permute(0, 2, 3, 1)
        g = x.norm(p=2, dim=(1, 2), keepdim=True)
        n = g / (g.mean(dim=-1, keepdim=True) + 1e-6)
        l1 = torch.linalg.vector_norm(x, ord=1, dim=-1, keepdim=True)
        return self.fc(x + x * n + 0.01 * l1)


@pytest.mark.parametrize("capture", ["auto", "export"])
def test_vector_norms_in_ncnn(tmp_path: Path, capture: str) -> None:
    """``export``: torch.export's ``aten.linalg_vector_norm`` (HF ConvNeXt-V2's GRN) had no type ("no converter
    for op type 'Unknown'") until lifted to ``torch.linalg.vector_norm``."""
    torch.manual_seed(0)
    data = [torch.randn(1, 3, 4, 4) for _ in range(2)]
    gm = fxq.quantize(ResponseNorm().eval(), data, "ncnn_int8", progress=False, capture=capture)
    assert {op_type(n, dict(gm.named_modules())) for n in gm.graph.nodes} >= {"ReduceL2", "ReduceL1"}
    assert _ncnn_vs_simulation(gm, tmp_path / "m", torch.randn(1, 3, 4, 4)) >= 0.9999


class CompoundArithmetic(nn.Module):
    """timm's GlobalResponseNorm ends ``torch.addcmul(bias, weight, x * x_n)``; ``addcdiv`` with a value, and the
    method form."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.fc = nn.Conv2d(3, 8, 3, padding=1), nn.Linear(8, 4)
        self.weight, self.bias = nn.Parameter(torch.randn(8)), nn.Parameter(torch.randn(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x).permute(0, 2, 3, 1)
        y = torch.addcmul(self.bias, self.weight, x * x.sigmoid())
        z = y.addcdiv(x, x.abs() + 1.0, value=0.5)
        return self.fc(z)


def test_addcmul_and_addcdiv_are_written_out(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, x = CompoundArithmetic().eval(), torch.randn(1, 3, 4, 4)
    gm = fxq.prepare(model, "ncnn_int8", x)
    assert not [n for n in gm.graph.nodes if "addc" in str(n.target)]
    with torch.no_grad(), fxq.fp32_mode(gm):  # torch's addcmul fuses its multiply-add: an ulp apart
        torch.testing.assert_close(gm(x), model(x), rtol=1e-6, atol=1e-6)
    assert _ncnn_cosine(model, (1, 3, 4, 4), tmp_path) >= 0.9999


def test_addcdiv_written_out_is_bit_exact():
    from fxq.graph.passes import decompose_compound_arithmetic

    class Div(nn.Module):
        def forward(self, a, b, c):
            return torch.addcdiv(a, b, c, value=3.0) + a.addcdiv(b, c)

    a, b, c = torch.randn(3, 500, 8)
    c = c.abs() + 1
    gm = decompose_compound_arithmetic(trace(Div()))
    assert not [n for n in gm.graph.nodes if "addc" in str(n.target)]
    assert torch.equal(gm(a, b, c), Div()(a, b, c))


class ScalarAttention(nn.Module):
    """CSATv2's spatial attention with one-number queries, keys and values: ``q, k, v = qkv.unbind(-1)``, each
    ``(B, N)``, then ``(q @ k.transpose(-1, -2)).softmax(-1) @ v``: at batch 1 a ``(1, N) @ (N, 1)`` product whose
    operands' blobs leave out a row and a column."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.qkv = nn.Conv2d(3, 1, 3, padding=1), nn.Linear(1, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        b, c, h, w = y.shape
        q, k, v = self.qkv(y.flatten(2).transpose(1, 2)).unbind(-1)
        attn = (q @ k.transpose(-1, -2)).softmax(dim=-1)
        return y + (attn @ v).unsqueeze(-1).transpose(1, 2).reshape(b, c, h, w)


def test_products_of_operands_leaving_out_different_size_1_dims_in_ncnn(tmp_path: Path) -> None:
    torch.manual_seed(0)
    assert _ncnn_cosine(ScalarAttention().eval(), (1, 3, 4, 4), tmp_path) >= 0.9999


class UnevenFold(nn.Module):
    """An unfold and a fold padded by different amounts along H and W."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cols = nn.functional.unfold(self.conv(x), 3, padding=(1, 0))
        return nn.functional.fold(cols, (x.shape[2], x.shape[3]), 3, padding=(1, 0))


@pytest.mark.parametrize("shape", [(1, 2, 6, 8), (1, 2, 7, 8)])
def test_fold_padded_unevenly_exports(shape, tmp_path):
    """ONNX Col2Im's pads are the begins of H and W, then their ends; the symbolic had written [ph, ph, pw, pw]:
    onnxruntime refused one size and computed another wrongly."""
    torch.manual_seed(0)
    gm = fxq.quantize(UnevenFold().eval(), [torch.randn(*shape) for _ in range(2)], "trt_int8", progress=False)
    assert _deployed_vs_simulation(gm, "trt_int8", tmp_path, torch.randn(*shape)) >= 0.9999


class ClampedRelPos(DecomposedRelPos):
    """The relative-position bias clamped by the other computed term: ``clamp(rel_h[..., None], min=rel_w[..., None,
    :])``, whose result keeps every dim while ``rel_h``'s blob leaves one out."""

    def combine(self, rel_h: torch.Tensor, rel_w: torch.Tensor) -> torch.Tensor:
        return torch.clamp(rel_h, min=rel_w)


def test_a_clamp_by_a_bound_that_broadcasts_it_in_ncnn(tmp_path: Path) -> None:
    torch.manual_seed(0)
    assert _ncnn_cosine(ClampedRelPos().eval(), (1, 4, 4, 16), tmp_path) >= 0.9999


def test_addcmul_with_the_deprecated_positional_value():
    from fxq.graph.passes import decompose_compound_arithmetic

    class Old(nn.Module):
        def forward(self, x, a, b):
            return torch.addcmul(x, 0.5, a, b) + x.addcdiv(2.0, a, b)

    x, a, b = torch.randn(3, 50, 8)
    b = b.abs() + 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = Old()(x, a, b)
        gm = decompose_compound_arithmetic(trace(Old()))
        torch.testing.assert_close(gm(x, a, b), want, rtol=1e-6, atol=1e-6)


class MaskIndex(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)
        self.register_buffer("mask", torch.tensor([1, 0, 1, 1, 0, 1, 1, 0], dtype=torch.uint8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x).flatten(2)[:, :, self.mask] * 2.0  # a uint8 index: a mask (deprecated in torch)


def test_a_mask_index_is_not_read_as_indices_in_ncnn(tmp_path: Path) -> None:
    """A uint8 / bool index is a mask (torch picks where it is set), never the positions 1, 0, 1...: refused."""
    gm = fxq.quantize(MaskIndex().eval(), [torch.randn(1, 3, 2, 4)], "ncnn_int8", progress=False)
    with pytest.raises(fxq.ExportError):
        fxq.export(gm, "ncnn_int8", tmp_path / "m")


def test_a_successful_export_without_a_python_stdout(tmp_path, monkeypatch):
    from fxq.backends.qdq import lowering

    monkeypatch.setattr(sys, "stdout", None)
    lowering._replay(b"printed by native code\n")  # nowhere to print it: no error
