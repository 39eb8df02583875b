"""`fivefold export --checkpoint PATH --hf OUT_DIR`: a trained checkpoint as a Hugging Face directory.

PATH is one checkpoint directory (`step_XXXXXXXX`) or a run directory whose `checkpoints/step_XXXXXXXX/` holds
several; then the newest one that passes is exported. Either passes the checks a resume runs
(`checkpoint_format.verify_checkpoint`, and `checkpoint_format.nonfinite` on every tensor: no NaN or inf): what
`--resume` would set aside is refused here. The tokenizer comes from
the run (`RUN_DIR/tokenizer/`, which training writes) or from `--tokenizer`; with it the directory is complete:
AutoTokenizer and `generate` work on it.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from fivefold.config import build_config, check_writable_dir, finite_float, shown
from fivefold.errors import CliError, ConfigError
from fivefold.flops import count_params

if TYPE_CHECKING:
    import torch

    from fivefold.checkpoint_format import PieceReader
    from fivefold.config import ModelConfig

_STEP_NAME = re.compile(r"^step_(\d+)((?:\.tmp|\.bad\d*|\.deleting))?$")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True, metavar="PATH",
                        help="a checkpoint directory, or a run directory (its newest complete checkpoint)")
    parser.add_argument("--hf", required=True, metavar="OUT_DIR", help="the Hugging Face directory to write")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace config.json, model.safetensors and the tokenizer files in a non-empty "
                        "OUT_DIR; other files stay")
    parser.add_argument("--tokenizer", metavar="PATH",
                        help="a tokenizer.json or a directory holding one (default: the run's RUN_DIR/tokenizer/)")
    parser.add_argument("--max-shard-gb", type=finite_float, default=5.0, metavar="GB",
                        help="largest safetensors file written, in GB of 10^9 bytes (default 5, as transformers): "
                        "a larger model is written as model-0000i-of-0000n.safetensors with an index")


def shard_bytes(gb: float) -> int:
    """--max-shard-gb in bytes, refused unless a number from 0.001 (1 MB) to 1,000,000 (1 PB)."""
    if not 1e-3 <= gb <= 1e6:  # NaN fails too
        raise CliError(f"--max-shard-gb {gb}: the largest file of an export is a number of GB from 0.001 (1 MB) to "
                       "1000000; the default is 5, as transformers writes")
    return int(gb * 10**9)


RUN_TOKENIZER_DIR = "tokenizer"


def find_tokenizer_dir(ckpt: Path, given: str | None) -> Path | None:
    """The directory holding the tokenizer.json of checkpoint `ckpt`: `given` (a tokenizer.json or a directory
    holding one, read here so that a file that is no tokenizer is refused naming it), else the run's `tokenizer/`
    directory (beside `checkpoints/`), else None."""
    if given:
        from fivefold.data import DataError, load_tokenizer

        path = Path(given).expanduser()
        if not path.exists():
            raise CliError(f"--tokenizer {shown(given)} does not exist; give a tokenizer.json or a Hugging Face model "
                           "directory that holds one")
        tokenizer = path if path.is_file() else path / "tokenizer.json"
        if not tokenizer.is_file():
            raise CliError(f"--tokenizer {shown(given)}: no tokenizer.json there; give a tokenizer.json or a Hugging "
                           "Face model directory that holds one")
        try:  # read now, before the weights are: a damaged or foreign file named as such, not as missing
            load_tokenizer(tokenizer)
        except DataError as e:
            raise CliError(f"--tokenizer {shown(given)}: {e}; give a Hugging Face tokenizer.json or a model "
                           "directory that holds one") from None
        if tokenizer.name != "tokenizer.json":
            raise CliError(f"--tokenizer {shown(given)} is a tokenizer named {shown(tokenizer.name)}; it is read as "
                           "a tokenizer.json beside its tokenizer_config.json: rename it tokenizer.json (or give the "
                           "directory that holds one)")
        return tokenizer.parent
    for candidate in (ckpt / RUN_TOKENIZER_DIR, ckpt.parent.parent / RUN_TOKENIZER_DIR):
        if (candidate / "tokenizer.json").is_file() and (candidate == ckpt / RUN_TOKENIZER_DIR
                                                          or ckpt.parent.name == "checkpoints"):
            return candidate
    return None


def check_tokenizer(tokenizer_dir: Path | None, own_dir: Path | None, vocab_size: int, given: str | None) -> None:
    """Refuse a tokenizer that the model cannot use: more ids than its `vocab_size` (the ids beyond have no
    embedding), or `--tokenizer` (`given`) other than the model's own (`own_dir`: the run's `tokenizer/`, a Hugging
    Face directory's): the same ids would mean other text."""
    if tokenizer_dir is None:
        return
    from fivefold.data import load_tokenizer
    from fivefold.data.format import tokenizer_fingerprint
    from fivefold.data.tokenizer import tokenizer_vocab_size

    named = f"--tokenizer {shown(given)}" if given else f"the tokenizer in {tokenizer_dir}"
    ids = tokenizer_vocab_size(load_tokenizer(tokenizer_dir / "tokenizer.json"))  # its largest id + 1
    if ids > vocab_size:
        raise CliError(f"{named} has {ids:,} token ids, but the model's vocab_size is {vocab_size:,} (ids from "
                       f"{vocab_size:,} up have no embedding); give the tokenizer the model was trained with")
    chosen = tokenizer_dir / "tokenizer.json"
    own = own_dir / "tokenizer.json" if own_dir is not None else None
    if given and own is not None and own.resolve() != chosen.resolve() and \
            tokenizer_fingerprint(own) != tokenizer_fingerprint(chosen):
        raise CliError(f"{named} is not the model's own tokenizer ({own}, another "
                       "fingerprint): the same ids would mean other text; leave --tokenizer out to use the model's")


