"""Quantize a model in parts when no capture path reaches the whole of it.

Detectors are the common case: torchvision's Faster R-CNN loops over the images in its root ``forward`` and its
postprocessing runs NMS under data-dependent size checks, so neither symbolic tracing nor ``torch.export``
captures the model, and an FP32 island cannot help when the failing code is the root's own. Their compute is in
submodules that do capture: the backbone, the RPN head, the box head and predictor. :func:`quantize_in_parts`
finds the largest such submodules (top-down: a submodule that captures is a part; one that does not is searched
inside), records the inputs the float model gives each part on the calibration data, quantizes every part with
those inputs, and returns a copy of the model whose parts are quantized ``GraphModule``\\ s. The rest (the root's
forward, pre- and postprocessing, modules with no parameters) runs as the model's own Python in float.

Each part is calibrated on the float model's values (its inputs are not affected by the quantization of the
parts before it). :func:`quantized_parts` lists the parts of such a model; ``fxq.export`` writes one file set per
part, named ``<stem>_<part path>``, as one atomic set.
"""
from __future__ import annotations

import copy
import inspect
import logging
import operator
import os
from pathlib import Path
from typing import Any, Callable

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from fxq.errors import ExportError, TraceError
from fxq.graph.capture import capture as capture_graph
from fxq.graph.data import iter_batches, to_call_args
from fxq.graph.info import QUANTIZERS_ATTR

__all__ = ["quantize_in_parts", "quantized_parts", "render_parts", "part_inputs", "part_file_stem", "flat_inputs",
           "record_inputs", "PART_KEY"]

logger = logging.getLogger(__name__)

PART_KEY = "fxq_part"
"""``gm.meta[PART_KEY]``: the module path of a part quantized by :func:`quantize_in_parts`."""
_DYNAMIC_DIMS = "fxq_part_dynamic_dims"  # {flat input name: [dims whose size varied between calls]}


def quantize_in_parts(model: nn.Module, calib_data: Any, failure: TraceError,
                      quantize_part: Callable[[fx.GraphModule, list], fx.GraphModule], *,
                      steps: int | None = None, collate_fn: Callable[[Any], Any] | None = None) -> nn.Module:
    """A copy of ``model`` (eval mode) whose largest capturable submodules are quantized by ``quantize_part``.

    Args:
        model: the float model no capture path reached whole.
        calib_data, steps, collate_fn: as :func:`fxq.quantize`; the float model runs on them once to find the
            parts (first batch) and once to record their inputs.
        failure: why the whole model was not captured; raised again when no part captures.
        quantize_part: ``(captured part, [its calibration batches]) -> quantized GraphModule``.

    Raises:
        TraceError: ``failure``, when no submodule with parameters captures on its own.
    """
    float_model = copy.deepcopy(model).eval()
    first = next(iter(iter_batches(calib_data, 1, collate_fn)))
    parts = _find_parts(float_model, first)
    if not parts:
        raise failure
    calls = record_inputs(float_model, list(parts), calib_data, steps, collate_fn)
    result = float_model  # the parts were captured as copies: the float copy itself takes them
    done, unused = [], []
    for path, gm in parts.items():
        if not calls[path]:
            unused.append(path)
            continue
        qpart = quantize_part(gm, calls[path])
        qpart.meta[PART_KEY] = path
        result.set_submodule(path, qpart)
    # sizes set by data (proposals kept after NMS) change once the parts upstream are quantized: what varies
    # between the float calls and the quantized model's own calls on the first batch is a dynamic dim
    again = record_inputs(result, list(quantized_parts(result)), [first], 1, None)
    for path, part in quantized_parts(result).items():
        part.meta[_DYNAMIC_DIMS] = _varying_dims(part, calls[path] + again[path])
        how = parts[path].meta.get("fxq_capture", "fx")
        done.append(f"{path} ({how}, {len(getattr(part, QUANTIZERS_ATTR))} quantizers)")
    if not done:
        raise failure
    float_params = _float_parameters(result)
    logger.warning(
        "no capture path reaches %s whole (%s); quantized its parts %s. The rest runs in float as the model's own Python%s. "
        "fxq.export writes one file set per part", type(model).__name__, _first_line(failure), ", ".join(done),
        f"; float parameters outside the parts: {', '.join(float_params)}" if float_params else "")
    if unused:
        logger.warning("parts %s did not run on the calibration data and stay float", unused)
    return result


