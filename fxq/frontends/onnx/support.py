"""Up-front check: does every node have a converter? All gaps are reported at once, before any conversion."""
from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass

import onnx
from onnx import defs

from fxq import onnx_data
from fxq.errors import FrontendError
from fxq.frontends.onnx.dequantize import quantized_format_advice

__all__ = ["Gap", "find_gaps", "check_supported", "check_wiring", "opset_of", "upgrade_for_converters",
           "UPGRADE_OPSETS"]

_LOG = logging.getLogger(__name__)
_MAX_NODES_SHOWN = 5
UPGRADE_OPSETS = (9, 11, 13, 17)
"""Default-domain opsets a file is upgraded to, in this order, when some of its ops have no converter at the opset
it imports (:func:`upgrade_for_converters`)."""


@dataclass(frozen=True)
class Gap:
    """One (domain, op type, opset) without a converter."""

    op_type: str
    domain: str
    opset: int
    since_version: int | None


def opset_of(model: onnx.ModelProto, domain: str) -> int | None:
    """The imported opset version of ``domain`` (``""`` and ``"ai.onnx"`` are the same domain)."""
    wanted = {"", "ai.onnx"} if domain in ("", "ai.onnx") else {domain}
    for imp in model.opset_import:
        if imp.domain in wanted:
            return int(imp.version)
    return None


def _since_version(op_type: str, domain: str, opset: int) -> int | None:
    try:
        return int(defs.get_schema(op_type, max_inclusive_version=opset, domain=domain).since_version)
    except (RuntimeError, defs.SchemaError):
        return None


def find_gaps(model: onnx.ModelProto) -> dict[Gap, list[str]]:
    """Map each unconvertible (op, domain, opset) to the names of its nodes (``#i`` for unnamed nodes)."""
    from onnx2torch.node_converters.registry import get_converter

    gaps: dict[Gap, list[str]] = defaultdict(list)
    for i, node in enumerate(model.graph.node):
        opset = opset_of(model, node.domain)
        label = node.name or f"#{i} (unnamed, output {node.output[0] if node.output else '?'})"
        if opset is None:
            gaps[Gap(node.op_type, node.domain, -1, None)].append(label)
            continue
        try:
            get_converter(operation_type=node.op_type, version=opset, domain=node.domain)
        except NotImplementedError:
            gaps[Gap(node.op_type, node.domain, opset, _since_version(node.op_type, node.domain, opset))].append(label)
    return dict(gaps)


def _default_domain_gaps(model: onnx.ModelProto) -> dict[Gap, list[str]]:
    return {g: n for g, n in find_gaps(model).items() if g.domain in ("", "ai.onnx")}


def upgrade_for_converters(model: onnx.ModelProto, source: str) -> onnx.ModelProto:
    """``model``, or ``model`` upgraded by onnx's version converter when ops of the default domain have no
    converter at the opset it imports but would at a later one.

    Old exporters write ops whose early schemas no converter reads (torch 0.3's ``Gemm-6`` with ``broadcast``,
    ``MaxPool-1``, ``Sum-6``, ``BatchNormalization-6``, ``PRelu-6``). onnx's own adapters rewrite them into
    the later schemas, keeping tensor names; the first opset of :data:`UPGRADE_OPSETS` that leaves no
    default-domain gap is taken. When none does, ``model`` comes back unchanged and :func:`check_supported`
    reports its gaps as they are in the file.
    """
    current = opset_of(model, "")
    gaps = _default_domain_gaps(model)
    if current is None or not gaps:
        return model
    for target in (v for v in UPGRADE_OPSETS if v > current):
        try:
            upgraded = onnx_data.convert_version(model, target)
        except Exception as exc:  # noqa: BLE001  (onnx's adapters raise anything; the gaps are reported as they are)
            _LOG.debug("onnx's version converter could not take %s from opset %d to %d: %s", source, current,
                       target, exc)
            continue
        if not _default_domain_gaps(upgraded):
            if current < 7:
                _per_channel_slopes(upgraded, _ranks(model))
            _LOG.info("ONNX model %s: ops %s have no converter at opset %d; loading it upgraded to opset %d by "
                      "onnx's version converter", source, sorted({g.op_type for g in gaps}), current, target)
            return upgraded
    return model


def _ranks(model: onnx.ModelProto) -> dict[str, int]:
    infos = [*model.graph.input, *model.graph.value_info]
    return {i.name: len(i.type.tensor_type.shape.dim) for i in infos if i.type.tensor_type.HasField("shape")}


