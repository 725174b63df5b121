"""``QuantizationSetting``: the seeds' settings tree as plain dataclasses with a json round trip.

Field names and defaults follow PPQ's so that tutorials translate one to one
(``setting.lsq_optimization = True``, ``setting.lsq_optimization_setting.lr = 1e-4`` ...).
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any

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
]

DISPATCHERS = ("conservative", "aggressive", "pointwise", "allin")
ALIGN_ELEMENTWISE = ("None", "Align to Large", "Align to Output")


@dataclasses.dataclass
class EqualizationSetting:
    opt_level: int = 1
    iterations: int = 10
    value_threshold: float = 0.5
    including_bias: bool = False
    bias_multiplier: float = 0.5
    including_act: bool = False
    act_multiplier: float = 0.5


@dataclasses.dataclass
class SSDEqualizationSetting:
    opt_level: int = 1
    channel_ratio: float = 0.5
    loss_threshold: float = 0.8
    iteration: int = 3


@dataclasses.dataclass
class ActivationQuantizationSetting:
    calib_algorithm: str | None = None  # None: the platform's default observer


@dataclasses.dataclass
class ParameterQuantizationSetting:
    calib_algorithm: str | None = None
    quantize_passive_parameter: bool = True
    baking_parameter: bool = True


@dataclasses.dataclass
class FusionSetting:
    remove_useless_quantization: bool = True
    fuse_activation: bool = True
    fuse_passive_op: bool = True
    align_quantization: bool = True
    align_avgpooling_to: str = "None"
    align_elementwise_to: str = "Align to Large"
    align_concat_to: str = "Align to Output"
    align_resize_to: str = "Align to Output"
    force_alignment_overlap: bool = True

    def __post_init__(self) -> None:
        for name in ("align_avgpooling_to", "align_elementwise_to", "align_concat_to", "align_resize_to"):
            if getattr(self, name) not in ALIGN_ELEMENTWISE:
                raise ConfigError(f"fusion_setting.{name}={getattr(self, name)!r}; use one of {ALIGN_ELEMENTWISE}")


@dataclasses.dataclass
class LSQSetting:
    interested_layers: list[str] = dataclasses.field(default_factory=list)
    lr: float = 1e-5
    steps: int = 500
    is_scale_trainable: bool = True
    gamma: float = 0.0
    block_size: int = 4
    collecting_device: str = "cpu"

    @property
    def epochs(self) -> int:
        """The seeds' tutorial spelling of ``steps``."""
        return self.steps

    @epochs.setter
    def epochs(self, value: int) -> None:
        self.steps = int(value)


@dataclasses.dataclass
class BlockwiseReconstructionSetting:
    interested_layers: list[str] = dataclasses.field(default_factory=list)
    lr: float = 1e-3
    steps: int = 5000
    gamma: float = 1.0
    block_size: int = 4
    is_scale_trainable: bool = False
    drop_prob: float = 0.5  # QDrop: probability of keeping an activation un-quantized during reconstruction
    collecting_device: str = "cpu"


@dataclasses.dataclass
class BiasCorrectionSetting:
    block_size: int = 4
    steps: int = 32


@dataclasses.dataclass
class AdaroundSetting:
    interested_layers: list[str] = dataclasses.field(default_factory=list)
    lr: float = 1e-3
    steps: int = 1000
    reg_weight: float = 0.01
    beta_range: tuple[float, float] = (20.0, 2.0)
    warm_up: float = 0.2
    collecting_device: str = "cpu"


_SUBSETTINGS = {
    "equalization_setting": EqualizationSetting,
    "ssd_setting": SSDEqualizationSetting,
    "quantize_activation_setting": ActivationQuantizationSetting,
    "quantize_parameter_setting": ParameterQuantizationSetting,
    "fusion_setting": FusionSetting,
    "lsq_optimization_setting": LSQSetting,
    "blockwise_reconstruction_setting": BlockwiseReconstructionSetting,
    "bias_correct_setting": BiasCorrectionSetting,
    "adaround_setting": AdaroundSetting,
}


@dataclasses.dataclass
class QuantizationSetting:
    """What the quantization pipeline does, switch by switch (PPQ's QuantizationSetting).

    ``dispatching_table`` maps a node/module name or a regex to ``"fp32"``, a platform name, or a dict
    of per-layer overrides (``{"bit_width": 4, "symmetrical": True, "per_channel": True}``).

    Example:
        >>> s = QuantizationSetting()
        >>> s.lsq_optimization = True
        >>> s.lsq_optimization_setting.lr = 1e-4
        >>> QuantizationSetting.from_json(s.to_json()) == s
        True
    """

    dispatcher: str = "conservative"
    dispatching_table: dict[str, Any] = dataclasses.field(default_factory=dict)
    equalization: bool = False
    equalization_setting: EqualizationSetting = dataclasses.field(default_factory=EqualizationSetting)
    ssd_equalization: bool = False
    ssd_setting: SSDEqualizationSetting = dataclasses.field(default_factory=SSDEqualizationSetting)
    quantize_activation: bool = True
    quantize_activation_setting: ActivationQuantizationSetting = dataclasses.field(
        default_factory=ActivationQuantizationSetting)
    quantize_parameter: bool = True
    quantize_parameter_setting: ParameterQuantizationSetting = dataclasses.field(
        default_factory=ParameterQuantizationSetting)
    fusion: bool = True
    fusion_setting: FusionSetting = dataclasses.field(default_factory=FusionSetting)
    lsq_optimization: bool = False
    lsq_optimization_setting: LSQSetting = dataclasses.field(default_factory=LSQSetting)
    blockwise_reconstruction: bool = False
    blockwise_reconstruction_setting: BlockwiseReconstructionSetting = dataclasses.field(
        default_factory=BlockwiseReconstructionSetting)
    bias_correct: bool = False
    bias_correct_setting: BiasCorrectionSetting = dataclasses.field(default_factory=BiasCorrectionSetting)
    adaround: bool = False
    adaround_setting: AdaroundSetting = dataclasses.field(default_factory=AdaroundSetting)

    def __post_init__(self) -> None:
        if self.dispatcher not in DISPATCHERS:
            raise ConfigError(f"dispatcher={self.dispatcher!r}; use one of {DISPATCHERS}")

    # ------------------------------------------------------------------ json
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self, indent: int = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "QuantizationSetting":
        """Build from a dict; unknown keys raise (``epochs`` is accepted for LSQ's ``steps``)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ConfigError(f"unknown setting fields {sorted(unknown)}; known: {sorted(known)}")
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            sub = _SUBSETTINGS.get(key)
            if sub is not None and isinstance(value, dict):
                value = dict(value)
                if sub is LSQSetting and "epochs" in value:
                    value["steps"] = value.pop("epochs")
                sub_known = {f.name for f in dataclasses.fields(sub)}
                bad = set(value) - sub_known
                if bad:
                    raise ConfigError(f"unknown fields {sorted(bad)} in {key}; known: {sorted(sub_known)}")
                if "beta_range" in value:
                    value["beta_range"] = tuple(value["beta_range"])
                value = sub(**value)
            kwargs[key] = value
        return cls(**kwargs)

    @classmethod
    def from_json(cls, text: str) -> "QuantizationSetting":
        return cls.from_dict(json.loads(text))


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
