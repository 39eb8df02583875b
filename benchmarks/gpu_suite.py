"""The GPU suite: every figure of docs/benchmarks.md's GPU section in one command, within one short lease of a GPU.

    python benchmarks/gpu_suite.py OUT_DIR                 # on a machine with an accelerator, about 8 minutes
    python benchmarks/gpu_suite.py OUT_DIR --dry           # the same steps at tiny sizes on the CPU (a test runs it)

Steps, in the order they run (the most wanted figures first, so that a lease that ends early still gives them):

  a. `fivefold bench` of the Llama-3.2-1B shape at sequence 4096, compiled, under lean mixed precision, at
     micro-batches 4, 2 and 8: tokens/s, MFU, peak memory (allocated and reserved), forward / backward / optimizer;
  g. float8 (`train.float8`, torchao) against bf16 on Llama-3.1-8B's shape cut to 4 layers, compiled: tokens/s of
     the rowwise and tensorwise recipes beside bf16's (target 1.2x); then 200 steps of the bundled corpus with bf16
     and with rowwise float8 (the shape cut to 2 layers and the corpus's vocabulary): the final losses, whose
     difference should stay within 1 %. Needs torchao on the machine (docs/benchmarks.md: carrying its wheel);
  d. `fivefold train --only-rank` of the first and the last rank of each examples/ config at full size, compiled
     (global batch cut to a few micro-batches: memory depends on the micro-batches in flight, not on how many are
     accumulated): measured peak memory and compute time beside the planner's prediction for that rank;
  c. an MoE step: `fivefold bench` of OLMoE's shape (64 experts, top-8) cut to a few layers, with the experts as
     grouped GEMMs (the default) and as the padded batched matmul beside it;
  e. every pipeline schedule and every data-parallel wrapper once, at small size, through `--only-rank`, so that
     every accelerator code path has run;
  f. document masking against causal attention (benchmarks/document_mask.py): step time at sequence 2048 with a
     mean document of 256 tokens, the attention work each executes, FlexAttention's forward beside it;
  b. the side by side with a plain `transformers` loop (benchmarks/hf_side_by_side.py).

Each step runs as its own process with its own time limit; a step that fails or runs out of time is recorded with
the end of its output and the suite goes on. A step that would start after `--budget-s` seconds is skipped and
recorded as such. Everything lands in OUT_DIR/suite.json (one file: the device, PyTorch, every step's command,
exit status, seconds and parsed JSON result) and a table is printed at the end. `--dry` swaps every model for a
tiny one and drops compile, keeping the layouts, so that the suite's plumbing is tested where no GPU is.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the quickest first: a lease that ends during the 70B ranks (the longest to build and compile) still gives the others
EXAMPLES = ("olmoe-1b-7b-2x8-h100", "llama3.1-8b-1x8-h100", "llama3.1-70b-4x8-h100")
# the shape every --dry step trains instead of the full-size one (the layout is kept)
TINY = {"model.hidden": "64", "model.n_heads": "4", "model.n_kv_heads": "4", "model.ffn": "128",
        "model.vocab_size": "512", "model.max_seq_len": "128"}
TINY_MOE = {**TINY, "model.moe_ffn": "64"}
# step e's layouts: each pipeline schedule and each data-parallel wrapper once (world size, layout overrides)
PATHS: list[tuple[str, int, dict[str, str]]] = [
    ("pp2 afab", 2, {"layout.pp": "2", "layout.schedule": "afab"}),
    ("pp2 1f1b", 2, {"layout.pp": "2", "layout.schedule": "1f1b"}),
    ("pp2 interleaved vpp2", 2, {"layout.pp": "2", "layout.schedule": "interleaved", "layout.vpp": "2"}),
    ("pp2 zero-bubble", 2, {"layout.pp": "2", "layout.schedule": "zero-bubble"}),
    ("pp2 dualpipev", 2, {"layout.pp": "2", "layout.schedule": "dualpipev"}),
    # the F/B pairs as two lanes (`parallel.lanes`), whose backward's collectives run in the accelerator's autograd
    # thread
    ("pp2 tp2 dualpipev", 4, {"layout.pp": "2", "layout.tp": "2", "layout.schedule": "dualpipev"}),
    ("dp2 zero0", 2, {"layout.dp": "2", "layout.zero": "0"}),
    ("dp2 zero1", 2, {"layout.dp": "2", "layout.zero": "1"}),
    ("dp2 zero2", 2, {"layout.dp": "2", "layout.zero": "2"}),
    ("dp2 zero3", 2, {"layout.dp": "2", "layout.zero": "3"}),
    ("dp4 hsdp shard2", 4, {"layout.dp": "4", "layout.zero": "3", "layout.dp_shard": "2"}),
    ("tp2 sp", 2, {"layout.tp": "2", "layout.sp": "true"}),
    ("cp2", 2, {"layout.cp": "2"}),
    ("pp2 zero3", 4, {"layout.dp": "2", "layout.pp": "2", "layout.zero": "3"}),
]
# step g's recipes beside bf16 ("off")
FLOAT8_RECIPES = ("off", "rowwise", "tensorwise")
MOE_PATHS: list[tuple[str, int, dict[str, str]]] = [
    ("moe ep2 dp2", 2, {"layout.dp": "2", "layout.ep": "2"}),
]


@dataclass
class Step:
    name: str
    group: str
    argv: list[str]
    timeout_s: int
    result: dict = field(default_factory=dict)
    run_dir: Path | None = None  # a training run's directory: its metrics.jsonl gives the result


def fivefold(*args: str) -> list[str]:
    return [sys.executable, "-m", "fivefold", *args]


def overrides(values: dict[str, str]) -> list[str]:
    return [a for key, value in values.items() for a in (f"--{key}", value)]


def bench_steps(dry: bool, micro_batches: tuple[int, ...] = (4, 2, 8)) -> list[Step]:
    """Steps a and c: fivefold bench of the dense 1B shape over micro-batches, and of OLMoE's shape cut to a few
    layers."""
    if dry:
        dense = ["--model", "tiny", "--seq-len", "64", "--steps", "2", "--warmup", "1"]
        moe = ["--model", "tiny-moe", "--seq-len", "64", "--micro-batch", "2", "--steps", "2", "--warmup", "1"]
    else:
        dense = ["--model", "llama-3.2-1b", "--seq-len", "4096", "--steps", "8", "--warmup", "3", "--compile"]
        moe = ["--model", "olmoe-1b-7b", "--model.n_layers", "4", "--seq-len", "4096", "--micro-batch", "2",
               "--steps", "6", "--warmup", "3", "--compile"]
    steps = [Step(f"bench dense mb{mb}", "a", fivefold("bench", *dense, "--micro-batch", str(mb), "--json"), 150)
             for mb in micro_batches]
    steps.insert(1, Step("bench moe", "c", fivefold("bench", *moe, "--json"), 150))
    # the experts as one padded batched matmul sized to the busiest expert, on the same device: the grouped GEMM's gain
    steps.insert(2, Step("bench moe padded", "c",
                         fivefold("bench", *moe, "--model.moe_impl", "padded", "--json"), 150))
    return steps


def float8_steps(dry: bool, out: Path) -> list[Step]:
    """Step g: float8 against bf16, throughput (`fivefold bench`) and the loss of a short run on the bundled corpus."""
    if dry:
        bench = ["--model", "tiny", "--seq-len", "64", "--micro-batch", "2", "--steps", "2", "--warmup", "1"]
        train = ["--preset", "tiny", "--train.max_steps", "3"]
    else:
        bench = ["--model", "llama-3.1-8b", "--model.n_layers", "4", "--seq-len", "4096", "--micro-batch", "2",
                 "--steps", "8", "--warmup", "3", "--compile"]
        train = ["--preset", "llama-3.1-8b", "--model.n_layers", "2", "--model.vocab_size", "2048",
                 "--train.max_steps", "200", "--train.lr", "3e-4", "--train.warmup_steps", "20",
                 "--train.compile", "true"]
    steps = [Step(f"bench float8 {recipe}", "g", fivefold("bench", *bench, "--train.float8", recipe, "--json"), 150)
             for recipe in FLOAT8_RECIPES]
    for recipe in ("off", "rowwise"):
        run_dir = out / f"g-train-float8-{recipe}"
        steps.append(Step(f"train float8 {recipe}", "g", fivefold(
            "train", *train, "--train.float8", recipe, "--run-dir", str(run_dir), "--log.log_every", "1",
            "--train.eval_every", "0"), 240, run_dir=run_dir))
    return steps


def run_losses(run_dir: Path, last: int = 20) -> dict | None:
    """A finished run's final losses from its metrics.jsonl: the mean train loss of its last `last` logged steps
    (less noisy than one step's) and the validation loss at the end."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    train = [r["loss"] for r in rows if "loss" in r]
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    if not train:
        return None
    return {"steps": len(train), "final_train_loss": sum(train[-last:]) / len(train[-last:]),
            "val_loss": val[-1] if val else None}


def float8_summary(steps: list[Step]) -> dict:
    """Step g's comparison: each recipe's tokens/s over bf16's, and the final losses' relative difference."""
    by_name = {s.name: s.result.get("result") or {} for s in steps if s.group == "g"}
    out: dict = {}
    base = by_name.get("bench float8 off", {}).get("tokens_per_s")
    for recipe in FLOAT8_RECIPES[1:]:
        got = by_name.get(f"bench float8 {recipe}", {}).get("tokens_per_s")
        if base and got:
            out[f"{recipe}_speedup"] = round(got / base, 3)
    bf16, f8 = by_name.get("train float8 off", {}), by_name.get("train float8 rowwise", {})
    for key in ("final_train_loss", "val_loss"):
        if bf16.get(key) and f8.get(key):
            out[f"{key}_difference"] = round(f8[key] / bf16[key] - 1, 5)
    return out


def only_rank_steps(dry: bool, out: Path) -> list[Step]:
    """Steps d and e: one rank of a layout at its size on this device, beside the planner's prediction."""
    steps = []
    common = ["--max-steps", "2", "--json", "--log.log_every", "1", "--train.eval_every", "0"]
    for name in EXAMPLES:
        config = ROOT / "examples" / f"{name}.toml"
        world, pipelined = _world_size(config)
        # a few micro-batches: the peak depends on the micro-batches in flight, not on how many are accumulated
        shape = overrides({**(TINY_MOE if "olmoe" in name else TINY), "model.n_layers": "8",
                           "train.seq_len": "64"}) if dry else []
        batch = _global_batch(config, micro_batches=8)
        for rank in (0, world - 1) if pipelined else (0,):  # without pp every rank holds the same
            steps.append(Step(f"only-rank {name} rank {rank}", "d", fivefold(
                "train", "--config", str(config), "--only-rank", str(rank), "--run-dir", str(out / f"d-{name}-{rank}"),
                "--train.global_batch_size", str(batch), "--train.compile", "false" if dry else "true",
                *shape, *common), 170))
    small = (["--preset", "tiny", "--train.seq_len", "64"] if dry else
             ["--preset", "llama-3.2-1b", "--model.n_layers", "4", "--train.seq_len", "2048"])
    small_moe = (["--preset", "tiny-moe", "--train.seq_len", "64"] if dry else
                 ["--preset", "olmoe-1b-7b", "--model.n_layers", "2", "--train.seq_len", "2048"])
    for label, world, layout in PATHS + MOE_PATHS:
        base = small_moe if label.startswith("moe") else small
        steps.append(Step(f"only-rank {label}", "e", fivefold(
            "train", *base, *overrides(layout), "--only-rank", str(world - 1),
            "--run-dir", str(out / f"e-{label.replace(' ', '-')}"),
            "--layout.micro_batch_size", "1", "--train.global_batch_size", str(4 * int(layout.get("layout.dp", "1"))),
            *common), 90))
    return steps


def side_by_side_step(dry: bool) -> Step:
    args = (["--model", "tiny", "--seq-len", "64", "--micro-batch", "2", "--steps", "2", "--warmup", "1"] if dry else
            ["--model", "llama-3.2-1b", "--seq-len", "4096", "--micro-batch", "2", "--steps", "8", "--warmup", "3",
             "--compile"])
    return Step("side by side", "b", [sys.executable, str(ROOT / "benchmarks" / "hf_side_by_side.py"), *args,
                                      "--json"], 200)


def document_mask_step(dry: bool) -> Step:
    args = ["--dry"] if dry else ["--rows", "8", "--layers", "4", "--hidden", "2048", "--heads", "16", "--repeats",
                                  "5", "--flex"]
    return Step("document mask vs causal", "f", [sys.executable, str(ROOT / "benchmarks" / "document_mask.py"),
                                                 *args, "--json"], 200)


def _world_size(config: Path) -> tuple[int, bool]:
    """(world size, whether the layout is pipelined: its first and last ranks hold different parts)."""
    import tomllib

    layout = tomllib.loads(config.read_text())["layout"]
    return layout["dp"] * layout["tp"] * layout["pp"] * layout["cp"], layout["pp"] > 1


def _global_batch(config: Path, micro_batches: int) -> int:
    import tomllib

    layout = tomllib.loads(config.read_text())["layout"]
    return layout["micro_batch_size"] * layout["dp"] * micro_batches


def last_json(text: str) -> dict | None:
    """The last line of `text` that parses as a JSON object (the step's result)."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


def run_step(step: Step, env: dict[str, str]) -> None:
    start = time.perf_counter()
    try:
        done = subprocess.run(step.argv, capture_output=True, text=True, timeout=step.timeout_s, env=env, cwd=ROOT)
        rc, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        rc = 124
        output = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
    result = None
    if rc == 0:
        result = run_losses(step.run_dir) if step.run_dir is not None else last_json(output)
    if step.run_dir is not None:  # the checkpoints of a full-width run take disk that later steps need
        shutil.rmtree(step.run_dir / "checkpoints", ignore_errors=True)
    step.result = {"name": step.name, "group": step.group, "command": " ".join(step.argv[1:]), "rc": rc,
                   "seconds": round(time.perf_counter() - start, 1), "result": result,
                   "output_tail": output[-1500:] if rc != 0 else ""}


def summary_line(record: dict) -> str:
    """One row of the printed table: the figures that matter for the step's kind."""
    r = record.get("result") or {}
    head = f"{record['name'][:44]:<44} {record.get('rc', '-')!s:>4} {record.get('seconds', 0):>6.1f}s  "
    if record.get("skipped"):
        return head + "skipped: " + record["skipped"]
    if not r:
        tail = record.get("output_tail", "").strip().splitlines()
        return head + "FAILED: " + (tail[-1][:100] if tail else "no output")
    if "tokens_per_s" in r and "mfu" in r:
        gib = (r.get("peak_memory_allocated_bytes") or r.get("peak_memory_bytes_per_rank", [0])[0] or 0) / 2**30
        mfu = f"{100 * r['mfu']:.1f} %" if r.get("mfu") else "n/a"
        return head + f"{r['tokens_per_s']:,.0f} tok/s, MFU {mfu}, peak {gib:.2f} GiB, step {r['step_time_s']:.3f} s"
    if "fivefold_tokens_per_s" in r:
        mfu = (f", MFU {100 * r['fivefold_mfu']:.1f} / {100 * r['transformers_mfu']:.1f} %"
               if r.get("fivefold_mfu") else "")
        return head + (f"fivefold {r['fivefold_tokens_per_s']:,.0f} tok/s, transformers "
                       f"{r['transformers_tokens_per_s']:,.0f} tok/s, ratio {r['ratio']:.2f}x{mfu}")
    if "final_train_loss" in r:
        val = f", val loss {r['val_loss']:.4f}" if r.get("val_loss") else ""
        return head + f"{r['steps']} steps, final train loss {r['final_train_loss']:.4f} (mean of the last 20){val}"
    if "document" in r and "causal" in r:
        doc, causal = r["document"], r["causal"]
        return head + (f"step {doc['step_time_s']:.3f} s document vs {causal['step_time_s']:.3f} s causal, "
                       f"attention pairs {doc['attention_pairs'] / causal['attention_pairs']:.3f} of causal")
    return head + "; ".join(f"{k} {v}" for k, v in _only_rank_figures(r).items())


def _only_rank_figures(r: dict) -> dict[str, str]:
    """Measured beside predicted of an --only-rank result: the peak memory and the step's compute time."""
    out = {}
    peak, compute = r.get("memory_bytes", {}).get("peak"), r.get("compute_s")
    if peak:
        out["peak GiB"] = f"{peak['measured'] / 2**30:.2f} (planner {peak['predicted'] / 2**30:.2f}, " \
                          f"{100 * peak['difference'] / max(peak['predicted'], 1):+.1f} %)"
    if r.get("peak_memory_bytes", {}).get("reserved"):
        out["reserved GiB"] = f"{r['peak_memory_bytes']['reserved'] / 2**30:.2f}"
    if compute:
        out["compute s"] = f"{compute['measured']:.3f} (planner {compute['predicted']:.3f}, " \
                           f"{100 * compute['difference'] / max(compute['predicted'], 1e-9):+.1f} %)"
    return out or {"keys": ",".join(sorted(r)[:8])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="directory for suite.json and the steps' run directories")
    p.add_argument("--dry", action="store_true", help="tiny sizes on the CPU, no compile: test the plumbing")
    p.add_argument("--budget-s", type=float, default=500.0, help="start no step after this many seconds")
    p.add_argument("--only", default="", help="comma-separated step groups to run (a,b,c,d,e,f,g); default all")
    p.add_argument("--micro-batches", default="4,2,8", help="group a's micro-batches (default 4,2,8)")
    p.add_argument("--order", default="a,g,d,c,e,f,b", help="the groups' order (default a,g,d,c,e,f,b)")
    p.add_argument("--concurrent-e", type=int, default=1, metavar="N",
                   help="run group e's small layouts N at a time (they check code paths, not speed or memory)")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT / "src") + os.pathsep
           + os.environ.get("PYTHONPATH", "")}
    if args.dry:
        env.setdefault("OMP_NUM_THREADS", "1")
    micro_batches = tuple(int(m) for m in args.micro_batches.split(","))
    every = [*bench_steps(args.dry, micro_batches), *float8_steps(args.dry, args.out),
             *only_rank_steps(args.dry, args.out), side_by_side_step(args.dry), document_mask_step(args.dry)]
    order = args.order.split(",")
    steps = sorted((s for s in every if not args.only or s.group in args.only.split(",")),
                   key=lambda s: order.index(s.group) if s.group in order else len(order))
    if args.dry:
        for s in steps:
            if s.argv[2:4] == ["fivefold", "bench"] or s.argv[2:4] == ["fivefold", "train"]:
                s.argv += ["--train.device", "cpu"]
    import torch

    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    device = ("cpu" if accelerator is None else
              getattr(torch, accelerator.type).get_device_name())
    report = {"device": device, "torch": torch.__version__, "dry": args.dry, "started": time.strftime(
        "%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "steps": []}
    print(f"gpu suite: {device}, torch {torch.__version__}, {len(steps)} steps, budget {args.budget_s:.0f} s",
          flush=True)
    start = time.perf_counter()
    concurrent = [s for s in steps if s.group == "e"] if args.concurrent_e > 1 else []
    for step in steps:
        if step.result:  # ran with its group
            continue
        if time.perf_counter() - start > args.budget_s:
            step.result = {"name": step.name, "group": step.group, "command": " ".join(step.argv[1:]),
                           "skipped": f"budget of {args.budget_s:.0f} s spent"}
        elif step in concurrent:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(args.concurrent_e) as pool:
                list(pool.map(lambda s: run_step(s, env), concurrent))
        else:
            run_step(step, env)
        for done in (concurrent if step in concurrent else [step]):
            report["steps"].append(done.result)
            print(summary_line(done.result), flush=True)
        (args.out / "suite.json").write_text(json.dumps(report, indent=1) + "\n")
    if any(s.group == "g" for s in steps):
        report["float8"] = float8_summary(steps)
        (args.out / "suite.json").write_text(json.dumps(report, indent=1) + "\n")
        print("float8 against bf16: " + (", ".join(f"{k} {v}" for k, v in report["float8"].items()) or "no figures"),
              flush=True)
    failed = [s.result["name"] for s in steps if s.result.get("rc", 0) != 0]
    print(f"gpu suite: {len(steps) - len(failed)} of {len(steps)} steps ran in {time.perf_counter() - start:.0f} s; "
          f"failed: {', '.join(failed) or 'none'}; results in {args.out / 'suite.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
