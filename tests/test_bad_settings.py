"""Every bad setting, override or table entry is a named ConfigError; backend capabilities are checked at prepare;
user dispatchers and algorithms plug in; removed settings say so."""
from __future__ import annotations

import json
import logging

import pytest
import torch

import fxq
from fxq.graph.info import NodeQuant
from fxq.graph.quant_graph import QuantGraph
from fxq.setting import QuantizationSetting as S

from _models import small_cnn


def _data(n: int = 2) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, 3, 16, 16, generator=g) for _ in range(n)]


def _prepare(platform: str = "academic_int8", setting: S | None = None, **kw):
    return fxq.prepare(small_cnn(), platform, _data(1)[0], setting, **kw)


def _roles(gm, role: str) -> dict:
    infos = QuantGraph(gm).infos()
    return {n: fq for n, fq in gm.fxq_quantizers.items() if infos[n].role == role}


# ------------------------------------------------------------------------------------ overrides
BAD_SCHEMES = [
    pytest.param("bit_width", 8.5, id="bits-float"),
    pytest.param("bit_width", "8", id="bits-str"),
    pytest.param("bit_width", 0, id="bits-0"),
    pytest.param("bit_width", -4, id="bits-negative"),
    pytest.param("bit_width", True, id="bits-bool"),
    pytest.param("bit_width", 17, id="bits-17"),
    pytest.param("symmetrical", "yes", id="sym-str"),
    pytest.param("symmetrical", 1, id="sym-int"),
    pytest.param("per_channel", "no", id="pc-str"),
    pytest.param("per_channel", 0, id="pc-zero"),
]


@pytest.mark.parametrize("key,value", BAD_SCHEMES)
def test_bad_scheme_override_per_call(key, value):
    for call in (lambda: _prepare(**{key: value}),
                 lambda: fxq.quantize(small_cnn(), _data(), "academic_int8", progress=False, **{key: value})):
        with pytest.raises(fxq.ConfigError, match=rf"fxq.prepare/quantize\(platform='academic_int8'.*{key}"):
            call()


@pytest.mark.parametrize("key,value", BAD_SCHEMES)
def test_bad_scheme_override_in_table(key, value):
    with pytest.raises(fxq.ConfigError, match=rf"setting.dispatching_table\['fc'\]: {key}"):
        S(dispatching_table={"fc": {key: value}})
    s = S()
    s.dispatching_table["fc"] = {key: value}  # changed in place: prepare re-validates before any work
    with pytest.raises(fxq.ConfigError, match=rf"setting.dispatching_table\['fc'\]: {key}"):
        _prepare(setting=s)


def test_unknown_override_key_names_close_ones():
    with pytest.raises(fxq.ConfigError, match=r"unknown override 'bitwidth' \(did you mean 'bit_width'\?\)"):
        S(dispatching_table={"fc": {"bitwidth": 4}})
    with pytest.raises(fxq.ConfigError, match=r"did you mean 'weight_observer'"):
        S(dispatching_table={"fc": {"weight_observr": "minmax"}})
    with pytest.raises(fxq.ConfigError, match=r"'trt_int' is neither 'fp32' nor a registered platform.*trt_int8"):
        S(dispatching_table={"fc": "trt_int"})
    with pytest.raises(fxq.ConfigError, match=r"dispatching_table\['fc'\] must be 'fp32'"):
        S(dispatching_table={"fc": 4})


def test_invalid_regex_key_is_a_config_error():
    with pytest.raises(fxq.ConfigError, match=r"key 'conv\(' is neither a node name nor a valid regex"):
        _prepare(setting=S(dispatching_table={"conv(": "fp32"}))


def test_table_entry_matching_no_node_warns_with_close_names(caplog):
    with caplog.at_level(logging.WARNING, logger="fxq.graph.dispatch"):
        gm = _prepare(setting=S(dispatching_table={"conv22": "fp32", "conv1": "fp32"}))
    msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(msgs) == 1 and "'conv22' matches no node" in msgs[0] and "'conv2'" in msgs[0]
    assert next(n for n in gm.graph.nodes if n.name == "conv1").meta["fxq"].platform == "fp32"


