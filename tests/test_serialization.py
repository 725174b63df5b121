"""fxq.save / fxq.load: identical outputs, usable quantizers and meta, no pickled objects, clear errors."""
from __future__ import annotations

import io
import operator
import warnings

import onnx
import pytest
import torch
from torch import nn

import fxq
from fxq.graph.info import GraphQuant, iter_quantizers
from fxq.graph.quant_graph import QuantGraph

from _export_helpers import SmallCNN, quantize_model, small_quantized


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    gm = small_quantized("ppl_cuda_int8")  # per-channel weights, passive int32 biases, baked parameters
    path = fxq.save(gm, tmp_path_factory.mktemp("save") / "model.fxq")
    return gm, path


def test_round_trip_identical_outputs(saved):
    gm, path = saved
    again = fxq.load(path)
    x = torch.randn(4, 3, 16, 16)
    with torch.no_grad():
        assert torch.equal(gm(x), again(x))
    assert again.code == gm.code
    assert [n.name for n in again.graph.nodes] == [n.name for n in gm.graph.nodes]


def test_quantizers_and_meta_survive(saved):
    gm, path = saved
    again = fxq.load(path)
    assert isinstance(again.meta["fxq"], GraphQuant) and again.meta["fxq"] == gm.meta["fxq"]
    assert QuantGraph(again).infos() == QuantGraph(gm).infos()  # role, source, parameter, consumers
    assert again.meta["fxq_setting"] == gm.meta["fxq_setting"]
    for (name, a), (_, b) in zip(iter_quantizers(gm), iter_quantizers(again)):
        assert a.config.to_dict() == b.config.to_dict(), name
        assert b.config.scale is b.scale  # config points at the module's buffers again
        assert a.mode == b.mode
        assert (a.role, a.param, a.derived_from) == (b.role, b.param, b.derived_from), name
        assert a.baked == b.baked and (not a.baked or torch.equal(a.fp32_backup, b.fp32_backup)), name
    for node in gm.graph.nodes:
        other = next(n for n in again.graph.nodes if n.name == node.name)
        assert other.meta.get("fxq") == node.meta.get("fxq")
    assert str(fxq.summary(again)) == str(fxq.summary(gm))


def test_fp32_mode_after_load(saved):
    gm, path = saved
    again = fxq.load(path)
    x = torch.randn(2, 3, 16, 16)
    with fxq.fp32_mode(gm), fxq.fp32_mode(again), torch.no_grad():
        assert torch.equal(gm(x), again(x))  # FP32 backups of the baked weights were saved too


def test_exports_of_the_reloaded_model_are_identical(saved, tmp_path):
    gm, path = saved
    again = fxq.load(path)
    a = fxq.export(gm, "ppl_cuda_int8", tmp_path / "a")
    b = fxq.export(again, "ppl_cuda_int8", tmp_path / "b")
    assert a[0].read_bytes() == b[0].read_bytes() and a[1].read_bytes() == b[1].read_bytes()


def test_file_is_weights_only(saved):
    _, path = saved
    blob = torch.load(path, weights_only=True)
    assert set(blob) == {"format", "version", "spec", "tensors", "sha256"}
    assert all(isinstance(t, torch.Tensor) for t in blob["tensors"].values())


def test_model_from_onnx_round_trip(tmp_path):
    """onnx2torch's modules are rebuilt from their saved attributes."""
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(SmallCNN().eval(), (torch.randn(1, 3, 16, 16),), buf, dynamo=False, opset_version=13,
                          input_names=["images"], output_names=["logits"])
    gm = fxq.load_onnx(onnx.load_from_string(buf.getvalue()))
    q = quantize_model(gm, "trt_int8", shape=(2, 3, 16, 16))
    again = fxq.load(fxq.save(q, tmp_path / "onnx.fxq"))
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        assert torch.equal(q(x), again(x))
    assert again.meta["onnx"] == q.meta["onnx"]


class _Opaque(nn.Module):
    def forward(self, x):
        return x * 2


