"""fxq's graph preparation never changes what the model computes, and says so when it breaks a graph."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import fxq
from fxq.graph import passes

pytestmark = pytest.mark.usefixtures("one_thread")


class PermuteFlatten(nn.Module):
    """The common idiom: ``x.permute(...).contiguous().view(n, -1)`` (``view`` needs the copy)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.fc = nn.Linear(4 * 6 * 6, 5)

    def forward(self, x):
        y = self.conv(x)
        n = y.shape[0]
        return self.fc(y.permute(0, 3, 2, 1).contiguous().view(n, -1))


class ContiguousOutput(nn.Module):
    def forward(self, x):
        return torch.relu(x.transpose(1, 2).contiguous())


def test_contiguous_before_view_keeps_the_model_working():
    model = PermuteFlatten().eval()
    data = [torch.randn(2, 3, 8, 8) for _ in range(2)]
    qmodel = fxq.quantize(model, data, platform="trt_int8", progress=False)
    with fxq.fp32_mode(qmodel):
        torch.testing.assert_close(qmodel(data[0]), model(data[0]))
    methods = [n.target for n in qmodel.graph.nodes if n.op == "call_method"]
    assert "contiguous" not in methods and "view" not in methods and "reshape" in methods


def test_contiguous_read_by_the_output_stays():
    gm = fxq.prepare(ContiguousOutput(), "trt_int8", example_inputs=torch.randn(2, 3, 4))
    out = gm(torch.randn(2, 3, 4))
    assert out.is_contiguous()
    out.view(-1)  # the caller's own view of the result still works


def test_a_broken_rewrite_is_fxqs_error_naming_the_node(monkeypatch):
    # a broken rewrite: drop contiguous without turning its view into reshape
    monkeypatch.setattr(passes, "_only_reshaped", lambda node: True)
    monkeypatch.setattr(passes, "_LAYOUT_STRICT", {})
    with pytest.raises(fxq.GraphError, match=r"fxq's graph preparation .* broke node 'view'.*not the data's"):
        fxq.prepare(PermuteFlatten().eval(), "trt_int8", example_inputs=torch.randn(2, 3, 8, 8))


def test_data_that_does_not_fit_still_blames_the_data():
    with pytest.raises(fxq.CalibrationError):
        fxq.prepare(PermuteFlatten().eval(), "trt_int8", example_inputs=torch.randn(2, 3, 9, 9))


class StochasticResidual(nn.Module):
    """EfficientNet/ConvNeXt's residual with torchvision's stochastic depth (identity in eval)."""

    def __init__(self) -> None:
        super().__init__()
        import torchvision

        self.conv = nn.Conv2d(3, 3, 3, padding=1)
        self.drop = torchvision.ops.StochasticDepth(0.2, "row")

    def forward(self, x):
        return x + self.drop(self.conv(x))


def test_stochastic_depth_in_eval_is_an_identity(tmp_path):
    """Traced in eval, torchvision's stochastic_depth(..., training=False) had no op type, so the ncnn export of
    EfficientNet failed ('no converter for op type Unknown'); it is an identity and leaves the graph."""
    from fxq.graph.op_types import op_type

    model = StochasticResidual().eval()
    data = [torch.randn(1, 3, 8, 8) for _ in range(2)]
    qmodel = fxq.quantize(model, data, platform="ncnn_int8", progress=False)
    assert not any("stochastic_depth" in str(n.target) for n in qmodel.graph.nodes)
    with fxq.fp32_mode(qmodel):
        torch.testing.assert_close(qmodel(data[0]), model(data[0]))
    assert fxq.export(qmodel, "ncnn_int8", tmp_path / "net")
    training = torch.fx.symbolic_trace(StochasticResidual().train())
    node = next(n for n in training.graph.nodes if "stochastic_depth" in str(n.target))
    assert op_type(node) != "Identity"  # in training it drops rows: not an identity


def _window_and_shift(shift: list, size: list) -> list:
    shift[0] = min(shift[0], size[0])  # edits its list argument in place, as torchvision's Swin3D helper does
    return shift


torch.fx.wrap("_window_and_shift")


class EditsItsListArgument(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        shift = _window_and_shift([3, 3], [y.shape[2] // 4, y.shape[3]])  # a graph node: it reads traced sizes
        return torch.roll(y, shifts=(shift[0], shift[1]), dims=(2, 3))


def test_a_function_editing_its_list_argument_prepares():
    """torch.fx's interpreter handed the node's immutable list to the function; the generated code gives a fresh
    list each call. Shape propagation now does too (Swin3D failed to prepare)."""
    model = EditsItsListArgument().eval()
    x = torch.randn(1, 3, 8, 8)
    gm = fxq.prepare(model, "trt_int8", example_inputs=x)
    with fxq.fp32_mode(gm):
        torch.testing.assert_close(gm(x), model(x))


def test_a_function_editing_its_list_argument_runs_in_every_interpreter(tmp_path):
    """Every fxq interpreter gives such a function fresh lists: analysis, mismatch location, equalization
    (Swin3D's trt_int8 zoo row failed in the mismatch analysis, which blamed the data)."""
    from fxq.analysis.mismatch import locate_mismatch

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 3, 1), EditsItsListArgument()).eval()
    data = [torch.randn(1, 3, 8, 8) for _ in range(2)]
    setting = fxq.QuantizationSetting()
    setting.equalization = True
    q = fxq.quantize(model, data, "trt_int8", setting=setting, progress=False)
    report = fxq.graphwise_error_analyse(q, data)
    assert len(report) and all(r.value == r.value for r in report)  # computed, no NaN
    onnx_file = fxq.export(q, "trt_int8", tmp_path / "m.onnx")[0]
    found = locate_mismatch(q, onnx_file, data, optimize=False, teacher_forced=True)
    assert found.first_divergence is None
