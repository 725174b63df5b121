"""Recurrent layers (``nn.LSTM`` / ``nn.GRU``, ONNX ``LSTM`` / ``GRU``) as quantizable ops with weight inputs.

:mod:`fxq.recurrent.ops` defines the ops and (through :mod:`fxq.recurrent.onnx_export`) their ONNX forms;
:mod:`fxq.graph.op_types` registers their op types and weight inputs. :mod:`fxq.recurrent.capture` holds the
tracing decompositions of ``nn.LSTM`` / ``nn.GRU`` (``import fxq`` imports it).
"""
from fxq.recurrent import onnx_export, ops  # noqa: F401  (registrations)
from fxq.recurrent.ops import RECURRENT_TARGETS

__all__ = ["RECURRENT_TARGETS"]
