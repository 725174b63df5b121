"""Mixed-range concats (detection heads: 0-640 boxes next to 0-1 scores) are found at calibration and kept FP32.

One int8 grid over ``torch.cat([boxes, scores])`` has a step of ~5: every score rounds to 0 and a detector finds
nothing. fxq flags concats whose input ranges differ more than ``fusion_setting.mixed_range_concat_ratio``
(64x by default), switches them to FP32 (the inputs keep their own scales), logs a warning and lists them in
``fxq.summary``; the exporters then write the concat in float.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import fx, nn

import fxq
from fxq.analysis.mismatch_ncnn import ncnn_mat
from fxq.graph.calibrate import MIXED_RANGE_KEY, MIXED_RANGE_RATIO
from fxq.graph.quant_graph import QuantGraph
from fxq.spec import QuantState

from _export_helpers import fx_values, ncnn_net, ort_session, run_ort

QDQ_PLATFORMS = ["trt_int8", "ort_int8", "ppl_cuda_int8"]
SHAPE = (2, 3, 32, 32)
SCORE_TOL = 0.025  # max abs error allowed on the 0-1 scores: ~3 steps of their int8 grid. They carry the convs'
# quantization error through the sigmoid (0.017-0.0205 measured at scores near 0.5); a score lost on a 0-640 grid is
# off by up to 1
N_BOX = 4


class TinyDetector(nn.Module):
    """Conv backbone, a box head (sigmoid x 640) and a class-score head (sigmoid), concatenated per anchor."""

    def __init__(self, classes: int = 3, last_dim: bool = False) -> None:
        super().__init__()
        self.last_dim = last_dim
        self.backbone = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),
                                      nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.ReLU())
        self.box = nn.Conv2d(16, N_BOX, 1)
        self.cls = nn.Conv2d(16, classes, 1)
        with torch.no_grad():  # hand-set: scores spread over about 0.13..0.96, both sides of 0.5
            self.box.weight.mul_(6.0)
            self.cls.weight.mul_(6.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = self.backbone(x)
        boxes = torch.sigmoid(self.box(f)) * 640.0
        scores = torch.sigmoid(self.cls(f))
        if self.last_dim:  # [N, anchors, 4 + classes]
            return torch.cat([boxes.flatten(2).transpose(1, 2), scores.flatten(2).transpose(1, 2)], dim=-1)
        return torch.cat([boxes.flatten(2), scores.flatten(2)], dim=1).transpose(1, 2)


def _data(n: int = 3, shape: tuple[int, ...] = SHAPE, seed: int = 2) -> list[torch.Tensor]:
    """Held-out inputs (seed 2); calibration uses seed 1."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g) for _ in range(n)]


def _quantize(model: nn.Module, platform: str, ratio: float | None = MIXED_RANGE_RATIO,
              shape: tuple[int, ...] = SHAPE) -> fx.GraphModule:
    setting = fxq.QuantizationSetting()
    setting.fusion_setting.mixed_range_concat_ratio = ratio
    setting.quantize_activation_setting.calib_algorithm = "minmax"
    return fxq.quantize(model.eval(), _calib(shape), platform, setting=setting, progress=False)


def _calib(shape: tuple[int, ...] = SHAPE) -> list[torch.Tensor]:
    return _data(8, shape, seed=1)


def _detector(**kw) -> TinyDetector:
    torch.manual_seed(0)
    return TinyDetector(**kw).eval()


