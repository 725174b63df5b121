"""Tracing, graph passes, dispatch, placement rules per platform, calibration inputs, switching."""
import operator
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxq
from fxq.graph.info import NodeQuant, is_quantizer_node
from fxq.graph.quant_graph import QuantGraph, quantizer_name
from fxq.spec import QuantState

from _export_helpers import fx_values, run_ort
from _models import noise_ratio, small_cnn


def _data(shape=(2, 3, 16, 16), n=2):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(*shape, generator=g) for _ in range(n)]


def _quantizers_by_role(q, role):
    infos = QuantGraph(q).infos()
    return {n: fq for n, fq in q.fxq_quantizers.items() if infos[n].role == role}


def _node(q, name):
    return next(n for n in q.graph.nodes if n.name == name)


# ------------------------------------------------------------------------------------------ tracing
class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Gate()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        return self.conv(self.inner(x))


class Gate(nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow
            return x
        return -x


class Flagged(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x, double: bool = False):
        y = self.conv(x)
        if double:
            y = y * 2
        return y


def test_trace_error_names_module_and_fix():
    with pytest.raises(fxq.TraceError) as e:
        fxq.prepare(Branchy(), "trt_int8", torch.randn(1, 3, 8, 8), capture="fx")
    msg = str(e.value)
    assert "'inner'" in msg and "control flow" in msg and "leaf_modules" in msg and "concrete_args" in msg


def test_leaf_module_workaround():
    q = fxq.quantize(Branchy().eval(), _data((1, 3, 8, 8)), "trt_int8", leaf_modules=[Gate], progress=False)
    assert any(n.op == "call_module" and n.target == "inner" for n in q.graph.nodes)
    assert _node(q, "conv").meta["fxq"].quantized


def test_concrete_args():
    model = Flagged().eval()
    q = fxq.quantize(model, _data((1, 3, 8, 8)), "trt_int8", concrete_args={"double": True}, progress=False)
    x = _data((1, 3, 8, 8))[0]
    with torch.no_grad(), fxq.fp32_mode(q):
        assert torch.allclose(q(x), model(x, True), atol=1e-5)


# ------------------------------------------------------------------------------------------ passes
def test_bn_fold_and_identity_removal_keep_output():
    model = nn.Sequential(nn.Conv2d(3, 4, 3, bias=False), nn.BatchNorm2d(4), nn.Dropout(0.5), nn.Identity(),
                          nn.ReLU(), nn.ConvTranspose2d(4, 2, 2, stride=2, groups=2), nn.BatchNorm2d(2))
    for bn in (model[1], model[6]):
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
        bn.weight.data.uniform_(0.5, 2)
    model.eval()
    x = torch.randn(2, 3, 8, 8)
    gm = fxq.prepare(model, "trt_int8", x)
    assert not any(isinstance(m, (nn.BatchNorm2d, nn.Dropout, nn.Identity)) for m in gm.modules())
    with torch.no_grad():
        fxq.switch_to_fp32(gm)
        assert torch.allclose(gm(x), model(x), atol=1e-5)
    # the caller's model is untouched
    assert isinstance(model[1], nn.BatchNorm2d) and model[0].bias is None


class TiedConvs(nn.Module):
    """Convs before BatchNorms whose tensors are read elsewhere too: ``a`` and ``b`` share one weight under two names,
    ``c``'s bias is a PReLU's slope, ``e``'s weight is read by a functional conv and by ``e`` itself (a reflect-padded
    conv stays a module call). None of those may fold: a fold would rewrite the other reader's tensor. ``d``, owning
    its tensors, folds twice (a BatchNorm, then another: caffe's BatchNorm + Scale)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 3, 1, bias=False), nn.Conv2d(3, 3, 1, bias=False)
        self.b.weight = self.a.weight
        self.c, self.d = nn.Conv2d(3, 3, 1), nn.Conv2d(3, 3, 1, bias=False)
        self.prelu = nn.PReLU(3)
        self.prelu.weight = self.c.bias
        self.e = nn.Conv2d(3, 3, 3, padding=1, padding_mode="reflect", bias=False)
        self.norms = nn.ModuleList(nn.BatchNorm2d(3) for _ in range(6))
        for bn in self.norms:
            bn.running_mean.uniform_(-1, 1)
            bn.running_var.uniform_(0.5, 2)
            bn.weight.data.uniform_(0.5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.norms
        y = n[0](self.a(x)) + n[1](self.b(x)) + n[2](self.c(x)) + n[4](n[3](self.d(x)))
        return self.prelu(y) + self.e(x) + n[5](F.conv2d(x, self.e.weight, padding=1))


def test_bn_fold_leaves_tied_tensors_and_folds_a_chain():
    model = TiedConvs().eval()
    x = torch.randn(2, 3, 5, 5)
    gm = fxq.prepare(model, "trt_int8", x)
    left = {n.target for n in gm.graph.nodes if n.op == "call_module"
            and isinstance(gm.get_submodule(n.target), nn.BatchNorm2d)}
    assert left == {"norms.0", "norms.1", "norms.2", "norms.5"}
    conv_d = next(n for n in gm.graph.nodes if n.meta.get("module_path") == "d")
    assert conv_d.meta["folded_bn"] == ["norms.3", "norms.4"]
    with torch.no_grad():
        fxq.switch_to_fp32(gm)
        torch.testing.assert_close(gm(x), model(x), atol=1e-5, rtol=1e-5)


class CopyThenMutate(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        z = y.clone()
        z.relu_()  # must not reach y through the removed copy
        return y + z.contiguous()


def test_copies_before_in_place_ops_are_kept():
    model = CopyThenMutate().eval()
    x = torch.randn(2, 8)
    gm = fxq.prepare(model, "trt_int8", x)
    assert [n.target for n in gm.graph.nodes if n.op == "call_method"].count("clone") == 1
    with torch.no_grad():
        fxq.switch_to_fp32(gm)
        assert torch.equal(gm(x), model(x))
    plain = fxq.prepare(nn.Sequential(nn.Linear(8, 8), nn.Dropout(), nn.ReLU()), "trt_int8", x)
    assert not any(isinstance(m, nn.Dropout) for m in plain.modules())  # no in-place op: copies still go


class FunctionalForms(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 3, 3, 3) * 0.2)
        self.b = nn.Parameter(torch.zeros(4))

    def forward(self, x):
        y = F.relu(F.conv2d(x, self.w, self.b, padding=1))
        return torch.add(y, y * 0.5)


class ModuleForms(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.relu = nn.ReLU()

    def forward(self, x):
        y = self.relu(self.conv(x))
        return y + y * 0.5


def _signature(q):
    out = []
    for n in q.graph.nodes:
        nq = n.meta.get("fxq")
        if isinstance(nq, NodeQuant):
            roles = sorted(QuantGraph(q).infos()[v].role for v in nq.inputs.values() if v)
            out.append((nq.op_type, nq.platform, nq.output_state.name, tuple(roles)))
    return out


def test_functional_and_module_forms_quantize_alike():
    x = _data((2, 3, 8, 8))
    a = fxq.quantize(FunctionalForms().eval(), x, "trt_int8", progress=False)
    b = fxq.quantize(ModuleForms().eval(), x, "trt_int8", progress=False)
    assert _signature(a) == _signature(b)
    assert [t for t, *_ in _signature(a)] == ["Conv", "Relu", "Mul", "Add"]


# ------------------------------------------------------------------------------------------ placement
def test_trt_placement_fusion_passive_and_axes():
    q = fxq.quantize(small_cnn(), _data(), "trt_int8", progress=False)
    conv1 = _node(q, "conv1").meta["fxq"]
    relu = _node(q, "relu").meta["fxq"]
    assert conv1.output_state is QuantState.OVERLAPPED and conv1.output == relu.output  # conv->relu fused
    pool = _node(q, "max_pool2d").meta["fxq"]
    assert pool.output_state is QuantState.PASSIVE and pool.output == relu.output
    weights = _quantizers_by_role(q, "weight")
    assert weights["up_weight"].config.per_channel and weights["up_weight"].config.channel_axis == 1
    assert weights["up_weight"].scale.numel() == 4  # ConvTranspose: out channels on axis 1
    for name, fq in weights.items():
        if name != "up_weight":
            assert fq.config.channel_axis == 0 and fq.config.quant_min == -127
    for fq in _quantizers_by_role(q, "activation").values():
        assert not fq.config.per_channel and fq.config.quant_min == -128
    assert not _quantizers_by_role(q, "bias")  # TensorRT keeps biases FP32
    # every add input is quantized (residual adds take Q/DQ inputs)
    add = _node(q, "add").meta["fxq"]
    assert all(add.inputs.values())


class SplitHeads(nn.Module):
    """One projection cut into query, key and value (attention's in_proj; YOLO's split of xy / wh / conf)."""

    def __init__(self, split: str) -> None:
        super().__init__()
        self.split = split
        self.proj = nn.Linear(16, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)
        q, k, v = y.chunk(3, dim=-1) if self.split == "chunk" else y.split((16, 16, 16), dim=-1)
        return torch.softmax(q @ k.transpose(-2, -1), dim=-1) @ v


@pytest.mark.parametrize("split", ["chunk", "split"])
@pytest.mark.parametrize("platform", ["trt_int8", "ort_int8", "ppl_cuda_int8"])
def test_pieces_of_a_split_share_its_input_grid(platform, split):
    """A split cuts a quantized tensor into pieces on its grid: each piece is covered by the projection's
    quantizer (PASSIVE), not quantized again on a grid of its own (a second rounding, and 3 more quantizers)."""
    q = fxq.quantize(SplitHeads(split).eval(), _data((2, 5, 16)), platform, progress=False)
    proj = _node(q, "proj").meta["fxq"]
    assert proj.output_state is QuantState.ACTIVATED
    pieces = [n for n in q.graph.nodes if n.op == "call_function" and n.target is operator.getitem]
    assert len(pieces) == 3
    for n in pieces:
        assert n.meta["fxq"].output_state is QuantState.PASSIVE and n.meta["fxq"].output == proj.output, n.name
    assert not [name for name, _ in QuantGraph(q).quantizers() if "getitem" in name]
    x = _data((2, 5, 16))[0]
    values = fx_values(q, x)
    grid = values[next(n.name for n in q.graph.nodes if quantizer_name(n) == proj.output)]
    for i, n in enumerate(pieces):
        assert torch.equal(values[n.name], grid[..., 16 * i: 16 * (i + 1)])  # the quantized values, as they are
    if platform == "ppl_cuda_int8":
        return  # OpenPPL's files are the float graph and a json of the grids (tests/test_export_openppl.py)
    with torch.no_grad():
        sim = q(x).numpy()
    (last,) = [n for n in q.graph.nodes if n.op == "output"][0].all_input_nodes
    step = float(QuantGraph(q)[quantizer_name(last)].scale)
    with tempfile.TemporaryDirectory() as tmp:
        (path,) = [p for p in fxq.export(q, platform, Path(tmp) / "m.onnx") if p.suffix == ".onnx"]
        np.testing.assert_allclose(run_ort(str(path), x, optimize=False), sim, rtol=0, atol=1e-6)
        # a default session fuses int8 kernels that round once where Q/DQ rounds twice: a code here and there
        np.testing.assert_allclose(run_ort(str(path), x, optimize=True), sim, rtol=0, atol=1.01 * step)


def test_ncnn_quantizes_only_conv_and_gemm_inputs():
    q = fxq.quantize(small_cnn(), _data(), "ncnn_int8", progress=False)
    infos = QuantGraph(q).infos()
    for name, fq in _quantizers_by_role(q, "activation").items():
        consumers = [_node(q, c).meta["fxq"].op_type for c in infos[name].consumers]
        assert set(consumers) <= {"Conv", "Gemm"}, (name, consumers)
        assert fq.config.quant_min == -127 and fq.config.rounding.name == "HALF_FAR_FROM_ZERO"
    for n in q.graph.nodes:
        nq = n.meta.get("fxq")
        if isinstance(nq, NodeQuant):
            assert nq.output is None  # outputs stay FP32
    assert _node(q, "conv2").meta["fxq"].platform == "ncnn_int8"
    assert _node(q, "up").meta["fxq"].platform == "fp32"  # ConvTranspose not in NCNN's list


def test_ncnn_six_bit_weights_for_3x3_stride1_convs():
    q = fxq.quantize(small_cnn(), _data(), "ncnn_int8", progress=False)
    w = _quantizers_by_role(q, "weight")
    assert w["conv1_weight"].config.quant_max == 31 and w["conv3_weight"].config.quant_max == 127


def test_ppl_bias_is_passive_input_times_weight_scale():
    q = fxq.quantize(small_cnn(), _data(), "ppl_cuda_int8", progress=False)
    biases = _quantizers_by_role(q, "bias")
    assert biases
    infos = QuantGraph(q).infos()
    for name, fq in biases.items():
        assert fq.config.state is QuantState.PASSIVE_BAKED and fq.config.num_bits == 32
        (consumer,) = infos[name].consumers  # found from the graph, not from the bias bookkeeping
        op = _node(q, consumer)
        x, w_q = op.args[0], op.args[1]
        assert QuantGraph(q).quantizer_of(w_q).role == "weight"
        while not is_quantizer_node(x):  # passive ops (MaxPool) pass their input's quantized values on
            assert x.meta["fxq"].output_state is QuantState.PASSIVE
            x = x.args[0]
        expected = q.get_submodule(x.target).scale * q.get_submodule(w_q.target).scale
        assert torch.allclose(fq.scale, expected)


def test_academic_quantizes_inputs_only_asymmetric():
    q = fxq.quantize(small_cnn(), _data(), "academic_int8", progress=False)
    acts = _quantizers_by_role(q, "activation")
    assert acts and all(not fq.config.symmetric and fq.config.quant_min == 0 for fq in acts.values())
    assert all(not fq.config.per_channel for fq in _quantizers_by_role(q, "weight").values())
    biases = _quantizers_by_role(q, "bias")
    assert biases and all(fq.config.num_bits == 30 for fq in biases.values())


def test_concat_inputs_aligned_to_output_and_add_inputs_to_large():
    q = fxq.quantize(small_cnn(), _data(), "trt_int8", progress=False)
    groups = QuantGraph(q).alignment_groups()
    assert {g.kind for g in groups} == {"largest", "output"}
    for g in groups:
        for i in g.members:  # each member records its group
            assert g.entry in q.fxq_quantizers[i].aligned
        if g.kind == "output":
            for i in g.members:
                assert torch.equal(q.fxq_quantizers[i].scale, q.fxq_quantizers[g.target].scale)
        else:
            scales = {float(q.fxq_quantizers[i].scale) for i in g.members}
            assert len(scales) == 1


def test_alignment_takes_the_largest_member_and_is_idempotent():
    """Symmetric add inputs take the largest scale as it is; aligning again (as every algorithm does on exit)
    changes nothing — re-deriving it from its own range [-128 s, 127 s] grew it by 256/255 per pass."""
    from fxq.graph.convert import apply_alignment

    q = fxq.quantize(small_cnn(), _data(), "trt_int8", progress=False)
    group = next(g for g in QuantGraph(q).alignment_groups() if g.kind == "largest")
    members = [q.fxq_quantizers[i] for i in group.members]
    for k, m in enumerate(members):
        m.set_qparams(torch.tensor([0.01 * (k + 1)]), torch.zeros(1), state=m.config.state)
    for _ in range(3):
        apply_alignment(q)
        assert all(float(m.scale) == pytest.approx(0.01 * len(members), rel=1e-7) for m in members)
    # a power-of-2 member keeps a power-of-2 scale (it is not handed the widest member's scale)
    members[0].config.power_of_2 = True
    members[0].set_qparams(torch.tensor([2.0 ** -7]), torch.zeros(1), state=members[0].config.state)
    apply_alignment(q)
    assert float(members[0].scale).hex().startswith("0x1.0000000000000p")


# ------------------------------------------------------------------------------------------ dispatch
def test_dispatchers():
    model, data = small_cnn(), _data()
    counts = {}
    for d in ("conservative", "aggressive", "pointwise", "allin"):
        q = fxq.quantize(model, data, "trt_int8", fxq.QuantizationSetting(dispatcher=d), progress=False)
        counts[d] = fxq.summary(q).counts
    assert counts["pointwise"]["quantized"] == 5  # the computing ops only
    assert counts["pointwise"]["fp32"] > counts["conservative"]["fp32"]
    assert counts["aggressive"]["fp32"] <= counts["conservative"]["fp32"]


def test_shape_computations_never_quantized():
    class Shapey(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(6, 6)

        def forward(self, x):
            n = x.size(0)
            scale = torch.arange(x.shape[1]).float() / x.shape[1]
            return self.fc(x * scale).reshape(n, -1)

    q = fxq.quantize(Shapey().eval(), [torch.randn(2, 6)], "trt_int8",
                     fxq.QuantizationSetting(dispatcher="aggressive"), progress=False)
    platforms = {n.name: n.meta["fxq"].platform for n in q.graph.nodes if isinstance(n.meta.get("fxq"), NodeQuant)}
    assert platforms["size"] == "shape" and platforms["arange"] == "shape" and platforms["truediv"] == "shape"
    assert platforms["fc"] == "trt_int8"


def test_dispatching_table_by_name_regex_and_overrides():
    setting = fxq.QuantizationSetting(dispatching_table={"conv2": "fp32", "up.*": {"bit_width": 4}})
    q = fxq.quantize(small_cnn(), _data(), "ort_int8", setting, progress=False)  # trt_int8 exports int8 only
    assert _node(q, "conv2").meta["fxq"].platform == "fp32"
    w = _quantizers_by_role(q, "weight")
    assert "conv2_weight" not in w
    assert w["up_weight"].config.num_bits == 4 and w["conv1_weight"].config.num_bits == 8


def test_per_call_low_bit_overrides():
    q = fxq.quantize(small_cnn(), _data(), "ort_int8", bit_width=4, symmetrical=True, per_channel=False,
                     progress=False)
    for fq in _quantizers_by_role(q, "weight").values():
        assert fq.config.num_bits == 4 and fq.config.quant_max == 7 and not fq.config.per_channel


def test_custom_platform_registration():
    @fxq.register_platform("test_only_conv_platform", override=True)
    class OnlyConv(fxq.Platform):
        quantized_ops = frozenset({"Conv"})
        activation_observer = "minmax"

    q = fxq.quantize(small_cnn(), _data(), "test_only_conv_platform", progress=False)
    assert fxq.summary(q).counts["quantized"] >= 3
    assert _node(q, "fc").meta["fxq"].platform == "fp32"
    with pytest.raises(fxq.RegistryError, match="already registered"):
        fxq.register_platform("test_only_conv_platform", OnlyConv)
    with pytest.raises(fxq.RegistryError, match="trt_int8"):
        fxq.get_platform("no_such_platform")
    assert fxq.qconfig.PLATFORMS.unregister("test_only_conv_platform") is OnlyConv  # registries are global
    with pytest.raises(fxq.RegistryError, match="unknown platform 'test_only_conv_platform'"):
        fxq.get_platform("test_only_conv_platform")


# ------------------------------------------------------------------------------------------ calibration
class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x, y):
        return self.a(x) + self.b(y)


def test_calibration_accepts_tuples_dicts_and_dataloaders():
    model = TwoInputs().eval()
    tuples = [(torch.randn(2, 4), torch.randn(2, 4)) for _ in range(3)]
    dicts = [{"x": x, "y": y} for x, y in tuples]
    qa = fxq.quantize(model, tuples, "trt_int8", progress=False)
    qb = fxq.quantize(model, dicts, "trt_int8", progress=False)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(6, 4), torch.randn(6, 4)),
                                         batch_size=2)
    qc = fxq.quantize(model, loader, "trt_int8", progress=False, collate_fn=tuple)
    x, y = tuples[0]
    with torch.no_grad():
        assert torch.equal(qa(x, y), qb(x, y))
        assert torch.isfinite(qc(x, y)).all()


def test_calibration_errors_name_the_input():
    model = TwoInputs().eval()
    gm = fxq.prepare(model, "trt_int8", (torch.randn(2, 4), torch.randn(2, 4)))
    with pytest.raises(fxq.CalibrationError, match="empty"):
        fxq.calibrate(gm, [], progress=False)
    with pytest.raises(fxq.CalibrationError, match="2 input"):
        fxq.calibrate(gm, [torch.randn(2, 4)], progress=False)
    with pytest.raises(fxq.CalibrationError, match="'y'"):
        fxq.calibrate(gm, [(torch.randn(2, 4), torch.randn(2, 5))], progress=False)
    with pytest.raises(fxq.CalibrationError, match="not model inputs"):
        fxq.calibrate(gm, [{"x": torch.randn(2, 4), "z": torch.randn(2, 4)}], progress=False)


def test_two_pass_observer_and_steps():
    model, data = small_cnn(), _data(n=4)
    setting = fxq.QuantizationSetting()
    setting.quantize_activation_setting.calib_algorithm = "kl"
    calls = []
    handle = model.register_forward_hook(lambda *a: calls.append(1))
    gm = fxq.prepare(model, "trt_int8", data[0], setting)
    handle.remove()
    counter = {"n": 0}
    gm.register_forward_pre_hook(lambda *a: counter.__setitem__("n", counter["n"] + 1))
    fxq.calibrate(gm, data, steps=3, progress=False)
    assert counter["n"] == 6  # two passes over three batches


def test_calibration_records_no_autograd_graph():
    """Observing needs no gradients: a calibration forward under grad mode kept every saved tensor of the
    backward alive and cloned each in-place activation's input (MobileNetV2: ~0.15 s of a 0.7 s calibration)."""
    model, data = small_cnn(), _data(n=2)
    gm = fxq.prepare(model, "trt_int8", data[0])
    seen = []
    gm.register_forward_hook(lambda mod, args, out: seen.append((torch.is_grad_enabled(), out.requires_grad)))
    with torch.enable_grad():
        fxq.calibrate(gm, data, progress=False)
    assert seen == [(False, False)] * len(data)
    assert torch.is_grad_enabled()


class _ReadsItsData(nn.Module):
    """A leaf that reads its input's values (fake tensors have none): shapes then come from a real run."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.from_numpy(x.detach().numpy().copy()).mean()


def test_real_shape_propagation_keeps_no_autograd_record():
    """The real-run fallback of shape propagation stores every value in ``meta["val"]``: it stored them with their
    autograd record (each conv's saved inputs alive for the prepared model's lifetime)."""
    from fxq.graph.passes import propagate_tensor_meta
    from fxq.graph.trace import trace

    model = nn.Sequential(nn.Conv2d(3, 4, 3), _ReadsItsData(), nn.Conv2d(4, 4, 1)).eval()
    gm = trace(model, leaf_modules=[_ReadsItsData])
    propagate_tensor_meta(gm, [torch.randn(2, 3, 8, 8)])
    values = [n.meta["val"] for n in gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
    assert len(values) == 5 and type(values[2]) is torch.Tensor  # the real run's values, not fake tensors
    assert not any(v.requires_grad for v in values)


class _Force(nn.Module):
    """d(energy)/dx in the forward (a force field, a PINN): needs gradients whatever fxq's own runs want."""

    def __init__(self) -> None:
        super().__init__()
        self.energy = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.detach().requires_grad_(True)
        return torch.autograd.grad(self.energy(x).sum(), x)[0]


class _ForceNet(nn.Module):
    def __init__(self, reads_data: bool = False) -> None:
        super().__init__()
        self.inp, self.force, self.out = nn.Linear(8, 8), _Force(), nn.Linear(8, 4)
        self.reads = _ReadsItsData() if reads_data else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.reads(self.force(self.inp(x))))


