"""Where an exported ONNX file and fxq's simulation part ways, tensor by tensor, in integer codes.

Every activation ``QuantizeLinear`` of the exported file is exposed as a graph output and run in onnxruntime;
its codes are compared with the simulation's codes of the same tensor (the fx node the Q's input names: the
exporters write fx node names, or the source ONNX tensor names for models loaded from ONNX).

* free-running: the runtime computes every tensor from its own upstream values (mismatches propagate);
* teacher-forced: every cut ``DequantizeLinear`` reads the simulation's codes instead, so each tensor is
  computed from identical inputs (only local mismatches remain).

Exposing a Q output keeps that Q, and onnxruntime then fuses the graph differently (its int8 -> uint8 rewrite and
QLinear* fusions leave graph outputs alone), so the exposed file may compute what the deployed file does not. The
verdict is therefore the unmodified file's: its outputs, run as asked, against the simulation's; and the per-tensor
rows come from the highest optimization level that still gives the unmodified file's outputs bit for bit.

A graph with its batch size baked in (``x.view(2, -1)``, an ONNX Reshape to [2, 8]) runs only that batch: the
comparison runs the batch the graph takes (the file's fixed input batch, or the batch the model was prepared with),
whatever batches the data comes in.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import re
from collections import deque
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch
from torch import fx

from fxq.errors import CalibrationError, ConfigError, FrontendError, FxqError, NotSupportedError, one_line
from fxq.graph.nodes import Interpreter
from fxq.onnx_data import ort_session

__all__ = ["TensorMismatch", "OutputMatch", "MismatchReport", "locate_mismatch", "simulation_values",
           "HISTOGRAM_BINS"]

logger = logging.getLogger(__name__)

HISTOGRAM_BINS = ("<=-3", "-2", "-1", "0", "+1", "+2", ">=+3")  # runtime code - simulation code
_INT_TYPES = {2: (np.uint8, 0, 255), 3: (np.int8, -128, 127), 4: (np.uint16, 0, 65535), 5: (np.int16, -32768, 32767)}
# onnxruntime's optimization levels, highest first (the per-tensor session is the highest that keeps the file's outputs)
_LEVELS = ("ORT_ENABLE_ALL", "ORT_ENABLE_EXTENDED", "ORT_ENABLE_BASIC", "ORT_DISABLE_ALL")
_REPLAY_BYTES = 256 << 20  # inputs kept to compare earlier batches again when a later one moves the rows' level
_SUPPORTED = ("ONNX files with QuantizeLinear / DequantizeLinear (fxq.export for trt_int8, ort_int8) and ncnn int8 "
              ".param files (fxq.export for ncnn_int8)")


@dataclasses.dataclass
class TensorMismatch:
    """One quantized tensor: runtime codes against the simulation's codes.

    Attributes:
        name: the tensor the Q quantizes (fx node name or source ONNX tensor name).
        op_type: the ONNX op producing it (``Input`` for a graph input).
        node: the fx node whose simulated value was used.
        elements: codes compared (over all batches).
        identical: share of identical codes.
        max_diff: largest ``|runtime - simulation|`` code difference.
        histogram: counts of ``runtime - simulation`` per :data:`HISTOGRAM_BINS`.
    """

    name: str
    op_type: str
    node: str
    elements: int = 0
    identical: float = 1.0
    max_diff: int = 0
    histogram: list[int] = dataclasses.field(default_factory=lambda: [0] * len(HISTOGRAM_BINS))

    def add(self, diff: np.ndarray) -> None:
        d = np.clip(diff.reshape(-1), -3, 3) + 3
        counts = np.bincount(d, minlength=len(HISTOGRAM_BINS))
        self.histogram = [a + int(b) for a, b in zip(self.histogram, counts)]
        self.elements = sum(self.histogram)
        self.identical = self.histogram[3] / self.elements if self.elements else 1.0
        if diff.size:
            self.max_diff = max(self.max_diff, int(np.abs(diff).max()))


@dataclasses.dataclass
class OutputMatch:
    """One output of the unmodified file, run as deployed, against the simulation's value of it.

    Attributes:
        name: the file's output name.
        elements: values compared (over all batches).
        matched: values equal to the simulation's (NaN equal to NaN).
        max_abs_diff: largest ``|file - simulation|``.
    """

    name: str
    elements: int = 0
    matched: int = 0
    max_abs_diff: float = 0.0

    @property
    def identical(self) -> float:
        """Share of values equal to the simulation's."""
        return self.matched / self.elements if self.elements else 1.0

    def add(self, got: np.ndarray, ref: np.ndarray) -> None:
        same = got == ref
        if got.dtype.kind in "fc":
            same |= np.isnan(got) & np.isnan(ref)
        self.elements += int(got.size)
        self.matched += int(same.sum())
        if got.size and got.dtype.kind in "fciu" and not same.all():
            diff = np.abs(got.astype(np.float64) - ref.astype(np.float64))[~same]
            self.max_abs_diff = max(self.max_abs_diff, float(np.nan_to_num(diff, nan=np.inf).max()))


