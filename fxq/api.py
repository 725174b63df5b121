"""Front door: ``prepare`` → ``calibrate`` → ``convert``, or all of it in ``quantize``."""
from __future__ import annotations

import inspect
import logging
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import fx, nn

from fxq.algorithms import enabled_algorithms, run_algorithms
from fxq.errors import CalibrationError, ConfigError, TraceError
from fxq.graph.calibrate import calibrate
from fxq.graph.capture import capture as capture_graph
from fxq.graph.convert import convert
from fxq.graph.data import (
    check_sized_inputs,
    data_failure,
    first_batch_errors,
    iter_batches,
    placeholder_values,
    record_example_values,
    to_call_args,
)
from fxq.graph.dispatch import dispatch
from fxq.graph.passes import standardize
from fxq.graph.prepare import insert_quantizers
from fxq.graph.quant_graph import QuantGraph
from fxq.parts import quantize_in_parts
from fxq.qconfig.base import Platform, get_platform
from fxq.setting import QuantizationSetting
from fxq.spec import QuantState

__all__ = ["prepare", "quantize"]

logger = logging.getLogger(__name__)


def _as_call(example_inputs: Any) -> tuple[tuple, dict[str, Any]]:
    """``(args, kwargs)`` of one batch: a dict is keyword inputs (``model(**batch)``), anything else positional."""
    if example_inputs is None:
        return (), {}
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    return tuple(example_inputs), {}


def _resolve_platform(platform: "str | Platform | type[Platform]", setting: QuantizationSetting,
                      bit_width: int | None, symmetrical: bool | None, per_channel: bool | None) -> Platform:
    p = get_platform(platform)
    if bit_width is not None or symmetrical is not None or per_channel is not None:
        given = {"bit_width": bit_width, "symmetrical": symmetrical, "per_channel": per_channel}
        args = ", ".join(f"{k}={v!r}" for k, v in given.items() if v is not None)
        p = p.with_overrides(bit_width=bit_width, symmetrical=symmetrical, per_channel=per_channel,
                             where=f"fxq.prepare/quantize(platform={p.name!r}, {args})")
    changes: dict[str, Any] = {}
    if setting.quantize_activation_setting.calib_algorithm:
        changes["activation_observer"] = setting.quantize_activation_setting.calib_algorithm
    if setting.quantize_parameter_setting.calib_algorithm:
        changes["weight_observer"] = setting.quantize_parameter_setting.calib_algorithm
    if changes:
        p = p.with_overrides(**changes, where="setting.quantize_*_setting.calib_algorithm")
    return p


def prepare(
    model: nn.Module,
    platform: "str | Platform | type[Platform]" = "trt_int8",
    example_inputs: Any = None,
    setting: QuantizationSetting | None = None,
    *,
    leaf_modules: Iterable[type[nn.Module] | str] = (),
    concrete_args: dict[str, Any] | None = None,
    bit_width: int | None = None,
    symmetrical: bool | None = None,
    per_channel: bool | None = None,
    fold_bn: bool = True,
    capture: str = "auto",
) -> fx.GraphModule:
    """Capture (or copy) ``model``, standardize the graph, dispatch it and insert quantizers.

    The caller's model is never modified. The result is a ``GraphModule`` whose quantizers live in
    ``gm.fxq_quantizers``; calibrate it with :func:`fxq.calibrate`.

    Args:
        model: float ``nn.Module``, a ``GraphModule`` from :func:`fxq.load_onnx` / :func:`fxq.load_caffe`, or a
            ``torch.export.ExportedProgram`` (or its ``.module()``).
        platform: platform name (``"trt_int8"``...), class or instance.
        example_inputs: one batch of inputs (tensor, tuple or dict) — shapes and dtypes drive dispatch.
        setting: :class:`fxq.QuantizationSetting` (dispatcher, fusion, observers, ...).
        leaf_modules, concrete_args: passed to ``torch.fx`` tracing.
        bit_width, symmetrical, per_channel: seed 002's per-call overrides of the platform's schemes.
        fold_bn: fold eval-mode BatchNorm into the preceding conv/linear.
        capture: ``"auto"`` (symbolic tracing, then ``torch.export``, then FP32 islands for submodules neither
            reaches; see :mod:`fxq.graph.capture`), ``"fx"`` or ``"export"``.

    Raises:
        TraceError, ConfigError: naming the module/node and the fix (TorchScript input, a model no capture path
            reaches); a bad setting or override, or a scheme the
            platform's exporter cannot express (:attr:`fxq.Platform.capability`), before any tracing.
    """
    setting = _checked_setting(setting)
    p = _resolve_platform(platform, setting, bit_width, symmetrical, per_channel)
    args, kwargs = _as_call(example_inputs)
    if not args and not kwargs:
        raise ConfigError("prepare() needs example_inputs (one batch) to learn shapes and dtypes")
    gm = capture_graph(model, args, example_kwargs=kwargs, capture=capture, leaf_modules=leaf_modules,
                       concrete_args=concrete_args)
    if kwargs:  # keyword inputs go to the captured graph's inputs by name, defaults to the others
        args = tuple(placeholder_values(gm, kwargs).values())
    gm.eval()
    device = next((t.device for t in gm.parameters()), torch.device("cpu"))
    args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)
    check_sized_inputs(gm, args)
    with first_batch_errors("example", True,  # the data does not fit the model: say where, not a torch trace
                            diagnose=lambda exc: data_failure(gm, args, exc, "example")):
        standardize(gm, args, fold_bn=fold_bn)
    record_example_values(gm, args)
    plan = dispatch(gm, p, setting.dispatcher, setting.dispatching_table)
    insert_quantizers(gm, plan, setting, p)
    for _, fq in QuantGraph(gm).quantizers():
        role = fq.role
        if (role == "activation" and not setting.quantize_activation) or (
            role in ("weight", "bias") and not setting.quantize_parameter
        ):
            fq.config.state = QuantState.FP32
    gm.meta["fxq_setting"] = setting.to_dict()
    gm.to(device)
    return gm


