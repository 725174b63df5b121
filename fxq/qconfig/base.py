"""``Platform``: what a deployment backend quantizes and how — one class per backend, one registry.

A platform is a declarative qconfig map: the op types it quantizes, the activation / weight / bias
schemes, rounding and default observers, plus a few small overridable rules (``weight_config``,
``activation_config``...). Add your own by subclassing and decorating with :func:`register_platform`
(seed 001's "custom platform" flow); override bit width / symmetry / per-channel per call or per layer
with :meth:`Platform.with_overrides` (seed 002).
"""
from __future__ import annotations

import copy
from typing import Any, ClassVar

from fxq.errors import ConfigError
from fxq.registry import Registry
from fxq.spec import QuantState, RoundingPolicy, TensorQuantConfig

__all__ = [
    "Platform",
    "PLATFORMS",
    "register_platform",
    "get_platform",
    "COMPUTING_OPS",
    "ACTIVATION_OPS",
    "PASSIVE_OPS",
    "ELEMENTWISE_OPS",
    "SHAPE_OPS",
]

COMPUTING_OPS = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul"})
ACTIVATION_OPS = frozenset(
    {"Relu", "Clip", "Sigmoid", "HardSigmoid", "HardSwish", "Gelu", "Silu", "LeakyRelu", "PRelu", "Tanh", "Elu"}
)
PASSIVE_OPS = frozenset(
    {"MaxPool", "Reshape", "Flatten", "Transpose", "Slice", "Squeeze", "Unsqueeze", "Split", "Identity", "Pad"}
)
"""Ops whose output lies on the input's grid: they share their input's quantizer."""
ELEMENTWISE_OPS = frozenset({"Add", "Sub", "Mul", "Div"})
SHAPE_OPS = frozenset({"Shape", "Size", "Range", "NonZero", "TopK", "ArgMax", "ArgMin", "NonMaxSuppression"})
FUSABLE_ACTIVATIONS = frozenset({"Relu", "Clip"})

PLATFORMS: Registry[type["Platform"]] = Registry("platform")


def _int_config(bits: int, symmetric: bool, narrow: bool = False, **kw: Any) -> TensorQuantConfig:
    cfg = TensorQuantConfig(num_bits=bits, symmetric=symmetric, **kw)
    if narrow and symmetric:
        cfg.quant_min = -cfg.quant_max
    return cfg


