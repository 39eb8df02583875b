"""`fivefold train`: short flags for the everyday fields, `--section.field value` for any other."""

from __future__ import annotations

import argparse
import errno
import os
import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from fivefold.config import Config, build_config, check_device_name, load_file, parse_overrides, shown
from fivefold.errors import CliError, EnvironmentFailure
from fivefold.outputs import check_target, keep_previous

if TYPE_CHECKING:
    from fivefold.planner.hardware import Cluster
    from fivefold.planner.search import Estimate
    from fivefold.train.expect import Expectation

ACCEPTS_OVERRIDES = True
SLURM_TIME = "24:00:00"  # --time's default


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
    p.add_argument("--nodes", type=int, default=1, help="nodes of the --slurm script (and of --dry-run's plan)")
    p.add_argument("--time", default=SLURM_TIME, help="--slurm: the job's time limit, HH:MM:SS or D-HH:MM:SS "
                   "(default 24:00:00)")
    p.add_argument("--partition", help="--slurm: the partition to submit to")
    p.add_argument("--account", help="--slurm: the account to charge")
    p.add_argument("--setup", metavar="FILE", help="--slurm: a shell file sourced on every node before training "
                   "(modules, virtual environment, NCCL settings)")
    p.add_argument("--dry-run", action="store_true",
                   help="validate the config and the layout and print the run and the planner's prediction for "
                   "it, without starting any process")
    p.add_argument("--only-rank", type=int, metavar="K",
                   help="run only rank K of the layout, alone on this machine's device at full size, every other "
                   "rank stood in for; print its peak memory and step time beside the planner's (docs/only-rank.md)")
    p.add_argument("--json", action="store_true", help="--only-rank: print one JSON object")
    p.add_argument("--gpu", help="--dry-run: the planner's hardware preset for the prediction (default: the device "
                   "the run will use, train.device; auto picks this machine's); see `fivefold plan --help`")
    p.add_argument("--hardware", metavar="FILE",
                   help="a hardware profile of the device the run uses (e.g. what `fivefold calibrate --out FILE` "
                        "measured on this machine), for the planner's prediction that the run is checked against: "
                        "the start-up check, the plan check of the run, --only-rank and --dry-run (default: the "
                        "built-in profile of that kind of device)")
    p.epilog = ("Any config field can be set as --section.field VALUE, e.g. --layout.dp 2 --train.lr 1e-3; "
                "sections: model, layout, train, data, log.")


def resolve_config(args: argparse.Namespace):
    from fivefold.train.loop import load_run_config

    overrides = parse_overrides(args.overrides)
    for flag, key, value in (("--preset", "model.preset", args.preset), ("--data", "data.path", args.data),
                             ("--max-steps", "train.max_steps", args.max_steps)):
        if value is None:
            continue
        if key in overrides and overrides[key] != str(value):  # two spellings of one field: say which, not pick
            raise CliError(f"{flag} {shown(str(value))} and --{key} {shown(overrides[key])} set the same field "
                           "differently; give one of them")
        overrides[key] = str(value)
    if args.profile:
        overrides["log.profile"] = "true"
    if args.resume:
        if not args.run_dir:
            raise CliError("--resume needs --run-dir: the run to continue")
        if "model.preset" in overrides:
            raise CliError("--resume continues the run's own model; drop --preset/--model.preset")
        if args.slurm and not (Path(args.run_dir) / "config.toml").is_file():
            # a script to resume a run that an earlier job will start: checked against the given config
            cfg = build_config(args.config, overrides)
        else:
            cfg = load_run_config(Path(args.run_dir), overrides, args.config)
    else:
        cfg = build_config(args.config, overrides)
        if args.hf:
            from fivefold.models.hf import model_config_from_hf

            cfg.model = hf_model(cfg.model, model_config_from_hf(Path(args.hf) / "config.json"), args, overrides)
    if args.run_dir:
        cfg.run_dir = args.run_dir
    elif not args.resume and "run_dir" not in overrides and not (args.config and "run_dir" in load_file(args.config)):
        cfg.run_dir = f"runs/{cfg.model.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    return cfg


