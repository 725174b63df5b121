"""Masked attention is quantized, not kept as an FP32 leaf (issue 14, item 5).

* FP32: every mask variant of ``nn.MultiheadAttention`` / ``nn.TransformerEncoder(Layer)`` and of
  ``F.scaled_dot_product_attention``, decomposed, computes what torch computes (max abs diff ~1e-6).
* Quantized on trt_int8 / ort_int8: a BERT-like encoder with a padding mask, a tiny torchvision ViT, a GPT-style
  decoder in plain torch (SDPA ``is_causal`` and ``masked_fill`` forms) and MultiheadAttention with float masks:
  every MatMul / Gemm quantized, the mask step in float (no quantizer sees ``-inf``, no NaN), and the exported
  files agree with the simulation in onnxruntime, graph optimizations on and off.
* A sequence classifier trained here on tokens whose padding holds distractors: quantized accuracy ~ float
  accuracy, and a wrong (all-valid) padding mask loses accuracy, so the mask really reaches the attention.
"""
from __future__ import annotations

import functools
import importlib.util
import io
import math
import pathlib

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import fxq
from fxq.graph.attention import ATTENTION_MASK_OP, apply_attention_mask, decompose_attention_functions
from fxq.graph.trace import trace

from _export_helpers import ort_session, segment_check

L, E, HEADS, N = 5, 16, 4, 2


def _masks(kind: str, g: torch.Generator) -> dict:
    """Keyword arguments of ``nn.MultiheadAttention`` for one mask variant (no row fully masked)."""
    causal_bool = torch.ones(L, L, dtype=torch.bool).triu(1)
    causal_float = torch.zeros(L, L).masked_fill(causal_bool, float("-inf"))
    random_bool = (torch.rand(N * HEADS, L, L, generator=g) > 0.6) & ~torch.eye(L, dtype=torch.bool)
    padding = torch.tensor([[False] * L, [False] * 3 + [True] * (L - 3)])
    return {
        "none": {},
        "bool_2d": {"attn_mask": causal_bool},
        "float_2d": {"attn_mask": causal_float},
        "bool_3d": {"attn_mask": random_bool},
        "float_3d": {"attn_mask": torch.randn(N * HEADS, L, L, generator=g).masked_fill(random_bool, float("-inf"))},
        "padding_bool": {"key_padding_mask": padding},
        "padding_float": {"key_padding_mask": torch.zeros(N, L).masked_fill(padding, float("-inf"))},
        "causal_and_padding": {"attn_mask": causal_bool, "key_padding_mask": padding},
        "is_causal": {"attn_mask": causal_bool, "is_causal": True},
    }[kind]


class MaskedMHA(nn.Module):
    """Masks as forward inputs, so they are graph inputs (placeholders), not constants."""

    def __init__(self, batch_first: bool, need_weights: bool, is_causal: bool = False) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(E, HEADS, batch_first=batch_first)
        self.need_weights, self.is_causal = need_weights, is_causal

    def forward(self, x, attn_mask=None, key_padding_mask=None):
        return self.attn(x, x, x, attn_mask=attn_mask, key_padding_mask=key_padding_mask,
                         need_weights=self.need_weights, is_causal=self.is_causal)


def _module_types(gm: fx.GraphModule) -> set[type]:
    modules = dict(gm.named_modules())
    return {type(modules[n.target]) for n in gm.graph.nodes if n.op == "call_module"}


MASK_KINDS = ["none", "bool_2d", "float_2d", "bool_3d", "float_3d", "padding_bool", "padding_float",
              "causal_and_padding", "is_causal"]


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
@pytest.mark.parametrize("need_weights", [True, False], ids=["weights", "no_weights"])
@pytest.mark.parametrize("kind", MASK_KINDS)
def test_multihead_attention_masks_match_torch(kind, need_weights, batch_first):
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    masks = _masks(kind, g)
    model = MaskedMHA(batch_first, need_weights, is_causal=masks.pop("is_causal", False)).eval()
    x = torch.randn((N, L, E) if batch_first else (L, N, E), generator=g)
    gm = trace(model)
    assert nn.MultiheadAttention not in _module_types(gm)
    with torch.no_grad():
        (out, w), (ref, ref_w) = gm(x, **masks), model(x, **masks)
    assert not out.isnan().any()
    assert (out - ref).abs().max() < 2e-6
    if need_weights:
        assert (w - ref_w).abs().max() < 1e-6
    else:
        assert w is None and ref_w is None


