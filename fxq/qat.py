"""Quantization-aware training: a prepared GraphModule you train in your own loop.

:func:`prepare_qat` traces and prepares the model like :func:`fxq.prepare`, initializes every quantizer on a
few batches (weights from their values, activations with the platform's observer), and swaps each
quantizer for a :class:`QATFakeQuantize` (still a :class:`fxq.FakeQuantize`, so summaries and exporters see
the usual contract). Two ways to track scales while training:

* ``method="lsq"`` (default) / ``"lsq+"``: scales (and, for ``lsq+``, asymmetric offsets) are
  ``nn.Parameter``\\ s learned by your optimizer with LSQ gradients, scaled by ``1/sqrt(N * q_max)`` as in
  the LSQ paper, so plain SGD works too.
* ``method="ema"``: activation ranges follow an exponential moving average of each training batch's
  min/max (``momentum``); weight ranges are the current weights' min/max. Scales are parameters with
  ``requires_grad=False`` (set by the EMA, skipped by optimizers). With ``torch.distributed``
  initialized, batch statistics are all-reduced (min of mins, max of maxes) before the update, so every
  DDP replica keeps the same scales.

Both are plain torch ops (fake-quant through the ``fxq::`` custom op, in-place buffer updates), so the model
compiles with ``torch.compile(fullgraph=True)`` and wraps in ``DistributedDataParallel``. Quantizers that
must share parameters (the inputs of an aligned Add, the inputs and output of a Concat) are one module under
several names, so they stay aligned while training. Bias quantizers (passive) quantize with the current
input scale x weight scale at every step (:class:`QATBiasQuantize`); :func:`fxq.convert` fixes them.

BatchNorm: ``fold_bn=True`` (default) folds it into the preceding conv with its running statistics before
training, so the trained graph is the deployed graph. ``fold_bn=False`` keeps BatchNorm modules (they stay
FP32 and learn with batch statistics); :func:`freeze_bn` then switches them to running statistics for the
last epochs.

Example:
    >>> qat = fxq.prepare_qat(model, "trt_int8", example_inputs=torch.randn(8, 3, 32, 32))
    >>> opt = torch.optim.SGD(qat.parameters(), lr=1e-3, momentum=0.9)
    >>> for x, y in loader:
    ...     loss = F.cross_entropy(qat(x), y); opt.zero_grad(); loss.backward(); opt.step()
    >>> qmodel = fxq.convert(qat.eval())
"""
from __future__ import annotations

import logging
import math
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import fx, nn

from fxq.errors import ConfigError
from fxq.functional import fake_quantize, qparams_from_minmax, representable_range
from fxq.graph.calibrate import calibrate
from fxq.graph.convert import passive_bias_scale, quant_scheme
from fxq.graph.info import QUANTIZERS_ATTR
from fxq.graph.quant_graph import QuantGraph
from fxq.nn.fake_quantize import FakeQuantize
from fxq.observers.base import channel_rows
from fxq.setting import QuantizationSetting
from fxq.spec import MIN_SCALE, QuantState, TensorQuantConfig

__all__ = ["prepare_qat", "freeze_bn", "QATFakeQuantize", "QATBiasQuantize", "FrozenBatchNorm", "QAT_METHODS"]

logger = logging.getLogger(__name__)

QAT_METHODS = ("lsq", "lsq+", "ema")
_BAKED = (QuantState.BAKED, QuantState.PASSIVE_BAKED)


class _GradScale(torch.autograd.Function):
    """The identity forward (``p``'s own values), ``g * grad`` backward: LSQ's gradient scale. The detach idiom
    ``(p - p * g).detach() + p * g`` rounds twice, and moved 0.2-10 % of the scales it was given by an ulp (more
    as ``g`` grows): the training forward then quantized with other scales than the frozen model exports."""

    generate_vmap_rule = True  # torch.func transforms (grad, vmap, jacrev) of an LSQ model

    @staticmethod
    def forward(p: torch.Tensor, g: float) -> torch.Tensor:
        return p.view_as(p)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.g = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.g, None


def _grad_scaled(p: torch.Tensor, g: float) -> torch.Tensor:
    """``p`` in the forward pass, ``g * dL/dp`` in the backward pass (LSQ's gradient scale). One call in a graph
    that dynamo records as it is (it does not speculate the Function at every quantizer); AOTAutograd traces it."""
    return _GradScale.apply(p, g)


torch._dynamo.allow_in_graph(_grad_scaled)


