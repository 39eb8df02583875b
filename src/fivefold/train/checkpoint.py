"""Checkpoints: written to a temporary directory and renamed, loaded without unpickling.

Layout of `RUN_DIR/checkpoints/step_XXXXXXXX/` (format 3, sharded; see docs/training.md):
    rankN.safetensors      rank N's pieces: rectangles of the plain-named global tensors `model.<param>`,
                           `exp_avg.<param>`, `exp_avg_sq.<param>` that rank N owns (one copy in all)
    rankN.json             their index (global shape and offsets of each piece), the sha256 of rankN.safetensors
                           and AdamW's step of each parameter
    rng-rankN.safetensors  rank N's CPU and accelerator RNG states
    trainer_state.json     step, tokens seen, steps skipped as non-finite, world size, global batch, seq length
    config.toml            the run's resolved config
    manifest.json          size and sha256 of every file above; a reader verifies the files it reads against it
    COMPLETE               written last, before the rename: a directory without it is not a checkpoint

A killed writer leaves at most a `*.tmp` directory, which is ignored and cleaned up by the next writer. Nothing is
unpickled: tensors are safetensors, everything else JSON or TOML.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from fivefold.models.pieces import MANIFEST, PieceError, PieceReader, file_sha256, verify_manifest, write_safetensors

FORMAT_VERSION = 3  # 2: manifest.json with the sha256 of every file; 3: sharded pieces
CHECKPOINT_PREFIX = "step_"


class CheckpointError(Exception):
    """A checkpoint that is missing, incomplete, corrupted or does not match the run."""


@dataclass
class TrainerState:
    step: int  # optimizer steps completed
    tokens_seen: int
    skipped_steps: int = 0  # steps whose update was skipped for a non-finite loss or gradient norm
    format_version: int = FORMAT_VERSION


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
    """A rectangle of a named global tensor that one rank writes: `name` is `model.<parameter>` or
    `exp_avg.<parameter>` / `exp_avg_sq.<parameter>` (AdamW's moments), with the plain single-process name."""

    name: str
    shape: tuple[int, ...]  # of the global tensor
    offsets: tuple[int, ...]  # of this piece in it
    tensor: torch.Tensor


def rank_files(rank: int) -> list[str]:
    return [f"rank{rank}.safetensors", f"rank{rank}.json", f"rng-rank{rank}.safetensors"]


def write_rank_files(tmp: Path, rank: int, pieces: list[Piece], steps: dict[str, float], device: torch.device) -> None:
    """One rank's pieces (`rankN.safetensors`, streamed), their index with the sha256 of that file and the AdamW
    step of each parameter (`rankN.json`), and the rank's RNG state (`rng-rankN.safetensors`)."""
    name = f"rank{rank}.safetensors"
    sha = write_safetensors(tmp / name, [(str(i), p.tensor) for i, p in enumerate(pieces)])
    _write_json(tmp / f"rank{rank}.json", {
        "format_version": FORMAT_VERSION, "rank": rank, "file": name, "sha256": sha, "steps": steps,
        "pieces": [{"name": p.name, "shape": list(p.shape), "offsets": list(p.offsets),
                    "piece_shape": list(p.tensor.shape), "key": str(i)} for i, p in enumerate(pieces)],
    })
    save_file(_rng_state(device), str(tmp / f"rng-rank{rank}.safetensors"))


def finish_checkpoint(tmp: Path, state: TrainerState, config_toml: str, world_size: int,
                      data: dict[str, int]) -> Path:
    """After every rank wrote its files: the trainer state and config, the manifest (the piece files' checksums
    as their writers computed them), the COMPLETE marker, then the rename into place."""
    _write_json(tmp / "trainer_state.json", {
        "format_version": state.format_version, "step": state.step, "tokens_seen": state.tokens_seen,
        "skipped_steps": state.skipped_steps, "world_size": world_size, **data,
    })
    (tmp / "config.toml").write_text(config_toml)
    for f in tmp.iterdir():
        if not f.name.endswith(".safetensors") or f.name.startswith("rng-"):
            with open(f, "rb+") as fh:
                os.fsync(fh.fileno())
    known = {}
    for r in range(world_size):
        index = json.loads((tmp / f"rank{r}.json").read_text())
        known[index["file"]] = index["sha256"]
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


def verify_files(path: Path, names: list[str] | None = None) -> None:
    """Check the files `names` (default: every file the manifest lists) against the manifest: each must be listed,
    present, and of the recorded size and sha256. Raises a CheckpointError naming the first file that is not."""
    try:
        verify_manifest(path, names)
    except PieceError as e:
        raise CheckpointError(str(e)) from None


def save_checkpoint(run_dir: Path, state: TrainerState, engine: Any, config_toml: str,
                    data: dict[str, int] | None = None) -> Path:
    """Write a complete checkpoint of a single-process engine for `state.step` atomically; its directory."""
    tmp = begin_checkpoint(run_dir, state.step)
    pieces, steps = engine.state_pieces()
    write_rank_files(tmp, 0, pieces, steps, engine.device)
    return finish_checkpoint(tmp, state, config_toml, 1, data or {})


def prune_checkpoints(run_dir: Path, keep: int) -> None:
    """Delete all but the `keep` newest complete checkpoints (only directories this module wrote). Each is first
    renamed to `NAME.deleting`, so a kill during the deletion never leaves a marked but partial checkpoint; such
    leftovers are deleted by the next call."""
    for old in list_checkpoints(run_dir)[:-keep]:
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
    data: dict[str, int]  # the global batch, sequence length and samples consumed it was written with


def _json_file(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} is missing") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint file {path} is corrupted: {e}") from None


