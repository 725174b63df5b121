"""Cross-layer equalization (Nagel et al., "Data-Free Quantization Through Weight Equalization and Bias
Correction", 2019) as a ``"pre"`` algorithm on FP32 weights.

For a group of *upstream* ops ``A`` (Conv / Linear) whose output channels reach *downstream* ops ``B``
only through positively homogeneous ops (ReLU, LeakyReLU, PReLU, max/avg pooling, identity, a flatten of
a 1x1 map; with ``opt_level >= 2`` also residual ``Add``\\ s, whose every input then joins the group),
scaling channel ``c`` of every ``A`` by ``1/s_c`` and the matching input channel of every ``B`` by ``s_c``
leaves the FP32 function unchanged (``relu(x / s) * s == relu(x)`` for ``s > 0``). Choosing
``s_c = sqrt(r_A[c] / r_B[c])`` makes both per-channel weight ranges equal to ``sqrt(r_A r_B)``, which
evens out the channels of per-tensor quantized weights.

Setting (``setting.equalization_setting``):
    opt_level: 1 = chains through unary ops; 2 = also through ``Add``.
    iterations: rounds over all groups (groups that share an op converge together).
    value_threshold: channels whose upstream and downstream ranges are both below it stay unscaled
        (near-dead channels; scaling them only amplifies noise).
    including_bias / bias_multiplier: the upstream range of a channel is at least ``|bias| * multiplier``.
    including_act / act_multiplier: the upstream range is at least ``max|A(x)| * multiplier`` on the
        calibration data (the activation then shrinks along with the weights).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import fx

from fxq.algorithms.blocks import param_target
from fxq.algorithms.pipeline import register_algorithm
from fxq.checked import Checked, checked_setting, opt
from fxq.graph.data import first_batch_errors, iter_batches, placeholder_values
from fxq.graph.info import NodeQuant, is_quantizer_node
from fxq.graph.nodes import Interpreter, get_attr_value
from fxq.nn.fake_quantize import fake_quant_mode

__all__ = ["EqualizationSetting", "EqualizationGroup", "find_equalization_groups", "equalize", "cross_layer_equalization"]

logger = logging.getLogger(__name__)

HOMOGENEOUS_OPS = frozenset({"Relu", "LeakyRelu", "PRelu", "MaxPool", "AveragePool", "GlobalAveragePool",
                             "GlobalMaxPool", "Identity"})
"""Op types with ``f(s * x) = s * f(x)`` per channel for ``s > 0``."""
_FLATTEN_OPS = frozenset({"Flatten", "Reshape", "Squeeze"})
_MAX_STEP = 16.0  # largest per-iteration channel scale (numerical guard; iterations compound)


@dataclasses.dataclass
class EqualizationGroup:
    """Upstream ops whose output channels are scaled down and downstream ops whose inputs are scaled up."""

    upstream: list[fx.Node]
    downstream: list[fx.Node]
    channels: int


def _op_type(node: fx.Node) -> str | None:
    nq = node.meta.get("fxq")
    return nq.op_type if isinstance(nq, NodeQuant) else None


def _weighted(node: fx.Node) -> bool:
    """A Conv (not transposed) or Linear with a parameter weight used by this node only."""
    if _op_type(node) not in ("Conv", "Gemm") or node.op != "call_function":
        return False
    if node.target not in (F.linear, torch.conv1d, torch.conv2d, torch.conv3d, F.conv1d, F.conv2d, F.conv3d):
        return False
    target = param_target(node, 1)
    if target is None:
        return False
    users = [n for n in node.graph.nodes if n.op == "get_attr" and n.target == target]
    return len(users) == 1 and len(users[0].users) == 1


def _groups(node: fx.Node) -> int:
    if _op_type(node) != "Conv":
        return 1
    return int(node.args[6]) if len(node.args) > 6 else int(node.kwargs.get("groups", 1))


def _channel_preserving_flatten(node: fx.Node) -> bool:
    src = node.args[0] if node.args else None
    val = src.meta.get("val") if isinstance(src, fx.Node) else None
    out = node.meta.get("val")
    return (isinstance(val, torch.Tensor) and isinstance(out, torch.Tensor) and val.dim() > 2
            and all(int(d) == 1 for d in val.shape[2:]) and out.dim() == 2)


def _data_input(node: fx.Node) -> Any:
    return node.args[0] if node.args else None


def _find_group(start: fx.Node, opt_level: int, taken: set[fx.Node]) -> EqualizationGroup | None:
    ups: list[fx.Node] = []
    downs: list[fx.Node] = []
    members: set[fx.Node] = set()
    work: list[tuple[fx.Node, str, fx.Node | None]] = [(start, "bwd", None)]
    while work:
        n, direction, via = work.pop()
        if n in ups or n in downs or n in members:
            if (direction == "fwd" and n in ups) or (direction == "bwd" and n in downs):
                return None  # an op would have to be scaled on both sides
            continue
        t = _op_type(n)
        if direction == "fwd" and _weighted(n) and _data_input(n) is via:
            downs.append(n)
            continue
        if direction == "bwd" and _weighted(n):
            if n in taken:
                return None
            ups.append(n)
            work.extend((u, "fwd", n) for u in n.users)
            continue
        unary = is_quantizer_node(n) or t in HOMOGENEOUS_OPS or (t in _FLATTEN_OPS and _channel_preserving_flatten(n))
        if unary and (direction == "bwd" or _data_input(n) is via):
            members.add(n)
            if direction == "bwd":
                work.append((_data_input(n), "bwd", None))
            work.extend((u, "fwd", n) for u in n.users)
            continue
        if t == "Add" and opt_level >= 2 and len(n.all_input_nodes) == len(
                [a for a in n.args if isinstance(a, fx.Node)]) == 2:
            members.add(n)
            work.extend((a, "bwd", None) for a in n.all_input_nodes if a is not via)
            work.extend((u, "fwd", n) for u in n.users)
            continue
        return None
    if not ups or not downs:
        return None
    chans = {_out_channels(u) for u in ups} | {_in_channels(d) for d in downs}
    if len(chans) != 1:
        return None
    return EqualizationGroup(upstream=ups, downstream=downs, channels=chans.pop())


def _weight(gm: fx.GraphModule, node: fx.Node) -> torch.Tensor:
    return get_attr_value(gm, param_target(node, 1))


def _out_channels(node: fx.Node) -> int:
    return int(get_attr_value(node.graph.owning_module, param_target(node, 1)).shape[0])


def _in_channels(node: fx.Node) -> int:
    w = get_attr_value(node.graph.owning_module, param_target(node, 1))
    return int(w.shape[1]) * _groups(node)


def find_equalization_groups(gm: fx.GraphModule, opt_level: int = 1) -> list[EqualizationGroup]:
    """Every equalizable group of ``gm`` (each upstream op in at most one group)."""
    taken: set[fx.Node] = set()
    groups = []
    for node in gm.graph.nodes:
        if node in taken or not _weighted(node):
            continue
        g = _find_group(node, opt_level, taken)
        if g is None:
            continue
        taken.update(g.upstream)
        groups.append(g)
    return groups


# --------------------------------------------------------------------------- ranges and scaling
def _down_view(w: torch.Tensor, groups: int) -> torch.Tensor:
    """``[g, out/g, in/g, ...]`` view of a downstream weight (input channel = (group, column))."""
    return w.reshape(groups, w.shape[0] // groups, w.shape[1], *w.shape[2:])


def _up_range(w: torch.Tensor) -> torch.Tensor:
    return w.detach().abs().reshape(w.shape[0], -1).amax(dim=1)


def _down_range(w: torch.Tensor, groups: int) -> torch.Tensor:
    v = _down_view(w.detach().abs(), groups)  # [g, og, ig, ...]
    v = v.transpose(1, 2).reshape(groups * w.shape[1], -1)  # rows = input channels
    return v.amax(dim=1)


@torch.no_grad()
def _scale_down(w: torch.Tensor, groups: int, s: torch.Tensor) -> None:
    v = _down_view(w.data, groups)
    v.mul_(s.reshape(groups, 1, w.shape[1], *([1] * (w.dim() - 2))).to(w.dtype))


@torch.no_grad()
def _activation_ranges(gm: fx.GraphModule, nodes: set[fx.Node], data: Any, steps: int | None,
                       collate_fn: Callable | None) -> dict[fx.Node, torch.Tensor]:
    ranges: dict[fx.Node, torch.Tensor] = {}

    class _Recorder(Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            out = super().run_node(n)
            if n in nodes and isinstance(out, torch.Tensor):
                axis = 1 if _op_type(n) == "Conv" else out.dim() - 1
                r = out.detach().abs().movedim(axis, 0).reshape(out.shape[axis], -1).amax(dim=1).float()
                ranges[n] = r if n not in ranges else torch.maximum(ranges[n], r)
            return out

    rec = _Recorder(gm)
    with fake_quant_mode(gm, "disabled"):
        # before calibration: the FP32 model meets the data here first, a first batch it fails on is the data's
        for index, batch in enumerate(iter_batches(data, steps, collate_fn)):
            with first_batch_errors("cross-layer equalization", index == 0):
                rec.run(*placeholder_values(gm, batch).values())
    return ranges


@torch.no_grad()
def equalize(gm: fx.GraphModule, groups: list[EqualizationGroup], iterations: int = 10,
             value_threshold: float = 0.5, bias_multiplier: float | None = None,
             act_ranges: dict[fx.Node, torch.Tensor] | None = None, act_multiplier: float = 0.5) -> None:
    """Rescale the weights of ``groups`` in place (FP32 function unchanged).

    Args:
        bias_multiplier: include ``|bias| * bias_multiplier`` in the upstream range (None: weights only).
        act_ranges: per-channel ``max|output|`` of upstream ops (kept up to date here) to include,
            times ``act_multiplier``.
    """
    for _ in range(max(1, int(iterations))):
        for g in groups:
            r_up = torch.zeros(g.channels)
            for u in g.upstream:
                r = _up_range(_weight(gm, u)).float().cpu()
                b_target = param_target(u, 2)
                if bias_multiplier is not None and b_target is not None:
                    r = torch.maximum(r, get_attr_value(gm, b_target).detach().abs().float().cpu() * bias_multiplier)
                if act_ranges is not None and u in act_ranges:
                    r = torch.maximum(r, act_ranges[u].cpu() * act_multiplier)
                r_up = torch.maximum(r_up, r)
            r_down = torch.zeros(g.channels)
            for d in g.downstream:
                r_down = torch.maximum(r_down, _down_range(_weight(gm, d), _groups(d)).float().cpu())
            s = torch.sqrt(r_up / r_down.clamp_min(1e-12))
            keep = (r_up <= 0) | (r_down <= 0) | ((r_up < value_threshold) & (r_down < value_threshold))
            s = torch.where(keep, torch.ones_like(s), s.clamp(1 / _MAX_STEP, _MAX_STEP))
            for u in g.upstream:
                w = _weight(gm, u)
                w.data.div_(s.to(w.device, w.dtype).reshape(-1, *([1] * (w.dim() - 1))))
                b_target = param_target(u, 2)
                if b_target is not None:
                    b = get_attr_value(gm, b_target)
                    b.data.div_(s.to(b.device, b.dtype))
                if act_ranges is not None and u in act_ranges:
                    act_ranges[u] = act_ranges[u] / s.to(act_ranges[u].device)
            for d in g.downstream:
                w = _weight(gm, d)
                _scale_down(w, _groups(d), s.to(w.device))


@checked_setting("setting.equalization_setting")
class EqualizationSetting(Checked):
    """``setting.equalization_setting``: cross-layer equalization's reach, iterations and thresholds."""

    opt_level: int = opt(1, choices=(1, 2))
    iterations: int = opt(10, ge=1)
    value_threshold: float = opt(0.5, ge=0.0)
    including_bias: bool = False
    bias_multiplier: float = opt(0.5, ge=0.0)
    including_act: bool = False
    act_multiplier: float = opt(0.5, ge=0.0)


@register_algorithm("equalization", stage="pre", order=10, setting=EqualizationSetting)
def cross_layer_equalization(gm: fx.GraphModule, data: Any, setting: Checked,
                             steps: int | None = None, collate_fn: Callable | None = None) -> fx.GraphModule:
    """``setting.equalization``: equalize per-channel weight ranges of Conv/Linear pairs on FP32 weights.

    Example:
        >>> s = fxq.QuantizationSetting(equalization=True)
        >>> s.equalization_setting.opt_level = 2  # through residual adds too
        >>> q = fxq.quantize(model, data, platform="academic_int8", setting=s)
    """
    es = setting.equalization_setting
    groups = find_equalization_groups(gm, opt_level=es.opt_level)
    act_ranges = None
    if es.including_act and groups:
        act_ranges = _activation_ranges(gm, {u for g in groups for u in g.upstream}, data, steps, collate_fn)
    equalize(gm, groups, iterations=es.iterations, value_threshold=es.value_threshold,
             bias_multiplier=es.bias_multiplier if es.including_bias else None,
             act_ranges=act_ranges, act_multiplier=es.act_multiplier)
    logger.info("equalization: %d group(s), %d iteration(s)", len(groups), es.iterations)
    return gm
