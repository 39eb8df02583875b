"""`fivefold train --only-rank K`: rank K of the configured layout, alone, at full size, on this machine's device.

The world is started with the stand-in process group (`fivefold.parallel.standin`): the engine sees rank K of
N ranks and builds exactly what rank K builds in the real run (its model part, its shards of the weights,
gradients and optimizer state, its pipeline stages and schedule, recompute and compile) and steps on rank K's
rows of each global batch; every collective and point-to-point is answered locally with tensors of the right
shapes and dtypes. The values mean nothing, so MoE routing is forced to balance (`models.llama.force_balanced_
routing`), no checkpoint, metrics file or run directory is written, and a non-finite step does not stop the run
(the engine skips its update as usual).

Per logged step and at the end it prints the peak memory (allocated and reserved on an accelerator, the peak
resident set on the CPU), the step's time, and the planner's prediction for that rank beside each: the state
bytes by part (parameters, gradients, optimizer), the rest of the peak (activations and buffers), and the
compute time (the planner's compute plus optimizer step: what one process does when no rank waits for
another), with the differences. `--json` prints one JSON object instead. docs/only-rank.md shows an example.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import TextIO

import torch
import torch.distributed as dist

from fivefold.config import Config, ConfigError, shown
from fivefold.device import resolve_device
from fivefold.parallel.mesh import coordinates, expert_groups
from fivefold.train.metrics import peak_memory, planned_peak

__all__ = ["measure_rank", "planner_for_rank", "rank_description", "run_only_rank"]

MIB = 2**20


def check_rank(cfg: Config, rank: int) -> None:
    """Refuse a rank outside the layout's world, naming the valid ones."""
    world = cfg.layout.world_size
    if not 0 <= rank < world:
        raise ConfigError(f"--only-rank {rank}: the layout dp {cfg.layout.dp} x tp {cfg.layout.tp} x pp "
                          f"{cfg.layout.pp} x cp {cfg.layout.cp} has {world} rank{'s' if world > 1 else ''}; give "
                          + (f"a rank 0 .. {world - 1}" if world > 1 else "rank 0 (or set a layout with more ranks)"))


def rank_description(cfg: Config, rank: int) -> dict:
    """Rank `rank`'s coordinates, its ep rank, and which pipeline rank the planner predicts it as."""
    la = cfg.layout
    c = coordinates(la, rank)
    ep_block = next(block for block in expert_groups(la)[0] if rank in block)
    pp = c["pp"]
    planner_rank = "first" if pp == 0 else "last" if pp == la.pp - 1 else "first"
    return {**c, "ep": ep_block.index(rank), "world_size": la.world_size, "planner_rank": planner_rank,
            "planner_rank_exact": pp in (0, la.pp - 1)}


def planner_for_rank(cfg: Config, rank: int, device_type: str, hardware_file: str | None = None) -> dict:
    """The planner's prediction for rank `rank` of `cfg` on this kind of device: memory by part (the first or the
    last pipeline rank's: the planner models those two, so a middle pipeline rank is compared with the first, and
    `rank_description` says so) and the time one process computes (compute, host waits and the optimizer step), on
    `hardware_file`'s profile where given (`fivefold train --hardware`), else the device's built-in one."""
    from fivefold.planner.predict import engine_parts, estimate_run, load_hardware, on_one_node

    # (the planner splits the blocks over pipeline stages at the run's sequence length, as the engine does)
    hw = on_one_node(load_hardware(hardware_file, device_type), cfg.layout.world_size)
    e = estimate_run(cfg, hw, device_type)
    which = rank_description(cfg, rank)["planner_rank"]
    parts = engine_parts(e.memory[which] if which in e.memory else e.memory["first"])
    t = e.time_parts
    compute = t.get("compute", 0.0) + t.get("host_wait", 0.0) + t.get("optimizer", 0.0)
    return {"hardware": hw.name, "pipeline_rank": which, "memory_bytes": parts,
            "peak_bytes": sum(parts.values()), "compute_s": compute,
            "step_s": e.step_time_s, "time_s": dict(t)}


# --- measuring ---------------------------------------------------------------------------------------------