# model fields that the training engine chooses, not the weights: a user's value applies on top of --hf's model
ENGINE_MODEL_FIELDS = ("attn_mask", "fp32_residual", "moe_impl", "aux_loss", "aux_loss_coef", "router_z_loss_coef",
                       "bias_update_rate", "capacity_factor")


def hf_model(given, hf, args: argparse.Namespace, overrides: dict[str, str]):
    """--hf's model config, with the engine's choices that the user gave (`ENGINE_MODEL_FIELDS`); a CliError for any
    other model field given (on the command line or in --config's [model]) that differs from the checkpoint's: the
    weights fix it, and dropping it without a word would train another model than the one asked for."""
    named = {key.removeprefix("model."): f"--{key}" for key in overrides if key.startswith("model.")}
    if args.config:
        named.update({key: f"[model] {key} in {args.config}" for key in load_file(args.config).get("model", {})
                      if key not in named})
    if "preset" in named:
        raise CliError(f"{named['preset']} and --hf {shown(args.hf)} both give the model; drop the preset (--hf's "
                       "config.json is the model)")
    for key, where in named.items():
        if key in ENGINE_MODEL_FIELDS:
            setattr(hf, key, getattr(given, key))
        elif key != "name" and getattr(given, key) != getattr(hf, key):
            raise CliError(f"{where} = {shown(getattr(given, key))}, but --hf {shown(args.hf)} has model.{key} = "
                           f"{shown(getattr(hf, key))}, which its weights fix; drop it (the engine's own choices "
                           f"apply on top: {', '.join(ENGINE_MODEL_FIELDS)})")
    return hf


