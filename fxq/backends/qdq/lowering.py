"""Marked GraphModule -> ONNX ``ModelProto`` (TorchScript exporter, in memory), then name marks resolved.

After :func:`lower`, the graph holds only standard ONNX nodes plus the quant marks (``fxq.Mark``), every
marked value carries its wanted name (the fx node name, or the tensor name of the ONNX file the model came
from), graph inputs/outputs are named, and :class:`Lowered` says which ONNX tensor each fx node became.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import os
import re
import sys
import tempfile
import threading
import warnings
from typing import Any, Iterator, Sequence

import onnx
import torch
from torch import fx

from fxq import onnx_data
from fxq.backends.qdq.common import fold_initializer_identities
from fxq.backends.qdq.marking import (
    MARK_DOMAIN,
    MARK_OP,
    Mark,
    MarkedModule,
    freeze_quant_mark_inputs,
    mark_sizes,
    mark_sizes_while_exporting,
)
from fxq.backends.qdq.onnx_graph import (
    all_tensor_names,
    attr,
    outer_reads,
    producers,
    rename_outer_reads,
    rename_tensors,
    unique_name,
)
from fxq.errors import ExportError
from fxq.graph.data import example_value
from fxq.graph.export_capture import FIXED_BATCH_KEY
from fxq.graph.nodes import eval_mode, value_read_nodes
from fxq.io import write_error

__all__ = ["Lowered", "OpsetTooLow", "lower", "example_inputs_for", "dynamic_axes_for", "mark_nodes",
           "torch_onnx_export"]

logger = logging.getLogger(__name__)

_TORCH_ONNX_LOCK = threading.Lock()
"""torch.onnx's TorchScript exporter keeps process-wide state (``GLOBALS``: opset, in-export flag) and
``warnings.catch_warnings`` is process-wide too: two threads exporting at once fail inside torch, so they take turns."""


@dataclasses.dataclass
class Lowered:
    """An exported ONNX model whose only non-standard nodes are quant marks."""

    model: onnx.ModelProto
    marked: MarkedModule
    tensor_of: dict[str, str]  # fx node name -> ONNX tensor name
    opset: int
    fx_of_onnx_node: dict[str, str] = dataclasses.field(default_factory=dict)  # ONNX node name -> fx node name


def example_inputs_for(gm: fx.GraphModule, example_inputs: Any = None) -> tuple:
    """Inputs for tracing the export: the user's, or tensors shaped like the calibration batch (random floats; its
    own values for non-float inputs, :func:`fxq.graph.data.record_example_values`)."""
    if example_inputs is not None:
        if isinstance(example_inputs, torch.Tensor):
            return (example_inputs,)
        if isinstance(example_inputs, dict):
            return tuple(example_inputs.values())
        return tuple(example_inputs)
    gen = torch.Generator().manual_seed(0)
    args = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise ExportError(
                f"input {node.name!r} has no recorded shape (node.meta['val']); pass example_inputs=... to export"
            )
        shape, dtype = tuple(val.shape), val.dtype
        if dtype.is_floating_point:
            args.append(torch.randn(shape, generator=gen).to(dtype))
        else:  # a shape, sizes or indices: the calibration example's values, zeros where none was kept
            kept = example_value(gm, node, shape, dtype)
            args.append(kept if kept is not None else torch.zeros(shape, dtype=dtype))
    device = next((p.device for p in gm.parameters()), torch.device("cpu"))
    return tuple(a.to(device) for a in args)


def dynamic_axes_for(gm: fx.GraphModule, input_names: Sequence[str], output_names: Sequence[str],
                     dynamic_batch: bool) -> dict[str, dict[int, str]] | None:
    """Dynamic axes: the source ONNX file's symbolic and unknown input dims, and axis 0 when ``dynamic_batch``.

    The file's dims (``source_input_shapes``) count, not the shapes it was loaded or calibrated at. A dim name
    that is an identifier is kept (shared across inputs); others (``"-1"``, ``"?"``, none) get ``<input>_dim<i>``.
    Outputs the file declares with named dims (``source_output_shapes``: ``logits [batch, 1000]``) keep those names.
    """
    axes: dict[str, dict[int, str]] = {}
    meta = gm.meta.get("onnx") if isinstance(getattr(gm, "meta", None), dict) else None
    meta = meta if isinstance(meta, dict) else {}
    shapes = meta.get("source_input_shapes") or meta.get("input_shapes") or {}
    for name in input_names:
        dims = shapes.get(name) or []
        sym = {i: (d if d.isidentifier() else f"{name}_dim{i}") if isinstance(d, str) and d else f"{name}_dim{i}"
               for i, d in enumerate(dims) if not (isinstance(d, int) and d > 0)}
        if sym:
            axes[name] = sym
    out_shapes = meta.get("source_output_shapes") or {}
    for name in output_names:
        named = {i: d for i, d in enumerate(out_shapes.get(name) or []) if isinstance(d, str) and d.isidentifier()}
        if named and axes:  # only where some input dim is dynamic too
            axes[name] = named
    if dynamic_batch:
        fixed = gm.meta.get(FIXED_BATCH_KEY) if isinstance(getattr(gm, "meta", None), dict) else None
        if fixed:
            shown = ", ".join(f"{k!r} at batch {v}" for k, v in fixed.items())
            raise ExportError(f"dynamic_batch=True: torch.export captured this model with a fixed batch ({shown}): "
                              "its code depends on the batch size, so a file with a dynamic batch would compute "
                              "the example's batch at every size. Fix: export with dynamic_batch=False (the file "
                              "runs at that batch), or make the model's code independent of the batch size")
        for name in input_names:
            axes.setdefault(name, {})[0] = "batch"
        for name in output_names:
            axes.setdefault(name, {})[0] = "batch"
    return axes or None


_UNSUPPORTED = re.compile(r"Exporting the operator '?([\w:.]+)'? to ONNX opset version (\d+) is not supported")
_ADDED_IN = re.compile(r"added in (?:opset )?version (\d+)")


class OpsetTooLow(ExportError):
    """torch.onnx expresses an op of the model only from a newer opset (``needed``), which it names."""

    def __init__(self, message: str, needed: int) -> None:
        super().__init__(message)
        self.needed = needed


def _max_torchscript_opset() -> int:
    from torch.onnx import _constants  # private, but the only place torch says what its exporter supports

    return int(getattr(_constants, "ONNX_TORCHSCRIPT_EXPORTER_MAX_OPSET", 17))


def _sizes_as_tensor(g: Any, sizes: Any) -> Any:
    """A list of traced sizes (``prim::ListConstruct``) as the 1-D int64 tensor an ONNX op reads; a tensor as it is."""
    from torch.onnx import symbolic_helper

    if not symbolic_helper._is_packed_list(sizes):
        return sizes
    one = g.op("Constant", value_t=torch.tensor([1], dtype=torch.int64))
    return g.op("Concat", *[symbolic_helper._reshape_helper(g, v, one) for v in symbolic_helper._unpack_list(sizes)],
                axis_i=0)


def _col2im_symbolic(g: Any, input: Any, output_size: Any, kernel_size: Any, dilation: Any, padding: Any,
                     stride: Any) -> Any:
    """``aten::col2im`` (``F.fold``) as ONNX ``Col2Im``, its output size computed at run time or not.

    torch's own symbolic (torch 2.14) reads the spatial rank off ``output_size``'s static shape, which a list of
    traced sizes has not: timm's VOLO folds to ``(H, W)`` read from its input, and its export failed with
    "'NoneType' object is not subscriptable". The rank is the length of ``dilation`` (``F.fold`` always gives it).
    ONNX's pads are all the dims' begins, then their ends (torch's symbolic wrote ``[ph, ph, pw, pw]``).
    """
    from torch.onnx import symbolic_helper

    dilation, padding, stride = (symbolic_helper._get_const(v, "is", name) for v, name in
                                 ((dilation, "dilation"), (padding, "padding"), (stride, "stride")))
    return g.op("Col2Im", input, _sizes_as_tensor(g, output_size), _sizes_as_tensor(g, kernel_size),
                dilations_i=list(dilation), pads_i=list(padding) * 2, strides_i=list(stride))  # begins, then ends


@contextlib.contextmanager
def _native_stdout_held() -> Iterator[io.BytesIO]:
    """Hold what native code prints to the process's stdout (file descriptor 1) while torch.onnx exports; the caller
    gets it in the yielded buffer once the block ends.

    torch 2.14's exporter turns its ONNX log on for every export (``setup_onnx_logging`` tests the function
    ``_jit_is_onnx_log_enabled`` for truth instead of calling it), so a failed export prints its whole TorchScript
    graph, thousands of lines for a transformer. fxq retries such an export at the opset torch.onnx names, and the
    user would see a dump for a failure fxq handled. What another thread prints meanwhile is held too: replayed
    after a successful export, in the debug log after a failed one."""
    held = io.BytesIO()
    stdout_fd = 1  # C's stdout, whatever Python's sys.stdout is (pytest and notebooks replace that)
    _flush_python_stdout()
    try:
        saved = os.dup(stdout_fd)
    except OSError:  # no descriptor 1 (a process without a console): nothing to hold
        saved = None
    if saved is None:
        yield held
        return
    try:
        with tempfile.TemporaryFile() as sink:
            os.dup2(sink.fileno(), stdout_fd)
            try:
                yield held
            finally:
                _flush_python_stdout()
                _flush_c_stdio()
                os.dup2(saved, stdout_fd)
                sink.seek(0)
                held.write(sink.read())
    finally:
        os.close(saved)


def _flush_python_stdout() -> None:
    if sys.stdout is not None:
        sys.stdout.flush()


def _replay(printed: bytes) -> None:
    """Print what a successful export printed, where Python's stdout goes (nowhere when there is none)."""
    if printed and sys.stdout is not None:
        sys.stdout.write(printed.decode(errors="replace"))


