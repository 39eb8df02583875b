"""The training step: forward and backward over the micro-batches of one global batch, gradient
clipping and the optimizer step, on one device.

The parallel engine extends this class: it overrides how gradients are reduced and clipped, how the loss
is computed under tensor parallel, and how state is gathered for checkpoints. The contract that every
engine keeps:

* `forward_backward(micro_batches, global_tokens)` runs every micro-batch of this rank's share of the
  global batch; each micro-batch's summed token loss is divided by the number of target tokens in the
  *global* batch before backward, so gradients summed over micro-batches (and over data-parallel ranks)
  are the gradient of the global mean loss, whatever the layout. It returns this rank's summed token loss.
* `optimizer_step()` clips the global gradient norm, steps and zeroes the gradients, and returns the norm.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from fivefold import faults
from fivefold.config import Config
from fivefold.models.llama import Llama
from fivefold.train.loss import linear_cross_entropy_sum
from fivefold.train.optim import build_adamw, lr_at

LOSS_CHUNK_TOKENS = 8192  # tokens per chunk of the fused output layer + loss


def resolve_device(name: str) -> torch.device:
    """`auto` picks the current accelerator (CUDA, XPU, ROCm, ...) if there is one, else the CPU."""
    if name == "auto":
        acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        return acc if acc is not None else torch.device("cpu")
    return torch.device(name)


def use_bf16(cfg: Config, device: torch.device | str) -> bool:
    """bf16 autocast (fp32 master weights) on accelerators by default, fp32 on CPU (`device`: a device or its
    type)."""
    kind = device if isinstance(device, str) else device.type
    return cfg.train.dtype == "bf16" or (cfg.train.dtype == "auto" and kind != "cpu")


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed (not averaged) cross-entropy over the tokens; targets of -100 are ignored."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum", ignore_index=-100)


class Engine:
    """Single-device engine. `dp_rank`/`dp_size` tell the data sampler which rows of the batch are ours."""

    dp_rank = 0
    dp_size = 1
    drop_fraction: torch.Tensor | None = None
    is_logging_rank = True
    n_devices = 1

    def __init__(self, model: Llama, cfg: Config, device: torch.device) -> None:
        self.model, self.cfg, self.device = model, cfg, device
        self.bf16 = use_bf16(cfg, device)
        self.optimizer = build_adamw(model, cfg.train, device)

    def autocast(self) -> contextlib.AbstractContextManager:
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16)

    def prepare_micro_batch(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor | None
    ]:
        """What this rank computes of a micro-batch of whole sequences [rows, seq]: (inputs, targets, rotary
        positions, None meaning 0..seq-1). The one place where a layout cuts a micro-batch (the parallel
        engine keeps a context-parallel rank's chunks of each sequence); on one device, all of it."""
        return inputs, targets, None

    def loss_sum(self, inputs: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        """Summed token loss of a prepared micro-batch. The output layer and the loss run fused and chunked, so
        the whole batch's fp32 logits are never materialised."""
        with self.autocast():
            hidden = self.model.forward_hidden(inputs, positions)
            return linear_cross_entropy_sum(hidden, self.model.lm_head.weight, targets, LOSS_CHUNK_TOKENS,
                                            torch.bfloat16 if self.bf16 else torch.float32, self.cfg.train.compile)

    def eval_loss_sum(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Summed token loss of this rank's part of a batch of whole sequences (also the training loss before
        normalisation)."""
        return self.loss_sum(*self.prepare_micro_batch(inputs, targets))

    @torch.no_grad()
    def eval_micro_batches(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Summed token loss over the micro-batches, forward only (a pipeline runs them as one schedule)."""
        total = torch.zeros((), device=self.device, dtype=torch.float64)
        for inputs, targets in micro_batches:
            total += self.eval_loss_sum(inputs, targets).double()
        return total

    def micro_batch_loss(self, inputs: torch.Tensor, targets: torch.Tensor, global_tokens: int) -> tuple[
        torch.Tensor, torch.Tensor
    ]:
        """(loss to backpropagate, summed token loss) of one micro-batch of whole sequences."""
        inputs, targets, positions = self.prepare_micro_batch(inputs, targets)
        loss_sum = self.loss_sum(inputs, targets, positions)
        loss = loss_sum
        aux = self.model.moe_aux_loss()
        if aux is not None:
            # token-weighted mean of the load-balancing loss over the global batch (this rank's tokens' share)
            loss = loss + self.cfg.model.aux_loss_coef * aux * targets.numel()
        return loss / global_tokens, loss_sum.detach()

    def micro_batch_context(self, index: int, count: int) -> contextlib.AbstractContextManager:
        """Context for micro-batch `index` of `count`; data parallel skips gradient sync but for the last."""
        return contextlib.nullcontext()

    def forward_backward(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], global_tokens: int) -> (
        torch.Tensor
    ):
        total = torch.zeros((), device=self.device)
        drops = []
        capacity = self.cfg.model.capacity_factor > 0  # only capacity-based routing drops, so only it is logged
        for i, (inputs, targets) in enumerate(micro_batches):
            faults.note(micro_batch=i, action="forward-backward")
            with self.micro_batch_context(i, len(micro_batches)):
                loss, loss_sum = self.micro_batch_loss(inputs, targets, global_tokens)
                loss.backward()
            total += loss_sum
            drop = self.model.moe_drop_fraction() if capacity else None
            if drop is not None:
                drops.append(drop.detach())
        self.drop_fraction = torch.stack(drops).mean() if drops else None
        return total

    def moe_drop_fraction(self) -> float | None:
        """Fraction of routed slots that capacity-based routing dropped in the last step (mean over the MoE
        layers and micro-batches; over the ranks under data, context or expert parallel), or None without
        capacity-based routing (a dense or dropless model). Collective in the parallel engine."""
        return None if self.drop_fraction is None else float(self.drop_fraction)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        params = [p for p in self.model.parameters() if p.grad is not None]
        if max_norm > 0:
            return nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        return nn.utils.get_total_norm([p.grad for p in params], foreach=True)

    def set_lr(self, step: int) -> float:
        lr = lr_at(step, self.cfg.train)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def optimizer_step(self) -> torch.Tensor:
        norm = self.clip_grad_norm(self.cfg.train.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def reduce_for_logging(self, value: torch.Tensor) -> torch.Tensor:
        """Sum a per-rank scalar over the ranks that hold different data (identity on one device)."""
        return value

    # --- state for checkpoints -------------------------------------------------------------------
    def model_state(self) -> dict[str, torch.Tensor]:
        """The full, unsharded model state with plain-model names (tied weights once)."""
        state = self.model.state_dict()
        if self.cfg.model.tied_embeddings:
            state.pop("lm_head.weight", None)
        return state

    def load_model_state(self, state: dict[str, torch.Tensor]) -> None:
        if self.cfg.model.tied_embeddings:
            state = {**state, "lm_head.weight": state["embed.weight"]}
        self.model.load_state_dict(state, strict=True)

    def optimizer_state(self) -> dict:
        return self.optimizer.state_dict()

    def load_optimizer_state(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)

    def barrier(self) -> None:
        """Wait for every rank (no-op on one device)."""

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.model.parameters()


def create_engine(cfg: Config, device: torch.device) -> Engine:
    """Build the model for `cfg` (meta device, then materialised and initialised from the seed) and the
    engine that trains it: the single-device engine when every parallel degree is 1, else the parallel
    engine, which shards the model over the process grid."""
    la = cfg.layout
    if la.world_size > 1 or la.ep > 1:
        from fivefold.parallel import create_parallel_engine

        return create_parallel_engine(cfg, device)
    from fivefold.models.llama import build_model

    model = build_model(cfg.model, device=device, seed=cfg.train.seed)
    if la.recompute != "none":  # before compiling, as the parallel engine orders them
        from fivefold.parallel.recompute import apply_recompute

        apply_recompute(model, la.recompute)
    if cfg.train.compile:
        for block in model.layers.values():
            block.compile()
    return Engine(model, cfg, device)
