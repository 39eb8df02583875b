"""Steps per second with a checkpoint every `--every` steps against none: the same `fivefold train` run three
times, without periodic checkpoints, with synchronous ones (`--train.async_checkpoint false`) and with asynchronous
ones (the default). Steps per second over steps 1 .. N from the run's own per-step log (`log.log_every 1`: each
record's interval runs from the previous step's record, so it holds that step's checkpoint when there is one, and a
save that waits for the one in flight); the final checkpoint, after step N's record, is outside in every run.
Prints each run's figure and the two ratios to the run without checkpoints.

    PYTHONPATH=src python benchmarks/async_checkpoint.py [--steps 20] [--every 5] [--nproc 4] -- [train flags]

Default train flags: the 300M-parameter untied Llama of docs/benchmarks.md (4 blocks of smollm-1.7b, vocabulary
8192) under tp 2 x pp 2, sequence 64, global batch 4, one thread per process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

DEFAULT = ["--preset", "smollm-1.7b", "--model.n_layers", "4", "--model.vocab_size", "8192",
           "--model.tied_embeddings", "false", "--train.seq_len", "64", "--train.global_batch_size", "4",
           "--train.threads", "1", "--layout.tp", "2", "--layout.pp", "2", "--train.eval_every", "0",
           "--train.eval_batches", "1", "--log.progress", "none", "--train.keep_checkpoints", "2"]


def flag(args: list[str], name: str, default: str) -> int:
    return int(args[args.index(name) + 1]) if name in args else int(default)


def logged_step_seconds(steps: int, nproc: int, extra: list[str], train_flags: list[str]) -> list[float]:
    """Seconds of each step of a real `fivefold train` run (`train_flags` then `extra`), from its own per-step log
    (`log.log_every 1`)."""
    with tempfile.TemporaryDirectory() as run_dir:
        run = Path(run_dir) / "run"
        cmd = [sys.executable, "-m", "fivefold", "train", *train_flags, "--max-steps", str(steps), "--nproc",
               str(nproc), "--run-dir", str(run), "--log.log_every", "1", *extra]
        out = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
        if out.returncode != 0:
            sys.exit(f"failed ({out.returncode}): {' '.join(cmd)}\n{out.stderr[-3000:]}")
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    tokens_per_step = flag(train_flags, "--train.global_batch_size", "8") * flag(train_flags, "--train.seq_len", "256")
    return [tokens_per_step / r["tokens_per_s"] for r in records if "tokens_per_s" in r]


def steps_per_second(steps: int, nproc: int, extra: list[str], train_flags: list[str]) -> float:
    return steps / sum(logged_step_seconds(steps, nproc, extra, train_flags))


def main() -> None:
    argv = sys.argv[1:]
    train_flags = argv[argv.index("--") + 1:] if "--" in argv else DEFAULT
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
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
