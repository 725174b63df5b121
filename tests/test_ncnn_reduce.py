"""NCNN export of every ONNX ``Reduce*`` as ncnn's ``Reduction`` (0 operation sum / sumsq / mean / max / min /
prod / L1 / L2 / logsum / logsumexp), each run through the ``ncnn`` package.

Each graph is built with onnx.helper, checked in onnxruntime (default and no graph optimization) against fxq's
FP32 model, quantized for ``ncnn_int8`` and exported; ncnn's FP32 files must match fxq's FP32 mode and its int8
files fxq's simulation (``check`` of test_ncnn_gaps).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper
from test_ncnn_gaps import check
from torch import nn

import fxq
from fxq.errors import ExportError

pytest.importorskip("ncnn")

_OPS = ("ReduceSum", "ReduceSumSquare", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1",
        "ReduceL2", "ReduceLogSum", "ReduceLogSumExp")
_SHAPE = (1, 3, 4, 5)


def _reduce_model(op: str, axes: list[int], keepdims: int, opset: int, batch: int = 1) -> onnx.ModelProto:
    """Conv (3 -> 4 channels) -> Sigmoid for the log-sum (a positive sum) -> ``op`` over ``axes``."""
    rng = np.random.RandomState(0)
    w = numpy_helper.from_array((rng.randn(4, 3, 3, 3) * 0.3).astype(np.float32), "w")
    bias = numpy_helper.from_array((rng.randn(4) * 0.1).astype(np.float32), "b")
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["y"], pads=[1, 1, 1, 1])]
    src = "y"
    if op == "ReduceLogSum":
        nodes.append(helper.make_node("Sigmoid", ["y"], ["s"]))
        src = "s"
    inits = [w, bias]
    axes_as_input = opset >= 18 or (op == "ReduceSum" and opset >= 13)
    if axes_as_input:
        inits.append(numpy_helper.from_array(np.array(axes, np.int64), "axes"))
        nodes.append(helper.make_node(op, [src, "axes"], ["out"], keepdims=keepdims))
    else:
        nodes.append(helper.make_node(op, [src], ["out"], axes=axes, keepdims=keepdims))
    graph = helper.make_graph(nodes, "reduce", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, *_SHAPE[1:]])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def _ort(path: Path, x: np.ndarray, level: ort.GraphOptimizationLevel) -> np.ndarray:
    opts = ort.SessionOptions()
    opts.graph_optimization_level = level
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    return sess.run(None, {sess.get_inputs()[0].name: x})[0]


def _load_checked(path: Path) -> torch.fx.GraphModule:
    """fxq's FP32 model of ``path``, checked against onnxruntime (default and ORT_DISABLE_ALL)."""
    gm = fxq.load_onnx(path)
    x = torch.randn(*_SHAPE)
    with torch.no_grad():
        got = gm(x).numpy()
    for level in (ort.GraphOptimizationLevel.ORT_ENABLE_ALL, ort.GraphOptimizationLevel.ORT_DISABLE_ALL):
        ref = _ort(path, x.numpy(), level)
        assert got.shape == ref.shape
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)
    return gm


@pytest.mark.parametrize("op", _OPS)
@pytest.mark.parametrize("axes", [[1], [2, 3], [-1]], ids=["channel", "spatial", "last"])
@pytest.mark.parametrize("keepdims", [0, 1])
def test_reduce(tmp_path: Path, op: str, axes: list[int], keepdims: int) -> None:
    path = tmp_path / "m.onnx"
    onnx.save(_reduce_model(op, axes, keepdims, 13), path)
    _, files = check(_load_checked(path), _SHAPE, tmp_path / "net")
    param = files["param"].read_text()
    if op == "ReduceMean" and axes == [2, 3]:
        assert "Pooling" in param  # global average pooling
    else:
        assert "Reduction" in param and f" 0={_REDUCTION_OPS[op]} " in param.split("Reduction", 1)[1]


_REDUCTION_OPS = {"ReduceSum": 0, "ReduceSumSquare": 2, "ReduceMean": 3, "ReduceMax": 4, "ReduceMin": 5,
                  "ReduceProd": 6, "ReduceL1": 7, "ReduceL2": 8, "ReduceLogSum": 9, "ReduceLogSumExp": 10}
"""ncnn's Reduction operations (its reduction.h); the ncnn runs above are what pin each number."""


@pytest.mark.parametrize("op", ["ReduceSum", "ReduceMax", "ReduceL2"])
def test_reduce_opset18_axes_input(tmp_path: Path, op: str) -> None:
    """Axes as a constant input (fxq's ``OnnxReduce`` for opset 18, onnx2torch's module for ``ReduceSum-13``)."""
    for opset in (13, 18):
        path = tmp_path / f"m{opset}.onnx"
        onnx.save(_reduce_model(op, [1, -1], 0, opset), path)
        check(_load_checked(path), _SHAPE, tmp_path / f"net{opset}")


def test_reduce_over_the_batch_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "m.onnx"
    onnx.save(_reduce_model("ReduceMax", [0, 1], 1, 13, batch=2), path)
    gm = fxq.quantize(fxq.load_onnx(path), [torch.randn(2, *_SHAPE[1:]) for _ in range(2)], "ncnn_int8",
                      progress=False)
    with pytest.raises(ExportError, match="batch"):
        fxq.export(gm, "ncnn_int8", tmp_path / "net")


class Torch(nn.Module):
    """The torch function / method forms of the reductions fxq types (``torch.sum``, ``x.amax``...)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = self.conv(x)
        return (torch.sum(y, dim=1), y.amax(dim=(2, 3), keepdim=True), torch.amin(y, -1), y.prod(1, keepdim=True),
                torch.logsumexp(y, dim=(1, 3)))


def test_torch_forms(tmp_path: Path) -> None:
    _, files = check(Torch().eval(), _SHAPE, tmp_path / "net")
    assert files["param"].read_text().count("Reduction") == 5


class Normalized(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.fc(x), dim=-1)


def test_onnx_normalize(tmp_path: Path) -> None:
    """F.normalize as torch.onnx writes it at opset 17 (ReduceL2 -> Clip -> Expand -> Div): a Swin-V2 attention."""
    path = tmp_path / "m.onnx"
    torch.onnx.export(Normalized().eval(), (torch.randn(1, 5, 8),), str(path), dynamo=False, opset_version=17)
    assert "ReduceL2" in {n.op_type for n in onnx.load(path).graph.node}
    gm = fxq.load_onnx(path)
    x = torch.randn(1, 5, 8)
    with torch.no_grad():
        got = gm(x).numpy()
    for level in (ort.GraphOptimizationLevel.ORT_ENABLE_ALL, ort.GraphOptimizationLevel.ORT_DISABLE_ALL):
        np.testing.assert_allclose(got, _ort(path, x.numpy(), level), rtol=1e-4, atol=1e-5)
    _, files = check(gm, (1, 5, 8), tmp_path / "net")
    assert " 0=8 " in files["param"].read_text()
