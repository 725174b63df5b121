"""Name mapping: write the ONNX names onto the nodes of the GraphModule onnx2torch built (layout: package docstring).

onnx2torch names each ``call_module`` target after the ONNX node (its ``OnnxGraph`` unique name) and, with
``attach_onnx_mapping=True``, leaves on each module the ONNX tensors its ``forward`` arguments come from. This
module reads both, records them in ``node.meta["onnx"]``, removes the attribute again, and rebuilds the output
node so the GraphModule returns exactly the ONNX graph outputs, in order.
"""
from __future__ import annotations

import operator
from typing import Any

import onnx
import torch
from torch import fx

from fxq.frontends.onnx.support import opset_of

__all__ = ["annotate", "PARAM_INPUTS", "output_meta"]

# op type -> module tensor name -> index of the ONNX input it is made from (onnx2torch's built-in converters)
PARAM_INPUTS: dict[str, dict[str, int]] = {
    "Conv": {"weight": 1, "bias": 2},
    "ConvTranspose": {"weight": 1, "bias": 2},
    "Gemm": {"weight": 1, "bias": 2},
    "BatchNormalization": {"weight": 1, "bias": 2, "running_mean": 3, "running_var": 4},
    "InstanceNormalization": {"weight": 1, "bias": 2},
    "LayerNormalization": {"weight": 1, "bias": 2},
    "LSTM": {"W": 1, "R": 2, "B": 3},  # fxq's RecurrentLayer
    "GRU": {"W": 1, "R": 2, "B": 3},
}


def _dims(info: onnx.ValueInfoProto) -> list[int | str | None]:
    if not info.type.HasField("tensor_type") or not info.type.tensor_type.HasField("shape"):
        return []
    out: list[int | str | None] = []
    for d in info.type.tensor_type.shape.dim:
        out.append(int(d.dim_value) if d.HasField("dim_value") else (d.dim_param if d.HasField("dim_param") else None))
    return out


def _module_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    tensors = dict(module.named_parameters())
    tensors.update(module.named_buffers())
    return {k: v for k, v in tensors.items() if v is not None}


def _param_names(module: torch.nn.Module, node: Any, arg_names: list[str], graph: Any) -> dict[str, str]:
    """Module tensor name -> ONNX initializer it was made from (initializers the converter consumed)."""
    tensors = _module_tensors(module)
    consumed = [v for v in node.input_values if v in graph.initializers and v not in arg_names]
    if not tensors or not consumed:
        return {}
    params: dict[str, str] = {}
    inputs = node.input_values
    for pname, idx in PARAM_INPUTS.get(node.operation_type, {}).items():
        if pname in tensors and idx < len(inputs) and inputs[idx] in consumed:
            params[pname] = inputs[idx]
    free = [c for c in consumed if c not in params.values()]
    for pname, value in tensors.items():  # other converters: match by value, only when unambiguous
        if pname in params or not free:
            continue
        hits = [c for c in free if _same(graph.initializers[c].to_torch(), value)]
        if len(hits) == 1:
            params[pname] = hits[0]
            free.remove(hits[0])
    return params


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b.detach().cpu())


def _node_meta(node: Any, opset: int, arg_names: list[str]) -> dict[str, Any]:
    return {
        "node_name": node.name,
        "op_type": node.operation_type,
        "domain": node.domain,
        "opset": opset,
        "inputs": list(node.input_values),
        "outputs": list(node.output_values),
        "args": list(arg_names),
    }


