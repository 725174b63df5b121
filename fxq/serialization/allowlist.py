"""What a saved fxq model may name: module classes, functions, ops and tensor methods — nothing else.

Loading never unpickles objects: classes and functions are looked up by qualified name, and only among

* module classes from ``torch.nn``, ``fxq`` and ``onnx2torch`` (the ONNX frontend's modules), and classes
  registered with :func:`register_serializable`;
* functions of ``torch``, ``torch.nn.functional``, ``operator``, ``math``, a few builtins (``getattr``...),
  ``torch.ops`` overloads, and functions registered with :func:`register_serializable` — exactly the names
  :func:`function_name` gives, never classes, private (``_``) names, setters of global state (``set_*``,
  ``register_*``), I/O (``save``, ``load``...) or calls by name (``operator.attrgetter / methodcaller / call``);
* method names of ``torch.Tensor`` (``call_method`` targets);
* attribute names without a leading underscore (``getattr`` nodes) and module / attribute paths without
  dunder parts (``get_attr`` / ``call_module`` targets),

so a file cannot reach an object's ``__globals__`` and call what it finds there (:func:`check_node`).
"""
from __future__ import annotations

import builtins
import functools
import importlib
import math
import operator
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from fxq.errors import NotSupportedError
from fxq.registry import Registry

__all__ = ["register_serializable", "class_name", "resolve_class", "function_name", "resolve_function",
           "check_method", "check_node", "SERIALIZABLE"]

SERIALIZABLE: Registry[Any] = Registry("serializable class or function")
"""User-registered module classes and functions, keyed by ``module:qualname``."""

_MODULE_PREFIXES = ("torch.nn.", "fxq.", "onnx2torch.")
_BUILTINS = ("getattr", "len", "abs", "min", "max", "int", "float", "bool", "round", "slice", "range", "tuple",
             "list")
_FUNCTION_NAMESPACES: dict[str, Any] = {"torch": torch, "torch.nn.functional": F, "operator": operator,
                                        "math": math, "torch.fft": torch.fft, "torch.linalg": torch.linalg,
                                        "torch.special": torch.special}


def _qualified(obj: Any) -> str:
    return f"{obj.__module__}:{obj.__qualname__}"


def register_serializable(obj: Any) -> Any:
    """Allow ``fxq.save``/``fxq.load`` to name a module class or function of yours; usable as a decorator.

    Example:
        >>> @register_serializable
        ... class MyBlock(nn.Module): ...
    """
    if not (isinstance(obj, type) and issubclass(obj, nn.Module)) and not callable(obj):
        raise NotSupportedError(f"register_serializable takes an nn.Module subclass or a function, got {obj!r}")
    SERIALIZABLE.register(_qualified(obj), obj, override=True)
    return obj


# ---------------------------------------------------------------------------------------------- classes
def class_name(cls: type) -> str | None:
    """``module:qualname`` of an allowed module class, else None."""
    name = _qualified(cls)
    if name in SERIALIZABLE:
        return name
    if issubclass(cls, nn.Module) and cls.__module__.startswith(_MODULE_PREFIXES) and "<locals>" not in cls.__qualname__:
        return name
    return None


def resolve_class(name: str) -> type:
    """The class saved as ``name``, if it is allowed; otherwise :class:`NotSupportedError`."""
    if name in SERIALIZABLE:
        return SERIALIZABLE.get(name)
    module, _, qual = name.partition(":")
    if not module.startswith(_MODULE_PREFIXES) or not qual:
        raise NotSupportedError(f"module class {name!r} is not allowed in fxq files; register it with "
                                f"fxq.serialization.register_serializable before fxq.load")
    obj: Any = importlib.import_module(module)
    for part in qual.split("."):
        obj = getattr(obj, part, None)
    if not (isinstance(obj, type) and issubclass(obj, nn.Module)):
        raise NotSupportedError(f"{name!r} does not name an nn.Module class")
    return obj


