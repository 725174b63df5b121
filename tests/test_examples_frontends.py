"""The ONNX and caffe quantization examples run end to end (``--fast``, in process) and write what they say."""
from __future__ import annotations

import importlib.util
import json
import pathlib

import numpy as np
import pytest
import torch

import fxq

from _models import noise_ratio

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _node_by_source(q: torch.fx.GraphModule, key: str, field: str, value: str) -> torch.fx.Node:
    return next(n for n in q.graph.nodes if isinstance(n.meta.get(key), dict) and n.meta[key].get(field) == value
                and "fxq" in n.meta)


def test_quantize_onnx_model_example(tmp_path):
    result = _load("quantize_onnx_model").main(["--fast", "--out", str(tmp_path)])
    q = result["model"]
    assert result["noise"] < 0.1  # random weights, two 4-image calibration batches at 32x32
    # the dispatching table named the classifier by its ONNX node name
    assert result["table"] == {"/fc/Gemm": "fp32"}
    assert _node_by_source(q, "onnx", "node_name", "/fc/Gemm").meta["fxq"].platform == "fp32"
    assert _node_by_source(q, "onnx", "node_name", "/conv1/Conv").meta["fxq"].platform == "trt_int8"
    graphwise, layerwise = result["graphwise"], result["layerwise"]
    assert graphwise.kind == "graphwise" and len(graphwise) == 20  # 20 quantized convs; the FP32 Gemm is left out
    assert [o.name for o in graphwise.outputs] == ["logits"]  # the ONNX output name
    assert layerwise.kind == "layerwise" and len(layerwise) == 20
    names = sorted(p.name for p in result["files"])
    assert names == ["resnet18_trt_int8.fxq", "resnet18_trt_int8.onnx"] and (tmp_path / "resnet18.onnx").is_file()
    # the exported Q/DQ model runs at another batch size (dynamic batch) and computes what fxq simulates, up to
    # values on rounding boundaries: conv sums differ in their last float bits between onnxruntime and torch,
    # and each flipped integer spreads through the 20 quantized layers that follow
    ort = pytest.importorskip("onnxruntime")
    sess = ort.InferenceSession(str(tmp_path / "resnet18_trt_int8.onnx"), providers=["CPUExecutionProvider"])
    assert [i.name for i in sess.get_inputs()] == ["image"]
    x = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = q(x)
        with fxq.fp32_mode(q):
            fp32 = q(x)
    got = torch.from_numpy(sess.run(None, {"image": x.numpy()})[0])
    assert torch.nn.functional.cosine_similarity(got.flatten(), ref.flatten(), dim=0) > 0.98
    assert noise_ratio(got, fp32) < 2 * noise_ratio(ref, fp32)
    again = fxq.load(tmp_path / "resnet18_trt_int8.fxq")
    with torch.no_grad():
        torch.testing.assert_close(again(x), ref)


@pytest.mark.parametrize("platform", ["ncnn_int8", "ppl_cuda_int8"])
def test_quantize_caffe_model_example(platform, tmp_path):
    result = _load("quantize_caffe_model").main(["--fast", "--platform", platform, "--out", str(tmp_path)])
    q = result["model"]
    assert result["noise"] < 0.01
    assert (tmp_path / "resnet_mini.prototxt").is_file() and (tmp_path / "resnet_mini.caffemodel").is_file()
    assert len(list((tmp_path / "calib").glob("*.npy"))) == 2
    # BatchNorm + Scale folded; the dispatching table named the stem by its caffe layer name
    assert not [n for n in q.graph.nodes if n.meta.get("caffe", {}).get("type") in ("BatchNorm", "Scale")]
    assert _node_by_source(q, "caffe", "layer", "conv1").meta["fxq"].platform == "fp32"
    assert _node_by_source(q, "caffe", "layer", "res2a_branch2a").meta["fxq"].platform == platform
    assert result["graphwise"].outputs[0].name == "prob" and len(result["layerwise"]) > 0
    files = {p.name: p for p in result["files"]}
    if platform == "ncnn_int8":
        assert set(files) == {"resnet_mini_ncnn.param", "resnet_mini_ncnn.bin", "resnet_mini_ncnn.table",
                              "resnet_mini_ncnn.fp32.param", "resnet_mini_ncnn.fp32.bin"}
        table = files["resnet_mini_ncnn.table"].read_text()
        layers = {line.split()[0] for line in table.splitlines() if line.strip()}
        assert "res2a_branch2a" in layers and "res2a_branch2a_param_0" in layers  # caffe layer names
        assert "conv1" not in layers  # kept in FP32 by the dispatching table
        scales = [float(v) for line in table.splitlines() for v in line.split()[1:]]
        assert scales and np.isfinite(scales).all() and min(scales) > 0
    else:
        assert set(files) == {"resnet_mini_ppl.onnx", "resnet_mini_ppl.json"}
        doc = json.loads(files["resnet_mini_ppl.json"].read_text())
        assert doc["op_info"]["conv1"]["data_type"] == "FLOAT32"
        assert doc["op_info"]["res2a_branch2a"]["data_type"] == "INT8"
        assert doc["quant_info"]


@pytest.mark.parametrize("name", ["quantize_onnx_model", "quantize_caffe_model"])
def test_examples_have_docstring_and_main(name):
    mod = _load(name)
    assert mod.__doc__ and callable(mod.main)
