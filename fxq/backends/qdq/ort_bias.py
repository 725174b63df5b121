"""What a default onnxruntime session does to the FP32 biases of a Q/DQ model, for both QDQ exporters to warn about.

A default session (graph optimizations on) quantizes the FP32 bias of every Conv/Gemm that reads a dequantized
input and whose output is quantized (onnxruntime's ``WeightBiasQuantization`` pass): int32 codes of input scale x
weight scale. Where those codes overflow int32 (input scales at the 1e-8 floor: vanishing activations) or the
rounding moves the bias by half an output step, that session computes something else than fxq's simulation;
:func:`ort_bias_issues` finds those nodes and :func:`warn_ort_bias_issues` logs them as one WARNING.
"""
from __future__ import annotations

import logging
from typing import Any

import numpy as np

__all__ = ["ort_bias_issues", "warn_ort_bias_issues"]

logger = logging.getLogger(__name__)

_INT32_LIMIT = float(2**31)
_BIAS_OPS = ("Conv", "ConvTranspose", "Gemm")


def _quantized_path(node: Any, cons: dict[str, list[Any]]) -> Any:
    """The QuantizeLinear that ``node``'s output reaches through single-consumer Relu/Clip, or None."""
    cur = node
    while len(cur.output) == 1:
        users = cons.get(cur.output[0], [])
        if len(users) != 1:
            return None
        if users[0].op_type == "QuantizeLinear":
            return users[0]
        if users[0].op_type not in ("Relu", "Clip"):
            return None
        cur = users[0]
    return None


def ort_bias_issues(model: Any) -> list[str]:
    """FP32 biases that a default onnxruntime session (graph optimizations on) does not add as written.

    Mirrors onnxruntime's ``WeightBiasQuantization`` pass: a Conv/ConvTranspose/Gemm whose input comes from a
    per-tensor DequantizeLinear, whose output reaches a QuantizeLinear (through Relu/Clip only) and whose bias is
    a 1-D FP32 initializer gets that bias as ``round(bias / (input_scale * weight_scale))`` int32 codes (and an
    FP32 weight as per-tensor int8). Returns one line per node where the codes overflow int32, the rounding moves
    the bias by half an output step, or a weight is FP32.
    """
    from onnx import numpy_helper

    from fxq.backends.qdq.onnx_graph import attr, consumers, producers

    graph = model.graph
    consts = {t.name: t for t in graph.initializer}
    prod, cons = producers(graph), consumers(graph)

    def const(name: str) -> np.ndarray | None:
        t = consts.get(name)
        return None if t is None else numpy_helper.to_array(t)

    out: list[str] = []
    for node in graph.node:
        if node.op_type not in _BIAS_OPS or len(node.input) < 2:
            continue
        dq_in = prod.get(node.input[0])
        if dq_in is None or dq_in.op_type != "DequantizeLinear" or len(dq_in.input) < 2:
            continue
        s_in = const(dq_in.input[1])
        q = _quantized_path(node, cons)
        if s_in is None or s_in.size != 1 or q is None:
            continue
        bias = const(node.input[2]) if len(node.input) > 2 and node.input[2] else None
        bias = bias if bias is not None and bias.ndim == 1 and bias.dtype == np.float32 else None
        where = f"{node.op_type} {node.name or node.output[0]!r}"
        dq_w = prod.get(node.input[1])
        if dq_w is None or dq_w.op_type != "DequantizeLinear":
            w = const(node.input[1])
            if w is not None and w.dtype == np.float32:
                out.append(f"{where}: onnxruntime quantizes its FP32 weight {node.input[1]!r} to per-tensor int8")
            continue
        s_w = const(dq_w.input[1])
        if bias is None or s_w is None:
            continue
        if s_w.size > 1:  # per-channel: onnxruntime takes axis 0 (Gemm: 0 with transB, else 1) only
            w = const(dq_w.input[0])
            rank = w.ndim if w is not None else (2 if node.op_type == "Gemm" else 4)
            want = (0 if attr(node, "transB", 0) else 1) if node.op_type == "Gemm" else 0
            if s_w.size != bias.size or int(attr(dq_w, "axis", 1)) % rank != want:
                continue
        b_scale = (np.float32(s_in.reshape(-1)[0]) * s_w.astype(np.float32).reshape(-1)).astype(np.float32)
        with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
            ratio = (bias / b_scale).astype(np.float32)
            codes = np.round(ratio)
            moved = np.abs(codes.astype(np.float64) * b_scale - bias)
        s_out = const(q.input[1]) if len(q.input) > 1 else None
        step = float(np.min(s_out)) if s_out is not None and s_out.size else float("inf")
        q_in = prod.get(dq_in.input[0])
        src = q_in.input[0] if q_in is not None and q_in.op_type == "QuantizeLinear" else dq_in.input[0]
        where += f" (bias {node.input[2]!r}; input {src!r} at scale {float(s_in.reshape(-1)[0]):.3g})"
        if not bool(np.all(np.isfinite(codes))) or float(np.abs(codes).max(initial=0.0)) >= _INT32_LIMIT:
            out.append(f"{where}: bias / (input scale x weight scale) reaches "
                       f"{float(np.nanmax(np.abs(ratio))):.3g}, beyond int32")
        elif moved.size and float(moved.max()) >= 0.5 * step:
            out.append(f"{where}: int32 rounding moves the bias by {float(moved.max()):.3g}, "
                       f"{float(moved.max()) / step:.2f} output steps")
    return out


def warn_ort_bias_issues(model: Any, exporter: str) -> list[str]:
    """Log :func:`ort_bias_issues` of ``model`` as one WARNING; returns the lines."""
    issues = ort_bias_issues(model)
    if issues:
        shown = issues[:8] + ([f"... and {len(issues) - 8} more"] if len(issues) > 8 else [])
        logger.warning(
            "%s: a default onnxruntime session (graph optimizations on) will not compute what fxq simulates for "
            "%d node(s): it quantizes their FP32 biases to int32 codes of input scale x weight scale, which cannot "
            "hold them:\n  %s\nTiny input scales mean the activations vanish (e.g. untrained BatchNorm statistics, "
            "or calibration data unlike real inputs): calibrate with representative data. The file itself is "
            "written as fxq simulates it (onnxruntime computes it with ORT_DISABLE_ALL, or with "
            "disabled_optimizers=['WeightBiasQuantization']); a platform with int32 biases (ort_int8) avoids it.",
            exporter, len(issues), "\n  ".join(shown))
    return issues
