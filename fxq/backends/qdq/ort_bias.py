"""What a default onnxruntime session does to the biases of a Q/DQ model, for both QDQ exporters to warn about.

A default session (graph optimizations on) changes two things fxq's simulation and ``ORT_DISABLE_ALL`` do not:

* **FP32 biases become int32 codes** (``WeightBiasQuantization``, level 1): every Conv/Gemm that reads a
  dequantized input and whose output is quantized gets its FP32 bias as codes of input scale x weight scale.
  Where those overflow int32 or the rounding moves the bias by half an output step, the session adds another bias.
* **int32 biases are added in an int32 accumulator that wraps** (``QDQSelectorActionTransformer``, level 2: the
  fused QLinearConv / QGemm): the kernel adds the bias codes (the file's, or those of the pass above) to
  sum(input codes x weight codes) in int32 arithmetic, modulo 2^32. Where a bias code sits within that sum's reach
  of +-2^31 (codes saturated at the int32 limits because the input scale is at the 1e-8 floor: vanishing
  activations) an output of the same sign wraps to the other end of the range, e.g. 150 output codes on
  ShuffleNet-V2's classifier; ONNX's DequantizeLinear -> float Conv/Gemm (what fxq simulates) does not wrap.

A third change is not about biases: **DequantizeLinear -> Softmax -> QuantizeLinear becomes QLinearSoftmax** (the
same level-2 transformer), which computes from a table of exp over the input codes and quantizes with
``floor(1 / output scale)`` as its multiplier. The floor alone moved one output in 6 of a small attention;
ort_int8's calibration now makes that reciprocal an integer (:func:`fxq.graph.convert.snap_softmax_scales`),
which leaves the table's rounding ties (under 1 %). :func:`warn_fused_softmax` names those nodes.

A fourth depends on the CPU: **x86 CPUs without VNNI saturate pairs of products** (the fused kernels, and the
``MatMulIntegerToFloat`` of an unquantized output, run uint8 activation codes, int8 ones shifted by 128 by
``QDQS8ToU8Transformer``, against int8 weight codes with AVX2's ``vpmaddubsw``, which adds the products of two
neighbours along the reduced dimension into int16 with saturation). Where two neighbouring weight codes of one sign
sum to more than 32767 / 255 (128), inputs near the top of their range give a clipped pair sum: one Linear of a
random-init DeBERTa moved 30 of 1024 outputs by up to 18 LSB, which took the model's output to cosine 0.004. VNNI
(``avx512_vnni``, ``avx_vnni``) accumulates in int32 and does not saturate; weights of 7 bits cannot reach it
(onnxruntime's own ``reduce_range``, fxq's ``ort_int8_reduce_range``). :func:`u8s8_saturation_issues` finds the
nodes from the file alone and :func:`warn_u8s8_saturation` names them where this process runs on such a CPU.

fxq's own int32 bias grids leave the accumulator that room (``fxq.graph.convert``: the bias range stops short of
the int32 limits by the largest sum its op can accumulate), so its ort_int8 files do not wrap. FP32 biases
(trt_int8: TensorRT adds them in float) are rounded by the first pass. :func:`ort_bias_issues` finds such nodes from
the file alone and :func:`warn_ort_bias_issues` logs them as one WARNING; the file itself stays what fxq simulates.
"""
from __future__ import annotations

import logging
from typing import Any

import numpy as np

__all__ = ["ort_bias_issues", "warn_ort_bias_issues", "fused_softmaxes", "warn_fused_softmax", "cpu_saturates_u8s8",
           "u8s8_saturation_issues", "warn_u8s8_saturation"]

logger = logging.getLogger(__name__)

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_BIAS_OPS = ("Conv", "ConvTranspose", "Gemm")
_FUSED = {"Conv": "QLinearConv", "Gemm": "QGemm"}
"""The ops whose fused int8 kernel adds an int32 bias (onnxruntime's CPU provider fuses no ConvTranspose)."""
_ROUNDING, _WRAP = "WeightBiasQuantization", "QDQSelectorActionTransformer"


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


