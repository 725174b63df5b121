"""The values of an exported graph that are numbers of the ncnn file, not tensors of its network."""
from __future__ import annotations

import torch
from torch import fx, nn

from fxq.graph.info import is_quantizer_node
from fxq.graph.nodes import value_inputs
from fxq.graph.op_types import op_type

__all__ = ["shape_only_nodes"]


def shape_only_nodes(gm: fx.GraphModule, modules: dict[str, nn.Module]) -> set[fx.Node]:
    """The nodes computed only from tensor shapes (``Shape`` nodes), constants and stored tensors: ONNX's
    Shape -> Gather -> Unsqueeze -> Concat -> Reshape, and parameter arithmetic (SSD's ``weight.view(1, -1, 1, 1)``,
    ViT's ``class_token.expand(n, -1, -1)``), and calls of constants only (``torch.arange(8)``, which torch.export
    records for an anchor grid). A quantizer is never one: a quantized value is the network's; nor is a random
    draw."""
    found: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op not in ("call_module", "call_function", "call_method") or is_quantizer_node(node):
            continue
        ins = value_inputs(node)
        if op_type(node, modules) == "Shape" or (all(i in found or i.op == "get_attr" for i in ins) and (
                node.all_input_nodes or (node.op == "call_function" and node.target not in _RANDOM))):
            found.add(node)
    return found


_RANDOM = {torch.rand, torch.randn, torch.randint, torch.randperm, torch.normal, torch.bernoulli, torch.multinomial,
           torch.rand_like, torch.randn_like, torch.randint_like, torch.poisson}