@pytest.mark.parametrize("reads_data", [False, True])
def test_a_forward_that_takes_gradients_itself_still_calibrates(reads_data):
    """Calibration and the real-run shape propagation keep no autograd record, but a model whose forward calls
    torch.autograd.grad needs grad mode: both failed ("element 0 of tensors does not require grad", reported as
    the data's fault) until calibration retries its first batch in grad mode and the propagation detaches what it
    keeps instead. ``reads_data``: a module fake tensors cannot run, so shapes come from a real run."""
    torch.manual_seed(0)
    model = _ForceNet(reads_data).eval()
    data = [torch.randn(4, 8) for _ in range(3)]
    q = fxq.quantize(model, data, "trt_int8", progress=False, leaf_modules=[_Force, _ReadsItsData])
    assert (q(data[0]) - model(data[0])).abs().max() < 0.05


class _NumpyTopK(nn.Module):
    """Numpy post-processing of its input's values (fine without autograd; ``x.numpy()`` refuses a tensor that
    requires grad). Fake tensors cannot run it, so shapes come from a real run."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        order = np.argsort(-x.numpy(), axis=1)[:, :4]
        return torch.gather(x, 1, torch.from_numpy(order))


class _RangeCheck(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x.abs() > 1e3).any():
            raise ValueError("scores out of range: normalize the inputs")
        return x


class _TopKNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.top, self.check, self.out = nn.Linear(8, 8), _NumpyTopK(), _RangeCheck(), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.check(self.top(self.fc(x))))


def test_grad_mode_is_a_fallback_only():
    """A leaf that reads its input's values runs without gradients, as before the grad-mode fallbacks (review of
    the first mends: prepare failed with "Can't call numpy() on Tensor that requires grad", blamed on fxq); and a
    batch the model refuses is reported with the model's own error, not the grad-mode rerun's."""
    torch.manual_seed(0)
    leaves = [_NumpyTopK, _RangeCheck]
    data = [torch.randn(2, 8) for _ in range(2)]
    q = fxq.quantize(_TopKNet().eval(), data, "ort_int8", progress=False, leaf_modules=leaves)
    with torch.no_grad():
        assert q(data[0]).shape == (2, 2)
    with torch.no_grad():
        gm = fxq.prepare(_TopKNet().eval(), "ort_int8", data[0], leaf_modules=leaves)
    with pytest.raises(fxq.CalibrationError, match="scores out of range"):
        fxq.calibrate(gm, [data[0] * 1e5], progress=False)


def test_unimplemented_algorithm_switch_raises(monkeypatch):
    """A switch without a registered implementation (every built-in has one now) says so instead of doing nothing."""
    from fxq.algorithms.pipeline import ALGORITHMS

    monkeypatch.delitem(ALGORITHMS._items, "ssd_equalization")
    setting = fxq.QuantizationSetting(ssd_equalization=True)
    with pytest.raises(fxq.NotSupportedError, match="ssd_equalization"):
        fxq.quantize(small_cnn(), _data(), "trt_int8", setting, progress=False)


def test_setting_json_round_trip_and_validation():
    s = fxq.QuantizationSetting(dispatcher="aggressive")
    s.lsq_optimization_setting.epochs = 30
    assert fxq.QuantizationSetting.from_json(s.to_json()) == s
    with pytest.raises(fxq.ConfigError, match="dispatcher"):
        fxq.QuantizationSetting(dispatcher="nope")
    with pytest.raises(fxq.ConfigError, match="unknown"):
        fxq.QuantizationSetting.from_dict({"lsq_optimization_setting": {"learning_rate": 1}})


# ------------------------------------------------------------------------------------------ convert
def test_state_dict_round_trip_and_uncalibrated_convert():
    model, data = small_cnn(), _data()
    q = fxq.quantize(model, data, "trt_int8", progress=False)
    fresh = fxq.prepare(model, "trt_int8", data[0])
    with pytest.raises(fxq.ConfigError, match="calibrate"):
        fxq.convert(fresh)
    fresh.load_state_dict(q.state_dict())
    fxq.convert(fresh, bake=False)
    with torch.no_grad():
        assert torch.equal(fresh(data[0]), q(data[0]))


def test_summary_is_data_and_text():
    q = fxq.quantize(small_cnn(), _data(), "trt_int8", progress=False)
    s = fxq.summary(q)
    assert set(s.counts) == {"quantized", "passive", "overlapped", "fp32", "shape"}
    assert "conv1" in str(s) and s.to_dict()["platform"] == "trt_int8"


def test_quantized_model_compiles_fullgraph():
    model, data = small_cnn(), _data()
    q = fxq.quantize(model, data, "trt_int8", progress=False)
    compiled = torch.compile(q, fullgraph=True)
    with torch.no_grad():
        assert torch.allclose(compiled(data[0]), q(data[0]), atol=1e-6)
    assert noise_ratio(q(data[0]), model(data[0])) < 0.05


def test_passive_clip_bounds_quantized_on_ppl_and_restored_in_fp32():
    class ClipNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)
            self.act = nn.ReLU6()
            self.conv2 = nn.Conv2d(4, 4, 1)

        def forward(self, x):
            y = self.act(self.conv(x))
            return torch.clamp(self.conv2(y), -0.3, 0.7)

    model = ClipNet().eval()
    data = [torch.randn(2, 3, 8, 8) * 4 for _ in range(2)]
    q = fxq.quantize(model, data, "ppl_cuda_int8", progress=False)
    act = q.get_submodule("act")
    s = float(q.fxq_quantizers[_node(q, "act").meta["fxq"].output].scale)
    assert act.max_val == pytest.approx(min(round(6 / s), 127) * s) and act.max_val != 6.0
    clamp = _node(q, "clamp")
    assert clamp.args[2] != 0.7
    with fxq.fp32_mode(q):
        assert act.max_val == 6.0 and clamp.args[1:] == (-0.3, 0.7)
        with torch.no_grad():
            assert torch.allclose(q(data[0]), model(data[0]), atol=1e-5)
    assert act.max_val != 6.0
    trt = fxq.quantize(model, data, "trt_int8", progress=False)
    assert trt.get_submodule("act").max_val == 6.0  # TensorRT keeps clip bounds as they are


class _Writes(nn.Module):
    """Every in-place form, each written value read again afterwards."""

    def __init__(self) -> None:
        super().__init__()
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        a = x * 2
        b = self.relu(a)
        a = a + 1  # a is b: reads the ReLU's result
        c = torch.relu_(a - 3)
        c.mul_(2)
        d = torch.nn.functional.leaky_relu(c, 0.1, inplace=True)
        e = d * 1
        e.zero_()  # no out-of-place twin: written into a copy
        return a + b + c + d + e + x


def test_rewrite_out_of_place_keeps_the_result_and_writes_nothing():
    from fxq.graph.passes import rewrite_out_of_place

    model = _Writes()
    traced = torch.fx.symbolic_trace(model)  # the reference: tracing keeps relu/mul_/leaky_relu/zero_ in place
    gm = torch.fx.symbolic_trace(model)
    modules = dict(gm.named_modules())
    rewrite_out_of_place(gm.graph, modules)
    out = torch.fx.GraphModule(modules, gm.graph)
    x = torch.randn(2, 3)
    probe, original = {}, {n.name for n in traced.graph.nodes}

    class _Keep(torch.fx.Interpreter):  # every value as computed, compared with itself after the run
        def run_node(self, n):
            v = super().run_node(n)
            if isinstance(v, torch.Tensor) and n.name in original:  # not the copies made to be written into
                probe[n.name] = (v, v.clone())
            return v

    torch.testing.assert_close(_Keep(out).run(x.clone()), traced(x.clone()))
    assert all(torch.equal(v, kept) for v, kept in probe.values())  # nothing was written after it was computed
    mods = dict(out.named_modules())
    assert not any(getattr(mods.get(str(n.target)), "inplace", False) for n in out.graph.nodes if n.op == "call_module")


def test_inplace_function_forms_have_op_types():
    class InPlace(nn.Module):
        def __init__(self):
            super().__init__()
            self.c = nn.Conv2d(3, 4, 3)

        def forward(self, x):
            return F.max_pool2d(torch.relu_(self.c(x)), 2)

    q = fxq.quantize(InPlace().eval(), _data((1, 3, 8, 8)), "trt_int8", progress=False)
    assert _node(q, "relu_").meta["fxq"].op_type == "Relu"
    assert _node(q, "c").meta["fxq"].output_state is QuantState.OVERLAPPED
    assert _node(q, "max_pool2d").meta["fxq"].output_state is QuantState.PASSIVE


def test_placeholder_values_by_position_and_name():
    from fxq.errors import CalibrationError
    from fxq.graph.data import placeholder_values

    a, b = torch.randn(2, 4), torch.randn(2, 4)
    gm = fxq.prepare(TwoInputs(), "trt_int8", (a, b))
    by_position = placeholder_values(gm, (a, b))
    by_name = placeholder_values(gm, {"y": b, "x": a})
    assert [n.name for n in by_position] == ["x", "y"]
    assert all(by_position[n] is by_name[n] for n in by_position)
    with pytest.raises(CalibrationError, match="'y'"):
        placeholder_values(gm, (a,))


def test_first_batch_errors():
    from fxq.errors import CalibrationError, ConfigError
    from fxq.graph.data import first_batch_errors

    with pytest.raises(CalibrationError, match="first analysis batch failed in the model: bad shape"):
        with first_batch_errors("analysis", first=True):
            raise RuntimeError("bad shape")
    with pytest.raises(RuntimeError):  # the data fitted before: not a data problem
        with first_batch_errors("analysis", first=False):
            raise RuntimeError("later")
    with pytest.raises(ConfigError):  # fxq's own errors pass through
        with first_batch_errors("analysis", first=True):
            raise ConfigError("x")


@pytest.mark.parametrize("opset", [11, 13])
def test_first_batch_failure_names_the_node_and_a_squeeze_onnx_refuses(opset):
    """A text recognizer's file (height pooled to 1, squeezed, transposed) calibrated on lines of another height:
    the error names the node that fails with its ONNX node, the batch's and the file's input shapes, and the
    ONNX Squeeze whose dim is not 1 (onnx2torch's squeeze keeps it, so the graph fails two nodes on); at the
    height the file takes, it quantizes."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.RandomState(0)
    inits = [numpy_helper.from_array(rng.randn(8, 3, 3, 3).astype(np.float32) * 0.3, "w"),
             numpy_helper.from_array(rng.randn(8, 5).astype(np.float32) * 0.3, "fc"),
             numpy_helper.from_array(np.array([2], dtype=np.int64), "axes")]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1], name="Conv_0"),
             helper.make_node("MaxPool", ["c"], ["p"], kernel_shape=[8, 1], strides=[8, 1], name="MaxPool_0"),
             helper.make_node("Squeeze", ["p", "axes"], ["s"], name="Squeeze_0") if opset >= 13 else
             helper.make_node("Squeeze", ["p"], ["s"], axes=[2], name="Squeeze_0"),  # opset 13: axes an input
             helper.make_node("Transpose", ["s"], ["t"], perm=[0, 2, 1], name="Transpose_0"),
             helper.make_node("MatMul", ["t", "fc"], ["y"], name="MatMul_0")]
    graph = helper.make_graph(nodes, "rec", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, "H", "W"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "T", 5])], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    gm = fxq.load_onnx(model)
    with pytest.raises(fxq.CalibrationError, match=r"first example batch failed in the model at node "
                       r"'transpose_0' \(ONNX Transpose 'Transpose_0'\) \(RuntimeError: [^;]*\); the batch's inputs: "
                       r"x \(1, 3, 16, 20\); the ONNX file declares x \[1, 3, 'H', 'W'\]; ONNX Squeeze 'Squeeze_0' "
                       r"squeezes dim\(s\) \[2\] of its input of shape \(1, 8, 2, 20\).*Fix: give batches of the "
                       r"sizes the model takes"):
        fxq.quantize(gm, [torch.randn(1, 3, 16, 20)], "trt_int8", progress=False)
    gm = fxq.load_onnx(onnx.load_from_string(model.SerializeToString()), input_shapes={"x": [1, 3, 8, 20]})
    q = fxq.quantize(gm, [torch.randn(1, 3, 8, 20)], "trt_int8", progress=False)
    assert q(torch.randn(1, 3, 8, 20)).shape == (1, 20, 5)


