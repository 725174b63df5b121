"""The ncnn layer-converter registry: one converter per canonical op type, looked up by the builder.

Kept apart from :mod:`~fxq.backends.ncnn.builder` so that converters (``layers``, ``recurrent``, a user's own)
import the builder and this registry, and the builder imports neither of them: no import cycle.
"""
from __future__ import annotations

from typing import Any, Callable

from torch import fx

from fxq.registry import Registry

__all__ = ["NCNN_CONVERTERS", "Converter", "register_ncnn_converter", "takes_any_batch_dim", "converts_tuples",
           "takes_high_rank"]

Converter = Callable[[Any, fx.Node], None]
"""``fn(builder, node)``: the builder is a :class:`~fxq.backends.ncnn.builder.NcnnBuilder` (not imported here:
the builder imports this module)."""
NCNN_CONVERTERS: Registry[Converter] = Registry("ncnn layer converter")
_ANY_BATCH_DIM: set[str] = set()  # op types whose converter maps any batch dim (lower case, as the registry)
_MULTI_OUTPUT: set[str] = set()  # op types whose converter takes a node of several outputs (a tuple value)
_HIGH_RANK: set[str] = set()  # op types whose converter takes values of more than 4 dims besides the batch


def register_ncnn_converter(*op_types: str, override: bool = False, any_batch_dim: bool = False,
                            multi_output: bool = False, high_rank: bool = False) -> Callable[[Converter], Converter]:
    """Register ``fn(builder, node)`` as the ncnn converter of the canonical ``op_types`` (``"Conv"``...).

    ``any_batch_dim``: the converter maps its inputs through :meth:`NcnnBuilder.batch_dim` / ``ncnn_axis``, so
    it also takes values whose batch is not dim 0; without it the builder refuses such inputs before calling it.
    ``multi_output``: the op's node has several outputs (its value is a tuple, read by ``getitem`` nodes); the
    converter writes one layer and gives those ``getitem`` nodes their blobs. Other tuple-valued nodes are index
    arithmetic the builder skips.
    ``high_rank``: the converter takes values of more than 4 dims besides the batch (MaxViT's window partition
    ``(N, C, H / p, p, W / p, p)``), whose ncnn blob holds the elements in torch's order with the outer dims
    merged (:meth:`NcnnBuilder.stored_shape`); without it the builder refuses such inputs before calling it.
    """

    def deco(fn: Converter) -> Converter:
        for t in op_types:
            NCNN_CONVERTERS.register(t, fn, override=override)
            (_ANY_BATCH_DIM.add if any_batch_dim else _ANY_BATCH_DIM.discard)(t.lower())
            (_MULTI_OUTPUT.add if multi_output else _MULTI_OUTPUT.discard)(t.lower())
            (_HIGH_RANK.add if high_rank else _HIGH_RANK.discard)(t.lower())
        return fn

    return deco


def takes_any_batch_dim(op: str) -> bool:
    """Whether ``op``'s converter was registered with ``any_batch_dim=True``."""
    return op.lower() in _ANY_BATCH_DIM


def converts_tuples(op: str) -> bool:
    """Whether ``op``'s converter was registered with ``multi_output=True``."""
    return op.lower() in _MULTI_OUTPUT


def takes_high_rank(op: str) -> bool:
    """Whether ``op``'s converter was registered with ``high_rank=True``."""
    return op.lower() in _HIGH_RANK
