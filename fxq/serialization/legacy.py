"""Reading what fxq wrote before a quantizer's record moved onto its FakeQuantize.

Files of that time keep role / source / parameter in ``gm.meta["fxq_quantizer_infos"]`` and
``node.meta["fxq_quantizer"]`` (:class:`~fxq.graph.info.QuantizerInfo` records), a bias's input and weight
quantizers in the ``bias_deps`` field of ``gm.meta["fxq"]``, and the FP32 copy of a baked weight in a plain
``_fp32_backup`` attribute. Files written before alignment moved onto the quantizers keep the alignment groups in
the ``align_large`` (member lists) and ``align_output`` ((inputs, output quantizer) pairs) fields of
``gm.meta["fxq"]``. Loading moves each fact to its place now and drops the old records; nothing here runs code
from the file.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import fx

from fxq.errors import ConfigError, FrontendError
from fxq.graph.info import QUANTIZERS_ATTR, QuantizerInfo
from fxq.graph.quant_graph import AlignGroup, record_alignment
from fxq.nn.fake_quantize import FakeQuantize
from fxq.serialization.codec import TensorTable, decode

__all__ = ["LEGACY_BACKUP_ATTR", "complete_fake_quantize", "pop_legacy_fields", "upgrade_records"]

LEGACY_BACKUP_ATTR = "_fp32_backup"
"""The attribute that held a baked weight's FP32 copy before it was the ``fp32_backup`` buffer."""

def complete_fake_quantize(fq: FakeQuantize, backup: Any) -> None:
    """Give a FakeQuantize rebuilt from a file what an older file lacks (:meth:`FakeQuantize.adopt_legacy_state`)
    and check the alignment it records; ``backup`` is the legacy attribute's value, checked here because it comes
    from the file."""
    if backup is not None and type(backup) is not torch.Tensor:
        raise FrontendError(f"quantizer {fq.name!r}: {LEGACY_BACKUP_ATTR} is a {type(backup).__name__}, not a tensor")
    fq.adopt_legacy_state(backup)
    try:
        fq.set_alignment(fq.aligned)  # what the file says it is aligned with, checked as prepare's records are
    except ConfigError as exc:
        raise FrontendError(f"{exc} (in the file: it is damaged; quantize and save the model again)") from None


_LEGACY_FIELDS = {"bias_deps": dict, "align_large": list, "align_output": list}
"""Fields an older file's ``gm.meta["fxq"]`` record holds that :class:`~fxq.graph.info.GraphQuant` no longer has."""


def pop_legacy_fields(meta_doc: Any, table: TensorTable) -> dict[str, Any]:
    """Remove the legacy fields (:data:`_LEGACY_FIELDS`) from the encoded ``gm.meta["fxq"]`` record; returns those
    it held, decoded."""
    record = meta_doc.get("fxq") if isinstance(meta_doc, dict) else None
    body = record.get("$record") if isinstance(record, dict) else None
    if not (isinstance(body, list) and len(body) == 2 and body[0] == "GraphQuant" and isinstance(body[1], dict)):
        return {}
    legacy = {}
    for key, kind in _LEGACY_FIELDS.items():
        if key in body[1]:
            legacy[key] = decode(body[1].pop(key), table)
            if not isinstance(legacy[key], kind):
                raise FrontendError(f"gm.meta['fxq'].{key} is a {type(legacy[key]).__name__}, not "
                                    f"{'an object' if kind is dict else 'a list'}")
    return legacy


def _legacy_groups(legacy: dict[str, Any], holder: Any) -> list[AlignGroup]:
    """The alignment groups of an older file's ``align_large`` / ``align_output`` lists, each member checked."""
    groups = []
    for g in legacy.get("align_large", []):
        if not (isinstance(g, (list, tuple)) and all(isinstance(m, str) for m in g)):
            raise FrontendError(f"gm.meta['fxq'].align_large holds {g!r:.80}, not a list of quantizer names")
        groups.append(AlignGroup("largest", tuple(g)))
    for g in legacy.get("align_output", []):
        if not (isinstance(g, (list, tuple)) and len(g) == 2 and isinstance(g[0], (list, tuple))
                and all(isinstance(m, str) for m in g[0]) and isinstance(g[1], str)):
            raise FrontendError(f"gm.meta['fxq'].align_output holds {g!r:.80}, not (input quantizers, output "
                                f"quantizer)")
        groups.append(AlignGroup("output", tuple(g[0]), g[1]))
    for group in groups:
        wrong = [n for n in group.names if n not in holder or holder[n].role != "activation"]
        if wrong:
            raise FrontendError(f"gm.meta['fxq'] aligns {wrong[:3]}, which the file holds no activation quantizer "
                                f"of: the file is damaged; quantize and save the model again")
    return groups


def upgrade_records(gm: fx.GraphModule, legacy: dict[str, Any]) -> None:
    """Move the quantizer records of an older file onto the FakeQuantize modules and drop the old copies
    (``legacy``: what :func:`pop_legacy_fields` took out of ``gm.meta["fxq"]``)."""
    infos = gm.meta.pop("fxq_quantizer_infos", None) or {}
    for node in gm.graph.nodes:
        node.meta.pop("fxq_quantizer", None)
    holder = getattr(gm, QUANTIZERS_ATTR, None)
    if holder is None:
        return
    bias_deps = legacy.get("bias_deps", {})
    for name, fq in holder.items():
        info = infos.get(name)
        if fq.role is not None or not isinstance(info, QuantizerInfo):
            continue
        deps = bias_deps.get(name)
        if deps is not None and not (isinstance(deps, (tuple, list)) and len(deps) == 2):
            raise FrontendError(f"bias_deps[{name!r}] is {deps!r:.80}, not (input quantizer, weight quantizer)")
        fq.set_record(info.role, info.param,
                      tuple(deps) if deps is not None and info.role == "bias" else None)
    for group in _legacy_groups(legacy, holder):  # in the order the old lists applied them
        record_alignment(holder, group)