def _encoder(norm_first: bool, nested: bool = False) -> nn.Module:
    layer = nn.TransformerEncoderLayer(E, HEADS, 32, batch_first=True, norm_first=norm_first, dropout=0.0)
    return nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(E), enable_nested_tensor=nested)


class Encoder(nn.Module):
    def __init__(self, norm_first: bool, is_causal: bool | None, nested: bool = False) -> None:
        super().__init__()
        self.enc, self.is_causal = _encoder(norm_first, nested), is_causal

    def forward(self, x, mask=None, src_key_padding_mask=None):
        return self.enc(x, mask=mask, src_key_padding_mask=src_key_padding_mask, is_causal=self.is_causal)


@pytest.mark.parametrize("norm_first", [False, True], ids=["post_norm", "pre_norm"])
@pytest.mark.parametrize("kind", ["bool_2d", "float_2d", "padding_bool", "padding_float", "causal_and_padding",
                                  "is_causal"])
def test_transformer_encoder_masks_match_torch(kind, norm_first):
    g = torch.Generator().manual_seed(1)
    torch.manual_seed(1)
    masks = _masks(kind, g)
    is_causal = masks.pop("is_causal", None)
    masks = {{"attn_mask": "mask", "key_padding_mask": "src_key_padding_mask"}[k]: v for k, v in masks.items()}
    model = Encoder(norm_first, is_causal).eval()
    x = torch.randn(N, L, E, generator=g)
    gm = trace(model)
    assert not _module_types(gm) & {nn.TransformerEncoder, nn.TransformerEncoderLayer, nn.MultiheadAttention}
    with torch.no_grad():
        assert (gm(x, **masks) - model(x, **masks)).abs().max() < 5e-6


def test_nested_tensor_fast_path_agrees_outside_padding():
    """torch's nested-tensor path writes zeros at padded positions; the decomposition computes them."""
    torch.manual_seed(2)
    model = Encoder(False, None, nested=True).eval()
    x = torch.randn(N, L, E)
    padding = _masks("padding_bool", torch.Generator())["key_padding_mask"]
    gm = trace(model)
    with torch.no_grad():
        got, ref = gm(x, src_key_padding_mask=padding), model(x, src_key_padding_mask=padding)
    assert (got - ref)[~padding].abs().max() < 5e-6


class SDPA(nn.Module):
    def __init__(self, **kwargs) -> None:
        super().__init__()
        self.kwargs = kwargs

    def forward(self, q, k, v, mask=None):
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, **self.kwargs)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **self.kwargs)


@pytest.mark.parametrize("kind", ["plain", "bool_keep", "float", "is_causal", "scale", "gqa", "broadcast_mask"])
def test_scaled_dot_product_attention_is_decomposed_exactly(kind):
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(N, HEADS, L, 8, generator=g) for _ in range(3))
    kwargs, mask = {}, None
    if kind == "bool_keep":  # SDPA's bool masks mark the positions to keep
        mask = (torch.rand(N, HEADS, L, L, generator=g) > 0.4) | torch.eye(L, dtype=torch.bool)
    elif kind == "float":
        mask = torch.randn(N, HEADS, L, L, generator=g).masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1),
                                                                    float("-inf"))
    elif kind == "broadcast_mask":
        mask = torch.ones(L, L, dtype=torch.bool).tril()
    elif kind == "is_causal":
        kwargs = {"is_causal": True}
    elif kind == "scale":
        kwargs = {"scale": 0.3}
    elif kind == "gqa":
        k, v = k[:, :2], v[:, :2]
        kwargs = {"enable_gqa": True}
    model = SDPA(**kwargs)
    gm = decompose_attention_functions(trace(model))
    assert not any(n.target is F.scaled_dot_product_attention for n in gm.graph.nodes)
    with torch.no_grad():
        got, ref = gm(q, k, v, mask), model(q, k, v, mask)
    assert not got.isnan().any() and (got - ref).abs().max() < 2e-6


