"""``fxq`` command line: quantize, analyse, export and report on ONNX / caffe / Python models.

Every command exits 0 on success; on bad input (missing file, empty calibration folder, shape
mismatch...) it prints one line ``fxq: error: ...`` to stderr and exits 1 (2 for usage errors).
``fxq quantize`` exits 3 when the deployment files were written but an optional file (the ``.fxq`` save or
the summary) could not be: a warning names the file and the reason. ``--verbose`` adds debug logging and tracebacks.

``--input-shape`` also fixes the symbolic / unknown dims of an ONNX model's inputs for loading
(``fxq.load_onnx(..., input_shapes=...)``); exports keep the dims the file has symbolic dynamic.
``--outputs a,b`` loads an ONNX model up to those tensors (``fxq.load_onnx(..., outputs=...)``), or a caffe model
up to those blobs (``fxq.load_caffe(..., outputs=...)``): the cut that a load error for a detector's NMS /
data-dependent If / SSD ``DetectionOutput`` names.
"""
from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, NoReturn, Sequence

from fxq.io import atomic_write_text

__all__ = ["main", "build_parser"]

logger = logging.getLogger("fxq.cli")

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_PARTIAL, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
POOR_OUTPUT_SNR = 0.1
"""Output noise / signal against FP32 (on the first calibration batch) above which ``fxq quantize`` warns that
the quantized model computes something else: 10 %, where int8 CNNs and transformers that deploy well sit at
0.01-5 %."""


# ------------------------------------------------------------------------------------------- helpers
def _fxq() -> Any:
    import fxq

    return fxq


_SHAPE_FORM = "[NAME=]N,C,H,W with positive integer dims, e.g. 1,3,224,224 or image=1,3,224,224"