# ------------------------------------------------------------------------------------ settings tree
@pytest.mark.parametrize("data,match", [
    ({"lsq_optimization": "no"}, r"setting.lsq_optimization must be true or false.*'no'"),
    ({"fusion": 1}, r"setting.fusion must be true or false"),
    ({"adaround_setting": 5}, r"setting.adaround_setting must be a dict of AdaroundSetting fields"),
    ({"quantize_activation_setting": []}, r"setting.quantize_activation_setting must be a dict"),
    ({"lsq_optimisation": True}, r"unknown field 'lsq_optimisation' \(did you mean 'lsq_optimization'"),
    ({"bitwidth": 4}, r"unknown field 'bitwidth'.*dispatching_table.*did you mean 'bit_width'"),
    ({"fusion_setting": {"fuse_activations": True}}, r"setting.fusion_setting: unknown field.*'fuse_activation'"),
    ({"lsq_optimization_setting": {"steps": 0}}, r"setting.lsq_optimization_setting.steps=0 must be >= 1"),
    ({"lsq_optimization_setting": {"epochs": -5}}, r"setting.lsq_optimization_setting.steps=-5 must be >= 1"),
    ({"lsq_optimization_setting": {"steps": 2.5}}, r"steps must be an integer, got 2.5"),
    ({"lsq_optimization_setting": {"lr": "1e-3"}}, r"lsq_optimization_setting.lr must be a finite number"),
    ({"adaround_setting": {"lr": 0}}, r"setting.adaround_setting.lr=0.0 must be > 0"),
    ({"adaround_setting": {"beta_range": [2, 20]}}, r"beta_range=\[2.0, 20.0\]"),
    ({"adaround_setting": {"beta_range": 3}}, r"beta_range must be a list of 2 values"),
    ({"blockwise_reconstruction_setting": {"drop_prob": 1.5}}, r"drop_prob=1.5 must be <= 1"),
    ({"bias_correct_setting": {"block_size": 0}}, r"bias_correct_setting.block_size=0 must be >= 1"),
    ({"equalization_setting": {"iterations": 0}}, r"equalization_setting.iterations=0 must be >= 1"),
    ({"equalization_setting": {"opt_level": 3}}, r"opt_level=3; use one of \[1, 2\]"),
    ({"fusion_setting": {"align_concat_to": "Align to Input"}}, r"align_concat_to='Align to Input'"),
    ({"lsq_optimization_setting": {"collecting_device": "executor"}}, r"collecting_device='executor' is not a torch"),
    ({"lsq_optimization_setting": {"interested_layers": "conv1"}}, r"interested_layers must be a list"),
    ({"quantize_parameter_setting": {"calib_algorithm": "minmx"}}, r"'minmx' is not a registered observer.*minmax"),
    ({"dispatcher": "conservativ"}, r"'conservativ' is not a registered dispatcher.*'conservative'"),
    ({"custom_algorithms": ["no_such_algorithm"]}, r"'no_such_algorithm' is not a registered algorithm"),
    ({"custom_algorithms": ["adaround"]}, r"built-in 'adaround'; switch it on with setting.adaround = True"),
    ([1, 2], r"setting must be a dict of QuantizationSetting fields"),
])
def test_bad_setting_dict(data, match):
    with pytest.raises(fxq.ConfigError, match=match):
        S.from_dict(data)
    with pytest.raises(fxq.ConfigError, match=match):
        S.from_json(json.dumps(data))


def test_bad_assignment_is_refused_where_it_happens():
    s = S()
    with pytest.raises(fxq.ConfigError, match=r"unknown field 'lsq_optimisation' \(did you mean"):
        s.lsq_optimisation = True  # a typo used to create a new attribute silently
    with pytest.raises(fxq.ConfigError, match="setting.lsq_optimization_setting.steps=0"):
        s.lsq_optimization_setting.epochs = 0
    with pytest.raises(fxq.ConfigError, match="setting.bias_correct must be true or false"):
        s.bias_correct = "False"
    s.lsq_optimization_setting.interested_layers.append(3)  # in place: caught by validate() at prepare
    with pytest.raises(fxq.ConfigError, match=r"interested_layers\[0\] must be a string"):
        fxq.quantize(small_cnn(), _data(), "academic_int8", s, progress=False)
    with pytest.raises(fxq.ConfigError, match="setting must be a fxq.QuantizationSetting"):
        _prepare(setting=5)


