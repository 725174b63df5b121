"""Quantize a transformer with a padding mask for TensorRT and ONNX Runtime INT8, and deploy it.

A small encoder (token + position embeddings, ``nn.TransformerEncoder`` called with ``src_key_padding_mask``, a
classifier on the [CLS] position) learns to tell whether token A outnumbers token B in sequences of random
length; the padding holds A/B distractors, so the answer is only right when attention honours the mask. fxq
traces through the attention (no FP32 leaf): the matmuls are quantized, the mask is added in float, and the
exported files take the padding mask as an input.

    python examples/quantize_transformer.py [--fast]
"""
from __future__ import annotations

import argparse
import logging
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import fxq

logger = logging.getLogger("quantize_transformer")

VOCAB, SEQ, DIM = 8, 12, 32
"""Token 0 is [CLS], 1 is A, 2 is B, the rest are neutral."""


class PaddedClassifier(nn.Module):
    """Token + position embeddings, one post-norm encoder layer, a classifier on the first ([CLS]) position."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, DIM)
        self.position = nn.Parameter(torch.randn(SEQ, DIM) * 0.1)
        layer = nn.TransformerEncoderLayer(DIM, 4, 2 * DIM, batch_first=True, dropout=0.0)
        self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = nn.Linear(DIM, 2)

    def forward(self, tokens: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        x = self.tokens(tokens) + self.position
        return self.head(self.encoder(x, src_key_padding_mask=padding)[:, 0])


def count_task(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(tokens, padding, labels)``: label 1 when A outnumbers B among the real tokens (ties dropped); padded
    positions (``padding`` True) hold A/B distractors."""
    lengths = torch.randint(4, SEQ + 1, (n,), generator=g)
    padding = torch.arange(SEQ)[None] >= lengths[:, None]
    distractors = torch.randint(1, 3, (n, SEQ), generator=g)
    tokens = torch.where(padding, distractors, torch.randint(1, VOCAB, (n, SEQ), generator=g))
    tokens[:, 0] = 0
    diff = ((tokens == 1) & ~padding).sum(1) - ((tokens == 2) & ~padding).sum(1)
    keep = diff != 0
    return tokens[keep], padding[keep], (diff[keep] > 0).long()


def train(steps: int, g: torch.Generator) -> PaddedClassifier:
    torch.manual_seed(0)
    model = PaddedClassifier()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        tokens, padding, labels = count_task(128, g)
        loss = F.cross_entropy(model(tokens, padding), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def _accuracy(logits: torch.Tensor | np.ndarray, labels: torch.Tensor) -> float:
    logits = torch.as_tensor(logits)
    return float((logits.argmax(1) == labels).float().mean())


def _deployed_accuracy(path: Path, tokens: torch.Tensor, padding: torch.Tensor, labels: torch.Tensor) -> float:
    import onnxruntime as ort

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    return _accuracy(sess.run(None, {names[0]: tokens.numpy(), names[1]: padding.numpy()})[0], labels)


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Train, quantize for trt_int8 and ort_int8, export, run the files; returns the accuracies by name."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--fast", action="store_true", help="a short training run (for tests)")
    parser.add_argument("--out", default=None, help="folder for the exported files (default: a temporary one)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    g = torch.Generator().manual_seed(0)
    model = train(60 if args.fast else 300, g)
    tokens, padding, labels = count_task(1000, g)
    no_padding = torch.zeros_like(padding)
    with torch.no_grad():
        results = {"float": _accuracy(model(tokens, padding), labels),
                   "float, mask ignored": _accuracy(model(tokens, no_padding), labels)}
    calib = [count_task(64, g)[:2] for _ in range(4)]  # (tokens, padding) batches
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out or tmp)
        for platform in ("trt_int8", "ort_int8"):
            qmodel = fxq.quantize(model, calib, platform, progress=False)
            with torch.no_grad():
                results[platform] = _accuracy(qmodel(tokens, padding), labels)
                results[f"{platform}, mask ignored"] = _accuracy(qmodel(tokens, no_padding), labels)
            written = fxq.export(qmodel, platform, out / f"{platform}.onnx", dynamic_batch=True)
            onnx_file = next(p for p in written if p.suffix == ".onnx")
            results[f"{platform}, onnxruntime"] = _deployed_accuracy(onnx_file, tokens, padding, labels)
    for name, acc in results.items():
        logger.info("%-32s %.1f %%", name, 100 * acc)
    return results


if __name__ == "__main__":
    main()
