"""One error tree for fxq: catch ``FxqError`` to catch everything fxq raises on purpose.

Every message says what is wrong, where (node, op, file, observer) and what to do about it.
"""
from __future__ import annotations

__all__ = [
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
    "one_line",
]


def one_line(exc: BaseException) -> str:
    """``exc``'s message on one line (whitespace runs collapsed), for quoting it inside fxq's own messages; the
    graph dump torch.fx's interpreter appends (``While executing %node ...``) is left out: fxq names the node."""
    text = str(exc)
    cut = text.find("While executing %")
    return " ".join((text[:cut] if cut > 0 else text).split())


class FxqError(Exception):
    """Base class of every error fxq raises deliberately."""


class ConfigError(FxqError, ValueError):
    """A quantization config, setting or platform is invalid or inconsistent."""


class ObserverError(FxqError, ValueError):
    """An observer saw data it cannot turn into a scale (NaN/Inf, nothing observed, ...)."""


class TraceError(FxqError):
    """``torch.fx`` could not trace the user's module.

    Symbolic tracing's errors say where: ``module_path`` (the failing submodule, None for the model's own forward),
    ``construct`` (what could not be traced) and ``source_line``; capture reads them to keep that submodule FP32.
    """

    module_path: str | None = None
    construct: str | None = None
    source_line: str | None = None


class GraphError(FxqError):
    """A graph pass met a graph it cannot handle."""


class CalibrationError(FxqError, ValueError):
    """Calibration data is empty, has the wrong number of inputs, or the wrong shape."""


class FrontendError(FxqError):
    """A model file (ONNX, caffe) could not be read or converted.

    ``suggested_outputs``: for a graph part fxq cannot convert (a data-dependent If, a Loop), the tensor names of a
    cut that loads the graph without it (``load_onnx(..., outputs=...)``); empty otherwise."""

    suggested_outputs: tuple[str, ...] = ()


class ExportError(FxqError):
    """A backend exporter cannot express the model, or cannot write where asked.

    ``suggested_outputs``: for ops of an ONNX-loaded model the target has no layer for (ncnn and comparisons),
    the tensor names of a cut that loads the file without them (``load_onnx(..., outputs=...)``); empty otherwise."""

    suggested_outputs: tuple[str, ...] = ()


class RegistryError(FxqError, KeyError):
    """A name was registered twice, or looked up and not found."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class NotSupportedError(FxqError, NotImplementedError):
    """A feature was asked for that this version of fxq does not provide."""
