"""Checkpoints: the `Checkpointer`, which owns their lifecycle, and the directory it writes and reads.

The lifecycle, for one run (one `Checkpointer` per rank, built once the engine exists):
    load     at `--resume`, `Checkpointer.load` tries the run's `step_XXXXXXXX` directories newest first. Every rank
             opens the trainer state, the one index of every piece (`index.json`), the config and its own RNG file,
             each checked against the manifest (sha256), then loads its rectangles, verifying each piece file it
             reads (size and sha256) when it first opens it: a rank hashes only what it reads, all ranks at once,
             and no rank hashes the whole checkpoint. The ranks agree on the newest checkpoint that none of them
             failed.
    fall back  the newer ones that failed are reported and set aside as `NAME.bad` (kept for inspection, never read
             or written again); when every one fails, a CheckpointError lists the reasons.
    restore  `Checkpointer.restore` checks the tensor names and global shapes against the model and the sequence
             length against the run, loads this rank's rectangles of the weights and AdamW state into the engine
             (whatever layout wrote them), restores the RNG (same world size only) and returns the sampler that
             continues at the checkpoint's data position (samples consumed, whatever the global batch now).
    save     `Checkpointer.save`, every `train.checkpoint_every` steps, at the end and when a run stops early: first
             a check, on every rank, that the weights and optimizer state are finite (if not, nothing is written and
             the older checkpoints stay); then the atomic write below, every rank writing its own pieces (views of
             its state, nothing gathered).
    prune    after a save not written amid skipped steps, all but the newest `train.keep_checkpoints` are deleted.

The atomic rules:
- A checkpoint is written into `step_XXXXXXXX.tmp`: every rank its own files, then the first rank the trainer state,
  the config, the manifest and the `COMPLETE` marker last; the files and the directory are fsynced and the
  directory renamed into place. A directory without `COMPLETE` is not a checkpoint.
- A killed writer leaves at most a `*.tmp` directory, which every reader ignores and the next writer removes.
- An existing complete checkpoint is never replaced; a directory of the same step without its marker is set aside.
- A pruned checkpoint is first renamed to `NAME.deleting`, so a kill during the deletion never leaves a marked but
  partial checkpoint; the next prune deletes such leftovers.
- Nothing is unpickled: tensors are safetensors, everything else JSON or TOML.

Layout of `RUN_DIR/checkpoints/step_XXXXXXXX/` (format 3, sharded; see docs/training.md; the pieces and the manifest
are `fivefold.checkpoint_format`):
    rankN.safetensors      rank N's pieces: rectangles of the plain-named global tensors `model.<param>`,
                           `exp_avg.<param>`, `exp_avg_sq.<param>` that rank N owns (one copy in all), and the
                           MoE balancing biases `buffer.<layer>.expert_bias` (whole, from one rank per stage)
    rankN.json             their index (global shape and offsets of each piece), the sha256 of rankN.safetensors
                           and AdamW's step of each parameter (the finishing writer's input for the two below;
                           read by a reader of a checkpoint written without index.json)
    index.json             every rank's pieces and steps merged, written once at save: what a resuming rank reads
    rng-rankN.safetensors  rank N's CPU and accelerator RNG states
    trainer_state.json     step, tokens seen, steps skipped as non-finite, world size, global batch, seq length
                           and samples consumed, and the training corpus's fingerprint
    config.toml            the run's resolved config
    manifest.json          size and sha256 of every file above; a reader verifies the files it reads against it
    COMPLETE               written last, before the rename
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import shutil
import sys
import threading
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import load_file

from fivefold import faults
from fivefold.checkpoint_format import (
    FORMAT_VERSION,
    GLOBAL_INDEX,
    MANIFEST,
    PieceError,
    PieceReader,
    TrainerState,
    VerifiedCheckpoint,
    WriteCancelled,
    global_index,
    nonfinite,
    read_manifest,
    verify_checkpoint,
    verify_manifest,
    write_safetensors,
)
from fivefold.config import Config, ConfigError, ModelConfig, config_from_dict, dump_toml, file_sha256, shown
from fivefold.models.llama import full_parameter_shapes

if TYPE_CHECKING:
    from fivefold.data import BatchSampler
    from fivefold.train.engine import Engine

CHECKPOINT_PREFIX = "step_"


class CheckpointError(Exception):
    """A checkpoint that is missing, incomplete, corrupted or does not match the run."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint that could not be written (no space, a read-only or forbidden directory): its partial files
    removed and the older checkpoints untouched. `own`: this rank's failure (else another rank's, which says it)."""

    def __init__(self, message: str, own: bool = True) -> None:
        super().__init__(message)
        self.own = own


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"{CHECKPOINT_PREFIX}{step:08d}"


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    """Every `step_XXXXXXXX` directory of a run, complete or not, oldest first (not `*.tmp` or set-aside ones)."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(CHECKPOINT_PREFIX)
             and p.name[len(CHECKPOINT_PREFIX):].isdigit()]
    return sorted(found, key=lambda p: p.name)


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run (with their COMPLETE marker, not yet verified), oldest first."""
    return [p for p in checkpoint_dirs(run_dir) if (p / "COMPLETE").is_file()]


def set_aside(path: Path) -> Path:
    """Rename a checkpoint directory that cannot be used to `NAME.bad` (`NAME.bad2`, ... if taken): kept for
    inspection, ignored by every reader and writer."""
    for n in range(1, 1000):
        target = path.with_name(f"{path.name}.bad{n if n > 1 else ''}")
        if not target.exists():
            os.replace(path, target)
            return target
    raise CheckpointError(f"cannot set {path} aside: {path.name}.bad ... .bad999 all exist")


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def _rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    state = {"cpu": torch.random.get_rng_state()}
    if device.type != "cpu":
        state[device.type] = torch.get_device_module(device.type).get_rng_state()
    return state


def _set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.random.set_rng_state(state["cpu"])
    if device.type != "cpu" and device.type in state:
        torch.get_device_module(device.type).set_rng_state(state[device.type])


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: Path, data: Any) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def begin_checkpoint(run_dir: Path, step: int) -> Path:
    """Create the temporary directory of step `step`'s checkpoint (one writer, before the others write).

    Refuses to replace an existing complete checkpoint of the same step; a directory of that step without its
    COMPLETE marker (left by an older writer or a damaged copy) is set aside as `NAME.bad`."""
    final = checkpoint_dir(run_dir, step)
    if final.exists() and not (final / "COMPLETE").is_file():
        set_aside(final)
    if final.exists():
        raise CheckpointError(f"checkpoint {final} already exists; refusing to overwrite it")
    tmp = final.with_name(final.name + ".tmp")
    if tmp.exists():  # left by a writer that was killed
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


@dataclass
class Piece:
    """A rectangle of a named global tensor that one rank writes: `name` is `model.<parameter>`,
    `exp_avg.<parameter>` / `exp_avg_sq.<parameter>` (AdamW's moments) or `buffer.<module>.<buffer>` (state that is
    not a parameter: the MoE balancing bias), with the plain single-process name."""

    name: str
    shape: tuple[int, ...]  # of the global tensor
    offsets: tuple[int, ...]  # of this piece in it
    tensor: torch.Tensor


def write_rank_files(tmp: Path, rank: int, pieces: list[Piece], steps: dict[str, float], device: torch.device,
                     rng: dict[str, torch.Tensor] | None = None, cancelled=None, read=None) -> None:
    """One rank's pieces (`rankN.safetensors`, streamed), their index with the sha256 of that file and the AdamW
    step of each parameter (`rankN.json`), and the rank's RNG state (`rng-rankN.safetensors`; `rng`: as taken when
    the state was copied, else now). `cancelled()`: gives the write up between pieces when true; `read()`: called
    once the pieces' bytes are written (before the file's fsync), after which nothing reads them."""
    name = f"rank{rank}.safetensors"
    pairs = [(str(i), p.tensor) for i, p in enumerate(pieces)]
    options = {"cancelled": cancelled} if cancelled else {}
    sha = write_safetensors(tmp / name, pairs, **options, **({"read": read} if read else {}))
    _write_json(tmp / f"rank{rank}.json", {
        "format_version": FORMAT_VERSION, "rank": rank, "file": name, "sha256": sha, "steps": steps,
        "pieces": [{"name": p.name, "shape": list(p.shape), "offsets": list(p.offsets),
                    "piece_shape": list(p.tensor.shape), "key": str(i)} for i, p in enumerate(pieces)],
    })
    write_safetensors(tmp / f"rng-rank{rank}.safetensors", (rng or _rng_state(device)).items())


def finish_checkpoint(tmp: Path, state: TrainerState, config_toml: str, world_size: int,
                      data: dict[str, Any]) -> Path:
    """After every rank wrote its files: the trainer state and config, the manifest (the piece files' checksums
    as their writers computed them), the COMPLETE marker, then the rename into place."""
    _write_json(tmp / "trainer_state.json", {
        "format_version": state.format_version, "step": state.step, "tokens_seen": state.tokens_seen,
        "skipped_steps": state.skipped_steps, "world_size": world_size, **data,
        **({"lr_phases": state.lr_phases} if state.lr_phases else {}),
    })
    (tmp / "config.toml").write_text(config_toml)
    for f in tmp.iterdir():
        if not f.name.endswith(".safetensors") or f.name.startswith("rng-"):
            with open(f, "rb+") as fh:
                os.fsync(fh.fileno())
    known, parts = {}, []
    for r in range(world_size):  # each rank's part read once, here, and merged into the one index readers open
        part = json.loads((tmp / f"rank{r}.json").read_text())
        known[part["file"]] = part["sha256"]
        parts.append(part)
    _write_json(tmp / GLOBAL_INDEX, {"format_version": FORMAT_VERSION, **global_index(parts)})
    write_manifest(tmp, known)
    (tmp / "COMPLETE").write_text(f"{state.step}\n")
    _fsync_dir(tmp)
    final = tmp.with_name(tmp.name.removesuffix(".tmp"))
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    return final


def write_manifest(directory: Path, known: dict[str, str] | None = None) -> None:
    """Record the size and sha256 of every file of a checkpoint directory in its manifest (`known`: sha256s
    computed by the ranks as they wrote their files)."""
    known = known or {}
    files = {f.name: {"bytes": f.stat().st_size, "sha256": known.get(f.name) or file_sha256(f)}
             for f in sorted(directory.iterdir()) if f.is_file() and f.name not in (MANIFEST, "COMPLETE")}
    _write_json(directory / MANIFEST, {"format_version": FORMAT_VERSION, "files": files})


def verify_files(path: Path, names: list[str] | None = None, listed: dict[str, dict[str, Any]] | None = None) -> None:
    """Check the files `names` (default: every file the manifest lists) against the manifest (`listed`: its files,
    already read): each must be listed, present, and of the recorded size and sha256. Raises a CheckpointError naming
    the first file that is not."""
    try:
        verify_manifest(path, names, listed=listed)
    except PieceError as e:
        raise CheckpointError(str(e)) from None


def prune_checkpoints(run_dir: Path, keep: int) -> None:
    """Delete all but the `keep` newest complete checkpoints (only directories this module wrote). Each is first
    renamed to `NAME.deleting`, so a kill during the deletion never leaves a marked but partial checkpoint; such
    leftovers are deleted by the next call."""
    for old in list_checkpoints(run_dir)[:-keep]:
        try:
            own = set(read_manifest(old)) | {MANIFEST, "COMPLETE"}
        except PieceError:
            own = set()
        if foreign := sorted(p.name for p in old.iterdir() if p.name not in own):  # put there by someone else
            print(f"fivefold: kept the old checkpoint {old}: it holds {', '.join(foreign[:3])}"
                  f"{' ...' if len(foreign) > 3 else ''}, which no checkpoint writes; move that out and the next "
                  "save deletes it", file=sys.stderr)
            continue
        doomed = old.with_name(old.name + ".deleting")
        if doomed.exists():
            shutil.rmtree(doomed)
        os.replace(old, doomed)
    for doomed in (run_dir / "checkpoints").glob(f"{CHECKPOINT_PREFIX}*.deleting"):
        shutil.rmtree(doomed)


@dataclass
class LoadedCheckpoint:
    path: Path
    state: TrainerState
    reader: PieceReader  # every rank's pieces, read lazily
    steps: dict[str, float]  # AdamW's step of each parameter
    rng_state: dict[str, torch.Tensor] | None  # this rank's, when the checkpoint has as many ranks as the run
    config_toml: str
    world_size: int
    data: dict[str, Any]  # the global batch, sequence length, samples consumed and data fingerprint it recorded


def load_checkpoint(path: Path, rank: int = 0, world_size: int = 1) -> LoadedCheckpoint:
    """Open a checkpoint directory for a rank of a run of `world_size` ranks, after the one check every reader runs
    (`checkpoint_format.verify_checkpoint`: the marker, then the trainer state, the index, the config, this rank's
    RNG state and its share of every other listed file against the manifest (sha256), every piece file present and
    of its listed size). Piece files are read lazily, each verified against the manifest (size and sha256) when the
    reader first opens it: a rank hashes the files it reads and no other. Every failure is a CheckpointError naming
    the file (a piece file's: a PieceError when read)."""
    try:
        found = verify_checkpoint(path, rank, world_size)
    except PieceError as e:
        raise CheckpointError(str(e)) from None
    rng = None
    if found.own_rng:
        try:
            rng = load_file(str(path / found.own_rng))
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"checkpoint file {path / found.own_rng} is corrupted or unreadable: {e}") from None
    listed = found.listed
    reader = PieceReader(path, found.index, opened=lambda name: verify_manifest(path, [name], listed=listed))
    return LoadedCheckpoint(path=path, state=found.state, reader=reader, steps=found.steps, rng_state=rng,
                            config_toml=(path / "config.toml").read_text(), world_size=found.world_size,
                            data=found.data)


