"""`fivefold export --checkpoint PATH --hf OUT_DIR`: a trained checkpoint as a Hugging Face directory.

PATH is one checkpoint directory (`model.safetensors` + `config.toml`) or a run directory whose
`checkpoints/step_XXXXXXXX/` holds several; then the newest complete one (with its `COMPLETE`
marker) is exported. The tokenizer comes from the run (`RUN_DIR/tokenizer/`, which training writes) or
from `--tokenizer`; with it the directory is complete: AutoTokenizer and `generate` work on it.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import TYPE_CHECKING

from fivefold.config import build_config, check_writable_dir, finite_float, shown
from fivefold.errors import CliError
from fivefold.flops import count_params

if TYPE_CHECKING:
    import torch

    from fivefold.checkpoint_format import PieceReader
    from fivefold.config import ModelConfig

_STEP_DIR = re.compile(r"^step_(\d+)$")


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


def resolve_checkpoint(path: Path) -> tuple[Path, str | None]:
    """The checkpoint directory to export and, when it was picked from a run, a note saying which."""
    if not path.exists():
        raise CliError(f"--checkpoint {shown(str(path))} does not exist")
    if not path.is_dir():
        raise CliError(f"--checkpoint {shown(str(path))} is a file; give a checkpoint directory (step_XXXXXXXX) "
                       f"or a run "
                       "directory")
    if (path / "model.safetensors").is_file() or (path / "rank0.json").is_file():
        return path, None
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    steps = sorted((int(m.group(1)), p) for p in root.iterdir()
                   if p.is_dir() and (m := _STEP_DIR.match(p.name)))
    complete = [(s, p) for s, p in steps if (p / "COMPLETE").is_file()]
    if not complete:
        found = ", ".join(p.name for _, p in steps[-5:]) or "none"
        raise CliError(
            f"--checkpoint {shown(str(path))} holds no model.safetensors and no complete checkpoint "
            f"(step_XXXXXXXX directory with a COMPLETE marker) under {shown(str(root))}; "
            f"step directories found: {found}"
        )
    newest_step, newest = complete[-1]
    skipped = [p.name for s, p in steps if s > newest_step]
    note = f"using {newest.name}, the newest of {len(complete)} complete checkpoint(s) in {root}"
    if skipped:
        note += f" (skipped incomplete: {', '.join(skipped)})"
    return newest, note


def checkpoint_model_config(ckpt: Path) -> ModelConfig:
    """The model config saved with checkpoint directory `ckpt` (its config.toml, checked against the manifest
    first: `checkpoint_format.verify_config`), for `export` and `generate`."""
    from fivefold.checkpoint_format import PieceError, verify_config

    config_file = ckpt / "config.toml"
    if not config_file.is_file():
        raise CliError(f"checkpoint {shown(str(ckpt))} has no config.toml (the run's resolved config)")
    try:
        verify_config(ckpt)
    except PieceError as e:
        raise CliError(str(e)) from None
    return build_config(config_file).model


def checkpoint_reader(directory: Path) -> PieceReader:
    """A reader of the plain-named model weights (`model.<param>`) of a checkpoint directory, nothing read yet: a
    sharded one's pieces after its config, piece indexes and piece files were checked against the manifest
    (sha256), or a plain `model.safetensors` (each tensor its one piece). Damaged files raise the format's
    PieceError (a plain file: `models.hf.CheckpointError`)."""
    from fivefold.checkpoint_format import PieceReader, checkpoint_index, index_files, verify_manifest
    from fivefold.models.hf import safetensors_shapes

    single = directory / "model.safetensors"
    if single.is_file():
        index = {f"model.{name}": {"shape": list(shape), "pieces": [
            {"file": single.name, "key": name, "offsets": [0] * len(shape), "shape": list(shape)}]}
            for name, shape in safetensors_shapes(single).items()}
        return PieceReader(directory, index)
    index = checkpoint_index(directory)
    verify_manifest(directory, ["config.toml", *(f.name for f in sorted(directory.glob("rank*.json")))])
    index_files(directory, index)
    return PieceReader(directory, index)


def check_checkpoint_model(reader: PieceReader, cfg: ModelConfig, where: str) -> None:
    """The checkpoint's model tensors against `cfg` (a CheckpointError naming the missing, unexpected and wrongly
    shaped ones), from the piece index alone: a config that does not match its weights, before any is read."""
    from fivefold.models.hf import check_tensors, expected_shapes

    found = {k.removeprefix("model."): reader.shape(k) for k in reader.names() if k.startswith("model.")}
    if cfg.tied_embeddings:
        found.pop("lm_head.weight", None)
    check_tensors(found, expected_shapes(cfg), where)


def read_checkpoint_weights(directory: Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The plain-named model weights of a checkpoint directory (`checkpoint_reader`), checked against `cfg`
    (`check_checkpoint_model`), then assembled tensor by tensor (no model is built; each tensor reads only its
    pieces' bytes)."""
    reader = checkpoint_reader(directory)
    check_checkpoint_model(reader, cfg, str(directory))
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
    ckpt, note = resolve_checkpoint(Path(args.checkpoint))
    if note:
        print(note)
    tokenizer_dir = find_tokenizer_dir(ckpt, args.tokenizer)
    cfg = checkpoint_model_config(ckpt)
    cfg.validate()
    check_tokenizer(tokenizer_dir, find_tokenizer_dir(ckpt, None), cfg.vocab_size, args.tokenizer)
    hf_architecture(cfg)  # refuses what no Hugging Face architecture holds
    weights = ckpt / "model.safetensors" if (ckpt / "model.safetensors").is_file() else ckpt
    try:
        reader = checkpoint_reader(ckpt)
        check_checkpoint_model(reader, cfg, f"{weights}")
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
