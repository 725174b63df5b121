"""``QuantizationSetting``: the seeds' settings tree as plain dataclasses with a json round trip.

Field names and defaults follow PPQ's so that tutorials translate one to one
(``setting.lsq_optimization = True``, ``setting.lsq_optimization_setting.lr = 1e-4`` ...).

Every field is checked against its type annotation and its ``field(metadata=...)`` bounds when it is set — by the
constructor, by assignment and by :meth:`~_Checked.from_dict` — and :meth:`QuantizationSetting.validate` re-checks
the whole tree (for lists and dicts changed in place) before :func:`fxq.prepare` / :func:`fxq.quantize` do any work.
Booleans must be real booleans, numbers real numbers; unknown names raise :class:`~fxq.errors.ConfigError` with the
closest known names. Names in ``dispatcher``, ``calib_algorithm`` and ``custom_algorithms`` are looked up in their
registries, so register your dispatcher / observer / algorithm before building a setting that names it.

Removed fields: ``fusion_setting.remove_useless_quantization`` and ``fusion_setting.force_alignment_overlap`` (fxq
always gives a tensor one quantizer, which its consumers and aligned ops share: PPQ's behaviour with both True).
A setting (or json) that still sets them to ``True`` gets a ``DeprecationWarning``; ``False`` is a ConfigError.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import types
import typing
import warnings
from typing import Any, Callable, ClassVar, Union

from fxq.errors import ConfigError

__all__ = [
    "QuantizationSetting",
    "QuantizationSettingFactory",
    "EqualizationSetting",
    "SSDEqualizationSetting",
    "ActivationQuantizationSetting",
    "ParameterQuantizationSetting",
    "FusionSetting",
    "LSQSetting",
    "BlockwiseReconstructionSetting",
    "BiasCorrectionSetting",
    "AdaroundSetting",
    "close_names",
    "check_value",
]

ALIGN_ELEMENTWISE = ("None", "Align to Large", "Align to Output")


def close_names(name: str, known: typing.Iterable[str]) -> str:
    """``" (did you mean 'a', 'b'?)"`` for the known names closest to ``name``, or ``""``."""
    near = difflib.get_close_matches(str(name), list(known), n=3, cutoff=0.6)
    return f" (did you mean {', '.join(repr(n) for n in near)}?)" if near else ""


def _kind(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


# ------------------------------------------------------------------------------------------- field checks
def _opt(default: Any = dataclasses.MISSING, *, factory: Callable[[], Any] | None = None, **rules: Any) -> Any:
    """A dataclass field with checking rules in its metadata: ``gt``, ``ge``, ``le``, ``lt``, ``choices``,
    ``registry`` (a registry name, see :func:`_registry`), ``device`` (a torch device string), ``check`` (a
    callable ``(value, path) -> value``)."""
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=rules)
    return dataclasses.field(default=default, metadata=rules)


def _registry(kind: str) -> Any:
    """The live registry behind a setting that names a registered object (imported lazily: no cycles)."""
    if kind == "dispatcher":
        from fxq.graph.dispatch import DISPATCHERS  # noqa: PLC0415
        return DISPATCHERS
    if kind == "observer":
        from fxq.observers import OBSERVERS  # noqa: PLC0415
        return OBSERVERS
    if kind == "algorithm":
        from fxq.algorithms.pipeline import ALGORITHMS  # noqa: PLC0415
        return ALGORITHMS
    raise AssertionError(kind)


def check_value(value: Any, tp: Any, path: str) -> Any:
    """``value`` checked (and normalized: list -> tuple, int -> float, dict -> sub-setting) against ``tp``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        arms = [a for a in args if a is not type(None)]
        return check_value(value, arms[0], path)
    if tp is bool:
        if not isinstance(value, bool):
            hint = " (a JSON true/false, not a string)" if isinstance(value, str) else ""
            raise ConfigError(f"{path} must be true or false{hint}, got {_kind(value)}")
        return value
    if tp is int:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path} must be an integer, got {_kind(value)}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"{path} must be a finite number, got {_kind(value)}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path} must be a string, got {_kind(value)}")
        return value
    if origin is list:
        if isinstance(value, str) or not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path} must be a list, got {_kind(value)}")
        return [check_value(v, args[0], f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is tuple:
        if isinstance(value, str) or not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{path} must be a list of {len(args)} values, got {_kind(value)}")
        return tuple(check_value(v, a, f"{path}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if origin in (frozenset, set):
        if isinstance(value, str) or not isinstance(value, (list, tuple, set, frozenset)):
            raise ConfigError(f"{path} must be a set of values, got {_kind(value)}")
        return frozenset(check_value(v, args[0], f"{path} item") for v in value)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path} must be a dict, got {_kind(value)}")
        return {check_value(k, args[0], f"{path} key"): check_value(v, args[1], f"{path}[{k!r}]")
                for k, v in value.items()}
    if isinstance(tp, type) and issubclass(tp, _Checked):
        if isinstance(value, tp):
            return value
        if isinstance(value, dict):
            return tp.from_dict(value)
        raise ConfigError(f"{path} must be a dict of {tp.__name__} fields ({', '.join(tp.field_names())}) or a "
                          f"{tp.__name__}, got {_kind(value)}")
    if isinstance(tp, type):
        if not isinstance(value, tp):
            raise ConfigError(f"{path} must be a {tp.__name__}, got {_kind(value)}")
        return value
    raise AssertionError(f"no check for {tp!r}")


def _check_rules(value: Any, rules: typing.Mapping[str, Any], path: str) -> Any:
    for op, bound, what in (("gt", rules.get("gt"), ">"), ("ge", rules.get("ge"), ">="),
                            ("lt", rules.get("lt"), "<"), ("le", rules.get("le"), "<=")):
        if bound is None or value is None:
            continue
        ok = {"gt": value > bound, "ge": value >= bound, "lt": value < bound, "le": value <= bound}[op]
        if not ok:
            raise ConfigError(f"{path}={value!r} must be {what} {bound}" + (f" ({rules['why']})" if "why" in rules
                                                                               else ""))
    if "choices" in rules and value not in rules["choices"]:
        raise ConfigError(f"{path}={value!r}; use one of {list(rules['choices'])}")
    names = value if isinstance(value, list) else [] if value is None else [value]
    if rules.get("registry") and names:
        reg = _registry(rules["registry"])
        for name in names:
            if name not in reg:
                raise ConfigError(f"{path}={name!r} is not a registered {reg.kind}{close_names(name, reg.names())}; "
                                  f"registered: {', '.join(reg.names())}. Register yours with "
                                  f"fxq.register_{reg.kind}({name!r}) before building the setting")
    if rules.get("device"):
        import torch  # noqa: PLC0415

        try:
            torch.device(value)
        except (RuntimeError, TypeError):
            raise ConfigError(f"{path}={value!r} is not a torch device; use 'cpu' or 'cuda'") from None
    if rules.get("check"):
        value = rules["check"](value, path)
    return value


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


class _Checked:
    """Base of the settings dataclasses: every field is type- and range-checked when set; unknown names raise.

    Class attributes: ``PATH`` (how messages name the object, e.g. ``setting.lsq_optimization_setting``),
    ``ALIASES`` (accepted spellings -> field) and ``REMOVED`` (removed field -> what fxq does instead).
    """

    PATH: ClassVar[str] = "setting"
    ALIASES: ClassVar[dict[str, str]] = {}
    REMOVED: ClassVar[dict[str, str]] = {}

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    def __setattr__(self, name: str, value: Any) -> None:
        cls = type(self)
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if name in fields:
            path = f"{cls.PATH}.{name}"
            value = _check_rules(check_value(value, _hints(cls)[name], path), fields[name].metadata, path)
        elif isinstance(getattr(cls, name, None), property):
            pass  # e.g. LSQSetting.epochs, whose setter assigns a field
        elif name in cls.REMOVED:
            _removed(cls, name, value)
            return
        else:
            raise ConfigError(_unknown(cls, name))
        object.__setattr__(self, name, value)

    @classmethod
    def _known_kwargs(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Constructor keywords with aliases resolved, removed fields handled, unknown ones refused."""
        fields = cls.field_names()
        out: dict[str, Any] = {}
        for key, value in kwargs.items():
            if key in cls.REMOVED:
                _removed(cls, key, value)
                continue
            key = cls.ALIASES.get(key, key)
            if key not in fields:
                raise ConfigError(_unknown(cls, key))
            out[key] = value
        return out

    @classmethod
    def from_dict(cls, data: Any) -> Any:
        """Build from a (json) dict; unknown keys raise with the closest names."""
        if not isinstance(data, dict):
            raise ConfigError(f"{cls.PATH} must be a dict of {cls.__name__} fields, got {_kind(data)}")
        bad = [k for k in data if not isinstance(k, str)]
        if bad:
            raise ConfigError(f"{cls.PATH}: field names are strings, got {_kind(bad[0])}")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    def validate(self) -> Any:
        """Re-check every field (lists / dicts may have changed in place); returns self."""
        for name in self.field_names():
            value = getattr(self, name)
            if isinstance(value, _Checked):
                value.validate()
            setattr(self, name, value)
        return self


def _unknown(cls: type[_Checked], name: str) -> str:
    fields = cls.field_names()
    near = close_names(name, [*fields, *cls.ALIASES])
    msg = f"{cls.PATH}: unknown field {name!r}{near}; fields: {', '.join(fields)}"
    scheme = close_names(name, ("bit_width", "symmetrical", "per_channel"))
    if scheme:
        msg += (f". Bit width / symmetry / per-channel are not settings: pass them to fxq.quantize / fxq.prepare "
                f"(bit_width=4) or per layer in setting.dispatching_table ({{'fc': {{'bit_width': 4}}}}){scheme}")
    return msg


def _removed(cls: type[_Checked], name: str, value: Any) -> None:
    path = f"{cls.PATH}.{name}"
    if value is True:
        warnings.warn(f"{path} was removed and is ignored: {cls.REMOVED[name]}; drop the key",
                      DeprecationWarning, stacklevel=4)
        return
    raise ConfigError(f"{path}={value!r}: this field was removed ({cls.REMOVED[name]}) and cannot be switched off; "
                      f"drop the key")


def _setting(path: str) -> Callable[[type], type]:
    """``@dataclass`` plus a constructor that resolves aliases and names unknown keywords in a ConfigError."""

    def deco(cls: type) -> type:
        cls.PATH = path
        cls = dataclasses.dataclass(cls)
        init = cls.__init__

        @functools.wraps(init)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            fields = cls.field_names()
            if len(args) > len(fields):
                raise ConfigError(f"{path} takes at most {len(fields)} positional values, got {len(args)}")
            init(self, *args, **cls._known_kwargs(kwargs))

        cls.__init__ = __init__
        return cls

    return deco


# ------------------------------------------------------------------------------------------- sub-settings
_POSITIVE_STEPS = {"ge": 1, "why": "a number of optimization steps"}
_LR = {"gt": 0.0, "why": "a learning rate"}


@_setting("setting.equalization_setting")
class EqualizationSetting(_Checked):
    opt_level: int = _opt(1, choices=(1, 2))
    iterations: int = _opt(10, ge=1)
    value_threshold: float = _opt(0.5, ge=0.0)
    including_bias: bool = False
    bias_multiplier: float = _opt(0.5, ge=0.0)
    including_act: bool = False
    act_multiplier: float = _opt(0.5, ge=0.0)


@_setting("setting.ssd_setting")
class SSDEqualizationSetting(_Checked):
    opt_level: int = _opt(1, choices=(1, 2))
    channel_ratio: float = _opt(0.5, gt=0.0, le=1.0)
    loss_threshold: float = _opt(0.8, ge=0.0)
    iteration: int = _opt(3, ge=1)


@_setting("setting.quantize_activation_setting")
class ActivationQuantizationSetting(_Checked):
    calib_algorithm: str | None = _opt(None, registry="observer")  # None: the platform's default observer


@_setting("setting.quantize_parameter_setting")
class ParameterQuantizationSetting(_Checked):
    calib_algorithm: str | None = _opt(None, registry="observer")
    quantize_passive_parameter: bool = True
    baking_parameter: bool = True


@_setting("setting.fusion_setting")
class FusionSetting(_Checked):
    REMOVED: ClassVar[dict[str, str]] = {
        "remove_useless_quantization": "fxq always shares one quantizer between a tensor's producer and consumers",
        "force_alignment_overlap": "aligned inputs are their producers' quantizers, so alignment always overlaps",
    }
    fuse_activation: bool = True
    fuse_passive_op: bool = True
    align_quantization: bool = True
    align_avgpooling_to: str = _opt("None", choices=ALIGN_ELEMENTWISE)
    align_elementwise_to: str = _opt("Align to Large", choices=ALIGN_ELEMENTWISE)
    align_concat_to: str = _opt("Align to Output", choices=ALIGN_ELEMENTWISE)
    align_resize_to: str = _opt("Align to Output", choices=ALIGN_ELEMENTWISE)
    # Concats whose inputs' ranges differ more than this keep their output FP32 (None: never); see
    # fxq.graph.calibrate.MIXED_RANGE_RATIO for the reasoning behind the default.
    mixed_range_concat_ratio: float | None = _opt(64.0, gt=1.0, why="a ratio of input ranges; None switches "
                                                                       "the check off")


@_setting("setting.lsq_optimization_setting")
class LSQSetting(_Checked):
    ALIASES: ClassVar[dict[str, str]] = {"epochs": "steps"}
    interested_layers: list[str] = _opt(factory=list)
    lr: float = _opt(1e-5, **_LR)
    steps: int = _opt(500, **_POSITIVE_STEPS)
    is_scale_trainable: bool = True
    gamma: float = _opt(0.0, ge=0.0)
    block_size: int = _opt(4, ge=1)
    collecting_device: str = _opt("cpu", device=True)

    @property
    def epochs(self) -> int:
        """The seeds' tutorial spelling of ``steps``."""
        return self.steps

    @epochs.setter
    def epochs(self, value: int) -> None:
        self.steps = value


@_setting("setting.blockwise_reconstruction_setting")
class BlockwiseReconstructionSetting(_Checked):
    interested_layers: list[str] = _opt(factory=list)
    lr: float = _opt(1e-3, **_LR)
    steps: int = _opt(5000, **_POSITIVE_STEPS)
    gamma: float = _opt(1.0, ge=0.0)
    block_size: int = _opt(4, ge=1)
    is_scale_trainable: bool = False
    # QDrop: probability of keeping an activation un-quantized during reconstruction
    drop_prob: float = _opt(0.5, ge=0.0, le=1.0)
    collecting_device: str = _opt("cpu", device=True)


@_setting("setting.bias_correct_setting")
class BiasCorrectionSetting(_Checked):
    block_size: int = _opt(4, ge=1)
    steps: int = _opt(32, ge=1, why="a number of calibration batches")


def _beta_range(value: tuple[float, float], path: str) -> tuple[float, float]:
    if not value[0] >= value[1] > 0:
        raise ConfigError(f"{path}={list(value)}: AdaRound anneals beta from the first value down to the second, "
                          f"both > 0 (default [20, 2])")
    return value


@_setting("setting.adaround_setting")
class AdaroundSetting(_Checked):
    interested_layers: list[str] = _opt(factory=list)
    lr: float = _opt(1e-3, **_LR)
    steps: int = _opt(1000, **_POSITIVE_STEPS)
    reg_weight: float = _opt(0.01, ge=0.0)
    beta_range: tuple[float, float] = _opt((20.0, 2.0), check=_beta_range)
    warm_up: float = _opt(0.2, ge=0.0, le=1.0)
    collecting_device: str = _opt("cpu", device=True)


def _check_table(table: dict[str, Any], path: str) -> dict[str, Any]:
    """Dispatching-table values: ``"fp32"``, a platform name or Platform, or a dict of overrides."""
    from fxq.qconfig.base import PLATFORMS, Platform  # noqa: PLC0415

    for key, value in table.items():
        where = f"{path}[{key!r}]"
        if not key:
            raise ConfigError(f"{path}: an empty key matches no node; use a node / module name or a regex")
        if isinstance(value, Platform):
            continue
        if isinstance(value, str):
            if value.lower() != "fp32" and value not in PLATFORMS:
                raise ConfigError(f"{where}={value!r} is neither 'fp32' nor a registered platform"
                                  f"{close_names(value.lower(), ['fp32', *PLATFORMS.names()])}; "
                                  f"platforms: {', '.join(PLATFORMS.names())}")
        elif isinstance(value, dict):
            Platform.check_overrides(value, where)
        else:
            raise ConfigError(f"{where} must be 'fp32', a platform name or a dict of overrides "
                              f"({{'bit_width': 4, 'symmetrical': True, 'per_channel': True}}), got {_kind(value)}")
    return table


def _no_builtins(names: list[str], path: str) -> list[str]:
    from fxq.algorithms.pipeline import ALGORITHM_ORDER  # noqa: PLC0415

    for name in names:
        if any(name in stage for stage in ALGORITHM_ORDER.values()):
            raise ConfigError(f"{path} names the built-in {name!r}; switch it on with setting.{name} = True instead")
    if len(set(names)) != len(names):
        raise ConfigError(f"{path}={names} names an algorithm twice")
    return names


@_setting("setting")
class QuantizationSetting(_Checked):
    """What the quantization pipeline does, switch by switch (PPQ's QuantizationSetting).

    ``dispatching_table`` maps a node/module name or a regex to ``"fp32"``, a platform name, or a dict
    of per-layer overrides (``{"bit_width": 4, "symmetrical": True, "per_channel": True}`` and any
    :class:`~fxq.Platform` field such as ``"weight_observer"``). ``custom_algorithms`` names algorithms
    registered with :func:`fxq.register_algorithm` to run after the built-ins of their stage, in this order.

    Raises:
        ConfigError: a value of the wrong type or out of range, an unknown field, an unregistered name.

    Example:
        >>> s = QuantizationSetting()
        >>> s.lsq_optimization = True
        >>> s.lsq_optimization_setting.lr = 1e-4
        >>> QuantizationSetting.from_json(s.to_json()) == s
        True
    """

    dispatcher: str = _opt("conservative", registry="dispatcher")
    dispatching_table: dict[str, Any] = _opt(factory=dict, check=_check_table)
    equalization: bool = False
    equalization_setting: EqualizationSetting = _opt(factory=EqualizationSetting)
    ssd_equalization: bool = False
    ssd_setting: SSDEqualizationSetting = _opt(factory=SSDEqualizationSetting)
    quantize_activation: bool = True
    quantize_activation_setting: ActivationQuantizationSetting = _opt(factory=ActivationQuantizationSetting)
    quantize_parameter: bool = True
    quantize_parameter_setting: ParameterQuantizationSetting = _opt(factory=ParameterQuantizationSetting)
    fusion: bool = True
    fusion_setting: FusionSetting = _opt(factory=FusionSetting)
    lsq_optimization: bool = False
    lsq_optimization_setting: LSQSetting = _opt(factory=LSQSetting)
    blockwise_reconstruction: bool = False
    blockwise_reconstruction_setting: BlockwiseReconstructionSetting = _opt(factory=BlockwiseReconstructionSetting)
    bias_correct: bool = False
    bias_correct_setting: BiasCorrectionSetting = _opt(factory=BiasCorrectionSetting)
    adaround: bool = False
    adaround_setting: AdaroundSetting = _opt(factory=AdaroundSetting)
    custom_algorithms: list[str] = _opt(factory=list, registry="algorithm", check=_no_builtins)

    # ------------------------------------------------------------------ json
    def to_json(self, indent: int = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> "QuantizationSetting":
        """Parse json text; a syntax error is a ConfigError with its line and column."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"setting json is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}"
                              ) from None
        return cls.from_dict(data)


class QuantizationSettingFactory:
    """PPQ-style constructors of default settings per backend."""

    @staticmethod
    def default_setting() -> QuantizationSetting:
        return QuantizationSetting()

    @staticmethod
    def trt_setting() -> QuantizationSetting:
        return QuantizationSetting()

    @staticmethod
    def pplcuda_setting() -> QuantizationSetting:
        return QuantizationSetting()

    @staticmethod
    def ncnn_setting() -> QuantizationSetting:
        return QuantizationSetting()

    @staticmethod
    def dsp_setting() -> QuantizationSetting:
        s = QuantizationSetting()
        s.equalization = True
        return s

    @staticmethod
    def academic_setting() -> QuantizationSetting:
        return QuantizationSetting(dispatcher="pointwise")
