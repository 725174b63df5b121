"""The Triton kernels against the torch reference, bit for bit, plus opcheck of the ``fxq::`` ops.

Kernels run in Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1``, set by conftest), or on a GPU
when ``FXQ_TEST_TRITON_GPU=1``. Tensors are small (the interpreter is slow) but span several blocks and
end in a partial one.
"""
from __future__ import annotations

import logging
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import fxq.ops  # noqa: F401  (registers torch.ops.fxq)
from fxq import functional as F
from fxq.spec import FloatFormat, RoundingPolicy

pytest.importorskip("triton")
pytest.importorskip("numpy")  # the interpreter needs it

from fxq.triton_kernels import _LazyKernel, register_cuda_kernels, triton_kernels_available  # noqa: E402
from fxq.triton_kernels import floating as FK  # noqa: E402
from fxq.triton_kernels import linear as LK  # noqa: E402

ON_GPU = os.environ.get("FXQ_TEST_TRITON_GPU") == "1"
if ON_GPU and not torch.cuda.is_available():
    pytest.skip("FXQ_TEST_TRITON_GPU=1 but no CUDA device", allow_module_level=True)
DEV = "cuda" if ON_GPU else "cpu"

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy: inf - inf inside the interpreter

POLICIES = list(RoundingPolicy)
SHAPE = (3, 5, 131)  # 1965 elements: two blocks of 1024, the second partial
# (name, axis, channel count): per-tensor and per-channel on every axis of SHAPE
LAYOUTS = [("tensor", 0, 1), ("axis0", 0, 3), ("axis1", 1, 5), ("axis-1", -1, 131)]
RANGES = [("int8", -128, 127), ("uint8", 0, 255)]
_BITS = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16}
_BITS[torch.bfloat16] = torch.int16


def assert_bit_identical(actual: torch.Tensor | None, expected: torch.Tensor | None, what: str = "") -> None:
    """Same dtype, shape, values (torch.equal; NaN where NaN) and bit patterns, except the sign of zero."""
    if expected is None:
        assert actual is None, what
        return
    actual = actual.cpu()
    expected = expected.cpu()
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    nan = expected.isnan()
    assert torch.equal(actual.isnan(), nan), f"{what}: NaN positions differ"
    a, e = actual[~nan], expected[~nan]
    assert torch.equal(a, e), f"{what}: {int((a != e).sum())} values differ, e.g. {a[a != e][:4]} vs {e[a != e][:4]}"
    zero = e == 0
    assert torch.equal(a[~zero].view(_BITS[a.dtype]), e[~zero].view(_BITS[e.dtype])), f"{what}: bit patterns differ"


