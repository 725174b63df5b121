"""fxq's quantization math at the level of a :class:`~fxq.spec.TensorQuantConfig`.

Everything that quantizes (FakeQuantize, observers, exporters) goes through these functions. They pick the
compute dtype and the parameters from the config and run the ``fxq::`` ops (:mod:`fxq.ops`) or the
reference math (:mod:`fxq.numeric.reference`, the one definition of rounding and fake-quant; its names and
the reference backwards of :mod:`fxq.numeric.opspec` are re-exported here).
"""
from __future__ import annotations

import weakref
from typing import Any

import torch

from fxq import fused_cpu, ops
from fxq.errors import ConfigError
from fxq.numeric.opspec import (
    FLOAT,
    LINEAR,
    float_fake_quantize_backward_reference,
    linear_fake_quantize_backward_reference,
)
from fxq.numeric.reference import (
    broadcast_qparam,
    float_fake_quantize_backward_elementwise,
    float_fake_quantize_reference,
    fp_round_to_grid,
    linear_codes,
    linear_fake_quantize_backward_elementwise,
    linear_fake_quantize_reference,
    round_with_policy,
)
from fxq.spec import MIN_SCALE, RoundingPolicy, TensorQuantConfig, integer_range_for_compute

__all__ = [
    "round_with_policy",
    "quantize_to_int",
    "dequantize",
    "dequantize_linear",
    "fake_quantize",
    "linear_fake_quantize_reference",
    "float_fake_quantize_reference",
    "linear_fake_quantize_backward_elementwise",
    "linear_fake_quantize_backward_reference",
    "float_fake_quantize_backward_elementwise",
    "float_fake_quantize_backward_reference",
    "qparams_from_minmax",
    "round_scale_to_power_of_2",
    "broadcast_qparam",
    "representable_range",
    "accumulator_reach",
]


# --------------------------------------------------------------------------- config-level API
def _compute_dtype(x: torch.Tensor, cfg: TensorQuantConfig) -> torch.dtype:
    if integer_range_for_compute(cfg):
        return torch.float64
    return x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32


def _require_qparams(cfg: TensorQuantConfig, x: torch.Tensor) -> None:
    if cfg.scale is None:
        raise ConfigError(f"{cfg!r} has no scale yet: calibrate it (fxq.calibrate) or set_qparams() first")
    cfg.check_channels(x.shape)


def quantize_to_int(x: torch.Tensor, cfg: TensorQuantConfig) -> torch.Tensor:
    """Integer codes of ``x`` (int32; int64 beyond 31 bits). For FP8, the FP8 values as float32."""
    _require_qparams(cfg, x)
    dtype = _compute_dtype(x, cfg)
    xc = x.detach().to(dtype)
    if cfg.is_floating:
        fmt = cfg.fp_format
        s = broadcast_qparam(cfg.scale.to(x.device), xc, cfg.channel_axis)
        v = torch.clamp(xc.float() / s, cfg.quant_min, cfg.quant_max)
        return fp_round_to_grid(v, fmt.mantissa_bits, fmt.min_exponent, cfg.rounding)
    s = broadcast_qparam(cfg.scale.to(x.device, dtype), xc, cfg.channel_axis)
    o = broadcast_qparam(cfg.offset.to(x.device, dtype), xc, cfg.channel_axis)
    q = linear_codes(xc, s, o, cfg.quant_min, cfg.quant_max, cfg.rounding)
    return q.to(torch.int64 if cfg.num_bits > 31 else torch.int32)


def accumulator_reach(weight_codes: torch.Tensor, out_axis: int, input_min: float, input_max: float,
                      input_zero: float) -> torch.Tensor:
    """Per output channel, the largest ``|sum(input codes x weight codes)|`` an integer kernel can accumulate:
    the sum of ``|weight code - zero-point|`` over the channel's weights (``weight_codes``, zero-points already
    taken off; channels along ``out_axis``) times the input codes' largest distance from their zero-point
    (codes in ``[input_min, input_max]``). An int64 tensor. What an int32 bias code needs of room not to wrap."""
    dims = [d for d in range(weight_codes.dim()) if d != out_axis % weight_codes.dim()]
    per_out = weight_codes.to(torch.int64).abs().sum(dim=dims)
    return per_out * int(max(input_zero - input_min, input_max - input_zero))


