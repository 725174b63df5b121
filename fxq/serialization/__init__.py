"""Native save / load of quantized GraphModules, without pickling objects.

``fxq.save(model, path)`` writes one file with ``torch.save``: a plain dict of tensors (parameters, buffers,
quantizer scales, FP32 backups of baked weights; baked weights as their integer codes, see
:mod:`fxq.serialization.packing`) and a JSON string describing the module tree, the graph (node by node,
targets by name) and the meta records fxq and its exporters read. ``fxq.load(path)`` reads it
with ``torch.load(weights_only=True)`` and resolves every class and function through an allow-list
(:mod:`fxq.serialization.allowlist`); extend it with :func:`register_serializable`.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

from fxq.errors import ConfigError, ExportError, FrontendError, FxqError, NotSupportedError
from fxq.io import atomic_path, check_output_dir, ensure_dir, model_file_kind
from fxq.serialization.allowlist import register_serializable
from fxq.serialization.codec import TensorTable, check_shape, dtype_name, dtype_of
from fxq.serialization.graph import decode_graph, decode_meta, encode_graph, encode_meta
from fxq.serialization.legacy import pop_legacy_fields, upgrade_records
from fxq.serialization.modules import decode_modules, encode_modules
from fxq.serialization.packing import pack_baked_parameters, unpack_parameters

__all__ = ["save", "load", "register_serializable", "file_digest", "FORMAT", "VERSION"]

logger = logging.getLogger(__name__)

FORMAT = "fxq.graphmodule"
VERSION = 3
"""2: baked weights as integer codes ("packed"); 3: a ``sha256`` of spec and tensors (:func:`file_digest`).
Versions 1 and 2 are read too."""
_READABLE = (1, 2, 3)
_BLOB_KEYS = frozenset({"format", "version", "spec", "tensors", "sha256"})


def file_digest(spec: str, tensors: dict[str, torch.Tensor]) -> str:
    """The ``sha256`` a version-3 file holds: over the UTF-8 spec, then, for every tensor in sorted key order,
    a JSON header ``[key, dtype, shape, number of bytes]`` and the tensor's bytes (C order, as stored)."""
    h = hashlib.sha256()
    h.update(b"fxq.graphmodule/3\0")
    h.update(spec.encode("utf-8"))
    for key in sorted(tensors):
        t = tensors[key]
        data = b"" if t.is_meta or not t.numel() else t.detach().cpu().resolve_conj().resolve_neg().contiguous().reshape(-1).view(
            torch.uint8).numpy().tobytes()
        header = json.dumps([key, str(t.dtype), list(t.shape), len(data), "meta" if t.is_meta else "data"])
        h.update(b"\0" + header.encode("utf-8") + b"\0")
        h.update(data)
    return h.hexdigest()


def save(model: nn.Module, path: str | os.PathLike) -> Path:
    """Save a GraphModule from fxq (quantized or not) to ``path`` (one file, written atomically).

    The same model always gives the same bytes (no file name, time or object id inside).

    Raises:
        NotSupportedError: a module class or function outside the allow-list, or an attribute that is not a
            plain value / tensor (the message names the module, node or attribute).
        ExportError: ``path`` is a directory, or its folder cannot be created (a file in the way) or written. A
            missing folder is created, as :func:`fxq.export` does.

    Example:
        >>> fxq.save(qmodel, "resnet18_trt.fxq")
        >>> again = fxq.load("resnet18_trt.fxq")
    """
    if not isinstance(model, fx.GraphModule):
        raise NotSupportedError(f"fxq.save takes a torch.fx.GraphModule (from fxq.quantize / fxq.prepare / "
                                f"fxq.load_onnx), got {type(model).__name__}; use torch.save(model.state_dict()) "
                                f"for other modules")
    target = Path(path)
    if target.is_dir() or str(path).endswith(("/", os.sep)):
        raise ExportError(f"fxq.save needs a file name, {str(path)!r} is a directory; save to e.g. "
                          f"{str(target / 'model.fxq')!r}")
    check_output_dir(target.parent)
    table = TensorTable()
    doc = {
        "modules": encode_modules(model, table),
        "graph": encode_graph(model, table),
        "meta": encode_meta(getattr(model, "meta", {}), table, "model", tensor_spec_only=False),
        "training": bool(model.training),
        "torch": torch.__version__,
    }
    doc["packed"] = pack_baked_parameters(model, table)
    doc["tensors"] = {k: [list(t.shape), dtype_name(t.dtype)] for k, t in table.tensors.items()}
    spec = json.dumps(doc, allow_nan=False)
    blob = {"format": FORMAT, "version": VERSION, "spec": spec, "tensors": table.tensors,
            "sha256": file_digest(spec, table.tensors)}
    ensure_dir(target.parent)  # once the model encoded: a refused model leaves no new folder
    with atomic_path(target) as tmp:
        with open(tmp, "wb") as fh:  # a file object: torch.save would name the zip's records after the temp file
            torch.save(blob, fh)
    logger.info("saved %s (%d tensors)", target, len(table.tensors))
    return target