class Platform:
    """Base platform: TensorRT-like INT8 defaults; subclasses set class attributes and override rules.

    Instances take any attribute as a keyword (``Platform(bias_bits=32)``); templates are never
    mutated — every config handed out is a copy.

    Attributes:
        name: registry name.
        activation: template config for activations (per tensor).
        weight: template config for weights (per-channel axis is set per op by :meth:`weight_config`).
        bias_bits: ``None`` keeps biases FP32; otherwise biases are passive with this many bits
            (scale = input scale x weight scale).
        quantized_ops: canonical (ONNX-style) op types this platform quantizes.
        quantize_outputs: False when only the inputs of ``input_quantized_ops`` are quantized
            (NCNN, academic), outputs stay FP32.
        input_quantized_ops: ops whose activation inputs are quantized when ``quantize_outputs`` is False.
        fusable_activations: activations that absorb the output quantizer of their producer.
        passive_ops: ops whose output shares their input's quantizer.
        activation_observer / weight_observer: default observer names.
        quantize_passive_constants: quantize clip bounds / pad values with the input's scale.
        exporter: the registered exporter :func:`fxq.export` uses for this platform.
    """

    TRT_INT8: ClassVar[str] = "trt_int8"
    TRT_FP8: ClassVar[str] = "trt_fp8"
    PPL_CUDA_INT8: ClassVar[str] = "ppl_cuda_int8"
    NCNN_INT8: ClassVar[str] = "ncnn_int8"
    ACADEMIC_INT8: ClassVar[str] = "academic_int8"
    ACADEMIC_INT4: ClassVar[str] = "academic_int4"
    ACADEMIC_MIX: ClassVar[str] = "academic_mix"
    ORT_INT8: ClassVar[str] = "ort_int8"
    DSP_INT8: ClassVar[str] = "dsp_int8"

    name: str = "custom"
    activation: TensorQuantConfig = _int_config(8, True)
    weight: TensorQuantConfig = _int_config(8, True, narrow=True, per_channel=True)
    bias_bits: int | None = None
    quantized_ops: frozenset[str] = COMPUTING_OPS
    quantize_outputs: bool = True
    input_quantized_ops: frozenset[str] = COMPUTING_OPS
    fusable_activations: frozenset[str] = FUSABLE_ACTIVATIONS
    passive_ops: frozenset[str] = PASSIVE_OPS
    activation_observer: str = "percentile"
    weight_observer: str = "minmax"
    rounding: RoundingPolicy = RoundingPolicy.HALF_EVEN
    quantize_passive_constants: bool = False
    exporter: str = "onnxruntime"  # registered exporter name used by fxq.export(model, platform, ...)
    description: str = ""

    def __init__(self, **fields: Any) -> None:
        for key, value in fields.items():
            if key.startswith("_") or not hasattr(type(self), key) or callable(getattr(type(self), key)):
                raise ConfigError(f"unknown platform field {key!r} for {type(self).__name__}")
            setattr(self, key, value)
        self._validate()

    def _validate(self) -> None:
        self.rounding = RoundingPolicy.parse(self.rounding)
        self.quantized_ops = frozenset(self.quantized_ops)
        self.input_quantized_ops = frozenset(self.input_quantized_ops)
        if self.bias_bits is not None and not 8 <= self.bias_bits <= 32:
            raise ConfigError(f"platform {self.name!r}: bias_bits={self.bias_bits} outside 8..32")
        for role in ("activation", "weight"):
            cfg = getattr(self, role).replace(rounding=self.rounding)
            setattr(self, role, cfg)

    # ------------------------------------------------------------------ rules (override these)
    def activation_config(self, op_type: str, node_name: str) -> TensorQuantConfig:
        """Config for an activation tensor consumed or produced by ``op_type``."""
        return self.activation.replace(observer=self.activation_observer, scale=None, offset=None,
                                       state=QuantState.INITIAL)

    def weight_config(self, op_type: str, node_name: str, weight_shape: tuple[int, ...] | None,
                      op_attrs: dict[str, Any]) -> TensorQuantConfig:
        """Config of the weight of a computing op; per-channel axis 1 for ConvTranspose, -1 for MatMul."""
        axis = {"ConvTranspose": 1, "MatMul": -1}.get(op_type, 0)
        return self.weight.replace(observer=self.weight_observer, channel_axis=axis, scale=None, offset=None,
                                   state=QuantState.INITIAL)

    def bias_config(self, op_type: str, node_name: str) -> TensorQuantConfig | None:
        """Passive bias config (None: bias stays FP32)."""
        if self.bias_bits is None:
            return None
        return TensorQuantConfig(num_bits=self.bias_bits, symmetric=True, per_channel=self.weight.per_channel,
                                 channel_axis=0, rounding=self.rounding, state=QuantState.PASSIVE_INIT,
                                 observer="minmax")

    def quantizes_output(self, op_type: str) -> bool:
        return self.quantize_outputs and op_type in self.quantized_ops

    def quantizes_inputs(self, op_type: str) -> bool:
        if self.quantize_outputs:
            return op_type in self.quantized_ops
        return op_type in self.input_quantized_ops

    # ------------------------------------------------------------------ overrides
    def with_overrides(self, bit_width: int | None = None, symmetrical: bool | None = None,
                       per_channel: bool | None = None, **fields: Any) -> "Platform":
        """A copy with bit width / symmetry / per-channel changed (seed 002's low-bit extension)."""
        new = copy.copy(self)
        for key, value in fields.items():
            setattr(new, key, value)
        new.activation = _rescheme(self.activation, bit_width, symmetrical, None)
        new.weight = _rescheme(self.weight, bit_width, symmetrical, per_channel)
        new._validate()
        return new

    def describe(self) -> dict[str, Any]:
        """Plain-data description (for ``fxq platforms`` and summaries)."""
        return {
            "name": self.name,
            "description": self.description,
            "activation": repr(self.activation.replace(observer=self.activation_observer)),
            "weight": repr(self.weight.replace(observer=self.weight_observer)),
            "bias": "fp32" if self.bias_bits is None else f"int{self.bias_bits} passive",
            "rounding": self.rounding.name,
            "quantized_ops": sorted(self.quantized_ops),
            "outputs_quantized": self.quantize_outputs,
        }


def _rescheme(cfg: TensorQuantConfig, bits: int | None, symmetric: bool | None,
              per_channel: bool | None) -> TensorQuantConfig:
    if bits is None and symmetric is None and per_channel is None:
        return cfg.replace()
    if cfg.is_floating and bits not in (None, 8):
        raise ConfigError("floating (FP8) platforms only take bit_width=8")
    narrow = cfg.symmetric and cfg.quant_min == -cfg.quant_max
    b = cfg.num_bits if bits is None else int(bits)
    sym = cfg.symmetric if symmetric is None else bool(symmetric)
    pc = cfg.per_channel if per_channel is None else bool(per_channel)
    if cfg.is_floating:
        return cfg.replace(per_channel=pc)
    new = _int_config(b, sym, narrow=narrow and sym, per_channel=pc, channel_axis=cfg.channel_axis,
                      power_of_2=cfg.power_of_2, rounding=cfg.rounding, observer=cfg.observer)
    return new


def register_platform(name: str, cls: type[Platform] | None = None, *, override: bool = False):
    """Register a :class:`Platform` subclass under ``name`` (usable as decorator).

    Example:
        >>> @register_platform("my_npu")
        ... class MyNpu(Platform):
        ...     quantized_ops = frozenset({"Conv", "Gemm"})
    """

    def deco(c: type[Platform]) -> type[Platform]:
        if not (isinstance(c, type) and issubclass(c, Platform)):
            raise ConfigError(f"register_platform({name!r}) needs a Platform subclass, got {c!r}")
        PLATFORMS.register(name, c, override=override)
        return c

    return deco(cls) if cls is not None else deco


def get_platform(platform: "str | Platform | type[Platform]") -> Platform:
    """Resolve a name, class or instance to a Platform instance (a fresh one for names/classes)."""
    if isinstance(platform, Platform):
        return platform
    if isinstance(platform, type) and issubclass(platform, Platform):
        return platform()
    cls = PLATFORMS.get(str(platform))
    inst = cls()
    inst.name = str(platform).lower()
    return inst