def _per_channel_slopes(model: onnx.ModelProto, ranks: dict[str, int]) -> None:
    """``PRelu`` before opset 7 applies a slope of shape ``(C,)`` along dim 1; from 7 on a slope broadcasts
    numpy-style (along the last dim), and onnx's version converter has no adapter for that change. Such slopes of an
    upgraded model become ``(C, 1, ..., 1)`` for inputs of rank 3 and more."""
    inits = {t.name: t for t in model.graph.initializer}
    readers: dict[str, int] = defaultdict(int)
    for node in model.graph.node:
        for name in node.input:
            readers[name] += 1
    for node in model.graph.node:
        if node.op_type != "PRelu" or node.domain not in ("", "ai.onnx") or len(node.input) < 2:
            continue
        slope, rank = inits.get(node.input[1]), ranks.get(node.input[0], 0)
        if slope is None or len(slope.dims) != 1 or slope.dims[0] <= 1 or rank < 3:
            continue
        if readers[slope.name] > 1:  # shared with another node: this PRelu gets its own reshaped copy
            copy = model.graph.initializer.add()
            copy.CopyFrom(slope)
            copy.name = f"{slope.name}__per_channel_{len(model.graph.initializer)}"
            node.input[1], slope = copy.name, copy
        slope.dims[:] = [slope.dims[0]] + [1] * (rank - 2)


def _describe(gap: Gap, nodes: list[str]) -> str:
    domain = gap.domain or "ai.onnx"
    if gap.opset < 0:
        where = f"domain {domain!r} is not in the model's opset imports"
    else:
        version = f", schema version {gap.since_version}" if gap.since_version not in (None, gap.opset) else ""
        where = f"domain {domain!r}, opset {gap.opset}{version}"
    shown = ", ".join(repr(n) for n in nodes[:_MAX_NODES_SHOWN])
    more = f" and {len(nodes) - _MAX_NODES_SHOWN} more" if len(nodes) > _MAX_NODES_SHOWN else ""
    return f"  - {gap.op_type} ({where}): {len(nodes)} node(s): {shown}{more}"


def check_wiring(model: onnx.ModelProto, source: str) -> None:
    """Every node input must be a graph input, an initializer or the output of an earlier node.

    Raises:
        FrontendError: names the first nodes reading tensors nothing defines (a truncated or hand-broken file,
            or nodes out of topological order).
    """
    defined = {i.name for i in model.graph.input} | {t.name for t in model.graph.initializer} | {""}
    dangling: list[str] = []
    for i, node in enumerate(model.graph.node):
        missing = [name for name in node.input if name not in defined]
        if missing:
            dangling.append(f"{node.name or f'#{i}'!r} ({node.op_type}) reads {missing}")
        defined.update(node.output)
    if dangling:
        shown = "; ".join(dangling[:_MAX_NODES_SHOWN])
        more = f" and {len(dangling) - _MAX_NODES_SHOWN} more" if len(dangling) > _MAX_NODES_SHOWN else ""
        raise FrontendError(
            f"ONNX model {source!r} is broken: node(s) read tensors that no input, initializer or earlier node "
            f"defines: {shown}{more}. The file is truncated or edited by hand, or its nodes are not in "
            "topological order; re-export it (or sort it with onnx tools) and load again."
        )


def check_supported(model: onnx.ModelProto, source: str) -> None:
    """Raise one FrontendError listing every op of ``model`` without a converter.

    Raises:
        FrontendError: names the file, each op type with its domain and opset, and the nodes using it.
    """
    gaps = find_gaps(model)
    produced = {o for node in model.graph.node for o in node.output}
    orphans = [o.name for o in model.graph.output if o.name not in produced]
    if not gaps and not orphans:
        return
    lines = [f"cannot convert ONNX model {source!r}:"]
    if gaps:
        lines.append(f"{len(gaps)} op type(s) have no converter (onnx2torch's or fxq's):")
        lines += [_describe(g, n) for g, n in sorted(gaps.items(), key=lambda kv: (kv[0].domain, kv[0].op_type))]
        lines.append(quantized_format_advice({g.op_type for g in gaps}) or (
            "What to do: re-export with ops/opsets these converters support (e.g. torch.onnx.export(..., "
            "dynamo=False, opset_version=17)), or register a converter with "
            "fxq.frontends.onnx.register_onnx_converter(op_type, schema_version, domain)."
        ))
    if orphans:
        lines.append(
            f"graph output(s) {orphans} are graph inputs or initializers, not node outputs; "
            "add an Identity node in front of them before loading."
        )
    raise FrontendError("\n".join(lines))
