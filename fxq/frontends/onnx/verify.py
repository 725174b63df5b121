"""``load_onnx``'s self-check: one run of the converted graph against onnxruntime on a generated input.

When the outputs differ (or the converted graph fails), the file is run again in onnxruntime with every node
output exposed and each fx node is fed onnxruntime's inputs: the first ONNX node (in file order) whose output then
differs is named.
"""
from __future__ import annotations

import logging
from collections import ChainMap
from typing import Any, Callable, Mapping, NamedTuple

import numpy as np
import onnx
import torch
from torch import fx

from fxq.errors import FrontendError
from fxq.frontends.onnx.cleanup import infer_shapes
from fxq.frontends.onnx.shapes import source_dims
from fxq.graph.nodes import Interpreter
from fxq.onnx_data import ort_session

__all__ = ["VERIFY_AUTO_MAX_BYTES", "wants_check", "check_conversion"]

_LOG = logging.getLogger(__name__)

VERIFY_AUTO_MAX_BYTES = 256 * 2**20
"""``verify="auto"`` checks models whose weights (initializers) take at most this many bytes."""

_ATOL, _RTOL = 1e-4, 1e-3


def _weight_bytes(model: onnx.ModelProto) -> int:
    total = 0
    for t in model.graph.initializer:
        n = int(np.prod(t.dims, dtype=np.int64))
        size = onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize if t.data_type != onnx.TensorProto.STRING else 8
        total += n * size
    return total


def wants_check(model: onnx.ModelProto, verify: bool | str) -> bool:
    """Whether to check: ``True``/``False``, or ``"auto"``: onnxruntime importable and weights small enough."""
    if verify not in (True, False, "auto"):
        raise FrontendError(f"verify must be True, False or 'auto', got {verify!r}")
    if verify is False:
        return False
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        _LOG.debug("onnxruntime is not installed: the converted ONNX graph is not checked")
        return False
    if verify == "auto" and _weight_bytes(model) > VERIFY_AUTO_MAX_BYTES:
        _LOG.debug("ONNX model weights over %d bytes: conversion check skipped (verify=True runs it)",
                   VERIFY_AUTO_MAX_BYTES)
        return False
    return True


def _inputs(model: onnx.ModelProto, fixed: Mapping[str, list[int]], verify: bool | str,
            source: str) -> dict[str, np.ndarray] | None:
    """Generated inputs: random normal floats, zeros for integers, ones for booleans (seeded)."""
    rng = np.random.default_rng(0)
    types = {i.name: i.type.tensor_type.elem_type for i in model.graph.input}
    feeds: dict[str, np.ndarray] = {}
    for name, dims in source_dims(model).items():
        shape = fixed.get(name, dims)
        if not all(isinstance(d, int) and d > 0 for d in shape) or not types.get(name):
            log = _LOG.warning if verify is True else _LOG.debug
            log("conversion check of %r skipped: input %r has open dims %s; pass input_shapes={%r: [...]}",
                source, name, dims, name)
            return None
        dtype = onnx.helper.tensor_dtype_to_np_dtype(types[name])
        if dtype.kind == "f":
            feeds[name] = rng.standard_normal(shape).astype(dtype)
        elif dtype.kind == "b":
            feeds[name] = np.ones(shape, dtype=dtype)
        else:
            feeds[name] = np.zeros(shape, dtype=dtype)
    return feeds


def _ort_run(model: onnx.ModelProto, feeds: dict[str, np.ndarray], outputs: list[str]) -> dict[str, np.ndarray]:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.log_severity_level = 3
    sess = ort_session(model, opts)  # models over 2 GiB: weights handed over in memory
    return dict(zip(outputs, sess.run(outputs, feeds)))