def _on_dev(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Arguments for a backward reference: on the kernel's device. The scale / offset gradients are the
    reference's own torch sum of the kernel's elementwise products, and torch sums in another order on CUDA than
    on CPU (last-bit differences): the kernels match the reference run where they run. Elementwise results
    (forward, grad_x, the products) are compared with the CPU reference too."""
    return tuple(t.to(DEV) for t in tensors)


def _params(channels: int, quant_min: int, quant_max: int, pow2: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales (powers of two, so that x = (k + 1/2) * s divides to an exact tie) and integer offsets."""
    if pow2:
        scale = torch.pow(2.0, -torch.arange(channels) % 5 - 2.0)
    else:
        scale = torch.rand(channels) * 0.3 + 0.01
    offset = torch.zeros(channels) if quant_min < 0 else torch.randint(0, 40, (channels,)).float()
    return scale, offset


def _special_values(scale: torch.Tensor, axis: int, quant_min: int, quant_max: int) -> torch.Tensor:
    """Random values plus exact ties (+-0.5, +-1.5, +-2.5 after scaling), +-0, and clipping at both ends."""
    x = torch.randn(SHAPE) * (quant_max - quant_min) / 4
    s = F.broadcast_qparam(scale, x, axis).expand(SHAPE)
    flat_x = x.reshape(-1)
    flat_s = s.reshape(-1)
    ties = torch.tensor([0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 3.5, -3.5, 126.5, -127.5])
    specials = torch.cat(
        [ties, torch.tensor([0.0, -0.0, 0.25, -0.25, 1e6, -1e6, quant_max + 3.0, quant_min - 3.0])]
    )
    idx = torch.randperm(flat_x.numel())[: 3 * specials.numel()]
    flat_x[idx] = specials.repeat(3) * flat_s[idx]
    flat_x[-1] = -0.0
    flat_x[1023] = 0.5 * flat_s[1023]  # last element of the first block
    return x


# --------------------------------------------------------------------------- linear
@pytest.mark.parametrize("rng", RANGES, ids=[r[0] for r in RANGES])
@pytest.mark.parametrize("layout", LAYOUTS, ids=[lay[0] for lay in LAYOUTS])
@pytest.mark.parametrize("policy", POLICIES, ids=[p.name for p in POLICIES])
def test_linear_forward_and_backward_bit_identical(policy, layout, rng):
    _, axis, channels = layout
    _, qmin, qmax = rng
    scale, offset = _params(channels, qmin, qmax)
    x = _special_values(scale, axis, qmin, qmax)
    g = torch.randn(SHAPE)
    args = (axis, qmin, qmax, int(policy))
    xd, gd, sd, od = (t.to(DEV) for t in (x, g, scale, offset))

    want_y = F.linear_fake_quantize_reference(x, scale, offset, *args)
    assert_bit_identical(LK.linear_forward(xd, sd, od, *args), want_y, "y")
    got = LK.fake_quant_linear_backward_triton(gd, xd, sd, od, *args, True, True)
    want = F.linear_fake_quantize_backward_reference(*_on_dev(g, x, scale, offset), *args, True, True)
    for name, a, e in zip(("grad_x", "grad_scale", "grad_offset"), got, want):
        assert_bit_identical(a, e, name)
    # the elementwise products too, and what the kernel leaves out when a gradient is not needed
    got = LK.linear_backward_elementwise(gd, xd, sd, od, *args, True, False)
    want = F.linear_fake_quantize_backward_elementwise(g, x, scale, offset, *args, True, False)
    for name, a, e in zip(("grad_x", "g*ds", "g*do"), got, want):
        assert_bit_identical(a, e, name)


@pytest.mark.parametrize(
    "policy", [RoundingPolicy.HALF_EVEN, RoundingPolicy.HALF_TOWARDS_ZERO, RoundingPolicy.UP], ids=lambda p: p.name
)
def test_linear_nonpow2_scale_nan_inf_and_inexact_fraction(policy):
    """Scales that are not powers of two, NaN/inf, subnormals, and v = -0.5 + 2**-25 (v - floor(v) rounds to 0.5)."""
    scale, offset = _params(5, 0, 255, pow2=False)
    x = torch.randn(SHAPE) * 20
    inf, nan = float("inf"), float("nan")
    x.view(-1)[:8] = torch.tensor([nan, inf, -inf, -0.5 + 2**-25, 0.5 - 2**-25, -0.0, 3e38, -3e38]) * scale[0]
    if not (ON_GPU and policy in DIRECTED):  # see test_subnormals_under_directed_rounding
        x.view(-1)[8:12] = torch.tensor([1e-40, -1e-40, 1e-45, -3e-39])  # subnormal: no flush-to-zero allowed
    args = (1, 0, 255, int(policy))
    want = F.linear_fake_quantize_reference(x, scale, offset, *args)
    assert_bit_identical(LK.linear_forward(x.to(DEV), scale.to(DEV), offset.to(DEV), *args), want)
    g = torch.randn(SHAPE)
    got = LK.fake_quant_linear_backward_triton(g.to(DEV), x.to(DEV), scale.to(DEV), offset.to(DEV), *args, True, True)
    want = F.linear_fake_quantize_backward_reference(*_on_dev(g, x, scale, offset), *args, True, True)
    for a, e in zip(got, want):
        assert_bit_identical(a, e)


DIRECTED = (RoundingPolicy.UP, RoundingPolicy.DOWN)


@pytest.mark.xfail(ON_GPU, strict=True, reason="Triton compiles float32 arithmetic with flush-to-zero on NVIDIA GPUs "
                   "(seen on an H100, Triton 3.6): a subnormal x counts as 0, which only directed rounding can tell")
@pytest.mark.parametrize("policy", DIRECTED, ids=lambda p: p.name)
def test_subnormals_under_directed_rounding(policy):
    """A subnormal x (|x| < 2**-126) rounds UP / DOWN to one step away from 0, as in torch, where the kernels keep
    subnormals: in the CPU interpreter. On a GPU the kernels see 0 (module docstring of fxq.triton_kernels)."""
    scale, offset = torch.tensor([0.15]), torch.tensor([0.0])
    x = torch.tensor([1e-40, -1e-40, 1e-45, -3e-39] * 300)
    want = F.linear_fake_quantize_reference(x, scale, offset, 0, -128, 127, int(policy))
    assert int((want != 0).sum()) == 600  # the reference keeps them: one step up (UP) or down (DOWN)
    assert_bit_identical(LK.linear_forward(x.to(DEV), scale.to(DEV), offset.to(DEV), 0, -128, 127, int(policy)), want)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "policy", [RoundingPolicy.HALF_EVEN, RoundingPolicy.HALF_UP, RoundingPolicy.TO_NEAR_INT], ids=lambda p: p.name
)
def test_linear_other_dtypes_bit_identical(dtype, policy):
    """float64 and the 16-bit dtypes: every step rounded to the input dtype, as torch does."""
    scale, offset = _params(5, 0, 255, pow2=False)
    x = (_special_values(scale, 1, 0, 255)).to(dtype)
    g = torch.randn(SHAPE).to(dtype)
    args = (1, 0, 255, int(policy))
    assert_bit_identical(
        LK.linear_forward(x.to(DEV), scale.to(DEV), offset.to(DEV), *args),
        F.linear_fake_quantize_reference(x, scale, offset, *args),
    )
    got = LK.fake_quant_linear_backward_triton(g.to(DEV), x.to(DEV), scale.to(DEV), offset.to(DEV), *args, True, True)
    want = F.linear_fake_quantize_backward_reference(*_on_dev(g, x, scale, offset), *args, True, True)
    for a, e in zip(got, want):
        assert_bit_identical(a, e)


