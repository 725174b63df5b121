"""fxq: PyTorch-native torch.fx quantization — an ``nn.Module`` in, a quantized ``GraphModule`` out.

Public API, re-exported name by name; everything not listed here is private.
"""
import logging as _logging

# --- spec and errors
from fxq.errors import (
    CalibrationError,
    ConfigError,
    ExportError,
    FrontendError,
    FxqError,
    GraphError,
    NotSupportedError,
    ObserverError,
    RegistryError,
    TraceError,
)
from fxq.spec import FloatFormat, QuantState, RoundingPolicy, TensorQuantConfig

# --- functional math (one definition) and modules
from fxq.functional import dequantize, fake_quantize, quantize_to_int, round_with_policy
from fxq.nn import FakeQuantize, fake_quant_mode
from fxq.observers import Observer, register_observer

_logging.getLogger(__name__).addHandler(_logging.NullHandler())

__version__ = "0.1.0"

__all__ = [
    # spec
    "TensorQuantConfig",
    "RoundingPolicy",
    "QuantState",
    "FloatFormat",
    # errors
    "FxqError",
    "ConfigError",
    "ObserverError",
    "TraceError",
    "GraphError",
    "CalibrationError",
    "FrontendError",
    "ExportError",
    "RegistryError",
    "NotSupportedError",
    # functional
    "quantize_to_int",
    "dequantize",
    "fake_quantize",
    "round_with_policy",
    # modules and observers
    "FakeQuantize",
    "fake_quant_mode",
    "Observer",
    "register_observer",
]
