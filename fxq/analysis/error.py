"""Quantization error per layer: graphwise (accumulated through the quantized graph) and layerwise
(one layer quantized at a time), as in the seeds' analysis section.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Callable, Iterable

import torch
from torch import fx
from tqdm.auto import tqdm

from fxq.analysis.engine import iter_bound_batches, output_names, run_two_pass
from fxq.analysis.metrics import MetricAccumulator, Scratch, check_metric, format_value, higher_is_better
from fxq.analysis.runner import GraphRunner, analysis_mode, tensors_of
from fxq.errors import CalibrationError, ConfigError
from fxq.graph.data import count_batches, first_batch_errors
from fxq.graph.info import NodeQuant, source_names
from fxq.qconfig.base import COMPUTING_OPS

__all__ = [
    "LayerError",
    "ErrorReport",
    "graphwise_error_analyse",
    "layerwise_error_analyse",
    "select_layers",
]

logger = logging.getLogger(__name__)

_METRIC_TITLES = {
    "snr": "SNR = noise power / signal power (lower is better)",
    "cosine": "cosine similarity (higher is better)",
    "mse": "mean squared error (lower is better)",
}


@dataclasses.dataclass
class LayerError:
    """The error of one layer (or one network output).

    Attributes:
        name: fx node name of the op (or the output's name).
        op_type: canonical op type (``Conv``, ``Gemm``...; ``Output`` for network outputs).
        metric: ``snr`` | ``cosine`` | ``mse``.
        value: the metric (SNR as a ratio: 0.01 = 1 %).
        measured_at: the node whose values were compared (the op, its output quantizer, or ``output``).
        module_path: the source module's path when the op came from an ``nn.Module``.
        outputs: layerwise only: the metric at each network output.
        source: the op's name in the file it came from (ONNX node, caffe layer); shown in the table.
    """

    name: str
    op_type: str
    metric: str
    value: float
    measured_at: str
    module_path: str | None = None
    outputs: dict[str, float] | None = None
    source: str | None = None

    @property
    def formatted(self) -> str:
        return format_value(self.metric, self.value)


class ErrorReport(list):
    """A list of :class:`LayerError`, worst first; ``str()`` gives the table.

    Attributes:
        method: the metric.
        kind: ``graphwise`` or ``layerwise``.
        batches: batches analysed.
        measured: where layerwise errors are measured (``network`` outputs or each ``layer``'s output).
        outputs: graphwise only: the error at each network output.
    """

    def __init__(self, records: Iterable[LayerError], *, method: str, kind: str, batches: int,
                 measured: str = "layer", outputs: list[LayerError] | None = None) -> None:
        super().__init__(sort_records(records, method))
        self.method = method
        self.kind = kind
        self.batches = batches
        self.measured = measured
        self.outputs = list(outputs or [])

    def worst(self, k: int = 5) -> list[LayerError]:
        return list(self[:k])

    def as_dict(self) -> dict[str, float]:
        """``{layer name: value}`` (PPQ's return value)."""
        return {r.name: r.value for r in self}

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, "kind": self.kind, "batches": self.batches, "measured": self.measured,
                "layers": [dataclasses.asdict(r) for r in self],
                "outputs": [dataclasses.asdict(r) for r in self.outputs]}

    def table(self, limit: int | None = None, width: int = 30, outputs: bool = True) -> str:
        """The table, worst first (``limit`` rows; ``outputs``: add the network outputs' errors)."""
        where = {"network": "at the network output(s)", "layer": "at each layer's output"}[self.measured]
        title = (f"{self.kind} error, {_METRIC_TITLES[self.method]}, {where}, "
                 f"{self.batches} batch{'es' if self.batches != 1 else ''}, worst first")
        lines = [title, format_table(self[:limit] if limit else list(self), self.method, width)]
        if limit and len(self) > limit:
            lines.append(f"  ... {len(self) - limit} more")
        if self.outputs and outputs:
            lines.append("network output(s):")
            lines.append(format_table(self.outputs, self.method, width))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        return f"<ErrorReport {self.kind} {self.method}: {len(self)} layers, {self.batches} batches>"


def sort_records(records: Iterable[LayerError], method: str) -> list[LayerError]:
    """Worst first (NaN last)."""
    sign = 1.0 if higher_is_better(method) else -1.0
    return sorted(records, key=lambda r: (math.isnan(r.value), sign * r.value if not math.isnan(r.value) else 0.0))


def badness(method: str, value: float) -> float:
    """How bad a value is, >= 0 (a bar's length): 1 - cosine, or the error itself; NaN counts as 0."""
    if math.isnan(value):
        return 0.0
    return max(0.0, 1.0 - value) if method == "cosine" else max(0.0, value)


def format_table(records: list[LayerError], method: str, width: int = 30) -> str:
    """Rows ``name  op  value  bar``; bars are scaled to the worst row."""
    if not records:
        return "  (no layers)"
    labels = [r.name if r.source in (None, r.name) else f"{r.name} ({r.source})" for r in records]
    name_w = max(5, max(len(label) for label in labels))
    op_w = max(2, max(len(r.op_type) for r in records))
    worst = max(badness(method, r.value) for r in records)
    finite_worst = worst if math.isfinite(worst) else max(
        (badness(method, r.value) for r in records if math.isfinite(badness(method, r.value))), default=0.0)
    rows = [f"  {'layer'.ljust(name_w)}  {'op'.ljust(op_w)}  {method.upper():>12}"]
    for r, label in zip(records, labels):
        b = badness(method, r.value)
        frac = 1.0 if not math.isfinite(b) else (b / finite_worst if finite_worst > 0 else 0.0)
        bar = "\u2588" * int(round(frac * width))
        rows.append(f"  {label.ljust(name_w)}  {r.op_type.ljust(op_w)}  {r.formatted:>12} | {bar}")
    return "\n".join(rows)


def select_layers(gm: fx.GraphModule, ops: str | Iterable[str] = "computing") -> list[fx.Node]:
    """The op nodes to analyse.

    Args:
        ops: ``"computing"`` (Conv, ConvTranspose, Gemm, MatMul — PPQ's choice), ``"quantized"`` (every op
            dispatched to a quantized platform), or node names.

    Raises:
        ConfigError: unknown node names or selector.
    """
    quantized = [n for n in gm.graph.nodes if isinstance(n.meta.get("fxq"), NodeQuant) and n.meta["fxq"].quantized]
    if isinstance(ops, str):
        if ops == "computing":
            return [n for n in quantized if n.meta["fxq"].op_type in COMPUTING_OPS]
        if ops == "quantized":
            return quantized
        raise ConfigError(f"ops={ops!r}: use 'computing', 'quantized' or a list of node names")
    wanted = list(ops)
    by_name = {n.name: n for n in gm.graph.nodes}
    missing = [w for w in wanted if w not in by_name or not isinstance(by_name[w].meta.get("fxq"), NodeQuant)]
    if missing:
        raise ConfigError(f"ops {missing} are not op nodes of this model; choose from {[n.name for n in quantized]}")
    return [by_name[w] for w in wanted]


def _resolve_data(data: Any, dataloader: Any) -> Any:
    if data is None and dataloader is None:
        raise CalibrationError("no analysis data given: pass data (a list of batches or a DataLoader)")
    if data is not None and dataloader is not None:
        raise ConfigError("pass either data or dataloader, not both")
    return data if data is not None else dataloader


class _LayerProbe:
    """Accumulates the graphwise error at each selected layer and at the network outputs."""

    def __init__(self, runner: GraphRunner, layers: list[fx.Node], method: str) -> None:
        self.runner = runner
        self.method = method
        self.measure = {n: runner.own_output_quantizer(n) or n for n in layers}
        self.scratch = Scratch()
        self.acc = {n: MetricAccumulator(method, self.scratch) for n in layers}
        self.out_acc: list[MetricAccumulator] = []

    def fp32_watch(self) -> dict[fx.Node, Callable[[Any], None]]:
        w: dict[fx.Node, Callable[[Any], None]] = {}
        for layer, node in self.measure.items():
            w[node] = _tensor_cb(self.acc[layer].reference)
        w[self.runner.output_node] = self._outputs_fp32
        return w

    def quant_watch(self) -> dict[fx.Node, Callable[[Any], None]]:
        w: dict[fx.Node, Callable[[Any], None]] = {}
        for layer, node in self.measure.items():
            w[node] = _tensor_cb(self.acc[layer].compare)
        w[self.runner.output_node] = self._outputs_quant
        return w

    def _outputs_fp32(self, value: Any) -> None:
        ts = tensors_of(value)
        while len(self.out_acc) < len(ts):
            self.out_acc.append(MetricAccumulator(self.method, self.scratch))
        for acc, t in zip(self.out_acc, ts):
            acc.reference(t)

    def _outputs_quant(self, value: Any) -> None:
        for acc, t in zip(self.out_acc, tensors_of(value)):
            acc.compare(t)

    def records(self) -> list[LayerError]:
        return [_record(layer, self.method, acc.value, self.measure[layer].name) for layer, acc in self.acc.items()]

    def output_records(self, gm: fx.GraphModule) -> list[LayerError]:
        names = output_names(gm, len(self.out_acc))
        return [LayerError(n, "Output", self.method, acc.value, "output") for n, acc in zip(names, self.out_acc)]


def _tensor_cb(fn: Callable[[torch.Tensor], None]) -> Callable[[Any], None]:
    def cb(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            fn(value)

    return cb


def _record(node: fx.Node, method: str, value: float, measured_at: str,
            outputs: dict[str, float] | None = None) -> LayerError:
    nq = node.meta.get("fxq")
    op = nq.op_type if isinstance(nq, NodeQuant) else "Unknown"
    names = source_names(node, module_path=False)
    return LayerError(node.name, op, method, value, measured_at, node.meta.get("module_path"), outputs,
                      names[0] if names else None)


def graphwise_error_analyse(
    model: fx.GraphModule,
    data: Any = None,
    method: str = "snr",
    steps: int | None = 8,
    collate_fn: Callable[[Any], Any] | None = None,
    *,
    ops: str | Iterable[str] = "computing",
    progress: bool = False,
    dataloader: Any = None,
) -> ErrorReport:
    """Error accumulated through the quantized graph, at the output of every selected op.

    Per batch the model runs exactly twice: once in FP32 (quantizers off, FP32 weights) and once
    quantized; each layer's output is compared between the two as soon as it is computed, and only
    running sums are kept. An op is measured at its own output quantizer when it has one (the value
    its consumers read), otherwise at its raw output (e.g. a conv whose output quantizer belongs to
    the following ReLU). The model is not modified.

    Args:
        model: a quantized ``GraphModule`` from :func:`fxq.quantize`.
        data: batches (list, DataLoader, tensor, tuples or dicts); ``dataloader=`` is accepted too.
        method: ``"snr"`` (noise / signal power, lower is better), ``"cosine"`` or ``"mse"``.
        steps: analyse at most this many batches (None: all).
        collate_fn: applied to each batch first (e.g. move to a device).
        ops: ``"computing"``, ``"quantized"`` (every quantized op) or a list of node names.
        progress: show a progress bar.

    Returns:
        :class:`ErrorReport` — records worst first, ``.outputs`` the error at the network outputs,
        ``str()`` the table.

    Raises:
        ConfigError: unknown metric, uncalibrated model; CalibrationError: empty or mismatching data;
        GraphError: not an fxq model.

    Example:
        >>> report = fxq.graphwise_error_analyse(qmodel, calib_batches, method="snr", steps=8)
        >>> print(report)            # table, worst layer first
        >>> report[0].name, report[0].value
    """
    method = check_metric(method)
    data = _resolve_data(data, dataloader)
    runner = GraphRunner(model, channels_last=True)
    probe = _LayerProbe(runner, select_layers(model, ops), method)
    batches = run_two_pass(model, data, [probe], steps=steps, collate_fn=collate_fn, progress=progress,
                           desc="graphwise analysis", runner=runner)
    report = ErrorReport(probe.records(), method=method, kind="graphwise", batches=batches, measured="layer",
                         outputs=probe.output_records(model))
    logger.info("%s", report)
    return report


def layerwise_error_analyse(
    model: fx.GraphModule,
    data: Any = None,
    method: str = "snr",
    steps: int | None = 8,
    collate_fn: Callable[[Any], Any] | None = None,
    *,
    ops: str | Iterable[str] = "computing",
    measure: str = "network",
    progress: bool = False,
    dataloader: Any = None,
) -> ErrorReport:
    """Error caused by each layer alone: that layer quantized, everything else FP32.

    "That layer quantized" means its input, weight and bias quantizers act on its inputs (for this
    op only, even when a quantizer is shared with other consumers) and its own output quantizer, if
    it has one, is on. Per batch the model runs once in FP32 (all values kept for the batch); each
    layer then re-runs only the nodes that depend on it.

    Args:
        measure: ``"network"`` (PPQ's choice): compare the network outputs; ``"layer"``: compare the
            layer's own output (cheap: one op per layer).
        other arguments: as :func:`graphwise_error_analyse`.

    Returns:
        :class:`ErrorReport`, worst first; with ``measure="network"`` each record's ``outputs`` holds
        the metric at every network output and ``value`` is their mean.

    Raises:
        as :func:`graphwise_error_analyse`; ConfigError for an unknown ``measure``.

    Example:
        >>> print(fxq.layerwise_error_analyse(qmodel, calib_batches, steps=4))
    """
    method = check_metric(method)
    if measure not in ("network", "layer"):
        raise ConfigError(f"measure={measure!r}: use 'network' (graph outputs) or 'layer' (the layer's output)")
    data = _resolve_data(data, dataloader)
    runner = GraphRunner(model, channels_last=True)
    layers = select_layers(model, ops)
    plans = {n: runner.layer_plan(n) for n in layers}
    if measure == "network":
        todo = {n: runner.downstream(n) for n in layers}
    else:
        todo = {n: [n] + ([plans[n].output_quantizer] if plans[n].output_quantizer is not None else [])
                for n in layers}
    accs: dict[fx.Node, list[MetricAccumulator]] = {n: [] for n in layers}
    scratch = Scratch()
    batches = 0
    with analysis_mode(model):
        total = count_batches(data, steps)
        bar = tqdm(total=total * len(layers) if total else None, desc="layerwise analysis", disable=not progress,
                   leave=False)
        for inputs in iter_bound_batches(runner, data, steps, collate_fn, progress=False, desc=""):
            cache: dict[fx.Node, Any] = {}
            with first_batch_errors("analysis", batches == 0):
                ref = runner.run(inputs, fp32=True, keep=cache)
            for layer in layers:
                plan = plans[layer]
                if measure == "network":
                    out = runner.run(inputs, fp32=True, layer=plan, base=cache, nodes=todo[layer], fp32_ran=True)
                    pairs = list(zip(tensors_of(ref), tensors_of(out)))
                else:
                    node = plan.output_quantizer or layer
                    got: dict[str, Any] = {}
                    runner.run(inputs, fp32=True, layer=plan, base=cache, nodes=todo[layer], fp32_ran=True,
                               watch={node: lambda v, got=got: got.__setitem__("v", v)})
                    pairs = [(cache[node], got.get("v"))]
                acc = accs[layer]
                while len(acc) < len(pairs):
                    acc.append(MetricAccumulator(method, scratch))
                for a, (f, q) in zip(acc, pairs):
                    if isinstance(f, torch.Tensor) and isinstance(q, torch.Tensor):
                        a.reference(f)
                        a.compare(q)
                bar.update(1)
            batches += 1
        bar.close()
    records = []
    for layer in layers:
        acc = accs[layer]
        if measure == "network":
            names = output_names(model, len(acc))
            per = {n: a.value for n, a in zip(names, acc)}
            vals = [v for v in per.values() if not math.isnan(v)]
            value = sum(vals) / len(vals) if vals else float("nan")
            records.append(_record(layer, method, value, "output", per))
        else:
            node = plans[layer].output_quantizer or layer
            records.append(_record(layer, method, acc[0].value if acc else float("nan"), node.name))
    report = ErrorReport(records, method=method, kind="layerwise", batches=batches, measured=measure)
    logger.info("%s", report)
    return report