def _with_all_outputs(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str]]:
    """A copy whose graph outputs are every node output of known element type (file order)."""
    typed = infer_shapes(model)
    types = {v.name: v.type.tensor_type.elem_type for v in list(typed.graph.value_info) + list(typed.graph.output)
             if v.type.HasField("tensor_type") and v.type.tensor_type.elem_type}
    out = onnx.ModelProto()
    out.CopyFrom(model)
    present = {o.name for o in out.graph.output}
    names: list[str] = []
    for node in out.graph.node:
        for o in node.output:
            if o and o in types and o not in present:
                out.graph.output.append(onnx.helper.make_tensor_value_info(o, types[o], None))
                present.add(o)
            if o and o in present:
                names.append(o)
    return out, names


def _fx_values(gm: fx.GraphModule, args: list[torch.Tensor], ref: Mapping[str, np.ndarray] | None = None,
               keep: Callable[[str], bool] = lambda name: True) -> _FxRun:
    """Run ``gm`` keeping every value (whose name ``keep`` takes) under its ONNX tensor name.

    With ``ref`` (onnxruntime's value of each tensor, by name) the run is teacher-forced: each node's value is
    recorded, then replaced by onnxruntime's, so every node computes on onnxruntime's own inputs and what it
    records measures that node alone, not the rounding accumulated before it."""
    values: dict[str, Any] = {}
    failed: list[tuple[fx.Node, Exception]] = []

    class _Capture(Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            try:
                value = super().run_node(n)
            except Exception as exc:
                failed.append((n, exc))
                raise
            meta = n.meta.get("onnx") or {}
            names = meta.get("outputs") if n.op in ("call_module", "call_function") else None
            if not names:
                return value
            # a multi-output node records its outputs, not the getitem that then picks one (forced already)
            if len(names) == 1 and isinstance(value, torch.Tensor):
                if keep(names[0]):
                    values.setdefault(names[0], value)
                return _theirs(value, names[0], ref)
            if isinstance(value, (tuple, list)) and len(value) == len(names):
                for k, v in zip(names, value):
                    if isinstance(v, torch.Tensor) and keep(k):
                        values.setdefault(k, v)
                return type(value)(_theirs(v, k, ref) for k, v in zip(names, value))
            return value

    result: Any = None
    with torch.no_grad():
        try:
            result = _Capture(gm).run(*args)
        except Exception:  # noqa: BLE001  (reported with the node below)
            pass
    return _FxRun(values, failed[0] if failed else None, result)


def _theirs(ours: Any, name: str, ref: Mapping[str, np.ndarray] | None) -> Any:
    """onnxruntime's value of tensor ``name`` in fxq's dtype and shape, where it has one of the same size."""
    if ref is None or name not in ref or not isinstance(ours, torch.Tensor):
        return ours
    theirs = np.asarray(ref[name])
    if theirs.size != ours.numel() or theirs.dtype.kind not in "biuf":
        return ours
    return torch.from_numpy(np.ascontiguousarray(theirs)).to(ours.dtype).reshape(ours.shape)


class _FxRun(NamedTuple):
    values: dict[str, Any]  # by ONNX tensor name
    failed: tuple[fx.Node, Exception] | None  # the node that raised
    result: Any  # what the graph returned (None when it failed)


_SELECTIONS = ("TopK", "ArgMax", "ArgMin")
_COMPARISONS = ("Greater", "Less", "GreaterOrEqual", "LessOrEqual", "Equal")
_DECISIONS = _SELECTIONS + _COMPARISONS
"""ONNX ops whose result is a decision between values: a last-bit difference of their input from onnxruntime's
(another summation order or ``exp``) may change which of two near-equal values they pick, or which side of a
threshold a value falls on."""

_ROUNDING_RTOL = 1e-5
"""How far (relative to the tensor's largest magnitude) a node fed onnxruntime's own inputs may be from
onnxruntime's output and still count as float rounding (another summation order, another ``exp``): 100x tighter
than the value check. Where the graph's outputs differ, every node must meet it, or be as close to the exact answer
as onnxruntime is (:func:`_as_exact_as_onnxruntime`), for the difference to be taken as rounding accumulated over
the graph rather than a small conversion bug."""


def _node_error(node: onnx.NodeProto, forced: _FxRun, ref: Mapping[str, np.ndarray],
                attrs: dict[str, Any]) -> str | None:
    """What differs between ``node``'s outputs in the teacher-forced run and onnxruntime's (the value check), or
    None. A TopK / ArgMax / ArgMin that picks exactly what the ONNX spec picks on its input is right whatever order
    onnxruntime gave exact ties."""
    names = [o for o in node.output if o in ref and o in forced.values]
    bad = [(o, d) for o in names if (d := _diff(forced.values[o], ref[o])) is not None]
    if not bad:
        return None
    if node.op_type in _SELECTIONS and node.input and names == [o for o in node.output if o]:
        data = ref.get(node.input[0], forced.values.get(node.input[0]))
        data = data.detach().cpu().numpy() if isinstance(data, torch.Tensor) else data
        want = (_onnx_selection(node.op_type, attrs, np.asarray(data), len(names), np.asarray(ref[names[0]]).shape)
                if data is not None else None)
        if want is not None and len(want) == len(names) and all(
                np.array_equal(forced.values[o].detach().cpu().numpy(), w) for o, w in zip(names, want)):
            return None
    name, d = bad[0]
    return f"output {name!r}: {d}"


def _relative_error(ours: Any, theirs: Any) -> float:
    """How far float ``ours`` is from ``theirs``, relative to the latter's largest magnitude (0 for non-floats;
    non-finite values left out)."""
    a, b = _as_torch(ours), _as_torch(theirs)
    if a is None or b is None or not (_floats(ours) and _floats(theirs)) or a.numel() != b.numel() or not a.numel():
        return 0.0
    a, b = a.reshape(-1), b.reshape(-1)
    err = float((a - b).abs().max())
    if not np.isfinite(err):  # rare: leave the non-finite values out
        fin = torch.isfinite(a) & torch.isfinite(b)
        a, b = a[fin], b[fin]
        err = float((a - b).abs().max()) if a.numel() else 0.0
    scale = _largest_magnitude(b)
    return err / scale if scale else (0.0 if err == 0.0 else float("inf"))


def _largest_magnitude(t: torch.Tensor) -> float:
    if not t.numel():
        return 0.0
    low, high = torch.aminmax(t)
    return max(abs(float(low)), abs(float(high)))


def _floats(v: Any) -> bool:
    return v.is_floating_point() if isinstance(v, torch.Tensor) else np.asarray(v).dtype.kind == "f"


def _as_torch(v: Any) -> torch.Tensor | None:
    """``v`` (tensor or array) as a real CPU tensor, integers and booleans as float64; None for other kinds."""
    if isinstance(v, torch.Tensor):
        t = v.detach().cpu()
    else:
        arr = np.asarray(v)
        if arr.dtype.kind not in "biuf":
            return None
        t = torch.from_numpy(np.ascontiguousarray(arr))
    if t.is_complex():
        return None
    return t if t.is_floating_point() else t.to(torch.float64)


_AS_EXACT_FACTOR = 8.0
"""How many times further than onnxruntime's from the exact answer fxq's output of a node may be and still be the
same function rounded another way (:func:`_as_exact_as_onnxruntime`)."""


def _as_exact_as_onnxruntime(node: onnx.NodeProto, model: onnx.ModelProto, forced: _FxRun,
                             ref: Mapping[str, np.ndarray]) -> bool:
    """Whether fxq's output of ``node`` on onnxruntime's inputs is about as close to the exact answer as
    onnxruntime's: the two are float32 roundings of the same function (a Resize's coordinates carry ~n * eps),
    not two functions. The exact answer is the ONNX reference implementation (``onnx.reference``) run in float64 on
    the same inputs; False where it cannot run the node."""
    from onnx.reference import ReferenceEvaluator

    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
        return False
    initializers = {t.name: t for t in model.graph.initializer}
    feeds: dict[str, np.ndarray] = {}
    for name in (i for i in node.input if i):
        value = ref.get(name)
        if value is None and name in initializers:
            value = onnx.numpy_helper.to_array(initializers[name])
        if value is None:
            return False
        value = np.asarray(value)
        feeds[name] = value.astype(np.float64) if value.dtype.kind == "f" else value
    outputs = [o for o in node.output if o]
    graph = onnx.helper.make_graph(
        [node], "node",
        [onnx.helper.make_tensor_value_info(k, onnx.helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
         for k, v in feeds.items()],
        [onnx.helper.make_tensor_value_info(o, onnx.TensorProto.UNDEFINED, None) for o in outputs])
    single = onnx.helper.make_model(graph, opset_imports=list(model.opset_import))
    try:
        exact = ReferenceEvaluator(single).run(None, feeds)
    except Exception as exc:  # noqa: BLE001  (no exact answer: the node is not excused)
        _LOG.debug("onnx.reference cannot run ONNX node %r (%s): %s", node.name, node.op_type, exc)
        return False
    for name, want in zip(outputs, exact):
        if name not in ref or name not in forced.values:
            continue
        ours, theirs = _relative_error(forced.values[name], want), _relative_error(ref[name], want)
        if ours > max(_ROUNDING_RTOL, _AS_EXACT_FACTOR * theirs):
            return False
        _LOG.debug("ONNX node %r (%s), output %r: fxq's is %.2g and onnxruntime's %.2g from the exact answer "
                   "(relative): the same function rounded another way", node.name, node.op_type, name, ours, theirs)
    return True


def _onnx_selection(op_type: str, attrs: dict[str, Any], data: np.ndarray, n_outputs: int,
                    shape: tuple[int, ...]) -> list[np.ndarray] | None:
    """The ONNX op's result on ``data`` by its spec, in numpy: TopK's values and indices (equal values in index
    order; ``k`` read off ``shape``, that of onnxruntime's first output), ArgMax / ArgMin's indices (the first or,
    with ``select_last_index``, the last extreme). None where the spec leaves the order free (``sorted=0``)."""
    axis = int(attrs.get("axis", -1 if op_type == "TopK" else 0)) % max(data.ndim, 1)
    if op_type == "TopK":
        if not int(attrs.get("sorted", 1)) or n_outputs != 2:
            return None
        k = shape[axis] if len(shape) == data.ndim else -1
        if not 0 <= k <= data.shape[axis]:
            return None
        key = -data if int(attrs.get("largest", 1)) else data
        indices = np.take(np.argsort(key, axis=axis, kind="stable"), np.arange(k), axis=axis)
        return [np.take_along_axis(data, indices, axis), indices.astype(np.int64)]
    pick = np.argmax if op_type == "ArgMax" else np.argmin
    if int(attrs.get("select_last_index", 0)):
        flipped = pick(np.flip(data, axis), axis=axis)
        indices = data.shape[axis] - 1 - flipped
    else:
        indices = pick(data, axis=axis)
    if int(attrs.get("keepdims", 1)):
        indices = np.expand_dims(indices, axis)
    return [indices.astype(np.int64)]


def _diff(ours: Any, ref: np.ndarray) -> str | None:
    """None when equal (floats within tolerance; integers and booleans, indices and counts, exactly), else what
    differs."""
    if not isinstance(ours, torch.Tensor):
        return f"fxq's value is a {type(ours).__name__}, not a tensor"
    a, b = _as_torch(ours), _as_torch(ref)
    if a is None or b is None:  # complex or another kind: compared exactly
        x, y = ours.detach().cpu().numpy(), np.asarray(ref)
        return None if x.shape == y.shape and np.array_equal(x, y) else "values differ"
    if a.shape != b.shape:
        if a.numel() == b.numel() and a.numel() and _diff(ours.reshape(-1), np.asarray(ref).reshape(-1)) is None:
            return None
        return f"shape {list(a.shape)} where onnxruntime gives {list(b.shape)}"
    exact = not (_floats(ours) or _floats(ref))
    if a.numel() == 0 or (torch.equal(a, b) if exact else _close(a, b)):
        return None
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))
    err = (a.double() - b.double()).abs()
    err = torch.where(same, 0.0, torch.where(torch.isnan(err), float("inf"), err))
    reach = float(torch.where(torch.isfinite(b), b.double().abs(), 0.0).max())
    return f"max abs diff {float(err.max()):.4g} (onnxruntime's values reach {reach:.4g})"


