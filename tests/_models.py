"""Small seeded models shared by the graph tests (no downloads)."""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
import torchvision
from torch import nn


def resnet18() -> nn.Module:
    torch.manual_seed(0)
    return torchvision.models.resnet18(num_classes=10).eval()


def with_bn_statistics(model: nn.Module, shape: tuple[int, ...], batches: int = 3, mix: float = 1.0,
                       seed: int = 1) -> nn.Module:
    """Move a randomly initialised model's BatchNorm statistics ``mix`` of the way from their init to those of
    random data (``batches`` seeded batches of ``shape``), in place.

    At init BatchNorm is the identity in eval mode (MobileNetV2's activations then vanish to ~1e-10 and every
    scale hits the minimum); fully data-normalised random nets are chaotic (any tiny difference is amplified);
    part of the way (``mix`` 0.2-0.5) gives well-conditioned test models.
    """
    data_stats = copy.deepcopy(model)
    for m in data_stats.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.reset_running_stats()
            m.momentum = None  # cumulative average over the batches below
    data_stats.train()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _ in range(batches):
            data_stats(torch.randn(*shape, generator=g))
    for a, b in zip(model.modules(), data_stats.modules()):
        if isinstance(a, nn.modules.batchnorm._BatchNorm):
            a.running_mean.lerp_(b.running_mean, mix)
            a.running_var.lerp_(b.running_var, mix)
    return model.eval()


def mobilenet_v2(num_classes: int = 10) -> nn.Module:
    """Seeded MobileNetV2 with BatchNorm statistics half-way between its init (signal fades to ~1e-10) and
    random-data statistics (every layer normalised: chaotic, quantization errors explode) — well conditioned."""
    torch.manual_seed(0)
    model = torchvision.models.mobilenet_v2(num_classes=num_classes).eval()
    return with_bn_statistics(model, (4, 3, 64, 64), mix=0.5)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        attn = (q @ k.transpose(-2, -1)) * (c // self.heads) ** -0.5
        attn = attn.softmax(dim=-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(b, n, c))


class EncoderBlock(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, dim * 2)
        self.fc2 = nn.Linear(dim * 2, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class TinyEncoder(nn.Module):
    """A small pre-norm transformer encoder written with plain ops (fx-traceable)."""

    def __init__(self, in_dim: int = 16, dim: int = 32, depth: int = 2, classes: int = 5) -> None:
        super().__init__()
        self.embed = nn.Linear(in_dim, dim)
        self.pos = nn.Parameter(torch.randn(1, 8, dim) * 0.02)
        self.blocks = nn.Sequential(*[EncoderBlock(dim) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x) + self.pos
        x = self.norm(self.blocks(x))
        return self.head(x.mean(dim=1))


def tiny_encoder() -> nn.Module:
    torch.manual_seed(0)
    return TinyEncoder().eval()


class SmallCNN(nn.Module):
    """conv-bn-relu, maxpool, residual add, concat, conv-transpose, avgpool, linear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.conv3 = nn.Conv2d(8, 8, 1)
        self.up = nn.ConvTranspose2d(16, 4, 2, stride=2)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.max_pool2d(x, 2)
        y = self.conv2(x) + x
        z = torch.cat([y, torch.relu(self.conv3(y))], dim=1)
        z = self.up(z)
        return self.fc(torch.flatten(self.pool(z), 1))


def small_cnn() -> nn.Module:
    torch.manual_seed(0)
    return with_bn_statistics(SmallCNN(), (4, 3, 16, 16))


def noise_ratio(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Noise power / signal power (PPQ's SNR, lower is better)."""
    return float((out - ref).pow(2).sum() / ref.pow(2).sum())


def torch_encoder() -> nn.Module:
    """A transformer built from torch's own modules (nn.TransformerEncoder / MultiheadAttention)."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, norm_first=True, activation="gelu")
    return nn.Sequential(nn.Linear(16, 32), nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(32),
                                                                  enable_nested_tensor=False), nn.Linear(32, 5)).eval()


class DigitsNet(nn.Module):
    """c1-relu, c2-relu-maxpool, c3-relu, (``residual``: x + relu(c4(x))), global avg pool, fc — for 8x8 digits."""

    def __init__(self, residual: bool = False) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(1, 16, 3, padding=1)
        self.c2 = nn.Conv2d(16, 32, 3, padding=1)
        self.c3 = nn.Conv2d(32, 32, 3, padding=1)
        self.c4 = nn.Conv2d(32, 32, 3, padding=1) if residual else None
        self.fc = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.c1(x))
        x = F.max_pool2d(F.relu(self.c2(x)), 2)
        x = F.relu(self.c3(x))
        if self.c4 is not None:
            x = x + F.relu(self.c4(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def digits_tensors() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's digits as normalized ``(1797, 1, 8, 8)`` images and labels (skips the test without sklearn)."""
    import pytest

    sk = pytest.importorskip("sklearn.datasets")
    d = sk.load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    return (x - x.mean()) / x.std(), torch.tensor(d.target, dtype=torch.long)


def train_digits(model: nn.Module, x: torch.Tensor, y: torch.Tensor, epochs: int = 6, lr: float = 1e-2,
                 n_train: int = 1200) -> nn.Module:
    """Adam on the first ``n_train`` digits, batches of 64 in a seeded order; returns ``model`` in eval mode."""
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(0)
    for _ in range(epochs):
        perm = torch.randperm(n_train, generator=gen)
        for i in range(0, n_train, 64):
            j = perm[i:i + 64]
            loss = F.cross_entropy(model(x[j]), y[j])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model.eval()


class KeypointScores(nn.Module):
    """YOLO pose's decode: every third channel (a keypoint's score) goes through a sigmoid in place
    (torch.export records ``slice_scatter(..., step=3)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 9, 3, padding=1)

    def forward(self, x):
        y = self.conv(x).flatten(2)
        y[:, 2::3] = y[:, 2::3].sigmoid()
        return y

