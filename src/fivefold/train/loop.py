"""The training loop: data, steps, evaluation, metrics, checkpoints, resume and profiling.

Every check that can fail (config, data, run directory, checkpoint) runs before the first step. `train` reads top
to bottom: the checks, the engine and its starting state, the run directory, then a `Run` takes the steps and
decides after each whether to stop, evaluate or save. What a checkpoint is, how it is loaded, verified, set aside,
saved and pruned is `train.checkpoint.Checkpointer`'s.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import torch

from fivefold import faults
from fivefold.checkpoint_format import PieceError, verify_config
from fivefold.config import (
    Config,
    ConfigError,
    apply_dict,
    apply_overrides,
    load_file,
    shown,
    write_text_atomic,
)
from fivefold.data import BatchSampler, TokenDataset, default_cache_dir, ensure_builtin_dataset, val_batches
from fivefold.data.format import DataError, tokenizer_fingerprint
from fivefold.data.tokenizer import DEFAULT_VOCAB_SIZE as BUILTIN_VOCAB_SIZE
from fivefold.device import default_threads, resolve_device
from fivefold.flops import causal_equivalent, training_flops_per_token
from fivefold.models.masking import mask_document_targets
from fivefold.train import checkpoint as ckpt
from fivefold.train.build import Engine, build_engine
from fivefold.train.expect import Expectation, Interval, PlanCheck, injected_delay
from fivefold.train.guard import GuardState, StepGuard, StopSignals
from fivefold.train.metrics import (
    MetricsWriter,
    Throughput,
    check_logging_backends,
    format_duration,
    gather_ints,
    memory_baseline,
    peak_memory_bytes,
    peak_source,
    resolve_peak_tflops,
    step_record,
    synchronize,
    truncate_metrics,
)
from fivefold.train.optim import LrSchedule, describe_extension


class RunDirError(Exception):
    """The run directory cannot be used as asked (holds another run, or has nothing to resume)."""

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


def configured_data(cfg: Config) -> Path | None:
    """`data.path` checked to be a directory (None: the built-in corpus)."""
    if not cfg.data.path:
        return None
    path = Path(cfg.data.path)
    if not path.is_dir():
        raise ConfigError(
            f"data.path = {shown(cfg.data.path)} is not a directory; prepare one with "
            "`fivefold data prepare FILES --out DIR`, or leave data.path empty for the built-in corpus"
        )
    if not (path / "index.json").is_file():  # named by the field the user set, before any reader opens it
        raise ConfigError(
            f"data.path = {shown(cfg.data.path)} holds no index.json: it is not a directory written by "
            "`fivefold data prepare`; prepare one with `fivefold data prepare FILES --out DIR`, or leave data.path "
            "empty for the built-in corpus"
        )
    return path


def check_data_vocabulary(cfg: Config) -> None:
    """Before any process starts: the data directory exists and its vocabulary fits the model's embeddings (the
    index's vocabulary only; each rank still reads every shard's largest id, `TokenDataset.check_model_vocab`).
    The built-in corpus's vocabulary is known without preparing it."""
    path = configured_data(cfg)
    vocab = TokenDataset(path, "train").vocab_size if path is not None else BUILTIN_VOCAB_SIZE
    if cfg.model.vocab_size < vocab:
        where = path if path is not None else "the built-in corpus"
        raise DataError(f"model.vocab_size {cfg.model.vocab_size} is smaller than the vocabulary of {where} "
                        f"({vocab} ids); set model.vocab_size >= {vocab}")


def resolve_data(cfg: Config, is_first_rank: bool, barrier) -> Path:
    """The prepared dataset directory: the configured one, or the built-in corpus (prepared on first use)."""
    path = configured_data(cfg)
    if path is not None:
        return path
    if is_first_rank:  # rank 0 prepares the corpus on first use, the others then find it ready
        ensure_builtin_dataset(default_cache_dir(), val_fraction=cfg.data.val_fraction)
    barrier()
    return ensure_builtin_dataset(default_cache_dir(), val_fraction=cfg.data.val_fraction)


def started_run(run_dir: Path) -> bool:
    """Whether fivefold started a run in `run_dir`: the resolved config.toml and the tokenizer it writes together
    (`open_run_dir`), not a user's config file that happens to sit there."""
    return (run_dir / "config.toml").is_file() and (run_dir / RUN_TOKENIZER_DIR).is_dir()


