"""The fast subset of the model-zoo conformance suite (``bench/zoo.py``): torchvision models of distinct families,
random init at 32x32, through capture, quantize, export and the runtime check on TensorRT / ONNX Runtime / NCNN.

The whole zoo (109 models, four capture paths) is a benchmark; its table is in ``bench/RESULTS.md``.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import zoo  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

NATIVE = ["resnet18", "mobilenet_v2", "mobilenet_v3_small", "shufflenet_v2_x0_5", "squeezenet1_1",
          "efficientnet_b0", "densenet121"]
FROM_ONNX = ["resnet18", "mobilenet_v3_small", "efficientnet_b0"]


def _run(name: str, path: str) -> None:
    assert name in zoo.SUBSET
    rows = zoo.work(name, "classification", path, list(zoo.PLATFORMS))
    failed = [f"{r['platform']}/{r['step']}: {r['status']}" for r in rows if r["status"] != "ok"]
    assert not failed, failed
    done = {(r["platform"], r["step"]) for r in rows}
    assert all((p, "runtime") in done for p in zoo.PLATFORMS), done


@pytest.mark.parametrize("name", NATIVE)
def test_native(name):
    _run(name, "native")


@pytest.mark.parametrize("name", FROM_ONNX)
def test_legacy_onnx_opset13(name):
    _run(name, "legacy13")