CHECKPOINT_FILES = ("manifest.json", "COMPLETE", "trainer_state.json", "index.json", "rank0.json")  # any: a checkpoint
_LEFTOVER = {".tmp": "the directory of a save that never finished (a killed or abandoned save), which no resume reads",
             ".bad": "a checkpoint that a resume found unusable and set aside (kept for inspection, never read)",
             ".deleting": "an old checkpoint being deleted by pruning"}


@dataclass
class OpenedCheckpoint:
    """A checkpoint directory that passed the check a resume runs, its model config and a reader of its pieces."""

    path: Path
    cfg: ModelConfig
    reader: PieceReader


def open_checkpoint(ckpt: Path) -> OpenedCheckpoint:
    """Checkpoint directory `ckpt` for `export` and `generate`, accepted only as a resume accepts it: the one check
    every reader runs (`checkpoint_format.verify_checkpoint`, as one rank that reads everything: the marker, every
    file the manifest lists, each checked against it before it is parsed, piece files included), then its config and
    its model tensors against that config (`check_checkpoint_model`: names and shapes, before any weight is read),
    then every tensor it holds, weights and optimizer state, finite (`check_finite`: what a resume sets aside as
    NaN or inf). A CliError names the file or tensor and the problem."""
    from fivefold.checkpoint_format import PieceError, PieceReader, verify_checkpoint
    from fivefold.models.hf import CheckpointError

    try:
        found = verify_checkpoint(ckpt, pieces=True)
        cfg = build_config(ckpt / "config.toml").model
        try:  # a model no run trains (a field edited by hand): refused naming the file, before any weight is read
            cfg.validate()
        except ConfigError as e:
            raise ConfigError(f"{ckpt / 'config.toml'}: {e}") from None
        reader = PieceReader(ckpt, found.index)  # every file was just verified: not hashed again as it is opened
        check_checkpoint_model(reader, cfg, str(ckpt))
        check_finite(reader, ckpt)
    except (PieceError, CheckpointError, ConfigError) as e:
        raise CliError(str(e)) from None
    return OpenedCheckpoint(ckpt, cfg, reader)


