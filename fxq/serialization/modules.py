"""The module tree of a GraphModule as data: class names, plain attributes, parameters and buffers.

A module is rebuilt without running its ``__init__``: an instance of its (allowed) class gets
``nn.Module.__init__`` and then its saved attributes, parameters, buffers and children — which is what
``forward`` reads. Modules whose class is not allowed are rebuilt as plain ``nn.Module`` containers when
the graph never calls them (they only hold parameters), and are an error otherwise.
"""
from __future__ import annotations

import logging
from typing import Any

import torch
from torch import fx, nn

from fxq.errors import NotSupportedError
from fxq.nn.fake_quantize import FakeQuantize
from fxq.serialization.allowlist import class_name, resolve_class
from fxq.serialization.codec import TensorTable, Unencodable, decode, encode

__all__ = ["encode_modules", "decode_modules"]

logger = logging.getLogger(__name__)

_MODULE_INTERNALS = frozenset(nn.Module().__dict__) - {"training"}
_SKIP_ATTRS = {FakeQuantize: frozenset({"observer"})}  # calibration state, rebuilt on demand


def _skip(mod: nn.Module) -> frozenset[str]:
    return next((v for k, v in _SKIP_ATTRS.items() if isinstance(mod, k)), frozenset())


def _attrs(path: str, mod: nn.Module, table: TensorTable) -> dict[str, Any]:
    out: dict[str, Any] = {}
    skip = _skip(mod)
    for key, value in vars(mod).items():
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


def _fill(mod: nn.Module, rec: dict[str, Any], table: TensorTable) -> None:
    for key, (tkey, grad) in rec["params"].items():
        mod.register_parameter(key, nn.Parameter(table.get(tkey), requires_grad=grad))
    for key in rec.get("none_params", []):
        mod.register_parameter(key, None)
    for key, (tkey, persistent) in rec["buffers"].items():
        mod.register_buffer(key, table.get(tkey), persistent=persistent)
    for key in rec.get("none_buffers", []):
        mod.register_buffer(key, None)


def decode_modules(records: list[dict[str, Any]], root: nn.Module, table: TensorTable) -> None:
    """Rebuild the saved tree under ``root`` (a fresh GraphModule), sharing tensors saved once."""
    built: dict[str, nn.Module] = {"": root}
    shared: dict[str, nn.Parameter] = {}
    for rec in records:
        path = rec["path"]
        if not path:
            mod = root
        else:
            cls = resolve_class(rec["class"])
            mod = cls.__new__(cls)
            nn.Module.__init__(mod)
            for key, value in rec["attrs"].items():
                if key.startswith("__"):
                    raise NotSupportedError(f"module {path!r}: attribute {key!r} is not allowed in fxq files")
                object.__setattr__(mod, key, decode(value, table))
            if isinstance(mod, FakeQuantize):
                mod.observer = None
        for key, (tkey, grad) in rec["params"].items():  # a parameter saved under two paths stays one object
            p = shared.get(tkey)
            if p is None:
                p = shared[tkey] = nn.Parameter(table.get(tkey), requires_grad=grad)
            mod.register_parameter(key, p)
        rest = dict(rec, params={})
        _fill(mod, rest, table)
        if isinstance(mod, FakeQuantize):
            mod._sync_config()
        if path:
            parent_path, _, name = path.rpartition(".")
            built[parent_path].add_module(name, mod)
            built[path] = mod
        for key, tkey in rec.get("tensor_attrs", {}).items():
            setattr(mod, key, table.get(tkey))
    missing = [r["path"] for r in records if any(f"{r['path']}.{c}".lstrip(".") not in built for c in r["children"])]
    if missing:
        raise NotSupportedError(f"saved module tree is incomplete under {missing[:3]}")
