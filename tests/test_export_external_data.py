"""ONNX exports over protobuf's 2 GiB limit write external data (``model.onnx`` + ``model.onnx.data``).

The threshold (:data:`fxq.onnx_data.EXTERNAL_DATA_THRESHOLD`) is forced to a few bytes so a small CNN takes the
path a >2 GiB model takes: torch.onnx into a temp folder, shape inference / checker / version converter on copies
without weights, onnxruntime from memory, and the two files written as one atomic set.
"""
from __future__ import annotations

import errno
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

import fxq
import fxq.io
from fxq import onnx_data
from fxq.backends.tensorrt.check import check_tensorrt

from _export_helpers import SmallCNN, end_to_end, ort_session, quantize_model, run_ort, segment_check

# (platform, exporter, options): every ONNX-writing exporter; TensorRT's legacy set has a second .onnx
CASES = [("trt_int8", "tensorrt", {}), ("trt_int8", "tensorrt", {"legacy": True}),
         ("trt_int8", "tensorrt", {"weights": "dq", "opset": 19}),  # through onnx's version converter
         ("ort_int8", "onnxruntime", {}), ("ppl_cuda_int8", "openppl", {})]
IDS = ["tensorrt", "tensorrt-legacy", "tensorrt-dq-opset19", "onnxruntime", "openppl"]
TINY = 4096  # bytes: every export of the test model is larger


def _quantized(platform: str, seed: int = 0):
    torch.manual_seed(seed)  # 256 classes: the Linear's int8 weight (2 KiB) goes external in "dq" exports too
    return quantize_model(SmallCNN(classes=256), platform, shape=(2, 3, 16, 16), batches=2, seed=seed)


@pytest.fixture(scope="module")
def models():
    return {p: (_quantized(p, 0), _quantized(p, 1)) for p in ("trt_int8", "ort_int8", "ppl_cuda_int8")}


@pytest.fixture
def tiny(monkeypatch):
    monkeypatch.setattr(onnx_data, "EXTERNAL_DATA_THRESHOLD", TINY)


