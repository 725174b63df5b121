"""Export marks: a copy of a quantized GraphModule in which quantizers and named tensors are identity marks.

``fxq_export::mark(x, id)`` is an opaque identity op. The TorchScript ONNX exporter writes each call as a node
``fxq.Mark(id)``; :mod:`fxq.backends.qdq.lowering` then removes the marks, naming tensors (``kind="name"``) or
replacing them by QuantizeLinear/DequantizeLinear (``kind="quant"``, see :mod:`fxq.backends.qdq.insert`).
The user's model is never modified: the copy shares its parameters and modules.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn
from torch.onnx import symbolic_helper

from fxq.graph.data import doubled_dim_probes
from fxq.graph.info import NodeQuant, computed_from_parameters, is_quantizer_node
from fxq.graph.nodes import output_shapes
from fxq.graph.quant_graph import QuantGraph, quantizer_name

__all__ = ["Mark", "MarkedModule", "build_marked_module", "freeze_quant_mark_inputs", "MARK_DOMAIN", "MARK_OP",
           "flat_output_count", "mark_sizes", "mark_sizes_while_exporting"]

logger = logging.getLogger(__name__)

MARK_DOMAIN = "fxq"
MARK_OP = "Mark"


@torch.library.custom_op("fxq_export::mark", mutates_args=())
def _mark(x: Tensor, mark_id: int) -> Tensor:
    return x.clone()


@_mark.register_fake
def _(x, mark_id):
    return torch.empty_like(x)


_EXPORTING = threading.local()
"""``sizes``: per mark id, the sizes of its value in this thread's export, None where they follow the export's
dynamic input axes (:func:`mark_sizes`)."""


@symbolic_helper.parse_args("v", "i")
def _mark_symbolic(g: Any, x: Any, mark_id: int) -> Any:
    out = g.op(f"{MARK_DOMAIN}::{MARK_OP}", x, id_i=mark_id)
    typ = x.type()
    sizes = getattr(_EXPORTING, "sizes", {}).get(mark_id)
    if sizes is not None and hasattr(typ, "with_sizes"):
        # torch.onnx cannot infer a custom op's shape and keeps the type it is given. The sizes fxq ran: a dynamic
        # dim left static would let its constant folding freeze every Shape read downstream (a dynamic width became
        # a constant 40); a static one left unknown (torch.onnx knows no shape past a Pad) makes the symbolics that
        # need it refuse (HaloNet's ``unfold``: "input size not accessible")
        typ = typ.with_sizes(list(sizes))
    out.setType(typ)
    return out


torch.onnx.register_custom_op_symbolic("fxq_export::mark", _mark_symbolic, 1)


@dataclasses.dataclass(frozen=True)
class Mark:
    """One mark: what the exported tensor is (a quantizer's input, or a value to name)."""

    id: int
    kind: str  # "quant" | "name"
    fx_node: str  # the fx node whose value passes through the mark
    quantizer: str | None = None  # kind "quant": the fxq quantizer
    tensor_name: str | None = None  # kind "name": the wanted ONNX tensor name
    node_name: str | None = None  # kind "name": the wanted name of the ONNX node producing it
    requantize: bool = False  # a quant mark added after a passive op (values already on the grid)


@dataclasses.dataclass
class MarkedModule:
    """The marked copy and what the ONNX side needs to know about it."""

    module: fx.GraphModule
    marks: dict[int, Mark]
    input_names: list[str]
    output_names: list[str]
    param_names: dict[str, str]  # parameter target -> wanted ONNX initializer name
    grid_of: dict[str, tuple[str, str]]  # fx node -> (quantizer whose grid its value lies on, "passive"|"overlapped")


def _tensor_val(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.is_floating_point()


def _onnx_output_name(node: fx.Node) -> str | None:
    info = node.meta.get("onnx")
    if isinstance(info, dict):
        outs = info.get("outputs") or []
        if len(outs) == 1 and outs[0]:
            return str(outs[0])
    return None


def _onnx_node_name(node: fx.Node) -> str | None:
    info = node.meta.get("onnx")
    if isinstance(info, dict) and info.get("node_name"):
        return str(info["node_name"])
    return None


def flat_output_count(value: Any) -> int:
    if isinstance(value, (list, tuple)):
        return sum(flat_output_count(v) for v in value)
    if isinstance(value, dict):
        return sum(flat_output_count(v) for v in value.values())
    return 1


class _Builder:
    def __init__(self, gm: fx.GraphModule) -> None:
        self.gm = gm
        self.graph = fx.Graph()
        self.val_map: dict[fx.Node, fx.Node] = {}
        out = self.graph.graph_copy(gm.graph, self.val_map)
        self.graph.output(out)
        self.marks: dict[int, Mark] = {}
        self.quantizers = QuantGraph(gm).as_dict()

    def _insert_mark(self, after: fx.Node, mark: Mark, users: list[fx.Node] | None) -> fx.Node:
        with self.graph.inserting_after(after):
            m = self.graph.call_function(torch.ops.fxq_export.mark.default, (after, mark.id))
        m.meta.update({k: v for k, v in after.meta.items() if k == "val"})
        m.meta["fxq_export_mark"] = mark
        for user in list(users if users is not None else after.users):
            if user is not m:
                user.replace_input_with(after, m)
        self.marks[mark.id] = mark
        return m

    def _activation_quantized(self, node: fx.Node) -> bool:
        """Whether an activation quantizer reads ``node``: its Q/DQ stops torch.onnx's constant folding there, so
        the value stays a computed tensor (Swin-V2's position-bias MLP over a buffer) and can carry its fx name."""
        for user in node.users:
            fq = self.quantizers.get(quantizer_name(user))
            if fq is not None and fq.config.is_quantizing and fq.role == "activation":
                return True
        return False

    def _next_id(self) -> int:
        return len(self.marks) + 1

    def pool_by_windows(self) -> None:
        """Adaptive average pools to a size that does not divide the input's (CSATv2's ``AdaptiveAvgPool2d((7, 7))``
        of 16 x 16; VGG's at other sizes than 224) as :func:`adaptive_avg_pool_by_windows`, which torch.onnx writes
        (its own symbolic refuses them: "output size that are not factor of input size")."""
        for node in self.graph.nodes:
            if node.op == "call_module" and type(self.gm.get_submodule(str(node.target))) is nn.AdaptiveAvgPool2d:
                x, size = node.args[0], self.gm.get_submodule(str(node.target)).output_size
            elif node.op == "call_function" and node.target is F.adaptive_avg_pool2d:
                x, size = node.args[0], node.args[1] if len(node.args) > 1 else node.kwargs.get("output_size")
            else:
                continue
            val = x.meta.get("val") if isinstance(x, fx.Node) else None
            if not isinstance(val, Tensor) or val.dim() < 3:
                continue
            out = [d if s is None else int(s) for d, s in zip(val.shape[-2:], (size, size) if isinstance(size, int)
                                                                  else size)]
            if all(int(d) % o == 0 for d, o in zip(val.shape[-2:], out)):
                continue  # torch.onnx writes these itself
            node.op, node.target, node.args, node.kwargs = "call_function", adaptive_avg_pool_by_windows, \
                (x, tuple(out)), {}

    def name_values(self) -> None:
        memo: dict[fx.Node, bool] = {}
        for node in list(self.graph.nodes):
            if node.op not in ("call_function", "call_method", "call_module") or is_quantizer_node(node):
                continue
            if not _tensor_val(node):
                continue
            if computed_from_parameters(node, memo) and not self._activation_quantized(node):
                continue  # left unnamed so that torch.onnx folds it into an initializer
            mark = Mark(self._next_id(), "name", node.name, tensor_name=_onnx_output_name(node) or node.name,
                        node_name=_onnx_node_name(node) or node.name)
            self._insert_mark(node, mark, None)

    def replace_quantizers(self) -> None:
        for node in list(self.graph.nodes):
            qname = quantizer_name(node)
            if qname is None:
                continue
            fq = self.quantizers[qname]
            src = node.args[0]
            if fq.config.is_quantizing:
                fx_src = src.name
                with self.graph.inserting_after(node):
                    mark = Mark(self._next_id(), "quant", fx_src, quantizer=qname)
                    m = self.graph.call_function(torch.ops.fxq_export.mark.default, (src, mark.id))
                m.meta["val"] = node.meta.get("val", src.meta.get("val"))
                m.meta["fxq_export_mark"] = mark
                self.marks[mark.id] = mark
                node.replace_all_uses_with(m)
            else:
                node.replace_all_uses_with(src)
            self.graph.erase_node(node)

    def requantize_passive(self) -> None:
        """Repeat the shared quantizer after passive ops (MaxPool, Reshape...) that feed quantized ops.

        Their values are already on that grid, so Q/DQ there changes nothing numerically; it puts Q/DQ
        directly on the inputs of the consumers, where TensorRT and ONNX Runtime look for it.
        """
        for node in list(self.graph.nodes):
            nq = node.meta.get("fxq")
            if not isinstance(nq, NodeQuant) or not nq.quantized or nq.output_state.name != "PASSIVE":
                continue
            fq = self.quantizers.get(nq.output or "")
            if fq is None or not fq.config.is_quantizing:
                continue
            carrier = node
            name_marks = [u for u in node.users if _is_mark(u, "name")]
            if name_marks:
                carrier = name_marks[0]
            consumers = [u for u in carrier.users if _consumes_quantized(u, node.name, nq.output)]
            if consumers:
                mark = Mark(self._next_id(), "quant", node.name, quantizer=nq.output, requantize=True)
                self._insert_mark(carrier, mark, consumers)

    def finish(self) -> fx.GraphModule:
        self.graph.lint()
        return fx.GraphModule(self.gm, self.graph, class_name="FxqExportModule")


def adaptive_avg_pool_by_windows(x: Tensor, size: tuple[int, int]) -> Tensor:
    """``F.adaptive_avg_pool2d(x, size)`` as the mean of each window's rows, then of its columns (the windows of
    adaptive pooling: ``floor(i * H / h)`` to ``ceil((i + 1) * H / h)``), which torch.onnx writes as Slice,
    ReduceMean and Concat at any size."""
    for dim, (length, count) in enumerate(zip(x.shape[-2:], size), start=x.dim() - 2):
        # positive divisions only: torch.onnx writes a traced size's // as ONNX Div, which truncates
        windows = [(k * length // count, ((k + 1) * length + count - 1) // count) for k in range(count)]
        x = torch.cat([x.narrow(dim, lo, hi - lo).mean(dim, keepdim=True) for lo, hi in windows], dim)
    return x


def _is_mark(node: fx.Node, kind: str) -> bool:
    mark = node.meta.get("fxq_export_mark")
    return isinstance(mark, Mark) and mark.kind == kind


def _consumes_quantized(user: fx.Node, src: str, quantizer: str | None) -> bool:
    nq = user.meta.get("fxq")
    return isinstance(nq, NodeQuant) and nq.quantized and nq.inputs.get(src) == quantizer


def _io_names(gm: fx.GraphModule) -> tuple[list[str], list[str]]:
    onnx_meta = gm.meta.get("onnx") if isinstance(getattr(gm, "meta", None), dict) else None
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    inputs = []
    for n in placeholders:
        inputs.append(_onnx_output_name(n) or n.name)
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    count = flat_output_count(out_node.args[0])
    if isinstance(onnx_meta, dict) and len(onnx_meta.get("outputs") or []) == count:
        outputs = [str(o) for o in onnx_meta["outputs"]]
    else:
        outputs = ["output"] if count == 1 else [f"output_{i}" for i in range(count)]
    return inputs, outputs


def _param_names(gm: fx.GraphModule) -> dict[str, str]:
    """Parameter target -> the initializer name it had in the ONNX file the model came from."""
    names: dict[str, str] = {}
    for node in gm.graph.nodes:
        info = node.meta.get("onnx")
        if node.op == "get_attr" and isinstance(info, dict) and info.get("initializer"):
            names[str(node.target)] = str(info["initializer"])
        path = node.meta.get("module_path") or (node.target if node.op == "call_module" else None)
        if isinstance(info, dict) and isinstance(info.get("params"), dict) and isinstance(path, str):
            for key, init in info["params"].items():
                if init:
                    names[f"{path}.{key}"] = str(init)
    return names


def _grid_of(gm: fx.GraphModule) -> dict[str, tuple[str, str]]:
    grid: dict[str, tuple[str, str]] = {}
    for node in gm.graph.nodes:
        nq = node.meta.get("fxq")
        if isinstance(nq, NodeQuant) and nq.output and nq.output_state.name in ("PASSIVE", "OVERLAPPED"):
            grid[node.name] = (nq.output, nq.output_state.name.lower())
    return grid


def build_marked_module(gm: fx.GraphModule, *, requantize_passive: bool = True) -> MarkedModule:
    """The marked copy of ``gm``: named values, quantizers as quant marks, optional passive requantization."""
    b = _Builder(gm)
    b.pool_by_windows()
    b.name_values()
    b.replace_quantizers()
    if requantize_passive:
        b.requantize_passive()
    module = b.finish()
    inputs, outputs = _io_names(gm)
    return MarkedModule(module, b.marks, inputs, outputs, _param_names(gm), _grid_of(gm))


def _value_name(node: fx.Node) -> str:
    """The fx name of the value ``node`` carries: a name mark stands for the node it names."""
    mark = node.meta.get("fxq_export_mark")
    while isinstance(mark, Mark) and mark.kind == "name":
        node = node.args[0]
        mark = node.meta.get("fxq_export_mark")
    return node.name


def freeze_quant_mark_inputs(marked: MarkedModule, ids: set[int], args: tuple) -> list[str]:
    """Feed the quant marks ``ids`` that torch.onnx folded away from buffers holding the values reaching them.

    torch.onnx's tracer folds a value computed only from constants and static shapes (RAFT's coordinate grid:
    ``arange`` / ``meshgrid`` at the traced size) into a constant, and the marks on it with it, so the value's Q/DQ
    would be lost while the simulation quantizes it. A buffer is an input of the traced graph: its mark stays, and
    the Q/DQ step writes the value as an initializer quantized by fxq's own function, as it does weights. Only the
    first folded marks of a chain are fed (those with no folded quant mark upstream): what follows them is then
    computed in the file, their own marks included, and what reaches them is not quantized anywhere, so a plain
    run of the marked module on ``args`` gives the simulation's values. Returns the frozen values' names (their
    initializers' names).
    """
    from fxq.analysis.mismatch import simulation_values

    gm = marked.module
    lost = [m for m in gm.graph.nodes if _is_mark(m, "quant") and m.meta["fxq_export_mark"].id in ids]
    below: set[fx.Node] = set()  # nodes computed from a folded quant mark
    folded = set(lost)
    for node in gm.graph.nodes:  # topological order
        if any(a in below or a in folded for a in node.all_input_nodes):
            below.add(node)
    roots = {m: m.args[0] for m in lost if m not in below}
    inputs = dict(zip([n for n in gm.graph.nodes if n.op == "placeholder"], args))
    values = simulation_values(gm, inputs, {src.name for src in roots.values()})
    frozen: dict[fx.Node, fx.Node] = {}
    for mark, src in roots.items():
        if src not in frozen:
            target = name = _value_name(src)
            k = 0
            while hasattr(gm, target):
                k += 1
                target = f"{name}_{k}"
            gm.register_buffer(target, values[src.name])
            with gm.graph.inserting_before(mark):
                frozen[src] = gm.graph.get_attr(target)
            frozen[src].meta["val"] = src.meta.get("val")
        mark.replace_input_with(src, frozen[src])
    gm.recompile()
    return [str(n.target) for n in frozen.values()]


@contextlib.contextmanager
def mark_sizes_while_exporting(sizes: dict[int, tuple[int | None, ...]]) -> Iterator[None]:
    """Give the marks' ONNX symbolic the sizes :func:`mark_sizes` found, for one export in this thread."""
    before = getattr(_EXPORTING, "sizes", {})
    _EXPORTING.sizes = sizes
    try:
        yield
    finally:
        _EXPORTING.sizes = before


def mark_sizes(marked: MarkedModule, args: tuple, axes: dict[str, dict[int, str]] | None
               ) -> dict[int, tuple[int | None, ...]]:
    """Per mark id, the sizes of its value at the example's size, None for the dims that change when the dynamic
    input axes do (doubled: the example repeated along them), found by running the marked module at the example's
    size and the doubled one: all axes at once, else each alone (an OCR recognizer's height is symbolic in its file
    but only its width varies). Marks no doubled size reached (the model takes the example's size only) are left
    out, and so is every mark where the module does not run here: those keep torch.onnx's types."""
    base = _mark_shapes(marked.module, args)
    if base is None:
        return {}
    wanted = [(i, d) for i, name in enumerate(marked.input_names) if i < len(args)
              and isinstance(args[i], torch.Tensor) for d in sorted((axes or {}).get(name) or {}) if d < args[i].dim()]
    found: dict[int, set[int]] = {}
    for bigger in doubled_dim_probes(args, wanted, lambda probe: _mark_shapes(marked.module, probe)) if wanted else ():
        for mark_id, shape in base.items():
            other = bigger.get(mark_id)
            if other is not None and len(other) == len(shape):
                found.setdefault(mark_id, set()).update(k for k, (p, q) in enumerate(zip(shape, other)) if p != q)
    # with dynamic axes, only the marks a doubled size reached are known; the others keep torch.onnx's types
    return {mark_id: tuple(None if k in found.get(mark_id, ()) else d for k, d in enumerate(shape))
            for mark_id, shape in base.items() if not wanted or mark_id in found}


def _mark_shapes(module: fx.GraphModule, args: tuple) -> dict[int, tuple[int, ...]] | None:
    """Output shape of every mark of ``module`` run on ``args`` (:func:`~fxq.graph.nodes.output_shapes`); None
    when it fails there."""
    try:
        shapes = output_shapes(module, args)
    except Exception as exc:  # noqa: BLE001  (the model takes only the example's sizes: keep its traced sizes)
        logger.debug("export: the model does not run with its dynamic axes doubled (%s); shapes stay as traced", exc)
        return None
    return {n.meta["fxq_export_mark"].id: shape for n, shape in shapes.items()
            if isinstance(n.meta.get("fxq_export_mark"), Mark)}
