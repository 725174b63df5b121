"""torch's attention and transformer modules are traced through (their decompositions), so they get quantized."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import fxq
from fxq.graph.decompose import DECOMPOSITIONS
from fxq.graph.trace import trace

from _models import noise_ratio, torch_encoder


def _module_types(gm: torch.fx.GraphModule) -> set[type]:
    modules = dict(gm.named_modules())
    return {type(modules[n.target]) for n in gm.graph.nodes if n.op == "call_module"}


class SelfAttention(nn.Module):
    def __init__(self, batch_first: bool, bias: bool, need_weights: bool) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(24, 3, bias=bias, batch_first=batch_first)
        self.need_weights = need_weights

    def forward(self, x: torch.Tensor):
        return self.attn(x, x, x, need_weights=self.need_weights)


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("need_weights", [True, False])
def test_multihead_attention_matches_torch(batch_first, bias, need_weights):
    torch.manual_seed(0)
    model = SelfAttention(batch_first, bias, need_weights).eval()
    x = torch.randn(2, 5, 24)
    gm = trace(model)
    assert nn.MultiheadAttention not in _module_types(gm)
    with torch.no_grad():
        (out, w), (ref, ref_w) = gm(x), model(x)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    if need_weights:
        torch.testing.assert_close(w, ref_w, atol=1e-6, rtol=1e-5)
    else:
        assert w is None and ref_w is None


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_transformer_encoder_matches_torch(norm_first, activation):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(24, 3, 48, batch_first=True, norm_first=norm_first, activation=activation)
    model = nn.Sequential(nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(24), enable_nested_tensor=False)).eval()
    x = torch.randn(2, 6, 24)
    gm = trace(model)
    assert not _module_types(gm) & {nn.TransformerEncoder, nn.TransformerEncoderLayer, nn.MultiheadAttention}
    with torch.no_grad():
        torch.testing.assert_close(gm(x), model(x), atol=1e-5, rtol=1e-5)


def test_training_mode_traces_the_same_graph():
    model = torch_encoder()
    targets = [[n.target for n in trace(m).graph.nodes] for m in (model.eval(), model.train())]
    assert targets[0] == targets[1]
    model.eval()


def test_attention_is_quantized_inside():
    model = torch_encoder()
    g = torch.Generator().manual_seed(0)
    data = [torch.randn(2, 8, 16, generator=g) for _ in range(2)]
    q = fxq.quantize(model, data, "trt_int8", progress=False)
    quantized = [n.meta["fxq"].op_type for n in q.graph.nodes
                 if n.meta.get("fxq") is not None and n.meta["fxq"].quantized]
    assert quantized.count("MatMul") == 4 and quantized.count("Softmax") == 2  # two layers: QK^T, softmax, AV
    with torch.no_grad():
        assert noise_ratio(q(data[1]), model(data[1])) < 0.01


def test_bare_transformer_as_the_whole_model_says_wrap_it():
    layer = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)
    with pytest.raises(fxq.TraceError, match="wrap it"):
        trace(nn.TransformerEncoder(layer, 1, enable_nested_tensor=False).eval())


def test_leaf_modules_and_add_zero_attn_keep_attention_whole():
    """The user's leaf_modules or add_zero_attn keep the module whole, as torch.fx would (masks are decomposed:
    tests/test_transformer_masks.py)."""
    torch.manual_seed(0)
    kept = trace(SelfAttention(True, True, False).eval(), leaf_modules=[nn.MultiheadAttention])
    assert nn.MultiheadAttention in _module_types(kept)
    zero_attn = SelfAttention(False, True, False)
    zero_attn.attn = nn.MultiheadAttention(8, 2, add_zero_attn=True)
    gm = trace(zero_attn.eval())
    assert nn.MultiheadAttention in _module_types(gm)  # not decomposed: kept whole, exact
    x = torch.randn(4, 2, 8)
    with torch.no_grad():
        torch.testing.assert_close(gm(x), zero_attn(x))


def test_register_decomposition_for_a_user_module():
    class Scale2(nn.Module):  # pretend torch.fx could not trace it
        def forward(self, x):
            raise AssertionError("the decomposition runs instead")

    @fxq.register_decomposition(Scale2)
    def _scale2(m, x):
        return x * 2

    gm = trace(nn.Sequential(nn.Linear(3, 3), Scale2()))
    x = torch.randn(2, 3)
    torch.testing.assert_close(gm(x), gm.get_submodule("0")(x) * 2)
    assert any(name.endswith(".scale2") for name in DECOMPOSITIONS.names())


def test_tuple_valued_float_nodes_are_data_not_shape():
    """chunk/split return tuples of float tensors: they are data (a dispatch bug once called them shape math)."""

    class Gated(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 16)

        def forward(self, x):
            a, b = self.fc(x).chunk(2, dim=-1)
            return a * torch.sigmoid(b)

    torch.manual_seed(0)
    data = [torch.randn(4, 8) for _ in range(2)]
    q = fxq.quantize(Gated().eval(), data, "trt_int8", progress=False)
    types = {n.meta["fxq"].op_type: n.meta["fxq"].platform for n in q.graph.nodes if n.meta.get("fxq") is not None}
    assert types["Mul"] == "trt_int8" and types["Sigmoid"] == "trt_int8"
