"""Traceable forms of torch modules that ``torch.fx`` keeps whole, so their insides can be quantized.

``torch.fx`` treats every ``torch.nn`` module as a leaf, and the forwards of ``nn.MultiheadAttention`` and
``nn.TransformerEncoder(Layer)`` could not be traced anyway (fast-path checks, shape checks on tensors). As
leaves they run in FP32 on every platform. The tracer instead calls the *decomposition* registered for the
module's type: the same computation written with traceable ops (linear, matmul, softmax, layer norm...)
that reads the module's own parameters and submodules, so the graph has the nodes a platform quantizes.

Decompositions write the eval-mode computation whatever mode the module is in (fxq's graphs are inference
graphs: preparation removes dropout too), so a model handed over in training mode traces the same way.
A decomposition returns ``NotImplemented`` for calls it does not cover (masks, ``add_bias_kv``, separate
key/value sizes...); the module then stays a leaf, as before. Register more with
:func:`register_decomposition`.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from fxq.registry import Registry

__all__ = ["DECOMPOSITIONS", "register_decomposition", "decomposition_for"]

Decomposition = Callable[..., Any]

DECOMPOSITIONS: Registry = Registry("module decomposition")


def _type_key(module_type: type) -> str:
    return f"{module_type.__module__}.{module_type.__qualname__}"


def register_decomposition(
    module_type: type[nn.Module], *, override: bool = False
) -> Callable[[Decomposition], Decomposition]:
    """Register ``fn(module, *args, **kwargs)`` as the traceable forward of ``module_type`` (exact type).

    ``fn`` runs while tracing, on proxies: it may call the module's submodules and read its parameters,
    and returns ``NotImplemented`` for calls it does not cover (the module then stays a leaf).
    """

    def wrap(fn: Decomposition) -> Decomposition:
        DECOMPOSITIONS.register(_type_key(module_type), fn, override=override)
        return fn

    return wrap


def decomposition_for(module: nn.Module) -> Decomposition | None:
    """The decomposition registered for ``type(module)``, if any."""
    key = _type_key(type(module))
    return DECOMPOSITIONS.get(key) if key in DECOMPOSITIONS else None


@register_decomposition(nn.MultiheadAttention)
def _multihead_attention(m: nn.MultiheadAttention, query: Any, key: Any, value: Any, key_padding_mask: Any = None,
                         need_weights: bool = True, attn_mask: Any = None, average_attn_weights: bool = True,
                         is_causal: bool = False) -> Any:
    """Self-attention over ``m``'s projections, as ``F.multi_head_attention_forward`` computes it in eval mode
    (no masks, packed in-projection, no extra key/value bias, no zero attention)."""
    self_attention = query is key and key is value
    if (key_padding_mask is not None or attn_mask is not None or is_causal or m.bias_k is not None
            or m.add_zero_attn or not m._qkv_same_embed_dim or not self_attention):
        return NotImplemented  # cross-attention would need split weights: not plain get_attr weights
    if m.batch_first:
        query = query.transpose(0, 1)
    heads, embed = m.num_heads, m.embed_dim
    head_dim = embed // heads
    q, k, v = F.linear(query, m.in_proj_weight, m.in_proj_bias).chunk(3, dim=-1)  # one packed projection
    tgt_len, bsz = query.size(0), query.size(1)
    src_len = tgt_len
    # (L, N, E) -> (N * heads, L, head_dim)
    q = q.reshape(tgt_len, bsz * heads, head_dim).transpose(0, 1)
    k = k.reshape(src_len, bsz * heads, head_dim).transpose(0, 1)
    v = v.reshape(src_len, bsz * heads, head_dim).transpose(0, 1)
    scores = torch.bmm(q * (1.0 / math.sqrt(head_dim)), k.transpose(-2, -1))
    weights = torch.softmax(scores, dim=-1)
    out = torch.bmm(weights, v).transpose(0, 1).reshape(tgt_len * bsz, embed)
    out = m.out_proj(out).reshape(tgt_len, bsz, embed)
    if m.batch_first:
        out = out.transpose(0, 1)
    if not need_weights:
        return out, None
    weights = weights.reshape(bsz, heads, tgt_len, src_len)
    return out, (weights.mean(dim=1) if average_attn_weights else weights)


@register_decomposition(nn.TransformerEncoderLayer)
def _transformer_encoder_layer(m: nn.TransformerEncoderLayer, src: Any, src_mask: Any = None,
                               src_key_padding_mask: Any = None, is_causal: bool = False) -> Any:
    """The layer's reference ("slow") path: attention and feed-forward blocks, pre- or post-norm."""
    if src_mask is not None or src_key_padding_mask is not None or is_causal:
        return NotImplemented

    def attention(x: Any) -> Any:
        return m.dropout1(m.self_attn(x, x, x, need_weights=False)[0])

    def feed_forward(x: Any) -> Any:
        return m.dropout2(m.linear2(m.dropout(m.activation(m.linear1(x)))))

    x = src
    if m.norm_first:
        x = x + attention(m.norm1(x))
        return x + feed_forward(m.norm2(x))
    x = m.norm1(x + attention(x))
    return m.norm2(x + feed_forward(x))


@register_decomposition(nn.TransformerEncoder)
def _transformer_encoder(m: nn.TransformerEncoder, src: Any, mask: Any = None, src_key_padding_mask: Any = None,
                         is_causal: bool | None = None) -> Any:
    """The stack of layers, then the final norm."""
    if mask is not None or src_key_padding_mask is not None or is_causal:
        return NotImplemented
    x = src
    for layer in m.layers:
        x = layer(x)
    return m.norm(x) if m.norm is not None else x
