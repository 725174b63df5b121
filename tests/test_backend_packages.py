"""Backends as packages: every built-in platform and exporter registered on ``import fxq``, and each exporter's
generic pre-check against its platforms' declared Capability (one rule, one message, nothing written)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import fxq
from fxq.backends import EXPORTERS
from fxq.backends.capability import capabilities_of, check_capabilities
from fxq.backends.ncnn import NcnnInt8
from fxq.qconfig import PLATFORMS

from _export_helpers import small_quantized

BUILT_IN = {"trt_int8": "tensorrt", "trt_fp8": "tensorrt", "ort_int8": "onnxruntime", "dsp_int8": "onnxruntime",
            "academic_int8": "onnxruntime", "academic_int4": "onnxruntime", "academic_mix": "onnxruntime",
            "ppl_cuda_int8": "openppl", "ncnn_int8": "ncnn"}


def test_import_fxq_registers_every_built_in_platform_and_exporter() -> None:
    assert set(BUILT_IN) <= set(PLATFORMS.names())
    assert {"tensorrt", "onnxruntime", "openppl", "ncnn"} <= set(EXPORTERS.names())
    for name, exporter in BUILT_IN.items():
        assert PLATFORMS.get(name).exporter == exporter


def test_capabilities_of_an_exporter_are_its_platforms() -> None:
    assert set(capabilities_of("tensorrt")) == {"trt_int8", "trt_fp8"}
    assert set(capabilities_of("onnxruntime")) == {"ort_int8", "ort_int8_reduce_range"}  # dsp / academic: none
    assert set(capabilities_of("ncnn")) == {"ncnn_int8"}
    assert capabilities_of("no such exporter") == {}


def test_capabilities_declare_the_ops_their_exporters_run_quantized() -> None:
    cap = capabilities_of("ncnn")["ncnn_int8"]

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c2, self.c3, self.fc = nn.Conv2d(3, 3, 3), nn.Conv3d(3, 3, 1), nn.Linear(4, 4)
            self.up = nn.ConvTranspose2d(3, 3, 2)
            self.w = nn.Parameter(torch.randn(4, 4))

        def forward(self, x, v):
            y = self.up(self.c2(x)) + self.c3(x.unsqueeze(2)).squeeze(2).mean()
            return y, self.fc(v) @ self.w, v @ v.transpose(0, 1)

    gm = fxq.prepare(Net().eval(), "trt_int8", (torch.randn(1, 3, 6, 6), torch.randn(4, 4)))
    nodes = {n.name: n for n in gm.graph.nodes}
    problem = {name: cap.op_problem(t, nodes[name], gm) for name, t in
               [("c2", "Conv"), ("c3", "Conv"), ("fc", "Gemm"), ("up", "ConvTranspose"), ("matmul", "MatMul"),
                ("matmul_1", "MatMul")]}
    assert problem["c2"] is None and problem["fc"] is None and problem["matmul"] is None  # x @ W: InnerProduct
    assert problem["c3"] == "ncnn has no int8 3-D convolution (Convolution3D runs in FP32)"
    assert problem["up"] == "only Conv, Gemm, MatMul run quantized, not ConvTranspose"
    assert problem["matmul_1"] == "ncnn runs a MatMul int8 only by a constant 2-D matrix"  # two activations
    for exporter in ("tensorrt", "onnxruntime", "openppl"):  # Q/DQ formats put a quantizer before any op
        assert not any(cap.restricts_ops for cap in capabilities_of(exporter).values())


@pytest.mark.parametrize(("platform", "exporter", "message"), [
    ("ort_int8", "tensorrt", r"tensorrt export: quantizer '\w+' \(activation of '\w+'\): trt_int8 exports TensorRT "
                             r"INT8 .*must be symmetric.*Fix: quantize for 'trt_fp8' or 'trt_int8'"),
    ("ncnn_int8", "onnxruntime", r"onnxruntime export: quantizer '\w+' \(activation of '\w+'\): .*must round "
                                 r"HALF_EVEN, got HALF_FAR_FROM_ZERO.*Fix: quantize for 'ort_int8'"),
    ("ncnn_int8", "openppl", r"openppl export: quantizer '\w+' \(activation of '\w+'\): .*half to even.*must "
                             r"round HALF_EVEN"),
    ("trt_fp8", "openppl", r"openppl export: quantizer '\w+' \(\w+ of '\w+'\): .*must be integer, got FP8 E4M3"),
    ("ppl_cuda_int8", "ncnn", r"ncnn export: quantizer '\w+' \(\w+ of '\w+'\): ncnn_int8 .*Fix: quantize for "
                              r"'ncnn_int8'"),
], ids=["ort-to-tensorrt", "ncnn-to-onnxruntime", "ncnn-to-openppl", "fp8-to-openppl", "ppl-to-ncnn"])
def test_exporter_pre_check_names_quantizer_rule_and_fix(tmp_path, platform: str, exporter: str,
                                                          message: str) -> None:
    gm = small_quantized(platform)
    with pytest.raises(fxq.ExportError, match=message):
        check_capabilities(gm, exporter)
    with pytest.raises(fxq.ExportError, match=message):
        fxq.export(gm, exporter, tmp_path / "m.onnx")
    assert list(tmp_path.iterdir()) == []


class _BiasedNcnn(NcnnInt8):
    """ncnn_int8 with int32 passive biases, which its exporter cannot write (not registered: no capability)."""

    capability = None
    bias_bits = 32


def test_quantized_bias_is_refused_by_an_exporter_that_keeps_biases_fp32() -> None:
    check_capabilities(small_quantized("ncnn_int8"), "ncnn")
    with pytest.raises(fxq.ExportError, match=r"quantizer '\w+' \(bias of '\w+'\): ncnn_int8 .*bias quantization "
                                              r"must stay FP32 \(bias_bits=None\)"):
        check_capabilities(small_quantized(_BiasedNcnn()), "ncnn")
