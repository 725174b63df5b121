"""Value statistics of quantized tensors: FP32 vs quantized min / max / mean / std and histograms."""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import torch
from torch import fx

from fxq.analysis.engine import run_two_pass
from fxq.analysis.runner import GraphRunner, analysis_mode
from fxq.functional import representable_range
from fxq.graph.nodes import get_attr_value
from fxq.nn.fake_quantize import FakeQuantize

__all__ = ["ValueStats", "TensorStatistics", "StatisticsReport", "statistics"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class ValueStats:
    """Summary of the values one tensor took over all batches."""

    count: int = 0
    min: float = float("nan")
    max: float = float("nan")
    mean: float = float("nan")
    std: float = float("nan")


@dataclasses.dataclass
class TensorStatistics:
    """FP32 vs quantized values of the tensor one quantizer covers.

    Attributes:
        name: the quantizer's name (``gm.fxq_quantizers.<name>``).
        role: ``activation`` | ``weight`` | ``bias``.
        source: the node whose value is quantized.
        consumers: op nodes that read the quantized value.
        fp32 / quantized: value summaries. For activations the quantized values are those of the fully
            quantized model (error accumulated upstream included); for weights the quantized weights.
        grid: (lowest, highest) value the quantizer can represent.
        clipped: fraction of FP32 values outside ``grid``.
        edges: ``bins + 1`` histogram bin edges, shared by both histograms.
        fp32_hist / quant_hist: value counts per bin; values outside ``edges`` (possible for activations, whose
            edges are fixed on the first batch) are counted in the first / last bin.
    """

    name: str
    role: str
    source: str
    consumers: list[str]
    fp32: ValueStats
    quantized: ValueStats
    grid: tuple[float, float]
    clipped: float
    edges: list[float]
    fp32_hist: list[int]
    quant_hist: list[int]


class StatisticsReport(list):
    """A list of :class:`TensorStatistics` in graph order; ``str()`` gives a table."""

    def __init__(self, items: list[TensorStatistics], batches: int) -> None:
        super().__init__(items)
        self.batches = batches

    def by_name(self, name: str) -> TensorStatistics:
        for s in self:
            if s.name == name:
                return s
        raise KeyError(f"no statistics for quantizer {name!r}; known: {[s.name for s in self]}")

    def to_dict(self) -> dict[str, Any]:
        return {"batches": self.batches, "tensors": [dataclasses.asdict(s) for s in self]}

    def __str__(self) -> str:
        if not self:
            return "no quantized tensors"
        w = max(9, max(len(s.name) for s in self))
        lines = [f"value statistics over {self.batches} batch(es): FP32 -> quantized",
                 f"  {'quantizer'.ljust(w)}  {'role':<10} {'fp32 min':>10} {'fp32 max':>10} {'q min':>10} "
                 f"{'q max':>10} {'fp32 std':>10} {'q std':>10} {'clipped':>8}"]
        for s in self:
            lines.append(f"  {s.name.ljust(w)}  {s.role:<10} {s.fp32.min:>10.4g} {s.fp32.max:>10.4g} "
                         f"{s.quantized.min:>10.4g} {s.quantized.max:>10.4g} {s.fp32.std:>10.4g} "
                         f"{s.quantized.std:>10.4g} {s.clipped * 100:>7.3f}%")
        return "\n".join(lines)


def grid_range(fq: FakeQuantize) -> tuple[float, float]:
    """Lowest and highest value ``fq`` can represent (over all channels)."""
    lo, hi = representable_range(fq.config, fq.scale, fq.offset)
    return float(lo.min()), float(hi.max())


class _Running:
    """Running count / min / max / sum / sum of squares / histogram of one stream of values."""

    def __init__(self) -> None:
        self.count = 0
        self.min = float("inf")
        self.max = float("-inf")
        self.sum: torch.Tensor | float = 0.0
        self.sq: torch.Tensor | float = 0.0
        self.hist: torch.Tensor | None = None

    def add(self, x: torch.Tensor, edges: tuple[float, float, int]) -> tuple[float, float] | None:
        """Take the finite values of ``x`` (histogram over ``edges``); returns their ``(min, max)``, read from the
        device once, or None when there are none."""
        v = _finite(x)
        if v is None:
            return None
        lo, hi = torch.stack(torch.aminmax(v)).tolist()
        self.count += v.numel()
        self.min, self.max = min(self.min, lo), max(self.max, hi)
        self.sum = self.sum + v.sum(dtype=torch.float64)
        self.sq = self.sq + torch.linalg.vector_norm(v, dtype=torch.float64) ** 2
        if lo < edges[0] or hi > edges[1]:
            v = v.clamp(edges[0], edges[1])  # outliers of later batches: counted in the edge bins
        h = torch.histc(v, bins=edges[2], min=edges[0], max=edges[1])
        self.hist = h if self.hist is None else self.hist + h
        return lo, hi

    def stats(self) -> ValueStats:
        if self.count == 0:
            return ValueStats()
        mean = float(self.sum) / self.count
        var = max(float(self.sq) / self.count - mean * mean, 0.0)
        return ValueStats(self.count, self.min, self.max, mean, var ** 0.5)


class _StatsProbe:
    """Watches activation quantizer nodes: their input in the FP32 pass, their output in the quantized pass."""

    def __init__(self, runner: GraphRunner, bins: int) -> None:
        self.runner = runner
        self.bins = bins
        self.nodes = {}
        for qnode, fq in runner.quantizers.items():
            info = runner.quantizer_info(qnode)
            if info is None or info.role != "activation" or not fq.config.is_quantizing:
                continue
            self.nodes[qnode] = fq
        self.fp32 = {n: _Running() for n in self.nodes}
        self.quant = {n: _Running() for n in self.nodes}
        self.edges: dict[fx.Node, tuple[float, float, int]] = {}
        self.clipped = {n: 0 for n in self.nodes}
        self.grid = {n: grid_range(fq) for n, fq in self.nodes.items()}

    def fp32_watch(self) -> dict[fx.Node, Callable[[Any], None]]:
        def make(node: fx.Node) -> Callable[[Any], None]:
            def cb(x: Any) -> None:
                if not (isinstance(x, torch.Tensor) and x.is_floating_point()):
                    return
                g = self.grid[node]
                if node not in self.edges:  # fixed on the first batch: its FP32 range joined with the grid
                    v = _finite(x)
                    if v is None:
                        return
                    lo, hi = torch.stack(torch.aminmax(v)).tolist()
                    self.edges[node] = _range_edges(lo, hi, g, self.bins)
                seen = self.fp32[node].add(x, self.edges[node])
                if seen is not None and (seen[0] < g[0] or seen[1] > g[1]):  # only then count what the grid clips
                    self.clipped[node] += int(((x < g[0]) | (x > g[1])).sum())
            return cb

        return {n: make(n) for n in self.nodes}

    def quant_watch(self) -> dict[fx.Node, Callable[[Any], None]]:
        def make(node: fx.Node) -> Callable[[Any], None]:
            def cb(x: Any) -> None:
                if isinstance(x, torch.Tensor) and x.is_floating_point() and node in self.edges:
                    self.quant[node].add(x, self.edges[node])
            return cb

        return {n: make(n) for n in self.nodes}

    def results(self) -> dict[str, TensorStatistics]:
        out = {}
        for node in self.nodes:
            info = self.runner.quantizer_info(node)
            f, q = self.fp32[node], self.quant[node]
            out[info.name] = _make(info, f, q, self.grid[node], self.clipped[node], self.edges.get(node))
        return out


def _make(info: Any, f: _Running, q: _Running, grid: tuple[float, float], clipped: int,
          edges: tuple[float, float, int] | None) -> TensorStatistics:
    if edges is None:
        edge_list: list[float] = []
    else:
        edge_list = torch.linspace(edges[0], edges[1], edges[2] + 1, dtype=torch.float64).tolist()
    return TensorStatistics(info.name, info.role, info.source, list(info.consumers), f.stats(), q.stats(),
                            grid, clipped / f.count if f.count else 0.0, edge_list, _counts(f), _counts(q))


def _counts(r: _Running) -> list[int]:
    return [int(v) for v in r.hist.tolist()] if r.hist is not None else []


def _weight_statistics(runner: GraphRunner, bins: int) -> dict[str, TensorStatistics]:
    out = {}
    gm = runner.gm
    for qnode, fq in runner.quantizers.items():
        info = runner.quantizer_info(qnode)
        if info is None or info.role == "activation" or info.param is None or not fq.config.is_quantizing:
            continue
        current = get_attr_value(gm, info.param).detach()
        if info.param in runner.fp32_params:
            fp32, quant = runner.fp32_params[info.param], current
        else:
            fp32, quant = current, fq(current)
        grid = grid_range(fq)
        finite = _finite(fp32)
        lo, hi = torch.stack(torch.aminmax(finite)).tolist() if finite is not None else grid
        edges = _range_edges(lo, hi, grid, bins)
        f, q = _Running(), _Running()
        f.add(fp32, edges)
        q.add(quant, edges)
        if fq.config.per_channel:
            clipped = 0  # per-channel grids: each channel's range covers its own values
        else:
            clipped = int(((fp32 < grid[0]) | (fp32 > grid[1])).sum())
        out[info.name] = _make(info, f, q, grid, clipped, edges)
    return out


def _finite(x: torch.Tensor) -> torch.Tensor | None:
    """``x`` flat in float32 without inf / NaN (those would make the histogram range infinite); None if empty."""
    v = x.detach().reshape(-1)
    if v.dtype != torch.float32:
        v = v.float()
    if not bool(torch.isfinite(v).all()):
        v = v[torch.isfinite(v)]
    return v if v.numel() else None


def _range_edges(lo: float, hi: float, grid: tuple[float, float], bins: int) -> tuple[float, float, int]:
    """Histogram edges over ``[lo, hi]`` joined with the quantization grid (never empty)."""
    a, b = min(lo, grid[0]), max(hi, grid[1])
    return (a, b if b > a else a + 1.0, bins)


def collect_statistics(runner: GraphRunner, probe: _StatsProbe, batches: int) -> StatisticsReport:
    """Statistics of weights (from the model) and activations (from ``probe``), in quantizer order."""
    with analysis_mode(runner.gm):
        weights = _weight_statistics(runner, probe.bins)
    acts = probe.results()
    order = [name for name, _ in runner.qg.quantizers()]
    items = [weights.get(n) or acts.get(n) for n in order]
    return StatisticsReport([s for s in items if s is not None], batches)


def statistics(
    model: fx.GraphModule,
    data: Any,
    steps: int | None = 8,
    collate_fn: Callable[[Any], Any] | None = None,
    *,
    bins: int = 128,
    progress: bool = False,
) -> StatisticsReport:
    """Per quantized tensor: min / max / mean / std and histograms of FP32 vs quantized values.

    Activations are watched at their quantizers during one FP32 and one quantized pass per batch
    (quantized values include the error accumulated upstream); weights and biases are read from the
    model. Histogram edges are fixed on the first batch (FP32 range joined with the quantizer's grid);
    later values outside them land in the edge bins.

    Args:
        model: a quantized ``GraphModule`` from :func:`fxq.quantize`.
        data: batches, as for :func:`fxq.calibrate`.
        steps: at most this many batches (None: all).
        collate_fn: applied to each batch first.
        bins: histogram bins.
        progress: show a progress bar.

    Returns:
        :class:`StatisticsReport` (a list of :class:`TensorStatistics`; ``str()`` is a table).

    Raises:
        ConfigError: uncalibrated model; CalibrationError: empty or mismatching data.

    Example:
        >>> stats = fxq.statistics(qmodel, calib_batches, steps=4)
        >>> stats.by_name("conv1_weight").clipped
    """
    runner = GraphRunner(model)
    probe = _StatsProbe(runner, bins)
    batches = run_two_pass(model, data, [probe], steps=steps, collate_fn=collate_fn, progress=progress,
                           desc="statistics", runner=runner)
    report = collect_statistics(runner, probe, batches)
    logger.info("%s", report)
    return report
