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
import re
from typing import Any, Callable

import torch
from torch import fx

from fxq.graph.info import GraphQuant, NodeQuant, QuantizerInfo
from fxq.serialization.allowlist import function_name, resolve_function
from fxq.spec import FloatFormat, QuantState, RoundingPolicy, TensorQuantConfig

__all__ = ["Unencodable", "TensorTable", "encode", "decode", "decode_config", "dtype_of", "dtype_name", "check_shape", "GRAPH_TAGS"]

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


_DTYPES: dict[str, torch.dtype] = {
    n: getattr(torch, n) for n in (
        "float32", "float64", "float16", "bfloat16", "complex32", "complex64", "complex128", "uint8", "int8",
        "int16", "int32", "int64", "uint16", "uint32", "uint64", "bool", "float8_e4m3fn", "float8_e5m2",
        "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "qint8", "quint8", "qint32", "quint4x2",
    ) if isinstance(getattr(torch, n, None), torch.dtype)
}
_CONSTANTS: dict[str, Any] = {
    n: getattr(torch, n) for n in (
        "contiguous_format", "channels_last", "channels_last_3d", "preserve_format", "strided", "sparse_coo",
        "sparse_csr", "sparse_csc", "sparse_bsr", "sparse_bsc", "per_tensor_affine", "per_channel_affine",
        "per_tensor_symmetric", "per_channel_symmetric", "per_channel_affine_float_qparams",
    ) if isinstance(getattr(torch, n, None), _TORCH_CONSTANTS)
}
_DEVICE = re.compile(r"(cpu|cuda|meta|mps|xpu)(:[0-9]{1,4})?\Z")
_MAX_NUMEL = 2**48
GRAPH_TAGS = frozenset({"$node", "$float", "$size", "$tuple", "$dict", "$set", "$slice", "$ellipsis", "$dtype",
                        "$device", "$torch", "$function"})
"""What node arguments may hold: no tensors, records or configs (torch.fx would print their repr as code)."""


def dtype_of(name: Any) -> torch.dtype:
    """The dtype named ``name`` (``"float32"``), from an explicit table."""
    if not isinstance(name, str) or name not in _DTYPES:
        raise Unencodable(f"unknown dtype {name!r}")
    return _DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """``"float32"`` for ``torch.float32``."""
    return str(dtype).replace("torch.", "")


def check_shape(shape: Any, what: str = "tensor") -> list[int]:
    """``shape`` as a list of sizes, if it is one (non-negative ints, at most 2**48 elements)."""
    if not isinstance(shape, (list, tuple)) or len(shape) > 64 or not all(
            type(d) is int and 0 <= d <= _MAX_NUMEL for d in shape) or math.prod(shape) > _MAX_NUMEL:
        raise Unencodable(f"{what} shape {shape!r} is not a valid tensor shape (at most 2**48 elements)")
    return list(shape)


def _expect(body: Any, kind: type | tuple[type, ...], key: str, length: int | None = None) -> Any:
    if not isinstance(body, kind) or isinstance(body, bool) and bool not in (kind if isinstance(kind, tuple)
                                                                             else (kind,)):
        raise Unencodable(f"{key} holds {type(body).__name__}, not {getattr(kind, '__name__', kind)}")
    if length is not None and len(body) != length:
        raise Unencodable(f"{key} holds {len(body)} items, not {length}")
    return body


