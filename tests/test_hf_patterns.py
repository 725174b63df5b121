"""Patterns from Hugging Face transformers models (built from their configs, random init; nothing downloads), each
rebuilt small here: GPT-2's ``Conv1D`` (``torch.addmm``), its packed-sequence check on position ids (``torch.diff``,
then a ``cumsum`` of a bool), Swin-V2's normalized attention (``F.normalize``'s ``clamp_min`` under torch.export).
Each goes through torch.export capture (HF models do not trace symbolically) and symbolic tracing, to the files of
every platform, checked against fxq's simulation."""
from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxq
from fxq.analysis.mismatch_ncnn import ncnn_mat
from fxq.graph.info import is_quantizer_node

from _export_helpers import ncnn_net, run_ort

ncnn = pytest.importorskip("ncnn")


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-30))


def _files_match_simulation(gm: torch.fx.GraphModule, x: torch.Tensor, tmp_path: Path, platform: str) -> None:
    """The exported file against the simulation on ``x``: ONNX in onnxruntime, both session modes; ncnn int8."""
    with torch.no_grad():
        sim = gm(x).numpy()
    if platform == "ncnn_int8":
        param, bin_ = fxq.export(gm, platform, tmp_path / platform)[:2]
        ex = ncnn_net(param, bin_, int8=True).create_extractor()
        ex.input("in0", ncnn_mat(x[0].numpy()))
        got = np.array(ex.extract("out0")[1]).reshape(sim[0].shape)
        assert _cosine(got, sim[0]) >= 0.9999
        return
    fxq.export(gm, platform, tmp_path / f"{platform}.onnx")
    for optimize in (True, False):
        assert _cosine(run_ort(tmp_path / f"{platform}.onnx", x, optimize=optimize), sim) >= 0.999


