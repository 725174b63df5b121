"""Builds one ``torch.fx.Graph`` layer by layer: caffe blob names -> fx nodes, with shapes known as we go.

Every node is run on ``meta`` tensors (shapes only, no compute) as soon as it is created, so converters can ask for
the shape of any bottom (e.g. a prototxt-only ``Convolution`` learns its input channels) and a layer that cannot
run fails at load time with its name in the message.
"""
from __future__ import annotations

import keyword
import math
import re
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.fx
from torch import nn

from fxq.errors import FrontendError
from fxq.frontends.caffe.reader import CaffeWeights

__all__ = ["GraphBuilder", "LayerContext", "sanitize_name", "MAX_ELEMENTS"]

# The most elements an input blob or a learned weight may have (2**28: 1 GiB of float32), checked before anything is
# allocated, so that a prototxt declaring a 100000 x 100000 input fails at once; load_caffe(max_elements=) raises it.
MAX_ELEMENTS = 2**28

_RESERVED = set(dir(torch.fx.GraphModule))


def sanitize_name(name: str) -> str:
    """A Python identifier close to a caffe name: ``conv1/3x3_s2`` -> ``conv1_3x3_s2``, ``1x1`` -> ``_1x1``."""
    out = re.sub(r"[^0-9a-zA-Z_]", "_", name) or "_"
    if out[0].isdigit():
        out = "_" + out
    if keyword.iskeyword(out):
        out += "_"
    return out


def _strip_leading_ones(shape: Sequence[int]) -> tuple[int, ...]:
    shape = tuple(int(d) for d in shape)
    i = 0
    while i < len(shape) and shape[i] == 1:
        i += 1
    return shape[i:]


