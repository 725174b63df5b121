"""The quantization spec: what a quantizer does to one tensor, and in what state it is.

``TensorQuantConfig`` is fxq's TensorQuantizationConfig (PPQ): scheme (bits, range, symmetry,
granularity, power-of-2 / floating), rounding, the quantization parameters and the lifecycle state.
Everything else in fxq (functional math, kernels, observers, platforms, exporters) reads this one type.
"""
from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any

import torch

from fxq.errors import ConfigError

__all__ = [
    "RoundingPolicy",
    "QuantState",
    "FloatFormat",
    "TensorQuantConfig",
    "QuantScheme",
    "MIN_SCALE",
    "QUANTIZING_STATES",
]

MIN_SCALE = 1e-8
"""Smallest scale fxq produces: zero-range tensors get this, never 0 or NaN."""


class RoundingPolicy(enum.IntEnum):
    """How a real number becomes an integer; the int values are the kernels' codes.

    Ties (x.5): HALF_EVEN -> even neighbour, HALF_UP -> +inf, HALF_DOWN -> -inf,
    HALF_TOWARDS_ZERO -> towards 0, HALF_FAR_FROM_ZERO and TO_NEAR_INT -> away from 0 (C ``round``).
    UP is ceil and DOWN is floor for every value, not only ties.
    """

    HALF_EVEN = 0
    HALF_UP = 1
    HALF_DOWN = 2
    HALF_TOWARDS_ZERO = 3
    HALF_FAR_FROM_ZERO = 4
    TO_NEAR_INT = 5
    UP = 6
    DOWN = 7

    @classmethod
    def parse(cls, value: "RoundingPolicy | str | int") -> "RoundingPolicy":
        """Accept a member, its int code, its name, or PPQ's ``ROUND_*`` spelling."""
        if isinstance(value, RoundingPolicy):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            if value in cls._value2member_map_:
                return cls(value)
            raise ConfigError(f"unknown rounding policy code {value}; use 0..{len(cls) - 1} or a name")
        # "RoundingPolicy.ROUND_HALF_FAR_FORM_ZERO" is how PPQ's enum members print
        name = str(value).rsplit(".", 1)[-1].upper().replace("ROUND_", "").replace("FORM", "FROM")
        try:
            return cls[name]
        except KeyError:
            raise ConfigError(
                f"unknown rounding policy {value!r}; use one of {[m.name for m in cls]}"
            ) from None


class QuantState(enum.Enum):
    """Lifecycle of one tensor's quantizer (PPQ's QuantizationStates)."""

    INITIAL = "initial"  # created, no parameters yet
    ACTIVATED = "activated"  # has its own scale/offset and quantizes
    PASSIVE = "passive"  # quantizes with parameters derived from others (bias = s_in * s_w)
    PASSIVE_INIT = "passive_init"  # passive, parameters not derived yet
    OVERLAPPED = "overlapped"  # another quantizer covers this tensor (conv output before relu)
    BAKED = "baked"  # the tensor was quantized in place; its values are already on the grid
    PASSIVE_BAKED = "passive_baked"  # passive and baked
    FP32 = "fp32"  # never quantized
    # PPQ's DEACTIVATED (the seeds' ``op.dequantize()``) is not a state in fxq: switching quantization off is a
    # FakeQuantize mode (``fxq.switch_to_fp32`` / ``fxq.fp32_mode``), which keeps each quantizer's own state.

    @classmethod
    def parse(cls, value: "QuantState | str") -> "QuantState":
        if isinstance(value, QuantState):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            try:
                return cls[str(value).upper()]
            except KeyError:
                hint = ("; fxq has no DEACTIVATED state: use fxq.switch_to_fp32(model) or fxq.fp32_mode(model) "
                        "to run without quantization" if str(value).lower().endswith("deactivated") else "")
                raise ConfigError(
                    f"unknown quant state {value!r}; use one of {[m.name for m in cls]}{hint}"
                ) from None


QUANTIZING_STATES = frozenset(
    {QuantState.ACTIVATED, QuantState.PASSIVE, QuantState.BAKED, QuantState.PASSIVE_BAKED}
)
"""States in which a quantizer changes the values that flow through it."""

_PASSIVE_STATES = frozenset({QuantState.PASSIVE, QuantState.PASSIVE_INIT, QuantState.PASSIVE_BAKED})


