"""`fivefold bench`: time the training step on synthetic tokens.

Warm-up steps, then N timed steps, each from a barrier to the device synchronised and every rank done; the
step time is their median (a burst of other work during one step does not move it). Reports tokens/s (total and
per device), model TFLOP/s per device and MFU (the trainer's FLOPs function), peak memory allocated and
reserved, and the split of the step between forward, backward and optimizer, measured with device events
(host timers on CPU). Event timing adds a few synchronisations per step, so the split is taken on
separate profiled steps and the throughput on steps without them.

With a parallel layout it runs on several processes: `--nproc N` starts them through PyTorch's launcher, and
under `torchrun` the same command joins the process group. Each data-parallel rank draws its own rows; rank 0
times the steps (all ranks meet at a barrier at both edges of each), gathers every rank's peak memory and prints (or
writes with `--out`) the result. On CPU the peak memory is the process's peak resident set size above its
resident size just before the model was built, after one small step has initialised the libraries (no
allocator statistics exist there).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist

from fivefold import faults
from fivefold.config import (
    MAX_TIMED_STEPS,
    Config,
    ConfigError,
    build_config,
    int_in,
    parse_overrides,
    shown,
    write_text_atomic,
)
from fivefold.device import resolve_device
from fivefold.flops import training_flops_per_token
from fivefold.launch import local_world_size, start_or_join
from fivefold.layout import check_layout
from fivefold.outputs import check_target, keep_previous
from fivefold.planner.predict import check_fits, device_cluster
from fivefold.train.build import build_engine
from fivefold.train.loop import set_threads
from fivefold.train.metrics import (
    gather_ints,
    memory_baseline,
    peak_memory,
    planned_peak,
    resolve_peak_tflops,
    synchronize,
)
from fivefold.train.preflight import check_start

ACCEPTS_OVERRIDES = True


TIMED = "a benchmark times a few steps; 10^5 of them take hours at any size"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model preset (see `fivefold models`; default: the config's model, else tiny)")
    p.add_argument("--config", help="TOML or YAML config file (model, layout and train sections)")
    p.add_argument("--seq-len", type=int, help="sequence length: sets train.seq_len, at most model.max_seq_len "
                                               "(default: the config's train.seq_len)")
    p.add_argument("--micro-batch", type=int_in(1, 1 << 20, "sequences per micro-batch"),
                   help="sequences per micro-batch per rank (default: the config's, else 1)")
    p.add_argument("--grad-accum", type=int_in(1, 1 << 20, "micro-batches per step"),
                   help="micro-batches per step (default: the config's when --micro-batch is not given, else 1)")
    p.add_argument("--steps", type=int_in(1, MAX_TIMED_STEPS, TIMED), default=10, help="timed steps")
    p.add_argument("--warmup", type=int_in(0, MAX_TIMED_STEPS, TIMED), default=3, help="untimed warm-up steps")
    p.add_argument("--dtype", choices=["auto", "fp32", "bf16"], help="default: the config's train.dtype (auto)")
    p.add_argument("--compile", action="store_true", help="torch.compile each block")
    p.add_argument("--nproc", type=int, default=1, help="start this many local processes (the layout's world "
                                                       "size: dp x tp x pp x cp)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--out", help="also write the JSON object to this file")
    p.add_argument("--profile", type=int_in(0, 1000, "profiled steps, each traced"), default=0, metavar="N",
                   help="after timing, profile N more steps and report the top kernels by device time")
    p.add_argument("--trace", help="with --profile: write the profiler's Chrome trace to this file (rank 0's)")


def _timer(device: torch.device):
    """A pair (mark, elapsed) measuring device time between marks; host time on CPU."""
    if device.type == "cpu":
        def mark():
            return time.perf_counter()

        def elapsed(a, b) -> float:
            return b - a
    else:
        def mark():
            event = torch.Event(device=device, enable_timing=True)
            event.record()
            return event

        def elapsed(a, b) -> float:
            b.synchronize()
            return a.elapsed_time(b) / 1e3
    return mark, elapsed


def bench_config(args: argparse.Namespace) -> Config:
    """The config to time: file and overrides, then the bench flags (sequence, micro-batch, accumulation)."""
    overrides = parse_overrides(getattr(args, "overrides", []) or [])
    if args.model is not None or args.config is None:  # the config's model (and its `preset`) unless --model names one
        overrides.setdefault("model.preset", args.model or "tiny")
    cfg = build_config(args.config, overrides)
    # the batch flags default to the config's micro-batch and accumulation (a file's are not silently replaced)
    from_config = args.config is not None and args.micro_batch is None
    args.micro_batch = args.micro_batch or (cfg.micro_batch_size if args.config is not None else 1)
    args.grad_accum = args.grad_accum or (cfg.grad_accum_steps if from_config else 1)
    # --seq-len is train.seq_len: above model.max_seq_len it is refused by `Config.validate`, as `fivefold train`
    # refuses it (no silent extension of the rotary tables); --model.max_seq_len raises the model's limit
    cfg.train.seq_len = args.seq_len or cfg.train.seq_len
    cfg.train.dtype = args.dtype or cfg.train.dtype
    cfg.train.compile = args.compile or cfg.train.compile
    cfg.layout.micro_batch_size = args.micro_batch
    cfg.train.global_batch_size = args.micro_batch * args.grad_accum * cfg.layout.dp
    cfg.train.max_steps = max(cfg.train.max_steps, args.steps + args.warmup)
    cfg.train.warmup_steps = 0
    if args.seq_len is not None and args.seq_len < 1:
        raise ConfigError(f"--seq-len = {args.seq_len} must be >= 1 (tokens per sequence)")
    if args.steps < 1 or args.warmup < 0:
        raise ConfigError(f"--steps = {args.steps} must be >= 1 and --warmup = {args.warmup} >= 0")
    if args.micro_batch < 1 or args.grad_accum < 1:
        raise ConfigError(f"--micro-batch = {args.micro_batch} and --grad-accum = {args.grad_accum} must be >= 1")
    if args.trace and not args.profile:
        raise ConfigError(f"--trace {shown(args.trace)} writes the trace of the profiled steps; add --profile N (the "
                          "steps to profile)")
    for flag, target, example in (("--out", args.out, "bench.json"), ("--trace", args.trace, "trace.json")):
        if target is not None:  # before the benchmark: empty, a directory, no such directory, not writable
            check_target(target, flag, example)
    if cfg.model.attn_mask == "document":
        raise ConfigError("model.attn_mask = 'document' needs document boundaries, which bench's synthetic tokens do "
                          "not have; time it with benchmarks/document_mask.py, or use model.attn_mask = 'causal'")
    cfg.validate()
    return cfg


def run_bench(args: argparse.Namespace, cfg: Config) -> dict:
    """Time `cfg` (what `bench_config(args)` built) as `args` says; the result as `--json` prints it."""
    seq = cfg.train.seq_len
    device = resolve_device(cfg.train.device)
    set_threads(cfg.train.threads, device)  # as a training run sets them (the cores' share when 0)
    resident_before = memory_baseline(device)
    engine = build_engine(cfg, device)
    # each data-parallel rank its own rows; tensor-parallel ranks of one dp rank share them
    gen = torch.Generator().manual_seed(cfg.train.seed + engine.dp_rank)
    rows = args.micro_batch * args.grad_accum
    tokens = torch.randint(0, cfg.model.vocab_size, (rows, seq + 1), generator=gen)
    inputs, targets = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
    micro = list(zip(inputs.split(args.micro_batch), targets.split(args.micro_batch), strict=True))
    global_tokens = cfg.train.global_batch_size * seq
    mark, elapsed = _timer(device)
    barrier = dist.barrier if dist.is_initialized() else (lambda: None)
    # the split times micro-batches one by one, which only engines with the plain micro-batch loop allow
    can_split = engine.runner.splits_micro_batches
    steps = [0]

    def step(split: dict[str, float] | None) -> None:
        steps[0] += 1
        faults.note(step=steps[0], micro_batch=None, action="forward-backward")
        if split is None:
            engine.forward_backward(micro, global_tokens)
            engine.optimizer_step()
            return
        for i, (x, y) in enumerate(micro):
            with engine.micro_batch_context(i, len(micro)):
                t0 = mark()
                loss, _ = engine.micro_batch_loss(x, y, global_tokens)
                t1 = mark()
                loss.backward()
                t2 = mark()
            split["forward"] += elapsed(t0, t1)
            split["backward"] += elapsed(t1, t2)
        t3 = mark()
        engine.optimizer_step()
        split["optimizer"] += elapsed(t3, mark())

    for _ in range(args.warmup):
        step(None)
    synchronize(device)
    module = torch.get_device_module(device.type) if device.type != "cpu" else None
    if module is not None and hasattr(module, "reset_peak_memory_stats"):
        module.reset_peak_memory_stats()
    # each step timed on its own, from a barrier to the slowest rank's end: the step time is their median, which
    # a burst of other work on the machine (or a straggling rank) during one step does not move
    step_seconds = []
    for _ in range(args.steps):
        barrier()
        start = time.perf_counter()
        step(None)
        synchronize(device)
        barrier()
        step_seconds.append(time.perf_counter() - start)
    median = statistics.median(step_seconds)
    split: dict[str, float] | None = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0} if can_split else None
    split_steps = min(3, args.steps)
    for _ in range(split_steps if can_split else 0):
        step(split)
    synchronize(device)

    trace = args.trace if not dist.is_initialized() or dist.get_rank() == 0 else None
    top_kernels = profile_steps(step, args.profile, device, trace) if args.profile else None

    tokens_per_s = global_tokens / median
    per_device = tokens_per_s / engine.n_devices
    flops = training_flops_per_token(cfg.model, seq)
    peak = resolve_peak_tflops(cfg.log.peak_tflops, device, "bf16" if engine.bf16 else "fp32")
    tflops = per_device * flops / 1e12
    if module is not None and hasattr(module, "max_memory_allocated"):
        memory = [int(module.max_memory_allocated()), int(module.max_memory_reserved())]
        source = "allocator peak over the timed steps"
    else:
        memory = [planned_peak(peak_memory(device, resident_before))] * 2
        source = "peak resident set size above the resident size before the model was built"
    per_rank = gather_ints(memory, device)
    allocated = [m[0] for m in per_rank]
    return {
        "model": cfg.model.name, "device": str(device),
        "device_name": module.get_device_name() if module is not None else "cpu",
        "torch": torch.__version__, "seq_len": seq, "micro_batch_size": args.micro_batch,
        "grad_accum_steps": args.grad_accum, "moe_impl": cfg.model.moe_impl if cfg.model.n_experts else None,
        "dtype": "bf16" if engine.bf16 else "fp32", "compile": cfg.train.compile, "float8": cfg.train.float8,
        "n_devices": engine.n_devices, "layout": dict(vars(cfg.layout)),
        "steps": args.steps, "step_time_s": median, "step_times_s": step_seconds, "tokens_per_s": tokens_per_s,
        "tokens_per_s_per_device": per_device, "tflops_per_device": tflops,
        "mfu": tflops / peak if peak else None, "peak_tflops": peak,
        "peak_memory_allocated_bytes": max(allocated) if module is not None else None,
        "peak_memory_reserved_bytes": max(m[1] for m in per_rank) if module is not None else None,
        "peak_memory_bytes_per_rank": allocated, "memory_source": source,
        "time_split_s": {k: v / split_steps for k, v in split.items()} if split is not None else None,
        "top_kernels": top_kernels,
    }


def forwarded_argv(args: argparse.Namespace) -> list[str]:
    """This command's arguments for each started process, without --nproc."""
    out = ["--micro-batch", str(args.micro_batch), "--grad-accum", str(args.grad_accum),
           "--steps", str(args.steps), "--warmup", str(args.warmup)]
    for flag, value in (("--model", args.model), ("--config", args.config), ("--seq-len", args.seq_len),
                        ("--dtype", args.dtype),
                        ("--out", args.out), ("--profile", args.profile or None), ("--trace", args.trace)):
        if value is not None:
            out += [flag, str(value)]
    out += ["--compile"] * args.compile + ["--json"] * args.json
    return out + list(getattr(args, "overrides", []) or [])


