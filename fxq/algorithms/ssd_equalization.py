"""SSD equalization (PPQ's ``SSDEqualizationPass``) as a ``"pre"`` algorithm on FP32 weights.

Pairs ``A -> relays -> B`` of Conv / Linear ops whose relays are level-1 positively homogeneous ops (Relu,
PRelu, max / average pooling, global pooling), every intermediate value with one consumer. Per round, with
weight and activation ranges raised to at least ``channel_ratio`` x their max::

    kernel = max(r_A) / r_A,  nxt = max(r_B) / r_B,  act = max(a) / a   (a: mean over batches of max relu(A(x)))
    s = min(kernel / nxt, act / nxt);  s = min(s, 8);  s /= min(s);  s = clamp(s, 1, 2)

output channel ``c`` of ``A`` (weight and bias) is multiplied by ``s_c`` and input channel ``c`` of ``B`` divided
by it, which keeps the FP32 function. After ``iteration`` rounds a pair's change is kept only when its estimated
quantization loss (weight rounding error of ``A`` and ``B`` plus the activation step between them, measured in the
original coordinates and relative to the signal) is at most ``loss_threshold`` x the loss before; else reverted.

Pairs come from :func:`fxq.algorithms.equalization.find_equalization_groups` (one upstream, one downstream, level-1
relays only), so ConvTranspose is not paired.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import torch
from torch import fx

from fxq.algorithms.blocks import param_target

# private helpers of the layerwise equalization, reused on purpose (one copy of pairing and rescaling)
from fxq.algorithms.equalization import (
    EqualizationGroup,
    _down_range,
    _groups,
    _op_type,
    _scale_down,
    _up_range,
    _weight,
    find_equalization_groups,
)
from fxq.algorithms.pipeline import register_algorithm
from fxq.checked import Checked, checked_setting, opt
from fxq.functional import fake_quantize, qparams_from_minmax
from fxq.graph.data import first_batch_errors, iter_batches, placeholder_values
from fxq.graph.info import is_quantizer_node
from fxq.graph.nodes import Interpreter, get_attr_value
from fxq.nn.fake_quantize import fake_quant_mode
from fxq.observers.base import channel_rows
from fxq.spec import TensorQuantConfig

__all__ = ["SSDEqualizationSetting", "find_ssd_pairs", "ssd_equalization"]

logger = logging.getLogger(__name__)

RELAY_OPS = frozenset({"Relu", "MaxPool", "GlobalMaxPool", "PRelu", "AveragePool", "GlobalAveragePool"})
"""Level-1 ops an SSD pair may pass through."""
_ACT_FLOOR = 0.01


def _single_chain(group: EqualizationGroup) -> bool:
    """``A -> relays -> B`` with every relay in :data:`RELAY_OPS` (or a quantizer) and one consumer a value."""
    (up,), (down,) = group.upstream, group.downstream
    n = down.args[0] if down.args else None
    while isinstance(n, fx.Node) and n is not up:
        if len(n.users) != 1 or not (is_quantizer_node(n) or _op_type(n) in RELAY_OPS):
            return False
        n = n.args[0] if n.args else None
    return n is up and len(up.users) == 1


def find_ssd_pairs(gm: fx.GraphModule) -> list[EqualizationGroup]:
    """The ``(A, B)`` pairs SSD equalization rescales, in graph order."""
    return [g for g in find_equalization_groups(gm, opt_level=1)
            if len(g.upstream) == 1 and len(g.downstream) == 1 and _single_chain(g)]


@torch.no_grad()
def _act_ranges(gm: fx.GraphModule, nodes: set[fx.Node], data: Any, steps: int | None,
                collate_fn: Callable | None) -> dict[fx.Node, torch.Tensor]:
    """Per output channel of ``nodes``: mean over batches of ``max relu(y)``."""
    sums: dict[fx.Node, torch.Tensor] = {}
    count = 0

    class _Recorder(Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            out = super().run_node(n)
            if n in nodes and isinstance(out, torch.Tensor):
                axis = 1 if _op_type(n) == "Conv" else out.dim() - 1
                r = out.detach().clamp_min(0).movedim(axis, 0).reshape(out.shape[axis], -1).amax(dim=1).float()
                sums[n] = sums[n] + r if n in sums else r
            return out

    rec = _Recorder(gm)
    with fake_quant_mode(gm, "disabled"):
        # before calibration: the FP32 model meets the data here first, a first batch it fails on is the data's
        for index, batch in enumerate(iter_batches(data, steps, collate_fn)):
            with first_batch_errors("SSD equalization", index == 0):
                rec.run(*placeholder_values(gm, batch).values())
            count += 1
    return {n: (s / max(count, 1)).cpu() for n, s in sums.items()}  # one host copy per node, after all batches


def _config_of(gm: fx.GraphModule, arg: Any) -> TensorQuantConfig:
    """The config of the quantizer node ``arg`` (8-bit symmetric per-tensor when ``arg`` is not quantized)."""
    if isinstance(arg, fx.Node) and is_quantizer_node(arg):
        cfg = getattr(gm.get_submodule(str(arg.target)), "config", None)
        if isinstance(cfg, TensorQuantConfig):
            return cfg
    return TensorQuantConfig(num_bits=8, symmetric=True)


def _round_error(w: torch.Tensor, cfg: TensorQuantConfig) -> torch.Tensor:
    """Rounding error of ``w`` quantized with the weight quantizer's own scheme (grid, symmetry, granularity,
    rounding) at its minmax parameters: the loss estimate judges the quantizer that will run."""
    lo, hi = torch.aminmax(channel_rows(w, cfg), dim=1)
    scale, offset = qparams_from_minmax(lo, hi, cfg)
    return fake_quantize(w, cfg, scale.to(w.dtype), offset.to(w.dtype)) - w


class _Pair:
    """One pair's tensors, its accumulated scale and its loss estimate."""

    def __init__(self, gm: fx.GraphModule, group: EqualizationGroup, act: torch.Tensor) -> None:
        self.gm, self.up, self.down = gm, group.upstream[0], group.downstream[0]
        self.w1, self.w2 = _weight(gm, self.up), _weight(gm, self.down)
        b = param_target(self.up, 2)
        self.b1 = get_attr_value(gm, b) if b is not None else None
        self.groups = _groups(self.down)
        self.act = act.clamp_min(0)  # original activation ranges
        self.total = torch.ones(group.channels)  # accumulated scale of A's output channels
        self.cfg1 = _config_of(gm, self.up.args[1])
        self.cfg2 = _config_of(gm, self.down.args[1])
        self.act_bits = int(_config_of(gm, self.down.args[0]).num_bits)  # the activation quantizer there
        self.saved = [t.detach().clone() for t in (self.w1, self.w2, self.b1) if t is not None]

    def revert(self) -> None:
        for t, v in zip([t for t in (self.w1, self.w2, self.b1) if t is not None], self.saved):
            t.data.copy_(v)
        self.total = torch.ones_like(self.total)

    @torch.no_grad()
    def apply(self, s: torch.Tensor) -> None:
        self.w1.data.mul_(s.to(self.w1.device, self.w1.dtype).reshape(-1, *([1] * (self.w1.dim() - 1))))
        if self.b1 is not None:
            self.b1.data.mul_(s.to(self.b1.device, self.b1.dtype))
        _scale_down(self.w2, self.groups, (1.0 / s).to(self.w2.device))
        self.total = self.total * s

    @torch.no_grad()
    def loss(self) -> float:
        """Relative quantization noise of A's weight, the activation and B's weight, in original coordinates."""
        t = self.total
        w1, w2 = self.w1.detach().float().cpu(), self.w2.detach().float().cpu()
        e1 = _round_error(w1, self.cfg1) / t.reshape(-1, *([1] * (w1.dim() - 1)))
        w1_orig = w1 / t.reshape(-1, *([1] * (w1.dim() - 1)))
        e2 = _round_error(w2, self.cfg2)
        e2_view = e2.reshape(self.groups, e2.shape[0] // self.groups, e2.shape[1], *e2.shape[2:])
        e2_orig = e2_view * t.reshape(self.groups, 1, e2.shape[1], *([1] * (e2.dim() - 2)))
        w2_orig = w2.reshape_as(e2_view) * t.reshape(self.groups, 1, e2.shape[1], *([1] * (e2.dim() - 2)))
        step = float((self.act * t).max()) / (2 ** self.act_bits - 1)
        act_noise = float(((step / t) ** 2 / 12).sum()) / max(float((self.act ** 2).sum()), 1e-12)
        return (float(e1.pow(2).sum()) / max(float(w1_orig.pow(2).sum()), 1e-12)
                + float(e2_orig.pow(2).sum()) / max(float(w2_orig.pow(2).sum()), 1e-12) + act_noise)

    def scale(self, ratio: float) -> torch.Tensor:
        """This round's per-channel scale (PPQ's default "algo 2")."""
        def floor(r: torch.Tensor) -> torch.Tensor:
            r = r.float().cpu()
            return torch.maximum(r, ratio * r.max()).clamp_min(1e-12)

        r1 = floor(_up_range(self.w1))
        r2 = floor(_down_range(self.w2, self.groups))
        a = floor((self.act * self.total).clamp_min(_ACT_FLOOR))
        kernel, nxt, act = r1.max() / r1, r2.max() / r2, a.max() / a
        s = torch.minimum(kernel / nxt, act / nxt).clamp_max(8.0)
        return (s / s.min()).clamp(1.0, 2.0)


@checked_setting("setting.ssd_setting")
class SSDEqualizationSetting(Checked):
    """``setting.ssd_setting``: PPQ's SSD equalization's channel share, loss threshold and rounds. ``opt_level`` 2
    behaves as 1 (the groups are always found at level 1)."""

    opt_level: int = opt(1, choices=(1, 2))
    channel_ratio: float = opt(0.5, gt=0.0, le=1.0)
    loss_threshold: float = opt(0.8, ge=0.0)
    iteration: int = opt(3, ge=1)


@register_algorithm("ssd_equalization", stage="pre", order=20, setting=SSDEqualizationSetting)
def ssd_equalization(gm: fx.GraphModule, data: Any, setting: Checked,
                     steps: int | None = None, collate_fn: Callable | None = None) -> fx.GraphModule:
    """``setting.ssd_equalization``: SSD equalization of Conv/Linear pairs on FP32 weights (kept where it helps).

    Example:
        >>> s = fxq.QuantizationSetting(ssd_equalization=True)
        >>> s.ssd_setting.iteration = 5
        >>> q = fxq.quantize(model, data, platform="academic_int8", setting=s)
    """
    ss = setting.ssd_setting
    groups = find_ssd_pairs(gm)
    logger.info("ssd_equalization: %d pair(s)", len(groups))
    if not groups:
        return gm
    acts = _act_ranges(gm, {g.upstream[0] for g in groups}, data, steps, collate_fn)
    for g in groups:
        pair = _Pair(gm, g, acts.get(g.upstream[0], torch.ones(g.channels)))
        before = pair.loss()
        for _ in range(ss.iteration):
            pair.apply(pair.scale(ss.channel_ratio))
        after = pair.loss()
        kept = after <= ss.loss_threshold * before
        if not kept:
            pair.revert()
        logger.info("ssd_equalization: %s -> %s: loss %.4g -> %.4g, %s", pair.up.name, pair.down.name, before,
                    after, "kept" if kept else "reverted")
    return gm