class GraphBuilder:
    """Holds the graph under construction, its submodules, the blob -> node map and each node's meta-tensor value."""

    def __init__(self, prototxt_label: str, weights: CaffeWeights | None,
                 input_shapes: dict[str, tuple[int, ...]] | None = None, max_elements: int = MAX_ELEMENTS) -> None:
        self.prototxt_label = prototxt_label
        self.max_elements = max_elements
        self.weights = weights
        self.graph = torch.fx.Graph()
        self.root = nn.Module()
        self.blobs: dict[str, torch.fx.Node] = {}
        self.values: dict[torch.fx.Node, Any] = {}
        self.inputs: list[str] = []
        self.input_shapes: dict[str, list[int]] = {}
        self.aliases: dict[str, str] = {}
        self._shape_overrides = dict(input_shapes or {})
        self._available: dict[str, None] = {}  # caffe's "available blobs": produced and not consumed since
        self._module_names: set[str] = set()
        self.sized_by_input: list[str] = []  # layers whose constants hold for the loaded input sizes (PriorBox)

    # ---- inputs, layers, outputs

    def add_input(self, blob: str, shape: Sequence[int] | None, layer: Any | None = None) -> torch.fx.Node:
        """Add a graph input for ``blob``; ``shape`` from the prototxt unless ``input_shapes`` overrides it."""
        where = f"{self.prototxt_label}: input {blob!r}"
        if blob in self.blobs:
            raise FrontendError(f"{where} is defined twice")
        if blob in self._shape_overrides:
            shape = self._shape_overrides[blob]
        if not shape:
            raise FrontendError(
                f"{where} has no shape in the prototxt; pass input_shapes={{{blob!r}: (N, C, H, W)}} to load_caffe"
            )
        shape = [int(d) for d in shape]
        if any(d <= 0 for d in shape):
            raise FrontendError(f"{where} has a non-positive dimension in its shape {shape}; give positive dims in "
                                f"the prototxt or in input_shapes")
        if math.prod(shape) > self.max_elements:
            raise FrontendError(f"{where} has shape {shape}, {math.prod(shape)} elements, over the limit of "
                                f"{self.max_elements} per input (max_elements); check the prototxt's input dims")
        placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
        if placeholders:
            ctx = self.graph.inserting_after(placeholders[-1])
        elif len(self.graph.nodes):
            ctx = self.graph.inserting_before(next(iter(self.graph.nodes)))
        else:
            ctx = self.graph.inserting_after()
        with ctx:
            node = self.graph.placeholder(sanitize_name(blob))
        node.meta["caffe"] = {
            "layer": layer.name if layer is not None else None,
            "type": "Input",
            "bottom": [],
            "top": [blob],
            "produces": [blob],
        }
        self.values[node] = torch.empty(shape, device="meta")
        self.blobs[blob] = node
        self.inputs.append(blob)
        self.input_shapes[blob] = shape
        self._mark_available([], [blob])
        return node

    def convert(self, layer: Any, fn: Callable[[LayerContext], None]) -> None:
        """Run one layer's converter and record which blobs it consumed and produced."""
        ctx = LayerContext(self, layer)
        fn(ctx)
        missing = [t for i, t in enumerate(layer.top) if i not in ctx.tops_set]
        if missing:
            raise ctx.error(f"the converter did not produce top(s) {missing}")
        self._mark_available(list(layer.bottom), list(layer.top))

    def _mark_available(self, bottoms: list[str], tops: list[str]) -> None:
        for blob in bottoms:
            self._available.pop(blob, None)
        for blob in tops:
            self._available.pop(blob, None)
            self._available[blob] = None

    def unused_shape_overrides(self) -> list[str]:
        return sorted(set(self._shape_overrides) - set(self.inputs))

    def finish(self, net_name: str, source: dict[str, str | None],
               outputs: Sequence[str] | None = None) -> torch.fx.GraphModule:
        """Close the graph with ``outputs`` (default: caffe's net outputs, blobs no later layer consumed) and wrap
        it in a GraphModule."""
        outputs = list(self._available) if outputs is None else list(outputs)
        if not outputs:
            raise FrontendError(f"{self.prototxt_label}: the net has no output blob")
        nodes = [self.blobs[b] for b in outputs]
        out = self.graph.output(nodes[0] if len(nodes) == 1 else tuple(nodes))
        out.meta["caffe"] = {"layer": None, "type": "Output", "bottom": outputs, "top": [], "produces": []}
        self.graph.lint()
        gm = torch.fx.GraphModule(self.root, self.graph, class_name="CaffeNet")
        gm.meta["caffe"] = {
            "name": net_name,
            "inputs": list(self.inputs),
            "outputs": outputs,
            "input_shapes": {k: list(v) for k, v in self.input_shapes.items()},
            "aliases": dict(self.aliases),
            "source": dict(source),
            "sized_by_input": list(self.sized_by_input),
        }
        gm.eval()
        return gm

    # ---- node creation

    def module_name(self, base: str) -> str:
        name = sanitize_name(base)
        candidate, i = name, 0
        while candidate in self._module_names or candidate in _RESERVED:
            i += 1
            candidate = f"{name}_{i}"
        self._module_names.add(candidate)
        return candidate

    def evaluate(self, node: torch.fx.Node) -> Any:
        args = torch.fx.node.map_arg(node.args, self.values.__getitem__)
        kwargs = torch.fx.node.map_arg(node.kwargs, self.values.__getitem__)
        with torch.no_grad():
            if node.op == "call_module":
                module = self.root.get_submodule(node.target)
                with _weights_on_meta(module):
                    return module(*args, **kwargs)
            if node.op == "call_method":
                return getattr(args[0], node.target)(*args[1:], **kwargs)
            if node.op == "get_attr":
                return getattr(self.root, node.target).to("meta")
            return node.target(*args, **kwargs)


