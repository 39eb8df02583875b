"""`fivefold plan scaling`: predicted throughput, MFU and scaling efficiency of a model over a series of node
counts, for the best layout at each size (or one fixed layout whose data-parallel degree grows with the nodes).

* `--weak`: the global batch grows with the nodes (the given `--global-batch` is the batch of the first size);
* `--strong`: the global batch stays as given.

Efficiency at N nodes is the throughput per GPU at N over the throughput per GPU at the first size: for weak
scaling the usual definition (time per step at the first size over time per step at N), for strong scaling
speed-up over the ideal speed-up (N / N0).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from pathlib import Path

from fivefold.config import ModelConfig, shown
from fivefold.errors import CliError
from fivefold.flops import DocumentLengths
from fivefold.outputs import keep_previous
from fivefold.planner.hardware import Cluster
from fivefold.planner.layout import Framework, Layout, check_runs_hsdp, parse_layout
from fivefold.planner.search import (
    MAX_BATCH_SEQUENCES,
    Estimate,
    SearchPool,
    SearchSpace,
    announce_search,
    estimate,
    search,
)


@dataclasses.dataclass
class Point:
    nodes: int
    gpus: int
    global_batch_seqs: int
    best: Estimate | None  # None: no layout fits or reaches the batch at this size
    reason: str = ""

    def to_json(self, base_tps: float | None) -> dict:
        out: dict = {"nodes": self.nodes, "gpus": self.gpus, "global_batch_seqs": self.global_batch_seqs}
        if self.best is None:
            out["error"] = self.reason
            return out
        e = self.best
        out.update({"layout": e.layout.short(), "layout_knobs": e.layout.to_dict(), "step_time_s": e.step_time_s,
                    "tokens_per_s": e.tokens_per_s_per_device * self.gpus,
                    "tokens_per_s_per_gpu": e.tokens_per_s_per_device, "mfu": e.mfu,
                    "efficiency": typical_tps(e) / base_tps if base_tps else None, **e.risk_json()})
        return out


MAX_SCALING_POINTS = 32


def parse_nodes(text: str) -> list[int]:
    if any(not x.strip() for x in text.split(",")):
        raise CliError(f"--nodes {shown(text)} has an empty item; give node counts separated by single commas, "
                       "e.g. 1,2,4,8")
    try:
        nodes = [int(x) for x in text.split(",")]
    except ValueError:
        raise CliError(f"--nodes {shown(text)} must be a comma-separated list of node counts, e.g. 1,2,4,8") from None
    if not nodes or any(n < 1 for n in nodes) or nodes != sorted(set(nodes)):
        raise CliError(f"--nodes {shown(text)} must be increasing node counts >= 1, e.g. 1,2,4,8,16")
    if len(nodes) > MAX_SCALING_POINTS:
        raise CliError(f"--nodes lists {len(nodes)} node counts; a scaling plot takes at most {MAX_SCALING_POINTS} "
                       "(each is a whole layout search), e.g. powers of two")
    return nodes


def scale_layout(lay: Layout, gpus: int, batch_seqs: int) -> Layout:
    """`lay` on `gpus` devices: tp, pp, cp, ep and the micro-batch kept, dp = the rest, grad_acc from the batch."""
    model_parallel = lay.tp * lay.pp * lay.cp
    if gpus % model_parallel:
        raise CliError(f"--layout tp x pp x cp = {model_parallel} does not divide {gpus} GPUs; choose node "
                       "counts whose GPUs it divides")
    dp = gpus // model_parallel
    if batch_seqs % (dp * lay.micro_batch_size):
        raise CliError(f"--layout on {gpus} GPUs: dp x micro_batch_size = {dp} x {lay.micro_batch_size} does not "
                       f"divide the global batch of {batch_seqs} sequences; use a smaller micro_batch_size or a "
                       f"batch that is a multiple of {dp * lay.micro_batch_size} sequences")
    out = dataclasses.replace(lay, dp=dp, grad_accum_steps=batch_seqs // (dp * lay.micro_batch_size))
    if lay.dp_shard and dp <= lay.dp_shard:  # one shard group holds every dp rank: plain FSDP
        return dataclasses.replace(out, dp_shard=0)
    if lay.dp_shard and dp % lay.dp_shard:
        raise CliError(f"--layout dp_shard = {lay.dp_shard} does not divide dp = {dp} on {gpus} GPUs; choose node "
                          "counts whose dp it divides")
    return out


def typical_tps(e: Estimate) -> float:
    """Tokens/s per device at the p50 step time (the clean one unless a stall is more likely than not)."""
    return e.tokens_per_s_at(e.step_time_at(0.5))


def check_weak(batch_seqs: int, nodes: list[int]) -> None:
    """Weak scaling's batch, `batch_seqs` sequences at the first node count, grows to a whole number of sequences
    at every other, within the planner's limit."""
    if batch_seqs * nodes[-1] // nodes[0] > MAX_BATCH_SEQUENCES:
        raise CliError(f"--weak: the batch of {batch_seqs:,} sequences at {nodes[0]} node(s) grows to "
                       f"{batch_seqs * nodes[-1] // nodes[0]:,} at {nodes[-1]}; the planner takes at most "
                       f"{MAX_BATCH_SEQUENCES:,} sequences per step: a smaller --global-batch or fewer nodes")
    for n in nodes:
        if batch_seqs * n % nodes[0]:
            raise CliError(f"--weak: the batch of {batch_seqs} sequences at {nodes[0]} nodes does not scale to a "
                           f"whole number of sequences at {n} nodes; choose node counts that are multiples of "
                           f"{nodes[0]}")