def representable_range(cfg: TensorQuantConfig, scale: torch.Tensor | None = None,
                        offset: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Lowest and highest real value ``cfg`` represents, per channel: ``(qmin - o) * s``, ``(qmax - o) * s``.

    1-D float64 tensors on the CPU; ``scale``/``offset`` override the config's (e.g. a module's buffers).
    """
    scale = cfg.scale if scale is None else scale
    offset = cfg.offset if offset is None else offset
    s = scale.detach().double().cpu().reshape(-1)
    o = torch.zeros_like(s) if cfg.is_floating or offset is None else offset.detach().double().cpu().reshape(-1)
    return (cfg.quant_min - o) * s, (cfg.quant_max - o) * s


def dequantize(q: torch.Tensor, cfg: TensorQuantConfig, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Real values of integer (or FP8-grid) codes ``q``: ``(q - offset) * scale``."""
    _require_qparams(cfg, q)
    wide = torch.float64 if integer_range_for_compute(cfg) else torch.float32
    if cfg.is_floating:
        qf = q.to(wide)
        return (qf * broadcast_qparam(cfg.scale.to(q.device, wide), qf, cfg.channel_axis)).to(dtype)
    return dequantize_linear(q, cfg.scale, cfg.offset, cfg.channel_axis, dtype, wide)