def test_invalid_json_names_line_and_column():
    with pytest.raises(fxq.ConfigError, match="not valid JSON.*line 2, column 7"):
        S.from_json('{"fusion": true,\n "x": }')


def test_good_settings_still_round_trip_and_normalize():
    s = S.from_dict({"adaround_setting": {"beta_range": [10, 1], "steps": 3.0}, "dispatching_table": {"fc": "fp32"}})
    assert s.adaround_setting.beta_range == (10.0, 1.0) and s.adaround_setting.steps == 3
    assert S.from_json(s.to_json()) == s
    assert S(adaround_setting={"steps": 7}).adaround_setting.steps == 7


# ------------------------------------------------------------------------------------ removed settings
@pytest.mark.parametrize("name", ["remove_useless_quantization", "force_alignment_overlap"])
def test_removed_fusion_fields(name):
    with pytest.warns(DeprecationWarning, match=f"fusion_setting.{name} was removed and is ignored"):
        s = S.from_dict({"fusion_setting": {name: True}})
    assert s == S()
    with pytest.warns(DeprecationWarning):
        S().fusion_setting.__setattr__(name, True)
    with pytest.raises(fxq.ConfigError, match=f"fusion_setting.{name}=False: this field was removed"):
        S.from_dict({"fusion_setting": {name: False}})


def test_one_quantizer_per_tensor_is_what_the_removed_fields_asked_for():
    """remove_useless_quantization / force_alignment_overlap = True: concat inputs are their producers' quantizers."""
    gm = _prepare("trt_int8")
    cat = next(n for n in gm.graph.nodes if isinstance(n.meta.get("fxq"), NodeQuant) and n.meta["fxq"].op_type
               == "Concat")
    quantizer_sources = [QuantGraph(gm).infos()[q].source for q in cat.meta["fxq"].inputs.values()]
    assert len(quantizer_sources) == len(set(quantizer_sources))  # no tensor quantized twice
    assert any(g.kind == "output" for g in QuantGraph(gm).alignment_groups())


def test_deactivated_state_was_removed():
    assert "DEACTIVATED" not in fxq.QuantState.__members__
    with pytest.raises(fxq.ConfigError, match="no DEACTIVATED state: use fxq.switch_to_fp32"):
        fxq.QuantState.parse("deactivated")


# ------------------------------------------------------------------------------------ capabilities
@pytest.mark.parametrize("platform,kw,match", [
    ("trt_int8", {"bit_width": 4}, r"trt_int8 exports TensorRT INT8 Q/DQ.*bit_width must be 8, got 4.*academic_int4"),
    ("trt_int8", {"symmetrical": False}, r"trt_int8 exports.*must be symmetric"),
    ("trt_fp8", {"symmetrical": False}, r"FP8.*symmetric only.*trt_fp8 exports TensorRT FP8"),
    ("trt_fp8", {"bit_width": 4}, r"FP8.*bit_width=8 only"),
    ("ncnn_int8", {"symmetrical": False}, r"ncnn_int8 exports ncnn int8 layers.*must be symmetric"),
    ("ncnn_int8", {"bit_width": 4}, r"ncnn_int8 exports.*activation quantization bit_width must be 8"),
])
def test_capability_checked_at_prepare_before_calibration(platform, kw, match, monkeypatch):
    calibrated = []
    monkeypatch.setattr(fxq.api, "calibrate", lambda *a, **k: calibrated.append(1))
    with pytest.raises(fxq.ConfigError, match=rf"fxq.prepare/quantize\(platform='{platform}'.*{match}"):
        fxq.quantize(small_cnn(), _data(), platform, progress=False, **kw)
    assert not calibrated
    key = next(iter(kw))
    with pytest.raises(fxq.ConfigError, match=rf"dispatching_table\['fc'\] on platform '{platform}'"):
        _prepare(platform, S(dispatching_table={"fc": {key: kw[key]}}))


