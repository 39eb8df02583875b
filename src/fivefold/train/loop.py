"""The training loop: data, steps, evaluation, metrics, checkpoints, resume and profiling.

Every check that can fail (config, data, run directory, checkpoint) runs before the first step.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import torch

from fivefold import faults
from fivefold.config import (
    Config,
    ConfigError,
    apply_dict,
    apply_overrides,
    build_config,
    dump_toml,
    load_file,
    write_text_atomic,
)
from fivefold.flops import training_flops_per_token
from fivefold.train import checkpoint as ckpt
from fivefold.train.engine import Engine, create_engine, resolve_device
from fivefold.train.metrics import (
    MetricsWriter,
    Throughput,
    gather_ints,
    peak_memory_bytes,
    resolve_peak_tflops,
    step_record,
    synchronize,
    truncate_metrics,
)


class RunDirError(Exception):
    """The run directory cannot be used as asked (holds another run, or has nothing to resume)."""


@dataclass
class TrainResult:
    run_dir: Path
    steps: int
    losses: list[float] = field(default_factory=list)  # train loss of every step run in this call
    val_losses: dict[int, float] = field(default_factory=dict)  # step -> validation loss
    checkpoint: Path | None = None


def resolve_data(cfg: Config, is_first_rank: bool, barrier) -> Path:
    """The prepared dataset directory: the configured one, or the built-in corpus (prepared on first use)."""
    from fivefold.data import default_cache_dir, ensure_builtin_dataset

    if cfg.data.path:
        path = Path(cfg.data.path)
        if not path.is_dir():
            raise ConfigError(
                f"data.path = {cfg.data.path!r} is not a directory; prepare one with "
                "`fivefold data prepare FILES --out DIR`, or leave data.path empty for the built-in corpus"
            )
        return path
    if is_first_rank:  # rank 0 prepares the corpus on first use, the others then find it ready
        ensure_builtin_dataset(default_cache_dir(), val_fraction=cfg.data.val_fraction)
    barrier()
    return ensure_builtin_dataset(default_cache_dir(), val_fraction=cfg.data.val_fraction)


def check_run_dir(run_dir: Path, resume: bool) -> Path | None:
    """For a new run the directory must be absent or empty; for a resume it must hold a checkpoint.
    Returns the checkpoint to resume from."""
    if resume:
        latest = ckpt.latest_checkpoint(run_dir)
        if latest is None:
            raise RunDirError(f"--resume: run directory {run_dir} holds no complete checkpoint to resume from")
        return latest
    if run_dir.exists() and (not run_dir.is_dir() or any(run_dir.iterdir())):
        raise RunDirError(
            f"run directory {run_dir} already holds another run (or other files); pass --resume to continue "
            "it, or choose a new --run-dir"
        )
    return None


def load_run_config(run_dir: Path, overrides: dict[str, str], file: str | None) -> Config:
    """For --resume: the run's own config, then the given file and overrides on top."""
    base = run_dir / "config.toml"
    if not base.is_file():
        raise RunDirError(f"--resume: {base} is missing, so the run's config is unknown")
    cfg = build_config(base, {})
    if file:
        apply_dict(cfg, load_file(file))
    apply_overrides(cfg, overrides)
    return cfg


def split_micro_batches(inputs: torch.Tensor, targets: torch.Tensor, mbs: int, device: torch.device) -> list[
    tuple[torch.Tensor, torch.Tensor]
]:
    """This rank's rows as micro-batches on the device (pinned, asynchronous copies on accelerators)."""
    if device.type != "cpu":
        inputs, targets = inputs.pin_memory(), targets.pin_memory()
    inputs = inputs.to(device, non_blocking=True)
    targets = targets.to(device, non_blocking=True)
    return list(zip(inputs.split(mbs), targets.split(mbs), strict=True))


@torch.no_grad()
def evaluate(engine: Engine, batches: list[tuple[torch.Tensor, torch.Tensor]], mbs: int) -> float:
    """Mean token loss over the validation batches (rows split over data-parallel ranks)."""
    engine.model.eval()
    total = torch.zeros((), device=engine.device, dtype=torch.float64)
    tokens = 0
    for inputs, targets in batches:
        faults.note(micro_batch=None, action="evaluation")
        rows = inputs.shape[0] // engine.dp_size
        lo = engine.dp_rank * rows
        total += engine.eval_micro_batches(split_micro_batches(inputs[lo:lo + rows], targets[lo:lo + rows], mbs,
                                                               engine.device)).double()
        tokens += targets.numel()
    engine.model.train()
    return float(engine.reduce_for_logging(total).item() / tokens)