def read_model_state(path: Path) -> dict[str, torch.Tensor]:
    """The whole plain-named model state of a checkpoint (tied output layer left out), assembled from its
    pieces; verifies the files it reads."""
    loaded = load_checkpoint(path)
    verify_files(path)
    loaded.reader.opened = None  # every file was just verified: not hashed again as it is opened
    try:
        return {name.removeprefix("model."): loaded.reader.read(name) for name in loaded.reader.names()
                if name.startswith("model.")}
    except PieceError as e:
        raise CheckpointError(str(e)) from None


def model_shapes(model: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The plain names and global shapes of a model's weights that a checkpoint stores (no tied output layer)."""
    return {k: tuple(v) for k, v in full_parameter_shapes(model).items()
            if not (k == "lm_head.weight" and model.tied_embeddings)}


def checkpoint_model(loaded: LoadedCheckpoint) -> ModelConfig | None:
    """The model of a checkpoint's own config.toml (`own_model`)."""
    return own_model(loaded.config_toml)


def check_model_shapes(saved: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]], path: Path) -> None:
    """Refuse a checkpoint whose tensor names or global shapes differ from the model's, listing the differences."""
    problems = [f"missing {k}" for k in expected if k not in saved]
    problems += [f"unexpected {k}" for k in saved if k not in expected]
    problems += [f"{k}: checkpoint {tuple(saved[k])} vs model {tuple(v)}"
                 for k, v in expected.items() if k in saved and tuple(saved[k]) != tuple(v)]
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise CheckpointError(
            f"checkpoint {path} does not match the configured model: {'; '.join(problems[:5])}{more}"
        )


