"""fxq's table of ONNX op converters, installed into onnx2torch's own converter registry.

A converter has onnx2torch's signature: ``(OnnxNode, OnnxGraph) -> OperationConverterResult``. It is registered for
the ``since_version`` of the op's schema it handles: a model importing opset 20 looks ``ReduceMean`` up at version 18
(the newest schema at or below 20). Ops in custom domains without a schema are looked up at the domain's imported
version as is.

Where onnx2torch already converts the exact (domain, op, version), its converter is kept and ours is only recorded
(logged at debug level), so a newer onnx2torch wins over our stop-gaps, unless ``override=True``. Otherwise
onnx2torch gets a small dispatcher that reads this table when it converts, so a later override takes effect at once.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Iterable

from fxq.errors import RegistryError
from fxq.registry import Registry, import_submodules

__all__ = ["ONNX_CONVERTERS", "register_onnx_converter", "converter_key", "domain_alias", "load_builtin_converters"]

_LOG = logging.getLogger(__name__)

Converter = Callable[[Any, Any], Any]

ONNX_CONVERTERS: Registry[Converter] = Registry("ONNX op converter")
_INSTALLED: set[str] = set()  # keys whose onnx2torch entry dispatches to ONNX_CONVERTERS
_BUILTINS_LOADING: list[bool] = []  # non-empty once fxq's own converters are (being) registered


def load_builtin_converters() -> None:
    """Register fxq's own converters (once): every public module of this package, found on disk, so that adding a
    converter is adding its file. Imports onnx2torch, hence torchvision: called on first use."""
    if _BUILTINS_LOADING:
        return
    _BUILTINS_LOADING.append(True)
    import_submodules(str(__package__), [str(Path(__file__).parent)], exclude=("registry",))


def domain_alias(domain: str) -> str:
    """The dot-free name a domain gets during conversion (onnx2torch puts the domain into module names)."""
    return domain.replace(".", "_") if "." in domain and domain != "ai.onnx" else domain


def converter_key(op_type: str, version: int, domain: str = "") -> str:
    """Registry key of one converter, e.g. ``ai.onnx::ReduceMean-18``."""
    return f"{domain or 'ai.onnx'}::{op_type}-{int(version)}"


def _onnx2torch_has(op_type: str, version: int, domain: str) -> bool:
    from onnx2torch.node_converters.registry import get_converter

    try:
        get_converter(operation_type=op_type, version=version, domain=domain)
    except NotImplementedError:
        return False
    return True


def _install(op_type: str, version: int, domain: str, replace: bool) -> None:
    """Point onnx2torch at our table for this key (once); the table is read at conversion time."""
    from onnx2torch.node_converters import registry as o2t

    key = converter_key(op_type, version, domain)
    if key in _INSTALLED:
        return

    def dispatch(node: Any, graph: Any) -> Any:
        return ONNX_CONVERTERS.get(key)(node, graph)

    dispatch.__name__ = f"fxq_convert_{op_type}_{version}"
    if _onnx2torch_has(op_type, version, domain):
        if not replace:
            _LOG.debug("onnx2torch already converts %s; keeping its converter", key)
            return
        table = getattr(o2t, "_CONVERTER_REGISTRY", None)  # onnx2torch has no public way to replace an entry
        if not isinstance(table, dict):
            raise RegistryError(f"cannot replace onnx2torch's converter for {key} with this onnx2torch version")
        table[o2t.OperationDescription(domain=domain, operation_type=op_type, version=version)] = dispatch
        _LOG.info("replacing onnx2torch's converter for %s", key)
    else:
        o2t.add_converter(operation_type=op_type, version=version, domain=domain)(dispatch)
    alias = domain_alias(domain)
    if alias != domain and not _onnx2torch_has(op_type, version, alias):
        o2t.add_converter(operation_type=op_type, version=version, domain=alias)(dispatch)
    _INSTALLED.add(key)


def register_onnx_converter(
    op_type: str, versions: int | Iterable[int], domain: str = "", *, override: bool = False
) -> Callable[[Converter], Converter]:
    """Decorator: convert ``op_type`` at each of ``versions`` (schema ``since_version``s) with the decorated function.

    Args:
        op_type: ONNX op type, e.g. ``"ReduceMean"``.
        versions: one version or several; use the op schema's ``since_version`` values.
        domain: ONNX domain; ``""`` (the default) is ``ai.onnx``.
        override: replace a converter registered under the same key, fxq's or onnx2torch's own.

    Raises:
        RegistryError: the key is already registered in fxq and ``override`` is false.

    Example:
        >>> @register_onnx_converter("MyOp", 1, domain="com.example")
        ... def _my_op(node, graph):
        ...     ...
    """
    load_builtin_converters()  # ours first, so a user's converter for the same key needs override=True
    vs = (versions,) if isinstance(versions, int) else tuple(versions)
    if domain == "ai.onnx":
        domain = ""

    def deco(fn: Converter) -> Converter:
        for v in vs:
            ONNX_CONVERTERS.register(converter_key(op_type, v, domain), fn, override=override)
            _install(op_type, v, domain, replace=override)
        return fn

    return deco
