"""Reading what fxq wrote before a quantizer's record moved onto its FakeQuantize.

Files of that time keep role / source / parameter in ``gm.meta["fxq_quantizer_infos"]`` and
``node.meta["fxq_quantizer"]`` (:class:`~fxq.graph.info.QuantizerInfo` records), a bias's input and weight
quantizers in the ``bias_deps`` field of ``gm.meta["fxq"]``, and the FP32 copy of a baked weight in a plain
``_fp32_backup`` attribute. Loading moves each fact to its place now and drops the old records; nothing here
runs code from the file.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import fx

from fxq.errors import FrontendError
from fxq.graph.info import QUANTIZERS_ATTR, QuantizerInfo
from fxq.nn.fake_quantize import FakeQuantize
from fxq.serialization.codec import TensorTable, decode

__all__ = ["LEGACY_BACKUP_ATTR", "complete_fake_quantize", "pop_bias_deps", "upgrade_records"]

LEGACY_BACKUP_ATTR = "_fp32_backup"
"""The attribute that held a baked weight's FP32 copy before it was the ``fp32_backup`` buffer."""

def complete_fake_quantize(fq: FakeQuantize, backup: Any) -> None:
    """Give a FakeQuantize rebuilt from a file what an older file lacks (:meth:`FakeQuantize.adopt_legacy_state`);
    ``backup`` is the legacy attribute's value, checked here because it comes from the file."""
    if backup is not None and type(backup) is not torch.Tensor:
        raise FrontendError(f"quantizer {fq.name!r}: {LEGACY_BACKUP_ATTR} is a {type(backup).__name__}, not a tensor")
    fq.adopt_legacy_state(backup)


def pop_bias_deps(meta_doc: Any, table: TensorTable) -> dict[str, Any]:
    """Remove the legacy ``bias_deps`` field from the encoded ``gm.meta["fxq"]`` record; returns it decoded."""
    record = meta_doc.get("fxq") if isinstance(meta_doc, dict) else None
    body = record.get("$record") if isinstance(record, dict) else None
    if not (isinstance(body, list) and len(body) == 2 and body[0] == "GraphQuant" and isinstance(body[1], dict)):
        return {}
    deps = decode(body[1].pop("bias_deps", {}), table)
    if not isinstance(deps, dict):
        raise FrontendError(f"gm.meta['fxq'].bias_deps is a {type(deps).__name__}, not an object")
    return deps


def upgrade_records(gm: fx.GraphModule, bias_deps: dict[str, Any]) -> None:
    """Move the quantizer records of an older file onto the FakeQuantize modules and drop the old copies."""
    infos = gm.meta.pop("fxq_quantizer_infos", None) or {}
    for node in gm.graph.nodes:
        node.meta.pop("fxq_quantizer", None)
    holder = getattr(gm, QUANTIZERS_ATTR, None)
    if holder is None:
        return
    for name, fq in holder.items():
        info = infos.get(name)
        if fq.role is not None or not isinstance(info, QuantizerInfo):
            continue
        deps = bias_deps.get(name)
        if deps is not None and not (isinstance(deps, (tuple, list)) and len(deps) == 2):
            raise FrontendError(f"bias_deps[{name!r}] is {deps!r:.80}, not (input quantizer, weight quantizer)")
        fq.set_record(info.role, info.param,
                      tuple(deps) if deps is not None and info.role == "bias" else None)
