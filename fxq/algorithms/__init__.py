"""Accuracy algorithms as plain torch loops, switched on by ``QuantizationSetting`` fields.

Each algorithm is one file: its settings dataclass and its handler, registered together with
:func:`register_algorithm` under the setting switch that enables it and the stage it runs in (``"pre"`` before
calibration on FP32 weights, ``"post"`` after it); :class:`fxq.QuantizationSetting` composes the switches.
A switch that is on with no registered algorithm raises :class:`fxq.NotSupportedError`. User algorithms
register under their own name and run, after the built-ins of their stage, when ``setting.custom_algorithms``
names them (see :mod:`fxq.algorithms.pipeline`).

Registered: ``equalization`` (cross-layer equalization), ``ssd_equalization`` (PPQ's SSD equalization),
``bias_correct``, ``lsq_optimization`` (block-wise LSQ), ``adaround``, ``blockwise_reconstruction`` (BRECQ / QDrop).
"""

from fxq.algorithms.pipeline import (
    ALGORITHM_ORDER,
    ALGORITHMS,
    STAGES,
    SWITCHES,
    enabled_algorithms,
    register_algorithm,
    run_algorithms,
)
from fxq.registry import import_submodules

__all__ = ["register_algorithm", "run_algorithms", "enabled_algorithms", "ALGORITHM_ORDER", "ALGORITHMS", "SWITCHES", "STAGES"]


import_submodules(__name__, __path__)  # their decorators register the algorithms: a new one is its file alone
