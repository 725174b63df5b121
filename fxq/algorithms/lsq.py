"""Block-wise LSQ post-training optimization (Esser et al., "Learned Step Size Quantization", 2020).

Block by block (``block_size`` consecutive computing ops), the quantized block on the quantized model's
inputs is trained to reproduce the FP32 block on FP32 inputs: the FP32 weights of its computing ops learn
through their weight quantizers (straight-through estimator), and with ``is_scale_trainable`` the scales of
its weight and activation quantizers learn too (LSQ gradients of the ``fxq::`` fake-quant op). Afterwards
the scales are fixed again (buffers), aligned quantizers re-aligned and bias scales re-derived.

Setting (``setting.lsq_optimization_setting``): ``steps`` (alias ``epochs``) and ``lr`` per block,
``block_size``, ``is_scale_trainable``, ``gamma`` (weight of ``sum ||W - W_fp32||^2 / ||W_fp32||^2``, which
keeps weights near their FP32 values; 0 = off), ``interested_layers`` (only these ops' weights learn; blocks
without one are skipped), ``collecting_device``. Power-of-2 scales are not learned. A block whose error on
the calibration data ends up higher than before training is reverted.
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Callable, ClassVar

import torch
from torch import fx
from tqdm.auto import tqdm

from fxq.algorithms.blocks import (
    BlockRunner,
    activation_quantizers,
    matches_layer,
    param_target,
    unbaked,
    weight_quantizer_of,
)
from fxq.algorithms.pipeline import register_algorithm
from fxq.algorithms.training import Snapshot, TrainingSetting, kept_if_better, record_run, train_block
from fxq.checked import LEARNING_RATE, OPTIMIZATION_STEPS, Checked, checked_setting, opt
from fxq.graph.nodes import get_attr_value

__all__ = ["LSQSetting", "lsq_optimization", "weight_drift"]

logger = logging.getLogger(__name__)


def weight_drift(weights: list[torch.Tensor], originals: list[torch.Tensor], gamma: float,
                 step: int = 0) -> torch.Tensor:
    """``gamma * sum ||W - W0||^2 / ||W0||^2`` (0 when ``gamma`` is 0)."""
    if gamma == 0 or not weights:
        return torch.zeros(())
    return gamma * sum((w - w0).pow(2).sum() / w0.pow(2).sum().clamp_min(1e-12) for w, w0 in zip(weights, originals))


@checked_setting("setting.lsq_optimization_setting")
class LSQSetting(TrainingSetting):
    """``setting.lsq_optimization_setting``: block-wise LSQ's schedule and what it learns."""

    ALIASES: ClassVar[dict[str, str]] = {"epochs": "steps"}
    lr: float = opt(1e-5, **LEARNING_RATE)
    steps: int = opt(500, **OPTIMIZATION_STEPS)
    is_scale_trainable: bool = True
    gamma: float = opt(0.0, ge=0.0)
    block_size: int = opt(4, ge=1)

    @property
    def epochs(self) -> int:
        """The seeds' tutorial spelling of ``steps``."""
        return self.steps

    @epochs.setter
    def epochs(self, value: int) -> None:
        self.steps = value


@register_algorithm("lsq_optimization", stage="post", order=20, setting=LSQSetting)
def lsq_optimization(gm: fx.GraphModule, data: Any, setting: Checked, steps: int | None = None,
                     collate_fn: Callable | None = None) -> fx.GraphModule:
    """``setting.lsq_optimization``: learn weights and quantizer scales block by block.

    Example:
        >>> s = fxq.QuantizationSetting(lsq_optimization=True)
        >>> s.lsq_optimization_setting.lr = 1e-4
        >>> s.lsq_optimization_setting.epochs = 300   # the seeds' spelling of steps
        >>> q = fxq.quantize(model, data, platform="academic_mix", setting=s)
    """
    st = setting.lsq_optimization_setting
    with unbaked(gm):
        runner = BlockRunner(gm, data, steps, collate_fn, st.block_size, st.collecting_device,
                             algorithm="algorithm 'lsq_optimization'")
        todo = [b for b in runner.blocks if any(matches_layer(op, st.interested_layers) for op in b.computing)]
        bar = tqdm(total=len(todo) * st.steps, desc="lsq", leave=False, disable=None)
        for bd in runner:
            ops = [op for op in bd.block.computing if matches_layer(op, st.interested_layers)]
            if not ops:
                continue
            acts = [fq for _, fq in activation_quantizers(gm, bd.block)]
            weight_fqs = [f[1] for f in (weight_quantizer_of(gm, op) for op in ops) if f is not None]
            snap = Snapshot([get_attr_value(gm, t) for t in (param_target(op, 1) for op in ops) if t is not None],
                            weight_fqs + acts)
            weights, originals, scaled = [], [], []
            for op in ops:
                target = param_target(op, 1)
                found = weight_quantizer_of(gm, op)
                if target is None or found is None or not found[1].config.is_quantizing:
                    continue
                w = get_attr_value(gm, target)
                weights.append(w.requires_grad_(True))
                originals.append(w.detach().clone())
                if st.is_scale_trainable and not found[1].config.power_of_2:
                    scaled.append(found[1].make_learnable(scale=True))
            if st.is_scale_trainable:
                scaled += [fq.make_learnable(scale=True) for fq in acts if not fq.config.power_of_2]
            groups = [{"params": weights, "lr": st.lr}] if weights else []
            if scaled:
                groups.append({"params": [fq.scale for fq in scaled], "lr": st.lr})

            with kept_if_better(bd, snap, f"lsq block {bd.block.index}"):
                loss = train_block(bd, bd.block.module, groups, st.steps,
                                   regularizer=functools.partial(weight_drift, weights, originals, st.gamma),
                                   positive=scaled, progress=lambda _: bar.update(1), seed=bd.block.index)
                for w in weights:
                    w.requires_grad_(False)
                for fq in scaled:
                    fq.freeze()
            bar.set_postfix(block=bd.block.index, loss=f"{loss:.4g}")
            logger.debug("lsq block %d %s: reconstruction loss %.4g", bd.block.index, [o.name for o in ops], loss)
        bar.close()
    record_run(gm, "lsq_optimization", runner, len(todo))
    return gm
