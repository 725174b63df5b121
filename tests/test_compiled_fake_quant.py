"""Inside ``torch.compile`` the fake-quant is the reference's own aten ops (fused by inductor): the values are the
eager ``fxq::`` op's, bit for bit, for every rounding policy, per tensor and per channel, linear and FP8; the STE
gradient of x is identical and the LSQ scale / offset gradients equal up to the order of the sum."""
from __future__ import annotations

import pytest
import torch

from fxq import ops
from fxq.spec import FloatFormat, RoundingPolicy

pytestmark = pytest.mark.usefixtures("one_thread")

POLICIES = [int(p) for p in RoundingPolicy]


def _inputs(per_channel: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 8, 5, 5, generator=gen) * 3
    shape = (8,) if per_channel else (1,)
    scale = torch.rand(shape, generator=gen) * 0.05 + 0.01
    offset = torch.randint(-3, 4, shape, generator=gen).float()
    # exact ties and values far outside the grid
    x[0, :, 0, 0] = (torch.arange(8) - 4.0 + 0.5) * scale.expand(8)
    x[0, :, 0, 1] = 1e4
    return x, scale, offset


def _linear_all(x, s_pt, o_pt, s_pc, o_pc):
    """Every policy, per tensor and per channel (axis 1): one compiled graph."""
    return tuple(ops.fake_quant_linear(x, s, o, 1, -128, 127, p) for s, o in ((s_pt, o_pt), (s_pc, o_pc))
                 for p in POLICIES)


def test_linear_forward_and_backward_match_the_op():
    x_pt, s_pt, o_pt = _inputs(False)
    x_pc, s_pc, o_pc = _inputs(True)
    x = torch.cat([x_pt, x_pc])  # exact ties of both the per-tensor and the per-channel grids
    compiled = torch.compile(_linear_all, fullgraph=True)
    leaves_e = [t.clone().requires_grad_(True) for t in (x, s_pt, o_pt, s_pc, o_pc)]
    leaves_c = [t.clone().requires_grad_(True) for t in (x, s_pt, o_pt, s_pc, o_pc)]
    eager = _linear_all(*leaves_e)
    got = compiled(*leaves_c)
    names = [f"{kind} {RoundingPolicy(p).name}" for kind in ("per-tensor", "per-channel") for p in POLICIES]
    for name, e, c in zip(names, eager, got):
        assert torch.equal(e, c), name
    weights = torch.randn(len(eager), *x.shape, generator=torch.Generator().manual_seed(1))
    sum((w * e).sum() for w, e in zip(weights, eager)).backward()
    sum((w * c).sum() for w, c in zip(weights, got)).backward()
    assert torch.equal(leaves_e[0].grad, leaves_c[0].grad)  # straight-through: elementwise, exact
    for e, c in zip(leaves_e[1:], leaves_c[1:]):  # LSQ sums: same terms, maybe another order
        torch.testing.assert_close(c.grad, e.grad, rtol=1e-5, atol=1e-6)


def test_float_forward_and_backward_match_the_op():
    x, scale, _ = _inputs(True)
    fmt = FloatFormat.E4M3

    def f(x, scale):
        return tuple(ops.fake_quant_float(x, scale, 1, fmt.mantissa_bits, fmt.min_exponent, fmt.max_value, p)
                     for p in (0, 4))

    compiled = torch.compile(f, fullgraph=True)
    xe, se = x.clone().requires_grad_(True), scale.clone().requires_grad_(True)
    xc, sc = x.clone().requires_grad_(True), scale.clone().requires_grad_(True)
    eager, got = f(xe, se), compiled(xc, sc)
    for e, c in zip(eager, got):
        assert torch.equal(e, c)
    sum(e.sum() for e in eager).backward()
    sum(c.sum() for c in got).backward()
    assert torch.equal(xe.grad, xc.grad)
    torch.testing.assert_close(sc.grad, se.grad, rtol=1e-5, atol=1e-6)


def test_compiled_graph_has_no_opaque_fake_quant():
    """Inductor sees aten ops, not the fxq:: op (which it cannot fuse), in the forward and the backward graph."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    seen: list[object] = []

    def capture(gm, example_inputs):
        seen.extend(n.target for n in gm.graph.nodes if n.op == "call_function")
        return make_boxed_func(gm.forward)

    x, scale, offset = _inputs(False)
    x.requires_grad_(True)
    scale.requires_grad_(True)
    torch._dynamo.reset()
    f = torch.compile(lambda x, s: ops.fake_quant_linear(x, s, offset, 0, -128, 127, 0),
                      backend=aot_autograd(fw_compiler=capture, bw_compiler=capture), fullgraph=True)
    f(x, scale).sum().backward()
    assert seen and scale.grad is not None
    assert all(isinstance(t, torch._ops.OpOverload) and t.namespace in ("aten", "prims") for t in seen), seen


def test_dynamo_records_one_call_per_fake_quant():
    """dynamo records each CPU fake-quant as one call instead of speculating its autograd.Function (forward and
    backward) at every call site: that was two thirds of dynamo's time on a QAT ResNet-18 and 1.3x the compile
    time of its FP32 model. AOTAutograd then traces the call into aten ops (test above)."""
    from fxq.ops import _traced

    calls: list[object] = []

    def backend(gm, example_inputs):
        calls.extend(n.target for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    x, scale, offset = _inputs(False)
    torch._dynamo.reset()
    f = torch.compile(lambda x: ops.fake_quant_linear(ops.fake_quant_linear(x, scale, offset, 0, -128, 127, 0),
                                                      scale, offset, 0, -128, 127, 1),
                      backend=backend, fullgraph=True)
    eager = ops.fake_quant_linear(ops.fake_quant_linear(x, scale, offset, 0, -128, 127, 0), scale, offset, 0, -128,
                                  127, 1)
    assert torch.equal(f(x), eager)
    assert calls.count(_traced) == 2, calls
