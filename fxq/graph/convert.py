"""After calibration: alignment, passive parameters, baking, and switching between FP32 and quantized."""
from __future__ import annotations

import contextlib
import logging
from typing import Iterator

import torch
from torch import fx

from fxq.errors import ConfigError
from fxq.functional import (
    accumulator_reach,
    broadcast_qparam,
    fake_quantize,
    integer_reciprocal_scale,
    qparams_from_minmax,
    quantize_to_int,
    representable_range,
    round_scale_to_power_of_2,
)
from fxq.graph.info import GraphQuant, graph_quant, is_quantizer_node
from fxq.graph.nodes import get_attr_value
from fxq.graph.op_types import CLIP_BOUNDS, op_type, stores_clip_bounds
from fxq.graph.quant_graph import QuantGraph
from fxq.nn.fake_quantize import FakeQuantize
from fxq.observers.base import channel_rows
from fxq.spec import QuantState

__all__ = [
    "apply_alignment",
    "snap_softmax_scales",
    "is_baked",
    "passive_bias_scale",
    "quant_scheme",
    "derive_passive_parameters",
    "bake_parameters",
    "unbake_parameters",
    "convert",
    "switch_to_fp32",
    "switch_to_quantized",
    "fp32_mode",
]

logger = logging.getLogger(__name__)


def apply_alignment(gm: fx.GraphModule) -> None:
    """Elementwise inputs share the largest range; concat/resize inputs take the output's parameters; then softmax
    outputs get the scales a fused runtime kernel needs (:func:`snap_softmax_scales`).

    When one member's grid already covers every other member's range (always, for symmetric members) all
    take that member's parameters, so aligning again changes nothing; otherwise the union of the ranges
    is mapped onto the grid. (Re-deriving a symmetric scale from its own range ``[-128 s, 127 s]`` would
    grow it by 256/255 on every pass: the algorithms re-align after each run.)
    """
    graph_quant(gm)  # a model fxq did not prepare: its error, not a silent no-op
    qs = QuantGraph(gm)
    for group in qs.alignment_groups():
        if group.kind == "largest":
            _align_to_largest([qs[n] for n in group.members])
        else:
            _align_to_output([qs[n] for n in group.members], qs[group.target])
    snap_softmax_scales(gm, qs)


@torch.no_grad()
def snap_softmax_scales(gm: fx.GraphModule, quant_graph: QuantGraph | None = None) -> list[str]:
    """Give each quantized softmax output that a runtime fuses (a reader on a platform with
    ``integer_softmax_reciprocal``: onnxruntime runs DequantizeLinear -> Softmax -> QuantizeLinear as QLinearSoftmax,
    which multiplies by ``floor(1 / y_scale)``) a scale whose reciprocal is that integer
    (:func:`~fxq.functional.integer_reciprocal_scale`); returns the quantizers changed.

    Otherwise the fused kernel quantizes with a grid up to one part in ``1 / scale`` coarser than the Q node the
    file writes and fxq simulates: ~0.4 % for a softmax whose largest value is near 1, which moved one code in 6 of
    an attention's outputs in a default session (tests/test_ort_optimizations.py). The scale grows by under that,
    so the range stays covered. Run by :func:`apply_alignment`, so every re-alignment (after LSQ / BRECQ learn
    scales) snaps again."""
    from fxq.graph.info import NodeQuant
    from fxq.qconfig.base import PLATFORMS, get_platform

    quant_graph = quant_graph or QuantGraph(gm)
    modules = dict(gm.named_modules())
    changed = []
    for name, fq in quant_graph.quantizers("activation"):
        cfg = fq.config
        node = quant_graph.node_of(name)
        if fq.aligned:  # a member of an alignment group keeps the group's shared grid
            continue
        source = node.args[0] if node is not None and node.args else None
        if (not cfg.has_qparams or not cfg.is_quantizing or cfg.per_channel or cfg.is_floating
                or not isinstance(source, fx.Node) or op_type(source, modules) != "Softmax"):
            continue
        platforms = {nq.platform for u in node.users if isinstance(nq := u.meta.get("fxq"), NodeQuant)}
        if not any(p in PLATFORMS and get_platform(p).integer_softmax_reciprocal for p in platforms):
            continue
        snapped = integer_reciprocal_scale(fq.scale)
        if not torch.equal(snapped, fq.scale.detach()):
            fq.set_qparams(snapped, fq.offset.detach().clone(), state=cfg.state)
            changed.append(name)
    if changed:
        logger.debug("softmax output scales made integer reciprocals (QLinearSoftmax): %s", changed)
    return changed