def quantized_parts(model: nn.Module) -> dict[str, fx.GraphModule]:
    """``{module path: quantized part}`` for a model from :func:`quantize_in_parts` (empty for any other)."""
    return {name: m for name, m in model.named_modules()
            if isinstance(m, fx.GraphModule) and name and m.meta.get(PART_KEY) == name}


def part_inputs(model: nn.Module, batch: Any) -> dict[str, dict[str, torch.Tensor]]:
    """``{part path: {input name of its exported file: tensor}}``: what ``model`` (quantized in parts) gives each
    part on one batch (its first call), named as the exported files name their inputs (``feats_0``...), to run
    the deployed files side by side with the simulation."""
    calls = record_inputs(model, list(quantized_parts(model)), [batch], 1, None, keep=1)
    named = {}
    for path, batches in calls.items():
        if batches:
            part = model.get_submodule(path)
            leaves = _leaves_by_name(part, batches[0])
            named[path] = {ph.name: leaves[str(ph.target)]
                           for ph in flat_inputs(part).graph.nodes if ph.op == "placeholder"}
    return named


def part_file_stem(stem: str, part_path: str) -> str:
    """The stem of one part's files: ``<stem>_<part path>`` with dots as ``_`` (``det`` + ``rpn.head`` ->
    ``det_rpn_head``)."""
    return f"{stem}_{part_path.replace('.', '_')}"


def render_parts(model: nn.Module, path: str | os.PathLike,
                 render_one: Callable[[fx.GraphModule, Path], dict[Path, Any]]) -> dict[Path, Any]:
    """Every part of ``model`` rendered by ``render_one(part, path)`` (an exporter's ``render_files``) as
    ``<stem>_<part path>`` (dots as ``_``, the extension of ``path`` kept): one ``{path: content}`` for all parts,
    written by the caller as one set (old set or new set)."""
    target = Path(path)
    if target.is_dir():
        raise ExportError(f"export path {str(target)!r} is a folder; give a file path or stem inside it")
    stem = target.with_suffix("") if target.suffix else target
    files: dict[Path, Any] = {}
    for part_path, part in quantized_parts(model).items():
        name = part_file_stem(stem.name, part_path) + target.suffix  # model.onnx -> model_rpn_head.onnx
        for file, content in render_one(flat_inputs(part), stem.parent / name).items():
            if Path(file) in files:
                raise ExportError(f"parts export: two parts write {str(file)!r}; export to another stem")
            files[Path(file)] = content
    return files


