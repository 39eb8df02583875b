"""Checkpoints: written to a temporary directory and renamed, loaded without unpickling.

Layout of `RUN_DIR/checkpoints/step_XXXXXXXX/`:
    model.safetensors      the plain model's weights (tied embedding stored once)
    optimizer.safetensors  optimizer state tensors, and optimizer.json its hyper-parameters
                           (`optimizer-rankN.*` per rank when the engine shards the optimizer state)
    rng.safetensors        CPU and accelerator RNG states (`rng-rankN.safetensors` likewise)
    trainer_state.json     step, tokens seen, steps skipped as non-finite, number of optimizer shards, format version
    config.toml            the run's resolved config
    manifest.json          size and sha256 of every file above; a reader verifies the files it reads against it
    COMPLETE               written last, before the rename: a directory without it is not a checkpoint

A killed writer leaves at most a `*.tmp` directory, which is ignored and cleaned up by the next writer. Nothing is
unpickled: tensors are safetensors, everything else JSON or TOML.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

FORMAT_VERSION = 2  # 2: manifest.json with the sha256 of every file
MANIFEST = "manifest.json"
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


# --- optimizer state <-> flat tensors + JSON ---------------------------------------------------------


def flatten_optimizer_state(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split a torch optimizer state_dict into tensors (for safetensors) and JSON-able metadata."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for idx, per_param in state["state"].items():
        for name, value in per_param.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{idx}.{name}"] = value.detach().contiguous().cpu()
            else:
                scalars.setdefault(str(idx), {})[name] = value
    extra = {k: v for k, v in state.items() if k not in ("state", "param_groups")}  # e.g. the layout of a shard
    return tensors, {"param_groups": state["param_groups"], "scalars": scalars, "extra": extra}


def unflatten_optimizer_state(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        _, idx, name = key.split(".", 2)
        state.setdefault(int(idx), {})[name] = value
    for idx, values in meta.get("scalars", {}).items():
        state.setdefault(int(idx), {}).update(values)
    # JSON turns tuples (Adam's betas) into lists
    groups = [{k: tuple(v) if k == "betas" else v for k, v in g.items()} for g in meta["param_groups"]]
    return {**meta.get("extra", {}), "state": state, "param_groups": groups}


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


def write_rank_files(tmp: Path, optimizer_state: dict[str, Any], device: torch.device, rank_suffix: str = "") -> None:
    """The optimizer state and RNG state of one rank (`rank_suffix` "" when one rank holds it all)."""
    opt_tensors, opt_meta = flatten_optimizer_state(optimizer_state)
    save_file(opt_tensors, str(tmp / f"optimizer{rank_suffix}.safetensors"))
    _write_json(tmp / f"optimizer{rank_suffix}.json", opt_meta)
    save_file(_rng_state(device), str(tmp / f"rng{rank_suffix}.safetensors"))


def finish_checkpoint(tmp: Path, state: TrainerState, model_state: dict[str, torch.Tensor], config_toml: str,
                      optimizer_shards: int = 0) -> Path:
    """Write the model and trainer state, mark the directory complete and rename it into place."""
    save_file({k: v.detach().contiguous().cpu() for k, v in model_state.items()}, str(tmp / "model.safetensors"))
    _write_json(tmp / "trainer_state.json", {
        "format_version": state.format_version, "step": state.step, "tokens_seen": state.tokens_seen,
        "skipped_steps": state.skipped_steps, "optimizer_shards": optimizer_shards,
    })
    (tmp / "config.toml").write_text(config_toml)
    for f in tmp.iterdir():
        with open(f, "rb+") as fh:
            os.fsync(fh.fileno())
    write_manifest(tmp)
    (tmp / "COMPLETE").write_text(f"{state.step}\n")
    _fsync_dir(tmp)
    final = tmp.with_name(tmp.name.removesuffix(".tmp"))
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    return final


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(directory: Path) -> None:
    """Record the size and sha256 of every file of a checkpoint directory in its manifest."""
    files = {f.name: {"bytes": f.stat().st_size, "sha256": _sha256(f)} for f in sorted(directory.iterdir())
             if f.is_file() and f.name not in (MANIFEST, "COMPLETE")}
    _write_json(directory / MANIFEST, {"format_version": FORMAT_VERSION, "files": files})


def verify_files(path: Path, names: list[str] | None = None) -> None:
    """Check the files `names` (default: every file the manifest lists) against the manifest: each must be listed,
    present, and of the recorded size and sha256. Raises a CheckpointError naming the first file that is not."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        listed = manifest["files"]
        if not isinstance(listed, dict):
            raise TypeError("'files' is not a table")
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path / MANIFEST} is missing") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint file {path / MANIFEST} is corrupted: {e}") from None
    for name in listed if names is None else names:
        f = path / name
        if name not in listed:
            raise CheckpointError(f"checkpoint file {f} is not in the manifest, so it cannot be verified")
        if not f.is_file():
            raise CheckpointError(f"checkpoint file {f} is missing")
        size, want = f.stat().st_size, listed[name].get("sha256")
        if size != listed[name].get("bytes"):
            raise CheckpointError(f"checkpoint file {f} is corrupted: {size} bytes, the manifest says "
                                  f"{listed[name].get('bytes')} (an incomplete copy?)")
        got = _sha256(f)
        if got != want:
            raise CheckpointError(f"checkpoint file {f} is corrupted: its sha256 is {got[:16]}..., the manifest "
                                  f"says {str(want)[:16]}...")


