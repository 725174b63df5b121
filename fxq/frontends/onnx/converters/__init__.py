"""Our ONNX op converters, filling onnx2torch's gaps through its own converter registry.

The converter modules import onnx2torch (which imports torchvision), so they are registered on first use by
:func:`load_builtin_converters` (every public module here: a new converter is one new file) rather than on import,
keeping ``import fxq`` light. Extend with :func:`register_onnx_converter`.
"""
from fxq.frontends.onnx.converters.registry import (
    ONNX_CONVERTERS,
    converter_key,
    load_builtin_converters,
    register_onnx_converter,
)

__all__ = ["ONNX_CONVERTERS", "register_onnx_converter", "converter_key", "load_builtin_converters"]
