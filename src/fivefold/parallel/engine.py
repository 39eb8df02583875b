"""The parallel engine: the single-device engine's contract (`fivefold.train.engine`) over a process grid.

It differs from the single-device engine in these places: `prepare_micro_batch` keeps a context-parallel
rank's zig-zag chunks of each sequence with their rotary positions; the loss goes through `LossModel`
(vocabulary parallel under tp); each micro-batch tells the data-parallel state whether to reduce gradients
(over dp x cp); the gradient norm is summed over shards (tp-sharded parameters over tp, ZeRO slices over
dp x cp, replicated ones counted once); logged values are summed over dp x cp; and checkpoints gather the
full plain-named state (collective) or shard a loaded one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from fivefold.config import Config
from fivefold.models.llama import Llama, build_model
from fivefold.parallel.data import DEFAULT_BUCKET_BYTES, BucketedDataParallel, FullyShardedDataParallel
from fivefold.parallel.mesh import ProcessGrid
from fivefold.parallel.parallelize import LossModel, parallelize
from fivefold.train.engine import Engine, use_bf16
from fivefold.train.optim import build_adamw


class ParallelEngine(Engine):
    """Trains one rank's part of the model; `dp_rank`/`dp_size` select this rank's rows of the batch (every cp
    rank of a dp rank gets the same rows and keeps its chunks of them)."""

    def __init__(self, model: Llama, loss_model: LossModel,
                 data_parallel: BucketedDataParallel | FullyShardedDataParallel, grid: ProcessGrid, cfg: Config,
                 device: torch.device) -> None:
        self.model, self.loss_model, self.data_parallel, self.grid = model, loss_model, data_parallel, grid
        self.cfg, self.device = cfg, device
        self.bf16 = use_bf16(cfg, device)
        self.dp_rank, self.dp_size = grid.ranks["dp"], grid.size("dp")
        self.tp_rank, self.tp_size = grid.ranks["tp"], grid.size("tp")
        self.cp_rank, self.cp_size = grid.ranks["cp"], grid.size("cp")
        self.is_logging_rank = grid.rank == 0
        self.n_devices = grid.world_size
        # every rank writes its own optimizer file when the states differ between ranks
        self.optimizer_state_is_sharded = cfg.layout.zero >= 1 or self.tp_size > 1
        self.optimizer = build_adamw(nn.ParameterList(data_parallel.optimizer_params()), cfg.train, device)

    def prepare_micro_batch(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor | None
    ]:
        """Under context parallel, this cp rank's zig-zag chunks of every sequence and their rotary positions."""
        if self.cp_size == 1:
            return inputs, targets, None
        from fivefold.parallel.context import shard_batch

        return shard_batch(inputs, targets, self.cp_rank, self.cp_size)

    def loss_sum(self, inputs: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        with self.autocast():
            return self.loss_model(inputs, targets, positions)

    @contextlib.contextmanager
    def micro_batch_context(self, index: int, count: int) -> Iterator[None]:
        self.data_parallel.sync = index == count - 1
        yield
        self.data_parallel.end_micro_batch()

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        self.data_parallel.attach_grads()
        sharded, replicated = self.data_parallel.grad_square_sums()
        if self.tp_size > 1:  # each tp rank holds a different slice of the sharded parameters
            dist.all_reduce(sharded, group=self.grid.tp_group)
        norm = (sharded + replicated).sqrt()
        if max_norm > 0:
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            for p in self.data_parallel.optimizer_params():
                if p.grad is not None:
                    grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                    grad.mul_(coef)
        return norm

    def optimizer_step(self) -> torch.Tensor:
        norm = self.clip_grad_norm(self.cfg.train.grad_clip)
        self.optimizer.step()
        self.data_parallel.after_step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def reduce_for_logging(self, value: torch.Tensor) -> torch.Tensor:
        """Sum over the data- and context-parallel ranks, which hold different tokens (tp ranks hold the same
        value)."""
        value = value.clone()
        dist.all_reduce(value, group=self.grid.grad_group)
        return value

    def moe_drop_fraction(self) -> float | None:
        """The mean over dp x cp ranks, which route equally many slots."""
        if self.drop_fraction is None:
            return None
        return float(self.reduce_for_logging(self.drop_fraction)) / dist.get_world_size(self.grid.grad_group)

    # --- state -----------------------------------------------------------------------------------
    def _local_state(self) -> dict[str, torch.Tensor]:
        """This tp rank's parameters with plain names, unsharded over dp."""
        state = self.model.state_dict()
        if isinstance(self.data_parallel, FullyShardedDataParallel):
            state = {name: t.full_tensor() for name, t in state.items()}
        return state

    def model_state(self) -> dict[str, torch.Tensor]:
        """The full plain-named state on every rank (collective: every rank must call it)."""
        state = self._local_state()
        if self.tp_size > 1:
            from fivefold.parallel.tensor import gather_state

            state = gather_state(state, self.grid.tp_group)
        if self.cfg.model.tied_embeddings:
            state.pop("lm_head.weight", None)
        return state

    @torch.no_grad()
    def load_model_state(self, state: dict[str, torch.Tensor]) -> None:
        if self.cfg.model.tied_embeddings:
            state = {**state, "lm_head.weight": state["embed.weight"]}
        if self.tp_size > 1:
            from fivefold.parallel.tensor import shard_state

            state = shard_state(state, self.tp_rank, self.tp_size)
        if isinstance(self.data_parallel, FullyShardedDataParallel):
            own = self.model.state_dict()
            missing = set(own) ^ set(state)
            if missing:
                raise KeyError(f"model state keys differ: {sorted(missing)}")
            # fully_shard splits dim 0 over the ranks that reduce gradients (dp x cp)
            group = self.grid.grad_group
            size, rank = dist.get_world_size(group), dist.get_rank(group)
            for name, param in own.items():
                param.to_local().copy_(state[name].chunk(size, 0)[rank])
            return
        self.model.load_state_dict(state, strict=True)  # copies in place: bucket views stay views

    def optimizer_state(self) -> dict:
        state = self.optimizer.state_dict()
        state["state"] = {idx: {k: v.to_local() if hasattr(v, "to_local") else v for k, v in s.items()}
                          for idx, s in state["state"].items()}
        state["shard_layout"] = self._shard_layout()
        return state

    def load_optimizer_state(self, state: dict) -> None:
        state = dict(state)
        saved = state.pop("shard_layout", None)
        if saved is not None and saved != self._shard_layout():
            raise ValueError(f"the optimizer state was saved under layout {saved}, not {self._shard_layout()}; "
                             "resume with the same layout")
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        restored = {}
        for idx, values in state["state"].items():
            p = params[int(idx)]
            restored[idx] = {k: self._like_param(v, p) if isinstance(v, torch.Tensor) and v.ndim else v
                             for k, v in values.items()}
        self.optimizer.load_state_dict({**state, "state": restored})

    @staticmethod
    def _like_param(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        if hasattr(param, "device_mesh"):  # a ZeRO-3 shard: rebuild the sharded tensor around the local slice
            from torch.distributed.tensor import DTensor

            return DTensor.from_local(value.to(param.device), param.device_mesh, param.placements,
                                      shape=param.shape, stride=param.stride())
        return value

    def _shard_layout(self) -> dict[str, int]:
        la = self.cfg.layout
        extra = {"cp": la.cp} if la.cp > 1 else {}
        return {"dp": la.dp, "tp": la.tp, **extra, "zero": la.zero, "rank": self.grid.rank}

    def barrier(self) -> None:
        dist.barrier()

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.model.parameters()

    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for parameters, gradients and optimizer states (Adam's two moments)."""
        held = self.data_parallel.state_bytes()
        optimizer = 0
        for s in self.optimizer.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in s:
                    t = s[key].to_local() if hasattr(s[key], "to_local") else s[key]
                    optimizer += t.numel() * t.element_size()
        return {**held, "optimizer": optimizer}


def create_parallel_engine(cfg: Config, device: torch.device,
                           bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> ParallelEngine:
    """Validate the layout against the initialised world, build the grid, the plain model (same seed on every
    rank), apply the layout and return the engine."""
    grid = ProcessGrid.build(cfg)
    model = build_model(cfg.model, device=device, seed=cfg.train.seed)
    loss_model, data_parallel = parallelize(model, cfg, grid, device, bucket_bytes)
    return ParallelEngine(model, loss_model, data_parallel, grid, cfg, device)
