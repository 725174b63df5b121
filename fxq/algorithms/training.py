"""The one optimization loop of the block-wise algorithms (AdaRound, BRECQ/QDrop, LSQ).

Plain torch: Adam, the block reconstruction loss (quantized block on quantized inputs vs the FP32 block on
FP32 inputs), ``backward``, ``step``. QDrop (Wei et al., 2022) is two small things here: block inputs are
taken element-wise from the FP32 model with probability ``drop_prob``, and every activation quantizer in
the block leaves a random ``drop_prob`` share of its values un-quantized (:class:`DropQuantize`).
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
from torch import fx, nn

from fxq.algorithms.blocks import BlockData, block_errors, call_block, stored
from fxq.checked import LEARNING_RATE, OPTIMIZATION_STEPS, Checked, checked_setting, opt
from fxq.errors import GraphError
from fxq.nn.fake_quantize import FakeQuantize
from fxq.spec import MIN_SCALE

logger = logging.getLogger(__name__)

__all__ = ["TrainingSetting", "DropQuantize", "train_block", "block_error", "Snapshot", "reconstruction_loss"]


@checked_setting("setting.<block training>_setting")
class TrainingSetting(Checked):
    """What every block-wise training algorithm asks: which layers, how fast, how long, where cached inputs live.

    Subclasses re-declare ``lr`` / ``steps`` for their own defaults and add their fields.
    """

    interested_layers: list[str] = opt(factory=list)
    lr: float = opt(1e-3, **LEARNING_RATE)
    steps: int = opt(1000, **OPTIMIZATION_STEPS)
    collecting_device: str = opt("cpu", device=True)


def reconstruction_loss(outputs: Sequence[Any], targets: Sequence[Any]) -> torch.Tensor:
    """Squared error summed over features, averaged over the batch, summed over float outputs."""
    loss = None
    for o, t in zip(outputs, targets):
        if not (isinstance(o, torch.Tensor) and o.is_floating_point()):
            continue
        n = o.shape[0] if o.dim() > 0 else 1
        term = (o - t).pow(2).sum() / n
        loss = term if loss is None else loss + term
    if loss is None:
        raise GraphError("a block's outputs hold no floating-point tensor to compare with FP32; leave its ops out "
                         "with interested_layers or change block_size")
    return loss


class DropQuantize(nn.Module):
    """Wrap an activation quantizer: each value stays un-quantized with probability ``drop_prob`` (QDrop)."""

    def __init__(self, fq: FakeQuantize, drop_prob: float) -> None:
        super().__init__()
        self.fq = fq
        self.drop_prob = float(drop_prob)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fq(x)
        if self.drop_prob <= 0 or not x.is_floating_point():
            return y
        return torch.where(torch.rand_like(x) < self.drop_prob, x, y)


def _mix(fp: tuple, q: tuple, drop_prob: float) -> tuple:
    out = []
    for a, b in zip(fp, q):
        if isinstance(a, torch.Tensor) and a.is_floating_point() and a.shape == b.shape:
            out.append(torch.where(torch.rand_like(b) < drop_prob, a, b))
        else:
            out.append(b)
    return tuple(out)


@torch.no_grad()
def block_error(data: BlockData, module: fx.GraphModule, keep: list[tuple] | None = None) -> float:
    """Mean reconstruction loss of ``module`` (quantized, on quantized inputs) over every cached batch.

    ``keep``, a list, receives the outputs per batch (detached, on the collecting device), as
    :func:`fxq.algorithms.blocks.run_block` gives them.
    """
    total = 0.0
    for b in range(data.num_batches):
        target = data.target(b)  # the FP32 block: its own errors
        inputs = data.inputs(b, quantized=True)
        with block_errors(data, module, b, inputs):
            out = call_block(module, inputs)
        total += float(reconstruction_loss(out, target))
        if keep is not None:
            keep.append(stored(out, data.store))
    return total / max(1, data.num_batches)


class Snapshot:
    """Copies of some parameters and quantizer scales/offsets, to undo an optimization that did not help."""

    def __init__(self, tensors: Iterable[torch.Tensor] = (), quantizers: Iterable[FakeQuantize] = ()) -> None:
        self.tensors = [(t, t.detach().clone()) for t in tensors]
        self.quantizers = [(q, q.scale.detach().clone(), q.offset.detach().clone()) for q in quantizers]

    @torch.no_grad()
    def restore(self) -> None:
        for t, saved in self.tensors:
            t.data.copy_(saved)
        for q, scale, offset in self.quantizers:
            q.set_qparams(scale, offset, state=None)


def _adam(param_groups: list[dict]) -> torch.optim.Optimizer:
    """Adam; its fused kernel (one pass over each parameter per step) where torch has one for every parameter.

    torch picks the per-tensor loop on CPU by default: five elementwise ops, each one pass over each parameter.
    Block reconstruction trains every weight of a block (AdaRound's ``V``, LSQ's weights), so these passes were
    ~8 % of a step of ResNet-18 BRECQ on CPU. Same update rule, same hyper-parameters.
    """
    params = [p for g in param_groups for p in g["params"]]
    devices = {p.device.type for p in params}
    if params and all(p.is_floating_point() for p in params) and devices <= {"cpu", "cuda"}:
        try:
            return torch.optim.Adam(param_groups, fused=True)
        except (RuntimeError, TypeError):  # a torch without a fused kernel for this device / dtype
            pass
    return torch.optim.Adam(param_groups)


def train_block(
    data: BlockData,
    module: fx.GraphModule,
    param_groups: list[dict],
    steps: int,
    regularizer: Callable[[int], torch.Tensor] | None = None,
    drop_prob: float = 0.0,
    positive: Sequence[FakeQuantize] = (),
    progress: "Callable[[float], None] | None" = None,
    seed: int = 0,
) -> float:
    """Minimize the block reconstruction loss (+ ``regularizer(step)``) over ``param_groups`` with Adam.

    The scales of the quantizers in ``positive`` (learned ones) are kept at or above ``MIN_SCALE``.

    One calibration batch per step, chosen at random; modules keep their train/eval mode (BatchNorm left
    in the graph is not updated). Returns the last reconstruction loss.
    """
    if not any(g["params"] for g in param_groups) or steps <= 0:
        return float("nan")
    opt = _adam(param_groups)
    gen = torch.Generator().manual_seed(seed)
    nb = data.num_batches
    last = None
    for step in range(steps):
        b = int(torch.randint(nb, (1,), generator=gen))
        inputs = data.inputs(b, quantized=True)
        if drop_prob > 0:
            inputs = _mix(data.inputs(b, quantized=False), inputs, drop_prob)
        target = data.target(b)  # the FP32 block: its own errors
        with block_errors(data, module, b, inputs):  # the forward and backward of fxq's quantized block
            out = call_block(module, inputs)
            rec = reconstruction_loss(out, target)
            loss = rec if regularizer is None else rec + regularizer(step)
            opt.zero_grad(set_to_none=True)
            loss.backward()
        opt.step()
        if positive:
            with torch.no_grad():
                for fq in positive:
                    fq.scale.clamp_(min=MIN_SCALE)
        last = rec.detach()  # stays a tensor: no host sync per step
        if progress is not None:
            progress(last)
    return float("nan") if last is None else float(last)


@contextlib.contextmanager
def kept_if_better(data: BlockData, snapshot: Snapshot, what: str) -> Iterator[None]:
    """Optimize the block inside; restore ``snapshot`` when the block's error on the cached batches got worse
    (the reconstruction did not beat plain rounding on the calibration data).

    When the optimization is kept, the outputs of that last evaluation are the block's final quantized outputs:
    they go to ``data.q_outputs`` for the runner (which would otherwise run the block over every batch again).
    Nothing may change the block between this context's exit and the runner's next step."""
    before = block_error(data, data.block.module)
    yield
    outputs: list[tuple] = []
    after = block_error(data, data.block.module, keep=outputs)
    if after > before:
        snapshot.restore()
        logger.info("%s: error %.4g > %.4g before the optimization; reverted", what, after, before)
    else:
        data.q_outputs = outputs


def record_run(gm: fx.GraphModule, name: str, runner: Any, units: int, unit: str = "block") -> None:
    """Log what an algorithm did and keep its peak cache size in ``gm.meta["fxq_algorithm_stats"]``."""
    logger.info("%s: %d %s(s), peak cache %.1f MB", name, units, unit, runner.peak_cache_bytes / 2**20)
    gm.meta.setdefault("fxq_algorithm_stats", {})[name] = {"peak_cache_bytes": runner.peak_cache_bytes}