def test_capability_rules_per_role_and_bias():
    with pytest.raises(fxq.ConfigError, match="activation quantization must be per-tensor"):
        fxq.get_platform("trt_int8").with_overrides(activation=fxq.TensorQuantConfig(per_channel=True))
    with pytest.raises(fxq.ConfigError, match="must round HALF_EVEN, got HALF_UP"):
        _prepare("trt_int8", S(dispatching_table={"conv.*": {"rounding": "HALF_UP"}}))
    with pytest.raises(fxq.ConfigError, match="ppl_cuda_int8.*must be integer, got FP8 E4M3"):
        fxq.get_platform("ppl_cuda_int8").with_overrides(activation=fxq.TensorQuantConfig(fp_format="e4m3"))
    with pytest.raises(fxq.ConfigError, match="ncnn_int8.*biases stay FP32"):
        _prepare("ncnn_int8", S(dispatching_table={"fc": {"bias_bits": 32}}))


def test_capability_checked_on_per_op_configs():
    """A platform rule that hands out an inexpressible config per op fails at prepare, naming the node."""

    @fxq.register_platform("test_trt_int4_fc", override=True)
    class Int4Fc(fxq.get_platform("trt_int8").__class__):
        def weight_config(self, op_type, node_name, weight_shape, op_attrs):
            cfg = super().weight_config(op_type, node_name, weight_shape, op_attrs)
            return cfg.replace(num_bits=4, quant_min=-7, quant_max=7) if node_name == "fc" else cfg

    try:
        with pytest.raises(fxq.ConfigError, match=r"node 'fc' \(weight config from platform 'test_trt_int4_fc'\).*"
                                                  r"bit_width must be 8, got 4"):
            _prepare("test_trt_int4_fc")
    finally:  # registries are global: leave none of this test's platforms to the tests after it
        fxq.qconfig.PLATFORMS.unregister("test_trt_int4_fc")


def test_expressible_overrides_pass():
    gm = _prepare("ort_int8", bit_width=4)  # ONNX QDQ writes int4 (opset 21)
    assert {fq.config.num_bits for fq in _roles(gm, "weight").values()} == {4}
    gm = _prepare("ncnn_int8", S(dispatching_table={"fc": {"per_channel": False}}))
    assert not next(fq for n, fq in _roles(gm, "weight").items() if n.startswith("fc")).config.per_channel
    gm = _prepare("academic_int8", bit_width=3, symmetrical=False)  # simulation: anything valid
    assert {fq.config.num_bits for fq in _roles(gm, "activation").values()} == {3}

    @fxq.register_platform("test_no_exporter_platform", override=True)
    class Mine(fxq.Platform):
        exporter = ""

    gm = _prepare("test_no_exporter_platform", bit_width=5, symmetrical=False, per_channel=False)
    assert {fq.config.num_bits for fq in _roles(gm, "weight").values()} == {5}


# ------------------------------------------------------------------------------------ open registries
def test_user_dispatcher_from_registry():
    @fxq.register_dispatcher("test_convs_only", override=True)
    def convs_only(t, platform, fed):
        return t == "Conv"

    s = S.from_json(json.dumps({"dispatcher": "test_convs_only"}))
    gm = _prepare("trt_int8", s)
    platforms = {n.name: n.meta["fxq"].platform for n in gm.graph.nodes if isinstance(n.meta.get("fxq"), NodeQuant)}
    assert platforms["conv1"] == platforms["conv2"] == "trt_int8"
    assert platforms["fc"] == platforms["up"] == platforms["add"] == "fp32"


