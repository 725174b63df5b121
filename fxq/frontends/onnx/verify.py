"""``load_onnx``'s self-check: one run of the converted graph against onnxruntime on a generated input.

When the outputs differ (or the converted graph fails), the file is run again in onnxruntime with every node
output exposed, and the first ONNX node (in file order) whose value differs from the matching fx node's is named.
"""
from __future__ import annotations

import logging
from typing import Any, Mapping, NamedTuple

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
               attrs: Mapping[str, dict[str, Any]] | None = None) -> _FxRun:
    """Run ``gm`` keeping every value under its ONNX tensor name.

    With ``ref`` (onnxruntime's value of every tensor) and ``attrs`` (each ONNX node's attributes, by its first
    output), a deciding node (:data:`_DECISIONS`) whose result differs from onnxruntime's but is an equally valid
    answer (:func:`_forced_decision`) continues with onnxruntime's result: the two broke a
    near-tie differently, and what follows is compared on the same choice."""
    values: dict[str, Any] = {}
    failed: list[tuple[fx.Node, Exception]] = []
    forced: list[str] = []

    class _Capture(Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            try:
                value = super().run_node(n)
            except Exception as exc:
                failed.append((n, exc))
                raise
            meta = n.meta.get("onnx") or {}
            names = meta.get("outputs") if n.op in ("call_module", "call_function") else None
            if names and ref is not None and meta.get("op_type") in _DECISIONS and "args" in meta:
                inputs = [self.env[a] if isinstance(a, fx.Node) else a for a in n.args]
                value = _forced_decision(meta, value, inputs, ref, (attrs or {}).get(names[0], {}), forced)
            if names:
                if len(names) == 1 and isinstance(value, torch.Tensor):
                    values[names[0]] = value
                elif isinstance(value, (tuple, list)) and len(value) == len(names):
                    values.update({k: v for k, v in zip(names, value) if isinstance(v, torch.Tensor)})
            return value

    result: Any = None
    with torch.no_grad():
        try:
            result = _Capture(gm).run(*args)
        except Exception:  # noqa: BLE001  (reported with the node below)
            pass
    return _FxRun(values, failed[0] if failed else None, forced, result)


class _FxRun(NamedTuple):
    values: dict[str, Any]  # by ONNX tensor name
    failed: tuple[fx.Node, Exception] | None  # the node that raised
    forced: list[str]  # deciding nodes continued with onnxruntime's result (their first output's name)
    result: Any  # what the graph returned (None when it failed)


_SELECTIONS = ("TopK", "ArgMax", "ArgMin")
_COMPARISONS = ("Greater", "Less", "GreaterOrEqual", "LessOrEqual", "Equal")
_DECISIONS = _SELECTIONS + _COMPARISONS
"""ONNX ops whose result is a decision between values: a last-bit difference of their input from onnxruntime's
(another summation order or ``exp``) may change which of two near-equal values they pick, or which side of a
threshold a value falls on."""


def _forced_decision(meta: dict[str, Any], value: Any, inputs: list[Any], ref: Mapping[str, np.ndarray],
                     attrs: dict[str, Any], forced: list[str]) -> Any:
    """onnxruntime's result of a deciding node in place of ``value`` (fxq's, on fxq's ``inputs``) when the two
    differ only by a near-tie: fxq's inputs are onnxruntime's up to float rounding (:func:`_agree_closely`), and
    fxq's result is exactly the ONNX
    op's on fxq's inputs (:func:`_onnx_selection`) or, for a comparison, differs only where onnxruntime's operands
    order the other way (:func:`_flips_at_ties`). Else ``value``."""
    outputs = [o for o in meta["outputs"] if o]
    got = list(value) if isinstance(value, (tuple, list)) else [value]
    if (len(got) != len(outputs) or any(o not in ref for o in outputs) or not inputs
            or not all(isinstance(g, torch.Tensor) for g in got)
            or all(_diff(v, ref[o]) is None for v, o in zip(got, outputs))):
        return value
    for name, x in zip(meta["args"], inputs):  # inputs onnxruntime computed too (not initializers) must agree
        if name in ref and not _agree_closely(x, ref[name]):
            return value
    if meta["op_type"] in _COMPARISONS:
        theirs = [ref[name] if name in ref else x for name, x in zip(meta["args"], inputs)]
        if not _flips_at_ties(inputs, theirs, got[0], ref[outputs[0]]):
            return value
    else:
        data = inputs[0]
        want = (_onnx_selection(meta["op_type"], attrs, data.detach().cpu().numpy(), len(got),
                                ref[outputs[0]].shape) if isinstance(data, torch.Tensor) else None)
        if want is None or any(not np.array_equal(g.detach().cpu().numpy(), w) for g, w in zip(got, want)):
            return value
    forced.append(outputs[0])
    theirs = [torch.from_numpy(np.ascontiguousarray(ref[o])).to(v.dtype) for v, o in zip(got, outputs)]
    return type(value)(theirs) if isinstance(value, (tuple, list)) else theirs[0]


_TIE_RTOL = 1e-5
"""How far (relative to the tensor's largest magnitude) a deciding node's input may be from onnxruntime's for its
decision to count as a near-tie: last-bit differences of float arithmetic, 100x tighter than the value check."""


def _agree_closely(ours: Any, theirs: np.ndarray) -> bool:
    """Whether fxq's input of a deciding node equals onnxruntime's up to float rounding: exactly for integers and
    booleans, within :data:`_TIE_RTOL` of the tensor's largest magnitude for floats."""
    if not isinstance(ours, torch.Tensor):
        return False
    a = ours.detach().cpu().numpy()
    b = np.asarray(theirs)
    if a.shape != b.shape:
        return False
    if a.dtype.kind != "f" or b.dtype.kind != "f":
        return bool(np.array_equal(a, b))
    return _close(a.astype(np.float64), b.astype(np.float64), atol=0.0, rtol=_TIE_RTOL)


def _flips_at_ties(inputs: list[Any], theirs: list[Any], got: torch.Tensor, want: np.ndarray) -> bool:
    """Whether a comparison's result ``got`` (fxq's, on its ``inputs``) differs from onnxruntime's ``want`` only
    where onnxruntime's operands (``theirs``) order the other way, or tie where fxq's do not (or the reverse): the
    difference of the inputs explains each flip."""
    if len(inputs) != 2 or len(theirs) != 2 or tuple(got.shape) != want.shape:
        return False
    try:
        ours_a, ours_b, their_a, their_b = (
            np.asarray(x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else x, dtype=np.float64)
            for x in (*inputs, *theirs))
        ours = np.broadcast_to(np.sign(ours_a - ours_b), want.shape)
        their = np.broadcast_to(np.sign(their_a - their_b), want.shape)
    except (TypeError, ValueError):
        return False
    flipped = got.detach().cpu().numpy() != want
    return bool(np.all(ours[flipped] != their[flipped]))


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
    """None when equal within tolerance, else what differs."""
    if not isinstance(ours, torch.Tensor):
        return f"fxq's value is a {type(ours).__name__}, not a tensor"
    a = ours.detach().cpu()
    a = a.to(torch.float64).numpy() if not a.dtype.is_complex else a.numpy()
    b = np.asarray(ref)
    b = b.astype(np.float64) if b.dtype.kind in "biuf" else b
    if a.shape != b.shape:
        if a.size == b.size and a.size and _close(a.reshape(-1), b.reshape(-1)):
            return None
        return f"shape {list(a.shape)} where onnxruntime gives {list(b.shape)}"
    if a.size == 0 or _close(a, b):
        return None
    err = np.abs(a - b)
    err = np.where(np.isnan(a) & np.isnan(b), 0.0, err)
    return (f"max abs diff {float(np.nanmax(np.where(np.isnan(err), np.inf, err))):.4g} "
            f"(onnxruntime's values reach {float(np.nanmax(np.abs(b))) if b.size else 0.0:.4g})")


def _close(a: np.ndarray, b: np.ndarray, atol: float = _ATOL, rtol: float = _RTOL) -> bool:
    """NaN where ``b`` has NaN, elsewhere within ``atol + rtol *`` (``b``'s largest magnitude) of ``b``."""
    scale = float(np.nanmax(np.abs(b))) if b.size and not np.all(np.isnan(b)) else 0.0
    nan_ok = np.array_equal(np.isnan(a), np.isnan(b))
    fin = ~np.isnan(b)
    return nan_ok and bool(np.all(np.abs(a[fin] - b[fin]) <= atol + rtol * scale))


def _feeds_desc(feeds: dict[str, np.ndarray]) -> str:
    return ", ".join(f"{k}: {v.dtype} {list(v.shape)}" for k, v in feeds.items())


def check_conversion(gm: fx.GraphModule, original: onnx.ModelProto, fixed: Mapping[str, list[int]],
                     source: str, verify: bool | str) -> None:
    """Run ``gm`` and onnxruntime (on ``original``, the file as read) on one generated input and compare.

    When the outputs differ, both run again with every tensor compared; a TopK / ArgMax / ArgMin that picked
    differently from onnxruntime among values equal within tolerance, or a comparison whose operands onnxruntime
    computed the other way round within tolerance, continues with onnxruntime's decision, and the outputs are
    compared on the same choices (see :func:`_fx_values`).

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
    failure: str | None = None
    try:
        with torch.no_grad():
            got = gm(*args)
        failure = _outputs_differ(got, outputs, ref)
        if failure is None:
            _LOG.debug("conversion of %r checked against onnxruntime: outputs match", source)
            return
    except Exception as exc:  # noqa: BLE001  (localized below)
        failure = f"the converted graph fails: {type(exc).__name__}: {exc}"
    message = _locate(gm, original, feeds, args, source, failure)
    if message is not None:
        raise FrontendError(message)


def _outputs_differ(got: Any, names: list[str], ref: Mapping[str, np.ndarray]) -> str | None:
    """What differs between the graph's outputs ``got`` and onnxruntime's (``ref``, by name); None if nothing."""
    got = list(got) if isinstance(got, (tuple, list)) else [got]
    bad = [(name, d) for name, value in zip(names, got) if (d := _diff(value, ref[name])) is not None]
    return f"graph output {bad[0][0]!r}: {bad[0][1]}" if bad else None


def _locate(gm: fx.GraphModule, original: onnx.ModelProto, feeds: dict[str, np.ndarray], args: list[torch.Tensor],
            source: str, failure: str) -> str | None:
    """The error message naming the first ONNX node whose value differs, or None when the graph matches
    onnxruntime once its deciding nodes take onnxruntime's decisions between near-equal values."""
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
             for node in original.graph.node if node.op_type in _DECISIONS and node.output}
    run = _fx_values(gm, args, ref, attrs)
    outputs = [o.name for o in original.graph.output]
    if run.forced and run.failed is None and all(o in ref for o in outputs):
        if _outputs_differ(run.result, outputs, ref) is None:
            _LOG.info("conversion of %r checked against onnxruntime: outputs match once %d deciding node(s) (%s) "
                      "take onnxruntime's decision between values equal within tolerance", source, len(run.forced),
                      ", ".join(run.forced[:5]))
            return None
    for node in original.graph.node:
        for name in node.output:
            if name in ref and name in run.values:
                d = _diff(run.values[name], ref[name])
                if d is not None:
                    return (head + f"first differing ONNX node {node.name or '(unnamed)'!r} ({node.op_type}), "
                            f"output {name!r}: {d}." + tail)
    if run.failed is not None:
        n, exc = run.failed
        meta = n.meta.get("onnx") or {}
        what = (f"ONNX node {meta.get('node_name') or '(unnamed)'!r} ({meta.get('op_type')})" if meta
                else f"fx node {n.name!r}")
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return head + f"{what} fails in fxq: {type(exc).__name__}: {first}." + tail
    return head + failure + "." + tail