class Conv1DBlock(nn.Module):
    """GPT-2's ``Conv1D``: ``torch.addmm(bias, x.view(-1, nx), weight).view(...)``, weight stored (in, out)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.randn(16, 24) * 0.2), nn.Parameter(torch.randn(24) * 0.1)
        self.proj = nn.Linear(24, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.addmm(self.bias, x.reshape(-1, 16), self.weight).reshape(x.shape[0], x.shape[1], 24)
        return self.proj(torch.tanh(y))


@pytest.mark.parametrize("capture", ["fx", "export"])
@pytest.mark.parametrize("platform", ["trt_int8", "ncnn_int8"])
def test_addmm_by_a_stored_matrix_is_a_quantized_linear(tmp_path: Path, capture: str, platform: str) -> None:
    """``torch.addmm`` was a Gemm without weight quantizer on every platform, and ncnn had no converter for it (nor
    for torch.export's ``aten.addmm``): written out as ``x @ W + bias``, it becomes a linear with its weight
    quantized per channel and the bias folded in."""
    torch.manual_seed(0)
    data = [torch.randn(1, 5, 16) for _ in range(2)]
    gm = fxq.quantize(Conv1DBlock().eval(), data, platform, progress=False, capture=capture)
    linears = [n for n in gm.graph.nodes if n.target is F.linear]
    assert len(linears) == 2 and not [n for n in gm.graph.nodes if "addmm" in str(n.target)]
    assert all(is_quantizer_node(n.args[1]) for n in linears)  # the weight quantized
    _files_match_simulation(gm, torch.randn(1, 5, 16), tmp_path, platform)


class PackedPositions(nn.Module):
    """HF's packed-sequence check: ``(torch.diff(position_ids, prepend=...) != 1).cumsum(-1)``, the count used as a
    float scale of the features (so the graph computes it at run time)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(x.shape[1]).unsqueeze(0).expand(x.shape[0], -1)
        first = pos[:, :1] - 1
        starts = (torch.diff(pos, dim=-1, prepend=first) != 1).cumsum(-1)
        steps = torch.diff(x, n=2, dim=1, append=x[:, -2:])
        return self.fc(x * (starts.unsqueeze(-1) + 1).float() + steps)


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_diff_and_a_cumsum_of_bools_export_for_onnxruntime(tmp_path: Path, capture: str) -> None:
    """torch.onnx has no symbolic for ``aten::diff`` ("cannot express op 'aten::diff'"), and wrote a bool input to
    ONNX ``CumSum``, which onnxruntime refuses to load; ``torch.diff`` is now two slices and a difference (equal to
    torch's, ``n`` times, prepend / append), and fxq's ``cumsum`` symbolic sums as torch does, in int64."""
    torch.manual_seed(0)
    model = PackedPositions().eval()
    data = [torch.randn(2, 6, 8) for _ in range(2)]
    gm = fxq.quantize(model, data, "trt_int8", progress=False, capture=capture)
    assert not [n for n in gm.graph.nodes if "diff" in str(n.target)]
    with fxq.fp32_mode(gm), torch.no_grad():
        assert torch.equal(gm(data[0]), model(data[0]))  # the written-out diff computes torch's exactly
    _files_match_simulation(gm, torch.randn(2, 6, 8), tmp_path, "trt_int8")


class _Diff(nn.Module):
    def __init__(self, args: tuple, kwargs: dict) -> None:
        super().__init__()
        self.args, self.kwargs = args, kwargs

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return torch.diff(t, *self.args, **self.kwargs)


def test_written_out_diff_equals_torch_diff() -> None:
    """Every argument form, and a bool input (torch's difference of bools is ``!=``)."""
    from fxq.graph.passes import decompose_compound_arithmetic, propagate_tensor_meta

    cases = [((), {}), ((1, 0), {}), ((2, -1), {}), ((1, 1), {"prepend": torch.zeros(3, 1, 5)}),
             ((1,), {"dim": -2, "append": torch.ones(3, 2, 5)}), ((3, -1), {"prepend": torch.ones(3, 4, 2)})]
    x = torch.randn(3, 4, 5)
    for args, kwargs in cases:
        gm = decompose_compound_arithmetic(propagate_tensor_meta(torch.fx.symbolic_trace(_Diff(args, kwargs)), [x]))
        assert not [n for n in gm.graph.nodes if n.target is torch.diff]
        torch.testing.assert_close(gm(x), torch.diff(x, *args, **kwargs), rtol=0, atol=0)
    flags = torch.rand(3, 6) > 0.5
    graph = torch.fx.Graph()  # a bool diff, its value recorded as capture records it
    t = graph.placeholder("t")
    d = graph.call_function(torch.diff, (t,))
    d.meta["val"] = torch.diff(flags)
    graph.output(d)
    gm = decompose_compound_arithmetic(torch.fx.GraphModule(nn.Module(), graph))
    assert torch.equal(gm(flags), torch.diff(flags))


class NormalizedAttention(nn.Module):
    """Swin-V2's cosine attention: ``F.normalize`` of queries and keys (torch.export writes its ``clamp_min``)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(8, 24), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        a = torch.softmax(F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-1, -2) * 10.0, dim=-1)
        return self.out(a @ v)


def test_normalize_captured_by_torch_export_exports_to_ncnn(tmp_path: Path) -> None:
    """torch.export's ``aten.clamp_min`` / ``clamp_max`` had no type ("no converter for op type 'Unknown'"): they
    are ``torch.clamp`` with one bound now."""
    torch.manual_seed(0)
    data = [torch.randn(1, 6, 8) for _ in range(2)]
    gm = fxq.quantize(NormalizedAttention().eval(), data, "ncnn_int8", progress=False, capture="export")
    assert not [n for n in gm.graph.nodes if "clamp_min" in str(n.target)]
    _files_match_simulation(gm, torch.randn(1, 6, 8), tmp_path, "ncnn_int8")


class BoolDiff(nn.Module):
    """``torch.diff`` of a bool mask (where a run of positive values starts), as a method with ``n`` and ``prepend``
    too: symbolic tracing records no dtype, so the difference (``!=`` for bools) waits for the shapes pass."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positive = x > 0
        starts = torch.diff(positive, prepend=torch.zeros_like(positive[:, :1])) | positive.diff(n=2, append=positive[
            :, -2:])
        return self.fc(x * starts.float() + torch.diff(x, n=0, prepend=x[:, :1]))


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_bool_diff_and_zero_order_diff(capture: str) -> None:
    """A bool diff under symbolic tracing was written out as a subtraction ("Subtraction ... with two bool tensors
    is not supported", reported as fxq's rewrite failing); ``n=0`` returned the prepended input instead of the
    input (both found by review)."""
    torch.manual_seed(0)
    model = BoolDiff().eval()
    data = [torch.randn(2, 6) for _ in range(2)]
    gm = fxq.quantize(model, data, "trt_int8", progress=False, capture=capture)
    assert not [n for n in gm.graph.nodes if "diff" in str(n.target)]
    with fxq.fp32_mode(gm), torch.no_grad():
        assert torch.equal(gm(data[0]), model(data[0]))


class DeprecatedAddmm(nn.Module):
    """torch's deprecated positional scalars: ``torch.addmm(beta, input, alpha, mat1, mat2)``."""

    def __init__(self) -> None:
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.randn(8, 4)), nn.Parameter(torch.randn(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.addmm(0.5, self.bias, 2.0, x, self.weight)


def test_an_addmm_in_another_form_is_left_as_it_is() -> None:
    """Written out only in the ``(input, mat1, mat2, beta=, alpha=)`` form: the deprecated positional scalars were
    read as the input and the matrices (a review finding)."""
    model = DeprecatedAddmm().eval()
    x = torch.randn(3, 8)
    gm = fxq.prepare(model, "trt_int8", x)
    with fxq.fp32_mode(gm), torch.no_grad():
        torch.testing.assert_close(gm(x), model(x))


class RotaryHalf(nn.Module):
    """Llama / Qwen2's rotary embedding: ``rotate_half`` concatenates ``-x2`` and ``x1`` (torch.export writes
    ``aten.neg``), scaled by stored cos / sin tables."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.out = nn.Linear(8, 8), nn.Linear(8, 8)
        angle = torch.arange(6.0)[:, None] * torch.tensor([1.0, 0.1, 0.01, 0.001]).repeat(2)[None]
        self.register_buffer("cos", angle.cos())
        self.register_buffer("sin", angle.sin())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q(x)
        rotated = torch.cat((-q[..., 4:], q[..., :4]), dim=-1)
        return self.out(q * self.cos + rotated * self.sin)


def test_rotary_neg_captured_by_torch_export_exports_to_ncnn(tmp_path: Path) -> None:
    """torch.export's ``aten.neg`` had no type ("no converter for op type 'Unknown'", Llama / Qwen2 natively on
    ncnn): it is ``torch.neg`` now, ncnn's UnaryOp."""
    torch.manual_seed(0)
    data = [torch.randn(1, 6, 8) for _ in range(2)]
    gm = fxq.quantize(RotaryHalf().eval(), data, "ncnn_int8", progress=False, capture="export")
    assert not [n for n in gm.graph.nodes if "aten.neg" in str(n.target) or str(n.target) == "neg.default"]
    _files_match_simulation(gm, torch.randn(1, 6, 8), tmp_path, "ncnn_int8")
