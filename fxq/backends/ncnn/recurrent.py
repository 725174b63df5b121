"""ncnn ``LSTM`` / ``GRU`` layers for ``fxq::lstm`` / ``fxq::gru`` nodes, in FP32 (ncnn_int8 keeps them FP32).

ncnn runs one sequence: its recurrent layers read a ``(T, input)`` blob (the op's ``[T, 1, I]`` input without its
batch of 1) and write ``(T, D*H)``, the directions side by side; the states are ``(D, H)`` blobs. Weights are the
ONNX ones with ncnn's gate order (LSTM: I F O G; GRU: R U N) and biases summed where ncnn has one per gate
(LSTM: four ``W_b + R_b`` rows; GRU: ``R``, ``U`` summed, ``N``'s two kept apart, as torch's GRU computes them).
The states come in as extra bottoms (zeros from a ``MemoryData`` when the node takes none but its final states are
used) and go out as extra tops.
"""
from __future__ import annotations

import operator

import numpy as np
from torch import fx

from fxq.backends.ncnn.builder import NcnnBuilder
from fxq.backends.ncnn.registry import register_ncnn_converter

__all__: list[str] = []

_NCNN_GATES = {"LSTM": (0, 2, 1, 3), "GRU": (1, 0, 2)}  # ONNX gate index of each ncnn gate


def _gates(t: np.ndarray, order: tuple[int, ...], hidden: int) -> np.ndarray:
    """``[D, G*H, ...]`` rows regrouped gate by gate in ``order``."""
    return np.concatenate([t[:, g * hidden:(g + 1) * hidden] for g in order], axis=1)


def _weights(kind: str, w: np.ndarray, r: np.ndarray, bias: np.ndarray, hidden: int) -> list[tuple[str, np.ndarray]]:
    order = _NCNN_GATES[kind]
    gates = len(order)
    wb, rb = bias[:, :gates * hidden].reshape(-1, gates, hidden), bias[:, gates * hidden:].reshape(-1, gates, hidden)
    if kind == "LSTM":
        b = (wb + rb)[:, list(order)]  # [D, 4, H]
    else:  # R, U summed; N's input and hidden biases apart (the hidden one is scaled by the reset gate)
        z, rr, n = 0, 1, 2
        b = np.stack([wb[:, rr] + rb[:, rr], wb[:, z] + rb[:, z], wb[:, n], rb[:, n]], axis=1)
    return [("tagged", np.ascontiguousarray(_gates(w, order, hidden), dtype=np.float32)),
            ("tagged", np.ascontiguousarray(b, dtype=np.float32)),
            ("tagged", np.ascontiguousarray(_gates(r, order, hidden), dtype=np.float32))]


@register_ncnn_converter("LSTM", "GRU", any_batch_dim=True, multi_output=True)
def _recurrent(b: NcnnBuilder, node: fx.Node) -> None:
    kind = b.op(node)
    args = list(node.args)
    x, w_arg, r_arg, b_arg = args[:4]
    states = list(args[4:6] if kind == "LSTM" else args[4:5])
    hidden, direction = (args[6], args[7]) if kind == "LSTM" else (args[5], args[6])
    if kind == "GRU" and not args[7]:
        raise b.fail(node, "ncnn's GRU computes the candidate as torch does (linear_before_reset=1); this node has "
                     "linear_before_reset=0", "export the model for 'ort_int8' / 'trt_int8'")
    dirs = 2 if direction == "bidirectional" else 1
    if b.shape(x)[1] != 1:  # the writer exports at batch 1: these are sequences the model folds into its batch
        raise b.fail(node, f"its input of shape {b.shape(x)} (time, sequences, features) runs {b.shape(x)[1]} "
                     f"sequences at once (the model folds them into the batch, as Sequencer's rows), and ncnn's "
                     f"{kind} runs one sequence at a time", f"run the {kind} over one sequence per call, or deploy "
                     "with trt_int8 / ort_int8, whose ONNX LSTM / GRU take a batch of sequences")
    w, r, bias = (b.param(a, node, what).numpy() for a, what in ((w_arg, "W"), (r_arg, "R"), (b_arg, "B")))
    users = {u.args[1]: u for u in node.users if u.op == "call_function" and u.target is operator.getitem}
    want_states = any(i in users for i in (1, 2))
    bottoms = [b.blob(x, node)]
    if want_states or any(s is not None for s in states):
        def state(value: np.ndarray) -> str:  # an initial state the file stores: ncnn's (D, H) layout
            return b.helper(node, "MemoryData", [], {0: hidden, 1: dirs}, [("raw", value.reshape(dirs, hidden))])

        zeros = None
        for s in states:
            if s is None:  # zeros, stored once for both states
                zeros = zeros or state(np.zeros((dirs, hidden), dtype=np.float32))
                bottoms.append(zeros)
            elif b.is_constant(s):  # a stored initial state [D, 1, H] (torch 1.x's zeros made in forward)
                value = b.fixed_value(s).detach().float()
                if value.numel() != dirs * hidden:
                    raise b.fail(node, f"its initial state {s.name!r} has shape {tuple(value.shape)}, not "
                                 f"[{dirs}, 1, {hidden}]", "export at batch 1")
                bottoms.append(state(np.ascontiguousarray(value.numpy())))
            else:
                bottoms.append(b.blob(s, node))
    n_tops = len(bottoms)
    layer = b.add_layer(node, kind, bottoms, {0: hidden, 1: int(w.size), 2: {"forward": 0, "reverse": 1}.get(
        direction, 2)}, _weights(kind, w, r, bias, hidden), n_tops=n_tops)
    if 0 in users:  # Y [T, D, 1, H]: ncnn's (T, D*H) as a (T, D, H) blob, the value's own shape without its batch
        y = b.helper(node, "Reshape", [layer.tops[0]], {0: hidden, 1: dirs, 2: int(b.shape(users[0])[0])})
        b._set_blob(users[0], y, 2)
    for index in (1, 2)[: n_tops - 1]:
        if index in users:  # Y_h / Y_c [D, 1, H]: ncnn's (D, H)
            b._set_blob(users[index], layer.tops[index], 1)
