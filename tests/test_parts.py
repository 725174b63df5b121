"""Models no capture path reaches whole are quantized in parts (fxq.parts): detectors' backbones and heads."""
from __future__ import annotations

import logging

import numpy as np
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import _pytree as pytree

import fxq
from fxq.graph.capture import capture
from fxq.parts import part_inputs, quantized_parts


class Neck(nn.Module):
    """Tensor in, list of two feature maps out (symbolic tracing reaches it)."""

    def __init__(self) -> None:
        super().__init__()
        self.lateral = nn.Conv2d(8, 8, 1)
        self.down = nn.Conv2d(8, 8, 3, stride=2, padding=1)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        y = F.relu(self.lateral(x))
        return [y, F.relu(self.down(y))]


class Head(nn.Module):
    """Loops over a list of feature maps: symbolic tracing cannot iterate it, torch.export can."""

    def __init__(self) -> None:
        super().__init__()
        self.cls = nn.Conv2d(8, 3, 3, padding=1)
        self.box = nn.Conv2d(8, 4, 1)

    def forward(self, feats: list[torch.Tensor]) -> list[torch.Tensor]:
        return [torch.cat([self.cls(f), self.box(f)], 1).flatten(2) for f in feats]


class TinyDetector(nn.Module):
    """A root forward nothing captures: a loop over the input images and a branch on a tensor value."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                                      nn.ReLU())
        self.neck = Neck()
        self.head = Head()

    def forward(self, images: list[torch.Tensor]) -> torch.Tensor:
        x = torch.stack([img * 2 - 1 for img in images])
        out = torch.cat(self.head(self.neck(self.backbone(x))), 2)
        if out[:, :3].amax() > 0:  # postprocessing decides on values
            out = out.sigmoid()
        return out


def _data(n: int = 3) -> list[tuple[list[torch.Tensor]]]:
    g = torch.Generator().manual_seed(0)
    return [([torch.rand(3, 16, 16, generator=g), torch.rand(3, 16, 16, generator=g)],) for _ in range(n)]


@pytest.fixture(scope="module")
def detector() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    model = TinyDetector().eval()
    return model, fxq.quantize(model, _data(), "trt_int8", progress=False)


def test_quantized_in_parts_keeps_the_model(detector):
    model, qmodel = detector
    assert type(qmodel) is TinyDetector and qmodel is not model
    parts = quantized_parts(qmodel)
    assert list(parts) == ["backbone", "neck", "head"]
    assert parts["head"].meta["fxq_capture"] == "export"  # the list loop: torch.export
    assert all(len(p.fxq_quantizers) > 0 for p in parts.values())
    assert isinstance(model.backbone, nn.Sequential)  # the caller's model is untouched
    with torch.no_grad():
        got, want = qmodel(*_data(1)[0]), model(*_data(1)[0])
    cos = F.cosine_similarity(got.flatten().double(), want.flatten().double(), dim=0)
    assert got.shape == want.shape and cos > 0.99


def test_parts_compute_their_quantized_simulation(detector):
    """Each part in the model is its quantized GraphModule: in FP32 mode, it is the float submodule."""
    model, qmodel = detector
    inputs = part_inputs(qmodel, _data(1)[0])
    assert set(inputs) == {"backbone", "neck", "head"}
    assert list(inputs["head"]) == ["feats_0", "feats_1"]
    with fxq.fp32_mode(qmodel.head), torch.no_grad():
        got = qmodel.head(list(inputs["head"].values()))
        want = model.head(list(inputs["head"].values()))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_warning_names_the_parts(caplog):
    torch.manual_seed(0)
    with caplog.at_level(logging.WARNING, logger="fxq.parts"):
        fxq.quantize(TinyDetector().eval(), _data(2), "trt_int8", progress=False)
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "TinyDetector whole" in text and "backbone (fx" in text and "head (export" in text


@pytest.mark.parametrize("platform", ["trt_int8", "ort_int8"])
def test_exported_parts_run_as_simulated(detector, tmp_path, platform):
    model, _ = detector
    qmodel = detector[1] if platform == "trt_int8" else fxq.quantize(model, _data(), platform, progress=False)
    files = fxq.export(qmodel, platform, tmp_path / "det.onnx")
    assert [f.name for f in files] == ["det_backbone.onnx", "det_neck.onnx", "det_head.onnx"]
    inputs = part_inputs(qmodel, _data(1)[0])
    for f, (path, part) in zip(files, quantized_parts(qmodel).items()):
        feed = inputs[path]
        with torch.no_grad():
            args = list(feed.values()) if path != "head" else [list(feed.values())]
            want = [t.numpy() for t in pytree.tree_leaves(part(*args))]
        for level in (ort.GraphOptimizationLevel.ORT_ENABLE_ALL, ort.GraphOptimizationLevel.ORT_DISABLE_ALL):
            opts = ort.SessionOptions()
            opts.graph_optimization_level = level
            sess = ort.InferenceSession(str(f), opts, providers=["CPUExecutionProvider"])
            assert [i.name for i in sess.get_inputs()] == list(feed)
            got = sess.run(None, {k: v.numpy() for k, v in feed.items()})
            for g, w in zip(got, want, strict=True):
                cos = np.dot(g.ravel(), w.ravel()) / (np.linalg.norm(g) * np.linalg.norm(w) + 1e-30)
                assert cos > 0.999, (path, level, cos)


def test_export_of_parts_replaces_the_whole_set(detector, tmp_path):
    _, qmodel = detector
    first = fxq.export(qmodel, "trt_int8", tmp_path / "det")
    second = fxq.export(qmodel, "trt_int8", tmp_path / "det")
    assert first == second and all(f.suffix == ".onnx" for f in first)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f.name for f in first)  # no temp folder left


def test_export_of_parts_writes_each_file_once(detector, tmp_path, monkeypatch):
    """The parts are rendered in memory and written once, as one set (no temp export read back)."""
    import fxq.io

    _, qmodel = detector
    writes: list[str] = []
    real = fxq.io._write_data

    def counting(tmp, data):
        if not bytes(data[:16]).startswith(b'{"fxq_file_set"'):  # not the set's commit journal
            writes.append(str(tmp))
        return real(tmp, data)

    monkeypatch.setattr(fxq.io, "_write_data", counting)
    files = fxq.export(qmodel, "trt_int8", tmp_path / "det.onnx", legacy=True)
    assert len(writes) == len(files) == 3 * 4  # Q/DQ onnx, FP32 onnx, calibration cache and json per part
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f.name for f in files)


def test_parts_export_deletes_stale_external_data(detector, tmp_path, monkeypatch):
    """A part exported over protobuf's limit writes ``.onnx.data``; a later small export deletes it in its set."""
    from fxq import onnx_data

    _, qmodel = detector
    monkeypatch.setattr(onnx_data, "EXTERNAL_DATA_THRESHOLD", 64)
    large = fxq.export(qmodel, "trt_int8", tmp_path / "det.onnx")
    assert "det_backbone.onnx.data" in {f.name for f in large}
    monkeypatch.setattr(onnx_data, "EXTERNAL_DATA_THRESHOLD", onnx_data.PROTO_LIMIT)
    small = fxq.export(qmodel, "trt_int8", tmp_path / "det.onnx")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f.name for f in small) == [
        "det_backbone.onnx", "det_head.onnx", "det_neck.onnx"]