class FloatFormat(enum.Enum):
    """FP8 formats (OCP): exponent bits, mantissa bits, largest finite value, smallest normal exponent."""

    E4M3 = "e4m3"
    E5M2 = "e5m2"

    @property
    def exponent_bits(self) -> int:
        return 4 if self is FloatFormat.E4M3 else 5

    @property
    def mantissa_bits(self) -> int:
        return 3 if self is FloatFormat.E4M3 else 2

    @property
    def max_value(self) -> float:
        return 448.0 if self is FloatFormat.E4M3 else 57344.0

    @property
    def min_exponent(self) -> int:
        """Exponent of the smallest normal number (1 - bias); below it values are subnormal."""
        return 1 - (2 ** (self.exponent_bits - 1) - 1)

    @classmethod
    def parse(cls, value: "FloatFormat | str") -> "FloatFormat":
        if isinstance(value, FloatFormat):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            raise ConfigError(f"unknown float format {value!r}; use 'e4m3' or 'e5m2'") from None


def _as_param_tensor(value: Any, what: str) -> torch.Tensor | None:
    if value is None:
        return None
    t = torch.as_tensor(value, dtype=torch.float32)
    if t.dim() == 0:
        t = t.reshape(1)
    if t.dim() != 1:
        raise ConfigError(f"{what} must be a scalar or a 1-D tensor, got shape {tuple(t.shape)}")
    return t


@dataclasses.dataclass(frozen=True)
class QuantScheme:
    """What a quantizer does, without its parameters and lifecycle state: frozen and hashable.

    Two quantizers with equal schemes can share parameters (alignment, QAT ties) and one quantizer per scheme
    covers a tensor. Built by :attr:`TensorQuantConfig.scheme`; the fields mean what they mean there.
    """

    num_bits: int
    symmetric: bool
    per_channel: bool
    channel_axis: int
    power_of_2: bool
    fp_format: FloatFormat | None
    quant_min: int | float
    quant_max: int | float
    rounding: RoundingPolicy
    observer: str

    @property
    def grid(self) -> tuple:
        """What two quantizers must share to share parameters: bits, symmetry, range, FP format, power-of-2."""
        return (self.num_bits, self.symmetric, self.quant_min, self.quant_max, self.fp_format, self.power_of_2)


_SCHEME_FIELDS = tuple(f.name for f in dataclasses.fields(QuantScheme))


