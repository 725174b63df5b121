"""Attention written with the ops a platform quantizes, and the one step masks need in float.

Masked attention is ``softmax(q @ k^T * scale + mask) @ v``. The two matmuls are what TensorRT and ONNX Runtime
quantize; the mask is not data a quantizer may see: it holds ``-inf`` (a bool mask becomes ``-inf`` where it
masks), and a quantizer fed ``-inf`` calibrates an infinite range and turns the whole tensor into NaN. So the
mask step is one node, :func:`apply_attention_mask`, whose op type ``"AttentionMask"`` no platform quantizes: it
runs in FP32, the softmax after it is not fed by a quantized op and stays float too (as TensorRT keeps a masked
softmax), and the ``weights @ v`` matmul quantizes the softmax's finite output. The same node exports as the float
``Where`` / ``Add`` ops torch writes for it.

:func:`decompose_attention_functions` rewrites ``F.scaled_dot_product_attention`` calls in a graph (fx or
torch.export) into these ops; the module decompositions in :mod:`fxq.graph.decompose` use :func:`attention`.
"""
from __future__ import annotations

import logging
import math
import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from fxq.graph.nodes import get_attr_value
from fxq.graph.op_types import op_type, register_op_type

__all__ = ["apply_attention_mask", "attention", "decompose_attention_functions", "route_mask_adds",
           "ATTENTION_MASK_OP"]

logger = logging.getLogger(__name__)

ATTENTION_MASK_OP = "AttentionMask"
"""Op type of :func:`apply_attention_mask` nodes; in no platform's quantized ops, so masks stay float."""


def _additive(mask: torch.Tensor, dtype: torch.dtype, bool_keeps: bool) -> torch.Tensor:
    """A float mask as is; a bool mask as 0 / -inf (``bool_keeps``: True marks kept positions, as in SDPA)."""
    if mask.dtype != torch.bool:
        return mask.to(dtype)
    masked = ~mask if bool_keeps else mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(masked, float("-inf"))


def apply_attention_mask(scores: torch.Tensor, attn_mask: torch.Tensor | None = None,
                         key_padding_mask: torch.Tensor | None = None, bool_keeps: bool = False,
                         causal: bool = False, heads_folded: bool = False) -> torch.Tensor:
    """``scores`` (``(..., L, S)``) plus every given mask, as torch's attention adds them (masks summed first).

    Args:
        scores: attention logits.
        attn_mask: bool or float, broadcastable to ``scores``.
        key_padding_mask: ``(N, S)``, bool (True = padding) or float, for 4-D ``(N, heads, L, S)`` scores.
        bool_keeps: a bool ``attn_mask`` marks positions to keep (``F.scaled_dot_product_attention``) instead of
            positions to mask (``nn.MultiheadAttention``).
        causal: mask keys after each query (top-left aligned, as ``is_causal=True``).
        heads_folded: a 3-D ``attn_mask`` is ``(N * heads, L, S)`` (``nn.MultiheadAttention``'s layout) for
            ``(N, heads, L, S)`` scores, instead of broadcasting.
    """
    total: torch.Tensor | None = None
    if causal:
        rows = torch.arange(scores.shape[-2], device=scores.device).unsqueeze(-1)
        cols = torch.arange(scores.shape[-1], device=scores.device)
        total = _additive(cols > rows, scores.dtype, bool_keeps=False)
    if attn_mask is not None:
        m = _additive(attn_mask, scores.dtype, bool_keeps)
        if heads_folded and m.dim() == 3 and scores.dim() == 4:
            m = m.reshape(scores.shape)
        total = m if total is None else total + m
    if key_padding_mask is not None:
        m = _additive(key_padding_mask, scores.dtype, bool_keeps=False)
        m = m.reshape(m.shape[0], 1, 1, m.shape[-1])
        total = m if total is None else total + m
    return scores if total is None else scores + total


register_op_type(apply_attention_mask, ATTENTION_MASK_OP)


