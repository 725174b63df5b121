"""fx graph -> :class:`~fxq.backends.ncnn.writer.NcnnModel`: the walk, names, blobs and int8 scales.

Layer converters (one per canonical op type, :mod:`fxq.backends.ncnn.layers`) are registered with
:func:`~fxq.backends.ncnn.registry.register_ncnn_converter` (the package imports the built-in ones) and
receive the :class:`NcnnBuilder` and the node. Blobs follow ncnn's batch-less layout: a torch value of shape
``(N, *rest)`` is an ncnn blob of shape ``rest`` (graph inputs and outputs always). A model whose inputs are
unbatched (torchvision's detectors take one ``[3, H, W]`` image and add the batch inside, :func:`_unbatched_evidence`)
has inputs whose blob is their whole shape. Inside the graph a batch of 1 may move: ``x.transpose(0, 1)`` of a
``(1, T, D)`` value is
``(T, 1, D)``, still the blob ``(T, D)``, and torch's attention folds the batch into the heads,
``(T, B * H, Dh)``, a blob with every dim. :meth:`NcnnBuilder.batch_dim` records which torch dim a value's
blob leaves out (``None``: none); converters registered with ``any_batch_dim=True`` read it, every other
converter gets only values whose batch is dim 0. A value of more than 4 dims besides the batch (beyond ncnn's
blobs) is a rank-4 blob of its elements in torch's order (:meth:`NcnnBuilder.stored_shape`), which only converters
registered with ``high_rank=True`` (reshape, permute, identity) read; the builder refuses it to any other op.

Naming: a layer is named after the original layer (``node.meta["caffe"]["layer"]``,
``node.meta["onnx"]["node_name"]``) or else the fx node's name; a layer's output blob carries the layer's
name; graph inputs are ``in0, in1...`` and outputs ``out0, out1...`` (pnnx's convention).

Quantization: only Conv / Gemm nodes whose data input *and* weight pass through quantizing FakeQuantize
nodes become int8 layers. Which ops may read a quantized value (Conv and Gemm, no 3-D conv) and the schemes
themselves (bits, range, symmetry, axis, FP32 biases) are ``ncnn_int8``'s :class:`~fxq.qconfig.Capability`, checked
by the exporter before the build; :meth:`NcnnBuilder.check_quantizers` then makes sure every quantizing
FakeQuantize was written into an int8 layer by its converter.
"""
from __future__ import annotations

import logging
import math
import re
from typing import Any

import numpy as np
import torch
from torch import fx, nn

from fxq.backends.ncnn.fuse import FUSED_OPS, drop_broadcast_expands, fuse_erf_gelu, fuse_layer_norm
from fxq.backends.ncnn.islands import FLOAT_VALUE, inline_islands, island_note
from fxq.backends.ncnn.registry import NCNN_CONVERTERS, converts_tuples, takes_any_batch_dim, takes_high_rank
from fxq.backends.ncnn.static import shape_only_nodes
from fxq.backends.ncnn.writer import Int8Scales, NcnnLayer, NcnnModel, drop_dim, shape_params
from fxq.backends.qdq.lowering import example_inputs_for
from fxq.errors import ExportError
from fxq.functional import fake_quantize
from fxq.graph.data import (
    doubled_dim_probes,
    input_batch_dim,
    onnx_input_name,
    onnx_output_name,
    source_batch_dim,
    source_dynamic_dims,
    source_unbatched,
)
from fxq.graph.info import is_quantizer_node
from fxq.graph.nodes import get_attr_value, output_shapes
from fxq.graph.op_types import op_type
from fxq.graph.passes import propagate_tensor_meta
from fxq.graph.quant_graph import QuantGraph
from fxq.nn.fake_quantize import FakeQuantize
from fxq.spec import QUANTIZING_STATES, QuantState, RoundingPolicy

__all__ = ["NcnnBuilder", "WeightInfo", "build_ncnn_model", "fold_dims"]

logger = logging.getLogger(__name__)

_INHERIT = object()

_NCNN_ROUNDING = (RoundingPolicy.HALF_FAR_FROM_ZERO, RoundingPolicy.TO_NEAR_INT)
_PENDING = (QuantState.INITIAL, QuantState.PASSIVE_INIT)


def _reserve(name: str, taken: set[str]) -> str:
    """``name``, or ``name_1``, ``name_2``... when taken; added to ``taken``."""
    unique, i = name, 1
    while unique in taken:
        unique = f"{name}_{i}"
        i += 1
    taken.add(unique)
    return unique


def _sanitize(name: str) -> str:
    return re.sub(r"\s+", "_", str(name)).strip() or "layer"


class WeightInfo:
    """The weight of a Conv / Gemm node: its FP32 value, the quantizer over it, and the quantized value.

    ``out_axis``: the weight's output-channel axis (0 for Conv / Linear, -1 for the ``(K, N)`` matrix of a
    MatMul), the one its per-channel scales must lie along."""

    def __init__(self, fp32: torch.Tensor, fq: FakeQuantize | None, qnode: fx.Node | None, out_axis: int = 0) -> None:
        self.fp32 = fp32
        self.fq = fq
        self.qnode = qnode
        self.out_axis = out_axis

    @property
    def quantizing(self) -> bool:
        return self.fq is not None and self.fq.config.state in QUANTIZING_STATES

    def quantized(self) -> torch.Tensor:
        """The fake-quantized weight (the values fxq's simulation computes with)."""
        assert self.fq is not None
        return fake_quantize(self.fp32, self.fq.config, self.fq.scale.detach(), self.fq.offset.detach())


