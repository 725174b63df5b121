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

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_ncnn_gaps import check
from test_ncnn_onnx import _cosine, check_onnx
from torch import nn

import fxq
from fxq.analysis.mismatch_ncnn import ncnn_mat
from fxq.backends import export
from fxq.backends.ncnn import ncnn_paths
from fxq.errors import ExportError

from _export_helpers import ncnn_net

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
        scores = h @ h.transpose(-1, -2)
        if self.mode == "row":
            scores = scores + self.mask
        else:  # "filled": the row hidden by a masked_fill (found by the review: the walk stopped at the select)
            scores = scores.masked_fill(self.mask == -math.inf, -math.inf)
        p = scores.softmax(-1)
        return self.out(torch.where(torch.isnan(p), torch.zeros(()), p) @ h)


@pytest.mark.parametrize("mode,why", [("value", "is not a softmax"), ("row", "leave a row without a finite value"),
                                      ("filled", "leave a row without a finite value")])
def test_undecided_nan_tests_are_refused_by_name(tmp_path: Path, mode: str, why: str) -> None:
    gm = fxq.quantize(NanTest(mode).eval(), [torch.randn(1, 6, 8) for _ in range(2)], "ncnn_int8", progress=False)
    with pytest.raises(ExportError, match=rf"node 'isnan'.*ncnn has no NaN test.*{why}"):
        export(gm, "ncnn", tmp_path / "m.param")


