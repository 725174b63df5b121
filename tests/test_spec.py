"""TensorQuantConfig validation, serialization and the parsing of enum spellings."""
from __future__ import annotations

import json
import math

import pytest
import torch

from fxq.errors import ConfigError, FxqError
from fxq.spec import MIN_SCALE, FloatFormat, QuantState, RoundingPolicy, TensorQuantConfig

# (id, constructor kwargs, words the message must contain)
INVALID = [
    ("qmin-eq-qmax", dict(quant_min=5, quant_max=5), ["quant_min=5", "quant_max=5"]),
    ("qmin-gt-qmax", dict(quant_min=10, quant_max=-10), ["smaller than"]),
    ("range-too-wide", dict(num_bits=8, quant_min=-128, quant_max=128), ["8 bits", "raise num_bits"]),
    ("range-beyond-unsigned", dict(num_bits=4, symmetric=False, quant_min=0, quant_max=16), ["4 bits"]),
    ("range-below-signed", dict(num_bits=4, quant_min=-9, quant_max=7), ["4 bits"]),
    ("qmin-not-integer", dict(quant_min=0.5, quant_max=10), ["quant_min", "integer"]),
    ("qmax-not-a-number", dict(quant_max="many"), ["quant_max", "finite number"]),
    ("qmax-nan", dict(quant_max=math.nan), ["quant_max", "finite"]),
    ("bits-1", dict(num_bits=1), ["num_bits=1", "2..16"]),
    ("bits-17-active", dict(num_bits=17, state=QuantState.ACTIVATED), ["num_bits=17", "passive"]),
    ("bits-32-initial", dict(num_bits=32), ["num_bits=32", "passive"]),
    ("bits-33-passive", dict(num_bits=33, state=QuantState.PASSIVE), ["num_bits=33", "2..32"]),
    ("bits-float", dict(num_bits=8.0), ["num_bits must be an int"]),
    ("bits-none", dict(num_bits=None), ["num_bits must be an int"]),
    ("bits-bool", dict(num_bits=True), ["num_bits must be an int"]),
    ("floating-asymmetric", dict(fp_format="e4m3", symmetric=False), ["symmetric"]),
    ("floating-not-8-bits", dict(fp_format="e5m2", num_bits=16), ["8 bits"]),
    ("floating-range-too-wide", dict(fp_format="e4m3", quant_min=-500.0, quant_max=500.0), ["E4M3", "448"]),
    ("floating-range-lopsided", dict(fp_format="e4m3", quant_min=-448.0, quant_max=200.0), ["symmetric"]),
    ("unknown-format", dict(fp_format="e3m4"), ["e3m4", "e4m3"]),
    ("unknown-rounding", dict(rounding="ROUND_SIDEWAYS"), ["ROUND_SIDEWAYS", "HALF_EVEN"]),
    ("unknown-rounding-code", dict(rounding=42), ["42"]),
    ("unknown-state", dict(state="sleeping"), ["sleeping", "ACTIVATED"]),
    ("scale-zero", dict(scale=0.0), ["scale must be finite and > 0", str(MIN_SCALE)]),
    ("scale-negative", dict(scale=-1.0), ["scale must be finite and > 0"]),
    ("scale-nan", dict(scale=math.nan), ["scale must be finite and > 0"]),
    ("scale-inf", dict(scale=math.inf), ["scale must be finite and > 0"]),
    ("scale-2d", dict(scale=[[1.0, 2.0]], per_channel=True), ["1-D"]),
    ("scale-empty", dict(scale=torch.ones(0), per_channel=True), ["empty"]),
    ("per-tensor-many-scales", dict(scale=[1.0, 2.0]), ["per-tensor", "2", "per_channel=True"]),
    ("offset-count", dict(symmetric=False, per_channel=True, scale=[1.0, 2.0], offset=[0.0]), ["1", "2"]),
    ("offset-on-symmetric", dict(scale=1.0, offset=3.0), ["symmetric", "offset 0"]),
    ("offset-fraction", dict(symmetric=False, scale=1.0, offset=0.5), ["integers"]),
    ("offset-out-of-range", dict(symmetric=False, scale=1.0, offset=300.0), ["[0, 255]"]),
    ("pow2-scale-not-pow2", dict(power_of_2=True, scale=0.3), ["power of two"]),
    ("channel-axis-not-int", dict(per_channel=True, channel_axis=1.5), ["channel_axis"]),
]


@pytest.mark.parametrize("kwargs, words", [pytest.param(k, w, id=i) for i, k, w in INVALID])
def test_invalid_config_raises_config_error(kwargs, words):
    with pytest.raises(ConfigError) as info:
        TensorQuantConfig(**kwargs)
    assert isinstance(info.value, FxqError)
    message = str(info.value)
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"


