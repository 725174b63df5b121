"""Graphs far deeper than Python's recursion limit: no graph walk of fxq may recurse along graph edges.

ResNet-152, EfficientNet and ViT graphs have thousands of nodes in one long chain; a walk that recursed from a
node back to its inputs raised ``RecursionError`` in ``fxq.prepare``. Every test here runs with the default
recursion limit (pinned to at most 1000, never raised) on a residual chain of ``3 * BLOCKS`` ops, traced
natively and loaded from an ONNX file, and on raw ``fx`` graphs ``CHAIN`` nodes deep.
"""
from __future__ import annotations

import copy
import logging
import sys
import warnings

import onnx
import pytest
import torch
from torch import fx, nn

import fxq
from fxq.algorithms.adaround import adaround
from fxq.algorithms.bias_correction import bias_correction
from fxq.algorithms.blocks import _build_module
from fxq.errors import GraphError
from fxq.graph.info import computed_from_parameters
from fxq.setting import QuantizationSetting

pytestmark = pytest.mark.usefixtures("one_thread", "default_recursion_limit")

BLOCKS = 450  # conv-or-mul, add, relu6: 1350 ops in one chain, ~2400 nodes once quantized (limit: 1000 frames)
CONV_EVERY = 3  # a 1x1 conv in every third block, a multiply in the others (fewer quantizers: faster)
CHAIN = 5000  # raw fx graphs: cheap, so deeper


@pytest.fixture(scope="module", autouse=True)
def default_recursion_limit():
    """Python's default limit (1000), or lower if something lowered it; restored afterwards, never raised."""
    before = sys.getrecursionlimit()
    sys.setrecursionlimit(min(before, 1000))
    yield
    sys.setrecursionlimit(before)


class DeepChain(nn.Module):
    """``x = relu6(x + f_k(x))`` ``BLOCKS`` times; ``f_k`` a 1x1 conv or ``* 0.5`` (relu6 keeps values bounded)."""

    def __init__(self) -> None:
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(4, 4, 1) for _ in range(0, BLOCKS, CONV_EVERY))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for k in range(BLOCKS):
            y = self.convs[k // CONV_EVERY](x) if k % CONV_EVERY == 0 else x * 0.5
            x = nn.functional.relu6(x + y)
        return x


def _data() -> list[torch.Tensor]:
    return [torch.randn(1, 4, 4, 4, generator=torch.Generator().manual_seed(1))]


@pytest.fixture(scope="module")
def deep() -> nn.Module:
    torch.manual_seed(0)
    return DeepChain().eval()


@pytest.fixture(scope="module")
def deep_trt(deep) -> fx.GraphModule:
    return fxq.quantize(deep, _data(), "trt_int8", progress=False)


@pytest.fixture(scope="module")
def deep_onnx(deep, tmp_path_factory) -> fx.GraphModule:
    path = tmp_path_factory.mktemp("deep") / "deep.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(deep, (_data()[0],), str(path), dynamo=False, opset_version=13,
                          input_names=["x"], output_names=["y"])
    return fxq.load_onnx(path)


def _check_runs(q: nn.Module, model: nn.Module) -> torch.Tensor:
    x = _data()[0]
    with torch.no_grad():
        out, ref = q(x), model(x)
    assert out.shape == ref.shape and torch.isfinite(out).all()
    return out


# --------------------------------------------------------------------------- the walks themselves
def _chains() -> tuple[fx.Graph, fx.Node, fx.Node]:
    """``x -> relu -> ... -> relu`` and ``w -> neg -> ... -> neg`` (a parameter chain), each ``CHAIN`` long."""
    g = fx.Graph()
    data = g.placeholder("x")
    param = g.get_attr("w")
    for _ in range(CHAIN):
        data = g.call_function(torch.relu, (data,))
        param = g.call_function(torch.neg, (param,))
    g.output((data, param))
    return g, data, param


