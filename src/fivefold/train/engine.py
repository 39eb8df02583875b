"""The training step: forward and backward over the micro-batches of one global batch, gradient
clipping and the optimizer step, on one device.

`Engine` is the one base of every engine: the parallel engine (`fivefold.train.parallel_engine.ParallelEngine`)
and the pipeline engine (`PipelineEngine`, beside it) extend it. They override what the optimizer steps, how a
micro-batch is cut and its loss computed (context and tensor parallel), how gradients are reduced and their norm
summed over shards, and which pieces of the state a rank holds for checkpoints (`state_segments`); the step itself
(`forward_backward`, clipping, `optimizer_step`) is written here once. The contract that every engine keeps:

* `forward_backward(micro_batches, global_tokens)` runs every micro-batch of this rank's share of the
  global batch; each micro-batch's summed token loss is divided by the number of target tokens in the
  *global* batch before backward, so gradients summed over micro-batches (and over data-parallel ranks)
  are the gradient of the global mean loss, whatever the layout. It returns this rank's summed token loss.
* `optimizer_step(loss_sum, stop)` clips the global gradient norm, steps and zeroes the gradients, and returns the
  norm. It skips the update (on the device, without a host sync) when the loss or the norm is not finite on any
  rank, and leaves `step_flags` = [skipped, stop asked on any rank] (0 or 1, the same on every rank).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from fivefold import faults
from fivefold.checkpoint_format import flat_rects
from fivefold.config import Config
from fivefold.device import autocast, use_bf16
from fivefold.models.loss import model_loss_sum
from fivefold.train.checkpoint import Piece
from fivefold.train.optim import build_adamw, lr_at

MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass
class Segment:
    """Elements of one plain-model parameter that this rank holds, and where AdamW keeps their moments: the flat
    range [start, end) (row-major) of this rank's local tensor, a rectangle of the global tensor at `offsets`
    (its tp slice, ep experts or ZeRO-3 shard; the whole tensor on one device)."""

    name: str
    shape: tuple[int, ...]  # of the global tensor
    offsets: tuple[int, ...]  # of the local tensor in it
    local_shape: tuple[int, ...]
    start: int
    end: int
    weight: torch.Tensor  # 1-D view of the (fp32 master) weights of those elements
    opt_param: torch.Tensor  # the parameter whose AdamW state holds their moments
    opt_start: int  # at this offset of its flattened state
    write: bool  # this rank writes them (one owner per element: the first of the replicas)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class Engine:
    """Single-device engine. `dp_rank`/`dp_size` tell the data sampler which rows of the batch are ours."""

    dp_rank = 0
    dp_size = 1
    drop_fraction: torch.Tensor | None = None
    is_logging_rank = True
    n_devices = 1

    def __init__(self, model: nn.Module, cfg: Config, device: torch.device) -> None:
        self.model, self.cfg, self.device = model, cfg, device
        self.bf16 = use_bf16(cfg, device)
        self.optimizer = build_adamw(self.optimized_parameters(), cfg.train, device)

    def optimized_parameters(self) -> nn.Module:
        """The parameters that this rank's optimizer steps (the whole model on one device)."""
        return self.model

    def autocast(self) -> contextlib.AbstractContextManager:
        return autocast(self.device, self.bf16)

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
            return model_loss_sum(self.model, inputs, targets, positions,
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

    def local_grads(self) -> list[torch.Tensor]:
        """The gradients that this rank's optimizer steps, as plain local tensors."""
        return [p.grad for p in self.model.parameters() if p.grad is not None]

    def grad_norm(self) -> torch.Tensor:
        """The global gradient norm of the whole model (every rank gets the same value)."""
        return nn.utils.get_total_norm(self.local_grads(), foreach=True)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Scale the gradients so that their global norm is at most `max_norm` (0: no clipping); returns the norm
        before clipping. The one place where every engine clips."""
        norm = self.grad_norm()
        if max_norm > 0:
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            for grad in self.local_grads():
                grad.mul_(coef)
        return norm

    def set_lr(self, step: int) -> float:
        lr = lr_at(step, self.cfg.train)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def optimizer_step(self, loss_sum: torch.Tensor | None = None, stop: bool = False) -> torch.Tensor:
        norm = self.clip_grad_norm(self.cfg.train.grad_clip)
        self.step_guarded(norm, loss_sum, stop)
        self.after_optimizer_step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def after_optimizer_step(self) -> None:
        """Work after the optimizer stepped and before the gradients are cleared (none on one device)."""

    def step_guarded(self, norm: torch.Tensor, loss_sum: torch.Tensor | None, stop: bool) -> None:
        """Step the optimizer unless the loss or the gradient norm is non-finite on some rank: the flag goes to the
        fused AdamW kernel as `found_inf` (the protocol `torch.amp.GradScaler` uses), which then leaves the
        parameters, moments and step count as they were, decided on the device."""
        bad = ~torch.isfinite(norm.detach().float())
        if loss_sum is not None:
            bad = bad | ~torch.isfinite(loss_sum.detach().float())
        asked = torch.ones if stop else torch.zeros
        flags = torch.stack([bad.float(), asked((), device=bad.device)])
        self.step_flags = self.agree(flags)
        self.optimizer.found_inf = self.step_flags[0].clone()
        try:
            self.optimizer.step()
        finally:
            del self.optimizer.found_inf

    def agree(self, flags: torch.Tensor) -> torch.Tensor:
        """The maximum of `flags` over every rank (identity on one device)."""
        return flags

    def reduce_for_logging(self, value: torch.Tensor) -> torch.Tensor:
        """Sum a per-rank scalar over the ranks that hold different data (identity on one device)."""
        return value

    # --- state for checkpoints -------------------------------------------------------------------
    def model_state(self) -> dict[str, torch.Tensor]:
        """The full, unsharded model state with plain-model names (tied weights once). Collective in the parallel
        engines: every rank must call it."""
        state = self.full_model_state()
        if self.cfg.model.tied_embeddings:
            state.pop("lm_head.weight", None)
        return state

    def full_model_state(self) -> dict[str, torch.Tensor]:
        """The whole model's plain-named state (a tied output layer may be left out)."""
        return self.model.state_dict()

    def load_model_state(self, state: dict[str, torch.Tensor]) -> None:
        """Load a plain-named state as `model_state` returns it (tied weights once)."""
        if self.cfg.model.tied_embeddings:
            state = {**state, "lm_head.weight": state["embed.weight"]}
        self.load_full_model_state(state)

    def load_full_model_state(self, state: dict[str, torch.Tensor]) -> None:
        """Load a plain-named state with every parameter of the model (this rank's part of it, in place)."""
        self.model.load_state_dict(state, strict=True)

    # --- sharded checkpoints: this rank's pieces of the named fp32 state ---------------------------
    def state_segments(self) -> list[Segment]:
        """Every element of the training state this rank holds, by plain parameter name (see `Segment`)."""
        return [Segment(name, tuple(p.shape), (0,) * p.ndim, tuple(p.shape), 0, p.numel(), p.detach().view(-1), p,
                        0, True) for name, p in self.model.named_parameters()]

    def _source(self, name: str) -> str:
        """The checkpoint's name for parameter `name` (a tied output layer is stored as the embedding)."""
        return "embed.weight" if name == "lm_head.weight" and self.cfg.model.tied_embeddings else name

    def state_pieces(self) -> tuple[list[Piece], dict[str, float]]:
        """The pieces this rank writes (views of its weights and AdamW moments, no copies) and AdamW's step of
        each parameter it writes. Together over the ranks, each element of each tensor once."""
        pieces: list[Piece] = []
        steps: dict[str, float] = {}
        for seg in self.state_segments():
            if not seg.write or self._source(seg.name) != seg.name:
                continue
            state = self.optimizer.state.get(seg.opt_param, {})
            if "step" in state:
                steps[seg.name] = max(steps.get(seg.name, 0.0), float(state["step"]))
            for off, shape, lo, hi in flat_rects(seg.local_shape, seg.start, seg.end):
                where = tuple(a + b for a, b in zip(seg.offsets, off, strict=True))
                pieces.append(Piece(f"model.{seg.name}", seg.shape, where,
                                    seg.weight[lo - seg.start:hi - seg.start].view(shape)))
                for key in MOMENTS:
                    if key in state:
                        flat = _local(state[key]).view(-1)
                        begin = seg.opt_start + lo - seg.start
                        pieces.append(Piece(f"{key}.{seg.name}", seg.shape, where,
                                            flat[begin:begin + hi - lo].view(shape)))
        return pieces, steps

    @torch.no_grad()
    def load_state_pieces(self, reader, steps: dict[str, float]) -> None:
        """Load this rank's weights and AdamW state from a checkpoint's pieces (`checkpoint_format.PieceReader`),
        whatever layout wrote them: each segment reads the rectangles it covers, only those bytes."""
        segments = self.state_segments()
        with_moments = {}
        for seg in segments:
            src = self._source(seg.name)
            if all(f"{k}.{src}" in reader.index for k in MOMENTS):
                step = steps.get(src, 0.0)
                with_moments[seg.opt_param] = max(with_moments.get(seg.opt_param, 0.0), step)
        index = {p: i for i, p in enumerate(p for g in self.optimizer.param_groups for p in g["params"])}
        fresh = {index[p]: {"step": torch.tensor(step, dtype=torch.float32), "exp_avg": torch.zeros_like(p),
                            "exp_avg_sq": torch.zeros_like(p)} for p, step in with_moments.items()}
        self.optimizer.load_state_dict({"state": fresh, "param_groups": self.optimizer.state_dict()["param_groups"]})
        for seg in segments:
            src = self._source(seg.name)
            state = self.optimizer.state.get(seg.opt_param, {})
            for off, shape, lo, hi in flat_rects(seg.local_shape, seg.start, seg.end):
                where = tuple(a + b for a, b in zip(seg.offsets, off, strict=True))
                seg.weight[lo - seg.start:hi - seg.start].copy_(reader.read(f"model.{src}", where, shape).view(-1))
                if seg.opt_param not in with_moments:
                    continue
                for key in MOMENTS:
                    begin = seg.opt_start + lo - seg.start
                    _local(state[key]).view(-1)[begin:begin + hi - lo].copy_(
                        reader.read(f"{key}.{src}", where, shape).view(-1))
        self.after_state_load()

    def after_state_load(self) -> None:
        """Work after the pieces were loaded (none on one device)."""

    def barrier(self) -> None:
        """Wait for every rank (no-op on one device)."""

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.model.parameters()


class LeanEngine(Engine):
    """Single-device engine under bf16 (the default on accelerators): lean mixed precision as the parallel engines
    do it (`fivefold.parallel.data`), without the sharding. The model holds bf16 working weights, so activations
    and the residual stream are bf16 and no weight is cast per micro-batch; its gradients are added into fp32 buffers
    as backward produces them (`layout.fp32_grad_accum`, the default), or accumulate in bf16 over the micro-batches;
    AdamW steps an fp32 master copy of every parameter, which is cast to the working weights once after each step.
    State: 2 + (4 or 2) + 12 bytes per parameter (weights, gradients, master and moments), where autocast over fp32
    weights holds 4 + 4 + 8 plus a bf16 copy of every weight per micro-batch in flight. The master copy is the
    model state that checkpoints save and load."""

    def __init__(self, model: nn.Module, cfg: Config, device: torch.device) -> None:
        self.names: list[str] = []
        self.working: list[nn.Parameter] = []
        masters = []
        for name, p in model.named_parameters():  # a tied weight once
            masters.append(nn.Parameter(p.detach().clone()))
            p.data = p.data.to(torch.bfloat16)
            self.names.append(name)
            self.working.append(p)
        self.master = nn.ParameterList(masters)
        self.fp32_grads = cfg.layout.fp32_grad_accum
        if self.fp32_grads:
            for p, m in zip(self.working, self.master, strict=True):
                p.register_post_accumulate_grad_hook(self._accumulate_into(m))
        super().__init__(model, cfg, device)

    @staticmethod
    def _accumulate_into(master: nn.Parameter):
        def hook(p: torch.Tensor) -> None:
            if master.grad is None:
                master.grad = p.grad.float()
            else:
                master.grad.add_(p.grad)
            p.grad = None
        return hook

    def optimized_parameters(self) -> nn.Module:
        return self.master

    def local_grads(self) -> list[torch.Tensor]:
        return [m.grad for m in self.master if m.grad is not None]

    def optimizer_step(self, loss_sum: torch.Tensor | None = None, stop: bool = False) -> torch.Tensor:
        for p, m in zip(self.working, self.master, strict=True):  # bf16 gradients to fp32, one tensor at a time
            if p.grad is not None:
                m.grad = p.grad.float()
                p.grad = None
        return super().optimizer_step(loss_sum, stop)

    @torch.no_grad()
    def after_optimizer_step(self) -> None:
        self.cast_masters()

    @torch.no_grad()
    def cast_masters(self) -> None:
        """The working weights from the fp32 masters (once per optimizer step, and after a load)."""
        for p, m in zip(self.working, self.master, strict=True):
            p.copy_(m)

    def full_model_state(self) -> dict[str, torch.Tensor]:
        masters = {id(p): m for p, m in zip(self.working, self.master, strict=True)}
        return {name: (masters[id(t)] if id(t) in masters else t).detach()
                for name, t in self.model.state_dict(keep_vars=True).items()}

    @torch.no_grad()
    def load_full_model_state(self, state: dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict(state, strict=True)  # checks the names and shapes
        for name, m in zip(self.names, self.master, strict=True):
            m.copy_(state[name])
        self.cast_masters()

    def state_segments(self) -> list[Segment]:
        return [Segment(name, tuple(m.shape), (0,) * m.ndim, tuple(m.shape), 0, m.numel(), m.detach().view(-1), m,
                        0, True) for name, m in zip(self.names, self.master, strict=True)]

    def after_state_load(self) -> None:
        self.cast_masters()


def create_engine(cfg: Config, device: torch.device) -> Engine:
    """Build the model for `cfg` (meta device, then materialised and initialised from the seed) and the
    engine that trains it: the single-device engine when every parallel degree is 1 (`LeanEngine` under bf16),
    else the parallel engine, which shards the model over the process grid."""
    la = cfg.layout
    if la.world_size > 1 or la.ep > 1:
        from fivefold.train.parallel_engine import create_parallel_engine

        return create_parallel_engine(cfg, device)
    from fivefold.models.llama import build_model

    model = build_model(cfg.model, device=device, seed=cfg.train.seed)
    if la.recompute != "none":  # before compiling, as the parallel engine orders them
        from fivefold.parallel.recompute import apply_recompute

        apply_recompute(model, la.recompute)
    if cfg.train.compile:
        for block in model.layers.values():
            block.compile()
    return LeanEngine(model, cfg, device) if use_bf16(cfg, device) else Engine(model, cfg, device)
