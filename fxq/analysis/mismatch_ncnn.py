"""Where an exported ncnn int8 file and fxq's simulation part ways, blob by blob, in integer codes.

ncnn's int8 layers quantize their inputs themselves, so its blobs carry float values; each blob whose value the
simulation quantizes is read back from the ncnn runtime and put on that quantizer's grid, and those codes are
compared with the simulation's codes of the same tensor (the :class:`~fxq.analysis.mismatch.MismatchReport` of
the ONNX files, one sample at a time as ncnn runs).

The blob of each tensor is known by exporting the model again in memory (the export is deterministic); a file
whose layers (types, names, blobs; parameters may differ) are not those of the model is refused.

* free-running: the runtime computes every blob from its own upstream values (mismatches propagate);
* teacher-forced: the blob compared is computed with every other compared blob set to the simulation's value, so
  only local mismatches remain.
"""
from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import fx

from fxq.errors import ConfigError, FrontendError, one_line

__all__ = ["locate_ncnn_mismatch"]

logger = logging.getLogger(__name__)


def _layers(text: str, source: str) -> list[tuple[str, ...]]:
    """The ``.param`` text's layers as (type, name, bottoms..., tops..., int8 or not), their other parameters left
    out (the FP32 file has the int8 file's layers without the int8 term ``8=``)."""
    lines = text.splitlines()
    if not lines or lines[0].strip() != "7767517":
        raise FrontendError(f"{source!r} is not an ncnn .param file (its first line is not the magic 7767517)")
    layers = []
    for line in lines[2:]:
        fields = line.split()
        if len(fields) < 4 or not fields[2].isdigit() or not fields[3].isdigit():
            continue
        n = 4 + int(fields[2]) + int(fields[3])
        layers.append((*fields[:n], "int8" if any(f.startswith("8=") for f in fields[n:]) else "fp32"))
    return layers


def ncnn_mat(array: np.ndarray) -> Any:
    """An ``ncnn.Mat`` that owns a copy of ``array``. ``ncnn.Mat(array)`` only borrows the buffer, so the array
    must stay alive until the copy: ``ncnn.Mat(np.ascontiguousarray(view)).clone()`` copies the temporary after it
    was freed when ``view`` is not contiguous (a transposed tensor), and the allocator has by then overwritten its
    first bytes."""
    import ncnn

    array = np.ascontiguousarray(array)
    return ncnn.Mat(array).clone()


def _bin_path(param: Path) -> Path:
    return param.with_name(re.sub(r"\.param$", ".bin", param.name, flags=re.I))


