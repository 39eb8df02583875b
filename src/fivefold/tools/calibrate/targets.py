"""What a calibration measures (`Plan`, from the command line's arguments) and what one group of ranks returns
(`Result`); both travel to the started processes and back as JSON."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import asdict, dataclass, field

import torch

from fivefold.config import ModelConfig, shown
from fivefold.errors import CliError
from fivefold.layout import LOSS_CHUNK_TOKENS, TP_LOSS_CHUNK_TOKENS, tensor_parallel_problem
from fivefold.planner.hardware import COLLECTIVES
from fivefold.planner.time import linear_shapes
from fivefold.presets import get_preset

KIB = 1024


@dataclass
class Plan:
    """What one group of ranks measures."""

    device_type: str
    threads: int
    linear: list[tuple[int, int, int]]
    attention: list[tuple[int, int, int, int, int]]  # batch, heads, kv heads, seq, head dim
    loss: list[tuple[int, int, int]]  # tokens per chunk, vocabulary, hidden
    elementwise_numel: list[int]
    message_bytes: list[int]
    optimizer_numel: int
    min_seconds: float  # timing budget per measured point
    sample_seconds: float  # shortest sample (see `Clock.time`)
    model: ModelConfig | None = None  # the (first) model of interest: its block is the ZeRO-3 unit timed
    passes: int = 2  # timing passes over the shapes and the collectives
    compute: bool = True
    quiet: bool = False
    kinds: tuple[str, ...] = COLLECTIVES

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Plan:
        """The plan `to_json` wrote, with its shapes as tuples again."""
        data = dict(data)
        for key in ("linear", "attention", "loss"):
            data[key] = [tuple(shape) for shape in data[key]]
        data["kinds"] = tuple(data["kinds"])
        data["model"] = ModelConfig(**data["model"]) if data["model"] is not None else None
        return cls(**data)


@dataclass
class Result:
    """Figures of one group of ranks (the same on every rank: each sample lasts until the slowest is done)."""

    ranks: int
    linear: list[list[float]] = field(default_factory=list)
    attention: list[list[float]] = field(default_factory=list)
    loss: list[list[float]] = field(default_factory=list)
    elementwise: list[list[float]] = field(default_factory=list)
    kernel_overhead_us: float = 0.0
    backward_overhead_us: float = 0.0
    optimizer_gbps: float = 0.0
    optimizer_tensor_us: float = 0.0
    collectives: dict[str, dict[int, list[list[float]]]] = field(default_factory=dict)
    comm_overlap: float = 1.0
    zero3_unit_us: float = 0.0
    collective_wait: list[list[float]] = field(default_factory=list)
    posted_p2p_wait_us: float = 0.0
    seconds: float = 0.0

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Result:
        """The result `to_json` wrote, with its group sizes as numbers again (JSON keys are strings)."""
        data = dict(data)
        data["collectives"] = {k: {int(s): rows for s, rows in v.items()} for k, v in data["collectives"].items()}
        return cls(**data)


def shapes_for(models: list, seq: int, micro_batches: list[int], tps: list[int]) -> tuple[list, list, list]:
    """Linear (m, n, k) and attention (batch, heads, kv heads, seq, head dim) shapes of the models' blocks, and
    output layer + loss (tokens per chunk, vocabulary, hidden) shapes, on one tp rank, as the planner's time
    model asks for them."""
    linear: set[tuple[int, int, int]] = set()
    loss: set[tuple[int, int, int]] = set()
    attention: set[tuple[int, int, int, int, int]] = set()
    for cfg in models:
        for tp in tps:
            if tensor_parallel_problem(cfg, tp):  # a degree the engine refuses for this model
                continue
            for mbs in micro_batches:
                tokens = mbs * seq
                for m, n, k in linear_shapes(cfg, tokens, tp, fused=False):
                    linear.add((int(m), int(n), int(k)))
                chunk = min(tokens, LOSS_CHUNK_TOKENS if tp == 1 else TP_LOSS_CHUNK_TOKENS)
                loss.add((chunk, cfg.vocab_size // tp, cfg.hidden))
                attention.add((mbs, cfg.n_heads // tp, max(cfg.n_kv_heads // tp, 1), seq, cfg.head_dim))
    # the planner looks attention up by (batch x heads, seq, head dim): one shape per key
    unique = {(b * h, s, d): (b, h, kvh, s, d) for b, h, kvh, s, d in sorted(attention, reverse=True)}
    return sorted(linear), sorted(unique.values()), sorted(loss)


def make_plan(args: argparse.Namespace, device_type: str) -> tuple[Plan, list[int]]:
    """The measurement plan and the rank counts to run it with."""
    cpu = device_type == "cpu"
    names = [m.strip() for m in (args.model or ("tiny" if cpu else "llama-3.2-1b")).split(",")]
    if "" in names or len(set(names)) < len(names):
        raise CliError(f"--model {shown(args.model)} has an empty or repeated item; give presets separated by single "
                       "commas, each once (e.g. --model tiny,llama-3.2-1b)")
    models = [get_preset(n) for n in names]
    seq = args.seq_len or (128 if cpu else 4096)
    if seq < 8:
        raise CliError(f"--seq-len = {seq} must be >= 8")
    nproc = args.nproc_max or (4 if cpu else max(torch.accelerator.device_count(), 1))
    if args.quick:
        nproc = min(nproc, 2) if args.nproc_max == 0 else nproc
    if nproc < 1:
        raise CliError(f"--nproc-max = {nproc} must be >= 1")
    if not cpu and nproc > torch.accelerator.device_count():
        raise CliError(f"--nproc-max = {nproc} exceeds the {torch.accelerator.device_count()} {device_type} "
                          "devices of this machine")
    if args.threads < 0:
        raise CliError(f"--threads = {args.threads} must be >= 1 (or 0: each rank's share of the cores)")
    tps = [t for t in (1, 2, 4, 8) if t <= nproc]
    if args.quick:
        mbs, sizes, elem = [2], [4 * KIB, 1024 * KIB], [2**12, 2**20]
        min_seconds, opt_numel = 0.003, 2**16
    else:
        mbs = [1, 2, 4, 8, 16, 32] if cpu else [1, 2, 4, 8]
        sizes = [4 * KIB * 4**i for i in range(7)]  # 4 KiB .. 16 MiB
        elem = [2**i for i in range(10, 25, 2)]
        min_seconds, opt_numel = 0.05, 2**21
    linear, attention, loss = shapes_for(models, seq, mbs, tps)
    plan = Plan(device_type, args.threads, linear, attention, loss, elem, sizes, opt_numel, min_seconds,
                0.005 if args.quick else 0.03, model=models[0], passes=1 if args.quick else 2)
    return plan, list(range(1, nproc + 1))


def for_group(plan: Plan, ranks: int) -> Plan:
    """The plan for `ranks` at once: on an accelerator each rank has its own device, so compute is measured
    with one rank only; on a CPU each rank runs the intra-op threads `fivefold train` gives as many local processes
    (`train.loop.threads_per_process`: `--threads`, or 0, their share of the cores)."""
    from fivefold.train.loop import threads_per_process

    return dataclasses.replace(plan, compute=plan.device_type == "cpu" or ranks == 1,
                               threads=threads_per_process(plan.threads, ranks))