def _flush_c_stdio() -> None:
    """Flush C's stdio buffers, where native code's prints wait."""
    try:
        import ctypes

        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError, TypeError):  # no C library to ask (Windows: CDLL(None) is a TypeError)
        pass


def _cumsum_symbolic(g: Any, input: Any, dim: Any, dtype: Any = None) -> Any:
    """``aten::cumsum`` as ONNX ``CumSum`` of the dtype torch's result has: torch sums a bool or integer input as
    int64, while torch's symbolic (torch 2.14) passed it on as it is, and ONNX's CumSum takes no bool: HF GPT-2's
    ``(position_ids.diff() != 1).cumsum(-1)`` wrote a file onnxruntime refused to load."""
    from torch.onnx import symbolic_helper
    from torch.onnx._internal.torchscript_exporter import _type_utils

    dim = symbolic_helper._get_const(dim, "i", "dim")
    if symbolic_helper._is_none(dtype):
        kind = _type_utils.JitScalarType.from_value(input, _type_utils.JitScalarType.UNDEFINED)
        floating = kind in (_type_utils.JitScalarType.FLOAT, _type_utils.JitScalarType.DOUBLE,
                            _type_utils.JitScalarType.HALF, _type_utils.JitScalarType.BFLOAT16)
        target = None if floating or kind == _type_utils.JitScalarType.UNDEFINED else _type_utils.JitScalarType.INT64
    else:
        target = _type_utils.JitScalarType(symbolic_helper._get_const(dtype, "i", "dtype"))
    x = input if target is None else g.op("Cast", input, to_i=target.onnx_type())
    return g.op("CumSum", x, g.op("Constant", value_t=torch.tensor(dim, dtype=torch.int64)))


