"""Accuracy algorithms as plain torch loops, switched on by ``QuantizationSetting`` fields.

Each algorithm registers itself with :func:`register_algorithm` under the setting switch that enables
it and the stage it runs in (``"pre"`` before calibration on FP32 weights, ``"post"`` after it).
A switch that is on with no registered algorithm raises :class:`fxq.NotSupportedError`. User algorithms
register under their own name and run, after the built-ins of their stage, when ``setting.custom_algorithms``
names them (see :mod:`fxq.algorithms.pipeline`).

Registered: ``equalization`` (cross-layer equalization), ``ssd_equalization`` (PPQ's SSD equalization),
``bias_correct``, ``lsq_optimization`` (block-wise LSQ), ``adaround``, ``blockwise_reconstruction`` (BRECQ / QDrop).
"""
from fxq.algorithms import adaround, bias_correction, brecq, equalization, lsq, ssd_equalization  # noqa: F401,E402
from fxq.algorithms.pipeline import ALGORITHM_ORDER, ALGORITHMS, STAGES, register_algorithm, run_algorithms

__all__ = ["register_algorithm", "run_algorithms", "ALGORITHM_ORDER", "ALGORITHMS", "STAGES"]
