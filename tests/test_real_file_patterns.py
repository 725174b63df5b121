"""Failure patterns of ONNX files users have (issue: real files in, deployable files out), each reproduced
with torch's own exporters and run to a deployed file."""
from __future__ import annotations

import onnx
import pytest
import torch
from torch import nn

import fxq

from _export_helpers import run_ort

pytestmark = pytest.mark.usefixtures("one_thread")


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3)).eval()


@pytest.mark.parametrize("opset", [13, 17])
@pytest.mark.parametrize("platform", ["trt_int8", "ort_int8", "ppl_cuda_int8"])
def test_numeric_output_names(tmp_path, platform, opset):
    """torch.onnx.export without output_names numbers the outputs ('8'); torch.onnx then refused that name when
    fxq exported the quantized model. The exported file keeps the source's names and runs."""
    x = torch.randn(1, 3, 8, 8)
    src = tmp_path / "numbered.onnx"
    torch.onnx.export(_cnn(), x, src, opset_version=opset, dynamo=False)
    names = [o.name for o in onnx.load(src).graph.output]
    assert names[0].isdigit()
    qmodel = fxq.quantize(fxq.load_onnx(src), [x, torch.randn(1, 3, 8, 8)], platform=platform, progress=False)
    files = fxq.export(qmodel, platform, tmp_path / "out.onnx")
    exported = onnx.load(files[0])
    assert [o.name for o in exported.graph.output] == names
    onnx.checker.check_model(exported)
    with torch.no_grad():
        if platform == "ppl_cuda_int8":  # a float ONNX with baked weights; the quantization lives in the json
            with fxq.fake_quant_mode(qmodel, "disabled"):
                ref = qmodel(x).numpy()
        else:
            ref = qmodel(x).numpy()
    for optimize in (False, True):
        got = run_ort(files[0], x, optimize=optimize)
        assert got.shape == ref.shape
        assert float(abs(got - ref).max()) <= 1e-4 * max(1.0, float(abs(ref).max()))


_GATHER_EXPORT = """
import torchvision  # first, as users do: onnx2torch then binds torch.onnx's public symbolic_helper shim
import sys, torch, fxq
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        y = self.conv(x)
        return y[:, 1] + y.mean(dim=1)  # Gather and ReduceMean: onnx2torch modules with their own ONNX form

x = torch.randn(2, 3, 8, 8)
src, out = sys.argv[1], sys.argv[2]
torch.onnx.export(Net().eval(), (x,), src, opset_version=13, dynamo=False)
qmodel = fxq.quantize(fxq.load_onnx(src), [x], platform="trt_int8", progress=False)
print(fxq.export(qmodel, "trt_int8", out))
"""


def test_onnx2torch_modules_export_whatever_was_imported_first(tmp_path):
    """onnx2torch's Gather/Shape/Reduce modules read the export's opset from torch.onnx.symbolic_helper; after
    ``import torchvision`` that is torch's public shim without it, and every export failed (AttributeError
    '_export_onnx_opset_version')."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _GATHER_EXPORT, str(tmp_path / "g.onnx"), str(tmp_path / "q.onnx")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "q.onnx").is_file()
    from torch.onnx import symbolic_helper

    assert not hasattr(symbolic_helper, "_export_onnx_opset_version") or hasattr(symbolic_helper, "GLOBALS")


def test_renaming_a_tensor_follows_reads_inside_if_bodies():
    """torch.onnx writes If/Loop bodies that read values of the main graph by name (MViT-v2's exported file); a
    rename that skipped the bodies left them reading a name nobody produces ('Nodes in a graph must be
    topologically sorted')."""
    from onnx import TensorProto, helper

    from fxq.backends.qdq.onnx_graph import rename_tensors

    def branch(name: str, op: str) -> onnx.GraphProto:
        shadow = [helper.make_node("Neg", ["x"], ["a"])] if name == "else" else []  # 'a' shadowed here
        reads = "a"
        return helper.make_graph(shadow + [helper.make_node(op, [reads], [f"{name}_out"])], name, [],
                                 [helper.make_tensor_value_info(f"{name}_out", TensorProto.FLOAT, [2])])

    nodes = [helper.make_node("Relu", ["x"], ["a"]),
             helper.make_node("If", ["cond"], ["y"], then_branch=branch("then", "Abs"),
                              else_branch=branch("else", "Abs"))]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2]),
                                           helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    rename_tensors(model.graph, {"a": "relu_out"})
    onnx.checker.check_model(model, full_check=True)
    if_node = model.graph.node[1]
    then_g = next(a.g for a in if_node.attribute if a.name == "then_branch")
    else_g = next(a.g for a in if_node.attribute if a.name == "else_branch")
    assert list(then_g.node[0].input) == ["relu_out"]  # the outer value, renamed
    assert list(else_g.node[1].input) == ["a"]  # the body's own 'a' stays


