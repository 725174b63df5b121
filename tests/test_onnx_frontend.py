"""ONNX frontend: load_onnx against onnxruntime, name mapping, external data, clean-up, bad files, our converters."""
from __future__ import annotations

import operator
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper
from torch import nn

import fxq
from fxq.errors import FrontendError
from fxq.frontends.onnx import load_onnx, register_onnx_converter

ort = pytest.importorskip("onnxruntime")

ORT_MAX_IR = 10  # onnx 1.23 writes IR 14 by default; onnxruntime 1.31 runs up to 10 (REFERENCE.md)


# ----------------------------------------------------------------------------------------------- models
class SmallCNN(nn.Module):
    """conv/bn/relu, a residual add, max pool, a BatchNorm the exporters cannot fold, global mean, linear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.pool, self.bn3 = nn.MaxPool2d(2), nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(y + self.bn2(self.conv2(y)))
        y = self.bn3(self.pool(y))
        return self.fc(y.mean(dim=(2, 3)))


class Block(nn.Module):
    """A pre-norm transformer block: layernorm, qkv split, matmul, softmax, gelu MLP, residuals."""

    def __init__(self, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.qkv, self.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ln2, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h, hd = self.heads, d // self.heads
        q, k, v = (z.reshape(b, t, h, hd).transpose(1, 2) for z in self.qkv(self.ln1(x)).chunk(3, dim=-1))
        a = torch.softmax(q @ k.transpose(-1, -2) / hd**0.5, dim=-1)
        x = x + self.proj((a @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def _randomize(model: nn.Module, seed: int = 0) -> nn.Module:
    """Non-trivial BatchNorm statistics and affine parameters, so outputs are not ~0 and BN mapping matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.BatchNorm2d, nn.LayerNorm)):
                m.weight.uniform_(0.5, 1.5, generator=g)
                m.bias.normal_(0.0, 0.1, generator=g)
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.normal_(0.0, 0.1, generator=g)
                m.running_var.uniform_(0.5, 1.5, generator=g)
            if isinstance(m, nn.Linear):
                m.weight.normal_(0.0, 0.1, generator=g)
    return model.eval()


def _mobilenet() -> nn.Module:
    torchvision = pytest.importorskip("torchvision")
    return torchvision.models.mobilenet_v3_small(num_classes=10)


MODELS = {
    "cnn": (SmallCNN, (2, 3, 16, 16)),
    "block": (Block, (2, 5, 16)),
    "mobilenet_v3_small": (_mobilenet, (1, 3, 64, 64)),
}
EXPORTERS = ["legacy13", "legacy17", "dynamo"]


def _export(model: nn.Module, x: torch.Tensor, path: Path, exporter: str) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "dynamo":
            torch.onnx.export(model, (x,), str(path), dynamo=True, verbose=False)
        else:
            torch.onnx.export(model, (x,), str(path), dynamo=False, opset_version=int(exporter[len("legacy") :]))
    return path


def _run_ort(model: str | Path | onnx.ModelProto, *xs: np.ndarray) -> list[np.ndarray]:
    proto = onnx.load(str(model)) if not isinstance(model, onnx.ModelProto) else model
    proto.ir_version = min(proto.ir_version, ORT_MAX_IR)
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {i.name: x for i, x in zip(sess.get_inputs(), xs)})


def _close(got: torch.Tensor, want: np.ndarray, tol: float = 1e-4) -> None:
    np.testing.assert_allclose(got.detach().numpy(), want, atol=tol, rtol=tol)


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[tuple[str, str], tuple[Path, torch.Tensor]]:
    """Each (model, exporter) written once to a temp folder, with its input."""
    out: dict[tuple[str, str], tuple[Path, torch.Tensor]] = {}
    folder = tmp_path_factory.mktemp("onnx_models")
    for name, (make, shape) in MODELS.items():
        torch.manual_seed(0)
        model = _randomize(make())
        x = torch.randn(*shape)
        for exporter in EXPORTERS:
            out[name, exporter] = (_export(model, x, folder / f"{name}_{exporter}.onnx", exporter), x)
    return out


def _onnx_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """fx nodes made from an ONNX node (not the getitem picks of a multi-output node)."""
    return [n for n in gm.graph.nodes if "op_type" in n.meta.get("onnx", {}) and "output_index" not in n.meta["onnx"]]