def load(path: str | os.PathLike, map_location: Any = "cpu") -> fx.GraphModule:
    """Load a model written by :func:`save`; tensors go to ``map_location``.

    Loading runs no code from the file: every class, function, method and name it holds is checked against
    fxq's allow-list (:mod:`fxq.serialization.allowlist`) before the graph is built.

    Raises:
        FrontendError: the file cannot be read as an fxq model: missing, a directory, damaged (checksum mismatch),
            another tool's (an ONNX model: the message says fxq.load_onnx; another torch.save file) or of a format
            version this fxq does not read; the kinds and the class :func:`fxq.load_onnx` uses for the same.
        NotSupportedError: the file names a class, function or attribute outside the allow-list.
        ConfigError: ``map_location`` names a device this machine does not have.
    """
    p = Path(path)
    if p.is_dir():
        raise FrontendError(f"{str(p)!r} is a directory, not an fxq model file; pass the file fxq.save wrote")
    if not p.is_file():
        raise FrontendError(f"fxq model file {str(p)!r} does not exist; check the path")
    _check_map_location(map_location)
    try:
        blob = torch.load(p, map_location=map_location, weights_only=True)
    except Exception as exc:
        raise _unreadable(p, exc) from exc
    if not isinstance(blob, dict) or blob.get("format") != FORMAT:
        raise FrontendError(f"{str(p)!r} is not an fxq model file but a torch.save file of another tool; fxq.load "
                            f"reads files written by fxq.save (a PyTorch model: pass the nn.Module to fxq.quantize)")
    version = blob.get("version")
    if type(version) is not int or version not in _READABLE:
        raise FrontendError(f"{str(p)!r} has format version {version!r}; this fxq reads versions "
                            f"{', '.join(map(str, _READABLE))} (a newer file: upgrade fxq; an older one: save it "
                            f"again with the fxq that wrote it)")
    spec, tensors = blob.get("spec"), blob.get("tensors")
    _check_blob(p, blob, spec, tensors)
    if version >= 3:
        if file_digest(spec, tensors) != blob.get("sha256"):
            raise FrontendError(f"{str(p)!r} is damaged: its sha256 does not match its contents (a flipped byte, a "
                                f"partial copy?); re-save or re-export the model")
    else:
        logger.debug("%s: format version %d has no checksum", p, version)
    try:
        gm = _build(spec, tensors, version)
    except (FrontendError, NotSupportedError) as exc:
        raise type(exc)(f"{str(p)!r}: {exc}") from exc
    except FxqError:
        raise
    except Exception as exc:  # a damaged or crafted file: never a raw error
        raise FrontendError(f"{str(p)!r} is damaged or from an incompatible fxq ({type(exc).__name__}: "
                            f"{str(exc)[:300]}); re-save or re-export the model") from exc
    logger.info("loaded %s", p)
    return gm


def _check_map_location(map_location: Any) -> None:
    if isinstance(map_location, (str, torch.device)):
        try:
            device = torch.device(map_location)
        except RuntimeError as exc:
            raise ConfigError(f"map_location={map_location!r} is not a device ({exc})") from exc
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"map_location={map_location!r} but CUDA is not available on this machine; "
                              f"load with map_location=\"cpu\"")


