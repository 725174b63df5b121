"""fxq: PyTorch-native torch.fx quantization — an ``nn.Module`` in, a quantized ``GraphModule`` out.

Public API, re-exported name by name; everything not listed here is private.
"""
# isort: skip_file  (grouped by topic, spec first; the order is deliberate)

from fxq.algorithms import register_algorithm
from fxq.analysis import (
    ErrorReport,
    StatisticsReport,
    graphwise_error_analyse,
    layerwise_error_analyse,
    locate_mismatch,
    statistics,
    write_report,
)
from fxq.api import prepare, quantize
from fxq.backends import export, register_exporter
from fxq.data import ImagePreprocess, load_calibration_folder
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
from fxq.frontends.caffe import load_caffe
from fxq.frontends.onnx import load_onnx
from fxq.functional import dequantize, fake_quantize, quantize_to_int, round_with_policy
from fxq.graph.calibrate import calibrate
from fxq.graph.convert import convert, fp32_mode, switch_to_fp32, switch_to_quantized
from fxq.graph.decompose import register_decomposition
from fxq.graph.dispatch import register_dispatcher
from fxq.graph.op_types import register_op_type
from fxq.graph.summary import QuantSummary, summary
from fxq.nn import FakeQuantize, fake_quant_mode
from fxq.observers import Observer, register_observer
from fxq.precision_search import AutoQuantReport, Budget, auto_quantize
from fxq.qat import freeze_bn, prepare_qat
from fxq.qconfig import Platform, get_platform, register_platform
from fxq.recurrent import capture as _recurrent_capture  # noqa: F401  (registers nn.LSTM / nn.GRU capture)
from fxq.serialization import load, save
from fxq.setting import QuantizationSetting, QuantizationSettingFactory
from fxq.spec import FloatFormat, QuantState, RoundingPolicy, TensorQuantConfig

# No NullHandler on the "fxq" logger: where the application configured no logging, Python's last-resort handler
# prints WARNING and above to stderr, so a user is told when fxq keeps a layer FP32, protects a mixed-range concat
# or writes a file a default onnxruntime session computes differently. Configured logging takes over as usual.

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
    # platforms and settings
    "Platform",
    "get_platform",
    "register_platform",
    "QuantizationSetting",
    "QuantizationSettingFactory",
    # flow
    "prepare",
    "calibrate",
    "convert",
    "quantize",
    "auto_quantize",
    "Budget",
    "AutoQuantReport",
    "switch_to_fp32",
    "switch_to_quantized",
    "fp32_mode",
    "summary",
    "QuantSummary",
    "register_dispatcher",
    "register_decomposition",
    "register_op_type",
    "register_algorithm",
    # quantization-aware training
    "prepare_qat",
    "freeze_bn",
    # frontends
    "load_onnx",
    "load_caffe",
    # export and native save / load
    "export",
    "register_exporter",
    "save",
    "load",
    # analysis and calibration data
    "graphwise_error_analyse",
    "layerwise_error_analyse",
    "locate_mismatch",
    "statistics",
    "write_report",
    "ErrorReport",
    "StatisticsReport",
    "load_calibration_folder",
    "ImagePreprocess",
]