# --------------------------------------------------------------------------------------------- quantized models
VOCAB, SEQ, DIM = 8, 12, 32


@functools.lru_cache(maxsize=1)
def _example():
    """examples/quantize_transformer.py: its model and task are the ones tested here."""
    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "quantize_transformer.py"
    spec = importlib.util.spec_from_file_location("quantize_transformer", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class CausalSelfAttention(nn.Module):
    def __init__(self, sdpa: bool) -> None:
        super().__init__()
        self.qkv, self.proj, self.sdpa = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM), sdpa
        self.register_buffer("causal", torch.tril(torch.ones(SEQ, SEQ)).view(1, 1, SEQ, SEQ))

    def forward(self, x):
        b, t, c = x.size(0), x.size(1), x.size(2)  # not `x.shape` unpacking: symbolic tracing cannot iterate
        qkv = self.qkv(x).split(DIM, dim=2)
        q, k, v = (qkv[i].view(b, t, 4, c // 4).transpose(1, 2) for i in range(3))
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # nanoGPT's explicit form
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.causal == 0, float("-inf"))  # t == SEQ here
            y = F.softmax(att, dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class TinyGPT(nn.Module):
    def __init__(self, sdpa: bool) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, DIM)
        self.position = nn.Parameter(torch.randn(SEQ, DIM) * 0.1)
        self.ln1, self.ln2, self.ln_f = nn.LayerNorm(DIM), nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = CausalSelfAttention(sdpa)
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens):
        x = self.tokens(tokens) + self.position
        x = x + self.attn(self.ln1(x))
        x = x + self.mlp(self.ln2(x))
        return self.head(self.ln_f(x))