def _outputs(gm: fx.GraphModule, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        q = gm(x)
        with fxq.fp32_mode(gm):
            ref = gm(x)
    return q, ref


def _check_detections(q: torch.Tensor, ref: torch.Tensor) -> None:
    scores, ref_scores = q[..., N_BOX:], ref[..., N_BOX:]
    assert ((ref_scores > 0.5).float().mean() - 0.5).abs() < 0.4  # meaningful: detections and non-detections
    assert float((scores - ref_scores).abs().max()) < SCORE_TOL
    clear = (ref_scores - 0.5).abs() > SCORE_TOL  # scores within the error bound of 0.5 may go either way
    assert torch.equal((scores > 0.5)[clear], (ref_scores > 0.5)[clear])
    assert int((scores > 0.5).sum()) > 0


# ------------------------------------------------------------------------------------------ simulation
@pytest.mark.parametrize("platform", QDQ_PLATFORMS)
def test_without_protection_every_score_is_zero(platform: str, caplog) -> None:
    """The failure this guards against: one shared grid (scale ~5) rounds every 0-1 score to 0."""
    with caplog.at_level(logging.WARNING, logger="fxq"):
        gm = _quantize(_detector(), platform, ratio=None)
    q, ref = _outputs(gm, _data(1)[0])
    assert float(ref[..., N_BOX:].max()) > 0.9
    assert float(q[..., N_BOX:].abs().max()) == 0.0
    assert not [r for r in caplog.records if "mixed_range_concat_ratio" in r.getMessage()]
    assert fxq.summary(gm).protected == []


@pytest.mark.parametrize("last_dim", [False, True], ids=["dim1", "dim-1"])
@pytest.mark.parametrize("platform", QDQ_PLATFORMS)
def test_protected_scores_match_fp32(platform: str, last_dim: bool, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="fxq"):
        gm = _quantize(_detector(last_dim=last_dim), platform)
    for x in _data(3):
        q, ref = _outputs(gm, x)
        _check_detections(q, ref)
        scores = fx_values(gm, x)["fxq_quantizers_sigmoid_1_out"].flatten(2).transpose(1, 2)
        assert torch.equal(q[..., N_BOX:], scores)  # the float concat adds no error to the quantized scores
    cat = next(n for n in gm.graph.nodes if n.name == "cat")
    record = cat.meta[MIXED_RANGE_KEY]
    assert record["action"] == "fp32" and record["ratio"] > MIXED_RANGE_RATIO
    assert cat.meta["fxq"].platform == "fp32"
    assert gm.fxq_quantizers[record["output_quantizer"]].config.state is QuantState.FP32
    assert not QuantGraph(gm).alignment_groups()  # the concat's alignment group is gone from its members' records
    assert not any(fq.aligned for fq in gm.fxq_quantizers.values())
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "'cat'" in r.getMessage()]
    assert len(warnings) == 1 and "kept in FP32" in warnings[0]
    for label, lo, hi in record["inputs"]:
        assert f"{label} [{lo:.4g}, {hi:.4g}]" in warnings[0]
    s = fxq.summary(gm)
    assert [p["node"] for p in s.protected] == ["cat"] and s.counts["fp32"] == 1
    assert "mixed-range Concat cat: kept FP32" in str(s)


def test_stack_is_a_joining_op() -> None:
    class Stacked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.fc(x)
            return torch.stack([torch.sigmoid(y) * 640.0, torch.sigmoid(y)], dim=1)

    torch.manual_seed(0)
    gm = _quantize(Stacked(), "trt_int8", shape=(2, 8))
    (node,) = [n for n in gm.graph.nodes if MIXED_RANGE_KEY in n.meta]
    assert node.target is torch.stack and node.meta[MIXED_RANGE_KEY]["action"] == "fp32"
    x = _data(1, (2, 8))[0]
    q, ref = _outputs(gm, x)
    assert torch.equal(q[:, 1], fx_values(gm, x)["fxq_quantizers_sigmoid_1_out"])  # not on the 0-640 grid
    assert float((q[:, 1] - ref[:, 1]).abs().max()) < 0.05