def check_run_dir(run_dir: Path, resume: bool) -> list[Path]:
    """For a new run the directory must be absent or empty; for a resume it must hold a checkpoint, or be a run
    stopped before its first one (its config.toml and no checkpoint: it starts again at step 0). Returns the
    checkpoint directories to try, newest first (verified later; incomplete ones included, to be reported)."""
    if resume:
        for name, folder in (("checkpoints", True), (RUN_TOKENIZER_DIR, True), ("config.toml", False),
                             ("metrics.jsonl", False)):  # what a run keeps there, each of its own kind
            entry = run_dir / name
            if entry.exists() and entry.is_dir() != folder:
                raise RunDirError(f"--resume: {entry} is a {'file' if folder else 'directory'}, where the run keeps "
                                  f"its {'folder' if folder else 'file'} {name}; move it away, then resume")
        found = ckpt.checkpoint_dirs(run_dir)[::-1]
        if not found and not (run_dir / "config.toml").is_file():
            raise RunDirError(f"--resume: run directory {run_dir} holds no complete checkpoint to resume from")
        if not found and not started_run(run_dir):
            raise RunDirError(f"--resume: {run_dir} holds a config.toml but no checkpoint and no {RUN_TOKENIZER_DIR}/: "
                              "not a run that fivefold started (a run writes both), so nothing there is replaced; to "
                              "train with that file, give it as --config and choose a new --run-dir")
        kept = run_dir / RUN_TOKENIZER_DIR / "tokenizer.json"
        if found and not kept.is_file():  # written with config.toml, before the first checkpoint (`open_run_dir`)
            raise RunDirError(f"--resume: the run's tokenizer {kept} is missing (a run keeps the tokenizer of the data "
                              "it started on there, to check the data it resumes on); copy that data's "
                              "tokenizer.json there, then resume")
        return found
    if run_dir.exists() and (not run_dir.is_dir() or any(p.name != faults.RUN_LOCK for p in run_dir.iterdir())):
        no_checkpoint = run_dir.is_dir() and not ckpt.checkpoint_dirs(run_dir)
        if no_checkpoint and not started_run(run_dir):  # files, but no run
            raise RunDirError(f"run directory {run_dir} holds files but no run (none that fivefold started there); "
                              "choose a new or empty --run-dir (a config file can stay where it is: give it as "
                              "--config)")
        raise RunDirError(
            f"run directory {run_dir} already holds another run (or other files); pass --resume to continue "
            "it" + (" (it stopped before its first checkpoint: --resume starts it again in place)" if no_checkpoint
                    else "")
            + ", or choose a new --run-dir"
        )
    return []


def load_run_config(run_dir: Path, overrides: dict[str, str], file: str | None) -> Config:
    """For --resume: the run's own config (or, if RUN_DIR/config.toml is gone, the newest checkpoint's), then the
    given file and overrides on top. The directory is checked as `train` checks it (`check_run_dir`) before the
    config is read, so that the command line refuses it before any process starts."""
    base, fallback = run_dir / "config.toml", None
    if not base.is_file():
        saved = [p / "config.toml" for p in ckpt.list_checkpoints(run_dir) if (p / "config.toml").is_file()]
        if not saved:
            raise RunDirError(f"--resume: {base} is missing and {run_dir} holds no checkpoint with its own "
                              "config.toml, so the run's config is unknown; start a new run with --run-dir")
        fallback = saved[-1]
        try:  # checked against the checkpoint's manifest before it is parsed: damage is reported as such
            verify_config(fallback.parent)
        except PieceError as e:
            raise RunDirError(f"--resume: {e}") from None
    check_run_dir(run_dir, resume=True)
    if fallback is not None:
        print(f"fivefold: {base} is missing; using the config saved with checkpoint {fallback.parent.name}",
              file=sys.stderr)
        base = fallback
    saved = load_file(base)
    model = saved.get("model")
    if isinstance(model, dict) and model.get("sliding_window") == 0:
        del model["sliding_window"]  # written when 0 meant no window (now left out, i.e. null)
    cfg = Config()
    apply_dict(cfg, saved)
    if file:
        apply_dict(cfg, load_file(file))
    apply_overrides(cfg, overrides)
    return cfg


def threads_per_process(threads: int, local_processes: int) -> int:
    """CPU intra-op threads of each of `local_processes` processes on this machine: `train.threads`, or (0) their
    share of the cores (`default_threads`). What a run sets, what `fivefold calibrate` measures with, and what a
    profile's `threads_per_rank` is compared with."""
    return threads or default_threads(local_processes)


RUN_TOKENIZER_DIR = "tokenizer"  # RUN_DIR/tokenizer/: the run's tokenizer, which `fivefold export` writes out
HF_TOKENIZER_FILES = ("tokenizer_config.json", "special_tokens_map.json")


def check_hf_tokenizer(hf_dir: Path, dataset) -> None:
    """Refuse data prepared with another tokenizer than the Hugging Face model's own (fingerprints differ)."""
    hf_tokenizer = hf_dir / "tokenizer.json"
    if not hf_tokenizer.is_file():
        return  # nothing to compare: the model directory carries no tokenizer
    if tokenizer_fingerprint(hf_tokenizer) != dataset.tokenizer_fingerprint:
        raise DataError(
            f"the data in {dataset.path} was prepared with another tokenizer than the model's {hf_tokenizer} "
            f"(fingerprints {dataset.tokenizer_fingerprint[:12]} and {tokenizer_fingerprint(hf_tokenizer)[:12]}); "
            f"prepare it with the model's: `fivefold data prepare FILES --tokenizer {hf_dir} --out DIR`"
        )


