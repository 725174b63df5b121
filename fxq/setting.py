"""``QuantizationSetting``: the seeds' settings tree as plain dataclasses with a json round trip.

Field names and defaults follow PPQ's so that tutorials translate one to one
(``setting.lsq_optimization = True``, ``setting.lsq_optimization_setting.lr = 1e-4`` ...).

Every field is checked against its type annotation and its ``field(metadata=...)`` bounds when it is set — by the
constructor, by assignment and by :meth:`~fxq.checked.Checked.from_dict` — and :meth:`QuantizationSetting.validate` re-checks
the whole tree (for lists and dicts changed in place) before :func:`fxq.prepare` / :func:`fxq.quantize` do any work.
Booleans must be real booleans, numbers real numbers; unknown names raise :class:`~fxq.errors.ConfigError` with the
closest known names. Names in ``dispatcher``, ``calib_algorithm`` and ``custom_algorithms`` are looked up in their
registries, so register your dispatcher / observer / algorithm before building a setting that names it.

The algorithms' switches and settings (``equalization`` / ``equalization_setting``, ``adaround`` /
``adaround_setting`` ...) are not listed here: each algorithm declares its settings dataclass next to its code and
registers both (:func:`fxq.register_algorithm`), and ``QuantizationSetting`` composes every registered switch.

Removed fields: ``fusion_setting.remove_useless_quantization`` and ``fusion_setting.force_alignment_overlap`` (fxq
always gives a tensor one quantizer, which its consumers and aligned ops share: PPQ's behaviour with both True).
A setting (or json) that still sets them to ``True`` gets a ``DeprecationWarning``; ``False`` is a ConfigError.
"""
from __future__ import annotations

import json
from typing import Any, ClassVar

# the algorithms' settings classes, re-exported where they used to live (``from fxq.setting import LSQSetting``)
from fxq.algorithms.adaround import AdaroundSetting
from fxq.algorithms.bias_correction import BiasCorrectionSetting
from fxq.algorithms.brecq import BlockwiseReconstructionSetting
from fxq.algorithms.equalization import EqualizationSetting
from fxq.algorithms.lsq import LSQSetting
from fxq.algorithms.pipeline import ALGORITHMS, SWITCHES, switches
from fxq.algorithms.ssd_equalization import SSDEqualizationSetting
from fxq.checked import Checked, ExtraField, _kind, checked_setting, opt
from fxq.errors import ConfigError
from fxq.graph.dispatch import DISPATCHERS
from fxq.observers import OBSERVERS
from fxq.qconfig.base import PLATFORMS, Platform
from fxq.registry import close_names

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

ALIGN_ELEMENTWISE = ("None", "Align to Large", "Align to Output")


# ------------------------------------------------------------------------------------------- sub-settings
@checked_setting("setting.quantize_activation_setting")
class ActivationQuantizationSetting(Checked):
    calib_algorithm: str | None = opt(None, registry=OBSERVERS)  # None: the platform's default observer


@checked_setting("setting.quantize_parameter_setting")
class ParameterQuantizationSetting(Checked):
    calib_algorithm: str | None = opt(None, registry=OBSERVERS)
    quantize_passive_parameter: bool = True
    baking_parameter: bool = True


@checked_setting("setting.fusion_setting")
class FusionSetting(Checked):
    REMOVED: ClassVar[dict[str, str]] = {
        "remove_useless_quantization": "fxq always shares one quantizer between a tensor's producer and consumers",
        "force_alignment_overlap": "aligned inputs are their producers' quantizers, so alignment always overlaps",
    }
    fuse_activation: bool = True
    fuse_passive_op: bool = True
    align_quantization: bool = True
    align_avgpooling_to: str = opt("None", choices=ALIGN_ELEMENTWISE)
    align_elementwise_to: str = opt("Align to Large", choices=ALIGN_ELEMENTWISE)
    align_concat_to: str = opt("Align to Output", choices=ALIGN_ELEMENTWISE)
    align_resize_to: str = opt("Align to Output", choices=ALIGN_ELEMENTWISE)
    # Concats whose inputs' ranges differ more than this keep their output FP32 (None: never); see
    # fxq.graph.calibrate.MIXED_RANGE_RATIO for the reasoning behind the default.
    mixed_range_concat_ratio: float | None = opt(64.0, gt=1.0, why="a ratio of input ranges; None switches "
                                                                       "the check off")


def _check_table(table: dict[str, Any], path: str) -> dict[str, Any]:
    """Dispatching-table values: ``"fp32"``, a platform name or Platform, or a dict of overrides."""
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


def _no_switches(names: list[str], path: str) -> list[str]:
    for name in names:
        if name in SWITCHES:
            raise ConfigError(f"{path} names the built-in {name!r}; switch it on with setting.{name} = True instead")
    if len(set(names)) != len(names):
        raise ConfigError(f"{path}={names} names an algorithm twice")
    return names


@checked_setting("setting")
class QuantizationSetting(Checked):
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

    dispatcher: str = opt("conservative", registry=DISPATCHERS)
    dispatching_table: dict[str, Any] = opt(factory=dict, check=_check_table)
    quantize_activation: bool = True
    quantize_activation_setting: ActivationQuantizationSetting = opt(factory=ActivationQuantizationSetting)
    quantize_parameter: bool = True
    quantize_parameter_setting: ParameterQuantizationSetting = opt(factory=ParameterQuantizationSetting)
    fusion: bool = True
    fusion_setting: FusionSetting = opt(factory=FusionSetting)
    custom_algorithms: list[str] = opt(factory=list, registry=ALGORITHMS, check=_no_switches)

    @classmethod
    def extra_fields(cls) -> dict[str, ExtraField]:
        """Each registered algorithm switch (``<name>: bool``, off) and its settings (``<field>``), in running
        order: composed from the algorithm registry, so an algorithm adds its fields without an edit here."""
        out: dict[str, ExtraField] = {}
        for switch in switches():
            out[switch.name] = ExtraField(bool, bool)
            out[switch.field] = ExtraField(switch.config, switch.config)
        return out

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
        """fxq's defaults, which are also TensorRT's, PPL CUDA's and ncnn's (PPQ's names for them below)."""
        return QuantizationSetting()

    trt_setting = pplcuda_setting = ncnn_setting = default_setting

    @staticmethod
    def dsp_setting() -> QuantizationSetting:
        s = QuantizationSetting()
        s.equalization = True
        return s

    @staticmethod
    def academic_setting() -> QuantizationSetting:
        return QuantizationSetting(dispatcher="pointwise")
