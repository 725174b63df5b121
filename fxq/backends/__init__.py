"""Backend exporters. Importing this package registers the built-in ones."""
from fxq.backends import ncnn as _ncnn  # noqa: F401  (registers "ncnn")
from fxq.backends.base import EXPORTERS, Exporter, export, exporter_for, register_exporter

__all__ = ["Exporter", "EXPORTERS", "register_exporter", "export", "exporter_for"]