_OWN_SYMBOLICS = {"aten::col2im": (_col2im_symbolic, 18), "aten::cumsum": (_cumsum_symbolic, 11)}
"""Symbolics fxq's exports use in place of torch's: ``{op: (function, first opset)}``, registered only while fxq
exports and only where the user registered none of their own."""


@contextlib.contextmanager
def _own_symbolics():
    """Register :data:`_OWN_SYMBOLICS` for the duration of one export (under :data:`_TORCH_ONNX_LOCK`)."""
    registered = []
    for name, (fn, opset) in _OWN_SYMBOLICS.items():
        if _user_registered(name, opset):
            continue
        torch.onnx.register_custom_op_symbolic(name, fn, opset)
        registered.append((name, opset))
    try:
        yield
    finally:
        for name, opset in registered:
            torch.onnx.unregister_custom_op_symbolic(name, opset)


def _user_registered(name: str, opset: int) -> bool:
    """Whether the symbolic torch.onnx would use for ``name`` at ``opset`` is someone's own rather than torch's."""
    try:
        from torch.onnx._internal.torchscript_exporter import registration  # private: a later torch may move it
        group = registration.registry.get_function_group(name)
        fn = group.get(opset) if group is not None else None
    except Exception:  # noqa: BLE001 - without the registry, fxq's symbolic goes in (torch's fails on VOLO)
        return False
    return fn is not None and not str(getattr(fn, "__module__", "")).startswith("torch.onnx")


