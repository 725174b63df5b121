"""Backends: one package each (``fxq/backends/<name>/``) holding its platforms, their capabilities and its exporter.

Importing this package imports every backend package found beside it, which registers their platforms and
exporters: adding a backend is adding one package. ``qdq`` is the template the ONNX exporters share.
"""
from fxq.backends.base import EXPORTERS, Exporter, export, exporter_for, register_exporter
from fxq.backends.tensorrt.check import check_tensorrt
from fxq.registry import import_submodules

import_submodules(__name__, __path__, packages_only=True)  # registers the built-in platforms and exporters

__all__ = ["Exporter", "EXPORTERS", "register_exporter", "export", "exporter_for", "check_tensorrt"]