def test_config_error_is_an_fxq_error_and_a_value_error():
    assert issubclass(ConfigError, FxqError)
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param(dict(), id="int8-sym"),
        pytest.param(dict(symmetric=False), id="uint8-asym"),
        pytest.param(dict(num_bits=2), id="int2"),
        pytest.param(dict(num_bits=16, symmetric=False), id="uint16"),
        pytest.param(dict(quant_min=-127, quant_max=127), id="narrow-int8"),
        pytest.param(dict(quant_min=0, quant_max=255), id="unsigned-symmetric"),
        pytest.param(dict(num_bits=9, quant_min=-128, quant_max=128), id="seed-range-9-bits"),
        pytest.param(dict(num_bits=32, state=QuantState.PASSIVE), id="int32-passive"),
        pytest.param(dict(num_bits=30, state="passive_init"), id="int30-passive-init"),
        pytest.param(dict(fp_format="e4m3"), id="fp8-e4m3"),
        pytest.param(dict(fp_format=FloatFormat.E5M2, quant_min=-1024.0, quant_max=1024.0), id="fp8-e5m2-narrow"),
        pytest.param(dict(power_of_2=True, scale=0.125), id="pow2"),
        pytest.param(dict(per_channel=True, channel_axis=1, scale=[0.5, 1.0, 2.0]), id="per-channel"),
        pytest.param(dict(symmetric=False, scale=0.1, offset=128.0), id="asym-offset"),
    ],
)
def test_valid_configs(kwargs):
    cfg = TensorQuantConfig(**kwargs)
    assert cfg.quant_min < cfg.quant_max


def test_defaults_and_derived_facts():
    cfg = TensorQuantConfig()
    assert (cfg.quant_min, cfg.quant_max) == (-128, 127)
    assert cfg.rounding is RoundingPolicy.HALF_EVEN and cfg.state is QuantState.INITIAL
    assert not cfg.has_qparams and not cfg.is_quantizing and not cfg.is_floating
    assert TensorQuantConfig(symmetric=False).default_range() == (0, 255)
    assert TensorQuantConfig(num_bits=4).default_range() == (-8, 7)
    assert TensorQuantConfig(fp_format="e5m2").default_range() == (-57344.0, 57344.0)
    cfg = TensorQuantConfig(scale=2.0, state="activated")
    assert cfg.is_quantizing and cfg.has_qparams
    assert torch.equal(cfg.offset, torch.zeros(1))  # offset defaults to 0 when a scale is given
    assert TensorQuantConfig(num_bits=32, state=QuantState.PASSIVE).is_passive


def test_check_channels():
    cfg = TensorQuantConfig(per_channel=True, channel_axis=1, scale=[1.0, 2.0, 3.0])
    cfg.check_channels((4, 3, 5))
    cfg.replace(channel_axis=-2).check_channels((4, 3, 5))
    with pytest.raises(ConfigError, match="3 scales for 4 channels on axis 1"):
        cfg.check_channels((2, 4), where="conv1.weight")
    with pytest.raises(ConfigError, match="conv1.weight"):
        cfg.check_channels((2, 4), where="conv1.weight")
    with pytest.raises(ConfigError, match="0-d"):
        cfg.check_channels(())
    with pytest.raises(ConfigError, match="channel_axis=3 is outside a 2-d tensor"):
        cfg.replace(channel_axis=3).check_channels((5, 3))  # must not wrap around to axis 1
    with pytest.raises(ConfigError, match="outside"):
        cfg.replace(channel_axis=-3).check_channels((3, 5))
    TensorQuantConfig(scale=1.0).check_channels((7, 9))  # per-tensor: nothing to check


def test_set_qparams_validates_and_keeps_old_values_on_error():
    cfg = TensorQuantConfig(symmetric=False)
    cfg.set_qparams(0.5, 3)
    assert cfg.scale.tolist() == [0.5] and cfg.offset.tolist() == [3.0]
    with pytest.raises(ConfigError):
        cfg.set_qparams(-1.0)
    with pytest.raises(ConfigError):
        cfg.set_qparams([1.0, 2.0])
    assert cfg.scale.tolist() == [0.5]