def dequantize_linear(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, axis: int,
                      dtype: torch.dtype = torch.float32, compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``(q - offset) * scale`` in ``compute_dtype`` (the arithmetic of the fake-quant's last step), as ``dtype``."""
    qf = q.to(compute_dtype)
    s = broadcast_qparam(scale.to(q.device, compute_dtype), qf, axis)
    o = broadcast_qparam(offset.to(q.device, compute_dtype), qf, axis)
    return ((qf - o) * s).to(dtype)


def fake_quantize(
    x: torch.Tensor,
    cfg: TensorQuantConfig,
    scale: torch.Tensor | None = None,
    offset: torch.Tensor | None = None,
    *,
    overwrite: bool = False,
) -> torch.Tensor:
    """Quantize and dequantize ``x`` with ``cfg``; differentiable (STE for x, LSQ for scale/offset).

    ``scale``/``offset`` override the config's tensors (e.g. learnable parameters of a module).
    Runs the ``fxq::`` custom ops: the torch path on CPU, Triton kernels on CUDA.
    ``overwrite=True`` lets the result reuse ``x``'s memory (the fused CPU path then writes in place and
    returns ``x``): only for values nothing else reads, without gradients; same values either way.
    """
    scale = cfg.scale if scale is None else scale
    offset = cfg.offset if offset is None else offset
    if not cfg.per_channel and not x.is_contiguous():
        laid_out = fused_cpu.fusable_layout(x, *(t for t in (scale, offset) if t is not None))
        if laid_out is not None:  # elementwise: the same values, fused, in x's own stride order
            xc, back, copied = laid_out
            # a Parameter is never overwritten, nor through a view (the in-place kernels refuse it as x)
            y = fake_quantize(xc, cfg, scale, offset, overwrite=copied or (overwrite and type(x) is torch.Tensor))
            return y.permute(back)
    # the bindings are eager bookkeeping: a traced call must not read them (dynamo guards a weak dict's keys by
    # position, and a collected key breaks that guard: IndexError in a later compile)
    eager = not torch.compiler.is_compiling()
    bound = _BOUND.get(cfg) if eager and not overwrite else None
    if bound is not None:
        y = bound.run(x, bound_params(cfg, scale, offset), _call_tag(cfg))
        if y is not None:
            return y
    if scale is None:
        _require_qparams(cfg, x)
    if cfg.per_channel:
        cfg.check_channels(x.shape)
    dtype = _compute_dtype(x, cfg)
    xc = x if x.dtype == dtype else x.to(dtype)
    given = (scale, offset)
    scale = scale.to(xc.device)
    axis = cfg.channel_axis if cfg.per_channel else 0
    in_place = overwrite and xc is x and x.device.type == "cpu" and not fused_cpu.records_grad((x, scale, offset))
    if cfg.is_floating:
        fmt = cfg.fp_format
        if in_place and fused_cpu.fake_quant_float_inplace(
            x, scale, axis, fmt.mantissa_bits, fmt.min_exponent, float(cfg.quant_max), int(cfg.rounding)
        ):
            return x
        args = (xc, scale, axis, fmt.mantissa_bits, fmt.min_exponent, float(cfg.quant_max), int(cfg.rounding))
        y = ops.fake_quant_float(*args)
        spec = FLOAT
    else:
        offset = torch.zeros_like(scale) if offset is None else offset.to(xc.device)
        if in_place and fused_cpu.fake_quant_linear_inplace(
            x, scale, offset, axis, int(cfg.quant_min), int(cfg.quant_max), int(cfg.rounding)
        ):
            return x
        args = (xc, scale, offset, axis, int(cfg.quant_min), int(cfg.quant_max), int(cfg.rounding))
        y = ops.fake_quant_linear(*args)
        spec = LINEAR
    # a binding holds the parameter tensors it was made with: one made of fresh copies (moved, a zero offset made
    # here) would never hold again and be made anew at every call
    # a training call (QAT: x or a learned scale records its gradient) is never bound: it does not count as a call
    # that repeats
    if (eager and not overwrite and xc is x
            and not fused_cpu.records_grad(args[:spec.num_tensors])
            and all(a is b for a, b in zip(given, args[1:spec.num_tensors])) and _repeated(cfg, x)):
        bound = ops.bind(spec, args, _call_tag(cfg))
        if bound is not None:
            _BOUND[cfg] = bound
    return y if y.dtype == x.dtype else y.to(x.dtype)


_BOUND: weakref.WeakKeyDictionary[TensorQuantConfig, Any] = weakref.WeakKeyDictionary()
"""The last bound call of each config (:func:`fxq.ops.bind`: the fused graph on CPU, the kernel launch on CUDA): a quantizer runs the same call batch after
batch, and the binding saves the per-call checks; it holds only while the config's attributes stay as they were."""


def bound_call(cfg: TensorQuantConfig, x: torch.Tensor, scale: torch.Tensor,
               offset: torch.Tensor | None) -> tuple[Any, tuple] | None:
    """The binding :func:`fake_quantize` holds for ``cfg`` on tensors of ``x``'s shape and dtype with these very
    ``scale`` / ``offset`` tensors, and the tag to run it with (``binding.run(x, params, tag)``, params as
    :func:`bound_params` gives them); None when it holds none for them. The pair stays right while ``cfg.revision``
    is the same (a caller that checks that skips the config-level work of a call)."""
    bound = _BOUND.get(cfg)
    if bound is None or bound.shape != x.shape or bound.dtype != x.dtype:
        return None  # none, or one made for other calls (the last repeated shape)
    params = bound_params(cfg, scale, offset)
    if len(bound.params) != len(params) or any(a is not b for a, b in zip(bound.params, params)):
        return None
    tag = _call_tag(cfg)
    return (bound, tag) if bound.tag == tag else None


def bound_params(cfg: TensorQuantConfig, scale: torch.Tensor, offset: torch.Tensor | None) -> tuple:
    """The parameter tensors a binding of ``cfg`` runs on: the scale, and the offset of a linear grid."""
    return (scale,) if cfg.is_floating else (scale, offset)


_LAST_UNBOUND: weakref.WeakKeyDictionary[TensorQuantConfig, tuple] = weakref.WeakKeyDictionary()
"""The shape, dtype and device of each config's last call that ran without a binding."""


def _repeated(cfg: TensorQuantConfig, x: torch.Tensor) -> bool:
    """Whether ``cfg``'s previous unbound call had ``x``'s shape, dtype and device. Making a binding costs (a CUDA one
    launches the kernel once more, a CPU one plans the call at x's own rank and may compile its graph): worth it for a
    call that repeats, not for one whose shape changes every time (text of varying length, a last smaller batch)."""
    key = (x.shape, x.dtype, x.device)
    last = _LAST_UNBOUND.get(cfg)
    _LAST_UNBOUND[cfg] = key
    return last == key


def _call_tag(cfg: TensorQuantConfig) -> tuple:
    """Everything of ``cfg`` the op's arguments are made of (a binding made under other values does not hold)."""
    return (cfg.quant_min, cfg.quant_max, cfg.rounding, cfg.per_channel, cfg.channel_axis, cfg.fp_format)


# --------------------------------------------------------------------------- parameters
def round_scale_to_power_of_2(scale: torch.Tensor, policy: RoundingPolicy = RoundingPolicy.UP) -> torch.Tensor:
    """``2 ** round(log2(scale))`` under ``policy`` (UP by default, so nothing new gets clipped)."""
    exp = round_with_policy(torch.log2(scale.double()), policy)
    return torch.pow(2.0, exp).to(scale.dtype)


def integer_reciprocal_scale(scale: torch.Tensor) -> torch.Tensor:
    """The float32 scale on which a runtime computing with ``floor(1 / scale)`` (onnxruntime's QLinearSoftmax)
    and one dividing by the scale agree: ``k = floor(1 / scale)`` in float32, then the largest float32 ``s <= 1 / k``
    whose float32 reciprocal floors to ``k`` (``float32(1 / 7)`` inverts to 6.9999995: one ulp lower inverts to
    7.0000005). ``k`` is taken one ulp below the scale too, so ``float32(1 / 255)`` stays 1 / 255 (not 1 / 254):
    ``s >= scale`` up to an ulp, and the range stays covered."""
    s32 = scale.detach().to(torch.float32)
    k = torch.floor(torch.ones_like(s32) / s32)
    # a scale one rounding below an integer reciprocal (float32(1 / 255) inverts to 254.99998) is that integer's
    k = torch.maximum(k, torch.floor(torch.ones_like(s32) / torch.nextafter(s32, torch.zeros_like(s32)))).clamp_min(1.0)
    out = (1.0 / k.double()).to(torch.float32)
    low = torch.floor(torch.ones_like(out) / out) < k  # one ulp lower always suffices: 1 / k rounds within half an ulp
    return torch.where(low, torch.nextafter(out, torch.zeros_like(out)), out).to(scale.dtype)


def qparams_from_minmax(
    min_val: torch.Tensor, max_val: torch.Tensor, cfg: TensorQuantConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and offset that map ``[min_val, max_val]`` onto ``cfg``'s grid (PPQ's minmax formulas).

    Symmetric signed: ``s = 2 * absmax / (qmax - qmin)``; symmetric unsigned: ``s = max / qmax``;
    floating: ``s = absmax / fp_max``; asymmetric: ``s = (max - min) / (qmax - qmin)`` over a range that
    contains 0, ``offset = qmin + round(-min / s)``. Scales never fall below ``MIN_SCALE``.
    """
    lo = torch.minimum(min_val.detach().double().reshape(-1), torch.zeros(()))
    hi = torch.maximum(max_val.detach().double().reshape(-1), torch.zeros(()))
    qmin, qmax = float(cfg.quant_min), float(cfg.quant_max)
    if cfg.is_floating:
        scale = torch.maximum(-lo, hi) / qmax
    elif cfg.symmetric:
        absmax = torch.maximum(-lo, hi)
        scale = hi / qmax if qmin >= 0 else 2 * absmax / (qmax - qmin)
    else:
        scale = (hi - lo) / (qmax - qmin)
    scale = torch.clamp(scale, min=MIN_SCALE)
    if cfg.power_of_2:
        scale = round_scale_to_power_of_2(scale)
    if cfg.symmetric or cfg.is_floating:
        offset = torch.zeros_like(scale)
    else:
        offset = torch.clamp(qmin + round_with_policy(-lo / scale, cfg.rounding), qmin, qmax)
    return scale.float(), offset.float()