# ------------------------------------------------------------------------------------- end to end vs ORT
@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("name", list(MODELS))
def test_matches_onnxruntime(exported, name: str, exporter: str) -> None:
    path, x = exported[name, exporter]
    gm = load_onnx(path)
    assert isinstance(gm, torch.fx.GraphModule) and not gm.training
    with torch.no_grad():
        got = gm(x)
    _close(got, _run_ort(path, x.numpy())[0])
    # structure: every ONNX node that was not folded into an initializer has exactly one fx node
    proto = onnx.load(str(path), load_external_data=False)
    folded = {"Constant", "Identity"}
    want = sorted(tuple(nd.output) for nd in proto.graph.node if nd.op_type not in folded)
    got_nodes = sorted(tuple(n.meta["onnx"]["outputs"]) for n in _onnx_nodes(gm) if n.meta["onnx"]["op_type"] not in folded)
    assert got_nodes == want


def test_traces_again_with_onnx2torch_modules_as_leaves(exported) -> None:
    from onnx2torch.utils.common import OnnxToTorchModule

    class LeafTracer(torch.fx.Tracer):
        def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
            return isinstance(m, OnnxToTorchModule) or super().is_leaf_module(m, qualname)

    path, x = exported["block", "dynamo"]  # our Reduce/Reshape/Split/Gelu converters trace through
    gm = load_onnx(path)
    again = torch.fx.GraphModule(gm, LeafTracer().trace(gm))
    torch.testing.assert_close(again(x), gm(x))


# ------------------------------------------------------------------------------------------ name mapping
def test_name_mapping_conv_bn_gemm(exported) -> None:
    path, _ = exported["cnn", "legacy17"]
    proto = onnx.load(str(path))
    inits = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    gm = load_onnx(path)
    by_output = {tuple(n.meta["onnx"]["outputs"]): n for n in _onnx_nodes(gm)}
    seen = set()
    for nd in proto.graph.node:
        node = by_output[tuple(nd.output)]
        meta = node.meta["onnx"]
        assert meta["node_name"] == nd.name and meta["op_type"] == nd.op_type
        assert meta["inputs"] == list(nd.input) and meta["domain"] == "" and meta["opset"] == 17
        if nd.op_type in ("Conv", "BatchNormalization", "Gemm"):
            seen.add(nd.op_type)
            module = gm.get_submodule(node.target)
            keys = {"Conv": ["weight", "bias"], "Gemm": ["weight", "bias"],
                    "BatchNormalization": ["weight", "bias", "running_mean", "running_var"]}[nd.op_type]
            assert meta["params"] == dict(zip(keys, nd.input[1:]))
            assert meta["args"] == [nd.input[0]]
            for pname, iname in meta["params"].items():
                value = getattr(module, pname).detach().numpy()
                want = inits[iname].T if (nd.op_type == "Gemm" and value.shape != inits[iname].shape) else inits[iname]
                np.testing.assert_array_equal(value, want)
    assert seen == {"Conv", "BatchNormalization", "Gemm"}


def test_graph_meta_and_placeholders(exported, tmp_path) -> None:
    path, x = exported["cnn", "dynamo"]
    proto = onnx.load(str(path), load_external_data=False)
    gm = load_onnx(path)
    meta = gm.meta["onnx"]
    assert meta["inputs"] == [i.name for i in proto.graph.input] == ["x"]
    assert meta["outputs"] == [o.name for o in proto.graph.output]
    assert meta["input_shapes"] == {"x": list(x.shape)}
    assert meta["opset"] == next(i.version for i in proto.opset_import if i.domain == "")
    assert meta["source"] == path.name
    assert str(path.parent) not in repr(meta) and str(tmp_path) not in repr(meta)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert [n.meta["onnx"] for n in placeholders] == [{"outputs": ["x"]}]
    out = next(n for n in gm.graph.nodes if n.op == "output")
    assert out.meta["onnx"] == {"inputs": meta["outputs"]}


