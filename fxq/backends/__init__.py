"""Backends: one package each (``fxq/backends/<name>/``) holding its platforms, their capabilities and its exporter.

Importing this package imports every backend package found beside it, which registers their platforms and
exporters: adding a backend is adding one package. ``qdq`` is the template the ONNX exporters share.
"""
import importlib as _importlib
import pkgutil as _pkgutil

from fxq.backends.base import EXPORTERS, Exporter, export, exporter_for, register_exporter
from fxq.backends.tensorrt.check import check_tensorrt


def _import_backends() -> None:
    """Import every subpackage (sorted by name), registering the built-in platforms and exporters."""
    for info in _pkgutil.iter_modules(__path__):
        if info.ispkg:
            _importlib.import_module(f"{__name__}.{info.name}")


_import_backends()

__all__ = ["Exporter", "EXPORTERS", "register_exporter", "export", "exporter_for", "check_tensorrt"]
