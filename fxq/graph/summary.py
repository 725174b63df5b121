"""The seeds' "Network Snapshot": what got quantized and how, as data and as a table."""
from __future__ import annotations

import collections
import dataclasses

from torch import fx

from fxq.graph.calibrate import MIXED_RANGE_KEY
from fxq.graph.capture import ISLANDS_KEY
from fxq.graph.dispatch import UNEXPRESSIBLE_KEY
from fxq.graph.info import NodeQuant, graph_quant
from fxq.graph.quant_graph import QuantGraph
from fxq.spec import QuantState

__all__ = ["QuantSummary", "summary"]


@dataclasses.dataclass
class LayerRow:
    node: str
    op_type: str
    platform: str
    output_state: str
    inputs: list[str]
    weight: str | None
    output: str | None


@dataclasses.dataclass
class QuantSummary:
    platform: str
    counts: dict[str, int]
    quantizer_states: dict[str, int]
    layers: list[LayerRow]
    protected: list[dict] = dataclasses.field(default_factory=list)  # mixed-range concats: node, action, reason
    fp32_islands: dict[str, str] = dataclasses.field(default_factory=dict)  # module path -> why capture kept it FP32
    unexpressible: dict[str, str] = dataclasses.field(default_factory=dict)  # node -> why the exporter keeps it FP32

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        lines = [f"fxq network snapshot — platform {self.platform}"]
        lines.append("  nodes: " + ", ".join(f"{k} {v}" for k, v in self.counts.items()))
        lines.append("  quantizers: " + ", ".join(f"{k} {v}" for k, v in sorted(self.quantizer_states.items())))
        rows = [r for r in self.layers if r.weight is not None]
        if rows:
            w = max(len(r.node) for r in rows)
            lines.append(f"  {'layer'.ljust(w)}  {'type':<14} {'weight':<36} input")
            for r in rows:
                lines.append(f"  {r.node.ljust(w)}  {r.op_type:<14} {r.weight:<36} {', '.join(r.inputs) or '-'}")
        for p in self.protected:
            ranges = ", ".join(f"{label} [{lo:.4g}, {hi:.4g}]" for label, lo, hi in p["inputs"])
            lines.append(f"  mixed-range {p['op_type']} {p['node']}: {p['reason']} ({ranges})")
        for path, why in self.fp32_islands.items():
            lines.append(f"  FP32 island {path}: {why}; exports write it as float ops in the same file (ONNX "
                         "nodes, ncnn layers)")
        if self.unexpressible:
            lines.append(f"  kept FP32, not expressible on {self.platform}: {len(self.unexpressible)}")
            lines.extend(f"    {node}: {why}" for node, why in self.unexpressible.items())
        return "\n".join(lines)


def _short(cfg) -> str:
    kind = cfg.fp_format.name if cfg.is_floating else f"int{cfg.num_bits}"
    gran = f"pc{cfg.channel_axis}" if cfg.per_channel else "pt"
    sym = "sym" if cfg.symmetric else "asym"
    return f"{kind} {sym} {gran} [{cfg.quant_min},{cfg.quant_max}] {cfg.state.name}"


def summary(gm: fx.GraphModule) -> QuantSummary:
    """Count quantized / passive / overlapped / FP32 / shape nodes, list per-layer schemes and the mixed-range
    concats found at calibration (``protected``)."""
    gq = graph_quant(gm)
    qs = QuantGraph(gm).as_dict()
    counts: collections.Counter[str] = collections.Counter()
    layers: list[LayerRow] = []
    protected: list[dict] = []
    for node in gm.graph.nodes:
        nq = node.meta.get("fxq")
        if not isinstance(nq, NodeQuant):
            continue
        record = node.meta.get(MIXED_RANGE_KEY)
        if isinstance(record, dict):
            protected.append(dict(record))
        if nq.platform == "shape":
            counts["shape"] += 1
        elif not nq.quantized:
            counts["fp32"] += 1
        elif nq.output_state is QuantState.OVERLAPPED:
            counts["overlapped"] += 1
        elif nq.output_state is QuantState.PASSIVE:
            counts["passive"] += 1
        else:
            counts["quantized"] += 1
        weight = None
        ins = []
        for q in nq.inputs.values():
            if q is None or q not in qs:
                continue
            role = qs[q].role
            if role == "weight":
                weight = _short(qs[q].config)
            elif role == "activation":
                ins.append(_short(qs[q].config))
        out = _short(qs[nq.output].config) if nq.output in qs else None
        layers.append(LayerRow(node.name, nq.op_type, nq.platform, nq.output_state.name, ins, weight, out))
    states = collections.Counter(fq.config.state.name for fq in qs.values())
    order = ["quantized", "passive", "overlapped", "fp32", "shape"]
    meta = gm.meta if hasattr(gm, "meta") else {}
    return QuantSummary(gq.platform, {k: counts.get(k, 0) for k in order}, dict(states), layers, protected,
                        dict(meta.get(ISLANDS_KEY, {})), dict(meta.get(UNEXPRESSIBLE_KEY, {})))