def _unreadable(p: Path, exc: Exception) -> FrontendError:
    """The error for a file torch.load refuses: an ONNX model is named as one; torch's own advice (load with
    weights_only=False, which runs the file's code) is cut off."""
    if model_file_kind(p) == "onnx":
        return FrontendError(f"{str(p)!r} is an ONNX model, not an fxq model file: read it with fxq.load_onnx "
                             f"(or quantize it with fxq.quantize)")
    text = str(exc)
    text = text.split("WeightsUnpickler error:", 1)[-1]  # the reason, after torch's advice
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return FrontendError(f"{str(p)!r} is not a readable fxq model file ({type(exc).__name__}: {first[:200] or 'empty or cut short'}); "
                         f"it is damaged or not written by fxq.save: save the model again with fxq.save")


def _check_blob(p: Path, blob: dict[str, Any], spec: Any, tensors: Any) -> None:
    extra = set(blob) - _BLOB_KEYS
    if extra or not isinstance(spec, str) or not isinstance(tensors, dict):
        raise FrontendError(f"{str(p)!r} is damaged: unexpected content (keys {sorted(map(str, blob))})")
    for key, t in tensors.items():
        if not isinstance(key, str) or type(t) not in (torch.Tensor, nn.Parameter) or t.layout != torch.strided \
                or t.is_quantized:
            raise FrontendError(f"{str(p)!r} is damaged: tensor entry {key!r:.80} is not a plain dense tensor")


def _no_constant(name: str) -> Any:
    raise FrontendError(f"the model description holds {name}, which fxq never writes")


def _check_declared(declared: Any, tensors: dict[str, torch.Tensor]) -> None:
    if not isinstance(declared, dict):
        raise FrontendError(f"the tensor list is a {type(declared).__name__}, not an object")
    missing, extra = sorted(set(declared) - set(tensors)), sorted(set(tensors) - set(declared))
    if missing or extra:
        raise FrontendError(f"the file declares tensors it does not hold ({missing[:3]}) or holds undeclared "
                            f"ones ({extra[:3]})")
    for key, spec in declared.items():
        if not (isinstance(spec, list) and len(spec) == 2):
            raise FrontendError(f"tensor {key!r}: declared as {spec!r:.80}, not [shape, dtype]")
        shape, dtype = check_shape(spec[0], f"tensor {key!r}"), dtype_of(spec[1])
        t = tensors[key]
        if list(t.shape) != shape or t.dtype != dtype:
            raise FrontendError(f"tensor {key!r} is declared {dtype_name(dtype)}{shape} but the file holds "
                                f"{dtype_name(t.dtype)}{list(t.shape)}")


def _build(spec: str, tensors: dict[str, torch.Tensor], version: int) -> fx.GraphModule:
    doc = json.loads(spec, parse_constant=_no_constant)
    if not isinstance(doc, dict):
        raise FrontendError(f"the model description is a {type(doc).__name__}, not an object")
    if version >= 3:  # what the file declares must be what it holds
        _check_declared(doc.get("tensors"), tensors)
    table = TensorTable(tensors)
    packed = doc.get("packed", {})
    if not isinstance(packed, dict):
        raise FrontendError("'packed' is not an object")
    unpack_parameters(packed, table)
    gm = fx.GraphModule(nn.Module(), fx.Graph(), class_name="GraphModule")
    defined = decode_modules(doc["modules"], gm, table)
    gm.graph = decode_graph(doc["graph"], table, defined)
    gm.graph.lint()
    meta = doc.get("meta", {})
    legacy = pop_legacy_fields(meta, table)
    gm.meta.update(decode_meta(meta, table))
    upgrade_records(gm, legacy)
    training = doc.get("training", False)
    if not isinstance(training, bool):
        raise FrontendError(f"'training' is a {type(training).__name__}, not a bool")
    gm.training = training  # submodules keep their own saved flags
    return gm
