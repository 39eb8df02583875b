"""Steps per second with a checkpoint every `--every` steps against none: the same `fivefold train` run three
times, without periodic checkpoints, with synchronous ones (`--train.async_checkpoint false`) and with asynchronous
ones (the default). Each run ends with its final (synchronous) checkpoint inside the timed loop, as every run does.
Prints each run's steps per second (from the run's own summary: tokens per second per device x devices / tokens
per step) and the two ratios to the run without checkpoints.

    PYTHONPATH=src python benchmarks/async_checkpoint.py [--steps 21] [--every 5] [--nproc 4] -- [train flags]

Default train flags: the 300M-parameter untied Llama of docs/benchmarks.md (4 blocks of smollm-1.7b, vocabulary
8192) under tp 2 x pp 2, sequence 64, global batch 4, one thread per process.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

DEFAULT = ["--preset", "smollm-1.7b", "--model.n_layers", "4", "--model.vocab_size", "8192",
           "--model.tied_embeddings", "false", "--train.seq_len", "64", "--train.global_batch_size", "4",
           "--train.threads", "1", "--layout.tp", "2", "--layout.pp", "2", "--train.eval_every", "0",
           "--train.eval_batches", "1", "--log.progress", "none", "--train.keep_checkpoints", "2"]
SUMMARY = re.compile(r"mean ([\d,.]+) tokens/s per device on (\d+) device")


def flag(args: list[str], name: str, default: str) -> int:
    return int(args[args.index(name) + 1]) if name in args else int(default)


def steps_per_second(steps: int, nproc: int, extra: list[str], train_flags: list[str]) -> float:
    with tempfile.TemporaryDirectory() as run_dir:
        cmd = [sys.executable, "-m", "fivefold", "train", *train_flags, "--max-steps", str(steps), "--nproc",
               str(nproc), "--run-dir", str(Path(run_dir) / "run"), *extra]
        out = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
        if out.returncode != 0:
            sys.exit(f"failed ({out.returncode}): {' '.join(cmd)}\n{out.stderr[-3000:]}")
        m = SUMMARY.search(out.stdout + out.stderr)
        if m is None:
            sys.exit(f"no summary line in the output of {' '.join(cmd)}")
    per_device, devices = float(m.group(1).replace(",", "")), int(m.group(2))
    tokens_per_step = flag(train_flags, "--train.global_batch_size", "8") * flag(train_flags, "--train.seq_len", "256")
    return per_device * devices / tokens_per_step


def main() -> None:
    argv = sys.argv[1:]
    train_flags = argv[argv.index("--") + 1:] if "--" in argv else DEFAULT
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=21)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--nproc", type=int, default=4)
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    every = ["--train.checkpoint_every", str(args.every)]
    runs = {"no periodic checkpoint": ["--train.checkpoint_every", "0"],
            f"synchronous every {args.every}": [*every, "--train.async_checkpoint", "false"],
            f"asynchronous every {args.every}": [*every, "--train.async_checkpoint", "true"]}
    rates = {}
    for name, extra in runs.items():
        rates[name] = steps_per_second(args.steps, args.nproc, extra, train_flags)
        print(f"{name}: {rates[name]:.4f} steps/s", flush=True)
    base = rates["no periodic checkpoint"]
    names = list(runs)
    print(f"ratio to no periodic checkpoint: synchronous {rates[names[1]] / base:.3f}, "
          f"asynchronous {rates[names[2]] / base:.3f} ({args.steps} steps, {args.nproc} processes)")


if __name__ == "__main__":
    main()
