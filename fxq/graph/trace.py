"""``torch.fx`` tracing with leaf modules and concrete args, and errors that say how to get around a failure."""
from __future__ import annotations

import copy
import linecache
import operator
import os
import re
import threading
import traceback
from typing import Any, Collection, Iterable

import torch
from torch import fx, nn

from fxq.errors import TraceError
from fxq.graph.decompose import decomposition_for

__all__ = ["trace", "failure_line"]

_HINTS = (  # the first that matches: torch.fx's iteration message mentions "control flow" too
    ("cannot be iterated", "iteration over a traced value (a loop over it, unpacking it, or *args)"),
    ("control flow", "data-dependent control flow (an `if`/`while` on a tensor value)"),
    ("iterate", "iteration over a traced tensor"),
    ("len(", "len() of a traced tensor"),
    ("cannot be interpreted as an integer", "a traced value used as a Python int"),
    ("__bool__", "a traced value used as a Python bool"),
)


_TRACE_LOCK = threading.RLock()
"""torch.fx patches ``nn.Module.__call__`` / ``__getattr__`` process-wide while it traces and restores what it found
when it ends; two traces overlapping in time would restore each other's patches out of order (leaving a finished
tracer installed for good), so fxq's traces take turns."""


class _Tracer(fx.Tracer):
    """Symbolic tracer with fxq's leaves and decompositions that leaves other threads alone: module calls and
    attribute reads made by another thread while this one traces (through torch.fx's process-wide patches) run
    as plain eager code instead of being recorded into this graph."""

    def __init__(self, leaf_modules: Iterable[type[nn.Module] | str] = ()) -> None:
        super().__init__()
        self._owner = threading.get_ident()
        leaves = list(leaf_modules)
        self._leaf_types = tuple(t for t in leaves if isinstance(t, type))
        self._leaf_names = {t for t in leaves if isinstance(t, str)}
        self.failed_module: str | None = None

    def _user_leaf(self, m: nn.Module, qualname: str) -> bool:
        return qualname in self._leaf_names or bool(self._leaf_types and isinstance(m, self._leaf_types))

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return self._user_leaf(m, qualname) or super().is_leaf_module(m, qualname)

    def getattr(self, attr, attr_val, parameter_proxy_cache):
        if threading.get_ident() != self._owner:
            return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    def call_module(self, m, forward, args, kwargs):
        if threading.get_ident() != self._owner:  # another thread's eager forward, not part of this trace
            return forward(*args, **kwargs)
        decompose = decomposition_for(m)
        if decompose is not None and not self._user_leaf(m, self.path_of_module(m)):
            out = decompose(m, *args, **kwargs)  # traced through: its insides become graph nodes
            if out is not NotImplemented:
                return out
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_module is None:
                try:
                    self.failed_module = self.path_of_module(m) or type(m).__name__
                except Exception:  # not a submodule of root
                    self.failed_module = type(m).__name__
            raise


_LIBRARY_DIRS = (os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
                 os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep)


def failure_line(exc: BaseException) -> str | None:
    """``file:line: code`` of the deepest frame of the user's code in ``exc``'s traceback (torch's and fxq's own
    frames skipped), or None."""
    found = None
    for frame, lineno in traceback.walk_tb(exc.__traceback__):
        filename = frame.f_code.co_filename
        if filename.startswith(_LIBRARY_DIRS) or filename.startswith("<"):
            continue
        code = (linecache.getline(filename, lineno) or "").strip()
        found = f"{os.path.basename(filename)}:{lineno}: {code}" if code else f"{os.path.basename(filename)}:{lineno}"
    return found


