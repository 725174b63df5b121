"""Backend exporters. Importing this package registers the built-in ones."""
from fxq.backends import ncnn as _ncnn  # noqa: F401  (registers "ncnn")
from fxq.backends import onnxruntime as _onnxruntime  # noqa: F401  (registers "onnxruntime")
from fxq.backends import openppl as _openppl  # noqa: F401  (registers "openppl")
from fxq.backends import tensorrt as _tensorrt  # noqa: F401  (registers "tensorrt")
from fxq.backends.base import EXPORTERS, Exporter, export, exporter_for, register_exporter
from fxq.backends.trt_check import check_tensorrt

__all__ = ["Exporter", "EXPORTERS", "register_exporter", "export", "exporter_for", "check_tensorrt"]
