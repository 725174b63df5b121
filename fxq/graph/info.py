"""Per-node quantization facts, stored once in ``node.meta["fxq"]`` and ``gm.meta["fxq"]``.

Dispatch, prepare, calibration, analysis and every exporter read these records:

* ``node.meta["fxq"]`` on an op node is a :class:`NodeQuant` — its canonical op type, the platform
  it was dispatched to (a platform name, ``"fp32"`` or ``"shape"``), which quantizer covers each of
  its tensor inputs, and which quantizer covers its output (its own, an overlapping one downstream
  such as the ReLU after a conv, or the input's one for passive ops such as MaxPool).
* a quantizer node (``call_module`` into ``gm.fxq_quantizers``) carries nothing: what its quantizer
  quantizes (role, source, parameter, the quantizers a bias derives from, the groups whose grid it shares) is
  recorded on the :class:`~fxq.FakeQuantize` itself, and :class:`fxq.graph.quant_graph.QuantGraph` answers the
  queries.
* ``gm.meta["fxq"]`` is a :class:`GraphQuant`: the platform and the dispatcher.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Iterable, Iterator

from torch import fx, nn

from fxq.spec import QuantState

__all__ = ["NodeQuant", "QuantizerInfo", "GraphQuant", "QUANTIZERS_ATTR", "node_quant", "iter_quantizers",
           "graph_quant", "quantizer_nodes", "is_quantizer_node", "computed_from_parameters", "node_names"]

QUANTIZERS_ATTR = "fxq_quantizers"
"""Name of the ``nn.ModuleDict`` of a prepared GraphModule that holds every FakeQuantize."""


def computed_from_parameters(node: fx.Node, memo: dict[fx.Node, bool] | None = None) -> bool:
    """Whether ``node``'s value is computed from parameters only (``get_attr``, possibly reshaped or quantized).

    Walks inputs with an explicit stack, so a graph of any depth is fine; ``memo`` keeps the answers across calls
    (inserting a quantizer on an edge leaves them true).
    """
    memo = {} if memo is None else memo
    stack = [node]
    while stack:
        n = stack[-1]
        if n in memo:
            stack.pop()
        elif n.op == "get_attr":
            memo[stack.pop()] = True
        elif n.op in ("placeholder", "output") or not n.all_input_nodes:
            memo[stack.pop()] = False
        else:
            pending = [a for a in n.all_input_nodes if a not in memo]
            if pending:
                stack.extend(reversed(pending))
            else:
                memo[stack.pop()] = all(memo[a] for a in n.all_input_nodes)
    return memo[node]


@dataclasses.dataclass
class NodeQuant:
    op_type: str
    platform: str  # platform name, "fp32" or "shape"
    inputs: dict[str, str | None] = dataclasses.field(default_factory=dict)  # input node -> quantizer
    output: str | None = None  # quantizer covering this node's output value
    output_state: QuantState = QuantState.FP32  # ACTIVATED (own), OVERLAPPED, PASSIVE (shared), FP32

    @property
    def quantized(self) -> bool:
        return self.platform not in ("fp32", "shape")


@dataclasses.dataclass
class QuantizerInfo:
    """A snapshot of one quantizer's record (``QuantGraph.info``); files saved before the record moved onto the
    FakeQuantize hold these in ``gm.meta["fxq_quantizer_infos"]`` and ``node.meta["fxq_quantizer"]``."""

    name: str
    role: str  # "activation" | "weight" | "bias"
    source: str  # name of the node whose value it quantizes
    consumers: list[str] = dataclasses.field(default_factory=list)  # op nodes that read the quantized value
    param: str | None = None  # get_attr target for weights / biases


@dataclasses.dataclass
class GraphQuant:
    """What a prepared graph was prepared for; files saved before alignment moved onto the quantizers also hold
    ``align_large`` / ``align_output`` lists here (moved onto them on load)."""

    platform: str
    dispatcher: str


def node_quant(node: fx.Node) -> NodeQuant | None:
    return node.meta.get("fxq")


def graph_quant(gm: fx.GraphModule) -> GraphQuant:
    from fxq.errors import GraphError

    info = gm.meta.get("fxq") if hasattr(gm, "meta") else None
    if not isinstance(info, GraphQuant):
        raise GraphError("this module was not prepared by fxq: call fxq.prepare / fxq.quantize first")
    return info


def source_names(node: fx.Node, module_path: bool = True) -> list[str]:
    """The names ``node`` had in the model it came from: ONNX node name, caffe layer (, ``nn.Module`` path)."""
    names = []
    for key, field in (("onnx", "node_name"), ("caffe", "layer")):
        info = node.meta.get(key)
        if isinstance(info, dict) and info.get(field):
            names.append(str(info[field]))
    if module_path and node.meta.get("module_path"):
        names.append(str(node.meta["module_path"]))
    return names


def node_names(node: fx.Node) -> set[str]:
    """The names a user may give ``node`` by: its fx name, target, module path and original ONNX / caffe name."""
    names = {node.name, str(node.target), *source_names(node)}
    names.discard("")
    return names


def match_node_name(node: fx.Node, keys: Iterable[str]) -> str | None:
    """The first of ``keys`` naming ``node`` (:func:`node_names`) exactly, else the first that matches one of them
    as a regex (fullmatch); None when none does."""
    names = node_names(node)
    keys = list(keys)
    for key in keys:
        if key in names:
            return key
    for key in keys:
        try:
            rx = re.compile(key)
        except re.error:
            continue
        if any(rx.fullmatch(n) for n in names):
            return key
    return None


def is_quantizer_node(node: fx.Node) -> bool:
    """True for the ``call_module`` nodes that run one of ``gm.fxq_quantizers``."""
    return node.op == "call_module" and str(node.target).startswith(QUANTIZERS_ATTR + ".")


def quantizer_nodes(gm: fx.GraphModule) -> Iterator[fx.Node]:
    return (node for node in gm.graph.nodes if is_quantizer_node(node))


def iter_quantizers(gm: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(name, FakeQuantize) pairs of a prepared model, in insertion order."""
    holder = getattr(gm, QUANTIZERS_ATTR, None)
    if holder is None:
        return iter(())
    return iter(holder.items())