def _align_to_largest(group: list[FakeQuantize]) -> None:
    members = [m for m in group if m.config.has_qparams and m.config.is_quantizing]
    if len(members) < 2 or any(m.config.per_channel for m in members):
        return
    ranges = [representable_range(m.config, m.scale, m.offset) for m in members]
    lo = torch.stack([r[0] for r in ranges]).min(0).values
    hi = torch.stack([r[1] for r in ranges]).max(0).values
    widest = next((m for m, r in zip(members, ranges) if bool((r[0] <= lo).all() and (r[1] >= hi).all())), None)
    for m in members:
        if widest is not None and quant_scheme(m) == quant_scheme(widest):
            scale, offset = widest.scale.detach().clone(), widest.offset.detach().clone()
        else:
            scale, offset = qparams_from_minmax(lo, hi, m.config)
        m.set_qparams(scale, offset, state=m.config.state)


def _align_to_output(members: list[FakeQuantize], target: FakeQuantize) -> None:
    if not target.config.is_quantizing:
        return
    for m in members:
        if m is target or not m.config.is_quantizing or m.config.per_channel:
            continue
        if quant_scheme(m) != quant_scheme(target):
            continue
        m.set_qparams(target.scale.detach().clone(), target.offset.detach().clone(), state=m.config.state)


def quant_scheme(fq: FakeQuantize) -> tuple:
    """What two quantizers must share to share parameters: bits, symmetry, range, FP format, power-of-2 scales."""
    return fq.scheme.grid


def derive_passive_parameters(gm: fx.GraphModule) -> None:
    """Bias scale = input scale x weight scale (offset 0); a bias with no quantized input stays FP32."""
    graph_quant(gm)  # a model fxq did not prepare: its error, not a silent no-op
    qs = QuantGraph(gm)
    for bias_name, bias, data_q, weight_q in qs.biases():
        if (data_q is None or weight_q is None or not qs[data_q].config.is_quantizing
                or not qs[weight_q].config.is_quantizing):
            bias.config.state = QuantState.FP32
            continue
        value = get_attr_value(gm, bias.param) if bias.param is not None else None
        s_in, wq = qs[data_q].scale.detach(), qs[weight_q]
        scale = passive_bias_scale(s_in, wq.scale.detach(), None if value is None else value.numel(),
                                   bias.config.per_channel, bias_name)
        if value is not None and _widen_zero_weight_channels(gm, wq, value, scale, bias.config.quant_max):
            scale = passive_bias_scale(s_in, wq.scale.detach(), value.numel(), bias.config.per_channel, bias_name)
        _leave_accumulator_room(gm, bias, qs[data_q], wq)
        bias.set_qparams(scale, torch.zeros_like(scale), state=QuantState.PASSIVE)


def _leave_accumulator_room(gm: fx.GraphModule, bias: FakeQuantize, data: FakeQuantize, wq: FakeQuantize) -> None:
    """Narrow an integer bias grid by the largest ``sum(input codes x weight codes)`` its op can accumulate.

    Integer kernels (onnxruntime's QLinearConv / QGemm, which a default session fuses every exported Q/DQ
    Conv / Gemm into) add the bias codes to that sum in an int32 accumulator that wraps. Bias codes sit near the
    int32 limits only when the input scale is tiny (vanishing activations, a dead branch: scale at its floor), and
    there the sum pushed them past the limit: the file computed an output at the other end of its range. With this
    room nothing wraps and every runtime adds what fxq simulates; ordinary biases are far inside and unchanged.
    """
    cfg = bias.config
    if cfg.is_floating or wq.param is None or data.config.is_floating or wq.config.is_floating:
        return
    full_min, full_max = -(2 ** (cfg.num_bits - 1)), 2 ** (cfg.num_bits - 1) - 1
    weight = wq.fp32_backup if wq.baked else get_attr_value(gm, wq.param)
    if weight is None or weight.dim() < 2:
        return
    axis = wq.config.channel_axis  # the op's output channels (1 for ConvTranspose), per-tensor weights too
    offset = broadcast_qparam(wq.offset.detach().to(torch.int64), weight, axis)
    codes = quantize_to_int(weight, wq.config).to(torch.int64) - offset
    zero = float(data.offset.detach().reshape(-1)[0]) if data.offset is not None else 0.0
    reach = int(accumulator_reach(codes, axis, data.config.quant_min, data.config.quant_max, zero).max()) + 1
    if reach >= full_max // 2:  # an accumulator this wide is not a runtime's: keep the full grid
        return
    cfg.quant_min, cfg.quant_max = full_min + reach, full_max - reach


