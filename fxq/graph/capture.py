"""One way into fxq for every model: symbolic tracing, ``torch.export``, and FP32 islands when neither reaches a part.

``capture="auto"`` (the default) tries ``torch.fx`` symbolic tracing first (its graphs keep module calls and are
what fxq was built on), then ``torch.export`` (aten graphs lifted to the same torch-level calls), then symbolic
tracing again with each submodule that fails kept whole as an FP32 *island*, innermost first. When all of that
fails, one :class:`~fxq.errors.TraceError` lists, per path, the first construct that failed and where.
"""
from __future__ import annotations

import copy
import inspect
import logging
import re
from typing import Any, Iterable

import torch
from torch import fx, nn

from fxq.errors import ConfigError, TraceError
from fxq.graph.export_capture import export_program, from_exported_program, is_aten_graph, lift_aten_graph
from fxq.graph.nodes import get_attr_value
from fxq.graph.trace import failure_line, trace

__all__ = ["capture", "CAPTURE_PATHS", "ISLANDS_KEY"]

logger = logging.getLogger(__name__)

CAPTURE_PATHS = ("auto", "fx", "export")
ISLANDS_KEY = "fxq_fp32_islands"
"""``gm.meta[ISLANDS_KEY]``: ``{module path: why it stayed FP32}`` for the islands capture made."""

_MAX_ISLANDS = 32


def capture(model: Any, example_args: tuple, *, example_kwargs: dict[str, Any] | None = None, capture: str = "auto",
            leaf_modules: Iterable[type[nn.Module] | str] = (),
            concrete_args: dict[str, Any] | None = None) -> fx.GraphModule:
    """A float ``GraphModule`` of ``model`` (never the caller's object: a copy, or new graph over copied weights).

    Args:
        model: ``nn.Module``, ``GraphModule`` (fx, ONNX/caffe frontends, or ``ExportedProgram.module()``), or
            ``torch.export.ExportedProgram``.
        example_args, example_kwargs: one batch, positional and by keyword (``torch.export`` runs the model on
            it; a dict batch is keywords, as ``model(**batch)``).
        capture: ``"auto"``, ``"fx"`` or ``"export"`` (see the module docstring).
        leaf_modules, concrete_args: symbolic tracing's; ``torch.export`` has no leaves and takes the batch as is.

    Raises:
        TraceError: TorchScript input (with what to pass instead), or no path captured the model.
        ConfigError: an unknown ``capture``.

    Example:
        >>> gm = capture(torchvision.models.optical_flow.raft_small(), (img1, img2))  # fx fails, torch.export works
        >>> gm.meta["fxq_capture"], gm.meta.get("fxq_fp32_islands", {})
        ('export', {})
    """
    if capture not in CAPTURE_PATHS:
        raise ConfigError(f"capture={capture!r}; use one of {CAPTURE_PATHS}")
    if isinstance(model, torch.export.ExportedProgram):
        return from_exported_program(copy.deepcopy(model), _name(model.module()))
    if isinstance(model, (torch.jit.ScriptModule, torch.jit.ScriptFunction)):
        raise _torchscript_error(model)
    if isinstance(model, fx.GraphModule):
        if is_aten_graph(model):  # ExportedProgram.module(): its aten ops would all be "Unknown"
            logger.info("lifting the aten graph of %s (torch.export) to torch-level ops", _name(model))
            return lift_aten_graph(copy.deepcopy(model), _name(model))
        return trace(model)
    if capture == "export":
        if leaf_modules or concrete_args:
            logger.warning("capture='export': leaf_modules and concrete_args are symbolic tracing's and do not apply")
        return _export(model, example_args, example_kwargs or {})
    left_out = _left_out(model, example_args, example_kwargs or {})
    concrete_args = {**{k: v for k, v in left_out.items() if v is not _NO_DEFAULT}, **(concrete_args or {})}
    left_out_names = [name for name in concrete_args if name in left_out] + [
        name for name in left_out if name.startswith("*")]
    try:
        gm = trace(model, leaf_modules=leaf_modules, concrete_args=concrete_args, left_out=left_out_names)
    except TraceError as fx_error:
        if capture == "fx":
            raise
        return _fallback(model, (example_args, example_kwargs or {}), fx_error, list(leaf_modules), concrete_args,
                         left_out_names)
    return _note_script_leaves(gm)


_NO_DEFAULT = object()


