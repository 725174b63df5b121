"""Alignment as a quantizer record: each aligned activation FakeQuantize lists the groups whose grid it shares
(``fq.aligned``); ``QuantGraph.alignment_groups`` reads them back in the order prepare found them."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import fxq
from fxq.graph.quant_graph import AlignGroup, QuantGraph
from fxq.qat import QATFakeQuantize


class NestedConcat(nn.Module):
    """``cat([cat([a, b]), c])`` with ``c`` computed first: its quantizer is made before ``a``'s and ``b``'s."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Conv2d(3, 4, 1), nn.Conv2d(3, 4, 1), nn.Conv2d(3, 4, 1)
        self.head = nn.Conv2d(12, 2, 1)
        with torch.no_grad():
            self.c.weight.mul_(10)  # the outer concat's range is not the inner one's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.c(x)
        inner = torch.cat([self.a(x), self.b(x)], 1)
        return self.head(torch.cat([inner, c], 1))


class SharedAdd(nn.Module):
    """``a`` is aligned in two adds, ``a + b`` first; ``c``'s quantizer is made before ``b``'s."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Conv2d(3, 4, 1), nn.Conv2d(3, 4, 1), nn.Conv2d(3, 4, 1)
        with torch.no_grad():
            self.c.weight.mul_(10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c, b, a = self.c(x), self.b(x), self.a(x)
        return torch.cat([a + b, a + c], 1)


class CatThenAdd(nn.Module):
    """``y`` is a concat input and, with the concat's output, an add input: aligned to the output and the largest."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.conv = nn.Conv2d(3, 4, 1), nn.Conv2d(4, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        y = self.conv(x)
        return torch.cat([x, y], 1)[:, :4] + y


def _data(n: int = 2) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, 3, 8, 8, generator=g) for _ in range(n)]


