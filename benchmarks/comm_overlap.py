"""What an overlap switch hides: the same `fivefold train` with the switch off and on, and `--only-rank 0` of the
same layout (every other rank stood in for: the rank's compute alone), side by side on the CPU (gloo).

Per case it prints the mean step time (steps 2 .. N, the first warms up) with the overlap off, on, the compute-only
time, the exposed communication (off - compute) and the share of it that the overlap hides ((off - on) / (off -
compute)). For a pipeline it also runs `--only-rank` of every rank and puts their compute through the schedule
(`schedules.simulate`, no transfer time), so that the schedule's bubble, which no overlap hides, is not counted as
communication, and prints the share hidden of what is exposed beyond compute and bubble. Cases (`--case`,
repeatable; default all):

    dp2-zero1   data parallel over 2 processes, ZeRO-1: `layout.dp_overlap_param_gather` (the updated parameters'
                all-gather under the next forward, bucket by bucket, against after the step)
    pp2-1f1b    a 2-stage 1F1B pipeline, 4 micro-batches: `layout.pp_comm_overlap` (receives waited for alone, a
                backward's input gradient sent before its weight gradients); here the exposed time holds the
                pipeline's bubble too, which no overlap hides
    pp2-dualpipev  the same switch under DualPipeV (the V of 4 stages on 2 processes, 4 micro-batches)
    pp2-tp2-dualpipev  the same switch under DualPipeV with tp2 in each stage (4 processes)
    pp2-tp2-dualpipev-fb  DualPipeV with tp2 in each stage (4 processes): `layout.pp_fb_overlap` (each F0B1 / F1B0
                pair as two lanes, one micro-batch's tensor-parallel all-reduces under the other's compute)
    pp2-tp2-sp-dualpipev-fb  the same with sequence parallel: the backward's lane also runs its W pass, whose
                input all-gathers then run under the forward's compute
    tp2-sp      tensor parallel over 2 processes with sequence parallel: `layout.tp_comm_overlap` (every
                all-gather and reduce-scatter of sequence parallel under a matmul that does not need it)

    PYTHONPATH=src python benchmarks/comm_overlap.py [--steps 6] [--case dp2-zero1] [-- train flags]

Default train flags: the 300M-parameter untied Llama of docs/benchmarks.md (4 blocks of smollm-1.7b, vocabulary
8192), sequence 128, global batch 4, one thread per process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from async_checkpoint import logged_step_seconds

DEFAULT = ["--preset", "smollm-1.7b", "--model.n_layers", "4", "--model.vocab_size", "8192",
           "--model.tied_embeddings", "false", "--train.seq_len", "128", "--train.global_batch_size", "4",
           "--train.threads", "1", "--train.eval_every", "0", "--train.eval_batches", "1", "--log.progress", "none",
           "--train.checkpoint_every", "0"]
# name -> (layout flags, the overlap switch's field)
CASES = {"dp2-zero1": (["--layout.dp", "2", "--layout.zero", "1"], "layout.dp_overlap_param_gather"),
         "pp2-1f1b": (["--layout.pp", "2", "--layout.schedule", "1f1b", "--layout.micro_batch_size", "1"],
                      "layout.pp_comm_overlap"),
         "pp2-dualpipev": (["--layout.pp", "2", "--layout.schedule", "dualpipev", "--layout.micro_batch_size", "1"],
                           "layout.pp_comm_overlap"),
         "pp2-tp2-dualpipev": (["--layout.pp", "2", "--layout.tp", "2", "--layout.schedule", "dualpipev",
                                "--layout.micro_batch_size", "1"], "layout.pp_comm_overlap"),
         "pp2-tp2-dualpipev-fb": (["--layout.pp", "2", "--layout.tp", "2", "--layout.schedule", "dualpipev",
                                   "--layout.micro_batch_size", "1"], "layout.pp_fb_overlap"),
         "pp2-tp2-sp-dualpipev-fb": (["--layout.pp", "2", "--layout.tp", "2", "--layout.sp", "true",
                                      "--layout.schedule", "dualpipev", "--layout.micro_batch_size", "1"],
                                     "layout.pp_fb_overlap"),
         "tp2-sp": (["--layout.tp", "2", "--layout.sp", "true"], "layout.tp_comm_overlap")}


def fivefold(args: list[str]) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "fivefold", *args], capture_output=True, text=True, env=os.environ)
    if out.returncode != 0:
        sys.exit(f"failed ({out.returncode}): fivefold {' '.join(args)}\n{out.stderr[-3000:]}")
    return out


def cpu_times() -> tuple[int, int]:
    """(idle, total) jiffies of every core of this machine so far (Linux's /proc/stat; zeros elsewhere)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except OSError:
        return 0, 0
    return fields[3] + fields[4], sum(fields)  # idle + iowait


def step_seconds(train_flags: list[str], steps: int, nproc: int, extra: list[str]) -> tuple[float, float]:
    """Mean seconds of steps 2 .. `steps` of a real run, from its per-step log, and the share of the machine's cores
    left idle over the whole run (start-up included): on a CPU the collectives' copies run on the same cores as the
    compute, so this idle time bounds what any overlap can hide there."""
    idle0, total0 = cpu_times()
    seconds = logged_step_seconds(steps, nproc, extra, train_flags)[1:]
    idle1, total1 = cpu_times()
    return sum(seconds) / len(seconds), (idle1 - idle0) / max(total1 - total0, 1)


def compute_seconds(train_flags: list[str], steps: int, extra: list[str], rank: int = 0) -> float:
    """`--only-rank rank`'s mean compute seconds per step (every other rank stood in for)."""
    out = fivefold(["train", *train_flags, *extra, "--max-steps", str(steps), "--only-rank", str(rank), "--json"])
    return json.loads(out.stdout.strip().splitlines()[-1])["compute_s"]["measured"]


def flag(flags: list[str], name: str, default: str) -> str:
    return flags[flags.index(name) + 1] if name in flags else default


def pipeline_compute_seconds(train_flags: list[str], steps: int, layout: list[str]) -> tuple[float, list[float]]:
    """A pipeline's step with its compute alone: every rank's `--only-rank` compute seconds, each split evenly over
    the rank's stages and micro-batches and over F, B and W, run through the schedule (`schedules.simulate`, no
    transfer time). What the ranks' compute and the schedule's bubble take; the rest of a real step is the
    pipeline's communication and its waits."""
    from fivefold.parallel.schedules import build_schedule, simulate

    name, pp = flag(layout, "--layout.schedule", "1f1b"), int(flag(layout, "--layout.pp", "1"))
    micro = int(flag(train_flags, "--train.global_batch_size", "8")) // int(flag(layout, "--layout.micro_batch_size",
                                                                               "1"))
    schedule = build_schedule(name, pp, micro)
    per_stage = 1  # the global rank of pp rank r with every other coordinate 0 is r x (dp x cp x tp): pp outermost
    for axis in ("dp", "tp", "cp"):
        per_stage *= int(flag(layout, f"--layout.{axis}", "1"))
    ranks = [compute_seconds(train_flags, steps, layout, rank=r * per_stage) for r in range(pp)]
    stages_on = [schedule.stage_rank.count(r) for r in range(pp)]
    each = [ranks[r] / (micro * stages_on[r]) / 3 for r in schedule.stage_rank]  # F = B = W per stage
    return simulate(schedule, each, each, each).makespan, ranks


