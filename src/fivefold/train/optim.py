"""AdamW and the learning-rate schedule (a pure function of the step and of the run's extensions, which every
checkpoint records, so resuming is exact)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

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


def lr_at(step: int, cfg: TrainConfig, max_steps: int | None = None) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warmup, then cosine or WSD decay to
    `min_lr_ratio * lr` at `max_steps` (default `cfg.max_steps`), or constant."""
    peak, floor = cfg.lr, cfg.lr * cfg.min_lr_ratio
    max_steps = cfg.max_steps if max_steps is None else max_steps
    if step < cfg.warmup_steps:
        return peak * (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return peak
    remaining = max(1, max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / remaining)
    if cfg.lr_schedule == "cosine":
        return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    # warmup-stable-decay: hold the peak, then decay linearly over the last `wsd_decay_fraction`
    decay_start = 1.0 - cfg.wsd_decay_fraction
    if progress <= decay_start:
        return peak
    return peak + (floor - peak) * (progress - decay_start) / cfg.wsd_decay_fraction


@dataclass(frozen=True)
class LrSchedule:
    """The learning rate of every optimizer step of a run whose `train.max_steps` may have been raised on resume.
    `phases` are (end step, kind): the first, "schedule", is `lr_at` over its end (the run's first max_steps); each
    extension adds a phase to its new max_steps that holds the rate the phases before it ended at ("hold"), or decays
    from it to `min_lr_ratio` times it ("decay": cosine, linear under wsd). A "stretch" extension plans
    `train.lr_schedule` again over the new total: one "schedule" phase (the rate goes back up)."""

    cfg: TrainConfig
    phases: tuple[tuple[int, str], ...]

    @classmethod
    def plain(cls, cfg: TrainConfig) -> LrSchedule:
        return cls(cfg, ((cfg.max_steps, "schedule"),))

    def at(self, step: int) -> float:
        i = next((i for i, (end, _) in enumerate(self.phases) if step < end), len(self.phases) - 1)
        start, (end, kind) = self.phases[i - 1][0] if i else 0, self.phases[i]
        if kind == "schedule":
            return lr_at(step, self.cfg, end)
        rate = LrSchedule(self.cfg, self.phases[:i]).at(start)  # where the phases before this one ended
        if kind == "hold":
            return rate
        progress, floor = min(1.0, (step - start) / max(1, end - start)), rate * self.cfg.min_lr_ratio
        if self.cfg.lr_schedule == "wsd":
            return rate + (floor - rate) * progress
        return floor + (rate - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    def resized(self, max_steps: int, on_extension: str) -> LrSchedule:
        """This schedule for a run resumed with `max_steps`: extended the `on_extension` way when it is more than
        the schedule's end; cut at it when less (the last phase ending there)."""
        if max_steps > self.phases[-1][0]:
            if on_extension == "stretch":
                return LrSchedule.plain(dataclasses.replace(self.cfg, max_steps=max_steps))
            return LrSchedule(self.cfg, (*self.phases, (max_steps, on_extension)))
        kept = tuple(p for p in self.phases if p[0] < max_steps)
        return LrSchedule(self.cfg, (*kept, (max_steps, self.phases[len(kept)][1])))


def describe_extension(before: LrSchedule, after: LrSchedule) -> str:
    """The line that says how the learning rate goes on when a resume raises train.max_steps."""
    old, new, how = before.phases[-1][0], after.phases[-1][0], after.cfg.lr_on_extension
    rate = before.at(old)
    what = {"hold": f"stays at the schedule's final {rate:.2e}",
            "decay": f"decays from the schedule's final {rate:.2e} to {rate * after.cfg.min_lr_ratio:.2e}",
            "stretch": f"follows train.lr_schedule planned again over {new} steps, from {after.at(old):.2e} (the "
                       f"schedule ended at {rate:.2e})"}
    return (f"learning rate: train.max_steps {old} -> {new} extends the run; train.lr_on_extension = {how}: the rate "
            f"{what[how]} for steps {old + 1} to {new} (other choices: "
            f"{', '.join(k for k in ('hold', 'decay', 'stretch') if k != how)})")
