"""examples/export_all_backends.py runs in fast mode and writes every backend's files."""
from __future__ import annotations

import importlib.util
from pathlib import Path

from fxq.backends import EXPORTERS

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "export_all_backends.py"


def test_export_all_backends_fast(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("export_all_backends", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--fast", "--out", str(tmp_path)]) == 0
    names = {p.name for p in tmp_path.iterdir()}
    assert {"model_tensorrt.onnx", "model_onnxruntime.onnx", "model_openppl.onnx", "model_openppl.json"} <= names
    assert "ncnn" in EXPORTERS and any(n.startswith("model_ncnn") for n in names)
    out = capsys.readouterr().out
    assert "cosine" in out