def flat_inputs(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` over the same modules with one tensor input per leaf of a container input (``feats`` read as
    ``feats[0]``, ``feats[1]`` becomes ``feats_0``, ``feats_1``) and its varying input dims declared dynamic:
    deployed files take tensors."""
    def is_key_read(user: fx.Node) -> bool:
        return (user.op == "call_function" and user.target is operator.getitem and len(user.args) == 2
                and isinstance(user.args[1], (int, str)))

    def flatten(node: fx.Node, name: str) -> None:
        if node.users and all(is_key_read(u) for u in node.users):
            for user in list(node.users):
                flatten(user, f"{name}_{user.args[1]}")
        elif node.op != "placeholder":
            with graph.inserting_before(first):
                leaf = graph.placeholder(name)
            leaf.meta.update(node.meta)
            node.replace_all_uses_with(leaf)
        if node.op != "placeholder" or not node.users:
            graph.erase_node(node)

    nested = any(n.op == "placeholder" and n.users and all(is_key_read(u) for u in n.users) for n in gm.graph.nodes)
    if not nested and not gm.meta.get(_DYNAMIC_DIMS):
        return gm
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    for ph in [n for n in graph.nodes if n.op == "placeholder"]:
        first = ph
        flatten(ph, str(ph.target))
    flat = fx.GraphModule(gm, graph, type(gm).__name__)
    flat.meta.update(gm.meta)
    setattr(flat, QUANTIZERS_ATTR, getattr(gm, QUANTIZERS_ATTR))  # the same quantizer modules, same container
    _declare_dynamic_dims(flat)
    return flat


# ----------------------------------------------------------------------------------------------- internals
def _find_parts(model: nn.Module, batch: Any) -> dict[str, fx.GraphModule]:
    """Top-down: each submodule with parameters that ran on ``batch`` and captures is a part (its graph returned);
    one that does not capture is searched inside."""
    first_call = record_inputs(model, [n for n, m in model.named_modules() if n and _has_params(m)], [batch],
                                1, None, keep=1)
    parts: dict[str, fx.GraphModule] = {}

    def search(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if not _has_params(child) or not first_call.get(path):
                continue
            args = _positional(child, first_call[path][0])
            try:
                if args is None:
                    raise TraceError("called with keyword arguments")
                parts[path] = capture_graph(child, args)
            except TraceError as exc:
                logger.info("part search: %s does not capture (%s); searching inside it", path, _first_line(exc))
                search(child, path)

    search(model, "")
    return parts


def record_inputs(model: nn.Module, paths: list[str], data: Any, steps: int | None,
                   collate_fn: Callable[[Any], Any] | None, keep: int | None = None) -> dict[str, list]:
    """``{path: [batch per call]}``: the inputs the float model gives each submodule (a tuple of positional
    arguments, or a dict when it was called with keywords), detached copies."""
    calls: dict[str, list] = {p: [] for p in paths}

    def recorder(path: str):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if keep is not None and len(calls[path]) >= keep:
                return
            args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.detach().clone(), (args, kwargs))
            calls[path].append(_as_batch(module, args, kwargs))
        return hook

    handles = [model.get_submodule(p).register_forward_pre_hook(recorder(p), with_kwargs=True) for p in paths]
    try:
        with torch.no_grad():
            for batch in iter_batches(data, steps, collate_fn):
                args, kwargs = to_call_args(model, batch, check=False)
                model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return calls


def _leaves_by_name(part: fx.GraphModule, batch: Any) -> dict[str, Any]:
    """``{flat input name: value}`` for one recorded batch (the names :func:`flat_inputs` gives)."""
    targets = [str(n.target) for n in part.graph.nodes if n.op == "placeholder"]
    given = batch if isinstance(batch, dict) else dict(zip(targets, batch))
    return {"_".join([top, *(str(k.idx if isinstance(k, pytree.SequenceKey) else k.key) for k in keys)]): leaf
            for top, value in given.items() for keys, leaf in pytree.tree_flatten_with_path(value)[0]}


def _varying_dims(part: fx.GraphModule, batches: list) -> dict[str, list[int]]:
    shapes: dict[str, set] = {}
    for batch in batches:
        for name, leaf in _leaves_by_name(part, batch).items():
            if isinstance(leaf, torch.Tensor):
                shapes.setdefault(name, set()).add(tuple(leaf.shape))
    varying = {}
    for name, seen in shapes.items():
        ranks = {len(s) for s in seen}
        if len(seen) > 1 and len(ranks) == 1:
            varying[name] = [i for i in range(ranks.pop()) if len({s[i] for s in seen}) > 1]
    return varying


def _as_batch(module: nn.Module, args: tuple, kwargs: dict) -> Any:
    """Positional arguments as a tuple; a call with keywords as a dict of every argument by name."""
    if not kwargs:
        return args
    return dict(inspect.signature(module.forward).bind(*args, **kwargs).arguments)


def _positional(module: nn.Module, batch: Any) -> tuple | None:
    """The batch as positional arguments for capture (None when it cannot be)."""
    if isinstance(batch, tuple):
        return batch
    names = list(inspect.signature(module.forward).parameters)
    if isinstance(batch, dict) and list(batch) == names[: len(batch)]:
        return tuple(batch.values())
    return None


def _declare_dynamic_dims(flat: fx.GraphModule) -> None:
    """Tell the exporters which input dims vary, as an ONNX source's symbolic dims (``source_input_shapes``)."""
    dynamic = flat.meta.get(_DYNAMIC_DIMS) or {}
    shapes = {}
    for ph in (n for n in flat.graph.nodes if n.op == "placeholder"):
        val = ph.meta.get("val")
        if str(ph.target) in dynamic and isinstance(val, torch.Tensor):
            shapes[ph.name] = ["" if i in dynamic[str(ph.target)] else int(d) for i, d in enumerate(val.shape)]
    if shapes:
        flat.meta["onnx"] = {**(flat.meta.get("onnx") or {}), "source_input_shapes": shapes}


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _float_parameters(model: nn.Module) -> list[str]:
    """Modules outside the parts that hold parameters of their own."""
    parts = quantized_parts(model)
    return [name for name, m in model.named_modules()
            if name and any(True for _ in m.parameters(recurse=False))
            and not any(name == p or name.startswith(p + ".") for p in parts)]


def _first_line(exc: BaseException) -> str:
    """Capture errors run to many lines (a header, then one per path): each path's line, joined."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    paths = [line.strip("- ") for line in lines[1:] if line.startswith("- ")] if lines and lines[0].endswith(":") \
        else []
    return "; ".join(paths) if paths else lines[0] if lines else type(exc).__name__
