"""The fast subset of ``bench/onnx_corpus.py``: files of the onnx package's own backend test data (torch 0.3/0.4's
opset-6 exports, onnx-caffe2's SqueezeNet graph) through load, quantize, export and the runtime check on TensorRT /
ONNX Runtime / NCNN. The whole corpus's table is in ``bench/RESULTS.md``."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import onnx_corpus  # noqa: E402
import zoo  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

FILES = [("pytorch-converted", "test_Conv2d_groups"), ("pytorch-converted", "test_PReLU_2d_multiparam"),
         ("pytorch-converted", "test_AvgPool3d_stride"), ("pytorch-converted", "test_log_softmax_dim3"),
         ("pytorch-operator", "test_operator_add_size1_broadcast"), ("light", "light_squeezenet")]


@pytest.mark.skipif(not onnx_corpus.backend_data().is_dir(), reason="onnx was installed without its test data")
@pytest.mark.parametrize("set_name, name", FILES)
def test_file_deploys_on_every_platform(set_name, name):
    item = next(i for i in onnx_corpus.corpus([set_name], None) if i[1] == name)
    rows = onnx_corpus.work(*item, list(zoo.PLATFORMS))
    failed = [f"{r['platform']}/{r['step']}: {r['status']}" for r in rows if r["status"] != "ok"]
    assert not failed, failed
    assert all((p, "runtime") in {(r["platform"], r["step"]) for r in rows} for p in zoo.PLATFORMS)


def test_followed_advice_is_the_concrete_one():
    """The bench follows a ``batch_dims`` entry an export error gives with its dim, as a user would, and not one
    that asks for the user's knowledge."""
    concrete = ("... Fix: load the model with fxq.load_onnx(..., batch_dims={'387': 1}) (CLI: --batch-dim 387=1): "
                "ONNX output '387' carries the batch at dim 1")
    assert zoo.advised_batch_dims(concrete) == {"387": 1}
    assert zoo.advised_batch_dims("batch_dims={'t': None}) (CLI: --batch-dim t=none)") == {"t": None}
    assert zoo.advised_batch_dims("fxq.load_onnx(..., batch_dims={'state': <its batch dim>})") is None
    assert zoo.advised_batch_dims("slice the other dims") is None