# ---------------------------------------------------------------------------------------------- functions
@functools.lru_cache(maxsize=1)
def _function_index() -> dict[int, str]:
    index: dict[int, str] = {}
    for ns_name, ns in _FUNCTION_NAMESPACES.items():
        for attr in dir(ns):
            if not _allowed_attr(attr):
                continue
            obj = getattr(ns, attr, None)
            if callable(obj) and not isinstance(obj, type):
                index.setdefault(id(obj), f"{ns_name}:{attr}")
    for attr in _BUILTINS:
        index.setdefault(id(getattr(builtins, attr)), f"builtins:{attr}")
    return index


def function_name(fn: Callable[..., Any]) -> str | None:
    """A name :func:`resolve_function` turns back into ``fn``, or None if ``fn`` is not allowed."""
    if isinstance(fn, torch._ops.OpOverload):
        return f"torch.ops:{fn._schema.name}.{fn._overloadname}"
    if isinstance(fn, torch._ops.OpOverloadPacket):
        return f"torch.ops:{fn._qualified_op_name}"
    for key, obj in SERIALIZABLE.items():
        if obj is fn:
            return key
    return _function_index().get(id(fn))


def resolve_function(name: str) -> Callable[..., Any]:
    """The function saved as ``name``, looked up only in the allowed namespaces."""
    if name in SERIALIZABLE:
        return SERIALIZABLE.get(name)
    ns_name, _, attr = name.partition(":")
    if ns_name == "torch.ops":
        ns, _, rest = attr.partition("::")
        op, _, overload = rest.partition(".")
        try:
            packet = getattr(getattr(torch.ops, ns), op)
            return getattr(packet, overload) if overload else packet
        except (AttributeError, RuntimeError) as exc:
            raise NotSupportedError(f"op {attr!r} is not registered in this process (import the library that "
                                    f"defines it before fxq.load)") from exc
    if name not in _allowed_names():
        raise NotSupportedError(f"function {name!r} is not allowed in fxq files; register it with "
                                f"fxq.serialization.register_serializable before fxq.load")
    ns = builtins if ns_name == "builtins" else _FUNCTION_NAMESPACES[ns_name]
    return getattr(ns, attr)


@functools.lru_cache(maxsize=1)
def _allowed_names() -> frozenset[str]:
    return frozenset(_function_index().values())


_DENIED = frozenset({
    "save", "load", "from_file", "load_library", "compile", "jit", "hub", "package", "manual_seed", "seed",
    "use_deterministic_algorithms", "export", "onnx", "attrgetter", "methodcaller", "call",
})
"""Names refused in every namespace: I/O, code loading, global state, calls by name (operator.call...)."""
_DENIED_PREFIXES = ("_", "set_", "register_")
_PRIVATE_ALLOWED = frozenset({"_assert"})  # torch.fx writes torch._assert for traced asserts


def _allowed_attr(attr: str) -> bool:
    return attr in _PRIVATE_ALLOWED or (attr not in _DENIED and not attr.startswith(_DENIED_PREFIXES))


def check_node(op: str, target: Any, args: tuple) -> None:
    """Refuse what could walk from a value to arbitrary objects: ``getattr`` of a private / dunder name, and
    ``get_attr`` / ``call_module`` paths through dunder attributes."""
    if op == "call_function" and target is builtins.getattr:
        attr = args[1] if len(args) > 1 else None
        if not isinstance(attr, str) or attr.startswith("_"):
            raise NotSupportedError(f"getattr of {attr!r} is not allowed in fxq files (only public attribute names)")
    if op in ("get_attr", "call_module") and any(p.startswith("__") for p in str(target).split(".")):
        raise NotSupportedError(f"{op} target {target!r} is not allowed in fxq files (dunder attribute)")


def check_method(name: str) -> str:
    """``name`` if it is a ``torch.Tensor`` method (a valid ``call_method`` target)."""
    if not isinstance(name, str) or (name.startswith("_") and name != "__getitem__") or not hasattr(torch.Tensor, name):
        raise NotSupportedError(f"call_method target {name!r} is not a torch.Tensor method")
    return name