def decode(data: Any, table: TensorTable, nodes: dict[str, fx.Node] | None = None,
           tags: frozenset[str] | None = None) -> Any:
    """Inverse of :func:`encode` (``nodes`` resolves ``$node`` references; ``tags``: the ``$`` forms allowed)."""
    rec = lambda v: decode(v, table, nodes, tags)  # noqa: E731
    if data is None or isinstance(data, (bool, int, float, str)):
        return data
    if isinstance(data, list):
        return [rec(v) for v in data]
    if not isinstance(data, dict):
        raise Unencodable(f"unexpected JSON value {data!r}")
    if not any(isinstance(k, str) and k.startswith("$") for k in data):
        return {k: rec(v) for k, v in data.items()}
    if len(data) != 1:
        raise Unencodable(f"unexpected keys {sorted(data)[:5]}")
    (key, body), = data.items()
    if tags is not None and key not in tags:
        raise Unencodable(f"{key} is not allowed here")
    if key == "$node":
        if nodes is None or not isinstance(body, str) or body not in nodes:
            raise Unencodable(f"reference to unknown (or later) node {body!r}")
        return nodes[body]
    if key == "$tensor":
        if not isinstance(body, str) or body not in table.tensors:
            raise Unencodable(f"reference to missing tensor {body!r}")
        return table.get(body)
    if key == "$tensor_spec":
        shape, dtype = _expect(body, list, key, 2)
        return torch.empty(check_shape(shape), dtype=dtype_of(dtype), device="meta")
    if key == "$float":
        return float(_expect(body, str, key))
    if key == "$size":
        return torch.Size(check_shape(_expect(body, list, key), "torch.Size"))
    if key == "$tuple":
        return tuple(rec(v) for v in _expect(body, list, key))
    if key == "$dict":
        return {_hashable(rec(k)): rec(v) for k, v in (_expect(p, list, key, 2) for p in _expect(body, list, key))}
    if key == "$set":
        return {_hashable(rec(v)) for v in _expect(body, list, key)}
    if key == "$slice":
        return slice(*(rec(v) for v in _expect(body, list, key, 3)))
    if key == "$ellipsis":
        return Ellipsis
    if key == "$dtype":
        return dtype_of(body)
    if key == "$device":
        if not isinstance(body, str) or not _DEVICE.match(body):
            raise Unencodable(f"unknown device {body!r}")
        return torch.device(body)
    if key == "$torch":
        if not isinstance(body, str) or body not in _CONSTANTS:
            raise Unencodable(f"unknown torch constant {body!r}")
        return _CONSTANTS[body]
    if key == "$enum":
        name, member = _expect(body, list, key, 2)
        cls = _ENUMS.get(name) if isinstance(name, str) else None
        if cls is None or not isinstance(member, str) or member not in cls.__members__:
            raise Unencodable(f"unknown enum member {name!r}.{member!r}")
        return cls.__members__[member]
    if key == "$config":
        return decode_config(body)
    if key == "$record":
        name, fields = _expect(body, list, key, 2)
        cls = _RECORDS.get(name) if isinstance(name, str) else None
        if cls is None:
            raise Unencodable(f"unknown record type {name!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(fields, dict) or not set(fields) <= known:
            raise Unencodable(f"record {name} has unknown fields {sorted(set(fields) - known)[:5]}")
        return cls(**{k: rec(v) for k, v in fields.items()})
    if key == "$function":
        return resolve_function(body)
    raise Unencodable(f"unknown tag {key!r}")


_CONFIG_TYPES: dict[str, tuple[type, ...]] = {
    "num_bits": (int,), "symmetric": (bool,), "per_channel": (bool,), "channel_axis": (int,),
    "power_of_2": (bool,), "fp_format": (str, type(None)), "quant_min": (int, float, type(None)), "quant_max": (int, float, type(None)),
    "rounding": (str,), "scale": (list, type(None)), "offset": (list, type(None)), "state": (str,),
    "observer": (str, type(None)),
}


def decode_config(body: Any) -> TensorQuantConfig:
    """A :class:`TensorQuantConfig` from its ``to_dict`` form, every field type checked first."""
    if not isinstance(body, dict):
        raise Unencodable(f"$config holds {type(body).__name__}, not an object")
    for name, value in body.items():
        kinds = _CONFIG_TYPES.get(name)
        if kinds is None:
            raise Unencodable(f"unknown TensorQuantConfig field {name!r}")
        if not isinstance(value, kinds) or isinstance(value, bool) and bool not in kinds:
            raise Unencodable(f"TensorQuantConfig field {name!r} holds {type(value).__name__}")
        if isinstance(value, list) and not all(type(v) in (int, float) for v in value):
            raise Unencodable(f"TensorQuantConfig field {name!r} must hold numbers")
    return TensorQuantConfig.from_dict(dict(body))


def _hashable(value: Any) -> Any:
    return tuple(_hashable(v) for v in value) if isinstance(value, list) else value