def run(args: argparse.Namespace) -> int:
    from fivefold.launch import finish_distributed, local_world_size, start_or_join
    from fivefold.layout import check_layout, layout_notes
    from fivefold.train import preflight
    from fivefold.train.loop import RunDirError, train

    for flag in ("config", "preset", "data", "run_dir", "hf", "slurm", "setup", "gpu", "hardware"):
        if getattr(args, flag, None) == "":  # an empty value is not "left out": say so rather than use the default
            raise CliError(f"--{flag.replace('_', '-')} '' is empty; give a value, or leave the flag out")
    if args.only_rank is not None:
        refuse_with_only_rank(args)
    elif args.json:
        raise CliError("--json goes with --only-rank")
    if args.gpu and not args.dry_run:
        raise CliError(f"--gpu {shown(args.gpu)} names the device of --dry-run's prediction; a run trains on "
                       "train.device (auto: this machine's accelerator, else the CPU): add --dry-run, or drop --gpu")
    preflight.check_nproc(args.nproc, args.nodes)
    refuse_without_slurm(args)
    if args.hf:
        preflight.check_hf_dir(args.hf)
    if args.resume and args.run_dir and not args.slurm:  # a SLURM chain's resume script may precede the run
        preflight.check_run_dir_writable(Path(args.run_dir), resume=True)
    try:
        cfg = resolve_config(args)
    except RunDirError as e:
        raise CliError(str(e)) from None
    cfg.validate()  # every config error before any process starts
    if args.hardware:
        check_hardware_file(args, cfg)
    from fivefold.train.metrics import check_logging_backends

    check_logging_backends(cfg.log)
    if args.resume and not args.slurm and "WORLD_SIZE" not in os.environ:  # a started worker: its launcher checked
        from fivefold.train.checkpoint import CheckpointError
        from fivefold.train.loop import check_resume

        try:  # what the checkpoint's small files decide, before data, engine and weights
            check_resume(cfg)
        except (RunDirError, CheckpointError) as e:
            raise CliError(str(e)) from None
    if args.only_rank is not None:
        return only_rank(cfg, args)
    if args.dry_run:
        return dry_run(cfg, args)
    check_layout(cfg, args.nodes * args.nproc if args.slurm else local_world_size(args.nproc))
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:  # the process the user started says it, not each rank
        for line in layout_notes(cfg.model, cfg.layout):
            print(f"fivefold: note: {line}", file=sys.stderr)
    if not args.slurm and not args.hf and local_world_size(args.nproc) > 1 and "WORLD_SIZE" not in os.environ:
        from fivefold.train.loop import check_data_vocabulary

        check_data_vocabulary(cfg)  # once, before the processes start (each then checks every shard)
    if args.slurm:
        from fivefold.launch import write_slurm_script
        check_target(args.slurm, "--slurm", "train.sbatch")  # a file name in a writable, existing directory

        if args.nodes < 1 or args.nproc < 1:
            raise CliError(f"--nodes = {args.nodes} and --nproc = {args.nproc} must both be >= 1")
        check_slurm_time(args.time)
        if args.setup and not Path(args.setup).is_file():
            raise CliError(f"--setup {shown(args.setup)} is not a file; give the shell file to source on every node "
                           "(module loads, `source venv/bin/activate`, NCCL settings)")
        if (backup := keep_previous(args.slurm)) is not None:  # a script there (perhaps edited) is kept
            print(f"kept the previous {args.slurm} as {backup}")
        path = write_slurm_script(args.slurm, forwarded_argv(args, cfg.run_dir), args.nodes, args.nproc,
                                  time_limit=args.time, partition=args.partition, account=args.account,
                                  setup=str(Path(args.setup).resolve()) if args.setup else None,
                                  gpus=cfg.train.device != "cpu")  # a CPU run's job asks for no GPU
        print(f"wrote {path}: {args.nodes} node(s) x {args.nproc} processes, time limit {args.time}; submit it "
              f"with `sbatch {path}`")
        return 0
    device = preflight.check_start(cfg, resume=args.resume)
    if device is not None:  # the process the user started: the planner's prediction on the device the run uses
        from fivefold.planner.predict import check_fits, device_cluster

        e = check_fits(cfg, hardware := device_cluster(device, args.nproc, args.hardware), device.type)
        lines = preflight.warnings(cfg, device, e.step_time_s)
        if threads := profile_threads(cfg, hardware, local_world_size(args.nproc)):
            lines.append(threads)
        for line in lines:
            print(f"fivefold: warning: {line}", file=sys.stderr)
    from fivefold.faults import SaveAbandoned, held_by_parent
    from fivefold.train.checkpoint import CheckpointError, CheckpointWriteError
    from fivefold.train.loop import abandoned_message

    try:  # every process must agree on the run directory; the launcher (or the one process) owns it
        status = start_or_join(cfg, args.nproc, forwarded_argv(args, cfg.run_dir), "train")
        if status is not None:
            return status
        # the estimate made above, in the one process of a one-process run; made again on rank 0 of a job
        expected = (plan_expectation(cfg, local_world_size(args.nproc), args.hardware)
                    if device is None or args.nproc > 1
                    else expectation(e, hardware))
        result = train(cfg, resume=args.resume, hf_init=Path(args.hf) if args.hf else None, expected=expected)
    except CheckpointWriteError as e:
        raise EnvironmentFailure(str(e) if e.own else "") from None
    except (RunDirError, CheckpointError) as e:
        raise CliError(str(e)) from None
    except SaveAbandoned as e:  # said once: by the launcher, the one process, or rank 0 of a torchrun job
        if int(os.environ.get("RANK", "0")) == 0 and not held_by_parent(cfg.run_dir):
            print(abandoned_message(Path(cfg.run_dir), e.name, local_world_size(args.nproc)), file=sys.stderr)
        return 128 + e.signum
    except (OSError, RuntimeError) as e:
        raise environment_failure(e, Path(cfg.run_dir), args.nproc) from None
    finish_distributed()
    return result.exit_code  # 3 after a streak of non-finite steps, 128 + N when signal N stopped it


def plan_expectation(cfg: Config, local_ranks: int, hardware_file: str | None = None) -> Expectation | None:
    """The planner's prediction of this run on the device it uses (`hardware_file`'s profile where given), for the
    logging rank to check the run against (`train.expect`); None on the other ranks."""
    from fivefold.device import resolve_device
    from fivefold.planner.predict import device_cluster, estimate_run

    if int(os.environ.get("RANK", "0")) != 0:
        return None
    device = resolve_device(cfg.train.device)
    hardware = device_cluster(device, local_ranks, hardware_file)
    return expectation(estimate_run(cfg, hardware, device.type), hardware)


