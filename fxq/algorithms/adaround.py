"""AdaRound (Nagel et al., "Up or Down? Adaptive Rounding for Post-Training Quantization", 2020).

Each weight is rounded down or up, not to nearest: ``w_q = s * clamp(floor(w / s) + h(V) + o, qmin, qmax) - o``
with a learned ``V`` and the rectified sigmoid ``h(V) = clamp(sigmoid(V) * (zeta - gamma) + gamma, 0, 1)``
(``zeta = 1.1``, ``gamma = -0.1``). ``V`` starts where ``h(V)`` equals the fractional part of ``w / s``
(the FP32 weight), and is trained layer by layer to reconstruct the FP32 layer output from the quantized
model's input, with the regularizer ``lambda * sum(1 - |2 h(V) - 1| ** beta)`` that pushes every ``h`` to
0 or 1 (off during the first ``warm_up`` share of the steps, then ``beta`` annealed linearly from
``beta_range[0]`` to ``beta_range[1]``). At the end every weight is rounded by ``h(V) >= 0.5`` and written
back into the FP32 parameter (already on the quantization grid), so the plain weight quantizer and every
exporter reproduce the learned rounding. Scales stay as calibrated. A layer whose error on the calibration
data ends up above rounding-to-nearest's keeps rounding to nearest.
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Callable

import torch
from torch import fx, nn
from tqdm.auto import tqdm

from fxq.algorithms.blocks import BlockRunner, matches_layer, param_target, unbaked, weight_quantizer_of
from fxq.algorithms.pipeline import register_algorithm
from fxq.algorithms.training import Snapshot, TrainingSetting, kept_if_better, record_run, train_block
from fxq.checked import Checked, checked_setting, opt
from fxq.errors import ConfigError
from fxq.functional import broadcast_qparam
from fxq.graph.info import QUANTIZERS_ATTR
from fxq.graph.nodes import get_attr_value
from fxq.nn.fake_quantize import FakeQuantize

__all__ = ["AdaroundSetting", "AdaRoundQuantizer", "adaround", "rounding_regularizer"]

logger = logging.getLogger(__name__)

ZETA, GAMMA = 1.1, -0.1


class AdaRoundQuantizer(nn.Module):
    """Stand-in for a weight ``FakeQuantize`` while its rounding is learned (``alpha`` is ``V``).

    Args:
        fq: the calibrated weight quantizer (its scale, offset and range are used, not changed).
        weight: the FP32 weight.
        param_target: ``get_attr`` target of the weight (where :func:`write_hard_weights` stores it).

    Raises:
        ConfigError: for floating-point (FP8) quantizers, which have no integer rounding to learn.
    """

    def __init__(self, fq: FakeQuantize, weight: torch.Tensor, param_target: str | None = None) -> None:
        super().__init__()
        self.param_target = param_target
        cfg = fq.config
        if cfg.is_floating:
            raise ConfigError(f"AdaRound: weight quantizer {fq.name!r} is floating-point (FP8); switch adaround off "
                              f"or dispatch this layer to an integer platform")
        self.quant_min, self.quant_max = float(cfg.quant_min), float(cfg.quant_max)
        w = weight.detach().float()
        axis = cfg.channel_axis if cfg.per_channel else 0
        self.register_buffer("s", broadcast_qparam(fq.scale.detach().float(), w, axis).clone())
        self.register_buffer("o", broadcast_qparam(fq.offset.detach().float(), w, axis).clone())
        v = w / self.s
        self.register_buffer("floor", torch.floor(v))
        rest = v - self.floor  # in [0, 1): h(alpha) = rest there, finite at both ends
        self.alpha = nn.Parameter(-torch.log((ZETA - GAMMA) / (rest - GAMMA) - 1))
        self.dtype = weight.dtype
        self.last_h: torch.Tensor | None = None

    def h(self) -> torch.Tensor:
        return torch.clamp(torch.sigmoid(self.alpha) * (ZETA - GAMMA) + GAMMA, 0, 1)

    def _dequant(self, up: torch.Tensor) -> torch.Tensor:
        q = torch.clamp(self.floor + up + self.o, self.quant_min, self.quant_max)
        return ((q - self.o) * self.s).to(self.dtype)

    def forward(self, weight: torch.Tensor) -> torch.Tensor:  # the graph's FP32 weight is not used
        h = self.h()
        # the training step's regularizer reads the same h (one sigmoid pass over the weight per step, not two)
        self.last_h = h if torch.is_grad_enabled() else None
        return self._dequant(h)

    @torch.no_grad()
    def hard_weight(self) -> torch.Tensor:
        """The weight with the learned rounding (``h >= 0.5`` rounds up), on the quantization grid."""
        return self._dequant((self.alpha >= 0).to(self.floor.dtype))


def rounding_regularizer(quantizers: list[AdaRoundQuantizer], step: int, steps: int, weight: float,
                         beta_range: tuple[float, float], warm_up: float) -> torch.Tensor:
    """``weight * sum(1 - |2h - 1|^beta)``: 0 during warm-up, then beta annealed linearly over the rest.

    ``h`` is each quantizer's from its last forward with gradients (the current training step's; read once), else
    computed.
    """
    start = int(warm_up * steps)
    if step < start or weight == 0 or not quantizers:
        return torch.zeros(())
    rel = (step - start) / max(1, steps - start)
    beta = beta_range[0] + (beta_range[1] - beta_range[0]) * rel
    total = None
    for q in quantizers:
        h = q.last_h if q.last_h is not None and torch.is_grad_enabled() else q.h()
        q.last_h = None  # used once: a later step without a forward of q computes its own
        term = (1 - (2 * h - 1).abs().pow(beta)).sum()
        total = term if total is None else total + term
    return weight * total


def adaround_overrides(gm: fx.GraphModule, ops: list[fx.Node]) -> dict[str, AdaRoundQuantizer]:
    """``{weight quantizer target: AdaRoundQuantizer}`` for the ops that have a parameter weight."""
    out: dict[str, AdaRoundQuantizer] = {}
    for op in ops:
        found = weight_quantizer_of(gm, op)
        target = param_target(op, 1)
        if found is None or target is None or not found[1].config.is_quantizing or found[1].config.is_floating:
            continue
        name, fq = found
        out[f"{QUANTIZERS_ATTR}.{name}"] = AdaRoundQuantizer(fq, get_attr_value(gm, target), target)
    return out


@torch.no_grad()
def write_hard_weights(gm: fx.GraphModule, overrides: dict[str, AdaRoundQuantizer]) -> None:
    """Store the learned rounding in the FP32 parameters."""
    for ada in overrides.values():
        get_attr_value(gm, ada.param_target).data.copy_(ada.hard_weight())


def _beta_range(value: tuple[float, float], path: str) -> tuple[float, float]:
    if not value[0] >= value[1] > 0:
        raise ConfigError(f"{path}={list(value)}: AdaRound anneals beta from the first value down to the second, "
                          f"both > 0 (default [20, 2])")
    return value


@checked_setting("setting.adaround_setting")
class AdaroundSetting(TrainingSetting):
    """``setting.adaround_setting``: AdaRound's regularizer and its annealing (see :func:`adaround`)."""

    reg_weight: float = opt(0.01, ge=0.0)
    beta_range: tuple[float, float] = opt((20.0, 2.0), check=_beta_range)
    warm_up: float = opt(0.2, ge=0.0, le=1.0)


