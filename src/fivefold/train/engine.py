"""The training step: forward and backward over the micro-batches of one global batch, gradient clipping and the
optimizer step, for one rank of any layout (one device being a grid of one rank).

`Engine` is the one engine. It is built by `fivefold.train.build.build_engine` from the model's parts on this rank
(the whole model, or its pipeline stages), the loss module, the data-parallel states (`parallel.data.DataParallel`:
one device, ZeRO-0/1/2 buckets, `fully_shard`, `fully_shard` per stage) and a step runner (`train.step`: the
micro-batch loop, or the pipeline schedule), chosen once. What a layout changes is behind those: the engine cuts a
micro-batch for context parallel (`prepare_micro_batch`), sums the gradient norm over the shards (tp, ep, pp, and
the data-parallel groups inside `grad_square_sums`), sums logged values over the ranks that hold different tokens,
and names the pieces of the plain-model state this rank holds for checkpoints (`state_segments`). The contract:

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
import functools
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from fivefold.checkpoint_format import TensorReader, flat_rects
from fivefold.config import Config, ConfigError
from fivefold.device import autocast, use_bf16
from fivefold.models.llama import Llama, MoE, build_model, full_parameter_shapes
from fivefold.models.masking import document_positions
from fivefold.parallel.data import DataParallel, Segment, local_part
from fivefold.parallel.float8 import gathers_float8, precompute_weight_scales
from fivefold.parallel.mesh import ProcessGrid
from fivefold.parallel.parallelize import LossModel
from fivefold.parallel.pipeline import layer_ranges, stage_layer_counts
from fivefold.parallel.schedules import stage_placement
from fivefold.train.checkpoint import Piece
from fivefold.train.expect import WaitClock
from fivefold.train.optim import LrSchedule, build_adamw
from fivefold.train.step import StepRunner, router_loss_share, stage_modules

__all__ = ["MOMENTS", "Engine", "Segment"]

MOMENTS = ("exp_avg", "exp_avg_sq")


class Engine:
    """Trains this rank's part of the model. `dp_rank`/`dp_size` select this rank's rows of the batch (every cp
    rank of a dp rank gets the same rows and keeps its chunks of them); `grid` None is one device."""

    def __init__(self, cfg: Config, device: torch.device, parts: dict[int, Llama], loss_model: LossModel | None,
                 data_parallels: list[DataParallel], runner: StepRunner, grid: ProcessGrid | None = None) -> None:
        self.cfg, self.device, self.parts, self.loss_model, self.grid = cfg, device, parts, loss_model, grid
        self.data_parallels, self.runner = data_parallels, runner
        self.data_parallel = data_parallels[0]  # the dense parameters' (the experts' follows under ep)
        self.model = parts[0] if cfg.layout.pp == 1 else stage_modules(parts)
        self.bf16 = use_bf16(cfg, device)
        self.drop_fraction: torch.Tensor | None = None
        # the data's end-of-document token under `model.attn_mask = "document"` (set by the training loop)
        self.eos_id: int | None = None
        self.step_flags: torch.Tensor | None = None
        # seconds waited for peers, for the training loop's plan check (`train.expect`), which turns it on
        self.waits = WaitClock(device, enabled=False)
        self._shapes: dict[str, tuple[int, ...]] | None = None  # the plain model's, for checkpoint segments
        self.lr_schedule = LrSchedule.plain(cfg.train)  # a resume that raises train.max_steps extends it
        # waits of the background readers of the live weights and optimizer state (the CPU's asynchronous checkpoint
        # writes them without a copy): each returns once its reader is done, before the next step changes them, or
        # gives the reader up when its argument turns true (a stop, whose own checkpoint is newer)
        self.state_readers: list[Callable[[Callable[[], bool]], None]] = []
        self.stop_asked: Callable[[], bool] = lambda: False  # set by the training loop (its stop signals)
        if grid is None:
            self.dp_rank = self.tp_rank = self.cp_rank = self.ep_rank = self.pp_rank = 0
            self.dp_size = self.tp_size = self.cp_size = self.ep_size = self.pp_size = self.n_devices = 1
            self.is_logging_rank, self.pp_group, self.pp_channels = True, None, []
        else:
            self.dp_rank, self.dp_size = grid.ranks["dp"], grid.size("dp")
            self.tp_rank, self.tp_size = grid.ranks["tp"], grid.size("tp")
            self.cp_rank, self.cp_size = grid.ranks["cp"], grid.size("cp")
            self.ep_rank, self.ep_size = grid.group_ranks["ep"].index(grid.rank), grid.size("ep")
            self.pp_rank, self.pp_size, self.pp_group = grid.ranks["pp"], grid.size("pp"), grid.group("pp")
            self.pp_channels = grid.pp_channels  # the point-to-point communicators (`pipeline_comm.edge_channel`)
            self.is_logging_rank = grid.rank == 0
            self.n_devices = grid.world_size
        # what AdamW steps: this rank's share as the data-parallel states hand it over (ZeRO slices, tp and ep
        # shards, fp32 masters under lean mixed precision)
        optimized = nn.ParameterList([p for dp in data_parallels for p in dp.optimizer_params()])
        self.optimizer = build_adamw(optimized, cfg.train, device)

    def autocast(self) -> contextlib.AbstractContextManager:
        return autocast(self.device, self.bf16)

    # --- the step ---------------------------------------------------------------------------------
    def prepare_micro_batch(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor | None
    ]:
        """What this rank computes of a micro-batch of whole sequences [rows, seq]: (inputs, targets, rotary
        positions, None meaning 0..seq-1). Under context parallel, this cp rank's zig-zag chunks of every sequence
        and their rotary positions; otherwise all of it. Under document masking the positions are the tokens'
        positions in their documents [rows, seq] (`models.masking.document_positions`), computed here from the
        whole sequences, before the cp split, so that every rank and pipeline stage holds the same ones."""
        positions = self.document_positions(inputs)
        if self.cp_size == 1:
            return inputs, targets, positions
        from fivefold.parallel.context import shard_batch

        return shard_batch(inputs, targets, self.cp_rank, self.cp_size, positions=positions)

    def document_positions(self, inputs: torch.Tensor) -> torch.Tensor | None:
        """The document positions of `inputs` [rows, seq] under document masking, else None."""
        if self.cfg.model.attn_mask != "document":
            return None
        if self.eos_id is None:
            raise ConfigError("model.attn_mask = 'document' needs the data's end-of-document token (the shard "
                              "index's eos_id); the engine was given none")
        return document_positions(inputs, self.eos_id)

    def loss_sum(self, inputs: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        """Summed token loss of a prepared micro-batch (`LossModel`: the output layer and the loss fused and
        chunked, vocabulary-parallel under tp, so the whole batch's fp32 logits are never materialised)."""
        with self.autocast():
            return self.loss_model(inputs, targets, positions)

    def eval_loss_sum(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Summed token loss of this rank's part of a batch of whole sequences (also the training loss before
        normalisation)."""
        return self.runner.eval_loss_sum(self, inputs, targets)

    @torch.no_grad()
    def eval_micro_batches(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Summed token loss over the micro-batches, forward only (a pipeline runs them as one schedule)."""
        return self.runner.eval_micro_batches(self, micro_batches)

    def micro_batch_loss(self, inputs: torch.Tensor, targets: torch.Tensor, global_tokens: int) -> tuple[
        torch.Tensor, torch.Tensor
    ]:
        """(loss to backpropagate, summed token loss) of one micro-batch of whole sequences."""
        inputs, targets, positions = self.prepare_micro_batch(inputs, targets)
        loss_sum = self.loss_sum(inputs, targets, positions)
        loss = loss_sum / global_tokens
        router_loss = self.model.moe_router_loss()
        if router_loss is not None:
            loss = loss + router_loss_share(self.cfg, router_loss, targets.numel())
        return loss, loss_sum.detach()

    @contextlib.contextmanager
    def micro_batch_context(self, index: int, count: int) -> Iterator[None]:
        """Micro-batch `index` of `count`: data parallel reduces the gradients on the last one only."""
        for dp in self.data_parallels:
            dp.sync = index == count - 1
        yield
        with self.waits() if any(dp.reduces_now for dp in self.data_parallels) else contextlib.nullcontext():
            for dp in self.data_parallels:
                dp.end_micro_batch()

    def forward_backward(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], global_tokens: int) -> (
        torch.Tensor
    ):
        return self.runner.forward_backward(self, micro_batches, global_tokens)

    def moe_drop_fraction(self) -> float | None:
        """Fraction of routed slots that capacity-based routing dropped in the last step (mean over the MoE
        layers and micro-batches; over the ranks under data, context or expert parallel), or None without
        capacity-based routing (a dense or dropless model). Collective over a grid."""
        if self.drop_fraction is None:
            return None
        if self.grid is None:
            return float(self.drop_fraction)
        # the mean over dp x cp ranks, which route equally many slots (and over tp, whose ranks route their own parts
        # of the tokens when the experts stay whole)
        total = self.reduce_for_logging(self.drop_fraction)
        ranks = dist.get_world_size(self.grid.group("dp_cp"))
        if self.cfg.layout.splits_tokens_over_tp:
            dist.all_reduce(total, group=self.grid.group("tp"))
            ranks *= self.tp_size
        return float(total) / ranks

    def local_grads(self) -> list[torch.Tensor]:
        """The gradients of what the optimizer steps, as plain local tensors (a ZeRO-3 shard's local slice)."""
        return [local_part(p.grad) for dp in self.data_parallels for p in dp.optimizer_params() if p.grad is not None]

    def grad_square_sum(self) -> torch.Tensor:
        """Sum of the squared gradients of the whole model (every rank gets the same value): tp-sharded parameters
        summed over tp, experts over ep, each pipeline rank's over pp (ZeRO slices inside `grad_square_sums`)."""
        sharded, replicated = self.data_parallel.grad_square_sums()
        for experts_dp in self.data_parallels[1:]:  # each ep rank holds other experts (and under tp, a slice)
            experts = sum(experts_dp.grad_square_sums())
            dist.all_reduce(experts, group=self.grid.group("ep"))
            if self.cfg.layout.splits_tokens_over_tp:  # whole experts: reduced over edp, which spans tp
                replicated = replicated + experts
            else:
                sharded = sharded + experts
        if self.tp_size > 1:  # each tp rank holds a different slice of the sharded parameters
            dist.all_reduce(sharded, group=self.grid.group("tp"))
        total = sharded + replicated
        if self.pp_size > 1:  # each pp rank holds other parameters
            dist.all_reduce(total, group=self.pp_group)
        return total

    def grad_norm(self) -> torch.Tensor:
        """The global gradient norm of the whole model (every rank gets the same value). One device takes torch's
        total norm of the gradients (the order `clip_grad_norm_` sums in)."""
        if self.grid is None:
            return nn.utils.get_total_norm(self.local_grads(), foreach=True)
        return self.grad_square_sum().sqrt()

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Scale the gradients so that their global norm is at most `max_norm` (0: no clipping); returns the norm
        before clipping."""
        norm = self.grad_norm()
        if max_norm > 0:
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            for grad in self.local_grads():
                grad.mul_(coef)
        return norm

    def set_lr(self, step: int) -> float:
        lr = self.lr_schedule.at(step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def optimizer_step(self, loss_sum: torch.Tensor | None = None, stop: bool = False) -> torch.Tensor:
        for dp in self.data_parallels:
            dp.attach_grads()
        with self.waits():  # the norm's and the agreement's all-reduces: where this rank meets its peers
            norm = self.clip_grad_norm(self.cfg.train.grad_clip)
        self.wait_for_state_readers(stop)
        self.step_guarded(norm, loss_sum, stop)
        self.update_expert_bias()
        for dp in self.data_parallels:
            dp.after_step()
        if gathers_float8(self.cfg):  # the next gathers' float8 scales, in one all-reduce
            precompute_weight_scales(self.parts.values())
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def wait_for_state_readers(self, stop: bool = False) -> None:
        """Wait until every background reader of the live state (`state_readers`) is done with it: the optimizer step
        is the first thing that changes the weights and AdamW's moments after a checkpoint. With `stop` (or a stop
        asked meanwhile) the readers are given up instead: the stop's own checkpoint is newer."""
        while self.state_readers:
            self.state_readers.pop()(lambda: stop or self.stop_asked())

    @functools.cached_property
    def moe_layers(self) -> list[MoE]:
        """This rank's MoE layers (found once: the model's modules do not change after the build)."""
        return [m for m in self.model.modules() if isinstance(m, MoE)]

    def update_expert_bias(self) -> None:
        """Auxiliary-loss-free balancing (`model.bias_update_rate > 0`): each MoE layer's bias moves towards the
        mean load of the step's global batch: the loads of this rank's micro-batches summed over the ranks that
        hold other tokens (dp x cp, which ep folds over; and tp with whole experts, where each tp rank routes its own
        part of the tokens), in one all-reduce of every layer's loads per group, so every rank moves the same bias.
        Outside autograd; not when the step is skipped."""
        layers = self.moe_layers
        if self.cfg.model.bias_update_rate <= 0 or not layers:
            return
        loads = torch.stack([m.expert_load for m in layers])
        if self.grid is not None:
            dist.all_reduce(loads, group=self.grid.group("dp_cp"))
            if self.cfg.layout.splits_tokens_over_tp:  # whole experts: each tp rank routed its own tokens
                dist.all_reduce(loads, group=self.grid.group("tp"))
        loads = loads * (1 - self.step_flags[0]).to(loads.dtype)  # a skipped step moves nothing
        for moe, load in zip(layers, loads, strict=True):
            moe.update_bias(load)

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
        """The maximum of `flags` over every rank (one all-reduce, no host sync; identity on one device)."""
        if self.grid is not None:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return flags

    def reduce_for_logging(self, value: torch.Tensor) -> torch.Tensor:
        """Sum a per-rank scalar over the ranks that hold different tokens: dp x cp, and pp (only the last stage's
        is not zero); tp ranks hold the same value. Identity on one device."""
        if self.grid is None:
            return value
        value = value.clone()
        dist.all_reduce(value, group=self.grid.group("dp_cp"))
        if self.pp_size > 1:
            dist.all_reduce(value, group=self.pp_group)
        return value

    def barrier(self) -> None:
        """Wait for every rank (no-op on one device)."""
        if self.grid is not None:
            dist.barrier()

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.model.parameters()

    # --- state for checkpoints -------------------------------------------------------------------
    def model_state(self) -> dict[str, torch.Tensor]:
        """The full, unsharded model state with plain-model names (tied weights once). Collective over a grid:
        every rank must call it."""
        state = self.full_model_state()
        if self.cfg.model.tied_embeddings:
            state.pop("lm_head.weight", None)
        return state

    def _parts_state(self) -> dict[str, torch.Tensor]:
        """The state of this rank's parts, plain-named, as the modules hold it (after freeing gathered weights)."""
        for dp in self.data_parallels:
            dp.reshard()
        return {name: t for part in self.parts.values() for name, t in part.state_dict().items()}

    def _local_state(self) -> dict[str, torch.Tensor]:
        """This rank's tp/ep-local parameters with plain names, whole over dp (the fp32 master values under lean
        mixed precision; collective over the data-parallel groups)."""
        state = self._parts_state()
        for dp in self.data_parallels:
            state = dp.plain_state(state)
        return state

    def _gathered_state(self) -> dict[str, torch.Tensor]:
        """This rank's parameters with plain names, whole over tp and ep (collective over those groups)."""
        state = self._local_state()
        if self.tp_size > 1:
            from fivefold.parallel.tensor import gather_state

            state = gather_state(state, self.grid.group("tp"), self.cfg.layout.splits_experts_over_tp)
        if self.ep_size > 1:
            from fivefold.parallel.expert import gather_expert_state

            state = gather_expert_state(state, self.grid.group("ep"))
        return state

    def full_model_state(self) -> dict[str, torch.Tensor]:
        """The full plain-named state on every rank (under pipeline parallel a tied output layer left out: each
        stage's parameters, whole over tp and ep, broadcast from their pp rank over the pp group)."""
        mine = self._gathered_state()
        if self.pp_size == 1:
            return mine
        counts = stage_layer_counts(self.cfg)
        placement = stage_placement(self.cfg.layout.schedule, self.cfg.layout.pp, self.cfg.layout.vpp)
        full = {}
        for name, meta in build_model(self.cfg.model, device="meta").state_dict().items():
            if name == "lm_head.weight" and self.cfg.model.tied_embeddings:
                continue
            owner = stage_owner(name, counts, placement)
            tensor = mine[name] if owner == self.pp_rank else torch.empty(meta.shape, dtype=meta.dtype,
                                                                          device=self.device)
            tensor = tensor.detach().contiguous()
            dist.broadcast(tensor, group=self.pp_group, group_src=owner)
            full[name] = tensor
        return full

    # --- sharded checkpoints: this rank's pieces of the named fp32 state ---------------------------
    def named_plain_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """This rank's parameters with their plain-model names (tp, ep or ZeRO-3 local parts; a weight tied on one
        rank once, by the embedding's name)."""
        named: dict[int, tuple[str, nn.Parameter]] = {}
        for part in self.parts.values():
            for name, p in part.named_parameters():
                if id(p) not in named or name == "embed.weight":
                    named[id(p)] = (name, p)
        return list(named.values())

    def _global_shapes(self) -> dict[str, tuple[int, ...]]:
        if self._shapes is None:
            self._shapes = {n: tuple(shape) for n, shape in full_parameter_shapes(self.cfg.model).items()}
        return self._shapes

    def _placed(self, name: str, local_shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...], bool]:
        """(global shape, offsets of this rank's tp/ep part in it, whether this rank is its first tp replica):
        a dim smaller than the global one is split over ep (dim 0 of an expert weight) or tp. Whole experts under tp
        (etp = 1) have no tp replicas: the tp ranks are among the edp ranks that their data parallel cuts them over
        (and writes them from)."""
        from fivefold.parallel.expert import is_expert_param

        whole_expert = self.cfg.layout.splits_tokens_over_tp and is_expert_param(name)
        shape = self._global_shapes()[name]
        offsets, tp_split = [], False
        for d, (local, full) in enumerate(zip(local_shape, shape, strict=True)):
            if local == full:
                offsets.append(0)
            elif d == 0 and is_expert_param(name) and self.ep_size > 1 and local * self.ep_size == full:
                offsets.append(self.ep_rank * local)
            else:
                offsets.append(self.tp_rank * local)
                tp_split = True
        return shape, tuple(offsets), tp_split or self.tp_rank == 0 or whole_expert

    def state_segments(self) -> list[Segment]:
        """Every element of the training state this rank holds, by plain parameter name (see `Segment`): its tp/ep
        parts of the parameters, cut as its data parallel holds them (`DataParallel.state_segments`)."""
        for dp in self.data_parallels:
            dp.reshard()
        named = self.named_plain_parameters()
        return [seg for dp in self.data_parallels for seg in dp.state_segments(named, self._placed)]

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
                        flat = local_part(state[key]).view(-1)
                        begin = seg.opt_start + lo - seg.start
                        pieces.append(Piece(f"{key}.{seg.name}", seg.shape, where,
                                            flat[begin:begin + hi - lo].view(shape)))
        if self.dp_rank == self.cp_rank == self.tp_rank == 0:  # the biases' one writer in each pipeline stage
            pieces += [Piece(name, tuple(b.shape), (0,), b) for name, b in self.balancing_biases().items()]
        return pieces, steps

    def balancing_biases(self) -> dict[str, torch.Tensor]:
        """This rank's auxiliary-loss-free balancing biases (`model.bias_update_rate > 0`) by checkpoint name,
        `buffer.<plain MoE layer name>.expert_bias`: whole on every rank of a pipeline stage, which all move them
        alike (`update_expert_bias`)."""
        return {f"buffer.{name}.expert_bias": m.expert_bias for part in self.parts.values()
                for name, m in part.named_modules() if isinstance(m, MoE) and m.bias_update_rate > 0}

    @torch.no_grad()
    def load_state_pieces(self, reader: TensorReader, steps: dict[str, float]) -> None:
        """Load this rank's weights and AdamW state from a checkpoint's pieces (`checkpoint_format.PieceReader`),
        whatever layout wrote them, or its weights alone from a Hugging Face directory (`models.hf.HfSliceReader`):
        each segment reads the rectangles it covers, only those bytes."""
        segments = self.state_segments()
        with_moments = {}
        names = set(reader.names())
        for seg in segments:
            src = self._source(seg.name)
            if all(f"{k}.{src}" in names for k in MOMENTS):
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
                    local_part(state[key]).view(-1)[begin:begin + hi - lo].copy_(
                        reader.read(f"{key}.{src}", where, shape).view(-1))
        for name, bias in self.balancing_biases().items():  # none in released weights: they start at zero
            if name in names:
                bias.copy_(reader.read(name))
        for dp in self.data_parallels:
            dp.after_load()

    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for parameters, gradients and optimizer states (Adam's two moments, and the fp32
        master weights under lean mixed precision: the playbook's k = 12)."""
        held = {"parameters": 0, "gradients": 0}
        for dp in self.data_parallels:
            counted = dp.state_bytes()
            for key in held:
                held[key] += counted[key]
        optimizer = sum(dp.master_bytes() for dp in self.data_parallels)
        for s in self.optimizer.state.values():
            for key in MOMENTS:
                if key in s:
                    t = local_part(s[key])
                    optimizer += t.numel() * t.element_size()
        return {**held, "optimizer": optimizer}


def stage_owner(name: str, counts: list[int], placement: tuple[int, ...]) -> int:
    """The pp rank that holds plain-model parameter `name` (blocks per stage `counts`, stage ranks `placement`)."""
    if name.startswith("embed."):
        return placement[0]
    if name.startswith("layers."):
        index = int(name.split(".")[1])
        stage = next(s for s, r in enumerate(layer_ranges(counts)) if index in r)
        return placement[stage]
    return placement[-1]  # final norm, output layer

