"""``torch.export`` capture: an ``ExportedProgram`` becomes the same kind of graph symbolic tracing gives.

``torch.export`` records aten ops (``aten.conv2d.default``, ``aten.add.Tensor``...). Every later stage of fxq
(dispatch, prepare, algorithms, analysis, the exporters) reads graphs of torch-level calls (``F.conv2d``,
``torch.add``, ``F.batch_norm``...), so the aten graph is *lifted*: each aten overload whose arguments are laid
out like a torch function's becomes a call of that function; other aten ops stay as they are and get their op
type from :mod:`fxq.graph.op_types`. Node names come from ``nn_module_stack`` (``layer1_0_conv1``), and weighted
nodes carry ``meta["module_path"]`` like those of the fx path.
"""
from __future__ import annotations

import contextlib
import inspect
import io
import logging
import operator
import sys
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.utils import _pytree as pytree

from fxq.graph.nodes import get_attr_value, redirect_later_readers
from fxq.graph.op_types import LIFTED, WEIGHTED_FUNCTIONS
from fxq.graph.passes import reuse_node_name

__all__ = ["export_program", "from_exported_program", "lift_aten_graph", "is_aten_graph"]

logger = logging.getLogger(__name__)

aten = torch.ops.aten

_ARITY = {F.layer_norm: 5, F.group_norm: 5, F.elu: 2}
"""Lifted functions whose aten overload takes more positional arguments than they do (the rest are defaults)."""

_BN_NO_TRAINING = aten._native_batch_norm_legit_no_training.default
_IDENTITIES = {aten.clone.default, aten.alias.default, aten.dropout.default, aten.contiguous.default,
               aten.detach.default, aten.lift_fresh_copy.default}
FIXED_BATCH_KEY = "fxq_fixed_batch"
"""``gm.meta[FIXED_BATCH_KEY]``: ``{input: batch size}`` of the inputs whose batch torch.export fixed (the model's code
depends on the example's batch): the graph, and any file exported from it, computes for that batch only."""

_CHECKS = {aten._assert_tensor_metadata.default, aten._assert_scalar.default, aten.sym_constrain_range_for_size.default}


def export_program(model: nn.Module, args: tuple, kwargs: dict[str, Any] | None = None) -> torch.export.ExportedProgram:
    """``torch.export`` of ``model`` in eval mode at the example's shapes, the batch dimension left dynamic where the
    model allows it (calibration batches may differ in size). Non-strict: the model's Python runs as is.

    A batch of one would be specialized (torch.export fixes sizes 0 and 1), so such an example is exported as a
    batch of two (repeated) and kept only if the program then gives the model's own result on the batch of one.

    Raises:
        Exception: torch.export's error of the last attempt (fixed shapes); :mod:`fxq.graph.capture` names it.
    """
    args, kwargs = tuple(args), dict(kwargs or {})
    doubled = pytree.tree_map(lambda a: a.repeat(2, *([1] * (a.dim() - 1)))
                              if isinstance(a, torch.Tensor) and a.dim() and a.shape[0] == 1 else a, (args, kwargs))
    if not _same_structure_values(doubled, (args, kwargs)):
        try:
            ep = _export_dynamic(model, *doubled)
            if _same_result(ep, model, args, kwargs):
                return ep
            logger.debug("the program exported at batch 2 differs from the model at batch 1; exporting at batch 1")
        except Exception as exc:  # batch-size-dependent code: the example's own batch next
            if _data_dependent(exc):
                raise
            logger.debug("torch.export at batch 2 failed (%s)", exc)
    try:
        return _export_dynamic(model, args, kwargs)
    except Exception as exc:  # a batch-size-dependent model: fall back to the example's shapes
        if _data_dependent(exc):
            raise
        logger.debug("torch.export with a dynamic batch failed (%s); exporting at fixed shapes", exc)
    with _quiet(), _state_kept(model):
        return torch.export.export(model, args, kwargs or None, strict=False)