class _WithOpaqueLeaf(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.opaque = _Opaque()

    def forward(self, x):
        return self.opaque(self.conv(x))


def test_unknown_module_class_is_a_clear_error(tmp_path):
    gm = quantize_model(_WithOpaqueLeaf(), "trt_int8", shape=(1, 3, 8, 8), leaf_modules=[_Opaque])
    with pytest.raises(fxq.FxqError, match="opaque.*register_serializable"):
        fxq.save(gm, tmp_path / "m.fxq")
    assert list(tmp_path.iterdir()) == []
    fxq.serialization.register_serializable(_Opaque)
    again = fxq.load(fxq.save(gm, tmp_path / "m.fxq"))
    x = torch.randn(1, 3, 8, 8)
    with torch.no_grad():
        assert torch.equal(gm(x), again(x))


def test_every_module_class_a_frontend_builds_is_allow_listed():
    """A module class the caffe frontend or fxq's ONNX converters put in a graph must round-trip through ``.fxq``
    (the CLI saves before it reports success): a new frontend class missing from the allow-list fails here."""
    import importlib
    import inspect
    import pkgutil

    import fxq.frontends.onnx.converters as converters
    from fxq.serialization.allowlist import class_name

    modules = [importlib.import_module("fxq.frontends.caffe.modules")]
    modules += [importlib.import_module(f"{converters.__name__}.{m.name}")
                for m in pkgutil.iter_modules(converters.__path__)]
    classes = {cls for module in modules for _, cls in inspect.getmembers(module, inspect.isclass)
               if issubclass(cls, nn.Module) and cls.__module__ == module.__name__ and not inspect.isabstract(cls)
               and not cls.__name__.startswith("_")}
    assert len(classes) > 20
    missing = sorted(f"{c.__module__}.{c.__name__}" for c in classes if class_name(c) is None)
    assert not missing, missing


def test_baked_weights_are_stored_as_codes(saved, tmp_path):
    """Each baked 8-bit weight is saved as int8 codes beside its FP32 backup, not as a second float copy."""
    gm, path = saved
    blob = torch.load(path, weights_only=True)
    infos = QuantGraph(gm).infos()
    weights = {infos[n].param for n, fq in iter_quantizers(gm) if fq.baked
               and infos[n].role == "weight"}
    assert len(weights) >= 3
    assert all(blob["tensors"][w].dtype == torch.int8 for w in weights)
    # the same model with its weights kept as floats (version-1 files) is bigger and loads to the same model
    old = tmp_path / "v1.fxq"
    unpacked = dict(blob, version=1, tensors={k: gm.get_parameter(k).detach() if k in weights else t
                                              for k, t in blob["tensors"].items()})
    unpacked["spec"] = blob["spec"].replace('"packed": {', '"unused": {')
    del unpacked["sha256"]
    torch.save(unpacked, old)
    assert path.stat().st_size < old.stat().st_size
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        assert torch.equal(fxq.load(old)(x), gm(x)) and torch.equal(fxq.load(path)(x), gm(x))


def test_packed_weights_keep_their_dtype(tmp_path):
    """A model quantized in float64 has its baked weights packed and rebuilt as the same float64 values."""
    torch.manual_seed(0)
    gm = fxq.quantize(SmallCNN().eval().double(), [torch.randn(2, 3, 16, 16, dtype=torch.float64)], "trt_int8",
                      progress=False)
    path = fxq.save(gm, tmp_path / "m.fxq")
    infos = QuantGraph(gm).infos()
    weights = [infos[n].param for n, fq in iter_quantizers(gm) if fq.baked]
    blob = torch.load(path, weights_only=True)
    assert weights and all(blob["tensors"][w].dtype == torch.int8 for w in weights)
    again = fxq.load(path)
    assert all(again.get_parameter(w).dtype == torch.float64 for w in weights)
    assert all(torch.equal(again.get_parameter(w), gm.get_parameter(w)) for w in weights)


def test_a_weight_off_its_grid_stays_float(tmp_path):
    """Packing never changes a value: a baked weight edited off the grid is saved as it is."""
    gm = small_quantized("trt_int8")
    infos = QuantGraph(gm).infos()
    name = next(n for n, fq in iter_quantizers(gm) if fq.baked)
    weight = gm.get_parameter(infos[name].param)
    with torch.no_grad():
        weight.view(-1)[0] += 1e-3 * float(gm.fxq_quantizers[name].scale.reshape(-1)[0])
    path = fxq.save(gm, tmp_path / "m.fxq")
    assert torch.load(path, weights_only=True)["tensors"][infos[name].param].dtype == torch.float32
    assert torch.equal(fxq.load(path).get_parameter(infos[name].param), weight.detach())


def test_bad_files(tmp_path):
    with pytest.raises(fxq.FrontendError, match="does not exist"):
        fxq.load(tmp_path / "missing.fxq")
    (tmp_path / "junk.fxq").write_bytes(b"not a model")
    with pytest.raises(fxq.FrontendError, match="not a readable"):
        fxq.load(tmp_path / "junk.fxq")
    torch.save({"format": "something else"}, tmp_path / "other.fxq")
    with pytest.raises(fxq.FrontendError, match="not an fxq model"):
        fxq.load(tmp_path / "other.fxq")
    with pytest.raises(fxq.FxqError, match="GraphModule"):
        fxq.save(SmallCNN(), tmp_path / "m.fxq")
    gm = small_quantized("trt_int8")
    (tmp_path / "a_file").write_bytes(b"")
    with pytest.raises(fxq.ExportError, match="a_file.*is a file, not a folder"):
        fxq.save(gm, tmp_path / "a_file" / "sub" / "m.fxq")
    saved = fxq.save(gm, tmp_path / "new" / "sub" / "m.fxq")  # a missing folder is made, as fxq.export does
    assert saved.is_file() and fxq.load(saved) is not None


def test_files_cannot_name_io_functions():
    from fxq.serialization.allowlist import function_name, resolve_function

    assert resolve_function(function_name(torch.conv2d)) is torch.conv2d
    refused = ("torch:save", "torch:load", "torch:from_file", "operator:attrgetter", "operator:methodcaller",
               "operator:call", "torch:set_default_tensor_type", "torch:set_rng_state", "torch:_load_global_deps",
               "torch:Tensor", "torch:Generator", "builtins:eval", "torch:__import__")
    for name in refused:
        with pytest.raises(fxq.NotSupportedError):
            resolve_function(name)
    assert function_name(operator.attrgetter) is None  # refused at save time too


def _resave(blob, path):
    """Write an edited blob with a matching sha256, so only the check under test can refuse it."""
    blob["sha256"] = fxq.serialization.file_digest(blob["spec"], blob["tensors"])
    torch.save(blob, path)


class _Shape(nn.Module):
    def forward(self, x):
        return x * x.shape[0]


@pytest.mark.parametrize("edit", [
    ('"shape"', '"__class__"'),           # getattr(x, "__class__"): the first step to __globals__
    ('"shape"', '"_version"'),            # any private attribute
    ('"$function": "builtins:getattr"', '"$function": "operator:attrgetter"'),
])
def test_a_file_cannot_walk_to_arbitrary_objects(tmp_path, edit):
    """A crafted file must not reach an object's __globals__ (and call os.system from there) through getattr,
    attrgetter or dunder get_attr paths: the node is refused when the file is read."""
    gm = torch.fx.symbolic_trace(_Shape())
    path = fxq.save(gm, tmp_path / "m.fxq")
    blob = torch.load(path, weights_only=True)
    assert edit[0] in blob["spec"]
    blob["spec"] = blob["spec"].replace(*edit)
    _resave(blob, tmp_path / "crafted.fxq")
    with pytest.raises(fxq.NotSupportedError, match="not allowed"):
        fxq.load(tmp_path / "crafted.fxq")


def test_get_attr_paths_through_dunders_are_refused():
    from fxq.serialization.allowlist import check_node

    with pytest.raises(fxq.NotSupportedError, match="dunder"):
        check_node("get_attr", "conv.__class__.__init__.__globals__", ())
    check_node("get_attr", "_tensor_constant0", ())  # fx's own constants are fine


def test_module_attributes_cannot_be_dunders(saved, tmp_path):
    _, path = saved
    blob = torch.load(path, weights_only=True)
    blob["spec"] = blob["spec"].replace('"attrs": {', '"attrs": {"__class__": 1, ', 1)
    _resave(blob, tmp_path / "crafted.fxq")
    with pytest.raises(fxq.NotSupportedError, match="not allowed"):
        fxq.load(tmp_path / "crafted.fxq")


def test_same_model_same_bytes(saved, tmp_path):
    """No temp file name, object id or dict order in the file: two saves, and a save of the loaded model, agree."""
    gm, path = saved
    other = fxq.save(gm, tmp_path / "another_name.fxq")
    assert other.read_bytes() == path.read_bytes()
    again = fxq.save(fxq.load(path), tmp_path / "again.fxq")
    assert again.read_bytes() == path.read_bytes()
    assert b".tmp" not in path.read_bytes() and b"another_name" not in other.read_bytes()


def test_version_2_files_without_checksum_still_load(saved, tmp_path):
    gm, path = saved
    blob = torch.load(path, weights_only=True)
    del blob["sha256"]
    blob["version"] = 2
    torch.save(blob, tmp_path / "v2.fxq")
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        assert torch.equal(fxq.load(tmp_path / "v2.fxq")(x), gm(x))


def test_save_to_a_directory_is_refused(saved, tmp_path):
    gm, _ = saved
    (tmp_path / "out").mkdir()
    for target in (tmp_path / "out", f"{tmp_path / 'out'}/", f"{tmp_path / 'missing'}/"):
        with pytest.raises(fxq.ExportError, match="directory"):
            fxq.save(gm, target)
    assert list((tmp_path / "out").iterdir()) == [] and not (tmp_path / "missing").exists()
    with pytest.raises(fxq.FrontendError, match="directory"):
        fxq.load(tmp_path / "out")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_map_location_cuda_without_cuda_is_explained(saved):
    _, path = saved
    with pytest.raises(fxq.ConfigError, match="CUDA is not available.*map_location=\"cpu\""):
        fxq.load(path, map_location="cuda")


class _Grids(nn.Module):
    """Ops torch.export keeps as aten ops outside the old hand-written list: linspace, meshgrid, grid_sampler
    (RAFT's coordinate grids and bilinear sampling); repeat / expand lift to Tensor methods."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        n, _, h, w = y.shape
        gy, gx = torch.meshgrid(torch.linspace(-1, 1, h), torch.linspace(-1, 1, w), indexing="ij")
        grid = torch.stack((gx, gy), dim=-1)[None].repeat(n, 1, 1, 1) * 0.9
        out = nn.functional.grid_sample(y, grid, align_corners=False)
        return out + y.mean(dim=1, keepdim=True).expand(-1, 4, -1, -1)


def test_export_captured_aten_ops_round_trip(tmp_path):
    """An export capture keeps aten.linspace / meshgrid / grid_sampler; its file loads and gives the same outputs
    bit for bit (before the rule-based aten allow-list, fxq.save refused them)."""
    g = torch.Generator().manual_seed(0)
    data = [torch.rand(2, 3, 12, 12, generator=g) for _ in range(2)]
    q = fxq.quantize(_Grids().eval(), data, "trt_int8", progress=False, capture="export")
    aten_ops = {n.target._schema.name for n in q.graph.nodes
                if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)}
    assert {"aten::linspace", "aten::meshgrid", "aten::grid_sampler"} <= aten_ops
    again = fxq.load(fxq.save(q, tmp_path / "grids.fxq"))
    with torch.no_grad():
        assert torch.equal(again(data[1]), q(data[1]))


class _Anchors(nn.Module):
    """Tensor methods torch.export keeps as their aten ops (``aten.type_as``, ``aten.view_as``...): Ultralytics'
    ``make_anchors`` writes ``torch.arange(w).type_as(feats)``; ``h, w = y.shape[2:]`` sends fxq to torch.export."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        h, w = y.shape[2:]
        sx = torch.arange(w).type_as(y) + 0.5
        sy = torch.arange(h).to(torch.float32).view_as(torch.empty(h, 1)) + 0.5
        return (y + sx + sy).reshape_as(y)


def test_export_captured_tensor_methods_round_trip(tmp_path):
    """They were refused by fxq.save ("aten::type_as ... not in the allow-list") after a capture that worked."""
    g = torch.Generator().manual_seed(0)
    data = [torch.rand(1, 3, 8, 8, generator=g) for _ in range(2)]
    from fxq.serialization.allowlist import function_name, resolve_function

    q = fxq.quantize(_Anchors().eval(), data, "trt_int8", progress=False, capture="export")
    for op in (torch.ops.aten.type_as.default, torch.ops.aten.view_as.default, torch.ops.aten.reshape_as.default):
        assert resolve_function(function_name(op)) is op  # a graph handed over unlifted keeps them
    again = fxq.load(fxq.save(q, tmp_path / "anchors.fxq"))
    with torch.no_grad():
        assert torch.equal(again(data[1]), q(data[1]))


def test_aten_rule_admits_only_functional_safe_overloads():
    """The aten rule over torch's whole registry: nothing admitted writes its arguments (but copy_), takes a
    storage or a free string, or is a memory / file op, even when torch tags it core (as_strided is)."""
    from fxq.serialization import allowlist

    verdicts = allowlist._aten_verdicts()
    admitted = [op for op, why in verdicts.values() if why is None]
    assert len(admitted) > 500 and len(verdicts) > 2 * len(admitted)
    for op in admitted:
        schema, base = op._schema, op._schema.name.split("::")[1]
        assert not schema.is_mutable or base == "copy_", op
        assert not allowlist._ATEN_NEVER.search(base), op
        assert all("Storage" not in str(a.type) for a in schema.arguments), op
        assert all("str" not in str(a.type) or a.name in allowlist._ATEN_STR_ARGS for a in schema.arguments), op
    assert torch.Tag.core in torch.ops.aten.as_strided.default.tags
    for op in (torch.ops.aten.as_strided.default, torch.ops.aten.from_file.default, torch.ops.aten.resize_.default,
               torch.ops.aten.set_.source_Storage, torch.ops.aten._unsafe_index.Tensor, torch.ops.aten.add_.Tensor,
               torch.ops.aten.add.out):
        assert allowlist.aten_refusal(op) is not None and allowlist.function_name(op) is None
    assert allowlist.function_name(torch.ops.aten.relu) is None  # packets: the overload is picked at run time
    assert allowlist.resolve_function("torch.ops:aten::repeat.default") is torch.ops.aten.repeat.default


def test_saving_a_refused_aten_op_says_why(tmp_path):
    g = torch.fx.Graph()
    x = g.placeholder("x")
    g.output(g.call_function(torch.ops.aten.as_strided.default, (x, [2], [1])))
    with pytest.raises(fxq.NotSupportedError, match="as_strided.*reinterprets or resizes memory"):
        fxq.save(torch.fx.GraphModule(nn.Module(), g), tmp_path / "m.fxq")


def test_each_reader_names_the_other_for_its_file(tmp_path):
    """fxq.load and fxq.load_onnx raise FrontendError for a file they cannot read, naming the file and the reader
    or fix, and never pass on torch's advice to load with weights_only=False (which runs the file's code)."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2])])
    onnx_file = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), onnx_file)
    fxq_file = fxq.save(small_quantized("trt_int8"), tmp_path / "m.fxq")
    with pytest.raises(fxq.FrontendError, match=r"m\.onnx.*is an ONNX model.*fxq\.load_onnx"):
        fxq.load(onnx_file)
    with pytest.raises(fxq.FrontendError, match=r"m\.fxq.*not ONNX.*fxq\.load\b"):
        fxq.load_onnx(fxq_file)
    junk = tmp_path / "junk.fxq"
    junk.write_bytes(b"\x80\x02garbage")
    with pytest.raises(fxq.FrontendError, match=r"junk\.fxq.*not a readable fxq model file.*fxq\.save") as info:
        fxq.load(junk)
    assert "weights_only" not in str(info.value)
    blob = torch.load(fxq_file, weights_only=True)
    torch.save(dict(blob, version=99), tmp_path / "future.fxq")
    with pytest.raises(fxq.FrontendError, match=r"future\.fxq.*version 99.*upgrade fxq"):
        fxq.load(tmp_path / "future.fxq")
    torch.save({"state_dict": {"w": torch.zeros(2)}}, tmp_path / "other.pt")
    with pytest.raises(fxq.FrontendError, match=r"other\.pt.*another tool.*fxq\.quantize"):
        fxq.load(tmp_path / "other.pt")


def test_a_model_that_ran_its_bound_calls_saves_as_before(tmp_path):
    """After repeated inference the quantizers hold shortcuts to compiled graphs (eager bookkeeping): the file
    leaves them out, so it is the same bytes as the model's file before it ran."""
    from fxq.fused_cpu import cpu_fusion

    gm = small_quantized("trt_int8")
    before = fxq.save(gm, tmp_path / "before.fxq").read_bytes()
    x = torch.randn(2, 3, 32, 32)
    with cpu_fusion(min_numel=0, warmup_seconds=0), torch.no_grad():
        want = [gm(x) for _ in range(3)][-1]
    assert any(getattr(m, "_shortcut", None) is not None for m in gm.modules())
    after = fxq.save(gm, tmp_path / "after.fxq")
    assert after.read_bytes() == before
    torch.testing.assert_close(fxq.load(after)(x), want, rtol=0, atol=0)
