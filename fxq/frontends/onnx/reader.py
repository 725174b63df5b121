"""Read an ONNX model from a path or a ``ModelProto``, external data included; every failure is a FrontendError."""
from __future__ import annotations

import os
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError
from onnx.external_data_helper import load_external_data_for_model, uses_external_data

from fxq.errors import FrontendError
from fxq.io import model_file_kind

__all__ = ["read_model", "PROTO_SOURCE"]

PROTO_SOURCE = "<ModelProto>"


def _external_tensors(model: onnx.ModelProto) -> list[onnx.TensorProto]:
    return [t for t in model.graph.initializer if uses_external_data(t)]


def _read_path(path: Path, shown: str, base_dir: Path | None) -> onnx.ModelProto:
    if not path.exists():
        raise FrontendError(f"ONNX file {shown!r} does not exist; check the path")
    if not path.is_file():
        raise FrontendError(f"ONNX file {shown!r} is not a file (a directory?); pass the .onnx file itself")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except (DecodeError, OSError, RuntimeError, ValueError) as exc:
        if model_file_kind(path) == "zip":
            raise FrontendError(
                f"{shown!r} is a PyTorch archive (torch.save / fxq.save), not ONNX: read a file of fxq.save with "
                "fxq.load; for another PyTorch model pass the nn.Module to fxq.quantize"
            ) from exc
        raise FrontendError(
            f"{shown!r} is not a readable ONNX model ({type(exc).__name__}: {exc}); "
            "the file is corrupt, truncated or not ONNX: re-export it"
        ) from exc
    _check_is_model(model, shown)
    if _external_tensors(model):
        _load_external(model, base_dir if base_dir is not None else path.parent, shown)
    return model


def _load_external(model: onnx.ModelProto, base_dir: Path, shown: str) -> None:
    """Load external tensor data (``.onnx.data`` files) found relative to ``base_dir``."""
    locations = sorted(
        {kv.value for t in _external_tensors(model) for kv in t.external_data if kv.key == "location"}
    )
    missing = [loc for loc in locations if not (base_dir / loc).is_file()]
    if missing:
        raise FrontendError(
            f"ONNX model {shown!r} keeps its weights in external data file(s) {missing} that are not found "
            f"next to it; keep the data file(s) beside the .onnx file (or pass base_dir=<their folder>)"
        )
    try:
        load_external_data_for_model(model, str(base_dir))
    except Exception as exc:  # noqa: BLE001  (onnx raises several types for bad offsets/lengths)
        raise FrontendError(
            f"cannot read the external data of ONNX model {shown!r} ({type(exc).__name__}: {exc}); "
            "the data file does not match the model: re-export both together"
        ) from exc


def _check_is_model(model: onnx.ModelProto, shown: str) -> None:
    """Protobuf parses many non-ONNX byte strings into an empty message: reject what has no graph."""
    if model.ir_version <= 0 or not model.opset_import or not model.HasField("graph") or not model.graph.output:
        raise FrontendError(
            f"{shown!r} is not an ONNX model (no IR version, opset imports or graph outputs); "
            "expected a serialized onnx.ModelProto such as torch.onnx.export writes"
        )


def read_model(
    source: str | os.PathLike | onnx.ModelProto, base_dir: str | os.PathLike | None = None
) -> tuple[onnx.ModelProto, str]:
    """Return ``(model, source name)``: a private copy with all tensor data in memory, and the file's base name.

    Args:
        source: path of a ``.onnx`` file or a ``ModelProto`` (never modified).
        base_dir: folder of external data files; default: the model file's folder. Needed for a ``ModelProto``
            whose tensors still point at external files.

    Raises:
        FrontendError: missing, unreadable, corrupt or non-ONNX input, or missing external data.
    """
    if isinstance(source, onnx.ModelProto):
        model = onnx.ModelProto()
        model.CopyFrom(source)
        _check_is_model(model, PROTO_SOURCE)
        if _external_tensors(model):
            if base_dir is None:
                raise FrontendError(
                    f"ONNX model {PROTO_SOURCE} refers to external data files but was given without their folder; "
                    "pass the .onnx path instead, or base_dir=<folder of the data files>"
                )
            _load_external(model, Path(base_dir), PROTO_SOURCE)
        return model, PROTO_SOURCE
    if not isinstance(source, (str, os.PathLike)):
        raise FrontendError(
            f"load_onnx expects a path or an onnx.ModelProto, got {type(source).__name__}"
        )
    path = Path(source)
    model = _read_path(path, str(source), Path(base_dir) if base_dir is not None else None)
    return model, path.name
