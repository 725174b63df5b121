"""Exporter registry: one exporter per backend, looked up by name or through a platform.

An exporter is a class with ``name`` and ``render_files(model, path, **options) -> {path: content}``: it checks
everything it needs and renders every file in memory (``None`` deletes a stale file of the set, e.g. an earlier
export's external data). :meth:`Exporter.export` then creates a missing output folder and writes the files as one
atomic set (:func:`fxq.io.atomic_file_set`): old set or new set, never a mix. A model quantized in parts is
rendered part by part and written once, as one set.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

from fxq.errors import ExportError
from fxq.io import atomic_file_set, ensure_dir
from fxq.parts import quantized_parts, render_parts
from fxq.registry import Registry

__all__ = ["Exporter", "EXPORTERS", "register_exporter", "export", "exporter_for", "FileContents"]

logger = logging.getLogger(__name__)

FileContents = dict[Path, "bytes | bytearray | str | None"]
"""An export's files before they are written: ``{path: content}``; ``None`` deletes that file in the same set."""

EXPORTERS: Registry[type["Exporter"]] = Registry("exporter")


class Exporter:
    """Base class: subclasses set ``name`` (by :func:`register_exporter`) and ``options``, and implement
    :meth:`render_files`; :meth:`export` writes what it renders."""

    name = "exporter"
    options: tuple[str, ...] = ()  # accepted keyword options; anything else is rejected

    def render_files(self, model: nn.Module, path: str | os.PathLike, **options: Any) -> FileContents:
        """Every check, then every file of ``model`` exported at ``path`` in memory; raises
        :class:`fxq.ExportError` (nothing written) when the model cannot be expressed."""
        raise NotImplementedError

    def export(self, model: nn.Module, path: str | os.PathLike, **options: Any) -> list[Path]:
        """Render the files, then write them as one atomic set; returns the paths written. Nothing in an export
        needs gradients: a model with learned scales (QAT, LSQ, not converted yet) exports as it computes now."""
        self.check_options(options)
        with torch.no_grad():
            files = self.render_files(model, path, **options)
        return write_files(files)

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
        return write_files(render_parts(model, path, lambda part, stem: exporter.render_files(part, stem, **options)))
    return exporter.export(model, path, **options)


def write_files(files: FileContents) -> list[Path]:
    """Create the folder if missing, then write every file as one atomic set (:func:`fxq.io.atomic_file_set`)."""
    for folder in dict.fromkeys(Path(p).parent for p in files):
        ensure_dir(folder)
    written = atomic_file_set(files)
    for path in written:
        logger.info("wrote %s", path)
    return written