def rank_batches(cfg: Config, engine, notes: list[str]):
    """A function of the step giving this rank's (inputs, targets) rows: from the configured dataset (or the built-in
    corpus) as the real run samples them, else random token ids of the same shape."""
    from fivefold.data import BatchSampler, TokenDataset, default_cache_dir, ensure_builtin_dataset

    t = cfg.train
    path = Path(cfg.data.path) if cfg.data.path else None
    if path is None:
        path = ensure_builtin_dataset(default_cache_dir(), val_fraction=cfg.data.val_fraction)
    if path.is_dir():
        dataset = TokenDataset(path, "train")
        if dataset.vocab_size <= cfg.model.vocab_size and (cfg.model.attn_mask != "document"
                                                           or dataset.eos_id is not None):
            sampler = BatchSampler(dataset, t.seq_len, t.global_batch_size, t.seed)
            engine.eos_id = dataset.eos_id if cfg.model.attn_mask == "document" else None
            return lambda step: sampler.rank_batch(step, engine.dp_rank, engine.dp_size)
        notes.append(f"data: random token ids ({path} has {dataset.vocab_size} ids, more than model.vocab_size)")
    else:
        notes.append(f"data: random token ids (data.path = {shown(cfg.data.path)} is not a prepared dataset)")
    rows = t.global_batch_size // engine.dp_size
    if cfg.model.attn_mask == "document":  # random ids have no documents: token 0 stands for the boundary
        engine.eos_id = 0
        notes.append("data: document boundaries at token id 0 of the random ids")

    def random_rows(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(t.seed * 1_000_003 + step * 1009 + engine.dp_rank)
        tokens = torch.randint(0, cfg.model.vocab_size, (rows, t.seq_len + 1), generator=g)
        return tokens[:, :-1], tokens[:, 1:]

    return random_rows


def measure_rank(cfg: Config, rank: int, steps: int | None = None, on_step=None) -> dict:
    """Build and step rank `rank` of `cfg` alone (the stand-in world must not be started yet). Returns what was
    measured: per step its seconds and peak memory, the state bytes held, the engine's parameter count.

    One stand-in world per process: PyTorch's `DeviceMesh` keeps the group names of a mesh it built (HSDP's 2D
    mesh) past `destroy_process_group`, so a second world in the same process may look up the first world's
    names. The command line measures one rank per process, and `plan --measure` starts a process per rank."""
    from fivefold.parallel.standin import init_standin
    from fivefold.train.loop import threads_per_process

    check_rank(cfg, rank)
    device = resolve_device(cfg.train.device)
    torch.set_num_threads(threads_per_process(cfg.train.threads, 1))
    init_standin(rank, cfg.layout.world_size)
    try:
        return _measure(cfg, rank, device, steps, on_step)
    finally:
        dist.destroy_process_group()


def _measure(cfg: Config, rank: int, device: torch.device, steps: int | None, on_step) -> dict:
    from fivefold.models.llama import force_balanced_routing
    from fivefold.train.build import build_engine
    from fivefold.train.loop import split_micro_batches
    from fivefold.train.metrics import memory_baseline, synchronize

    t = cfg.train
    baseline = memory_baseline(device)  # on the CPU the peak is compared with the planner's above it
    start = time.perf_counter()
    engine = build_engine(cfg, device)
    balanced = force_balanced_routing(engine.model)
    synchronize(device)
    build_s = time.perf_counter() - start
    notes: list[str] = []
    batch_of = rank_batches(cfg, engine, notes)
    records, held = [], {}
    mbs, global_tokens = cfg.micro_batch_size, t.global_batch_size * t.seq_len
    for step in range(steps or t.max_steps):
        inputs, targets = batch_of(step)
        start = time.perf_counter()
        engine.set_lr(step)
        loss_sum = engine.forward_backward(split_micro_batches(inputs, targets, mbs, device), global_tokens)
        held = engine.state_bytes()  # the gradients exist until the optimizer step
        engine.optimizer_step(loss_sum)
        synchronize(device)
        record = {"step": step + 1, "seconds": time.perf_counter() - start, "peak": peak_memory(device, baseline)}
        records.append(record)
        if on_step is not None:
            on_step(record)
    held["optimizer"] = engine.state_bytes()["optimizer"]  # the moments exist after the first step
    return {"rank": rank, "device": str(device), "build_s": build_s, "steps": records, "held_bytes": held,
            "parameters_on_rank": sum(p.numel() for p in engine.parameters()), "moe_layers_balanced": balanced,
            "notes": notes}


# --- reporting ---------------------------------------------------------------------------------------------


# the sign of every difference --only-rank prints (per step and in the summary): + = more than the planner predicted
DIFFERENCE = "measured / planner - 1"


def _diff(measured: float, predicted: float) -> str:
    if not predicted:
        return "n/a"
    return f"{100 * (measured - predicted) / predicted:+.1f} %"


def summary(cfg: Config, rank: int, measured: dict, predicted: dict) -> dict:
    """One JSON-able object: the rank, what was measured, the planner's prediction and the differences."""
    steps = measured["steps"]
    timed = steps[1:] or steps  # the first step warms up (and compiles)
    compute = sum(s["seconds"] for s in timed) / len(timed)
    peak = steps[-1]["peak"]
    held = measured["held_bytes"]
    peak_bytes = planned_peak(peak)
    pm = predicted["memory_bytes"]
    memory = {k: {"measured": held.get(k, 0), "predicted": pm[k]} for k in ("parameters", "gradients", "optimizer")}
    rest = peak_bytes - sum(held.get(k, 0) for k in ("parameters", "gradients", "optimizer"))
    memory["activations_and_buffers"] = {"measured": rest, "predicted": pm["activations"] + pm["buffers"]
                                         + pm.get("allocator_cache", 0.0)}
    memory["peak"] = {"measured": peak_bytes, "predicted": predicted["peak_bytes"]}
    for v in memory.values():
        v["difference"] = v["measured"] - v["predicted"]
    return {"rank": rank, "coordinates": rank_description(cfg, rank), "device": measured["device"],
            "peak_memory_bytes": peak, "memory_bytes": memory,
            "compute_s": {"measured": compute, "predicted": predicted["compute_s"],
                          "difference": compute - predicted["compute_s"]},
            "steps": steps, "build_s": measured["build_s"], "parameters_on_rank": measured["parameters_on_rank"],
            "planner": predicted, "notes": measured["notes"]}


def _step_line(record: dict, predicted: dict) -> str:
    peak = record["peak"]
    value = planned_peak(peak)
    what = ("allocated" if "allocated" in peak else "resident above the baseline" if "resident_above_baseline" in peak
            else "resident")
    reserved = f", {peak['reserved'] / MIB:,.0f} MiB reserved" if "reserved" in peak else ""
    return (f"step {record['step']}: {record['seconds']:.3f} s (planner's compute {predicted['compute_s']:.3f} s, "
            f"{_diff(record['seconds'], predicted['compute_s'])}); peak {value / MIB:,.0f} MiB {what}{reserved} "
            f"(planner {predicted['peak_bytes'] / MIB:,.0f} MiB, {_diff(value, predicted['peak_bytes'])})")


def print_summary(s: dict, out: TextIO) -> None:
    c = s["coordinates"]
    which = c["planner_rank"] + " pipeline rank" + ("" if c["planner_rank_exact"] else
                                                    " (the planner models the first and the last)")
    print(f"only-rank {s['rank']} of {c['world_size']} on {s['device']}: planner's prediction is for the {which}, "
          f"{s['planner']['hardware']} profile", file=out)
    print(f"  {'':30}{'measured':>14}{'planner':>14}{'difference':>14}  ({DIFFERENCE})", file=out)
    for part, v in s["memory_bytes"].items():
        name = part.replace("_", " ")
        print(f"  {name + ' (MiB)':30}{v['measured'] / MIB:>14,.1f}{v['predicted'] / MIB:>14,.1f}"
              f"{_diff(v['measured'], v['predicted']):>14}", file=out)
    t = s["compute_s"]
    print(f"  {'compute time (s)':30}{t['measured']:>14.3f}{t['predicted']:>14.3f}"
          f"{_diff(t['measured'], t['predicted']):>14}", file=out)
    if "reserved" in s["peak_memory_bytes"]:
        print(f"  peak reserved: {s['peak_memory_bytes']['reserved'] / MIB:,.1f} MiB", file=out)


def run_only_rank(cfg: Config, rank: int, as_json: bool = False, out: TextIO | None = None,
                  hardware_file: str | None = None) -> int:
    """`fivefold train --only-rank RANK [--json]`: measure, compare with the planner, print."""
    out = out or sys.stdout
    check_rank(cfg, rank)
    device_type = resolve_device(cfg.train.device).type
    predicted = planner_for_rank(cfg, rank, device_type, hardware_file)  # before any work: a wrong config fails here
    c = rank_description(cfg, rank)
    if not as_json:
        print(f"fivefold: only rank {rank} of {c['world_size']} (pp {c['pp']}, dp {c['dp']}, cp {c['cp']}, tp "
              f"{c['tp']}, ep {c['ep']}); every other rank stood in for, values meaningless, MoE routing "
              "balanced, nothing written", file=out)
    every = max(cfg.log.log_every, 1)

    def on_step(record: dict) -> None:
        if not as_json and (record["step"] % every == 0 or record["step"] in (1, cfg.train.max_steps)):
            print(_step_line(record, predicted), file=out, flush=True)

    measured = measure_rank(cfg, rank, on_step=on_step)
    s = summary(cfg, rank, measured, predicted)
    if as_json:
        print(json.dumps(s, default=str), file=out)
    else:
        for note in s["notes"]:
            print(f"note: {note}", file=out)
        print_summary(s, out)
    return 0


def in_launcher() -> bool:
    """Whether this process was started by a launcher (torchrun or `--nproc`)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


# --- `fivefold plan --measure`: the ranks that hold the most, each in a process of its own --------------------


def ranks_to_measure(cfg: Config) -> dict[int, str]:
    """{rank: what it holds} for the ranks that hold the most: the first pipeline stage's (the embedding; an expert
    rank under ep, as every ep rank holds as many experts) and the last stage's (the output layer and the loss)."""
    from fivefold.parallel.mesh import rank_of

    la = cfg.layout
    first = "first pipeline stage" if la.pp > 1 else "every rank's part"
    if la.ep > 1:
        first += f", ep rank 0 of {la.ep} (every ep rank holds {cfg.model.n_experts // la.ep} experts)"
    ranks = {0: first}
    if la.pp > 1:
        ranks[rank_of(la, la.pp - 1, 0, 0, 0)] = "last pipeline stage"
    return ranks


