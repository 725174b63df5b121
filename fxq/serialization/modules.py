"""The module tree of a GraphModule as data: class names, plain attributes, parameters and buffers.

A module is rebuilt without running its ``__init__``: an instance of its (allowed) class gets
``nn.Module.__init__`` and then its saved attributes, parameters, buffers and children — which is what
``forward`` reads. Modules whose class is not allowed are rebuilt as plain ``nn.Module`` containers when
the graph never calls them (they only hold parameters), and are an error otherwise.
"""
from __future__ import annotations

import dataclasses
import inspect
import logging
from typing import Any

import torch
from torch import fx, nn

from fxq.errors import FrontendError, NotSupportedError
from fxq.nn.fake_quantize import FakeQuantize
from fxq.serialization.allowlist import check_identifier, check_part, check_path, class_name, resolve_class
from fxq.serialization.codec import TensorTable, Unencodable, decode, encode
from fxq.serialization.legacy import LEGACY_BACKUP_ATTR, complete_fake_quantize

__all__ = ["encode_modules", "decode_modules", "Defined"]

logger = logging.getLogger(__name__)

_MODULE_INTERNALS = frozenset(nn.Module().__dict__) - {"training"}
# calibration state and the shortcut to a bound call (a compiled graph): rebuilt on demand
_SKIP_ATTRS = {FakeQuantize: frozenset({"observer", "_shortcut"})}


def _skip(mod: nn.Module) -> frozenset[str]:
    return next((v for k, v in _SKIP_ATTRS.items() if isinstance(mod, k)), frozenset())


def _attrs(path: str, mod: nn.Module, table: TensorTable) -> dict[str, Any]:
    out: dict[str, Any] = {}
    skip = _skip(mod)
    for key, value in sorted(vars(mod).items()):  # sorted: the same bytes after a load, whatever __init__ did
        if key in _MODULE_INTERNALS or key in skip:
            continue
        if isinstance(mod, FakeQuantize) and key == "config":
            cfg = value.to_dict()
            cfg["scale"] = cfg["offset"] = None  # they live in the buffers
            out[key] = {"$config": cfg}
            continue
        try:
            out[key] = encode(value, table, f"{path}.{key}")
        except Unencodable as exc:
            raise NotSupportedError(
                f"cannot save module {path!r} ({type(mod).__qualname__}): attribute {key!r} holds a {exc}. "
                f"fxq files hold plain values, tensors and allowed functions only"
            ) from None
    for hooks in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks"):
        if getattr(mod, hooks, None):
            logger.warning("module %r has %s; hooks are not saved", path, hooks.strip("_"))
    return out


def encode_modules(gm: fx.GraphModule, table: TensorTable) -> list[dict[str, Any]]:
    """One record per module (the root first), in ``named_modules`` order."""
    called = {str(n.target) for n in gm.graph.nodes if n.op == "call_module"}
    records = []
    for path, mod in gm.named_modules(remove_duplicate=False):
        rec: dict[str, Any] = {"path": path}
        if path:
            name = class_name(type(mod))
            if name is None:
                if path in called:
                    raise NotSupportedError(
                        f"cannot save module {path!r}: its class {type(mod).__module__}.{type(mod).__qualname__} is "
                        f"not an allowed class (torch.nn, fxq, onnx2torch). Register it with "
                        f"fxq.serialization.register_serializable(cls), or trace through it (leaf_modules)"
                    )
                name = "torch.nn.modules.module:Module"  # holds parameters only: a plain container is enough
                logger.debug("module %r (%s) saved as a plain container", path, type(mod).__qualname__)
            rec["class"] = name
            rec["attrs"] = _attrs(path, mod, table)
        rec["params"] = {k: [table.put(p, f"{path}.{k}" if path else k), bool(p.requires_grad)]
                         for k, p in mod._parameters.items() if p is not None}
        rec["none_params"] = [k for k, p in mod._parameters.items() if p is None]
        rec["buffers"] = {k: [table.put(b, f"{path}.{k}" if path else k), k not in mod._non_persistent_buffers_set]
                          for k, b in mod._buffers.items() if b is not None}
        rec["none_buffers"] = [k for k, b in mod._buffers.items() if b is None]
        rec["children"] = [k for k, c in mod._modules.items() if c is not None]
        if not path:  # plain tensors the root holds for get_attr (traced constants)
            rec["tensor_attrs"] = {k: table.put(v, k) for k, v in vars(mod).items()
                                   if isinstance(v, torch.Tensor) and k not in mod._parameters and k not in mod._buffers}
        records.append(rec)
    return records


@dataclasses.dataclass
class Defined:
    """What a file's module tree defines: the targets its graph may name."""

    modules: set[str] = dataclasses.field(default_factory=set)
    attrs: set[str] = dataclasses.field(default_factory=set)  # parameters, buffers, tensor attributes


def _record(rec: Any, where: str) -> dict[str, Any]:
    if not isinstance(rec, dict):
        raise FrontendError(f"{where} is a {type(rec).__name__}, not an object")
    for key, kind in (("params", dict), ("buffers", dict), ("none_params", list), ("none_buffers", list),
                      ("children", list), ("attrs", dict), ("tensor_attrs", dict)):
        if not isinstance(rec.get(key, kind()), kind):
            raise FrontendError(f"{where}: {key!r} is a {type(rec[key]).__name__}, not a {kind.__name__}")
    return rec