def check_run_settings(cfg: Config, path: Path, data: dict[str, Any], config_toml: str) -> dict[str, Any]:
    """Refuse (CheckpointError) a resume whose settings cannot continue the checkpoint at `path` (its trainer state's
    `data`, its `config_toml`): another train.seq_len, train.seed or, on the built-in corpus, data.val_fraction. The
    checkpoint's config as read (empty when it does not parse: its own check reports it)."""
    t = cfg.train
    saved = data.get("seq_len", t.seq_len)
    if saved != t.seq_len:
        raise CheckpointError(
            f"--resume: checkpoint {path.name} was written with train.seq_len = {saved}, this run has "
            f"{t.seq_len}; the data position counts windows of {saved} tokens in an order drawn over those "
            f"windows, which another length does not continue without repeating or skipping tokens, so resume "
            f"with train.seq_len = {saved} (the global batch, layout, world size and micro-batch size may change)")
    try:
        written = tomllib.loads(config_toml) if config_toml else {}
    except tomllib.TOMLDecodeError:
        written = {}  # its own check reports a damaged config
    held = [("train", "seed", "the data position continues the sample order that seed drew; another seed would "
             "repeat some samples and skip others")]
    if not cfg.data.path:  # the built-in corpus, split when prepared
        held.append(("data", "val_fraction", "another split moves documents between training and validation, "
                     "so that validation would score text the model trained on"))
    for section, name, why in held:
        was, now = written.get(section, {}).get(name), getattr(getattr(cfg, section), name)
        if was is not None and was != now:
            raise CheckpointError(f"--resume: checkpoint {path.name} was written with {section}.{name} = "
                                  f"{was}, this run has {now}; {why}; resume with {section}.{name} = {was}")
    return written