def _parse_shape(text: str) -> tuple[str | None, list[int]]:
    """``1,3,224,224``, ``1x3x224x224`` or ``name=1,3,224,224``: ``(name or None, dims)``.

    Raises ``argparse.ArgumentTypeError`` (argparse names the flag): empty, non-integer or non-positive dims.
    """
    name, sep, dims = text.rpartition("=")
    parts = [d.strip() for d in dims.replace("x", ",").replace("X", ",").split(",")]
    if (sep and not name.strip()) or not all(p.isascii() and p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: expected {_SHAPE_FORM}")
    return (name.strip() or None), [int(p) for p in parts]


def _parse_value(text: str) -> tuple[str, Any]:
    """``name=16000`` or ``name=1,0.5``: ``(name, number or list of numbers)`` for ``--input-value``.

    Raises ``argparse.ArgumentTypeError`` (argparse names the flag): no name, or a value that is not numbers.
    """
    name, sep, raw = text.partition("=")
    numbers: list[Any] = []
    for part in raw.split(","):
        try:
            numbers.append(int(part))
        except ValueError:
            try:
                numbers.append(float(part))
            except ValueError:
                numbers = []
                break
    if not sep or not name.strip() or not numbers:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=VALUE[,VALUE...], e.g. sr=16000")
    return name.strip(), (numbers[0] if len(numbers) == 1 else numbers)


def _named_items(args: argparse.Namespace, flag: str) -> dict[str, Any] | None:
    """The ``(name, value)`` pairs of repeatable flag ``--<flag>`` as a dict (None when absent); ConfigError when a
    name is given twice."""
    from fxq.errors import ConfigError

    items = list(getattr(args, flag.replace("-", "_"), None) or [])
    named = dict(items)
    if len(named) != len(items):
        twice = sorted({name for name, _ in items if sum(n == name for n, _ in items) > 1})
        raise ConfigError(f"--{flag}: {', '.join(twice)} given more than once; give each name once")
    return named or None


def _input_values(args: argparse.Namespace) -> dict[str, Any] | None:
    return _named_items(args, "input-value")


def _parse_batch_dim(text: str) -> tuple[str, int | None]:
    """``state=1`` / ``t=none``: ``(name, dim or None)`` for ``--batch-dim`` (argparse names the flag on a bad
    value)."""
    name, sep, raw = text.partition("=")
    if sep and name.strip() and raw.strip().lower() == "none":
        return name.strip(), None
    try:
        dim = int(raw)
    except ValueError:
        dim = None
    if not sep or not name.strip() or dim is None:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=DIM or NAME=none, e.g. state=1")
    return name.strip(), dim


def _batch_dims(args: argparse.Namespace) -> dict[str, int | None] | None:
    return _named_items(args, "batch-dim")


def _int_at_least(low: int) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low:
            what = "a positive integer" if low == 1 else f"an integer >= {low}"
            raise argparse.ArgumentTypeError(f"{text!r}: expected {what}")
        return value

    parse.__name__ = "positive int" if low == 1 else f"int >= {low}"
    return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


def _dtype_name(text: str) -> str:
    """A torch dtype name (``float32``, ``torch.float16``...)."""
    import torch

    if not isinstance(getattr(torch, text.replace("torch.", ""), None), torch.dtype):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a torch dtype such as float32, float16, int64")
    return text


def _input_shapes(args: argparse.Namespace) -> list[int] | dict[str, list[int]] | None:
    from fxq.errors import ConfigError

    items = list(args.input_shape or [])
    if not items:
        return None
    named = {n: s for n, s in items if n}
    if len(named) != len([n for n, _ in items if n]):
        raise ConfigError("--input-shape: the same input name is given twice")
    if named and len(named) != len(items):
        raise ConfigError("--input-shape: name every shape (name=1,3,224,224) when giving several inputs")
    if named:
        return named
    if len(items) > 1:
        raise ConfigError("--input-shape given several times without input names; use name=dims for each input")
    return items[0][1]


def _readable_file(path: Path, what: str) -> None:
    """:class:`FrontendError` naming ``what`` unless ``path`` is a readable file."""
    from fxq.errors import FrontendError

    if path.is_dir():
        raise FrontendError(f"{what} {str(path)!r} is a folder, not a file")
    if not path.is_file():
        raise FrontendError(f"{what} {str(path)!r} not found")
    if not os.access(path, os.R_OK):
        raise FrontendError(f"{what} {str(path)!r} is not readable (permission denied)")


class _Loaded:
    """A model read from the command line: the module, what it is, whether it is already quantized."""

    def __init__(self, module: Any, kind: str, name: str, quantized: bool = False) -> None:
        self.module, self.kind, self.name, self.quantized = module, kind, name, quantized


def load_model(spec: str, caffemodel: str | None = None, shapes: Any = None,
               outputs: list[str] | None = None, input_values: dict[str, Any] | None = None,
               batch_dims: dict[str, int | None] | None = None) -> _Loaded:
    """Load ``spec``: an ``.onnx`` file, a ``.prototxt`` (+ caffemodel), a ``.fxq`` file (:func:`fxq.save`) or
    ``module:factory``. ``outputs``: ONNX tensor / caffe blob names to cut the graph at (``outputs=...``);
    ``input_values``: ONNX inputs made constants (``load_onnx(input_values=...)``); ``batch_dims``: where ONNX
    inputs / outputs hold the batch (``load_onnx(batch_dims=...)``)."""
    from torch import nn

    from fxq.errors import ConfigError, FrontendError

    path = Path(spec)
    suffix = path.suffix.lower()
    if caffemodel and suffix != ".prototxt":
        raise ConfigError(f"--caffemodel {caffemodel!r} applies only to a .prototxt model, not to {spec!r}")
    if outputs and suffix not in (".onnx", ".prototxt"):
        raise ConfigError(f"--outputs applies only to an .onnx or .prototxt model, not to {spec!r}")
    if input_values and suffix != ".onnx":
        raise ConfigError(f"--input-value applies only to an .onnx model, not to {spec!r}")
    if batch_dims and suffix != ".onnx":
        raise ConfigError(f"--batch-dim applies only to an .onnx model, not to {spec!r}")
    if path.is_dir():
        raise FrontendError(f"model {spec!r} is a folder; give a model file (.onnx, .prototxt, .fxq) or "
                            f"module:factory")
    if suffix in (".onnx", ".prototxt", ".fxq") or (suffix and path.exists()):
        _readable_file(path, "model file")
        if suffix == ".onnx":
            return _Loaded(_fxq().load_onnx(path, input_shapes=_onnx_open_shapes(path, shapes, input_values),
                                            outputs=outputs, input_values=input_values, batch_dims=batch_dims),
                           "onnx", path.stem)
        if suffix == ".prototxt":
            weights = Path(caffemodel) if caffemodel else path.with_suffix(".caffemodel")
            if weights.is_dir():
                raise FrontendError(f"--caffemodel {str(weights)!r} is a folder, not a caffemodel file")
            if not weights.is_file():
                hint = f"{str(weights)!r} not found" if caffemodel else f"no {weights.name!r} beside it"
                raise FrontendError(f"caffe model {spec!r}: {hint}; pass --caffemodel PATH")
            _readable_file(weights, "--caffemodel")
            caffe_shapes = shapes if isinstance(shapes, dict) else None  # unnamed: the prototxt's shapes
            return _Loaded(_fxq().load_caffe(path, weights, input_shapes=caffe_shapes, outputs=outputs), "caffe",
                           path.stem)
        if suffix == ".fxq":
            return _Loaded(_fxq().load(path), "fxq", path.stem, quantized=True)
        raise FrontendError(f"model {spec!r}: unknown model file type {suffix!r}; use .onnx, .prototxt, .fxq or "
                            f"module:factory")
    module_name, sep, factory = spec.partition(":")
    if not sep or not module_name or not factory:
        raise FrontendError(f"model {spec!r} not found: give an .onnx file, a .prototxt, or module:factory "
                            f"(a Python function returning an nn.Module)")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001  (ImportError, or whatever the module raises while importing)
        raise FrontendError(f"cannot import {module_name!r} for model {spec!r}: {type(exc).__name__}: {exc}") from exc
    fn = getattr(module, factory, None)
    if fn is None or not callable(fn):
        raise FrontendError(f"{module_name!r} has no callable {factory!r} (model {spec!r})")
    try:
        model = fn()
    except Exception as exc:  # noqa: BLE001  (the user's factory failed: say which)
        raise FrontendError(f"model factory {spec}() raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(model, nn.Module):
        raise FrontendError(f"{spec}() returned a {type(model).__name__}, expected a torch.nn.Module")
    return _Loaded(model.eval(), "python", factory)


def _onnx_open_shapes(path: Path, shapes: Any, values: dict[str, Any] | None = None) -> dict[str, list[int]] | None:
    """The ``--input-shape`` entries for ONNX inputs with symbolic / unknown dims (static inputs keep the file's
    shape for loading; ``--input-shape`` then only describes the calibration data). Inputs ``values`` makes
    constants (``--input-value``) do not count."""
    if not shapes:
        return None
    import onnx

    from fxq.errors import FrontendError
    from fxq.frontends.onnx.shapes import source_dims

    try:
        declared = {k: v for k, v in source_dims(onnx.load(str(path), load_external_data=False)).items()
                    if k not in (values or {})}
    except Exception as exc:  # noqa: BLE001  (load_onnx reports unreadable files with their reason)
        logger.debug("could not read the inputs of %s before loading: %s", path, exc)
        return None
    if not isinstance(shapes, dict):
        if len(declared) != 1:
            raise FrontendError(f"{str(path)!r} has inputs {list(declared)}: give --input-shape NAME=dims for each")
        shapes = {next(iter(declared)): shapes}
    open_dims = {k: v for k, v in shapes.items()
                 if k in declared and (not declared[k] or any(not (isinstance(d, int) and d > 0) for d in declared[k]))}
    unknown = sorted(set(shapes) - set(declared))
    if unknown:
        raise FrontendError(f"--input-shape names {unknown}, which are not inputs of {str(path)!r} "
                            f"(its inputs: {list(declared)})")
    return open_dims or None


def _load_model_for(args: argparse.Namespace) -> _Loaded:
    """:func:`load_model` of ``args``. An ONNX file with symbolic input dims that fails to load without
    ``--input-shape`` is loaded again at the shapes of the first calibration batch (what its error advises: a rank
    shape inference cannot tell, a converter that needs a size; the exports keep those dims dynamic), with a
    WARNING saying so."""
    from fxq.errors import FrontendError, FxqError

    shapes = _input_shapes(args)
    outputs = getattr(args, "outputs", None)
    values = _input_values(args)
    batch_dims = _batch_dims(args)
    try:
        return load_model(args.model, args.caffemodel, shapes, outputs, values, batch_dims)
    except FrontendError:
        if shapes or Path(args.model).suffix.lower() != ".onnx" or not getattr(args, "calib", None) \
                or not _has_open_dims(Path(args.model)):
            raise
        try:
            data_shapes = _first_batch_shapes(args)
        except (FxqError, OSError, ValueError) as data_exc:
            logger.debug("could not read the calibration data's shapes: %s", data_exc)
            data_shapes = None
        if data_shapes is None:
            raise
    shown = " ".join(f"{k}={','.join(map(str, v))}" for k, v in data_shapes.items()) \
        if isinstance(data_shapes, dict) else ",".join(map(str, data_shapes))
    logger.warning("%s has symbolic dims that loading must fix: fixed from the first calibration batch (%s); "
                   "the exports keep them dynamic. Pass --input-shape to choose other sizes", args.model, shown)
    return load_model(args.model, args.caffemodel, data_shapes, outputs, values, batch_dims)


def _has_open_dims(path: Path) -> bool:
    """Whether ONNX file ``path`` declares an input with a symbolic or unknown dim (or rank)."""
    import onnx

    from fxq.frontends.onnx.shapes import symbolic_inputs

    try:
        return bool(symbolic_inputs(onnx.load(str(path), load_external_data=False)))
    except Exception:  # noqa: BLE001  (unreadable: load_onnx's error stands)
        return False


def _first_batch_shapes(args: argparse.Namespace) -> list[int] | dict[str, list[int]] | None:
    """Input shapes of the first batch of the calibration folder (one tensor, or a dict by input name)."""
    import torch

    from fxq.data import load_calibration_folder

    data = load_calibration_folder(args.calib, dtype=args.dtype, layout=args.layout, batch_size=args.batch_size,
                                   **_folder_options(args))
    first = next(iter(data), None)
    if isinstance(first, torch.Tensor):
        return list(first.shape)
    if isinstance(first, dict) and all(isinstance(v, torch.Tensor) for v in first.values()):
        return {str(k): list(v.shape) for k, v in first.items()}
    return None


def _model_input_shapes(loaded: _Loaded) -> list[int] | dict[str, list[int]] | None:
    """Static input shapes recorded by the ONNX / caffe frontends (None when unknown or symbolic)."""
    meta = getattr(loaded.module, "meta", {}) or {}
    info = meta.get(loaded.kind) if loaded.kind in ("onnx", "caffe") else None
    shapes = info.get("input_shapes") if isinstance(info, dict) else None
    if not shapes:
        return None
    if not all(isinstance(s, (list, tuple)) and s and all(isinstance(d, int) and d > 0 for d in s)
               for s in shapes.values()):
        return None
    if len(shapes) == 1:
        return list(next(iter(shapes.values())))
    return {k: list(v) for k, v in shapes.items()}


def load_data(args: argparse.Namespace, loaded: _Loaded, folder: str | None = None) -> Any:
    """The calibration folder of ``args`` (or ``folder``); the library says when its first batch does not fit."""
    from fxq.data import load_calibration_folder

    shapes = _input_shapes(args) or _model_input_shapes(loaded)
    return load_calibration_folder(folder or args.calib, input_shape=shapes, dtype=args.dtype, layout=args.layout,
                                   batch_size=args.batch_size, **_folder_options(args))


def _folder_options(args: argparse.Namespace) -> dict[str, Any]:
    """``load_calibration_folder``'s image options from the flags: the pixel cap, and ``image=`` when any of
    ``--mean`` / ``--std`` / ``--bgr`` / ``--pixel-max`` is given."""
    from fxq.data import ImagePreprocess

    options: dict[str, Any] = {"max_image_pixels": args.max_image_pixels} if args.max_image_pixels else {}
    given = {k: v for k, v in (("mean", args.mean), ("std", args.std), ("pixel_max", args.pixel_max)) if v}
    if given or args.bgr:
        options["image"] = ImagePreprocess(**given, bgr=args.bgr)
    return options


def _setting(args: argparse.Namespace) -> Any:
    from fxq.errors import ConfigError, FxqError
    from fxq.setting import QuantizationSetting

    if not getattr(args, "setting", None):
        return None
    if getattr(args, "_setting_obj", None) is not None:
        return args._setting_obj
    p = Path(args.setting)
    if p.is_dir():
        raise ConfigError(f"--setting {args.setting!r} is a folder, not a JSON file")
    if not p.is_file():
        raise ConfigError(f"--setting file {args.setting!r} not found")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise ConfigError(f"--setting file {args.setting!r} cannot be read: {why or exc}") from None
    try:
        args._setting_obj = QuantizationSetting.from_json(text)
        return args._setting_obj
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--setting file {args.setting!r} is not valid JSON: {exc}") from exc
    except FxqError as exc:
        raise type(exc)(f"--setting file {args.setting!r}: {exc}") from exc


def _preflight(args: argparse.Namespace) -> Path | None:
    """Check the cheap arguments (setting file, --json, --out, folders) before any model is loaded; return --out."""
    from fxq.errors import ConfigError

    _setting(args)
    if getattr(args, "budget", None):
        from fxq.precision_search import Budget

        Budget.parse(args.budget)
    elif getattr(args, "fallback", "fp32") != "fp32":
        raise ConfigError("--fallback fp16 is the precision of the layers --budget takes off INT8; give --budget, "
                          "or export the whole float part in FP16 with --export-option high_precision_dtype=fp16")
    for flag, folder in (("--calib", getattr(args, "calib", None)), ("--data", getattr(args, "data", None))):
        if folder and Path(folder).is_file():
            raise ConfigError(f"{flag} {folder!r} is a file; give a folder of batches (one file per batch)")
    target = getattr(args, "json", None)
    if isinstance(target, str):
        t = Path(target)
        if t.is_dir():
            raise ConfigError(f"--json {target!r} is a folder; give a file name")
        if not t.parent.is_dir():
            raise ConfigError(f"--json {target!r}: folder {str(t.parent)!r} does not exist")
    return _out_dir(args.out) if getattr(args, "out", None) else None


def _platform(args: argparse.Namespace, loaded: _Loaded) -> str:
    """``--platform``, else the platform a saved model was quantized for, else trt_int8."""
    if args.platform:
        return args.platform
    quant = getattr(loaded.module, "meta", {}).get("fxq") if loaded.quantized else None
    return getattr(quant, "platform", None) or "trt_int8"


def _quantize(args: argparse.Namespace, loaded: _Loaded, data: Any) -> Any:
    if loaded.quantized:
        if getattr(args, "budget", None):
            from fxq.errors import ConfigError

            raise ConfigError(f"--budget searches precisions while quantizing; {loaded.name!r} is already quantized: "
                              "give the float model (.onnx / .prototxt / module:factory)")
        return loaded.module
    t0 = time.perf_counter()
    if getattr(args, "budget", None):
        gm, report = _fxq().auto_quantize(loaded.module, data, platform=_platform(args, loaded),
                                          budget=args.budget, setting=_setting(args), fallback=args.fallback,
                                          steps=args.steps, capture=args.capture)
        args._auto_report = report
        logger.info("auto-quantized %s for %s in %.1f s", loaded.name, _platform(args, loaded),
                    time.perf_counter() - t0)
        return gm
    gm = _fxq().quantize(loaded.module, data, platform=_platform(args, loaded), setting=_setting(args),
                         steps=args.steps, progress=not args.quiet, capture=args.capture)
    logger.info("quantized %s for %s in %.1f s", loaded.name, _platform(args, loaded), time.perf_counter() - t0)
    return gm


def _out_dir(path: str) -> Path:
    from fxq.errors import ExportError

    out = Path(path)
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {path!r} is a file; give a folder (it is created when missing)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ExportError(f"cannot create output folder {path!r}: {exc.strerror or exc}") from exc
    return out


def _export_options(args: argparse.Namespace) -> dict[str, Any]:
    from fxq.errors import ConfigError

    opts: dict[str, Any] = {}
    for item in getattr(args, "export_option", None) or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--export-option {item!r}: use KEY=VALUE (VALUE as JSON, e.g. legacy=true)")
        try:
            opts[key] = json.loads(value)
        except json.JSONDecodeError:
            opts[key] = value
    return opts


def _export(gm: Any, platform: str, out: Path, stem: str, exporter: str | None, options: dict[str, Any]) -> list[Path]:
    return list(_fxq().export(gm, exporter or platform, out / stem, **options))


def _stem(loaded: _Loaded, platform: str) -> str:
    """Output file stem ``<model>_<platform>`` (a saved ``<model>_<platform>.fxq`` keeps its name)."""
    name = loaded.name if loaded.quantized and loaded.name.endswith(f"_{platform}") else f"{loaded.name}_{platform}"
    return name.replace("/", "_").replace(os.sep, "_")


# ------------------------------------------------------------------------------------------- commands
def cmd_quantize(args: argparse.Namespace) -> int:
    """Quantize MODEL on the calibration folder, save it and export it for the platform."""
    fxq = _fxq()
    out = _preflight(args)
    loaded = _load_model_for(args)
    data = load_data(args, loaded)
    gm = _quantize(args, loaded, data)
    summary = fxq.summary(gm)
    fidelity = _output_fidelity(gm, data)
    platform = _platform(args, loaded)
    stem = _stem(loaded, platform)
    files: list[Path] = []
    failed: list[str] = []
    optional = [("summary", lambda: atomic_write_text(out / f"{stem}.summary.txt",
                                                       str(summary) + "\n" + (fidelity + "\n" if fidelity else ""))),
                ("saved model", lambda: fxq.save(gm, out / f"{stem}.fxq"))]
    report = getattr(args, "_auto_report", None)
    if report is not None:
        optional.append(("auto_quantize report", lambda: atomic_write_text(
            out / f"{stem}.auto_quantize.json", json.dumps(report.to_dict(), indent=2) + "\n")))
    for what, write in optional:
        try:
            files.append(write())
        except Exception as exc:  # noqa: BLE001  (an optional file never stops the exports)
            if args.no_export:
                raise
            logger.warning("could not write the %s (%s: %s); writing the exports anyway", what,
                           type(exc).__name__, _one_line(exc))
            failed.append(what)
    if not args.no_export:
        options = _export_options(args)
        if report is not None and args.fallback == "fp16":
            options.setdefault("high_precision_dtype", "fp16")
        files += _export(gm, platform, out, stem, args.exporter, options)
    if not args.quiet:
        print(summary)
        if fidelity:
            print(fidelity)
    if report is not None:
        print(report)
    print("wrote:\n" + "\n".join(f"  {p}" for p in files))
    if failed:
        print(f"fxq: warning: not written: {', '.join(failed)} (see the warning above); exit code {EXIT_PARTIAL}",
              file=sys.stderr)
        return EXIT_PARTIAL
    return EXIT_OK


def _output_fidelity(gm: Any, data: Any) -> str | None:
    """The quantized model's output noise / signal against its FP32 graph on the first calibration batch, as one
    line; a warning naming the layers that hurt most above :data:`POOR_OUTPUT_SNR`. None when it cannot be
    measured (the analysis' own failure never stops the command)."""
    fxq = _fxq()
    try:
        report = fxq.graphwise_error_analyse(gm, data, steps=1)
    except Exception as exc:  # noqa: BLE001
        logger.debug("output fidelity not measured (%s: %s)", type(exc).__name__, _one_line(exc), exc_info=True)
        return None
    if not report.outputs:
        return None
    worst = max(report.outputs, key=lambda r: r.value)
    line = (f"output noise / signal against FP32 on the first calibration batch: {worst.value:.2%}"
            + (f" ({worst.name})" if len(report.outputs) > 1 else ""))
    if worst.value > POOR_OUTPUT_SNR:
        layers = ", ".join(f"{r.name} ({r.value:.0%})" for r in report.worst(3))
        logger.warning("the quantized model's output is %.0f%% noise against FP32 on calibration data: it computes "
                       "something else. The layers that hurt most: %s. `fxq analyse` with the same arguments shows "
                       "the whole table; `--budget snr=0.05` keeps the fewest layers in float to reach 5%%",
                       100 * worst.value, layers)
    return line


def cmd_export(args: argparse.Namespace) -> int:
    """Quantize MODEL (unless it is a saved fxq model) and write the exporter's files only."""
    out = _preflight(args)
    loaded = _load_model_for(args)
    if loaded.quantized:
        gm = loaded.module
    else:
        if not args.calib:
            from fxq.errors import ConfigError

            raise ConfigError("export of a float model needs calibration data: pass --calib DIR")
        gm = _quantize(args, loaded, load_data(args, loaded))
    platform = _platform(args, loaded)
    files = _export(gm, platform, out, _stem(loaded, platform), args.exporter, _export_options(args))
    print("wrote:\n" + "\n".join(f"  {p}" for p in files))
    return EXIT_OK


def _quantized_for_analysis(args: argparse.Namespace) -> tuple[_Loaded, Any, Any]:
    """The loaded model, its quantized GraphModule and the batches to analyse (``--data``, else the calibration)."""
    from fxq.errors import ConfigError

    loaded = _load_model_for(args)
    if loaded.quantized:  # a saved model: only the analysis data
        if not (args.data or args.calib):
            raise ConfigError("give the analysis data: --data DIR (or --calib DIR)")
        return loaded, loaded.module, load_data(args, loaded, args.data or args.calib)
    if not args.calib:
        raise ConfigError("quantizing a float model needs calibration data: pass --calib DIR")
    data = load_data(args, loaded)
    gm = _quantize(args, loaded, data)
    return loaded, gm, (load_data(args, loaded, args.data) if args.data else data)


def cmd_analyse(args: argparse.Namespace) -> int:
    """Quantize MODEL and print the graphwise (and layerwise) error tables."""
    fxq = _fxq()
    _preflight(args)
    loaded, gm, eval_data = _quantized_for_analysis(args)
    graphwise = fxq.graphwise_error_analyse(gm, eval_data, method=args.method, steps=args.analyse_steps,
                                            ops=args.ops, progress=not args.quiet)
    print(graphwise.table(limit=args.top))
    result: dict[str, Any] = {"graphwise": graphwise.to_dict()}
    if args.layerwise:
        layerwise = fxq.layerwise_error_analyse(gm, eval_data, method=args.method, steps=args.analyse_steps,
                                                ops=args.ops, measure=args.measure, progress=not args.quiet)
        print()
        print(layerwise.table(limit=args.top))
        result["layerwise"] = layerwise.to_dict()
    if args.json:
        atomic_write_text(Path(args.json), json.dumps(result, indent=2, default=float) + "\n")
        print(f"wrote {args.json}")
    return EXIT_OK


def cmd_report(args: argparse.Namespace) -> int:
    """Quantize MODEL and write an HTML / markdown report with plots."""
    fxq = _fxq()
    out = _preflight(args)
    loaded, gm, eval_data = _quantized_for_analysis(args)
    page = fxq.write_report(gm, eval_data, out, steps=args.analyse_steps, method=args.method, fmt=args.format,
                            layerwise=args.layerwise, top_k=args.top_k, ops=args.ops, progress=not args.quiet,
                            title=f"fxq report: {loaded.name} ({_platform(args, loaded)})")
    print(f"wrote {page}")
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    """Compare an exported ONNX Q/DQ file (onnxruntime) or ncnn int8 .param (ncnn) with the saved model's
    simulation, tensor by tensor."""
    from fxq.errors import ConfigError, NotSupportedError

    _preflight(args)
    exported = Path(args.exported)
    _readable_file(exported, "exported file")
    if exported.suffix.lower() not in (".onnx", ".param"):
        raise NotSupportedError(f"exported file {args.exported!r}: only ONNX Q/DQ files (.onnx from trt_int8 / "
                                f"ort_int8 exports) and ncnn int8 files (.param from ncnn_int8 exports) can be "
                                f"verified")
    if Path(args.model).suffix.lower() != ".fxq":
        raise ConfigError(f"model {args.model!r}: give the quantized model saved with fxq.save (.fxq) that the file "
                          f"was exported from")
    loaded = load_model(args.model, None, _input_shapes(args))
    data = load_data(args, loaded, args.data)
    report = _fxq().locate_mismatch(loaded.module, exported, data, teacher_forced=args.teacher_forced,
                                    optimize=not args.no_optimize, steps=args.steps)
    print(report.table(limit=args.top))
    if args.json:
        atomic_write_text(Path(args.json), json.dumps(report.to_dict(), indent=2, default=float) + "\n")
        print(f"wrote {args.json}")
    return EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    """Quantize a seeded, randomly initialised torchvision ResNet-18 on synthetic data, analyse and export it."""
    import torch

    fxq = _fxq()
    import torchvision

    from fxq.errors import FxqError
    out = _out_dir(args.out)
    size, batches, batch = (64, 2, 2) if args.fast else (224, 8, 4)
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None).eval()
    gen = torch.Generator().manual_seed(0)
    calib = [torch.randn(batch, 3, size, size, generator=gen) for _ in range(batches)]
    held_out = [torch.randn(batch, 3, size, size, generator=gen) for _ in range(1 if args.fast else 2)]
    print(f"fxq demo: ResNet-18 (seeded random weights), {args.platform}, {batches} calibration batches of "
          f"{batch}x3x{size}x{size}")
    t0 = time.perf_counter()
    gm = fxq.quantize(model, calib, platform=args.platform, progress=not args.quiet)
    print(f"quantized in {time.perf_counter() - t0:.1f} s\n")
    summary = fxq.summary(gm)
    print(summary)
    report = fxq.graphwise_error_analyse(gm, held_out, method="snr", steps=None)
    for r in report.outputs:
        print(f"\noutput SNR vs FP32 ({r.name}): {r.formatted} (noise power / signal power, lower is better)")
    print(report.table(limit=5, outputs=False))
    stem = f"resnet18_{args.platform}"
    files = [atomic_write_text(out / f"{stem}.summary.txt", str(summary) + "\n")]
    if not args.no_export:
        try:
            files.append(fxq.save(gm, out / f"{stem}.fxq"))
        except Exception as exc:  # noqa: BLE001  (the optional save never stops the exports)
            logger.warning("could not save the model (%s: %s); exporting anyway", type(exc).__name__, _one_line(exc))
        try:
            files += _export(gm, args.platform, out, stem, None, _demo_export_options(args.platform))
        except FxqError as exc:  # e.g. a user platform without an exporter
            logger.warning("export skipped: %s", exc)
    print("\nwrote:\n" + "\n".join(f"  {p}" for p in files))
    return EXIT_OK


def _demo_export_options(platform: str) -> dict[str, Any]:
    """Also the legacy TensorRT files (calibration cache + json) when the platform's exporter writes them."""
    try:
        from fxq.backends import exporter_for

        exporter = exporter_for(platform)
    except Exception:  # noqa: BLE001  (no exporter registered: _export reports it)
        return {}
    return {"legacy": True} if "legacy" in getattr(exporter, "options", ()) else {}


def cmd_platforms(args: argparse.Namespace) -> int:
    """List the registered platforms and their quantization schemes."""
    from fxq.qconfig import PLATFORMS, get_platform

    rows = []
    for name in PLATFORMS.names():
        d = get_platform(name).describe()
        d["exporter"] = getattr(get_platform(name), "exporter", None)
        rows.append(d)
    if args.json:
        print(json.dumps(rows, indent=2))
        return EXIT_OK
    for d in rows:
        print(f"{d['name']}" + (f" — {d['description']}" if d.get("description") else ""))
        print(f"    activation: {d['activation']}")
        print(f"    weight:     {d['weight']}")
        print(f"    bias: {d['bias']}; rounding: {d['rounding']}; outputs quantized: {d['outputs_quantized']}; "
              f"exporter: {d['exporter']}")
        print(f"    quantized ops: {', '.join(d['quantized_ops'])}")
        print(f"    the exporter runs quantized: {d['expressible_ops']}")
    return EXIT_OK


# ------------------------------------------------------------------------------------------- parser
def _common(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("-q", "--quiet", action="store_true", help="errors only, no progress bars")
    g.add_argument("-v", "--verbose", action="store_true", help="debug logging and tracebacks")


def _names(text: str) -> list[str]:
    """``a,b`` -> ``["a", "b"]`` (tensor names; empty entries refused)."""
    names = [t.strip() for t in text.split(",")]
    if not all(names):
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated tensor names, e.g. boxes,scores")
    return names


def _floats(text: str) -> list[float]:
    """``104,177,123`` -> ``[104.0, 177.0, 123.0]``."""
    try:
        return [float(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated numbers, e.g. 104,177,123") from None


def _image_args(p: argparse.ArgumentParser) -> None:
    """How images in a data folder become the model's input (fxq.ImagePreprocess)."""
    p.add_argument("--mean", type=_floats, metavar="M[,M,M]",
                   help="images: subtract this per channel, in --pixel-max units (caffe's 104,117,123)")
    p.add_argument("--std", type=_floats, metavar="S[,S,S]", help="images: then divide by this per channel")
    p.add_argument("--bgr", action="store_true", help="images: feed channels as BGR (caffe / OpenCV models)")
    p.add_argument("--pixel-max", type=float, metavar="V",
                   help="images: pixel values run 0..V before --mean / --std (default 1; 255 for 0-255 models)")


def _model_args(p: argparse.ArgumentParser, calib_required: bool = True) -> None:
    p.add_argument("model", help="model.onnx, model.prototxt (+ --caffemodel), module:factory, or a quantized "
                                 "model.fxq (fxq.save) for analyse / export / report")
    p.add_argument("--caffemodel", help="caffe weights (default: the .caffemodel beside the .prototxt)")
    p.add_argument("--platform", default=None,
                   help="target platform (see `fxq platforms`; default: a saved model's own, else trt_int8)")
    p.add_argument("--calib", required=calib_required, metavar="DIR",
                   help="calibration folder: .npy / .bin / .pt / images, one batch per file "
                        "(one sub-folder per input for multi-input models)")
    p.add_argument("--input-shape", action="append", metavar="[NAME=]N,C,H,W", type=_parse_shape,
                   help="input shape (needed for raw .bin files; checked against the data; fixes an ONNX file's "
                        "symbolic dims for loading, exports stay dynamic); repeat with NAME= for several inputs")
    p.add_argument("--outputs", metavar="NAME[,NAME...]", type=_names,
                   help="ONNX / caffe models: load the graph up to these tensors / blobs, as its outputs (cut "
                        "before a detector's NMS / data-dependent If / DetectionOutput; load errors for such nodes "
                        "name the cut)")
    p.add_argument("--input-value", action="append", metavar="NAME=VALUE[,VALUE...]", type=_parse_value,
                   help="ONNX models: make input NAME a constant of this value (an input that selects a mode, such "
                        "as a sample rate, so an If on it folds); repeat for several inputs")
    p.add_argument("--batch-dim", action="append", metavar="NAME=DIM", type=_parse_batch_dim,
                   help="ONNX models: the batch of input or output NAME is dim DIM, not dim 0 (a recurrent state "
                        "[2, batch, 128]) where the file does not name it, or NAME=none for a tensor without a batch "
                        "dim; read by the ncnn export; repeat")
    p.add_argument("--dtype", default=None, type=_dtype_name, help="convert calibration tensors to this dtype (default: keep; "
                                                 "float64 -> float32; raw files float32)")
    p.add_argument("--layout", default="NCHW", choices=["NCHW", "NHWC"], help="image layout (default NCHW)")
    p.add_argument("--batch-size", type=_positive_int, default=None, help="re-batch the calibration samples to this size")
    p.add_argument("--setting", metavar="JSON", help="QuantizationSetting as JSON (QuantizationSetting.to_json)")
    p.add_argument("--steps", type=_positive_int, default=None, help="calibration batches to use (default: all)")
    p.add_argument("--capture", default="auto", choices=["auto", "fx", "export"],
                   help="how a Python model (module:factory) becomes a graph: symbolic tracing, torch.export, or "
                        "auto (tracing, then torch.export, then FP32 islands; default)")
    p.add_argument("--max-image-pixels", type=_positive_int, default=None, metavar="N",
                   help="largest width x height of a calibration image, checked before decoding "
                        "(default 2**26, 64 megapixels)")
    _image_args(p)


def _analysis_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", metavar="DIR", help="analysis data folder (default: the calibration folder)")
    p.add_argument("--method", default="snr", choices=["snr", "cosine", "mse"], help="error metric (default snr)")
    p.add_argument("--analyse-steps", type=_positive_int, default=8, help="batches to analyse (default 8)")
    p.add_argument("--ops", default="computing", choices=["computing", "quantized"],
                   help="layers to analyse: computing ops (default) or every quantized op")
    p.add_argument("--layerwise", action="store_true", help="also run the layerwise analysis (slower)")


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line on stderr (exit 2), like fxq's other errors."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"fxq: error: {' '.join(message.split())} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``fxq`` argument parser."""
    parser = _Parser(prog="fxq", description="fxq: PyTorch-native torch.fx quantization toolkit")
    parser.add_argument("--version", action="version", version=f"fxq {_fxq().__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("quantize", help="quantize a model and save + export it")
    _model_args(p)
    p.add_argument("--out", default="fxq_out", help="output folder (default ./fxq_out)")
    p.add_argument("--exporter", help="exporter name (default: the platform's)")
    p.add_argument("--export-option", action="append", metavar="KEY=VALUE", help="exporter option (repeatable)")
    p.add_argument("--no-export", action="store_true", help="do not write deployment files")
    p.add_argument("--budget", metavar="SPEC",
                   help="search per-layer precision (fxq.auto_quantize) for the fewest layers off INT8 that meet "
                        "SPEC: an output SNR bound (0.01 or 1%%), or comma-separated snr=/cosine=/size= "
                        "(size: weight bytes as a fraction of FP32's); writes <model>_<platform>.auto_quantize.json")
    p.add_argument("--fallback", default="fp32", choices=["fp32", "fp16"],
                   help="precision of the layers --budget takes off INT8 (fp16: TensorRT FP16 export)")
    _common(p)
    p.set_defaults(func=cmd_quantize)

    p = sub.add_parser("analyse", aliases=["analyze"], help="quantize and print per-layer quantization error")
    _model_args(p, calib_required=False)
    _analysis_args(p)
    p.add_argument("--measure", default="network", choices=["network", "layer"],
                   help="layerwise: compare at the network outputs (default) or at each layer's output")
    p.add_argument("--top", type=_positive_int, default=20, help="rows per table (default 20)")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    _common(p)
    p.set_defaults(func=cmd_analyse)

    p = sub.add_parser("export", help="quantize and write the platform's deployment files")
    _model_args(p, calib_required=False)
    p.add_argument("--out", default="fxq_out", help="output folder (default ./fxq_out)")
    p.add_argument("--exporter", help="exporter name (default: the platform's)")
    p.add_argument("--export-option", action="append", metavar="KEY=VALUE", help="exporter option (repeatable)")
    _common(p)
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("report", help="quantize and write an HTML / markdown report with plots")
    _model_args(p, calib_required=False)
    _analysis_args(p)
    p.add_argument("--out", default="fxq_report", help="report folder (default ./fxq_report)")
    p.add_argument("--format", default="html", choices=["html", "md"], help="page format (default html)")
    p.add_argument("--top-k", type=_non_negative_int, default=4,
                   help="worst layers that get histograms (default 4; 0: none)")
    _common(p)
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("verify", help="compare an exported ONNX (onnxruntime) or ncnn file with the simulation, "
                                      "per tensor")
    p.add_argument("model", help="the quantized model.fxq (fxq.save) the file was exported from")
    p.add_argument("exported", help="the exported .onnx file (trt_int8 / ort_int8 Q/DQ export) or ncnn .param "
                                    "(ncnn_int8 export, its .bin beside it)")
    p.add_argument("--data", required=True, metavar="DIR", help="data folder: one batch per file (as --calib)")
    p.add_argument("--teacher-forced", action="store_true",
                   help="feed every DequantizeLinear (every compared ncnn blob) with the simulation's values (local "
                        "mismatches only)")
    p.add_argument("--no-optimize", action="store_true", help="onnxruntime with ORT_DISABLE_ALL (default ENABLE_ALL)")
    p.add_argument("--top", type=_positive_int, default=30, help="rows of the table (default 30)")
    p.add_argument("--steps", type=_positive_int, default=4, help="batches to compare (default 4)")
    p.add_argument("--input-shape", action="append", metavar="[NAME=]N,C,H,W", type=_parse_shape,
                   help="input shape (needed for raw .bin files); repeat with NAME= for several inputs")
    p.add_argument("--dtype", default=None, type=_dtype_name, help="convert data tensors to this dtype")
    p.add_argument("--layout", default="NCHW", choices=["NCHW", "NHWC"], help="image layout (default NCHW)")
    p.add_argument("--batch-size", type=_positive_int, default=None, help="re-batch the samples to this size")
    p.add_argument("--max-image-pixels", type=_positive_int, default=None, metavar="N",
                   help="largest width x height of an image, checked before decoding")
    _image_args(p)
    p.add_argument("--json", metavar="FILE", help="also write the report as JSON")
    _common(p)
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("demo", help="quantize a seeded random ResNet-18 for TensorRT INT8 and export it")
    p.add_argument("--platform", default="trt_int8", help="target platform (default trt_int8)")
    p.add_argument("--out", default="fxq_out", help="output folder (default ./fxq_out)")
    p.add_argument("--fast", action="store_true", help="small inputs and few batches (for tests)")
    p.add_argument("--no-export", action="store_true", help="do not save or export")
    _common(p)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("platforms", help="list platforms and their quantization schemes")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    _common(p)
    p.set_defaults(func=cmd_platforms)
    return parser


def _configure_logging(level: int) -> logging.Handler:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("fxq")
    root.addHandler(handler)
    root.setLevel(level)
    return handler


def _one_line(exc: BaseException) -> str:
    from fxq.errors import one_line

    return one_line(exc) or type(exc).__name__


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``fxq`` command line with ``argv`` (default ``sys.argv[1:]``); return the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, usage errors
        return int(exc.code) if isinstance(exc.code, int) else EXIT_USAGE
    verbose, quiet = getattr(args, "verbose", False), getattr(args, "quiet", False)
    level = logging.DEBUG if verbose else logging.ERROR if quiet else logging.WARNING
    fxq_logger = logging.getLogger("fxq")
    saved_level = fxq_logger.level
    handler = _configure_logging(level)
    try:
        return int(args.func(args) or EXIT_OK)
    except KeyboardInterrupt:
        print("fxq: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # output piped into head & co.
        sys.stdout = open(os.devnull, "w")  # silence the flush at exit
        return EXIT_OK
    except Exception as exc:  # noqa: BLE001  (the one place that turns errors into exit codes)
        if verbose:
            traceback.print_exc()
        from fxq.errors import FxqError

        if isinstance(exc, FxqError):
            print(f"fxq: error: {_one_line(exc)}", file=sys.stderr)
        elif isinstance(exc, OSError):
            where = f" {exc.filename!r}" if getattr(exc, "filename", None) else ""
            print(f"fxq: error: {exc.strerror or _one_line(exc)}{where}", file=sys.stderr)
        else:
            hint = "" if verbose else " (rerun with --verbose for the traceback)"
            print(f"fxq: error: {type(exc).__name__}: {_one_line(exc)}{hint}", file=sys.stderr)
        return EXIT_ERROR
    finally:
        fxq_logger.removeHandler(handler)
        fxq_logger.setLevel(saved_level)