def _widen_zero_weight_channels(gm: fx.GraphModule, wq: FakeQuantize, bias: torch.Tensor, scale: torch.Tensor,
                                limit: float) -> bool:
    """Raise the weight scale of all-zero output channels whose bias does not fit the bias grid ``s_in * s_w``.

    An all-zero weight channel (a pruned or zero-gamma BatchNorm channel folded in) gets the smallest scale,
    so its bias would clip at the integer limit; any scale represents zeros exactly, so the channel takes the
    smallest that fits its bias. True when a scale changed.
    """
    if not wq.config.per_channel or scale.numel() != bias.numel() or wq.scale.numel() != bias.numel():
        return False
    need = bias.detach().abs().reshape(-1).to(scale) / limit
    over = need > scale
    if not bool(over.any()):
        return False
    if wq.param is None:
        return False
    weight = wq.fp32_backup if wq.baked else get_attr_value(gm, wq.param)
    zero = channel_rows(weight, wq.config).abs().amax(dim=1) == 0
    fix = over & zero.to(over.device)
    if not bool(fix.any()):
        return False
    s_w = wq.scale.detach().clone().reshape(-1)
    s_w[fix] = torch.maximum(s_w[fix], need[fix] / scale[fix] * s_w[fix] * (1 + 1e-6))
    if wq.config.power_of_2:
        s_w = round_scale_to_power_of_2(s_w)
    wq.set_qparams(s_w.reshape(wq.scale.shape), wq.offset.detach().clone(), state=wq.config.state)
    return True


