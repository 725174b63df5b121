"""Static checker of TensorRT's explicit-quantization rules on a Q/DQ ONNX model (TensorRT 10/11).

:func:`check_tensorrt` returns one line per violation (empty list: the model follows the rules). The
TensorRT exporter runs it on everything it writes and raises :class:`fxq.ExportError` on violations.

Rules checked:

1. opset >= 13 (per-axis Q/DQ); only standard-domain ops.
2. every QuantizeLinear / DequantizeLinear has a scale and a zero-point, both constant; zero-points are
   all 0 and INT8 (FLOAT8E4M3FN zeros for FP8 models); scales are finite and > 0.
3. a QuantizeLinear feeds DequantizeLinear only, with the same scale, zero-point and axis.
4. activations are per-tensor; per-axis scales only on constant weights that feed the weight input of
   Conv (axis 0), ConvTranspose (axis 1), Gemm (axis 0 with transB=1, else 1) or MatMul (last axis), or the
   W / R inputs of LSTM / GRU (axis 1: gate and channel; the parser multiplies them inside its recurrence
   loop; not checked against a TensorRT build here), with one scale per slice along that axis.
5. weight codes lie in [-127, 127] (int8 initializers, or float weights rounded half to even by their Q).
6. a Conv / ConvTranspose / Gemm / MatMul with a dequantized weight takes a dequantized data input (one with
   a dequantized data input and a float weight is legal: TensorRT keeps the DQ and runs the op in float).
7. a residual Add (two non-constant inputs) with one dequantized input has each input dequantized or
   computed by a quantized weighted op (which TensorRT fuses with the Add). An Add that feeds only Softmax
   adds an attention mask (``-inf`` where masked, never quantized): TensorRT runs it and the softmax in float.
   An Add of a dequantized value and a float function of that value alone is part of an op torch.onnx spells
   out (the tanh GELU before opset 20), not a residual.
"""
from __future__ import annotations

import os
from typing import Any, Iterator, Mapping

import numpy as np

__all__ = ["check_tensorrt", "TRT_WEIGHTED_OPS"]

TRT_WEIGHTED_OPS = ("Conv", "ConvTranspose", "Gemm", "MatMul")
_RECURRENT_WEIGHTS = {"LSTM": (1, 2), "GRU": (1, 2)}  # input indices of W and R, per-axis along axis 1


def _is_weight_input(user: Any, name: str) -> bool:
    """Whether ``name`` is a weight input of ``user`` (input 1 of a weighted op, W / R of a recurrent op)."""
    index = list(user.input).index(name)
    if user.op_type in _RECURRENT_WEIGHTS:
        return index in _RECURRENT_WEIGHTS[user.op_type]
    return user.op_type in TRT_WEIGHTED_OPS and index == 1
_Q, _DQ = "QuantizeLinear", "DequantizeLinear"


class _Constants(Mapping):
    """Constant values by name, converted to numpy when read: converting every weight up front copies them all."""

    def __init__(self, tensors: dict[str, Any]) -> None:
        self._tensors = tensors

    def __getitem__(self, name: str) -> np.ndarray:
        from onnx import numpy_helper

        return numpy_helper.to_array(self._tensors[name])

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


class _View:
    def __init__(self, model: Any) -> None:

        self.graph = model.graph
        self.opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
        tensors = {t.name: t for t in self.graph.initializer}
        for node in self.graph.node:
            if node.op_type == "Constant" and node.attribute:
                for a in node.attribute:
                    if a.name == "value":
                        tensors[node.output[0]] = a.t
        self.consts = _Constants(tensors)
        self.types: dict[str, int] = {name: t.data_type for name, t in tensors.items()}
        self.prod = {o: n for n in self.graph.node for o in n.output if o}
        self.cons: dict[str, list[Any]] = {}
        for n in self.graph.node:
            for i in n.input:
                if i:
                    self.cons.setdefault(i, []).append(n)

    def attr(self, node: Any, name: str, default: Any = None) -> Any:
        from onnx import helper

        for a in node.attribute:
            if a.name == name:
                return helper.get_attribute_value(a)
        return default

    def label(self, node: Any) -> str:
        return f"{node.op_type} {node.name or node.output[0]!r}"

    def is_dq(self, tensor: str) -> bool:
        p = self.prod.get(tensor)
        return p is not None and p.op_type == _DQ

    def weight_source(self, tensor: str) -> Any:
        """The DQ producing ``tensor`` if it carries a constant (weight), else None."""
        p = self.prod.get(tensor)
        if p is None or p.op_type != _DQ:
            return None
        src = p.input[0]
        if src in self.consts:
            return p
        q = self.prod.get(src)
        if q is not None and q.op_type == _Q and q.input[0] in self.consts:
            return p
        return None


