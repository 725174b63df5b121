"""OpenPPL export: FP32 ONNX + json whose schema ppl.nn reads (no ppl.nn runtime can be installed here)."""
from __future__ import annotations

import json

import onnx
import pytest
import torch

import fxq
from fxq.backends.openppl import PPL_KEYS

from _export_helpers import ort_session, small_quantized


@pytest.fixture(scope="module")
def ppl(tmp_path_factory):
    gm = small_quantized("ppl_cuda_int8")
    paths = fxq.export(gm, "ppl_cuda_int8", tmp_path_factory.mktemp("ppl") / "model")
    return gm, paths


def test_files(ppl):
    _, paths = ppl
    assert [p.name for p in paths] == ["model.onnx", "model.json"]


def test_json_schema(ppl):
    gm, (onnx_path, json_path) = ppl
    doc = json.loads(json_path.read_text())
    assert set(doc) == {"quant_info", "op_info"}
    model = onnx.load(onnx_path)
    tensors = ({o for n in model.graph.node for o in n.output} | {i.name for i in model.graph.input}
               | {t.name for t in model.graph.initializer})
    assert doc["quant_info"] and set(doc["quant_info"]) <= tensors
    for name, entry in doc["quant_info"].items():
        assert tuple(entry) == PPL_KEYS, name
        assert entry["quant_flag"] == 1 and isinstance(entry["sym"], bool)
        assert isinstance(entry["bit_width"], int) and isinstance(entry["q_min"], int)
        if entry["per_channel"]:
            n = len(entry["scale"])
            for key in ("scale", "zero_point", "tensor_min", "tensor_max"):
                assert isinstance(entry[key], list) and len(entry[key]) == n
            values = zip(entry["scale"], entry["tensor_min"], entry["tensor_max"])
        else:
            assert isinstance(entry["scale"], float) and isinstance(entry["zero_point"], int)
            values = [(entry["scale"], entry["tensor_min"], entry["tensor_max"])]
        for scale, lo, hi in values:
            assert isinstance(lo, float) and isinstance(hi, float)
            # ppl.nn derives the scale from the range and the bit width
            assert (hi - lo) / (entry["q_max"] - entry["q_min"]) == pytest.approx(scale, rel=1e-6)
    # weights per channel (int8), passive biases int32
    widths = {e["bit_width"] for e in doc["quant_info"].values()}
    assert {8, 32} <= widths
    assert any(e["per_channel"] for e in doc["quant_info"].values())
    assert {n.name for n in model.graph.node} == set(doc["op_info"])
    kinds = {v["data_type"] for v in doc["op_info"].values()}
    assert kinds <= {"INT8", "FLOAT32"} and "INT8" in kinds
    assert doc["op_info"]["conv1"] == {"data_type": "INT8"}


def test_fp32_model_runs_with_baked_weights(ppl):
    gm, (onnx_path, _) = ppl
    model = onnx.load(onnx_path)
    assert not any(n.op_type in ("QuantizeLinear", "DequantizeLinear") for n in model.graph.node)
    x = torch.randn(2, 3, 16, 16)
    sess = ort_session(onnx_path, False)
    got = torch.from_numpy(sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0])
    with fxq.fake_quant_mode(gm, "disabled"), torch.no_grad():
        ref = gm(x)  # weights and biases stay baked: only activations are not quantized
    assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4)
