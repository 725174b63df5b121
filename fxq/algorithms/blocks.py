"""Blocks of a quantized graph and a runner that feeds them cached FP32 and quantized inputs.

A *block* is a contiguous run of graph nodes holding ``block_size`` consecutive computing ops (Conv,
Gemm, MatMul, ConvTranspose). Block ``k + 1`` starts right after the last op of block ``k``'s tail, i.e.
at the input quantizers of its first computing op, so block inputs are the values *before* the next
block's input quantizers and every quantizer belongs to exactly one block. Because the blocks cut the
node list of a DAG in topological order, every block is a valid sub-graph; it is run as its own small
``GraphModule`` (sharing modules and parameters with the model).

:class:`BlockRunner` walks the blocks in order. It keeps, per calibration batch, only the values that
cross the current cut (the FP32 ones and the quantized ones): block ``k``'s outputs replace its inputs
as soon as block ``k`` is done, so memory holds one block's inputs and outputs, never the whole model's
activations.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from typing import Any, Callable, ContextManager, Iterator, Sequence

import torch
from torch import fx, nn

from fxq.errors import CalibrationError, FxqError, GraphError
from fxq.graph.convert import (
    apply_alignment,
    bake_parameters,
    derive_passive_parameters,
    is_baked,
    unbake_parameters,
)
from fxq.graph.data import (
    algorithm_errors,
    diagnose_block_failure,
    iter_batches,
    model_device,
    placeholder_values,
    to_device,
)
from fxq.graph.info import NodeQuant, graph_quant, is_quantizer_node, match_node_name
from fxq.graph.nodes import get_attr_value
from fxq.graph.passes import rewrite_out_of_place
from fxq.graph.quant_graph import QuantGraph, quantizer_name
from fxq.nn.fake_quantize import FakeQuantize, fake_quant_mode
from fxq.qconfig.base import COMPUTING_OPS
from fxq.spec import QuantState

__all__ = [
    "Block",
    "BlockData",
    "BlockRunner",
    "partition_blocks",
    "computing_nodes",
    "weight_quantizer_of",
    "activation_quantizers",
    "param_target",
    "matches_layer",
    "unbaked",
    "block_errors",
    "call_block",
]

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- graph facts
def computing_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """Quantized computing ops (Conv, Gemm, MatMul, ConvTranspose) in graph order."""
    out = []
    for node in gm.graph.nodes:
        nq = node.meta.get("fxq")
        if isinstance(nq, NodeQuant) and nq.quantized and nq.op_type in COMPUTING_OPS:
            out.append(node)
    return out



def weight_quantizer_of(gm: fx.GraphModule, node: fx.Node) -> tuple[str, FakeQuantize] | None:
    """(name, FakeQuantize) of the weight quantizer of a computing op with a parameter weight."""
    nq = node.meta.get("fxq")
    if not isinstance(nq, NodeQuant):
        return None
    qg = QuantGraph(gm)
    for qname in nq.inputs.values():
        fq = qg[qname] if qname in qg else None
        if fq is not None and fq.role == "weight" and fq.param is not None:
            return qname, fq
    return None


def activation_quantizers(gm: fx.GraphModule, block: "Block") -> list[tuple[str, FakeQuantize]]:
    """The block's own activation quantizers that quantize with their own parameters (state ACTIVATED)."""
    qg = QuantGraph(gm)
    out = []
    for name in block.quantizer_names:
        fq = qg[name] if name in qg else None
        if fq is not None and fq.role == "activation" and fq.config.is_quantizing \
                and fq.config.state is QuantState.ACTIVATED:
            out.append((name, fq))
    return out


def param_target(node: fx.Node, index: int) -> str | None:
    """``get_attr`` target feeding argument ``index`` of ``node`` (through quantizer nodes), or None."""
    arg = node.args[index] if len(node.args) > index else node.kwargs.get(("input", "weight", "bias")[index])
    while isinstance(arg, fx.Node):
        if arg.op == "get_attr":
            return str(arg.target)
        if is_quantizer_node(arg):
            arg = arg.args[0]
            continue
        return None
    return None