def _check_qdq_node(v: _View, node: Any, out: list[str]) -> None:
    from onnx import TensorProto

    label = v.label(node)
    if len(node.input) < 3 or not node.input[2]:
        out.append(f"{label}: zero-point missing (TensorRT needs an explicit zero-point of 0)")
    for idx, what in ((1, "scale"), (2, "zero-point")):
        if len(node.input) > idx and node.input[idx] and node.input[idx] not in v.consts:
            out.append(f"{label}: {what} {node.input[idx]!r} is not a constant")
    if len(node.input) > 2 and node.input[2] in v.consts:
        zp_type = v.types[node.input[2]]
        if zp_type not in (TensorProto.INT8, TensorProto.FLOAT8E4M3FN):
            out.append(f"{label}: zero-point type {TensorProto.DataType.Name(zp_type)} (TensorRT takes INT8, or "
                       f"FLOAT8E4M3FN for FP8)")
        zp = v.consts[node.input[2]].astype(np.float64)
        if zp.size and bool(np.any(zp != 0)):
            out.append(f"{label}: zero-point {zp.ravel()[:4].tolist()} is not 0 (TensorRT is symmetric)")
    if len(node.input) > 1 and node.input[1] in v.consts:
        s = v.consts[node.input[1]].astype(np.float64)
        if s.size == 0 or not bool(np.all(np.isfinite(s))) or not bool(np.all(s > 0)):
            out.append(f"{label}: scale must be finite and > 0")


def _per_axis(v: _View, node: Any) -> bool:
    s = v.consts.get(node.input[1]) if len(node.input) > 1 else None
    return s is not None and s.ndim > 0


def _weight_axis_rule(v: _View, dq: Any, out: list[str]) -> None:
    """Rule 4/5 for one DQ carrying a constant."""
    label = v.label(dq)
    src = dq.input[0]
    q = v.prod.get(src)
    const = v.consts.get(src) if q is None else v.consts.get(q.input[0])
    if const is None:
        return
    axis = int(v.attr(dq, "axis", 1))
    users = v.cons.get(dq.output[0], [])
    if _per_axis(v, dq):
        if axis < 0:
            axis += const.ndim
        scale = v.consts[dq.input[1]]
        if not 0 <= axis < const.ndim or scale.size != const.shape[axis]:
            out.append(f"{label}: {scale.size} scales for axis {axis} of a weight shaped {list(const.shape)}")
        for user in users:
            if not _is_weight_input(user, dq.output[0]):
                out.append(f"{label}: per-axis weight feeds {v.label(user)} other than as its weight (TensorRT "
                           f"allows per-axis Q/DQ only on weights of Conv/ConvTranspose/Gemm/MatMul/LSTM/GRU)")
                continue
            want = {"Conv": 0, "ConvTranspose": 1, "MatMul": const.ndim - 1, "LSTM": 1, "GRU": 1}.get(user.op_type)
            if user.op_type == "Gemm":
                want = 0 if int(v.attr(user, "transB", 0)) else 1
            if want is not None and axis != want:
                out.append(f"{label}: per-axis weight of {v.label(user)} on axis {axis}; TensorRT needs axis {want}")
    # weight codes (INT8 weights of weighted ops only; FP8 saturates to the E4M3 range by construction)
    from onnx import TensorProto

    if len(dq.input) > 2 and v.types.get(dq.input[2]) != TensorProto.INT8:
        return
    if not any(_is_weight_input(u, dq.output[0]) for u in users):
        return
    if q is None:
        codes = const.astype(np.int64)
    else:
        s = v.consts.get(q.input[1])
        if s is None:
            return
        s = s.astype(np.float32)
        if s.ndim > 0:
            shape = [1] * const.ndim
            qa = int(v.attr(q, "axis", 1))
            shape[qa % const.ndim] = -1
            s = s.reshape(shape)
        codes = np.rint(const.astype(np.float32) / s).astype(np.int64)
    if codes.size and (codes.min() < -127 or codes.max() > 127):
        out.append(f"{label}: weight codes reach [{codes.min()}, {codes.max()}]; TensorRT weights use [-127, 127]")


