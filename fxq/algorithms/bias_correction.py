"""Empirical bias correction: remove the mean output error of every quantized computing op.

Block by block (``setting.bias_correct_setting.block_size`` computing ops), with the quantized model's
inputs to the block (all earlier corrections applied) and the FP32 model's inputs, each op's per-channel
mean output error ``E[y_q - y_fp]`` over the calibration batches is subtracted from its bias. Ops are
corrected one after the other inside the block, so later ops see the corrected earlier ones. Ops without
a bias parameter are left alone.

The FP32 side is the model as it was: one FP32 run per block, before any of its biases moves (the quantized
and the FP32 views share one bias parameter), gives every op's reference and the next block's inputs, so a
correction is never measured against itself downstream.
After the pass, ``fxq.fp32_mode`` runs with the corrected biases, as PPQ's dequantized graph does.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import torch
from torch import fx
from tqdm.auto import tqdm

from fxq.algorithms.blocks import BlockRunner, param_target, run_block, unbaked
from fxq.algorithms.pipeline import register_algorithm
from fxq.checked import Checked, checked_setting, opt
from fxq.graph.info import NodeQuant
from fxq.graph.nodes import get_attr_value

__all__ = ["BiasCorrectionSetting", "bias_correction", "channel_axis"]

logger = logging.getLogger(__name__)


def channel_axis(node: fx.Node, value: torch.Tensor) -> int:
    """Output channel axis of a computing op: 1 for Conv / ConvTranspose, the last one for Gemm / MatMul."""
    nq = node.meta.get("fxq")
    if isinstance(nq, NodeQuant) and nq.op_type in ("Conv", "ConvTranspose") and value.dim() > 1:
        return 1
    return value.dim() - 1


def _mean_per_channel(x: torch.Tensor, axis: int) -> torch.Tensor:
    return x.movedim(axis, 0).reshape(x.shape[axis], -1).double().mean(dim=1)


@checked_setting("setting.bias_correct_setting")
class BiasCorrectionSetting(Checked):
    """``setting.bias_correct_setting``: how many layers per block and calibration batches it uses."""

    block_size: int = opt(4, ge=1)
    steps: int = opt(32, ge=1, why="a number of calibration batches")


@register_algorithm("bias_correct", stage="post", order=10, setting=BiasCorrectionSetting)
@torch.no_grad()
def bias_correction(gm: fx.GraphModule, data: Any, setting: Checked, steps: int | None = None,
                    collate_fn: Callable | None = None) -> fx.GraphModule:
    """``setting.bias_correct``: subtract each op's mean quantization error from its bias.

    Uses at most ``bias_correct_setting.steps`` calibration batches (and at most ``steps``).

    Example:
        >>> s = fxq.QuantizationSetting(bias_correct=True)
        >>> q = fxq.quantize(model, data, platform="academic_int8", setting=s)
    """
    bs = setting.bias_correct_setting
    n = bs.steps if steps is None else min(bs.steps, steps)
    corrected = 0
    with unbaked(gm):
        runner = BlockRunner(gm, data, n, collate_fn, bs.block_size, algorithm="algorithm 'bias_correct'")
        total = sum(len(b.computing) for b in runner.blocks)
        bar = tqdm(total=total, desc="bias correction", leave=False, disable=None)
        for bd in runner:
            block = bd.block
            ops = [op for op in block.computing if param_target(op, 2) is not None]
            bar.update(len(block.computing) - len(ops))
            # the FP32 reference, before any bias of this block moves (FP32 and quantized views share biases)
            fp = bd.fp32_with(ops)
            for k, op in enumerate(ops):
                bar.update(1)
                q = run_block(block.build(extra_outputs=[op]), bd, quantized=True)
                err = sum(_mean_per_channel(qq[-1] - f[k], channel_axis(op, qq[-1])) for f, qq in zip(fp, q))
                bias = get_attr_value(gm, param_target(op, 2))
                if err.numel() != bias.numel():
                    logger.debug("bias correction: %s output channels do not match its bias; skipped", op.name)
                    continue
                bias.data.sub_((err / len(fp)).to(bias.device, bias.dtype).reshape(bias.shape))
                corrected += 1
        bar.close()
    logger.info("bias correction: corrected %d op(s), peak cache %.1f MB", corrected,
                runner.peak_cache_bytes / 2**20)
    gm.meta.setdefault("fxq_algorithm_stats", {})["bias_correct"] = {"peak_cache_bytes": runner.peak_cache_bytes}
    return gm