def test_explicit_capture_path_does_not_split():
    torch.manual_seed(0)
    with pytest.raises(fxq.TraceError):
        fxq.quantize(TinyDetector().eval(), _data(1), "trt_int8", capture="fx", progress=False)


def test_nothing_capturable_raises_the_capture_error():
    class Loop(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))

        def forward(self, xs: list[torch.Tensor]) -> torch.Tensor:
            total = sum(x * self.w for x in xs)
            return total if total.sum() > 0 else -total

    with pytest.raises(fxq.TraceError, match="could not capture Loop"):
        fxq.quantize(Loop(), [([torch.ones(3)],)], "trt_int8", progress=False)


def test_export_capture_keeps_nested_inputs(caplog):
    """torch.export flattens a list / dict / keyword input; the captured graph takes them as the model did."""

    class Nested(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, xs: list[torch.Tensor], d: dict[str, torch.Tensor], scale: torch.Tensor) -> torch.Tensor:
            return self.fc(xs[0] + xs[1] * d["a"]) * scale

    torch.manual_seed(0)
    model = Nested().eval()
    args = ([torch.randn(2, 4), torch.randn(2, 4)], {"a": torch.randn(2, 4)}, torch.randn(2, 4))
    with caplog.at_level(logging.WARNING):
        gm = capture(model, args, capture="export")
    assert "flattened" not in caplog.text
    assert [n.target for n in gm.graph.nodes if n.op == "placeholder"] == ["xs", "d", "scale"]
    torch.testing.assert_close(gm(*args), model(*args))
    qmodel = fxq.quantize(model, [args, args], "trt_int8", capture="export", progress=False)
    assert qmodel(*args).shape == (2, 4)


class Proposals(nn.Module):
    """The box head sees as many rows as the data keeps: its exported input must take any number."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Linear(4, 8)
        self.box_head = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))

    def forward(self, xs: list[torch.Tensor]) -> torch.Tensor:
        f = self.backbone(torch.cat(list(xs)))
        kept = f[f[:, 0] > 0]
        if kept.numel() == 0:
            return f.new_zeros(0, 2)
        return self.box_head(kept)


def test_sizes_set_by_data_are_dynamic_in_the_exported_part(tmp_path):
    torch.manual_seed(0)
    model = Proposals().eval()
    g = torch.Generator().manual_seed(0)
    calib = [([torch.randn(16, 4, generator=g)],) for _ in range(4)]
    qmodel = fxq.quantize(model, calib, "ort_int8", progress=False)
    assert list(quantized_parts(qmodel)) == ["backbone", "box_head"]
    files = fxq.export(qmodel, "ort_int8", tmp_path / "prop.onnx")
    sess = ort.InferenceSession(str(files[1]), providers=["CPUExecutionProvider"])
    assert isinstance(sess.get_inputs()[0].shape[0], str)  # the row count is symbolic
    for rows in (3, 11):
        x = torch.randn(rows, 8)
        with torch.no_grad():
            want = qmodel.box_head(x).numpy()
        got = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]
        assert got.shape == (rows, 2)
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_example_inputs_for_a_model_in_parts_is_refused(detector, tmp_path):
    with pytest.raises(fxq.ExportError, match="quantized in parts"):
        fxq.export(detector[1], "trt_int8", tmp_path / "det.onnx", example_inputs=torch.randn(1, 3, 16, 16))
    assert not list(tmp_path.iterdir())