def _weight_codes(dq_w: Any, const: Any, prod: dict[str, Any], centered: bool = True) -> np.ndarray | None:
    """The integer weight codes a DequantizeLinear reads (int64), less their zero-point where ``centered``, or None
    where they are not integer constants (FP8 codes, a computed weight); with ``centered=False`` also None unless
    they are int8. ``weights="qdq"`` files hold a QuantizeLinear of the FP32 constant: its codes are computed as
    onnxruntime folds them."""
    from onnx import helper

    from fxq.backends.qdq.onnx_graph import INT_RANGES, attr

    w = const(dq_w.input[0])
    s_w = const(dq_w.input[1])
    zw = const(dq_w.input[2]) if len(dq_w.input) > 2 and dq_w.input[2] else None
    if (zw is not None and zw.dtype.kind not in "iu") or (w is not None and w.dtype.kind not in "iu"):
        return None  # FP8 codes: onnxruntime has no fused integer kernel for them

    def along_axis(v: np.ndarray, rank: int) -> np.ndarray:
        """A per-tensor or per-channel parameter of the DequantizeLinear, shaped to broadcast over the weight."""
        shape = [1] * rank
        if v.size > 1:
            shape[int(attr(dq_w, "axis", 1)) % rank] = -1
        return v.reshape(shape)

    if w is None:  # weights="qdq": the codes are those of a QuantizeLinear of an FP32 constant, folded
        q_w = prod.get(dq_w.input[0])
        w = const(q_w.input[0]) if q_w is not None and q_w.op_type == "QuantizeLinear" else None
        if w is None or s_w is None or w.ndim < 2:
            return None
        code_type = helper.np_dtype_to_tensor_dtype(zw.dtype if zw is not None else np.dtype(np.uint8))
        w = np.round(w / along_axis(s_w, w.ndim)) + (0 if zw is None else along_axis(zw.astype(np.float64), w.ndim))
        w = np.clip(w, *INT_RANGES[code_type])  # QuantizeLinear: half to even, saturated
    if w.ndim < 2:
        return None
    if not centered:  # the raw codes: int8 ones only (the element type is the zero-point's, uint8 without one)
        kind = zw.dtype if zw is not None else (w.dtype if w.dtype.kind in "iu" else np.dtype(np.uint8))
        return w.astype(np.int64) if kind == np.int8 else None
    w = w.astype(np.int64)
    if zw is not None and zw.size:
        w = w - along_axis(zw.astype(np.int64), w.ndim)
    return w


def _accumulator_reach(node: Any, dq_in: Any, dq_w: Any, const: Any, prod: dict[str, Any]) -> np.ndarray | None:
    """Per output channel, the largest |sum(input codes x weight codes)| the fused kernel can accumulate:
    sum |weight code - zero-point| over the channel's weights x the input codes' largest distance from their
    zero-point (over the whole range of their element type). None where the codes are not constants."""
    import torch
    from onnx import helper

    from fxq.backends.qdq.onnx_graph import INT_RANGES, attr
    from fxq.functional import accumulator_reach

    w = _weight_codes(dq_w, const, prod)
    if w is None:
        return None
    out_axis = 0 if node.op_type == "Conv" or attr(node, "transB", 0) else 1
    zx = const(dq_in.input[2]) if len(dq_in.input) > 2 and dq_in.input[2] else np.zeros((), np.uint8)
    if zx is None:
        return None
    lo, hi = INT_RANGES[helper.np_dtype_to_tensor_dtype(zx.dtype)]
    return accumulator_reach(torch.from_numpy(w), out_axis, lo, hi, int(zx.reshape(-1)[0])).numpy()


def _wrap_issue(codes: np.ndarray, reach: np.ndarray | None, where: str, fused: str) -> str | None:
    """The line for int32 bias ``codes`` that ``reach`` more accumulation can push past int32, or None."""
    if reach is None or reach.size not in (1, codes.size):
        return None
    codes = codes.astype(np.int64)
    high, low = codes + reach > _INT32_MAX, codes - reach < _INT32_MIN
    n = int(np.count_nonzero(high | low))
    if not n:
        return None
    return (f"{where}: {n} of its {codes.size} int32 bias codes lie within {int(reach.max()):.3g} (input codes x "
            f"weight codes) of the int32 limits (largest |code| {int(np.abs(codes).max()):.3g}), and {fused}'s int32 "
            f"accumulator wraps around there")


def _indexed(model: Any) -> tuple[Any, dict[str, Any], dict[str, list[Any]], Any]:
    """``model``'s graph, its producer and consumer maps, and ``const(name)``: an initializer's array, or None."""
    from onnx import numpy_helper

    from fxq.backends.qdq.onnx_graph import consumers, producers

    graph = model.graph
    consts = {t.name: t for t in graph.initializer}

    def const(name: str) -> np.ndarray | None:
        t = consts.get(name)
        return None if t is None else numpy_helper.to_array(t)

    return graph, producers(graph), consumers(graph), const


