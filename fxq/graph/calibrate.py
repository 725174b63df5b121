"""Calibration: weights from their values, activations from data (at most two passes)."""
from __future__ import annotations

import functools
import logging
from typing import Any, Callable

import torch
from torch import fx
from tqdm.auto import tqdm

from fxq.errors import CalibrationError, ConfigError, ObserverError
from fxq.functional import representable_range
from fxq.graph.convert import apply_alignment, bake_parameters, derive_passive_parameters, unbake_parameters
from fxq.graph.data import (
    call_model,
    check_steps,
    count_batches,
    diagnose_batch,
    first_batch_errors,
    iter_batches,
)
from fxq.graph.info import NodeQuant, graph_quant, is_quantizer_node
from fxq.graph.nodes import get_attr_value, without_grad_first
from fxq.graph.op_types import op_type, output_bounded, output_lower_bound
from fxq.graph.quant_graph import AlignGroup, QuantGraph, drop_alignment, record_alignment
from fxq.nn.fake_quantize import FakeQuantize
from fxq.spec import MIN_SCALE, QuantState

__all__ = ["calibrate", "calibrate_parameters", "protect_mixed_range", "MIXED_RANGE_RATIO", "MIXED_RANGE_KEY"]

logger = logging.getLogger(__name__)

MIXED_RANGE_RATIO = 64.0
"""Default ``setting.fusion_setting.mixed_range_concat_ratio``: the widest over the narrowest input range of a
concat above which one shared grid destroys the narrow input. An 8-bit grid has 127 steps per sign; an input 64x
narrower than the widest keeps at most 127 / 64 < 2 of them (under 2 bits), so its values round to 0 or one step
(YOLO heads: 0-1 class scores concatenated with 0-640 boxes lose every score)."""

MIXED_RANGE_KEY = "fxq_mixed_range"
"""``node.meta`` key of a concat found mixed-range: plain values (ratio, input ranges, what was done)."""

JOINING_OPS = frozenset({"Concat"})  # torch.cat / torch.concat / torch.stack and ONNX Concat


@torch.no_grad()
def calibrate_parameters(gm: fx.GraphModule) -> None:
    """Compute the parameters of every weight quantizer straight from the weight values."""
    unbake_parameters(gm)
    for _, fq in QuantGraph(gm).quantizers("weight"):
        if fq.param is None or fq.config.state is QuantState.FP32:
            continue
        fq.set_mode("observe")
        fq.observer.reset()
        fq(get_attr_value(gm, fq.param).detach())
        fq.compute_qparams()
        fq.set_mode("quantize")


