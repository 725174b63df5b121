"""Export memory: what an export holds on top of the quantized model, as a multiple of its FP32 weights.

The ONNX model being built (1x) and its serialized bytes while it is written (2x inside protobuf's serializer)
are needed; rebuilding protobuf lists, rewriting unchanged weights and checking or reading every weight at once
each held one more copy (TensorRT exports peaked at 5.2x; 6.1x on ResNet-152). Linux only: the peak is the
process's resident high-water mark, reset through ``/proc/self/clear_refs``. ``bench/export_memory.py`` measures
torchvision models.
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from fxq.backends.qdq.onnx_graph import drop_unused_initializers

_CHILD = r"""
import os, sys, tempfile, torch, fxq

def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024

torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(6)]).eval()  # 96 MiB
x = torch.randn(4, 2048)
q = fxq.quantize(model, [(x,)], platform=sys.argv[1], progress=False)
weights = sum(p.numel() * 4 for p in model.parameters()) / 2**20
with tempfile.TemporaryDirectory() as d:
    start = status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    fxq.export(q, sys.argv[1], os.path.join(d, "m.onnx"))
    print((status("VmHWM") - start) / weights)
"""


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
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")  # freed tensors leave at once: live memory is measured
    proc = subprocess.run([sys.executable, "-c", _CHILD, platform], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ratio = float(proc.stdout.strip().splitlines()[-1])
    assert ratio < 4.0, f"{platform}: the export peaked at {ratio:.2f}x the FP32 weights"


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
