"""``QuantGraph(gm)``: the one answer to the questions passes, algorithms, analysis and exporters ask a prepared graph.

The facts live in one place each: what a quantizer is and what it quantizes on its :class:`~fxq.FakeQuantize`
(role, parameter, bias derivation, the alignment groups it is a member of), where quantizers sit in
``node.meta["fxq"]`` (:class:`~fxq.graph.info.NodeQuant`), and what a quantizer reads and who reads its value in the
graph itself.
This view joins them over a snapshot of the quantizer table and memos of graph walks: build a new one after
editing the graph or swapping quantizer modules.

Example:
    >>> qg = QuantGraph(gm)
    >>> [name for name, fq in qg.quantizers("weight") if fq.baked]
"""
from __future__ import annotations

import heapq
from typing import Iterator, NamedTuple

from torch import fx, nn

from fxq.errors import GraphError
from fxq.graph.info import QUANTIZERS_ATTR, QuantizerInfo, computed_from_parameters, is_quantizer_node
from fxq.nn.fake_quantize import ALIGNMENTS, ROLES, Alignment, FakeQuantize

__all__ = ["AlignGroup", "QuantGraph", "drop_alignment", "quantizer_name", "record_alignment"]

_PREFIX = QUANTIZERS_ATTR + "."


def quantizer_name(node: fx.Node) -> str | None:
    """Name of the quantizer a quantizer node runs (None for any other node)."""
    return str(node.target)[len(_PREFIX):] if is_quantizer_node(node) else None


class AlignGroup(NamedTuple):
    """One alignment group, as its members' :attr:`~fxq.FakeQuantize.aligned` records give it."""

    kind: str  # one of ALIGNMENTS
    members: tuple[str, ...]  # the quantizers put on one grid ("largest": in the op's input order)
    target: str | None = None  # "output": the quantizer whose parameters the members take

    @property
    def entry(self) -> Alignment:
        """What each member records."""
        return (self.kind, self.members) if self.kind == "largest" else (self.kind, self.target)

    @property
    def names(self) -> list[str]:
        """Every quantizer of the group, the target first."""
        return ([self.target] if self.target is not None else []) + list(self.members)


def record_alignment(quantizers: "nn.ModuleDict | QuantGraph", group: AlignGroup) -> None:
    """Record ``group`` on each member (after the groups it is already in; a group is recorded once)."""
    for name in dict.fromkeys(group.members):
        fq = quantizers[name]
        if group.entry not in fq.aligned:
            fq.set_alignment((*fq.aligned, group.entry))


def drop_alignment(quantizers: "nn.ModuleDict | QuantGraph", group: AlignGroup) -> None:
    """Remove ``group`` from its members' records."""
    for name in dict.fromkeys(group.members):
        fq = quantizers[name]
        fq.set_alignment(e for e in fq.aligned if e != group.entry)