@register_algorithm("adaround", stage="post", order=30, setting=AdaroundSetting)
def adaround(gm: fx.GraphModule, data: Any, setting: Checked, steps: int | None = None,
             collate_fn: Callable | None = None) -> fx.GraphModule:
    """``setting.adaround``: learn the rounding of every quantized weight, layer by layer.

    ``adaround_setting``: ``steps`` and ``lr`` per layer, ``reg_weight`` (lambda), ``beta_range``,
    ``warm_up``, ``interested_layers`` (node names / module paths / regexes; empty = all) and
    ``collecting_device`` (where cached layer inputs live).

    Example:
        >>> s = fxq.QuantizationSetting(adaround=True)
        >>> s.adaround_setting.steps = 500
        >>> q = fxq.quantize(model, data, platform="academic_mix", setting=s)
    """
    st = setting.adaround_setting
    with unbaked(gm):
        runner = BlockRunner(gm, data, steps, collate_fn, block_size=1, collecting_device=st.collecting_device,
                             algorithm="algorithm 'adaround'")
        todo = sum(1 for b in runner.blocks for op in b.computing if matches_layer(op, st.interested_layers))
        bar = tqdm(total=todo * st.steps, desc="adaround", leave=False, disable=None)
        for bd in runner:
            ops = [op for op in bd.block.computing if matches_layer(op, st.interested_layers)]
            overrides = adaround_overrides(gm, ops)
            if not overrides:
                continue
            module = bd.block.build(overrides)
            quantizers = list(overrides.values())
            snap = Snapshot([get_attr_value(gm, q.param_target) for q in quantizers])
            with kept_if_better(bd, snap, f"adaround {ops[0].name}"):  # else rounding to nearest stays
                loss = train_block(
                    bd, module, [{"params": [q.alpha for q in quantizers], "lr": st.lr}], st.steps,
                    regularizer=functools.partial(rounding_regularizer, quantizers, steps=st.steps,
                                                  weight=st.reg_weight, beta_range=tuple(st.beta_range),
                                                  warm_up=st.warm_up),
                    progress=lambda _: bar.update(1))
                write_hard_weights(gm, overrides)
            bar.set_postfix(layer=ops[0].name, loss=f"{loss:.4g}")
            logger.debug("adaround %s: reconstruction loss %.4g", [o.name for o in ops], loss)
        bar.close()
    record_run(gm, "adaround", runner, todo, unit="layer")
    return gm