def _contents(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def _onnx_members(written: list[Path]) -> list[Path]:
    return [p for p in written if p.suffix == ".onnx"]


@pytest.mark.parametrize("platform,exporter,options", CASES + [("trt_int8", "tensorrt", {"high_precision_dtype": "fp16"})],
                         ids=IDS + ["tensorrt-fp16"])  # FP16: onnx's full check on the copy without weights
def test_large_export_writes_onnx_and_data(models, tmp_path, monkeypatch, platform, exporter, options):
    """Each .onnx of the set gets its <name>.onnx.data; the .onnx alone is small, refers to the data by a
    relative location, and loads (onnx.load) into the same model as the inline export."""
    gm = models[platform][0]
    inline = fxq.export(gm, exporter, tmp_path / "inline" / "model.onnx", **options)
    monkeypatch.setattr(onnx_data, "EXTERNAL_DATA_THRESHOLD", TINY)
    written = fxq.export(gm, exporter, tmp_path / "ext" / "model.onnx", **options)
    names = sorted(p.name for p in written)
    assert names == sorted([p.name for p in inline] + [p.name + ".data" for p in _onnx_members(inline)])
    assert sorted(_contents(tmp_path / "ext")) == names  # nothing else: no temp, lock or journal
    for main in _onnx_members(written):
        data = main.with_name(main.name + ".data")
        lazy = onnx.load(str(main), load_external_data=False)
        external = [t for t in lazy.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
        assert external and {e.value for t in external for e in t.external_data if e.key == "location"} == {data.name}
        moved = sum(int(e.value) for t in external for e in t.external_data if e.key == "length")
        assert moved >= 4096 and data.stat().st_size >= moved
        assert main.stat().st_size < (tmp_path / "inline" / main.name).stat().st_size - moved // 2
        same = onnx.load(str(tmp_path / "inline" / main.name))
        loaded = onnx.load(str(main))
        for t in loaded.graph.initializer:
            t.ClearField("data_location")  # onnx.load leaves it set to DEFAULT
        assert loaded.SerializeToString() == same.SerializeToString()
        onnx.checker.check_model(str(main), full_check=True)  # the checker reads the pair from disk
    if exporter == "tensorrt":
        assert check_tensorrt(written[0]) == []


@pytest.mark.parametrize("platform,exporter,options", CASES, ids=IDS)
def test_onnxruntime_runs_the_large_export(models, tmp_path, tiny, platform, exporter, options):
    """onnxruntime (default session and ORT_DISABLE_ALL) runs the pair from its path and from a ModelProto over
    the threshold (weights handed over in memory), as close to fxq's simulation as the existing export tests
    require; the Q/DQ files reproduce every activation code teacher-forced (fxq.locate_mismatch)."""
    gm = models[platform][0]
    main = fxq.export(gm, exporter, tmp_path / "model.onnx", **options)[0]
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = gm(x)
    proto = onnx.load(str(main))
    assert onnx_data.too_large(proto)
    for optimize in (False, True):
        got = run_ort(main, x, optimize)
        np.testing.assert_array_equal(got, run_ort(proto, x, optimize))
        if exporter != "openppl":  # the FP32 graph does not quantize activations
            assert end_to_end(ref, got, None).cosine >= 0.9995, optimize
    if exporter != "openppl":
        stats = segment_check(proto, gm, (x,), optimize=False)
        assert stats.tensors >= 5 and stats.exact == 1.0, stats


def test_load_onnx_round_trip(models, tmp_path, tiny):
    """export (external data) -> fxq.load_onnx -> the same outputs as onnxruntime on that file."""
    main = fxq.export(models["ppl_cuda_int8"][0], "openppl", tmp_path / "model.onnx")[0]
    assert main.with_name("model.onnx.data").is_file()
    gm = fxq.load_onnx(main)
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        ours = gm(x).numpy()
    sess = ort_session(main, optimize=False)
    np.testing.assert_allclose(ours, sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0], rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("platform,exporter,options", CASES[:2] + CASES[3:], ids=IDS[:2] + IDS[3:])
def test_failed_data_write_keeps_the_old_set(models, tmp_path, tiny, monkeypatch, platform, exporter, options):
    """Disk full while writing a .onnx.data: the ExportError names it, and the folder holds the old set, byte
    for byte, with no new file and no temp."""
    fxq.export(models[platform][0], exporter, tmp_path / "model.onnx", **options)
    old = _contents(tmp_path)
    real_write = fxq.io._write_data

    def write(tmp, data):
        if ".onnx.data." in tmp.name:
            real_write(tmp, data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device", str(tmp))
        real_write(tmp, data)

    monkeypatch.setattr(fxq.io, "_write_data", write)
    with pytest.raises(fxq.ExportError, match=r"no space left on device while writing '.*model\.onnx\.data'"):
        fxq.export(models[platform][1], exporter, tmp_path / "model.onnx", **options)
    assert _contents(tmp_path) == old


def test_failed_rename_of_the_data_file_rolls_back(models, tmp_path, tiny, monkeypatch):
    """A failure between the renames of the .onnx and its .onnx.data (the commit) restores the old pair."""
    import os

    gm_a, gm_b = models["trt_int8"]
    fxq.export(gm_a, "tensorrt", tmp_path / "model.onnx")
    old = _contents(tmp_path)
    real_replace = os.replace

    def replace(src, dst):
        if Path(dst).name == "model.onnx.data" and str(src).endswith(".fxq-tmp"):  # the commit, not the rollback
            raise OSError(errno.EIO, "Input/output error")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(fxq.ExportError, match="model.onnx.data"):
        fxq.export(gm_b, "tensorrt", tmp_path / "model.onnx")
    monkeypatch.setattr(os, "replace", real_replace)
    assert _contents(tmp_path) == old


@pytest.mark.parametrize("platform,exporter,options", CASES[:2] + CASES[3:], ids=IDS[:2] + IDS[3:])
def test_reexport_replaces_both_files(models, tmp_path, tiny, platform, exporter, options):
    """Exporting another model to the same path replaces the .onnx and its .onnx.data together."""
    first = _contents(_export_dir(models[platform][0], exporter, tmp_path / "a", options))
    second = _contents(_export_dir(models[platform][1], exporter, tmp_path / "b", options))
    target = tmp_path / "a"
    fxq.export(models[platform][1], exporter, target / "model.onnx", **options)
    now = _contents(target)
    assert now == second
    assert all(now[name] != first[name] for name in now if name.endswith((".onnx", ".onnx.data")))


def _export_dir(gm, exporter: str, directory: Path, options: dict) -> Path:
    fxq.export(gm, exporter, directory / "model.onnx", **options)
    return directory


def test_small_model_stays_one_file(models, tmp_path):
    """Under the threshold nothing changes: one .onnx, no data file, no external tensor."""
    written = fxq.export(models["ort_int8"][0], "onnxruntime", tmp_path / "model.onnx")
    assert [p.name for p in written] == ["model.onnx"]
    proto = onnx.load(str(written[0]), load_external_data=False)
    assert not any(t.data_location == onnx.TensorProto.EXTERNAL for t in proto.graph.initializer)


@pytest.mark.parametrize("platform,exporter,options", CASES[:2] + CASES[3:], ids=IDS[:2] + IDS[3:])
def test_small_export_over_a_large_one_deletes_its_data(models, tmp_path, monkeypatch, platform, exporter, options):
    """A model under the threshold written where a large export was: the stale .onnx.data files go in the same
    set, so the folder holds exactly what an export into an empty folder gives."""
    gm = models[platform][0]
    fresh = _contents(_export_dir(gm, exporter, tmp_path / "fresh", options))
    monkeypatch.setattr(onnx_data, "EXTERNAL_DATA_THRESHOLD", TINY)
    fxq.export(gm, exporter, tmp_path / "out" / "model.onnx", **options)
    assert any(name.endswith(".onnx.data") for name in _contents(tmp_path / "out"))
    monkeypatch.undo()
    written = fxq.export(gm, exporter, tmp_path / "out" / "model.onnx", **options)
    assert sorted(p.name for p in written) == sorted(fresh)
    assert _contents(tmp_path / "out") == fresh


def test_failed_small_export_keeps_the_large_set(models, tmp_path, monkeypatch):
    """The deletion of the stale .onnx.data is rolled back with the rest when the commit fails."""
    import os

    gm = models["trt_int8"][0]
    monkeypatch.setattr(onnx_data, "EXTERNAL_DATA_THRESHOLD", TINY)
    fxq.export(gm, "tensorrt", tmp_path / "model.onnx")
    old = _contents(tmp_path)
    monkeypatch.setattr(onnx_data, "EXTERNAL_DATA_THRESHOLD", onnx_data.PROTO_LIMIT)
    calls = []

    def hook(target):  # after the .onnx is renamed and the data file deleted: fail
        calls.append(target)
        if target is None:
            raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(fxq.io, "_after_rename_hook", hook)
    with pytest.raises(fxq.ExportError, match="Input/output error"):
        fxq.export(models["trt_int8"][1], "tensorrt", tmp_path / "model.onnx")
    assert [c.name for c in calls[:-1]] == ["model.onnx", "model.onnx.data"]
    assert _contents(tmp_path) == old
    assert not any(name.startswith(".") for name in os.listdir(tmp_path))


@pytest.mark.parametrize("platform,exporter,options", CASES, ids=IDS)
def test_proto_size_is_bytesize_without_serializing(models, tmp_path, platform, exporter, options):
    """The size test counts raw initializers from dims and types: never under protobuf's ByteSize, and over it
    by less than 64 bytes a tensor (the threshold leaves 64 MiB below the limit)."""
    proto = onnx.load(str(fxq.export(models[platform][0], exporter, tmp_path / "model.onnx", **options)[0]))
    extra = onnx_data.proto_size(proto) - proto.ByteSize()
    assert 0 <= extra <= 64 * len(proto.graph.initializer)


def test_light_check_still_checks_the_weights_sizes(monkeypatch):
    """Models over LIGHT_CHECK_BYTES are checked without serializing their weights; a weight whose bytes do not
    fit its dims is still an error, a sound one passes."""
    from onnx import helper, numpy_helper

    monkeypatch.setattr(onnx_data, "LIGHT_CHECK_BYTES", 0)
    w = numpy_helper.from_array(np.ones((64, 128), np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 64])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 128])], initializer=[w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx_data.check_model(model)
    model.graph.initializer[0].raw_data = model.graph.initializer[0].raw_data[:-4]
    with pytest.raises(onnx.checker.ValidationError, match="'w': 32764 raw bytes"):
        onnx_data.check_model(model)
