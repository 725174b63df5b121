"""Where an exported ONNX file and fxq's simulation part ways, tensor by tensor, in integer codes.

Every activation ``QuantizeLinear`` of the exported file is exposed as a graph output and run in onnxruntime;
its codes are compared with the simulation's codes of the same tensor (the fx node the Q's input names: the
exporters write fx node names, or the source ONNX tensor names for models loaded from ONNX).

* free-running: the runtime computes every tensor from its own upstream values (mismatches propagate);
* teacher-forced: every cut ``DequantizeLinear`` reads the simulation's codes instead, so each tensor is
  computed from identical inputs (only local mismatches remain).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import re
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import fx

from fxq.errors import ConfigError, FrontendError, NotSupportedError, one_line
from fxq.graph.nodes import Interpreter
from fxq.onnx_data import ort_session

__all__ = ["TensorMismatch", "MismatchReport", "locate_mismatch", "simulation_values", "HISTOGRAM_BINS"]

HISTOGRAM_BINS = ("<=-3", "-2", "-1", "0", "+1", "+2", ">=+3")  # runtime code - simulation code
_INT_TYPES = {2: (np.uint8, 0, 255), 3: (np.int8, -128, 127), 4: (np.uint16, 0, 65535), 5: (np.int16, -32768, 32767)}
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


class MismatchReport(list):
    """A list of :class:`TensorMismatch` in graph order; ``str()`` gives the table.

    Attributes:
        mode: ``free-running`` or ``teacher-forced``.
        optimize: onnxruntime ran with ``ORT_ENABLE_ALL`` (else ``ORT_DISABLE_ALL``).
        runtime: ``onnxruntime`` or ``ncnn int8``.
        batches: batches compared.
        unmatched: Q inputs with no simulated value (not compared).
    """

    def __init__(self, records: list[TensorMismatch], *, mode: str, optimize: bool, batches: int,
                 unmatched: list[str] | None = None, runtime: str = "onnxruntime") -> None:
        super().__init__(records)
        self.mode, self.optimize, self.batches, self.runtime = mode, optimize, batches, runtime
        self.unmatched = list(unmatched or [])

    def diverged(self, tolerance: float = 0.0) -> list[TensorMismatch]:
        """Tensors with less than ``1 - tolerance`` identical codes, in graph order."""
        return [r for r in self if r.identical < 1.0 - tolerance]

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
        return {"mode": self.mode, "runtime": self.runtime, "optimize": self.optimize, "batches": self.batches,
                "identical": self.identical, "first_divergence": first.name if first else None,
                "bins": list(HISTOGRAM_BINS), "tensors": [dataclasses.asdict(r) for r in self],
                "unmatched": list(self.unmatched)}

    def table(self, limit: int | None = None) -> str:
        """The table in graph order (``limit``: rows from the first divergence on, when there is one)."""
        runtime = (f"onnxruntime {'ORT_ENABLE_ALL' if self.optimize else 'ORT_DISABLE_ALL'}"
                   if self.runtime == "onnxruntime" else self.runtime)
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
        if first is None:
            lines.append(f"all {len(rows)} tensors identical")
        else:
            lines.append(f"first divergence: {first.name} ({first.op_type}): {100 * first.identical:.3f}% identical, "
                         f"max code difference {first.max_diff}; {len(self.diverged())} of {len(rows)} tensors differ")
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


def _session(model: Any, optimize: bool) -> Any:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize
                                     else ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    return ort_session(model, opts)  # models over 2 GiB: weights handed over in memory


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
    a time (:mod:`fxq.analysis.mismatch_ncnn`).

    Args:
        qmodel: the quantized ``GraphModule`` the file was exported from.
        exported_file: path of the ``.onnx`` file (or an ``onnx.ModelProto``), or of the ncnn ``.param``.
        data: batches (list, DataLoader, tensor, tuples or dicts).
        teacher_forced: feed every cut DequantizeLinear (every compared ncnn blob) with the simulation's value
            (local mismatches only).
        optimize: onnxruntime ``ORT_ENABLE_ALL`` (True) or ``ORT_DISABLE_ALL`` (ncnn: not used). Exposing the Q
            outputs keeps them as graph outputs, which can stop some of the runtime's Q/DQ fusions.
        steps: compare at most this many batches (None: all).
        collate_fn: applied to each batch first.
        example_inputs: ncnn only: the ``example_inputs`` the file was exported with (FP32 islands follow them).

    Returns:
        :class:`MismatchReport` in graph order; ``first_divergence`` names the first differing tensor.

    Raises:
        NotSupportedError: an ONNX file without Q/DQ; FrontendError: unreadable file; ConfigError: inputs of the
        file and the model do not match (an ncnn file not exported from ``qmodel``); CalibrationError: empty data.
    """
    import onnx
    from onnx import numpy_helper

    from fxq.analysis.engine import iter_bound_batches
    from fxq.analysis.runner import GraphRunner
    from fxq.graph.data import diagnose_failure, first_batch_errors
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

    outputs = {o.name for o in g.output}
    for node, *_ , elem in cuts:
        codes = node.output[0]
        if codes not in outputs:
            g.output.append(onnx.helper.make_tensor_value_info(codes, elem, None))
        if teacher_forced:
            fed = codes + "__fxq_fed"
            for user in g.node:
                if user.op_type == "DequantizeLinear" and user.input[0] == codes:
                    user.input[0] = fed
            g.input.append(onnx.helper.make_tensor_value_info(fed, elem, None))
    try:
        sess = _session(model, optimize)
    except Exception as exc:  # noqa: BLE001  (onnxruntime's own errors: one line)
        raise FrontendError(f"onnxruntime cannot load the exported file: {one_line(exc)}") from exc

    runner = GraphRunner(qmodel)
    placeholders = [n for n in qmodel.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(graph_inputs):
        raise ConfigError(f"the exported file has inputs {graph_inputs}, the model {[p.name for p in placeholders]}")
    input_of = {}
    for p, pos_name in zip(placeholders, graph_inputs):
        info = p.meta.get("onnx")
        name = str(info["outputs"][0]) if isinstance(info, dict) and info.get("outputs") else p.name
        input_of[p] = name if name in graph_inputs else pos_name
    records = [TensorMismatch(node.input[0], producer.get(node.input[0], "Input"), fxnode.name)
               for node, fxnode, *_ in cuts]
    in_names = {i.name for i in sess.get_inputs()}
    fetch = [node.output[0] for node, *_ in cuts]
    wanted = {fxnode.name for _, fxnode, *_ in cuts}
    batches = 0
    qmodel_training = qmodel.training
    qmodel.eval()
    try:
        for inputs in iter_bound_batches(runner, data, steps, collate_fn, progress=False, desc=""):
            diagnose = functools.partial(diagnose_failure, qmodel, inputs)  # no FP32 pass ran this batch
            with first_batch_errors("mismatch analysis", batches == 0, diagnose=diagnose):
                values = simulation_values(qmodel, inputs, wanted)
            feed = {input_of[p]: inputs[p].detach().cpu().numpy() for p in placeholders}
            sim: list[np.ndarray] = []
            for (node, fxnode, fq, scale, zp, elem) in cuts:
                ref = _codes(values[fxnode.name], fq, scale, zp, elem)
                sim.append(ref)
                if teacher_forced:
                    dtype, lo, hi = _INT_TYPES[elem]
                    feed[node.output[0] + "__fxq_fed"] = np.clip(ref, lo, hi).astype(dtype)
            feed = {k: v for k, v in feed.items() if k in in_names}  # a cut may leave an input unused
            try:
                got = sess.run(fetch, feed)
            except Exception as exc:  # noqa: BLE001
                raise ConfigError(f"onnxruntime failed on batch {batches}: {one_line(exc)}") from exc
            for rec, ref, out in zip(records, sim, got):
                out = np.asarray(out).astype(np.int64)
                if out.shape != ref.shape:
                    raise ConfigError(f"tensor {rec.name!r}: runtime shape {list(out.shape)} vs simulation "
                                      f"{list(ref.shape)}")
                rec.add(out - ref)
            batches += 1
    finally:
        qmodel.train(qmodel_training)
    return MismatchReport(records, mode="teacher-forced" if teacher_forced else "free-running", optimize=optimize,
                          batches=batches, unmatched=unmatched)