def scaling(cfg: ModelConfig, seq: int, batch_seqs: int, nodes: list[int], weak: bool, fw: Framework, hw: Cluster,
            space: SearchSpace, layout: str | None = None, docs: DocumentLengths | None = None,
            rank: str = "expected", announce: bool = False) -> list[Point]:
    """The best layout at each node count; `announce`: a long search says so on stderr (`announce_search`). One
    pool of processes (`SearchPool`) serves the searches of every node count."""
    if weak:
        check_weak(batch_seqs, nodes)
    points = []
    with SearchPool() as pool:
        for n in nodes:
            gpus = n * hw.gpus_per_node
            batch = batch_seqs * n // nodes[0] if weak else batch_seqs
            if layout:
                lay = parse_layout(layout, batch, fw.default_fp32_grad_accum if space.fp32_grad_accum is None
                                   else space.fp32_grad_accum, dp_given=False)
                check_runs_hsdp(lay, fw)
                lay = scale_layout(lay, gpus, batch)
                e = estimate(cfg, seq, lay, fw, hw, True, docs=docs)
                points.append(Point(n, gpus, batch, e if e.fits else None,
                                    "" if e.fits else f"{lay.short()} does not fit ({e.peak_bytes / 2**30:.1f} GiB)"))
                continue
            result = search(cfg, seq, batch, gpus, fw, hw, space, 1, docs=docs, rank=rank,
                            progress=announce_search(f"{n} node{'s' if n > 1 else ''}: ") if announce else None,
                            pool=pool)
            if result.candidates:
                points.append(Point(n, gpus, batch, result.candidates[0]))
            else:
                reason = result.rejected.most_common(1)[0][0] if result.rejected else "no layout reaches the batch"
                points.append(Point(n, gpus, batch, None, reason))
    return points


def report(points: list[Point], unit: str = "GPU", risk: bool = False) -> tuple[float | None, list[str]]:
    """The table's lines (with `risk`, a cluster with stall data: p50 step time and tokens/s, then the p90 step
    time and the chance of a stall), and the first size's tokens/s per device that the efficiency divides by."""
    base = next((typical_tps(p.best) for p in points if p.best is not None), None)
    lines = [f"{'nodes':>5s} {unit + 's':>6s} {'batch':>7s} {'layout':50s} {'p50 s' if risk else 'step s':>8s} "
             f"{'tokens/s':>12s} {'tok/s/' + unit:>10s} {'MFU %':>6s} {'eff %':>6s}"
             + (f" {'p90 s':>8s} {'stall %':>7s}" if risk else "")]
    for p in points:
        if p.best is None:
            lines.append(f"{p.nodes:5d} {p.gpus:6d} {p.global_batch_seqs:7d} {'(none: ' + p.reason + ')'}")
            continue
        e = p.best
        tps = typical_tps(e)
        eff = 100 * tps / base if base else float("nan")
        lines.append(f"{p.nodes:5d} {p.gpus:6d} {p.global_batch_seqs:7d} {e.layout.short():50s} "
                     f"{e.step_time_at(0.5):8.3f} {tps * p.gpus:12,.0f} "
                     f"{tps:10,.0f} "
                     f"{100 * e.mfu * tps / e.tokens_per_s_per_device:6.1f} {eff:6.1f}"
                     + (f" {e.step_time_at(0.9):8.3f} {100 * e.stall.probability:7.1f}" if risk else ""))
    return base, lines