def load_checkpoint(path: Path, rank: int = 0, world_size: int = 1) -> LoadedCheckpoint:
    """Open a checkpoint directory for a rank of a run of `world_size` ranks: the trainer state, the index of
    every rank's pieces and config (each checked against the manifest). Piece files are read lazily; the caller
    verifies them (`verify_files`). Every failure is a CheckpointError naming the file."""
    if not (path / "COMPLETE").is_file():
        raise CheckpointError(f"{path} is not a complete checkpoint (no COMPLETE marker)")
    if (path / "trainer_state.json").is_file():
        try:
            version = json.loads((path / "trainer_state.json").read_text()).get("format_version")
        except (OSError, ValueError, AttributeError):
            version = None
        if version is not None and version != FORMAT_VERSION:
            raise CheckpointError(f"{path} has checkpoint format {version}; this fivefold reads format "
                                  f"{FORMAT_VERSION} (sharded pieces with a manifest of checksums)")
    verify_files(path, ["trainer_state.json"])
    meta = _json_file(path / "trainer_state.json")
    try:
        state = TrainerState(step=int(meta["step"]), tokens_seen=int(meta["tokens_seen"]),
                             skipped_steps=int(meta.get("skipped_steps", 0)),
                             format_version=int(meta["format_version"]))
        saved_world = int(meta["world_size"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint file {path / 'trainer_state.json'} is corrupted: {e}") from None
    data = {k: int(meta[k]) for k in ("global_batch_size", "seq_len", "samples_consumed") if k in meta}
    indexes = [f"rank{r}.json" for r in range(saved_world)]
    own_rng = f"rng-rank{rank}.safetensors" if saved_world == world_size else None
    verify_files(path, ["config.toml", *indexes] + ([own_rng] if own_rng else []))
    index: dict[str, dict[str, Any]] = {}
    steps: dict[str, float] = {}
    for name in indexes:
        part = _json_file(path / name)
        try:
            for p in part["pieces"]:
                entry = index.setdefault(p["name"], {"shape": p["shape"], "pieces": []})
                entry["pieces"].append({"file": part["file"], "key": p["key"], "offsets": p["offsets"],
                                        "shape": p["piece_shape"]})
            for k, v in part["steps"].items():
                steps[k] = max(steps.get(k, 0.0), float(v))
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"checkpoint file {path / name} is corrupted: {e}") from None
    rng = None
    if own_rng:
        try:
            rng = load_file(str(path / own_rng))
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"checkpoint file {path / own_rng} is corrupted or unreadable: {e}") from None
    return LoadedCheckpoint(path=path, state=state, reader=PieceReader(path, index), steps=steps, rng_state=rng,
                            config_toml=(path / "config.toml").read_text(), world_size=saved_world, data=data)


def read_model_state(path: Path) -> dict[str, torch.Tensor]:
    """The whole plain-named model state of a checkpoint (tied output layer left out), assembled from its
    pieces; verifies the files it reads."""
    loaded = load_checkpoint(path)
    verify_files(path)
    try:
        return {name.removeprefix("model."): loaded.reader.read(name) for name in loaded.reader.names()
                if name.startswith("model.")}
    except PieceError as e:
        raise CheckpointError(str(e)) from None


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


def check_model_state(loaded: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], path: Path) -> None:
    """Refuse a state whose tensor names or shapes differ from the model's, listing the differences."""
    check_model_shapes({k: tuple(v.shape) for k, v in loaded.items()},
                       {k: tuple(v.shape) for k, v in expected.items()}, path)


def restore_rng(loaded: LoadedCheckpoint, device: torch.device) -> None:
    if loaded.rng_state is not None:
        _set_rng_state(loaded.rng_state, device)
