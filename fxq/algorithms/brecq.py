"""Block reconstruction: BRECQ (Li et al., 2021) with QDrop (Wei et al., 2022).

Like AdaRound, but the rounding of every weight of a *block* (``block_size`` consecutive computing ops) is
learned together, against the FP32 block output; activation scales of the block may be learned along
(LSQ gradients, ``is_scale_trainable``). With ``drop_prob > 0`` (QDrop), block inputs come element-wise
from the FP32 model with that probability and the block's activation quantizers leave that share of their
values un-quantized while training, which flattens the loss landscape the block is tuned on.

Setting (``setting.blockwise_reconstruction_setting``): ``steps`` and ``lr`` per block, ``block_size``,
``gamma`` (weight of the rounding regularizer, in units of AdaRound's lambda = 0.01),
``is_scale_trainable`` (activation scales learn at ``lr / 25``), ``drop_prob``, ``interested_layers``,
``collecting_device``. The regularizer's ``beta_range`` and ``warm_up`` come from ``adaround_setting``.
The reconstruction loss is the plain squared error of the block outputs (BRECQ's Fisher weighting is not
used). A block whose error on the calibration data ends up higher than before is reverted.
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Callable

from torch import fx
from tqdm.auto import tqdm

from fxq.algorithms.adaround import adaround_overrides, rounding_regularizer, write_hard_weights
from fxq.algorithms.blocks import BlockRunner, activation_quantizers, matches_layer, unbaked
from fxq.algorithms.pipeline import register_algorithm
from fxq.algorithms.training import DropQuantize, Snapshot, TrainingSetting, kept_if_better, record_run, train_block
from fxq.checked import OPTIMIZATION_STEPS, Checked, checked_setting, opt
from fxq.graph.info import QUANTIZERS_ATTR
from fxq.graph.nodes import get_attr_value

__all__ = ["BlockwiseReconstructionSetting", "blockwise_reconstruction", "ADAROUND_LAMBDA", "SCALE_LR_RATIO"]

logger = logging.getLogger(__name__)

ADAROUND_LAMBDA = 0.01
"""Rounding-regularizer weight per unit of ``gamma``."""
SCALE_LR_RATIO = 1 / 25
"""Learning rate of activation scales relative to ``lr``."""


@checked_setting("setting.blockwise_reconstruction_setting")
class BlockwiseReconstructionSetting(TrainingSetting):
    """``setting.blockwise_reconstruction_setting``: BRECQ / QDrop block size, drop rate and schedule."""

    steps: int = opt(5000, **OPTIMIZATION_STEPS)
    gamma: float = opt(1.0, ge=0.0)
    block_size: int = opt(4, ge=1)
    is_scale_trainable: bool = False
    # QDrop: probability of keeping an activation un-quantized during reconstruction
    drop_prob: float = opt(0.5, ge=0.0, le=1.0)


@register_algorithm("blockwise_reconstruction", stage="post", order=40, setting=BlockwiseReconstructionSetting)
def blockwise_reconstruction(gm: fx.GraphModule, data: Any, setting: Checked,
                             steps: int | None = None, collate_fn: Callable | None = None) -> fx.GraphModule:
    """``setting.blockwise_reconstruction``: BRECQ / QDrop block reconstruction of weight rounding.

    Example:
        >>> s = fxq.QuantizationSetting(blockwise_reconstruction=True)
        >>> s.blockwise_reconstruction_setting.steps = 1000
        >>> s.blockwise_reconstruction_setting.drop_prob = 0.5   # QDrop; 0 = BRECQ
        >>> q = fxq.quantize(model, data, platform="academic_int4", setting=s)
    """
    st = setting.blockwise_reconstruction_setting
    ada = setting.adaround_setting
    with unbaked(gm):
        runner = BlockRunner(gm, data, steps, collate_fn, st.block_size, st.collecting_device,
                             algorithm="algorithm 'blockwise_reconstruction'")
        todo = [b for b in runner.blocks if any(matches_layer(op, st.interested_layers) for op in b.computing)]
        bar = tqdm(total=len(todo) * st.steps, desc="block reconstruction", leave=False, disable=None)
        for bd in runner:
            ops = [op for op in bd.block.computing if matches_layer(op, st.interested_layers)]
            rounding = adaround_overrides(gm, ops) if ops else {}
            acts = activation_quantizers(gm, bd.block) if ops else []
            if not rounding and not (acts and st.is_scale_trainable):
                continue
            overrides: dict[str, Any] = dict(rounding)
            rounders = list(rounding.values())
            snap = Snapshot([get_attr_value(gm, q.param_target) for q in rounders], [fq for _, fq in acts])
            groups = []
            if rounders:
                groups.append({"params": [q.alpha for q in rounders], "lr": st.lr})
            learned = []
            if st.is_scale_trainable:
                learned = [fq.make_learnable(scale=True) for _, fq in acts if not fq.config.power_of_2]
                if learned:
                    groups.append({"params": [fq.scale for fq in learned], "lr": st.lr * SCALE_LR_RATIO})
            if st.drop_prob > 0:
                for name, fq in acts:
                    overrides[f"{QUANTIZERS_ATTR}.{name}"] = DropQuantize(fq, st.drop_prob)
            module = bd.block.build(overrides)
            with kept_if_better(bd, snap, f"block {bd.block.index} reconstruction"):
                loss = train_block(
                    bd, module, groups, st.steps,
                    regularizer=functools.partial(rounding_regularizer, rounders, steps=st.steps,
                                                  weight=ADAROUND_LAMBDA * st.gamma, beta_range=tuple(ada.beta_range),
                                                  warm_up=ada.warm_up),
                    drop_prob=st.drop_prob, positive=learned, progress=lambda _: bar.update(1), seed=bd.block.index)
                write_hard_weights(gm, rounding)
                for fq in learned:
                    fq.freeze()
            bar.set_postfix(block=bd.block.index, loss=f"{loss:.4g}")
            logger.debug("block %d %s: reconstruction loss %.4g", bd.block.index, [o.name for o in ops], loss)
        bar.close()
    record_run(gm, "blockwise_reconstruction", runner, len(todo))
    return gm