def _model(cls: type[nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    return cls().eval()


def _calibrated(cls: type[nn.Module], align: bool) -> torch.fx.GraphModule:
    setting = fxq.QuantizationSetting()
    setting.fusion_setting.align_quantization = align
    gm = fxq.prepare(_model(cls), "trt_int8", _data(1)[0], setting=setting)
    return fxq.calibrate(gm, _data(), progress=False, bake=False)


def test_members_record_their_groups_in_graph_order() -> None:
    gm = fxq.prepare(_model(NestedConcat), "trt_int8", _data(1)[0])
    names = list(gm.fxq_quantizers)
    assert names.index("c_out") < names.index("a_out")  # quantizer order is not graph order here
    assert gm.fxq_quantizers["a_out"].aligned == (("output", "cat_out"),)
    assert gm.fxq_quantizers["cat_out"].aligned == (("output", "cat_1_out"),)
    assert gm.fxq_quantizers["cat_1_out"].aligned == ()  # a target records nothing
    assert "align_output" not in vars(gm.meta["fxq"]) and "align_large" not in vars(gm.meta["fxq"])
    # the outer concat's group first: its output's grid then reaches the inner concat's inputs
    assert QuantGraph(gm).alignment_groups() == [AlignGroup("output", ("c_out", "cat_out"), "cat_1_out"),
                                                 AlignGroup("output", ("a_out", "b_out"), "cat_out")]
    gm = fxq.prepare(_model(SharedAdd), "trt_int8", _data(1)[0])
    assert gm.fxq_quantizers["a_out"].aligned == (("largest", ("a_out", "b_out")), ("largest", ("a_out", "c_out")))
    groups = [g for g in QuantGraph(gm).alignment_groups() if g.kind == "largest"]
    assert [g.members for g in groups] == [("a_out", "b_out"), ("a_out", "c_out")]
    gm = fxq.prepare(_model(CatThenAdd), "ort_int8", _data(1)[0])
    assert gm.fxq_quantizers["conv_out"].aligned == (("output", "cat_out"), ("largest", ("cat_out", "conv_out")))
    # every "largest" group first, as the old lists were applied, although the output group was recorded first
    assert QuantGraph(gm).alignment_groups() == [AlignGroup("largest", ("cat_out", "conv_out")),
                                                 AlignGroup("output", ("stem_out", "conv_out"), "cat_out")]


@pytest.mark.parametrize("cls", [NestedConcat, SharedAdd])
def test_alignment_applies_the_groups_in_graph_order(cls: type[nn.Module]) -> None:
    """The aligned scales are the unaligned calibration's, moved group by group in graph order."""
    raw = {n: fq.scale.clone() for n, fq in _calibrated(cls, align=False).fxq_quantizers.items()}
    got = {n: fq.scale for n, fq in _calibrated(cls, align=True).fxq_quantizers.items()}
    if cls is NestedConcat:  # outer concat: cat_out, c <- cat_1_out; then inner: a, b <- cat_out (now cat_1_out's)
        expected = {"a_out": raw["cat_1_out"], "b_out": raw["cat_1_out"], "cat_out": raw["cat_1_out"],
                    "c_out": raw["cat_1_out"]}
    else:  # a + b: both take the larger; then a + c: both take the larger of the new a and c
        ab = torch.maximum(raw["a_out"], raw["b_out"])
        expected = {"b_out": ab, "a_out": torch.maximum(ab, raw["c_out"]), "c_out": torch.maximum(ab, raw["c_out"])}
    if cls is NestedConcat:  # the order shows
        assert not torch.equal(raw["cat_out"], raw["cat_1_out"])
    else:
        assert not torch.equal(expected["a_out"], expected["b_out"])
    for name, scale in expected.items():
        assert torch.equal(got[name], scale), name


def test_qat_replacements_keep_the_record() -> None:
    gm = fxq.prepare_qat(_model(SharedAdd), "trt_int8", _data(1)[0])
    qs = QuantGraph(gm)
    assert isinstance(qs["a_out"], QATFakeQuantize) and qs["b_out"] is qs["a_out"] is qs["c_out"]  # tied
    assert qs["a_out"].aligned == (("largest", ("a_out", "b_out")), ("largest", ("a_out", "c_out")))
    assert [g.members for g in qs.alignment_groups() if g.kind == "largest"] == [("a_out", "b_out"),
                                                                                  ("a_out", "c_out")]
    fq = _calibrated(NestedConcat, align=True).fxq_quantizers["a_out"]
    assert QATFakeQuantize.from_fake_quantize(fq).aligned == fq.aligned == (("output", "cat_out"),)


def test_records_survive_save_and_load(tmp_path) -> None:
    gm = fxq.convert(_calibrated(NestedConcat, align=True))
    again = fxq.load(fxq.save(gm, tmp_path / "nested.fxq"))
    assert {n: fq.aligned for n, fq in again.fxq_quantizers.items()} == {
        n: fq.aligned for n, fq in gm.fxq_quantizers.items()}
    assert QuantGraph(again).alignment_groups() == QuantGraph(gm).alignment_groups()
    x = _data(1)[0]
    with torch.no_grad():
        assert torch.equal(again(x), gm(x))


def test_a_bad_alignment_record_is_refused() -> None:
    gm = fxq.prepare(_model(NestedConcat), "trt_int8", _data(1)[0])
    with pytest.raises(fxq.ConfigError, match="only an activation quantizer"):
        gm.fxq_quantizers["a_weight"].set_alignment([("output", "cat_out")])
    with pytest.raises(fxq.ConfigError, match="'largest'"):
        gm.fxq_quantizers["a_out"].set_alignment([("biggest", ("a_out",))])


def test_records_that_contradict_each_other_still_give_every_group_once() -> None:
    """Members listing two groups in opposite orders (only a hand-edited record does) form a cycle: no hang."""
    gm = fxq.prepare(_model(SharedAdd), "trt_int8", _data(1)[0])
    ab, ac = ("largest", ("a_out", "b_out")), ("largest", ("a_out", "c_out"))
    gm.fxq_quantizers["b_out"].set_alignment([ac, ab])  # a_out lists ab first
    assert sorted(g.entry for g in QuantGraph(gm).alignment_groups() if g.kind == "largest") == [ab, ac]


@pytest.mark.parametrize("cls", [NestedConcat, CatThenAdd])
def test_aligning_again_changes_nothing(cls: type[nn.Module]) -> None:
    """The algorithms re-align after each run: a second pass must keep every parameter (nested concats included)."""
    from fxq.graph.convert import apply_alignment

    gm = _calibrated(cls, align=True)
    first = {n: (fq.scale.clone(), fq.offset.clone()) for n, fq in gm.fxq_quantizers.items()}
    apply_alignment(gm)
    for name, fq in gm.fxq_quantizers.items():
        assert torch.equal(fq.scale, first[name][0]) and torch.equal(fq.offset, first[name][1]), name
