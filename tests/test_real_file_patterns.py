"""Failure patterns of ONNX files users have (issue: real files in, deployable files out), each reproduced
with torch's own exporters and run to a deployed file."""
from __future__ import annotations

import onnx
import pytest
import torch
from _export_helpers import run_ort
from torch import nn

import fxq

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
