"""Exports write their files as one atomic set (fxq.io): a failure, a kill or a concurrent export never leaves a
mix of two exports; disk-full and file-size-limit errors are ExportErrors naming the file."""
from __future__ import annotations

import errno
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import fxq
import fxq.io
from fxq.backends.ncnn import ncnn_paths

from _export_helpers import SmallCNN, quantize_model

# (platform, exporter, options, stem): each writes several files
SETS = [("ncnn_int8", "ncnn", {}, "net"), ("trt_int8", "tensorrt", {"legacy": True}, "model.onnx"),
        ("ppl_cuda_int8", "openppl", {}, "model.onnx")]
IDS = [s[1] for s in SETS]
REPO = Path(fxq.__file__).resolve().parents[1]


def _model(platform: str, seed: int):
    torch.manual_seed(seed)
    return quantize_model(SmallCNN(), platform, shape=(2, 3, 16, 16), batches=2, seed=seed)


@pytest.fixture(scope="module")
def models():
    """Two different quantized models per platform."""
    return {p: (_model(p, 0), _model(p, 1)) for p, *_ in SETS}


def _contents(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def _export(gm, exporter: str, directory: Path, stem: str, options: dict) -> dict[str, bytes]:
    directory.mkdir(parents=True, exist_ok=True)
    fxq.export(gm, exporter, directory / stem, **options)
    return _contents(directory)


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return env


# ----------------------------------------------------------------------------------------------- io level
def test_file_set_writes_bytes_and_text_and_leaves_nothing_else(tmp_path):
    written = fxq.io.atomic_file_set({tmp_path / "a.bin": b"\x00\x01", tmp_path / "a.txt": "héllo\n"})
    assert written == [tmp_path / "a.bin", tmp_path / "a.txt"]
    assert _contents(tmp_path) == {"a.bin": b"\x00\x01", "a.txt": "héllo\n".encode()}
    fxq.io.atomic_file_set({tmp_path / "a.bin": b"new", tmp_path / "a.txt": "new"})
    assert _contents(tmp_path) == {"a.bin": b"new", "a.txt": b"new"}  # no lock, journal, backup or temp left


def test_file_set_members_share_one_folder(tmp_path):
    (tmp_path / "sub").mkdir()
    with pytest.raises(ValueError, match="one folder"):
        fxq.io.atomic_file_set({tmp_path / "a": b"", tmp_path / "sub" / "b": b""})


def test_failed_rename_rolls_the_set_back(tmp_path, monkeypatch):
    old = {"a": b"old a", "b": b"old b"}  # "c" is new: it must not survive the rollback
    fxq.io.atomic_file_set({tmp_path / k: v for k, v in old.items()})
    real_replace = os.replace
    renamed = []

    def replace(src, dst):
        if Path(dst).name in ("a", "b", "c"):
            renamed.append(Path(dst).name)
            if len(renamed) == 3:
                raise OSError(errno.EIO, "Input/output error")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(fxq.ExportError, match=r"cannot finish writing '.*c': Input/output error"):
        fxq.io.atomic_file_set({tmp_path / "a": b"new a", tmp_path / "b": b"new b", tmp_path / "c": b"new c"})
    assert renamed[:3] == ["a", "b", "c"]
    assert _contents(tmp_path) == old


def test_failed_rename_leaves_no_backup_of_members_not_renamed(tmp_path, monkeypatch):
    """Members the commit had not renamed yet are hard links of their backups: the rollback drops those too."""
    fxq.io.atomic_file_set({tmp_path / "a": b"old a", tmp_path / "b": b"old b"})
    real_replace = os.replace

    def replace(src, dst):
        if Path(dst).name == "b" and str(src).endswith(".fxq-tmp"):
            raise OSError(errno.EIO, "Input/output error")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(fxq.ExportError, match="Input/output error"):
        fxq.io.atomic_file_set({tmp_path / "a": b"new a", tmp_path / "b": b"new b"})
    assert _contents(tmp_path) == {"a": b"old a", "b": b"old b"}


def test_recovery_deletes_only_dead_writers_temps(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    stale = [tmp_path / f".net.bin.{dead_pid}.abc123{ext}" for ext in (".fxq-tmp", ".fxq-bak")]
    live = tmp_path / f".net.bin.{os.getpid()}.def456.fxq-tmp"  # a writer still at work: kept
    foreign = tmp_path / ".net.bin.notapid.fxq-tmp"
    for p in [*stale, live, foreign]:
        p.write_bytes(b"x")
    assert fxq.io.recover_file_sets(tmp_path) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, foreign.name])