def locate_ncnn_mismatch(qmodel: fx.GraphModule, param: Path, data: Any, *, teacher_forced: bool,
                         steps: int | None, collate_fn: Callable[[Any], Any] | None,
                         example_inputs: Any = None) -> Any:
    """:func:`fxq.locate_mismatch` for an ncnn int8 ``.param`` (its ``.bin`` beside it); see there.
    ``example_inputs``: those the file was exported with (its FP32 islands' traced branches)."""
    try:
        import ncnn
    except ImportError as exc:
        raise ConfigError("comparing an ncnn file needs the ncnn package: pip install ncnn") from exc
    from fxq.analysis.engine import iter_bound_batches
    from fxq.analysis.mismatch import (
        MismatchReport,
        Samples,
        TensorMismatch,
        batch_size,
        gives_codes,
        prepared_batch,
        runnable_batch,
        simulation_values,
    )
    from fxq.analysis.runner import GraphRunner
    from fxq.backends.ncnn.builder import build_ncnn_model
    from fxq.backends.ncnn.islands import MODEL_NODE
    from fxq.functional import quantize_to_int

    if not param.is_file() or not _bin_path(param).is_file():
        raise FrontendError(f"ncnn files {str(param)!r} and its .bin not found")
    try:
        in_file = _layers(param.read_text(), str(param))
    except (OSError, UnicodeDecodeError) as exc:
        raise FrontendError(f"ncnn file {str(param)!r} cannot be read: {exc}") from exc
    model, builder = build_ncnn_model(qmodel, example_inputs)
    view = builder.gm
    ours = _layers(model.to_param(int8=True), "the model's export")
    if ours != in_file:
        if [layer[:-1] for layer in ours] == [layer[:-1] for layer in in_file]:
            raise ConfigError(f"{str(param)!r} is the FP32 file of this model's export; compare the int8 .param "
                              "(the one without .fp32)")
        first = next((f"layer {k}: {' '.join(a)} in the file, {' '.join(b)} from the model"
                      for k, (a, b) in enumerate(zip(in_file, ours)) if a != b),
                     f"{len(in_file)} layers in the file, {len(ours)} from the model")
        raise ConfigError(f"{str(param)!r} was not exported from this model ({first}): export it again with "
                          "fxq.export(model, 'ncnn', ...) and compare that file (a file exported with "
                          "example_inputs=... needs the same example_inputs here: its FP32 islands follow them)")
    placeholders = [n for n in view.graph.nodes if n.op == "placeholder"]
    inputs_blob = {p: builder.blob_of[p] for p in placeholders if p in builder.blob_of}

    # the compared tensors: values with a blob that the simulation quantizes, in graph order; the simulation is
    # the model's own (the export's view traces FP32 islands on one example and fuses ops: its nodes keep the
    # model's names, and a value the model does not have by that name is not compared)
    in_model = {n.name for n in qmodel.graph.nodes}
    compared: list[tuple[fx.Node, Any, str, str]] = []  # (view node, quantizer, blob, the model's node name)
    unmatched_names: list[str] = []
    for node in view.graph.nodes:
        if node.op == "output" or builder.is_quantizer(node) or node not in builder.blob_of:
            continue
        fq = next((view.get_submodule(str(u.target)) for u in node.users if builder.is_quantizer(u)
                   and gives_codes(view.get_submodule(str(u.target)))), None)
        own = str(node.meta.get(MODEL_NODE, node.name))  # an island's result, a fused op: the model's node
        if fq is not None:
            if own in in_model:
                compared.append((node, fq, builder.blob_of[node], own))
            else:
                unmatched_names.append(node.name)
    records = [TensorMismatch(own, builder.op(n), own) for n, _, _, own in compared]
    view_input = {p.name: p for p in inputs_blob}  # the model's placeholders by name -> the view's

    net = ncnn.Net()
    opt = net.opt
    opt.use_vulkan_compute = False
    opt.num_threads = max(1, torch.get_num_threads())
    opt.use_int8_inference = True
    opt.use_fp16_storage = opt.use_fp16_packed = opt.use_fp16_arithmetic = opt.use_bf16_storage = False
    if net.load_param(str(param)) != 0 or net.load_model(str(_bin_path(param))) != 0:
        raise FrontendError(f"ncnn cannot load {str(param)!r} and its .bin")

    def mat(value: torch.Tensor, node: fx.Node) -> Any:
        return ncnn_mat(value.detach().float().cpu().numpy().reshape(builder.stored_shape(node)))

    runner = GraphRunner(qmodel)
    samples = Samples(iter_bound_batches(runner, data, steps, collate_fn, progress=False, desc=""))
    names = {own for *_, own in compared}
    training = qmodel.training
    qmodel.eval()
    try:
        # ncnn has no batch: one sample at a time, simulated alone where the model runs one sample; a graph with
        # its batch size baked in (x.view(2, -1)) is simulated at that batch, each sample compared on its own
        size, _, values, _ = (runnable_batch(qmodel, samples, [None], names) if builder.unbatched_inputs else
                              runnable_batch(qmodel, samples, [1, prepared_batch(qmodel)], names))
        if size > 1 and not builder.unbatched_inputs:
            logger.info("ncnn comparison: the model does not run one sample alone (a batch size baked into it); "
                        "it is simulated on batches of %d, each sample compared with ncnn's", size)
        regroup = size if size == 1 or size == prepared_batch(qmodel) else None
        for chunk in samples.batches(None if builder.unbatched_inputs else regroup):
            values = values if values is not None else simulation_values(qmodel, chunk, names)
            count = None if builder.unbatched_inputs else batch_size(chunk)
            if count and count > 1:  # a value that does not hold the samples apart has no per-sample blob
                keep = [_splits(values[own], builder.batch_dim(n), count) for n, _, _, own in compared]
                for (_, _, _, own), kept in zip(compared, keep):
                    if not kept:
                        logger.info("ncnn comparison: %s has no dim of the %d samples it was simulated with; not "
                                    "compared", own, count)
                        unmatched_names.append(own)
                compared = [c for c, kept in zip(compared, keep) if kept]
                records = [r for r, kept in zip(records, keep) if kept]
            for i in range(count or 1):
                sample = {p: _pick(v, builder.batch_dim(view_input[p.name]) if p.name in view_input else 0, i,
                                   count) for p, v in chunk.items()}
                sample_values = {own: _pick(values[own], builder.batch_dim(n), i, count)
                                 for n, _, _, own in compared}
                fed = ({blob: mat(sample_values[own], n) for n, _, blob, own in compared} if teacher_forced else {})
                ex = None
                for (node, fq, blob, own), rec in zip(compared, records):
                    if ex is None or teacher_forced:  # free-running: one extractor keeps what it computed
                        ex = net.create_extractor()
                        for q, value in sample.items():
                            p = view_input.get(q.name)
                            if p is not None:
                                ex.input(inputs_blob[p], mat(value, p))
                        for other, value in fed.items() if teacher_forced else ():
                            if other != blob:
                                ex.input(other, value)
                    ret, out = ex.extract(blob)
                    if ret != 0:
                        raise FrontendError(f"ncnn failed computing blob {blob!r} (node {node.name!r}): code {ret}")
                    sim = sample_values[own]
                    got = torch.from_numpy(np.array(out).copy())
                    if got.numel() != sim.numel():
                        raise ConfigError(f"blob {blob!r} (node {node.name!r}): ncnn gives {list(got.shape)}, the "
                                          f"simulation {list(sim.shape)}")
                    ours = quantize_to_int(sim.float(), fq.config).numpy().astype(np.int64)
                    theirs = quantize_to_int(got.reshape(sim.shape), fq.config).numpy().astype(np.int64)
                    rec.add(theirs - ours)
            values = None
    except FrontendError:
        raise
    except RuntimeError as exc:
        raise FrontendError(f"ncnn comparison failed: {one_line(exc)}") from exc
    finally:
        qmodel.train(training)
    return MismatchReport(records, mode="teacher-forced" if teacher_forced else "free-running", optimize=False,
                          batches=samples.read, unmatched=unmatched_names, runtime="ncnn int8")


def _splits(value: torch.Tensor, batch_dim: int | None, count: int) -> bool:
    """Whether ``value``, simulated for ``count`` samples, holds them along ``batch_dim`` (one per ncnn run)."""
    return batch_dim is not None and value.dim() > batch_dim and int(value.shape[batch_dim]) == count


def _pick(value: Any, batch_dim: int | None, index: int, count: int | None) -> Any:
    """Sample ``index`` of a value simulated for ``count`` samples (None: a whole batch, the inputs unbatched), as
    ncnn's blob holds it: without its batch dim; the whole value where it has none."""
    if not isinstance(value, torch.Tensor):
        return value
    if count is not None and _splits(value, batch_dim, count):
        return value.select(batch_dim, index)
    return _unbatch(value, batch_dim)


def _unbatch(value: torch.Tensor, batch_dim: int | None) -> torch.Tensor:
    """A batch-1 value without its batch dim (ncnn's blob), or the whole value where it has none."""
    return value if batch_dim is None else value.squeeze(batch_dim) if value.dim() > batch_dim else value