def test_name_mapping_dynamo_block_split_and_initializers(exported) -> None:
    path, _ = exported["block", "dynamo"]
    proto = onnx.load(str(path))
    inits = {t.name for t in proto.graph.initializer}
    gm = load_onnx(path)
    split = next(n for n in _onnx_nodes(gm) if n.meta["onnx"]["op_type"] == "Split")
    picks = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is operator.getitem and n.args[0] is split]
    assert sorted(n.meta["onnx"]["output_index"] for n in picks) == [0, 1, 2]
    for n in picks:
        assert n.meta["onnx"]["outputs"] == [split.meta["onnx"]["outputs"][n.args[1]]]
        assert n.meta["onnx"]["node_name"] == split.meta["onnx"]["node_name"]
    gelu = next(n for n in _onnx_nodes(gm) if n.meta["onnx"]["op_type"] == "Gelu")
    assert gelu.meta["onnx"]["opset"] == gm.meta["onnx"]["opset"] >= 20
    getattrs = [n for n in gm.graph.nodes if n.op == "get_attr"]
    assert getattrs and all(n.meta["onnx"]["initializer"] in inits for n in getattrs)
    for user in (u for n in getattrs for u in n.users):  # the initializer is the argument it feeds
        flat = list(user.args) + list(user.kwargs.values())
        for arg, name in zip(flat, user.meta["onnx"]["args"]):
            if isinstance(arg, torch.fx.Node) and arg.op == "get_attr":
                assert arg.meta["onnx"]["initializer"] == name


def test_multi_output_graph_returns_onnx_outputs_in_order(tmp_path) -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 6])
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("b", "a", "r")]
    nodes = [
        helper.make_node("Split", ["x"], ["a", "b"], axis=1, num_outputs=2, name="split"),
        helper.make_node("Relu", ["a"], ["r"], name="relu"),
    ]
    model = helper.make_model(helper.make_graph(nodes, "g", [x], outs), opset_imports=[helper.make_opsetid("", 18)])
    path = tmp_path / "multi.onnx"
    onnx.save(model, str(path))
    gm = load_onnx(path)
    xv = torch.randn(2, 6)
    got = gm(xv)
    assert isinstance(got, tuple) and len(got) == 3
    for g, w in zip(got, _run_ort(path, xv.numpy())):
        _close(g, w)
    assert gm.meta["onnx"]["outputs"] == ["b", "a", "r"]