def test_linear_scalar_offset_with_per_channel_scale_and_empty():
    scale, _ = _params(131, -128, 127)
    offset = torch.tensor([0.0])
    x = _special_values(scale, -1, -128, 127)
    args = (-1, -128, 127, 0)
    want = F.linear_fake_quantize_reference(x, scale, offset, *args)
    assert_bit_identical(LK.linear_forward(x.to(DEV), scale.to(DEV), offset.to(DEV), *args), want)
    empty = torch.empty(0, 4, device=DEV)
    assert LK.linear_forward(empty, scale[:1].to(DEV), offset.to(DEV), 0, -128, 127, 0).shape == (0, 4)


def test_linear_op_impl_falls_back_to_reference():
    """Non-contiguous input and wrong channel counts take the reference (and its error)."""
    scale, offset = _params(5, -128, 127)
    x = torch.randn(5, 131).t()  # non-contiguous, channels on axis 1
    args = (1, -128, 127, 0)
    y = LK.fake_quant_linear_triton(x.to(DEV), scale.to(DEV), offset.to(DEV), *args)
    assert_bit_identical(y, F.linear_fake_quantize_reference(x, scale, offset, *args))
    assert LK.linear_layout(x, scale, offset, 1, -128, 127) is None
    with pytest.raises(RuntimeError):
        LK.fake_quant_linear_triton(torch.randn(4, 7, device=DEV), scale.to(DEV), offset.to(DEV), 1, -128, 127, 0)
    with pytest.raises(fxq.NotSupportedError, match="contiguous"):
        LK.linear_forward(x.to(DEV), scale.to(DEV), offset.to(DEV), *args)


# --------------------------------------------------------------------------- floating (FP8)
@pytest.mark.parametrize("fmt", list(FloatFormat), ids=[f.name for f in FloatFormat])
@pytest.mark.parametrize("layout", [LAYOUTS[0], LAYOUTS[2]], ids=["tensor", "axis1"])
@pytest.mark.parametrize("policy", POLICIES, ids=[p.name for p in POLICIES])
def test_float_forward_and_backward_bit_identical(policy, layout, fmt):
    _, axis, channels = layout
    scale = torch.rand(channels) * 0.01 + 1e-3
    x = torch.randn(SHAPE) * fmt.max_value * 1e-3 * 3
    flat = x.view(-1)
    flat[:6] = torch.tensor([0.0, -0.0, 1e-12, -1e30, 1e30, float("nan")])
    flat[6:12] = torch.tensor([1.0625, -1.0625, 1.1875, 2.5, -2.5, 0.0009765625]) * 1e-3  # mantissa ties
    g = torch.randn(SHAPE)
    args = (axis, fmt.mantissa_bits, fmt.min_exponent, fmt.max_value, int(policy))
    xd, gd, sd = x.to(DEV), g.to(DEV), scale.to(DEV)
    assert_bit_identical(FK.float_forward(xd, sd, *args), F.float_fake_quantize_reference(x, scale, *args), "y")
    got = FK.fake_quant_float_backward_triton(gd, xd, sd, *args, True)
    want = F.float_fake_quantize_backward_reference(*_on_dev(g, x, scale), *args, True)
    for name, a, e in zip(("grad_x", "grad_scale"), got, want):
        assert_bit_identical(a, e, name)
    assert_bit_identical(got[0], F.float_fake_quantize_backward_reference(g, x, scale, *args, True)[0], "grad_x, CPU")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16], ids=str)