@contextlib.contextmanager
def _opset_visible_to_onnx2torch(opset: int):
    """Let onnx2torch's modules read the opset of the running export.

    onnx2torch (1.5.15) modules with their own ONNX form (Gather, Shape, Squeeze, Reduce*, ScatterND, NMS...)
    ask ``torch.onnx.symbolic_helper`` for it: ``GLOBALS.export_onnx_opset_version``, else the legacy
    ``_export_onnx_opset_version``. Which module onnx2torch bound depends on import order: after ``import
    torchvision`` it is torch's public shim, which has neither, and every export of such a model failed. While
    fxq exports (under :data:`_TORCH_ONNX_LOCK`), the shim gets the legacy attribute; afterwards it is removed.
    """
    from torch.onnx import symbolic_helper

    if hasattr(symbolic_helper, "GLOBALS") or hasattr(symbolic_helper, "_export_onnx_opset_version"):
        yield
        return
    symbolic_helper._export_onnx_opset_version = opset
    try:
        yield
    finally:
        del symbolic_helper._export_onnx_opset_version


def _export(marked: MarkedModule, args: tuple, opset: int, dynamic_axes: dict | None) -> onnx.ModelProto:
    """torch.onnx (TorchScript exporter) at ``opset``, or at its highest opset and then onnx's version converter."""
    export_opset = min(opset, _max_torchscript_opset())
    # torch.onnx refuses some names (an all-digit one like '536', which torch.onnx itself gives unnamed outputs):
    # export under safe stand-ins, then give the graph the names the model wants
    io_names = {f"fxq_input_{i}": name for i, name in enumerate(marked.input_names)}
    io_names.update({f"fxq_output_{i}": name for i, name in enumerate(marked.output_names)})
    stand_in = {name: key for key, name in io_names.items()}
    if dynamic_axes:
        dynamic_axes = {stand_in.get(k, k): v for k, v in dynamic_axes.items()}
    model = _torch_export_loaded(marked, args, export_opset, dynamic_axes)
    _restore_io_names(model.graph, io_names)
    if export_opset < opset:
        try:
            model = onnx_data.convert_version(model, opset)
        except Exception as exc:
            raise ExportError(f"torch.onnx writes opset {export_opset} at most and onnx's version converter could "
                              f"not take the model to opset {opset} ({exc}); pass opset={export_opset} or lower"
                              ) from exc
        logger.info("exported at opset %d and converted to opset %d", export_opset, opset)
    return model


def _torch_export_loaded(marked: MarkedModule, args: tuple, export_opset: int,
                         dynamic_axes: dict | None) -> onnx.ModelProto:
    """:func:`_torch_export` into a temporary file, loaded. A file, not a buffer: torch.onnx then writes its
    serialized model straight to disk (a buffer holds one more copy of the weights beside the parsed model), and a
    model over protobuf's limit needs a path anyway (external data beside it). Where the temporary folder cannot
    take the file (full, ``ulimit -f``), a model under that limit is exported in memory instead."""
    try:
        with tempfile.TemporaryDirectory(prefix="fxq-onnx-") as folder:
            target = os.path.join(folder, "model.onnx")
            _torch_export(marked, args, export_opset, dynamic_axes, target)
            return onnx.load(target)
    except OSError as exc:
        if _tensor_bytes(marked.module) > onnx_data.EXTERNAL_DATA_THRESHOLD:
            raise write_error(exc.filename or tempfile.gettempdir(), exc, what="writing torch.onnx's temporary "
                              "file (set TMPDIR to a folder with room) at") from exc
        logger.info("torch.onnx could not write its temporary file (%s): exporting in memory", exc)
    buffer = io.BytesIO()
    _torch_export(marked, args, export_opset, dynamic_axes, buffer)
    return onnx.load_from_string(buffer.getvalue())