def test_replace_is_a_validated_copy():
    cfg = TensorQuantConfig(scale=[1.0, 2.0], per_channel=True)
    copy = cfg.replace(num_bits=4, quant_min=None, quant_max=None)  # None: the default range of 4 bits
    assert (copy.quant_min, copy.quant_max) == (-8, 7)
    assert copy.num_bits == 4 and copy.scale is not cfg.scale and torch.equal(copy.scale, cfg.scale)
    with pytest.raises(ConfigError):
        cfg.replace(per_channel=False)  # two scales on a per-tensor config


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param(dict(), id="blank"),
        pytest.param(
            dict(
                num_bits=6, symmetric=False, per_channel=True, channel_axis=1, rounding="ROUND_HALF_UP",
                scale=[0.25, 0.5], offset=[3.0, 7.0], state=QuantState.ACTIVATED, observer="mse",
            ),
            id="asym-per-channel",
        ),
        pytest.param(dict(fp_format="e4m3", power_of_2=True, scale=0.0625, state="baked"), id="fp8"),
        pytest.param(dict(num_bits=32, state=QuantState.PASSIVE, scale=1e-6), id="int32-passive"),
        pytest.param(dict(quant_min=-127, quant_max=127, rounding=RoundingPolicy.TO_NEAR_INT), id="narrow"),
    ],
)
def test_dict_round_trip_through_json(kwargs):
    cfg = TensorQuantConfig(**kwargs)
    data = json.loads(json.dumps(cfg.to_dict()))
    back = TensorQuantConfig.from_dict(data)
    assert back.to_dict() == cfg.to_dict()
    for name in ("num_bits", "symmetric", "per_channel", "channel_axis", "power_of_2", "fp_format",
                 "quant_min", "quant_max", "rounding", "state", "observer"):
        assert getattr(back, name) == getattr(cfg, name), name
    for name in ("scale", "offset"):
        a, b = getattr(cfg, name), getattr(back, name)
        assert (a is None and b is None) or torch.equal(a, b)


def test_from_dict_rejects_unknown_fields():
    data = TensorQuantConfig().to_dict()
    data["bit_width"] = 8
    with pytest.raises(ConfigError, match="bit_width"):
        TensorQuantConfig.from_dict(data)


@pytest.mark.parametrize(
    "spelling, expected",
    [
        ("ROUND_HALF_EVEN", RoundingPolicy.HALF_EVEN),
        ("ROUND_HALF_UP", RoundingPolicy.HALF_UP),
        ("ROUND_HALF_DOWN", RoundingPolicy.HALF_DOWN),
        ("ROUND_HALF_TOWARDS_ZERO", RoundingPolicy.HALF_TOWARDS_ZERO),
        ("ROUND_HALF_FAR_FORM_ZERO", RoundingPolicy.HALF_FAR_FROM_ZERO),  # PPQ's spelling
        ("ROUND_HALF_FAR_FROM_ZERO", RoundingPolicy.HALF_FAR_FROM_ZERO),
        ("ROUND_TO_NEAR_INT", RoundingPolicy.TO_NEAR_INT),
        ("ROUND_UP", RoundingPolicy.UP),
        ("RoundingPolicy.ROUND_HALF_EVEN", RoundingPolicy.HALF_EVEN),  # str() of PPQ's enum member
        ("round_half_even", RoundingPolicy.HALF_EVEN),
        ("half_up", RoundingPolicy.HALF_UP),
        ("DOWN", RoundingPolicy.DOWN),
        (0, RoundingPolicy.HALF_EVEN),
        (5, RoundingPolicy.TO_NEAR_INT),  # PPQ's integer codes 0..6 are fxq's
        (6, RoundingPolicy.UP),
        (RoundingPolicy.HALF_DOWN, RoundingPolicy.HALF_DOWN),
    ],
)
def test_rounding_policy_parse(spelling, expected):
    assert RoundingPolicy.parse(spelling) is expected
    assert TensorQuantConfig(rounding=spelling).rounding is expected


@pytest.mark.parametrize("bad", ["ROUND_NEAREST", "", 8, -1, True, None])
def test_rounding_policy_parse_rejects(bad):
    with pytest.raises(ConfigError, match="rounding policy"):
        RoundingPolicy.parse(bad)


def test_state_and_format_parse():
    assert QuantState.parse("ACTIVATED") is QuantState.ACTIVATED
    assert QuantState.parse("passive_baked") is QuantState.PASSIVE_BAKED
    assert FloatFormat.parse("E4M3") is FloatFormat.E4M3
    assert FloatFormat.E4M3.max_value == 448.0 and FloatFormat.E5M2.max_value == 57344.0
    assert FloatFormat.E4M3.min_exponent == -6 and FloatFormat.E5M2.min_exponent == -14


def test_repr_names_the_scheme():
    text = repr(TensorQuantConfig(symmetric=False, per_channel=True, channel_axis=1, observer="kl"))
    assert "int8" in text and "asym" in text and "axis=1" in text and "kl" in text