class QATFakeQuantize(FakeQuantize):
    """A :class:`FakeQuantize` that keeps its scale up to date while training.

    ``lsq`` / ``lsq+``: call :meth:`make_learnable`; scale (offset) gradients are multiplied by
    ``grad_scale``. ``ema``: in mode ``"qat"`` and train mode, each forward updates the running range and
    the scale from it; mode ``"quantize"`` (what :func:`fxq.convert` sets) stops updating.

    Args:
        config: the tensor's quantization config (taken over).
        name: quantizer name (error messages).
        method: ``"lsq"``, ``"lsq+"`` or ``"ema"`` (see :mod:`fxq.qat`).
        momentum: EMA momentum of activation ranges (``ema``).
        grad_scale: LSQ gradient scale ``1/sqrt(N * q_max)`` (1 = unscaled).
        track_batches: update EMA statistics from training batches (False for weights: their range is
            taken from the current values every step, without averaging or all-reduce).

    Raises:
        ConfigError: for an unknown method or a momentum outside ``[0, 1)``.
    """

    def __init__(self, config: TensorQuantConfig, name: str = "", method: str = "lsq", momentum: float = 0.9,
                 grad_scale: float = 1.0, track_batches: bool = True) -> None:
        super().__init__(config, name)
        if method not in QAT_METHODS:
            raise ConfigError(f"QAT method {method!r} for quantizer {name!r}; use one of {QAT_METHODS}")
        if not 0.0 <= momentum < 1.0:
            raise ConfigError(f"QAT momentum={momentum} for quantizer {name!r}: must be in [0, 1)")
        self.method = method
        self.momentum = float(momentum)
        self.grad_scale = float(grad_scale)
        self.track_batches = bool(track_batches)
        self.register_buffer("running_min", torch.zeros_like(self.scale))
        self.register_buffer("running_max", torch.zeros_like(self.scale))

    @classmethod
    def from_fake_quantize(cls, fq: FakeQuantize, **kwargs: Any) -> "QATFakeQuantize":
        """A QAT quantizer with ``fq``'s config, parameters and mode."""
        new = cls(fq.config, fq.name, **kwargs)
        new.copy_record(fq)
        new.set_qparams(fq.scale.detach().clone(), fq.offset.detach().clone(), state=None)
        new.observe_enabled, new.quant_enabled = False, fq.quant_enabled
        lo, hi = representable_range(new.config, new.scale, new.offset)
        new.running_min.copy_(lo)
        new.running_max.copy_(hi)
        return new.to(fq.scale.device)

    # ------------------------------------------------------------------ ema
    @torch.no_grad()
    def _update_range(self, x: torch.Tensor) -> None:
        lo, hi = torch.aminmax(channel_rows(x, self.config).float(), dim=1)
        if self.track_batches:
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(lo, op=dist.ReduceOp.MIN)
                dist.all_reduce(hi, op=dist.ReduceOp.MAX)
            lo = torch.lerp(lo, self.running_min, self.momentum)
            hi = torch.lerp(hi, self.running_max, self.momentum)
        self.running_min.copy_(lo)
        self.running_max.copy_(hi)
        scale, offset = qparams_from_minmax(lo, hi, self.config)
        self.scale.copy_(scale.to(self.scale.device))
        self.offset.copy_(offset.to(self.offset.device))

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.observe_enabled and self.config.state not in _BAKED:
            if self.method != "ema":
                with torch.no_grad():
                    self.observer.observe(x)
            elif self.training:
                self._update_range(x)
        if not self.quant_enabled or not self.config.is_quantizing or self.config.state in _BAKED:
            return x
        scale, offset = self.scale, self.offset
        if self.method == "ema" and self.observe_enabled and self.training:
            scale, offset = scale.clone(), offset.clone()  # the buffers change in place on the next call
        # learned where registered as parameters: torch.func.functional_call puts plain tensors in their place
        if "scale" in self._parameters:
            if self.grad_scale != 1.0:
                scale = _grad_scaled(scale, self.grad_scale)
            scale = scale.abs().clamp_min(MIN_SCALE)  # a step past zero flips the sign, never breaks the grid
        if "offset" in self._parameters and self.grad_scale != 1.0:
            offset = _grad_scaled(offset, self.grad_scale)
        return fake_quantize(x, self.config, scale, offset)

    def freeze(self) -> "QATFakeQuantize":
        """Fix learned parameters as buffers; a learned offset is rounded back onto the integer grid."""
        learned_offset = isinstance(self.offset, nn.Parameter)
        super().freeze()
        with torch.no_grad():
            self.scale.copy_(self.scale.abs().clamp_min(MIN_SCALE))
            if learned_offset:
                self.offset.copy_(torch.clamp(torch.round(self.offset), self.config.quant_min, self.config.quant_max))
        return self

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, method={self.method}"