def _left_out(model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The forward arguments the example batch does not pass, each with its default when that is no tensor
    (timm's ViT: ``attn_mask=None``, ``is_causal=False``; else ``_NO_DEFAULT``). Capture fixes those defaults as
    constants, as ``torch.export`` does: traced as inputs they would be placeholders that carry no tensor, which
    an exporter cannot write, and a flag among them could not pick its branch."""
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):  # a forward without a signature Python can read
        return {}
    positional = [p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                       inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    given = set(positional[:len(args)]) | set(kwargs)
    out = {}
    for p in params:
        if p.kind is inspect.Parameter.VAR_POSITIONAL and len(args) <= len(positional):
            out["*" + p.name] = _NO_DEFAULT  # torch.fx's placeholder of the empty ``*args``
        if p.name in given or p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            continue
        constant = p.default is None or isinstance(p.default, (bool, int, float, str))
        out[p.name] = p.default if p.default is not inspect.Parameter.empty and constant else _NO_DEFAULT
    return out


def _note_script_leaves(gm: fx.GraphModule) -> fx.GraphModule:
    """TorchScript submodules are kept whole by torch.fx: say they stay FP32, like any island."""
    for node in gm.graph.nodes:  # torch.fx calls a script's C++ object: get_attr <path>._c, then .forward()
        target = str(node.target)
        if node.op != "get_attr" or not target.endswith("._c"):
            continue
        owner = target[: -len("._c")]
        if not isinstance(get_attr_value(gm, target), torch._C.ScriptModule):
            continue
        gm.meta.setdefault(ISLANDS_KEY, {})[owner] = (
            "a TorchScript submodule (its Python code is gone); pass its Python module to quantize it")
        logger.warning("module %r stays FP32 (an island): it is TorchScript; pass its Python module to quantize "
                       "it", owner)
    return gm



def _name(model: Any) -> str:
    return str(getattr(model, "meta", {}).get("fxq_source") or type(model).__name__)


def _try_export(model: nn.Module, args: tuple, kwargs: dict[str, Any]
                ) -> tuple[Any, str, nn.Module, Exception | None]:
    """``(ExportedProgram or None, why it failed, the eval-mode copy it ran on, the exception)``: the caller's model
    is never run."""
    copied = copy.deepcopy(model).eval()  # as prepare() runs the traced graph: BatchNorm folds, dropout goes
    try:
        return export_program(copied, args, kwargs), "", copied, None
    except Exception as exc:  # torch.export raises many types
        return None, _export_failure(exc, copied), copied, exc


def _export(model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> fx.GraphModule:
    ep, failure, _, exc = _try_export(model, args, kwargs)
    if ep is None:
        raise TraceError(f"torch.export could not capture {type(model).__name__}: {failure}. "
                         f"Try capture='fx' (with leaf_modules=[...] around the failing part), or fix the "
                         f"construct (torch.cond for a branch on a tensor value, torch._check for a size)") from exc
    return from_exported_program(ep, type(model).__name__)


def _fallback(model: nn.Module, example: tuple[tuple, dict[str, Any]], fx_error: TraceError, leaves: list,
              concrete_args: dict[str, Any] | None, left_out: list[str]) -> fx.GraphModule:
    """torch.export, then FP32 islands, then one error naming every path's failure."""
    logger.info("symbolic tracing failed (%s); capturing %s with torch.export instead", fx_error,
                type(model).__name__)
    ep, export_failure, copied, _ = _try_export(model, *example)
    if ep is not None:
        if leaves:
            logger.warning("torch.export has no leaf modules: leaf_modules=%s do not apply to %s", leaves,
                           type(model).__name__)
        gm = from_exported_program(ep, type(model).__name__)
        gm.meta["fxq_capture_note"] = f"torch.export (symbolic tracing failed: {_first_line(fx_error)})"
        return gm
    logger.info("torch.export failed too (%s); keeping the failing submodules FP32", export_failure)
    gm, island_failure = _with_islands(model, fx_error, leaves, concrete_args, export_failure, left_out)
    if gm is not None:
        return _note_script_leaves(gm)
    parts = _capturable_parts(copied, example)  # the eval-mode copy: the caller's BatchNorm statistics stay as they are
    raise TraceError(
        f"fxq could not capture {type(model).__name__} by any path:\n"
        f"  - torch.fx symbolic tracing: {_first_line(fx_error)}\n"
        f"  - torch.export: {export_failure}\n"
        f"  - FP32 islands: {island_failure}\n"
        f"What to do: move the failing code into a submodule (fxq then keeps that submodule FP32 and quantizes "
        f"the rest), fix a branch on a flag with concrete_args={{...}}, write a branch on a tensor value with "
        f"torch.where or torch.cond, or export the model to ONNX yourself and use fxq.load_onnx{parts}"
    ) from fx_error


def _capturable_parts(model: nn.Module, example: tuple[tuple, dict[str, Any]]) -> str:
    """``; parts that do capture ...`` naming the direct submodules that capture on their own, with the inputs the
    model gives them (one eager run with hooks), so the user can quantize those (``fxq.quantize(model.backbone,
    ...)``); empty when none or when the model does not run."""
    seen: dict[str, tuple] = {}
    children = [(n, c) for n, c in model.named_children() if any(True for _ in c.parameters())]

    def recorder(name: str):
        def hook(_module: nn.Module, inputs: tuple) -> None:
            seen.setdefault(name, inputs)
        return hook

    handles = [c.register_forward_pre_hook(recorder(n)) for n, c in children]
    try:
        with torch.no_grad():
            model(*example[0], **example[1])
    except Exception:  # the model does not run this batch: nothing to suggest
        return ""
    finally:
        for h in handles:
            h.remove()
    found = []
    for name, child in children:
        if name not in seen:
            continue
        try:
            trace(child)
            found.append(f"{name} (fx)")
            continue
        except TraceError:
            pass
        try:
            export_program(copy.deepcopy(child), seen[name])
            found.append(f"{name} (export)")
        except Exception:  # not capturable on its own either
            continue
    if not found:
        return ""
    first = found[0].split(" ")[0]
    return (f". Parts that do capture on their own: {', '.join(found)}; quantize those, e.g. "
            f"fxq.quantize(model.{first}, ...) on the inputs the model gives it")


def _with_islands(model: nn.Module, error: TraceError, leaves: list, concrete_args: dict[str, Any] | None,
                  export_failure: str, left_out: list[str]) -> tuple[fx.GraphModule | None, str]:
    """Symbolic tracing with each failing submodule (innermost first) kept whole; (graph, "") or (None, why)."""
    islands: dict[str, str] = {}
    for _ in range(_MAX_ISLANDS):
        path, where = error.module_path, error.source_line
        if not path or not _has(model, path):
            return None, ("the failure is in the model's own forward, not in a submodule that could stay FP32"
                          + (f" ({where})" if where else ""))
        if path in leaves:
            return None, f"module {path!r} fails even as a leaf"
        islands[path] = (error.construct or "untraceable code") + (f" at {where}" if where else "")
        leaves.append(path)
        try:
            gm = trace(model, leaf_modules=leaves, concrete_args=concrete_args, left_out=left_out)
        except TraceError as again:
            error = again
            continue
        gm.meta[ISLANDS_KEY] = islands
        for p, why in islands.items():
            logger.warning("module %r stays FP32 (an island): symbolic tracing cannot enter it (%s) and torch.export "
                           "cannot capture the model (%s)", p, why, export_failure)
        return gm, ""
    return None, f"more than {_MAX_ISLANDS} submodules fail"


def _has(model: nn.Module, path: str) -> bool:
    try:
        model.get_submodule(path)
    except AttributeError:
        return False
    return True


def _first_line(exc: BaseException, limit: int = 400) -> str:
    line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return line if len(line) <= limit else line[:limit] + " ..."  # symbolic-shape guards can run to pages


def _export_failure(exc: BaseException, model: nn.Module) -> str:
    """``module 'a.b' (file:line: code): Error: first line`` for a torch.export failure."""
    path = _failing_module(exc, model)
    line = failure_line(exc)
    where = " ".join(p for p in (f"module {path!r}" if path is not None else "", f"({line})" if line else "") if p)
    unknown = _UNKNOWN_OUTPUT.search(str(exc))
    if unknown:
        return (f"the model returns a {unknown.group(1)}, which torch.export cannot take apart: make it return "
                f"tensors, or tuples / lists / dicts of them (a Hugging Face model: use_cache=False in its config "
                f"or batch), or register that class with torch.utils._pytree.register_pytree_node")
    return f"{where + ': ' if where else ''}{type(exc).__name__}: {_first_line(exc)}"


_UNKNOWN_OUTPUT = re.compile(r"Found <class '([\w.]+)'> in output, which is not a known type")


def _failing_module(exc: BaseException, model: nn.Module) -> str | None:
    """The innermost submodule of ``model`` whose code is on ``exc``'s traceback (non-strict export runs it)."""
    names = {id(m): n for n, m in model.named_modules()}
    found = None
    tb = exc.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if id(owner) in names and names[id(owner)]:
            found = names[id(owner)]
        tb = tb.tb_next
    return found


def _torchscript_error(model: Any) -> TraceError:
    return TraceError(
        f"{type(model).__name__} is TorchScript: its Python code is gone, so neither torch.fx nor torch.export can "
        f"trace it (making it a leaf would quantize nothing). Pass the Python nn.Module the script was made from, "
        f"or export the script to ONNX and quantize that: torch.onnx.export(script_module, example_inputs, "
        f"'model.onnx', dynamo=False); gm = fxq.load_onnx('model.onnx'); fxq.quantize(gm, calib_data, ...)")
