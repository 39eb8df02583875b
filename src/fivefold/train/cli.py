"""`fivefold train`: short flags for the everyday fields, `--section.field value` for any other."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from fivefold.cli import CliError
from fivefold.config import Config, ConfigError, build_config

ACCEPTS_OVERRIDES = True


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML or YAML config file")
    p.add_argument("--preset", help="model preset (see `fivefold models`); same as --model.preset")
    p.add_argument("--data", help="prepared dataset directory; same as --data.path (default: built-in corpus)")
    p.add_argument("--max-steps", type=int, help="optimizer steps; same as --train.max_steps")
    p.add_argument("--run-dir", help="directory for config, metrics and checkpoints (default: runs/NAME-TIME)")
    p.add_argument("--resume", action="store_true", help="continue the run in --run-dir from its newest checkpoint")
    p.add_argument("--hf", help="start from the weights (and shape) of a Hugging Face Llama directory")
    p.add_argument("--nproc", type=int, default=1, help="start this many local processes (one per device)")
    p.add_argument("--profile", action="store_true", help="record a profiler trace into RUN_DIR/profile")
    p.add_argument("--slurm", metavar="FILE", help="write a SLURM batch script for this run (torchrun on --nodes "
                   "nodes x --nproc processes each) to FILE instead of training")
    p.add_argument("--nodes", type=int, default=1, help="nodes of the --slurm script")
    p.epilog = ("Any config field can be set as --section.field VALUE, e.g. --layout.dp 2 --train.lr 1e-3; "
                "sections: model, layout, train, data, log.")


def parse_overrides(extra: list[str]) -> dict[str, str]:
    """`["--layout.dp", "2", "--train.lr=1e-3"]` -> `{"layout.dp": "2", "train.lr": "1e-3"}`."""
    out: dict[str, str] = {}
    i = 0
    while i < len(extra):
        arg = extra[i]
        if not arg.startswith("--") or "." not in arg.split("=")[0]:
            raise ConfigError(
                f"unrecognized argument {arg!r}; config fields are given as --section.field VALUE "
                "(e.g. --layout.dp 2); see `fivefold train --help`"
            )
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(extra):
                raise ConfigError(f"{arg} needs a value")
            value = extra[i + 1]
            i += 1
        out[key] = value
        i += 1
    return out


def resolve_config(args: argparse.Namespace):
    from fivefold.train.loop import load_run_config

    overrides = parse_overrides(args.overrides)
    if args.preset:
        overrides["model.preset"] = args.preset
    if args.data:
        overrides["data.path"] = args.data
    if args.max_steps is not None:
        overrides["train.max_steps"] = str(args.max_steps)
    if args.profile:
        overrides["log.profile"] = "true"
    if args.resume:
        if not args.run_dir:
            raise CliError("--resume needs --run-dir: the run to continue")
        if "model.preset" in overrides:
            raise CliError("--resume continues the run's own model; drop --preset/--model.preset")
        cfg = load_run_config(Path(args.run_dir), overrides, args.config)
    else:
        cfg = build_config(args.config, overrides)
        if args.hf:
            from fivefold.models.hf import model_config_from_hf

            cfg.model = model_config_from_hf(Path(args.hf) / "config.json")
    if args.run_dir:
        cfg.run_dir = args.run_dir
    elif not args.resume and "run_dir" not in overrides:
        cfg.run_dir = f"runs/{cfg.model.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    return cfg


def local_world_size(nproc: int) -> int:
    """Processes of a local run: those of the group a launcher started this one in, else the `nproc` to start."""
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    return launched if launched > 1 else max(nproc, 1)


def check_layout(cfg: Config, world: int) -> None:
    """Every layout error before any process or process group exists (parallel code imported only when needed)."""
    if world > 1 or cfg.layout.world_size > 1:
        from fivefold.parallel import validate_layout

        validate_layout(cfg, world)


def start_or_join(cfg: Config, nproc: int, argv: list[str], verb: str) -> int | None:
    """Outside a launcher with `nproc` > 1: run `fivefold VERB ARGV` on `nproc` local processes and return their
    exit status. In a process a launcher started: join its process group and return None, as on one process
    (the caller goes on)."""
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if nproc > 1 and not launched:
        from fivefold.parallel import launch

        return launch(nproc, argv, verb=verb)
    if launched:
        from fivefold.parallel import init_distributed
        from fivefold.train.engine import resolve_device

        init_distributed(resolve_device(cfg.train.device).type, cfg.train.collective_timeout_s)
    return None


def run(args: argparse.Namespace) -> int:
    from fivefold.train import preflight
    from fivefold.train.loop import RunDirError, train

    preflight.check_nproc(args.nproc, args.nodes)
    if args.hf:
        preflight.check_hf_dir(args.hf)
    if args.resume and args.run_dir:
        preflight.check_run_dir_writable(Path(args.run_dir), resume=True)
    try:
        cfg = resolve_config(args)
    except RunDirError as e:
        raise CliError(str(e)) from None
    cfg.validate()  # every config error before any process starts
    check_layout(cfg, args.nodes * args.nproc if args.slurm else local_world_size(args.nproc))
    if args.slurm:
        from fivefold.parallel import write_slurm_script

        path = write_slurm_script(args.slurm, forwarded_argv(args, cfg.run_dir), args.nodes, args.nproc)
        print(f"wrote {path}: {args.nodes} node(s) x {args.nproc} processes; submit it with `sbatch {path}`")
        return 0
    check_start(cfg, args.nproc, resume=args.resume)
    # every process must agree on the run directory
    status = start_or_join(cfg, args.nproc, forwarded_argv(args, cfg.run_dir), "train")
    if status is not None:
        return status
    try:
        from fivefold.train.checkpoint import CheckpointError

        train(cfg, resume=args.resume, hf_init=Path(args.hf) if args.hf else None)
    except (RunDirError, CheckpointError) as e:
        raise CliError(str(e)) from None
    return 0


def check_start(cfg: Config, nproc: int, resume: bool = False, run_dir: bool = True, warn: bool = True) -> None:
    """What this machine must offer the run (the device, its memory, the optional packages, a writable run
    directory), checked once by the process the user started, before anything is written; then warnings for
    settings that work but were probably not meant."""
    import sys

    from fivefold.train import preflight

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # a started worker: its launcher checked
        return
    device = preflight.check_device(cfg.train.device)
    preflight.check_extras(cfg)
    preflight.check_memory(cfg, device, nproc)
    if run_dir:
        preflight.check_run_dir_writable(Path(cfg.run_dir), resume)
    for line in preflight.warnings(cfg, device) if warn else []:
        print(f"fivefold: warning: {line}", file=sys.stderr)


def forwarded_argv(args: argparse.Namespace, run_dir: str) -> list[str]:
    """The arguments that each started process gets: this command's, without --nproc/--slurm/--nodes, and
    with the resolved run directory."""
    out = []
    for flag, value in (("--config", args.config), ("--preset", args.preset), ("--data", args.data),
                        ("--max-steps", args.max_steps), ("--hf", args.hf)):
        if value is not None:
            out += [flag, str(value)]
    out += ["--run-dir", run_dir]
    out += ["--resume"] * args.resume + ["--profile"] * args.profile
    return out + list(args.overrides)