def own_model(config_toml: str) -> ModelConfig | None:
    """The model of a checkpoint's own config.toml, or None when it cannot be read as this version's config (an
    older version's fields): a cross-check of the index, not a requirement."""
    try:
        model = config_from_dict(tomllib.loads(config_toml)).model
        model.validate()
        return model
    except (tomllib.TOMLDecodeError, ConfigError, TypeError, ValueError):
        return None


def _shape_fields(own: ModelConfig, other: ModelConfig) -> list[str]:
    """The model fields on which `other` differs from `own` that change the weights' shapes on their own."""
    names = [f.name for f in dataclasses.fields(ModelConfig)
             if f.name != "name" and getattr(other, f.name) != getattr(own, f.name)]
    shaping = []
    for name in names:
        try:
            if model_shapes(dataclasses.replace(own, **{name: getattr(other, name)})) != model_shapes(own):
                shaping.append(name)
        except (ArithmeticError, ValueError, TypeError):  # meaningful only beside the other changes
            shaping.append(name)
    return shaping or names


def check_resume_early(cfg: Config, candidates: list[Path]) -> VerifiedCheckpoint | None:
    """Before any process starts, data is read or an engine built: the refusals of a resume that the checkpoint's
    small files decide, raised as the resume itself raises them once it has loaded the checkpoint
    (`Checkpointer._load_into_engine`): on the newest of `candidates` (newest first) that passes its check (as
    `load` takes it; damaged ones are left for the resume to set aside), another train.seq_len, train.seed or
    data.val_fraction (`check_run_settings`), or another model (names and shapes). The newest such checkpoint
    as verified (None when none passes), for the caller's own refusal of train.max_steps."""
    for path in candidates:
        try:  # its small files hashed, its pieces' sizes: no weight read
            found = verify_checkpoint(path)
            config_toml = (path / "config.toml").read_text()
        except (PieceError, OSError, UnicodeDecodeError):  # damaged, or pruned by a run that holds the directory
            continue
        shapes = {k.removeprefix("model."): tuple(v["shape"]) for k, v in found.index.items() if k.startswith("model.")}
        own = own_model(config_toml)
        if own is not None:
            try:
                check_model_shapes(shapes, model_shapes(own), path)
            except CheckpointError:
                continue  # at odds with its own config: damaged, which the resume reports and sets aside
        check_run_settings(cfg, path, found.data, config_toml)
        if own is not None and model_shapes(own) != model_shapes(cfg.model):
            changed = [f"model.{name} = {shown(getattr(cfg.model, name))} (the checkpoint's: "
                       f"{shown(getattr(own, name))})" for name in _shape_fields(own, cfg.model)]
            raise CheckpointError(f"--resume: checkpoint {path} holds another model than this run's: "
                                  f"{'; '.join(changed[:5]) or 'other weight shapes'}; a resume continues the "
                                  "checkpoint's weights, whose shapes these fields fix: drop the change (a model of "
                                  "another shape starts in a new run directory)")
        check_model_shapes(shapes, model_shapes(cfg.model), path)
        return found
    return None