class Yolo5Head(nn.Module):
    """YOLOv5's Detect: per level cat([xy, wh, conf], -1), then the levels concatenated along the anchors."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.p1 = nn.Conv2d(8, 7, 1)
        self.p2 = nn.Conv2d(8, 7, 3, stride=2, padding=1)
        with torch.no_grad():
            self.p1.weight.mul_(4.0)
            self.p2.weight.mul_(4.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = self.stem(x)
        levels = []
        for head in (self.p1, self.p2):
            y = torch.sigmoid(head(f)).flatten(2).transpose(1, 2)
            xy, wh, conf = y.split((2, 2, 3), dim=-1)
            levels.append(torch.cat([xy * 640.0, wh * 320.0, conf], dim=-1))
        return torch.cat(levels, dim=1)


@pytest.mark.parametrize("platform", QDQ_PLATFORMS)
def test_nested_concat_of_mixed_outputs(platform: str) -> None:
    """The last concat joins similar ranges (0-640 each) whose parts are mixed: it is protected too."""
    torch.manual_seed(0)
    gm = _quantize(Yolo5Head(), platform)
    records = {n.name: n.meta[MIXED_RANGE_KEY] for n in gm.graph.nodes if MIXED_RANGE_KEY in n.meta}
    assert sorted(records) == ["cat", "cat_1", "cat_2"]
    assert all(r["action"] == "fp32" for r in records.values())
    for x in _data(2):
        q, ref = _outputs(gm, x)
        _check_detections(q, ref)


def test_concat_read_by_a_quantized_conv_is_reported_not_changed(caplog) -> None:
    class IntoConv(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 1)
            self.fuse = nn.Conv2d(8, 4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.conv(x)
            return self.fuse(torch.cat([torch.sigmoid(y) * 640.0, torch.sigmoid(y)], dim=1))

    torch.manual_seed(0)
    with caplog.at_level(logging.WARNING, logger="fxq"):
        gm = _quantize(IntoConv(), "trt_int8")
    cat = next(n for n in gm.graph.nodes if n.name == "cat")
    record = cat.meta[MIXED_RANGE_KEY]
    assert record["action"] == "warned" and record["blocked_by"] == ["fuse"]
    assert cat.meta["fxq"].platform == "trt_int8"
    assert gm.fxq_quantizers[record["output_quantizer"]].config.is_quantizing
    assert any("left quantized" in r.getMessage() and "fuse" in r.getMessage() for r in caplog.records)
    assert "left quantized" in str(fxq.summary(gm))


# ------------------------------------------------------------------------------------------ no false positives
class InceptionBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.b1 = nn.Sequential(nn.Conv2d(8, 4, 1), nn.ReLU())
        self.b2 = nn.Sequential(nn.Conv2d(8, 4, 3, padding=1), nn.ReLU())
        self.b3 = nn.Sequential(nn.MaxPool2d(3, 1, 1), nn.Conv2d(8, 4, 1), nn.ReLU())
        self.head = nn.Conv2d(12, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = self.stem(x)
        return self.head(torch.cat([self.b1(f), self.b2(f), self.b3(f)], dim=1))


@pytest.mark.parametrize("platform", [*QDQ_PLATFORMS, "ncnn_int8"])
def test_similar_branches_stay_quantized(platform: str, caplog) -> None:
    torch.manual_seed(0)
    with caplog.at_level(logging.WARNING, logger="fxq"):
        gm = _quantize(InceptionBlock(), platform)
    assert not any(MIXED_RANGE_KEY in n.meta for n in gm.graph.nodes)
    assert not [r for r in caplog.records if "mixed_range_concat_ratio" in r.getMessage()]
    assert fxq.summary(gm).protected == []
    cat = next(n for n in gm.graph.nodes if n.name == "cat")
    if platform != "ncnn_int8":  # ncnn quantizes only conv / gemm inputs
        nq = cat.meta["fxq"]
        assert nq.platform == platform and gm.fxq_quantizers[nq.output].config.state is QuantState.ACTIVATED
        assert [g for g in QuantGraph(gm).alignment_groups() if g.kind == "output" and g.target == nq.output]


def test_resnet_stays_quantized(caplog) -> None:
    torchvision = pytest.importorskip("torchvision")
    with caplog.at_level(logging.WARNING, logger="fxq"):
        gm = _quantize(torchvision.models.resnet18(num_classes=10), "trt_int8", shape=(1, 3, 32, 32))
    assert fxq.summary(gm).protected == []
    assert not any(MIXED_RANGE_KEY in n.meta for n in gm.graph.nodes)


# ------------------------------------------------------------------------------------------ lifecycle
def test_setting_field_is_checked() -> None:
    s = fxq.QuantizationSetting()
    assert s.fusion_setting.mixed_range_concat_ratio == MIXED_RANGE_RATIO
    with pytest.raises(fxq.errors.ConfigError, match="mixed_range_concat_ratio"):
        s.fusion_setting.mixed_range_concat_ratio = 1.0
    s.fusion_setting.mixed_range_concat_ratio = None
    assert fxq.QuantizationSetting.from_json(s.to_json()).fusion_setting.mixed_range_concat_ratio is None


def test_record_survives_save_and_load(tmp_path: Path) -> None:
    gm = _quantize(_detector(), "trt_int8")
    again = fxq.load(fxq.save(gm, tmp_path / "det.fxq"))
    before = next(n for n in gm.graph.nodes if n.name == "cat").meta[MIXED_RANGE_KEY]
    cat = next(n for n in again.graph.nodes if n.name == "cat")
    assert cat.meta[MIXED_RANGE_KEY] == before and cat.meta["fxq"].platform == "fp32"
    assert str(fxq.summary(again)) == str(fxq.summary(gm))
    x = _data(1)[0]
    with torch.no_grad():
        assert torch.equal(again(x), gm(x))


def test_calibrating_again_decides_again() -> None:
    gm = _quantize(_detector(), "ort_int8")
    x = _data(1)[0]
    with torch.no_grad():
        first = gm(x)
    fxq.calibrate(gm, _calib(), progress=False)
    fxq.convert(gm)
    cat = next(n for n in gm.graph.nodes if n.name == "cat")
    assert cat.meta[MIXED_RANGE_KEY]["action"] == "fp32" and cat.meta["fxq"].platform == "fp32"
    with torch.no_grad():  # scales may move by an ulp between calibrations: a code may flip
        assert float((gm(x) - first)[..., N_BOX:].abs().max()) < 0.01
    gm.meta["fxq_setting"]["fusion_setting"]["mixed_range_concat_ratio"] = None  # the check switched off
    fxq.calibrate(gm, _calib(), progress=False)
    fxq.convert(gm)
    cat = next(n for n in gm.graph.nodes if n.name == "cat")
    assert MIXED_RANGE_KEY not in cat.meta and cat.meta["fxq"].platform == "ort_int8"
    groups = QuantGraph(gm).alignment_groups()  # given back to the members' records
    assert [g for g in groups if g.kind == "output" and g.target == cat.meta["fxq"].output]
    with torch.no_grad():
        assert float(gm(x)[..., N_BOX:].abs().max()) == 0.0


# ------------------------------------------------------------------------------------------ exports
@pytest.mark.parametrize("last_dim", [False, True], ids=["dim1", "dim-1"])
@pytest.mark.parametrize("platform", ["trt_int8", "ort_int8"])
def test_qdq_export_writes_a_float_concat(platform: str, last_dim: bool, tmp_path: Path) -> None:
    gm = _quantize(_detector(last_dim=last_dim), platform)
    (path,) = fxq.export(gm, platform, tmp_path / "model")
    model = onnx.load(path)
    producers = {o: n for n in model.graph.node for o in n.output}
    concat = next(n for n in model.graph.node if n.op_type == "Concat" and n.output[0] in ("cat", "output"))
    assert not [n for n in model.graph.node if n.op_type == "QuantizeLinear" and concat.output[0] in n.input]
    for name in concat.input:  # each input is dequantized from its own grid upstream (through reshapes)
        while producers[name].op_type != "DequantizeLinear":
            assert producers[name].op_type in ("Reshape", "Transpose", "Flatten")
            name = producers[name].input[0]
    steps = {"scores": float(gm.fxq_quantizers["sigmoid_1_out"].scale),
             "boxes": float(gm.fxq_quantizers["mul_out"].scale)}
    for x in _data(2):
        q, ref = _outputs(gm, x)
        for optimize in (True, False):
            got = torch.from_numpy(run_ort(path, x, optimize))
            assert got.shape == q.shape
            # onnxruntime's fused integer kernels (default session) round some upstream codes differently:
            # measured <= 1.1% of the codes, by 1 step (2 on the boxes, x640 after the sigmoid)
            for part, sl in (("scores", slice(N_BOX, None)), ("boxes", slice(None, N_BOX))):
                lsb = (got[..., sl] - q[..., sl]).abs() / steps[part]
                assert float(lsb.max()) <= 2.01 and float((lsb < 0.01).double().mean()) > 0.98, part
            _check_detections(got, ref)


def _emulate_ppl(onnx_path: Path, doc: dict) -> onnx.ModelProto:
    """The FP32 ONNX with int8 Q/DQ after every activation tensor the json quantizes (what ppl.nn runs)."""
    model = onnx.load(onnx_path)
    g = model.graph
    inits = {t.name for t in g.initializer}
    for tensor, e in doc["quant_info"].items():
        if tensor in inits or e["per_channel"] or e["bit_width"] != 8:
            continue
        scale = numpy_helper.from_array(np.array(e["scale"], np.float32), f"{tensor}__s")
        zp = helper.make_tensor(f"{tensor}__z", TensorProto.INT8, [], [int(e["zero_point"])])
        g.initializer.extend([scale, zp])
        for n in g.node:
            n.input[:] = [f"{tensor}__dq" if i == tensor else i for i in n.input]
        for o in g.output:
            if o.name == tensor:
                raise AssertionError("a graph output is quantized")
        g.node.extend([helper.make_node("QuantizeLinear", [tensor, scale.name, zp.name], [f"{tensor}__q"]),
                       helper.make_node("DequantizeLinear", [f"{tensor}__q", scale.name, zp.name],
                                        [f"{tensor}__dq"])])
    sorted_nodes, ready = [], {i.name for i in g.input} | {t.name for t in g.initializer}
    pending = list(g.node)
    while pending:  # topological order for onnxruntime
        for n in pending:
            if all(i in ready or i == "" for i in n.input):
                sorted_nodes.append(n)
                ready.update(n.output)
                pending.remove(n)
                break
        else:
            raise AssertionError("cycle")
    del g.node[:]
    g.node.extend(sorted_nodes)
    return model


def test_ppl_json_leaves_the_concat_float(tmp_path: Path) -> None:
    gm = _quantize(_detector(), "ppl_cuda_int8")
    onnx_path, json_path = fxq.export(gm, "ppl_cuda_int8", tmp_path / "model")
    doc = json.loads(json_path.read_text())
    assert doc["op_info"]["cat"] == {"data_type": "FLOAT32"}
    model = onnx.load(onnx_path)
    concat = next(n for n in model.graph.node if n.name == "cat")
    assert concat.output[0] not in doc["quant_info"]
    scales = {i: doc["quant_info"][i]["scale"] for i in concat.input}
    assert max(scales.values()) / min(scales.values()) > MIXED_RANGE_RATIO  # each input on its own grid
    score_step = min(scales.values())
    emulated = _emulate_ppl(onnx_path, doc)
    for x in _data(2):
        q, ref = _outputs(gm, x)
        for optimize in (True, False):
            sess = ort_session(emulated, optimize)
            got = torch.from_numpy(sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0])
            # float convs in onnxruntime may flip a code at a rounding tie: 2 steps of the score grid at most
            assert float((got[..., N_BOX:] - q[..., N_BOX:]).abs().max()) <= 2.001 * score_step
            _check_detections(got, ref)


def test_ncnn_export_runs(tmp_path: Path) -> None:
    """ncnn_int8 quantizes conv / gemm inputs only: the concat is float already, nothing to protect."""
    pytest.importorskip("ncnn")
    from fxq.backends.ncnn import ncnn_paths

    shape = (1, 3, 32, 32)
    gm = _quantize(_detector(), "ncnn_int8", shape=shape)
    assert fxq.summary(gm).protected == []
    fxq.export(gm, "ncnn_int8", tmp_path / "net")
    files = ncnn_paths(tmp_path / "net")
    for x in _data(2, shape):
        q, ref = _outputs(gm, x)
        for param, bin_, int8, want in ((files["fp32_param"], files["fp32_bin"], False, ref),
                                        (files["param"], files["bin"], True, q)):
            net = ncnn_net(param, bin_, int8=int8)
            ex = net.create_extractor()
            ex.input("in0", ncnn_mat(x[0].numpy()))
            ret, out = ex.extract("out0")
            assert ret == 0
            got = torch.from_numpy(np.array(out).copy())
            assert got.shape == want[0].shape
            assert float((got[..., N_BOX:] - want[0][..., N_BOX:]).abs().max()) < 1e-3
        _check_detections(q, ref)


def test_similar_branches_export_int8_concat(tmp_path: Path) -> None:
    torch.manual_seed(0)
    gm = _quantize(InceptionBlock(), "trt_int8")
    (path,) = fxq.export(gm, "trt_int8", tmp_path / "model")
    model = onnx.load(path)
    concat = next(n for n in model.graph.node if n.op_type == "Concat" and len(n.input) == 3)
    assert any(n.op_type == "QuantizeLinear" and concat.output[0] in n.input for n in model.graph.node)
    x = _data(1)[0]
    with torch.no_grad():
        q = gm(x)
    head = next(n for n in gm.graph.nodes if n.name == "head")
    lsb = float(gm.fxq_quantizers[head.meta["fxq"].output].scale)
    for optimize in (True, False):
        assert np.abs(run_ort(path, x, optimize) - q.numpy()).max() <= lsb * 1.001