class MismatchReport(list):
    """A list of :class:`TensorMismatch` in graph order; ``str()`` gives the table.

    Attributes:
        mode: ``free-running`` or ``teacher-forced``.
        optimize: onnxruntime was asked for ``ORT_ENABLE_ALL`` (else ``ORT_DISABLE_ALL``).
        runtime: ``onnxruntime`` or ``ncnn int8``.
        batches: batches compared.
        unmatched: Q inputs with no simulated value (not compared).
        session: the onnxruntime optimization level the per-tensor rows ran in: the asked one, or a lower one where
            exposing the Q outputs changes the asked level's fusions (None: ncnn).
        faithful: whether that session, with the Q outputs exposed, gave the unmodified file's outputs bit for bit
            (None: not checked).
        outputs: the unmodified file's outputs, run as asked, against the simulation's (empty: not compared).
        notes: what the table should say besides the rows (which session, why).
    """

    def __init__(self, records: list[TensorMismatch], *, mode: str, optimize: bool, batches: int,
                 unmatched: list[str] | None = None, runtime: str = "onnxruntime", session: str | None = None,
                 faithful: bool | None = None, outputs: list[OutputMatch] | None = None,
                 notes: list[str] | None = None) -> None:
        super().__init__(records)
        self.mode, self.optimize, self.batches, self.runtime = mode, optimize, batches, runtime
        self.unmatched = list(unmatched or [])
        self.session = session if session is not None or runtime != "onnxruntime" else _asked(optimize)
        self.faithful = faithful
        self.outputs = list(outputs or [])
        self.notes = list(notes or [])

    @property
    def outputs_identical(self) -> bool | None:
        """Whether the unmodified file's outputs, run as asked, equal the simulation's on every compared batch
        (None: not compared, as for ncnn files or outputs that could not be paired with the model's)."""
        return all(o.matched == o.elements for o in self.outputs) if self.outputs else None

    def differing(self, tolerance: float = 0.0) -> list[TensorMismatch]:
        """Tensors with less than ``1 - tolerance`` identical codes in the per-tensor session, in graph order,
        whether or not the file's outputs differ."""
        return [r for r in self if r.identical < 1.0 - tolerance]

    def diverged(self, tolerance: float = 0.0) -> list[TensorMismatch]:
        """Tensors with less than ``1 - tolerance`` identical codes, in graph order; none when the unmodified file's
        outputs equal the simulation's (:attr:`outputs_identical`): a code difference that does not reach the
        outputs, or that only the comparison's own session makes, is not the file's mismatch."""
        return [] if self.outputs_identical else self.differing(tolerance)

    @property
    def first_divergence(self) -> TensorMismatch | None:
        """The first tensor in graph order whose codes differ (None: all identical)."""
        bad = self.diverged()
        return bad[0] if bad else None

    @property
    def identical(self) -> float:
        """Share of identical codes over all tensors."""
        total = sum(r.elements for r in self)
        return sum(r.histogram[3] for r in self) / total if total else 1.0

    def to_dict(self) -> dict[str, Any]:
        first = self.first_divergence
        return {"mode": self.mode, "runtime": self.runtime, "optimize": self.optimize, "session": self.session,
                "faithful": self.faithful, "batches": self.batches, "identical": self.identical,
                "first_divergence": first.name if first else None, "outputs_identical": self.outputs_identical,
                "outputs": [dict(dataclasses.asdict(o), identical=o.identical) for o in self.outputs],
                "bins": list(HISTOGRAM_BINS), "tensors": [dataclasses.asdict(r) for r in self],
                "unmatched": list(self.unmatched), "notes": list(self.notes)}

    def table(self, limit: int | None = None) -> str:
        """The table in graph order (``limit``: rows from the first divergence on, when there is one)."""
        runtime = self.runtime
        if self.runtime == "onnxruntime":
            asked = _asked(self.optimize)
            runtime = f"onnxruntime {self.session}" + (f" ({asked} asked)" if self.session != asked else "")
        title = (f"runtime vs simulation, integer codes, {self.mode}, {runtime}, {self.batches} "
                 f"batch{'es' if self.batches != 1 else ''}, graph order")
        rows = list(self)
        start = 0
        first = self.first_divergence
        if limit and first is not None and len(rows) > limit:
            start = max(0, min(rows.index(first), len(rows) - limit))
        shown = rows[start:start + limit] if limit else rows
        lines = [title]
        if not shown:
            lines.append("  (no quantized tensors compared)")
        else:
            name_w = max(6, max(len(r.name) for r in shown))
            op_w = max(2, max(len(r.op_type) for r in shown))
            lines.append(f"  {'tensor'.ljust(name_w)}  {'op'.ljust(op_w)}  {'identical':>9}  {'max':>4}  "
                         + " ".join(f"{b:>7}" for b in HISTOGRAM_BINS))
            for r in shown:
                mark = "  <- first divergence" if r is first else ""
                lines.append(f"  {r.name.ljust(name_w)}  {r.op_type.ljust(op_w)}  {100 * r.identical:8.3f}%  "
                             f"{r.max_diff:>4}  " + " ".join(f"{c:>7}" for c in r.histogram) + mark)
        if start:
            lines.insert(1, f"  ... {start} identical tensors before")
        if limit and len(rows) > start + limit:
            lines.append(f"  ... {len(rows) - start - limit} more")
        differing = self.differing()
        if first is not None:
            lines.append(f"first divergence: {first.name} ({first.op_type}): {100 * first.identical:.3f}% identical, "
                         f"max code difference {first.max_diff}; {len(self.diverged())} of {len(rows)} tensors differ")
        elif differing:
            lines.append(f"no divergence: the file's outputs equal the simulation's; {len(differing)} of {len(rows)} "
                         f"tensors differ in codes in the per-tensor session without reaching the outputs")
        else:
            lines.append(f"all {len(rows)} tensors identical")
        if self.outputs:
            asked = f"onnxruntime {_asked(self.optimize)}" if self.runtime == "onnxruntime" else self.runtime
            lines.append(f"outputs of the unmodified file ({asked}) vs simulation: " + ", ".join(
                f"{o.name} {100 * o.identical:.3f}% identical" + (f" (max |diff| {o.max_abs_diff:.3g})"
                                                                  if o.matched < o.elements else "")
                for o in self.outputs))
        lines += [f"note: {n}" for n in self.notes]
        if self.unmatched:
            lines.append(f"not compared (no simulated value): {', '.join(self.unmatched)}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        return f"<MismatchReport {self.mode}: {len(self)} tensors, {len(self.diverged())} differ>"


def simulation_values(gm: fx.GraphModule, inputs: dict[fx.Node, Any],
                      names: set[str] | None = None) -> dict[str, torch.Tensor]:
    """Tensor values of one simulated (quantized) forward pass by fx node name: those in ``names`` (default every
    one), copied (a later in-place op of the graph would write into them)."""
    values: dict[str, torch.Tensor] = {}

    class _Capture(Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            out = super().run_node(n)
            if isinstance(out, torch.Tensor) and (names is None or n.name in names):
                values[n.name] = out.detach().clone()
            return out

    args = [inputs[n] for n in gm.graph.nodes if n.op == "placeholder" and n in inputs]
    with torch.no_grad():
        _Capture(gm).run(*args)
    return values


def _load(exported: Any) -> Any:
    import onnx

    if isinstance(exported, onnx.ModelProto):
        m = onnx.ModelProto()
        m.CopyFrom(exported)
        return m
    path = Path(exported)
    if not path.is_file():
        raise FrontendError(f"exported file {str(path)!r} not found")
    try:
        return onnx.load(str(path))
    except Exception as exc:  # noqa: BLE001  (any decode error: say which file)
        raise FrontendError(f"exported file {str(path)!r} is not a readable ONNX model: {exc}") from exc


def _node_by_tensor(gm: fx.GraphModule) -> dict[str, fx.Node]:
    """Tensor name in the exported file -> fx node (fx names, overridden by source ONNX tensor names)."""
    names: dict[str, fx.Node] = {n.name: n for n in gm.graph.nodes}
    for n in gm.graph.nodes:
        info = n.meta.get("onnx")
        outs = info.get("outputs") if isinstance(info, dict) else None
        if outs and len(outs) == 1 and outs[0]:
            names[str(outs[0])] = n
    return names


def _named_by_dq(graph: Any, codes: str, by_tensor: dict[str, fx.Node]) -> fx.Node | None:
    """The fx node named by the output of the DequantizeLinear reading ``codes`` (a renamed graph output)."""
    for user in graph.node:
        if user.op_type == "DequantizeLinear" and user.input[0] == codes:
            n = by_tensor.get(user.output[0])
            if n is not None and n.op != "output":
                return n
    return None


def gives_codes(fq: Any) -> bool:
    """Whether quantizer ``fq`` puts values on an integer grid (quantizing, not a float format, scale known)."""
    cfg = getattr(fq, "config", None)
    return (cfg is not None and getattr(cfg, "is_quantizing", False) and not cfg.is_floating
            and cfg.scale is not None)


def _quantizer_for(gm: fx.GraphModule, node: fx.Node, scale: np.ndarray, zp: np.ndarray,
                   quantizers: dict[str, Any]) -> Any:
    """The FakeQuantize whose grid the value of ``node`` is exported on: among the node's quantizers the one with
    the file's scale and zero-point, else any quantizer with them (torch.onnx merges equal computations, so a
    Q may read a value that the simulation computes twice under two names: RAFT's ``coords1 - coords0`` as the
    upsampled flow and as the next iteration's flow), else the node's nearest in scale."""
    from fxq.graph.info import NodeQuant, is_quantizer_node

    def exact(fq: Any) -> bool:
        s = fq.config.scale.detach().float().cpu().numpy().reshape(-1)
        o = np.rint(fq.config.offset.detach().float().cpu().numpy().reshape(-1))
        return (s.shape == scale.reshape(-1).shape and np.array_equal(s, scale.reshape(-1).astype(np.float32))
                and np.array_equal(o, zp.reshape(-1).astype(np.float64)))

    cands = []
    for user in node.users:
        if is_quantizer_node(user):
            cands.append(gm.get_submodule(str(user.target)))
    nq = node.meta.get("fxq")
    if not cands and isinstance(nq, NodeQuant) and nq.output in quantizers:
        cands.append(quantizers[nq.output])
    cands = [fq for fq in cands if gives_codes(fq)]
    same = next((fq for fq in cands if exact(fq)), None) or next(
        (fq for fq in quantizers.values() if fq.role == "activation" and gives_codes(fq) and exact(fq)), None)
    if same is not None:
        return same
    if not cands:
        return None
    target = float(np.abs(scale).reshape(-1).mean()) or 1.0

    def distance(fq: Any) -> float:
        s = float(fq.config.scale.detach().double().abs().reshape(-1).mean()) or 1e-30
        return abs(math.log(s / target))

    return min(cands, key=distance)


def _codes(value: torch.Tensor, fq: Any, scale: np.ndarray, zp: np.ndarray, elem: int) -> np.ndarray:
    """Simulation codes: the simulation's own quantizer, else the file's scale on the simulated value."""
    from fxq.functional import quantize_to_int

    if fq is not None:
        return quantize_to_int(value.float(), fq.config).cpu().numpy().astype(np.int64)
    from fxq.spec import TensorQuantConfig

    _, lo, hi = _INT_TYPES[elem]  # the file's own grid: ONNX QuantizeLinear rounds half to even
    cfg = TensorQuantConfig(num_bits=int(np.log2(hi - lo + 1)), symmetric=not np.any(zp), quant_min=lo,
                            quant_max=hi, scale=torch.as_tensor(scale, dtype=torch.float32).reshape(-1),
                            offset=torch.as_tensor(zp, dtype=torch.float32).reshape(-1))
    return quantize_to_int(value.detach().float(), cfg).cpu().numpy().astype(np.int64)


def _asked(optimize: bool) -> str:
    return "ORT_ENABLE_ALL" if optimize else "ORT_DISABLE_ALL"


def _session(model: Any, level: str) -> Any:
    """An onnxruntime session of ``model`` at optimization ``level`` (one of :data:`_LEVELS`)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
    try:
        return ort_session(model, opts)  # models over 2 GiB: weights handed over in memory
    except Exception as exc:  # noqa: BLE001  (onnxruntime's own errors: one line)
        raise FrontendError(f"onnxruntime cannot load the exported file ({level}): {one_line(exc)}") from exc


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal shapes and values (NaN equal to NaN): what the deployed file computes, bit for bit up to NaN payloads."""
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and np.array_equal(a, b, equal_nan=a.dtype.kind in "fc" and b.dtype.kind in "fc")


def _feed_for(sess: Any, feed: dict[str, Any]) -> dict[str, Any]:
    """``feed`` without what ``sess`` does not take (a cut may leave an input unused)."""
    names = {i.name for i in sess.get_inputs()}
    return {k: v for k, v in feed.items() if k in names}


def _rows_session(model: Any, asked: str, feed: dict[str, Any], plain: list[np.ndarray],
                  names: list[str]) -> tuple[Any, str, bool]:
    """The session of ``model`` (the file with its Q outputs exposed) that the per-tensor rows come from: the highest
    optimization level, from ``asked`` down, at which it gives ``plain`` (the unmodified file's outputs ``names``
    at ``asked``, on the batch ``feed``) bit for bit. Exposing a Q keeps it, and onnxruntime fuses around
    graph outputs differently (its int8 -> uint8 rewrite and QLinear* fusions leave them alone), so the asked level
    may compute other values than the deployed file. None matching: the asked level's session and False."""
    first: tuple[Any, str, bool] | None = None
    for level in _LEVELS[_LEVELS.index(asked):]:
        sess = _session(model, level)
        got = sess.run(names, _feed_for(sess, feed))
        if all(_same(a, b) for a, b in zip(got, plain)):
            return sess, level, True
        logger.debug("with its Q outputs exposed, the file's outputs at %s differ from the file's own at %s",
                     level, asked)
        first = first or (sess, level, False)
    assert first is not None
    return first


def batch_size(bound: dict[fx.Node, Any]) -> int:
    """Samples in a batch of placeholder values: dim 0 of its first tensor of rank >= 1 (1 when none)."""
    return next((int(v.shape[0]) for v in bound.values() if isinstance(v, torch.Tensor) and v.dim()), 1)


def _batched(value: Any, n: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and int(value.shape[0]) == n


def _slice(bound: dict[fx.Node, Any], start: int, stop: int) -> dict[fx.Node, Any]:
    """Samples ``start:stop`` of a batch; a value without the batch's samples along dim 0 is kept whole."""
    n = batch_size(bound)
    return {p: v[start:stop] if _batched(v, n) else v for p, v in bound.items()}


def _join(pieces: list[dict[fx.Node, Any]]) -> dict[fx.Node, Any]:
    """One batch of the samples of ``pieces`` (in order); values without a batch dim come from the first."""
    sizes = [batch_size(b) for b in pieces]
    out: dict[fx.Node, Any] = {}
    for p in pieces[0]:
        values = [b[p] for b in pieces]
        if not all(_batched(v, n) for v, n in zip(values, sizes)):
            out[p] = values[0]
            continue
        try:
            out[p] = torch.cat(values)
        except RuntimeError as exc:
            raise CalibrationError(
                f"input {p.name!r}: samples of shapes {sorted({tuple(v.shape[1:]) for v in values})} cannot be put "
                f"in one batch of {sum(sizes)} (the batch size the graph runs): give samples of one size") from exc
    return out


class Samples:
    """The samples of the data's batches (placeholder values), taken in batches of any size: a graph with its batch
    size baked in (``x.view(2, -1)``, an ONNX Reshape to [2, 8]) runs only that batch, whatever batches the data
    comes in (a folder of single images), and ncnn runs one sample at a time."""

    def __init__(self, batches: Iterable[dict[fx.Node, Any]]) -> None:
        self._source = iter(batches)
        self._pending: list[dict[fx.Node, Any]] = []
        self.read = 0  # data batches read
        self.first: dict[fx.Node, Any] | None = None  # the data's first batch, as given

    def _fill(self, n: int) -> bool:
        while sum(batch_size(b) for b in self._pending) < n:
            bound = next(self._source, None)
            if bound is None:
                return False
            self.read += 1
            self.first = bound if self.first is None else self.first
            self._pending.append(bound)
        return True

    def first_batch(self) -> dict[fx.Node, Any]:
        """The data's first batch as given (read now if it was not)."""
        self._fill(1)
        assert self.first is not None  # an empty data raised CalibrationError
        return self.first

    def peek(self, n: int) -> dict[fx.Node, Any] | None:
        """The next ``n`` samples as one batch, left to take; None when the data has fewer."""
        if not self._fill(n):
            return None
        pieces, need = [], n
        for bound in self._pending:
            k = min(need, batch_size(bound))
            pieces.append(bound if k == batch_size(bound) else _slice(bound, 0, k))
            need -= k
            if not need:
                break
        return pieces[0] if len(pieces) == 1 else _join(pieces)

    def take(self, n: int) -> dict[fx.Node, Any] | None:
        """:meth:`peek`, the samples taken."""
        out = self.peek(n)
        need = n if out is not None else 0
        while need:
            k = batch_size(self._pending[0])
            if k <= need:
                self._pending.pop(0)
            else:
                self._pending[0] = _slice(self._pending[0], need, k)
            need -= min(k, need)
        return out

    def left(self) -> int:
        """Samples read and not taken."""
        return sum(batch_size(b) for b in self._pending)

    def batches(self, size: int | None, limit: int | None = None) -> Iterator[dict[fx.Node, Any]]:
        """Batches of ``size`` samples (None: the data's batches as given), at most ``limit``; samples left over
        (fewer than ``size``) are logged."""
        count = 0
        while limit is None or count < limit:
            if size is None:
                if not self._pending and not self._fill(1):
                    break
                bound = self._pending.pop(0)
            else:
                got = self.take(size)
                if got is None:
                    break
                bound = got
            count += 1
            yield bound
        if size is not None and self.left():
            logger.info("mismatch analysis: %d sample(s) left over, fewer than the batch of %d the graph runs: not "
                        "compared", self.left(), size)


def prepared_batch(gm: fx.GraphModule) -> int | None:
    """The batch size ``gm`` was prepared (captured, calibrated) with: dim 0 of its first input's recorded value."""
    for n in gm.graph.nodes:
        value = n.meta.get("val") if n.op == "placeholder" else None
        if isinstance(value, torch.Tensor) and value.dim():
            return int(value.shape[0])
    return None


def runnable_batch(gm: fx.GraphModule, samples: Samples, sizes: Iterable[int | None],
                   names: set[str]) -> tuple[int, dict[fx.Node, Any], dict[str, torch.Tensor], BaseException | None]:
    """The batch size the comparison runs ``gm`` at: the first of ``sizes`` at which the simulation runs the data's
    first samples (a graph with its batch size baked in runs only that one), with those samples, their simulated
    values (``names``) and None; else the data's own first batch, with the failure at the last of ``sizes``.

    Raises:
        CalibrationError: the data's own first batch fails in the FP32 model too (the data does not fit the model).
        GraphError: it fails only in fxq's quantized model (:func:`~fxq.graph.data.diagnose_failure`).
    """
    from fxq.graph.data import diagnose_failure, first_batch_errors

    failure: BaseException | None = None
    for size in dict.fromkeys(s for s in sizes if s):
        chunk = samples.peek(size)
        if chunk is None:
            continue
        try:
            return size, chunk, simulation_values(gm, chunk, names), None
        except Exception as exc:  # noqa: BLE001  (any failure: the next size, then the data's own batch, decide)
            logger.debug("the simulation does not run a batch of %d: %s", size, one_line(exc))
            failure = exc
    own = samples.first_batch()
    with first_batch_errors("mismatch analysis", True, diagnose=functools.partial(diagnose_failure, gm, own)):
        values = simulation_values(gm, own, names)
    return batch_size(own), own, values, failure


def _file_batch(graph: Any, inits: dict[str, Any]) -> int | None:
    """The batch size fixed in the file's inputs: their common static dim 0 (None when one is symbolic or they
    differ); onnxruntime refuses any other."""
    dims = set()
    for i in graph.input:
        if i.name in inits or not i.type.HasField("tensor_type") or not i.type.tensor_type.HasField("shape"):
            continue
        shape = i.type.tensor_type.shape.dim
        if shape:
            dims.add(shape[0].dim_value if shape[0].HasField("dim_value") and shape[0].dim_value > 0 else None)
    return dims.pop() if len(dims) == 1 and None not in dims else None


def _output_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The nodes whose values are the model's outputs, flattened in order (as the exporters write the file's)."""
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    nodes: list[fx.Node] = []
    fx.node.map_arg(out.args[0], nodes.append)
    return nodes


def locate_mismatch(
    qmodel: fx.GraphModule,
    exported_file: Any,
    data: Any,
    *,
    teacher_forced: bool = False,
    optimize: bool = True,
    steps: int | None = 4,
    collate_fn: Callable[[Any], Any] | None = None,
    example_inputs: Any = None,
) -> MismatchReport:
    """Compare an exported file, run in its runtime, with fxq's simulation, tensor by tensor, in integer codes.

    A Q/DQ ONNX file runs in onnxruntime, an ncnn int8 ``.param`` (its ``.bin`` beside it) in ncnn, one sample at
    a time (:mod:`fxq.analysis.mismatch_ncnn`). A graph with its batch size baked in (``x.view(2, -1)``) runs
    batches of that size: the file's fixed input batch, else the batch the model was prepared with.

    The verdict is about the file as it runs: the unmodified ONNX file's outputs, in the session asked, are compared
    with the simulation's (``report.outputs``); when they are equal no tensor is reported as diverging. The
    per-tensor rows run the file with its Q outputs exposed, at the highest optimization level that still gives the
    unmodified file's outputs bit for bit (``report.session``; exposing a Q changes onnxruntime's fusions).

    Args:
        qmodel: the quantized ``GraphModule`` the file was exported from.
        exported_file: path of the ``.onnx`` file (or an ``onnx.ModelProto``), or of the ncnn ``.param``.
        data: batches (list, DataLoader, tensor, tuples or dicts).
        teacher_forced: feed every cut DequantizeLinear (every compared ncnn blob) with the simulation's value
            (local mismatches only).
        optimize: onnxruntime ``ORT_ENABLE_ALL`` (True) or ``ORT_DISABLE_ALL`` (ncnn: not used).
        steps: compare at most this many batches (None: all).
        collate_fn: applied to each batch first.
        example_inputs: ncnn only: the ``example_inputs`` the file was exported with (FP32 islands follow them).

    Returns:
        :class:`MismatchReport` in graph order; ``first_divergence`` names the first differing tensor.

    Raises:
        NotSupportedError: an ONNX file without Q/DQ; FrontendError: unreadable file; ConfigError: inputs of the
        file and the model do not match (an ncnn file not exported from ``qmodel``, a file whose fixed batch the
        model does not run); CalibrationError: empty data, or data the FP32 model does not run.
    """
    import onnx
    from onnx import numpy_helper

    from fxq.analysis.engine import iter_bound_batches
    from fxq.analysis.runner import GraphRunner
    from fxq.graph.quant_graph import QuantGraph

    if not isinstance(qmodel, fx.GraphModule):
        raise ConfigError(f"qmodel must be a quantized fx.GraphModule, got {type(qmodel).__name__}")
    if isinstance(exported_file, (str, Path)) and str(exported_file).lower().endswith((".param", ".bin")):
        from fxq.analysis.mismatch_ncnn import locate_ncnn_mismatch

        param = Path(re.sub(r"\.bin$", ".param", str(exported_file), flags=re.I))
        return locate_ncnn_mismatch(qmodel, param, data, teacher_forced=teacher_forced, steps=steps,
                                    collate_fn=collate_fn, example_inputs=example_inputs)
    model = _load(exported_file)
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    by_tensor = _node_by_tensor(qmodel)
    quantizers = QuantGraph(qmodel).as_dict()
    producer = {o: n.op_type for n in g.node for o in n.output}
    graph_inputs = [i.name for i in g.input if i.name not in inits]

    # activation Qs with per-tensor or per-channel int scales, in graph order
    cuts: list[tuple[Any, fx.Node, Any, np.ndarray, np.ndarray, int]] = []
    unmatched: list[str] = []
    any_q = False
    for node in g.node:
        if node.op_type != "QuantizeLinear" or node.input[0] in inits or len(node.input) < 3:
            continue
        if node.input[1] not in inits or node.input[2] not in inits:
            continue
        any_q = True
        elem = inits[node.input[2]].data_type
        fxnode = by_tensor.get(node.input[0]) or _named_by_dq(g, node.output[0], by_tensor)
        if fxnode is None or elem not in _INT_TYPES:
            unmatched.append(node.input[0])
            continue
        scale = numpy_helper.to_array(inits[node.input[1]])
        zp = numpy_helper.to_array(inits[node.input[2]])
        cuts.append((node, fxnode, _quantizer_for(qmodel, fxnode, scale, zp, quantizers), scale, zp, elem))
    if not any_q:
        raise NotSupportedError(f"the exported file has no activation QuantizeLinear; supported: {_SUPPORTED}")

    runner = GraphRunner(qmodel)
    placeholders = [n for n in qmodel.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(graph_inputs):
        raise ConfigError(f"the exported file has inputs {graph_inputs}, the model {[p.name for p in placeholders]}")
    input_of = {}
    for p, pos_name in zip(placeholders, graph_inputs):
        info = p.meta.get("onnx")
        name = str(info["outputs"][0]) if isinstance(info, dict) and info.get("outputs") else p.name
        input_of[p] = name if name in graph_inputs else pos_name

    # the file as it runs, before any change: its outputs are the verdict's reference
    asked = _asked(optimize)
    file_outputs = [o.name for o in g.output]
    plain = _session(model, asked)
    out_nodes = _output_nodes(qmodel)
    notes: list[str] = []
    if len(out_nodes) != len(file_outputs):
        notes.append(f"the file has {len(file_outputs)} outputs and the model {len(out_nodes)}: outputs not compared")
        out_nodes = []
    outputs = [OutputMatch(name) for name in file_outputs] if out_nodes else []

    exposed = {o.name for o in g.output}
    for node, *_ , elem in cuts:
        if node.output[0] not in exposed:
            g.output.append(onnx.helper.make_tensor_value_info(node.output[0], elem, None))
            exposed.add(node.output[0])

    records = [TensorMismatch(node.input[0], producer.get(node.input[0], "Input"), fxnode.name)
               for node, fxnode, *_ in cuts]
    wanted = {fxnode.name for _, fxnode, *_ in cuts} | {n.name for n in out_nodes}

    fixed = _file_batch(g, inits)
    samples = Samples(iter_bound_batches(runner, data, None if fixed else steps, collate_fn, progress=False,
                                          desc=""))
    rows = _Rows(model, cuts, asked, teacher_forced, file_outputs)
    qmodel_training = qmodel.training
    qmodel.eval()
    try:
        own = batch_size(samples.first_batch())
        if fixed and samples.peek(fixed) is None:
            raise CalibrationError(f"the exported file takes batches of {fixed} only (its inputs' fixed batch size) "
                                   f"and the data has {samples.left()} sample(s): give at least {fixed}")
        sizes = [fixed] if fixed else [own, prepared_batch(qmodel)]
        size, _, first_values, failure = runnable_batch(qmodel, samples, sizes, wanted)
        if fixed and size != fixed:
            raise ConfigError(
                f"the exported file takes batches of {fixed} only (its inputs' fixed batch size), and the model fails "
                f"on {fixed} of your samples ({type(failure).__name__}: {one_line(failure)}) while it runs your "
                f"batch of {size}: fxq's comparison cannot run this pair, and your data is not the cause. The file "
                f"was exported for another batch size than the model runs: export it again from this model "
                f"(fxq.export) and compare that file")
        if size != own:
            logger.info("mismatch analysis: the graph runs batches of %d only (%s); the data's samples are compared "
                        "in batches of %d", size, "the file's fixed input batch" if fixed else
                        "a batch size baked into the model", size)
        history: list[dict[fx.Node, Any]] | None = []  # inputs of the batches in the rows (replayed at a new level)
        kept = 0  # their bytes
        in_rows = dropped = 0
        for inputs in samples.batches(size if fixed or size != own else None, steps if fixed else None):
            key = -1  # this batch's place in ``history``
            if history is not None and rows.may_move():
                kept += sum(v.numel() * v.element_size() for v in inputs.values() if isinstance(v, torch.Tensor))
                if kept <= _REPLAY_BYTES:
                    key = len(history)
                    history.append(inputs)
                else:
                    history = None
            todo = deque([(key, inputs, first_values, True)])
            first_values = None
            while todo:  # this batch; then, after the rows moved to another session, the earlier ones again
                key, batch, values, new = todo.popleft()
                values = values if values is not None else simulation_values(qmodel, batch, wanted)
                feed = {input_of[p]: batch[p].detach().cpu().numpy() for p in placeholders}
                sim = [_codes(values[fxnode.name], fq, scale, zp, elem) for (_, fxnode, fq, scale, zp, elem) in cuts]
                try:
                    file_got = plain.run(file_outputs, _feed_for(plain, feed))
                    got = rows.run(feed, sim, file_got)
                except FxqError:
                    raise
                except Exception as exc:  # noqa: BLE001  (onnxruntime's own errors: one line)
                    raise ConfigError(f"onnxruntime failed on batch {in_rows + dropped}: {one_line(exc)}") from exc
                if rows.reset:  # the rows so far ran in a session that computes other values than the file
                    records = [TensorMismatch(r.name, r.op_type, r.node) for r in records]
                    if history:
                        todo = deque((k, h, None, False) for k, h in enumerate(history) if k != key)
                    else:
                        dropped += in_rows
                    in_rows = 0
                for rec, ref, out in zip(records, sim, got):
                    out = np.asarray(out).astype(np.int64)
                    if out.shape != ref.shape:
                        raise ConfigError(f"tensor {rec.name!r}: runtime shape {list(out.shape)} vs simulation "
                                          f"{list(ref.shape)}")
                    rec.add(out - ref)
                in_rows += 1
                if new:
                    outputs = _add_outputs(outputs, file_got, [values.get(n.name) for n in out_nodes], notes)
    finally:
        qmodel.train(qmodel_training)
    if dropped:
        notes.append(f"the rows cover the last {in_rows} batch(es): {dropped} earlier one(s) ran at a level that a "
                     f"later batch showed to compute other values than the deployed file (too large to run again)")
    return MismatchReport(records, mode="teacher-forced" if teacher_forced else "free-running", optimize=optimize,
                          batches=in_rows, unmatched=unmatched, session=rows.level, faithful=rows.faithful,
                          outputs=outputs, notes=rows.notes() + notes)


class _Rows:
    """The onnxruntime session the per-tensor rows come from, and its check against the deployed file.

    Exposing a Q output keeps that Q, and onnxruntime then fuses the graph differently (its int8 -> uint8 rewrite and
    QLinear* fusions leave graph outputs alone), so the exposed file at the asked level may compute other values
    than the file as deployed. The rows run at the highest level, from the asked one down, at which the exposed file
    (free-running) gives the unmodified file's outputs bit for bit on every batch; a batch that shows a level wrong
    moves the rows down (:attr:`reset`: the rows so far ran in the wrong session)."""

    def __init__(self, model: Any, cuts: list[tuple], asked: str, teacher_forced: bool, names: list[str]) -> None:
        self.model, self.cuts, self.asked, self.teacher_forced, self.names = model, cuts, asked, teacher_forced, names
        self.fetch = [node.output[0] for node, *_ in cuts]
        self.extra = [name for name in names if name not in self.fetch]  # the file's outputs, beside the codes
        self.level = asked
        self.faithful = True
        self.checking = True  # False once no level gives the file's outputs: rows stay where they are
        self.reset = False  # the last run moved the rows to another session: the rows before it are wrong
        self._free: Any = None  # the exposed file at ``level``, free-running
        self._fed: Any = None  # the same, teacher-forced

    def _use(self, free: Any, level: str) -> None:
        self._free, self.level = free, level
        self._fed = None
        if self.teacher_forced:
            with _fed_by_inputs(self.model, self.cuts):
                self._fed = _session(self.model, level)

    def may_move(self) -> bool:
        """Whether a later batch may still move the rows to a lower level."""
        return self.checking and self._below() is not None

    def _below(self) -> str | None:
        """The optimization level below the rows' one (None: none is lower)."""
        i = _LEVELS.index(self.level) + 1
        return _LEVELS[i] if i < len(_LEVELS) else None

    def _free_outputs(self, got: list[Any]) -> list[Any]:
        mine = dict(zip(self.fetch + self.extra, got))
        return [mine[name] for name in self.names]

    def _choose(self, feed: dict[str, Any], file_got: list[np.ndarray], start: str | None) -> None:
        """The highest level from ``start`` down that gives ``file_got`` on this batch (else, or ``start`` None:
        unfaithful, the rows stay where they are)."""
        if start is None:
            self.faithful = self.checking = False
            return
        free, level, ok = _rows_session(self.model, start, feed, file_got, self.names)
        if not ok:
            self.faithful = self.checking = False
            if self._free is None:
                self._use(free, level)
            return
        if level != self.level or self._free is None:
            self.reset = self._free is not None
            self._use(free, level)

    def run(self, feed: dict[str, Any], sim: list[np.ndarray], file_got: list[np.ndarray]) -> list[Any]:
        """The exposed codes of one batch (``sim``: the simulation's codes, fed when teacher-forced), checked
        against ``file_got``, the unmodified file's outputs on it; sets :attr:`reset` when earlier rows go."""
        self.reset = False
        if self._free is None:
            self._choose(feed, file_got, self.asked)
        if self.teacher_forced:
            if self.checking and not all(_same(a, b) for a, b in zip(
                    self._free.run(self.names, _feed_for(self._free, feed)), file_got)):
                self._choose(feed, file_got, self._below())
            fed = dict(feed)
            for (node, *_, elem), ref in zip(self.cuts, sim):
                dtype, lo, hi = _INT_TYPES[elem]
                fed[node.output[0] + "__fxq_fed"] = np.clip(ref, lo, hi).astype(dtype)
            got = self._fed.run(self.fetch, _feed_for(self._fed, fed))
        else:
            got = self._free.run(self.fetch + self.extra, _feed_for(self._free, feed))
            if self.checking and not all(_same(a, b) for a, b in zip(self._free_outputs(got), file_got)):
                self._choose(feed, file_got, self._below())
                got = self._free.run(self.fetch + self.extra, _feed_for(self._free, feed))
        return got[:len(self.fetch)]

    def notes(self) -> list[str]:
        out = []
        if self.level != self.asked and self.faithful:
            out.append(f"per-tensor rows in {self.level}: with its Q outputs exposed, the file at {self.asked} fuses "
                       f"differently and computes other values than the file as deployed; {self.level} gives the "
                       f"unmodified file's {self.asked} outputs bit for bit")
        elif not self.faithful:
            out.append(f"with its Q outputs exposed, no optimization level from {self.level} down gives the "
                       f"unmodified file's {self.asked} outputs on every batch: the rows ({self.level}) may show "
                       f"differences the deployed file does not have; the outputs line is the deployed file's own")
        return out


@contextlib.contextmanager
def _fed_by_inputs(model: Any, cuts: list[tuple]) -> Iterator[Any]:
    """``model`` (its Q outputs exposed) with every DequantizeLinear of a compared Q reading a new graph input
    ``<codes>__fxq_fed`` instead, which the teacher-forced comparison feeds with the simulation's codes; restored
    after the block (the free-running file is needed again when the rows change level)."""
    import onnx

    g = model.graph
    changed: list[Any] = []
    for node, *_, elem in cuts:
        codes = node.output[0]
        fed = codes + "__fxq_fed"
        for user in g.node:
            if user.op_type == "DequantizeLinear" and user.input[0] == codes:
                user.input[0] = fed
                changed.append((user, codes))
        g.input.append(onnx.helper.make_tensor_value_info(fed, elem, None))
    try:
        yield model
    finally:
        for user, codes in changed:
            user.input[0] = codes
        for _ in cuts:
            g.input.pop()


def _add_outputs(outputs: list[OutputMatch], got: list[np.ndarray], sim: list[torch.Tensor | None],
                 notes: list[str]) -> list[OutputMatch]:
    """``outputs`` with one more batch compared: the file's outputs ``got`` against the simulation's ``sim``; none
    (and a note) when an output cannot be paired with the model's (another shape, no tensor)."""
    if not outputs:
        return outputs
    pairs = []
    for rec, out, ref in zip(outputs, got, sim):
        out = np.asarray(out)
        if not isinstance(ref, torch.Tensor) or tuple(ref.shape) != out.shape:
            notes.append(f"output {rec.name!r} of the file does not pair with the model's "
                         f"({list(out.shape)} vs {list(ref.shape) if isinstance(ref, torch.Tensor) else ref!r}): "
                         f"outputs not compared")
            return []
        ref_np = ref.detach().cpu().numpy()
        pairs.append((rec, out, ref_np if ref_np.dtype == out.dtype else ref_np.astype(out.dtype)))
    for rec, out, ref_np in pairs:
        rec.add(out, ref_np)
    return outputs