def measure_ranks(cfg: Config, steps: int, out: TextIO | None = None) -> list[dict]:
    """`fivefold train --only-rank K --json` of each rank of `ranks_to_measure`, each in a process of its own; their
    reports (`summary`), with `holds` added."""
    import subprocess
    import tempfile

    from fivefold.config import dump_toml

    out = out or sys.stdout
    reports = []
    with tempfile.TemporaryDirectory(prefix="fivefold-measure-") as tmp:
        path = Path(tmp) / "layout.toml"
        path.write_text(dump_toml(cfg))
        for rank, holds in ranks_to_measure(cfg).items():
            print(f"measuring rank {rank} ({holds}) alone: {steps} steps ...", file=out, flush=True)
            command = [sys.executable, "-m", "fivefold", "train", "--config", str(path), "--only-rank", str(rank),
                       "--json", "--max-steps", str(steps)]
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                raise ConfigError(f"fivefold train --only-rank {rank} failed (exit {done.returncode}):\n"
                                  + done.stderr[-4000:])
            report = json.loads(done.stdout.strip().splitlines()[-1])
            report["holds"] = holds
            reports.append(report)
    return reports


def print_measured(reports: list[dict], out: TextIO | None = None) -> None:
    """One line per measured rank: peak memory and compute time, measured beside the planner's, with the
    differences (the planner's prediction for the device that ran them)."""
    out = out or sys.stdout
    print(f"{'rank':>5} {'holds':34s} {'peak MiB':>10s} {'planner':>10s} {'diff':>9s} {'compute s':>10s} "
          f"{'planner':>9s} {'diff':>10s}", file=out)
    for r in reports:
        m, t = r["memory_bytes"]["peak"], r["compute_s"]
        print(f"{r['rank']:>5} {r['holds'][:34]:34s} {m['measured'] / MIB:>10,.1f} {m['predicted'] / MIB:>10,.1f} "
              f"{_diff(m['measured'], m['predicted']):>9s} {t['measured']:>10.3f} {t['predicted']:>9.3f} "
              f"{_diff(t['measured'], t['predicted']):>10s}", file=out)
    devices = sorted({r["device"] for r in reports})
    print(f"(measured on {', '.join(devices)}, each rank alone with the others stood in for; planner: its "
          f"{reports[0]['planner']['hardware']} profile of that device; per part: `fivefold train --only-rank K`)",
          file=out)