def plot(points: list[Point], base: float, path: str, title: str) -> bool:
    """A PNG of efficiency by nodes, when matplotlib is installed (False when it is not)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    xs = [p.nodes for p in points if p.best is not None]
    ys = [100 * typical_tps(p.best) / base for p in points if p.best is not None]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(xs, ys, marker="o")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("nodes")
    ax.set_ylabel("scaling efficiency (%)")
    ax.set_ylim(0, 105)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def run_scaling(args: argparse.Namespace, cfg: ModelConfig, fw: Framework, hw: Cluster, space: SearchSpace,
                seq: int, batch_seqs: int, docs: DocumentLengths | None = None, preface: tuple[str, ...] = ()) -> int:
    """`preface`: lines printed above the table (not with --json), once every node count has been judged, so that
    an error at any of them (the weak batch's included, `check_weak`) is the command's only output."""
    if args.weak == args.strong:
        raise CliError("plan scaling needs exactly one of --weak (the batch grows with the nodes) or --strong "
                          "(the batch stays)")
    nodes = parse_nodes(args.nodes_list)
    rank = getattr(args, "rank", "expected")
    points = scaling(cfg, seq, batch_seqs, nodes, args.weak, fw, hw, space, args.layout, docs, rank, announce=True)
    if not args.json:
        for line in preface:
            print(line)
    risk = hw.has_stall_data
    base, lines = report(points, hw.unit, risk)
    mode = "weak" if args.weak else "strong"
    if args.json:
        print(json.dumps({"model": cfg.name, "hardware": hw.name, "framework": fw.name, "mode": mode, "seq_len": seq,
                          "compiled": fw.compiled, "points": [p.to_json(base) for p in points]},
                         indent=2))
    else:
        print(f"{cfg.name}, {mode} scaling on {hw.name} ({hw.gpus_per_node} {hw.unit}s per node), {fw.name} engine, "
              f"seq {seq}; efficiency = tokens/s per {hw.unit} over the first size's")
        print("\n".join(lines))
        given_dp = re.search(r"(?:^|,)\s*dp\s*=\s*(\d+)", args.layout or "")
        if given_dp and any(p.best and p.best.layout.dp != int(given_dp[1]) for p in points):
            print(f"--layout dp = {given_dp[1]} is not kept: at each size dp is the {hw.unit}s over tp x pp x cp "
                  "(the table's layouts); tp, pp, cp, ep, the micro-batch, ZeRO and recompute are kept")
        if nodes[-1] > 1 and not risk and not hw.drift_per_node_doubling:
            print(f"{hw.name} has no stall or drift data: every size is predicted as a clean run with collectives as "
                  "fast as measured alone (on the playbook's cluster, --hardware src/fivefold/planner/profiles/"
                  "nanotron-h100-efa.toml, pipelined steps stall more often as the nodes grow, and the clean step "
                  "drifts 1 % slower per doubling)")
        elif risk:
            print(f"ranked by the {rank} step time; p50: the typical step, p90: the bad case (a stall at every "
                  "pipeline hand-over), stall %: the chance that a step stalls")
    if args.png and base:
        backup = keep_previous(args.png)  # checked before the computation (`cli.plan`); a file there is kept
        if backup is not None:
            print(f"kept the previous {args.png} as {backup}")
        if plot(points, base, args.png, f"{cfg.name} {mode} scaling ({fw.name}, {hw.name})"):
            print(f"wrote {args.png}")
        else:
            print("--png: matplotlib is not installed; no plot written")
    return 0
