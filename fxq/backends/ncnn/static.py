"""The values of an exported graph that are numbers of the ncnn file, not tensors of its network."""
from __future__ import annotations

from torch import fx, nn

from fxq.graph.info import is_quantizer_node
from fxq.graph.op_types import op_type

__all__ = ["shape_only_nodes"]


def shape_only_nodes(gm: fx.GraphModule, modules: dict[str, nn.Module]) -> set[fx.Node]:
    """The nodes computed only from tensor shapes (``Shape`` nodes), constants and stored tensors: ONNX's
    Shape -> Gather -> Unsqueeze -> Concat -> Reshape, and parameter arithmetic (SSD's ``weight.view(1, -1, 1, 1)``,
    ViT's ``class_token.expand(n, -1, -1)``). A quantizer is never one: a quantized value is the network's."""
    found: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op not in ("call_module", "call_function", "call_method") or is_quantizer_node(node):
            continue
        ins = node.all_input_nodes
        if op_type(node, modules) == "Shape" or (ins and all(i in found or i.op == "get_attr" for i in ins)):
            found.add(node)
    return found