def check_resume_tokenizer(run_dir: Path, dataset) -> None:
    """For --resume: refuse data prepared with another tokenizer than the run's own (RUN_DIR/tokenizer/, kept from
    the data it started on): the same token ids would mean other text. A run with checkpoints but without that copy
    was refused by `check_run_dir`; one stopped before its first checkpoint starts again and keeps this data's."""
    kept = run_dir / RUN_TOKENIZER_DIR / "tokenizer.json"
    if not kept.is_file():
        return
    try:
        own = tokenizer_fingerprint(kept)
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"--resume: the run's tokenizer {kept} is unreadable ({shown(e)}); restore it from the data "
                        "the run was started on") from None
    if own != dataset.tokenizer_fingerprint:
        raise DataError(
            f"--resume: the data {dataset.path} was prepared with another tokenizer than the run's {kept} "
            f"(data.path tokenizer fingerprint {dataset.tokenizer_fingerprint[:12]}, the run's "
            f"{own[:12]}): its token ids mean other text; resume with the data the run was started on, or prepare "
            f"this corpus with the run's tokenizer: `fivefold data prepare FILES --tokenizer {kept} --out DIR`"
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
        # micro-batches of one size (a pipeline's schedule sends one shape): the largest that divides the rows
        size = max(d for d in range(1, min(mbs, rows) + 1) if rows % d == 0)
        total += engine.eval_micro_batches(split_micro_batches(inputs[lo:lo + rows], targets[lo:lo + rows], size,
                                                               engine.device)).double()
        tokens += int((targets != -100).sum())  # under document masking, the trained targets only
    engine.model.train()
    return float(engine.reduce_for_logging(total).item() / tokens)


def train(cfg: Config, resume: bool = False, stop_after: int | None = None, stream: TextIO | None = None,
          hf_init: Path | None = None, expected: Expectation | None = None) -> TrainResult:
    """Train `cfg` in `cfg.run_dir`. `stop_after` ends the call after that many completed steps (as if the
    run were killed right after), which tests use to check resume.

    In order: every check that can fail (config, run directory, data, checkpoint), the engine and its starting
    state (a checkpoint, a Hugging Face model or the seed), the run directory's files, then the steps and the
    summary. The run directory is this run's alone from the start (`own_run_dir`)."""
    cfg.validate()
    check_logging_backends(cfg.log)
    with own_run_dir(Path(cfg.run_dir)):
        return train_owned(cfg, resume, stop_after, stream, hf_init, expected)


def before_steps_stop_line(resume: bool) -> str:
    """What `fivefold train` adds to `stopped by SIGTERM` when the signal came before the first step."""
    return ("before the first step, so nothing was trained and no checkpoint written"
            + ("; the run's checkpoints are as they were" if resume else ""))


@contextlib.contextmanager
def own_run_dir(run_dir: Path):
    """Hold the run directory's lock (`faults.RunLock`) for the run: in one process it is this process's; in a
    job of several, the first rank's, unless the launcher that started this process holds it for the job."""
    distributed = torch.distributed.is_initialized()
    if distributed and (torch.distributed.get_rank() != 0 or faults.held_by_parent(run_dir)):
        yield
        return
    with faults.RunLock(run_dir):
        yield


def train_owned(cfg: Config, resume: bool, stop_after: int | None, stream: TextIO | None,
                hf_init: Path | None, expected: Expectation | None) -> TrainResult:
    """`train` once the run directory is this run's; `expected`: the planner's prediction to check it against."""
    wall_start = time.perf_counter()
    run_dir = Path(cfg.run_dir)
    # until the loop's own handling (StopSignals) begins, SIGTERM / SIGHUP stop the call as Ctrl-C does, said in a line
    with faults.stop_signals_interrupt(before_steps_stop_line(resume)):
        run = start_run(cfg, resume, stop_after, stream, hf_init, expected, run_dir)
    loop_seconds = run.run_steps()
    run.finish(wall_start, loop_seconds)
    return run.result


def start_run(cfg: Config, resume: bool, stop_after: int | None, stream: TextIO | None, hf_init: Path | None,
              expected: Expectation | None, run_dir: Path) -> Run:
    """Everything `train_owned` does before the steps: checks, data, engine, starting state, run directory, the
    step-0 validation; the Run ready for its steps."""
    candidates = check_run_dir(run_dir, resume)
    device = resolve_device(cfg.train.device)
    set_threads(cfg.train.threads, device)
    distributed = torch.distributed.is_initialized()
    rank = torch.distributed.get_rank() if distributed else 0
    world = torch.distributed.get_world_size() if distributed else 1
    data_dir, train_set, sampler, val_data = load_data(cfg, rank == 0, hf_init)
    if resume:
        check_resume_tokenizer(run_dir, train_set)

    baseline = memory_baseline(device) if expected else 0  # what the plan check's peak is measured above
    engine = build_engine(cfg, device)
    engine.eos_id = document_eos(cfg, train_set, data_dir)
    checkpointer = ckpt.Checkpointer(run_dir, engine, cfg, rank, world, is_first=rank == 0,
                                     data_fingerprint=train_set.corpus_fingerprint)
    loaded = resume_point(checkpointer, candidates) if resume else None
    extension = ""
    if loaded is not None:
        sampler = checkpointer.restore(loaded, sampler)
        extension = resume_lr_schedule(engine, cfg, loaded)
    elif hf_init is not None:
        init_from_hf(engine, hf_init)

    writer = open_run_dir(cfg, engine, checkpointer.config_toml, train_set, hf_init, resume, loaded, stream)
    check = PlanCheck(expected, device.type, held_states=sum(engine.state_bytes().values())) if expected else None
    run = Run(cfg=cfg, engine=engine, device=device, checkpointer=checkpointer, sampler=sampler, val_data=val_data,
              writer=writer, result=TrainResult(run_dir=run_dir, steps=loaded.state.step if loaded else 0),
              tokens_seen=loaded.state.tokens_seen if loaded else 0,
              skipped_before=loaded.state.skipped_steps if loaded else 0, stop_after=stop_after,
              peak=resolve_peak_tflops(cfg.log.peak_tflops, device, "bf16" if engine.bf16 else "fp32"), check=check,
              baseline=baseline)
    if writer is not None:
        run.announce(data_dir, resuming=loaded is not None)
        if extension:
            writer.print(extension)
    if run.start == 0:
        run.validate(0)
    return run


def set_threads(threads: int, device: torch.device) -> None:
    """CPU intra-op threads: `train.threads`, or on the CPU the default share of this machine's cores."""
    if threads or device.type == "cpu":
        torch.set_num_threads(threads_per_process(threads, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def load_data(cfg: Config, is_first: bool, hf_init: Path | None) -> tuple[
    Path, TokenDataset, BatchSampler, list[tuple[torch.Tensor, torch.Tensor]]
]:
    """(dataset directory, training set, its sampler from step 0, validation batches), the data checked against
    the model's vocabulary and, with `hf_init`, the Hugging Face model's tokenizer."""
    t = cfg.train
    barrier = torch.distributed.barrier if torch.distributed.is_initialized() else (lambda: None)
    data_dir = resolve_data(cfg, is_first, barrier)
    train_set, val_set = TokenDataset(data_dir, "train"), TokenDataset(data_dir, "val")
    train_set.check_tokenizer()  # the run keeps it (`save_run_tokenizer`): checked before the run directory exists
    if hf_init is not None:  # its tokenizer first: data of another tokenizer is named as such
        check_hf_tokenizer(hf_init, train_set)
    train_set.check_model_vocab(cfg.model.vocab_size, hf_init)
    val_set.check_model_vocab(cfg.model.vocab_size, hf_init)
    eos_id = document_eos(cfg, train_set, data_dir)
    sampler = BatchSampler(train_set, t.seq_len, t.global_batch_size, t.seed)
    val_rows = max(cfg.layout.dp, min(t.global_batch_size, 16) // cfg.layout.dp * cfg.layout.dp)
    val_data = list(val_batches(val_set, t.seq_len, val_rows, t.eval_batches))
    if eos_id is not None:  # no loss across a document boundary (models.masking)
        val_data = [(inputs, mask_document_targets(inputs, targets, eos_id)) for inputs, targets in val_data]
    return data_dir, train_set, sampler, val_data


def document_eos(cfg: Config, train_set: TokenDataset, data_dir: Path) -> int | None:
    """The end-of-document token that `model.attn_mask = "document"` cuts documents at (None under "causal");
    refuses data whose index records none."""
    if cfg.model.attn_mask != "document":
        return None
    if train_set.eos_id is None:
        raise ConfigError(f"model.attn_mask = 'document' needs document boundaries, but the data {data_dir} "
                          "records no end-of-document token (eos_id in index.json); prepare it with `fivefold data "
                          "prepare`, or use model.attn_mask = 'causal'")
    return train_set.eos_id


def past_max_steps(path: Path, step: int, max_steps: int) -> RunDirError:
    return RunDirError(f"--resume: the newest checkpoint {path} is at step {step}, which is not before "
                       f"train.max_steps = {max_steps}; raise --max-steps to train further")


def check_resume(cfg: Config) -> None:
    """--resume, checked once by the process the user started, before any process starts, data is read or an engine
    built: the run directory (`check_run_dir`), the refusals that the checkpoint's small files decide
    (`checkpoint.check_resume_early`: another seq_len, seed, val_fraction or model), and train.max_steps where
    every checkpoint the resume could continue (newer ones may be set aside) is at or past it."""
    run_dir = Path(cfg.run_dir)
    candidates = check_run_dir(run_dir, resume=True)
    newest = ckpt.check_resume_early(cfg, candidates)
    max_steps = cfg.train.max_steps
    if newest is not None and newest.state.step >= max_steps and all(
            int(p.name.removeprefix(ckpt.CHECKPOINT_PREFIX)) >= max_steps for p in candidates):
        raise past_max_steps(newest.path, newest.state.step, max_steps)


def resume_point(checkpointer: ckpt.Checkpointer, candidates: list[Path]) -> ckpt.LoadedCheckpoint | None:
    """For --resume: the newest good checkpoint (None for a run stopped before its first one, which starts again
    at step 0, as the first rank says), refused when it is not before `train.max_steps`."""
    max_steps = checkpointer.cfg.train.max_steps
    loaded = checkpointer.load(candidates)
    if loaded is not None and loaded.state.step >= max_steps:
        raise past_max_steps(loaded.path, loaded.state.step, max_steps)
    if loaded is None and checkpointer.is_first:
        print(f"fivefold: {checkpointer.run_dir} holds no checkpoint yet (the run stopped before its first one); "
              "starting it again at step 0", file=sys.stderr)
    return loaded


def resume_lr_schedule(engine: Engine, cfg: Config, loaded: ckpt.LoadedCheckpoint) -> str:
    """Continue the learning-rate schedule that the checkpoint records, extended (`train.lr_on_extension`) when
    train.max_steps is now larger: the line that says how ("" when it is not extended)."""
    phases = loaded.state.lr_phases or [(int(tomllib.loads(loaded.config_toml)["train"]["max_steps"]), "schedule")]
    saved = LrSchedule(cfg.train, tuple(phases))
    engine.lr_schedule = saved.resized(cfg.train.max_steps, cfg.train.lr_on_extension)
    if cfg.train.max_steps < phases[-1][0]:  # cut short: the schedule's last phase now ends sooner
        step = loaded.state.step
        return (f"learning rate: train.max_steps {phases[-1][0]} -> {cfg.train.max_steps} shortens the run: its "
                f"schedule now ends at step {cfg.train.max_steps}, so the rate at step {step + 1} is "
                f"{engine.lr_schedule.at(step):.2e} (it was going to be {saved.at(step):.2e}); resume with "
                f"--max-steps {phases[-1][0]} to keep the planned rates")
    return describe_extension(saved, engine.lr_schedule) if cfg.train.max_steps > phases[-1][0] else ""


def init_from_hf(engine: Engine, hf_dir: Path) -> int:
    """Start from a Hugging Face model's weights: their names and shapes (the files' headers) checked against the
    model's (on the meta device), then each rank reads only the rectangles of the tensors it holds, straight into
    its shards (`models.hf.HfSliceReader`; nothing gathered, no rank holds a whole model). Returns the bytes this
    rank read."""
    from fivefold.models.hf import CheckpointError, HfSliceReader

    try:
        reader = HfSliceReader(hf_dir, engine.cfg.model)
        engine.load_state_pieces(reader, {})
    except CheckpointError as e:
        raise ckpt.CheckpointError(f"--hf {hf_dir}: {e}") from None
    return reader.bytes_read


def open_run_dir(cfg: Config, engine: Engine, config_toml: str, train_set: TokenDataset, hf_init: Path | None,
                 resume: bool, loaded: ckpt.LoadedCheckpoint | None, stream: TextIO | None) -> MetricsWriter | None:
    """On the logging rank: the run directory with the resolved config and the tokenizer, its metrics log cut back
    to the resumed step, and the writer of the metrics (None on the other ranks)."""
    if not engine.is_logging_rank:
        return None
    run_dir, start = Path(cfg.run_dir), loaded.state.step if loaded else 0
    run_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(run_dir / "config.toml", config_toml)
    save_run_tokenizer(run_dir, train_set, hf_init)
    if resume:  # a run started again from step 0 logs its step-0 validation anew
        truncate_metrics(run_dir, start if loaded else -1)
    wandb_run = ({"project": cfg.log.wandb_project, "mode": cfg.log.wandb_mode, "name": run_dir.name,
                  "config": cfg.to_dict()} if cfg.log.wandb else None)
    return MetricsWriter(run_dir, cfg.train.max_steps, cfg.log.progress, cfg.log.tensorboard, stream=stream,
                         wandb_run=wandb_run, start_step=start)


@dataclass
class Run:
    """One call of `train` once its engine and starting state exist: its steps, evaluations, checkpoints, stops
    and summary, and what they share. Every method is collective (every rank calls it at the same point); only the
    logging rank has a `writer` and prints."""

    cfg: Config
    engine: Engine
    device: torch.device
    checkpointer: ckpt.Checkpointer
    sampler: BatchSampler
    val_data: list[tuple[torch.Tensor, torch.Tensor]]
    writer: MetricsWriter | None
    result: TrainResult
    tokens_seen: int
    skipped_before: int  # steps skipped as non-finite before this call (the checkpoint's count)
    stop_after: int | None
    peak: float | None  # the device's peak TFLOP/s for MFU (None: unknown)
    check: PlanCheck | None = None  # the comparison with the planner's prediction (`train.expect`)
    peak_seen: int = 0  # the largest peak memory of any rank read so far, in bytes
    baseline: int = 0  # this rank's resident bytes before the model was built, for the plan check (CPU; else 0)
    # set by __post_init__ (fixed for the call), then by run_steps
    run_dir: Path = field(init=False)
    start: int = field(init=False)  # the step this call starts after
    mbs: int = field(init=False)
    global_tokens: int = field(init=False)  # tokens of one step
    trained_tokens: int = field(init=False)  # trained targets of the last step (fewer under document masking)
    flops_per_token: float = field(init=False)
    guard: StepGuard = field(init=False)
    throughput: Throughput = field(init=False)
    tokens_at_start: int = field(init=False)
    delay: float = field(init=False)  # tests only: a slow rank on purpose (`train.expect.injected_delay`)
    last_log: tuple[float, int] = field(init=False)  # the time and step of the last logging step

    def __post_init__(self) -> None:
        t = self.cfg.train
        self.delay = injected_delay(torch.distributed.get_rank() if torch.distributed.is_initialized() else 0)
        self.engine.waits.enabled = self.engine.grid is not None  # peers to wait for: measured for the plan check
        self.run_dir, self.start = self.result.run_dir, self.result.steps
        self.mbs, self.global_tokens = self.cfg.micro_batch_size, t.global_batch_size * t.seq_len
        self.trained_tokens = self.global_tokens
        # the attention the model's mask executes (under a document mask: priced from the data's document lengths)
        docs = self.sampler.dataset.document_lengths if self.cfg.model.attn_mask == "document" else None
        self.flops_per_token = training_flops_per_token(self.cfg.model, t.seq_len, docs=docs)

    def log(self, record: dict) -> None:
        if self.writer is not None:
            self.writer.write(record)

    def validate(self, step: int) -> None:
        faults.note(step=step, micro_batch=None, action="evaluation")
        val = evaluate(self.engine, self.val_data, self.mbs)
        self.result.val_losses[step] = val
        self.log({"step": step, "val_loss": val})

    def save(self, step: int, counts: GuardState, background: bool = False, stopping: bool = False) -> None:
        """The checkpoint of `step`, with the guard's `counts` after it; prunes nothing amid skipped steps.
        `background`: written while training goes on (`train.async_checkpoint`; `saved` collects it); `stopping`: a
        stop signal's, which gives up a background save in flight rather than wait for it."""
        written = self.checkpointer.save(step, self.tokens_seen, self.sampler.samples_before(step), counts.skipped,
                                         prune=counts.bad_run == 0, background=background, stopping=stopping)
        if written is not None:
            self.result.checkpoint = written

    def saved(self) -> None:
        """Wait for the checkpoint being written in the background, if any (collective)."""
        written = self.checkpointer.wait()
        if written is not None:
            self.result.checkpoint = written

    def announce(self, data_dir: Path, resuming: bool) -> None:
        """The run's first lines: model, devices, data, batch; a warning for a warm-up longer than the run."""
        t, engine, writer = self.cfg.train, self.engine, self.writer
        writer.print(
            f"fivefold: {self.cfg.model.name} ({sum(p.numel() for p in engine.parameters()):,} parameters on this "
            f"rank) on {engine.n_devices} x {self.device.type}, data {data_dir}, run dir {self.run_dir}, "
            f"global batch {t.global_batch_size} x {t.seq_len} tokens, micro-batch {self.mbs}, "
            f"accumulation {self.cfg.grad_accum_steps}, {torch.get_num_threads()} CPU thread(s) per process"
            + (f", float8 linears ({t.float8} scales)" if t.float8 != "off" else "")
            + (f", resuming at step {self.start}" if resuming else "")
        )
        if t.warmup_steps > t.max_steps:
            writer.print(f"warning: train.warmup_steps = {t.warmup_steps} exceeds train.max_steps = "
                         f"{t.max_steps}: the learning rate never reaches train.lr = {t.lr:g}; use fewer warm-up "
                         f"steps (e.g. {max(1, t.max_steps // 10)}) or more steps")
        if self.check is not None:
            writer.print(self.check.expected.describe())

    def run_steps(self) -> float:
        """The steps from `start` until `train.max_steps`, a stop or `stop_after`; the seconds they took."""
        cfg, result = self.cfg, self.result
        profiler = _profiler(cfg, self.run_dir) if cfg.log.profile and self.engine.is_logging_rank else None
        self.throughput = Throughput()
        loop_start, self.tokens_at_start = time.perf_counter(), self.tokens_seen
        self.last_log = (loop_start, self.start)
        self.guard = StepGuard(self.device, self.skipped_before)
        result.skipped_steps = self.skipped_before
        with profiler or contextlib.nullcontext(), StopSignals() as signals:
            # a stop asked while a step waits for a background save to read the state gives that save up
            self.engine.stop_asked = lambda: signals.asked
            for step in range(self.start, cfg.train.max_steps):
                to_log = self.step(step, signals)
                if profiler is not None:
                    profiler.step()
                done = step + 1
                result.losses.append(self.log_step(done, *to_log) if to_log is not None else float("nan"))
                result.steps = done
                if self.after_step(done, to_log is not None, signals):
                    break
            self.saved()
        return time.perf_counter() - loop_start

    def step(self, step: int, signals: StopSignals) -> tuple[torch.Tensor, float, torch.Tensor] | None:
        """Train step `step` + 1: (summed loss, learning rate, gradient norm) when it is logged (every
        `log.log_every` steps, the last step and `stop_after`), else None."""
        engine, t = self.engine, self.cfg.train
        faults.note(step=step + 1, micro_batch=None, action="data")
        lr = engine.set_lr(step)
        inputs, targets, self.trained_tokens = self.sampler.step_batch(step, engine.dp_rank, engine.dp_size,
                                                                       engine.eos_id)
        if engine.eos_id is not None:  # no loss across a document boundary: the mean is over the trained targets
            targets = mask_document_targets(inputs, targets, engine.eos_id)
        micro_batches = split_micro_batches(inputs, targets, self.mbs, self.device)
        if self.delay:
            time.sleep(self.delay)
        loss_sum = engine.forward_backward(micro_batches, self.trained_tokens)
        faults.note(micro_batch=None, action="optimizer step")
        grad_norm = engine.optimizer_step(loss_sum, signals.asked)
        self.guard.update(step + 1, engine.step_flags, loss_sum / self.trained_tokens)
        self.tokens_seen += self.global_tokens
        self.throughput.add(self.global_tokens)
        done = step + 1
        logged = done % self.cfg.log.log_every == 0 or done == t.max_steps or done == self.stop_after
        return (loss_sum, lr, grad_norm) if logged else None

    def log_step(self, done: int, loss_sum: torch.Tensor, lr: float, grad_norm: torch.Tensor) -> float:
        """Log step `done`'s record (loss, learning rate, gradient norm, throughput, MFU, peak memory); its loss."""
        engine = self.engine
        loss = engine.reduce_for_logging(loss_sum).item() / self.trained_tokens
        drop = engine.moe_drop_fraction()  # None but under capacity-based MoE routing
        synchronize(self.device)
        memory = self.measure(done)
        self.peak_seen = max(self.peak_seen, *memory)
        record = step_record(done, loss, lr, float(grad_norm), self.throughput.report(), engine.n_devices,
                             self.flops_per_token, self.peak, max(memory))
        if drop is not None:
            record["moe_drop_fraction"] = drop
        if len(memory) > 1:
            record["peak_memory_bytes_per_rank"] = memory
        now = self.guard.read(current=True)
        if now.skipped:
            record["skipped_steps"] = now.skipped
        self.log(record)
        return loss

    def measure(self, done: int) -> list[int]:
        """Every rank's peak memory, and for the plan check every rank's seconds since the last logging step and
        seconds waited for its peers (one collective, in rank order); the check's warnings are printed."""
        now, (then, step) = time.perf_counter(), self.last_log
        self.last_log = (now, done)
        ours = [peak_memory_bytes(self.device), round(1e6 * (now - then)), round(1e6 * self.engine.waits.read()),
                self.baseline]
        rows = gather_ints(ours, self.device)
        if self.check is not None and self.writer is not None:
            interval = Interval(done - step, [r[1] / 1e6 for r in rows], [r[2] / 1e6 for r in rows],
                                [r[0] for r in rows], [r[3] for r in rows])
            for line in self.check.observe(interval):
                self.writer.print(f"warning: {line}")
        return [r[0] for r in rows]

    def after_step(self, done: int, logged: bool, signals: StopSignals) -> bool:
        """What follows step `done`: a stop (a streak of non-finite steps, a signal), an evaluation, a scheduled
        checkpoint. True when the run stops here."""
        t = self.cfg.train
        scheduled = (t.checkpoint_every and done % t.checkpoint_every == 0) or done == t.max_steps
        # the counts after this step where the host waits anyway, else those of the step before
        seen = self.guard.read(current=logged or scheduled or done == self.stop_after)
        if seen is not None and seen.bad_run >= t.max_bad_steps:
            self.stop_non_finite(done, seen)
            return True
        if seen is not None and seen.stop_asked:
            self.stop_on_signal(done, signals)
            return True
        if t.eval_every and done % t.eval_every == 0 and done != t.max_steps:
            self.validate(done)
        if scheduled:
            self.scheduled_save(done)
        return self.stop_after is not None and done >= self.stop_after

    def stop_non_finite(self, done: int, seen: GuardState) -> None:
        """Stop after `train.max_bad_steps` non-finite steps in a row: a checkpoint of the last update's weights
        (finite, past the bad batches; it prunes nothing) and the error, exit code EXIT_NON_FINITE."""
        result = self.result
        now = self.guard.read(current=True)
        if now.bad_run > seen.bad_run:  # this step was bad too (`seen` may lag one step): say so
            seen = now
        result.skipped_steps, result.stopped, result.exit_code = now.skipped, "non-finite", EXIT_NON_FINITE
        result.last_finite_loss = last_finite_loss(self.engine, self.guard)
        self.save(done, now)
        if self.engine.is_logging_rank:
            print(non_finite_message(seen, done, self.cfg.train.max_bad_steps, result, self.run_dir),
                  file=sys.stderr)

    def stop_on_signal(self, done: int, signals: StopSignals) -> None:
        """Stop after a SIGTERM or SIGINT (on any rank): a checkpoint, exit code 128 + the signal's number."""
        result, run_dir = self.result, self.run_dir
        now = self.guard.read(current=True)
        result.skipped_steps = now.skipped
        self.save(done, now, stopping=True)
        result.stopped, result.exit_code = signals.name, 128 + signals.number
        if self.engine.is_logging_rank:
            world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
            print(f"fivefold: stopped by {signals.name or 'a signal on another rank'} after step {done} "
                  f"with a checkpoint at {ckpt.checkpoint_dir(run_dir, done)}; continue with "
                  f"`{resume_command(run_dir, world)}` (exit code {result.exit_code})", file=sys.stderr)

    def scheduled_save(self, done: int) -> None:
        """The checkpoint of `train.checkpoint_every` and of the last step (after its validation); a run that ends
        amid skipped steps is not a success (exit code EXIT_NON_FINITE)."""
        t, result = self.cfg.train, self.result
        if done == t.max_steps:
            self.validate(done)
        now = self.guard.read(current=True)
        result.skipped_steps = now.skipped
        self.save(done, now, background=done != t.max_steps)  # the last one complete before the run ends
        if done == t.max_steps and now.bad_run:
            result.stopped, result.exit_code = "non-finite", EXIT_NON_FINITE
            if self.engine.is_logging_rank:
                print(non_finite_message(now, done, t.max_bad_steps, result, self.run_dir), file=sys.stderr)

    def finish(self, wall_start: float, loop_seconds: float) -> None:
        """After the steps: the peak memory and the last finite loss (collectives), then the summary lines."""
        result = self.result
        if result.steps > self.start:  # collective; a run that stopped before its first logged step has read none
            self.peak_seen = max(self.peak_seen, *per_rank_peak_memory(self.device))
        if result.steps > self.start and result.stopped != "non-finite":  # collective
            result.last_finite_loss = last_finite_loss(self.engine, self.guard)
        if self.writer is not None:
            self.summarize(wall_start, loop_seconds)
            self.writer.close()

    def summarize(self, wall_start: float, loop_seconds: float) -> None:
        """The summary: time, tokens, throughput, MFU and peak memory; skipped steps; the final losses."""
        t, result, writer, n_devices = self.cfg.train, self.result, self.writer, self.engine.n_devices
        tokens_run = self.tokens_seen - self.tokens_at_start
        per_device = tokens_run / max(loop_seconds, 1e-9) / n_devices
        mfu = per_device * self.flops_per_token / 1e12 / self.peak if self.peak else None
        if mfu is not None and self.cfg.model.masks_attention:  # and the figure that counts causal attention
            causal = per_device * training_flops_per_token(causal_equivalent(self.cfg.model), t.seq_len) / 1e12
            mfu_note = f" (causal-equivalent {100 * causal / self.peak:.1f} %)"
        else:
            mfu_note = ""
        writer.print(
            f"summary: wall time {format_duration(time.perf_counter() - wall_start)} "
            f"({format_duration(loop_seconds)} in {result.steps - self.start} steps); tokens seen "
            f"{self.tokens_seen:,} ({tokens_run:,} in this run); mean {per_device:,.0f} tokens/s per device on "
            f"{n_devices} device(s); MFU {f'{100 * mfu:.1f} %' if mfu is not None else 'n/a (unknown device peak)'}"
            f"{mfu_note}"
            f"{peak_source(self.cfg.log.peak_tflops, self.device) if mfu is not None else ''}; "
            f"peak memory {self.peak_seen / 2**20:,.0f} MiB"
        )
        planned = self.check.summary() if self.check is not None else None
        if planned is not None:
            writer.print(planned)
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


def resume_command(run_dir: Path, nproc: int) -> str:
    return f"fivefold train --resume --run-dir {shlex.quote(str(run_dir))}" + (f" --nproc {nproc}" if nproc > 1 else "")


def abandoned_message(run_dir: Path, signal_name: str, nproc: int) -> str:
    """The line after a second stop signal: the save abandoned, the newest complete checkpoint, how to continue."""
    newest = ckpt.latest_checkpoint(run_dir)
    return (f"fivefold: second stop signal ({signal_name}) while stopping: the checkpoint in progress is abandoned "
            f"(its .tmp directory is never read); newest complete checkpoint: "
            + (f"{newest}; continue with `{resume_command(run_dir, nproc)}`" if newest else
               "none (the run starts again at step 0 with --resume)"))


def last_finite_loss(engine: Engine, guard: StepGuard) -> tuple[int, float] | None:
    """(step, train loss) of the last step that updated the weights in this call (collective), or None."""
    loss = engine.reduce_for_logging(guard.last_loss).item()
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
            + (f"; the newest checkpoint is {newest} (its weights are finite: a checkpoint never holds NaN or "
               f"inf): lower train.lr or set train.grad_clip and continue from {newest.name} with `fivefold train "
               f"--resume --run-dir {run_dir}`, which resumes from the newest checkpoint that loads with finite "
               "values" if newest else "; no checkpoint was written: lower train.lr or set train.grad_clip and "
               f"start again (`fivefold train --resume --run-dir {run_dir}` restarts at step 0)"))


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