class ComputedSelects(nn.Module):
    """Selects the ncnn writer refuses, each by its own reason: by a comparison the network computes (ncnn has none),
    of integers, and between two numbers by a computed bool."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind, self.fc, self.out = kind, nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if self.kind == "comparison":
            return self.out(torch.where(h > 0, h, 0.1 * h))
        if self.kind == "integers":
            return self.out(h * torch.where(mask, 2, 1)[..., None])
        return self.out(h * torch.where(mask, 2.0, -1.0)[..., None])


@pytest.mark.parametrize("kind,why", [
    ("comparison", r"node 'gt' .*no converter for op type"),
    ("integers", r"node 'where'.*selects non-float values"),
    ("numbers", r"node 'where'.*selects between numbers by a condition the network computes"),
])
def test_selects_ncnn_cannot_write_are_refused_by_name(tmp_path: Path, kind: str, why: str) -> None:
    mask = torch.tensor([[1, 1, 1, 1, 0, 0]]).bool()
    gm = fxq.quantize(ComputedSelects(kind).eval(), [(torch.randn(1, 6, 8), mask)], "ncnn_int8", progress=False)
    with pytest.raises(ExportError, match=why):
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


class PaddedAttention(nn.Module):
    """Attention over a padded batch, the mask taken in as bools (Hugging Face's ``attention_mask``, cast to bool
    again inside), shaped by slicing (``index=False``) or by indexing with ``arange``s (``index=True``, transformers'
    mask functions under torch.export), combined with a stored all-True mask (``&``) and given to
    ``scaled_dot_product_attention`` as a bool mask."""

    def __init__(self, index: bool) -> None:
        super().__init__()
        self.index = index
        self.qkv, self.out = nn.Linear(8, 24), nn.Linear(8, 8)
        self.register_buffer("allowed", torch.ones(6, 6, dtype=torch.bool))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, 4)).permute(2, 0, 3, 1, 4).unbind(0)
        keep = mask.to(torch.bool)
        if self.index:
            keep = keep[torch.arange(1)[:, None, None, None], torch.arange(6)[None, None, None, :]]
        else:
            keep = keep[:, None, None, :]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep & self.allowed)
        return self.out(y.transpose(1, 2).flatten(2))


def _run_two_inputs(param: Path, bin_: Path, x: torch.Tensor, mask: torch.Tensor, int8: bool) -> np.ndarray:
    ex = ncnn_net(param, bin_, int8=int8).create_extractor()
    ex.input("in0", ncnn_mat(x[0].numpy()))
    ex.input("in1", ncnn_mat(mask[0].float().numpy()))
    ret, out = ex.extract("out0")
    assert ret == 0
    return np.array(out).copy()


def _export_and_compare(gm: torch.fx.GraphModule, tmp_path: Path, masks: tuple[torch.Tensor, ...]) -> None:
    """Export ``gm`` (inputs ``x``, a bool ``mask``) to ncnn; on each mask, the FP32 file against torch and the int8
    file against the simulation."""
    export(gm, "ncnn", tmp_path / "m.param")
    files = ncnn_paths(tmp_path / "m.param")
    for mask in masks:
        x = torch.randn(1, 6, 8)
        with torch.no_grad():
            sim = gm(x, mask)[0].numpy()
            with fxq.fp32_mode(gm):
                ref = gm(x, mask)[0].numpy()
        fp32 = _run_two_inputs(files["fp32_param"], files["fp32_bin"], x, mask, int8=False).reshape(ref.shape)
        assert np.abs(fp32 - ref).max() <= 1e-4 * max(1.0, float(np.abs(ref).max()))
        int8 = _run_two_inputs(files["param"], files["bin"], x, mask, int8=True).reshape(sim.shape)
        assert _cosine(int8, sim) >= 0.9999


@pytest.mark.parametrize("index", [False, True], ids=["sliced", "indexed"])
def test_padding_mask_input_runs_in_ncnn(tmp_path: Path, index: bool) -> None:
    """Refused before at the indexing, the ``&`` and the computed bool mask: ncnn holds bools as 0 / 1, ``&`` is a
    product, and the mask adds -FLT_MAX where it masks. Checked with padding in the batch: the FP32 file against
    torch, the int8 file against the simulation."""
    torch.manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0]]).bool()
    gm = fxq.quantize(PaddedAttention(index).eval(), [(torch.randn(1, 6, 8), mask) for _ in range(2)], "ncnn_int8",
                      progress=False, capture="export")
    _export_and_compare(gm, tmp_path, (mask, torch.ones(1, 6, dtype=torch.bool)))


def test_an_integer_mask_input_is_refused_with_advice(tmp_path: Path) -> None:
    """ncnn's integer inputs are the int32 ids ``Embed`` reads: a mask taken in as int64 and cast to bool is refused,
    and the advice (take it in as bools) exports."""
    mask = torch.tensor([[1, 1, 1, 1, 0, 0]])
    gm = fxq.quantize(PaddedAttention(False).eval(), [(torch.randn(1, 6, 8), mask)], "ncnn_int8", progress=False,
                      capture="export")
    with pytest.raises(ExportError, match=r"casts a torch.int64 value to torch.bool.*Fix: take the mask in as bool"):
        export(gm, "ncnn", tmp_path / "m.param")


class IntegerLogic(nn.Module):
    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return x * (mask & 6).to(x.dtype)[..., None]


def test_bitwise_logic_of_integers_is_refused_by_name(tmp_path: Path) -> None:
    gm = fxq.quantize(IntegerLogic().eval(), [(torch.randn(1, 6, 8), torch.ones(1, 6, dtype=torch.long))],
                      "ncnn_int8", progress=False, capture="export")
    with pytest.raises(ExportError, match=r"bitwise logic of integers"):
        export(gm, "ncnn", tmp_path / "m.param")


class MaskedScores(nn.Module):
    """DeBERTa's masking: ``scores.masked_fill(~keep, fill)`` by a padding mask taken in as bools, the probabilities
    masked again with 0 after the softmax."""

    def __init__(self, fill: float) -> None:
        super().__init__()
        self.fill = fill
        self.qkv, self.out = nn.Linear(8, 24), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        keep = (mask[:, None, :] & mask[:, :, None])  # (N, T, T)
        scores = (q @ k.transpose(-1, -2)).masked_fill(~keep, self.fill)
        return self.out(scores.softmax(-1).masked_fill(~keep, 0.0) @ v)


def test_a_select_by_a_computed_bool_runs_in_ncnn(tmp_path: Path) -> None:
    """Refused before ("its condition is computed by the network"): the choices times 0 / 1 masks, summed."""
    torch.manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0]]).bool()
    gm = fxq.quantize(MaskedScores(torch.finfo(torch.float32).min).eval(),
                      [(torch.randn(1, 6, 8), mask) for _ in range(2)], "ncnn_int8", progress=False)
    _export_and_compare(gm, tmp_path, (mask,))


def test_an_infinite_fill_by_a_computed_bool_is_refused(tmp_path: Path) -> None:
    mask = torch.tensor([[1, 1, 1, 1, 0, 0]]).bool()
    gm = fxq.quantize(MaskedScores(-math.inf).eval(), [(torch.randn(1, 6, 8), mask)], "ncnn_int8", progress=False)
    with pytest.raises(ExportError, match=r"masked_fill.*selects -inf by a condition the network computes.*Fix: "
                                          r"select a finite number"):
        export(gm, "ncnn", tmp_path / "m.param")


class CausalThenPadding(nn.Module):
    """A decoder's masking in two steps: a stored causal mask filled with -inf, then the padding mask taken in as
    bools, filled with finfo.min. ncnn multiplied the first step's -inf by the second's 0 mask: NaN (the review)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(8, 8), nn.Linear(8, 8)
        self.register_buffer("causal", torch.ones(6, 6, dtype=torch.bool).triu(1))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        scores = (h @ h.transpose(-1, -2)).masked_fill(self.causal, -math.inf)
        scores = scores.masked_fill(~mask[:, None, :], torch.finfo(torch.float32).min)
        return self.out(scores.softmax(-1) @ h)


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_selects_in_a_row_keep_their_infinities_out_of_products(tmp_path: Path, capture: str) -> None:
    torch.manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0]]).bool()
    gm = fxq.quantize(CausalThenPadding().eval(), [(torch.randn(1, 6, 8), mask) for _ in range(2)], "ncnn_int8",
                      progress=False, capture=capture)
    _export_and_compare(gm, tmp_path, (mask, torch.ones(1, 6, dtype=torch.bool)))
