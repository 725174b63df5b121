"""Traceable forms of torch modules that ``torch.fx`` keeps whole, so their insides can be quantized.

``torch.fx`` treats every ``torch.nn`` module as a leaf, and the forwards of ``nn.MultiheadAttention`` and
``nn.TransformerEncoder(Layer)`` could not be traced anyway (fast-path checks, shape checks on tensors). As
leaves they run in FP32 on every platform. The tracer instead calls the *decomposition* registered for the
module's type: the same computation written with traceable ops (linear, matmul, softmax, layer norm...)
that reads the module's own parameters and submodules, so the graph has the nodes a platform quantizes.

Decompositions write the eval-mode computation whatever mode the module is in (fxq's graphs are inference
graphs: preparation removes dropout too), so a model handed over in training mode traces the same way.
Masks go through :mod:`fxq.graph.attention` (one float node, so quantizers never see ``-inf``). A
decomposition returns ``NotImplemented`` for calls it does not cover (``add_bias_kv``, cross-attention, separate
key/value sizes...); the module then stays a leaf, as before. Register more with
:func:`register_decomposition`.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch.nn.functional as F
from torch import nn

from fxq.graph.attention import attention
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
    """Self-attention over ``m``'s projections, as ``F.multi_head_attention_forward`` computes it in eval mode.

    Masks (bool or float ``attn_mask`` of 2-D ``(L, S)`` or 3-D ``(N * heads, L, S)``, ``key_padding_mask``,
    ``is_causal``) go through one float :func:`~fxq.graph.attention.apply_attention_mask` node, so the matmuls
    around them are quantized and the ``-inf`` they hold never reaches a quantizer. Batched inputs only.
    """
    self_attention = query is key and key is value
    if (m.bias_k is not None or m.add_zero_attn or not m._qkv_same_embed_dim or not self_attention
            or (is_causal and attn_mask is None)):  # the last one: torch raises, so the leaf should too
        return NotImplemented  # cross-attention would need split weights: not plain get_attr weights
    if m.batch_first:
        query = query.transpose(0, 1)
    heads, embed = m.num_heads, m.embed_dim
    head_dim = embed // heads
    q, k, v = F.linear(query, m.in_proj_weight, m.in_proj_bias).chunk(3, dim=-1)  # one packed projection
    tgt_len, bsz = query.size(0), query.size(1)
    # (L, N, E) -> (N, heads, L, head_dim)
    q, k, v = (t.reshape(tgt_len, bsz, heads, head_dim).permute(1, 2, 0, 3) for t in (q, k, v))
    # torch runs the pure causal kernel (ignoring attn_mask's values) only in this case; otherwise the mask
    # given is applied as it is
    causal = bool(is_causal) and key_padding_mask is None and not need_weights
    if causal:
        attn_mask = None
    out, weights = attention(q, k, v, 1.0 / math.sqrt(head_dim), attn_mask=attn_mask,
                             key_padding_mask=key_padding_mask, causal=causal, heads_folded=True)
    out = out.permute(2, 0, 1, 3).reshape(tgt_len * bsz, embed)
    out = m.out_proj(out).reshape(tgt_len, bsz, embed)
    if m.batch_first:
        out = out.transpose(0, 1)
    if not need_weights:
        return out, None
    return out, (weights.mean(dim=1) if average_attn_weights else weights)


@register_decomposition(nn.TransformerEncoderLayer)
def _transformer_encoder_layer(m: nn.TransformerEncoderLayer, src: Any, src_mask: Any = None,
                               src_key_padding_mask: Any = None, is_causal: bool = False) -> Any:
    """The layer's reference ("slow") path: attention and feed-forward blocks, pre- or post-norm, masks passed on."""

    def attention_block(x: Any) -> Any:
        out = m.self_attn(x, x, x, attn_mask=src_mask, key_padding_mask=src_key_padding_mask, need_weights=False,
                          is_causal=bool(is_causal))[0]
        return m.dropout1(out)

    def feed_forward(x: Any) -> Any:
        return m.dropout2(m.linear2(m.dropout(m.activation(m.linear1(x)))))

    if is_causal and src_mask is None:
        return NotImplemented  # torch raises: keep the leaf so it does
    x = src
    if m.norm_first:
        x = x + attention_block(m.norm1(x))
        return x + feed_forward(m.norm2(x))
    x = m.norm1(x + attention_block(x))
    return m.norm2(x + feed_forward(x))


@register_decomposition(nn.TransformerEncoder)
def _transformer_encoder(m: nn.TransformerEncoder, src: Any, mask: Any = None, src_key_padding_mask: Any = None,
                         is_causal: bool | None = None) -> Any:
    """The stack of layers, then the final norm (the reference path: no nested tensors).

    ``is_causal=None`` (torch's "detect it from the mask") passes the mask itself on, which computes the same.
    torch's nested-tensor fast path (eval, ``enable_nested_tensor``, a padding mask) writes zeros at padded
    positions before the final norm; the reference path computes them: values there differ, the rest is equal.
    """
    x = src
    for layer in m.layers:
        x = layer(x, src_mask=mask, src_key_padding_mask=src_key_padding_mask, is_causal=bool(is_causal))
    return m.norm(x) if m.norm is not None else x
