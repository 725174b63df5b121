"""A quantization report a user opens in a browser: tables, per-layer error bars and value histograms.

Plots are drawn with matplotlib's object API (no pyplot, no global backend switch) into PNG files;
every file is written atomically (:mod:`fxq.io`).
"""
from __future__ import annotations

import dataclasses
import html
import io
import logging
import math
import os
import re
from pathlib import Path
from typing import Any, Callable, Iterable

from torch import fx

from fxq.analysis.engine import run_two_pass
from fxq.analysis.error import ErrorReport, LayerError, _LayerProbe, badness, layerwise_error_analyse, select_layers
from fxq.analysis.metrics import check_metric, format_value
from fxq.analysis.runner import GraphRunner
from fxq.analysis.statistics import StatisticsReport, TensorStatistics, _StatsProbe, collect_statistics
from fxq.errors import ConfigError, NotSupportedError
from fxq.graph.info import NodeQuant, graph_quant
from fxq.graph.summary import summary
from fxq.io import atomic_write_bytes, atomic_write_text

__all__ = ["ReportData", "analyse_for_report", "write_report"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class ReportData:
    """Everything a report shows; :func:`write_report` renders it."""

    title: str
    platform: str
    summary: str
    graphwise: ErrorReport
    statistics: StatisticsReport
    layerwise: ErrorReport | None = None
    notes: list[str] = dataclasses.field(default_factory=list)


def analyse_for_report(model: fx.GraphModule, data: Any, *, steps: int | None = 8, method: str = "snr",
                       ops: str | Iterable[str] = "computing", layerwise: bool = False, bins: int = 128,
                       collate_fn: Callable[[Any], Any] | None = None, progress: bool = False,
                       title: str = "fxq quantization report") -> ReportData:
    """Graphwise errors and statistics from the same two passes per batch (plus layerwise if asked)."""
    method = check_metric(method)
    runner = GraphRunner(model)
    err = _LayerProbe(runner, select_layers(model, ops), method)
    stats = _StatsProbe(runner, bins)
    batches = run_two_pass(model, data, [err, stats], steps=steps, collate_fn=collate_fn, progress=progress,
                           desc="analysis", runner=runner)
    graphwise = ErrorReport(err.records(), method=method, kind="graphwise", batches=batches,
                            outputs=err.output_records(model))
    lw = None
    if layerwise:
        lw = layerwise_error_analyse(model, data, method=method, steps=steps, collate_fn=collate_fn, ops=ops,
                                     progress=progress)
    return ReportData(title, graph_quant(model).platform, str(summary(model)), graphwise,
                      collect_statistics(runner, stats, batches), lw)


# ---------------------------------------------------------------------------------------------- plots
def _figure(width: float, height: float) -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise NotSupportedError("reports need matplotlib: pip install 'fxq[report]' (or matplotlib)") from None
    return Figure(figsize=(width, height), dpi=100)


def _save_png(fig: Any, path: Path) -> Path:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return atomic_write_bytes(path, buf.getvalue())


def _graph_order(model: fx.GraphModule, records: list[LayerError]) -> list[LayerError]:
    order = {n.name: i for i, n in enumerate(model.graph.nodes)}
    return sorted(records, key=lambda r: order.get(r.name, len(order)))


def plot_errors(report: ErrorReport, model: fx.GraphModule, path: Path, highlight: int = 4) -> Path:
    """Horizontal bars, one per layer in graph order; the ``highlight`` worst in red."""
    records = _graph_order(model, list(report))
    worst = {r.name for r in report[:highlight]}
    scale, unit = (100.0, " (%)") if report.method == "snr" else (1.0, "")
    values = [0.0 if not math.isfinite(r.value) else r.value * scale for r in records]
    height = max(2.5, 0.22 * len(records) + 1.2)
    fig = _figure(8.0, height)
    longest = max((len(r.name) for r in records), default=5)
    fig.subplots_adjust(left=min(0.5, 0.02 + 0.0085 * longest), right=0.97, top=1 - 0.45 / height,
                        bottom=0.6 / height)
    ax = fig.subplots()
    ys = list(range(len(records)))
    ax.barh(ys, values, color=["#d62728" if r.name in worst else "#1f77b4" for r in records])
    ax.set_yticks(ys, [r.name for r in records], fontsize=7)
    ax.invert_yaxis()
    label = {"snr": "noise / signal power", "cosine": "cosine similarity", "mse": "mean squared error"}[report.method]
    ax.set_xlabel(label + unit)
    if report.method == "cosine" and values:
        ax.set_xlim(max(0.0, min(values) - (1 - min(values)) * 0.2), 1.0)
    where = "network output" if report.measured == "network" else "layer output"
    ax.set_title(f"{report.kind} {report.method.upper()} per layer (graph order, measured at the {where})",
                 fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    return _save_png(fig, path)


def plot_histograms(stats: list[TensorStatistics], title: str, path: Path) -> Path:
    """FP32 vs quantized value histograms of ``stats`` side by side (log counts, grid limits dashed)."""
    fig = _figure(5.0 * max(1, len(stats)), 3.4)
    fig.subplots_adjust(left=0.08, right=0.98, top=0.82, bottom=0.12, wspace=0.2)
    axes = fig.subplots(1, max(1, len(stats)), squeeze=False)[0]
    for ax, s in zip(axes, stats):
        if s.edges:
            ax.stairs(s.fp32_hist, s.edges, fill=True, alpha=0.5, label="FP32", color="#1f77b4")
            ax.stairs(s.quant_hist, s.edges, fill=True, alpha=0.5, label="quantized", color="#ff7f0e")
            for g in s.grid:
                ax.axvline(g, color="k", linestyle="--", linewidth=0.8)
            ax.set_yscale("log")
        ax.set_title(f"{s.name} ({s.role}), clipped {s.clipped * 100:.3f}%", fontsize=8)
        ax.legend(fontsize=7)
        ax.tick_params(labelsize=7)
    fig.suptitle(title, fontsize=9)
    return _save_png(fig, path)


def _layer_tensors(model: fx.GraphModule, layer: str, stats: StatisticsReport) -> list[TensorStatistics]:
    """The statistics that belong to a layer: its output (or input) activation and its weight."""
    node = next((n for n in model.graph.nodes if n.name == layer), None)
    nq = node.meta.get("fxq") if node is not None else None
    if not isinstance(nq, NodeQuant):
        return []
    known = {s.name: s for s in stats}
    picked: list[TensorStatistics] = []
    out = known.get(nq.output) if nq.output else None
    ins = [known[q] for q in nq.inputs.values() if q in known]
    act = out or next((s for s in ins if s.role == "activation"), None)
    if act is not None:
        picked.append(act)
    picked += [s for s in ins if s.role == "weight"]
    return picked


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[:80] or "layer"


# ---------------------------------------------------------------------------------------------- pages
def _md_table(records: list[LayerError]) -> list[str]:
    lines = ["| layer | op | value | measured at |", "|---|---|---:|---|"]
    for r in records:
        lines.append(f"| `{r.name}` | {r.op_type} | {r.formatted} | `{r.measured_at}` |")
    return lines


def _html_table(records: list[LayerError], method: str) -> str:
    bad = [badness(method, r.value) for r in records]  # NaN rows get no bar, as in the text table
    finite = [b for b in bad if math.isfinite(b)]
    top = max(finite, default=0.0) or 1.0
    rows = []
    for r, b in zip(records, bad):
        pct = 100.0 if not math.isfinite(b) else max(0.0, min(100.0, 100.0 * b / top))
        rows.append(f"<tr><td><code>{html.escape(r.name)}</code></td><td>{html.escape(r.op_type)}</td>"
                    f"<td class=num>{html.escape(r.formatted)}</td>"
                    f"<td class=barcell><div class=bar style='width:{pct:.1f}%'></div></td>"
                    f"<td><code>{html.escape(r.measured_at)}</code></td></tr>")
    return ("<table><tr><th>layer</th><th>op</th><th>value</th><th></th><th>measured at</th></tr>"
            + "".join(rows) + "</table>")


def _stats_rows(stats: StatisticsReport) -> list[tuple[str, ...]]:
    return [(s.name, s.role, f"{s.fp32.min:.4g}", f"{s.fp32.max:.4g}", f"{s.quantized.min:.4g}",
             f"{s.quantized.max:.4g}", f"{s.fp32.mean:.4g}", f"{s.fp32.std:.4g}", f"{s.quantized.std:.4g}",
             f"{s.clipped * 100:.3f}%") for s in stats]


_STATS_HEAD = ("quantizer", "role", "fp32 min", "fp32 max", "q min", "q max", "fp32 mean", "fp32 std", "q std",
               "clipped")

_CSS = """body{font-family:system-ui,sans-serif;margin:2em;max-width:1100px;color:#222}
table{border-collapse:collapse;font-size:13px;margin:0.5em 0 1.5em}td,th{border:1px solid #ddd;padding:2px 6px}
th{background:#f4f4f4}.num{text-align:right;font-variant-numeric:tabular-nums}.barcell{width:220px}
.bar{background:#d62728;height:10px}img{max-width:100%;border:1px solid #eee;margin:0.5em 0}
pre{background:#f7f7f7;padding:0.8em;overflow-x:auto;font-size:12px}"""


def _render_html(d: ReportData, plots: dict[str, Any]) -> str:
    e = html.escape
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{e(d.title)}</title>",
             f"<style>{_CSS}</style></head><body>", f"<h1>{e(d.title)}</h1>",
             f"<p>platform <b>{e(d.platform)}</b>; {d.graphwise.batches} batch(es) analysed; metric "
             f"<b>{e(d.graphwise.method)}</b>"
             + (" (noise power / signal power, lower is better)" if d.graphwise.method == "snr" else "") + "</p>"]
    for note in d.notes:
        parts.append(f"<p>{e(note)}</p>")
    if d.graphwise.outputs:
        parts.append("<h2>Network output error vs FP32</h2>" + _html_table(d.graphwise.outputs, d.graphwise.method))
    parts.append("<h2>Graphwise error (accumulated through the quantized graph)</h2>")
    if "graphwise" in plots:
        parts.append(f"<img src='{e(plots['graphwise'])}' alt='graphwise error per layer'>")
    parts.append(_html_table(list(d.graphwise), d.graphwise.method))
    if d.layerwise is not None:
        parts.append("<h2>Layerwise error (one layer quantized at a time, measured at the network output)</h2>")
        if "layerwise" in plots:
            parts.append(f"<img src='{e(plots['layerwise'])}' alt='layerwise error per layer'>")
        parts.append(_html_table(list(d.layerwise), d.layerwise.method))
    if plots.get("hists"):
        parts.append("<h2>Value histograms of the worst layers</h2>")
        for name, src in plots["hists"]:
            parts.append(f"<h3><code>{e(name)}</code></h3><img src='{e(src)}' alt='histograms of {e(name)}'>")
    parts.append("<h2>Quantized tensors</h2><table><tr>" + "".join(f"<th>{h}</th>" for h in _STATS_HEAD) + "</tr>")
    for row in _stats_rows(d.statistics):
        parts.append("<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>")
    parts.append("</table>")
    parts.append(f"<h2>Network snapshot</h2><pre>{e(d.summary)}</pre></body></html>")
    return "\n".join(parts)


def _render_md(d: ReportData, plots: dict[str, Any]) -> str:
    lines = [f"# {d.title}", "", f"platform **{d.platform}**; {d.graphwise.batches} batch(es) analysed; metric "
             f"**{d.graphwise.method}**" + (" (noise power / signal power, lower is better)"
                                            if d.graphwise.method == "snr" else ""), ""]
    lines += [*d.notes, ""] if d.notes else []
    if d.graphwise.outputs:
        lines += ["## Network output error vs FP32", "", *_md_table(d.graphwise.outputs), ""]
    lines += ["## Graphwise error (accumulated through the quantized graph)", ""]
    if "graphwise" in plots:
        lines += [f"![graphwise error per layer]({plots['graphwise']})", ""]
    lines += [*_md_table(list(d.graphwise)), ""]
    if d.layerwise is not None:
        lines += ["## Layerwise error (one layer quantized at a time, measured at the network output)", ""]
        if "layerwise" in plots:
            lines += [f"![layerwise error per layer]({plots['layerwise']})", ""]
        lines += [*_md_table(list(d.layerwise)), ""]
    if plots.get("hists"):
        lines += ["## Value histograms of the worst layers", ""]
        for name, src in plots["hists"]:
            lines += [f"### `{name}`", "", f"![histograms of {name}]({src})", ""]
    lines += ["## Quantized tensors", "", "| " + " | ".join(_STATS_HEAD) + " |",
              "|" + "---|" * len(_STATS_HEAD)]
    lines += ["| " + " | ".join(row) + " |" for row in _stats_rows(d.statistics)]
    lines += ["", "## Network snapshot", "", "```", d.summary, "```", ""]
    return "\n".join(lines)


def write_report(
    model: fx.GraphModule,
    data: Any,
    out_dir: str | os.PathLike,
    *,
    steps: int | None = 8,
    method: str = "snr",
    fmt: str = "html",
    layerwise: bool = False,
    top_k: int = 4,
    ops: str | Iterable[str] = "computing",
    collate_fn: Callable[[Any], Any] | None = None,
    title: str = "fxq quantization report",
    progress: bool = False,
    notes: Iterable[str] = (),
) -> Path:
    """Analyse ``model`` on ``data`` and write ``out_dir/report.html`` (or ``report.md``) with PNG plots.

    The page shows the network output error, a per-layer error bar chart and table (graphwise, and
    layerwise when asked), FP32 vs quantized histograms of the ``top_k`` worst layers' output and
    weight, value statistics of every quantized tensor and the network snapshot. Plots go to
    ``out_dir/plots/``.

    Args:
        model: a quantized ``GraphModule`` from :func:`fxq.quantize`.
        data: batches, as for :func:`fxq.calibrate`.
        out_dir: folder for the page and its plots (created if missing).
        fmt: ``"html"`` or ``"md"``.
        layerwise: also run the (slower) layerwise analysis.
        top_k: how many worst layers get histograms.
        other arguments: as :func:`fxq.graphwise_error_analyse`.

    Returns:
        the path of the page.

    Raises:
        ConfigError: bad ``fmt``; NotSupportedError: matplotlib missing; ExportError: folder not writable.

    Example:
        >>> page = fxq.write_report(qmodel, calib_batches, "report/")   # open report/report.html
    """
    if fmt not in ("html", "md"):
        raise ConfigError(f"fmt={fmt!r}: use 'html' or 'md'")
    _figure(1, 1)  # fail early when matplotlib is missing
    d = analyse_for_report(model, data, steps=steps, method=method, ops=ops, layerwise=layerwise,
                           collate_fn=collate_fn, progress=progress, title=title)
    d.notes.extend(notes)
    return render_report(d, model, out_dir, fmt=fmt, top_k=top_k)


def render_report(d: ReportData, model: fx.GraphModule, out_dir: str | os.PathLike, *, fmt: str = "html",
                  top_k: int = 4) -> Path:
    """Write the page and plots for already computed :class:`ReportData`."""
    out = Path(out_dir)
    plots_dir = out / "plots"
    try:
        plots_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        from fxq.errors import ExportError

        raise ExportError(f"cannot create report folder {str(out)!r}: {exc.strerror or exc}") from exc
    plots: dict[str, Any] = {}
    if len(d.graphwise):
        plot_errors(d.graphwise, model, plots_dir / "graphwise.png", highlight=top_k)
        plots["graphwise"] = "plots/graphwise.png"
    if d.layerwise is not None and len(d.layerwise):
        plot_errors(d.layerwise, model, plots_dir / "layerwise.png", highlight=top_k)
        plots["layerwise"] = "plots/layerwise.png"
    hists = []
    for r in d.graphwise[:top_k]:
        tensors = _layer_tensors(model, r.name, d.statistics)
        if not tensors:
            continue
        fname = f"hist_{_safe(r.name)}.png"
        plot_histograms(tensors, f"{r.name} ({r.op_type}): {format_value(r.metric, r.value)} graphwise "
                                 f"{r.metric.upper()}", plots_dir / fname)
        hists.append((r.name, f"plots/{fname}"))
    plots["hists"] = hists
    page = out / ("report.html" if fmt == "html" else "report.md")
    atomic_write_text(page, _render_html(d, plots) if fmt == "html" else _render_md(d, plots))
    logger.info("report written to %s (%d plots)", page, len(hists) + ("graphwise" in plots) + ("layerwise" in plots))
    return page