class QATBiasQuantize(FakeQuantize):
    """Passive bias quantizer for QAT: ``scale = |input scale| x |weight scale|`` at every step.

    The input and weight quantizers' scale parameters are registered here too (tied, like shared
    embeddings), so the product follows them through training, device moves and DDP; it is detached, as
    bias scales follow the others and do not learn. :meth:`freeze` (called by :func:`fxq.convert`) fixes
    the product as a buffer and unties the parameters.
    """

    def __init__(self, fq: FakeQuantize, data_q: FakeQuantize, weight_q: FakeQuantize) -> None:
        super().__init__(fq.config, fq.name)
        self.copy_record(fq)
        self.set_qparams(fq.scale.detach().clone(), fq.offset.detach().clone(), state=None)
        self.observe_enabled, self.quant_enabled = False, fq.quant_enabled
        if not (isinstance(data_q.scale, nn.Parameter) and isinstance(weight_q.scale, nn.Parameter)):
            raise ConfigError(f"QAT bias quantizer {fq.name!r}: its input and weight quantizers need parameter "
                              f"scales (prepare_qat makes them)")
        self.input_scale = data_q.scale
        self.weight_scale = weight_q.scale

    @property
    def learnable(self) -> bool:
        return "input_scale" in self._parameters

    def _current_scale(self) -> torch.Tensor:
        s_in, s_w = self._parameters["input_scale"], self._parameters["weight_scale"]
        return passive_bias_scale(s_in.detach().abs(), s_w.detach().abs(), self.scale.numel(),
                                  self.config.per_channel, self.name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.quant_enabled or not self.config.is_quantizing or self.config.state in _BAKED:
            return x
        if not self.learnable:
            return fake_quantize(x, self.config, self.scale, self.offset)
        scale = self._current_scale()
        return fake_quantize(x, self.config, scale, torch.zeros_like(scale))

    def freeze(self) -> "QATBiasQuantize":
        """Store the current product as the scale buffer and untie the source parameters."""
        if self.learnable:
            with torch.no_grad():
                scale = self._current_scale()
                self.set_qparams(scale, torch.zeros_like(scale), state=None)
            del self._parameters["input_scale"]
            del self._parameters["weight_scale"]
        return self


# --------------------------------------------------------------------------- BatchNorm
class FrozenBatchNorm(nn.Module):
    """BatchNorm that always normalizes with its running statistics (train mode included).

    Holds the same parameters and buffers under the same names as the module it replaces, so state dicts
    load both ways.
    """

    def __init__(self, bn: nn.modules.batchnorm._BatchNorm) -> None:
        super().__init__()
        self.num_features = bn.num_features
        self.eps = bn.eps
        self.weight = bn.weight
        self.bias = bn.bias
        self.register_buffer("running_mean", bn.running_mean)
        self.register_buffer("running_var", bn.running_var)
        self.register_buffer("num_batches_tracked", bn.num_batches_tracked)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)


def freeze_bn(model: nn.Module) -> nn.Module:
    """Replace every BatchNorm of ``model`` (in place) by a :class:`FrozenBatchNorm`; returns ``model``.

    Use with ``prepare_qat(..., fold_bn=False)`` for the last epochs of QAT: statistics stop moving and
    normalization matches inference.
    """
    for name, mod in list(model.named_modules()):
        if isinstance(mod, nn.modules.batchnorm._BatchNorm):
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, attr, FrozenBatchNorm(mod))
    return model


# --------------------------------------------------------------------------- prepare
def _lsq_grad_scale(fq: FakeQuantize, val: Any, role: str) -> float:
    if not isinstance(val, torch.Tensor) or val.numel() == 0:
        return 1.0
    n = val.numel()
    if role == "activation" and val.dim() > 1:
        n //= max(1, int(val.shape[0]))
    elif fq.config.per_channel:
        n //= max(1, int(val.shape[fq.config.channel_axis % val.dim()]))
    qmax = max(float(fq.config.quant_max), 1.0)
    return 1.0 / math.sqrt(max(n, 1) * qmax)


def _tie_aligned(gm: fx.GraphModule) -> int:
    """Make aligned quantizers one module (shared parameters); returns how many were tied."""
    holder = getattr(gm, QUANTIZERS_ATTR)
    tied = 0

    def same_scheme(a: FakeQuantize, b: FakeQuantize) -> bool:
        ca, cb = a.config, b.config
        return (not ca.per_channel and not cb.per_channel and ca.is_quantizing and cb.is_quantizing
                and quant_scheme(a) == quant_scheme(b))

    for group in QuantGraph(gm).alignment_groups():
        members = [n for n in dict.fromkeys(group.names) if n in holder]
        if len(members) < 2:
            continue
        leader = max(members, key=lambda n: float(holder[n].scale.detach().max()))
        for name in members:
            if holder[name] is not holder[leader] and same_scheme(holder[name], holder[leader]):
                holder[name] = holder[leader]
                tied += 1
    return tied