@contextmanager
def _weights_on_meta(module: nn.Module) -> Iterator[None]:
    """Temporarily swap ``module``'s parameters and buffers for ``meta`` twins, so it runs on meta inputs."""
    saved = []
    for sub in module.modules():
        for store in (sub._parameters, sub._buffers):
            for key, tensor in store.items():
                if tensor is not None:
                    saved.append((store, key, tensor))
                    meta = tensor.to("meta")
                    store[key] = nn.Parameter(meta, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta
    try:
        yield
    finally:
        for store, key, tensor in saved:
            store[key] = tensor


class LayerContext:
    """What a converter sees of one caffe layer: its parameters, bottoms (as nodes), tops to set, and blobs."""

    def __init__(self, builder: GraphBuilder, layer: Any) -> None:
        self.builder = builder
        self.layer = layer
        self.name: str = layer.name
        self.type: str = layer.type
        self.tops_set: set[int] = set()
        self._bottoms: list[torch.fx.Node] = []
        for blob in layer.bottom:
            if blob not in builder.blobs:
                raise self.error(f"bottom blob {blob!r} is not produced by any earlier layer or input")
            self._bottoms.append(builder.blobs[blob])

    # ---- errors and checks

    def error(self, message: str) -> FrontendError:
        return FrontendError(f"{self.builder.prototxt_label}: layer {self.name!r} ({self.type}): {message}")

    def expect(self, bottoms: int | tuple[int, int | None] = 1, tops: int | tuple[int, int | None] = 1) -> None:
        """Check the number of bottoms/tops: an exact count or a ``(min, max)`` range, ``max=None`` unbounded."""
        for what, count, want in (("bottom", len(self._bottoms), bottoms), ("top", len(self.layer.top), tops)):
            low, high = (want, want) if isinstance(want, int) else want
            if count < low or (high is not None and count > high):
                expected = str(low) if low == high else f"{low}..{'' if high is None else high}"
                raise self.error(f"expects {expected} {what}(s), got {count}")

    def check_size(self, what: str, shape: Sequence[int]) -> None:
        """:class:`FrontendError` before allocating a tensor of ``shape`` above the builder's element limit."""
        n = math.prod(int(d) for d in shape)
        if n > self.builder.max_elements:
            raise self.error(f"its {what} would have shape {tuple(shape)}, {n} elements, over the limit of "
                             f"{self.builder.max_elements} (max_elements); check the layer's parameters")

    def canonical_axis(self, axis: int, rank: int) -> int:
        if not -rank <= axis < rank:
            raise self.error(f"axis {axis} is out of range for a {rank}-D bottom")
        return axis % rank

    # ---- bottoms, shapes

    @property
    def bottoms(self) -> list[torch.fx.Node]:
        return list(self._bottoms)

    def bottom(self, index: int = 0) -> torch.fx.Node:
        return self._bottoms[index]

    def shape(self, node: torch.fx.Node) -> tuple[int, ...]:
        return tuple(self.builder.values[node].shape)

    # ---- nodes

    def _meta(self) -> dict[str, Any]:
        return {"layer": self.name, "type": self.type, "bottom": list(self.layer.bottom),
                "top": list(self.layer.top), "produces": []}

    def _finish_node(self, node: torch.fx.Node) -> torch.fx.Node:
        node.meta["caffe"] = self._meta()
        try:
            self.builder.values[node] = self.builder.evaluate(node)
        except Exception as exc:  # noqa: BLE001 - any failure here is a model the frontend cannot run
            shapes = [list(self.shape(b)) for b in self._bottoms]
            raise self.error(f"cannot run on bottom shape(s) {shapes}: {exc}") from exc
        return node

    def node_name(self, suffix: str | None = None) -> str:
        return sanitize_name(self.name if suffix is None else f"{self.name}_{suffix}")

    def call_module(self, module: nn.Module, *args: Any, suffix: str | None = None,
                    op_type: str | None = None) -> torch.fx.Node:
        """Add ``module`` as a submodule named after the layer and a ``call_module`` node using it.

        ``op_type`` (an ONNX-style name such as ``"MaxPool"``) goes to ``node.meta["caffe"]["op_type"]``, for
        modules whose class does not tell fxq what they compute.
        """
        target = self.builder.module_name(self.name if suffix is None else f"{self.name}_{suffix}")
        module.eval()
        self.builder.root.add_module(target, module)
        node = self.builder.graph.create_node("call_module", target, args, {}, name=target)
        node = self._finish_node(node)
        if op_type is not None:
            node.meta["caffe"]["op_type"] = op_type
        return node

    def constant(self, value: torch.Tensor, suffix: str | None = None) -> torch.fx.Node:
        """A tensor fixed at load time (a PriorBox's boxes for the net's input size): a buffer of the module and a
        ``get_attr`` node reading it, which the exporters write as a constant."""
        target = self.builder.module_name(self.name if suffix is None else f"{self.name}_{suffix}")
        self.builder.root.register_buffer(target, value.detach().clone())
        node = self.builder.graph.create_node("get_attr", target, (), {}, name=target)
        return self._finish_node(node)

    def call_function(self, fn: Callable[..., Any], *args: Any, suffix: str | None = None,
                      **kwargs: Any) -> torch.fx.Node:
        node = self.builder.graph.create_node("call_function", fn, args, kwargs, name=self.node_name(suffix))
        return self._finish_node(node)

    def call_method(self, method: str, *args: Any, suffix: str | None = None, **kwargs: Any) -> torch.fx.Node:
        node = self.builder.graph.create_node("call_method", method, args, kwargs, name=self.node_name(suffix))
        return self._finish_node(node)

    def set_top(self, index: int, node: torch.fx.Node) -> None:
        """Make ``node`` the value of this layer's ``index``-th top blob (in-place layers rebind their bottom)."""
        blob = self.layer.top[index]
        self.builder.blobs[blob] = node
        node.meta["caffe"]["produces"].append(blob)
        self.tops_set.add(index)

    def alias_top(self, index: int, bottom_index: int = 0) -> None:
        """Make top ``index`` another name for a bottom's value, without a node (caffe ``Split``)."""
        source = self.layer.bottom[bottom_index]
        self.builder.blobs[self.layer.top[index]] = self._bottoms[bottom_index]
        self.builder.aliases[self.layer.top[index]] = self.builder.aliases.get(source, source)
        self.tops_set.add(index)

    def add_input(self, index: int, shape: Sequence[int] | None) -> None:
        """Declare top ``index`` of an ``Input`` layer as a graph input."""
        self.builder.add_input(self.layer.top[index], shape, self.layer)
        self.tops_set.add(index)

    # ---- weights

    @property
    def has_weights(self) -> bool:
        return self.builder.weights is not None

    def load_blobs(self, specs: Sequence[tuple[str, Sequence[int]]]) -> list[torch.Tensor] | None:
        """The layer's blobs from the caffemodel, checked against ``specs`` (``(what, shape)`` per blob, in order).

        Returns ``None`` when no caffemodel was given (the converter keeps its default initialisation).
        Blob shapes may differ from the expected ones only by leading 1s (caffe's legacy 4-D blobs).
        """
        weights = self.builder.weights
        if weights is None:
            return None
        wanted = ", ".join(f"{what} {tuple(shape)}" for what, shape in specs)
        blobs = weights.blobs(self.name)
        if not blobs:  # absent, or present without blobs
            raise FrontendError(
                f"{weights.label}: no weights for layer {self.name!r} ({self.type}) of {self.builder.prototxt_label};"
                f" it needs {len(specs)} blob(s): {wanted}"
            )
        if len(blobs) != len(specs):
            raise FrontendError(
                f"{weights.label}: layer {self.name!r} ({self.type}) has {len(blobs)} blob(s), expected "
                f"{len(specs)}: {wanted}"
            )
        out = []
        for i, (blob, (what, shape)) in enumerate(zip(blobs, specs)):
            try:
                array = weights.to_array(blob)
            except ValueError as exc:
                raise FrontendError(f"{weights.label}: layer {self.name!r} blob {i} ({what}): {exc}") from None
            shape = tuple(int(d) for d in shape)
            if _strip_leading_ones(array.shape) != _strip_leading_ones(shape) or array.size != math.prod(shape):
                raise FrontendError(
                    f"{weights.label}: layer {self.name!r} ({self.type}) blob {i} ({what}) has shape "
                    f"{tuple(array.shape)}, expected {shape}"
                )
            out.append(torch.from_numpy(array.reshape(shape).copy()))
        return out