@dataclasses.dataclass(eq=False)
class TensorQuantConfig:
    """How one tensor is quantized: ``q = clamp(round(x / scale) + offset, quant_min, quant_max)``.

    Args:
        num_bits: 2..16 (17..32 only for passive tensors such as the bias of a conv).
        symmetric: offset fixed at 0 when True.
        per_channel: one scale per slice along ``channel_axis``.
        channel_axis: the axis of per-channel scales (0 for conv weights, 1 for ConvTranspose).
        power_of_2: scales are powers of two.
        fp_format: FP8 format for floating quantization (symmetric only); None for integer grids.
        quant_min, quant_max: the integer range (for floating: +/- the format's largest value).
            Default: signed ``[-2^(b-1), 2^(b-1)-1]`` when symmetric, ``[0, 2^b-1]`` otherwise.
        rounding: the rounding policy of values, offsets and power-of-2 scales.
        scale, offset: quantization parameters (1-D float32 tensors, one entry per channel).
        state: lifecycle state (:class:`QuantState`).
        observer: registered observer name used to calibrate this tensor.

    ``revision`` counts the assignments to its attributes: a cached fact about the config holds while it is the same.

    Raises:
        ConfigError: for any inconsistent combination, naming the field and the fix.

    Example:
        >>> cfg = TensorQuantConfig(num_bits=8, scale=torch.tensor([2.0]), state=QuantState.ACTIVATED)
        >>> cfg.quant_min, cfg.quant_max
        (-128, 127)
    """

    num_bits: int = 8
    symmetric: bool = True
    per_channel: bool = False
    channel_axis: int = 0
    power_of_2: bool = False
    fp_format: FloatFormat | None = None
    quant_min: int | float | None = None
    quant_max: int | float | None = None
    rounding: RoundingPolicy = RoundingPolicy.HALF_EVEN
    scale: torch.Tensor | None = None
    offset: torch.Tensor | None = None
    state: QuantState = QuantState.INITIAL
    observer: str = "minmax"

    revision = 0  # not a field: a config unpickled from before the counter existed starts at 0 too

    def __setattr__(self, name: str, value: Any) -> None:
        # every change counts (:attr:`revision`): a quantizer's shortcut to its bound call holds while none came
        object.__setattr__(self, name, value)
        object.__setattr__(self, "revision", self.__dict__.get("revision", 0) + 1)

    def __post_init__(self) -> None:
        if not isinstance(self.num_bits, int) or isinstance(self.num_bits, bool):
            raise ConfigError(f"num_bits must be an int, got {self.num_bits!r}")
        self.rounding = RoundingPolicy.parse(self.rounding)
        self.state = QuantState.parse(self.state)
        if self.fp_format is not None:
            self.fp_format = FloatFormat.parse(self.fp_format)
        if self.quant_min is None or self.quant_max is None:
            lo, hi = self.default_range()
            self.quant_min = lo if self.quant_min is None else self.quant_min
            self.quant_max = hi if self.quant_max is None else self.quant_max
        for name in ("quant_min", "quant_max"):
            v = getattr(self, name)
            try:
                f = float(v)
            except (TypeError, ValueError):
                f = math.nan
            if isinstance(v, bool) or not math.isfinite(f):
                raise ConfigError(f"{name} must be a finite number, got {v!r}")
            if not self.is_floating and f != int(f):
                raise ConfigError(f"{name}={v!r} must be an integer for an integer grid")
        if not self.is_floating:
            self.quant_min, self.quant_max = int(self.quant_min), int(self.quant_max)
        self.scale = _as_param_tensor(self.scale, "scale")
        self.offset = _as_param_tensor(self.offset, "offset")
        if self.scale is not None and self.offset is None:
            self.offset = torch.zeros_like(self.scale)
        self.validate()

    # ----------------------------------------------------------------- derived facts
    @property
    def is_floating(self) -> bool:
        return self.fp_format is not None

    @property
    def is_passive(self) -> bool:
        return self.state in _PASSIVE_STATES

    @property
    def is_quantizing(self) -> bool:
        """True when this quantizer changes values (ACTIVATED, PASSIVE, BAKED, PASSIVE_BAKED)."""
        return self.state in QUANTIZING_STATES

    @property
    def has_qparams(self) -> bool:
        return self.scale is not None

    @property
    def scheme(self) -> QuantScheme:
        """The frozen scheme part of this config (no scale, offset or state)."""
        return QuantScheme(**{name: getattr(self, name) for name in _SCHEME_FIELDS})

    def default_range(self) -> tuple[int | float, int | float]:
        if self.fp_format is not None:
            m = FloatFormat.parse(self.fp_format).max_value
            return -m, m
        b = int(self.num_bits)
        if self.symmetric:
            return -(2 ** (b - 1)), 2 ** (b - 1) - 1
        return 0, 2**b - 1

    # ----------------------------------------------------------------- validation
    def validate(self) -> None:
        """Raise :class:`ConfigError` if the fields contradict each other."""
        b = self.num_bits
        if not isinstance(b, int) or isinstance(b, bool):
            raise ConfigError(f"num_bits must be an int, got {b!r}")
        max_bits = 32 if self.is_passive else 16
        if not 2 <= b <= max_bits:
            hint = "" if self.is_passive else " (17..32 bits only for passive tensors such as biases)"
            raise ConfigError(f"num_bits={b} is outside 2..{max_bits}{hint}")
        if self.is_floating:
            if not self.symmetric:
                raise ConfigError("floating (FP8) quantization must be symmetric; set symmetric=True")
            if b != 8:
                raise ConfigError(f"floating quantization uses 8 bits (FP8), got num_bits={b}")
            fmax = self.fp_format.max_value
            if not (-fmax <= self.quant_min < self.quant_max <= fmax):
                raise ConfigError(
                    f"quant range [{self.quant_min}, {self.quant_max}] exceeds {self.fp_format.name}'s "
                    f"[-{fmax}, {fmax}]"
                )
            if self.quant_min != -self.quant_max:
                raise ConfigError(
                    f"a floating range must be symmetric, got [{self.quant_min}, {self.quant_max}]; "
                    f"use quant_min=-quant_max"
                )
        else:
            if self.quant_min >= self.quant_max:
                raise ConfigError(
                    f"quant_min={self.quant_min} must be smaller than quant_max={self.quant_max}"
                )
            lo, hi = -(2 ** (b - 1)), 2**b - 1
            if self.quant_min < lo or self.quant_max > hi or self.quant_max - self.quant_min > 2**b - 1:
                raise ConfigError(
                    f"range [{self.quant_min}, {self.quant_max}] does not fit in {b} bits; "
                    f"raise num_bits or narrow the range"
                )
        if self.per_channel and not isinstance(self.channel_axis, int):
            raise ConfigError(f"channel_axis must be an int, got {self.channel_axis!r}")
        if self.scale is not None:
            self._validate_qparams(self.scale, self.offset)

    def _validate_qparams(self, scale: torch.Tensor, offset: torch.Tensor | None) -> None:
        s = scale.detach()
        if not self.per_channel and s.numel() != 1:
            raise ConfigError(
                f"a per-tensor config takes one scale, got {s.numel()}; set per_channel=True "
                f"and channel_axis for one scale per channel"
            )
        if s.numel() == 0:
            raise ConfigError("scale is empty")
        if not bool(torch.isfinite(s).all()) or not bool((s > 0).all()):
            raise ConfigError(
                f"scale must be finite and > 0, got min {float(s.min()):.3g}; "
                f"re-calibrate or clamp it to at least {MIN_SCALE}"
            )
        if offset is not None:
            o = offset.detach()
            if o.numel() != s.numel():
                raise ConfigError(f"offset has {o.numel()} entries but scale has {s.numel()}")
            if self.symmetric and bool((o != 0).any()):
                raise ConfigError("a symmetric config must have offset 0; set symmetric=False for a zero-point")
            if not self.is_floating and (
                bool((o != torch.round(o)).any())
                or bool((o < self.quant_min).any())
                or bool((o > self.quant_max).any())
            ):
                raise ConfigError(
                    f"offset must hold integers inside [{self.quant_min}, {self.quant_max}]"
                )
        if self.power_of_2:
            log2 = torch.log2(s.double())
            if bool((log2 != torch.round(log2)).any()):
                raise ConfigError("power_of_2 config has a scale that is not a power of two")

    def check_channels(self, shape: torch.Size | tuple[int, ...], where: str = "tensor") -> None:
        """Raise if the scale count does not match ``shape`` along ``channel_axis``."""
        if self.scale is None or not self.per_channel:
            return
        if not shape:
            raise ConfigError(f"{where}: per-channel quantization of a 0-d tensor")
        if not -len(shape) <= self.channel_axis < len(shape):
            raise ConfigError(
                f"{where}: channel_axis={self.channel_axis} is outside a {len(shape)}-d tensor of shape "
                f"{tuple(shape)}; set channel_axis to the channel dimension"
            )
        axis = self.channel_axis % len(shape)
        if self.scale.numel() != shape[axis]:
            raise ConfigError(
                f"{where}: {self.scale.numel()} scales for {shape[axis]} channels on axis "
                f"{self.channel_axis} of shape {tuple(shape)}"
            )

    # ----------------------------------------------------------------- mutation
    def set_qparams(self, scale: Any, offset: Any = None) -> "TensorQuantConfig":
        """Set scale (and offset) after validating them; returns self."""
        s = _as_param_tensor(scale, "scale")
        o = _as_param_tensor(offset, "offset") if offset is not None else torch.zeros_like(s)
        self._validate_qparams(s, o)
        self.scale, self.offset = s, o
        return self

    def replace(self, **changes: Any) -> "TensorQuantConfig":
        """A validated copy with ``changes`` applied (tensors are cloned)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for key in ("scale", "offset"):
            if d[key] is not None:
                d[key] = d[key].detach().clone()
        d.update(changes)
        return TensorQuantConfig(**d)

    # ----------------------------------------------------------------- serialization
    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (tensors as lists); :meth:`from_dict` inverts it."""
        return {
            "num_bits": self.num_bits,
            "symmetric": self.symmetric,
            "per_channel": self.per_channel,
            "channel_axis": self.channel_axis,
            "power_of_2": self.power_of_2,
            "fp_format": None if self.fp_format is None else self.fp_format.value,
            "quant_min": self.quant_min,
            "quant_max": self.quant_max,
            "rounding": self.rounding.name,
            "scale": None if self.scale is None else self.scale.detach().cpu().tolist(),
            "offset": None if self.offset is None else self.offset.detach().cpu().tolist(),
            "state": self.state.name,
            "observer": self.observer,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TensorQuantConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ConfigError(f"unknown TensorQuantConfig fields {sorted(unknown)}")
        return cls(**data)

    def __repr__(self) -> str:
        kind = self.fp_format.name if self.is_floating else f"int{self.num_bits}"
        sym = "sym" if self.symmetric else "asym"
        gran = f"per-channel(axis={self.channel_axis})" if self.per_channel else "per-tensor"
        extra = " pow2" if self.power_of_2 else ""
        return (
            f"TensorQuantConfig({kind} {sym} {gran}{extra} [{self.quant_min}, {self.quant_max}] "
            f"{self.rounding.name} {self.state.name} observer={self.observer})"
        )


def integer_range_for_compute(cfg: TensorQuantConfig) -> bool:
    """True when the integer grid exceeds float32's exact-integer range and needs float64 math."""
    return (not cfg.is_floating) and (cfg.quant_max - cfg.quant_min) > 2**24


def is_power_of_two(value: float) -> bool:
    return value > 0 and math.log2(value).is_integer()
