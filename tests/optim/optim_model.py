"""The small model, batches and optimizer settings shared by the optim workers and tests."""

from __future__ import annotations

import torch
from torch import nn

STEPS = 20
BATCH_PER_RANK = 8
# 13 -> 37 -> 37 -> 10 with biases: odd tensor sizes (shard cuts fall inside parameters)
# and 2304 = 9 * 256 elements in all, so no padding: state bytes equal the formula exactly.
NUM_PARAMS = 2304
BUCKET_BYTES = 1024  # 256 elements: 9 gradient buckets, several gather chunks per shard

OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "betas": (0.9, 0.95)}),
    "sgd": (torch.optim.SGD, {"lr": 5e-2, "momentum": 0.9, "weight_decay": 1e-3}),
}


def build_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(13, 37), nn.Tanh(), nn.Linear(37, 37), nn.Tanh(), nn.Linear(37, 10))
    assert sum(p.numel() for p in model.parameters()) == NUM_PARAMS
    return model


def lr_lambda(step: int) -> float:
    return 1.0 / (1.0 + 0.1 * step)  # a schedule that visibly changes the lr every step


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A pure function of (step, rank), the same in every process."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(BATCH_PER_RANK, 13, generator=g), torch.randn(BATCH_PER_RANK, 10, generator=g)


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(x) - y).pow(2).mean()


def flat_weights(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()
