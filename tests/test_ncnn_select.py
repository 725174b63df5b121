"""ncnn exports of selects and NaN tests (issue #13: Hugging Face text models on ncnn).

ncnn has no select and no NaN test. A ``torch.where`` / ``masked_fill`` whose condition is fixed at export time (a
causal mask built from shapes or stored) is arithmetic on ``MemoryData`` masks; torch.onnx's attention writes
``where(isnan(p), 0, p)`` after its softmax (GPT-2, OPT, Llama, Qwen2 through the dynamo exporter), a test that is
all False when every row of the softmax keeps a finite score. A condition the network computes is refused by name.
Each file runs in ncnn against fxq's simulation (int8) and torch / onnxruntime (FP32).
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_ncnn_gaps import check
from test_ncnn_onnx import check_onnx
from torch import nn

import fxq
from fxq.backends import export
from fxq.errors import ExportError

pytest.importorskip("ncnn")


class CausalAttention(nn.Module):
    """Attention with its scores masked by ``masked_fill`` (DeBERTa, GPT-2's eager attention) or ``torch.where``,
    the mask causal, built from the sequence length or stored; ``fill`` is the masked scores' value."""

    def __init__(self, how: str, fill: float = -math.inf, seq: int = 6) -> None:
        super().__init__()
        self.how, self.fill = how, fill
        self.qkv, self.out = nn.Linear(8, 24), nn.Linear(8, 8)
        self.register_buffer("causal", torch.ones(seq, seq, dtype=torch.bool).tril())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-1, -2) * 8 ** -0.5
        n = x.shape[1]
        if self.how == "masked_fill":  # from the shape: True where masked
            scores = scores.masked_fill(scores.new_ones((n, n), dtype=torch.bool).triu(1), self.fill)
        else:  # stored: True where kept
            scores = torch.where(self.causal, scores, torch.tensor(self.fill))
        return self.out(scores.softmax(-1) @ v)


@pytest.mark.parametrize("capture", ["fx", "export"])
@pytest.mark.parametrize("how", ["masked_fill", "where"])
@pytest.mark.parametrize("fill", [-math.inf, -1e4])
def test_fixed_condition_selects_run_in_ncnn(tmp_path: Path, how: str, fill: float, capture: str) -> None:
    """The select was refused ("no converter for op type 'Unknown'", DeBERTa natively); now the masked scores are
    the kept ones times a 0 / 1 MemoryData plus the fill where masked, -inf included."""
    _, files = check(CausalAttention(how, fill), (1, 6, 8), tmp_path / "m.param", capture=capture)
    param = files["param"].read_text()
    assert "MemoryData" in param and " Where" not in param


class SelectBetweenTwo(nn.Module):
    """``torch.where`` choosing between two computed values by a stored mask (no fixed choice)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.out = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.register_buffer("mask", torch.rand(6, 8) > 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.where(self.mask, self.a(x), self.b(x)))


def test_select_between_two_computed_values(tmp_path: Path) -> None:
    check(SelectBetweenTwo(), (1, 6, 8), tmp_path / "m.param")


class SdpaBoolMask(nn.Module):
    """``F.scaled_dot_product_attention`` with a causal bool mask: torch.onnx's dynamo exporter writes its
    probabilities as ``Where(IsNaN(p), 0, p)``."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(8, 24), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, 4)).permute(2, 0, 3, 1, 4).unbind(0)
        n = x.shape[1]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(n, n, dtype=torch.bool).tril())
        return self.out(y.transpose(1, 2).flatten(2))


def test_dynamo_attention_nan_test_exports_to_ncnn(tmp_path: Path) -> None:
    """The file's IsNaN was refused ("no converter for op type 'IsNaN'"); a softmax whose causal mask keeps a
    finite score in every row has no NaN, so the test and its Where leave no layer."""
    param, _ = check_onnx(SdpaBoolMask(), (1, 6, 8), tmp_path, "dynamo")
    assert "IsNaN" not in param and "Where" not in param


class NanTest(nn.Module):
    """A NaN test fxq cannot decide: of a computed value (``mode="value"``), or of a softmax whose fixed mask hides
    a whole row (``mode="row"``)."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode, self.fc, self.out = mode, nn.Linear(8, 8), nn.Linear(8, 8)
        mask = torch.zeros(6, 6)
        mask[2] = -math.inf
        self.register_buffer("mask", mask)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if self.mode == "value":
            return self.out(torch.where(torch.isnan(h), torch.zeros(()), h))
        p = (h @ h.transpose(-1, -2) + self.mask).softmax(-1)
        return self.out(torch.where(torch.isnan(p), torch.zeros(()), p) @ h)


@pytest.mark.parametrize("mode,why", [("value", "is not a softmax"), ("row", "leave a row without a finite value")])
def test_undecided_nan_tests_are_refused_by_name(tmp_path: Path, mode: str, why: str) -> None:
    gm = fxq.quantize(NanTest(mode).eval(), [torch.randn(1, 6, 8) for _ in range(2)], "ncnn_int8", progress=False)
    with pytest.raises(ExportError, match=rf"node 'isnan'.*ncnn has no NaN test.*{why}"):
        export(gm, "ncnn", tmp_path / "m.param")


class ComputedCondition(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return self.out(torch.where(h > 0, h, 0.1 * h))


def test_a_computed_condition_is_refused_by_name(tmp_path: Path) -> None:
    """ncnn has no comparison: the export stops at the node that computes the condition, by name."""
    gm = fxq.quantize(ComputedCondition().eval(), [torch.randn(1, 6, 8) for _ in range(2)], "ncnn_int8",
                      progress=False)
    with pytest.raises(ExportError, match=r"node 'gt' .*no converter for op type"):
        export(gm, "ncnn", tmp_path / "m.param")


class PadSequence(nn.Module):
    """MobileBERT's trigram input: the sequence shifted both ways by ``F.pad`` of the sequence dim with pads for
    every dim (the batch's (0, 0) too), concatenated along the features."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(8, 8), nn.Linear(24, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return self.out(torch.cat([F.pad(h[:, 1:], [0, 0, 0, 1, 0, 0]), h, F.pad(h[:, :-1], [0, 0, 1, 0, 0, 0])], 2))


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_pads_of_the_outer_dims_left_at_zero(tmp_path: Path, capture: str) -> None:
    """Refused before ("'constant' padding [0, 0, 0, 1, 0, 0] of a rank-3 tensor (batch dim 0)"): the outer pairs of
    zeros pad nothing."""
    check(PadSequence(), (1, 6, 8), tmp_path / "m.param", capture=capture)


class Unflattened(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(8, 24), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.fc(x).unflatten(2, (3, 8)).sum(2))


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_unflatten_is_a_reshape(tmp_path: Path, capture: str) -> None:
    """``Tensor.unflatten`` had no type ("no converter for op type 'Unknown'")."""
    check(Unflattened(), (1, 6, 8), tmp_path / "m.param", capture=capture)