def restore_rng(loaded: LoadedCheckpoint, device: torch.device) -> None:
    if loaded.rng_state is not None:
        _set_rng_state(loaded.rng_state, device)


NAME_BYTES = 512  # the longest tensor name (UTF-8) that a non-finite report carries from its rank to the others


def first_nonfinite(engine: Engine, pieces: list[Piece]) -> str | None:
    """None when the weights and optimizer state that every rank writes are finite; else where the first NaN or inf
    is, for the message: `tensor 'exp_avg.layers.0.attn.q_proj.weight'`, and on several ranks `..., found by rank 3
    of 4`: the lowest rank that found one and its first such tensor (in the order of `Engine.state_pieces`), the
    same line on every rank. Each rank checks its own pieces (`checkpoint_format.nonfinite`, the check `fivefold
    export` and `generate` run too); the one reduction there always was, which tells every rank whether any found
    one, also says which (world - rank, under its maximum); only then does that rank broadcast the name
    (NAME_BYTES bytes): one small collective on the failure path alone, none while the state is finite."""
    bad = nonfinite([p.tensor for p in pieces])
    name = pieces[bad[0]].name if bad else None
    if engine.grid is None:
        return None if name is None else f"tensor {shown(name)}"
    rank, world = engine.grid.rank, engine.grid.world_size
    found = int(engine.agree(torch.tensor([float(world - rank if bad else 0)], device=engine.device)).item())
    if not found:
        return None
    source = world - found
    buf = torch.zeros(NAME_BYTES, dtype=torch.uint8, device=engine.device)
    if rank == source:
        raw = name.encode()[:NAME_BYTES]
        buf[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    dist.broadcast(buf, src=source)
    told = bytes(buf.cpu().tolist()).rstrip(b"\0").decode(errors="replace")
    return f"tensor {shown(told)}, found by rank {source} of {world}"


def resumed_sampler(sampler: BatchSampler, loaded: LoadedCheckpoint, cfg: Config, is_first: bool) -> BatchSampler:
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


def _same_path(a: str | None, b: str | None) -> bool:
    """Whether two data.path values name the same directory ('' or None: the built-in corpus)."""
    if not a or not b:
        return not a and not b
    return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()


def host_copies(pieces: list[Piece], reuse: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Host copies of the pieces' tensors (pinned when they live on an accelerator, so that the copies run at full
    speed), made now, before the next step changes the state; `reuse`: the copies of the previous save, whose
    buffers are taken again when their shapes and dtypes still match."""
    pin = device.type != "cpu"
    out = []
    for i, p in enumerate(pieces):
        src = p.tensor.detach()
        old = reuse[i] if i < len(reuse) else None
        buf = old if old is not None and old.shape == src.shape and old.dtype == src.dtype else \
            torch.empty(src.shape, dtype=src.dtype, pin_memory=pin)
        buf.copy_(src, non_blocking=pin)
        out.append(buf)
    if pin:
        torch.accelerator.synchronize()
    return out


WRITER_NICENESS = 10  # of a background save's thread (Linux schedules threads apart): training keeps the CPU first


class AsyncSave:
    """One rank's part of a checkpoint written in the background, from host copies taken at the save (on the CPU from
    the live state itself, which the next optimizer step waits to change until `state_read` is set): a thread
    writes the rank's files (the same files, checksums and fsyncs as a synchronous save), then leaves the marker
    `rankN.written` (or `rankN.failed` with its error) in the `.tmp` directory. On the logging rank the same thread
    then waits for every rank's marker, removes the markers and finishes the checkpoint (trainer state, config,
    index, manifest, COMPLETE last, the rename) and prunes: the atomic rules of a synchronous save, without a
    collective, so that training's collectives go on meanwhile. A process killed meanwhile leaves a `.tmp`
    directory, which no reader trusts."""

    def __init__(self, owner: Checkpointer, step: int, tmp: Path, pieces: list[Piece], steps: dict[str, float],
                 rng: dict[str, torch.Tensor], finish, prune: bool) -> None:
        self.owner, self.step, self.tmp, self.pieces, self.steps, self.rng = owner, step, tmp, pieces, steps, rng
        self.finish, self.prune = finish, prune
        self.error = ""
        self.written: Path | None = None
        self.cancel = threading.Event()  # set by a stop: give the save up (between pieces) rather than finish it
        # set once the pieces are read no more: handed to their file (before its fsync), or the write has ended
        self.state_read = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"fivefold-checkpoint-{step}", daemon=True)

    def start(self) -> AsyncSave:
        self.thread.start()
        return self

    def release(self, abandon_if) -> None:
        """Return once this save reads the live state no more; give it up (between two pieces) if `abandon_if()`
        turns true meanwhile."""
        while not self.state_read.wait(0.05):
            if abandon_if():
                self.cancel.set()

    def join(self) -> str:
        """Wait for this rank's part; '' or its error line."""
        self.thread.join()
        return self.error

    def _run(self) -> None:
        rank, tmp = self.owner.rank, self.tmp
        with contextlib.suppress(OSError, AttributeError):  # Linux: this thread yields the cores to training's
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICENESS)
        try:
            try:
                error = _os_error(lambda: write_rank_files(tmp, rank, self.pieces, self.steps,
                                                           self.owner.engine.device, self.rng,
                                                           cancelled=self.cancel.is_set, read=self.state_read.set))
            finally:  # whatever happened, this thread reads the pieces no more
                self.pieces = []  # (host copies stay with the owner, reused; the live state with the engine)
                self.state_read.set()
            marker = tmp / (f"rank{rank}.failed" if error else f"rank{rank}.written")
            with contextlib.suppress(OSError):
                marker.write_text(error)
            if error or self.finish is None:
                self.error = error
                return
            self.error = _os_error(self._finish) or self.error
        except WriteCancelled:
            return  # given up for a stop's save: its partial directory is removed there

    def _finish(self) -> None:
        """The logging rank: every rank's marker, then the shared files and the rename."""
        timeout = self.owner.cfg.train.collective_timeout_s
        deadline = time.monotonic() + timeout
        for r in range(self.owner.world):
            while not (self.tmp / f"rank{r}.written").exists():
                if self.cancel.is_set():
                    raise WriteCancelled(str(self.tmp))
                if (self.tmp / f"rank{r}.failed").exists():
                    raise OSError(errno.EIO, f"rank {r} could not write its part "
                                  f"({(self.tmp / f'rank{r}.failed').read_text().strip() or 'no detail'})")
                if time.monotonic() > deadline:
                    raise OSError(errno.ETIMEDOUT, f"rank {r} did not write its part within "
                                  f"train.collective_timeout_s = {timeout:g} s")
                time.sleep(0.01)
        for r in range(self.owner.world):
            (self.tmp / f"rank{r}.written").unlink()
        self.finish()
        self.written = checkpoint_dir(self.owner.run_dir, self.step)
        if self.prune:
            self.owner._prune(self.written)