def expectation(e: Estimate, hardware: Cluster) -> Expectation:
    """`Expectation` of the planner's estimate `e` on `hardware`: the most loaded rank's memory as a run measures it."""
    from fivefold.planner.predict import engine_parts
    from fivefold.train.expect import Expectation

    return Expectation(hardware.name, e.step_time_s, e.peak_bytes, engine_parts(e.peak_rank[1]))


ENVIRONMENT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO}
PEER_LOST = ("connection", "gloo", "nccl", "timed out", "timeout", "closed", "reset by peer", "broken pipe")


def environment_failure(e: OSError | RuntimeError, run_dir: Path, nproc: int) -> BaseException:
    """An OS error of the machine (no space, a read-only or forbidden path) or a lost rank (a collective whose peer
    died) as one line: what failed, where, what is safe on disk and how to continue. Any other error is returned
    as it is (a bug: its traceback)."""
    import torch.distributed as dist

    from fivefold.train.checkpoint import describe_os_error, latest_checkpoint

    if isinstance(e, OSError) and e.errno in ENVIRONMENT_ERRNOS:
        what = describe_os_error(e)
    elif (isinstance(e, RuntimeError) and dist.is_initialized() and dist.get_world_size() > 1
          and any(k in str(e).lower() for k in PEER_LOST)):
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        what = f"rank {dist.get_rank()} lost another rank in a collective ({shown(first)})"
    else:
        return e
    newest = latest_checkpoint(run_dir)
    safe = f"the newest complete checkpoint, {newest}, is intact" if newest else "no checkpoint was written yet"
    nprocs = f" --nproc {nproc}" if nproc > 1 else ""
    return EnvironmentFailure(f"{what}; {safe}; once the cause is fixed, continue with `fivefold train --resume "
                              f"--run-dir {run_dir}{nprocs}`", peer=not isinstance(e, OSError))


def refuse_without_slurm(args: argparse.Namespace) -> None:
    """The options of the --slurm script, refused without it rather than ignored: a run started here has no time
    limit, partition, account or set-up file of a job, and trains on this node alone (--nodes also sizes
    --dry-run's prediction)."""
    if args.slurm:
        return
    for flag, value in (("--time", args.time if args.time != SLURM_TIME else None), ("--partition", args.partition),
                        ("--account", args.account), ("--setup", args.setup)):
        if value is not None:
            raise CliError(f"{flag} {shown(value)} goes into the job that --slurm FILE writes; a run started here "
                           f"is no SLURM job and would ignore it: add --slurm FILE, or drop {flag}")
    if args.nodes > 1 and not args.dry_run and args.only_rank is None:
        raise CliError(f"--nodes {args.nodes} sets the nodes of the job that --slurm FILE writes (and of --dry-run's "
                       "prediction); a run started here trains on this node alone: add --slurm FILE, start each "
                       "node's processes with torchrun, or drop --nodes")


def refuse_with_only_rank(args: argparse.Namespace) -> None:
    """The flags --only-rank cannot take, refused by name before anything runs."""
    from fivefold.tools.only_rank import in_launcher

    for flag, given in (("--resume", args.resume), ("--hf", args.hf), ("--slurm", args.slurm),
                        ("--dry-run", args.dry_run), ("--profile", args.profile), ("--nproc", args.nproc > 1),
                        ("--nodes", args.nodes > 1)):
        if given:
            raise CliError(f"--only-rank runs one rank alone with meaningless values and writes nothing, so it does "
                           f"not take {flag}; drop {flag} (or --only-rank)")
    if in_launcher():
        raise CliError("--only-rank runs one process on its own; start it without torchrun or --nproc")


def only_rank(cfg: Config, args: argparse.Namespace) -> int:
    """`--only-rank K`: rank K of the layout alone (`fivefold.tools.only_rank`)."""
    from fivefold.layout import check_layout
    from fivefold.tools.only_rank import check_rank, run_only_rank

    check_layout(cfg, cfg.layout.world_size)
    check_rank(cfg, args.only_rank)
    return run_only_rank(cfg, args.only_rank, as_json=args.json, hardware_file=args.hardware)