@contextlib.contextmanager
def _state_kept(model: nn.Module) -> Iterator[None]:
    """Every submodule's attributes, parameters and buffers as they were before the block, whatever it assigned.

    A forward that caches a tensor on its module (a detection head's anchors, computed when the input size
    changes) assigns torch.export's fake tensor there while it traces. Kept, a later attempt lifts that fake value
    as a constant of its program, and every run of the program then fails (RT-DETR's decoder)."""
    # attribute containers copied, their items kept (as torch.export's own snapshot): a forward may write into a
    # cached list or dict in place (YOLOv5's ``self.grid[i] = ...``), and torch puts back copies of its own
    saved = [(m, {k: pytree.tree_map(lambda x: x, v) for k, v in m.__dict__.items() if k not in _MODULE_STORES},
              dict(m._parameters), dict(m._buffers), dict(m._modules)) for m in model.modules()]
    try:
        yield
    finally:
        for m, attrs, params, buffers, children in saved:
            for store, old in ((m._parameters, params), (m._buffers, buffers), (m._modules, children)):
                if store.keys() != old.keys() or any(store[k] is not v for k, v in old.items()):
                    store.clear()
                    store.update(old)
            for key in [k for k in m.__dict__ if k not in attrs and k not in _MODULE_STORES]:
                del m.__dict__[key]
            for key, value in attrs.items():
                if not _same_items(m.__dict__.get(key, _MISSING), value):
                    m.__dict__[key] = value


_MISSING = object()
_MODULE_STORES = frozenset({"_parameters", "_buffers", "_modules"})


def _same_items(now: Any, then: Any) -> bool:
    """Whether ``now`` holds the very items ``then`` does, in containers of the same structure."""
    if now is then:
        return True
    (a, spec_a), (b, spec_b) = pytree.tree_flatten(now), pytree.tree_flatten(then)
    return spec_a == spec_b and all(x is y for x, y in zip(a, b))


