"""``Pad-18`` and later: an optional ``axes`` input (18) and ``wrap`` mode (19).

``pads``, ``constant_value`` and ``axes`` must be constant. ONNX lists ``[begin of each axis..., end of each
axis...]``; ``torch.nn.functional.pad`` wants ``(begin, end)`` pairs from the last dimension backwards.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from onnx2torch.onnx_graph import OnnxGraph
from onnx2torch.onnx_node import OnnxNode
from onnx2torch.utils.common import OperationConverterResult
from torch import nn

from fxq.frontends.onnx.converters._common import const_input, int_list, rank_of, result
from fxq.frontends.onnx.converters.registry import register_onnx_converter

__all__ = ["OnnxPad"]

_TORCH_MODE = {"constant": "constant", "reflect": "reflect", "edge": "replicate", "wrap": "circular"}


class OnnxPad(nn.Module):
    """``F.pad`` with fixed pads.

    Args:
        pads: torch order, ``(last_begin, last_end, second_last_begin, ...)``.
        mode: a torch padding mode.
        value: fill value for ``constant`` mode.
    """

    def __init__(self, pads: list[int], mode: str, value: float = 0.0) -> None:
        super().__init__()
        self.pads = list(pads)
        self.mode = mode
        self.value = value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "constant":
            return F.pad(x, self.pads, mode="constant", value=self.value)
        return F.pad(x, self.pads, mode=self.mode)

    def extra_repr(self) -> str:
        return f"pads={self.pads}, mode={self.mode!r}, value={self.value}"


def torch_pads(onnx_pads: list[int], axes: list[int] | None, rank: int | None) -> list[int]:
    """ONNX pads (for ``axes``, default all) -> ``F.pad`` order, covering only the trailing dims that are padded."""
    n = len(onnx_pads) // 2
    if axes is None:
        axes = list(range(n))
        rank = n
    if len(axes) != n:
        raise NotImplementedError(f"Pad: {len(onnx_pads)} pads for {len(axes)} axes")
    per_dim: dict[int, tuple[int, int]] = {}  # negative dim index -> (begin, end)
    for i, a in enumerate(axes):
        if a >= 0:
            if rank is None:
                raise NotImplementedError("Pad: non-negative axes need the input's rank, which shape inference lacks")
            a -= rank
        per_dim[a] = (onnx_pads[i], onnx_pads[n + i])
    depth = max((-a for a, p in per_dim.items() if p != (0, 0)), default=0)
    out: list[int] = []
    for k in range(1, depth + 1):
        out.extend(per_dim.get(-k, (0, 0)))
    return out


@register_onnx_converter("Pad", (18, 19, 21, 23, 24, 25))
def _convert_pad(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    mode = node.attributes.get("mode", "constant")
    if mode not in _TORCH_MODE:
        raise NotImplementedError(f"Pad: mode {mode!r} is not one of {sorted(_TORCH_MODE)}")
    pads_t = const_input(node, graph, 1, "pads")
    value_t = const_input(node, graph, 2, "constant_value")
    axes_t = const_input(node, graph, 3, "axes")
    data = node.input_values[0]
    pads = torch_pads(int_list(pads_t), int_list(axes_t) if axes_t is not None else None, rank_of(graph, data))
    value = value_t.reshape(-1)[0].item() if value_t is not None and value_t.numel() else 0.0
    return result(OnnxPad(pads, _TORCH_MODE[mode], value), node, [data])
