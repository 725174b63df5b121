"""The quantizer record (on the FakeQuantize) and the QuantGraph view over a prepared graph."""
import json

import pytest
import torch
from torch import nn

import fxq
from fxq.errors import GraphError
from fxq.graph.quant_graph import QuantGraph
from fxq.serialization import file_digest
from fxq.spec import QuantState

from _models import small_cnn


def _data(n=2):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, 3, 16, 16, generator=g) for _ in range(n)]


@pytest.fixture(scope="module")
def ppl():
    return fxq.quantize(small_cnn(), _data(), "ppl_cuda_int8", progress=False)


def test_queries_come_from_the_record_and_the_graph(ppl):
    qg = QuantGraph(ppl)
    assert len(qg) == len(ppl.fxq_quantizers) and {fq.role for _, fq in qg.quantizers()} == {
        "activation", "weight", "bias"}
    for name, fq in qg.quantizers():
        node = qg.node_of(name)
        assert (fq.param is not None) == (qg.source(name) == node.args[0].name and node.args[0].op == "get_attr")
        assert qg.from_parameters(node) == (fq.role != "activation")
    biases = list(qg.biases())
    assert biases and all(qg.role(w) == "weight" and qg.role(d) == "activation" for _, _, d, w in biases)
    assert not any("fxq_quantizer" in n.meta for n in ppl.graph.nodes) and "fxq_quantizer_infos" not in ppl.meta
    assert not hasattr(next(iter(ppl.fxq_quantizers.values())), "source")  # read from the graph, never stored