class Checkpointer:
    """The checkpoint lifecycle of one run in `run_dir` (see the module docstring): load, fall back, restore, save,
    prune. `rank` of `world` ranks; `is_first` reports and sets aside what fails on load (the first rank of the
    world); the engine's logging rank writes the shared files and prunes. Every method but `load_state` is a
    collective: every rank calls it at the same point."""

    def __init__(self, run_dir: Path, engine: Engine, cfg: Config, rank: int = 0, world: int = 1,
                 is_first: bool = True, data_fingerprint: str | None = None) -> None:
        self.run_dir, self.engine, self.cfg = run_dir, engine, cfg
        # the training corpus's fingerprint (`TokenDataset.corpus_fingerprint`), recorded with each checkpoint's data
        # position and checked on resume
        self.data_fingerprint = data_fingerprint
        self.rank, self.world, self.is_first = rank, world, is_first
        self.config_toml = dump_toml(cfg)  # the resolved config, as the run directory and every checkpoint keep it
        self.in_flight: AsyncSave | None = None  # the asynchronous save being written (at most one)
        self.host: list[torch.Tensor] = []  # its host copies on accelerators (pinned), reused by the next save

    def load(self, candidates: list[Path]) -> LoadedCheckpoint | None:
        """The newest of `candidates` (newest first) that every rank reads, verifies (each rank the files it reads)
        and loads into the engine with finite values; newer ones that fail
        (a file, the manifest, the index, NaN or inf) are reported and set aside as `NAME.bad`. None when there is
        none at all; a CheckpointError listing the reasons when every one fails, or naming how the newest readable
        one does not match this run (model shapes, sequence length: nothing is set aside)."""
        engine = self.engine
        rejected: list[tuple[Path, str]] = []
        for path in candidates:
            loaded, reason = self._open(path)
            if not self._failed(reason):
                reason = self._load_into_engine(loaded)
                if not self._failed(reason):
                    where = first_nonfinite(engine, engine.state_pieces()[0])
                    if where is None:
                        break
                    reason = f"{path} holds NaN or inf in its weights or optimizer state, first in {where}"
            rejected.append((path, reason or "a file that another rank reads failed its verification"))
        else:
            if rejected:
                raise CheckpointError("--resume: no usable checkpoint: " + "; ".join(r for _, r in rejected))
            return None
        if self.is_first:
            for path, reason in rejected:
                moved = set_aside(path)
                print(f"fivefold: checkpoint {path.name} cannot be used ({reason}); set aside as {moved.name}",
                      file=sys.stderr)
            if rejected:
                print(f"fivefold: resuming from the newest good checkpoint, {loaded.path.name}", file=sys.stderr)
        engine.barrier()
        return loaded

    def _failed(self, reason: str) -> bool:
        """Whether any rank has a `reason` to refuse the checkpoint (collective)."""
        return bool(self.engine.agree(torch.tensor([float(bool(reason))], device=self.engine.device)).item())

    def _open(self, path: Path) -> tuple[LoadedCheckpoint | None, str]:
        """The checkpoint at `path` opened for this rank (its small files verified; the piece files it reads are,
        as it reads them), or why not."""
        try:
            return load_checkpoint(path, self.rank, self.world), ""
        except CheckpointError as e:
            return None, str(e)

    def restore(self, loaded: LoadedCheckpoint, sampler: BatchSampler) -> BatchSampler:
        """Continue from `loaded` (its state already in the engine: `load`): its RNG state (when it has this
        rank's), and the sampler that continues at its data position."""
        restore_rng(loaded, self.engine.device)
        return resumed_sampler(sampler, loaded, self.cfg, self.is_first)

    def load_state(self, loaded: LoadedCheckpoint) -> None:
        """Load a checkpoint written under any layout into this rank's part of the engine (see `_load_into_engine`);
        a CheckpointError for any failure."""
        reason = self._load_into_engine(loaded)
        if reason:
            raise CheckpointError(reason)

    def _load_into_engine(self, loaded: LoadedCheckpoint) -> str:
        """Load `loaded` into this rank's part of the engine; a reason when the checkpoint is damaged (its index
        disagrees with its own config, a piece is missing or unreadable). A checkpoint that does not match this run
        (the model's names and global shapes, the data position's sequence length) raises a CheckpointError: it is
        not damaged, and another run may use it."""
        cfg = self.cfg
        written = check_run_settings(cfg, loaded.path, loaded.data, loaded.config_toml)
        self._check_same_data(loaded, written)
        shapes = {k.removeprefix("model."): loaded.reader.shape(k) for k in loaded.reader.names()
                  if k.startswith("model.")}
        own = checkpoint_model(loaded)
        if own is not None:
            try:
                check_model_shapes(shapes, model_shapes(own), loaded.path)
            except CheckpointError as e:
                return f"its piece index disagrees with its own config.toml: {e}"
        check_model_shapes(shapes, model_shapes(cfg.model), loaded.path)
        try:
            self.engine.load_state_pieces(loaded.reader, loaded.steps)
        except PieceError as e:
            return f"checkpoint {loaded.path}: {e}"
        return ""

    def _check_same_data(self, loaded: LoadedCheckpoint, written: dict[str, Any]) -> None:
        """Refuse another training corpus than the checkpoint's: its data position (samples consumed) indexes the
        order drawn over that corpus's windows. Compared by the corpus fingerprint the checkpoint records (the same
        prepared directory moved elsewhere passes); a checkpoint written before it was recorded, by `data.path`."""
        was_path = written.get("data", {}).get("path")
        now_path = self.cfg.data.path
        saved = loaded.data.get("data_fingerprint")
        if saved and self.data_fingerprint:
            if saved == self.data_fingerprint:
                return
            how = f"corpus fingerprint {saved[:12]}, this data's {self.data_fingerprint[:12]}"
        elif was_path is None or _same_path(was_path, now_path):
            return
        else:
            how = "the checkpoint records no corpus fingerprint, so the paths are compared"

        def named(path: str | None) -> str:
            return shown(path) if path else "'' (the built-in corpus)"

        samples = loaded.data.get("samples_consumed")
        position = f"{samples:,} samples consumed" if samples is not None else f"step {loaded.state.step}"
        raise CheckpointError(
            f"--resume: checkpoint {loaded.path.name} was written on data.path = {named(was_path)}, this run has "
            f"data.path = {named(now_path)}, another corpus ({how}); its data position ({position}) indexes the "
            f"order drawn over the first corpus, so another would repeat or skip text: resume with data.path = "
            f"{named(was_path)} (moved or copied elsewhere is fine), or start a new run directory on this data (from "
            f"this run's weights: `fivefold export --checkpoint RUN_DIR --hf DIR`, then `fivefold train --hf DIR`)")

    def save(self, step: int, tokens_seen: int, samples_consumed: int, skipped: int = 0,
             prune: bool = True, background: bool = False, stopping: bool = False) -> Path | None:
        """Write the checkpoint of `step` (`samples_consumed`: the data position after it; `skipped`: the run's
        steps skipped as non-finite so far), then prune the older ones unless `prune` is false (a checkpoint written
        amid skipped steps keeps them all). Nothing is written, and the older checkpoints stay, when the state is
        not finite on some rank. With `background` (and `train.async_checkpoint`), the state is copied to host
        memory and written by a thread while training goes on (`AsyncSave`; `wait` collects it); the save in
        flight, if any, is waited for first, or with `stopping` (a stop signal's save, which must fit the grace
        before the process is killed) given up: the stop's own checkpoint is newer. Returns the new checkpoint's
        directory on the logging rank once it is complete (None for one still being written, or on the other
        ranks)."""
        engine, run_dir, t = self.engine, self.run_dir, self.cfg.train
        faults.note(step=step, micro_batch=None, action="checkpoint")
        self.wait(abandon=stopping)
        state = TrainerState(step=step, tokens_seen=tokens_seen, skipped_steps=skipped,
                             lr_phases=[tuple(p) for p in engine.lr_schedule.phases])
        pieces, steps = engine.state_pieces()  # views of this rank's weights and AdamW state, nothing gathered
        where = first_nonfinite(engine, pieces)
        if where is not None:
            if engine.is_logging_rank:
                print(f"fivefold: not writing the checkpoint of step {step}: the weights or optimizer state hold "
                      f"NaN or inf, first in {where}; the older checkpoints are kept", file=sys.stderr)
            return None
        tmp = checkpoint_dir(run_dir, step).with_name(checkpoint_dir(run_dir, step).name + ".tmp")
        data: dict[str, Any] = {"global_batch_size": t.global_batch_size, "seq_len": t.seq_len,
                                "samples_consumed": samples_consumed}
        if self.data_fingerprint:
            data["data_fingerprint"] = self.data_fingerprint
        written: list[Path] = []
        error = _os_error(lambda: begin_checkpoint(run_dir, step) if engine.is_logging_rank else None)
        if self._failed(error):
            raise self._write_failed(step, tmp, error)
        if background and t.async_checkpoint:
            rng = _rng_state(engine.device)
            finish = (lambda: finish_checkpoint(tmp, state, self.config_toml, self.world, data)) \
                if engine.is_logging_rank else None
            if engine.device.type == "cpu":
                # no copy: the thread writes the live state, which nothing changes before the next optimizer step,
                # and that step waits until the thread has handed it to the file (`Engine.state_readers`)
                self.in_flight = AsyncSave(self, step, tmp, pieces, steps, rng, finish, prune).start()
                engine.state_readers.append(self.in_flight.release)
                return None
            self.host = host_copies(pieces, self.host, engine.device)
            copies = [Piece(p.name, p.shape, p.offsets, h) for p, h in zip(pieces, self.host, strict=True)]
            self.in_flight = AsyncSave(self, step, tmp, copies, steps, rng, finish, prune).start()
            return None
        stages = [  # each stage on every rank, then an agreement (the barrier) that no rank failed
            lambda: write_rank_files(tmp, self.rank, pieces, steps, engine.device),
            lambda: written.append(finish_checkpoint(tmp, state, self.config_toml, self.world, data))
            if engine.is_logging_rank else None,
        ]
        for stage in stages:
            error = _os_error(stage)
            if self._failed(error):
                raise self._write_failed(step, tmp, error)
        if engine.is_logging_rank and prune:
            self._prune(written[0])
        engine.barrier()
        return written[0] if written else None

    def _prune(self, newest: Path) -> None:
        error = _os_error(lambda: prune_checkpoints(self.run_dir, self.cfg.train.keep_checkpoints))
        if error:
            print(f"fivefold: warning: could not delete older checkpoints ({error}); the new checkpoint "
                  f"{newest.name} is complete", file=sys.stderr)

    def wait(self, abandon: bool = False) -> Path | None:
        """Wait for the asynchronous save in flight, if any (collective: every rank calls it at the same point), and
        agree on its outcome: a CheckpointWriteError when some rank failed (its partial files removed). With
        `abandon`, the save is given up between two pieces instead (unless it finished first) and its partial
        directory removed. Returns the finished checkpoint's directory on the logging rank, else None."""
        save, self.in_flight = self.in_flight, None
        if save is None:
            return None
        if abandon:
            save.cancel.set()
        error = save.join()
        if self._failed(error):
            raise self._write_failed(save.step, save.tmp, error)
        if abandon:  # every rank's thread has ended: nothing writes there any more
            if self.engine.is_logging_rank and save.written is None:
                shutil.rmtree(save.tmp, ignore_errors=True)
            self.engine.barrier()
        return save.written

    def _write_failed(self, step: int, tmp: Path, error: str) -> CheckpointWriteError:
        """After a failed save (on some rank): the partial checkpoint removed, so that it holds no space, and the
        error that says what failed, what is safe on disk and how to continue (this rank's own failure, else a
        pointer to the rank that failed)."""
        if self.engine.is_logging_rank:
            shutil.rmtree(tmp, ignore_errors=True)
        self.engine.barrier()
        newest = latest_checkpoint(self.run_dir)
        safe = (f"the newest complete checkpoint, {newest}, is intact" if newest else
                "no complete checkpoint exists yet")
        where = error or "another rank's files (see its line)"
        return CheckpointWriteError(
            f"could not write the checkpoint of step {step}: {where}; its partial files ({tmp.name}) were removed "
            f"and {safe}; free space or make {self.run_dir / 'checkpoints'} writable, then continue with "
            f"`fivefold train --resume --run-dir {self.run_dir}`" + (" (add the run's --nproc and layout)"
                                                                    if self.world > 1 else ""),
            own=bool(error))


def _os_error(action) -> str:
    """Run `action`; '' when it succeeds, else one line naming the OS error and the path it concerns."""
    try:
        action()
    except OSError as e:
        return describe_os_error(e)
    return ""


def describe_os_error(e: OSError) -> str:
    """`[Errno 28] No space left on device: 'path'` as one line: what failed and where."""
    code = errno.errorcode.get(e.errno or 0, "")
    where = f" writing {e.filename}" if e.filename else ""
    return f"{e.strerror or e}{f' ({code})' if code else ''}{where}"
