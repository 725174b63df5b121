"""Where the algorithms plug into ``fxq.quantize`` (PPQ's pass order)."""
from __future__ import annotations

from typing import Any, Callable

from torch import fx

from fxq.errors import NotSupportedError
from fxq.setting import QuantizationSetting

__all__ = ["register_algorithm", "run_algorithms", "ALGORITHM_ORDER"]

ALGORITHM_ORDER: dict[str, tuple[str, ...]] = {
    "pre": ("equalization", "ssd_equalization"),
    "post": ("bias_correct", "lsq_optimization", "adaround", "blockwise_reconstruction"),
}
"""Setting switches per stage, in the order they run."""

_ALGORITHMS: dict[str, Callable[..., fx.GraphModule]] = {}


def register_algorithm(switch: str):
    """Register ``fn(gm, data, setting, steps=None, collate_fn=None) -> gm`` for a setting switch."""
    known = {s for stage in ALGORITHM_ORDER.values() for s in stage}
    if switch not in known:
        raise NotSupportedError(f"no setting switch {switch!r}; known: {sorted(known)}")

    def deco(fn: Callable[..., fx.GraphModule]) -> Callable[..., fx.GraphModule]:
        _ALGORITHMS[switch] = fn
        return fn

    return deco


def run_algorithms(stage: str, gm: fx.GraphModule, data: Any, setting: QuantizationSetting,
                   steps: int | None = None, collate_fn: Callable[[Any], Any] | None = None) -> fx.GraphModule:
    """Run every algorithm of ``stage`` that ``setting`` switches on."""
    for switch in ALGORITHM_ORDER[stage]:
        if not getattr(setting, switch):
            continue
        fn = _ALGORITHMS.get(switch)
        if fn is None:
            raise NotSupportedError(
                f"setting.{switch} = True, but this version of fxq has no implementation of it; switch it off"
            )
        gm = fn(gm, data, setting, steps=steps, collate_fn=collate_fn)
    return gm