def profile_threads(cfg: Config, hardware: Cluster, local_ranks: int) -> str | None:
    """A CPU profile measured with other intra-op threads per rank than this run's (`train.threads`, or the cores'
    share of its `local_ranks` processes): its times are for those threads, not this run's. None for a profile
    that states no threads (the built-in ones) or an accelerator's."""
    from fivefold.train.loop import threads_per_process

    measured = hardware.on_node(local_ranks).threads_per_rank
    runs = threads_per_process(cfg.train.threads, local_ranks)
    if not hardware.is_cpu or not measured or measured == runs:
        return None
    why = f"train.threads = {cfg.train.threads}" if cfg.train.threads else (
        f"train.threads = 0: the cores' share of {local_ranks} process(es)")
    return (f"the {hardware.name} profile was measured with {measured} intra-op thread(s) per rank with "
            f"{local_ranks} rank(s) on the machine, and this run uses {runs} ({why}): its predicted times are for "
            f"{measured}; `fivefold calibrate --threads {runs}` measures a profile for this run, or set "
            f"--train.threads {measured}")


def check_hardware_file(args: argparse.Namespace, cfg: Config) -> None:
    """`--hardware FILE`, read and checked before any work: a profile the planner reads (`fivefold plan
    --hardware`), of the kind of device the run uses (a CPU's profile for a run on the CPU, an accelerator's for one
    on an accelerator), and not beside --gpu, which names a preset for the same prediction."""
    from fivefold.device import resolve_device
    from fivefold.planner.hardware import get_cluster

    if args.gpu:
        raise CliError(f"--gpu {shown(args.gpu)} and --hardware {shown(args.hardware)} both name the profile of the "
                       "prediction; give one")
    hw = get_cluster(None, args.hardware)  # a ConfigError names the file and the field
    given = cfg.train.device
    if args.slurm and given == "auto":  # the compute nodes' device, which this machine cannot see
        return
    device = given if (args.dry_run or args.slurm) and given != "auto" else resolve_device(given).type
    if hw.is_cpu != (device == "cpu"):
        raise CliError(f"--hardware {shown(args.hardware)} describes {'a CPU' if hw.is_cpu else 'an accelerator'} "
                       f"({hw.name}), but the run uses train.device = {shown(given)}"
                       f"{f' ({device})' if given == 'auto' else ''}; give a profile of that device "
                       "(`fivefold calibrate --out FILE` measures this machine's), or leave --hardware out")


_SLURM_TIME = re.compile(r"^(?:(\d+)-)?(\d{1,3}):([0-5]\d):([0-5]\d)$")


def check_slurm_time(value: str) -> None:
    match = _SLURM_TIME.match(value)
    if not match or (match[1] is not None and int(match[2]) > 23):  # minutes and seconds < 60; hours < 24 after days
        raise CliError(f"--time {shown(value)} is not a SLURM time limit; use HH:MM:SS or D-HH:MM:SS, e.g. 48:00:00 or "
                       "2-00:00:00")


