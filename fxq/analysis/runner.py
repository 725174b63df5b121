"""Run a quantized GraphModule node by node in an FP32, a quantized or a one-layer-quantized view.

The analysis tools compare the values of the same nodes in two executions. Instead of flipping the
model between FP32 and quantized state for every batch (which re-bakes every weight), the runner
reads the model as it is and decides per node what to compute:

* **quantized view**: every node as ``gm.forward`` would run it;
* **FP32 view**: quantizer nodes pass their input through and baked parameters are read from
  their FP32 copies — the same values :func:`fxq.fp32_mode` would produce, without touching the model;
* **layer view**: the FP32 view except one op, which reads its inputs through its own quantizers,
  and that op's own output quantizer.

Ops that would mutate a tensor in place (``nn.ReLU(inplace=True)``, ``x += y``...) run out of place,
so values handed to watchers or kept in a cache are never changed behind their back — except in
:meth:`GraphRunner.run_side_by_side`, whose watchers are done with a value when they return: there such
ops, quantizers (:meth:`fxq.nn.FakeQuantize.forward_`) and activations that take an ``inplace`` flag
(:func:`fxq.graph.op_types.in_place_form`) write into their input when nothing can see it any more (no
later reader, no alias among the live values, not a model input, parameter, buffer or constant).

With ``channels_last=True`` (the error analyses), 2-D convolutions on CPU read their input (and weight)
channels-last, and their outputs stay so through quantizers and layout-free ops (:data:`LAYOUT_FREE_OP_TYPES`)
that give 4-D values; any other reader gets them contiguous, as the model's forward has them. This holds for
CPU inputs none of which is channels-last already (else the model's convolutions are channels-last themselves)
and graphs that name no memory format. oneDNN's channels-last convolutions take 20-50 % less time than the NCHW
ones on x86 CPUs (NCHW inputs are reordered on every call); their sums run in another order, so values differ
from the model's forward by an ulp here and there (~1e-6 relative), which an error metric cannot see. Tools that
compare the simulation with a deployed file value for value keep the default (NCHW: bit for bit).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.nn.functional as F
from torch import fx, nn

from fxq.errors import ConfigError, FxqError
from fxq.graph.data import placeholder_values, rewrite_failure
from fxq.graph.info import NodeQuant, QuantizerInfo, graph_quant, is_quantizer_node
from fxq.graph.nodes import get_attr_value, thaw
from fxq.graph.op_types import (
    LAYOUT_FREE_OP_TYPES,
    in_place_form,
    mutates_first_argument,
    op_type,
    out_of_place_form,
)
from fxq.graph.quant_graph import QuantGraph
from fxq.nn.fake_quantize import FakeQuantize
from fxq.spec import QuantState

__all__ = ["GraphRunner", "LayerPlan", "analysis_mode", "tensors_of"]

Watch = Mapping[fx.Node, Callable[[torch.Tensor], None]]


def tensors_of(value: Any) -> list[torch.Tensor]:
    """The tensors inside a (nested) node value, in order."""
    out: list[torch.Tensor] = []
    fx.node.map_aggregate(value, lambda v: out.append(v) if isinstance(v, torch.Tensor) else None)
    return out


@dataclasses.dataclass
class LayerPlan:
    """What the layer view quantizes: ``node`` reads ``inputs`` (arg node -> quantizer node) quantized,
    and ``output_quantizer`` (the op's own output quantizer node, if any) runs."""

    node: fx.Node
    inputs: dict[fx.Node, fx.Node]
    output_quantizer: fx.Node | None


class GraphRunner:
    """Node-by-node executor of a quantized ``GraphModule`` (see the module docstring for the views).

    Args:
        gm: a model prepared (and normally calibrated / converted) by fxq.
        channels_last: run 2-D convolutions channels-last on CPU (see the module docstring): faster, values
            equal to the model's forward up to their last bits (the convolutions' summation order).

    Raises:
        GraphError: ``gm`` was not prepared by fxq.
    """

    def __init__(self, gm: fx.GraphModule, channels_last: bool = False) -> None:
        graph_quant(gm)
        self.gm = gm
        self.nodes: list[fx.Node] = list(gm.graph.nodes)
        self.index = {n: i for i, n in enumerate(self.nodes)}
        self.modules = dict(gm.named_modules())
        self.placeholders = [n for n in self.nodes if n.op == "placeholder"]
        self.output_node = next(n for n in reversed(self.nodes) if n.op == "output")
        self.qg = QuantGraph(gm)
        self.quantizers = {n: self.modules[str(n.target)] for n in self.nodes if is_quantizer_node(n)}
        self._infos = {n: self.qg.info(n) for n in self.quantizers}
        # values freed after each node (the node of their last use)
        last_use: dict[fx.Node, fx.Node] = {}
        for node in self.nodes:
            for inp in node.all_input_nodes:
                last_use[inp] = node
        self.frees: dict[fx.Node, list[fx.Node]] = {}
        for value, user in last_use.items():
            self.frees.setdefault(user, []).append(value)
        self.mutating = {n for n in self.nodes if n not in self.quantizers and mutates_first_argument(n, self.modules)}
        self.out_of_place = {n: out_of_place_form(n, self.modules) for n in self.mutating}
        self.max_pools = {n for n in self.nodes if self._is_plain_max_pool2d(n)}
        self.in_place = {n: make for n in self.nodes if n.op in _COMPUTED and n not in self.quantizers
                         and (make := in_place_form(n, self.modules)) is not None}
        # quantizers whose forward is FakeQuantize's own (a subclass, e.g. QAT's, may compute differently)
        self.in_place_quantizers = {n for n, fq in self.quantizers.items()
                                    if isinstance(fq, FakeQuantize) and type(fq).forward is FakeQuantize.forward}
        self.convs: set[fx.Node] = set()
        self.restore: dict[fx.Node, frozenset[fx.Node]] = {}
        if channels_last and not any(_names_channels_last(n) for n in self.nodes):
            self._plan_channels_last()
        self._channels_last_on = False
        self._cl_weights: dict[tuple[fx.Node, bool, bool], tuple[torch.Tensor, int, torch.Tensor]] = {}
        self.fp32_params: dict[str, torch.Tensor] = {}
        self.refresh()

    # ------------------------------------------------------------------ model facts
    def _plan_channels_last(self) -> None:
        """Which nodes carry channels-last values (see the module docstring) and which readers restore them.

        Carriers: the 2-D convolutions, then the quantizers and layout-free ops (:data:`LAYOUT_FREE_OP_TYPES`) that
        read a carrier and give a 4-D tensor (a ``flatten(y, 2)`` or a ``stack`` of channels-last values has strides
        no model forward gives it). Every other reader of a carrier gets the value contiguous, as in the model."""
        if any(t.dim() == 4 and not t.is_contiguous() for t in (*self.gm.parameters(), *self.gm.buffers())):
            return  # channels-last weights make the model's own convolutions channels-last
        types = {n: op_type(n, self.modules) for n in self.nodes if n.op in _COMPUTED and n not in self.quantizers}
        rank = {n: v.dim() for n in self.nodes if isinstance(v := n.meta.get("val"), torch.Tensor)}
        carriers: set[fx.Node] = set()
        for node in self.nodes:
            if types.get(node) == "Conv" and rank.get(node) == 4:
                self.convs.add(node)
                carriers.add(node)
            elif node in self.quantizers or types.get(node) in LAYOUT_FREE_OP_TYPES:
                given = node.args[0] if node in self.quantizers and node.args else None
                own = rank.get(node, rank.get(given) if isinstance(given, fx.Node) else None)  # a quantizer: x's
                if own == 4 and any(a in carriers for a in node.all_input_nodes):  # (a tuple, a pool's indices: not)
                    carriers.add(node)
        for node in self.nodes:
            if node not in carriers and node.op in _COMPUTED and not _reads_sizes_only(node, types.get(node)):
                read = frozenset(a for a in node.all_input_nodes if a in carriers)
                if read:
                    self.restore[node] = read

    def refresh(self) -> None:
        """Re-read which parameters are baked (call after baking / unbaking the model)."""
        self._cl_weights.clear()  # baking writes through .data: no version bump tells the copies are stale
        self.fp32_params = {fq.param: fq.fp32_backup for _, fq in self.qg.weights() if fq.baked}

    def quantizer_info(self, qnode: fx.Node) -> QuantizerInfo | None:
        """The record of the quantizer ``qnode`` runs (None for any other node)."""
        return self._infos.get(qnode)

    def own_output_quantizer(self, node: fx.Node) -> fx.Node | None:
        """The quantizer node right after ``node`` that quantizes its output with its own parameters."""
        nq = node.meta.get("fxq")
        if not isinstance(nq, NodeQuant) or nq.output is None or nq.output_state is not QuantState.ACTIVATED:
            return None
        for user in node.users:
            info = self.quantizer_info(user)
            if info is not None and info.name == nq.output and user.args and user.args[0] is node:
                return user
        return None

    def layer_plan(self, node: fx.Node) -> LayerPlan:
        """The quantizers that belong to ``node``: those of its inputs (weight, bias, activations) and its own output."""
        nq = node.meta.get("fxq")
        names = {q for q in (nq.inputs.values() if isinstance(nq, NodeQuant) else ()) if q is not None}
        by_name = {self.quantizer_info(q).name: q for q in self.quantizers if self.quantizer_info(q) is not None}
        inputs: dict[fx.Node, fx.Node] = {}
        for arg in node.all_input_nodes:
            if arg in self.quantizers:
                info = self.quantizer_info(arg)
                if info is not None and info.name in names:
                    inputs[arg] = arg
            elif isinstance(nq, NodeQuant) and nq.inputs.get(arg.name) in by_name:
                q = by_name[nq.inputs[arg.name]]  # value on a passive path (flatten, maxpool...) of q's grid
                fq = self.quantizers[q]
                info = self.quantizer_info(q)
                if info is not None and info.role == "activation" and not fq.config.per_channel:
                    inputs[arg] = q
        return LayerPlan(node, inputs, self.own_output_quantizer(node))

    def downstream(self, node: fx.Node) -> list[fx.Node]:
        """``node`` and every node that depends on it, in graph order."""
        seen = {node}
        stack = [node]
        while stack:
            for user in stack.pop().users:
                if user not in seen:
                    seen.add(user)
                    stack.append(user)
        return sorted(seen, key=self.index.__getitem__)

    # ------------------------------------------------------------------ execution
    def bind(self, batch: Any, check: bool = False) -> dict[fx.Node, Any]:
        """Placeholder values for one batch (moved to the model's device)."""
        return placeholder_values(self.gm, batch, check=check)

    def _quantized_input(self, qnode: fx.Node, fp32_value: Any) -> Any:
        info = self.quantizer_info(qnode)
        if info is not None and info.param is not None and info.param in self.fp32_params:
            return get_attr_value(self.gm, info.param)  # baked: the parameter already holds quantized values
        return self.quantizers[qnode](fp32_value)

    def _is_plain_max_pool2d(self, node: fx.Node) -> bool:
        """A 2-D max-pool returning values only (no indices)."""
        if node.op == "call_module":
            mod = self.modules.get(str(node.target))
            return type(mod) is nn.MaxPool2d and not mod.return_indices
        return (node.op == "call_function" and node.target in (F.max_pool2d, torch.max_pool2d)
                and not node.kwargs.get("return_indices", False) and len(node.args) < 7)

    def _max_pool2d(self, node: fx.Node, args: tuple, kwargs: dict) -> Any:
        """The same max-pool over a channels-last copy of a CPU input, returned in the input's layout.

        Identical values (a max is exact) at a third of the time: torch's NCHW max-pool kernel on CPU is
        scalar, its channels-last one vectorised (ResNet's stem pool: 32 ms -> 12 ms for 8x64x112x112).
        """
        x = args[0]
        if not (isinstance(x, torch.Tensor) and x.device.type == "cpu" and x.dim() == 4 and x.is_contiguous()
                and x.is_floating_point()):
            return self._call_original(node, args, kwargs)
        out = self._call_original(node, (_channels_last(x), *args[1:]), kwargs)
        return out.contiguous()

    def _protected_storages(self, inputs: Mapping[fx.Node, Any]) -> set[int]:
        """Storages an overwriting run must never write: model inputs, parameters, buffers, FP32 backups."""
        tensors = [*self.gm.parameters(), *self.gm.buffers(), *self.fp32_params.values()]
        for value in inputs.values():
            tensors += tensors_of(value)
        return {_storage(t) for t in tensors}

    def _may_overwrite(self, node: fx.Node, env: Mapping[fx.Node, Any], protected: set[int] | None) -> bool:
        """Whether ``node`` may write into the value of its first argument (see the module docstring).

        ``protected``: storages never to write (None: write nothing in place)."""
        first = node.args[0] if node.args else None
        if protected is None or not isinstance(first, fx.Node) or first.op not in _COMPUTED:
            return False
        value = env[first]
        if not isinstance(value, torch.Tensor) or any(
                self.index[u] > self.index[node] for u in first.users if u is not node):
            return False
        storage = _storage(value)
        if storage is None or storage in protected:
            return False
        for other, v in env.items():  # aliases: views, pass-through quantizers, tuple elements
            if other is not first and any(_storage(t) in (storage, None) for t in tensors_of(v)):
                return False
        return True

    def _exec(self, node: fx.Node, env: Mapping[fx.Node, Any], fp32: bool, layer: LayerPlan | None,
              protected: set[int] | None = None) -> Any:
        if node.op == "get_attr":
            target = str(node.target)
            if fp32 and target in self.fp32_params:
                return self.fp32_params[target]
            return get_attr_value(self.gm, target)
        if node.op == "output":
            return fx.node.map_arg(node.args[0], env.__getitem__)
        read: Callable[[fx.Node], Any] = env.__getitem__
        restore = self.restore.get(node) if self._channels_last_on else None
        if restore:  # as the model's forward has it (a writing op's copy reaches later readers: _exec_mutating)
            read = functools.partial(_read_contiguous, env, restore)
        if layer is not None and node is layer.node and layer.inputs:
            swap = {a: self._quantized_input(q, read(a)) for a, q in layer.inputs.items()}
            read = functools.partial(_read_swapped, read, swap)
        args = thaw(fx.node.map_arg(node.args, read))  # mutable lists, as the generated code gives
        kwargs = thaw(fx.node.map_arg(node.kwargs, read))
        if self._channels_last_on and node in self.convs:
            args = self._channels_last_conv_args(node, args, fp32, layer is not None and node is layer.node)
        if node.op == "call_module" and node in self.quantizers:
            if fp32 and not (layer is not None and node is layer.output_quantizer):
                return args[0]
            if node in self.in_place_quantizers and len(args) == 1 and not kwargs and \
                    self._may_overwrite(node, env, protected):
                return self.quantizers[node].forward_(args[0])
            return self.quantizers[node](*args, **kwargs)
        make = self.in_place.get(node)
        if make is not None and args and _writable(args[0]) and self._may_overwrite(node, env, protected):
            return make()(*args, **{k: v for k, v in kwargs.items() if k != "inplace"})
        if node in self.max_pools:
            return self._max_pool2d(node, args, kwargs)
        if node in self.mutating:
            if self._may_overwrite(node, env, protected):
                return self._call_original(node, args, kwargs)
            return self._exec_mutating(node, env, args, kwargs)
        if node.op == "call_module":
            return self.modules[str(node.target)](*args, **kwargs)
        if node.op == "call_function":
            return node.target(*args, **kwargs)
        if node.op == "call_method":
            return getattr(args[0], str(node.target))(*args[1:], **kwargs)
        raise ConfigError(f"node {node.name!r}: unsupported fx op {node.op!r}")

    def _channels_last_conv_args(self, node: fx.Node, args: tuple, fp32: bool, layer_node: bool) -> tuple:
        """A convolution's input channels-last, and a functional one's weight too (oneDNN otherwise reorders a plain
        weight on every call: ResNet-18's 45 MB a pass). One copy per node and view (the layer view's own), made
        again when the weight is another tensor or was written in place (cleared by :meth:`refresh` after baking,
        which writes via .data)."""
        if not args:
            return args
        w = args[1] if node.op == "call_function" and len(args) > 1 else None
        if not isinstance(w, torch.Tensor) or w.dim() != 4 or w.device.type != "cpu":
            return (_channels_last(args[0]), *args[1:])
        if w.is_inference():  # no version counter: a fresh copy every call
            return (_channels_last(args[0]), _channels_last(w), *args[2:])
        key = (node, fp32, layer_node)
        kept = self._cl_weights.get(key)
        if kept is None or kept[0] is not w or kept[1] != w._version:
            kept = self._cl_weights[key] = (w, w._version, _channels_last(w))
        return (_channels_last(args[0]), kept[2], *args[2:])

    def _exec_rewritten(self, node: fx.Node, env: Mapping[fx.Node, Any], fp32: bool, layer: LayerPlan | None,
                        protected: set[int] | None = None) -> Any:
        """:meth:`_exec` of a quantized or layer view after the FP32 view ran the same batch: a failure there is
        fxq's rewrite's (its quantizers, baked weights, in-place reuse), never the data's.

        Raises:
            GraphError: naming ``node``, saying it is fxq's failure and to report it (memory errors pass as they are).
        """
        try:
            return self._exec(node, env, fp32, layer, protected)
        except (FxqError, torch.OutOfMemoryError):
            raise
        except Exception as exc:  # noqa: BLE001  (any error of the rewrite: say whose it is)
            raise rewrite_failure(node.name, exc) from exc

    def _exec_mutating(self, node: fx.Node, env: Any, args: tuple, kwargs: dict) -> Any:
        first = node.args[0] if node.args else None
        read_later = isinstance(first, fx.Node) and any(
            self.index[u] > self.index[node] for u in first.users if u is not node)
        if read_later or not isinstance(args[0], torch.Tensor):
            # the graph reads the mutated argument again: mutate a copy and make later readers see it
            if isinstance(first, fx.Node) and isinstance(args[0], torch.Tensor):
                copy = args[0].clone()
                env[first] = copy
                args = (copy, *args[1:])
            return self._call_original(node, args, kwargs)
        form = self.out_of_place[node]
        if form is None:
            return self._call_original(node, (args[0].clone(), *args[1:]), kwargs)
        op, target, inplace_off = form
        if inplace_off:
            kwargs = {**kwargs, "inplace": False}
        if op == "call_method":
            return getattr(args[0], target)(*args[1:], **kwargs)
        return target(*args, **kwargs)

    def _call_original(self, node: fx.Node, args: tuple, kwargs: dict) -> Any:
        if node.op == "call_module":
            return self.modules[str(node.target)](*args, **kwargs)
        if node.op == "call_function":
            return node.target(*args, **kwargs)
        return getattr(args[0], str(node.target))(*args[1:], **kwargs)

    def run(
        self,
        inputs: dict[fx.Node, Any],
        *,
        fp32: bool,
        watch: Watch | None = None,
        layer: LayerPlan | None = None,
        base: Mapping[fx.Node, Any] | None = None,
        nodes: list[fx.Node] | None = None,
        keep: dict[fx.Node, Any] | None = None,
        fp32_ran: bool = False,
    ) -> Any:
        """Execute the graph and return the model's output.

        Args:
            inputs: placeholder values (:meth:`bind`).
            fp32: FP32 view (True) or quantized view (False).
            watch: node -> callback, called with the node's value as soon as it is computed.
            layer: run the layer view of this plan (use with ``fp32=True``).
            base: values of nodes not in ``nodes`` (a cache from an earlier FP32 run).
            nodes: the nodes to compute (default: all); the others are read from ``base``.
            keep: when given, every computed value is stored here (and nothing is freed).
            fp32_ran: the FP32 view already ran this batch, so a failure of a quantized or layer view is fxq's:
                GraphError naming the node (see :meth:`_exec_rewritten`).

        Raises:
            GraphError: with ``fp32_ran``, a node of the quantized or layer view failed.
        """
        watch = watch or {}
        self._channels_last_on = bool(self.convs) and _plain_layout(inputs)
        rewritten = fp32_ran and (not fp32 or layer is not None)
        env: dict[fx.Node, Any] = dict(inputs)
        lookup: Any = env if base is None else _Overlay(env, base)
        for node in self.nodes if nodes is None else nodes:
            if node.op == "placeholder":
                if node not in env:
                    raise ConfigError(f"no value for model input {node.name!r}")
            elif rewritten:
                env[node] = self._exec_rewritten(node, lookup, fp32, layer)
            else:
                env[node] = self._exec(node, lookup, fp32, layer)
            if keep is not None:
                keep[node] = env[node]
            cb = watch.get(node)
            if cb is not None:
                cb(env[node])
            if keep is None and node.op != "output":
                for dead in self.frees.get(node, ()):
                    env.pop(dead, None)
        return lookup[self.output_node]

    def run_side_by_side(self, inputs: dict[fx.Node, Any], *, fp32_watch: Watch | None = None,
                         quant_watch: Watch | None = None) -> tuple[Any, Any]:
        """The FP32 and the quantized view in lockstep; returns both outputs.

        Node by node: its FP32 value, its quantized value, then the FP32 watcher and the quantized watcher
        of that node. A node that fails in the quantized view only is fxq's failure (GraphError naming it, not
        blaming the data: see :meth:`_exec_rewritten`). Each view computes every node once (one FP32 and one quantized pass), but no value
        has to outlive its node: the watchers must be done with a value when they return (compare it,
        add it to running sums), and in exchange quantizers and in-place ops write into values that
        nothing reads any more instead of allocating (see the module docstring).
        """
        fp32_watch, quant_watch = fp32_watch or {}, quant_watch or {}
        views = ((True, dict(inputs), fp32_watch), (False, dict(inputs), quant_watch))
        self._channels_last_on = bool(self.convs) and _plain_layout(inputs)
        protected = self._protected_storages(inputs)
        for node in self.nodes:
            for fp32, env, _ in views:
                if node.op == "placeholder":
                    if node not in env:
                        raise ConfigError(f"no value for model input {node.name!r}")
                    continue
                if fp32:
                    env[node] = self._exec(node, env, fp32, None, protected)
                else:  # the FP32 view just ran this node on the same values up to here
                    env[node] = self._exec_rewritten(node, env, False, None, protected)
                if node.op == "get_attr":
                    protected.update(_storage(t) for t in tensors_of(env[node]))
            for _, env, watch in views:
                cb = watch.get(node)
                if cb is not None:
                    cb(env[node])
            if node.op != "output":
                for _, env, _ in views:
                    for dead in self.frees.get(node, ()):
                        env.pop(dead, None)
        return views[0][1][self.output_node], views[1][1][self.output_node]


_COMPUTED = ("call_function", "call_method", "call_module")


def _channels_last(x: Any) -> Any:
    """A 4-D floating CPU tensor channels-last (itself when it already is); anything else as it is."""
    if isinstance(x, torch.Tensor) and x.dim() == 4 and x.device.type == "cpu" and x.is_floating_point():
        return x.contiguous(memory_format=torch.channels_last)
    return x


def _plain_layout(inputs: Mapping[fx.Node, Any]) -> bool:
    """CPU inputs, none of them 4-D channels-last (which would make the model's own convolutions channels-last, as
    channels-last weights do: :meth:`GraphRunner._plan_channels_last` plans nothing then)."""
    tensors = [t for v in inputs.values() for t in tensors_of(v)]
    return all(t.device.type == "cpu" and (t.dim() != 4 or t.is_contiguous()) for t in tensors)


def _names_channels_last(node: fx.Node) -> bool:
    """The node asks for a memory format itself (``x.contiguous(memory_format=torch.channels_last)``, ``.to``): the
    model lays out its own values, which the runner would not restore the same way."""
    found: list[bool] = []
    fx.node.map_aggregate((node.args, node.kwargs), lambda v: found.append(isinstance(v, torch.memory_format)))
    return any(found)


def _reads_sizes_only(node: fx.Node, node_type: str | None) -> bool:
    """``x.shape``, ``x.size()``, ``x.dim()``: the same whatever the layout (no copy to restore it)."""
    if node_type != "Shape":
        return False
    if node.op == "call_function" and node.target is getattr:
        return len(node.args) > 1 and node.args[1] in ("shape", "ndim", "dtype", "device")
    return node.op == "call_method" and node.target in ("size", "dim", "numel")


def _read_contiguous(env: Mapping[fx.Node, Any], restore: frozenset[fx.Node], arg: fx.Node) -> Any:
    value = env[arg]
    return value.contiguous() if arg in restore and isinstance(value, torch.Tensor) else value


def _read_swapped(read: Callable[[fx.Node], Any], swap: Mapping[fx.Node, Any], arg: fx.Node) -> Any:
    return swap[arg] if arg in swap else read(arg)


def _writable(x: Any) -> bool:
    """A tensor an elementwise op may write into: dense, no element twice (an ``expand``'s is refused by torch)."""
    return isinstance(x, torch.Tensor) and (x.is_contiguous() or x.is_contiguous(memory_format=torch.channels_last))


def _storage(t: torch.Tensor) -> int | None:
    """Address of ``t``'s memory; None when it has no plain storage (sparse, some subclasses): never written."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


class _Overlay:
    """Computed values first, then the cache; writes go to the computed values."""

    def __init__(self, top: dict, base: Mapping) -> None:
        self.top, self.base = top, base

    def __getitem__(self, key: Any) -> Any:
        if key in self.top:
            return self.top[key]
        return self.base[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        self.top[key] = value


@contextlib.contextmanager
def analysis_mode(gm: fx.GraphModule) -> Iterator[fx.GraphModule]:
    """Eval mode, no gradients and no observers inside the block; everything restored after.

    Raises:
        ConfigError: some quantizer has no parameters yet (the model was not calibrated).
    """
    qg = QuantGraph(gm)
    pending = [n for n, fq in qg.quantizers() if fq.config.state in (QuantState.INITIAL, QuantState.PASSIVE_INIT)]
    if pending:
        shown = ", ".join(pending[:6]) + (" ..." if len(pending) > 6 else "")
        raise ConfigError(f"{len(pending)} quantizer(s) are not calibrated ({shown}): analyse the model returned by "
                          "fxq.quantize, or run fxq.calibrate first")
    observing = [fq for _, fq in qg.quantizers() if fq.observe_enabled]
    was_training = gm.training
    gm.eval()
    for fq in observing:
        fq.observe_enabled = False
    try:
        with torch.no_grad():
            yield gm
    finally:
        for fq in observing:
            fq.observe_enabled = True
        gm.train(was_training)
