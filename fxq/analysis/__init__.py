"""Analysis: where the quantization error comes from (graphwise / layerwise), value statistics, reports.

Every tool runs the quantized model as it is, through :class:`~fxq.analysis.runner.GraphRunner`: per
batch one FP32 pass and one quantized pass (layerwise: one FP32 pass and a partial pass per layer).
"""
from fxq.analysis.error import ErrorReport, LayerError, graphwise_error_analyse, layerwise_error_analyse
from fxq.analysis.mismatch import MismatchReport, TensorMismatch, locate_mismatch
from fxq.analysis.report import ReportData, write_report
from fxq.analysis.statistics import StatisticsReport, TensorStatistics, ValueStats, statistics

__all__ = [
    "graphwise_error_analyse",
    "layerwise_error_analyse",
    "ErrorReport",
    "LayerError",
    "statistics",
    "StatisticsReport",
    "TensorStatistics",
    "ValueStats",
    "write_report",
    "ReportData",
    "locate_mismatch",
    "MismatchReport",
    "TensorMismatch",
]
