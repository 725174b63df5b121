"""Exporter registry: one exporter per backend, looked up by name or through a platform.

An exporter is a class with ``name`` and ``export(model, path, **options) -> list[Path]`` (the files it
wrote). It checks everything it needs *before* writing anything, creates a missing output folder, and writes
its files as one atomic set (:func:`fxq.io.atomic_file_set`): old set or new set, never a mix.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torch import fx, nn

from fxq.errors import ExportError
from fxq.parts import export_parts, quantized_parts
from fxq.registry import Registry

__all__ = ["Exporter", "EXPORTERS", "register_exporter", "export", "exporter_for"]

EXPORTERS: Registry[type["Exporter"]] = Registry("exporter")


class Exporter:
    """Base class: subclasses set ``name`` and implement :meth:`export`."""

    name = "exporter"
    options: tuple[str, ...] = ()  # accepted keyword options; anything else is rejected

    def export(self, model: nn.Module, path: str | os.PathLike, **options: Any) -> list[Path]:
        raise NotImplementedError

    def check_options(self, options: dict[str, Any]) -> None:
        unknown = sorted(set(options) - set(self.options))
        if unknown:
            raise ExportError(f"exporter {self.name!r} got unknown option(s) {unknown}; it accepts {list(self.options)}")


def register_exporter(name: str, *, override: bool = False):
    """Class decorator registering an :class:`Exporter` subclass under ``name``."""

    def deco(cls: type[Exporter]) -> type[Exporter]:
        cls.name = name
        EXPORTERS.register(name, cls, override=override)
        return cls

    return deco


def exporter_for(platform_or_exporter: Any) -> Exporter:
    """An exporter instance for an exporter name, a platform name, or a Platform."""
    from fxq.qconfig.base import PLATFORMS, Platform, get_platform

    key = platform_or_exporter
    if isinstance(key, str) and key in EXPORTERS:
        return EXPORTERS.get(key)()
    if isinstance(key, Platform) or (isinstance(key, str) and key in PLATFORMS) or isinstance(key, type):
        plat = get_platform(key)
        if not plat.exporter:
            raise ExportError(f"platform {plat.name!r} names no exporter; pass an exporter name: {EXPORTERS.names()}")
        return EXPORTERS.get(plat.exporter)()
    return EXPORTERS.get(str(key))()


def export(model: nn.Module, platform: Any, path: str | os.PathLike, **options: Any) -> list[Path]:
    """Write ``model`` (prepared and calibrated by fxq) in ``platform``'s deployable format.

    Args:
        model: the quantized GraphModule from :func:`fxq.quantize`, or a model it quantized in parts (one file set
            per part, ``<stem>_<part path>``, written as one set).
        platform: a platform (its exporter is used) or an exporter name.
        path: output file path or stem; exporters that write several files derive their names from it. A missing
            folder is created (parents too).
        options: exporter-specific options (unknown ones raise).

    Returns:
        the paths written.

    Raises:
        ExportError: the model cannot be expressed, the path is a folder or lies under a file, or a write fails
            (disk full, file size limit, permissions); the previous files are then left as they were.
    """
    exporter = exporter_for(platform)
    exporter.check_options(options)
    if not isinstance(model, fx.GraphModule) and quantized_parts(model):  # fxq.quantize quantized it in parts
        if options.get("example_inputs") is not None:
            raise ExportError("example_inputs cannot be given for a model quantized in parts (each part has its "
                              "own inputs, recorded at calibration); drop it, or export one part: "
                              "fxq.export(model.<part>, ..., example_inputs=...)")
        return export_parts(model, path, lambda part, stem: exporter.export(part, stem, **options))
    return exporter.export(model, path, **options)
