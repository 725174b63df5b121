"""The ONNX Runtime backend: the ``"onnxruntime"`` QDQ exporter and the platforms it exports: ``ort_int8`` (with
its capability), ``dsp_int8`` and the simulation-only ``academic_*`` platforms (no capability: any valid scheme)."""
from fxq.backends.onnxruntime.academic import AcademicInt4, AcademicInt8, AcademicMix
from fxq.backends.onnxruntime.dsp import DspInt8
from fxq.backends.onnxruntime.exporter import OnnxRuntimeExporter, auto_opset, ort_bias_issues, warn_ort_bias_issues
from fxq.backends.onnxruntime.platforms import OrtInt8

__all__ = ["OnnxRuntimeExporter", "auto_opset", "ort_bias_issues", "warn_ort_bias_issues", "OrtInt8", "DspInt8",
           "AcademicInt8", "AcademicInt4", "AcademicMix"]