# ------------------------------------------------------------------------------- clean-up and external data
class _TwoZeroBiasConvs(nn.Module):
    """Equal conv biases: torch's legacy exporter routes the second through ``Identity`` (onnx2torch KeyError)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)
        nn.init.zeros_(self.a.bias)
        nn.init.zeros_(self.b.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


@pytest.mark.parametrize("opset", [13, 17])
def test_identity_fed_conv_bias_is_folded(tmp_path, opset: int) -> None:
    x = torch.randn(1, 3, 8, 8)
    path = _export(_TwoZeroBiasConvs().eval(), x, tmp_path / "dedup.onnx", f"legacy{opset}")
    proto = onnx.load(str(path))
    identity = next(nd for nd in proto.graph.node if nd.op_type == "Identity")  # the exporter's quirk is there
    gm = load_onnx(path)
    _close(gm(x), _run_ort(path, x.numpy())[0])
    conv_b = next(n for n in _onnx_nodes(gm) if n.meta["onnx"].get("params", {}).get("bias") == identity.output[0])
    assert conv_b.meta["onnx"]["inputs"][2] == identity.output[0]  # the user's tensor name, not the source's


def test_constant_and_identity_chains_fold_into_initializers(tmp_path) -> None:
    w = np.random.default_rng(0).standard_normal((4, 3, 3, 3)).astype(np.float32)
    nodes = [
        helper.make_node("Constant", [], ["w"], value=numpy_helper.from_array(w), name="cw"),
        helper.make_node("Identity", ["b0"], ["b1"], name="id1"),
        helper.make_node("Identity", ["b1"], ["b2"], name="id2"),
        helper.make_node("Conv", ["x", "w", "b2"], ["y"], pads=[1, 1, 1, 1], name="conv"),
        helper.make_node("Constant", [], ["two"], value_float=2.0, name="c2"),
        helper.make_node("Mul", ["y", "two"], ["z"], name="mul"),
    ]
    b0 = numpy_helper.from_array(np.arange(4, dtype=np.float32), "b0")
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 5, 5])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)], [b0],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    before = model.SerializeToString()
    gm = load_onnx(model)
    assert model.SerializeToString() == before  # the caller's proto is not modified
    xv = torch.randn(1, 3, 5, 5)
    _close(gm(xv), _run_ort(model, xv.numpy())[0])
    conv = next(n for n in _onnx_nodes(gm) if n.meta["onnx"]["op_type"] == "Conv")
    assert conv.meta["onnx"]["params"] == {"weight": "w", "bias": "b2"}
    assert gm.meta["onnx"]["source"] == "<ModelProto>"
    assert {n.meta["onnx"]["op_type"] for n in _onnx_nodes(gm)} == {"Conv", "Mul"}


def test_casts_of_initializers_fold(tmp_path) -> None:
    """Clip bounds written as Cast(constant) (a dynamo export without constant folding); float -> int truncates."""
    inits = [numpy_helper.from_array(np.array(0.0, dtype=np.float64), "lo64"),
             numpy_helper.from_array(np.array(6, dtype=np.int64), "hi64"),
             numpy_helper.from_array(np.array([-1.7, 2.5, 3.9], dtype=np.float32), "steps")]
    nodes = [
        helper.make_node("Cast", ["lo64"], ["lo"], to=TensorProto.FLOAT, name="cast_lo"),
        helper.make_node("Cast", ["hi64"], ["hi"], to=TensorProto.FLOAT, name="cast_hi"),
        helper.make_node("Clip", ["x", "lo", "hi"], ["clipped"], name="clip"),
        helper.make_node("Cast", ["steps"], ["steps_i"], to=TensorProto.INT64, name="cast_i"),
        helper.make_node("Cast", ["steps_i"], ["steps_f"], to=TensorProto.FLOAT, name="cast_f"),
        helper.make_node("Add", ["clipped", "steps_f"], ["y"], name="add"),
    ]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = ORT_MAX_IR
    gm = load_onnx(model)
    xv = torch.tensor([[-1.0, 3.0, 9.0], [0.5, 7.0, -2.0]])
    _close(gm(xv), _run_ort(model, xv.numpy())[0])
    assert {n.meta["onnx"]["op_type"] for n in _onnx_nodes(gm)} == {"Clip", "Add"}


def test_external_data_round_trip(exported, tmp_path) -> None:
    src, x = exported["cnn", "legacy13"]
    proto = onnx.load(str(src))
    path = tmp_path / "ext.onnx"
    onnx.save(proto, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location="ext.onnx.data",
              size_threshold=0)
    assert (tmp_path / "ext.onnx.data").stat().st_size > 0 and path.stat().st_size < src.stat().st_size
    want = _run_ort(src, x.numpy())[0]
    _close(load_onnx(path)(x), want)  # path: data read from beside the file
    _close(load_onnx(str(path))(x), want)
    lazy = onnx.load(str(path), load_external_data=False)
    with pytest.raises(FrontendError, match="external data"):
        load_onnx(lazy)
    _close(load_onnx(lazy, base_dir=tmp_path)(x), want)  # ModelProto + the data's folder
    (tmp_path / "ext.onnx.data").rename(tmp_path / "moved.data")
    with pytest.raises(FrontendError, match=r"ext\.onnx.*ext\.onnx\.data"):
        load_onnx(path)


def test_dynamo_export_writes_external_data_and_loads(exported) -> None:
    path, x = exported["cnn", "dynamo"]
    assert any(t.data_location == TensorProto.EXTERNAL for t in onnx.load(str(path), load_external_data=False).graph.initializer)
    _close(load_onnx(path)(x), _run_ort(path, x.numpy())[0])


# --------------------------------------------------------------------------------------------- bad files
def _bad_file_cases(tmp_path: Path, good: Path) -> dict[str, Path]:
    cases = {
        "missing": tmp_path / "nope.onnx",
        "directory": tmp_path / "folder.onnx",
        "empty": tmp_path / "empty.onnx",
        "garbage": tmp_path / "garbage.onnx",
        "text": tmp_path / "notes.onnx",
        "truncated": tmp_path / "truncated.onnx",
    }
    cases["directory"].mkdir()
    cases["empty"].write_bytes(b"")
    cases["garbage"].write_bytes(bytes(range(256)) * 4)
    cases["text"].write_text("this is not a model\n")
    data = good.read_bytes()
    cases["truncated"].write_bytes(data[: len(data) // 2])
    return cases


@pytest.mark.parametrize("case", ["missing", "directory", "empty", "garbage", "text", "truncated"])
def test_bad_files_raise_frontend_error_naming_the_file(tmp_path, case: str) -> None:
    good = _export(_TwoZeroBiasConvs().eval(), torch.randn(1, 3, 8, 8), tmp_path / "good.onnx", "legacy17")
    path = _bad_file_cases(tmp_path, good)[case]
    with pytest.raises(FrontendError) as info:
        load_onnx(path)
    assert path.name in str(info.value)
    assert isinstance(info.value, fxq.FxqError)


def test_wrong_argument_type() -> None:
    with pytest.raises(FrontendError, match="path or an onnx.ModelProto"):
        load_onnx(b"bytes")  # type: ignore[arg-type]


def _model(nodes: list, opsets: list, outputs: list[str], path: Path) -> Path:
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 4, 4])],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs],
        [numpy_helper.from_array(np.float32(0.5), "s"), numpy_helper.from_array(np.uint8(0), "zp")],
    )
    model = helper.make_model(graph, opset_imports=opsets)
    onnx.save(model, str(path))
    return path


def test_unsupported_ops_are_all_listed_up_front(tmp_path) -> None:
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("QuantizeLinear", ["r", "s", "zp"], ["q"], name="quant_a"),
        helper.make_node("DequantizeLinear", ["q", "s", "zp"], ["d"], name="dequant_a"),
        helper.make_node("FancyOp", ["d"], ["f"], domain="com.example", name="fancy_1"),
        helper.make_node("FancyOp", ["f"], ["g"], domain="com.example", name="fancy_2"),
        helper.make_node("OtherOp", ["g"], ["y"], domain="com.example", name="other"),
    ]
    opsets = [helper.make_opsetid("", 19), helper.make_opsetid("com.example", 3)]
    path = _model(nodes, opsets, ["y"], tmp_path / "unsupported.onnx")
    with pytest.raises(FrontendError) as info:
        load_onnx(path)
    msg = str(info.value)
    assert "unsupported.onnx" in msg and "2 op type(s)" in msg
    assert "QuantizeLinear" not in msg and "DequantizeLinear" not in msg  # a QDQ pair: folded on load
    assert "FancyOp (domain 'com.example', opset 3)" in msg and "'fancy_1', 'fancy_2'" in msg
    assert "OtherOp (domain 'com.example', opset 3)" in msg and "'other'" in msg
    assert "register_onnx_converter" in msg and "Relu" not in msg


def test_undeclared_domain_is_reported(tmp_path) -> None:
    nodes = [helper.make_node("FancyOp", ["x"], ["y"], domain="com.nowhere", name="lost")]
    path = _model(nodes, [helper.make_opsetid("", 17)], ["y"], tmp_path / "nodomain.onnx")
    with pytest.raises(FrontendError, match=r"nodomain\.onnx(.|\n)*'com\.nowhere' is not in the model's opset"):
        load_onnx(path)


def test_dangling_inputs_are_reported(tmp_path) -> None:
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"), helper.make_node("Add", ["r", "ghost"], ["y"], name="add")]
    path = _model(nodes, [helper.make_opsetid("", 17)], ["y"], tmp_path / "broken.onnx")
    with pytest.raises(FrontendError, match=r"broken\.onnx(.|\n)*'add' \(Add\) reads \['ghost'\]"):
        load_onnx(path)


def test_converter_failure_names_every_failing_node(tmp_path) -> None:
    nodes = [
        helper.make_node("AveragePool", ["x"], ["a"], kernel_shape=[2, 2], dilations=[2, 2], name="pool_dilated"),
        helper.make_node("Gelu", ["a"], ["y"], approximate="sigmoid", name="gelu_odd"),
    ]
    path = _model(nodes, [helper.make_opsetid("", 20)], ["y"], tmp_path / "forms.onnx")
    with pytest.raises(FrontendError) as info:
        load_onnx(path)
    msg = str(info.value)
    assert "forms.onnx" in msg and "2 node(s)" in msg
    assert "'pool_dilated' (AveragePool, domain 'ai.onnx', opset 20)" in msg and "dilations" in msg
    assert "'gelu_odd' (Gelu" in msg and "sigmoid" in msg


# ------------------------------------------------------------------------- our converters, op by op vs ORT
def _single(op: str, opset: int, inputs: dict[str, np.ndarray], consts: dict[str, np.ndarray], n_out: int = 1,
            **attrs) -> tuple[onnx.ModelProto, list[np.ndarray]]:
    names = list(inputs) + list(consts)
    node = helper.make_node(op, names, [f"y{i}" for i in range(n_out)], name=f"{op.lower()}_node", **attrs)
    dtype = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.int64): TensorProto.INT64}
    graph = helper.make_graph(
        [node], "g",
        [helper.make_tensor_value_info(k, dtype[v.dtype], list(v.shape)) for k, v in inputs.items()],
        [helper.make_tensor_value_info(f"y{i}", attrs.get("to", TensorProto.FLOAT), None) for i in range(n_out)],
        [numpy_helper.from_array(v, k) for k, v in consts.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = ORT_MAX_IR
    return model, list(inputs.values())


def _x(*shape: int) -> np.ndarray:
    return np.random.default_rng(0).uniform(0.5, 2.0, shape).astype(np.float32)


def _ints(*v: int) -> np.ndarray:
    return np.array(v, dtype=np.int64)


SINGLE_OPS = {
    **{
        f"{op}-{axes}-keep{k}": (op, 18, {"x": _x(2, 3, 4)}, {"axes": _ints(*axes)} if axes else {}, 1, {"keepdims": k})
        for op in ["ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2", "ReduceLogSum",
                   "ReduceLogSumExp", "ReduceSumSquare"]
        for axes, k in [((1,), 1), ((-1, 0), 0), ((), 1)]
    },
    "ReduceMax-20": ("ReduceMax", 20, {"x": _x(2, 3, 4)}, {"axes": _ints(2)}, 1, {"keepdims": 0}),
    "ReduceMean-noop": ("ReduceMean", 18, {"x": _x(2, 3)}, {}, 1, {"noop_with_empty_axes": 1}),
    "Pad-18-constant-axes": ("Pad", 18, {"x": _x(1, 2, 3, 4)}, {"pads": _ints(1, 2, 0, 3),
                             "value": np.array(1.5, np.float32), "axes": _ints(-1, 2)}, 1, {}),
    "Pad-18-reflect": ("Pad", 18, {"x": _x(1, 2, 4, 5)}, {"pads": _ints(0, 0, 1, 2, 0, 0, 2, 1)}, 1,
                       {"mode": "reflect"}),
    "Pad-18-edge": ("Pad", 18, {"x": _x(1, 2, 4, 5)}, {"pads": _ints(0, 0, 1, 2, 0, 0, 2, 1)}, 1, {"mode": "edge"}),
    "Pad-19-wrap": ("Pad", 19, {"x": _x(1, 2, 4, 5)}, {"pads": _ints(0, 0, 1, 2, 0, 0, 2, 1)}, 1, {"mode": "wrap"}),
    "Split-18-num_outputs-uneven": ("Split", 18, {"x": _x(2, 7)}, {}, 3, {"axis": 1, "num_outputs": 3}),
    "Split-18-sizes": ("Split", 18, {"x": _x(6, 2)}, {"split": _ints(1, 5)}, 2, {"axis": 0}),
    "Reshape-19-allowzero0-copies": ("Reshape", 19, {"x": _x(2, 3, 4)}, {"shape": _ints(0, -1)}, 1, {}),
    "Reshape-21-allowzero1": ("Reshape", 21, {"x": _x(2, 3, 4)}, {"shape": _ints(6, 4)}, 1, {"allowzero": 1}),
    "Reshape-19-runtime-shape": ("Reshape", 19, {"x": _x(2, 3, 4), "s": _ints(0, 4, -1)}, {}, 1, {}),
    "Gelu-20": ("Gelu", 20, {"x": _x(3, 4) - 1.2}, {}, 1, {}),
    "Gelu-20-tanh": ("Gelu", 20, {"x": _x(3, 4) - 1.2}, {}, 1, {"approximate": "tanh"}),
    "AveragePool-19": ("AveragePool", 19, {"x": _x(1, 2, 6, 6)}, {}, 1, {"kernel_shape": [2, 2], "strides": [2, 2]}),
    "Resize-19": ("Resize", 19, {"x": _x(1, 2, 3, 3)}, {"roi": np.zeros(0, np.float32),
                  "scales": np.array([1, 1, 2, 2], np.float32)}, 1, {"mode": "nearest"}),
    "Cast-19": ("Cast", 19, {"x": _x(2, 3) * 3}, {}, 1, {"to": TensorProto.INT64}),
    "Flatten-21": ("Flatten", 21, {"x": _x(2, 3, 4)}, {}, 1, {"axis": 1}),
    "Transpose-21": ("Transpose", 21, {"x": _x(2, 3, 4)}, {}, 1, {"perm": [2, 0, 1]}),
    "Unsqueeze-21": ("Unsqueeze", 21, {"x": _x(2, 3)}, {"axes": _ints(0, -1)}, 1, {}),
    "Squeeze-23": ("Squeeze", 23, {"x": _x(2, 1, 3)}, {"axes": _ints(1)}, 1, {}),
    "Conv-22": ("Conv", 22, {"x": _x(1, 2, 5, 5)}, {"w": _x(3, 2, 3, 3)}, 1, {}),
    "HardSwish-22": ("HardSwish", 22, {"x": _x(2, 3) * 4 - 5}, {}, 1, {}),
}


@pytest.mark.parametrize("case", list(SINGLE_OPS))
def test_our_converters_match_onnxruntime(case: str) -> None:
    op, opset, inputs, consts, n_out, attrs = SINGLE_OPS[case]
    model, xs = _single(op, opset, inputs, consts, n_out, **attrs)
    gm = load_onnx(model)
    with torch.no_grad():
        got = gm(*(torch.from_numpy(x) for x in xs))
    got = got if isinstance(got, tuple) else (got,)
    want = _run_ort(model, *xs)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert tuple(g.shape) == w.shape
        _close(g, w)


def test_register_onnx_converter_for_a_custom_op(tmp_path) -> None:
    from onnx2torch.utils.common import OnnxMapping, OperationConverterResult

    class Twice(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * x

    @register_onnx_converter("Twice", 1, domain="org.fxq.test", override=True)
    def _twice(node, graph):
        return OperationConverterResult(Twice(), OnnxMapping(inputs=node.input_values, outputs=node.output_values))

    nodes = [helper.make_node("Twice", ["x"], ["y"], domain="org.fxq.test", name="twice")]
    path = _model(nodes, [helper.make_opsetid("", 17), helper.make_opsetid("org.fxq.test", 1)], ["y"],
                  tmp_path / "custom.onnx")
    gm = load_onnx(path)
    xv = torch.randn(1, 4, 4, 4)
    torch.testing.assert_close(gm(xv), 2 * xv)
    (node,) = _onnx_nodes(gm)
    assert node.meta["onnx"]["domain"] == "org.fxq.test" and node.meta["onnx"]["opset"] == 1


def test_exported_from_fxq() -> None:
    assert fxq.load_onnx is load_onnx and "load_onnx" in fxq.__all__


def test_shape_inference_runs_on_a_copy_without_weight_data(tmp_path) -> None:
    """fxq infers shapes on a light copy (large initializers as typed inputs): the same value_info as onnx's
    inference of the whole model, no weight data in the copy, and the loaded model still matches."""
    from fxq.frontends.onnx import cleanup

    model = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(64 * 8 * 8, 10)).eval()
    path = tmp_path / "m.onnx"
    torch.onnx.export(model, (torch.randn(1, 3, 8, 8),), str(path), dynamo=False, opset_version=13,
                      input_names=["x"], dynamic_axes={"x": {0: "n"}})
    proto = onnx.load(str(path))
    light = cleanup.light_copy(proto)
    assert max(int(np.prod(t.dims)) for t in light.graph.initializer) < cleanup.LIGHT_MIN_ELEMENTS
    assert light.ByteSize() < proto.ByteSize() / 20  # the 40960-element Linear weight is out
    full = onnx.shape_inference.infer_shapes(proto, data_prop=True)
    ours = cleanup.infer_shapes(proto)
    assert ours is not proto and not proto.graph.value_info  # a copy unless in_place
    assert sorted(v.SerializeToString() for v in ours.graph.value_info) == sorted(
        v.SerializeToString() for v in full.graph.value_info)
    assert [o.SerializeToString() for o in ours.graph.output] == [o.SerializeToString() for o in full.graph.output]
    assert cleanup.infer_shapes(proto, in_place=True) is proto and len(proto.graph.value_info) == len(full.graph.value_info)
    x = torch.randn(2, 3, 8, 8)
    torch.testing.assert_close(load_onnx(str(path))(x), model(x))
    import onnx2torch.converter

    assert onnx2torch.converter.safe_shape_inference.__name__ == "safe_shape_inference"  # put back after loading


def test_conversion_skips_the_random_init_the_file_overwrites(tmp_path, monkeypatch) -> None:
    """onnx2torch builds every conv / linear with torch's random init, then sets the file's weights: the init is
    put off and, since the file sets every parameter, never run (a third of a VGG's load). The values are the
    file's; ``torch.nn.init`` is torch's own again afterwards."""
    calls: list[tuple[int, ...]] = []
    real = torch.nn.init.kaiming_uniform_

    def spy(tensor, *args, **kwargs):
        calls.append(tuple(tensor.shape))
        return real(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.nn.init, "kaiming_uniform_", spy)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5)).eval()
    path = tmp_path / "m.onnx"
    x = torch.randn(1, 3, 8, 8)
    torch.onnx.export(model, (x,), path, input_names=["x"], output_names=["y"], dynamo=False)
    calls.clear()
    gm = load_onnx(path)
    assert calls == []
    assert torch.nn.init.kaiming_uniform_ is spy
    torch.testing.assert_close(gm(x), model(x))


def test_put_off_init_runs_on_tensors_nothing_replaced() -> None:
    """Inside the conversion block, a module whose parameters the converter does not set is initialised as torch
    would when the block ends; one whose parameters are replaced (``.data =``) or written in place (``copy_``,
    same address) keeps the converter's values; another thread's modules are initialised at once."""
    import threading

    from fxq.frontends.onnx.loader import _onnx2torch_shortcuts

    other: list[torch.Tensor] = []
    with _onnx2torch_shortcuts():
        kept = nn.Linear(8, 8)
        replaced = nn.Linear(8, 8)
        copied = nn.Linear(8, 8)
        with torch.no_grad():
            replaced.weight.data = torch.full((8, 8), 2.0)
            replaced.bias.data = torch.zeros(8)
            copied.weight.copy_(torch.full((8, 8), 3.0))
            copied.bias.data.copy_(torch.ones(8))
        worker = threading.Thread(target=lambda: other.append(nn.Linear(8, 8).weight.detach().clone()))
        worker.start()
        worker.join()
        assert other[0].abs().sum() > 0 and other[0].abs().max() <= 8 ** -0.5
    w = kept.weight.detach()
    assert torch.isfinite(w).all() and w.abs().max() <= 8 ** -0.5 and w.std() > 0
    assert torch.equal(replaced.weight.detach(), torch.full((8, 8), 2.0))
    assert torch.equal(copied.weight.detach(), torch.full((8, 8), 3.0))
    assert torch.equal(copied.bias.detach(), torch.ones(8))


class _UnitSlices(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, 1:3, :, 2:] * 2 + x[:, :2, :, -3:].sum()


class _SteppedSlices(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, 1:3, :, 2:] * 2 + x[:, :2, ::2, -3:].sum() + torch.flip(x, [3])[..., 1:4].mean()


@pytest.mark.parametrize("opset", [9, 11, 13, 17])
def test_slices_run_without_deprecated_indexing(tmp_path, opset: int) -> None:
    """onnx2torch's Slice indexed with a list (a torch UserWarning on every call, and a different meaning in a
    later torch) and could not convert Slice-1 (opset < 10) at all: each opset loads, runs warning-free, matches
    onnxruntime, and round-trips through ``.fxq`` quantized."""
    x = torch.randn(2, 4, 5, 6)
    path = tmp_path / "m.onnx"
    torch.onnx.export(_UnitSlices() if opset < 10 else _SteppedSlices(), (x,), path, opset_version=opset,
                      dynamo=False, input_names=["x"], output_names=["y"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gm = load_onnx(path)
        got = gm(x)
        q = fxq.quantize(gm, [x], platform="trt_int8", progress=False)
        fxq.save(q, tmp_path / "q.fxq")
        again = fxq.load(tmp_path / "q.fxq")
        assert torch.equal(again(x), q(x))
    want = ort.InferenceSession(str(path)).run(None, {"x": x.numpy()})[0]
    np.testing.assert_allclose(got.detach().numpy(), want, rtol=1e-5, atol=1e-5)


def test_slice_with_steps_and_no_axes(tmp_path) -> None:
    """ONNX lets ``steps`` be given with ``axes`` left out (axes 0, 1, ...); negative steps run backwards."""
    starts = numpy_helper.from_array(np.array([0, 3, -1], dtype=np.int64), "starts")
    ends = numpy_helper.from_array(np.array([2, 0, -7], dtype=np.int64), "ends")
    steps = numpy_helper.from_array(np.array([1, -1, -2], dtype=np.int64), "steps")
    node = helper.make_node("Slice", ["x", "starts", "ends", "", "steps"], ["y"])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4, 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              initializer=[starts, ends, steps])
    path = tmp_path / "s.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), str(path))
    x = torch.randn(2, 4, 6)
    want = ort.InferenceSession(str(path)).run(None, {"x": x.numpy()})[0]
    np.testing.assert_array_equal(load_onnx(path)(x).numpy(), want)