def _listed(lines: list[str], most: int = 8) -> list[str]:
    """The first ``most`` of ``lines``, then how many more there are."""
    return lines[:most] + ([f"... and {len(lines) - most} more"] if len(lines) > most else [])


def _issues(model: Any) -> list[tuple[str, str]]:
    """(cause, line) per node a default session computes otherwise; cause is the onnxruntime pass responsible."""
    from fxq.backends.qdq.onnx_graph import attr

    graph, prod, cons, const = _indexed(model)

    out: list[tuple[str, str]] = []
    for node in graph.node:
        if node.op_type not in _BIAS_OPS or len(node.input) < 2:
            continue
        dq_in = prod.get(node.input[0])
        if dq_in is None or dq_in.op_type != "DequantizeLinear" or len(dq_in.input) < 2:
            continue
        s_in = const(dq_in.input[1])
        q = _quantized_path(node, cons)
        if s_in is None or s_in.size != 1:
            continue
        where = f"{node.op_type} {node.name or node.output[0]!r}"
        q_in = prod.get(dq_in.input[0])
        src = q_in.input[0] if q_in is not None and q_in.op_type == "QuantizeLinear" else dq_in.input[0]
        dq_w = prod.get(node.input[1])
        bias_name = node.input[2] if len(node.input) > 2 else ""
        dq_b = prod.get(bias_name) if bias_name else None
        if dq_b is not None and dq_b.op_type == "DequantizeLinear":  # int32 codes in the file (ort_int8)
            codes = const(dq_b.input[0])
            fused = node.op_type in _FUSED and (q is not None or node.op_type == "Gemm")  # QGemm may output FP32
            if (fused and codes is not None and codes.dtype == np.int32 and dq_w is not None
                    and dq_w.op_type == "DequantizeLinear"):
                line = _wrap_issue(codes, _accumulator_reach(node, dq_in, dq_w, const, prod),
                                   f"{where} (bias {dq_b.input[0]!r}; input {src!r} at scale "
                                   f"{float(s_in.reshape(-1)[0]):.3g})", _FUSED[node.op_type])
                if line:
                    out.append((_WRAP, line))
            continue
        if q is None:
            continue
        bias = const(bias_name) if bias_name else None
        bias = bias if bias is not None and bias.ndim == 1 and bias.dtype == np.float32 else None
        if dq_w is None or dq_w.op_type != "DequantizeLinear":
            w = const(node.input[1])
            if w is not None and w.dtype == np.float32:
                out.append((_ROUNDING, f"{where}: onnxruntime quantizes its FP32 weight {node.input[1]!r} to "
                                       f"per-tensor int8"))
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
        where += f" (bias {bias_name!r}; input {src!r} at scale {float(s_in.reshape(-1)[0]):.3g})"
        if not bool(np.all(np.isfinite(codes))) or float(np.abs(codes).max(initial=0.0)) >= 2**31:
            out.append((_ROUNDING, f"{where}: bias / (input scale x weight scale) reaches "
                                   f"{float(np.nanmax(np.abs(ratio))):.3g}, beyond int32"))
        elif moved.size and float(moved.max()) >= 0.5 * step:
            out.append((_ROUNDING, f"{where}: int32 rounding moves the bias by {float(moved.max()):.3g}, "
                                   f"{float(moved.max()) / step:.2f} output steps"))
        elif node.op_type in _FUSED:
            line = _wrap_issue(codes, _accumulator_reach(node, dq_in, dq_w, const, prod),
                               f"{where} (int32 codes from {_ROUNDING})", _FUSED[node.op_type])
            if line:
                out.append((_WRAP, line))
    return out


def ort_bias_issues(model: Any) -> list[str]:
    """Conv/Gemm biases that a default onnxruntime session (graph optimizations on) does not add as written.

    Mirrors two passes. ``WeightBiasQuantization``: a Conv/ConvTranspose/Gemm whose input comes from a per-tensor
    DequantizeLinear, whose output reaches a QuantizeLinear (through Relu/Clip only) and whose bias is a 1-D FP32
    initializer gets that bias as ``round(bias / (input_scale * weight_scale))`` int32 codes (and an FP32 weight
    as per-tensor int8): flagged where the codes overflow int32, the rounding moves the bias by half an output
    step, or a weight is FP32. ``QDQSelectorActionTransformer``: a Conv (output quantized) or Gemm with dequantized
    input, weight and int32 bias runs as QLinearConv / QGemm, whose int32 accumulator wraps: flagged where a bias
    code plus the largest possible sum of input x weight codes passes an int32 limit. One line per node.
    """
    return [line for _, line in _issues(model)]


