"""FP16 for the unquantized part of a Q/DQ ONNX model (TensorRT strongly-typed builds), and its simulation.

:func:`cast_float_parts` rewrites a finished Q/DQ model (opset >= 19) so that every float tensor is float16:

* float initializers and ``Constant`` values (weights of FP32-dispatched ops, biases, constants) become
  float16; Q/DQ scales become float16, so DequantizeLinear outputs float16 and QuantizeLinear takes float16;
* a float weight in front of a QuantizeLinear (``weights="qdq"``) is written so that its int8 codes are those
  of the FP32 export (checked; raises otherwise);
* ``Cast(to=FLOAT)`` becomes ``Cast(to=FLOAT16)``, ``ConstantOfShape`` float values become float16;
* a Resize ``scales`` input stays float32 (ONNX requires it);
* graph inputs and outputs stay float32: a ``Cast`` to float16 follows each float input, a ``Cast`` back to
  float32 produces each float output.

:func:`fp16_simulation` is the matching PyTorch simulation: inside the context, the quantized GraphModule
rounds every float parameter / buffer (quantizer scales included) to float16 and rounds every node's float
output to float16. Arithmetic inside each op stays float32 (what TensorRT's FP16 kernels do with their FP32
accumulators, up to accumulation order), so this compares storage precision, not FP16 arithmetic.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator

import numpy as np
import torch
from torch import fx

from fxq.backends.qdq.onnx_graph import rename_tensors, subgraphs
from fxq.errors import ExportError
from fxq.graph.nodes import Interpreter

__all__ = ["HIGH_PRECISION_DTYPES", "cast_float_parts", "fp16_simulation"]

logger = logging.getLogger(__name__)

HIGH_PRECISION_DTYPES = ("fp32", "fp16")
"""Values of the TensorRT exporter's ``high_precision_dtype`` option."""

_Q, _DQ = "QuantizeLinear", "DequantizeLinear"
_FP16_TINY = float(np.finfo(np.float16).tiny)  # smallest normal float16