def main() -> None:
    argv = sys.argv[1:]
    train_flags = argv[argv.index("--") + 1:] if "--" in argv else DEFAULT
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--case", action="append", choices=sorted(CASES))
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    for name in args.case or sorted(CASES):
        layout, switch = CASES[name]
        nproc = 1
        for axis in ("dp", "tp", "pp", "cp"):
            nproc *= int(flag(layout, f"--layout.{axis}", "1"))
        off, idle_off = step_seconds(train_flags, args.steps, nproc, [*layout, f"--{switch}", "false"])
        on, idle_on = step_seconds(train_flags, args.steps, nproc, [*layout, f"--{switch}", "true"])
        compute = compute_seconds(train_flags, args.steps, layout)
        exposed = off - compute
        hidden = (off - on) / exposed if exposed > 0 else float("nan")
        print(f"{name} ({switch}): step {off:.3f} s off, {on:.3f} s on, {compute:.3f} s compute only (--only-rank 0); "
              f"exposed communication {exposed:.3f} s off, {on - compute:.3f} s on; hidden {hidden:.1%}; "
              f"cores idle {idle_off:.1%} of the run off, {idle_on:.1%} on", flush=True)
        if "--layout.pp" in layout:  # the bubble is no communication: what is exposed beyond compute and bubble
            bubbled, ranks = pipeline_compute_seconds(train_flags, args.steps, layout)
            beyond = off - bubbled
            share = (off - on) / beyond if beyond > 0 else float("nan")
            print(f"{name}: compute only per rank {', '.join(f'{r:.3f}' for r in ranks)} s; with the schedule's "
                  f"bubble {bubbled:.3f} s; communication exposed beyond it {beyond:.3f} s off, {on - bubbled:.3f} s "
                  f"on; hidden {share:.1%}", flush=True)


if __name__ == "__main__":
    main()