def test_float_other_dtypes_bit_identical(dtype):
    scale = torch.rand(5) * 0.01 + 1e-3
    x = (torch.randn(SHAPE) * 0.5).to(dtype)
    g = torch.randn(SHAPE).to(dtype)
    args = (1, 3, -6, 448.0, int(RoundingPolicy.HALF_EVEN))
    want = F.float_fake_quantize_reference(x, scale, *args)
    assert_bit_identical(FK.float_forward(x.to(DEV), scale.to(DEV), *args), want)
    got = FK.fake_quant_float_backward_triton(g.to(DEV), x.to(DEV), scale.to(DEV), *args, True)
    want = F.float_fake_quantize_backward_reference(*_on_dev(g, x, scale), *args, True)
    for a, e in zip(got, want):
        assert_bit_identical(a, e)


# --------------------------------------------------------------------------- registration
def test_register_cuda_kernels_is_idempotent():
    assert triton_kernels_available()
    assert register_cuda_kernels() and register_cuda_kernels()


def test_lazy_kernel_falls_back_when_triton_is_unusable(caplog):
    kernel = _LazyKernel("fxq::fake_quant_linear", "no_such_module", "nothing", F.linear_fake_quantize_reference)
    x, s, o = torch.randn(10), torch.tensor([0.1]), torch.tensor([0.0])
    with caplog.at_level(logging.WARNING, logger="fxq.triton_kernels"):
        y = kernel(x, s, o, 0, -128, 127, 0)
    assert torch.equal(y, F.linear_fake_quantize_reference(x, s, o, 0, -128, 127, 0))
    assert "torch reference" in caplog.text