@torch.no_grad()
def _compute_qparams(name: str, fq: FakeQuantize, quant_graph: QuantGraph) -> None:
    """``fq.compute_qparams()``; a range no grid can hold (NaN, infinities, float32's limit) is refused naming the
    quantizer and the nodes reading it, with the setting that keeps them FP32: such values are mostly sentinels
    (an additive attention mask of ``-inf`` / ``finfo.min`` fxq did not recognise), not bad data."""
    try:
        fq.compute_qparams()
    except (ConfigError, ObserverError) as exc:
        readers = quant_graph.consumers(name) or ["<node>"]
        table = "{" + ", ".join(f"{r!r}: 'fp32'" for r in readers) + "}"
        raise CalibrationError(
            f"quantizer {name!r} (read by {readers}) cannot be calibrated: {exc}. A tensor of NaN, infinities or "
            "values near float32's limit has no int8 grid; if the calibration data is finite, the tensor holds "
            "sentinels (an additive attention mask of -inf / finfo.min is the usual one). Fix: keep the nodes "
            f"reading it in FP32: setting.dispatching_table = {table}") from exc


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
    their observers needs a histogram range first. Afterwards mixed-range concats are kept FP32
    (:func:`protect_mixed_range`), alignment and passive (bias) parameters are derived and — with ``bake`` —
    weights are replaced by their quantized values.

    Raises:
        ConfigError: ``steps`` is not None or a positive int.
        CalibrationError: empty data, wrong input count or shape (naming the input), a later batch with another
            input rank or dtype than the first (naming the batch), or one with other sizes that the model fails on.
        GraphError: the first batch fails in the calibrating model but the FP32 model runs it (fxq's failure,
            naming the node).
    """
    check_steps(steps)
    graph_quant(model)
    _undo_protection(model)
    was_training = model.training
    model.eval()
    calibrate_parameters(model)
    if bake:
        bake_parameters(model)
    observing: dict[str, FakeQuantize] = {}
    quant_graph = QuantGraph(model)
    modules = dict(model.named_modules())
    for name, fq in quant_graph.quantizers():
        if fq.role == "bias":
            fq.set_mode("disabled")
        elif fq.role == "activation" or fq.param is None:
            if fq.config.state is QuantState.FP32:
                fq.set_mode("disabled")
                continue
            fq.set_mode("observe")
            fq.observer.reset()
            fq.observer.nonnegative = _nonnegative_input(quant_graph, name, modules)
            fq.observer.bounded = _bounded_input(quant_graph, name, modules)
            fq.observer.keeps_max = _read_for_its_peaks(quant_graph, name, modules)
            observing[name] = fq
    passes = max((fq.observer.passes for fq in observing.values()), default=1)
    total = count_batches(data, steps)
    seen = 0
    grad = False  # no autograd record (observing needs none), unless the model's forward needs gradients
    for p in range(passes):
        for fq in observing.values():
            fq.set_mode("observe" if fq.observer.passes > p else "disabled")
        desc = "calibrate" if passes == 1 else f"calibrate (pass {p + 1}/{passes})"
        seen = 0
        for batch in tqdm(iter_batches(data, steps, collate_fn), total=total, desc=desc, disable=not progress,
                          leave=False):
            # the calibrating model is fxq's rewrite: a batch the FP32 model runs does not fail for the data
            diagnose = functools.partial(diagnose_batch, model, batch)
            run = functools.partial(call_model, model, batch, check=(seen == 0))
            with first_batch_errors("calibration", seen == 0, diagnose=diagnose):
                if seen or p:  # the first batch decided the grad mode
                    with torch.set_grad_enabled(grad):
                        run()
                else:  # a record would keep every saved tensor and clone each in-place activation's input
                    _, grad = without_grad_first(run, before_retry=functools.partial(_reset_observers, observing))
            seen += 1
        if seen == 0:
            raise CalibrationError("calibration data is empty: give at least one batch")
        for fq in observing.values():
            if fq.observer.passes > p + 1:
                fq.observer.next_pass()
    for name, fq in observing.items():
        _compute_qparams(name, fq, quant_graph)
        fq.set_mode("quantize")
    protect_mixed_range(model)
    apply_alignment(model)  # and the softmax output scales a fused runtime kernel needs (snap_softmax_scales)
    derive_passive_parameters(model)
    for _, fq in QuantGraph(model).quantizers():
        fq.set_mode("quantize")
    if bake:
        bake_parameters(model)
    model.train(was_training)
    logger.info("calibrated %d activation quantizers on %d batches x %d pass(es)", len(observing), seen, passes)
    return model


def _reset_observers(observing: dict[str, FakeQuantize]) -> None:
    """Forget what the observers saw (a batch observed again from the start)."""
    for fq in observing.values():
        fq.observer.reset()


def _observed_op(quant_graph: QuantGraph, name: str) -> fx.Node | None:
    """The op whose output quantizer ``name`` observes."""
    node = quant_graph.node_of(name)
    source = node.args[0] if node is not None and node.args else None
    return source if isinstance(source, fx.Node) else None


def _nonnegative_input(quant_graph: QuantGraph, name: str, modules: dict[str, torch.nn.Module]) -> bool:
    """Whether the op whose output quantizer ``name`` observes cannot output a negative value."""
    source = _observed_op(quant_graph, name)
    low = output_lower_bound(source, modules) if source is not None else None
    return low is not None and low >= 0


def _bounded_input(quant_graph: QuantGraph, name: str, modules: dict[str, torch.nn.Module]) -> bool:
    """Whether the op whose output quantizer ``name`` observes bounds its output at both ends."""
    source = _observed_op(quant_graph, name)
    return source is not None and output_bounded(source, modules)


_LAYOUT_OPS = frozenset({"Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze", "Identity"})


_PEAK_READERS = frozenset({"Softmax", "LogSoftmax", "ArgMax", "ReduceMax"})
"""Ops decided by the largest values of their input: a class's logit, an attended key's score."""


def _read_for_its_peaks(quant_graph: QuantGraph, name: str, modules: dict[str, torch.nn.Module]) -> bool:
    """Whether the tensor quantizer ``name`` outputs is read only by softmaxes, argmaxes or maxes (or returned),
    through layout ops: keeping its maximum then costs no other reader resolution."""
    node = quant_graph.node_of(name)
    stack, seen, found = (list(node.users) if node is not None else []), set(), False
    while stack:
        user = stack.pop()
        if user in seen:
            continue
        seen.add(user)
        t = op_type(user, modules)
        if t in _PEAK_READERS:
            found = True
        elif t in _LAYOUT_OPS or is_quantizer_node(user):
            stack.extend(user.users)
        elif user.op != "output":
            return False
    return found


def _ratio_setting(gm: fx.GraphModule) -> float | None:
    setting = gm.meta.get("fxq_setting")
    fusion = setting.get("fusion_setting") if isinstance(setting, dict) else None
    if isinstance(fusion, dict) and "mixed_range_concat_ratio" in fusion:
        value = fusion["mixed_range_concat_ratio"]
        return None if value is None else float(value)
    return MIXED_RANGE_RATIO


def _undo_protection(gm: fx.GraphModule) -> None:
    """Give protected concats back their output quantizer and alignment, so a new calibration decides anew."""
    graph_quant(gm)  # a model fxq did not prepare: its error
    qs = QuantGraph(gm)
    for node in gm.graph.nodes:
        record = node.meta.pop(MIXED_RANGE_KEY, None)
        if not isinstance(record, dict) or record.get("action") != "fp32":
            continue
        nq = node.meta.get("fxq")
        if isinstance(nq, NodeQuant) and record.get("platform"):
            nq.platform, nq.output_state = record["platform"], QuantState[record["output_state"]]
        out = record.get("output_quantizer")
        if out in qs and qs[out].config.state is QuantState.FP32:
            qs[out].config.state = QuantState.ACTIVATED if qs[out].config.has_qparams else QuantState.INITIAL
        if record.get("align_output"):
            ins, target = record["align_output"]
            record_alignment(qs, AlignGroup("output", tuple(ins), target))
        if record.get("align_large"):
            record_alignment(qs, AlignGroup("largest", tuple(record["align_large"])))


def _grid(fq: FakeQuantize) -> tuple[float, float] | None:
    """Representable ``(lo, hi)`` of a calibrated per-tensor quantizer; None when it has none or saw only 0."""
    cfg = fq.config
    if not cfg.is_quantizing or not cfg.has_qparams or cfg.per_channel or fq.scale.numel() != 1:
        return None
    if float(fq.scale.detach().reshape(-1)[0]) <= MIN_SCALE * 1.5:
        return None  # an all-zero input is exact on every grid
    lo, hi = representable_range(cfg, fq.scale, fq.offset)
    return float(lo[0]), float(hi[0])


def _fmt(v: float) -> str:
    return f"{v:.4g}"


@torch.no_grad()
def protect_mixed_range(gm: fx.GraphModule, ratio: float | None | str = "setting") -> list[dict[str, Any]]:
    """Keep concats whose inputs' ranges differ more than ``ratio`` (default: the setting's
    ``fusion_setting.mixed_range_concat_ratio``) out of one shared grid.

    Run after the activation quantizers have parameters and before :func:`apply_alignment`. A flagged concat
    loses its alignment group and its output quantizer goes FP32 (the inputs keep their producers' own
    scales, the node's ``NodeQuant.platform`` becomes ``"fp32"``: exporters write the concat in float) — unless a quantized op other than a passive op or another
    flagged concat reads that output, where it is only reported. Each flagged node gets a plain-valued record in
    ``node.meta[MIXED_RANGE_KEY]`` and a WARNING is logged. Returns the records.
    """
    threshold = _ratio_setting(gm) if ratio == "setting" else ratio
    if threshold is None:
        return []
    graph_quant(gm)  # a model fxq did not prepare: its error
    qs = QuantGraph(gm)
    groups = qs.alignment_groups()
    nodes = [n for n in gm.graph.nodes if isinstance(n.meta.get("fxq"), NodeQuant)]
    flagged: dict[fx.Node, dict[str, Any]] = {}
    groups_of: dict[fx.Node, list[AlignGroup]] = {}  # a flagged node's alignment groups, dropped if it is protected
    parts_of: dict[str, list[tuple[str, float, float]]] = {}  # output quantizer of a flagged concat -> its parts
    for node in nodes:
        nq: NodeQuant = node.meta["fxq"]
        if not nq.quantized or nq.op_type not in JOINING_OPS:
            continue
        ins = [q for q in nq.inputs.values() if q is not None and qs.role(q) == "activation"]
        ins = list(dict.fromkeys(ins))
        own_out = (nq.output in qs and nq.output_state in (QuantState.ACTIVATED, QuantState.OVERLAPPED)
                   and qs[nq.output].config.is_quantizing)
        group_out = next((g for g in groups if g.kind == "output" and g.target == nq.output), None) if own_out \
            else None
        group_large = next((g for g in groups if g.kind == "largest" and list(g.members) == ins), None)
        if not own_out and group_large is None:
            continue  # nothing puts the inputs on one grid
        parts: list[tuple[str, float, float]] = []
        for name, q in nq.inputs.items():
            if q is None or q not in ins:
                continue
            if q in parts_of:
                parts += [(f"{name}/{label}", lo, hi) for label, lo, hi in parts_of[q]]
            elif (grid := _grid(qs[q])) is not None:
                parts.append((name, *grid))
        parts = list(dict.fromkeys(parts))
        if len(parts) < 2:
            continue
        widths = [hi - lo for _, lo, hi in parts]
        found = max(widths) / min(widths)
        if found <= threshold:
            continue
        cfg = qs[nq.output if own_out else ins[0]].config
        span = int(cfg.quant_max - cfg.quant_min)
        flagged[node] = {
            "op_type": nq.op_type, "ratio": found, "threshold": float(threshold),
            "steps_left": [round(span / found, 2), span],
            "inputs": [[label, lo, hi] for label, lo, hi in parts],
            "output_quantizer": nq.output if own_out else None,
            "align_output": [list(group_out.members), group_out.target] if group_out is not None else None,
            "align_large": list(group_large.members) if group_large is not None else None,
        }
        groups_of[node] = [g for g in (group_out, group_large) if g is not None]
        if own_out:
            parts_of[nq.output] = parts
    # decide from the last node back: a flagged concat read by a flagged concat follows that one's decision
    protect: dict[fx.Node, bool] = {}
    for node in reversed(list(flagged)):
        out = flagged[node]["output_quantizer"]
        blockers = []
        for user in nodes:
            unq: NodeQuant = user.meta["fxq"]
            if user is node or out is None or not unq.quantized or out not in unq.inputs.values():
                continue
            if unq.output == out and unq.output_state is QuantState.PASSIVE:
                continue  # a view of the concat's output: FP32 with it
            if user in flagged and protect.get(user, False):
                continue
            blockers.append(user)
        protect[node] = not blockers
        flagged[node]["blocked_by"] = [b.name for b in blockers]
    records = []
    for node, record in flagged.items():
        span = record["steps_left"][1]
        ranges = ", ".join(f"{label} [{_fmt(lo)}, {_fmt(hi)}]" for label, lo, hi in record["inputs"])
        what = (f"{record['op_type']} {node.name!r} joins inputs whose ranges differ {record['ratio']:.0f}x (> "
                f"{threshold:g}, setting.fusion_setting.mixed_range_concat_ratio): {ranges}; one shared grid "
                f"would leave the narrowest {record['steps_left'][0]:g} of its {span} steps")
        if protect[node]:
            record["action"] = "fp32"
            record["reason"] = (f"kept FP32: input ranges differ {record['ratio']:.0f}x; the inputs keep their "
                                f"own scales")
            if record["output_quantizer"] is not None:
                qs[record["output_quantizer"]].config.state = QuantState.FP32
            nq = node.meta["fxq"]
            record["platform"], record["output_state"] = nq.platform, nq.output_state.name
            nq.platform, nq.output_state = "fp32", QuantState.FP32  # exporters write a float node
            for group in groups_of[node]:
                drop_alignment(qs, group)
            logger.warning("%s; kept in FP32: its output quantizer %s is off and its inputs keep their own "
                           "scales (the exporters write it in float)", what, record["output_quantizer"])
        else:
            record["action"] = "warned"
            record["reason"] = (f"left quantized: input ranges differ {record['ratio']:.0f}x but quantized "
                                f"{', '.join(record['blocked_by'])} read(s) its output on one grid")
            logger.warning("%s; left quantized because quantized op(s) %s read its output on one grid: keep "
                           "them in FP32 with setting.dispatching_table or split the output", what,
                           ", ".join(record["blocked_by"]))
        node.meta[MIXED_RANGE_KEY] = {"node": node.name, **record}
        records.append(node.meta[MIXED_RANGE_KEY])
    return records
