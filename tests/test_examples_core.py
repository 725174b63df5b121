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


@pytest.mark.parametrize("name", ["quantize_torch_model", "custom_platform", "low_bit"])
def test_examples_have_docstring_and_main(name):
    mod = _load(name)
    assert mod.__doc__ and callable(mod.main)
