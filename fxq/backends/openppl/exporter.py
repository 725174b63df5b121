"""OpenPPL (ppl.nn) exporter: an FP32 ONNX model plus a json of quantization parameters.

Files, from ``path`` = ``out/model.onnx``: ``model.onnx`` (no Q/DQ; weights and passive biases hold their
fake-quantized values, so the FP32 graph computes what fxq simulates for them) and ``model.json``::

    {"quant_info": {tensor: {"bit_width", "per_channel", "quant_flag", "sym", "scale", "zero_point",
                             "tensor_min", "tensor_max", "q_min", "q_max"}},
     "op_info": {onnx node name: {"data_type": "INT8" | "FLOAT32"}}}

Scalars per tensor, lists per channel. ``tensor_min``/``tensor_max`` are the ends of the representable range,
``(q_min - zero_point) * scale`` and ``(q_max - zero_point) * scale``, written as floats: ppl.nn derives the
scale from them and ``bit_width``. Keys are the ONNX tensor names (the source file's names for models loaded
from ONNX); outputs of passive ops and outputs overlapped by a following activation are listed with the
parameters of the quantizer whose grid they lie on.

A model over protobuf's 2 GiB limit (:data:`fxq.onnx_data.EXTERNAL_DATA_THRESHOLD`) also gets ``model.onnx.data``
(the weights, as ONNX external data), written in the same atomic set.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from torch import fx

from fxq.backends.base import register_exporter
from fxq.backends.qdq.template import QdqJob, QdqOnnxExporter
from fxq.functional import representable_range
from fxq.graph.info import NodeQuant
from fxq.nn.fake_quantize import FakeQuantize

__all__ = ["OpenPPLExporter", "quant_entry", "PPL_KEYS"]

logger = logging.getLogger(__name__)

PPL_KEYS = ("bit_width", "per_channel", "quant_flag", "sym", "scale", "zero_point", "tensor_min", "tensor_max",
            "q_min", "q_max")


def quant_entry(fq: FakeQuantize) -> dict[str, Any]:
    """One ``quant_info`` record of a quantizer's parameters."""
    cfg = fq.config
    scale = [float(s) for s in fq.scale.detach().double().cpu().reshape(-1)]
    zero = [int(round(float(o))) for o in fq.offset.detach().cpu().reshape(-1)]
    lo_t, hi_t = representable_range(cfg, fq.scale, fq.offset)
    lo, hi = lo_t.tolist(), hi_t.tolist()

    def pick(values: list) -> Any:
        return values if cfg.per_channel else values[0]

    return {"bit_width": int(cfg.num_bits), "per_channel": bool(cfg.per_channel), "quant_flag": 1,
            "sym": bool(cfg.symmetric), "scale": pick(scale), "zero_point": pick(zero), "tensor_min": pick(lo),
            "tensor_max": pick(hi), "q_min": int(cfg.quant_min), "q_max": int(cfg.quant_max)}


def ppl_json(records: list, lowered: Any, quantizers: dict[str, FakeQuantize], gm: fx.GraphModule,
             onnx_model: Any) -> dict[str, Any]:
    """The ``{"quant_info", "op_info"}`` document."""
    quant_info: dict[str, Any] = {}
    for r in records:
        quant_info.setdefault(r.tensor, quant_entry(quantizers[r.quantizer]))
    for fx_node, (qname, _) in lowered.marked.grid_of.items():
        tensor = lowered.tensor_of.get(fx_node)
        fq = quantizers.get(qname)
        if tensor is not None and fq is not None and fq.config.is_quantizing:
            quant_info.setdefault(tensor, quant_entry(fq))
    fx_nodes = {n.name: n for n in gm.graph.nodes}
    op_info: dict[str, Any] = {}
    for node in onnx_model.graph.node:
        fx_node = fx_nodes.get(lowered.fx_of_onnx_node.get(node.name, ""))
        nq = fx_node.meta.get("fxq") if fx_node is not None else None
        quantized = isinstance(nq, NodeQuant) and nq.quantized
        op_info[node.name] = {"data_type": "INT8" if quantized else "FLOAT32"}
    return {"quant_info": quant_info, "op_info": op_info}


@register_exporter("openppl")
class OpenPPLExporter(QdqOnnxExporter):
    """FP32 ONNX + quantization json for ppl.nn (see module docstring).

    Options:
        opset: ONNX opset (default 13).
        example_inputs: inputs to trace with (default: random tensors shaped like the calibration batch).
        dynamic_batch: make axis 0 of inputs and outputs dynamic.
    """

    requantize_passive = False  # the FP32 graph carries no marks of passive ops

    def companions(self, options: dict[str, Any]) -> dict[str, str]:
        return {"json": ".json"}

    def render(self, job: QdqJob) -> dict[Path, bytes | bytearray | str | None]:
        """The FP32 graph (quant marks removed, constants fake-quantized, names kept) and the json keyed by it."""
        from fxq.backends.qdq.common import finalize, serialize
        from fxq.backends.qdq.insert import strip_marks

        records = strip_marks(job.lowered, job.quantizers)
        onnx_model = finalize(job.lowered.model, job.opset)
        doc = ppl_json(records, job.lowered, job.quantizers, job.gm, onnx_model)
        logger.info("openppl: %d quantized tensors", len(doc["quant_info"]))
        return {**serialize(onnx_model, job.paths["main"]), job.paths["json"]: json.dumps(doc, indent=1) + "\n"}