def _close(a: torch.Tensor, b: torch.Tensor, atol: float = _ATOL, rtol: float = _RTOL) -> bool:
    """NaN and infinities where ``b`` has them, elsewhere within ``atol + rtol *`` (``b``'s largest finite
    magnitude) of ``b``."""
    err = float((a - b).abs().max())
    if np.isfinite(err):  # no NaN or infinity on either side: one pass each
        return err <= atol + rtol * _largest_magnitude(b)
    finite = torch.isfinite(b)
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))
    if not bool(torch.where(finite, True, same).all()):  # a NaN or an infinity of one side only
        return False
    scale = float(torch.where(finite, b.abs(), 0).max())
    return bool(torch.where(finite, (a - b).abs() <= atol + rtol * scale, True).all())


def _feeds_desc(feeds: dict[str, np.ndarray]) -> str:
    return ", ".join(f"{k}: {v.dtype} {list(v.shape)}" for k, v in feeds.items())


def check_conversion(gm: fx.GraphModule, original: onnx.ModelProto, fixed: Mapping[str, list[int]],
                     source: str, verify: bool | str) -> None:
    """Run ``gm`` and onnxruntime (on ``original``, the file as read) on one generated input and compare.

    When the outputs differ, every node is compared with onnxruntime's on onnxruntime's own inputs
    (:func:`_locate`): a wrong node is named; a graph right node by node whose outputs differ by accumulated float
    rounding (a detector's TopK or score threshold breaking a near-tie the other way) passes.

    Raises:
        FrontendError: the converted graph fails or differs; names the first differing ONNX node, its op type and
            the max abs diff.
    """
    feeds = _inputs(original, fixed, verify, source)
    if feeds is None:
        return
    outputs = [o.name for o in original.graph.output]
    try:
        ref = _ort_run(original, feeds, outputs)
    except Exception as exc:  # noqa: BLE001  (no reference to check against: not the model's fault)
        _LOG.info("conversion check of %r skipped: onnxruntime cannot run the file (%s)", source, exc)
        return
    args = [torch.from_numpy(feeds[name]) for name in gm.meta["onnx"]["inputs"]]
    deciding = {o for node in original.graph.node if node.op_type in _DECISIONS for o in node.output}
    own = _fx_values(gm, args, keep=deciding.__contains__)  # fxq's own run; the deciding nodes' values kept
    if own.failed is not None:
        _, exc = own.failed
        failure = f"the converted graph fails: {type(exc).__name__}: {exc}"
    else:
        failure = _outputs_differ(own.result, outputs, ref)
        if failure is None:
            _LOG.debug("conversion of %r checked against onnxruntime: outputs match", source)
            return
    message = _locate(gm, original, feeds, args, source, failure, own)
    if message is not None:
        raise FrontendError(message)