def train(cfg: Config, resume: bool = False, stop_after: int | None = None, stream: TextIO | None = None,
          hf_init: Path | None = None) -> TrainResult:
    """Train `cfg` in `cfg.run_dir`. `stop_after` ends the call after that many completed steps (as if the
    run were killed right after), which tests use to check resume."""
    from fivefold.data import BatchSampler, TokenDataset, val_batches

    cfg.validate()
    t = cfg.train
    run_dir = Path(cfg.run_dir)
    resume_from = check_run_dir(run_dir, resume)
    device = resolve_device(t.device)
    if t.threads:
        torch.set_num_threads(t.threads)

    is_first = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    barrier = torch.distributed.barrier if torch.distributed.is_initialized() else (lambda: None)
    data_dir = resolve_data(cfg, is_first, barrier)
    train_set, val_set = TokenDataset(data_dir, "train"), TokenDataset(data_dir, "val")
    train_set.check_model_vocab(cfg.model.vocab_size)
    val_set.check_model_vocab(cfg.model.vocab_size)
    sampler = BatchSampler(train_set, t.seq_len, t.global_batch_size, t.seed)
    val_rows = max(cfg.layout.dp, min(t.global_batch_size, 16) // cfg.layout.dp * cfg.layout.dp)
    val_data = list(val_batches(val_set, t.seq_len, val_rows, t.eval_batches))

    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    engine = create_engine(cfg, device)
    rank_suffix = f"-rank{rank}" if getattr(engine, "optimizer_state_is_sharded", False) else ""
    loaded = None
    if resume_from is not None:
        loaded = ckpt.load_checkpoint(resume_from, rank_suffix)
        if loaded.state.step >= t.max_steps:
            raise RunDirError(
                f"--resume: the newest checkpoint {resume_from} is at step {loaded.state.step}, which is not "
                f"before train.max_steps = {t.max_steps}; raise --max-steps to train further"
            )

    if loaded is not None:
        ckpt.check_model_state(loaded.model_state, engine.model_state(), loaded.path)
        engine.load_model_state(loaded.model_state)
        engine.load_optimizer_state(loaded.optimizer_state)
        ckpt.restore_rng(loaded, device)
    elif hf_init is not None:
        from fivefold.models.hf import load_hf

        _, state = load_hf(hf_init)
        ckpt.check_model_state(state, engine.model_state(), hf_init)
        engine.load_model_state(state)

    start = loaded.state.step if loaded else 0
    tokens_seen = loaded.state.tokens_seen if loaded else 0
    config_toml = dump_toml(cfg)
    if engine.is_logging_rank:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_text_atomic(run_dir / "config.toml", config_toml)
        if loaded:
            truncate_metrics(run_dir, start)
    writer = MetricsWriter(run_dir, t.max_steps, cfg.log.progress if engine.is_logging_rank else "none",
                           cfg.log.tensorboard and engine.is_logging_rank) if engine.is_logging_rank else None

    result = TrainResult(run_dir=run_dir, steps=start)
    mbs, global_tokens = cfg.micro_batch_size, t.global_batch_size * t.seq_len
    flops_per_token = training_flops_per_token(cfg.model, t.seq_len)
    peak = resolve_peak_tflops(cfg.log.peak_tflops, device)

    def log(record: dict) -> None:
        if writer is not None:
            writer.write(record)

    def validate_now(step: int) -> None:
        faults.note(step=step, micro_batch=None, action="evaluation")
        val = evaluate(engine, val_data, mbs)
        result.val_losses[step] = val
        log({"step": step, "val_loss": val})

    def save(step: int) -> None:
        # every rank: gather the full model state (collective) and write its optimizer shard if sharded
        faults.note(step=step, micro_batch=None, action="checkpoint")
        state = ckpt.TrainerState(step=step, tokens_seen=tokens_seen)
        model_state, optimizer_state = engine.model_state(), engine.optimizer_state()
        if engine.is_logging_rank:
            ckpt.begin_checkpoint(run_dir, step)
        engine.barrier()
        tmp = ckpt.checkpoint_dir(run_dir, step).with_name(ckpt.checkpoint_dir(run_dir, step).name + ".tmp")
        if rank_suffix or engine.is_logging_rank:
            ckpt.write_rank_files(tmp, optimizer_state, device, rank_suffix)
        engine.barrier()
        if engine.is_logging_rank:
            result.checkpoint = ckpt.finish_checkpoint(tmp, state, model_state, config_toml,
                                                       engine.n_devices if rank_suffix else 0)
            ckpt.prune_checkpoints(run_dir, t.keep_checkpoints)
        engine.barrier()

    if writer is not None:
        writer.print(
            f"fivefold: {cfg.model.name} ({sum(p.numel() for p in engine.parameters()):,} parameters on this "
            f"rank) on {engine.n_devices} x {device.type}, data {data_dir}, run dir {run_dir}, "
            f"global batch {t.global_batch_size} x {t.seq_len} tokens, micro-batch {mbs}, "
            f"accumulation {cfg.grad_accum_steps}" + (f", resuming at step {start}" if loaded else "")
        )
    if start == 0:
        validate_now(0)

    profiler = _profiler(cfg, run_dir) if cfg.log.profile and engine.is_logging_rank else None
    throughput = Throughput()
    with profiler or contextlib.nullcontext():
        for step in range(start, t.max_steps):
            faults.note(step=step + 1, micro_batch=None, action="data")
            lr = engine.set_lr(step)
            inputs, targets = sampler.rank_batch(step, engine.dp_rank, engine.dp_size)
            micro_batches = split_micro_batches(inputs, targets, mbs, device)
            loss_sum = engine.forward_backward(micro_batches, global_tokens)
            faults.note(micro_batch=None, action="optimizer step")
            grad_norm = engine.optimizer_step()
            tokens_seen += global_tokens
            throughput.add(global_tokens)
            done = step + 1
            if profiler is not None:
                profiler.step()
            if done % cfg.log.log_every == 0 or done == t.max_steps or done == stop_after:
                loss = engine.reduce_for_logging(loss_sum).item() / global_tokens
                drop = engine.moe_drop_fraction()  # None but under capacity-based MoE routing
                synchronize(device)
                memory = per_rank_peak_memory(device)
                record = step_record(done, loss, lr, float(grad_norm), throughput.report(), engine.n_devices,
                                     flops_per_token, peak, max(memory))
                if drop is not None:
                    record["moe_drop_fraction"] = drop
                if len(memory) > 1:
                    record["peak_memory_bytes_per_rank"] = memory
                log(record)
                result.losses.append(loss)
            else:
                result.losses.append(float("nan"))
            result.steps = done
            if t.eval_every and done % t.eval_every == 0 and done != t.max_steps:
                validate_now(done)
            if (t.checkpoint_every and done % t.checkpoint_every == 0) or done == t.max_steps:
                if done == t.max_steps:
                    validate_now(done)
                save(done)
            if stop_after is not None and done >= stop_after:
                break
    if writer is not None:
        if result.steps == t.max_steps and 0 in result.val_losses:
            first, last = result.val_losses[0], result.val_losses[t.max_steps]
            writer.print(f"done: {t.max_steps} steps; final train loss {_last_finite(result.losses):.4f}; "
                         f"val loss {last:.4f} (step 0: {first:.4f}, {100 * last / first:.1f} % of it); "
                         f"checkpoint {result.checkpoint}")
        elif result.steps == t.max_steps:
            writer.print(f"done: {t.max_steps} steps; final train loss {_last_finite(result.losses):.4f}; val loss "
                         f"{result.val_losses.get(t.max_steps, float('nan')):.4f}; checkpoint {result.checkpoint}")
        writer.close()
    return result


def per_rank_peak_memory(device: torch.device) -> list[int]:
    """Peak memory of every rank (one collective when distributed), in rank order."""
    return [v[0] for v in gather_ints([peak_memory_bytes(device)], device)]


def _last_finite(values: list[float]) -> float:
    return next((v for v in reversed(values) if v == v), float("nan"))


def _profiler(cfg: Config, run_dir: Path) -> torch.profiler.profile:
    """PyTorch profiler over a few steps after one wait and one warm-up step; a Chrome trace lands in
    RUN_DIR/profile/."""
    out = run_dir / "profile"
    out.mkdir(parents=True, exist_ok=True)
    activities = [torch.profiler.ProfilerActivity.CPU]
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if acc is not None:
        kind = {"cuda": "CUDA", "xpu": "XPU"}.get(acc.type)
        if kind and hasattr(torch.profiler.ProfilerActivity, kind):
            activities.append(getattr(torch.profiler.ProfilerActivity, kind))

    def on_ready(prof: torch.profiler.profile) -> None:
        prof.export_chrome_trace(str(out / f"trace-{int(time.time())}.json"))
        (out / "top_ops.txt").write_text(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))

    return torch.profiler.profile(
        activities=activities,
        schedule=torch.profiler.schedule(wait=1, warmup=1, active=cfg.log.profile_steps, repeat=1),
        on_trace_ready=on_ready, record_shapes=True,
    )