def _mask_node(scores: Any, attn_mask: Any, key_padding_mask: Any, bool_keeps: bool, causal: bool,
               heads_folded: bool) -> Any:
    """One ``apply_attention_mask`` node in the graph ``scores`` is being traced into (eager values run it)."""
    if attn_mask is None and key_padding_mask is None and not causal:
        return scores
    args = (scores, attn_mask, key_padding_mask, bool_keeps, causal, heads_folded)
    if isinstance(scores, fx.Proxy):
        return scores.tracer.create_proxy("call_function", apply_attention_mask, args, {})
    return apply_attention_mask(*args)


def attention(q: Any, k: Any, v: Any, scale: Any, attn_mask: Any = None, key_padding_mask: Any = None,
              bool_keeps: bool = False, causal: bool = False, heads_folded: bool = False) -> tuple[Any, Any]:
    """``(softmax(q @ k^T * scale + masks) @ v, softmax weights)`` on ``(..., L, E)`` tensors or proxies."""
    scores = torch.matmul(q * scale, k.transpose(-2, -1))
    scores = _mask_node(scores, attn_mask, key_padding_mask, bool_keeps, causal, heads_folded)
    weights = torch.softmax(scores, dim=-1)
    return torch.matmul(weights, v), weights


_KEPT_META = ("stack_trace", "nn_module_stack", "module_path")
_WEIGHTED_OPS = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul"})

_SDPA_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS: dict[str, Any] = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None,
                                  "enable_gqa": False}


def _sdpa_targets() -> tuple[Any, ...]:
    targets: list[Any] = [F.scaled_dot_product_attention]
    aten = getattr(torch.ops.aten, "scaled_dot_product_attention", None)
    if aten is not None:
        targets.append(aten.default)
    return tuple(targets)


def _sdpa_arguments(node: fx.Node) -> dict[str, Any]:
    bound = dict(_SDPA_DEFAULTS)
    bound.update(zip(_SDPA_PARAMS, node.args))
    bound.update(node.kwargs)
    return bound


def _is_plain_add(node: fx.Node, modules: dict[str, Any]) -> bool:
    """``a + b``: torch's add without ``alpha``, or an ONNX ``Add`` (a module of the ONNX frontend)."""
    if node.op == "call_function" and node.target in (operator.add, torch.add):
        return len(node.args) == 2 and not node.kwargs
    if node.op == "call_module":
        return op_type(node, modules) == "Add" and len(node.args) == 2 and not node.kwargs
    return node.op == "call_method" and node.target == "add" and len(node.args) == 2 and not node.kwargs


_SENTINEL = 1e4
"""A mask's fill: ``-inf``, ``finfo.min`` or old BERT's ``-10000.0`` (any constant this large or non-finite)."""


def _is_mask_like(value: Any, gm: fx.GraphModule, modules: dict[str, Any]) -> bool:
    """Computed through no weighted op and no parameter from graph inputs (a padding mask), or from constants of
    which one is a mask's fill (:data:`_SENTINEL`: a causal mask of ``-inf``): data a model adds to attention
    logits as a mask. A learned or stored bias (a Linear's bias in an ONNX file, Swin's relative positions) is
    not one."""
    if not isinstance(value, fx.Node):
        return False
    seen: set[fx.Node] = set()
    stack = [value]
    masks = False  # read an input or a mask's fill
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if op_type(node, modules) in ("Shape", "Size"):
            continue  # a size read from a value (a dynamic file's mask expanded to the logits' sizes): no data
        if node.op == "placeholder":
            masks = True
        elif node.op == "get_attr":
            stored = get_attr_value(gm, str(node.target))
            if isinstance(stored, nn.Parameter):
                return False
            masks = masks or _holds_sentinel(stored)
        elif op_type(node, modules) in _WEIGHTED_OPS:
            return False
        elif node.op == "call_module" and next(modules[str(node.target)].parameters(), None) is not None:
            return False  # a layer with weights; the ONNX frontend's ops (Where, Cast, Unsqueeze) hold none
        else:
            masks = masks or any(_holds_sentinel(a) for a in _literals((node.args, node.kwargs)))
        stack.extend(node.all_input_nodes)
    return masks


