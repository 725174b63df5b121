"""``Platform``: what a deployment backend quantizes and how — one class per backend, one registry.

A platform is a declarative qconfig map: the op types it quantizes, the activation / weight / bias
schemes, rounding and default observers, plus a few small overridable rules (``weight_config``,
``activation_config``...). Add your own by subclassing and decorating with :func:`register_platform`
(seed 001's "custom platform" flow); override bit width / symmetry / per-channel per call or per layer
with :meth:`Platform.with_overrides` (seed 002).
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import typing
from typing import Any, Callable, ClassVar, Mapping

from fxq.checked import check_value
from fxq.errors import ConfigError
from fxq.registry import Registry, close_names
from fxq.spec import QuantState, RoundingPolicy, TensorQuantConfig

__all__ = [
    "Platform",
    "Capability",
    "RoleCapability",
    "OpRule",
    "PLATFORMS",
    "register_platform",
    "get_platform",
    "COMPUTING_OPS",
    "ACTIVATION_OPS",
    "PASSIVE_OPS",
    "ELEMENTWISE_OPS",
    "SHAPE_OPS",
    "RECURRENT_OPS",
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
RECURRENT_OPS = frozenset({"LSTM", "GRU"})
"""One node per recurrent layer with weight inputs (:mod:`fxq.recurrent`); like computing ops they start
quantized regions, and platforms that cannot express them keep them FP32."""
SHAPE_OPS = frozenset({"Shape", "Size", "Range", "NonZero", "TopK", "ArgMax", "ArgMin", "NonMaxSuppression"})
FUSABLE_ACTIVATIONS = frozenset({"Relu", "Clip"})

PLATFORMS: Registry[type["Platform"]] = Registry("platform")


def _int_config(bits: int, symmetric: bool, narrow: bool = False, **kw: Any) -> TensorQuantConfig:
    cfg = TensorQuantConfig(num_bits=bits, symmetric=symmetric, **kw)
    if narrow and symmetric:
        cfg.quant_min = -cfg.quant_max
    return cfg


def _bits_text(bits: frozenset[int]) -> str:
    b = sorted(bits)
    if len(b) == 1:
        return str(b[0])
    if b == list(range(b[0], b[-1] + 1)):
        return f"{b[0]}..{b[-1]}"
    return f"one of {b}"


@dataclasses.dataclass(frozen=True)
class RoleCapability:
    """What an exporter can write for one tensor role (activation or weight); ``None`` allows any valid value.

    Args:
        bits: allowed bit widths.
        symmetric: True: symmetric only (offset 0); False: asymmetric only.
        narrow: True: the range is ``[-quant_max, quant_max]``; False: the full signed range ``[-2^(b-1), 2^(b-1)-1]``.
        per_channel: False: per-tensor only.
        axes: the channel axes a per-channel scheme may use (``{0}``: output channels only).
        formats: ``"int"`` and / or FP8 format names (``"e4m3"``).
        rounding: rounding policies the runtime applies.
    """

    bits: frozenset[int] | None = None
    symmetric: bool | None = None
    narrow: bool | None = None
    per_channel: bool | None = None
    axes: frozenset[int] | None = None
    formats: frozenset[str] | None = None
    rounding: frozenset[RoundingPolicy] | None = None

    def problems(self, cfg: TensorQuantConfig) -> list[str]:
        """What ``cfg`` asks that this role cannot express, one phrase per rule."""
        out: list[str] = []
        fmt = cfg.fp_format.value if cfg.is_floating else "int"
        if self.formats is not None and fmt not in self.formats:
            want = " or ".join("integer" if f == "int" else f"FP8 {f.upper()}" for f in sorted(self.formats))
            out.append(f"must be {want}, got {'integer' if fmt == 'int' else 'FP8 ' + fmt.upper()}")
        if self.bits is not None and cfg.num_bits not in self.bits:
            out.append(f"bit_width must be {_bits_text(self.bits)}, got {cfg.num_bits}")
        if self.symmetric is not None and cfg.symmetric != self.symmetric:
            out.append("must be symmetric (symmetrical=True)" if self.symmetric else "must be asymmetric")
        if self.narrow is not None and cfg.symmetric and not cfg.is_floating:
            is_narrow = cfg.quant_min == -cfg.quant_max
            full = (-(2 ** (cfg.num_bits - 1)), 2 ** (cfg.num_bits - 1) - 1)
            if self.narrow and not is_narrow:
                out.append(f"must use the narrow range [-qmax, qmax], got [{cfg.quant_min}, {cfg.quant_max}]")
            elif not self.narrow and (cfg.quant_min, cfg.quant_max) != full:
                out.append(f"must use the full range {list(full)}, got [{cfg.quant_min}, {cfg.quant_max}]")
        if self.per_channel is False and cfg.per_channel:
            out.append("must be per-tensor (per_channel=False)")
        elif self.axes is not None and cfg.per_channel and cfg.channel_axis not in self.axes:
            out.append(f"must be per-channel along axis {_bits_text(self.axes)}, got axis {cfg.channel_axis}")
        if self.rounding is not None and cfg.rounding not in self.rounding:
            out.append(f"must round {' or '.join(sorted(r.name for r in self.rounding))}, got {cfg.rounding.name}")
        return out


OpRule = Callable[[Any, Any], "str | None"]
"""A per-op condition of a :class:`Capability`: ``(torch.fx node, the GraphModule holding it) -> why that node cannot
run quantized, or None when it can`` (:mod:`fxq.graph.op_types` answers the usual questions: ``weight_shape``,
``conv_attrs``; :func:`fxq.graph.info.computed_from_parameters`). Its docstring's first line says the rule in
``fxq platforms``."""


@dataclasses.dataclass(frozen=True)
class Capability:
    """What a platform's exporter can express, written once: :func:`fxq.prepare` checks every scheme against it
    before any calibration (per call, per dispatching-table entry and per quantizer), and every exporter checks
    every quantizer of the model it is given against the capabilities of its platforms before it writes anything
    (:func:`fxq.backends.capability.check_capabilities`).

    Args:
        rule: the backend, as messages name it (``"trt_int8 exports TensorRT INT8 Q/DQ"``).
        activation, weight: per-role rules.
        quantized_bias: False when the exporter keeps biases in FP32 (``bias_bits`` must stay None, and an
            exported model may carry no quantizing bias quantizer).
        hint: what to do instead (another platform, an override to drop).
        ops: the op types (:mod:`fxq.graph.op_types`) that may read a quantized value in the exported file (ncnn:
            Conv, Gemm, its int8 layers); None: any op (Q/DQ formats put a quantizer before any op).
            :func:`fxq.prepare` keeps a node it cannot run quantized FP32, so the simulation matches the file.
        op_rules: per-op conditions (:data:`OpRule`) on top of ``ops`` (ncnn: no int8 3-D convolution).
    """

    rule: str
    activation: RoleCapability = RoleCapability()
    weight: RoleCapability = RoleCapability()
    quantized_bias: bool = True
    hint: str = ""
    ops: frozenset[str] | None = None
    op_rules: Mapping[str, OpRule] = dataclasses.field(default_factory=dict, hash=False)

    @property
    def restricts_ops(self) -> bool:
        """Whether some op cannot read a quantized value here (``ops`` or ``op_rules`` declared)."""
        return self.ops is not None or bool(self.op_rules)

    def op_problem(self, op_type: str, node: Any, gm: Any) -> str | None:
        """Why ``node`` (of ``op_type``, in ``gm``) cannot run quantized; None: it can."""
        if self.ops is not None and op_type not in self.ops:
            return f"only {', '.join(sorted(self.ops))} run quantized, not {op_type}"
        rule = self.op_rules.get(op_type)
        return rule(node, gm) if rule is not None else None

    def problems(self, role: str, cfg: TensorQuantConfig) -> list[str]:
        """What ``cfg`` (of ``role``: activation, weight or bias) asks that this capability cannot express."""
        if role == "bias":
            return [] if self.quantized_bias else ["must stay FP32 (bias_bits=None)"]
        rules = getattr(self, role, None)
        return rules.problems(cfg) if isinstance(rules, RoleCapability) else []

    def check(self, role: str, cfg: TensorQuantConfig, where: str) -> None:
        """Raise :class:`ConfigError` if ``cfg`` (of ``role``) is not expressible."""
        problems = self.problems(role, cfg)
        if problems:
            hint = f"; {self.hint}" if self.hint else ""
            raise ConfigError(f"{where}: {self.rule}: {role} quantization {'; '.join(problems)}{hint}")


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
        integer_softmax_reciprocal: the runtime fuses DequantizeLinear -> Softmax -> QuantizeLinear into one
            kernel that multiplies by ``floor(1 / y_scale)`` (onnxruntime's QLinearSoftmax): calibration gives a
            quantized softmax output a scale whose reciprocal is that integer, so the fused kernel and the graph
            as written use one grid (:func:`fxq.graph.convert.snap_softmax_scales`).
        exporter: the registered exporter :func:`fxq.export` uses for this platform.
        capability: what that exporter can express (:class:`Capability`), checked at prepare; None (the base,
            academic and user platforms) accepts every valid scheme.
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
    integer_softmax_reciprocal: bool = False
    exporter: str = "onnxruntime"  # registered exporter name used by fxq.export(model, platform, ...)
    description: str = ""
    capability: Capability | None = None

    FIELDS: ClassVar[tuple[str, ...]] = (
        "activation", "weight", "bias_bits", "quantized_ops", "quantize_outputs", "input_quantized_ops",
        "fusable_activations", "passive_ops", "activation_observer", "weight_observer", "rounding",
        "quantize_passive_constants", "integer_softmax_reciprocal")
    """Fields a dispatching-table entry or :meth:`with_overrides` may change (besides the three scheme keys)."""
    SCHEME_KEYS: ClassVar[tuple[str, ...]] = ("bit_width", "symmetrical", "per_channel")

    def __init__(self, **fields: Any) -> None:
        cls = type(self)
        known = [k for k in dir(cls) if not k.startswith("_") and not k.isupper() and not callable(getattr(cls, k))]
        for key, value in fields.items():
            if key not in known:
                raise ConfigError(f"unknown platform field {key!r} for {type(self).__name__}"
                                  f"{close_names(key, known)}; fields: {', '.join(known)}")
            setattr(self, key, value)
        self._validate(f"platform {self.name!r}")

    def _validate(self, where: str) -> None:
        self.rounding = RoundingPolicy.parse(self.rounding)
        self.quantized_ops = frozenset(self.quantized_ops)
        self.input_quantized_ops = frozenset(self.input_quantized_ops)
        if self.bias_bits is not None and not 8 <= self.bias_bits <= 32:
            raise ConfigError(f"{where}: bias_bits={self.bias_bits} outside 8..32")
        for role in ("activation", "weight"):
            cfg = getattr(self, role).replace(rounding=self.rounding)
            setattr(self, role, cfg)
            self.check_config(role, cfg, where)
        if self.capability is not None and self.bias_bits is not None and not self.capability.quantized_bias:
            raise ConfigError(f"{where}: {self.capability.rule}: biases stay FP32 (bias_bits=None), got "
                              f"bias_bits={self.bias_bits}")

    def check_config(self, role: str, cfg: TensorQuantConfig, where: str) -> None:
        """Raise :class:`ConfigError` if this platform's exporter cannot express ``cfg`` (see :attr:`capability`)."""
        if self.capability is not None and role in ("activation", "weight"):
            self.capability.check(role, cfg, where)

    @classmethod
    def check_overrides(cls, overrides: dict[str, Any], where: str) -> None:
        """Check the keys and value types of a dict of overrides (a dispatching-table entry)."""
        known = [*cls.SCHEME_KEYS, *cls.FIELDS]
        for key, value in overrides.items():
            if key not in known:
                raise ConfigError(f"{where}: unknown override {key!r}{close_names(key, known)}; "
                                  f"overrides: {', '.join(known)}")
            path = f"{where}: {key}"
            if key == "bit_width":
                if isinstance(value, bool) or not isinstance(value, int) or not 2 <= value <= 16:
                    raise ConfigError(f"{path} must be an integer number of bits in 2..16, "
                                      f"got {value!r} ({type(value).__name__})")
            elif key in ("symmetrical", "per_channel"):
                if not isinstance(value, bool):
                    raise ConfigError(f"{path} must be True or False, got {value!r} ({type(value).__name__})")
            elif key == "rounding":
                RoundingPolicy.parse(value)
            else:
                check_value(value, _platform_hints()[key], path)
                if key in ("activation_observer", "weight_observer"):
                    from fxq.observers import OBSERVERS  # noqa: PLC0415

                    OBSERVERS.require(value, path)

    # ------------------------------------------------------------------ rules (override these)
    def activation_config(self, op_type: str, node_name: str) -> TensorQuantConfig:
        """Config for an activation tensor consumed or produced by ``op_type``."""
        return self.activation.replace(observer=self.activation_observer, scale=None, offset=None,
                                       state=QuantState.INITIAL)

    def weight_config(self, op_type: str, node_name: str, weight_shape: tuple[int, ...] | None,
                      op_attrs: dict[str, Any]) -> TensorQuantConfig:
        """Config of the weight of a computing op; per-channel axis 1 for ConvTranspose, -1 for MatMul, 1 (gate and
        channel) for the ``[directions, gates*hidden, k]`` weights of LSTM / GRU."""
        axis = {"ConvTranspose": 1, "MatMul": -1, "LSTM": 1, "GRU": 1}.get(op_type, 0)
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
                       per_channel: bool | None = None, *, where: str = "", **fields: Any) -> "Platform":
        """A copy with bit width / symmetry / per-channel (seed 002's low-bit extension) or fields changed.

        Raises:
            ConfigError: an unknown key, a value of the wrong type, or a scheme the platform's exporter cannot
                express (:attr:`capability`); ``where`` names the input in the message.
        """
        where = where or f"platform {self.name!r} overrides"
        schemes = {"bit_width": bit_width, "symmetrical": symmetrical, "per_channel": per_channel}
        self.check_overrides({**{k: v for k, v in schemes.items() if v is not None}, **fields}, where)
        new = copy.copy(self)
        for key, value in fields.items():
            setattr(new, key, value)
        try:
            new.activation = _rescheme(new.activation, bit_width, symmetrical, None)
            new.weight = _rescheme(new.weight, bit_width, symmetrical, per_channel)
        except ConfigError as exc:
            cap = self.capability
            rule = f" ({cap.rule}{'; ' + cap.hint if cap.hint else ''})" if cap else ""
            raise ConfigError(f"{where}: platform {self.name!r}: {exc}{rule}") from None
        new._validate(where)
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
            "expressible_ops": _expressible_ops(self.capability),
        }


def _expressible_ops(cap: Capability | None) -> str:
    """What the exporter can run quantized, in words: ``any`` or the op types, with each per-op rule's first
    docstring line."""
    if cap is None or not cap.restricts_ops:
        return "any"
    ops = ", ".join(sorted(cap.ops)) if cap.ops is not None else "any"
    rules = "; ".join(f"{op}: {(rule.__doc__ or rule.__name__).strip().splitlines()[0].rstrip('.')}"
                      for op, rule in sorted(cap.op_rules.items()))
    return f"{ops} ({rules})" if rules else ops


@functools.lru_cache(maxsize=None)
def _platform_hints() -> dict[str, Any]:
    return typing.get_type_hints(Platform)


def _rescheme(cfg: TensorQuantConfig, bits: int | None, symmetric: bool | None,
              per_channel: bool | None) -> TensorQuantConfig:
    if bits is None and symmetric is None and per_channel is None:
        return cfg.replace()
    if cfg.is_floating and bits not in (None, 8):
        raise ConfigError(f"floating (FP8) quantization takes bit_width=8 only, got {bits}")
    if cfg.is_floating and symmetric is False:
        raise ConfigError("floating (FP8) quantization is symmetric only: symmetrical must be True")
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
    return cls(name=str(platform).lower())