def check_tensorrt(model: Any) -> list[str]:
    """Violations of TensorRT's explicit-quantization rules in ``model`` (a ModelProto or a file path).

    Example:
        >>> problems = check_tensorrt("model.onnx")   # doctest: +SKIP
        >>> assert not problems, "\\n".join(problems)  # doctest: +SKIP
    """
    import onnx

    if isinstance(model, (str, os.PathLike)):
        model = onnx.load(os.fspath(model))
    v = _View(model)
    out: list[str] = []
    if v.opset < 13:
        out.append(f"opset {v.opset} < 13: per-axis QuantizeLinear/DequantizeLinear needs opset 13")
    for node in v.graph.node:
        if node.domain not in ("", "ai.onnx"):
            out.append(f"{v.label(node)}: custom domain {node.domain!r} is not a TensorRT op")
    for node in v.graph.node:
        if node.op_type not in (_Q, _DQ):
            continue
        _check_qdq_node(v, node, out)
        if node.op_type == _Q:
            users = v.cons.get(node.output[0], [])
            for u in users:
                if u.op_type != _DQ:
                    out.append(f"{v.label(node)} feeds {v.label(u)}; a QuantizeLinear must feed DequantizeLinear")
                elif list(u.input[1:3]) != list(node.input[1:3]) or v.attr(u, "axis", 1) != v.attr(node, "axis", 1):
                    out.append(f"{v.label(node)} and {v.label(u)} use different scale/zero-point/axis")
            if node.input[0] not in v.consts and _per_axis(v, node):
                out.append(f"{v.label(node)}: per-axis activation quantization; TensorRT activations are per-tensor")
        else:
            src = node.input[0]
            if src in v.consts or (v.prod.get(src) is not None and v.prod[src].op_type == _Q
                                   and v.prod[src].input[0] in v.consts):
                _weight_axis_rule(v, node, out)
            elif v.prod.get(src) is None or v.prod[src].op_type != _Q:
                out.append(f"{v.label(node)}: dequantizes {src!r}, which no QuantizeLinear produces")
            elif _per_axis(v, node):
                out.append(f"{v.label(node)}: per-axis activation quantization; TensorRT activations are per-tensor")
    quantized_weighted: set[str] = set()
    for node in v.graph.node:
        if node.op_type not in TRT_WEIGHTED_OPS or len(node.input) < 2:
            continue
        data, weight = node.input[0], node.input[1]
        w_dq = v.weight_source(weight) is not None
        w_const = weight in v.consts
        if node.op_type == "MatMul" and not w_dq and not w_const:
            a, b = v.is_dq(data), v.is_dq(weight)
            if a != b:
                out.append(f"{v.label(node)}: one input is dequantized and the other is not")
            if a and b:
                quantized_weighted.add(node.output[0])
            continue
        if w_dq and not v.is_dq(data):
            out.append(f"{v.label(node)}: weight is quantized but input {data!r} has no Q/DQ (put Q/DQ on the "
                       f"inputs of weighted ops)")
        # a dequantized input with float weights is legal: TensorRT keeps the DQ and runs the op in float (an op
        # dispatched to FP32 after a quantized producer), which is what fxq simulates
        if w_dq and v.is_dq(data):
            quantized_weighted.add(node.output[0])
    for node in v.graph.node:
        if node.op_type != "Add":
            continue
        ins = [i for i in node.input if i and i not in v.consts]
        if len(ins) != 2 or not any(v.is_dq(i) for i in ins):
            continue
        if _masks_a_softmax(v, node) or any(_float_function_of(v, a, b) for a, b in (ins, ins[::-1])):
            continue
        for i in ins:
            if not v.is_dq(i) and i not in quantized_weighted:
                out.append(f"{v.label(node)}: residual input {i!r} has no Q/DQ (TensorRT needs Q/DQ on both "
                           f"inputs of a residual Add, or a quantized Conv/Gemm producing it)")
    return out


def _float_function_of(v: _View, value: str, source: str, limit: int = 64) -> bool:
    """Whether ``value`` is computed in float from the dequantized ``source`` and constants alone, without a
    weighted op: an op torch.onnx spells out, not a residual branch (the tanh GELU before opset 20:
    ``x + 0.044715 * x * x * x``), which TensorRT runs or fuses in float as a whole."""
    if not v.is_dq(source):
        return False
    todo, seen = [value], set()
    while todo:
        tensor = todo.pop()
        if tensor == source or tensor in v.consts or tensor in seen:
            continue
        seen.add(tensor)
        node = v.prod.get(tensor)
        if node is None or node.op_type in (_Q, _DQ, *TRT_WEIGHTED_OPS) or len(seen) > limit:
            return False
        todo.extend(i for i in node.input if i)
    return True


def _masks_a_softmax(v: _View, node: Any) -> bool:
    """An Add whose every consumer is a Softmax: attention scores plus a mask, a float step, not a residual."""
    users = v.cons.get(node.output[0], [])
    return bool(users) and all(u.op_type == "Softmax" for u in users)