def test_parameter_walks_follow_chains_of_any_length():
    _, data, param = _chains()
    assert computed_from_parameters(param) is True and computed_from_parameters(data) is False
    memo: dict[fx.Node, bool] = {}
    assert computed_from_parameters(param, memo) is True and computed_from_parameters(data, memo) is False
    assert len(memo) == 2 * CHAIN + 2  # every node answered once


def test_block_copies_a_long_parameter_chain_and_names_a_missing_input():
    g, data, param = _chains()
    root = nn.Module()
    root.w = nn.Parameter(torch.randn(3))
    gm = fx.GraphModule(root, g)
    block = _build_module(gm, [param], [], [param], {})  # the whole parameter chain is copied in
    assert torch.equal(block()[0], root.w if CHAIN % 2 == 0 else -root.w)
    with pytest.raises(GraphError, match="'x' that is not among its inputs"):
        _build_module(gm, [data], [], [data], {})  # the chain leads back to a graph input the block was not given


# --------------------------------------------------------------------------- the public paths
def test_quantize_trt_native(deep, deep_trt):
    assert sum(1 for _ in deep_trt.graph.nodes) > 3 * BLOCKS
    _check_runs(deep_trt, deep)


def test_export_trt_onnx(deep_trt, tmp_path):
    paths = fxq.export(deep_trt, "trt_int8", tmp_path / "deep_trt.onnx")
    model = onnx.load(str(paths[0]))
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("Conv") == len(range(0, BLOCKS, CONV_EVERY)) and ops.count("QuantizeLinear") > BLOCKS


def test_save_load_round_trip(deep_trt, tmp_path):
    again = fxq.load(fxq.save(deep_trt, tmp_path / "deep.fxq"))
    x = _data()[0]
    with torch.no_grad():
        assert torch.equal(again(x), deep_trt(x))


def test_graphwise_error_analyse(deep_trt):
    report = fxq.graphwise_error_analyse(deep_trt, _data(), steps=1)
    assert len(report) == len(range(0, BLOCKS, CONV_EVERY)) and report.outputs


def test_block_algorithms(deep_trt, caplog):
    """Bias correction (blocks of 4 ops) and AdaRound (one step, blocks of 1 op) walk every block of the chain."""
    q = copy.deepcopy(deep_trt)
    s = QuantizationSetting()
    s.adaround_setting.steps = 1
    s.adaround_setting.interested_layers = [r"convs\.(0|50|100|149)"]  # every layer: too slow for this file
    with caplog.at_level(logging.INFO, logger="fxq.algorithms"):
        bias_correction(q, _data(), s)
        adaround(q, _data(), s)
    convs = len(range(0, BLOCKS, CONV_EVERY))
    assert f"bias correction: corrected {convs} op(s)" in caplog.text
    assert "adaround: 4 layer(s)" in caplog.text
    assert torch.isfinite(q(_data()[0])).all()


def test_onnx_loaded_ncnn_quantize_and_export(deep, deep_onnx, tmp_path):
    q = fxq.quantize(deep_onnx, _data(), "ncnn_int8", progress=False)
    _check_runs(q, deep)
    paths = fxq.export(q, "ncnn_int8", tmp_path / "deep.param")
    assert paths[0].read_text().count("Convolution") >= len(range(0, BLOCKS, CONV_EVERY))


def test_onnx_loaded_trt_quantize(deep, deep_onnx):
    _check_runs(fxq.quantize(deep_onnx, _data(), "trt_int8", progress=False), deep)


@pytest.mark.parametrize("name", ["resnet152", "efficientnet_b0"])
def test_torchvision_deep_models_quantize(name):
    """Random init, one 1x3x32x32 batch: each takes a few seconds."""
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = getattr(torchvision.models, name)(weights=None).eval()
    x = torch.randn(1, 3, 32, 32)
    q = fxq.quantize(model, [x], "trt_int8", progress=False)
    with torch.no_grad():
        assert q(x).shape == (1, 1000) and torch.isfinite(q(x)).all()