def warn_ort_bias_issues(model: Any, exporter: str) -> list[str]:
    """Log :func:`ort_bias_issues` of ``model`` as one WARNING; returns the lines."""
    found = _issues(model)
    issues = [line for _, line in found]
    if not issues:
        return issues
    causes = sorted({cause for cause, _ in found})
    why = []
    if _ROUNDING in causes:
        why.append(f"{_ROUNDING} quantizes FP32 biases to int32 codes of input scale x weight scale, which cannot "
                   f"hold them")
    if _WRAP in causes:
        why.append(f"{_WRAP} runs them as QLinearConv/QGemm, which add int32 bias codes near the int32 limits in "
                   f"an int32 accumulator that wraps around")
    shown = _listed(issues)
    logger.warning(
        "%s: a default onnxruntime session (graph optimizations on) will not compute what fxq simulates for %d "
        "node(s): %s:\n  %s\nTiny input scales mean the activations vanish (e.g. untrained BatchNorm statistics, "
        "or calibration data unlike real inputs): calibrate with representative data. The file itself is written "
        "as fxq simulates it (onnxruntime computes it with ORT_DISABLE_ALL, or with disabled_optimizers=%s).",
        exporter, len(issues), "; ".join(why), "\n  ".join(shown), causes)
    return issues


def fused_softmaxes(model: Any) -> list[str]:
    """Names of the Softmax nodes a default onnxruntime session runs as QLinearSoftmax: read from a
    DequantizeLinear, read only by QuantizeLinear."""
    from fxq.backends.qdq.onnx_graph import consumers, producers

    producer, readers = producers(model.graph), consumers(model.graph)
    graph_outputs = {o.name for o in model.graph.output}
    found = []
    for n in model.graph.node:
        if n.op_type != "Softmax" or n.output[0] in graph_outputs:
            continue
        source, users = producer.get(n.input[0]), readers.get(n.output[0], [])
        if source is not None and source.op_type == "DequantizeLinear" and users and all(
                u.op_type == "QuantizeLinear" for u in users):
            found.append(n.name or n.output[0])
    return found


def warn_fused_softmax(model: Any, exporter: str) -> list[str]:
    """Log :func:`fused_softmaxes` of ``model`` as one WARNING; returns the names."""
    names = fused_softmaxes(model)
    if names:
        shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        logger.warning(
            "%s: a default onnxruntime session (graph optimizations on) runs %d softmax(es) (%s) as QLinearSoftmax, "
            "which computes from an exp table and multiplies by floor(1 / output scale) (ort_int8's calibration makes "
            "that reciprocal an integer; a trained or other platform's scale may not be): some outputs one code off "
            "what fxq simulates. The file is "
            "written as fxq simulates it (onnxruntime computes exactly that with ORT_DISABLE_ALL, or with "
            "disabled_optimizers=['%s'])", exporter, len(names), shown, _WRAP)
    return names


_PAIR_LIMIT = 32767 // 255  # 128: |w0| + |w1| beyond it reaches int16 saturation at the top input code 255
_SATURATING_OPS = ("Conv", "Gemm", "MatMul")
_VNNI_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")


def cpu_saturates_u8s8(cpuinfo: str | None = None) -> bool | None:
    """Whether onnxruntime's int8 CPU kernels saturate pairs of products on this machine: True on an x86-64 CPU
    with AVX2 and no VNNI, False on one with VNNI or on another architecture, None where Linux's ``/proc/cpuinfo``
    cannot be read (other systems). ``cpuinfo``: its text, for tests."""
    import platform

    if cpuinfo is None:
        if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686"):
            return False
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
                cpuinfo = fh.read()
        except OSError:
            return None
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), None)
    if flags is None:
        return None
    return "avx2" in flags and not any(f in flags for f in _VNNI_FLAGS)


def _saturating_pairs(w: np.ndarray, k_axis: int) -> tuple[int, int]:
    """(pairs, largest sum): the neighbours ``(2i, 2i + 1)`` along ``k_axis`` of the weight codes ``w`` whose
    products with the top input code add up beyond int16 (same sign, ``|w0| + |w1| > 128``)."""
    k = np.moveaxis(w, k_axis, -1).reshape(-1, w.shape[k_axis])
    if k.shape[1] % 2:
        k = np.concatenate([k, np.zeros((k.shape[0], 1), k.dtype)], axis=1)
    a, b = k[:, 0::2], k[:, 1::2]
    same = np.abs(a + b)  # |a| + |b| where a and b share a sign, less otherwise
    hit = same > _PAIR_LIMIT
    return int(np.count_nonzero(hit)), int(same.max(initial=0))


