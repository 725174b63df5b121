"""torchvision models symbolic tracing cannot reach: RAFT through torch.export; detection models' limits."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import fxq
from fxq.graph.info import iter_quantizers
from fxq.graph.quant_graph import QuantGraph

torchvision = pytest.importorskip("torchvision")


class Flow(nn.Module):
    """RAFT-small with two refinement steps (the loop is unrolled by capture), returning the last flow."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.raft = torchvision.models.optical_flow.raft_small(weights=None)

    def forward(self, a, b):
        return self.raft(a, b, num_flow_updates=2)[-1]


@pytest.fixture(scope="module")
def raft():
    """(model, data, quantized): RAFT quantized with capture="auto" (symbolic tracing fails, torch.export works)."""
    g = torch.Generator().manual_seed(0)
    data = [(torch.rand(1, 3, 128, 128, generator=g), torch.rand(1, 3, 128, 128, generator=g)) for _ in range(2)]
    model = Flow().eval()
    return model, data, fxq.quantize(model, data, "trt_int8", progress=False)


def test_raft_is_captured_by_export_quantized_and_exported(raft, tmp_path):
    """Captured by torch.export, quantized, and exported: with no opset given the file is written at the opset
    grid_sampler needs (16); the coordinate grids, computed only from the static input shape, keep their Q/DQ;
    fed the simulation's codes (ORT_DISABLE_ALL), every quantized tensor of the file is within 1 code. End to end
    the random-init model is chaotic (a 1e-4 input change moves the simulation itself to cosine ~0.99)."""
    onnx = pytest.importorskip("onnx")
    model, data, q = raft
    with pytest.raises(fxq.TraceError):
        fxq.prepare(model, "trt_int8", data[0], capture="fx")
    assert q.meta.get("fxq_capture") == "export"
    weighted = [r.node for r in fxq.summary(q).layers if r.weight is not None]
    assert len(weighted) >= 50 and weighted[0] == "raft_feature_encoder_convnormrelu_0"
    assert len(list(iter_quantizers(q))) > 100
    with torch.no_grad():
        ref = model(*data[1])
        with fxq.fp32_mode(q):  # the lifted graph computes what the model does
            assert torch.allclose(q(*data[1]), ref, atol=1e-4)
        assert not torch.equal(q(*data[1]), ref)
    path = fxq.export(q, "trt_int8", tmp_path / "raft.onnx")[0]
    graph = onnx.load(path)
    assert graph.opset_import[0].version == 16
    inits = {t.name for t in graph.graph.initializer}
    grids = [info.source for info in QuantGraph(q).infos().values()
             if info.role == "activation" and _from_constants_only(q, info.source)]
    assert grids and all(name in inits for name in grids)  # written as initializers, their Q/DQ after them
    forced = fxq.locate_mismatch(q, path, [data[1]], teacher_forced=True, optimize=False)
    assert not forced.unmatched and all(r.max_diff <= 1 for r in forced) and forced.identical > 0.9999


def test_raft_round_trips_through_fxq_save(raft, tmp_path):
    """The export capture keeps aten ops (grid_sampler, linspace, meshgrid, instance_norm...) that the aten
    allow-list must admit: the saved file loads and computes the same flow bit for bit."""
    _, data, q = raft
    kept = {n.target._schema.name for n in q.graph.nodes if isinstance(n.target, torch._ops.OpOverload)}
    assert {"aten::grid_sampler", "aten::linspace", "aten::meshgrid"} <= kept
    again = fxq.load(fxq.save(q, tmp_path / "raft.fxq"))
    with torch.no_grad():
        assert torch.equal(again(*data[1]), q(*data[1]))


def _from_constants_only(gm, name: str) -> bool:
    """Whether node ``name`` is computed from constants and sizes only (no placeholder's data, no parameter)."""
    seen: set = set()
    stack = [next(n for n in gm.graph.nodes if n.name == name)]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op in ("placeholder", "get_attr"):
            return False
        if n.op == "call_method" and n.target == "size":
            continue  # the size of an input (static in a file exported without dynamic_batch)
        stack.extend(n.all_input_nodes)
    return True


def test_detection_model_gets_one_error_and_its_backbone_quantizes_by_both_paths():
    torch.manual_seed(0)
    model = torchvision.models.detection.fasterrcnn_mobilenet_v3_large_320_fpn(
        weights=None, weights_backbone=None).eval()
    with pytest.raises(fxq.TraceError) as e:  # postprocessing (NMS, box filtering) is data-dependent
        fxq.prepare(model, "trt_int8", ([torch.rand(3, 320, 320)],))
    msg = str(e.value)
    assert "for img in images:" in msg and "iteration over a traced value" in msg  # symbolic tracing
    assert "module 'rpn'" in msg and "boxes.py" in msg  # torch.export: where NMS guards on a data-dependent size
    assert "Parts that do capture on their own: backbone (fx)" in msg  # what the user can quantize instead
    x = torch.rand(1, 3, 320, 320)
    counts = [len(list(iter_quantizers(fxq.prepare(model.backbone, "trt_int8", x, capture=c)))) for c in ("fx", "export")]
    assert counts[0] == counts[1] > 100