def _tensor_ref(value: Any, table: TensorTable, where: str) -> tuple[torch.Tensor, bool]:
    if not (isinstance(value, list) and len(value) == 2 and isinstance(value[0], str) and isinstance(value[1], bool)):
        raise FrontendError(f"{where}: expected [tensor key, flag], got {value!r:.80}")
    if value[0] not in table.tensors:
        raise FrontendError(f"{where}: tensor {value[0]!r} is missing from the file")
    return table.get(value[0]), value[1]


_name = check_part  # a parameter / buffer / child name: an identifier, an index (Sequential's 0), onnx2torch's

def _check_attr_name(cls: type, key: Any, where: str) -> str:
    check_identifier(key, f"{where}: attribute")
    if key in _MODULE_INTERNALS:
        raise NotSupportedError(f"{where}: attribute {key!r} is not allowed in fxq files (module internals)")
    static = inspect.getattr_static(cls, key, None)
    if static is not None and (callable(static) or hasattr(type(static), "__get__")):
        raise NotSupportedError(f"{where}: attribute {key!r} is not allowed in fxq files (it would replace "
                                f"{cls.__qualname__}.{key})")
    return key


def decode_modules(records: list[dict[str, Any]], root: nn.Module, table: TensorTable) -> Defined:
    """Rebuild the saved tree under ``root`` (a fresh GraphModule), sharing tensors saved once."""
    if not isinstance(records, list) or not records or not isinstance(records[0], dict) or records[0].get("path"):
        raise FrontendError("the module tree does not start with the root module")
    built: dict[str, nn.Module] = {"": root}
    shared: dict[str, nn.Parameter] = {}
    defined = Defined()
    for i, raw in enumerate(records):
        rec = _record(raw, f"module record {i}")
        path = rec.get("path")
        where = f"module {path!r}"
        if i and path == "" or not isinstance(path, str) or path in built and i:
            raise FrontendError(f"{where} is saved twice or has no path")
        if not path:
            mod = root
        else:
            check_path(path, "module path")
            parent_path, _, name = path.rpartition(".")
            if parent_path not in built:
                raise FrontendError(f"{where} comes before its parent module")
            cls = resolve_class(rec.get("class"))
            mod = cls.__new__(cls)
            nn.Module.__init__(mod)
            legacy_backup = None
            for key, value in rec.get("attrs", {}).items():
                if key == LEGACY_BACKUP_ATTR and isinstance(mod, FakeQuantize):
                    legacy_backup = decode(value, table)  # older files: the backup was a plain attribute
                    continue
                _check_attr_name(cls, key, where)
                value = decode(value, table)
                object.__setattr__(mod, key, value)
                if isinstance(value, torch.Tensor):
                    defined.attrs.add(f"{path}.{key}")
            if isinstance(mod, FakeQuantize):
                mod.observer = None
        prefix = f"{path}." if path else ""
        for key, ref in rec["params"].items():  # a parameter saved under two paths stays one object
            _name(key, f"{where}: parameter")
            tensor, grad = _tensor_ref(ref, table, f"{where}: parameter {key!r}")
            p = shared.get(ref[0])
            if p is None:
                p = shared[ref[0]] = nn.Parameter(tensor, requires_grad=grad)
            mod.register_parameter(key, p)
            defined.attrs.add(prefix + key)
        for key in rec.get("none_params", []):
            mod.register_parameter(_name(key, f"{where}: parameter"), None)
            defined.attrs.add(prefix + key)
        for key, ref in rec["buffers"].items():
            tensor, persistent = _tensor_ref(ref, table, f"{where}: buffer {key!r}")
            mod.register_buffer(_name(key, f"{where}: buffer"), tensor, persistent=persistent)
            defined.attrs.add(prefix + key)
        for key in rec.get("none_buffers", []):
            mod.register_buffer(_name(key, f"{where}: buffer"), None)
            defined.attrs.add(prefix + key)
        if isinstance(mod, FakeQuantize):
            complete_fake_quantize(mod, legacy_backup)
            mod._sync_config()
        if path:
            built[parent_path].add_module(name, mod)
            built[path] = mod
            defined.modules.add(path)
        for key, tkey in rec.get("tensor_attrs", {}).items():
            if path:
                raise FrontendError(f"{where}: only the root module holds tensor attributes")
            check_identifier(key, "tensor attribute")
            if hasattr(type(root), key) or key in vars(root):
                raise NotSupportedError(f"tensor attribute {key!r} is not allowed in fxq files (it would replace "
                                        f"GraphModule.{key})")
            if not isinstance(tkey, str) or tkey not in table.tensors:
                raise FrontendError(f"tensor attribute {key!r}: tensor {tkey!r} is missing from the file")
            setattr(mod, key, table.get(tkey))
            defined.attrs.add(key)
    for rec in records:
        prefix = f"{rec['path']}." if rec["path"] else ""
        missing = [c for c in rec["children"] if not isinstance(c, str) or prefix + c not in built]
        if missing:
            raise FrontendError(f"saved module tree is incomplete: {rec['path']!r} misses children {missing[:3]}")
    return defined