def _is_plain_module(model: Any) -> bool:
    """An eager module (not a graph, a script or an exported program): the kind quantized in parts."""
    return isinstance(model, nn.Module) and not isinstance(model, (fx.GraphModule, torch.jit.ScriptModule))


def _checked_setting(setting: QuantizationSetting | None) -> QuantizationSetting:
    if setting is None:
        return QuantizationSetting()
    if isinstance(setting, dict):
        return QuantizationSetting.from_dict(setting)
    if not isinstance(setting, QuantizationSetting):
        raise ConfigError(f"setting must be a fxq.QuantizationSetting, a dict of its fields or None, got {type(setting).__name__}; "
                          f"build one with QuantizationSetting.from_dict / from_json")
    return setting.validate()


def _first_batch(model: nn.Module, data: Any, collate_fn: Callable[[Any], Any] | None) -> Any:
    """The first calibration batch as the model is called with it: positional args, or a dict of keyword inputs."""
    if isinstance(model, torch.export.ExportedProgram):
        model = model.module()
    try:
        batch = next(iter(iter_batches(data, 1, collate_fn)))
    except StopIteration:
        raise CalibrationError("calibration data is empty: give at least one batch") from None
    args, kwargs = to_call_args(model, batch, check=False)
    if not kwargs:
        return args
    if isinstance(model, fx.GraphModule):
        names = [str(n.target) for n in model.graph.nodes if n.op == "placeholder"]
    else:
        names = list(inspect.signature(model.forward).parameters)
    missing = [k for k in kwargs if k not in names]
    if missing:
        raise CalibrationError(f"batch keys {missing} are not inputs of the model; inputs are {names}")
    return kwargs


def quantize(
    model: nn.Module,
    calib_data: Any,
    platform: "str | Platform | type[Platform]" = "trt_int8",
    setting: QuantizationSetting | None = None,
    example_inputs: Any = None,
    *,
    steps: int | None = None,
    collate_fn: Callable[[Any], Any] | None = None,
    progress: bool = True,
    leaf_modules: Sequence[type[nn.Module] | str] = (),
    concrete_args: dict[str, Any] | None = None,
    bit_width: int | None = None,
    symmetrical: bool | None = None,
    per_channel: bool | None = None,
    capture: str = "auto",
) -> fx.GraphModule:
    """Quantize ``model`` for ``platform`` in one call: prepare, (equalize), calibrate, (optimize), convert.

    Order: validate ``setting`` and the overrides, :func:`prepare` (dispatch, capability checks, quantizers),
    the ``"pre"`` algorithms (built-ins, then ``setting.custom_algorithms`` of that stage), calibration, the
    ``"post"`` algorithms (likewise), :func:`convert`. See :func:`fxq.register_algorithm`.

    A model that no capture path reaches whole (``capture="auto"``; detectors whose root ``forward`` loops over
    images and runs NMS) is quantized in parts (:mod:`fxq.parts`): the result is then a copy of ``model`` whose
    largest capturable submodules are quantized ``GraphModule`` objects, and the rest runs in float.

    Example:
        >>> qmodel = fxq.quantize(model, [torch.randn(8, 3, 224, 224) for _ in range(8)], platform="trt_int8")
        >>> print(fxq.summary(qmodel))
    """
    setting = _checked_setting(setting)
    if example_inputs is None:
        example_inputs = _first_batch(model, calib_data, collate_fn)
    overrides = {"bit_width": bit_width, "symmetrical": symmetrical, "per_channel": per_channel}
    try:
        gm = prepare(model, platform, example_inputs, setting, leaf_modules=leaf_modules,
                     concrete_args=concrete_args, capture=capture, **overrides)
    except TraceError as failure:
        if capture != "auto" or leaf_modules or concrete_args or not _is_plain_module(model):
            raise

        def quantize_part(part: fx.GraphModule, batches: list) -> fx.GraphModule:
            return quantize(part, batches, platform, setting, steps=None, progress=False, **overrides)

        return quantize_in_parts(model, calib_data, failure, quantize_part, steps=steps, collate_fn=collate_fn)
    gm = run_algorithms("pre", gm, calib_data, setting, steps=steps, collate_fn=collate_fn)
    # weights are baked once: by calibrate when nothing follows it (its batches then cost no weight fake-quant),
    # else by convert after the post algorithms, which work on the FP32 weights (no unbake / rebake around each)
    bake = setting.quantize_parameter_setting.baking_parameter
    calibrate(gm, calib_data, steps=steps, collate_fn=collate_fn, progress=progress,
              bake=bake and not enabled_algorithms("post", setting))
    gm = run_algorithms("post", gm, calib_data, setting, steps=steps, collate_fn=collate_fn)
    return convert(gm, bake=setting.quantize_parameter_setting.baking_parameter)