def save_checkpoint(
    run_dir: Path,
    state: TrainerState,
    model_state: dict[str, torch.Tensor],
    optimizer_state: dict[str, Any],
    config_toml: str,
    device: torch.device,
) -> Path:
    """Write a complete single-writer checkpoint for `state.step` atomically and return its directory."""
    tmp = begin_checkpoint(run_dir, state.step)
    write_rank_files(tmp, optimizer_state, device)
    return finish_checkpoint(tmp, state, model_state, config_toml)


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
    model_state: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any]
    rng_state: dict[str, torch.Tensor]
    config_toml: str


def load_checkpoint(path: Path, rank_suffix: str = "") -> LoadedCheckpoint:
    """Read a checkpoint directory; every failure is a CheckpointError naming the file."""
    if not (path / "COMPLETE").is_file():
        raise CheckpointError(f"{path} is not a complete checkpoint (no COMPLETE marker)")
    if not (path / MANIFEST).is_file() and (path / "trainer_state.json").is_file():
        try:
            version = json.loads((path / "trainer_state.json").read_text()).get("format_version")
        except (OSError, ValueError, AttributeError):
            version = None
        if version is not None and version != FORMAT_VERSION:
            raise CheckpointError(f"{path} has checkpoint format {version}; this fivefold reads format "
                                  f"{FORMAT_VERSION} (with a manifest of checksums)")
    verify_files(path, ["trainer_state.json"])

    def tensors(name: str) -> dict[str, torch.Tensor]:
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint file {f} is missing")
        try:
            return load_file(str(f))
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"checkpoint file {f} is corrupted or unreadable: {e}") from None

    def json_file(name: str) -> dict[str, Any]:
        f = path / name
        try:
            return json.loads(f.read_text())
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint file {f} is missing") from None
        except (OSError, ValueError) as e:
            raise CheckpointError(f"checkpoint file {f} is corrupted: {e}") from None

    meta = json_file("trainer_state.json")
    try:
        state = TrainerState(step=int(meta["step"]), tokens_seen=int(meta["tokens_seen"]),
                             skipped_steps=int(meta.get("skipped_steps", 0)),
                             format_version=int(meta["format_version"]))
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint file {path / 'trainer_state.json'} is corrupted: {e}") from None
    if state.format_version != FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has checkpoint format {state.format_version}; this fivefold reads format {FORMAT_VERSION}"
        )
    shards = int(meta.get("optimizer_shards", 0))
    if bool(shards) != bool(rank_suffix):
        raise CheckpointError(
            f"{path} holds the optimizer state {f'in {shards} per-rank shards' if shards else 'of a single rank'}, "
            f"but this run {'shards' if rank_suffix else 'does not shard'} it; resume with the layout it was "
            "written under (see its config.toml)"
        )
    verify_files(path, ["config.toml", "model.safetensors", f"optimizer{rank_suffix}.json",
                        f"optimizer{rank_suffix}.safetensors", f"rng{rank_suffix}.safetensors"])
    optimizer = unflatten_optimizer_state(tensors(f"optimizer{rank_suffix}.safetensors"),
                                          json_file(f"optimizer{rank_suffix}.json"))
    return LoadedCheckpoint(
        path=path, state=state, model_state=tensors("model.safetensors"), optimizer_state=optimizer,
        rng_state=tensors(f"rng{rank_suffix}.safetensors"), config_toml=(path / "config.toml").read_text(),
    )


def check_model_state(loaded: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], path: Path) -> None:
    """Refuse a checkpoint whose tensor names or shapes differ from the model's, listing the differences."""
    problems = [f"missing {k}" for k in expected if k not in loaded]
    problems += [f"unexpected {k}" for k in loaded if k not in expected]
    problems += [
        f"{k}: checkpoint {tuple(loaded[k].shape)} vs model {tuple(v.shape)}"
        for k, v in expected.items() if k in loaded and loaded[k].shape != v.shape
    ]
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise CheckpointError(
            f"checkpoint {path} does not match the configured model: {'; '.join(problems[:5])}{more}"
        )


def restore_rng(loaded: LoadedCheckpoint, device: torch.device) -> None:
    _set_rng_state(loaded.rng_state, device)