def test_first_batch_failure_of_a_graph_that_runs_it_is_fxqs(monkeypatch):
    """When the model's graph runs the first batch but fxq's preparation fails on it, the error says it is fxq's
    own failure, not the data's."""
    import fxq.api

    def broken(*args, **kwargs):
        raise RuntimeError("internal pass failure")

    monkeypatch.setattr(fxq.api, "standardize", broken)
    with pytest.raises(fxq.GraphError, match="internal pass failure.*failure of fxq's own rewrite, not of your data"):
        fxq.quantize(nn.Sequential(nn.Conv2d(3, 4, 1)).eval(), [torch.randn(1, 3, 8, 8)], "trt_int8", progress=False)


def test_unary_functions_have_op_types_in_both_captures():
    """torch.sqrt / exp / log / abs / reciprocal, traced by torch.fx or torch.export (their aten overloads)."""
    from fxq.graph.op_types import op_type

    class Unary(nn.Module):
        def forward(self, x):
            return torch.reciprocal(torch.sqrt(torch.log(torch.abs(x) + 1)) + 1) + torch.exp(-x)

    for capture in ("fx", "export"):
        gm = fxq.prepare(Unary().eval(), "ncnn_int8", (torch.randn(2, 3),), capture=capture)
        types = {op_type(n, dict(gm.named_modules())) for n in gm.graph.nodes if n.op == "call_function"}
        assert {"Sqrt", "Exp", "Log", "Abs", "Reciprocal"} <= types, (capture, types)


def test_algorithm_errors_diagnose_only_a_failure_and_pass_memory_errors():
    from fxq.errors import CalibrationError, GraphError
    from fxq.graph.data import algorithm_errors

    calls = []

    def diagnose(exc):
        calls.append(exc)
        raise ValueError("the diagnosis fails too")

    with algorithm_errors("algorithm 'x'", diagnose):
        pass
    assert not calls  # nothing runs on the success path
    with pytest.raises(torch.OutOfMemoryError):  # memory: as it is, undiagnosed
        with algorithm_errors("algorithm 'x'", diagnose):
            raise torch.OutOfMemoryError("out of memory")
    assert not calls
    with pytest.raises(GraphError, match=r"^the model failed in fxq's quantized model during algorithm 'x' .*"
                                         r"\(IndexError: deep\).*not of your data"):
        with algorithm_errors("algorithm 'x'", diagnose):
            raise IndexError("deep")
    with pytest.raises(CalibrationError, match="algorithm 'x': the FP32 model fails on a batch too"):
        with algorithm_errors("algorithm 'x'", lambda exc: None):
            raise RuntimeError("bad")
