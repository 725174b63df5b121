"""``load_onnx`` checks its conversion against onnxruntime and names the first ONNX node that differs."""
from __future__ import annotations

import logging
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import fxq
from fxq.errors import FrontendError

ort = pytest.importorskip("onnxruntime")


class _Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.fc = nn.Conv2d(3, 8, 3, padding=1), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.conv(x)).mean((2, 3)))


def _export(model: nn.Module, path: Path, opset: int, dynamic: bool = False, size: int = 16) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model.eval(), (torch.randn(1, 3, size, size),), str(path), dynamo=False,
                          opset_version=opset, input_names=["x"],
                          dynamic_axes={"x": {0: "batch"}} if dynamic else None)
    return path


@pytest.fixture
def small_file(tmp_path) -> Path:
    torch.manual_seed(0)
    return _export(_Small(), tmp_path / "small.onnx", 13)


@pytest.fixture
def broken_relu(monkeypatch):
    """onnx2torch's Relu converter made wrong on purpose (adds 1)."""
    from onnx2torch.node_converters import registry as o2t
    from onnx2torch.utils.common import OperationConverterResult

    key = o2t.OperationDescription(domain="", operation_type="Relu", version=13)  # what opset 13 files use
    original = o2t._CONVERTER_REGISTRY[key]

    class _PlusOne(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(x) + 1

    def convert(node, graph):
        return OperationConverterResult(torch_module=_PlusOne(), onnx_mapping=original(node, graph).onnx_mapping)

    monkeypatch.setitem(o2t._CONVERTER_REGISTRY, key, convert)


def test_wrong_converter_is_caught_and_the_node_named(small_file, broken_relu) -> None:
    with pytest.raises(FrontendError) as info:
        fxq.load_onnx(small_file)
    text = str(info.value)
    assert "first differing ONNX node '/Relu' (Relu)" in text
    assert "max abs diff 1 " in text and "x: float32 [1, 3, 16, 16]" in text
    assert "verify=False" in text and "report" in text


def test_verify_false_skips_the_check(small_file, broken_relu) -> None:
    gm = fxq.load_onnx(small_file, verify=False)
    assert gm(torch.randn(1, 3, 16, 16)).shape == (1, 4)


def test_check_passes_on_a_good_conversion(small_file, caplog) -> None:
    with caplog.at_level(logging.DEBUG, logger="fxq.frontends.onnx"):
        fxq.load_onnx(small_file, verify=True)
    assert "outputs match" in caplog.text


def test_without_onnxruntime_the_check_is_skipped(small_file, broken_relu, monkeypatch, caplog) -> None:
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    with caplog.at_level(logging.DEBUG, logger="fxq.frontends.onnx"):
        fxq.load_onnx(small_file)
    assert "onnxruntime is not installed" in caplog.text


def test_open_dims_skip_the_check_unless_shapes_are_given(tmp_path, broken_relu) -> None:
    path = _export(_Small(), tmp_path / "dyn.onnx", 13, dynamic=True)
    fxq.load_onnx(path)  # batch is symbolic: nothing to generate an input from
    with pytest.raises(FrontendError, match=r"'/Relu' \(Relu\)"):
        fxq.load_onnx(path, input_shapes={"x": [2, 3, 16, 16]})


def test_bad_verify_value(small_file) -> None:
    with pytest.raises(FrontendError, match="verify must be"):
        fxq.load_onnx(small_file, verify="yes")


def _small_swin() -> nn.Module:
    from torchvision.models.swin_transformer import SwinTransformer

    torch.manual_seed(0)
    return SwinTransformer(patch_size=[4, 4], embed_dim=16, depths=[1, 1], num_heads=[1, 2], window_size=[2, 2],
                           num_classes=10).eval()


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("opset", [13, 17])
def test_swin_like_file_converts_right(tmp_path, opset: int, dynamic: bool) -> None:
    """torchvision's Swin at opsets 13/17: GlobalAveragePool over an input of unknown rank averaged every dim
    (``addmm 1x1 and 768x1000``) and LayerNormalization got ``normalized_shape=[0]`` from unknown dims."""
    model = _small_swin()
    path = _export(model, tmp_path / "swin.onnx", opset, dynamic=dynamic, size=32)
    gm = fxq.load_onnx(path, verify=True)
    for batch in (1, 2) if dynamic else (1,):
        x = torch.randn(batch, 3, 32, 32)
        with torch.no_grad():
            ref = model(x).numpy()
            np.testing.assert_allclose(gm(x).numpy(), ref, rtol=1e-4, atol=1e-5)