def _tensor_bytes(module: torch.nn.Module) -> int:
    """Bytes of the module's distinct parameters and buffers (about what torch.onnx writes as initializers)."""
    seen: dict[int, int] = {}
    for t in list(module.parameters()) + list(module.buffers()):
        seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())


def _torch_export(marked: MarkedModule, args: tuple, export_opset: int, dynamic_axes: dict | None,
                  target: Any) -> None:
    """torch.onnx's TorchScript exporter over the marked module, with stand-in input / output names."""
    torch_onnx_export(marked.module, args, target, opset=export_opset,
                      input_names=[f"fxq_input_{i}" for i in range(len(marked.input_names))],
                      output_names=[f"fxq_output_{i}" for i in range(len(marked.output_names))],
                      dynamic_axes=dynamic_axes, custom_opsets={MARK_DOMAIN: 1})


def torch_onnx_export(module: torch.nn.Module, args: tuple, target: Any, *, opset: int, input_names: Sequence[str],
                      output_names: Sequence[str], dynamic_axes: dict | None = None,
                      custom_opsets: dict[str, int] | None = None) -> None:
    """torch.onnx's TorchScript exporter (``dynamo=False``: it records the branches the example takes), in eval
    mode, into ``target`` (a file path or a buffer), one export at a time
    (:data:`_TORCH_ONNX_LOCK`).

    Raises:
        ExportError: torch.onnx fails, naming the op (and its fx nodes when ``module`` is a GraphModule).
    """
    printed = io.BytesIO()
    try:
        with eval_mode(module), _TORCH_ONNX_LOCK, _opset_visible_to_onnx2torch(opset), _own_symbolics(), \
                warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            with _native_stdout_held() as printed:
                torch.onnx.export(
                    module, args, target, dynamo=False, opset_version=opset, input_names=list(input_names),
                    output_names=list(output_names), dynamic_axes=dynamic_axes, do_constant_folding=True,
                    custom_opsets=custom_opsets or {},
                )
        _replay(printed.getvalue())  # an export that succeeded prints what it printed
    except (ExportError, OSError):  # OSError: writing ``target`` failed, the caller knows that file
        raise
    except Exception as exc:  # torch.onnx raises many types; name the op when it says which
        logger.debug("torch.onnx failed; it printed:\n%s", printed.getvalue().decode(errors="replace"),
                     exc_info=True)
        m = _UNSUPPORTED.search(str(exc))
        # torch's C++ errors carry the whole partial ONNX graph: the first lines say what failed
        what = f"the model ({type(exc).__name__}: {_head(str(exc))})"
        if m:
            short = m.group(1).split("::")[-1]
            graph = module.graph.nodes if isinstance(module, fx.GraphModule) else ()
            nodes = [n.name for n in graph if short in (getattr(n.target, "__name__", None), str(n.target))]
            where = f" (fx node {', '.join(map(repr, nodes[:3]))})" if nodes else ""
            what = f"op {m.group(1)!r}{where} at opset {m.group(2)}"
            added = _ADDED_IN.search(str(exc))
            if added and int(added.group(1)) > opset:
                needed = int(added.group(1))
                raise OpsetTooLow(f"torch.onnx cannot express {what}: it writes that op from opset {needed}. Fix: "
                                  f"pass opset={needed} (or higher)", needed) from exc
        raise ExportError(
            f"torch.onnx cannot express {what}, and says of no opset that can. Fix: register a symbolic with "
            f"torch.onnx.register_custom_op_symbolic, or move that op out of the exported model (compute it "
            f"after the deployed file runs)"
        ) from None  # the cause (with torch's partial graph) is in the debug log