def _drop_specialized(graph: fx.Graph, concrete_args: dict[str, Any], left_out: Collection[str]) -> None:
    """Concrete args are constants of the graph. torch.fx keeps a placeholder for each (named ``<arg>_1``), read
    only by a check that the caller passed that value (``_assert_is_none``, or ``torch._assert(arg == value)``).
    Those the caller's batches leave out (``left_out``) go with their checks, so an exporter sees only the inputs
    that carry tensors; the others stay inputs that take the value as their default."""
    placeholders = {str(n.target): n for n in graph.nodes if n.op == "placeholder"}
    for param, value in concrete_args.items():
        node = next((n for t, n in placeholders.items() if t == param or re.fullmatch(rf"{re.escape(param)}_\d+", t)),
                    None)
        if node is None:
            continue
        node.args = (value,)
        if param not in left_out:
            continue
        for user in list(node.users):
            checks = [user] if user.target is fx._symbolic_trace._assert_is_none else []
            if user.target is operator.eq and [u.target for u in user.users] == [torch._assert]:
                checks = [*user.users, user]
            for check in checks:
                graph.erase_node(check)
        if not node.users:
            graph.erase_node(node)
    for name in left_out:  # ``*args`` the batches fill with nothing, and the model does not read
        node = placeholders.get(name)
        if name not in concrete_args and node is not None and not node.users:
            graph.erase_node(node)


def trace(
    model: nn.Module,
    leaf_modules: Iterable[type[nn.Module] | str] = (),
    concrete_args: dict[str, Any] | None = None,
    copy_model: bool = True,
    left_out: Collection[str] = (),
) -> fx.GraphModule:
    """Symbolically trace ``model`` into a ``GraphModule``.

    A ``GraphModule`` is returned as is (deep-copied when ``copy_model``), keeping its node metadata.

    Args:
        model: the float model (put in eval mode by the caller for PTQ).
        leaf_modules: module classes or qualified names to keep as single ``call_module`` nodes.
        concrete_args: forward arguments to fix to constants while tracing (e.g. flags).
        left_out: those of ``concrete_args`` that callers do not pass: no longer inputs of the graph.
        copy_model: trace a deep copy, so graph passes never touch the caller's parameters.

    Raises:
        TraceError: naming the module where tracing failed, the construct, and the way around it.
    """
    if copy_model:
        model = copy.deepcopy(model)
    if isinstance(model, fx.GraphModule):
        return model
    tracer = _Tracer(leaf_modules)
    try:
        with _TRACE_LOCK:
            graph = tracer.trace(model, concrete_args=concrete_args)
    except Exception as exc:  # torch.fx raises many types here
        where = tracer.failed_module or type(model).__name__
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if decomposition_for(model) is not None:
            raise TraceError(
                f"torch.fx cannot trace a bare {type(model).__name__} as the whole model ({type(exc).__name__}: "
                f"{msg}); wrap it, e.g. nn.Sequential(model), and fxq traces through it"
            ) from exc
        construct = next((c for key, c in _HINTS if key in msg), "an operation torch.fx cannot trace symbolically")
        line = failure_line(exc)
        at = f" at {line}" if line else ""
        if tracer.failed_module is None:  # the root's own forward: no module to keep whole
            err = TraceError(
                f"torch.fx could not trace the forward of {where} itself: {construct} ({type(exc).__name__}: "
                f"{msg}){at}. Fix the branch with concrete_args={{...}}, or move that code into a submodule and "
                f"keep it whole with leaf_modules=[...] (it then runs in FP32)."
            )
        else:
            err = TraceError(
                f"torch.fx could not trace module {where!r}: {construct} ({type(exc).__name__}: {msg}){at}. Keep "
                f"it whole with leaf_modules=[{where!r}] (it then runs in FP32 unless the platform knows its "
                f"type), or fix the branch with concrete_args={{...}}."
            )
        err.module_path, err.construct, err.source_line = tracer.failed_module, construct, line
        raise err from exc
    if concrete_args or left_out:
        _drop_specialized(graph, concrete_args or {}, left_out)
    name = type(model).__name__
    gm = fx.GraphModule(tracer.root, graph, name)
    gm.meta["fxq_source"] = name
    return gm


