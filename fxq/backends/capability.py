"""The exporters' generic pre-check: every quantizer of a model against the capabilities of the exporter's platforms.

A platform declares what its exporter can express (:class:`fxq.qconfig.Capability`: bits, ranges, symmetry, axes,
formats and rounding per role, bias handling, the ops that may read a quantized value). :func:`fxq.prepare` checks schemes against it; an exporter is also
handed models quantized for other platforms, so before writing anything it checks every quantizing quantizer against
the capabilities of the platforms that name it (``Platform.exporter``): each rule is written once, in the platform.
"""
from __future__ import annotations

from torch import nn

from fxq.errors import ExportError
from fxq.graph.dispatch import capability_problem
from fxq.graph.info import computed_from_parameters, is_quantizer_node
from fxq.graph.op_types import op_type
from fxq.graph.quant_graph import QuantGraph
from fxq.qconfig.base import PLATFORMS, Capability
from fxq.spec import TensorQuantConfig

__all__ = ["capabilities_of", "check_capabilities"]


def capabilities_of(exporter: str) -> dict[str, Capability]:
    """``{platform name: capability}`` of the registered platforms exported by ``exporter`` that declare one."""
    return {name: cls.capability for name, cls in PLATFORMS.items()
            if cls.exporter == exporter and cls.capability is not None}


def check_capabilities(gm: nn.Module, exporter: str) -> None:
    """Raise :class:`ExportError` for the first quantizer that no capability of ``exporter``'s platforms expresses.

    A quantizer passes when one capability takes its scheme (TensorRT: INT8 or FP8, quantizer by quantizer). The
    message names the quantizer, its role and the node it quantizes, the closest platform's rule and what breaks it,
    and the fix (quantize for one of the exporter's platforms). Then every op that reads a quantized value must be
    one a capability runs quantized (``Capability.ops`` / ``op_rules``; a model quantized for another platform may
    quantize ops the exporter keeps FP32). No declared capability: nothing to check.
    """
    caps = capabilities_of(exporter)
    if not caps:
        return
    qg = QuantGraph(gm)
    for name, fq in qg.quantizers():
        cfg = fq.config
        if not cfg.is_quantizing:
            continue
        role = fq.role
        found = {platform: cap.problems(role, cfg) for platform, cap in caps.items()}
        if any(not problems for problems in found.values()):
            continue
        platform = min(found, key=lambda p: (_other_format(caps[p], role, cfg), len(found[p])))
        cap = caps[platform]
        where = f"quantizer {name!r} ({role} of {qg.source(name)!r})"
        hint = f"; {cap.hint}" if cap.hint else ""
        raise ExportError(f"{exporter} export: {where}: {cap.rule}: {role} quantization {'; '.join(found[platform])}. "
                          f"Fix: quantize for {' or '.join(repr(p) for p in caps)}{hint}")
    _check_readers(gm, qg, exporter, caps)


def _check_readers(gm: nn.Module, qg: QuantGraph, exporter: str, caps: dict[str, Capability]) -> None:
    """Raise :class:`ExportError` for the first op that reads a quantized value and that no capability of
    ``exporter`` runs quantized (readers computed from parameters only are constants the exporter folds)."""
    if not any(cap.restricts_ops for cap in caps.values()):
        return
    modules, memo = dict(gm.named_modules()), {}
    for name, fq in qg.quantizers():
        node = qg.node_of(name)
        if node is None or not fq.config.is_quantizing:
            continue
        for user in node.users:
            if is_quantizer_node(user) or computed_from_parameters(user, memo):
                continue
            t = op_type(user, modules)
            found = {p: capability_problem(user, t, cap, gm) for p, cap in caps.items()}
            if any(why is None for why in found.values()):
                continue
            why = "; ".join(f"{p}: {why}" for p, why in found.items())
            raise ExportError(
                f"{exporter} export: quantizer {name!r} on the value of node {qg.source(name)!r} feeds node "
                f"{user.name!r} (op {t}), which {exporter} cannot run quantized ({why}). Fix: quantize for "
                f"{' or '.join(repr(p) for p in caps)}: prepare keeps the nodes it cannot run quantized FP32")


def _other_format(cap: Capability, role: str, cfg: TensorQuantConfig) -> bool:
    """Whether ``cap`` takes another number format than ``cfg``'s for ``role`` (integer vs FP8): the platform to
    name in a message is one of the same format, then the one with the fewest problems."""
    formats = getattr(getattr(cap, role, None), "formats", None)
    return formats is not None and (cfg.fp_format.value if cfg.is_floating else "int") not in formats