def u8s8_saturation_issues(model: Any) -> list[str]:
    """Conv / Gemm / MatMul nodes whose int8 weight codes hold neighbours (along the reduced dimension) that x86
    CPUs without VNNI add into a saturated int16 pair sum when both inputs are near the top of their range (see the
    module docstring): one line per node. A Conv's reduced dimension is taken in both orders onnxruntime may use
    (channels outermost, or innermost as in its NHWC kernels); a node is named if either holds such a pair. An FP32
    weight of a Conv / Gemm between a DequantizeLinear and a QuantizeLinear counts with the per-tensor int8 codes a
    default session gives it (``WeightBiasQuantization``)."""
    from fxq.backends.qdq.onnx_graph import attr

    graph, prod, cons, const = _indexed(model)

    out = []
    for node in graph.node:
        if node.op_type not in _SATURATING_OPS or len(node.input) < 2:
            continue
        dq_in, dq_w = prod.get(node.input[0]), prod.get(node.input[1])
        if dq_in is None or dq_in.op_type != "DequantizeLinear":
            continue
        zx = const(dq_in.input[2]) if len(dq_in.input) > 2 and dq_in.input[2] else np.zeros((), np.uint8)
        if zx is None or zx.dtype not in (np.uint8, np.int8):
            continue  # 8-bit activations only: 16-bit ones take other kernels
        if dq_w is not None and dq_w.op_type == "DequantizeLinear":
            w = _weight_codes(dq_w, const, prod, centered=False)  # the kernel multiplies raw int8 codes
        else:  # an FP32 weight that WeightBiasQuantization turns into per-tensor int8 codes (output quantized)
            w = const(node.input[1]) if node.op_type in _FUSED and _quantized_path(node, cons) is not None else None
            if w is not None and w.dtype == np.float32 and w.ndim >= 2 and np.abs(w).max(initial=0) > 0:
                w = np.round(w / (np.abs(w).max() / 127)).astype(np.int64)
            else:
                w = None
        if w is None:
            continue
        if node.op_type == "Conv":
            flat = w.reshape(w.shape[0], -1)
            channels_last = np.moveaxis(w, 1, -1).reshape(w.shape[0], -1)
            found = max(_saturating_pairs(flat, 1), _saturating_pairs(channels_last, 1))
        else:
            k_axis = (w.ndim - 1) if node.op_type == "Gemm" and attr(node, "transB", 0) else (w.ndim - 2)
            found = _saturating_pairs(w, k_axis)
        if found[0]:
            out.append(f"{node.op_type} {node.name or node.output[0]!r}: {found[0]} pair(s) of neighbouring weight "
                       f"codes sum to up to {found[1]} (> {_PAIR_LIMIT})")
    return out


def warn_u8s8_saturation(model: Any, exporter: str) -> list[str]:
    """Log :func:`u8s8_saturation_issues` of ``model`` where this process runs on a CPU that saturates
    (:func:`cpu_saturates_u8s8`): one WARNING for onnxruntime's own files, one INFO for TensorRT's (which
    TensorRT runs unaffected; only checking them in onnxruntime on this machine is). Returns the lines found there
    (none elsewhere)."""
    if not cpu_saturates_u8s8():
        return []
    issues = u8s8_saturation_issues(model)
    if issues:
        shown = _listed(issues)
        target = ("for CPUs without VNNI, quantize for platform 'ort_int8_reduce_range' (7-bit weights, as "
                  "onnxruntime's own reduce_range), or deploy on a CPU with VNNI"
                  if exporter == "onnxruntime" else "TensorRT is not affected; to check this file in onnxruntime "
                  "here, use ORT_DISABLE_ALL or a CPU with VNNI")
        logger.log(
            logging.WARNING if exporter == "onnxruntime" else logging.INFO,
            "%s: this machine's CPU (x86 without VNNI) makes onnxruntime's int8 kernels add products in pairs "
            "with int16 saturation; %d node(s) have weight codes that can reach it, so a default onnxruntime "
            "session here can compute them up to many LSB away from the file's Q/DQ arithmetic (which fxq "
            "simulates, and ORT_DISABLE_ALL computes) where inputs are near the top of their range:\n  %s\nFix: %s.",
            exporter, len(issues), "\n  ".join(shown), target)
    return issues