def profile_steps(step, n: int, device: torch.device, trace: str | None, top: int = 15) -> list[dict]:
    """Run `n` steps under the PyTorch profiler; the `top` operators by self time on the device (CPU time on
    CPU), each with its share of the profiled device time, per step."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    kind = {"cuda": "CUDA", "xpu": "XPU"}.get(device.type)
    if kind and hasattr(torch.profiler.ProfilerActivity, kind):
        activities.append(getattr(torch.profiler.ProfilerActivity, kind))
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(n):
            step(None)
        synchronize(device)
    if trace:
        if (backup := keep_previous(trace)) is not None:  # a file already there is kept, not overwritten
            print(f"kept the previous {trace} as {backup}", file=sys.stderr)
        prof.export_chrome_trace(trace)
    on_device = device.type != "cpu"
    if on_device:  # the kernels themselves, not the host operators that launched them (which would count twice)
        events = [e for e in prof.key_averages()
                  if e.device_type != torch.autograd.DeviceType.CPU and not e.is_user_annotation]
    else:
        events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    key = (lambda e: e.self_device_time_total) if on_device else (lambda e: e.self_cpu_time_total)
    events.sort(key=key, reverse=True)
    total = sum(key(e) for e in events) or 1.0
    return [{"name": e.key[:90], "calls_per_step": e.count / n, "ms_per_step": key(e) / 1e3 / n,
             "share": key(e) / total} for e in events[:top]]


def run(args: argparse.Namespace) -> int:
    if args.nproc < 1:
        raise ConfigError(f"--nproc = {args.nproc} must be >= 1")
    cfg = bench_config(args)  # every config error before any process starts
    check_layout(cfg, local_world_size(args.nproc))
    device = check_start(cfg, run_dir=False)
    if device is not None:  # the process the user started: the planner's prediction on the device the run uses
        check_fits(cfg, device_cluster(device, args.nproc), device.type)
    status = start_or_join(cfg, args.nproc, forwarded_argv(args), "bench")
    if status is not None:
        return status
    result = run_bench(args, cfg)
    if dist.is_initialized():
        rank = dist.get_rank()
        dist.destroy_process_group()
        if rank != 0:
            return 0
    if args.out:
        if (backup := keep_previous(args.out)) is not None:  # what was there is kept, not overwritten
            print(f"kept the previous {args.out} as {backup}", file=sys.stderr)  # stdout may be --json's
        write_text_atomic(args.out, json.dumps(result) + "\n")
    if args.json:
        print(json.dumps(result))
        return 0
    gib = 2**30
    mfu = f"{100 * result['mfu']:.1f} %" if result["mfu"] is not None else "n/a (no known peak: --log.peak_tflops)"
    mem = (f"{max(result['peak_memory_bytes_per_rank']) / 2**20:,.0f} MiB resident above the baseline"
           if result["peak_memory_allocated_bytes"] is None else
           f"{result['peak_memory_allocated_bytes'] / gib:.2f} GiB allocated, "
           f"{result['peak_memory_reserved_bytes'] / gib:.2f} GiB reserved")
    split = result["time_split_s"]
    devices = f"{result['n_devices']} x " if result["n_devices"] > 1 else ""
    print(f"{result['model']} on {devices}{result['device_name']} ({result['dtype']}, seq {result['seq_len']}, "
          f"micro-batch {result['micro_batch_size']} x {result['grad_accum_steps']}, compile {result['compile']}"
          + (f", float8 {result['float8']}" if result["float8"] != "off" else "") + ")")
    print(f"  step time        {1e3 * result['step_time_s']:.1f} ms")
    print(f"  tokens/s         {result['tokens_per_s']:,.0f} ({result['tokens_per_s_per_device']:,.0f} per device)")
    print(f"  TFLOP/s/device   {result['tflops_per_device']:.2f}   MFU {mfu}")
    print(f"  peak memory      {mem}")
    if split is not None:
        total = sum(split.values()) or 1.0
        print("  step split       " + ", ".join(f"{k} {1e3 * v:.1f} ms ({100 * v / total:.0f} %)"
                                               for k, v in split.items()))
    if result["top_kernels"]:
        print("  top kernels (self time per step, share of the profiled time)")
        for k in result["top_kernels"]:
            print(f"    {k['ms_per_step']:8.2f} ms  {100 * k['share']:5.1f} %  x{k['calls_per_step']:<5g} {k['name']}")
    return 0
