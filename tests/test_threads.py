"""Two threads using fxq at once: torch.fx's tracing patches are process-wide, and must not capture or break the
other thread's model."""
from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import fxq

from _models import small_cnn

pytestmark = pytest.mark.usefixtures("one_thread")


_GATE: dict[str, threading.Event] = {}  # module-level: fxq.prepare deep-copies the model, and events do not copy


class _Gate(nn.Module):
    """Blocks the tracing thread inside its own trace until the other thread has run its eager forward."""

    def forward(self, x):
        if _GATE:
            _GATE["entered"].set()
            assert _GATE["release"].wait(60), "the eager thread never finished"
        return x


def _gated_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), _Gate(), nn.ReLU())


def _run_during_trace(eager_call):
    """Trace a model in a thread while ``eager_call`` runs in this thread, exactly inside that trace."""
    entered, release = _GATE["entered"], _GATE["release"] = threading.Event(), threading.Event()
    traced = _gated_model()
    result: dict = {}

    def trace_it():
        try:
            result["gm"] = fxq.prepare(traced, "trt_int8", example_inputs=torch.randn(1, 3, 8, 8))
        except BaseException as exc:  # pragma: no cover - reported below
            result["error"] = exc

    worker = threading.Thread(target=trace_it)
    worker.start()
    try:
        assert entered.wait(60)
        out = eager_call()
    finally:
        release.set()
        worker.join(60)
        _GATE.clear()
    assert "error" not in result, result.get("error")
    return out, result["gm"]


def test_eager_forward_inside_another_threads_trace_runs_eagerly():
    qmodel = fxq.quantize(small_cnn().eval(), [torch.randn(2, 3, 32, 32)], platform="trt_int8", progress=False)
    x = torch.randn(2, 3, 32, 32)
    expected = qmodel(x)
    original_call = nn.Module.__call__

    out, gm = _run_during_trace(lambda: qmodel(x))  # before the fix: NameError, module is not installed ...

    assert torch.equal(out, expected)
    alone = fxq.prepare(_gated_model(), "trt_int8", example_inputs=torch.randn(1, 3, 8, 8))
    # nothing of the other thread's forward was recorded into the traced graph
    assert [(n.op, str(n.target)) for n in gm.graph.nodes] == [(n.op, str(n.target)) for n in alone.graph.nodes]
    assert nn.Module.__call__ is original_call  # torch.fx's patch was undone


def test_two_threads_quantize_different_models():
    torch.manual_seed(1)
    models = [small_cnn().eval(), nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 1)).eval()]
    data = [[torch.randn(2, 3, 16, 16) for _ in range(2)] for _ in models]
    alone = [fxq.quantize(m, d, platform="trt_int8", progress=False)(d[0]) for m, d in zip(models, data)]
    for _ in range(3):
        results: list = [None, None]

        def work(i, results=results):
            try:
                results[i] = fxq.quantize(models[i], data[i], platform="trt_int8", progress=False)(data[i][0])
            except BaseException as exc:  # pragma: no cover - reported below
                results[i] = exc

        threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        for got, want in zip(results, alone):
            assert isinstance(got, torch.Tensor), got
            assert torch.equal(got, want)


def test_two_threads_export_at_once(tmp_path):
    """torch.onnx keeps process-wide export state: without fxq's lock the second export fails inside torch."""
    torch.manual_seed(2)
    model = small_cnn().eval()
    data = [torch.randn(2, 3, 16, 16)]
    qmodel = fxq.quantize(model, data, platform="trt_int8", progress=False)
    errors: list = []

    def work(i):
        try:
            fxq.export(qmodel, "trt_int8", tmp_path / f"m{i}.onnx")
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    for _ in range(2):
        threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert not errors, errors
    assert (tmp_path / "m0.onnx").read_bytes() == (tmp_path / "m1.onnx").read_bytes()
