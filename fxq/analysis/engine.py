"""The two-pass loop shared by the analysis tools: per batch one FP32 pass and one quantized pass.

The two passes run side by side (:meth:`GraphRunner.run_side_by_side`). A *probe* names the nodes it
watches in each pass and receives each node's FP32 value and then its quantized value as soon as both
are computed; it keeps running sums only and must not hold on to a value after its callback returns.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Protocol

from torch import fx
from tqdm.auto import tqdm

from fxq.analysis.runner import GraphRunner, analysis_mode
from fxq.errors import CalibrationError
from fxq.graph.data import count_batches, first_batch_errors, iter_batches

__all__ = ["Probe", "run_two_pass", "iter_bound_batches", "output_names"]

logger = logging.getLogger(__name__)

Callback = Callable[[Any], None]


class Probe(Protocol):
    def fp32_watch(self) -> dict[fx.Node, Callback]: ...

    def quant_watch(self) -> dict[fx.Node, Callback]: ...


def _merge(watches: Iterable[dict[fx.Node, Callback]]) -> dict[fx.Node, Callback]:
    merged: dict[fx.Node, list[Callback]] = {}
    for w in watches:
        for node, cb in w.items():
            merged.setdefault(node, []).append(cb)

    def chain(cbs: list[Callback]) -> Callback:
        if len(cbs) == 1:
            return cbs[0]

        def call(value: Any) -> None:
            for cb in cbs:
                cb(value)

        return call

    return {node: chain(cbs) for node, cbs in merged.items()}


def iter_bound_batches(runner: GraphRunner, data: Any, steps: int | None, collate_fn: Callable[[Any], Any] | None,
                       *, progress: bool, desc: str) -> Iterable[dict[fx.Node, Any]]:
    """Placeholder values for each batch; an empty ``data`` raises :class:`CalibrationError`."""
    total = count_batches(data, steps)
    n = 0
    for batch in tqdm(iter_batches(data, steps, collate_fn), total=total, desc=desc, disable=not progress,
                      leave=False):
        yield runner.bind(batch, check=(n == 0))
        n += 1
    if n == 0:
        raise CalibrationError("analysis data is empty: give at least one batch")


def run_two_pass(gm: fx.GraphModule, data: Any, probes: list[Probe], *, steps: int | None,
                 collate_fn: Callable[[Any], Any] | None, progress: bool, desc: str,
                 runner: GraphRunner | None = None) -> int:
    """Feed every batch through the FP32 and the quantized view, side by side; return the batch count.

    Raises:
        CalibrationError: empty data, or the first batch does not fit the model.
    """
    runner = runner or GraphRunner(gm)
    fp32_watch = _merge(p.fp32_watch() for p in probes)
    quant_watch = _merge(p.quant_watch() for p in probes)
    batches = 0
    with analysis_mode(gm):
        for inputs in iter_bound_batches(runner, data, steps, collate_fn, progress=progress, desc=desc):
            with first_batch_errors("analysis", batches == 0):
                runner.run_side_by_side(inputs, fp32_watch=fp32_watch, quant_watch=quant_watch)
            batches += 1
    logger.debug("%s: %d batches x 2 passes", desc, batches)
    return batches


def output_names(gm: fx.GraphModule, count: int) -> list[str]:
    """Names of the model's outputs: the ONNX / caffe names when the model came from a file."""
    for key in ("onnx", "caffe"):
        info = gm.meta.get(key) if hasattr(gm, "meta") else None
        names = info.get("outputs") if isinstance(info, dict) else None
        if names and len(names) == count:
            return [str(n) for n in names]
    return ["output"] if count == 1 else [f"output[{i}]" for i in range(count)]
