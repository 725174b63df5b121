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
import importlib
import pkgutil

from fxq.algorithms.pipeline import (
    ALGORITHM_ORDER,
    ALGORITHMS,
    STAGES,
    SWITCHES,
    enabled_algorithms,
    register_algorithm,
    run_algorithms,
)

__all__ = ["register_algorithm", "run_algorithms", "enabled_algorithms", "ALGORITHM_ORDER", "ALGORITHMS", "SWITCHES", "STAGES"]


def _import_algorithm_modules() -> None:
    """Import every public module of this package (alphabetically): their decorators register the algorithms, so a
    new built-in algorithm is its file alone."""
    for name in sorted(m.name for m in pkgutil.iter_modules(__path__)):
        if not name.startswith("_"):
            importlib.import_module(f"{__name__}.{name}")


_import_algorithm_modules()
