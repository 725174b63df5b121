"""Calibration: weights from their values, activations from data (at most two passes)."""
from __future__ import annotations

import logging
from typing import Any, Callable

import torch
from torch import fx
from tqdm.auto import tqdm

from fxq.errors import CalibrationError
from fxq.graph.convert import apply_alignment, bake_parameters, derive_passive_parameters, unbake_parameters
from fxq.graph.data import call_model, check_steps, count_batches, first_batch_errors, iter_batches
from fxq.graph.info import graph_quant, iter_quantizers, quantizer_infos
from fxq.graph.passes import get_attr_value
from fxq.spec import QuantState

__all__ = ["calibrate", "calibrate_parameters"]

logger = logging.getLogger(__name__)


@torch.no_grad()
def calibrate_parameters(gm: fx.GraphModule) -> None:
    """Compute the parameters of every weight quantizer straight from the weight values."""
    infos = quantizer_infos(gm)
    unbake_parameters(gm)
    for name, fq in iter_quantizers(gm):
        info = infos.get(name)
        if info is None or info.role != "weight" or info.param is None or fq.config.state is QuantState.FP32:
            continue
        fq.set_mode("observe")
        fq.observer.reset()
        fq(get_attr_value(gm, info.param).detach())
        fq.compute_qparams()
        fq.set_mode("quantize")


@torch.no_grad()
def calibrate(
    model: fx.GraphModule,
    data: Any,
    steps: int | None = None,
    collate_fn: Callable[[Any], Any] | None = None,
    progress: bool = True,
    bake: bool = True,
) -> fx.GraphModule:
    """Calibrate a prepared model in place and return it.

    Weight quantizers are computed from the weights; activation quantizers observe ``data`` (a list,
    a DataLoader, tensors, tuples or dicts of inputs) for at most ``steps`` batches, twice if any of
    their observers needs a histogram range first. Afterwards alignment and passive (bias) parameters
    are derived and — with ``bake`` — weights are replaced by their quantized values.

    Raises:
        ConfigError: ``steps`` is not None or a positive int.
        CalibrationError: empty data, wrong input count or shape (naming the input), a later batch with another
            input rank or dtype than the first (naming the batch), or one with other sizes that the model fails on.
    """
    check_steps(steps)
    graph_quant(model)
    infos = quantizer_infos(model)
    was_training = model.training
    model.eval()
    calibrate_parameters(model)
    if bake:
        bake_parameters(model)
    observing = []
    for name, fq in iter_quantizers(model):
        info = infos.get(name)
        role = info.role if info else "activation"
        if role == "bias":
            fq.set_mode("disabled")
        elif role == "activation" or (role == "weight" and info.param is None):
            if fq.config.state is QuantState.FP32:
                fq.set_mode("disabled")
                continue
            fq.set_mode("observe")
            fq.observer.reset()
            observing.append(fq)
    passes = max((fq.observer.passes for fq in observing), default=1)
    total = count_batches(data, steps)
    seen = 0
    for p in range(passes):
        for fq in observing:
            fq.set_mode("observe" if fq.observer.passes > p else "disabled")
        desc = "calibrate" if passes == 1 else f"calibrate (pass {p + 1}/{passes})"
        seen = 0
        for batch in tqdm(iter_batches(data, steps, collate_fn), total=total, desc=desc, disable=not progress,
                          leave=False):
            with first_batch_errors("calibration", seen == 0):
                call_model(model, batch, check=(seen == 0))
            seen += 1
        if seen == 0:
            raise CalibrationError("calibration data is empty: give at least one batch")
        for fq in observing:
            if fq.observer.passes > p + 1:
                fq.observer.next_pass()
    for fq in observing:
        fq.compute_qparams()
        fq.set_mode("quantize")
    apply_alignment(model)
    derive_passive_parameters(model)
    for _, fq in iter_quantizers(model):
        fq.set_mode("quantize")
    if bake:
        bake_parameters(model)
    model.train(was_training)
    logger.info("calibrated %d activation quantizers on %d batches x %d pass(es)", len(observing), seen, passes)
    return model