def _outputs_differ(got: Any, names: list[str], ref: Mapping[str, np.ndarray]) -> str | None:
    """What differs between the graph's outputs ``got`` and onnxruntime's (``ref``, by name); None if nothing."""
    got = list(got) if isinstance(got, (tuple, list)) else [got]
    bad = [(name, d) for name, value in zip(names, got) if (d := _diff(value, ref[name])) is not None]
    return f"graph output {bad[0][0]!r}: {bad[0][1]}" if bad else None


def _locate(gm: fx.GraphModule, original: onnx.ModelProto, feeds: dict[str, np.ndarray], args: list[torch.Tensor],
            source: str, failure: str, own: _FxRun) -> str | None:
    """The error message naming the ONNX node the difference comes from (``own``: fxq's own run, which failed or
    gave ``failure``), or None when the conversion is right node by node and the outputs differ only by float rounding accumulated over the graph (and the near-tie decisions it
    flips: a detector's TopK, a score threshold).

    Every node is judged on onnxruntime's own inputs (a teacher-forced run, :func:`_fx_values`): the first whose
    output differs is the one converted wrongly. Where all agree, each must also agree to float rounding
    (:data:`_ROUNDING_RTOL`), else the first that does not is taken for a small conversion bug that the
    graph amplified."""
    head = (f"load_onnx checked its conversion of ONNX model {source!r} against onnxruntime on a generated input "
            f"({_feeds_desc(feeds)}) and the converted graph differs: ")
    tail = (" This is a conversion bug in fxq (or onnx2torch), not a problem of your model or data: please report "
            "it with the model; load_onnx(..., verify=False) skips this check.")
    try:
        exposed, names = _with_all_outputs(original)
        ref = _ort_run(exposed, feeds, names)
    except Exception as exc:  # noqa: BLE001  (cannot localize: report what we know)
        _LOG.debug("could not expose intermediate outputs in onnxruntime: %s", exc)
        ref = {}
    attrs = {node.output[0]: {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
             for node in original.graph.node if node.op_type in _SELECTIONS and node.output}
    forced = _fx_values(gm, args, ref)
    known = ChainMap(ref, feeds)  # every tensor's onnxruntime value, graph inputs included
    nodes = list(original.graph.node)
    for node in nodes:
        d = _node_error(node, forced, known, attrs.get(node.output[0], {}) if node.output else {})
        if d is not None:
            return (head + f"first differing ONNX node {node.name or '(unnamed)'!r} ({node.op_type}), fed "
                    f"onnxruntime's own inputs, {d}." + tail)
    for run in (forced, own):
        if run.failed is not None:
            return head + _failing_node(*run.failed) + tail
    outputs = [o.name for o in original.graph.output]
    if not ref or not all(o in ref for o in outputs):
        return head + failure + "." + tail
    wiring = _outputs_differ(forced.result, outputs, ref)  # on onnxruntime's values, only wiring can differ
    if wiring is not None:
        return (head + f"the graph returns other tensors than the file's outputs ({wiring}, every node fed "
                "onnxruntime's own values)." + tail)
    for node in nodes:
        excess = max((_relative_error(forced.values[o], ref[o]) for o in node.output
                      if o in ref and o in forced.values), default=0.0)
        if excess > _ROUNDING_RTOL and not _as_exact_as_onnxruntime(node, original, forced, known):
            return (head + f"{failure}. Fed onnxruntime's own inputs, ONNX node {node.name or '(unnamed)'!r} "
                    f"({node.op_type}) is off by {excess:.2g} of its output's largest magnitude: within the value "
                    f"check's tolerance, but more than float rounding ({_ROUNDING_RTOL:g}), and the graph "
                    "amplifies it." + tail)
    flipped = [node.name or node.output[0] for node in nodes if node.op_type in _DECISIONS and any(
        o in ref and o in own.values and _diff(own.values[o], ref[o]) is not None for o in node.output)]
    if flipped:
        _LOG.info("conversion of %r checked against onnxruntime node by node: every node, fed onnxruntime's own "
                  "inputs, agrees to float rounding; the outputs differ (%s) by rounding accumulated over the graph, "
                  "which breaks near-ties of %d deciding node(s) the other way (%s)", source, failure, len(flipped),
                  ", ".join(flipped[:5]))
    else:
        _LOG.warning("conversion of %r checked against onnxruntime node by node: every node, fed onnxruntime's own "
                     "inputs, agrees to float rounding, yet the outputs differ (%s): the model amplifies float "
                     "rounding that much (another runtime's summation order moves its outputs as far)", source,
                     failure)
    return None


def _failing_node(n: fx.Node, exc: Exception) -> str:
    meta = n.meta.get("onnx") or {}
    what = (f"ONNX node {meta.get('node_name') or '(unnamed)'!r} ({meta.get('op_type')})" if meta
            else f"fx node {n.name!r}")
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{what} fails in fxq: {type(exc).__name__}: {first}."