def matches_layer(node: fx.Node, patterns: Sequence[str]) -> bool:
    """True when ``patterns`` is empty or names ``node`` (as a dispatching table would, see
    :func:`fxq.graph.info.match_node_name`: node name, module path, original ONNX / caffe name; exact or regex)."""
    return not patterns or match_node_name(node, patterns) is not None


def _param_like(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes computed from parameters only (get_attr and e.g. their weight quantizers)."""
    qg = QuantGraph(gm)
    return {node for node in gm.graph.nodes if qg.from_parameters(node)}


# --------------------------------------------------------------------------- blocks
@dataclasses.dataclass
class Block:
    """A contiguous sub-graph of ``gm``: ``nodes`` read ``inputs`` and produce ``outputs``.

    Attributes:
        index: position among the blocks.
        nodes: the graph nodes the block runs, in order (parameter chains are copied in, not listed).
        inputs: values computed before the block (or graph inputs) that the block reads.
        outputs: values of the block read after it (by later blocks or the graph output).
        computing: the quantized computing ops of the block.
        quantizer_names: names of the quantizers whose nodes the block runs (weights included).
        module: the block as a ``GraphModule`` ``(*inputs) -> tuple(outputs)``.
    """

    index: int
    gm: fx.GraphModule
    nodes: list[fx.Node]
    inputs: list[fx.Node]
    outputs: list[fx.Node]
    computing: list[fx.Node]
    quantizer_names: list[str]
    module: fx.GraphModule = dataclasses.field(repr=False, default=None)

    def build(self, overrides: dict[str, nn.Module] | None = None,
              extra_outputs: Sequence[fx.Node] = ()) -> fx.GraphModule:
        """The block as a ``GraphModule``; ``overrides`` maps module targets to replacement modules.

        ``extra_outputs`` (values inside the block, e.g. one op's output) are appended to the outputs as they
        were when computed. The block writes into no value (:func:`fxq.graph.passes.rewrite_out_of_place`), so
        cached inputs and probed outputs stay as computed, also through aliases (a disabled quantizer returns
        its input).
        """
        return _build_module(self.gm, self.nodes, self.inputs, list(self.outputs), overrides or {},
                             list(extra_outputs))


def _build_module(gm: fx.GraphModule, nodes: list[fx.Node], inputs: list[fx.Node], outputs: list[fx.Node],
                  overrides: dict[str, nn.Module], extra_outputs: Sequence[fx.Node] = ()) -> fx.GraphModule:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    root: dict[str, Any] = {}
    for n in inputs:
        env[n] = graph.placeholder(n.name)

    def copy(node: fx.Node) -> fx.Node:
        # inputs first, depth first (a parameter chain, get_attr -> weight quantizer, used here first); an
        # explicit stack, not Python recursion, so a missing input far up a deep graph is a GraphError
        stack = [node]
        while stack:
            n = stack[-1]
            if n in env:
                stack.pop()
                continue
            pending = [a for a in n.all_input_nodes if a not in env]
            if pending:
                stack.extend(reversed(pending))
                continue
            stack.pop()
            if n.op in ("placeholder", "output"):
                raise GraphError(f"block sub-graph needs node {n.name!r} that is not among its inputs")
            if n.op in ("call_module", "get_attr"):
                target = str(n.target)
                if target not in root:
                    root[target] = overrides.get(target) if target in overrides else get_attr_value(gm, target)
            env[n] = graph.node_copy(n, lambda a: env[a])
        return env[node]

    for n in nodes:
        copy(n)
    moved = rewrite_out_of_place(graph, root)

    def final(v: fx.Node) -> fx.Node:  # the value a later block reads: after the block's writes into it
        while v in moved:
            v = moved[v]
        return v

    graph.output(tuple([final(env[o]) for o in outputs] + [env[o] for o in extra_outputs]))
    return fx.GraphModule(root, graph, class_name="FxqBlock")


def _external_inputs(nodes: list[fx.Node], members: set[fx.Node], params: set[fx.Node]) -> list[fx.Node]:
    """Values read by ``nodes`` but computed outside them (parameter chains are followed, not listed)."""
    inputs: list[fx.Node] = []
    seen: set[fx.Node] = set()
    stack = list(reversed(nodes))
    while stack:
        n = stack.pop()
        for x in n.all_input_nodes:
            if x in members or x in seen:
                continue
            seen.add(x)
            if x in params:
                stack.append(x)
            else:
                inputs.append(x)
    return inputs


def partition_blocks(gm: fx.GraphModule, block_size: int) -> list[Block]:
    """Cut ``gm``'s node list into blocks of ``block_size`` consecutive computing ops.

    Raises:
        GraphError: when ``block_size`` < 1.
    """
    if block_size < 1:
        raise GraphError(f"block_size={block_size}: use 1 or more computing ops per block")
    order = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(order)}
    params = _param_like(gm)
    comp = computing_nodes(gm)
    comp_set = set(comp)
    starts = [0]
    for k in range(block_size, len(comp), block_size):
        i = pos[comp[k]]
        # move back over parameter chains and input quantizers, so they belong to the block that uses them
        while i > starts[-1] + 1 and (order[i - 1] in params or (
                is_quantizer_node(order[i - 1]) and order[i - 1].args[0] is order[i - 2])):
            i -= 1
        if i > starts[-1]:
            starts.append(i)
    bounds = list(zip(starts, starts[1:] + [len(order)]))
    blocks: list[Block] = []
    for a, b in bounds:
        nodes = [n for n in order[a:b] if n.op not in ("placeholder", "output") and n not in params]
        if not nodes:
            continue
        members = set(nodes)
        inputs = _external_inputs(nodes, members, params)
        outputs = [n for n in nodes if any(u not in members for u in n.users)]
        qnames = [quantizer_name(n) for n in order[a:b] if is_quantizer_node(n)]
        for n in nodes:  # weight quantizers of the block's ops (copied parameter chains)
            for x in n.all_input_nodes:
                if x in params and is_quantizer_node(x):
                    name = quantizer_name(x)
                    if name not in qnames:
                        qnames.append(name)
        block = Block(index=len(blocks), gm=gm, nodes=nodes, inputs=inputs, outputs=outputs,
                      computing=[n for n in nodes if n in comp_set], quantizer_names=qnames)
        block.module = block.build()
        blocks.append(block)
    return blocks


# --------------------------------------------------------------------------- data
@dataclasses.dataclass
class BlockData:
    """Cached values of one block for every calibration batch (on the collecting device).

    ``fp_inputs[b]`` / ``q_inputs[b]`` are the block's inputs in the FP32 model and in the quantized model
    (with all earlier blocks already optimized); :attr:`fp_outputs` are the FP32 block outputs, the
    reconstruction targets (computed on first use). ``algorithm`` names the pass in errors (:func:`block_errors`).
    """

    block: Block
    fp_inputs: list[tuple]
    q_inputs: list[tuple]
    device: torch.device
    _fp_outputs: list[tuple] | None = None
    _store: str | torch.device = "cpu"
    algorithm: str = "a block-wise algorithm"
    q_outputs: list[tuple] | None = None
    """The block's quantized outputs per batch in its final state, when the algorithm already computed them
    (:func:`fxq.algorithms.training.kept_if_better` does): the runner then does not run the block again."""

    @property
    def store(self) -> str | torch.device:
        """Where this block's cached outputs are kept (the runner's collecting device)."""
        return self._store

    @property
    def num_batches(self) -> int:
        return len(self.fp_inputs)

    def inputs(self, b: int, quantized: bool = True) -> tuple:
        """Batch ``b``'s inputs on the model device."""
        src = self.q_inputs if quantized else self.fp_inputs
        return tuple(to_device(v, self.device) for v in src[b])

    @property
    def fp_outputs(self) -> list[tuple]:
        if self._fp_outputs is None:
            self._fp_outputs = run_block(self.block.module, self, quantized=False, store=self._store)
        return self._fp_outputs

    def fp32_with(self, extra_outputs: Sequence[fx.Node]) -> list[tuple]:
        """FP32 values of ``extra_outputs`` (nodes inside the block) per batch, from one FP32 run of the block
        that also provides :attr:`fp_outputs` when they are not computed yet."""
        n_out = len(self.block.outputs)
        runs = run_block(self.block.build(extra_outputs=extra_outputs), self, quantized=False, store=self._store)
        if self._fp_outputs is None:
            self._fp_outputs = [r[:n_out] for r in runs]
        return [r[n_out:] for r in runs]

    def target(self, b: int) -> tuple:
        return tuple(to_device(v, self.device) for v in self.fp_outputs[b])


@torch.no_grad()
def run_block(module: fx.GraphModule, data: BlockData, quantized: bool, store: str | torch.device = "cpu"
              ) -> list[tuple]:
    """Run ``module`` on every cached batch: FP32 (quantizers off) on FP32 inputs, or quantized on quantized inputs."""
    ctx = contextlib.nullcontext() if quantized else fake_quant_mode(data.block.gm, "disabled")
    out = []
    with ctx:
        for b in range(data.num_batches):
            inputs = data.inputs(b, quantized=quantized)
            with block_errors(data, module, b, inputs):
                out.append(stored(call_block(module, inputs), store))
    return out


def block_errors(data: BlockData, module: fx.GraphModule, batch: int, inputs: Sequence[Any]) -> ContextManager[None]:
    """Around running block ``module`` (of ``data.block``) on ``inputs`` for cached batch ``batch``.

    The model ran these batches in calibration, so a failure is fxq's (or the algorithm's): a :class:`GraphError`
    naming the algorithm and the failing node (the block's nodes when no single node fails), unless the FP32 block
    fails on the batch too (the data's :class:`CalibrationError`). Diagnosed only after a failure.
    """
    return algorithm_errors(data.algorithm, functools.partial(_diagnose_block, data, module, batch, tuple(inputs)))


def _diagnose_block(data: BlockData, module: fx.GraphModule, batch: int, inputs: tuple,
                    exc: BaseException) -> FxqError:
    block = data.block
    ops = ", ".join(repr(n.name) for n in block.computing) or "none"
    where = f"block {block.index} ({len(block.nodes)} nodes from {block.nodes[0].name!r} to " \
            f"{block.nodes[-1].name!r}, computing ops {ops})"
    return diagnose_block_failure(module, inputs, data.inputs(batch, quantized=False), exc, data.algorithm, where,
                                  batch)


def call_block(module: fx.GraphModule, inputs: Sequence[Any]) -> Any:
    """``module(*inputs)`` past torch.fx's wrapper, which prints a failure's generated code to stderr (the error
    :func:`block_errors` raises names the node)."""
    return nn.Module.__call__(module, *inputs)


def stored(outputs: tuple, store: str | torch.device) -> tuple:
    """A block's outputs as the runner keeps them: detached, on the collecting device ``store``."""
    return tuple(to_device(v.detach() if isinstance(v, torch.Tensor) else v, store) for v in outputs)


class BlockRunner:
    """Walk the blocks of ``gm`` with cached FP32 and quantized inputs.

    Iterating yields a :class:`BlockData` per block; after the caller is done with a block (parameters
    optimized), the runner computes the block's quantized outputs with the updated model, drops every
    cached value no later block reads, and moves on.

    Args:
        gm: a prepared and calibrated model (parameters unbaked: see :func:`unbaked`).
        data, steps, collate_fn: calibration batches, as for :func:`fxq.calibrate`.
        block_size: computing ops per block.
        collecting_device: where cached values live between uses (``"cpu"`` keeps GPU memory free).
        algorithm: the pass the runner serves, named in its errors.

    Attributes:
        peak_cache_bytes: the largest number of bytes cached at once (FP32 + quantized values).
    """

    def __init__(self, gm: fx.GraphModule, data: Any, steps: int | None, collate_fn: Callable | None,
                 block_size: int, collecting_device: str | torch.device = "cpu",
                 algorithm: str = "a block-wise algorithm") -> None:
        graph_quant(gm)
        self.gm = gm
        self.algorithm = algorithm
        self.blocks = partition_blocks(gm, block_size)
        self.device = model_device(gm)
        self.store = torch.device(collecting_device) if collecting_device else torch.device("cpu")
        if self.store.type == "cuda" and not torch.cuda.is_available():
            self.store = torch.device("cpu")
        self.peak_cache_bytes = 0
        self._fp: dict[fx.Node, list[Any]] = {}
        self._q: dict[fx.Node, list[Any]] = {}
        self._load(data, steps, collate_fn)

    def _load(self, data: Any, steps: int | None, collate_fn: Callable | None) -> None:
        phs = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        self._fp = {p: [] for p in phs}
        for batch in iter_batches(data, steps, collate_fn):
            values = placeholder_values(self.gm, batch)
            for p in phs:
                self._fp[p].append(to_device(values[p], self.store))
        if not phs or not self._fp[phs[0]]:
            raise CalibrationError("calibration data is empty: give at least one batch")
        self._q = dict(self._fp)  # graph inputs are the same in both models
        self._account()

    def _account(self) -> None:
        seen: set[int] = set()
        total = 0
        for table in (self._fp, self._q):
            for values in table.values():
                for v in values:
                    if isinstance(v, torch.Tensor) and id(v) not in seen:
                        seen.add(id(v))
                        total += v.numel() * v.element_size()
        self.peak_cache_bytes = max(self.peak_cache_bytes, total)

    def __len__(self) -> int:
        return len(self.blocks)

    def __iter__(self) -> Iterator[BlockData]:
        order = {n: i for i, n in enumerate(self.gm.graph.nodes)}
        for k, block in enumerate(self.blocks):
            nb = len(next(iter(self._fp.values())))
            data = BlockData(block=block, device=self.device, _store=self.store, algorithm=self.algorithm,
                             fp_inputs=[tuple(self._fp[n][b] for n in block.inputs) for b in range(nb)],
                             q_inputs=[tuple(self._q[n][b] for n in block.inputs) for b in range(nb)])
            yield data
            fp_out = data.fp_outputs
            q_out = data.q_outputs if data.q_outputs is not None else run_block(block.module, data, quantized=True,
                                                                                 store=self.store)
            for i, node in enumerate(block.outputs):
                self._fp[node] = [o[i] for o in fp_out]
                self._q[node] = [o[i] for o in q_out]
            self._account()
            data._fp_outputs = data.q_outputs = None
            del data, fp_out, q_out
            if k + 1 < len(self.blocks):
                next_first = order[self.blocks[k + 1].nodes[0]]
                for table in (self._fp, self._q):
                    for node in [n for n in table if all(order[u] < next_first for u in n.users)]:
                        del table[node]


# --------------------------------------------------------------------------- FP32 weights
@contextlib.contextmanager
def unbaked(gm: fx.GraphModule) -> Iterator[fx.GraphModule]:
    """Work on FP32 parameters through the weight quantizers; re-align, re-derive biases and re-bake after.

    Every parameter of ``gm`` is frozen (``requires_grad=False``) inside the block; algorithms switch on
    what they train. Aligned quantizers are re-aligned and passive (bias) parameters re-derived on exit,
    since learned scales may have moved.
    """
    was_baked = is_baked(gm)
    grads = {p: p.requires_grad for p in gm.parameters()}
    unbake_parameters(gm)
    for p in grads:
        p.requires_grad_(False)
    try:
        yield gm
    finally:
        for p, flag in grads.items():
            p.requires_grad_(flag)
            p.grad = None
        apply_alignment(gm)
        derive_passive_parameters(gm)
        if was_baked:
            bake_parameters(gm)