def _export_dynamic(model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> torch.export.ExportedProgram:
    def batch_dim(a: Any) -> Any:
        return {0: torch.export.Dim.AUTO} if isinstance(a, torch.Tensor) and a.dim() else None

    if kwargs:  # torch.export takes keyword inputs' specs by parameter name
        bound = inspect.signature(model.forward).bind(*args, **kwargs).arguments
        dyn: Any = {name: pytree.tree_map(batch_dim, value) for name, value in bound.items()}
    else:
        dyn = pytree.tree_map(batch_dim, args)
    with _quiet(), _state_kept(model):
        return torch.export.export(model, args, kwargs or None, dynamic_shapes=dyn, strict=False)


def _data_dependent(exc: BaseException) -> bool:
    """A guard on a tensor's value: no choice of input shapes changes it, so the other attempts would fail alike."""
    return type(exc).__name__ == "GuardOnDataDependentSymNode" or "data-dependent" in str(exc).split("\n", 1)[0]


def _same_structure_values(a: Any, b: Any) -> bool:
    return all(x is y for x, y in zip(pytree.tree_leaves(a), pytree.tree_leaves(b)))


def _same_result(ep: torch.export.ExportedProgram, model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> bool:
    """Whether ``ep`` computes what ``model`` does on ``args`` (same structure, shapes, close values)."""
    try:
        with torch.no_grad():
            want, got = model(*args, **kwargs), ep.module()(*args, **kwargs)
    except Exception:  # a guard of the program refuses these inputs
        return False
    w_leaves, w_spec = pytree.tree_flatten(want)
    g_leaves, g_spec = pytree.tree_flatten(got)
    if w_spec != g_spec:
        return False
    for w, g in zip(w_leaves, g_leaves):
        if isinstance(w, torch.Tensor) != isinstance(g, torch.Tensor):
            return False
        if isinstance(w, torch.Tensor) and (w.shape != g.shape or (w.is_floating_point() and not torch.allclose(
                w, g, rtol=1e-4, atol=1e-5)) or (not w.is_floating_point() and not torch.equal(w, g))):
            return False
    return True


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """torch.export prints the partial graph of a failed capture to stderr; fxq's error says what failed, and the
    graph goes to the debug log."""
    buf = io.StringIO()
    try:
        with contextlib.redirect_stderr(buf):
            yield
    finally:
        if buf.getvalue():
            logger.debug("torch.export wrote:\n%s", buf.getvalue())


def from_exported_program(ep: torch.export.ExportedProgram, name: str = "ExportedProgram") -> fx.GraphModule:
    """A plain ``GraphModule`` of torch-level calls from ``ep``: functional aten ops, no guards, lifted targets,
    readable names. Float modules stay float (BatchNorm appears as ``F.batch_norm`` and is folded later)."""
    try:
        ep = ep.run_decompositions({})  # functional form: no in-place ops, BN in its inference form
    except Exception as exc:  # lift_aten_graph functionalizes what is left
        logger.debug("run_decompositions failed (%s); lifting the program as exported", exc)
    return lift_aten_graph(ep.module(), name)


def is_aten_graph(model: Any) -> bool:
    """Whether ``model`` is a GraphModule of aten ops (``ExportedProgram.module()``), not of torch-level calls."""
    return isinstance(model, fx.GraphModule) and any(
        n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == "aten"
        and n.target not in _CHECKS for n in model.graph.nodes)


def lift_aten_graph(gm: fx.GraphModule, name: str = "ExportedProgram") -> fx.GraphModule:
    """Lift ``gm`` (``ExportedProgram.module()``, in place) to torch-level calls; see the module docstring."""
    graph = gm.graph
    _plain_codegen(gm)
    for node in list(graph.nodes):
        if node.op == "call_module" and str(node.target).startswith("_guards"):
            graph.erase_node(node)
        elif node.op == "call_function" and node.target in _CHECKS and not node.users:
            graph.erase_node(node)
        elif node.op == "call_function" and node.target in _IDENTITIES and node.args:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
    _functionalize(graph)
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in (aten.lstm.input, aten.gru.input):
            from fxq.recurrent.capture import lift_aten_recurrent  # noqa: PLC0415  (recurrent registers on import)

            lift_aten_recurrent(gm, node)
        elif node.target is _BN_NO_TRAINING:
            _lift_batch_norm(graph, node)
        elif node.target is aten.batch_norm.default:
            x, w, b, mean, var, training, momentum, eps = node.args[:8]
            node.target, node.args = F.batch_norm, (x, mean, var, w, b, training, momentum, eps)
        elif node.target in (aten.clamp_min.default, aten.clamp_max.default):  # a clamp with one bound
            bound = "min" if node.target is aten.clamp_min.default else "max"
            node.target, node.args, node.kwargs = torch.clamp, (node.args[0],), {bound: node.args[1]}
        elif node.target is aten.instance_norm.default:  # (x, w, b, mean, var, use_input_stats, momentum, eps, ..)
            x, w, b, mean, var, use_input_stats, momentum, eps = node.args[:8]
            node.target, node.args = F.instance_norm, (x, mean, var, w, b, use_input_stats, momentum, eps)
        elif node.target is aten.embedding.default:  # (weight, ids, padding_idx, ...): F.embedding takes ids first
            padding_idx = _schema_args(node)["padding_idx"]
            node.target, node.args = F.embedding, (node.args[1], node.args[0])
            node.kwargs = {} if padding_idx == -1 else {"padding_idx": padding_idx}
        elif node.target in (aten.slice.Tensor, aten.select.int):
            _lift_indexing(node)
        elif node.target is aten.split.Tensor and isinstance(node.args[1], fx.Node):
            _lift_split(graph, node)
        elif node.target in _WRITES:
            _WRITES[node.target](graph, node)
        elif node.target is torch.sym_float:  # float(n) of a size; a product keeps it a value in the tracer
            node.target, node.args = operator.mul, (node.args[0], 1.0)
        elif node.target in LIFTED:
            lifted = LIFTED[node.target]
            if isinstance(lifted, str):
                node.op = "call_method"
            node.target = lifted
            cap = _ARITY.get(node.target)
            if cap is not None and len(node.args) > cap:  # aten-only trailing flags (layer_norm's cudnn_enable)
                node.args = node.args[:cap]
    _readable_names(graph)
    _batch_norm_modules(gm)
    graph.eliminate_dead_code()
    graph.lint()
    gm = fx.GraphModule(gm, graph, name)  # a plain GraphModule: ep.module()'s refuses eval()/train()
    gm.meta["fxq_source"] = name
    gm.meta["fxq_capture"] = "export"
    fixed = {str(n.target): int(v.shape[0]) for n in graph.nodes if n.op == "placeholder"
             and isinstance(v := n.meta.get("val"), torch.Tensor) and v.dim() and isinstance(v.shape[0], int)}
    if fixed:
        gm.meta[FIXED_BATCH_KEY] = fixed
    return gm


def _schema_args(node: fx.Node) -> dict[str, Any]:
    """An aten node's arguments by name, defaults of its schema included."""
    arguments = node.target._schema.arguments  # type: ignore[union-attr]
    values = {a.name: a.default_value for a in arguments if a.has_default_value()}
    values.update(zip((a.name for a in arguments), node.args))
    values.update(node.kwargs)
    return values


def _lift_indexing(node: fx.Node) -> None:
    """``aten.slice.Tensor(x, dim, start, end, step)`` -> ``x[:, start:end:step]`` and ``aten.select.int(x, dim,
    i)`` -> ``x[:, i]``, as symbolic tracing records indexing: bounds computed from sizes stay values in the
    exported file (aten's are recorded as constants). A slice that takes the whole dim is its input."""
    a = _schema_args(node)
    if node.target is aten.select.int:
        item: Any = a["index"]
    else:
        end = None if isinstance(a["end"], int) and a["end"] >= sys.maxsize else a["end"]
        start, step = (None if a["start"] == 0 else a["start"]), (None if a["step"] == 1 else a["step"])
        if start is None and end is None and step is None:
            node.replace_all_uses_with(a["self"])
            return
        item = slice(start, end, step)
    dim = a["dim"]
    index = (slice(None),) * dim + (item,) if dim >= 0 else (Ellipsis, item) + (slice(None),) * (-dim - 1)
    node.target, node.args, node.kwargs = operator.getitem, (a["self"], index), {}


def _lift_split(graph: fx.Graph, node: fx.Node) -> None:
    """``aten.split.Tensor(x, s, dim)`` with a size ``s`` computed from the batch (``chunk`` of a computed size)
    -> ``torch.split(x, [s, ..., x.size(dim) - s * (k - 1)], dim)``: the ``k`` pieces the program was exported
    with, their sizes values in the exported file (``torch.split`` turns a computed split size into a constant)."""
    a = _schema_args(node)
    x, size, dim = a["self"], a["split_size"], a["dim"]
    k = len(node.meta.get("val") or ())
    if k < 2:
        node.target = torch.split
        return
    with graph.inserting_before(node):
        total = graph.call_method("size", (x, dim))
        before = size if k == 2 else graph.call_function(operator.mul, (size, k - 1))
        last = graph.call_function(operator.sub, (total, before))
    node.target, node.args, node.kwargs = torch.split, (x, [size] * (k - 1) + [last], dim), {}


def _val(node: Any) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _replace(graph: fx.Graph, node: fx.Node, value: fx.Node) -> None:
    node.replace_all_uses_with(value)
    graph.erase_node(node)


def _lift_to_copy(graph: fx.Graph, node: fx.Node) -> None:
    """``aten._to_copy(x, dtype=..., device=...)`` (``mask.to(torch.bool)``) -> ``x.to(dtype=..., device=...)``:
    torch.onnx has no form for ``aten::_to_copy``; a copy to the same dtype and device is ``x`` itself."""
    a = _schema_args(node)
    wanted = {k: a[k] for k in ("dtype", "device") if a.get(k) is not None}
    x = a["self"]
    val = _val(x)
    if val is not None and all(getattr(val, k) == (torch.device(v) if k == "device" else v)
                               for k, v in wanted.items()):
        _replace(graph, node, x)
        return
    node.op, node.target, node.args, node.kwargs = "call_method", "to", (x,), wanted


def _lift_copy(graph: fx.Graph, node: fx.Node) -> None:
    """``aten.copy(dst, src)`` (what ``dst[...] = src`` functionalizes to, before the scatter back) -> ``src``, cast
    to ``dst``'s dtype and broadcast to its shape where they differ; torch.onnx has no form for ``aten::copy``."""
    a = _schema_args(node)
    dst, src = a["self"], a["src"]
    d, s = _val(dst), _val(src)
    if d is not None and s is not None and d.dtype == s.dtype and d.shape == s.shape:
        _replace(graph, node, src)
        return
    with graph.inserting_before(node):
        value = graph.call_method("to", (src, d.dtype)) if d is None or s is None or d.dtype != s.dtype else src
        value = graph.call_method("expand_as", (value, dst))
    value.meta.update(node.meta)
    _replace(graph, node, value)


def _lift_slice_scatter(graph: fx.Graph, node: fx.Node) -> None:
    """``aten.slice_scatter(x, src, dim, start, end, step)`` (``x[:, a:b] = src`` functionalized) -> a ``torch.cat``
    of ``x``'s pieces around ``src`` (Slice + Concat, which every backend has) for a unit step; ``torch.scatter``
    along ``dim`` at ``range(start, end, step)`` otherwise. torch.onnx has no form for ``aten::slice_scatter``."""
    a = _schema_args(node)
    x, src, dim, start, end, step = a["self"], a["src"], a["dim"], a["start"], a["end"], a["step"]
    _scatter_range(graph, node, x, src, dim, start, end, step)


def _lift_select_scatter(graph: fx.Graph, node: fx.Node) -> None:
    """``aten.select_scatter(x, src, dim, i)`` (``x[:, i] = src``) -> the slice scatter of ``src.unsqueeze(dim)``
    at ``i:i+1``."""
    a = _schema_args(node)
    x, src, dim, index = a["self"], a["src"], a["dim"], a["index"]
    val = _val(x)
    if not isinstance(index, int) or val is None:
        return
    dim = dim % val.dim()
    with graph.inserting_before(node):
        piece = graph.call_method("unsqueeze", (src, dim))
    _scatter_range(graph, node, x, piece, dim, index, index + 1 if index != -1 else None, 1)


def _scatter_range(graph: fx.Graph, node: fx.Node, x: fx.Node, src: fx.Node, dim: int, start: Any, end: Any,
                   step: int) -> None:
    val = _val(x)
    if val is None or not all(isinstance(v, int) or v is None for v in (dim, start, end, step)):
        return  # stays aten (and its export names it)
    rank = val.dim()
    dim = dim % rank
    size = val.shape[dim]
    start = 0 if start is None else start
    end = None if end is None or end >= sys.maxsize or (isinstance(size, int) and end >= size) else end
    lead = (slice(None),) * dim
    with graph.inserting_before(node):
        if step == 1:  # the pieces before and after, read with the same (possibly negative) bounds
            before = [graph.call_function(operator.getitem, (x, (*lead, slice(None, start))))] if start else []
            after = [graph.call_function(operator.getitem, (x, (*lead, slice(end, None))))] if end is not None else []
            value = graph.call_function(torch.cat, (before + [src] + after, dim)) if before or after else src
        elif (periodic := _periodic_scatter(graph, x, src, dim, start, end, step)) is not None:
            value = periodic
        else:
            length = size if isinstance(size, int) else graph.call_method("size", (x, dim))
            first = start if start >= 0 else graph.call_function(operator.add, (length, start))
            stop = length if end is None else end if end >= 0 else graph.call_function(operator.add, (length, end))
            shape = [1] * rank
            shape[dim] = -1
            index = graph.call_function(torch.arange, (first, stop, step), {"device": val.device})
            index = graph.call_method("expand_as", (graph.call_method("view", (index, shape)), src))
            value = graph.call_function(torch.scatter, (x, dim, index, src))
    if value is not src:
        value.meta.update(node.meta)
    _replace(graph, node, value)


def _periodic_scatter(graph: fx.Graph, x: fx.Node, src: fx.Node, dim: int, start: int, end: int | None,
                      step: int) -> fx.Node | None:
    """A strided write that hits one position of every period of ``step`` (YOLO pose's ``y[:, 2::3] = ...``:
    every keypoint's score) as Reshape + Slice + Concat: ``dim`` split into ``(periods, step)``, the unit-step write
    at ``start`` of the inner axis, then the shape back. Every backend has those ops (ncnn has no scatter). None
    where the write is not such (sizes computed at run time, a partial last period)."""
    val, src_val = _val(x), _val(src)
    size = val.shape[dim] if val is not None else None
    if src_val is None or not isinstance(size, int) or size % step or not 0 <= start < step:
        return None
    periods = size // step
    if len(range(start, size if end is None else end, step)) != periods:
        return None

    def sizes(v: torch.Tensor, t: fx.Node, split: tuple[int, ...]) -> list[Any]:
        return [n for d, s in enumerate(v.shape) for n in (split if d == dim else (
            s if isinstance(s, int) else graph.call_method("size", (t, d)),))]

    wide = graph.call_method("view", (x, sizes(val, x, (periods, step))))
    piece = graph.call_method("view", (src, sizes(src_val, src, (periods, 1))))
    lead = (slice(None),) * (dim + 1)
    before = [graph.call_function(operator.getitem, (wide, (*lead, slice(None, start))))] if start else []
    after = [graph.call_function(operator.getitem, (wide, (*lead, slice(start + 1, None))))] \
        if start + 1 < step else []
    joined = graph.call_function(torch.cat, (before + [piece] + after, dim + 1))
    return graph.call_method("view", (joined, sizes(val, x, (size,))))


def _lift_fill(graph: fx.Graph, node: fx.Node) -> None:
    """``aten.fill.Scalar(x, v)`` (``x[...] = 0.5``) -> ``torch.full_like(x, v)``. ``aten.fill.Tensor``, as some
    torch releases record the same write (``v`` a lifted 0-d constant), takes the constant's number, so both give
    one graph; a computed ``v`` becomes ``v.type_as(x).expand_as(x)`` (torch.onnx has no ``full_like`` of a
    tensor)."""
    a = _schema_args(node)
    x, value = a["self"], a["value"]
    if isinstance(value, fx.Node):
        constant = _constant_value(graph, value)
        if constant is None:
            with graph.inserting_before(node):
                cast = graph.call_method("type_as", (value, x))
                node.op, node.target, node.args, node.kwargs = "call_method", "expand_as", (cast, x), {}
            return
        value = constant
    node.target, node.args, node.kwargs = torch.full_like, (x, value), {}


def _constant_value(graph: fx.Graph, node: fx.Node) -> bool | int | float | None:
    """The number a stored one-element tensor (``get_attr``, e.g. a lifted constant) holds; None for other values."""
    module = graph.owning_module
    if node.op != "get_attr" or module is None:
        return None
    try:
        value = get_attr_value(module, str(node.target))
    except AttributeError:
        return None
    return value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else None


_RESIZES = {aten.upsample_nearest1d.vec: "nearest", aten.upsample_nearest2d.vec: "nearest",
            aten.upsample_nearest3d.vec: "nearest", aten._upsample_nearest_exact2d.vec: "nearest-exact",
            aten.upsample_linear1d.vec: "linear", aten.upsample_bilinear2d.vec: "bilinear",
            aten.upsample_bicubic2d.vec: "bicubic", aten.upsample_trilinear3d.vec: "trilinear"}
"""aten's resizes (``F.interpolate`` as torch.export records it) and the ``mode`` of each."""


def _lift_resize(graph: fx.Graph, node: fx.Node) -> None:
    """``aten.upsample_<mode>.vec(x, output_size, [align_corners,] scale_factors)`` -> ``F.interpolate(x, size=...,
    scale_factor=..., mode=..., align_corners=...)``, the call every exporter reads a resize from (CrossViT's bicubic
    resize of the image for its second branch had stayed an aten op ncnn's writer did not know)."""
    a = _schema_args(node)
    mode = _RESIZES[node.target]
    kwargs: dict[str, Any] = {"size": a["output_size"], "scale_factor": a["scale_factors"], "mode": mode}
    if "align_corners" in a:
        kwargs["align_corners"] = a["align_corners"]
    if a["scale_factors"] is not None:
        kwargs["recompute_scale_factor"] = False  # aten maps coordinates by the factors themselves
    node.target, node.args, node.kwargs = F.interpolate, (a["input"],), kwargs


_WRITES = {aten._to_copy.default: _lift_to_copy, aten.copy.default: _lift_copy,
           aten.slice_scatter.default: _lift_slice_scatter, aten.select_scatter.default: _lift_select_scatter,
           aten.fill.Scalar: _lift_fill, aten.fill.Tensor: _lift_fill, **dict.fromkeys(_RESIZES, _lift_resize)}
"""aten ops lifted to torch calls that compute the same: casts and indexed writes, which torch.onnx has no form for,
and resizes, which the exporters read as ``F.interpolate``."""


def _functionalize(graph: fx.Graph) -> None:
    """In-place aten ops of the training IR (``relu_``, ``add_``) become their out-of-place overloads; later
    readers of the written tensor read the new node, so the graph computes what it did. Writes into inputs or
    buffers stay as they are (they are state, not arithmetic)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        op = node.target
        if node.op != "call_function" or not isinstance(op, torch._ops.OpOverload) or not op._schema.is_mutable:
            continue
        base = op._schema.name.split("::")[-1]
        written = node.args[0] if node.args else None
        twin = getattr(getattr(aten, base[:-1], None), op._overloadname, None) if base.endswith("_") else None
        if twin is None or not isinstance(written, fx.Node) or written.op in ("placeholder", "get_attr"):
            continue
        node.target = twin
        redirect_later_readers(written, node, node, order)


def _plain_codegen(gm: fx.GraphModule) -> None:
    """Replace ``ep.module()``'s pytree calling convention by plain arguments and the output structure written into
    the output node, so the graph copies into new GraphModules (fxq's passes do) without its ``_in_spec``.

    Nested inputs (a list of feature maps, a dict) keep their structure: one placeholder per argument of the
    model's ``forward`` and ``operator.getitem`` nodes down to each tensor, so the graph takes what the model took.
    """
    codegen = gm.graph._codegen
    pytree_info = getattr(codegen, "pytree_info", None)
    out_spec = getattr(pytree_info, "out_spec", None)
    in_spec = getattr(pytree_info, "in_spec", None)
    gm.graph._codegen = fx.graph.CodeGen()
    if in_spec is not None:
        n = in_spec.num_leaves
        if pytree.tree_unflatten(list(range(n)), in_spec) != (tuple(range(n)), {}) and not _structured_inputs(
                gm.graph, in_spec, list(pytree_info.orig_args)):
            logger.warning("the exported model takes nested inputs (lists, dicts or keywords) fxq cannot rebuild; "
                           "the captured graph takes its %d inputs flattened in order, so give batches as flat "
                           "tuples of tensors", n)
    if out_spec is not None:
        out = next(n for n in gm.graph.nodes if n.op == "output")
        flat = out.args[0]
        out.args = (pytree.tree_unflatten(list(flat) if isinstance(flat, (list, tuple)) else [flat], out_spec),)


def _structured_inputs(graph: fx.Graph, in_spec: pytree.TreeSpec, arg_names: list[str]) -> bool:
    """Turn the flat leaf placeholders back into the ``forward`` arguments they came from (``in_spec``: the
    ``(args, kwargs)`` structure), reading each leaf with ``getitem``; False (graph untouched) for containers other
    than lists, tuples and dicts."""
    leaves = [n for n in graph.nodes if n.op == "placeholder"]
    args, kwargs = pytree.tree_unflatten(list(range(in_spec.num_leaves)), in_spec)
    if len(leaves) != in_spec.num_leaves or len(arg_names) != len(args) + len(kwargs):
        return False
    tops = arg_names[: len(args)] + list(kwargs)
    routes = []  # per leaf: (index of its top-level argument, keys below it)
    for path, _ in pytree.tree_flatten_with_path((args, kwargs))[0]:
        keys = []
        for key in path[2:]:
            if isinstance(key, pytree.SequenceKey):
                keys.append(key.idx)
            elif isinstance(key, pytree.MappingKey):
                keys.append(key.key)
            else:
                return False
        top = path[1].idx if path[0].idx == 0 else len(args) + list(kwargs).index(path[1].key)
        routes.append((top, keys))
    groups: dict[int, list[tuple[fx.Node, list]]] = {}
    for leaf, (top, keys) in zip(leaves, routes):
        groups.setdefault(top, []).append((leaf, keys))
    gone = []
    for top, members in groups.items():
        if len(members) == 1 and not members[0][1]:  # a tensor given as is: its leaf is the argument
            leaf = members[0][0]
            leaf.target = tops[top]
            if leaf.name != tops[top]:
                leaf._rename(tops[top])
            continue
        for leaf, _ in members:
            leaf._rename(f"{leaf.name}_leaf")
        with graph.inserting_before(members[0][0]):  # in the forward's order, names as the forward's
            placeholder = graph.placeholder(tops[top])
        with graph.inserting_before(leaves[-1].next):
            for leaf, keys in members:
                value = placeholder
                for key in keys:
                    value = graph.call_function(operator.getitem, (value, key))
                value.meta.update(leaf.meta)
                leaf.replace_all_uses_with(value)
                gone.append(leaf)
    for leaf in gone:
        graph.erase_node(leaf)
    return True


_BN_CLASSES = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}


def _batch_norm_modules(gm: fx.GraphModule) -> None:
    """``F.batch_norm`` over one holder's ``running_mean/var, weight, bias`` becomes a call of a real BatchNorm module
    at that path, as symbolic tracing gives: folding treats both alike, and with ``fold_bn=False`` QAT trains it
    with batch statistics (``fxq.freeze_bn`` finds it)."""
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not F.batch_norm or len(node.args) != 8:
            continue
        x, mean, var, w, b, training, momentum, eps = node.args
        stats = (mean, var, w, b)
        if not all(isinstance(a, fx.Node) and a.op == "get_attr" for a in stats) or any(len(a.users) != 1 for a in stats):
            continue
        owners = {str(a.target).rpartition(".")[0] for a in stats}
        names = [str(a.target).rpartition(".")[2] for a in stats]
        val = getattr(x, "meta", {}).get("val")
        owner = next(iter(owners))
        if len(owners) != 1 or not owner or names != ["running_mean", "running_var", "weight", "bias"] or \
                not isinstance(val, torch.Tensor) or val.dim() not in _BN_CLASSES:
            continue
        holder = gm.get_submodule(owner)
        if set(dict(holder.named_children())):  # not a plain holder of this BatchNorm's tensors
            continue
        bn = _BN_CLASSES[val.dim()](holder.running_mean.numel(), eps=float(eps), momentum=momentum)
        with torch.no_grad():
            bn.running_mean.copy_(holder.running_mean)
            bn.running_var.copy_(holder.running_var)
            bn.weight.copy_(holder.weight)
            bn.bias.copy_(holder.bias)
        bn.train(training is not False)
        gm.add_submodule(owner, bn)
        with gm.graph.inserting_before(node):
            call = gm.graph.call_module(owner, (x,))
        call.meta.update(node.meta)
        node.replace_all_uses_with(call)
        name = node.name
        gm.graph.erase_node(node)
        for a in stats:
            gm.graph.erase_node(a)
        reuse_node_name(call, name)


def _lift_batch_norm(graph: fx.Graph, node: fx.Node) -> None:
    """``_native_batch_norm_legit_no_training(x, w, b, mean, var, momentum, eps)[0]`` -> ``F.batch_norm``."""
    users = list(node.users)
    if any(u.target is not operator.getitem for u in users) or any(u.args[1] != 0 for u in users if u.users):
        return
    x, w, b, mean, var, momentum, eps = node.args
    with graph.inserting_before(node):
        bn = graph.call_function(F.batch_norm, (x, mean, var, w, b, False, momentum, eps))
    bn.meta.update(node.meta)
    for u in users:
        if u.args[1] == 0:
            u.replace_all_uses_with(bn)
        graph.erase_node(u)
    graph.erase_node(node)


def _module_path(node: fx.Node) -> tuple[str, type | str] | None:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    path, cls = list(stack.values())[-1]
    if str(path).startswith("_"):  # torch's placeholder entries (``_empty_nn_module_stack_from_metadata_hook``)
        return None
    return str(path), cls


def _readable_names(graph: fx.Graph) -> None:
    """Name nodes after the module they ran in (``layer1_0_conv1``; ``layer1_0_add`` for the block's own ops), as
    symbolic tracing does; weighted ops record that module in ``meta["module_path"]``."""
    claimed: set[str] = set()
    for node in graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        found = _module_path(node)
        if found is None or not found[0]:
            continue
        path = found[0]
        op = getattr(node.target, "__name__", None) or str(node.target).split(".")[-2]
        base = path.replace(".", "_") if path not in claimed and _is_module_op(node, found[1]) else \
            f"{path.replace('.', '_')}_{op.strip('_')}"
        claimed.add(path)
        if node.target in WEIGHTED_FUNCTIONS:
            node.meta["module_path"] = path
        candidate = "".join(c if c.isalnum() or c == "_" else "_" for c in base)
        if candidate and candidate != node.name:
            node._rename(candidate)


_MODULE_OPS = {
    "Conv": (F.conv1d, F.conv2d, F.conv3d), "ConvTranspose": (F.conv_transpose1d, F.conv_transpose2d,
                                                              F.conv_transpose3d),
    "Linear": (F.linear,), "BatchNorm": (F.batch_norm,), "ReLU": (torch.relu,), "MaxPool": (F.max_pool1d,
                                                                                          F.max_pool2d),
}


def _is_module_op(node: fx.Node, cls: Any) -> bool:
    """``node`` is the op its (leaf) module stands for: a conv in a ``Conv2d``, not an add in a ``BasicBlock``."""
    cls_name = cls.__name__ if isinstance(cls, type) else str(cls).rsplit(".", 1)[-1]
    def plain(name: str) -> str:
        return name.replace("_", "").lower()

    return any(cls_name.startswith(k) and node.target in fns for k, fns in _MODULE_OPS.items()) or \
        plain(cls_name) == plain(getattr(node.target, "__name__", ""))