# ----------------------------------------------------------------------------------------------- failures
@pytest.mark.parametrize("platform,exporter,options,stem", SETS, ids=IDS)
def test_disk_full_on_the_second_member_keeps_the_old_set(models, tmp_path, monkeypatch, platform, exporter, options,
                                                          stem):
    old = _export(models[platform][0], exporter, tmp_path, stem, options)
    assert len(old) >= 2
    real_write = fxq.io._write_data
    calls = []

    def write(tmp, data):
        calls.append(tmp)
        if len(calls) == 2:
            real_write(tmp, data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device", str(tmp))
        real_write(tmp, data)

    monkeypatch.setattr(fxq.io, "_write_data", write)
    with pytest.raises(fxq.ExportError) as info:
        fxq.export(models[platform][1], exporter, tmp_path / stem, **options)
    second = calls[1].name[1:].rsplit(".", 3)[0]  # ".<target>.<pid>.<random>.fxq-tmp"
    assert f"no space left on device while writing '{tmp_path / second}'; free space or choose another " \
           f"directory" in str(info.value)
    assert isinstance(info.value, fxq.FxqError)
    assert _contents(tmp_path) == old  # the whole old set, byte for byte, and no temp file


@pytest.mark.parametrize("platform,exporter,options,stem", SETS, ids=IDS)
def test_new_folder_is_created(models, tmp_path, platform, exporter, options, stem):
    got = _export(models[platform][0], exporter, tmp_path / "a" / "b", stem, options)
    assert len(got) >= 2 and not any(name.startswith(".") for name in got)


def test_save_disk_full_keeps_the_old_file(models, tmp_path, monkeypatch):
    target = tmp_path / "m.fxq"
    fxq.save(models["trt_int8"][0], target)
    old = target.read_bytes()

    def full_disk(obj, f, *args, **kwargs):  # torch.save streams into the temp file, then the disk fills up
        if hasattr(f, "write"):
            f.write(b"partial")
            f.flush()
        else:
            Path(f).write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(fxq.ExportError, match=r"no space left on device while writing '.*m\.fxq'; free space or "
                                              r"choose another directory"):
        fxq.save(models["trt_int8"][1], target)
    assert _contents(tmp_path) == {"m.fxq": old}


_FSIZE_CHILD = r"""
import json, resource, signal, sys
from pathlib import Path
import fxq

directory, limit = Path(sys.argv[1]), int(sys.argv[2])
models = {p: fxq.load(directory / "models" / f"{p}.fxq") for p in ("ncnn_int8", "trt_int8", "ppl_cuda_int8")}
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead of killing us
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
jobs = [("save", lambda: fxq.save(models["trt_int8"], directory / "save" / "m.fxq")),
        ("ncnn", lambda: fxq.export(models["ncnn_int8"], "ncnn", directory / "ncnn" / "net")),
        ("tensorrt", lambda: fxq.export(models["trt_int8"], "tensorrt", directory / "tensorrt" / "model.onnx",
                                        legacy=True)),
        ("openppl", lambda: fxq.export(models["ppl_cuda_int8"], "openppl", directory / "openppl" / "model.onnx"))]
out = {}
for name, job in jobs:
    try:
        job()
        out[name] = "no error"
    except fxq.FxqError as exc:
        out[name] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""


def test_file_size_limit_is_an_export_error(models, tmp_path):
    """A real ``ulimit -f`` in a subprocess: fxq.save (torch.save's C++ writer) and three multi-file exports."""
    (tmp_path / "models").mkdir()
    old = {}
    for platform, exporter, options, stem in SETS:
        fxq.save(models[platform][1], tmp_path / "models" / f"{platform}.fxq")
        old[exporter] = _export(models[platform][0], exporter, tmp_path / exporter, stem, options)
    (tmp_path / "save").mkdir()
    fxq.save(models["trt_int8"][0], tmp_path / "save" / "m.fxq")
    old["save"] = _contents(tmp_path / "save")
    limit = 2048
    assert all(max(len(v) for v in files.values()) > limit for files in old.values())
    proc = subprocess.run([sys.executable, "-c", _FSIZE_CHILD, str(tmp_path), str(limit)], capture_output=True,
                          text=True, env=_child_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    errors = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, message in errors.items():
        assert message.startswith("ExportError: file size limit exceeded while writing "), (name, message)
        assert "(ulimit -f / RLIMIT_FSIZE); raise the limit or choose another directory" in message
        assert f"{tmp_path / name}" in message, message  # names the file
        assert _contents(tmp_path / name) == old[name], name  # old file / set intact, no temp file


# ----------------------------------------------------------------------------------------------- SIGKILL
_KILL_CHILD = r"""
import sys, time
from pathlib import Path
import fxq, fxq.io

model, stem, marker, kill_at = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
gm = fxq.load(model)
seen = []

def hook(target):
    seen.append(target)
    if (kill_at == "last" and target is None) or (kill_at != "last" and len(seen) == int(kill_at) + 1):
        marker.write_text("ready")
        time.sleep(600)  # killed here

fxq.io._after_rename_hook = hook
fxq.export(gm, "ncnn", stem)
"""


@pytest.fixture(scope="module")
def ncnn_sets(models, tmp_path_factory):
    """The two ncnn models saved for children, and the file set each writes alone."""
    root = tmp_path_factory.mktemp("ncnn_sets")
    paths, sets = [], []
    for i, gm in enumerate(models["ncnn_int8"]):
        path = root / f"m{i}.fxq"
        fxq.save(gm, path)
        paths.append(path)
        sets.append(_export(fxq.load(path), "ncnn", root / f"alone{i}", "net", {}))
    assert set(sets[0]) == set(sets[1]) and sets[0]["net.bin"] != sets[1]["net.bin"]
    return paths, sets


def _kill_mid_commit(tmp_path: Path, model: Path, kill_at: str) -> None:
    marker = tmp_path.parent / f"{tmp_path.name}.marker"
    proc = subprocess.Popen([sys.executable, "-c", _KILL_CHILD, str(model), str(tmp_path / "net"), str(marker),
                             kill_at], env=_child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 240
    while not marker.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"child never reached the kill point: {proc.communicate()[1][-3000:]!r}")
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL


@pytest.mark.parametrize("kill_at", ["0", "1", "3", "last"],
                         ids=["before-first-rename", "after-first-rename", "after-third-rename", "after-last-rename"])
@pytest.mark.parametrize("recovery", ["recover_file_sets", "next_export"])
def test_sigkill_between_renames(ncnn_sets, tmp_path, kill_at, recovery):
    (model_a, model_b), (set_a, set_b) = ncnn_sets
    fxq.export(fxq.load(model_a), "ncnn", tmp_path / "net")
    assert _contents(tmp_path) == set_a
    _kill_mid_commit(tmp_path, model_b, kill_at)
    members = {name: data for name, data in _contents(tmp_path).items() if not name.startswith(".")}
    journals = [p for p in tmp_path.iterdir() if p.name.endswith(".fxq-journal")]
    assert len(journals) == 1  # the interrupted commit is marked
    order = [p.name for p in ncnn_paths("net").values()]  # the order the exporter renames them in
    renamed = len(order) if kill_at == "last" else int(kill_at)
    # the reader's view before recovery: the first members new, the rest old
    assert [members[k] for k in order] == [set_b[k] for k in order[:renamed]] + [set_a[k] for k in order[renamed:]]
    if recovery == "recover_file_sets":
        assert fxq.io.recover_file_sets(tmp_path) == 1
        assert _contents(tmp_path) == set_a  # the complete old set; temps, backups, journal and lock gone
        assert fxq.io.recover_file_sets(tmp_path) == 0
    else:
        fxq.export(fxq.load(model_b), "ncnn", tmp_path / "net")
        assert _contents(tmp_path) == set_b


# ----------------------------------------------------------------------------------------------- concurrency
def _export_rounds(model: str, stem: str, rounds: int, barrier, pace: list[float]) -> None:
    import fxq
    import fxq.io

    calls = []

    def hook(target):  # pace[i] seconds before the i-th rename: without the lock the two processes' renames cross
        calls.append(target)
        time.sleep(pace[(len(calls) - 1) % len(pace)])

    fxq.io._after_rename_hook = hook
    try:
        gm = fxq.load(model)
        for _ in range(rounds):
            barrier.wait(timeout=240)  # start together
            fxq.export(gm, "ncnn", stem)
            barrier.wait(timeout=240)  # the parent checks the set
    except BaseException:
        barrier.abort()  # nobody waits for a dead worker
        raise


def test_concurrent_exports_leave_one_complete_set(ncnn_sets, tmp_path):
    (model_a, model_b), (set_a, set_b) = ncnn_sets
    rounds = 4
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(3)
    n = len(set_a) + 1  # hook calls per export: one before each rename, one after the last
    paces = ([0.15] + [0.0] * (n - 1), [0.0] + [0.06] * (n - 2) + [0.0])  # one renames late, one slowly
    procs = [ctx.Process(target=_export_rounds, args=(str(m), str(tmp_path / "net"), rounds, barrier, pace))
             for m, pace in zip((model_a, model_b), paces)]
    for p in procs:
        p.start()
    winners = []
    try:
        for _ in range(rounds):
            barrier.wait(timeout=240)
            barrier.wait(timeout=240)
            got = _contents(tmp_path)
            assert got in (set_a, set_b), {k: (v == set_a.get(k), v == set_b.get(k)) for k, v in got.items()}
            winners.append("a" if got == set_a else "b")
    except BaseException:
        barrier.abort()
        raise
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0, 0]
    assert sorted(_contents(tmp_path)) == sorted(ncnn_paths("net")[k].name for k in ncnn_paths("net"))


@pytest.mark.parametrize("platform,exporter,options,stem", SETS, ids=IDS)
def test_dotted_model_name_gets_its_extension(models, tmp_path, platform, exporter, options, stem):
    """A model named like PaddleOCR's ``ch_ppocr_mobile_v2.0_cls_infer`` (the CLI's stem ``<model>_<platform>``):
    ``.0_cls_infer_trt_int8`` is not an extension, so every file still gets its own (it was written without)."""
    got = _export(models[platform][0], exporter, tmp_path, "ocr_v2.0_cls_" + platform, options)
    main = {"ncnn": ".param", "tensorrt": ".onnx", "openppl": ".onnx"}[exporter]
    assert f"ocr_v2.0_cls_{platform}{main}" in got
    assert all(Path(name).suffix in {".param", ".bin", ".table", ".onnx", ".json", ".cache"} for name in got), got