def annotate(
    gm: fx.GraphModule, model: onnx.ModelProto, source: str, aliases: dict[str, str] | None = None
) -> fx.GraphModule:
    """Record ONNX names in ``gm`` (see the package docstring) and return exactly the ONNX outputs.

    Args:
        gm: what ``onnx2torch.convert(model, attach_onnx_mapping=True)`` returned.
        model: the (cleaned) model it was converted from.
        source: the file's base name, or ``"<ModelProto>"``.
        aliases: ``{alias: domain}`` of domains renamed for conversion; the meta shows the real names.
    """
    aliases = aliases or {}
    from onnx2torch.onnx_graph import OnnxGraph  # onnx2torch imports torchvision: only when loading

    graph = OnnxGraph(model.graph)  # the same unique node names onnx2torch gave the modules
    tensor_node: dict[str, fx.Node] = {}
    module_node: dict[str, fx.Node] = {}

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for ph, name in zip(placeholders, graph.input_values):
        ph.meta["onnx"] = {"outputs": [name]}
        tensor_node[name] = ph

    for n in gm.graph.nodes:
        if n.op != "call_module" or n.target not in graph.nodes:
            continue
        onode = graph.nodes[n.target]
        module = gm.get_submodule(n.target)
        mapping = getattr(module, "onnx_mapping", None)
        arg_names = [v for v in mapping.inputs if v != ""] if mapping is not None else []
        if mapping is not None:
            del module.onnx_mapping
        meta = _node_meta(onode, opset_of(model, onode.domain) or 0, arg_names)
        meta["domain"] = aliases.get(onode.domain, onode.domain)
        params = _param_names(module, onode, arg_names, graph)
        if params:
            meta["params"] = params
        n.meta["onnx"] = meta
        module_node[n.target] = n
        if len(onode.output_values) == 1:
            tensor_node[onode.output_values[0]] = n
        for arg, name in zip(list(n.args) + list(n.kwargs.values()), arg_names):
            if isinstance(arg, fx.Node) and arg.op == "get_attr" and name in graph.initializers:
                arg.meta["onnx"] = {"initializer": name, "outputs": [name]}

    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is operator.getitem:
            parent, index = n.args[0], n.args[1]
            if isinstance(parent, fx.Node) and parent.target in module_node and isinstance(index, int):
                n.meta["onnx"] = output_meta(parent.meta["onnx"], index)
                tensor_node[n.meta["onnx"]["outputs"][0]] = n

    _rebuild_output(gm, graph, tensor_node, module_node)
    gm.meta["onnx"] = _graph_meta(model, graph, source, aliases)
    gm.graph.lint()
    gm.recompile()
    return gm


def output_meta(parent: dict[str, Any], index: int) -> dict[str, Any]:
    """The ONNX meta of the node that picks output ``index`` of a multi-output node with meta ``parent``."""
    meta = {k: (list(v) if isinstance(v, list) else v) for k, v in parent.items() if k not in ("params", "args")}
    meta["outputs"] = [parent["outputs"][index]]
    meta["output_index"] = index
    return meta


def _rebuild_output(
    gm: fx.GraphModule, graph: Any, tensor_node: dict[str, fx.Node], module_node: dict[str, fx.Node]
) -> None:
    """Return the ONNX graph outputs in order (onnx2torch returns a whole tuple for a multi-output producer)."""
    values: list[fx.Node] = []
    for name in graph.output_values:
        node = tensor_node.get(name)
        if node is None:
            producer, index = graph.value_as_node_output(name)
            parent = module_node[producer.unique_name]
            with gm.graph.inserting_after(parent):
                node = gm.graph.call_function(operator.getitem, (parent, index))
            node.meta["onnx"] = output_meta(parent.meta["onnx"], index)
            tensor_node[name] = node
        values.append(node)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    out.args = (values[0] if len(values) == 1 else tuple(values),)
    out.meta["onnx"] = {"inputs": list(graph.output_values)}


def _graph_meta(model: onnx.ModelProto, graph: Any, source: str, aliases: dict[str, str]) -> dict[str, Any]:
    infos = {i.name: i for i in model.graph.input}
    return {
        "inputs": list(graph.input_values),
        "outputs": list(graph.output_values),
        "input_shapes": {name: _dims(infos[name]) for name in graph.input_values},
        "opset": opset_of(model, "") or 0,
        "opset_imports": {(aliases.get(i.domain, i.domain) or "ai.onnx"): int(i.version) for i in model.opset_import},
        "ir_version": int(model.ir_version),
        "producer": f"{model.producer_name} {model.producer_version}".strip(),
        "graph_name": model.graph.name,
        "source": source,
    }