def _head(text: str, lines: int = 4, limit: int = 600) -> str:
    """The start of an error's text (torch.onnx's C++ errors end with the partial graph, thousands of lines)."""
    head = "\n".join(text.split("ONNX graph being constructed", 1)[0].strip().splitlines()[:lines])
    return head if len(head) <= limit else head[:limit] + "..."


def _restore_io_names(graph: onnx.GraphProto, io_names: dict[str, str]) -> None:
    """Rename the stand-in input/output names to the wanted ones; an internal tensor that torch.onnx happened to
    give a wanted name (torch numbers its intermediates: '8') moves aside first."""
    present = all_tensor_names(graph)
    wanted = {name for stand, name in io_names.items() if stand in present}
    used = present | wanted
    aside = {name: unique_name(f"{name}_", used) for name in wanted & present if name not in io_names}
    rename_tensors(graph, aside)
    rename_tensors(graph, {stand: name for stand, name in io_names.items() if stand in present})
    for value in list(graph.input) + list(graph.output):  # dims torch.onnx named after a stand-in or a mark
        for i, dim in enumerate(value.type.tensor_type.shape.dim):
            if dim.dim_param and any(key in dim.dim_param for key in (*io_names, MARK_OP)):
                dim.dim_param = f"{value.name}_dim{i}"


