"""ONNX frontend: ``load_onnx(path_or_ModelProto) -> torch.fx.GraphModule`` through onnx2torch.

Pipeline (``loader.py``): read the file and its external data (``reader.py``) -> clean the graph (``cleanup.py``:
default-domain spelling, initializer inputs, Constant and Identity-of-initializer folding) -> shape inference,
at the ``input_shapes`` given for symbolic dims with shape subgraphs folded for inference only (``shapes.py``) ->
check every node has a converter, reporting all gaps at once (``support.py``) -> ``onnx2torch.convert`` with
fxq's converters for the ops and opsets onnx2torch lacks (``converters/``) -> name mapping (``naming.py``) ->
one run against onnxruntime on a generated input (``verify.py``).

Name-mapping layout (what exporters read to write back onto the user's tensor names):

``gm.meta["onnx"]``::

    {"inputs": [graph input names],            # in placeholder order (initializers excluded)
     "outputs": [graph output names],          # in the order the GraphModule returns them
     "input_shapes": {name: [dims]},           # int, str (symbolic dim_param) or None (unknown) per dim;
                                               # the input_shapes given to load_onnx where given
     "source_input_shapes": {name: [dims]},    # the file's own dims (exports keep its symbolic ones dynamic)
     "source_output_shapes": {name: [dims]},   # the file's declared output dims (exports keep their dim names)
     "opset": int,                             # default-domain opset
     "opset_imports": {domain: version},       # "ai.onnx" for the default domain
     "ir_version": int, "producer": str, "graph_name": str,
     "source": "model.onnx" | "<ModelProto>"}  # base name only, never a full path

``node.meta["onnx"]`` by fx node kind:

- ``placeholder``: ``{"outputs": [graph input name]}``.
- ``call_module`` made from an ONNX node::

    {"node_name": str,            # the ONNX node's name ("" when the node is unnamed)
     "op_type": str, "domain": str ("" = ai.onnx), "opset": int (imported opset of that domain),
     "inputs": [tensor names],    # the node's inputs as in the file ("" for a skipped optional input)
     "outputs": [tensor names],   # the node's outputs as in the file
     "args": [tensor names],      # the tensor behind each fx argument, in order (positional, then keyword)
     "params": {"weight": initializer name, "bias": ...}}  # only when the module holds tensors made from
                                  # initializers; the module may hold them transposed/scaled (Gemm transB/alpha)

- ``call_function operator.getitem`` picking output ``i`` of a multi-output node: the node's keys above except
  ``args``/``params``, with ``"outputs": [that one tensor name]`` and ``"output_index": i``.
- ``get_attr`` of an initializer fed to a node at run time: ``{"initializer": name, "outputs": [name]}``.
- ``output``: ``{"inputs": [graph output names]}``.

Initializers folded from ``Constant``/``Identity`` nodes keep the names their consumers use, so ``inputs`` and
``params`` match the user's file; those ``Constant``/``Identity`` nodes themselves have no fx node. Later graph
passes that replace nodes are responsible for carrying or dropping this metadata.
"""
from fxq.frontends.onnx.converters.registry import register_onnx_converter
from fxq.frontends.onnx.loader import load_onnx

__all__ = ["load_onnx", "register_onnx_converter"]