def test_user_algorithms_run_inside_quantize_in_their_stage():
    seen: list[tuple[str, set]] = []

    def states(gm):
        return {fq.config.state for fq in gm.fxq_quantizers.values() if not fq.config.is_passive}

    @fxq.register_algorithm("test_record_pre", stage="pre", override=True)
    def record_pre(gm, data, setting, steps=None, collate_fn=None):
        seen.append(("pre", states(gm)))
        return gm

    @fxq.register_algorithm("test_double_scales", override=True)  # default stage: "post"
    def double_scales(gm, data, setting, steps=None, collate_fn=None):
        seen.append(("post", states(gm)))
        for fq in _roles(gm, "activation").values():
            if fq.config.state is fxq.QuantState.ACTIVATED:
                fq.set_qparams(fq.scale.detach() * 2, fq.offset.detach())
        return gm

    base = fxq.quantize(small_cnn(), _data(), "trt_int8", progress=False)
    s = S(custom_algorithms=["test_double_scales", "test_record_pre"])
    q = fxq.quantize(small_cnn(), _data(), "trt_int8", s, progress=False)
    assert [stage for stage, _ in seen] == ["pre", "post"]
    assert seen[0][1] == {fxq.QuantState.INITIAL} and fxq.QuantState.ACTIVATED in seen[1][1]
    name = next(n for n, fq in _roles(q, "activation").items() if fq.config.state is fxq.QuantState.ACTIVATED)
    assert torch.allclose(q.fxq_quantizers[name].scale, 2 * base.fxq_quantizers[name].scale)


def test_bad_algorithm_registration_and_result():
    with pytest.raises(fxq.ConfigError, match="stage='during'"):
        fxq.register_algorithm("test_bad_stage", stage="during")
    with pytest.raises(fxq.ConfigError, match="built-in switch 'adaround' runs in stage 'post'"):
        fxq.register_algorithm("adaround", stage="pre")
    with pytest.raises(fxq.RegistryError, match="already registered"):
        fxq.register_algorithm("adaround")(lambda gm, *a, **k: gm)

    @fxq.register_algorithm("test_returns_none", override=True)
    def returns_none(gm, data, setting, steps=None, collate_fn=None):
        return None

    with pytest.raises(fxq.ConfigError, match="algorithm 'test_returns_none' returned NoneType"):
        fxq.quantize(small_cnn(), _data(), "academic_int8", S(custom_algorithms=["test_returns_none"]),
                     progress=False)


def test_user_algorithm_with_its_own_settings_is_a_switch(monkeypatch):
    """One decorator makes a user algorithm a setting switch with checked, json-round-tripping settings."""
    from fxq.algorithms.pipeline import ALGORITHMS, SWITCHES
    from fxq.checked import Checked, checked_setting, opt

    for registry in (ALGORITHMS, SWITCHES):  # the registration is undone after the test
        monkeypatch.setattr(registry, "_items", dict(registry._items))

    @checked_setting("setting.test_scale_setting")
    class ScaleSetting(Checked):
        factor: float = opt(2.0, gt=0.0)

    seen: list[float] = []

    @fxq.register_algorithm("test_scale", stage="pre", order=15, setting=ScaleSetting, override=True)
    def scale(gm, data, setting, steps=None, collate_fn=None):
        seen.append(setting.test_scale_setting.factor)
        return gm

    from fxq.algorithms import ALGORITHM_ORDER

    assert ALGORITHM_ORDER["pre"] == ("equalization", "test_scale", "ssd_equalization")
    s = S(test_scale=True)
    s.test_scale_setting.factor = 3.0
    assert S.from_json(s.to_json()) == s and S.from_dict(s.to_dict()).test_scale_setting.factor == 3.0
    with pytest.raises(fxq.ConfigError, match=r"setting.test_scale_setting.factor=-1.0 must be > 0"):
        s.test_scale_setting.factor = -1.0
    with pytest.raises(fxq.ConfigError, match="built-in 'test_scale'; switch it on with setting.test_scale = True"):
        S(custom_algorithms=["test_scale"])
    fxq.quantize(small_cnn(), _data(), "academic_int8", s, progress=False)
    assert seen == [3.0]


def test_registry_lookup_suggests_close_names():
    with pytest.raises(fxq.RegistryError, match=r"unknown platform 'trt_int9' \(did you mean 'trt_int8'.*registered:"):
        fxq.qconfig.base.PLATFORMS.get("trt_int9")
