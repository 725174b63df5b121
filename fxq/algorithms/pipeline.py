"""Where the algorithms plug into ``fxq.quantize`` (PPQ's pass order), built-in and user-registered.

``fxq.quantize`` runs: prepare (dispatch, quantizers) -> stage ``"pre"`` -> calibration -> stage ``"post"`` ->
convert. In each stage the switches on in the setting run first, in :data:`ALGORITHM_ORDER`; then the user
algorithms named in ``setting.custom_algorithms`` whose stage it is, in that list's order.

An algorithm is one file: its settings dataclass (``@checked_setting("setting.<name>_setting")``) and its handler,
registered together with ``@register_algorithm(name, stage=..., order=..., setting=TheSettings)``. That makes
``setting.<name>`` a switch and ``setting.<name>_setting`` its settings in :class:`fxq.QuantizationSetting`
(json included), with no edit anywhere else (torchao's config -> handler pattern).
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Callable, Iterator, Mapping

from torch import fx

from fxq.checked import Checked
from fxq.errors import ConfigError, NotSupportedError
from fxq.registry import Registry

__all__ = ["register_algorithm", "run_algorithms", "switches", "ALGORITHM_ORDER", "ALGORITHMS", "SWITCHES", "STAGES",
           "Switch"]

STAGES = ("pre", "post")
"""``pre``: after prepare, before calibration (FP32 weights, quantizers not calibrated); ``post``: after
calibration, before convert (calibrated quantizers, weights not yet baked into the graph for good)."""

Algorithm = Callable[..., fx.GraphModule]


@dataclasses.dataclass(frozen=True)
class _Entry:
    fn: Algorithm
    stage: str


@dataclasses.dataclass(frozen=True)
class Switch:
    """A setting switch: ``setting.<name>`` turns the algorithm on, ``setting.<field>`` holds its ``config``."""

    name: str
    stage: str
    order: float
    config: type[Checked]
    field: str
    seq: int = 0

    def sort_key(self) -> tuple[float, int]:
        return (self.order, self.seq)


ALGORITHMS: Registry[_Entry] = Registry("algorithm")
"""Every registered algorithm implementation: the switches' and the user's names."""

SWITCHES: Registry[Switch] = Registry("algorithm switch")
"""The algorithms that are switches of :class:`fxq.QuantizationSetting`, with their settings dataclasses."""

_seq = itertools.count()


class _Order(Mapping[str, tuple[str, ...]]):
    """stage -> the switches of that stage in the order they run, read live from :data:`SWITCHES`."""

    def __getitem__(self, stage: str) -> tuple[str, ...]:
        if stage not in STAGES:
            raise KeyError(stage)
        ordered = sorted((s for _, s in SWITCHES.items() if s.stage == stage), key=Switch.sort_key)
        return tuple(s.name for s in ordered)

    def __iter__(self) -> Iterator[str]:
        return iter(STAGES)

    def __len__(self) -> int:
        return len(STAGES)

    def __repr__(self) -> str:
        return repr(dict(self))


ALGORITHM_ORDER: Mapping[str, tuple[str, ...]] = _Order()
"""Setting switches per stage, in the order they run (built-ins: pre = equalization, ssd_equalization; post =
bias_correct, lsq_optimization, adaround, blockwise_reconstruction)."""


def switches() -> list[Switch]:
    """Every setting switch, stage by stage in running order: the order of their fields in a setting."""
    return [SWITCHES.get(name) for stage in STAGES for name in ALGORITHM_ORDER[stage]]


def register_algorithm(name: str, stage: str | None = None, *, setting: type[Checked] | None = None,
                       order: float = 1000.0, override: bool = False) -> Callable[[Algorithm], Algorithm]:
    """Register ``fn(gm, data, setting, steps=None, collate_fn=None) -> gm`` under ``name`` (a decorator).

    With ``setting`` (a ``@checked_setting("setting.<field>")`` dataclass), ``name`` becomes a switch of
    :class:`fxq.QuantizationSetting`: ``setting.<name> = True`` runs ``fn`` in ``stage``, ordered among the
    switches of that stage by ``order``, and ``setting.<field>`` holds its settings. A switch name (``"adaround"``...)
    without ``setting`` implements that switch in its stage (``override=True`` to replace fxq's own). Any other name
    is a user algorithm for ``stage`` (``"pre"`` or ``"post"``, default ``"post"``); it runs when
    ``setting.custom_algorithms`` names it, after the switches of its stage. It gets the prepared ``GraphModule``,
    the calibration data, the setting, ``fxq.quantize``'s ``steps`` and ``collate_fn``, and returns the (possibly
    new) ``GraphModule`` the pipeline goes on with.

    Raises:
        ConfigError: an unknown stage, a switch registered in another stage than its own, a non-callable.
        RegistryError: ``name`` is taken and ``override`` is False.

    Example:
        >>> @fxq.register_algorithm("clip_scales", stage="post")
        ... def clip_scales(gm, data, setting, steps=None, collate_fn=None):
        ...     return gm
        >>> fxq.quantize(model, data, setting=fxq.QuantizationSetting(custom_algorithms=["clip_scales"]))
    """
    switch = SWITCHES.get(name) if name in SWITCHES else None
    if switch is not None and setting is None and stage not in (None, switch.stage):
        raise ConfigError(f"register_algorithm({name!r}, stage={stage!r}): the built-in switch {name!r} runs in "
                          f"stage {switch.stage!r}")
    stage = stage or (switch.stage if switch is not None and setting is None else "post")
    if stage not in STAGES:
        raise ConfigError(f"register_algorithm({name!r}, stage={stage!r}); use one of {STAGES}")
    if setting is not None and not (isinstance(setting, type) and issubclass(setting, Checked)
                                    and setting.PATH.startswith("setting.")):
        raise ConfigError(f"register_algorithm({name!r}, setting={setting!r}) needs a class decorated with "
                          f"@checked_setting('setting.{name}_setting')")

    def deco(fn: Algorithm) -> Algorithm:
        if not callable(fn):
            raise ConfigError(f"register_algorithm({name!r}) needs a callable, got {fn!r}")
        ALGORITHMS.register(name, _Entry(fn, stage), override=override)
        if setting is not None:
            field = setting.PATH.split(".", 1)[1]
            SWITCHES.register(name, Switch(name, stage, order, setting, field, next(_seq)), override=override)
        return fn

    return deco


def _run(name: str, fn: Algorithm, gm: fx.GraphModule, data: Any, setting: Checked,
         steps: int | None, collate_fn: Callable[[Any], Any] | None) -> fx.GraphModule:
    out = fn(gm, data, setting, steps=steps, collate_fn=collate_fn)
    if not isinstance(out, fx.GraphModule):
        raise ConfigError(f"algorithm {name!r} returned {type(out).__name__}; an algorithm returns the GraphModule "
                          f"it was given (or a new one)")
    return out


def enabled_algorithms(stage: str, setting: Checked) -> list[str]:
    """The algorithms of ``stage`` that ``setting`` (a QuantizationSetting) turns on, in running order: its
    switches, then its ``custom_algorithms`` of that stage."""
    names = []
    for switch in ALGORITHM_ORDER[stage]:
        if not getattr(setting, switch):
            continue
        if switch not in ALGORITHMS:
            raise NotSupportedError(
                f"setting.{switch} = True, but this version of fxq has no implementation of it; switch it off"
            )
        names.append(switch)
    return names + [name for name in setting.custom_algorithms if ALGORITHMS.get(name).stage == stage]


def run_algorithms(stage: str, gm: fx.GraphModule, data: Any, setting: Checked,
                   steps: int | None = None, collate_fn: Callable[[Any], Any] | None = None) -> fx.GraphModule:
    """Run the algorithms of ``stage`` that ``setting`` turns on (:func:`enabled_algorithms`)."""
    for name in enabled_algorithms(stage, setting):
        gm = _run(name, ALGORITHMS.get(name).fn, gm, data, setting, steps, collate_fn)
    return gm
