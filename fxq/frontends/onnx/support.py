"""Up-front check: does every node have a converter? All gaps are reported at once, before any conversion."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import onnx
from onnx import defs

from fxq.errors import FrontendError

__all__ = ["Gap", "find_gaps", "check_supported", "check_wiring", "opset_of"]

_MAX_NODES_SHOWN = 5


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
        lines.append(
            "What to do: re-export with ops/opsets these converters support (e.g. torch.onnx.export(..., "
            "dynamo=False, opset_version=17)), or register a converter with "
            "fxq.frontends.onnx.register_onnx_converter(op_type, schema_version, domain)."
        )
    if orphans:
        lines.append(
            f"graph output(s) {orphans} are graph inputs or initializers, not node outputs; "
            "add an Identity node in front of them before loading."
        )
    raise FrontendError("\n".join(lines))