class NcnnBuilder:
    """Walks a quantized GraphModule once and collects ncnn layers (see the module docstring)."""

    def __init__(self, gm: fx.GraphModule, unbatched_inputs: bool = False) -> None:
        self.gm = gm
        self.unbatched_inputs = unbatched_inputs  # the inputs' dim 0 is no batch: each input is one whole blob
        self.modules = dict(gm.named_modules())
        self.model = NcnnModel()
        self.blob_of: dict[fx.Node, str] = {}
        self._batch_dims: dict[fx.Node, int | None] = {}  # the torch dim a value's blob leaves out (default 0)
        self._constants: dict[tuple[fx.Node, tuple[int, ...], str], str] = {}  # MemoryData by (tensor, layout, tag)
        self._stored: dict[fx.Node, tuple[int, ...]] = {}  # ncnn shapes of values of more than 4 blob dims
        self._layer_names: set[str] = set()
        self._blob_names: set[str] = set()
        self.used_quantizers: set[tuple[fx.Node, fx.Node]] = set()  # (quantizer node, consumer node)
        self._warned: set[str] = set()
        self.static_nodes: set[fx.Node] = set()  # values computed from shapes, constants and stored tensors
        self._static: dict[tuple[fx.Node, int | None], Any] = {}
        self._probes: list[dict[fx.Node, tuple[int, ...]]] | None = None  # :meth:`probe_shapes`
        self._empty: set[fx.Node] = set()  # values of no element: no blob (:meth:`mark_empty`)
        self._proven: dict[fx.Node, torch.Tensor] = {}  # values a converter showed to be fixed (:meth:`prove`)

    # ------------------------------------------------------------------ graph helpers
    def is_quantizer(self, node: Any) -> bool:
        return isinstance(node, fx.Node) and is_quantizer_node(node)

    def quantizer(self, node: fx.Node) -> FakeQuantize:
        return self.modules[str(node.target)]

    def strip(self, node: fx.Node) -> fx.Node:
        """The value under any chain of quantizer nodes."""
        while self.is_quantizer(node):
            node = node.args[0]
        return node

    def module(self, node: fx.Node) -> nn.Module | None:
        return self.modules.get(str(node.target)) if node.op == "call_module" else None

    def shape(self, node: fx.Node) -> tuple[int, ...]:
        val = self.strip(node).meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise ExportError(f"node {node.name!r} has no recorded tensor shape: prepare the model with example "
                              "inputs (fxq.prepare / fxq.quantize record node.meta['val'])")
        return tuple(int(d) for d in val.shape)

    def batch_dim(self, node: fx.Node) -> int | None:
        """The torch dim of ``node``'s value that its ncnn blob leaves out: 0 unless a converter moved a batch of
        1 (``x.transpose(0, 1)``); ``None`` when the blob keeps every dim (the batch was folded into another)."""
        return self._batch_dims.get(self.strip(node), 0)

    def blob_shape(self, node: fx.Node) -> tuple[int, ...]:
        """ncnn shape of a value: the torch shape without its batch dimension (see :meth:`batch_dim`)."""
        shape = self.shape(node)
        if not shape and self.strip(node) in self.blob_of:
            return (1,)  # a 0-d value computed by a layer (a mean of everything): ncnn's one-element blob
        if not shape:
            raise ExportError(f"node {node.name!r} is a scalar tensor; ncnn blobs have a batch-less shape (C, H, W)")
        return drop_dim(shape, self.batch_dim(node))

    def stored_shape(self, node: fx.Node) -> tuple[int, ...]:
        """The shape of ``node``'s ncnn blob: :meth:`blob_shape`, or for a value of more than 4 dims besides the
        batch (ncnn's limit) those dims with the outermost merged into one (:func:`fold_dims`): a blob keeps
        torch's element order, so such a value is a rank-4 blob that only ``high_rank`` converters read."""
        return self._stored.get(self.strip(node)) or self.blob_shape(node)

    def high_rank(self, node: fx.Node) -> bool:
        """Whether ``node``'s value has more than 4 dims besides the batch (see :meth:`stored_shape`)."""
        return self.strip(node) in self._stored

    def ncnn_axis(self, node: fx.Node, dim: int, value: fx.Node) -> int:
        """The blob axis of torch dim ``dim`` of ``value`` (an input of ``node``, whose layer works along it)."""
        rank, bd = len(self.shape(value)), self.batch_dim(value)
        d = dim + rank if dim < 0 else dim
        if not 0 <= d < rank or d == bd:
            raise self.fail(node, f"it works along dim {dim} of a rank-{rank} tensor whose batch dimension is dim "
                            f"{bd}; ncnn blobs have no batch dimension", "work along the other dims")
        return d if bd is None or d < bd else d - 1

    def op(self, node: fx.Node) -> str:
        return op_type(node, self.modules)

    def fail(self, node: fx.Node, why: str, fix: str) -> ExportError:
        where, island_fix = island_note(self.gm, node)
        return ExportError(f"ncnn export: node {node.name!r} (op {self.op(node)}, target {_target(node)}){where}: "
                           f"{why}. Fix: {fix}{island_fix}")

    def fixed_value(self, arg: Any) -> Any:
        """The export-time value of ``arg`` (past quantizers): a stored tensor (get_attr) or a value computed from
        stored tensors and shapes only (:meth:`static_value`); ``arg`` itself when it is no node; None for a value
        the network computes."""
        src = self.strip(arg) if isinstance(arg, fx.Node) else arg
        if not isinstance(src, fx.Node):
            return src
        if src.op == "get_attr":
            return get_attr_value(self.gm, str(src.target))
        if src in self._proven:
            return self._proven[src]
        return self.static_value(src) if src in self.static_nodes else None

    def prove(self, node: fx.Node, value: torch.Tensor) -> None:
        """``node``, computed in the network, has ``value`` whatever the input (a NaN test of a value that cannot be
        NaN): a fixed value of the file from now on (:meth:`fixed_value`), with no layer of its own."""
        self._proven[node] = value

    def shape_number(self, arg: fx.Node, node: fx.Node, what: str) -> Any:
        """The export-time value of a shape-only ``arg`` of ``node`` (:meth:`static_value`), warned about when it
        follows the input's spatial size (the file then runs only at the export size)."""
        src = self.strip(arg)
        value = self.static_value(src)
        if self.resolution_dependent(src).any():
            self.warn_once(f"baked:{src.name}", "ncnn export: the %s of node %s is computed from the input's "
                           "spatial size (node %s); the ncnn file keeps its export-time value %s and runs only "
                           "at that input size", what, node.name, src.name, _brief(value))
        return value

    def param(self, arg: Any, node: fx.Node, what: str) -> torch.Tensor:
        """Value of a parameter argument (a get_attr node, possibly under a quantizer, or a shape-only value: warned
        about when it follows the input's spatial size)."""
        src = self.strip(arg) if isinstance(arg, fx.Node) else arg
        value = self.fixed_value(arg)
        if isinstance(src, fx.Node) and value is not None:
            if src in self.static_nodes:
                value = self.shape_number(src, node, what)
            return torch.as_tensor(value).detach().float().cpu()
        if isinstance(src, torch.Tensor):
            return src.detach().float().cpu()
        raise self.fail(node, f"its {what} is computed in the graph ({src!r}), not a stored parameter",
                        "ncnn needs constant weights; fold the computation into a parameter before exporting")

    # ------------------------------------------------------------------ naming and layers
    def layer_name(self, node: fx.Node) -> str:
        """The original layer name (caffe layer, ONNX node) or the node's name, made unique."""
        base = node.name
        caffe, onnx_meta = node.meta.get("caffe"), node.meta.get("onnx")
        if isinstance(caffe, dict) and caffe.get("layer") and caffe.get("produces", [None]):
            base = str(caffe["layer"])  # helper nodes of a layer (e.g. the Flatten before an InnerProduct,
            # whose "produces" is empty) keep their own name so the layer itself gets the caffe name
        elif isinstance(onnx_meta, dict) and onnx_meta.get("node_name"):
            base = str(onnx_meta["node_name"])
        return self.unique_layer_name(base)

    def unique_layer_name(self, base: str) -> str:
        """``base`` (sanitized), or ``base_1``, ``base_2``... when a layer has that name already; reserved."""
        return _reserve(_sanitize(base)[:240], self._layer_names)

    def _new_blob(self, name: str) -> str:
        return _reserve(name, self._blob_names)

    def blob(self, arg: Any, node: fx.Node) -> str:
        """ncnn blob name of a tensor argument of ``node``; a stored tensor, or one computed from stored tensors
        and shapes only (``class_token.expand(n, -1, -1)``), becomes a ``MemoryData`` (:meth:`constant`)."""
        if not isinstance(arg, fx.Node):
            raise self.fail(node, f"an input is the constant {arg!r}, not a tensor computed in the graph",
                            "ncnn has no constant tensors here; make it a parameter of a supported layer")
        src = self.strip(arg)
        if src in self.blob_of:
            return self.blob_of[src]
        if src in self._empty:
            raise self.fail(node, f"its input {src.name!r} is empty (shape {self.shape(src)}); ncnn blobs cannot be "
                            "empty, and only a Concat can leave such a value out", "remove the empty value (an empty "
                            "slice) from the model, or concatenate it")
        if self.is_constant(src):
            return self.constant(arg, node, like=arg)
        if src in self.static_nodes:
            raise self.fail(node, f"its input {src.name!r} is computed from tensor shapes only (a constant at export "
                            "time), not a tensor of the network", "use such values only as shapes / slice bounds")
        value = self.fixed_value(src)
        if isinstance(value, torch.Tensor) and not value.is_floating_point():
            raise self.fail(node, f"its input {src.name!r} is a stored {value.dtype} tensor: ncnn blobs hold float "
                            "values and its layers compute in float, not on integers",
                            "compute integer (index / shape) arithmetic outside the exported network, or export "
                            "for 'ort_int8' / 'trt_int8'")
        raise self.fail(node, f"its input node {src.name!r} has no ncnn blob",
                        "only values computed by exported layers or stored tensors can feed a layer")

    def mark_empty(self, node: fx.Node) -> None:
        """``node``'s value has no element (an empty slice: ``x[:, :0]``): ncnn blobs cannot be empty, so it has no
        blob; a ``Concat`` leaves it out, any other reader is refused (:meth:`blob`)."""
        self._empty.add(node)

    def is_empty(self, arg: Any) -> bool:
        return isinstance(arg, fx.Node) and self.strip(arg) in self._empty

    def is_constant(self, arg: Any) -> bool:
        """Whether ``arg`` is a floating-point or bool tensor fixed at export time: a stored tensor (get_attr) or a
        value computed from stored tensors and shapes only (a static node, :meth:`static_value`). A bool one (a
        detection head's mask of valid anchors) is stored as 0 / 1, as torch's arithmetic reads it."""
        value = self.fixed_value(arg) if isinstance(arg, fx.Node) else None
        return isinstance(value, torch.Tensor) and (value.is_floating_point() or value.dtype == torch.bool)

    def emit(self, node: fx.Node, layer_type: str, bottoms: list[str], params: dict[int, Any] | None = None,
             weights: list[tuple[str, np.ndarray]] | None = None, *, int8: Int8Scales | None = None,
             int8_term: int = 2, batch_dim: Any = _INHERIT, name: str | None = None) -> NcnnLayer:
        """Append the layer computing ``node``; its output blob becomes the node's blob.

        ``batch_dim``: the output's :meth:`batch_dim`; by default that of the node's first input with a blob
        (a layer keeps its input's layout), 0 without one. ``name``: a layer name reserved with
        :meth:`layer_name` / :meth:`unique_layer_name` (default: a new :meth:`layer_name`).
        """
        layer = self.add_layer(node, layer_type, bottoms, params, weights, int8=int8, int8_term=int8_term, name=name)
        self._set_blob(node, layer.tops[0], self._input_batch_dim(node) if batch_dim is _INHERIT else batch_dim)
        return layer

    def helper(self, node: fx.Node, layer_type: str, bottoms: list[str], params: dict[int, Any] | None = None,
               weights: list[tuple[str, np.ndarray]] | None = None) -> str:
        """Append a layer that computes an intermediate value of ``node`` (not its result); returns its blob."""
        return self.add_layer(node, layer_type, bottoms, params, weights).tops[0]

    def add_layer(self, node: fx.Node, layer_type: str, bottoms: list[str], params: dict[int, Any] | None = None,
                  weights: list[tuple[str, np.ndarray]] | None = None, *, n_tops: int = 1,
                  int8: Int8Scales | None = None, int8_term: int = 2, name: str | None = None) -> NcnnLayer:
        """Append a layer of ``node`` with ``n_tops`` new blobs (named after the layer) that no node owns: an
        intermediate value, or several (a ``Slice``); :meth:`emit` gives the node its blob."""
        name = self.layer_name(node) if name is None else name
        tops = [self._new_blob(name if n_tops == 1 else f"{name}_{k}") for k in range(n_tops)]
        layer = NcnnLayer(layer_type, name, list(bottoms), tops, dict(params or {}), list(weights or []),
                          int8=int8, int8_term=int8_term, source=node.name)
        self.model.layers.append(layer)
        return layer

    def alias(self, node: fx.Node, src: fx.Node, batch_dim: int | None) -> None:
        """``node`` is ``src``'s blob unchanged (a reshape / permute that moves only a batch of 1): no layer."""
        self._set_blob(node, self.blob(src, node), batch_dim)

    def _set_blob(self, node: fx.Node, blob: str, batch_dim: int | None) -> None:
        self.blob_of[node] = blob
        self._batch_dims[node] = batch_dim
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and val.dim() - (batch_dim is not None) > 4:
            self._stored[node] = fold_dims(drop_dim(tuple(int(d) for d in val.shape), batch_dim))

    def _input_batch_dim(self, node: fx.Node) -> int | None:
        src = next((s for s in map(self.strip, node.all_input_nodes) if s in self.blob_of), None)
        return 0 if src is None else self.batch_dim(src)

    def constant(self, arg: fx.Node, node: fx.Node, like: fx.Node) -> str:
        """A stored tensor operand of ``node`` as an ncnn ``MemoryData`` blob laid out like the operand ``like``.

        A lower rank gains leading dims of 1 (torch's broadcasting), so ncnn sees both operands at one rank; the
        constant must have size 1 along ``like``'s batch dim (torch broadcasts it over the batch). One
        ``MemoryData`` per layout: a tensor used at two ranks (``x4d * s`` and ``x2d + s``) is stored twice, since
        ncnn reads a blob by its rank (a 1-D blob broadcasts along channels).
        """
        src = self.strip(arg)
        if src in self.blob_of:
            return self.blob(arg, node)
        return self.memory_data(self.param(src, node, "constant operand"), node, like, src)

    def memory_data(self, value: torch.Tensor, node: fx.Node, like: fx.Node, src: fx.Node, tag: str = "") -> str:
        """``value`` (the export-time value of ``src``, a node of the graph or ``node`` itself for a value only the
        converter computes; ``tag`` tells apart several such values of one node) as a ``MemoryData`` blob laid out
        like ``like`` (see :meth:`constant`)."""
        rank = len(self.shape(like))
        if value.dim() < rank:
            value = value.reshape((1,) * (rank - value.dim()) + tuple(value.shape))
        shape, bd = tuple(value.shape), self.batch_dim(like)
        if len(shape) != len(self.shape(like)) or (bd is not None and shape[bd] != 1):
            raise self.fail(node, f"its constant operand {src.name!r} of shape {shape} does not match the "
                            f"layout of {like.name!r} (shape {self.shape(like)}, batch dim {bd})",
                            "store the constant with the tensor's rank and size 1 along the batch dimension")
        blob_shape = drop_dim(shape, bd)
        if not 1 <= len(blob_shape) <= 4:
            raise self.fail(node, f"its constant operand {src.name!r} has rank {len(blob_shape)} without the batch "
                            "dimension", "ncnn blobs have rank 1 to 4")
        key = (src, blob_shape, tag)
        if key not in self._constants:
            name = self.layer_name(src)
            layer = NcnnLayer("MemoryData", name, [], [self._new_blob(name)], shape_params(blob_shape),
                              [("raw", value.numpy())], source=src.name)
            float_value = src.meta.get(FLOAT_VALUE)  # a constant the simulation computes: the FP32 file's own
            if isinstance(float_value, torch.Tensor) and float_value.numel() == value.numel():
                layer.int8_weights = layer.weights
                layer.weights = [("raw", float_value.detach().float().cpu().reshape(value.shape).numpy())]
            self.model.layers.append(layer)
            self._constants[key] = layer.tops[0]
        return self._constants[key]

    # ------------------------------------------------------------------ shape arithmetic
    def _find_static(self) -> None:
        """Mark the values computed only from tensor shapes, constants and stored tensors
        (:func:`~fxq.backends.ncnn.static.shape_only_nodes`). ncnn has no shape tensors; such values are constants
        of the exported file (:meth:`static_value`): numbers where a layer takes a shape, ``MemoryData`` where a
        layer takes a tensor (:meth:`blob`), no layers of their own."""
        self.static_nodes = shape_only_nodes(self.gm, self.modules)

    def static_value(self, node: fx.Node, probe: int | None = None) -> Any:
        """The export-time value of a shape-only node, run on stand-ins of the recorded shapes (batch 1).

        ``probe``: the value at the input size of probe ``probe`` (:meth:`probe_shapes`), to tell which numbers
        follow the input's size (:meth:`resolution_dependent`)."""
        key = (node, probe)
        if key in self._static:
            return self._static[key]
        shapes = self.probe_shapes()[probe] if probe is not None else {}

        def value(a: Any) -> Any:
            if not isinstance(a, fx.Node):
                return a
            if a in self.static_nodes:
                return self.static_value(a, probe)
            if a.op == "get_attr":
                return get_attr_value(self.gm, str(a.target)).detach()
            val = a.meta.get("val")
            if isinstance(val, torch.Tensor):
                shape = shapes.get(a, tuple(int(d) for d in val.shape))
                return torch.zeros((), dtype=val.dtype).expand(shape)  # the shape, no memory
            return val

        args, kwargs = fx.node.map_aggregate((node.args, node.kwargs), value)
        with torch.no_grad():
            if node.op == "call_module":
                out = self.modules[str(node.target)](*args, **kwargs)
            elif node.op == "call_function":
                out = node.target(*args, **kwargs)
            else:
                out = getattr(args[0], str(node.target))(*args[1:], **kwargs)
        self._static[key] = out
        return out

    def varying_input_dims(self) -> list[tuple[int, int]]:
        """The (input index, dim) pairs an ncnn file should follow (ncnn has no batch): the dims the source ONNX
        file leaves symbolic, or, for a model without a source file, the spatial dims (2+) of inputs of rank 4 or
        more (1+ of rank 3 or more for unbatched inputs)."""
        dims = []
        for i, ph in enumerate(n for n in self.gm.graph.nodes if n.op == "placeholder"):
            val = ph.meta.get("val")
            if not isinstance(val, torch.Tensor):
                continue
            source = source_dynamic_dims(self.gm, ph)
            lead = 0 if self.unbatched_inputs else 1  # the batch, which ncnn does not have
            spatial = set(range(lead + 1, val.dim())) if val.dim() - lead >= 3 else set()
            batch = self._placeholder_batch_dim(ph)
            free = source - {batch} if source is not None else spatial
            dims += [(i, d) for d in sorted(free) if d < val.dim()]
        return dims

    def probe_shapes(self) -> list[dict[fx.Node, tuple[int, ...]]]:
        """Every node's output shape with the varying input dims (:meth:`varying_input_dims`) doubled
        (:func:`~fxq.graph.data.doubled_dim_probes` of the exporters' seeded stand-in inputs,
        :func:`~fxq.graph.nodes.output_shapes`), run once; a size the model does not run at gives no probe."""
        if self._probes is None:
            self._probes = []
            wanted = self.varying_input_dims()
            try:
                args = example_inputs_for(self.gm) if wanted else None
            except ExportError:  # an input without a recorded tensor shape: nothing to double
                args = None
            if args is not None:
                self._probes = doubled_dim_probes(args, wanted, self._run_shapes)
        return self._probes

    def _run_shapes(self, args: tuple) -> dict[fx.Node, tuple[int, ...]] | None:
        try:
            return output_shapes(self.gm, args)
        except Exception as exc:  # noqa: BLE001  (the model takes only its export-time sizes there)
            logger.debug("ncnn export: the model does not run at input shapes %s (%s)",
                         [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)], exc)
            return None

    def probed_shapes(self, *nodes: fx.Node) -> list[tuple[tuple[int, ...], ...]]:
        """The torch shapes of ``nodes`` (past quantizers) at each probe size (:meth:`probe_shapes`) where all
        of them have their export-time rank."""
        srcs = [(self.strip(n), len(self.shape(n))) for n in nodes]
        return [tuple(p[s] for s, _ in srcs) for p in self.probe_shapes()
                if all(s in p and len(p[s]) == rank for s, rank in srcs)]

    def resolution_dependent(self, node: fx.Node) -> torch.Tensor:
        """Per element of a shape-only value: whether it follows the input's size (all False without a probe,
        :meth:`probe_shapes`)."""
        value = torch.as_tensor(self.static_value(node))
        follows = torch.zeros(value.shape, dtype=torch.bool)
        for i in range(len(self.probe_shapes())):
            try:
                other = torch.as_tensor(self.static_value(node, probe=i))
            except Exception:  # noqa: BLE001  (a value that cannot be computed at that size tells nothing)
                continue
            if other.shape != value.shape:
                return torch.ones(value.shape, dtype=torch.bool)
            follows |= other != value
        return follows

    # ------------------------------------------------------------------ weights and int8
    def weight(self, arg: Any, node: fx.Node, out_axis: int = 0) -> WeightInfo:
        """The weight operand ``arg`` of ``node`` (see :class:`WeightInfo` for ``out_axis``)."""
        fq = qnode = None
        if self.is_quantizer(arg):
            qnode, fq = arg, self.quantizer(arg)
        src = self.strip(arg) if isinstance(arg, fx.Node) else arg
        value = self.param(src, node, "weight")
        backup = fq.fp32_backup if fq is not None and fq.baked else None
        if backup is not None:
            value = backup.detach().float().cpu()
        elif fq is not None and fq.config.state in (QuantState.BAKED, QuantState.PASSIVE_BAKED):
            self.warn_once(fq.name, "weights of %s are baked and their FP32 copy is gone: the FP32 ncnn model uses "
                           "the quantized values", node.name)
        return WeightInfo(value, fq, qnode, out_axis)

    def warn_once(self, key: str, msg: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(msg, *args)

    def int8_scales(self, node: fx.Node, x_arg: Any, w: WeightInfo, groups: int = 1) -> Int8Scales | None:
        """ncnn int8 scales of a Conv / Gemm node, or None when it stays FP32 (checks expressibility)."""
        x_fq = self.quantizer(x_arg) if self.is_quantizer(x_arg) else None
        x_on = x_fq is not None and x_fq.config.state in QUANTIZING_STATES
        if not x_on and not w.quantizing:
            return None
        if x_on != w.quantizing:
            which = "input" if x_on else "weight"
            raise self.fail(node, f"only its {which} is quantized; an ncnn int8 layer quantizes input and weight "
                            "together", "quantize both (activation and parameter quantization on) or dispatch "
                            "this layer to fp32 with setting.dispatching_table")
        assert x_fq is not None and w.fq is not None
        self._check_activation(node, x_fq)
        wscale = self._weight_scales(node, w, groups)
        self.used_quantizers.add((x_arg, node))
        self.used_quantizers.add((w.qnode, node))
        s_in = float(x_fq.scale.detach().reshape(-1)[0])
        return Int8Scales(weight=(1.0 / wscale).astype(np.float32), bottom=float(np.float32(1.0 / s_in)))

    def _check_activation(self, node: fx.Node, fq: FakeQuantize) -> None:
        # the scheme passed ncnn_int8's capability before the build (fxq.backends.capability); its state must too
        why = None
        if fq.scale.numel() != 1:
            why = "is per-channel"
        elif bool((fq.offset.detach() != 0).any()):
            why = "is asymmetric"
        if why:
            raise self.fail(node, f"its input quantizer {fq.name!r} {why}; ncnn quantizes layer inputs per tensor, "
                            "symmetrically, to [-127, 127]", "quantize for the 'ncnn_int8' platform")
        self._check_rounding(fq)

    def _check_rounding(self, fq: FakeQuantize) -> None:
        if fq.config.rounding not in _NCNN_ROUNDING:
            self.warn_once(fq.name, "quantizer %s rounds %s; ncnn rounds half away from zero, so ties may differ "
                           "by one step", fq.name, fq.config.rounding.name)

    def _weight_scales(self, node: fx.Node, w: WeightInfo, groups: int) -> np.ndarray:
        fq = w.fq
        assert fq is not None
        rank = w.fp32.dim()
        out_ch = int(w.fp32.shape[w.out_axis])
        # the scheme passed ncnn_int8's capability before the build (fxq.backends.capability); its state must too
        if bool((fq.offset.detach() != 0).any()):
            raise self.fail(node, f"its weight quantizer {fq.name!r} is asymmetric",
                            "quantize for the 'ncnn_int8' platform (symmetric per-output-channel weights)")
        if fq.scale.numel() > 1 and fq.config.channel_axis % rank != w.out_axis % rank:
            raise self.fail(node, f"its weight quantizer {fq.name!r} has scales along axis "
                            f"{fq.config.channel_axis} of a weight of shape {tuple(w.fp32.shape)}, whose output "
                            f"channels are axis {w.out_axis}; ncnn scales weights per output channel",
                            "quantize for the 'ncnn_int8' platform (per-output-channel weights)")
        self._check_rounding(fq)
        scale = fq.scale.detach().double().cpu().reshape(-1).numpy()
        scale = np.full(out_ch, scale[0]) if scale.size == 1 else scale
        if groups > 1:
            per_group = scale.reshape(groups, -1)
            if not np.all(per_group == per_group[:, :1]):
                raise self.fail(node, f"it is a grouped convolution ({groups} groups of {out_ch // groups} output "
                                "channels) with different weight scales inside a group; ncnn's "
                                "ConvolutionDepthWise takes one weight scale per group",
                                "quantize this conv's weights per tensor (per_channel=False) or dispatch it to fp32")
            scale = per_group[:, 0]
        return scale

    # ------------------------------------------------------------------ whole graph
    def check_quantizers(self) -> None:
        """Every quantizing FakeQuantize must be the input or weight of an exported int8 layer (the op types that
        may read one are the capability's, checked before the build; this catches a converter that wrote none)."""
        for q in self.gm.graph.nodes:
            if not self.is_quantizer(q) or self.quantizer(q).config.state not in QUANTIZING_STATES:
                continue
            fq = self.quantizer(q)
            for user in q.users:
                if (q, user) in self.used_quantizers or user in self.static_nodes:
                    continue
                src = self.strip(q)
                raise ExportError(
                    f"ncnn export: quantizer {fq.name!r} on the value of node {src.name!r} feeds node "
                    f"{user.name!r} (op {self.op(user)}), which ncnn runs in FP32: ncnn int8 quantizes only the "
                    "inputs and weights of Convolution/ConvolutionDepthWise/InnerProduct. Fix: quantize for the "
                    "'ncnn_int8' platform, or dispatch the consumer to fp32")

    def build(self) -> NcnnModel:
        self._find_static()
        graph = self.gm.graph
        for node in graph.nodes:
            if node.op == "placeholder":
                self._input(node)
            elif node in self.blob_of or not self._computes_value(node):
                continue  # an output of a multi-output layer (set by its converter), or no value of the network
            else:
                t = self.op(node)
                if t not in NCNN_CONVERTERS:
                    raise self._no_converter(node)
                if not isinstance(node.meta.get("val"), torch.Tensor) and not converts_tuples(t):
                    continue  # a split: its readers take the pieces
                if not takes_any_batch_dim(t):
                    self.check_batch_first(node)
                if not takes_high_rank(t):
                    self._check_rank(node)
                try:
                    NCNN_CONVERTERS.get(t)(self, node)
                except ExportError:
                    raise
                except (AttributeError, ValueError, TypeError, KeyError, IndexError) as exc:
                    raise self.fail(node, f"the ncnn converter of op {t!r} cannot read this node's arguments "
                                    f"({type(exc).__name__}: {exc})",
                                    "rewrite the op in a standard torch form, or register your own converter with "
                                    "register_ncnn_converter(..., override=True)") from exc
        self.check_quantizers()
        self._outputs()
        _drop_unread_layers(self.model)
        _insert_splits(self.model)
        self.model.validate()
        return self.model

    def _computes_value(self, node: fx.Node) -> bool:
        """Whether ``node`` computes a value of the network (a tensor, or tensors: a split, a top-k): not an input,
        output, stored tensor, quantizer or shape / index arithmetic (its consumers read their static output
        shapes)."""
        if node.op in ("placeholder", "get_attr", "output") or self.is_quantizer(node) or node in self.static_nodes:
            return False
        val = node.meta.get("val")
        return (isinstance(val, torch.Tensor) or converts_tuples(self.op(node))
                or (isinstance(val, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in val)))

    def _no_converter(self, node: fx.Node) -> ExportError:
        """The refusal of ``node``, whose op type has no converter: for an ONNX-loaded model, with the cut that loads
        the file without every such op (:meth:`onnx_cut`, also the error's ``suggested_outputs``)."""
        t = self.op(node)
        fix = "register one with fxq.backends.ncnn.register_ncnn_converter, or rewrite this op with supported ones"
        missing = [n for n in self.gm.graph.nodes if self._computes_value(n) and self.op(n) not in NCNN_CONVERTERS]
        cut = self.onnx_cut(missing)
        if cut:
            from fxq.frontends.onnx.cut import cut_advice  # noqa: PLC0415  (only ONNX-loaded models have a cut)

            ops = sorted({self.op(n) for n in missing})
            fix += (f"; or, since ncnn has no layer for it ({len(missing)} node(s) of op types {', '.join(ops)}), "
                    + cut_advice(self.gm.meta["onnx"]["source"], cut, "beside the ncnn model"))
        exc = self.fail(node, f"the ncnn writer has no converter for op type {t!r} "
                        f"(it converts {', '.join(NCNN_CONVERTERS.names())})", fix)
        exc.suggested_outputs = tuple(cut)
        return exc

    def onnx_cut(self, missing: list[fx.Node]) -> list[str]:
        """Tensor names of the source ONNX file that load it up to just before the ``missing`` nodes: the graph's
        outputs that do not depend on them, then every computed value the part left out (the missing nodes and what
        depends on them, :func:`~fxq.frontends.onnx.cut.cut_frontier`) reads, each traced back through ops of one
        computed input that only feed what is cut off (SSD's score columns, one ``Gather`` per class before a
        threshold, are their score tensor). Empty for a model not loaded from a file, or where a name is not a
        tensor of the file."""
        from fxq.frontends.onnx.cut import cut_frontier  # noqa: PLC0415  (only ONNX-loaded models have a cut)

        meta = self.gm.meta.get("onnx")
        if not missing or not isinstance(meta, dict) or not meta.get("source"):
            return []
        nodes = list(self.gm.graph.nodes)
        gone, read = cut_frontier(nodes, lambda n: [self.strip(a) for a in n.all_input_nodes], missing)

        def computed(n: fx.Node) -> list[fx.Node]:
            return [a for a in map(self.strip, n.all_input_nodes)
                    if a.op not in ("get_attr", "placeholder") and a not in self.static_nodes]

        def feeds_only_gone(n: fx.Node) -> bool:
            return all(u in gone or (self.is_quantizer(u) and feeds_only_gone(u)) for u in n.users)

        out = next(n for n in nodes if n.op == "output")
        kept: list[fx.Node] = []
        fx.node.map_arg(out.args, lambda v: kept.append(self.strip(v)) if v not in gone else None)
        for a in read:
            if a.op in ("get_attr", "placeholder") or a in self.static_nodes:
                continue
            while a not in kept and len(computed(a)) == 1 and feeds_only_gone(a):
                a = computed(a)[0]
            kept.append(a)
        names = []
        for v in kept:
            outputs = v.meta["onnx"].get("outputs") if isinstance(v.meta.get("onnx"), dict) else None
            if not outputs or len(outputs) != 1:
                return []
            if outputs[0] not in names:
                names.append(outputs[0])
        return names if names != list(meta.get("outputs", [])) else []

    def check_batch_first(self, node: fx.Node) -> None:
        """Refuse ``node`` unless each of its inputs is batch-first (what a converter not registered with
        ``any_batch_dim`` takes)."""
        for arg in node.all_input_nodes:
            if self.strip(arg) in self.blob_of and self.batch_dim(arg) != 0:
                bd = self.batch_dim(arg)
                where = (f"has its batch dimension at dim {bd} (moved by a transpose / reshape)" if bd is not None
                         else "has no batch dimension (an unbatched input, or a batch folded into another dim)")
                raise self.fail(node, f"its input {self.strip(arg).name!r} of shape {self.shape(arg)} {where}; the "
                                "ncnn converter of this op needs a batch-first value",
                                "give the value a leading batch dimension (x[None], or transpose / reshape it back "
                                "to batch-first) before this op")

    def _check_rank(self, node: fx.Node) -> None:
        for arg in node.all_input_nodes:
            if self.high_rank(arg):
                raise self.fail(node, f"its input {self.strip(arg).name!r} of shape {self.shape(arg)} has "
                                f"{len(self.blob_shape(arg))} dims besides the batch; ncnn blobs have at most 4, and "
                                "only reshapes and permutes of such values are exported",
                                "reshape the value to at most 4 dims besides the batch before this op, or deploy "
                                "the model with another platform (trt_int8 / ort_int8: ONNX tensors take any rank)")

    def batch_advice(self, value: fx.Node) -> str:
        """The fix for an op that works along ``value``'s batch dim: for a model input whose batch is elsewhere
        (the file does not name it), the ``load_onnx`` argument that says where; else to work along other dims."""
        src = self.strip(value)
        if src.op == "placeholder" and isinstance(getattr(self.gm, "meta", {}).get("onnx"), dict):
            name = onnx_input_name(src)
            return (f"if dim {self.batch_dim(src)} of input {name!r} is not its batch, load the model with "
                    f"fxq.load_onnx(..., batch_dims={{{name!r}: <its batch dim>}}) (CLI: --batch-dim {name}=DIM), "
                    "with the outputs that carry it back too; ncnn blobs have no batch dimension")
        return "slice the other dims; ncnn blobs have no batch dimension"

    def _placeholder_batch_dim(self, node: fx.Node) -> int | None:
        """The dim of input ``node`` that its blob leaves out: None for unbatched inputs, else where the source
        ONNX file puts the batch symbol (:func:`~fxq.graph.data.source_batch_dim`), else 0."""
        return None if self.unbatched_inputs else input_batch_dim(self.gm, node)

    def _input(self, node: fx.Node) -> None:
        if not node.users:
            return
        self._batch_dims[node] = self._placeholder_batch_dim(node)
        shape = self.blob_shape(node)
        if not 1 <= len(shape) <= 4:
            batched = self._batch_dims[node] is not None
            batch = " without the batch dimension" if batched else ""
            fix = "reshape the input"
            if batched and not len(shape) and "onnx" in self.gm.meta:
                name = onnx_input_name(node)
                fix = (f"if dim 0 of input {name!r} is not a batch (a time step, a shape, a 1-D control value), "
                       f"load the file with fxq.load_onnx(..., batch_dims={{{name!r}: None}}) (CLI: --batch-dim "
                       f"{name}=none), so that ncnn takes it whole; else reshape the input")
            raise self.fail(node, f"input of shape {self.shape(node)} has rank {len(shape)}{batch}; ncnn blobs "
                            "have rank 1 to 4", fix)
        params = shape_params(shape)
        name = f"in{len(self.model.inputs)}"
        self._layer_names.add(name)
        self._blob_names.add(name)
        self.model.layers.append(NcnnLayer("Input", name, [], [name], params, source=node.name))
        self.model.inputs.append(name)
        self.blob_of[node] = name

    def _outputs(self) -> None:
        """Graph outputs are blobs of their shape without the batch dim (0, or where the source ONNX file declares
        the batch symbol for that output): a value whose batch of 1 moved is reshaped to that. A model with
        unbatched inputs may return unbatched values (no batch dim): their blob is their whole shape."""
        out = next(n for n in self.gm.graph.nodes if n.op == "output")
        values: list[fx.Node] = []
        fx.node.map_arg(out.args, lambda n: values.append(n) or n)
        for i, v in enumerate(values):
            src = self.strip(v)
            if src not in self.blob_of and self.is_constant(src) and 2 <= len(self.shape(src)) <= 5 \
                    and self.shape(src)[0] == 1:  # a constant output with a batch of 1 (an SSD's prior boxes)
                self.model.outputs.append(self.constant(src, src, like=src))
                continue
            if src not in self.blob_of or self.blob_of[src] in self.model.inputs:
                raise ExportError(f"ncnn export: graph output {i} ({src.name!r}) is not computed by an exported "
                                  "layer. Fix: return tensors computed by the network")
            if self.high_rank(src):
                raise self.fail(src, f"it is graph output {i}, of shape {self.shape(src)}, with more than 4 dims "
                                "besides the batch; ncnn blobs have at most 4", "return a tensor of at most 4 dims "
                                "besides the batch (reshape it in the model; the caller can reshape it back)")
            if source_unbatched(self.gm, output=i):  # load_onnx(batch_dims={name: None}): the whole value
                if self.batch_dim(src) is not None:
                    if not 1 <= len(self.shape(src)) <= 4:
                        raise self.fail(src, f"it is graph output {i}, of shape {self.shape(src)}, declared without a "
                                        "batch dim; ncnn blobs have rank 1 to 4", "return a tensor of rank 1 to 4")
                    self.emit(src, "Reshape", [self.blob_of[src]], shape_params(self.shape(src)), batch_dim=None)
                self.model.outputs.append(self.blob_of[src])
                continue
            declared = source_batch_dim(self.gm, output=i)  # the source file's batch dim of this output
            batch = 0 if declared is None else declared
            if self.batch_dim(src) != batch and not (self.unbatched_inputs and self.batch_dim(src) is None):
                shape = self.shape(src)
                if self._batch_misplaced(i, src):
                    raise self.fail(src, f"it is graph output {i}, of shape {shape}, whose dim {batch} is not the "
                                    f"batch dimension; ncnn outputs drop dim {batch}",
                                    self._output_batch_advice(values, declared))
                self.emit(src, "Reshape", [self.blob_of[src]], shape_params(drop_dim(shape, batch)), batch_dim=batch)
            self.model.outputs.append(self.blob_of[src])

    def _batch_misplaced(self, i: int, src: fx.Node) -> bool:
        """Whether graph output ``i`` (computed by ``src``) is refused for where its batch is (see :meth:`_outputs`):
        not at the dim ncnn drops, and that dim not a lone 1 that a Reshape could drop."""
        if source_unbatched(self.gm, output=i):
            return False
        declared = source_batch_dim(self.gm, output=i)
        batch = 0 if declared is None else declared
        if self.batch_dim(src) == batch or (self.unbatched_inputs and self.batch_dim(src) is None):
            return False
        shape = self.shape(src)
        return shape[batch] != 1 or not 1 <= len(shape) - 1 <= 4

    def _output_batch_advice(self, values: list[fx.Node], declared: int | None) -> str:
        """The fix for graph outputs whose batch is not where ncnn drops a dim: for an ONNX file's outputs whose
        declared dims do not say where (unnamed dims), the ``load_onnx`` argument that does, naming every such
        output at once (a cut through a transformer's split heads has many)."""
        if declared is not None:
            return "return the batch at the dim the source file declares for this output"
        fixes: dict[str, int | None] = {}
        for j, v in enumerate(values):
            src = self.strip(v)
            name = onnx_output_name(self.gm, j)
            if name is not None and src in self.blob_of and source_batch_dim(self.gm, output=j) is None \
                    and not self.high_rank(src) and self._batch_misplaced(j, src):
                fixes[name] = self.batch_dim(src)
        if not fixes:
            return "return a batch-first tensor"
        python = ", ".join(f"{n!r}: {d}" for n, d in fixes.items())
        cli = " ".join(f"--batch-dim {n}={'none' if d is None else d}" for n, d in fixes.items())
        said = "; ".join(f"{n!r} {'has no batch dim' if d is None else f'carries the batch at dim {d}'}"
                         for n, d in fixes.items())
        return (f"load the model with fxq.load_onnx(..., batch_dims={{{python}}}) (CLI: {cli}): ONNX output(s) "
                f"{said}, and the file's declared dims do not say so")


def fold_dims(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A blob shape of more than 4 dims with its outermost dims merged into one: 4 dims, the same elements in the
    same order (``shape`` itself when it has at most 4)."""
    if len(shape) <= 4:
        return shape
    return (math.prod(shape[:-3]), *shape[-3:])


def _target(node: fx.Node) -> str:
    t = node.target
    return getattr(t, "__name__", None) or str(t)


def _drop_unread_layers(model: NcnnModel) -> None:
    """Remove the layers nothing reads (no layer, no graph output), back to front: the pieces of a split that the
    graph reads only for their shapes (a constant of the file), what only they read."""
    outputs = set(model.outputs)
    while True:
        read = outputs | {b for layer in model.layers for b in layer.bottoms}
        unread = [layer for layer in model.layers if layer.type != "Input" and not any(t in read for t in layer.tops)]
        if not unread:
            return
        gone = {id(layer) for layer in unread}
        model.layers[:] = [layer for layer in model.layers if id(layer) not in gone]


def _insert_splits(model: NcnnModel) -> None:
    """Give every blob one reader: add ncnn ``Split`` layers and name the graph outputs ``out0, out1...``."""
    readers: dict[str, list[tuple[NcnnLayer | None, int]]] = {}
    for layer in model.layers:
        for i, b in enumerate(layer.bottoms):
            readers.setdefault(b, []).append((layer, i))
    for k, b in enumerate(model.outputs):
        readers.setdefault(b, []).append((None, k))
    out_names = [f"out{k}" for k in range(len(model.outputs))]
    new_layers: list[NcnnLayer] = []
    n_split = 0
    layer_names = {layer.name for layer in model.layers}
    for layer in model.layers:
        new_layers.append(layer)
        for t_idx, top in enumerate(list(layer.tops)):
            users = readers.get(top, [])
            if len(users) == 1 and users[0][0] is None:  # only a graph output: rename the blob itself
                layer.tops[t_idx] = out_names[users[0][1]]
                continue
            if len(users) <= 1:
                continue
            name = f"splitncnn_{n_split}"
            while name in layer_names:
                n_split += 1
                name = f"splitncnn_{n_split}"
            n_split += 1
            tops = []
            for j, (reader, slot) in enumerate(users):
                if reader is None:
                    tops.append(out_names[slot])
                else:
                    tops.append(f"{top}_splitncnn_{j}")
                    reader.bottoms[slot] = tops[-1]
            new_layers.append(NcnnLayer("Split", name, [top], tops, source=layer.source))
    model.layers[:] = new_layers
    model.outputs[:] = out_names


def build_ncnn_model(gm: fx.GraphModule, example_inputs: Any = None) -> tuple[NcnnModel, NcnnBuilder]:
    """Convert a prepared (and calibrated) GraphModule, at batch 1, its FP32 islands as float layers
    (:mod:`fxq.backends.ncnn.islands`), ONNX's spelled-out GELU / LayerNorm as one layer each and its Expand
    before broadcasting arithmetic left to the arithmetic; raises
    :class:`ExportError` naming the node. ``example_inputs``: what the islands are traced on."""
    view, unbatched = _at_batch_one(gm)
    _check_calibrated(view)  # before the islands' inputs are recorded: a pending quantizer observes
    view = inline_islands(view, example_inputs)
    modules = dict(view.named_modules())
    if any(op_type(n, modules) in FUSED_OPS for n in view.graph.nodes):  # ONNX's spelled-out ops: in a copy
        view = _graph_copy(gm) if view is gm else view
        fuse_erf_gelu(view)
        fuse_layer_norm(view)
        drop_broadcast_expands(view)
    builder = NcnnBuilder(view, unbatched_inputs=unbatched)
    return builder.build(), builder


def _check_calibrated(gm: fx.GraphModule) -> None:
    qg = QuantGraph(gm)
    pending = [name for name, fq in qg.quantizers() if fq.config.state in _PENDING]
    if pending:
        shown = ", ".join(pending[:6]) + (" ..." if len(pending) > 6 else "")
        raise ExportError(f"ncnn export: {len(pending)} quantizer(s) are not calibrated ({shown}). "
                          "Fix: run fxq.calibrate(model, data) / fxq.quantize(...) before exporting")


def _graph_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A new graph of ``gm``'s nodes (their meta copied shallowly) over the same modules and weights: the
    exporter's own view, which it may rewrite; ``gm`` itself is not touched."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    view = fx.GraphModule(gm, graph, class_name=type(gm).__name__)
    for name, child in gm.named_children():  # the quantizer holder and modules as they are, not rebuilt paths
        setattr(view, name, child)
    view.meta = gm.meta
    return view


def _brief(value: Any) -> Any:
    """``value`` for a log line: a tensor of more than 8 elements by its shape (a grid of anchors printed whole
    made 30 KB warnings)."""
    if isinstance(value, torch.Tensor):
        return value.tolist() if value.numel() <= 8 else f"<tensor of shape {tuple(value.shape)}>"
    return value


def _at_batch_one(gm: fx.GraphModule) -> tuple[fx.GraphModule, bool]:
    """``gm``'s graph over the same modules and weights with its value shapes taken at batch 1 (``gm`` itself is
    not touched), and whether the inputs' dim 0 is no batch (then ``gm`` as it is: each input is one sample).

    ncnn runs one sample, and a graph that folds the batch into other dims (attention's ``(T, B * H, Dh)``) is
    expressible at batch 1 only. ``gm`` as it is when its inputs have batch 1 already, or when the graph does
    not run at batch 1 (a batch size written into it): then a converter names the node that moves the batch.
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    vals = [n.meta.get("val") for n in placeholders]
    if not vals or not all(isinstance(v, torch.Tensor) for v in vals):
        return gm, False
    dims = [input_batch_dim(gm, n) for n in placeholders]
    batched = [(v, d) for v, d in zip(vals, dims) if d is not None]  # load_onnx(batch_dims={name: None}): whole
    if not batched or not all(v.dim() > d and v.shape[d] > 1 for v, d in batched):
        return gm, False
    view = _graph_copy(gm)  # node meta copied shallowly: the new nodes get new values
    try:
        propagate_tensor_meta(view, [torch.zeros(v.shape if d is None else (*v.shape[:d], 1, *v.shape[d + 1:]),
                                                 dtype=v.dtype, device=v.device) for v, d in zip(vals, dims)])
    except Exception as exc:  # noqa: BLE001  (any failure: the model's own shapes)
        logger.debug("ncnn export: the graph does not run at batch 1 (%s); using its calibration shapes", exc)
        return gm, False
    evidence = _unbatched_evidence(gm, view)
    if evidence is None:
        return view, False
    inputs = ", ".join(f"{n.name!r} {list(n.meta['val'].shape)}" for n in gm.graph.nodes if n.op == "placeholder")
    logger.info("ncnn export: the inputs %s are unbatched (at size 1 along dim 0, node %s gets its calibration size "
                "back from %s): each ncnn input is the whole tensor, a Mat of its shape", inputs, *evidence)
    return gm, True


def _unbatched_evidence(gm: fx.GraphModule, view: fx.GraphModule) -> tuple[str, str] | None:
    """(node, operand) where a node of ``view`` (``gm`` at size 1 along the inputs' dim 0) gets back ``gm``'s
    size along dim 0 from an operand of size 1 there: a constant broadcast over dim 0 (``x - mean[:, None, None]`` of
    a ``[3, H, W]`` image), so the inputs' dim 0 is not a batch (torchvision's detectors take unbatched images);
    None when no node does."""
    batch = int(next(n for n in gm.graph.nodes if n.op == "placeholder").meta["val"].shape[0])
    for old, new in zip(gm.graph.nodes, view.graph.nodes):
        was, now = old.meta.get("val"), new.meta.get("val")
        if (new.op == "placeholder" or not isinstance(was, torch.Tensor) or not isinstance(now, torch.Tensor)
                or not now.is_floating_point() or now.dim() == 0 or was.shape != now.shape or now.shape[0] != batch):
            continue  # integer values are shape arithmetic (a Shape's length is the rank, at any batch)
        ones = [a for a in new.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)
                and a.meta["val"].is_floating_point() and a.meta["val"].dim() and a.meta["val"].shape[0] == 1
                and a.op != "get_attr"]
        if ones:
            return new.name, ones[0].name
    return None