def check_finite(reader: PieceReader, ckpt: Path) -> None:
    """Every tensor of the checkpoint at `ckpt` finite, read one at a time (`checkpoint_format.nonfinite`, the check a
    resume runs on what it loads): a PieceError naming the first that holds a NaN or an infinity."""
    from fivefold.checkpoint_format import PieceError, nonfinite

    for name in reader.names():
        bad = nonfinite([reader.read(name)])
        reader.close()  # its mapped pages leave this process's resident memory, as export's reads do
        if bad:
            raise PieceError(f"{ckpt} holds NaN or inf in tensor {shown(name)}, which a resume sets aside as "
                             "unusable")


def resolve_checkpoint(path: Path) -> tuple[OpenedCheckpoint, str | None]:
    """The checkpoint to export or generate from, verified (`open_checkpoint`), and, when it was picked from a run
    directory, a note saying which (and which newer ones were skipped, and why). A named checkpoint directory that
    fails, or a `.tmp` / `.bad` / `.deleting` one, is refused; a run directory gives its newest checkpoint that
    passes, as `--resume` would take it (nothing is set aside: export only reads)."""
    where = f"--checkpoint {shown(str(path))}"
    if not path.exists():
        raise CliError(f"{where} does not exist")
    if not path.is_dir():
        raise CliError(f"{where} is a file; give a checkpoint directory (step_XXXXXXXX) or a run directory")
    if (m := _STEP_NAME.match(path.name)) and m.group(2):
        kind = next(v for k, v in _LEFTOVER.items() if m.group(2).startswith(k))
        raise CliError(f"{where} is {kind}; give the run directory (its newest complete, verified checkpoint) or a "
                       "complete step_XXXXXXXX directory")
    if _STEP_NAME.match(path.name) or any((path / name).exists() for name in CHECKPOINT_FILES):
        try:
            return open_checkpoint(path), None
        except CliError as e:
            raise CliError(f"{where} cannot be used: {e}; give the run directory to take its newest good "
                           "checkpoint, or an older step_XXXXXXXX") from None
    if (path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file():
        raise CliError(f"{where} is a Hugging Face model directory, not a fivefold checkpoint (no manifest.json); "
                       "give a run directory or a step_XXXXXXXX checkpoint (`generate` reads a Hugging Face "
                       "directory with --hf)")
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    steps = sorted((int(m.group(1)), p) for p in root.iterdir()
                   if p.is_dir() and (m := _STEP_NAME.match(p.name)) and not m.group(2))
    skipped: list[str] = []
    for _, candidate in reversed(steps):
        try:
            opened = open_checkpoint(candidate)
        except CliError as e:
            skipped.append(f"{candidate.name} ({e})")
            continue
        note = f"using {candidate.name}, the newest usable checkpoint in {root}"
        if skipped:
            note += f"; skipped the newer {'; '.join(skipped)}"
        return opened, note
    # a run that `fivefold train --resume` starts again at step 0 once it has no step_XXXXXXXX directory (as
    # `train.loop.started_run` tells: its config.toml and tokenizer/, beside checkpoints/)
    restartable = root == path / "checkpoints" and (path / "config.toml").is_file() and \
        (path / RUN_TOKENIZER_DIR).is_dir()
    if skipped:
        # a resume sets a failing checkpoint aside only when an older one loads; when none does it refuses the run
        # with every reason (`Checkpointer.load`) and leaves each directory where it is
        them, reasons = ("them", "reasons") if len(skipped) > 1 else ("it", "reason")
        how = (f"to train it again from step 0, move {them} out of {shown(str(root))} (a resume then starts the run "
               "again in place) or train in a new --run-dir" if restartable else "train the run again from the start")
        raise CliError(f"{where} holds no complete checkpoint that passes its check under {shown(str(root))}: "
                       f"{'; '.join(skipped)}; `fivefold train --resume` refuses the run for the same {reasons} (no "
                       f"usable checkpoint) and sets nothing aside; {how}")
    leftovers = sorted(p.name for p in root.iterdir() if p.is_dir() and _STEP_NAME.match(p.name))
    others = f"; only {', '.join(leftovers[-5:])}, which are not checkpoints" if leftovers else ""
    resume = "; `fivefold train --resume` starts this run again at step 0" if restartable else ""
    raise CliError(f"{where} holds no checkpoint (no step_XXXXXXXX directory under {shown(str(root))}{others}"
                   f"{resume}); give a run directory that has saved a checkpoint, or a step_XXXXXXXX directory")


def check_checkpoint_model(reader: PieceReader, cfg: ModelConfig, where: str) -> None:
    """The checkpoint's model tensors against `cfg` (a CheckpointError naming the missing, unexpected and wrongly
    shaped ones), from the piece index alone: a config that does not match its weights, before any is read."""
    from fivefold.models.hf import check_tensors, expected_shapes

    found = {k.removeprefix("model."): reader.shape(k) for k in reader.names() if k.startswith("model.")}
    if cfg.tied_embeddings:
        found.pop("lm_head.weight", None)
    check_tensors(found, expected_shapes(cfg), where)


def read_checkpoint_weights(opened: OpenedCheckpoint) -> dict[str, torch.Tensor]:
    """The plain-named model weights of a verified checkpoint (`open_checkpoint`), assembled tensor by tensor (no
    model is built; each tensor reads only its pieces' bytes)."""
    reader = opened.reader
    return {name.removeprefix("model."): reader.read(name) for name in reader.names() if name.startswith("model.")}


def export_checkpoint(reader: PieceReader, cfg: ModelConfig, out_dir: Path, overwrite: bool,
                      tokenizer_dir: Path | None, max_shard_bytes: int) -> None:
    """Write a checkpoint's model as a Hugging Face directory, streamed (`models.hf.write_hf_dir`): one tensor (or one
    expert of a batched weight) read from the pieces at a time, written, and let go of with the files it mapped,
    so that host memory holds about one tensor whatever the model's size."""
    from fivefold.models.hf import write_hf_dir

    def read(name: str, expert: int | None) -> torch.Tensor:
        key = f"model.{name}"
        shape = reader.shape(key)
        value = reader.read(key) if expert is None else reader.read(key, (expert, 0, 0), (1, *shape[1:]))[0]
        reader.close()
        return value

    write_hf_dir(read, lambda name: reader.dtype(f"model.{name}"), cfg, out_dir, overwrite, tokenizer_dir,
                 max_shard_bytes)


def run(args: argparse.Namespace) -> int:
    from fivefold.checkpoint_format import PieceError
    from fivefold.models.hf import (
        CheckpointError,
        check_output_dir,
        hf_architecture,
    )

    max_shard_bytes = shard_bytes(args.max_shard_gb)
    out_dir = Path(args.hf)
    try:
        check_output_dir(out_dir, args.overwrite)
    except CheckpointError as e:
        raise CliError(f"--hf: {e}") from None
    check_writable_dir(out_dir, "--hf")
    opened, note = resolve_checkpoint(Path(args.checkpoint))
    if note:
        print(note)
    ckpt, cfg, reader = opened.path, opened.cfg, opened.reader
    tokenizer_dir = find_tokenizer_dir(ckpt, args.tokenizer)
    cfg.validate()
    check_tokenizer(tokenizer_dir, find_tokenizer_dir(ckpt, None), cfg.vocab_size, args.tokenizer)
    hf_architecture(cfg)  # refuses what no Hugging Face architecture holds
    try:
        export_checkpoint(reader, cfg, out_dir, args.overwrite, tokenizer_dir, max_shard_bytes)
    except (CheckpointError, PieceError) as e:
        raise CliError(str(e)) from None
    arch = hf_architecture(cfg)
    print(f"wrote {arch} ({count_params(cfg):,} parameters, model {shown(cfg.name)}) to {out_dir}")
    if tokenizer_dir is None:
        print("warning: no tokenizer found (the run has no tokenizer/ directory); AutoTokenizer cannot load "
              f"{out_dir}; export again with --tokenizer PATH (the prepared data's tokenizer.json)")
    else:
        print(f"tokenizer from {tokenizer_dir}; generation_config.json written")
    if cfg.is_moe and cfg.capacity_factor > 0:
        print(f"note: model.capacity_factor = {cfg.capacity_factor} drops overflow tokens in fivefold; "
              f"{arch} routes without dropping, so outputs differ where fivefold would drop")
    return 0
