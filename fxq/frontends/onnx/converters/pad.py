"""``Pad``: ``Pad-2`` (pads and fill as attributes; onnx2torch read the fill from the wrong attribute name and padded
with 0), and ``Pad-11`` and later: an optional ``axes`` input (18) and ``wrap`` mode (19).

``axes`` must be constant; ``pads`` and ``constant_value`` computed at run time give :class:`OnnxPadRuntime`. ONNX
lists ``[begin of each axis..., end of each axis...]``; ``torch.nn.functional.pad`` wants ``(begin, end)`` pairs
from the last dimension backwards. ``F.pad``'s reflect / replicate / circular modes pad only the last 1-3 dims of a
tensor of one or two more dims (onnx2torch's Pad-11/13 raised at run time for ``reflect`` / ``edge`` on a 4-D
tensor's channel or batch dim): other pads are gathered along each dim (:func:`_gather_pad`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from onnx2torch.onnx_graph import OnnxGraph
from onnx2torch.onnx_node import OnnxNode
from onnx2torch.utils.common import OperationConverterResult
from torch import nn

from fxq.frontends.onnx.converters._common import const_input, int_list, rank_of, result, text
from fxq.frontends.onnx.converters.registry import register_onnx_converter
from fxq.frontends.onnx.cut import follows_data_shaped

__all__ = ["OnnxPad", "OnnxPadRuntime"]

_TORCH_MODE = {"constant": "constant", "reflect": "reflect", "edge": "replicate", "wrap": "circular"}


def _source_index(n_out: int, begin: int, n: int, mode: str) -> torch.Tensor:
    """Input index of each output position of one padded dim."""
    src = torch.arange(n_out) - begin
    if mode == "reflect":
        period = 2 * n - 2
        m = torch.remainder(src, period) if period else torch.zeros_like(src)
        return torch.where(m < n, m, period - m)
    if mode == "replicate":
        return src.clamp(0, n - 1)
    return torch.remainder(src, n)  # circular


def _gather_pad(x: torch.Tensor, pads: list[int], mode: str) -> torch.Tensor:
    """``F.pad`` for the non-constant modes on any dims: one ``index_select`` per padded dim. Negative pads crop
    first, so ``wrap`` continues from the cropped edge, as onnxruntime does."""
    for k in range(len(pads) // 2):
        begin, end = pads[2 * k], pads[2 * k + 1]
        if begin == 0 and end == 0:
            continue
        d = x.dim() - 1 - k
        x = x.narrow(d, max(-begin, 0), x.shape[d] - max(-begin, 0) - max(-end, 0))
        begin, end, n = max(begin, 0), max(end, 0), x.shape[d]
        x = x.index_select(d, _source_index(n + begin + end, begin, n, mode).to(x.device))
    return x


def _torch_pads_it(mode: str, pads: list[int], rank: int) -> bool:
    """Whether ``F.pad`` pads like this: constant always; other modes on the last 1-3 dims of a tensor with one or
    two more dims, without crops."""
    depth = len(pads) // 2
    return mode == "constant" or (1 <= depth <= 3 and rank in (depth + 1, depth + 2) and min(pads, default=0) >= 0)


class OnnxPad(nn.Module):
    """``F.pad`` with fixed pads.

    Args:
        pads: torch order, ``(last_begin, last_end, second_last_begin, ...)``.
        mode: a torch padding mode.
        value: fill value for ``constant`` mode.
        rank: the input's rank when shape inference knows it (then fx traces through the module).
    """

    def __init__(self, pads: list[int], mode: str, value: float = 0.0, rank: int | None = None) -> None:
        super().__init__()
        self.pads = list(pads)
        self.mode = mode
        self.value = value
        self.rank = rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "constant":
            return F.pad(x, self.pads, mode="constant", value=self.value)
        if not _torch_pads_it(self.mode, self.pads, self.rank if self.rank is not None else x.dim()):
            return _gather_pad(x, self.pads, self.mode)
        return F.pad(x, self.pads, mode=self.mode)

    def extra_repr(self) -> str:
        return f"pads={self.pads}, mode={self.mode!r}, value={self.value}"


class OnnxPadRuntime(nn.Module):
    """``Pad`` whose pads (and fill) are computed at run time (scripted code: silero VAD's reflect pad of the
    waveform): the same rules as :class:`OnnxPad`, on the pads of each call. A leaf of fx traces (it reads the pads'
    values).

    Args:
        mode: a torch padding mode.
        axes: the ONNX ``axes`` the pads apply to (None: all, in order).
    """

    def __init__(self, mode: str, axes: list[int] | None = None) -> None:
        super().__init__()
        self.mode = mode
        self.axes = None if axes is None else list(axes)

    def forward(self, x: torch.Tensor, pads: torch.Tensor, value: torch.Tensor | None = None) -> torch.Tensor:
        fixed = OnnxPad(torch_pads([int(p) for p in pads.reshape(-1).tolist()], self.axes, x.dim()), self.mode,
                        float(value.reshape(-1)[0]) if value is not None and value.numel() else 0.0, x.dim())
        return fixed(x)

    def extra_repr(self) -> str:
        return f"mode={self.mode!r}, axes={self.axes}"


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


def _mode(node: OnnxNode) -> str:
    """The node's ``mode`` as ``F.pad`` names it."""
    mode = text(node.attributes.get("mode", "constant"))
    if mode not in _TORCH_MODE:
        raise NotImplementedError(f"Pad: mode {mode!r} is not one of {sorted(_TORCH_MODE)}")
    return _TORCH_MODE[mode]


@register_onnx_converter("Pad", (11, 13, 18, 19, 21, 23, 24, 25), override=True)
def _convert_pad(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    mode = _mode(node)
    axes_t = const_input(node, graph, 3, "axes")
    axes = int_list(axes_t) if axes_t is not None else None
    try:
        pads_t = const_input(node, graph, 1, "pads")
        value_t = const_input(node, graph, 2, "constant_value")
    except NotImplementedError:  # computed at run time
        index = next(i for i, n in enumerate(graph.proto.node) if n == node.proto)
        if follows_data_shaped(graph.proto, [index]):
            raise NotImplementedError("Pad: pads computed at run time from a value-dependent size (after NonZero / "
                                      "NMS): post-processing, which a cut leaves out") from None
        inputs = [v for v in node.input_values[:3] if v]
        return result(OnnxPadRuntime(mode, axes), node, inputs)
    data = node.input_values[0]
    rank = rank_of(graph, data)
    pads = torch_pads(int_list(pads_t), axes, rank)
    value = value_t.reshape(-1)[0].item() if value_t is not None and value_t.numel() else 0.0
    return result(OnnxPad(pads, mode, value, rank), node, [data])


@register_onnx_converter("Pad", (1, 2), override=True)
def _convert_pad_attributes(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    """``Pad-2`` (``pads``, ``value``) and ``Pad-1`` (``paddings``, ``value``): the same layout as Pad-11's inputs."""
    mode = _mode(node)
    onnx_pads = node.attributes.get("pads", node.attributes.get("paddings"))
    if onnx_pads is None:
        raise NotImplementedError("Pad: neither the 'pads' nor the 'paddings' attribute is set")
    data = node.input_values[0]
    rank = rank_of(graph, data)
    pads = torch_pads([int(p) for p in onnx_pads], None, rank)
    return result(OnnxPad(pads, mode, float(node.attributes.get("value", 0.0)), rank), node, [data])
