"""The training loop: data, steps, evaluation, metrics, checkpoints, resume and profiling.

Every check that can fail (config, data, run directory, checkpoint) runs before the first step.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

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
from fivefold.device import resolve_device
from fivefold.flops import training_flops_per_token
from fivefold.models.llama import build_model
from fivefold.models.pieces import PieceError
from fivefold.train import checkpoint as ckpt
from fivefold.train.build import Engine, create_engine
from fivefold.train.guard import GuardState, StepGuard, StopSignals
from fivefold.train.metrics import (
    MetricsWriter,
    Throughput,
    check_logging_backends,
    format_duration,
    gather_ints,
    peak_memory_bytes,
    resolve_peak_tflops,
    step_record,
    synchronize,
    truncate_metrics,
)


class RunDirError(Exception):
    """The run directory cannot be used as asked (holds another run, or has nothing to resume)."""


if TYPE_CHECKING:
    from fivefold.data import BatchSampler

@dataclass
class TrainResult:
    run_dir: Path
    steps: int
    losses: list[float] = field(default_factory=list)  # train loss of every step run in this call
    val_losses: dict[int, float] = field(default_factory=dict)  # step -> validation loss
    checkpoint: Path | None = None
    skipped_steps: int = 0  # updates skipped for a non-finite loss or gradient norm (the whole run's)
    last_finite_loss: tuple[int, float] | None = None  # (step, loss) of the last finite logged train loss
    stopped: str = ""  # why the run stopped before train.max_steps: "non-finite", or the signal's name
    exit_code: int = 0  # for the command line: 3 after non-finite steps, 128 + the signal's number after a signal


EXIT_NON_FINITE = 3


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


def check_run_dir(run_dir: Path, resume: bool) -> list[Path]:
    """For a new run the directory must be absent or empty; for a resume it must hold a checkpoint, or be a run
    stopped before its first one (its config.toml and no checkpoint: it starts again at step 0). Returns the
    checkpoint directories to try, newest first (verified later; incomplete ones included, to be reported)."""
    if resume:
        found = ckpt.checkpoint_dirs(run_dir)[::-1]
        if not found and not (run_dir / "config.toml").is_file():
            raise RunDirError(f"--resume: run directory {run_dir} holds no complete checkpoint to resume from")
        return found
    if run_dir.exists() and (not run_dir.is_dir() or any(run_dir.iterdir())):
        started = (run_dir / "config.toml").is_file() and not ckpt.checkpoint_dirs(run_dir)
        raise RunDirError(
            f"run directory {run_dir} already holds another run (or other files); pass --resume to continue "
            "it" + (" (it stopped before its first checkpoint: --resume starts it again in place)" if started else "")
            + ", or choose a new --run-dir"
        )
    return []


def load_run_config(run_dir: Path, overrides: dict[str, str], file: str | None) -> Config:
    """For --resume: the run's own config (or, if RUN_DIR/config.toml is gone, the newest checkpoint's), then the
    given file and overrides on top."""
    base = run_dir / "config.toml"
    if not base.is_file():
        saved = [p / "config.toml" for p in ckpt.list_checkpoints(run_dir) if (p / "config.toml").is_file()]
        if not saved:
            raise RunDirError(f"--resume: {base} is missing and {run_dir} holds no checkpoint with its own "
                              "config.toml, so the run's config is unknown; start a new run with --run-dir")
        print(f"fivefold: {base} is missing; using the config saved with checkpoint {saved[-1].parent.name}",
              file=sys.stderr)
        base = saved[-1]
    cfg = build_config(base, {})
    if file:
        apply_dict(cfg, load_file(file))
    apply_overrides(cfg, overrides)
    return cfg


def default_threads(local_processes: int) -> int:
    """CPU intra-op threads per process when train.threads = 0: this process's cores divided by the processes on
    this machine (PyTorch's default of every core per process oversubscribes them)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, local_processes))


RUN_TOKENIZER_DIR = "tokenizer"  # RUN_DIR/tokenizer/: the run's tokenizer, which `fivefold export` writes out
HF_TOKENIZER_FILES = ("tokenizer_config.json", "special_tokens_map.json")


def check_hf_tokenizer(hf_dir: Path, dataset) -> None:
    """Refuse data prepared with another tokenizer than the Hugging Face model's own (fingerprints differ)."""
    from fivefold.data.format import DataError, tokenizer_fingerprint

    hf_tokenizer = hf_dir / "tokenizer.json"
    if not hf_tokenizer.is_file():
        return  # nothing to compare: the model directory carries no tokenizer
    if tokenizer_fingerprint(hf_tokenizer) != dataset.tokenizer_fingerprint:
        raise DataError(
            f"the data in {dataset.path} was prepared with another tokenizer than the model's {hf_tokenizer} "
            f"(fingerprints {dataset.tokenizer_fingerprint[:12]} and {tokenizer_fingerprint(hf_tokenizer)[:12]}); "
            f"prepare it with the model's: `fivefold data prepare FILES --tokenizer {hf_dir} --out DIR`"
        )


def save_run_tokenizer(run_dir: Path, dataset, hf_dir: Path | None) -> None:
    """Keep the data's tokenizer.json (and the model's tokenizer_config.json etc. with --hf) in RUN_DIR/tokenizer/."""
    out = run_dir / RUN_TOKENIZER_DIR
    if (out / "tokenizer.json").is_file():
        return
    out.mkdir(parents=True, exist_ok=True)
    if hf_dir is not None:
        for name in HF_TOKENIZER_FILES:
            if (hf_dir / name).is_file():
                shutil.copyfile(hf_dir / name, out / name)
    tmp = out / "tokenizer.json.tmp"
    shutil.copyfile(dataset.tokenizer_path, tmp)
    os.replace(tmp, out / "tokenizer.json")


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
    check_logging_backends(cfg.log)
    wall_start = time.perf_counter()
    t = cfg.train
    run_dir = Path(cfg.run_dir)
    candidates = check_run_dir(run_dir, resume)
    device = resolve_device(t.device)
    if t.threads:
        torch.set_num_threads(t.threads)
    elif device.type == "cpu":
        torch.set_num_threads(default_threads(int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))

    is_first = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    barrier = torch.distributed.barrier if torch.distributed.is_initialized() else (lambda: None)
    data_dir = resolve_data(cfg, is_first, barrier)
    train_set, val_set = TokenDataset(data_dir, "train"), TokenDataset(data_dir, "val")
    train_set.check_model_vocab(cfg.model.vocab_size)
    if hf_init is not None:
        check_hf_tokenizer(hf_init, train_set)
    val_set.check_model_vocab(cfg.model.vocab_size)
    sampler = BatchSampler(train_set, t.seq_len, t.global_batch_size, t.seed)
    val_rows = max(cfg.layout.dp, min(t.global_batch_size, 16) // cfg.layout.dp * cfg.layout.dp)
    val_data = list(val_batches(val_set, t.seq_len, val_rows, t.eval_batches))

    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    engine = create_engine(cfg, device)
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    loaded = choose_checkpoint(candidates, engine, rank, world, is_first) if resume else None
    if loaded is not None and loaded.state.step >= t.max_steps:
        raise RunDirError(
            f"--resume: the newest checkpoint {loaded.path} is at step {loaded.state.step}, which is not "
            f"before train.max_steps = {t.max_steps}; raise --max-steps to train further"
        )
    if resume and loaded is None and is_first:
        print(f"fivefold: {run_dir} holds no checkpoint yet (the run stopped before its first one); starting it "
              "again at step 0", file=sys.stderr)

    if loaded is not None:
        load_pieces(engine, loaded, cfg)
        ckpt.restore_rng(loaded, device)
        sampler = resumed_sampler(sampler, loaded, cfg, is_first)
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
        save_run_tokenizer(run_dir, train_set, hf_init)
        if resume:  # a run started again from step 0 logs its step-0 validation anew
            truncate_metrics(run_dir, start if loaded else -1)
    wandb_run = ({"project": cfg.log.wandb_project, "mode": cfg.log.wandb_mode, "name": run_dir.name,
                  "config": cfg.to_dict()} if cfg.log.wandb else None)
    writer = MetricsWriter(run_dir, t.max_steps, cfg.log.progress, cfg.log.tensorboard, stream=stream,
                           wandb_run=wandb_run, start_step=start) if engine.is_logging_rank else None

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

    def save(step: int, guard_state: GuardState) -> None:
        # every rank writes its own pieces of the weights and AdamW state (views, nothing gathered)
        faults.note(step=step, micro_batch=None, action="checkpoint")
        state = ckpt.TrainerState(step=step, tokens_seen=tokens_seen, skipped_steps=guard_state.skipped)
        pieces, steps = engine.state_pieces()
        if not all_finite(engine, [p.tensor for p in pieces]):
            if engine.is_logging_rank:
                print(f"fivefold: not writing the checkpoint of step {step}: the weights or optimizer state hold "
                      "NaN or inf; the older checkpoints are kept", file=sys.stderr)
            return
        if engine.is_logging_rank:
            ckpt.begin_checkpoint(run_dir, step)
        engine.barrier()
        tmp = ckpt.checkpoint_dir(run_dir, step).with_name(ckpt.checkpoint_dir(run_dir, step).name + ".tmp")
        ckpt.write_rank_files(tmp, rank, pieces, steps, device)
        del pieces
        engine.barrier()
        if engine.is_logging_rank:
            result.checkpoint = ckpt.finish_checkpoint(tmp, state, config_toml, world, {
                "global_batch_size": t.global_batch_size, "seq_len": t.seq_len,
                "samples_consumed": sampler.samples_before(step)})
            if guard_state.bad_run == 0:  # written amid skipped steps: keep the older ones too
                ckpt.prune_checkpoints(run_dir, t.keep_checkpoints)
        engine.barrier()

    if writer is not None:
        writer.print(
            f"fivefold: {cfg.model.name} ({sum(p.numel() for p in engine.parameters()):,} parameters on this "
            f"rank) on {engine.n_devices} x {device.type}, data {data_dir}, run dir {run_dir}, "
            f"global batch {t.global_batch_size} x {t.seq_len} tokens, micro-batch {mbs}, "
            f"accumulation {cfg.grad_accum_steps}, {torch.get_num_threads()} CPU thread(s) per process"
            + (f", resuming at step {start}" if loaded else "")
        )
        if t.warmup_steps > t.max_steps:
            writer.print(f"warning: train.warmup_steps = {t.warmup_steps} exceeds train.max_steps = "
                         f"{t.max_steps}: the learning rate never reaches train.lr = {t.lr:g}; use fewer warm-up "
                         f"steps (e.g. {max(1, t.max_steps // 10)}) or more steps")
    if start == 0:
        validate_now(0)

    profiler = _profiler(cfg, run_dir) if cfg.log.profile and engine.is_logging_rank else None
    throughput = Throughput()
    loop_start, tokens_at_start, peak_seen = time.perf_counter(), tokens_seen, 0
    guard = StepGuard(device, loaded.state.skipped_steps if loaded else 0)
    result.skipped_steps = loaded.state.skipped_steps if loaded else 0
    with profiler or contextlib.nullcontext(), StopSignals() as signals:
        for step in range(start, t.max_steps):
            faults.note(step=step + 1, micro_batch=None, action="data")
            lr = engine.set_lr(step)
            inputs, targets = sampler.rank_batch(step, engine.dp_rank, engine.dp_size)
            micro_batches = split_micro_batches(inputs, targets, mbs, device)
            loss_sum = engine.forward_backward(micro_batches, global_tokens)
            faults.note(micro_batch=None, action="optimizer step")
            grad_norm = engine.optimizer_step(loss_sum, signals.asked)
            guard.update(step + 1, engine.step_flags, loss_sum)
            tokens_seen += global_tokens
            throughput.add(global_tokens)
            done = step + 1
            if profiler is not None:
                profiler.step()
            logged = done % cfg.log.log_every == 0 or done == t.max_steps or done == stop_after
            if logged:
                loss = engine.reduce_for_logging(loss_sum).item() / global_tokens
                drop = engine.moe_drop_fraction()  # None but under capacity-based MoE routing
                synchronize(device)
                memory = per_rank_peak_memory(device)
                peak_seen = max(peak_seen, *memory)
                record = step_record(done, loss, lr, float(grad_norm), throughput.report(), engine.n_devices,
                                     flops_per_token, peak, max(memory))
                if drop is not None:
                    record["moe_drop_fraction"] = drop
                if len(memory) > 1:
                    record["peak_memory_bytes_per_rank"] = memory
                now = guard.read(current=True)
                if now.skipped:
                    record["skipped_steps"] = now.skipped
                log(record)
                result.losses.append(loss)
            else:
                result.losses.append(float("nan"))
            result.steps = done
            scheduled = (t.checkpoint_every and done % t.checkpoint_every == 0) or done == t.max_steps
            # the counts after this step where the host waits anyway, else those of the step before
            seen = guard.read(current=logged or scheduled or done == stop_after)
            if seen is not None and seen.bad_run >= t.max_bad_steps:
                now = guard.read(current=True)
                if now.bad_run > seen.bad_run:  # this step was bad too (`seen` may lag one step): say so
                    seen = now
                result.skipped_steps, result.stopped, result.exit_code = now.skipped, "non-finite", EXIT_NON_FINITE
                result.last_finite_loss = last_finite_loss(engine, guard, global_tokens)
                save(done, now)  # the weights of the last update (finite), past the bad batches; prunes nothing
                if engine.is_logging_rank:
                    print(non_finite_message(seen, done, t.max_bad_steps, result, run_dir), file=sys.stderr)
                break
            if seen is not None and seen.stop_asked:
                now = guard.read(current=True)
                result.skipped_steps = now.skipped
                save(done, now)
                result.stopped, result.exit_code = signals.name, 128 + signals.number
                if engine.is_logging_rank:
                    print(f"fivefold: stopped by {signals.name or 'a signal on another rank'} after step {done} "
                          f"with a checkpoint at {ckpt.checkpoint_dir(run_dir, done)}; continue with `fivefold "
                          f"train --resume --run-dir {run_dir}` (exit code {result.exit_code})", file=sys.stderr)
                break
            if t.eval_every and done % t.eval_every == 0 and done != t.max_steps:
                validate_now(done)
            if scheduled:
                if done == t.max_steps:
                    validate_now(done)
                now = guard.read(current=True)
                result.skipped_steps = now.skipped
                save(done, now)
                if done == t.max_steps and now.bad_run:  # ended amid skipped steps: not a success
                    result.stopped, result.exit_code = "non-finite", EXIT_NON_FINITE
                    if engine.is_logging_rank:
                        print(non_finite_message(now, done, t.max_bad_steps, result, run_dir), file=sys.stderr)
            if stop_after is not None and done >= stop_after:
                break
    loop_seconds = time.perf_counter() - loop_start
    if result.steps > start:  # collective; a run that stopped before its first logged step has read none yet
        peak_seen = max(peak_seen, *per_rank_peak_memory(device))
    if result.steps > start and result.stopped != "non-finite":  # collective
        result.last_finite_loss = last_finite_loss(engine, guard, global_tokens)
    if writer is not None:
        tokens_run = tokens_seen - tokens_at_start
        per_device = tokens_run / max(loop_seconds, 1e-9) / engine.n_devices
        mfu = per_device * flops_per_token / 1e12 / peak if peak else None
        writer.print(
            f"summary: wall time {format_duration(time.perf_counter() - wall_start)} "
            f"({format_duration(loop_seconds)} in {result.steps - start} steps); tokens seen {tokens_seen:,}"
            f" ({tokens_run:,} in this run); mean {per_device:,.0f} tokens/s per device on {engine.n_devices} "
            f"device(s); MFU {f'{100 * mfu:.1f} %' if mfu is not None else 'n/a (unknown device peak)'}; "
            f"peak memory {peak_seen / 2**20:,.0f} MiB"
        )
        if result.skipped_steps:
            last = result.last_finite_loss
            writer.print(f"{result.skipped_steps} steps skipped for a non-finite loss or gradient norm; last finite "
                         "train loss of an updating step " + (f"{last[1]:.4f} at step {last[0]}" if last else
                                                              "none"))
        if result.steps == t.max_steps and not result.stopped and 0 in result.val_losses:
            first, last = result.val_losses[0], result.val_losses[t.max_steps]
            writer.print(f"done: {t.max_steps} steps; final train loss {_last_finite(result.losses):.4f}; "
                         f"val loss {last:.4f} (step 0: {first:.4f}, {100 * last / first:.1f} % of it); "
                         f"checkpoint {result.checkpoint}")
        elif result.steps == t.max_steps and not result.stopped:
            writer.print(f"done: {t.max_steps} steps; final train loss {_last_finite(result.losses):.4f}; val loss "
                         f"{result.val_losses.get(t.max_steps, float('nan')):.4f}; checkpoint {result.checkpoint}")
        writer.close()
    return result


def load_pieces(engine: Engine, loaded: ckpt.LoadedCheckpoint, cfg: Config) -> None:
    """Load a checkpoint written under any layout into this rank's part of the engine: the names and global shapes
    must match the model, and the data position (samples of `train.seq_len` tokens) must mean the same windows."""
    t = cfg.train
    saved = loaded.data.get("seq_len", t.seq_len)
    if saved != t.seq_len:
        raise ckpt.CheckpointError(
            f"--resume: checkpoint {loaded.path.name} was written with train.seq_len = {saved}, this run has "
            f"{t.seq_len}; the data position counts windows of {saved} tokens in an order drawn over those windows, "
            f"which another length does not continue without repeating or skipping tokens, so resume with "
            f"train.seq_len = {saved} (the global batch, layout, world size and micro-batch size may change)")
    meta = build_model(cfg.model, device="meta").state_dict()
    expected = {k: tuple(v.shape) for k, v in meta.items()
                if not (k == "lm_head.weight" and cfg.model.tied_embeddings)}
    saved = {k.removeprefix("model."): loaded.reader.shape(k) for k in loaded.reader.names() if k.startswith("model.")}
    ckpt.check_model_shapes(saved, expected, loaded.path)
    try:
        engine.load_state_pieces(loaded.reader, loaded.steps)
    except PieceError as e:
        raise ckpt.CheckpointError(f"checkpoint {loaded.path}: {e}") from None


def choose_checkpoint(candidates: list[Path], engine: Engine, rank: int, world: int,
                      is_first: bool) -> ckpt.LoadedCheckpoint | None:
    """The newest checkpoint that every rank reads and verifies (the first rank verifies every file, the other ranks'
    shards included); newer ones that fail are reported and set aside as `NAME.bad`. None when there is none at
    all; a CheckpointError listing the reasons when every one fails."""
    rejected: list[tuple[Path, str]] = []
    for path in candidates:
        try:
            if not (path / "COMPLETE").is_file():
                raise ckpt.CheckpointError(f"{path} has no COMPLETE marker (its save was interrupted)")
            loaded = ckpt.load_checkpoint(path, rank, world)
            if is_first:
                ckpt.verify_files(path)
            reason = ""
        except ckpt.CheckpointError as e:
            loaded, reason = None, str(e)
        failed = engine.agree(torch.tensor([float(bool(reason))], device=engine.device))
        if not failed.item():
            break
        rejected.append((path, reason or "a file that another rank reads failed its verification"))
    else:
        if rejected:
            raise ckpt.CheckpointError("--resume: no usable checkpoint: " + "; ".join(r for _, r in rejected))
        return None
    if is_first:
        for path, reason in rejected:
            moved = ckpt.set_aside(path)
            print(f"fivefold: checkpoint {path.name} cannot be used ({reason}); set aside as {moved.name}",
                  file=sys.stderr)
        if rejected:
            print(f"fivefold: resuming from the newest good checkpoint, {loaded.path.name}", file=sys.stderr)
    engine.barrier()
    return loaded


def resumed_sampler(sampler: BatchSampler, loaded: ckpt.LoadedCheckpoint, cfg: Config,
                    is_first: bool) -> BatchSampler:
    """The sampler that continues at the checkpoint's data position: the sample after the last one its steps
    consumed, whatever the global batch size now (a checkpoint without that count consumed `step` batches of the
    size it was written with)."""
    t = cfg.train
    step = loaded.state.step
    saved_batch = loaded.data.get("global_batch_size", t.global_batch_size)
    samples = loaded.data.get("samples_consumed", step * saved_batch)
    if saved_batch != t.global_batch_size and is_first:
        print(f"fivefold: resuming at step {step} with train.global_batch_size = {t.global_batch_size} (the "
              f"checkpoint's run had {saved_batch}): the data continues at sample {samples:,} of the run's order, "
              f"so no sample is repeated or skipped; the learning-rate schedule goes on counting optimizer steps "
              f"(train.max_steps, warm-up and decay are in steps of the new batch)", file=sys.stderr)
    from fivefold.data import BatchSampler

    return BatchSampler(sampler.dataset, t.seq_len, t.global_batch_size, t.seed, start_step=step,
                        start_sample=samples)


FINITE_CHUNK = 1 << 18  # elements checked at a time: the check's temporaries stay at a quarter MiB


@torch.no_grad()
def all_finite(engine: Engine, tensors: list[torch.Tensor]) -> bool:
    """Whether the weights and optimizer state that every rank writes are finite (one reduction). Checked a chunk at
    a time: a mask of a whole piece (a byte per element, tens of MiB for a large layer) would stay in the process's
    heap and make the save the largest resident memory of the run."""
    ok = torch.ones((), dtype=torch.bool, device=engine.device)
    for v in tensors:
        for chunk in v.reshape(-1).split(FINITE_CHUNK):
            ok &= torch.isfinite(chunk).all()
    return not engine.agree((~ok).float().reshape(1)).item()


def last_finite_loss(engine: Engine, guard: StepGuard, global_tokens: int) -> tuple[int, float] | None:
    """(step, train loss) of the last step that updated the weights in this call (collective), or None."""
    loss = engine.reduce_for_logging(guard.last_loss_sum).item() / global_tokens
    step = int(guard.last_step)
    return (step, loss) if step else None


def non_finite_message(seen: GuardState, done: int, max_bad: int, result: TrainResult, run_dir: Path) -> str:
    first = seen.step - seen.bad_run + 1
    newest = ckpt.latest_checkpoint(run_dir)
    last = result.last_finite_loss
    return (f"fivefold: error: steps {first} to {seen.step} had a non-finite loss or gradient norm ({seen.bad_run} in "
            f"a row, train.max_bad_steps = {max_bad}; their updates were skipped); stopped at step {done}. "
            f"Last finite train loss of an updating step: " + (f"{last[1]:.4f} at step {last[0]}" if last else
                                                               "none")
            + f"; newest checkpoint: {newest if newest else 'none'} (older ones are kept). Lower train.lr or set "
            "train.grad_clip, and continue with --resume")


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
