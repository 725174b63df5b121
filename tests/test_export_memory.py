"""Export memory: what an export holds on top of the quantized model, as a multiple of its FP32 weights.

The ONNX model being built (1x) and its serialized bytes while it is written (2x inside protobuf's serializer)
are needed; rebuilding protobuf lists, rewriting unchanged weights and checking or reading every weight at once
each held one more copy (TensorRT exports peaked at 5.2x; 6.1x on ResNet-152). Linux only: the peak is the
process's resident high-water mark, reset through ``/proc/self/clear_refs``. ``bench/export_memory.py`` measures
torchvision models.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from fxq.backends.qdq.onnx_graph import drop_unused_initializers

BENCH = Path(__file__).resolve().parents[1] / "bench" / "export_memory.py"


def _can_reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _can_reset_peak(),
                    reason="the resident high-water mark is reset through Linux's /proc/self/clear_refs")
@pytest.mark.parametrize("platform", ["trt_int8", "ort_int8"])
def test_export_peak_stays_under_four_times_the_weights(platform):
    """``bench/export_memory.py`` on its 96 MiB MLP, in its own process."""
    proc = subprocess.run([sys.executable, str(BENCH), "--models", "mlp", "--platforms", platform, "--json"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "error" not in row, row["error"]
    assert row["weights_mib"] == 96 and row["export_x"] < 4.0, f"{platform}: the export peaked at {row}"


def test_dropping_initializers_keeps_the_others_in_place():
    """The unused ones go, the kept ones stay where they were, values and order unchanged."""
    values = {f"w{i}": np.full((2, 3), i, np.float32) for i in range(5)}
    graph = helper.make_graph([helper.make_node("Add", ["w1", "w3"], ["y"])], "g", [],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 3])],
                              initializer=[numpy_helper.from_array(v, k) for k, v in values.items()])
    drop_unused_initializers(graph, keep=["w4"])
    assert [t.name for t in graph.initializer] == ["w1", "w3", "w4"]
    for t in graph.initializer:
        np.testing.assert_array_equal(numpy_helper.to_array(t), values[t.name])