def _literals(value: Any) -> list[Any]:
    found: list[Any] = []
    fx.node.map_aggregate(value, lambda a: None if isinstance(a, fx.Node) else found.append(a))
    return found


def _holds_sentinel(value: Any) -> bool:
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel():
        return bool((~torch.isfinite(value)).any() or value.abs().max() >= _SENTINEL)
    return isinstance(value, float) and not math.isfinite(value) or isinstance(value, (int, float)) and not \
        isinstance(value, bool) and abs(value) >= _SENTINEL


def route_mask_adds(gm: fx.GraphModule) -> int:
    """``logits + mask`` written by hand, feeding only a softmax, becomes an :func:`apply_attention_mask` node when
    the addend is mask-like (:func:`_is_mask_like`: computed from inputs, buffers and constants through no
    parameter or weighted op — a ``-inf`` / ``finfo.min`` padding or causal mask, but also any such additive
    bias, which then stays FP32): a quantizer would calibrate on a mask's huge values (NaN for ``-inf``, every
    logit rounded to zero for ``finfo.min``). Returns how many were rerouted."""
    modules = dict(gm.named_modules())
    routed = 0
    for node in list(gm.graph.nodes):
        if not _is_plain_add(node, modules) or not node.users:
            continue
        if not all(op_type(u, modules) == "Softmax" for u in node.users):
            continue
        a, b = node.args
        masks = [_is_mask_like(a, gm, modules), _is_mask_like(b, gm, modules)]
        if masks.count(True) != 1:
            continue
        scores, mask = (b, a) if masks[0] else (a, b)
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(apply_attention_mask, (scores, mask))
        new.meta.update({k: v for k, v in node.meta.items() if k in _KEPT_META})
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        routed += 1
    return routed


def _default_scale(query: Any, q: Any) -> Any:
    """``1 / sqrt(E)``: a constant when the graph knows the query's shape (torch.export), else computed."""
    val = query.meta.get("val") if isinstance(query, fx.Node) else None
    size = getattr(val, "shape", None)
    if size is not None and isinstance(size[-1], int):
        return size[-1] ** -0.5
    return q.size(-1) ** -0.5


def decompose_attention_functions(gm: fx.GraphModule) -> fx.GraphModule:
    """Rewrite ``F.scaled_dot_product_attention`` nodes into matmul / mask / softmax / matmul, and hand-written
    ``logits + mask`` adds before a softmax into the float mask node (:func:`route_mask_adds`), in place.

    Dropout is left out (fxq's graphs are inference graphs); ``enable_gqa`` repeats key/value heads as torch does.
    """
    targets = _sdpa_targets()
    changed = 0
    tracer = fx.proxy.GraphAppendingTracer(gm.graph)  # one tracer: proxies of two tracers do not mix

    def proxy(value: Any) -> Any:
        return fx.Proxy(value, tracer) if isinstance(value, fx.Node) else value

    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in targets:
            continue
        a = _sdpa_arguments(node)
        with gm.graph.inserting_before(node):
            q, k, v = (proxy(a[name]) for name in ("query", "key", "value"))
            if a["enable_gqa"]:
                groups = q.size(-3) // k.size(-3)
                k = k.repeat_interleave(groups, dim=-3)
                v = v.repeat_interleave(groups, dim=-3)
            scale = a["scale"] if a["scale"] is not None else _default_scale(a["query"], q)
            out, _ = attention(q, k, v, scale, attn_mask=proxy(a["attn_mask"]), bool_keeps=True, causal=bool(a["is_causal"]))
        out.node.meta.update({key: value for key, value in node.meta.items() if key in _KEPT_META})
        node.replace_all_uses_with(out.node)
        gm.graph.erase_node(node)
        changed += 1
    if changed:
        logger.debug("decomposed %d scaled_dot_product_attention call(s) into quantizable matmuls", changed)
    routed = route_mask_adds(gm)
    if routed:
        logger.info("%d attention mask add(s) before a softmax kept in float (no quantizer sees the mask)", routed)
    if changed or routed:
        gm.graph.lint()
        gm.recompile()
    return gm