def test_tied_qat_quantizers_keep_their_own_sources():
    """prepare_qat ties a concat's aligned quantizers into one module; each name still quantizes its own node."""

    class Joined(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Conv2d(3, 4, 1), torch.nn.Conv2d(3, 4, 1)
            self.c = torch.nn.Conv2d(8, 2, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.c(torch.cat([self.a(x), self.b(x)], 1))

    gm = fxq.prepare_qat(Joined(), "trt_int8", _data(1)[0])
    qg = QuantGraph(gm)
    assert qg["a_out"] is qg["b_out"]  # tied
    assert (qg.source("a_out"), qg.source("b_out")) == ("a", "b")
    assert qg.consumers("a_out") == qg.consumers("b_out") == ["cat"]


def test_a_missing_role_is_an_error():
    gm = fxq.prepare(small_cnn(), "trt_int8", _data(1)[0])
    next(iter(gm.fxq_quantizers.values())).role = None
    with pytest.raises(GraphError, match="has no role"):
        QuantGraph(gm)
    with pytest.raises(fxq.ConfigError, match="role"):
        gm.fxq_quantizers[next(iter(gm.fxq_quantizers))].set_record("input")


def test_state_dict_holds_the_fp32_backup_and_moves_with_the_module(ppl):
    sd = ppl.state_dict()
    backups = {k for k in sd if k.endswith(".fp32_backup")}
    assert backups == {f"fxq_quantizers.{n}.fp32_backup" for n, fq in QuantGraph(ppl).weights() if fq.baked}
    fresh = fxq.prepare(small_cnn(), "ppl_cuda_int8", _data(1)[0])
    fresh.load_state_dict(sd)
    x = _data(1)[0]
    with torch.no_grad():
        assert torch.equal(fresh(x), ppl(x))
        with fxq.fp32_mode(fresh), fxq.fp32_mode(ppl):
            assert torch.equal(fresh(x), ppl(x))  # the restored backups are the FP32 weights
    double = fresh.double()
    for _, fq in QuantGraph(double).quantizers():
        assert fq.config.scale is fq.scale and fq.scale.dtype == torch.float64
        assert not fq.baked or fq.fp32_backup.dtype == torch.float64


def test_quantize_bakes_each_weight_once(monkeypatch):
    import fxq.graph.convert as convert

    baked = []
    real = convert.bake_parameters

    def counting(gm):
        before = {n for n, fq in QuantGraph(gm).weights() if fq.baked}
        real(gm)
        baked.extend(n for n, fq in QuantGraph(gm).weights() if fq.baked and n not in before)

    monkeypatch.setattr(convert, "bake_parameters", counting)
    monkeypatch.setattr("fxq.graph.calibrate.bake_parameters", counting)
    monkeypatch.setattr("fxq.algorithms.blocks.bake_parameters", counting)
    setting = fxq.QuantizationSetting()
    setting.bias_correct = True
    q = fxq.quantize(small_cnn(), _data(), "ppl_cuda_int8", setting=setting, progress=False)
    assert sorted(baked) == sorted(n for n, fq in QuantGraph(q).weights() if fq.baked) and baked


def _as_legacy(spec: dict, sources: dict[str, str]) -> dict:
    """``spec`` as fxq wrote it before the record moved onto the FakeQuantize (``sources``: each quantizer's node
    input, which the old record stored)."""
    infos, deps = {}, {}
    for rec in spec["modules"]:
        if not rec.get("class", "").startswith("fxq.nn.fake_quantize:"):
            continue
        attrs = rec["attrs"]
        name = rec["path"].rpartition(".")[2]
        role, param, derived = (attrs.pop(k) for k in ("role", "param", "derived_from"))
        infos[name] = {"$record": ["QuantizerInfo", {"name": name, "role": role, "source": sources[name],
                                                     "consumers": [], "param": param}]}
        if derived is not None:
            deps[name] = derived
        if "fp32_backup" in rec["buffers"]:
            attrs["_fp32_backup"] = {"$tensor": rec["buffers"].pop("fp32_backup")[0]}
        else:
            rec["none_buffers"].remove("fp32_backup")
            attrs["_fp32_backup"] = None
    spec["meta"]["fxq_quantizer_infos"] = infos
    spec["meta"]["fxq"]["$record"][1]["bias_deps"] = deps
    for node in spec["graph"]:
        target = node.get("target")
        if node["op"] == "call_module" and isinstance(target, str) and target.startswith("fxq_quantizers."):
            node["meta"]["fxq_quantizer"] = infos[target.partition(".")[2]]
    return spec


def _with_alignment_lists(spec: dict, groups: list) -> dict:
    """``spec`` as fxq wrote it before alignment moved onto the quantizers: no ``aligned`` record, the groups in
    the ``align_large`` / ``align_output`` fields of ``gm.meta["fxq"]`` (``groups``: in graph order)."""
    for rec in spec["modules"]:
        if rec.get("class", "").startswith("fxq.nn.fake_quantize:"):
            del rec["attrs"]["aligned"]
    fields = spec["meta"]["fxq"]["$record"][1]
    fields["align_large"] = [list(g.members) for g in groups if g.kind == "largest"]
    fields["align_output"] = [{"$tuple": [list(g.members), g.target]} for g in groups if g.kind == "output"]
    return spec


def test_files_saved_before_the_record_moved_still_load(ppl, tmp_path):
    path = fxq.save(ppl, tmp_path / "new.fxq")
    blob = torch.load(path, weights_only=True)
    qg = QuantGraph(ppl)
    spec = _with_alignment_lists(json.loads(blob["spec"]), qg.alignment_groups())
    spec = json.dumps(_as_legacy(spec, {name: qg.source(name) for name, _ in qg.quantizers()}))
    old = tmp_path / "old.fxq"
    torch.save(dict(blob, spec=spec, sha256=file_digest(spec, blob["tensors"])), old)
    again = fxq.load(old)
    a, b = QuantGraph(ppl), QuantGraph(again)
    assert a.infos() == b.infos()
    for (name, x), (_, y) in zip(a.quantizers(), b.quantizers()):
        assert (x.role, x.param, x.derived_from, x.aligned) == (y.role, y.param, y.derived_from, y.aligned), name
        assert x.baked == y.baked and (not x.baked or torch.equal(x.fp32_backup, y.fp32_backup)), name
    assert "fxq_quantizer_infos" not in again.meta and not any("fxq_quantizer" in n.meta for n in again.graph.nodes)
    x = _data(1)[0]
    with torch.no_grad():
        assert torch.equal(again(x), ppl(x))
        with fxq.fp32_mode(again), fxq.fp32_mode(ppl):
            assert torch.equal(again(x), ppl(x))
    assert fxq.load(fxq.save(again, tmp_path / "again.fxq")).state_dict().keys() == ppl.state_dict().keys()


def test_files_saved_with_alignment_lists_still_load(ppl, tmp_path):
    """Files written while the records were on the quantizers but alignment was in lists beside them."""
    path = fxq.save(ppl, tmp_path / "new.fxq")
    blob = torch.load(path, weights_only=True)
    qg = QuantGraph(ppl)
    groups = qg.alignment_groups()
    assert {g.kind for g in groups} == {"largest", "output"}
    spec = json.dumps(_with_alignment_lists(json.loads(blob["spec"]), groups))
    old = tmp_path / "old.fxq"
    torch.save(dict(blob, spec=spec, sha256=file_digest(spec, blob["tensors"])), old)
    again = fxq.load(old)
    assert {n: fq.aligned for n, fq in again.fxq_quantizers.items()} == {
        n: fq.aligned for n, fq in ppl.fxq_quantizers.items()}
    assert QuantGraph(again).alignment_groups() == groups
    assert not hasattr(again.meta["fxq"], "align_large") and not hasattr(again.meta["fxq"], "align_output")
    x = _data(1)[0]
    with torch.no_grad():
        assert torch.equal(again(x), ppl(x))
    resaved = json.loads(torch.load(fxq.save(again, tmp_path / "again.fxq"), weights_only=True)["spec"])
    assert "align_large" not in resaved["meta"]["fxq"]["$record"][1]


def test_a_damaged_alignment_record_is_refused(ppl, tmp_path):
    blob = torch.load(fxq.save(ppl, tmp_path / "new.fxq"), weights_only=True)
    spec = json.loads(blob["spec"])
    rec = next(r for r in spec["modules"] if r["path"] == "fxq_quantizers.add_out")
    rec["attrs"]["aligned"] = {"$tuple": [{"$tuple": ["output", 3]}]}
    spec = json.dumps(spec)
    torch.save(dict(blob, spec=spec, sha256=file_digest(spec, blob["tensors"])), tmp_path / "bad.fxq")
    with pytest.raises(fxq.FrontendError, match="add_out.*alignment"):
        fxq.load(tmp_path / "bad.fxq")


def test_state_dicts_saved_before_the_backup_was_a_buffer_load(ppl, caplog):
    sd = {k: v for k, v in ppl.state_dict().items() if not k.endswith(".fp32_backup")}
    fresh = fxq.quantize(small_cnn(), _data(), "ppl_cuda_int8", progress=False)
    with caplog.at_level("WARNING", logger="fxq.nn.fake_quantize"):
        fresh.load_state_dict(sd)  # strict: no missing key
    assert "no FP32 copy" in caplog.text  # fp32_mode cannot restore them: said, not silent
    assert not QuantGraph(fresh).is_baked()  # the incoming state has no FP32 copies: none is invented
    states = {fq.config.state for _, fq in QuantGraph(fresh).weights()}
    assert states <= {QuantState.BAKED, QuantState.PASSIVE_BAKED}


def test_a_standalone_fake_quantize_has_no_record():
    fq = fxq.FakeQuantize(fxq.TensorQuantConfig(num_bits=8))
    assert fq.role is None and not fq.baked and "fp32_backup" not in fq.state_dict()
    holder = nn.Module()
    holder.fxq_quantizers = nn.ModuleDict({"q": fq})
    with pytest.raises(GraphError, match="no role"):
        QuantGraph(holder)


class _TwiceApplied(nn.Module):
    """One Linear applied twice: two weight quantizers, alike, on one parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.fc(x))


def test_a_weight_quantized_twice_alike_is_baked_once():
    """The second quantizer baked the already baked weight and kept that as its FP32 copy, so fp32_mode and the
    FP32 ncnn file ran on quantized weights (0.003 off the model)."""
    torch.manual_seed(0)
    model = _TwiceApplied().eval()
    gm = fxq.quantize(model, [torch.randn(1, 6, 8) for _ in range(2)], "trt_int8", progress=False)
    weights = [fq for _, fq in QuantGraph(gm).weights() if fq.param == "fc.weight"]
    assert len(weights) == 2 and all(fq.baked for fq in weights)
    assert all(torch.equal(fq.fp32_backup, model.fc.weight) for fq in weights)
    x = torch.randn(1, 6, 8)
    with torch.no_grad(), fxq.fp32_mode(gm):
        assert torch.equal(gm(x), model(x))
    with torch.no_grad():
        sim = gm(x)
        fxq.switch_to_fp32(gm)
        assert torch.equal(gm.fc.weight, model.fc.weight)
        fxq.switch_to_quantized(gm)
        assert torch.equal(gm(x), sim)


class _TiedReadUnquantized(nn.Module):
    """A weight a Linear quantizes and another op reads as it is (a tied embedding's FP32 lookup)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.fc.weight.abs().mean()


def test_a_weight_read_unquantized_too_stays_fp32():
    """Baked, the weight handed its quantized values to the op that reads it unquantized."""
    torch.manual_seed(0)
    model = _TiedReadUnquantized().eval()
    gm = fxq.quantize(model, [torch.randn(1, 6, 8) for _ in range(2)], "trt_int8", progress=False)
    (fq,) = [fq for _, fq in QuantGraph(gm).weights() if fq.param == "fc.weight"]
    assert not fq.baked and fq.config.state is QuantState.ACTIVATED
    assert torch.equal(gm.fc.weight, model.fc.weight)
    seen = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            if n.op == "call_method" and n.target == "mean":
                seen["mean"] = out
            return out

    with torch.no_grad():
        Recorder(gm).run(torch.randn(1, 6, 8))
    assert torch.equal(seen["mean"], model.fc.weight.abs().mean())


def test_an_unbaked_weight_keeps_its_fake_quantized_value_until_it_changes():
    """The tied weight above is not baked, so each forward fake-quantized it again (a GPT-2 with 50 K tokens ran
    its quantized forward at 3.6x FP32 instead of 1.6x): its quantizer keeps the result while the weight and the
    parameters are unchanged, and only then."""
    from fxq.functional import fake_quantize

    torch.manual_seed(0)
    gm = fxq.quantize(_TiedReadUnquantized().eval(), [torch.randn(1, 6, 8) for _ in range(2)], "trt_int8",
                      progress=False)
    (fq,) = [fq for _, fq in QuantGraph(gm).weights() if fq.param == "fc.weight"]
    w = gm.fc.weight
    with torch.no_grad():
        first = fq(w)
        assert fq(w) is first and torch.equal(first, fake_quantize(w, fq.config, fq.scale, fq.offset))
        w.add_(0.5)  # the weight changes in place: recomputed
        moved = fq(w)
        assert moved is not first and torch.equal(moved, fake_quantize(w, fq.config, fq.scale, fq.offset))
        fq.scale.mul_(2)  # so do its parameters
        assert torch.equal(fq(w), fake_quantize(w, fq.config, fq.scale, fq.offset))
        for _ in range(2):  # new tensors behind the Parameter: the kept one's storage is held, so never reused
            w.data = torch.randn_like(w)
            assert torch.equal(fq(w), fake_quantize(w, fq.config, fq.scale, fq.offset))
    with torch.inference_mode():
        fq(w)  # not kept: an inference tensor cannot be saved for a later backward
    x = torch.randn(2, 8, requires_grad=True)
    torch.nn.functional.linear(x, fq(w)).sum().backward()
    assert x.grad is not None
    w.requires_grad_(True)
    out = fq(w)  # a gradient to record: computed, never kept
    assert out.requires_grad and out is not fq(w)
    w.requires_grad_(False)
    fxq.switch_to_fp32(gm)  # unbaking drops what was kept
    fxq.switch_to_quantized(gm, bake=False)
    with torch.no_grad():
        assert fq(w) is not fq(w)


class _TiedEmbedding(nn.Module):
    """A language model's head tied to its embedding (``head.weight is embed.weight``: one tensor, two names)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(16, 8), nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        e = self.embed(ids)
        return self.head(torch.relu(e)), e


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_tied_weight_under_two_names_is_read_as_fp32_by_the_lookup(capture):
    """The review found the readers grouped by name: the head's quantizer baked the tensor its embedding lookup
    reads (0.012 off FP32), and fp32_mode could not restore it."""
    torch.manual_seed(0)
    model = _TiedEmbedding().eval()
    ids = [torch.randint(0, 16, (1, 6)) for _ in range(2)]
    gm = fxq.quantize(model, ids, "trt_int8", progress=False, capture=capture)
    with torch.no_grad():
        _, e = gm(ids[0])
        assert torch.equal(e, model.embed(ids[0]))
        with fxq.fp32_mode(gm):
            assert all(torch.equal(a, b) for a, b in zip(gm(ids[1]), model(ids[1])))