class MHAFloatMasks(nn.Module):
    """nn.MultiheadAttention with a float causal mask held as a constant and a float padding mask as an input."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.attn = nn.MultiheadAttention(DIM, 4)
        self.register_buffer("causal", torch.zeros(SEQ, SEQ).masked_fill(
            torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1), float("-inf")))

    def forward(self, x, padding):
        x = self.inp(x).transpose(0, 1)
        out, weights = self.attn(x, x, x, attn_mask=self.causal, key_padding_mask=padding, need_weights=True)
        return out.transpose(0, 1), weights


class HandWrittenBert(nn.Module):
    """Attention written out as HuggingFace's BERT does: an int 0/1 ``attention_mask`` input turned into an
    additive ``finfo.min`` mask and added to the logits by hand (a quantizer on that add would see -3.4e38)."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, DIM)
        self.qkv, self.out, self.head = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM), nn.Linear(DIM, 2)
        self.norm = nn.LayerNorm(DIM)

    def forward(self, tokens, attention_mask):
        x = self.tokens(tokens)
        b, t = tokens.size(0), tokens.size(1)
        qkv = self.qkv(x).view(b, t, 3, 4, DIM // 4).permute(2, 0, 3, 1, 4)
        scores = torch.matmul(qkv[0], qkv[1].transpose(-1, -2)) / math.sqrt(DIM // 4)
        extended = (1.0 - attention_mask[:, None, None, :].float()) * torch.finfo(torch.float32).min
        probs = torch.softmax(scores + extended, dim=-1)
        y = torch.matmul(probs, qkv[2]).transpose(1, 2).reshape(b, t, DIM)
        return self.head(self.norm(x + self.out(y))[:, 0])


class SdpaBoolMask(nn.Module):
    """SDPA with a boolean padding mask input: torch.onnx writes the mask as ``Where(mask, 0, -inf)`` (the legacy
    exporter) or ``finfo.min`` (dynamo), added to the logits by an ONNX ``Add``."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)

    def forward(self, x, keep):
        q, k, v = self.qkv(x).view(x.shape[0], SEQ, 3, 4, DIM // 4).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :].bool())
        return self.out(y.transpose(1, 2).reshape(x.shape))


def _onnx_loaded(model: nn.Module, batch: tuple, dynamo: bool) -> fx.GraphModule:
    """``model`` as a user's ONNX file of it: exported by torch.onnx, loaded by fxq."""
    if dynamo:
        proto = torch.onnx.export(model, batch, dynamo=True, verbose=False).model_proto
    else:
        buf = io.BytesIO()
        torch.onnx.export(model, batch, buf, dynamo=False, opset_version=17)
        proto = onnx.load_from_string(buf.getvalue())
    return fxq.load_onnx(proto)


def _tiny_vit() -> nn.Module:
    from torchvision.models import VisionTransformer

    vit = VisionTransformer(image_size=16, patch_size=8, num_layers=1, num_heads=2, hidden_dim=16, mlp_dim=32,
                            num_classes=4)
    nn.init.normal_(vit.heads.head.weight, std=0.3)  # torchvision starts the head at zero: all outputs 0
    return vit


def _tokens(g: torch.Generator, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    lengths = torch.randint(3, SEQ + 1, (n,), generator=g)
    return tokens, torch.arange(SEQ)[None] >= lengths[:, None]


def _case(name: str) -> tuple[nn.Module, list[tuple]]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    if name == "bert_padding":
        return _example().PaddedClassifier().eval(), [_tokens(g) for _ in range(3)]
    if name.startswith("hand_written_bert"):
        batches = [(t, (~p).long()) for t, p in (_tokens(g) for _ in range(3))]
        bert = HandWrittenBert().eval()
        return (bert if name == "hand_written_bert" else _onnx_loaded(bert, batches[0], dynamo=False)), batches
    if name.startswith("sdpa_bool_mask"):
        batches = [(torch.randn(4, SEQ, DIM, generator=g), (~_tokens(g, 4)[1]).long()) for _ in range(3)]
        return _onnx_loaded(SdpaBoolMask().eval(), batches[0], dynamo=name.endswith("dynamo")), batches
    if name == "vit":
        return _tiny_vit().eval(), [(torch.randn(4, 3, 16, 16, generator=g),) for _ in range(3)]
    if name in ("gpt_sdpa_causal", "gpt_masked_fill"):
        return TinyGPT(sdpa=name == "gpt_sdpa_causal").eval(), [(_tokens(g)[0],) for _ in range(3)]
    padding = [torch.zeros(4, SEQ).masked_fill(_tokens(g, 4)[1], float("-inf")) for _ in range(3)]
    return MHAFloatMasks().eval(), [(torch.randn(4, SEQ, DIM, generator=g), p) for p in padding]


CASES = ["bert_padding", "hand_written_bert", "vit", "gpt_sdpa_causal", "gpt_masked_fill", "mha_float_masks",
         "hand_written_bert_onnx", "sdpa_bool_mask_onnx", "sdpa_bool_mask_dynamo"]
"""``*_onnx`` / ``*_dynamo``: the ONNX files torch's two exporters write, loaded by fxq: the masks are ONNX ops
(``Where``, ``Cast``, ``Unsqueeze``, an ONNX ``Add``), which were quantized (NaN, or an infinite scale)."""


def _first(out):
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("platform", ["trt_int8", "ort_int8"])
@pytest.mark.parametrize("name", CASES)
def test_masked_transformers_quantize_and_export(name, platform, tmp_path):
    model, data = _case(name)
    q = fxq.quantize(model, data, platform, progress=False)
    rows = fxq.summary(q).layers
    assert not _module_types(q) & {nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerEncoder}
    matmuls = [r for r in rows if r.op_type in ("MatMul", "Gemm")]
    assert sum(r.op_type == "MatMul" for r in matmuls) >= 2
    for r in matmuls:  # every matmul / linear quantized: inputs (and weights) through active quantizers
        assert r.platform == platform and r.inputs and all("ACTIVATED" in i for i in r.inputs), r
    masked = [r for r in rows if r.op_type == ATTENTION_MASK_OP]
    assert all(r.platform == "fp32" and not r.inputs for r in masked)  # the -inf step stays float
    assert masked or not name.endswith(("_onnx", "_dynamo"))  # the files' mask adds became mask steps
    for fq in q.fxq_quantizers.values():
        assert torch.isfinite(fq.scale).all()  # no quantizer calibrated on -inf
    with torch.no_grad():
        sim = [_first(q(*b)).numpy() for b in data]
        ref = [_first(model(*b)).numpy() for b in data]
    assert not any(np.isnan(s).any() for s in sim)
    noise = max(float(np.linalg.norm(s - r) / np.linalg.norm(r)) for s, r in zip(sim, ref))
    assert noise < (0.4 if name == "vit" else 0.1), noise  # random-init 16-wide ViT: int8 noise ~0.3
    path = next(p for p in fxq.export(q, platform, tmp_path / "model.onnx") if str(p).endswith("model.onnx"))
    for optimize in (False, True):
        sess = ort_session(str(path), optimize)
        names = [i.name for i in sess.get_inputs()]  # masks that are model inputs stay ONNX inputs
        got = [sess.run(None, dict(zip(names, (t.numpy() for t in batch))))[0] for batch in data]
        assert not any(np.isnan(o).any() for o in got)
        if not optimize:  # the runtime computes the graph as written: the simulation's values
            assert max(float(np.abs(o - s).max()) for o, s in zip(got, sim)) < 1e-5
    # with graph optimizations onnxruntime fuses and reorders float math: a code lands one off here and there,
    # which a tiny random model amplifies end to end; fed fxq's own codes, every quantized tensor agrees
    stats = segment_check(onnx.load(str(path)), q, data[0], optimize=True)
    assert stats.max_code_diff <= 1 and stats.exact >= 0.99, stats


# --------------------------------------------------------------------------------------------- a trained model
def test_trained_padding_model_keeps_its_accuracy():
    """The example trains a classifier whose padding holds distractors (60 Adam steps in fast mode): quantized
    and deployed accuracy ~ float accuracy, and ignoring the mask costs accuracy, so the mask is honoured."""
    r = _example().main(["--fast"])
    assert r["float"] >= 0.95 and r["float, mask ignored"] <= r["float"] - 0.1, r
    for platform in ("trt_int8", "ort_int8"):
        assert r[platform] >= r["float"] - 0.02, r
        assert r[f"{platform}, mask ignored"] <= r[platform] - 0.1, r
        assert r[f"{platform}, onnxruntime"] >= r["float"] - 0.02, r


def test_quantized_masked_model_saves_and_loads(tmp_path):
    model, data = _case("bert_padding")
    q = fxq.quantize(model, data, "ort_int8", progress=False)
    fxq.save(q, tmp_path / "model.fxq")
    loaded = fxq.load(tmp_path / "model.fxq")
    assert any(n.target is apply_attention_mask for n in loaded.graph.nodes)
    with torch.no_grad():
        torch.testing.assert_close(loaded(*data[0]), q(*data[0]), rtol=0, atol=0)


def test_only_mask_adds_before_a_softmax_are_kept_float():
    """A learned bias added to the logits (Swin's relative positions) is data: it stays a quantized Add."""

    class Biased(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(DIM, DIM)
            self.bias = nn.Parameter(torch.randn(SEQ, SEQ))
            self.register_buffer("causal", torch.zeros(SEQ, SEQ).masked_fill(
                torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1), float("-inf")))

        def forward(self, x):
            h = self.fc(x)
            scores = torch.matmul(h, h.transpose(-1, -2)) + self.bias
            return torch.matmul(torch.softmax(scores + self.causal, dim=-1), h)

    torch.manual_seed(0)
    model = Biased().eval()
    data = [torch.randn(2, SEQ, DIM) for _ in range(2)]
    q = fxq.quantize(model, data, "trt_int8", progress=False)
    types = {r.node: (r.op_type, r.platform) for r in fxq.summary(q).layers}
    assert ("Add", "trt_int8") in types.values()  # the learned bias
    assert (ATTENTION_MASK_OP, "fp32") in types.values()  # the causal mask
    with torch.no_grad():
        assert not q(data[0]).isnan().any()


def test_sdpa_with_a_mask_is_decomposed_on_the_torch_export_path_too():
    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)

        def forward(self, x, keep):
            q, k, v = self.qkv(x).view(2, SEQ, 3, 4, DIM // 4).permute(2, 0, 3, 1, 4).unbind(0)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
            return self.proj(y.transpose(1, 2).reshape(2, SEQ, DIM))

    torch.manual_seed(0)
    model = Attention().eval()
    keep = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    data = [(torch.randn(2, SEQ, DIM), keep) for _ in range(2)]
    q = fxq.quantize(model, data, "ort_int8", progress=False, capture="export")
    rows = fxq.summary(q).layers
    assert [r.platform for r in rows if r.op_type == "MatMul"] == ["ort_int8", "ort_int8"]
    assert [r.platform for r in rows if r.op_type == ATTENTION_MASK_OP] == ["fp32"]
    with torch.no_grad():
        out, ref = q(*data[1]), model(*data[1])
    assert not out.isnan().any() and float((out - ref).norm() / ref.norm()) < 0.05


def test_a_sentinel_tensor_fxq_does_not_recognise_is_refused_with_a_fix_that_works():
    """A -inf mask added outside attention (no softmax reads it) reaches a quantizer: calibration names the quantizer
    and the node reading it, and the dispatching-table entry it advises keeps that node FP32 and calibrates."""

    class Gated(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)

        def forward(self, x, keep):
            masked = torch.where(keep[:, :, None].bool(), 0.0, float("-inf"))
            return self.fc2(torch.relu(self.fc1(x) + masked).clamp(max=6.0))

    torch.manual_seed(0)
    keep = torch.ones(2, SEQ, dtype=torch.long)
    keep[1, 3:] = 0
    data = [(torch.randn(2, SEQ, DIM), keep) for _ in range(2)]
    with pytest.raises(fxq.errors.CalibrationError, match=r"quantizer '\w+' \(read by \['add'\]\).*NaN or Inf.*"
                       r"attention mask.*dispatching_table = \{'add': 'fp32'\}"):
        fxq.quantize(Gated().eval(), data, "trt_int8", progress=False)
    setting = fxq.QuantizationSetting()
    setting.dispatching_table = {"add": "fp32"}
    q = fxq.quantize(Gated().eval(), data, "trt_int8", setting, progress=False)
    with torch.no_grad():
        assert not q(*data[0]).isnan().any()


def test_a_linear_bias_before_a_softmax_in_an_onnx_file_is_no_mask():
    """An ONNX file writes a Linear as MatMul + Add of a stored bias: that Add before a softmax is data, quantized,
    not a mask step (a stored constant is a mask only with a mask's fill: -inf, finfo.min, -10000)."""
    model = nn.Sequential(nn.Linear(DIM, DIM), nn.ReLU(), nn.Linear(DIM, 4), nn.Softmax(dim=-1)).eval()
    x = torch.randn(2, SEQ, DIM)  # 3-D: MatMul + Add (a 2-D input is one Gemm)
    buf = io.BytesIO()
    torch.onnx.export(model, (x,), buf, dynamo=False, opset_version=17)
    q = fxq.quantize(fxq.load_onnx(onnx.load_from_string(buf.getvalue())), [x, x], "trt_int8", progress=False)
    assert ATTENTION_MASK_OP not in {r.op_type for r in fxq.summary(q).layers}


def test_a_mask_expanded_to_sizes_read_from_a_layer_norm_is_a_mask():
    """A dynamic-axes file at opset 17 expands the mask to sizes read (Shape) from a LayerNormalization's output:
    the walk followed the size read into the layer and took the mask for data (quantized: NaN)."""

    class Attn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln, self.qkv, self.out = nn.LayerNorm(DIM), nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)

        def forward(self, x, keep):
            x = self.ln(x)
            q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 4, DIM // 4).permute(2, 0, 3, 1, 4)
            m = keep[:, None, None, :].bool().expand(x.shape[0], 1, x.shape[1], x.shape[1])
            return self.out(F.scaled_dot_product_attention(q, k, v, attn_mask=m).transpose(1, 2).reshape(x.shape))

    torch.manual_seed(0)
    x, keep = torch.randn(2, SEQ, DIM), torch.ones(2, SEQ, dtype=torch.long)
    keep[1, 3:] = 0
    buf = io.BytesIO()
    torch.onnx.export(Attn().eval(), (x, keep), buf, dynamo=False, opset_version=17, input_names=["x", "keep"],
                      dynamic_axes={"x": {0: "b", 1: "s"}, "keep": {0: "b", 1: "s"}})
    q = fxq.quantize(fxq.load_onnx(onnx.load_from_string(buf.getvalue())), [(x, keep)] * 2, "trt_int8",
                     progress=False)
    assert ATTENTION_MASK_OP in {r.op_type for r in fxq.summary(q).layers}
    with torch.no_grad():
        assert not q(x, keep).isnan().any()
