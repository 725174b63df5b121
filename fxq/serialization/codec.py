"""JSON encoding of the values a GraphModule holds (node arguments, module attributes, meta).

Plain JSON values stay as they are; everything else becomes a one-key object (``{"$tuple": [...]}``...).
Tensors go to a side table (saved with ``torch.save`` and read back with ``weights_only=True``); fxq's own
records (configs, quantizer infos, graph facts) are encoded field by field. Anything else raises
:class:`Unencodable`, which the callers turn into an error naming the module / node / attribute.
"""
from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any, Callable

import torch
from torch import fx

from fxq.graph.info import GraphQuant, NodeQuant, QuantizerInfo
from fxq.serialization.allowlist import function_name, resolve_function
from fxq.spec import FloatFormat, QuantState, RoundingPolicy, TensorQuantConfig

__all__ = ["Unencodable", "TensorTable", "encode", "decode"]

_ENUMS: dict[str, type[enum.Enum]] = {c.__name__: c for c in (QuantState, RoundingPolicy, FloatFormat)}
_RECORDS: dict[str, type] = {c.__name__: c for c in (NodeQuant, QuantizerInfo, GraphQuant)}
_TORCH_CONSTANTS = (torch.memory_format, torch.layout, torch.qscheme)


class Unencodable(TypeError):
    """A value fxq files cannot hold; ``args[0]`` describes it."""


class TensorTable:
    """Tensors by key; the same tensor object is stored once."""

    def __init__(self, tensors: dict[str, torch.Tensor] | None = None) -> None:
        self.tensors: dict[str, torch.Tensor] = dict(tensors or {})
        self._keys: dict[int, str] = {}

    def put(self, t: torch.Tensor, hint: str) -> str:
        key = self._keys.get(id(t))
        if key is not None:
            return key
        key, i = hint, 0
        while key in self.tensors:
            i += 1
            key = f"{hint}#{i}"
        self.tensors[key] = t.detach().cpu() if not t.is_meta else t
        self._keys[id(t)] = key
        return key

    def get(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def key_of(self, t: torch.Tensor) -> str | None:
        """Key under which the tensor object ``t`` was put, if it was."""
        return self._keys.get(id(t))


def encode(value: Any, table: TensorTable, hint: str = "t", *, tensor_spec_only: bool = False) -> Any:
    """JSON-ready form of ``value``; tensors go to ``table`` (or only their shape/dtype when ``tensor_spec_only``)."""
    rec: Callable[[Any, str], Any] = lambda v, h: encode(v, table, h, tensor_spec_only=tensor_spec_only)  # noqa: E731
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int) and not isinstance(value, enum.Enum):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"$float": repr(value)}
    if isinstance(value, fx.Node):
        return {"$node": value.name}
    if isinstance(value, torch.Tensor):
        if tensor_spec_only or value.is_meta or type(value) is not torch.Tensor and not isinstance(
                value, torch.nn.Parameter):
            return {"$tensor_spec": [list(value.shape), str(value.dtype).replace("torch.", "")]}
        return {"$tensor": table.put(value, hint)}
    if isinstance(value, torch.Size):
        return {"$size": list(value)}
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        raise Unencodable(f"named tuple {type(value).__name__}")
    if isinstance(value, tuple):
        return {"$tuple": [rec(v, f"{hint}.{i}") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [rec(v, f"{hint}.{i}") for i, v in enumerate(value)]
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in value):
            return {k: rec(v, f"{hint}.{k}") for k, v in value.items()}
        return {"$dict": [[rec(k, hint), rec(v, f"{hint}.{i}")] for i, (k, v) in enumerate(value.items())]}
    if isinstance(value, (set, frozenset)):
        return {"$set": [rec(v, hint) for v in sorted(value, key=repr)]}
    if isinstance(value, slice):
        return {"$slice": [rec(value.start, hint), rec(value.stop, hint), rec(value.step, hint)]}
    if value is Ellipsis:
        return {"$ellipsis": True}
    if isinstance(value, torch.dtype):
        return {"$dtype": str(value).replace("torch.", "")}
    if isinstance(value, torch.device):
        return {"$device": str(value)}
    if isinstance(value, _TORCH_CONSTANTS):
        return {"$torch": str(value).replace("torch.", "")}
    if isinstance(value, enum.Enum) and type(value).__name__ in _ENUMS:
        return {"$enum": [type(value).__name__, value.name]}
    if isinstance(value, TensorQuantConfig):
        d = value.to_dict()
        return {"$config": d}
    if dataclasses.is_dataclass(value) and type(value).__name__ in _RECORDS and type(value) is _RECORDS[
            type(value).__name__]:
        fields = {f.name: rec(getattr(value, f.name), f"{hint}.{f.name}") for f in dataclasses.fields(value)}
        return {"$record": [type(value).__name__, fields]}
    if callable(value):
        name = function_name(value)
        if name is not None:
            return {"$function": name}
        raise Unencodable(f"function {getattr(value, '__qualname__', value)!r} (not in fxq's allow-list)")
    raise Unencodable(f"{type(value).__module__}.{type(value).__qualname__} value")


def decode(data: Any, table: TensorTable, nodes: dict[str, fx.Node] | None = None) -> Any:
    """Inverse of :func:`encode` (``nodes`` resolves ``$node`` references)."""
    rec = lambda v: decode(v, table, nodes)  # noqa: E731
    if data is None or isinstance(data, (bool, int, float, str)):
        return data
    if isinstance(data, list):
        return [rec(v) for v in data]
    if not isinstance(data, dict):
        raise Unencodable(f"unexpected JSON value {data!r}")
    if len(data) == 1:
        (key, body), = data.items()
        if key == "$node":
            if nodes is None or body not in nodes:
                raise Unencodable(f"reference to unknown node {body!r}")
            return nodes[body]
        if key == "$tensor":
            return table.get(body)
        if key == "$tensor_spec":
            shape, dtype = body
            return torch.empty(shape, dtype=getattr(torch, dtype), device="meta")
        if key == "$float":
            return float(body)
        if key == "$size":
            return torch.Size(body)
        if key == "$tuple":
            return tuple(rec(v) for v in body)
        if key == "$dict":
            return {_hashable(rec(k)): rec(v) for k, v in body}
        if key == "$set":
            return {_hashable(rec(v)) for v in body}
        if key == "$slice":
            return slice(*(rec(v) for v in body))
        if key == "$ellipsis":
            return Ellipsis
        if key == "$dtype":
            value = getattr(torch, str(body), None)
            if not isinstance(value, torch.dtype):
                raise Unencodable(f"unknown dtype {body!r}")
            return value
        if key == "$device":
            return torch.device(body)
        if key == "$torch":
            value = getattr(torch, str(body), None)
            if not isinstance(value, _TORCH_CONSTANTS):
                raise Unencodable(f"unknown torch constant {body!r}")
            return value
        if key == "$enum":
            cls = _ENUMS.get(body[0])
            if cls is None:
                raise Unencodable(f"unknown enum {body[0]!r}")
            return cls[body[1]]
        if key == "$config":
            return TensorQuantConfig.from_dict(dict(body))
        if key == "$record":
            cls = _RECORDS.get(body[0])
            if cls is None:
                raise Unencodable(f"unknown record type {body[0]!r}")
            return cls(**{k: rec(v) for k, v in body[1].items()})
        if key == "$function":
            return resolve_function(body)
    return {k: rec(v) for k, v in data.items()}


def _hashable(value: Any) -> Any:
    return tuple(_hashable(v) for v in value) if isinstance(value, list) else value