class QuantGraph:
    """Read-only view of a prepared GraphModule's quantizers and graph facts.

    Args:
        gm: a module prepared by fxq (an unprepared module has no quantizers).

    Raises:
        GraphError: a quantizer of ``gm`` has no role (a role is never guessed).
    """

    def __init__(self, gm: nn.Module) -> None:
        self.gm = gm
        holder = getattr(gm, QUANTIZERS_ATTR, None)
        self._quantizers: dict[str, FakeQuantize] = dict(holder.items()) if holder is not None else {}
        for name, fq in self._quantizers.items():
            if getattr(fq, "role", None) not in ROLES:
                raise GraphError(f"quantizer {name!r} has no role (activation / weight / bias); it was not made by "
                                 f"fxq.prepare, or the file it came from is damaged")
        self._node_table: dict[str, fx.Node] | None = None  # built by the first graph query
        self._param_memo: dict[fx.Node, bool] = {}

    @property
    def _nodes(self) -> dict[str, fx.Node]:
        if self._node_table is None:
            graph = getattr(self.gm, "graph", None)
            self._node_table = {}
            for node in graph.nodes if isinstance(graph, fx.Graph) else ():
                name = quantizer_name(node)
                if name is not None:
                    self._node_table.setdefault(name, node)
        return self._node_table

    # ------------------------------------------------------------------ quantizers
    def __contains__(self, name: object) -> bool:
        return name in self._quantizers

    def __len__(self) -> int:
        return len(self._quantizers)

    def __getitem__(self, name: str) -> FakeQuantize:
        return self._quantizers[name]

    def quantizers(self, role: str | None = None) -> Iterator[tuple[str, FakeQuantize]]:
        """(name, FakeQuantize) pairs in insertion order, of one ``role`` when given."""
        return ((n, fq) for n, fq in self._quantizers.items() if role is None or fq.role == role)

    def as_dict(self) -> dict[str, FakeQuantize]:
        """``{name: FakeQuantize}`` (a copy)."""
        return dict(self._quantizers)

    def role(self, name: str) -> str:
        return self._quantizers[name].role

    def weights(self) -> Iterator[tuple[str, FakeQuantize]]:
        """Quantizers of parameters (weights and biases read through ``get_attr``), with ``fq.param`` set."""
        return ((n, fq) for n, fq in self._quantizers.items() if fq.param is not None)

    def node_of(self, name: str) -> fx.Node | None:
        """The graph node that runs quantizer ``name``."""
        return self._nodes.get(name)

    def consumers(self, name: str) -> list[str]:
        """Names of the nodes that read quantizer ``name``'s quantized value."""
        node = self._nodes.get(name)
        return [u.name for u in node.users] if node is not None else []

    def source(self, name: str) -> str:
        """Name of the node whose value quantizer ``name`` quantizes (its node's input; tied QAT modules share one
        FakeQuantize but not one node)."""
        node = self._nodes.get(name)
        return node.args[0].name if node is not None and node.args and isinstance(node.args[0], fx.Node) else ""

    def info(self, name_or_node: "str | fx.Node") -> QuantizerInfo | None:
        """A :class:`QuantizerInfo` snapshot of one quantizer (by name or by its node); None when there is none."""
        name = quantizer_name(name_or_node) if isinstance(name_or_node, fx.Node) else name_or_node
        fq = self._quantizers.get(name) if name is not None else None
        if fq is None:
            return None
        return QuantizerInfo(name=name, role=fq.role, source=self.source(name), consumers=self.consumers(name),
                             param=fq.param)

    def infos(self) -> dict[str, QuantizerInfo]:
        """``{name: QuantizerInfo}`` for every quantizer."""
        return {name: self.info(name) for name in self._quantizers}

    def biases(self) -> Iterator[tuple[str, FakeQuantize, str | None, str]]:
        """(name, bias quantizer, input quantizer or None, weight quantizer) of every passive bias."""
        for name, fq in self._quantizers.items():
            if fq.role == "bias" and fq.derived_from is not None:
                data_q, weight_q = fq.derived_from
                yield name, fq, data_q, weight_q

    def is_baked(self) -> bool:
        """Whether any quantized parameter is baked."""
        return any(fq.baked for fq in self._quantizers.values())

    # ------------------------------------------------------------------ graph facts
    def quantizer_of(self, node: fx.Node) -> FakeQuantize | None:
        """The FakeQuantize a quantizer node runs."""
        name = quantizer_name(node)
        return self._quantizers.get(name) if name is not None else None

    def from_parameters(self, node: fx.Node) -> bool:
        """Whether ``node`` is computed from parameters only (``get_attr``, reshaped or quantized)."""
        return computed_from_parameters(node, self._param_memo)

    def alignment_groups(self) -> list[AlignGroup]:
        """Every alignment group, read from its members' records, in the order to apply them.

        Every "largest" group comes before every "output" group. Within a kind, a group comes after the groups its
        members were recorded in before it (each member lists its groups in graph order), and an inner concat's group
        after the outer one whose member its output is: the outer output's parameters then reach the inner inputs
        too, so a nested concat shares one grid and aligning again changes nothing (PPQ's dominance chain). Groups
        with no quantizer in common give the same parameters in any order; otherwise first seen first.
        """
        seen: dict[Alignment, list[str]] = {}  # entry -> the names recording it
        for name, fq in self._quantizers.items():
            for entry in fq.aligned:
                seen.setdefault(entry, []).append(name)
        groups = [AlignGroup(kind, other, None) if kind == "largest" else AlignGroup(kind, tuple(names), other)
                  for (kind, other), names in seen.items()]
        index = {g.entry: i for i, g in enumerate(groups)}
        after: list[set[int]] = [set() for _ in groups]  # groups that must come after each one
        for fq in self._quantizers.values():
            for kind in ALIGNMENTS:
                chain = [index[e] for e in fq.aligned if e[0] == kind]
                for a, b in zip(chain, chain[1:]):
                    after[a].add(b)
        target_of = {g.target: i for i, g in enumerate(groups) if g.kind == "output"}
        for i, g in enumerate(groups):
            if g.kind == "output":
                for m in g.members:
                    if target_of.get(m, i) != i:  # m: an inner concat's output, member of this outer concat
                        after[i].add(target_of[m])
        waiting = [0] * len(groups)
        for later in after:
            for j in later:
                waiting[j] += 1
        key = [(ALIGNMENTS.index(g.kind), i) for i, g in enumerate(groups)]
        ready = [key[i] for i in range(len(groups)) if not waiting[i]]
        heapq.heapify(ready)
        order: list[AlignGroup] = []
        while len(order) < len(groups):
            if not ready:  # only damaged records form a cycle: go on with the first group left
                heapq.heappush(ready, min(key[i] for i in range(len(groups)) if waiting[i] > 0))
            i = heapq.heappop(ready)[1]
            waiting[i] = -1
            order.append(groups[i])
            for j in after[i]:
                waiting[j] -= 1
                if waiting[j] == 0:
                    heapq.heappush(ready, key[j])
        return order
