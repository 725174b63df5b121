"""The graph-quantization examples run (fast mode) and say what they should."""
import importlib.util
import pathlib

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_quantize_torch_model_example():
    noise = _load("quantize_torch_model").main(["--fast"])
    assert noise < 0.01


def test_custom_platform_example():
    report = _load("custom_platform").main(["--fast"])
    assert report.platform == "my_academic_int8"
    fc = next(r for r in report.layers if r.node == "fc")
    assert "pc0" in fc.weight and fc.output is None
    conv = next(r for r in report.layers if r.node == "conv1")
    assert "pt" in conv.weight and conv.inputs == ["int8 asym pt [0,255] ACTIVATED"]


def test_low_bit_example():
    results = _load("low_bit").main(["--fast"])
    assert results["W8A8"] < results["W6A6"] < results["W4A4"]
    assert results["W8A8"] <= results["mixed 4/8"] < results["W4A4"]


@pytest.mark.parametrize("name", ["quantize_torch_model", "custom_platform", "low_bit", "auto_quantize"])
def test_examples_have_docstring_and_main(name):
    mod = _load(name)
    assert mod.__doc__ and callable(mod.main)


def test_auto_quantize_example():
    pytest.importorskip("sklearn")
    pytest.importorskip("onnxruntime")
    reports, deployed = _load("auto_quantize").main(["--fast"])
    ort_report, trt_report = reports["ort_int8"], reports["trt_int8"]
    assert ort_report.met and ort_report.size_final <= 0.2 * ort_report.size_fp32
    assert ort_report.lowered  # 4-bit layers were needed for the size budget
    assert abs(deployed - ort_report.final_value) <= 2 / 597  # onnxruntime ~ the simulation
    assert trt_report.met and trt_report.fallback == "fp16" and trt_report.final_value < trt_report.int8_value