def test_import_fxq_without_triton():
    """``import fxq`` and the CPU ops work when triton cannot be imported."""
    code = textwrap.dedent(
        """
        import sys
        sys.modules["triton"] = None  # makes 'import triton' raise ImportError
        import torch, fxq, fxq.ops
        y = torch.ops.fxq.fake_quant_linear(torch.randn(8), torch.tensor([0.1]), torch.tensor([0.0]), 0, -128, 127, 0)
        print("ok", y.shape[0])
        """
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "ok 8" in done.stdout


# --------------------------------------------------------------------------- opcheck (CPU)
def _opcheck(op, args):
    torch.library.opcheck(op, args)


def test_opcheck_fake_quant_linear():
    x = torch.randn(4, 6, requires_grad=True)
    scale = (torch.rand(6) * 0.1 + 0.01).requires_grad_(True)
    offset = torch.zeros(6, requires_grad=True)
    _opcheck(torch.ops.fxq.fake_quant_linear.default, (x, scale, offset, 1, -128, 127, 0))
    _opcheck(torch.ops.fxq.fake_quant_linear.default, (x, scale[:1], offset[:1], 0, 0, 255, 3))


def test_opcheck_fake_quant_linear_backward():
    x, g = torch.randn(4, 6), torch.randn(4, 6)
    scale, offset = torch.rand(6) * 0.1 + 0.01, torch.zeros(6)
    _opcheck(torch.ops.fxq.fake_quant_linear_backward.default, (g, x, scale, offset, 1, -128, 127, 0, True, True))


def test_opcheck_fake_quant_float():
    x = torch.randn(4, 6, requires_grad=True)
    scale = (torch.rand(4) * 0.01 + 1e-3).requires_grad_(True)
    _opcheck(torch.ops.fxq.fake_quant_float.default, (x, scale, 0, 3, -6, 448.0, 0))


def test_opcheck_fake_quant_float_backward():
    x, g = torch.randn(4, 6), torch.randn(4, 6)
    scale = torch.rand(4) * 0.01 + 1e-3
    _opcheck(torch.ops.fxq.fake_quant_float_backward.default, (g, x, scale, 0, 2, -14, 57344.0, 1, True))


@pytest.mark.parametrize("name", ["fake_quant_linear", "fake_quant_float"])
def test_eager_cuda_function_matches_the_op(name):
    """The autograd.Function that ``fxq.ops`` records for plain eager CUDA calls with gradients (the Triton kernels
    without the dispatcher, :data:`fxq.ops._EAGER_CUDA`): the op's values and gradients, bit for bit. On CPU
    its kernels run in Triton's interpreter."""
    from fxq import ops

    shape = (4, 6, 9, 9)
    weights = torch.arange(float(math.prod(shape))).view(shape).remainder(5).to(DEV)
    x0 = torch.randn(shape) * 3
    s0 = torch.rand(6) * 0.05 + 0.01
    attrs = (1, -128, 127, int(RoundingPolicy.HALF_EVEN)) if name == "fake_quant_linear" else (1, 3, -6, 448.0, 0)
    results = []
    for call in (ops._EAGER_CUDA[name].apply, getattr(torch.ops.fxq, name)):
        x = x0.to(DEV).requires_grad_(True)
        scale = s0.to(DEV).requires_grad_(True)
        params = (scale, torch.zeros(6, device=DEV)) if name == "fake_quant_linear" else (scale,)
        y = call(x, *params, *attrs)
        (y * weights).sum().backward()
        results.append((y.detach(), x.grad, scale.grad))
    for got, want, what in zip(results[0], results[1], ("y", "grad_x", "grad_scale")):
        assert_bit_identical(got, want, what)


@pytest.mark.parametrize("name", ["fake_quant_linear", "fake_quant_float"])
@pytest.mark.parametrize("per_channel", [False, True], ids=["tensor", "channel"])
def test_bound_launch_runs_the_op_and_holds_only_for_the_same_call(name, per_channel, caplog):
    """A bound forward call (what ``fxq.fake_quantize`` keeps per quantizer on CUDA: the op's kernel launched
    without the op's dispatch, checks and preparation) gives the op's values bit for bit, sees later in-place
    changes of its parameters, and declines (None) every call it was not made for. On a GPU the compiled
    kernel's own launcher must have been found to agree with Triton's launch (on CPU the interpreter has none).
    Another alignment of ``x`` or a resized parameter is another call."""
    from fxq.triton_kernels import floating as FK

    shape = (2, 6, 5, 7)
    x = (torch.randn(shape) * 3).to(DEV)
    channels = 6 if per_channel else 1
    scale = (torch.rand(channels) * 0.05 + 0.01).to(DEV)
    if name == "fake_quant_linear":
        params, attrs, binder = (scale, torch.zeros(channels, device=DEV)), (1, -128, 127, 0), LK.bind_fake_quant_linear
    else:
        params, attrs, binder = (scale,), (1, 3, -6, 448.0, 0), FK.bind_fake_quant_float
    op = getattr(torch.ops.fxq, name)
    tag = ("tag",)
    with caplog.at_level(logging.DEBUG, logger="fxq.triton_kernels.common"):
        bound = binder((x, *params, *attrs), tag)
    assert bound is not None
    if ON_GPU:
        assert bound.runner is not None, f"the compiled kernel's launcher was not taken: {caplog.text}"
    for _ in range(2):
        x2 = (torch.randn(shape) * 3).to(DEV)
        assert_bit_identical(bound.run(x2, params, tag), op(x2, *params, *attrs), "bound call")
    with torch.no_grad():
        scale.mul_(2.0)  # observers and optimizers update parameters in place: the binding reads them
    assert_bit_identical(bound.run(x, params, tag), op(x, *params, *attrs), "after an in-place update")
    assert bound.run(x, params, ("other",)) is None
    assert bound.run(x[:1].contiguous(), params, tag) is None
    assert bound.run(x.transpose(2, 3), params, tag) is None
    assert bound.run(x.double(), params, tag) is None
    assert bound.run(x, (scale.clone(), *params[1:]), tag) is None
    flat = torch.empty(x.numel() + 1, device=DEV)
    flat[1:].copy_(x.reshape(-1))
    assert bound.run(flat[1:].view(shape), params, tag) is None  # 4 bytes off: Triton's kernel for it is another
    scale.requires_grad_(True)
    assert bound.run(x, params, tag) is None  # a call that needs gradients goes through autograd
    with torch.no_grad():
        assert bound.run(x, params, tag) is not None
    scale.requires_grad_(False)
    if per_channel:
        with torch.no_grad():
            scale.resize_(1)  # the same storage, fewer entries than the layout was made for
        assert bound.run(x, params, tag) is None
    scale.data = scale.detach().clone()  # the storage replaced behind the same tensor
    assert bound.run(x, params, tag) is None


def test_bind_declines_parameters_it_would_copy():
    """A scalar offset with a per-channel scale is expanded into a copy for the kernel: a binding would never see
    the offset change, so there is none."""
    x = torch.randn(2, 6, 5).to(DEV)
    args = (x, (torch.rand(6) * 0.05 + 0.01).to(DEV), torch.zeros(1, device=DEV), 1, -128, 127, 0)
    assert LK.bind_fake_quant_linear(args, ()) is None
    assert LK.bind_fake_quant_linear((x[:0], *args[1:]), ()) is None  # empty: nothing to launch


@pytest.mark.parametrize("layout", LAYOUTS[1:], ids=[lay[0] for lay in LAYOUTS[1:]])
def test_per_channel_index_in_64_bits_agrees(layout, monkeypatch):
    """Per-channel kernels index the parameter with 32-bit arithmetic per element where a block's channel
    arithmetic fits (:attr:`ChannelLayout.code` 1) and in 64 bits otherwise (code 2, which only tensors of more
    than 2**31 elements per channel reach): the 64-bit path, forced here, gives the same bits. (Code 3, channels of
    at least a block, is the axis-0 layout of the other tests.)"""
    from fxq.triton_kernels.common import ChannelLayout

    _, axis, channels = layout
    scale, offset = _params(channels, -128, 127)
    x = torch.randn(SHAPE) * 4
    want = F.linear_fake_quantize_reference(x, scale, offset, axis, -128, 127, 0)
    fmt = FloatFormat.E4M3
    want_fp = F.float_fake_quantize_reference(x, scale, axis, fmt.mantissa_bits, fmt.min_exponent, fmt.max_value, 0)
    assert LK.linear_layout(x, scale, offset, axis, -128, 127).code == (3 if math.prod(SHAPE[axis % len(SHAPE) + 1:]) >= 1024
                                                                          else 1)
    monkeypatch.setattr(ChannelLayout, "code", property(lambda self: 2 if self.per_channel else 0))
    xd, sd, od = x.to(DEV), scale.to(DEV), offset.to(DEV)
    assert_bit_identical(LK.linear_forward(xd, sd, od, axis, -128, 127, 0), want, "linear, 64-bit index")
    got_fp = FK.float_forward(xd, sd, axis, fmt.mantissa_bits, fmt.min_exponent, fmt.max_value, 0)
    assert_bit_identical(got_fp, want_fp, "float, 64-bit index")


@pytest.mark.parametrize("shape,axis", [((3, 1500), 0), ((2, 3, 1100), 1), ((2, 3, 2048), 1)],
                         ids=["axis0", "wraps", "whole-blocks"])
def test_per_channel_channels_of_a_block_or_more(shape, axis):
    """Channels of at least a block (:attr:`ChannelLayout.code` 3: a comparison per element finds the channel),
    blocks that cross into the next channel and wrap from the last channel to the first: the reference's bits."""
    channels = shape[axis]
    scale, offset = _params(channels, -128, 127)
    x = torch.randn(shape) * 4
    g = torch.randn(shape)
    assert LK.linear_layout(x, scale, offset, axis, -128, 127).code == 3
    xd, gd, sd, od = x.to(DEV), g.to(DEV), scale.to(DEV), offset.to(DEV)
    assert_bit_identical(LK.linear_forward(xd, sd, od, axis, -128, 127, 0),
                         F.linear_fake_quantize_reference(x, scale, offset, axis, -128, 127, 0), "linear forward")
    got = LK.linear_backward_elementwise(gd, xd, sd, od, axis, -128, 127, 0, True, True)
    want = F.linear_fake_quantize_backward_elementwise(g, x, scale, offset, axis, -128, 127, 0, True, True)
    for name, a, e in zip(("grad_x", "g*ds", "g*do"), got, want):
        assert_bit_identical(a, e, name)
    fmt = FloatFormat.E4M3
    fp_args = (axis, fmt.mantissa_bits, fmt.min_exponent, fmt.max_value, 0)
    assert_bit_identical(FK.float_forward(xd, sd, *fp_args),
                         F.float_fake_quantize_reference(x, scale, *fp_args), "float forward")
