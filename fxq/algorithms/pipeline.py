"""Where the algorithms plug into ``fxq.quantize`` (PPQ's pass order), built-in and user-registered.

``fxq.quantize`` runs: prepare (dispatch, quantizers) -> stage ``"pre"`` -> calibration -> stage ``"post"`` ->
convert. In each stage the built-ins switched on in the setting run first, in :data:`ALGORITHM_ORDER`; then the
user algorithms named in ``setting.custom_algorithms`` whose stage it is, in that list's order.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from torch import fx

from fxq.errors import ConfigError, NotSupportedError
from fxq.registry import Registry
from fxq.setting import QuantizationSetting

__all__ = ["register_algorithm", "run_algorithms", "ALGORITHM_ORDER", "ALGORITHMS", "STAGES"]

STAGES = ("pre", "post")
"""``pre``: after prepare, before calibration (FP32 weights, quantizers not calibrated); ``post``: after
calibration, before convert (calibrated quantizers, weights not yet baked into the graph for good)."""

ALGORITHM_ORDER: dict[str, tuple[str, ...]] = {
    "pre": ("equalization", "ssd_equalization"),
    "post": ("bias_correct", "lsq_optimization", "adaround", "blockwise_reconstruction"),
}
"""Built-in setting switches per stage, in the order they run."""

Algorithm = Callable[..., fx.GraphModule]


@dataclasses.dataclass(frozen=True)
class _Entry:
    fn: Algorithm
    stage: str


ALGORITHMS: Registry[_Entry] = Registry("algorithm")
"""Every registered algorithm: the built-in switches and the user's names."""


def _builtin_stage(name: str) -> str | None:
    return next((stage for stage, names in ALGORITHM_ORDER.items() if name in names), None)


def register_algorithm(name: str, stage: str | None = None, *, override: bool = False):
    """Register ``fn(gm, data, setting, steps=None, collate_fn=None) -> gm`` under ``name`` (a decorator).

    A built-in switch name (``"adaround"``...) implements that switch in its built-in stage (``override=True`` to
    replace fxq's own). Any other name is a user algorithm for ``stage`` (``"pre"`` or ``"post"``, default
    ``"post"``); it runs when ``setting.custom_algorithms`` names it, after the built-ins of its stage. It gets the
    prepared ``GraphModule``, the calibration data, the setting, ``fxq.quantize``'s ``steps`` and ``collate_fn``,
    and returns the (possibly new) ``GraphModule`` the pipeline goes on with.

    Example:
        >>> @fxq.register_algorithm("clip_scales", stage="post")
        ... def clip_scales(gm, data, setting, steps=None, collate_fn=None):
        ...     return gm
        >>> fxq.quantize(model, data, setting=fxq.QuantizationSetting(custom_algorithms=["clip_scales"]))
    """
    builtin = _builtin_stage(name)
    if builtin is not None and stage not in (None, builtin):
        raise ConfigError(f"register_algorithm({name!r}, stage={stage!r}): the built-in switch {name!r} runs in "
                          f"stage {builtin!r}")
    stage = builtin or stage or "post"
    if stage not in STAGES:
        raise ConfigError(f"register_algorithm({name!r}, stage={stage!r}); use one of {STAGES}")

    def deco(fn: Algorithm) -> Algorithm:
        if not callable(fn):
            raise ConfigError(f"register_algorithm({name!r}) needs a callable, got {fn!r}")
        ALGORITHMS.register(name, _Entry(fn, stage), override=override)
        return fn

    return deco


def _run(name: str, fn: Algorithm, gm: fx.GraphModule, data: Any, setting: QuantizationSetting,
         steps: int | None, collate_fn: Callable[[Any], Any] | None) -> fx.GraphModule:
    out = fn(gm, data, setting, steps=steps, collate_fn=collate_fn)
    if not isinstance(out, fx.GraphModule):
        raise ConfigError(f"algorithm {name!r} returned {type(out).__name__}; an algorithm returns the GraphModule "
                          f"it was given (or a new one)")
    return out


def run_algorithms(stage: str, gm: fx.GraphModule, data: Any, setting: QuantizationSetting,
                   steps: int | None = None, collate_fn: Callable[[Any], Any] | None = None) -> fx.GraphModule:
    """Run the built-ins of ``stage`` that ``setting`` switches on, then its ``custom_algorithms`` of ``stage``."""
    for switch in ALGORITHM_ORDER[stage]:
        if not getattr(setting, switch):
            continue
        if switch not in ALGORITHMS:
            raise NotSupportedError(
                f"setting.{switch} = True, but this version of fxq has no implementation of it; switch it off"
            )
        gm = _run(switch, ALGORITHMS.get(switch).fn, gm, data, setting, steps, collate_fn)
    for name in setting.custom_algorithms:
        entry = ALGORITHMS.get(name)
        if entry.stage == stage:
            gm = _run(name, entry.fn, gm, data, setting, steps, collate_fn)
    return gm
