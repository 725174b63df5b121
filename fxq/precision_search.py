"""Accuracy-budgeted precision search: the fewest layers off INT8 that meet a target.

``auto_quantize`` starts from the platform's all-INT8 model and moves layers (Conv, ConvTranspose, Gemm, MatMul) to
a float fallback until the budget holds; with a size budget it then lowers the least sensitive INT8 layers to fewer
bits. Every configuration it judges is *realized*: quantized by :func:`fxq.quantize` with a dispatching table, so
the model returned is exactly the one that was measured — an export of it behaves as the report says.

The search ("verified"):

1. layerwise sensitivity of the all-INT8 model orders the layers (:func:`fxq.layerwise_error_analyse`, network
   outputs);
2. forward: at each step the ``window`` most sensitive layers not yet in float are each tried in the current model,
   and the one with the best measured metric is kept, even when no candidate improves it (sensitivity in isolation
   is only a guess: a layer whose error lives in a quantizer it shares with other consumers gains nothing when it
   alone falls back, but may once a second one does);
3. backward: each chosen layer, least sensitive first, goes back to INT8 when the budget still holds without it.

``strategy="greedy"`` is the baseline of the field (worst layer first, one at a time, no verification), kept for
comparison.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import logging
import math
import time
from typing import Any, Callable, Iterable

import torch
from torch import fx, nn

from fxq.analysis.error import badness, layerwise_error_analyse, select_layers
from fxq.analysis.metrics import MetricAccumulator
from fxq.analysis.runner import GraphRunner, analysis_mode, tensors_of
from fxq.api import quantize
from fxq.errors import CalibrationError, ConfigError
from fxq.graph.data import algorithm_errors, call_model, diagnose_batch, first_batch_errors, iter_batches
from fxq.graph.info import source_names
from fxq.graph.quant_graph import QuantGraph
from fxq.qconfig.base import Platform, get_platform
from fxq.setting import QuantizationSetting
from fxq.spec import QuantState

__all__ = ["AutoQuantReport", "Budget", "LayerChoice", "auto_quantize"]

logger = logging.getLogger(__name__)

FALLBACKS = ("fp32", "fp16")
STRATEGIES = ("verified", "greedy")


@dataclasses.dataclass(frozen=True)
class Budget:
    """What :func:`auto_quantize` must reach.

    At most one accuracy target — ``snr`` (output noise/signal power, at most this; 0.01 = 1 %), ``cosine``
    (output cosine similarity, at least this) or ``metric`` + ``target`` (a callback ``metric(model) -> float``
    evaluated on the user's validation set, higher is better, at least ``target``) — and optionally ``size``: the
    weights' bytes at most this fraction of the FP32 model's (needs ``low_bits`` layers when below ~0.25).

    ``Budget.parse("snr=0.01,size=0.2")`` reads the CLI form (a bare number is an SNR bound).
    """

    snr: float | None = None
    cosine: float | None = None
    metric: Callable[[nn.Module], float] | None = None
    target: float | None = None
    size: float | None = None

    def __post_init__(self) -> None:
        for key in ("snr", "cosine", "target", "size"):
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value)):
                raise ConfigError(f"Budget.{key} must be a finite number, got {value!r} ({type(value).__name__})")
        targets = [k for k in ("snr", "cosine", "metric") if getattr(self, k) is not None]
        if len(targets) > 1:
            raise ConfigError(f"Budget sets {' and '.join(targets)}: give one accuracy target (snr, cosine or "
                              "metric + target)")
        if self.metric is not None and not callable(self.metric):
            raise ConfigError(f"Budget.metric must be a callable model -> float, got {type(self.metric).__name__}")
        if (self.metric is None) != (self.target is None):
            raise ConfigError("Budget.metric and Budget.target go together: metric(model) must reach target "
                              "(higher is better; negate a loss)")
        if self.snr is not None and self.snr <= 0:
            raise ConfigError(f"Budget.snr={self.snr} must be > 0 (noise/signal power, e.g. 0.01 = 1 %)")
        if self.cosine is not None and not 0 < self.cosine <= 1:
            raise ConfigError(f"Budget.cosine={self.cosine} must be in (0, 1], e.g. 0.999")
        if self.size is not None and not 0 < self.size <= 1:
            raise ConfigError(f"Budget.size={self.size} must be in (0, 1]: weight bytes as a fraction of FP32's")
        if not targets and self.size is None:
            raise ConfigError("the budget is empty: give snr, cosine, metric + target, or size")

    @property
    def kind(self) -> str | None:
        """``snr`` | ``cosine`` | ``metric`` (None: size only)."""
        return next((k for k in ("snr", "cosine", "metric") if getattr(self, k) is not None), None)

    @property
    def bound(self) -> float | None:
        kind = self.kind
        return None if kind is None else float(self.target if kind == "metric" else getattr(self, kind))

    def accepts(self, value: float) -> bool:
        """Whether a measured accuracy value meets the target (True when there is none)."""
        kind, bound = self.kind, self.bound
        if kind is None or bound is None:
            return True
        if math.isnan(value):
            return False
        return value <= bound if kind == "snr" else value >= bound

    def better(self, a: float, b: float) -> bool:
        """Whether accuracy value ``a`` is strictly better than ``b``."""
        if math.isnan(a):
            return False
        if math.isnan(b):
            return True
        return a < b if self.kind == "snr" else a > b

    @classmethod
    def parse(cls, text: str) -> "Budget":
        """``"0.01"`` (SNR bound), or comma-separated ``snr=0.01`` / ``cosine=0.999`` / ``size=0.2``."""
        fields: dict[str, float] = {}
        for part in str(text).split(","):
            part = part.strip()
            if not part:
                continue
            key, sep, value = part.partition("=")
            if not sep:
                key, value = "snr", key
            key = key.strip().lower()
            if key not in ("snr", "cosine", "size"):
                raise ConfigError(f"budget {text!r}: unknown key {key!r}; use snr=0.01, cosine=0.999 and/or "
                                  "size=0.2 (comma-separated), or a bare number for an SNR bound")
            try:
                fields[key] = float(value.rstrip("%")) / (100.0 if value.strip().endswith("%") else 1.0)
            except ValueError:
                raise ConfigError(f"budget {text!r}: {key}={value!r} is not a number") from None
        return cls(**fields)

    @classmethod
    def coerce(cls, value: Any) -> "Budget":
        """A Budget from a Budget, a number (SNR bound), a string (:meth:`parse`) or a dict of fields."""
        if isinstance(value, Budget):
            return value
        if isinstance(value, str):
            return cls.parse(value)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return cls(snr=float(value))
        if isinstance(value, dict):
            unknown = sorted(set(value) - {f.name for f in dataclasses.fields(cls)})
            if unknown:
                raise ConfigError(f"budget keys {unknown} are unknown; use snr, cosine, metric, target, size")
            return cls(**value)
        raise ConfigError(f"budget must be a fxq.Budget, a number (SNR bound), a string like 'snr=0.01,size=0.3' "
                          f"or a dict, got {type(value).__name__}")

    def describe(self) -> str:
        parts = []
        if self.kind == "snr":
            parts.append(f"output SNR <= {self.snr * 100:.4g}%")
        elif self.kind == "cosine":
            parts.append(f"output cosine >= {self.cosine}")
        elif self.kind == "metric":
            parts.append(f"{getattr(self.metric, '__name__', 'metric')} >= {self.target}")
        if self.size is not None:
            parts.append(f"weights <= {self.size * 100:.4g}% of FP32")
        return ", ".join(parts)


@dataclasses.dataclass
class LayerChoice:
    """A layer that does not run at the platform's INT8.

    Attributes:
        name: fx node name (a key of ``setting.dispatching_table``).
        op_type: canonical op type.
        precision: ``fp32`` | ``fp16`` | ``int<bits>``.
        sensitivity: its layerwise error (the budget's metric kind; SNR when the budget is a callback or size only)
            with only it quantized at the precision it was judged at.
        value_after: the model's accuracy value right after this change was made (None for size-only budgets).
        reason: why.
        module_path / source: where it came from (module path; ONNX / caffe name).
    """

    name: str
    op_type: str
    precision: str
    sensitivity: float
    value_after: float | None
    reason: str
    module_path: str | None = None
    source: str | None = None


@dataclasses.dataclass
class CurvePoint:
    """The accuracy value after a step of the search (``fallbacks`` float layers, ``lowered`` low-bit layers)."""

    fallbacks: int
    lowered: int
    value: float
    change: str


@dataclasses.dataclass
class AutoQuantReport:
    """What :func:`auto_quantize` chose and measured; ``str()`` gives the table.

    Attributes:
        platform / strategy / fallback: the search's inputs.
        budget: the target, described.
        kind: ``snr`` | ``cosine`` | ``metric`` | None (size only).
        met: whether the returned model meets the whole budget.
        fp32_value: the metric callback on the FP32 model (callback budgets only).
        int8_value / final_value: the accuracy value of the all-INT8 model and of the returned one.
        choices: the layers not at INT8 with the reason for each.
        curve: the accuracy value after every kept step (the path of the search).
        evaluations: configurations measured (each realized by one :func:`fxq.quantize`); seconds: wall time.
        size_fp32 / size_int8 / size_final: weight bytes (FP32 model, all INT8, returned model).
    """

    platform: str
    strategy: str
    fallback: str
    budget: str
    kind: str | None
    met: bool
    int8_value: float
    final_value: float
    fp32_value: float | None
    choices: list[LayerChoice]
    curve: list[CurvePoint]
    evaluations: int
    seconds: float
    size_fp32: int
    size_int8: int
    size_final: int
    layers: int

    @property
    def fallbacks(self) -> list[str]:
        """Names of the layers that run in float."""
        return [c.name for c in self.choices if c.precision in FALLBACKS]

    @property
    def lowered(self) -> list[str]:
        """Names of the layers lowered below the platform's bits."""
        return [c.name for c in self.choices if c.precision not in FALLBACKS]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def _fmt(self, value: float | None) -> str:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return "-"
        return f"{value * 100:.4f}%" if self.kind in ("snr", None) else f"{value:.6g}"

    def __str__(self) -> str:
        head = (f"fxq auto_quantize — platform {self.platform}, budget: {self.budget}, strategy {self.strategy}\n"
                f"  {'met' if self.met else 'NOT met'}: {self.kind or 'snr'} {self._fmt(self.int8_value)} all INT8 -> "
                f"{self._fmt(self.final_value)} with {len(self.fallbacks)} {self.fallback} and {len(self.lowered)} "
                f"low-bit of {self.layers} layers")
        if self.fp32_value is not None:
            head += f" (FP32 model: {self._fmt(self.fp32_value)})"
        mb = 1 << 20
        head += (f"\n  weights: {self.size_final / mb:.3f} MiB ({self.size_final / max(self.size_fp32, 1) * 100:.1f}% "
                 f"of FP32 {self.size_fp32 / mb:.3f} MiB; all INT8 {self.size_int8 / mb:.3f} MiB); "
                 f"{self.evaluations} configurations measured in {self.seconds:.1f} s")
        lines = [head]
        if self.choices:
            lines.append(f"  {'layer':30} {'type':10} {'precision':9} {'sensitivity':>12} {'after':>12}  reason")
            for c in self.choices:
                lines.append(f"  {c.name[:30]:30} {c.op_type[:10]:10} {c.precision:9} "
                             f"{self._fmt(c.sensitivity) if self.kind != 'metric' else f'{c.sensitivity * 100:.4f}%':>12} "
                             f"{self._fmt(c.value_after):>12}  {c.reason}")
        if len(self.curve) > 1:
            lines.append("  curve: " + ", ".join(f"{p.fallbacks}f/{p.lowered}l {self._fmt(p.value)}"
                                                 for p in self.curve))
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- measuring
class _Judge:
    """Measures a realized model: output SNR / cosine against the FP32 model on fixed batches, or the callback."""

    def __init__(self, budget: Budget, batches: list[Any], fallback: str) -> None:
        self.budget = budget
        self.batches = batches
        self.fallback = fallback
        self.method = budget.kind if budget.kind in ("snr", "cosine") else "snr"
        self.reference: list[list[torch.Tensor]] = []

    def set_reference(self, gm: fx.GraphModule) -> None:
        """FP32 outputs per batch, from the FP32 view of a realized model (the FP32 model after BN folding)."""
        runner = GraphRunner(gm)
        self.reference = []
        with analysis_mode(gm):
            for i, b in enumerate(self.batches):
                with first_batch_errors("auto_quantize evaluation", i == 0):  # the FP32 model meets eval_data here
                    self.reference.append([t.detach() for t in tensors_of(runner.run(runner.bind(b), fp32=True))])

    def outputs_error(self, gm: fx.GraphModule) -> float:
        accs: list[MetricAccumulator] = []
        with analysis_mode(gm), self._precision(gm):
            for batch, ref in zip(self.batches, self.reference):
                # set_reference ran the FP32 model on these batches: a failure here is fxq's, naming the node
                with algorithm_errors("auto_quantize", functools.partial(diagnose_batch, gm, batch,
                                                                         what="auto_quantize")):
                    got = tensors_of(call_model(gm, batch, check=False))
                while len(accs) < len(got):
                    accs.append(MetricAccumulator(self.method))
                for acc, f, q in zip(accs, ref, got):
                    acc.reference(f)
                    acc.compare(q)
        values = [a.value for a in accs if not math.isnan(a.value)]
        return sum(values) / len(values) if values else float("nan")

    def __call__(self, gm: fx.GraphModule) -> float:
        if self.budget.kind == "metric":
            with self._precision(gm):
                return _call_metric(self.budget.metric, gm)
        return self.outputs_error(gm)

    def _precision(self, gm: fx.GraphModule) -> Any:
        if self.fallback == "fp16":
            from fxq.backends.qdq.fp16 import fp16_simulation  # noqa: PLC0415  (export-side simulation)

            return fp16_simulation(gm)
        return contextlib.nullcontext(gm)


def _call_metric(metric: Callable[[nn.Module], float], model: nn.Module) -> float:
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            value = metric(model)
    finally:
        model.train(was_training)
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"the budget's metric returned {type(value).__name__} ({value!r}); it must return a "
                          "number (higher is better)") from None


def _weight_bytes(gm: fx.GraphModule, float_bytes: int) -> int:
    """Bytes of the model's parameters: quantized weights at their bits, everything else at ``float_bytes``."""
    bits: dict[str, int] = {}
    for _, fq in QuantGraph(gm).quantizers("weight"):
        if fq.param is not None and fq.config.state is not QuantState.FP32:
            bits[fq.param] = int(fq.config.num_bits)
    total = 0.0
    for pname, p in gm.named_parameters():
        total += p.numel() * (bits[pname] / 8 if pname in bits else float_bytes)
    return int(math.ceil(total))


# ---------------------------------------------------------------------------------------------- the search
class _Search:
    """Realizes configurations (float layers, low-bit layers) through :func:`fxq.quantize` and caches their values."""

    def __init__(self, realize: Callable[[frozenset[str], frozenset[str]], fx.GraphModule], judge: _Judge,
                 max_evaluations: int | None) -> None:
        self.realize = realize
        self.judge = judge
        self.max_evaluations = max_evaluations
        self.cache: dict[tuple[frozenset[str], frozenset[str]], float] = {}
        self.models: dict[tuple[frozenset[str], frozenset[str]], fx.GraphModule] = {}

    @property
    def evaluations(self) -> int:
        return len(self.cache)

    def exhausted(self) -> bool:
        return self.max_evaluations is not None and self.evaluations >= self.max_evaluations

    def value(self, floats: Iterable[str], low: Iterable[str] = ()) -> float:
        key = (frozenset(floats), frozenset(low))
        if key not in self.cache:
            self.cache[key] = self.judge(self.model(*key))
            logger.debug("auto_quantize: %d float, %d low-bit -> %s", len(key[0]), len(key[1]), self.cache[key])
        return self.cache[key]

    def model(self, floats: Iterable[str], low: Iterable[str] = ()) -> fx.GraphModule:
        """The realized model of a configuration; only the latest is kept (the answer is re-realized if needed)."""
        key = (frozenset(floats), frozenset(low))
        if key not in self.models:
            self.models = {key: self.realize(*key)}
        return self.models[key]


def _layer_facts(gm: fx.GraphModule) -> dict[str, dict[str, Any]]:
    """Per quantized computing layer: op type, module path, source name and weight element count."""
    qg = QuantGraph(gm)
    params = dict(gm.named_parameters())
    facts: dict[str, dict[str, Any]] = {}
    for node in select_layers(gm, "computing"):
        numel = 0
        for q in node.meta["fxq"].inputs.values():
            if q in qg and qg.role(q) == "weight" and qg[q].param in params:
                numel += params[qg[q].param].numel()
        names = source_names(node, module_path=False)
        facts[node.name] = {"op_type": node.meta["fxq"].op_type, "module_path": node.meta.get("module_path"),
                            "source": names[0] if names else None, "weights": numel}
    return facts


def _sensitivities(gm: fx.GraphModule, batches: list[Any], method: str) -> dict[str, float]:
    """Layerwise error at the network outputs with only that layer quantized, per layer name."""
    report = layerwise_error_analyse(gm, batches, method=method, steps=None, measure="network")
    return {r.name: r.value for r in report}


def _badness(method: str, value: float) -> float:
    """How much quantizing a layer alone hurts (>= 0; a NaN result counts as the worst)."""
    return math.inf if math.isnan(value) else badness(method, value)


def auto_quantize(
    model: nn.Module,
    calib_data: Any,
    platform: "str | Platform | type[Platform]" = "trt_int8",
    budget: "Budget | float | str | dict[str, Any]" = 0.01,
    *,
    eval_data: Any = None,
    setting: QuantizationSetting | None = None,
    fallback: str = "fp32",
    low_bits: int = 4,
    strategy: str = "verified",
    window: int = 3,
    steps: int | None = 8,
    eval_steps: int | None = 8,
    collate_fn: Callable[[Any], Any] | None = None,
    max_evaluations: int | None = None,
    **quantize_kwargs: Any,
) -> tuple[fx.GraphModule, AutoQuantReport]:
    """Quantize ``model`` with the fewest layers off the platform's INT8 that meet ``budget``.

    Args:
        model, calib_data, platform, setting, steps, collate_fn: as :func:`fxq.quantize` (``setting`` may hold a
            ``dispatching_table``: its entries are kept and the search adds to them).
        budget: a :class:`Budget`, a number (output SNR bound: noise/signal power, 0.01 = 1 %), a string
            (``"snr=0.01,size=0.3"``, ``"cosine=0.999"``) or a dict of Budget fields.
        eval_data: batches the accuracy is judged on (default ``calib_data``); ``eval_steps`` of them.
        fallback: ``"fp32"`` or ``"fp16"`` (TensorRT platforms: the float parts are judged in FP16; export with
            ``fxq.export(..., high_precision_dtype="fp16")``).
        low_bits: bits of the layers lowered to meet a size budget (the platform must express them).
        strategy: ``"verified"`` (default, see the module docstring) or ``"greedy"`` (worst layer first, the
            field's baseline).
        window: layers tried per forward step of the verified search.
        max_evaluations: stop searching after this many configurations (the best found is returned).
        quantize_kwargs: other :func:`fxq.quantize` keywords (``leaf_modules``...).

    Returns:
        ``(quantized GraphModule, AutoQuantReport)``. The model is the configuration that was measured last as
        the answer; ``report.met`` says whether it meets the budget (a WARNING is logged when not).

    Raises:
        ConfigError: a bad budget / fallback / strategy, or a size budget on a platform that cannot express
            ``low_bits``; CalibrationError: empty data.

    Example:
        >>> qmodel, report = fxq.auto_quantize(model, calib, "trt_int8", budget=0.01)  # doctest: +SKIP
        >>> print(report)  # doctest: +SKIP
    """
    t0 = time.perf_counter()
    budget = Budget.coerce(budget)
    if fallback not in FALLBACKS:
        raise ConfigError(f"fallback={fallback!r}: use one of {list(FALLBACKS)}")
    if strategy not in STRATEGIES:
        raise ConfigError(f"strategy={strategy!r}: use one of {list(STRATEGIES)}")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ConfigError(f"window={window!r} must be a positive integer")
    if max_evaluations is not None and (isinstance(max_evaluations, bool) or not isinstance(max_evaluations, int)
                                        or max_evaluations < 1):
        raise ConfigError(f"max_evaluations={max_evaluations!r} must be a positive integer or None")
    p = get_platform(platform)
    if fallback == "fp16" and p.exporter != "tensorrt":
        raise ConfigError(f"fallback='fp16' is the TensorRT FP16 export (high_precision_dtype='fp16'); platform "
                          f"{p.name!r} exports with {p.exporter!r}: use fallback='fp32' or a TensorRT platform")
    if budget.size is not None:
        p.with_overrides(bit_width=low_bits, where=f"auto_quantize(budget size={budget.size}, low_bits={low_bits})")
    base = copy.deepcopy(setting) if isinstance(setting, QuantizationSetting) else (
        QuantizationSetting.from_dict(setting) if isinstance(setting, dict) else QuantizationSetting())
    base.validate()
    user_table = dict(base.dispatching_table)

    batches = list(iter_batches(calib_data if eval_data is None else eval_data, eval_steps, collate_fn))
    if not batches:
        raise CalibrationError("auto_quantize: the evaluation data is empty; give at least one batch")

    def realize(floats: frozenset[str], low: frozenset[str]) -> fx.GraphModule:
        s = copy.deepcopy(base)
        table = dict(user_table)
        table.update({name: {"bit_width": low_bits} for name in sorted(low)})
        table.update({name: "fp32" for name in sorted(floats)})
        s.dispatching_table = table
        return quantize(model, calib_data, p, s, steps=steps, collate_fn=collate_fn, progress=False,
                        **quantize_kwargs)

    judge = _Judge(budget, batches, fallback)
    search = _Search(realize, judge, max_evaluations)
    q0 = search.model(())
    if budget.kind != "metric":  # a metric budget never compares outputs
        judge.set_reference(q0)
    facts = _layer_facts(q0)
    method = judge.method
    int8_value = search.value(())
    fp32_value = None
    if budget.kind == "metric":
        from fxq.graph.convert import fp32_mode  # noqa: PLC0415

        with fp32_mode(q0):
            fp32_value = _call_metric(budget.metric, q0)
    size_fp32 = sum(pr.numel() for pr in q0.parameters()) * 4
    float_bytes = 2 if fallback == "fp16" else 4
    size_int8 = _weight_bytes(q0, float_bytes)
    curve = [CurvePoint(0, 0, int8_value, "all INT8")]
    choices: dict[str, LayerChoice] = {}
    floats: list[str] = []
    low: list[str] = []
    current = int8_value

    if not budget.accepts(int8_value):
        sens = _sensitivities(q0, batches, method)
        order = sorted(sens, key=lambda n: -_badness(method, sens[n]))  # worst first
        logger.info("auto_quantize: all INT8 gives %s %.6g, target %s; searching over %d layers", budget.kind,
                    int8_value, budget.describe(), len(order))
        while not budget.accepts(current) and not search.exhausted():
            todo = [n for n in order if n not in floats]
            if not todo:
                break
            tried = todo[:1] if strategy == "greedy" else todo[:window]
            results = {}
            for name in tried:
                if search.exhausted() and results:
                    break
                results[name] = search.value([*floats, name], low)
            best = tried[0]
            for name in results:
                if budget.better(results[name], results[best]):
                    best = name
            # kept even when it does not help alone: with another layer in float, a quantizer both read can go
            # (ResNet trt_int8 misses its two tightest budgets when such steps are skipped)
            floats.append(best)
            current = results[best]
            why = ("worst layerwise error" if strategy == "greedy" or len(results) == 1 else
                   f"largest measured gain of {len(results)} tried")
            choices[best] = LayerChoice(best, facts[best]["op_type"], fallback, sens[best], current, why,
                                        facts[best]["module_path"], facts[best]["source"])
            curve.append(CurvePoint(len(floats), 0, current, f"+{fallback} {best}"))
            logger.info("auto_quantize: %s -> %s (%s %.6g)", best, fallback, budget.kind, current)
        if strategy == "verified" and budget.accepts(current):
            for name in sorted(floats, key=lambda n: _badness(method, sens[n])):  # least sensitive first
                if search.exhausted():
                    break
                rest = [n for n in floats if n != name]
                value = search.value(rest, low)
                if budget.accepts(value):
                    floats, current = rest, value
                    del choices[name]
                    curve.append(CurvePoint(len(floats), 0, current, f"-{fallback} {name} (back to INT8)"))
                    logger.info("auto_quantize: %s back to INT8 (%s %.6g still meets the budget)", name,
                                budget.kind, current)
    size = _weight_bytes(search.model(floats, low), float_bytes)
    if budget.size is not None and size > budget.size * size_fp32:
        size = _lower_for_size(search, budget, floats, low, choices, curve, facts, method, low_bits, float_bytes,
                               size_fp32, size)
        current = search.value(floats, low)
    final = search.model(floats, low)
    met = budget.accepts(current) and (budget.size is None or size <= budget.size * size_fp32)
    report = AutoQuantReport(
        platform=p.name, strategy=strategy, fallback=fallback, budget=budget.describe(), kind=budget.kind, met=met,
        int8_value=int8_value, final_value=current, fp32_value=fp32_value,
        choices=list(choices.values()), curve=curve,
        evaluations=search.evaluations, seconds=time.perf_counter() - t0, size_fp32=size_fp32,
        size_int8=size_int8, size_final=size, layers=len(facts))
    if met:
        logger.info("%s", report)
    else:
        logger.warning("auto_quantize could not meet the budget (%s): best found %s %.6g with %d float and %d "
                       "low-bit layers. Relax the budget, give more calibration data, or turn on algorithms "
                       "(setting.equalization / lsq_optimization)", budget.describe(), budget.kind or "size",
                       current, len(floats), len(low))
    return final, report


def _lower_for_size(search: _Search, budget: Budget, floats: list[str], low: list[str],
                    choices: dict[str, LayerChoice], curve: list[CurvePoint], facts: dict[str, dict[str, Any]],
                    method: str, low_bits: int, float_bytes: int, size_fp32: int, size: int) -> int:
    """Lower INT8 layers to ``low_bits``, least sensitive per byte saved first, while the accuracy target holds."""
    candidates = [n for n in facts if n not in floats and facts[n]["weights"] > 0]
    all_low = search.model(floats, candidates)
    sens = _sensitivities(all_low, search.judge.batches, method)
    order = sorted(candidates, key=lambda n: _badness(method, sens.get(n, math.nan)) / facts[n]["weights"])
    for name in order:
        if size <= budget.size * size_fp32 or search.exhausted():
            break
        value = search.value(floats, [*low, name])
        if not budget.accepts(value):
            logger.info("auto_quantize: %s stays INT8 (int%d would give %s %.6g)", name, low_bits, budget.kind, value)
            continue
        low.append(name)
        size = _weight_bytes(search.model(floats, low), float_bytes)
        choices[name] = LayerChoice(name, facts[name]["op_type"], f"int{low_bits}", sens.get(name, math.nan),
                                    value if budget.kind else None, "size budget: least sensitive per byte",
                                    facts[name]["module_path"], facts[name]["source"])
        curve.append(CurvePoint(len(floats), len(low), value, f"+int{low_bits} {name}"))
    return size