def prepare_qat(
    model: nn.Module,
    platform: Any = "trt_int8",
    example_inputs: Any = None,
    setting: QuantizationSetting | None = None,
    *,
    method: str = "lsq",
    calib_data: Any = None,
    calib_steps: int | None = 8,
    collate_fn: Callable[[Any], Any] | None = None,
    momentum: float = 0.9,
    fold_bn: bool = True,
    leaf_modules: Iterable[Any] = (),
    concrete_args: dict[str, Any] | None = None,
    bit_width: int | None = None,
    symmetrical: bool | None = None,
    per_channel: bool | None = None,
    capture: str = "auto",
) -> fx.GraphModule:
    """Prepare ``model`` for quantization-aware training; returns a trainable ``GraphModule`` in train mode.

    Args:
        model: float model (not modified).
        platform, setting, leaf_modules, concrete_args, bit_width, symmetrical, per_channel, capture: as for
            :func:`fxq.prepare`. ``setting.equalization`` runs on ``calib_data`` before initialization.
        example_inputs: one batch (shapes, dtypes; also the initialization data if ``calib_data`` is None).
        method: ``"lsq"``, ``"lsq+"`` (learned offsets too) or ``"ema"``.
        calib_data, calib_steps, collate_fn: batches that initialize the scales (as for :func:`fxq.calibrate`).
        momentum: EMA momentum for ``method="ema"``.
        fold_bn: fold BatchNorm into convs before training (see :mod:`fxq.qat`).

    Returns:
        The QAT model. Train it in any loop; ``model.eval()`` then :func:`fxq.convert` gives the quantized
        model the exporters take.

    Raises:
        ConfigError: unknown method, missing example inputs.

    Example:
        >>> qat = fxq.prepare_qat(model, "academic_int4", example_inputs=x, method="lsq")
        >>> compiled = torch.compile(qat, fullgraph=True)
    """
    from fxq.algorithms import run_algorithms  # noqa: PLC0415  (fxq.api imports this package)
    from fxq.api import _first_batch, prepare  # noqa: PLC0415

    if method not in QAT_METHODS:
        raise ConfigError(f"prepare_qat(method={method!r}); use one of {QAT_METHODS}")
    setting = setting or QuantizationSetting()
    if calib_data is None:
        if example_inputs is None:
            raise ConfigError("prepare_qat() needs example_inputs (one batch) or calib_data")
        calib_data = [example_inputs]
    if example_inputs is None:
        example_inputs = _first_batch(model, calib_data, collate_fn)
    gm = prepare(model, platform, example_inputs,
                 setting, leaf_modules=leaf_modules, concrete_args=concrete_args, bit_width=bit_width,
                 symmetrical=symmetrical, per_channel=per_channel, fold_bn=fold_bn, capture=capture)
    gm = run_algorithms("pre", gm, calib_data, setting, steps=calib_steps, collate_fn=collate_fn)
    calibrate(gm, calib_data, steps=calib_steps, collate_fn=collate_fn, progress=False, bake=False)
    qg = QuantGraph(gm)
    holder = getattr(gm, QUANTIZERS_ATTR)
    swapped = 0
    for name, fq in list(qg.quantizers()):
        role = fq.role
        if role == "bias" or not fq.config.is_quantizing:
            continue
        node = qg.node_of(name)
        val = node.meta.get("val") if node is not None else None
        new = QATFakeQuantize.from_fake_quantize(
            fq, method=method, momentum=momentum, grad_scale=_lsq_grad_scale(fq, val, role),
            track_batches=(role == "activation"))
        new.make_learnable(scale=True, offset=(method == "lsq+"))
        if method == "ema":
            new.scale.requires_grad_(False)  # a parameter that the EMA sets, not the optimizer
            new.set_mode("qat")  # observe (EMA, in train mode) and quantize; fxq.convert ends observing
        holder[name] = new
        swapped += 1
    tied = _tie_aligned(gm)
    for bias_name, fq, data_q, weight_q in list(QuantGraph(gm).biases()):
        if data_q is None or weight_q is None or not fq.config.is_quantizing:
            continue
        if not (isinstance(holder[data_q], QATFakeQuantize) and isinstance(holder[weight_q], QATFakeQuantize)):
            fq.set_mode("disabled")  # its input is not quantized: fxq.convert makes it FP32
            continue
        holder[bias_name] = QATBiasQuantize(fq, holder[data_q], holder[weight_q])
    gm.meta["fxq_qat"] = {"method": method, "momentum": momentum, "fold_bn": fold_bn}
    gm.train()
    logger.info("prepare_qat: %d quantizer(s) trainable (%s), %d tied by alignment", swapped, method, tied)
    return gm

