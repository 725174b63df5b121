"""The ncnn backend: the ``ncnn_int8`` platform, its capability and the ``"ncnn"`` exporter.

Modules, each importing only those below it (no cycle): ``exporter`` (files, options) -> ``builder`` (the fx walk,
names, blobs, int8 scales) -> ``registry`` (layer converters by op type) and ``writer`` (the ``.param`` /
``.bin`` / table format); ``layers`` and ``recurrent`` hold the built-in converters and are imported here, so a
converter is registered as soon as any module of the package is.
"""
from fxq.backends.ncnn import layers as _layers  # noqa: F401  (registers the built-in layer converters)
from fxq.backends.ncnn import recurrent as _recurrent  # noqa: F401  (registers the LSTM / GRU converter)
from fxq.backends.ncnn.builder import NcnnBuilder, WeightInfo, build_ncnn_model
from fxq.backends.ncnn.exporter import NcnnExporter, ncnn_paths
from fxq.backends.ncnn.platforms import NcnnInt8
from fxq.backends.ncnn.registry import NCNN_CONVERTERS, register_ncnn_converter
from fxq.backends.ncnn.writer import Int8Scales, NcnnLayer, NcnnModel

__all__ = ["NcnnExporter", "ncnn_paths", "NcnnInt8", "NCNN_CONVERTERS", "register_ncnn_converter", "NcnnBuilder",
           "WeightInfo", "build_ncnn_model", "NcnnModel", "NcnnLayer", "Int8Scales"]
