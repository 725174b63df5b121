"""Crafted .fxq files: fxq.load must refuse each with an FxqError and run none of the file's code.

Every file is a real ``fxq.save`` output edited afterwards, with its sha256 recomputed, so the check under test
(names, allow-lists, structure) is what stops it, not the checksum. Payloads try to create a marker file in
``tmp_path``; each test asserts that it does not exist and that no file there changed.
"""
from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

import fxq
from fxq.serialization import file_digest
from fxq.serialization.codec import Unencodable


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.register_buffer("scale", torch.ones(1))
        self.seq = nn.Sequential(nn.ReLU())

    def forward(self, x):
        y = torch.relu(self.conv(x)) * self.scale
        y = torch.flatten(self.seq(y), start_dim=1)
        return y.view(y.shape[0], -1).sum(dim=1)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The saved toy model: (blob, doc)."""
    torch.manual_seed(0)
    path = fxq.save(torch.fx.symbolic_trace(Toy()), tmp_path_factory.mktemp("base") / "toy.fxq")
    blob = torch.load(path, weights_only=True)
    return blob, json.loads(blob["spec"])


def _node(doc, name):
    return next(n for n in doc["graph"] if n["name"] == name)


def _module(doc, path):
    return next(m for m in doc["modules"] if m["path"] == path)


def _snapshot(folder):
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns, p.read_bytes()) for p in folder.iterdir() if p.is_file()}


def _write(blob, doc, path, rehash=True):
    blob = dict(blob, spec=json.dumps(doc) if doc is not None else blob["spec"])
    if rehash:
        blob["sha256"] = file_digest(blob["spec"], blob["tensors"])
    torch.save(blob, path)
    return path


def _refused(path, tmp_path, marker):
    before = _snapshot(tmp_path)
    with pytest.raises(fxq.FxqError) as info:
        fxq.load(path)
    print(f"refused: {type(info.value).__name__}: {info.value}")
    # refused by a check, not by a check that crashed (load wraps every exception in FrontendError)
    cause = info.value.__cause__
    crashed = isinstance(cause, (TypeError, KeyError, AttributeError, IndexError, NameError))
    assert not crashed or isinstance(cause, Unencodable), repr(cause)
    assert not marker.exists()
    assert _snapshot(tmp_path) == before
    return info.value


def _payload(marker) -> str:
    return f"__import__('os').system('touch {marker}')"


# ------------------------------------------------------------------ edits of the spec (doc) by attack class
def _edits(m: str) -> dict[str, callable]:
    """Edits by id; ``m`` is the marker payload (Python source that would create the marker file)."""
    brk = f'")\n    {m}\n    #'  # a quote and a newline: out of getattr(self, "...") into the method body
    e: dict[str, callable] = {}

    def put(key):
        def deco(fn):
            e[key] = fn
            return fn
        return deco

    # --- names that reach torch.fx's generated source
    @put("placeholder-target-default-arg")
    def _(d):
        _node(d, "x")["target"] = f"x={m}"

    @put("placeholder-target-annotation")
    def _(d):
        _node(d, "x")["target"] = f"x: {m}"

    @put("placeholder-target-star-kwargs")
    def _(d):
        _node(d, "x")["target"] = f"**{m}"

    @put("placeholder-default-function")
    def _(d):
        _node(d, "x")["args"] = {"$tuple": [{"$function": "torch:relu"}]}

    @put("placeholder-default-nan")
    def _(d):
        _node(d, "x")["args"] = {"$tuple": [{"$float": "nan"}]}

    @put("placeholder-kwargs")
    def _(d):
        _node(d, "x")["kwargs"] = {"default": 1}

    @put("placeholder-target-self")
    def _(d):
        _node(d, "x")["target"] = "self"

    @put("node-name-code")
    def _(d):
        _node(d, "relu")["name"] = f"relu = {m}; y"

    @put("node-name-newline")
    def _(d):
        _node(d, "relu")["name"] = f"relu\n{m}"

    @put("node-name-dunder")
    def _(d):
        _node(d, "relu")["name"] = "__builtins__"

    @put("node-name-keyword")
    def _(d):
        _node(d, "relu")["name"] = "import"

    @put("node-name-duplicate")
    def _(d):
        _node(d, "relu")["name"] = "conv"

    @put("node-name-shadows-torch")
    def _(d):
        _node(d, "relu")["name"] = "torch"

    @put("kwargs-key-code")
    def _(d):
        _node(d, "flatten")["kwargs"] = {f"start_dim={m}, end_dim": 1}

    @put("kwargs-key-dunder")
    def _(d):
        _node(d, "flatten")["kwargs"] = {"__class__": 1}

    @put("kwargs-as-$dict")
    def _(d):
        _node(d, "flatten")["kwargs"] = {"$dict": [[{"$tuple": [1]}, 1]]}

    @put("get_attr-quote-newline")
    def _(d):
        _node(d, "scale")["target"] = f"scale{brk}"

    @put("get_attr-dunder-walk")
    def _(d):
        _node(d, "scale")["target"] = "conv.__class__.__init__.__globals__"

    @put("get_attr-undefined")
    def _(d):
        _node(d, "scale")["target"] = "conv.padding_mode"

    @put("get_attr-graphmodule-internals")
    def _(d):
        _node(d, "scale")["target"] = "_code"

    @put("call_module-quote-newline")
    def _(d):
        _node(d, "conv")["target"] = f"conv{brk}"

    @put("call_module-parameter")
    def _(d):
        _node(d, "conv")["target"] = "conv.weight"

    @put("call_module-root")
    def _(d):
        _node(d, "conv")["target"] = ""

    @put("call_method-dunder")
    def _(d):
        _node(d, "view")["target"] = "__reduce_ex__"

    @put("call_method-dotted")
    def _(d):
        _node(d, "view")["target"] = "__class__.__init__"

    for method in ("storage", "untyped_storage", "set_", "share_memory_", "apply_", "map_", "data_ptr",
                   "register_hook", "numpy", "tofile", "backward"):
        put(f"call_method-{method}")(lambda d, method=method: _node(d, "view").update(target=method))

    # --- functions
    for fn in ("builtins:eval", "builtins:exec", "builtins:open", "builtins:__import__", "builtins:compile",
               "os:system", "subprocess:Popen", "importlib:import_module", "torch:from_file", "torch:load",
               "torch:save", "torch:manual_seed", "torch:set_default_dtype", "torch:_C._set_grad_enabled",
               "torch.ops:aten::from_file", "torch.ops:aten::from_file.default", "torch.ops:aten::save",
               "torch.ops:aten::set_.source_Storage", "torch.ops:load_library", "torch.ops:aten::__class__",
               "torch.ops:import_module", "torch.hub:load", "torch.classes:load_library", "operator:attrgetter",
               "operator:methodcaller", "operator:call", "operator:itemgetter", "torch:relu.__globals__",
               "torch.nn.functional:__builtins__", "torch.nn.functional:sys", "torch:Tensor", "torch:Generator",
               "torch.serialization:load", "sys:modules", "torch:__import__", "builtins:getattr.__self__",
               "torch.nn.functional:torch"):
        put(f"function-{fn}")(lambda d, fn=fn: _node(d, "relu")["target"].update({"$function": fn}))

    @put("function-as-argument")
    def _(d):
        _node(d, "getitem")["args"] = {"$tuple": [{"$node": "getattr_1"}, {"$function": "builtins:eval"}]}

    @put("function-target-not-a-name")
    def _(d):
        _node(d, "relu")["target"] = {"$function": {"$function": "torch:relu"}}

    @put("function-target-plain-string")
    def _(d):
        _node(d, "relu")["target"] = "torch.relu"

    for attr in ("__class__", "_version", "storage", "untyped_storage", "tolist", "register_hook"):
        put(f"getattr-{attr}")(lambda d, attr=attr: _node(d, "getattr_1")["args"]["$tuple"].__setitem__(1, attr))

    @put("getattr-three-args")
    def _(d):
        _node(d, "getattr_1")["args"]["$tuple"].append(None)

    @put("tensor-as-node-argument")
    def _(d):
        _node(d, "getitem")["args"] = {"$tuple": [{"$node": "getattr_1"}, {"$tensor": "scale"}]}

    @put("record-as-node-argument")
    def _(d):
        _node(d, "getitem")["args"] = {"$tuple": [{"$node": "getattr_1"}, {"$enum": ["QuantState", "BAKED"]}]}

    # --- module tree
    for cls in ("os:system", "subprocess:Popen", "builtins:eval", "torch.nn.modules.module:Module.__init__",
                "torch.nn.modules.conv:Conv2d.__init__.__globals__", "torch.hub:load",
                "test_hostile_files:Toy", "fxq.serialization:load", "torch.fx.graph_module:GraphModule",
                "torch.nn:Conv2d", "torch.nn.modules.conv:conv", "onnx2torch.utils.common:os"):
        put(f"class-{cls}")(lambda d, cls=cls: _module(d, "conv").update({"class": cls}))

    @put("module-path-quote-newline")
    def _(d):
        _module(d, "seq.0")["path"] = f"seq.0{brk}"
        _module(d, "seq")["children"] = [f"0{brk}"]

    @put("module-path-dunder")
    def _(d):
        _module(d, "conv")["path"] = "__class__"

    @put("module-path-before-parent")
    def _(d):
        d["modules"].insert(1, d["modules"].pop(3))

    @put("module-path-twice")
    def _(d):
        d["modules"].append(copy.deepcopy(_module(d, "conv")))

    @put("module-child-missing")
    def _(d):
        _module(d, "seq")["children"].append("1")

    @put("attr-shadows-forward")
    def _(d):
        _module(d, "seq.0")["attrs"]["forward"] = {"$function": "torch:relu"}

    @put("attr-module-internals")
    def _(d):
        _module(d, "seq.0")["attrs"]["_forward_hooks"] = {"0": {"$function": "torch:relu"}}

    @put("attr-dunder-dict")
    def _(d):
        _module(d, "seq.0")["attrs"]["__dict__"] = {}

    @put("attr-callable-from-file")
    def _(d):
        _module(d, "seq.0")["attrs"]["inplace"] = {"$function": "builtins:exec"}

    @put("attr-name-code")
    def _(d):
        _module(d, "seq.0")["attrs"][f"x{brk}"] = 1

    @put("parameter-name-quote")
    def _(d):
        _module(d, "conv")["params"][f"w{brk}"] = ["conv.weight", True]

    @put("tensor-attr-shadows-forward")
    def _(d):
        _module(d, "")["tensor_attrs"]["forward"] = "scale"

    @put("tensor-attr-on-submodule")
    def _(d):
        _module(d, "conv")["tensor_attrs"] = {"t": "scale"}

    # --- meta and value tags
    @put("meta-is_wrapped-code")
    def _(d):
        _node(d, "relu")["meta"]["is_wrapped"] = f'x")\n{m}\n#'

    @put("meta-is_wrapped-on-get_attr")
    def _(d):
        _node(d, "scale")["meta"]["is_wrapped"] = True

    @put("meta-boxed_arg_indices")
    def _(d):
        _node(d, "relu")["meta"]["boxed_arg_indices"] = [0]

    @put("meta-unknown-tag")
    def _(d):
        _node(d, "relu")["meta"]["stack_trace"] = {"$eval": m}

    @put("meta-function-eval")
    def _(d):
        d["meta"]["hook"] = {"$function": "builtins:eval"}

    @put("record-unknown-type")
    def _(d):
        d["meta"]["fxq"] = {"$record": ["Popen", {"args": m}]}

    @put("record-unexpected-field")
    def _(d):
        d["meta"]["fxq"] = {"$record": ["GraphQuant", {"__class__": 1}]}

    @put("enum-dunder-member")
    def _(d):
        d["meta"]["e"] = {"$enum": ["QuantState", "__class__"]}

    @put("enum-unknown-class")
    def _(d):
        d["meta"]["e"] = {"$enum": ["Signals", "SIGKILL"]}

    @put("config-unknown-field")
    def _(d):
        d["meta"]["c"] = {"$config": {"num_bits": 8, "__class__": {"$function": "builtins:eval"}}}

    @put("config-observer-not-a-name")
    def _(d):
        d["meta"]["c"] = {"$config": {"num_bits": 8, "observer": {"$function": "builtins:eval"}}}

    @put("dtype-attribute-walk")
    def _(d):
        d["meta"]["t"] = {"$dtype": "load"}

    @put("torch-constant-walk")
    def _(d):
        d["meta"]["t"] = {"$torch": "save"}

    @put("device-odd-string")
    def _(d):
        d["meta"]["t"] = {"$device": f"cuda:0 {m}"}

    @put("tensor_spec-huge")
    def _(d):
        d["meta"]["t"] = {"$tensor_spec": [[2**62, 2**62], "float32"]}

    @put("tensor_spec-negative")
    def _(d):
        d["meta"]["t"] = {"$tensor_spec": [[-1, 3], "float32"]}

    @put("tensor_spec-dtype-walk")
    def _(d):
        d["meta"]["t"] = {"$tensor_spec": [[1], "Tensor"]}

    @put("size-not-ints")
    def _(d):
        d["meta"]["t"] = {"$size": ["a"]}

    @put("mixed-tag-object")
    def _(d):
        d["meta"]["t"] = {"$tensor": "scale", "extra": 1}

    @put("missing-tensor-reference")
    def _(d):
        d["meta"]["t"] = {"$tensor": "../../../etc/passwd"}

    # --- graph structure
    @put("graph-no-output")
    def _(d):
        d["graph"].pop()

    @put("graph-two-outputs")
    def _(d):
        d["graph"].insert(-1, copy.deepcopy(d["graph"][-1]) | {"name": "output_2"})

    @put("graph-output-not-last")
    def _(d):
        d["graph"].insert(0, d["graph"].pop())

    @put("graph-forward-reference")
    def _(d):
        _node(d, "relu")["args"] = {"$tuple": [{"$node": "sum_1"}]}

    @put("graph-self-reference")
    def _(d):
        _node(d, "relu")["args"] = {"$tuple": [{"$node": "relu"}]}

    @put("graph-empty")
    def _(d):
        d["graph"] = []

    @put("graph-unknown-op")
    def _(d):
        _node(d, "relu")["op"] = "call_eval"

    @put("graph-output-two-args")
    def _(d):
        d["graph"][-1]["args"]["$tuple"].append(1)

    # --- wrong JSON types
    @put("json-graph-is-object")
    def _(d):
        d["graph"] = {"x": 1}

    @put("json-modules-is-object")
    def _(d):
        d["modules"] = {"path": ""}

    @put("json-node-is-list")
    def _(d):
        d["graph"][1] = ["conv"]

    @put("json-args-is-string")
    def _(d):
        _node(d, "relu")["args"] = "conv"

    @put("json-kwargs-is-list")
    def _(d):
        _node(d, "flatten")["kwargs"] = [1]

    @put("json-params-is-list")
    def _(d):
        _module(d, "conv")["params"] = ["conv.weight"]

    @put("json-param-ref-is-number")
    def _(d):
        _module(d, "conv")["params"]["weight"] = 5

    @put("json-meta-is-list")
    def _(d):
        d["meta"] = []

    @put("json-training-is-string")
    def _(d):
        d["training"] = "yes"

    @put("json-packed-bad-record")
    def _(d):
        d["packed"] = {"conv.weight": {"scale": "scale", "offset": "nope", "axis": 0, "dtype": {"$dtype": "float32"}}}

    @put("json-spec-is-list")
    def _(d):
        return []  # a whole document of the wrong type

    # --- declared tensors
    @put("declared-shape-mismatch")
    def _(d):
        d["tensors"]["conv.bias"] = [[5], "float32"]

    @put("declared-huge-shape")
    def _(d):
        d["tensors"]["conv.bias"] = [[2**60, 2**60], "float32"]

    @put("declared-missing-tensor")
    def _(d):
        d["tensors"]["ghost"] = [[1], "float32"]

    @put("declared-dtype-walk")
    def _(d):
        d["tensors"]["conv.bias"] = [[4], "__class__"]

    @put("declared-list-missing")
    def _(d):
        del d["tensors"]

    return e


_EDIT_IDS = sorted(_edits("PAYLOAD"))


@pytest.mark.parametrize("attack", _EDIT_IDS)
def test_crafted_spec_is_refused(base, tmp_path, attack):
    blob, doc = base
    marker = tmp_path / "pwned"
    doc = copy.deepcopy(doc)
    edit = _edits(_payload(marker))[attack]
    replaced = edit(doc)  # edits change the document in place, or return a replacement
    doc = doc if replaced is None else replaced
    path = _write(blob, doc, tmp_path / "crafted.fxq")
    _refused(path, tmp_path, marker)


# ------------------------------------------------------------------ edits of the blob itself
def _blob_edits(marker):
    def version(v):
        return lambda b: b.update(version=v)

    def no_version(b):
        del b["version"]

    def extra_tensor(b):
        b["tensors"]["../../pwned"] = torch.ones(1)

    def missing_tensor(b):
        del b["tensors"]["conv.bias"]

    def stored_shape_differs(b):
        b["tensors"]["conv.bias"] = torch.zeros(7)

    def sparse_tensor(b):
        b["tensors"]["conv.bias"] = torch.eye(4)[0].to_sparse()

    def tensors_not_dict(b):
        b["tensors"] = [torch.ones(1)]

    def spec_not_str(b):
        b["spec"] = {"graph": []}

    def extra_key(b):
        b["code"] = f"import os; os.system('touch {marker}')"

    def invalid_json(b):
        b["spec"] = b["spec"][:-10]

    def nan_constant(b):
        b["spec"] = b["spec"].replace('"training": true', '"training": NaN')

    return {"version-string": version("3"), "version-bool": version(True), "version-future": version(99),
            "version-missing": no_version, "tensor-undeclared-traversal-key": extra_tensor,
            "tensor-missing": missing_tensor, "tensor-shape-differs": stored_shape_differs,
            "tensor-sparse": sparse_tensor, "tensors-not-a-dict": tensors_not_dict, "spec-not-a-string": spec_not_str,
            "blob-extra-key": extra_key, "spec-invalid-json": invalid_json, "spec-nan-constant": nan_constant}


@pytest.mark.parametrize("attack", sorted(_blob_edits(None)))
def test_crafted_blob_is_refused(base, tmp_path, attack):
    blob, _ = base
    marker = tmp_path / "pwned"
    blob = dict(blob, tensors=dict(blob["tensors"]))
    _blob_edits(marker)[attack](blob)
    path = tmp_path / "crafted.fxq"
    if attack not in ("spec-not-a-string", "tensors-not-a-dict", "tensor-sparse"):  # (no digest of those)
        blob["sha256"] = file_digest(blob["spec"], blob["tensors"])
    torch.save(blob, path)
    _refused(path, tmp_path, marker)


def test_a_flipped_byte_is_reported_as_damage(base, tmp_path):
    blob, _ = base
    tensors = dict(blob["tensors"])
    w = tensors["conv.weight"].clone()
    w.view(torch.int32).view(-1)[0] ^= 1
    torch.save(dict(blob, tensors=dict(tensors, **{"conv.weight": w})), tmp_path / "flipped.fxq")
    err = _refused(tmp_path / "flipped.fxq", tmp_path, tmp_path / "pwned")
    assert isinstance(err, fxq.FrontendError) and "damaged" in str(err) and "flipped.fxq" in str(err)
    torch.save(dict(blob, spec=blob["spec"].replace('"training": true', '"training": false')), tmp_path / "s.fxq")
    assert "damaged" in str(_refused(tmp_path / "s.fxq", tmp_path, tmp_path / "pwned"))


@pytest.mark.parametrize("content", [b"", b"PK\x03\x04", None, "truncated"])
def test_unreadable_files(base, tmp_path, content):
    path = tmp_path / "bad.fxq"
    if content is None:
        path.mkdir()
    elif content == "truncated":
        buf = tmp_path / "full.fxq"
        torch.save(base[0], buf)
        path.write_bytes(buf.read_bytes()[: buf.stat().st_size // 2])
    else:
        path.write_bytes(content)
    with pytest.raises(fxq.FrontendError):
        fxq.load(path)


def test_from_file_graph_touches_nothing(base, tmp_path):
    """The aten from_file attack (read any file; shared=True + an in-place op writes it) in both spellings."""
    blob, doc = base
    marker = tmp_path / "pwned"
    for name in ("torch:from_file", "torch.ops:aten::from_file.default"):
        d = copy.deepcopy(doc)
        _node(d, "relu").update(target={"$function": name}, args={"$tuple": [str(marker)]},
                                kwargs={"shared": True, "size": 4})
        _node(d, "mul")["target"] = {"$function": "operator:iadd"}
        err = _refused(_write(blob, d, tmp_path / "crafted.fxq"), tmp_path, marker)
        assert isinstance(err, fxq.NotSupportedError)


@pytest.mark.parametrize("name", ["torch.ops:aten::from_file.default", "torch.ops:aten::set_.source_Storage",
                                  "torch.ops:aten::as_strided.default", "torch.ops:aten::as_strided_scatter.default",
                                  "torch.ops:aten::resize_.default", "torch.ops:aten::_unsafe_index.Tensor",
                                  "torch.ops:aten::relu_.default", "torch.ops:aten::add.out"])
def test_refused_aten_ops_are_named_at_load(base, tmp_path, name):
    """aten overloads the rule refuses (memory / file ops even where torch tags them core, in-place and out=
    overloads): load names the op and why, before building the graph, so none runs."""
    blob, doc = base
    marker = tmp_path / "pwned"
    d = copy.deepcopy(doc)
    _node(d, "relu").update(target={"$function": name}, args={"$tuple": [{"$node": "conv"}, [1 << 40], [1]]})
    err = _refused(_write(blob, d, tmp_path / "crafted.fxq"), tmp_path, marker)
    assert isinstance(err, fxq.NotSupportedError)
    assert name.split("::")[1] in str(err) and "refused because" in str(err)


def test_inert_edits_load_and_run_no_code(base, tmp_path):
    """What loads by design (odd tensor keys, string defaults, stack traces with code in them) stays data."""
    blob, doc = base
    marker = tmp_path / "pwned"
    d = copy.deepcopy(doc)
    d["tensors"]["../../pwned"] = [[1], "float32"]
    d["meta"]["note"] = _payload(marker)
    _node(d, "relu")["meta"]["stack_trace"] = f'File "x", line 1\n    {_payload(marker)}\n'
    blob = dict(blob, tensors=dict(blob["tensors"], **{"../../pwned": torch.ones(1)}))
    path = _write(blob, d, tmp_path / "inert.fxq")
    before = _snapshot(tmp_path)
    gm = fxq.load(path)
    gm(torch.randn(1, 3, 4, 4))
    print(gm.code, gm.print_readable(print_output=False))
    assert not marker.exists() and _snapshot(tmp_path) == before
    assert gm.meta["note"] == _payload(marker)


def test_map_location_cuda_without_cuda(base, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    path = _write(base[0], None, tmp_path / "m.fxq")
    with pytest.raises(fxq.FxqError, match='map_location="cpu"'):
        fxq.load(path, map_location="cuda")


def test_suite_size():
    """Every attack still runs: cases cannot be lost silently (update the count when adding some)."""
    assert (len(_EDIT_IDS), len(_blob_edits(None))) == (154, 13)