def passive_bias_scale(s_in: torch.Tensor, s_w: torch.Tensor, n_bias: int | None, per_channel: bool,
                       name: str = "bias") -> torch.Tensor:
    """``s_in * s_w`` per output channel (one value per tensor when not ``per_channel``), the one bias grid of
    PTQ and QAT. A grouped ConvTranspose has C_out / groups weight scales (axis 1) for C_out outputs: output
    ``o`` uses weight scale ``o % (C_out / groups)``."""
    scale = torch.clamp(s_in.reshape(-1)[:1] * s_w.reshape(-1), min=1e-30)
    if not per_channel:
        return scale[:1]
    if n_bias is None or n_bias == scale.numel():
        return scale
    if n_bias % scale.numel():
        raise ConfigError(f"{name}: {n_bias} bias channels for {scale.numel()} weight scales; quantize this "
                          f"weight per channel along its output channels, or the bias per tensor")
    return scale.repeat(n_bias // scale.numel())


def _passive_constant_sites(gm: fx.GraphModule):
    """(key, getter, setter, quantizer) for clip bounds and pad values of ops on platforms that quantize them."""
    from fxq.graph.info import NodeQuant
    from fxq.qconfig.base import PLATFORMS, get_platform

    platforms: dict[str, bool] = {}
    modules = dict(gm.named_modules())
    for node in gm.graph.nodes:
        nq = node.meta.get("fxq")
        if not isinstance(nq, NodeQuant) or not nq.quantized or nq.op_type not in ("Clip", "Pad"):
            continue
        if nq.platform not in platforms:
            platforms[nq.platform] = nq.platform in PLATFORMS and get_platform(nq.platform).quantize_passive_constants
        q = nq.output or next((v for v in nq.inputs.values() if v), None)
        if not platforms[nq.platform] or q is None:
            continue
        mod = modules.get(node.target) if node.op == "call_module" else None
        if stores_clip_bounds(mod):
            for attr in ("min_val", "max_val"):
                if getattr(mod, attr, None) is None:  # an OnnxClip's open side
                    continue
                yield (f"{node.name}.{attr}", lambda m=mod, a=attr: getattr(m, a),
                       lambda v, m=mod, a=attr: setattr(m, a, v), q)
        elif node.op == "call_function" and nq.op_type == "Pad":
            idx = 3
            if len(node.args) > idx or "value" in node.kwargs:
                yield from _arg_site(node, idx, "value", q)
        elif node.op == "call_function":
            for idx, kw in CLIP_BOUNDS.get(getattr(node.target, "__name__", "").rstrip("_"), ()):
                yield from _arg_site(node, idx, kw, q)


def _arg_site(node: fx.Node, idx: int, kw: str, q: str):
    def get(n=node, i=idx, k=kw):
        return n.args[i] if len(n.args) > i else n.kwargs.get(k)

    def put(v, n=node, i=idx, k=kw):
        if len(n.args) > i:
            args = list(n.args)
            args[i] = v
            n.args = tuple(args)
        else:
            n.kwargs = {**n.kwargs, k: v}

    if isinstance(get(), (int, float)):
        yield (f"{node.name}.{kw}", get, put, q)


def _bake_constants(gm: fx.GraphModule) -> None:
    store = gm.meta.setdefault("fxq_fp32_constants", {})
    qs = QuantGraph(gm)
    changed = False
    for key, get, put, q in list(_passive_constant_sites(gm)):
        fq = qs[q]
        if key in store or not fq.config.is_quantizing or fq.config.per_channel:
            continue
        value = float(get())
        store[key] = value
        put(float(fake_quantize(torch.tensor([value]), fq.config, fq.scale.cpu(), fq.offset.cpu())))
        changed = True
    if changed:
        gm.recompile()


def _unbake_constants(gm: fx.GraphModule) -> None:
    store = gm.meta.get("fxq_fp32_constants", {})
    if not store:
        return
    for key, _, put, _ in list(_passive_constant_sites(gm)):
        if key in store:
            put(store.pop(key))
    gm.recompile()


@torch.no_grad()
def bake_parameters(gm: fx.GraphModule) -> None:
    """Replace each quantized parameter by its quantized value (state BAKED); keep the FP32 copy.

    Baked quantizers pass values through, so quantized forward passes cost no weight fake-quant. A parameter
    that cannot hold one quantized value for all its readers (a tied weight read unquantized too, or quantized
    differently by two ops) stays FP32, and its quantizers keep their results instead
    (:meth:`~fxq.nn.FakeQuantize.keep_result`). Clip bounds and pad values of platforms with
    ``quantize_passive_constants`` are quantized with their tensor's parameters here too (PASSIVE, as in PPQ),
    and restored by :func:`unbake_parameters`.
    """
    _bake_constants(gm)
    readers: dict[int, tuple[torch.Tensor, list[FakeQuantize]]] = {}  # by tensor: a tied weight has several names
    for _, fq in QuantGraph(gm).weights():
        if fq.config.state in (QuantState.ACTIVATED, QuantState.PASSIVE):
            param = get_attr_value(gm, str(fq.param))
            readers.setdefault(id(param), (param, []))[1].append(fq)
    if not readers:
        return
    unquantized = _unquantized_reads(gm)
    for key, (param, fqs) in readers.items():
        first = fqs[0]
        if key in unquantized or any(fq.scheme != first.scheme or not torch.equal(fq.scale, first.scale)
                                     or not torch.equal(fq.offset, first.offset) for fq in fqs[1:]):
            for fq in fqs:  # one value cannot serve every reader: each quantizer keeps its own result instead
                fq.keep_result()
            continue
        backup = param.detach().clone()  # one copy, shared by the quantizers of a tied weight
        param.data.copy_(fake_quantize(param.detach(), first.config, first.scale, first.offset))
        for fq in fqs:
            fq.fp32_backup = backup
            fq.config.state = QuantState.BAKED if fq.config.state is QuantState.ACTIVATED else \
                QuantState.PASSIVE_BAKED


def _unquantized_reads(gm: fx.GraphModule) -> set[int]:
    """The parameters (by ``id``) read other than through a quantizer, under any of their names: by an op directly
    (a tied embedding read by an FP32 ``Gather`` and a quantized linear), or inside a module the graph calls.
    Baked, they would hand those readers quantized values."""
    found: set[int] = set()
    for node in gm.graph.nodes:
        if node.op == "call_module" and not is_quantizer_node(node):
            found.update(id(p) for _, p in gm.get_submodule(str(node.target)).named_parameters(remove_duplicate=False))
        elif node.op == "get_attr" and not all(is_quantizer_node(u) for u in node.users):
            value = get_attr_value(gm, str(node.target))
            if isinstance(value, torch.Tensor):
                found.add(id(value))
    return found


@torch.no_grad()
def unbake_parameters(gm: fx.GraphModule) -> None:
    """Restore the FP32 parameters saved by :func:`bake_parameters`; states go back to ACTIVATED/PASSIVE."""
    _unbake_constants(gm)
    for _, fq in QuantGraph(gm).weights():
        fq.keep_result(False)
        if not fq.baked:
            continue
        get_attr_value(gm, fq.param).data.copy_(fq.fp32_backup)
        fq.fp32_backup = None
        fq.config.state = QuantState.ACTIVATED if fq.config.state is QuantState.BAKED else QuantState.PASSIVE


def is_baked(gm: fx.GraphModule) -> bool:
    """Whether the model's quantized parameters are baked (their FP32 copies kept aside)."""
    return QuantGraph(gm).is_baked()


def _check_ready(gm: fx.GraphModule) -> None:
    pending = [n for n, fq in QuantGraph(gm).quantizers() if fq.config.state in (QuantState.INITIAL, QuantState.PASSIVE_INIT)]
    if pending:
        shown = ", ".join(pending[:8]) + (" ..." if len(pending) > 8 else "")
        raise ConfigError(
            f"{len(pending)} quantizer(s) have no parameters yet ({shown}): run fxq.calibrate(model, data) first"
        )


def convert(gm: fx.GraphModule, bake: bool = True) -> fx.GraphModule:
    """Final states: every quantizer in quantize mode, parameters baked. Returns ``gm``.

    Learned (LSQ / QAT) scales become fixed buffers, and when nothing is baked yet (a QAT model, or post algorithms
    ran on the FP32 weights), passive (bias) parameters are derived again from the final scales.
    """
    _check_ready(gm)
    for _, fq in QuantGraph(gm).quantizers():
        fq.set_mode("quantize")
        fq.observer = None
        if fq.learnable:
            fq.freeze()
    if isinstance(gm.meta.get("fxq"), GraphQuant) and not is_baked(gm):
        derive_passive_parameters(gm)
    if bake:
        bake_parameters(gm)
    return gm


def switch_to_fp32(gm: fx.GraphModule) -> fx.GraphModule:
    """Run the model in FP32 (the seeds' ``op.dequantize()`` on every op): restore weights, disable quantizers."""
    unbake_parameters(gm)
    for _, fq in QuantGraph(gm).quantizers():
        fq.set_mode("disabled")
    return gm


def switch_to_quantized(gm: fx.GraphModule, bake: bool = True) -> fx.GraphModule:
    """Undo :func:`switch_to_fp32`."""
    for _, fq in QuantGraph(gm).quantizers():
        fq.set_mode("quantize")
    if bake:
        bake_parameters(gm)
    return gm


@contextlib.contextmanager
def fp32_mode(gm: fx.GraphModule) -> Iterator[fx.GraphModule]:
    """Run ``gm`` in FP32 inside the block, quantized again after it (modes and baking restored)."""
    saved = {n: (fq.observe_enabled, fq.quant_enabled) for n, fq in QuantGraph(gm).quantizers()}
    was_baked = is_baked(gm)
    switch_to_fp32(gm)
    try:
        yield gm
    finally:
        for n, fq in QuantGraph(gm).quantizers():
            fq.observe_enabled, fq.quant_enabled = saved[n]
        if was_baked:
            bake_parameters(gm)