def mark_nodes(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    return [n for n in graph.node if n.domain == MARK_DOMAIN and n.op_type == MARK_OP]


def _resolve_names(model: onnx.ModelProto, marked: MarkedModule) -> tuple[dict[str, str], dict[str, str]]:
    graph = model.graph
    g_inputs = {i.name for i in graph.input}
    g_outputs = {o.name for o in graph.output}
    inits = {t.name for t in graph.initializer}
    used = all_tensor_names(graph)
    alias: dict[str, str] = {}
    rename: dict[str, str] = {}
    node_names: dict[str, Mark] = {}  # ONNX tensor (final name) -> the name mark naming its producer
    identities: list[onnx.NodeProto] = []
    fx_tensor: dict[str, str] = {}  # fx node -> ONNX tensor (pre-rename names)

    def resolve(name: str) -> str:
        while name in alias:
            name = alias[name]
        return name

    keep = []
    for node in graph.node:
        mark = marked.marks.get(int(attr(node, "id", -1))) if node.domain == MARK_DOMAIN else None
        if mark is None or mark.kind != "name":
            keep.append(node)
            continue
        x, y = resolve(node.input[0]), node.output[0]
        fixed = x in g_inputs or x in inits or x in g_outputs or x in rename
        if y in g_outputs:
            if fixed:
                identities.append(onnx.helper.make_node("Identity", [x], [y], name=f"{y}_Identity"))
                fx_tensor[mark.fx_node] = x
            else:
                rename[x] = y
                fx_tensor[mark.fx_node] = y
                node_names[y] = mark
            continue
        alias[y] = x
        if not fixed and mark.tensor_name:
            used.discard(x)
            new = unique_name(mark.tensor_name, used)
            rename[x] = new
            fx_tensor[mark.fx_node] = new
            node_names[new] = mark
        else:
            fx_tensor[mark.fx_node] = rename.get(x, x)
    del graph.node[:]
    graph.node.extend(keep)
    for node in graph.node:
        for i, name in enumerate(node.input):
            node.input[i] = resolve(name)
    rename_outer_reads(graph, {name: resolve(name) for name in outer_reads(graph) if resolve(name) != name})
    rename_tensors(graph, rename)
    graph.node.extend(identities)
    # parameters: the source file's initializer names
    init_names = {t.name for t in graph.initializer}
    used = all_tensor_names(graph)
    param_map = {}
    for target, wanted in marked.param_names.items():
        if target in init_names and wanted not in used:
            param_map[target] = wanted
            used.add(wanted)
    rename_tensors(graph, param_map)
    # producer nodes get the fx (or source ONNX) node names
    taken = {n.name for n in graph.node}
    prod = producers(graph)
    fx_of_node: dict[str, str] = {}
    for tensor, mark in node_names.items():
        node = prod.get(tensor)
        if node is None:
            continue
        if mark.node_name and node.name != mark.node_name:
            taken.discard(node.name)
            node.name = unique_name(mark.node_name, taken)
        fx_of_node[node.name] = mark.fx_node
    # fx nodes -> final tensor names (placeholders included)
    for fx_name, onnx_name in zip([n.name for n in marked.module.graph.nodes if n.op == "placeholder"],
                                  marked.input_names):
        fx_tensor.setdefault(fx_name, onnx_name)
    for node in marked.module.graph.nodes:
        if node.op == "get_attr":
            name = param_map.get(str(node.target), str(node.target))
            if name in {t.name for t in graph.initializer}:
                fx_tensor.setdefault(node.name, name)
    return fx_tensor, fx_of_node


def _export_at_needed_opset(marked: MarkedModule, args: tuple, opset: int, dynamic_axes: dict | None,
                            raise_opset: bool) -> tuple[onnx.ModelProto, int]:
    """:func:`_export` at ``opset``, or, with ``raise_opset``, at the opset torch.onnx says an op of the model
    needs (RAFT's ``grid_sampler``: 16); returns the model and its opset."""
    while True:
        try:
            return _export(marked, args, opset, dynamic_axes), opset
        except OpsetTooLow as exc:
            if not raise_opset or exc.needed <= opset:  # torch.onnx's own limit: converting up did not help
                raise
            logger.info("%s: exporting at opset %d", exc, exc.needed)
            opset = exc.needed


def _shape_only_marks(marked: MarkedModule, ids: set[int]) -> set[int]:
    """The marks of ``ids`` on values the model reads for their shape only (``torch.full_like(x[..., -3:], v)``):
    torch.onnx folds such reads to constants and drops the values, which loses nothing."""
    live = value_read_nodes(marked.module.graph)
    return {mark.id for node in marked.module.graph.nodes
            if isinstance(mark := node.meta.get("fxq_export_mark"), Mark) and mark.id in ids and node not in live}


def lower(marked: MarkedModule, args: tuple, opset: int, dynamic_axes: dict | None = None, *,
          raise_opset: bool = False) -> Lowered:
    """Export ``marked`` with torch.onnx at ``opset`` and resolve its name marks.

    With ``raise_opset`` (the user gave no opset) an op that torch.onnx writes only from a newer opset raises it;
    :attr:`Lowered.opset` is the one written. Quant marks that torch.onnx folded away with a constant value are
    fed from buffers and the model is exported again
    (:func:`~fxq.backends.qdq.marking.freeze_quant_mark_inputs`), so every quantizer of the simulation has its
    Q/DQ in the file. The marks' values keep the dims that follow ``dynamic_axes`` dynamic
    and every other dim static (:func:`~fxq.backends.qdq.marking.mark_sizes`, probed once for every torch.onnx run
    here).
    """
    with mark_sizes_while_exporting(mark_sizes(marked, args, dynamic_axes)):
        model, opset = _export_at_needed_opset(marked, args, opset, dynamic_axes, raise_opset)
        present = {int(attr(n, "id", -1)) for n in mark_nodes(model.graph)}
        lost = {i for i, m in marked.marks.items() if m.kind == "quant" and i not in present}
        lost -= _shape_only_marks(marked, lost)
        if lost:
            names = freeze_quant_mark_inputs(marked, lost, args)
            logger.info("torch.onnx folded %d quantized value(s) computed only from constants and shapes (%s): "
                        "exported again with them as initializers, quantized as fxq simulates them", len(names),
                        ", ".join(names[:5]) + (" ..." if len(names) > 5 else ""))
            model = _export(marked, args, opset, dynamic_axes)
            still = sorted(lost - {int(attr(n, "id", -1)) for n in mark_nodes(model.graph)})
            if still:  # not folding after all (e.g. a value torch.onnx dropped as unused): say so, never silently
                logger.warning("the exported file has no Q/DQ for quantizer(s) %s: torch.onnx dropped the values "
                               "they quantize", ", ".join(repr(marked.marks[i].quantizer) for i in still))
    fold_initializer_identities(model.graph)
    tensor_of, fx_of_node = _resolve_names(model, marked)
    return Lowered(model, marked, tensor_of, opset, fx_of_node)