def dry_run(cfg: Config, args: argparse.Namespace) -> int:
    """Validate `cfg` for its layout's world size and print what the run would do and the planner's prediction."""
    from fivefold.device import resolve_device
    from fivefold.flops import count_params
    from fivefold.launch import local_world_size
    from fivefold.layout import check_layout, layout_notes
    from fivefold.planner.hardware import get_cluster
    from fivefold.planner.predict import default_hardware, estimate_run, run_framework, with_device_memory
    from fivefold.train.preflight import rough_duration

    la, t = cfg.layout, cfg.train
    world = la.world_size
    # the processes this command would start (more than one: as the run itself checks them), else the layout's own
    started = args.nodes * args.nproc if args.slurm else local_world_size(args.nproc)
    check_layout(cfg, started if started > 1 else world)
    check_dry_run_files(cfg, args)
    notes = layout_notes(cfg.model, cfg.layout)
    hsdp = f", HSDP: {la.zero_replicas} replicas of shard groups of {la.zero_group}" if la.dp_shard else ""
    print(f"config OK: {cfg.model.name} ({count_params(cfg.model):,} parameters), layout dp {la.dp} x tp {la.tp} x "
          f"pp {la.pp} x cp {la.cp} (ep {la.ep}, zero {la.zero}{hsdp}) = {world} processes; global batch "
          f"{t.global_batch_size} x {t.seq_len} = {t.global_batch_size * t.seq_len:,} tokens per step, micro-batch "
          f"{cfg.micro_batch_size}, accumulation {cfg.grad_accum_steps}; {t.max_steps:,} steps = "
          f"{t.max_steps * t.global_batch_size * t.seq_len:,} tokens; lr {t.lr:g} ({t.lr_schedule}, warm-up "
          f"{t.warmup_steps} steps); run dir {cfg.run_dir}")
    for line in notes:
        print(f"note: {line}")
    if cfg.data.path and not Path(cfg.data.path).exists():
        print(f"note: data.path = {shown(cfg.data.path)} does not exist yet; prepare it with `fivefold data "
              f"prepare FILES "
              "--tokenizer MODEL_DIR --out DIR` before training")
    # the device the run will use (`train.device`, `auto`: this machine's), unless --gpu names another
    check_device_name(t.device)
    device = resolve_device(t.device)
    hw = (get_cluster(args.gpu) if args.gpu else get_cluster(None, args.hardware) if args.hardware
          else default_hardware(device.type))
    if not args.gpu and not args.slurm:  # this machine runs it: its device's memory, as the start-up check sees it
        hw = with_device_memory(hw, device, world)  # on a CPU the run's processes share its RAM
    kind = "cpu" if hw.is_cpu else "accelerator"  # the kind of device the profile describes
    fw, e = run_framework(cfg, kind), estimate_run(cfg, hw, kind)
    step_s = e.step_time_s
    features = ", compiled" * t.compile + (f", float8 {t.float8}" if t.float8 != "off" else "")
    print(f"planner ({hw.name}, {fw.name} engine{features}): "
          f"{'fits' if e.fits else 'does NOT fit'}, peak "
          f"{e.peak_bytes / 2**30:.1f} GiB of {hw.memory_gib:,.1f} GiB per device; step {step_s:.2f} s, "
          f"{e.tokens_per_s_per_device:,.0f} tokens/s per device, MFU {100 * e.mfu:.1f} %; {t.max_steps:,} steps "
          f"take about {rough_duration(step_s * t.max_steps)}")
    if hw.is_cpu:  # processes, not devices: the ones this command names (--slurm's nodes), else all on this node
        nodes, per_node = (args.nodes, args.nproc) if args.slurm else (1, world)
    else:
        nodes = max(1, world // hw.gpus_per_node) if world > hw.gpus_per_node else 1
        per_node = min(world, hw.gpus_per_node)
    from fivefold.train.recipes import launch_lines

    print("launch:")  # this command's own arguments (its --resume, overrides and all), as the launcher forwards them
    for line in launch_lines(forwarded_argv(args, cfg.run_dir), nodes, per_node):
        print(f"  {line}")
    return 0 if e.fits else 1


def check_dry_run_files(cfg: Config, args: argparse.Namespace) -> None:
    """What the run would refuse at its start and --dry-run can see without starting it: a run directory that
    holds another run or other files (a new run), and data that is there but no prepared directory, or whose
    vocabulary the model lacks (data not prepared yet is a note: a config written for later, `plan
    --write-config`'s). A resume was checked against its checkpoints before (`check_resume`)."""
    from fivefold.train.loop import RunDirError, check_data_vocabulary, check_run_dir, configured_data

    if not args.resume:
        if Path(cfg.run_dir).exists() and not Path(cfg.run_dir).is_dir():
            raise CliError(f"--run-dir {shown(cfg.run_dir)} is a file, not a directory; choose a new or empty "
                           "directory")
        try:
            check_run_dir(Path(cfg.run_dir), resume=False)
        except RunDirError as e:
            raise CliError(str(e)) from None
    if cfg.data.path and not Path(cfg.data.path).exists():
        return
    if args.hf:  # the data's vocabulary is checked against the Hugging Face model's when the run starts
        configured_data(cfg)
    else:
        check_data_vocabulary(cfg)


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
    out += ["--hardware", str(Path(args.hardware).resolve())] if args.hardware else []
    return out + list(args.overrides)