def _fp16(values: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return values.astype(np.float16)


def _check_scale(name: str, s32: np.ndarray, s16: np.ndarray) -> None:
    if s16.size == 0 or not bool(np.all(np.isfinite(s16))) or not bool(np.all(s16 > 0)):
        bad = s32.ravel()[(~np.isfinite(s16) | (s16 <= 0)).ravel()][:4].tolist()
        raise ExportError(f"high_precision_dtype='fp16': Q/DQ scale {name!r} has values {bad} that float16 cannot "
                          f"hold (it underflows to 0 or overflows); export with high_precision_dtype='fp32'")
    if bool(np.any(s16 < _FP16_TINY)):
        logger.warning("high_precision_dtype='fp16': Q/DQ scale %r is below float16's normal range (min %.3g); "
                       "it is stored as a subnormal with reduced precision", name, float(s32.min()))


def _weight_codes(w: np.ndarray, s: np.ndarray, axis: int, zp: np.ndarray) -> np.ndarray:
    s = s.astype(np.float32)
    if s.ndim > 0 and w.ndim > 0:
        shape = [1] * w.ndim
        shape[axis % w.ndim] = -1
        s = s.reshape(shape)
    info = np.iinfo(zp.dtype) if np.issubdtype(zp.dtype, np.integer) else None
    codes = np.rint(w.astype(np.float32) / s)
    return np.clip(codes, info.min, info.max) if info is not None else codes


def cast_float_parts(model: Any) -> Any:
    """Rewrite ``model`` (a ModelProto with Q/DQ, opset >= 19) in place to float16, float32 at the boundary.

    Returns the model. Raises :class:`ExportError` where float16 cannot express it (a scale out of range,
    a weight whose codes would change, control-flow subgraphs).
    """
    from onnx import TensorProto, helper, numpy_helper

    graph = model.graph
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset < 19:
        raise ExportError(f"high_precision_dtype='fp16' needs opset >= 19 (float16 Q/DQ scales), got opset {opset}")
    for node in graph.node:
        if subgraphs(node):
            raise ExportError(f"high_precision_dtype='fp16': {node.op_type} {node.name!r} has subgraphs, which the "
                              f"FP16 rewrite does not handle; export with high_precision_dtype='fp32'")
    F32, F16 = TensorProto.FLOAT, TensorProto.FLOAT16
    inits = {t.name: t for t in graph.initializer}
    keep_f32 = {n.input[2] for n in graph.node if n.op_type == "Resize" and len(n.input) > 2 and n.input[2]}
    scales = {n.input[1] for n in graph.node if n.op_type in (_Q, _DQ) and len(n.input) > 1}
    # float weights quantized by a Q: keep their codes
    for q in (n for n in graph.node if n.op_type == _Q and n.input[0] in inits):
        w_t, s_t = inits[q.input[0]], inits.get(q.input[1])
        if w_t.data_type != F32 or s_t is None or s_t.data_type != F32:
            continue
        w, s32 = numpy_helper.to_array(w_t), numpy_helper.to_array(s_t)
        zp = numpy_helper.to_array(inits[q.input[2]]) if len(q.input) > 2 and q.input[2] in inits else np.int8(0)
        axis = next((int(a.i) for a in q.attribute if a.name == "axis"), 1)
        with np.errstate(divide="ignore", invalid="ignore"):  # a scale float16 cannot hold raises below
            codes = _weight_codes(w, s32, axis, zp)
            s16 = _fp16(s32)
            w16 = _fp16(w)
            same = np.array_equal(_weight_codes(w16, s16, axis, zp), codes)
        if not same:  # the nearest float16 of code x scale
            s_b = s16.astype(np.float32)
            if s_b.ndim > 0 and w.ndim > 0:
                s_b = s_b.reshape([-1 if i == axis % w.ndim else 1 for i in range(w.ndim)])
            w16 = _fp16(codes.astype(np.float32) * s_b)
            with np.errstate(divide="ignore", invalid="ignore"):
                same = np.array_equal(_weight_codes(w16, s16, axis, zp), codes)
            if not same and bool(np.all(s16 > 0)):
                raise ExportError(f"high_precision_dtype='fp16': weight {q.input[0]!r} changes its int8 codes in "
                                  f"float16; export with weights='dq' (int8 weight initializers)")
        w_t.CopyFrom(numpy_helper.from_array(w16, w_t.name))
    # initializers
    for t in graph.initializer:
        if t.data_type != F32 or t.name in keep_f32:
            continue
        a32 = numpy_helper.to_array(t)
        a16 = _fp16(a32)
        if t.name in scales:
            _check_scale(t.name, a32, a16)
        elif a16.size and not bool(np.all(np.isfinite(a16[np.isfinite(a32)]))):
            raise ExportError(f"high_precision_dtype='fp16': constant {t.name!r} overflows float16 "
                              f"(max |x| = {float(np.abs(a32).max()):.3g})")
        t.CopyFrom(numpy_helper.from_array(a16, t.name))
    # nodes that make float32 tensors
    for node in graph.node:
        for a in node.attribute:
            if node.op_type == "Cast" and a.name == "to" and a.i == F32:
                a.i = F16
            elif node.op_type in ("Constant", "ConstantOfShape") and a.name == "value" and a.t.data_type == F32:
                if node.output[0] in keep_f32:
                    continue
                a32 = numpy_helper.to_array(a.t)
                a16 = _fp16(a32)
                if node.output[0] in scales:
                    _check_scale(node.output[0], a32, a16)
                a.t.CopyFrom(numpy_helper.from_array(a16, a.t.name))
    # Resize scales computed in the graph: back to float32
    extra: list[tuple[int, Any]] = []
    constants = {n.output[0] for n in graph.node if n.op_type == "Constant"}
    for i, node in enumerate(graph.node):
        if (node.op_type == "Resize" and len(node.input) > 2 and node.input[2] and node.input[2] not in inits
                and node.input[2] not in constants):
            cast_out = f"{node.input[2]}__f32_{i}"
            extra.append((i, helper.make_node("Cast", [node.input[2]], [cast_out], to=F32,
                                              name=f"{node.name or 'Resize'}_scales_f32")))
            node.input[2] = cast_out
    for i, cast in reversed(extra):
        graph.node.insert(i, cast)
    # boundary: float32 in, float32 out; the graph's tensors of those names become FP16 ones behind a Cast
    inputs = [i for i in graph.input if i.type.tensor_type.elem_type == F32 and i.name not in inits]
    input_names = {i.name for i in graph.input}
    outputs = [o for o in graph.output if o.type.tensor_type.elem_type == F32 and o.name not in input_names
               and o.name not in inits]
    rename_tensors(graph, {v.name: f"{v.name}__fp16" for v in inputs + outputs})  # one pass over the graph
    head: list[Any] = []
    for inp in inputs:
        inp.name = inp.name[:-len("__fp16")]
        head.append(helper.make_node("Cast", [inp.name], [f"{inp.name}__fp16"], to=F16, name=f"{inp.name}_to_fp16"))
    tail: list[Any] = []
    for out in outputs:
        out.name = out.name[:-len("__fp16")]
        tail.append(helper.make_node("Cast", [f"{out.name}__fp16"], [out.name], to=F32, name=f"{out.name}_to_fp32"))
    nodes = head + list(graph.node) + tail
    del graph.node[:]
    graph.node.extend(nodes)
    del graph.value_info[:]
    return model


def check_fp16_model(model: Any) -> None:
    """``onnx.checker`` with ``full_check`` (strict type and shape inference) on the rewritten model."""
    from fxq.onnx_data import check_model

    try:
        check_model(model, full_check=True)
    except Exception as exc:
        raise ExportError(f"the FP16 ONNX model is invalid ({exc}); export with high_precision_dtype='fp32' and "
                          f"please report this with the model") from exc


def _round_fp16(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.dtype == torch.float32:
        return value.to(torch.float16).to(torch.float32)
    return value


class _Fp16Interpreter(Interpreter):
    def run_node(self, n: fx.Node) -> Any:
        return fx.node.map_aggregate(super().run_node(n), _round_fp16)


@contextlib.contextmanager
def fp16_simulation(gm: fx.GraphModule) -> Iterator[fx.GraphModule]:
    """Inside the context, ``gm(...)`` simulates the ``high_precision_dtype="fp16"`` TensorRT export.

    Every float32 parameter and buffer (weights, biases, quantizer scales) is rounded to a float16 value, and
    every node's float32 output (inputs included) is rounded to float16; each op still computes in float32.
    Everything is restored on exit.

    Example:
        >>> with fp16_simulation(qmodel):   # doctest: +SKIP
        ...     y16 = qmodel(x)
    """
    saved: list[tuple[torch.Tensor, torch.Tensor]] = []
    with torch.no_grad():
        for t in list(gm.parameters()) + list(gm.buffers()):
            if t.dtype == torch.float32:
                saved.append((t, t.detach().clone()))
                t.copy_(t.to(torch.float16).to(torch.float32))
    interp = _Fp16Interpreter(gm)
    had_forward = "forward" in gm.__dict__
    old_forward = gm.__dict__.get("forward")
    gm.forward = lambda *args: interp.run(*args)  # type: ignore[method-assign]
    try:
        yield gm
    finally:
        if had_forward:
            gm.forward = old_forward  # type: ignore[method-assign]
        else:
            del gm.forward
        with torch.no_grad():
            for t, v in saved:
                t.copy_(v)