class _TokenModel(nn.Module):
    """GPT-2's first step: token ids reshaped by a size read from themselves, then an embedding lookup."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.fc1, self.fc2 = nn.Embedding(100, 32), nn.Linear(32, 64), nn.Linear(64, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(self.emb(ids.view(-1, ids.shape[-1])))))


@pytest.mark.parametrize("form", ["native", "onnx-dynamic", "onnx-static"])
def test_an_embedding_of_ids_shaped_by_their_own_size_is_quantized(tmp_path, form):
    """The ids are integer shape-like values, but the lookup in the stored float table is data: everything after
    it was dispatched as shape arithmetic, nothing was quantized and no file held a QuantizeLinear."""
    torch.manual_seed(0)
    model = _TokenModel().eval()
    ids = torch.randint(0, 100, (2, 16))
    if form != "native":
        path = tmp_path / "m.onnx"
        torch.onnx.export(model, (ids,), str(path), dynamo=False, opset_version=14, input_names=["ids"],
                          dynamic_axes={"ids": {0: "b", 1: "s"}} if form == "onnx-dynamic" else None)
        model = fxq.load_onnx(path)
    q = fxq.quantize(model, [ids, ids], "trt_int8", progress=False)
    quantized = [r for r in fxq.summary(q).layers if r.platform == "trt_int8"]
    assert sum(r.op_type in ("MatMul", "Gemm") for r in quantized) == 2, fxq.summary(q)
    out = next(p for p in fxq.export(q, "trt_int8", tmp_path / "q.onnx") if str(p).endswith("q.onnx"))
    assert sum(n.op_type == "QuantizeLinear" for n in onnx.load(str(out)).graph.node) >= 4


class _ComputedWeights(nn.Module):
    """``weight_norm`` (a Conv1d's weight is ``g * v / ||v||``, as Wav2Vec2's positional convolution) and a linear
    layer whose weight is a transpose of the stored one: torch's legacy exporter without constant folding writes
    both as nodes over initializers."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.utils.parametrizations.weight_norm(nn.Conv1d(4, 8, 3, padding=1), dim=2)
        self.w = nn.Parameter(torch.randn(5, 8) * 0.3)
        self.bn = nn.BatchNorm1d(8).eval()

    def forward(self, x):
        y = torch.relu(self.bn(self.conv(x)))
        return y.transpose(1, 2) @ self.w.t().contiguous()


def test_parameters_computed_from_initializers_are_folded(tmp_path):
    """The Conv converter looked its weight up among the initializers: ``KeyError: '/conv/weight/.../Mul_output_0'``.
    The folded file keeps the Conv's parameters as weights fxq quantizes, and computes what the source file does."""
    model = _ComputedWeights().eval()
    x = torch.randn(2, 4, 16)
    src = tmp_path / "unfolded.onnx"
    torch.onnx.export(model, (x,), src, opset_version=17, dynamo=False, do_constant_folding=False,
                      input_names=["x"], output_names=["y"])
    assert {"ReduceL2", "Transpose"} <= {n.op_type for n in onnx.load(src).graph.node}
    gm = fxq.load_onnx(src)
    ops = {n.meta.get("onnx", {}).get("op_type") for n in gm.graph.nodes}
    assert "ReduceL2" not in ops
    with torch.no_grad():
        torch.testing.assert_close(gm(x), model(x), rtol=1e-5, atol=1e-5)
    qmodel = fxq.quantize(gm, [x, torch.randn(2, 4, 16)], platform="trt_int8", progress=False)
    summary = str(fxq.summary(qmodel))
    conv = next(n.name for n in qmodel.graph.nodes if n.meta.get("onnx", {}).get("op_type") == "Conv")
    assert any(conv in line and "int8" in line for line in summary.splitlines()), summary
    path = fxq.export(qmodel, "trt_int8", tmp_path / "q.onnx")[0]
    with torch.no_grad():
        torch.testing.assert_close(torch.from_numpy(run_ort(path, x)), qmodel(x), rtol=0, atol=1e-5)
