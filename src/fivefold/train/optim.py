"""AdamW and the learning-rate schedule (a pure function of the step, so resuming is exact)."""

from __future__ import annotations

import math

import torch
from torch import nn

from fivefold.config import TrainConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices (projections, embeddings, experts), none on norms. ZeRO-3 under expert parallel
    holds parameters sharded over two meshes (and, with one rank per expert replica, plain ones): a pair of groups
    per mesh, since a fused step takes the tensors of one group together."""
    by_mesh: dict = {}
    seen: set[int] = set()
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        decay, no_decay = by_mesh.setdefault(getattr(p, "device_mesh", None), ([], []))
        (decay if p.ndim >= 2 else no_decay).append(p)
    groups = []
    for decay, no_decay in by_mesh.values() or [([], [])]:
        groups += [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return groups


def build_adamw(model: nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW, fused on every device (the fused kernel can skip a step on a device-side flag, see
    `Engine.step_guarded`)."""
    return torch.optim.AdamW(
        param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=True,
    )


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warmup, then cosine or WSD decay to
    `min_lr_ratio * lr`, or constant."""
    peak, floor = cfg.lr, cfg.lr * cfg.min_lr_ratio
    if step < cfg.warmup_steps:
        return peak * (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return peak
    remaining = max(1, cfg.max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / remaining)
    if cfg.lr_schedule == "cosine":
        return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    # warmup-stable-decay: hold the peak, then decay linearly over the last `wsd_decay_fraction`
    decay_start = 1.0 - cfg.wsd_decay_fraction
    if progress <= decay_start:
        return peak
    return peak + (floor - peak) * (progress - decay_start) / cfg.wsd_decay_fraction
