"""The bubble of each pipeline schedule, measured on the real executor, next to its closed form.

p gloo ranks (spawned here) run `PipelineExecutor` over equal synthetic stages whose forward sleeps t_f, whose
input-gradient pass sleeps t_b and whose weight-gradient pass sleeps t_w (so a whole backward is t_b + t_w = 2
t_f, the playbook's assumption); an interleaved or V-shaped chunk is 1/v of a stage and sleeps 1/v as long. The
stages pass real tensors between ranks with the executor's point-to-point sends, so transfer latency is in the
figures. Each schedule runs --repeats times after a barrier; per run, the makespan is the first action's start
to the last action's end over all ranks (one clock: the ranks share a machine) and the busy time is the
busiest rank's measured work: its compute and the host time it spends posting its point-to-point operations
(each action's send and the receives after it; printed per action, as the last column), so that the bubble is
the time ranks wait for each other, and

    bubble = (makespan - busy) / busy

(the simulator's and the playbook's ratio; the closed forms are (p-1)/m for AFAB and 1F1B and (p-1)/(v m) for
interleaved). The median run is printed. Each forward also allocates --activation-mib of "activations" that
its backward frees (B; with a split backward the W pass still runs later), and the peak bytes each rank holds
at once are recorded: AFAB holds all m micro-batches, 1F1B at most p - r on rank r.

    python benchmarks/pipeline_bubble.py --pp 4 --micro-batches 8 --t-f 0.04

The executor runs with `layout.pp_comm_overlap` off by default, the order the closed forms assume; with
`--pp-comm-overlap on` (training's default) a whole backward sends its input gradient before its weight
gradients, and the check is that no bubble exceeds its closed form by more than 10 %.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from cp_memory import run_on_ranks

from fivefold.parallel.pipeline import PipelineExecutor
from fivefold.parallel.schedules import build_schedule, closed_form_bubble, simulate

MIB = 2**20
CASES = [("afab", 1), ("1f1b", 1), ("interleaved", 2), ("zero-bubble", 1), ("dualpipev", 2)]


class SleepStage:
    """A stage of known times that holds `activation_bytes` from its forward until its backward."""

    def __init__(self, t_f: float, t_b: float, t_w: float, activation_bytes: int, memory: dict,
                 last: bool) -> None:
        self.t_f, self.t_b, self.t_w, self.bytes, self.memory, self.last = t_f, t_b, t_w, activation_bytes, memory, last
        self.held: dict[int, torch.Tensor] = {}

    def forward(self, mb: int, x: torch.Tensor | None) -> torch.Tensor | None:
        time.sleep(self.t_f)
        self.held[mb] = torch.empty(self.bytes // 4)  # not touched: the benchmark times sleeps, not memory
        self.memory["held"] += self.bytes
        self.memory["peak"] = max(self.memory["peak"], self.memory["held"])
        return None if self.last else torch.zeros(1024)

    def backward_input(self, mb: int, grad: torch.Tensor | None) -> torch.Tensor:
        time.sleep(self.t_b)
        del self.held[mb]
        self.memory["held"] -= self.bytes
        return torch.zeros(1024)

    def backward_weight(self, mb: int) -> None:
        time.sleep(self.t_w)


def measure(rank: int, p: int, args: argparse.Namespace) -> list[tuple]:
    group = dist.new_group(list(range(p)))
    rows = []
    for name, v in CASES:
        schedule = build_schedule(name, p, args.micro_batches, v if name == "interleaved" else 1)
        v = schedule.v
        runs, peaks = [], []
        for _ in range(args.repeats):
            memory = {"held": 0, "peak": 0}
            stages = {s: SleepStage(args.t_f / v, args.t_f / v, args.t_f / v, args.activation_mib * MIB // v, memory,
                                    s == schedule.n_stages - 1)
                      for s, r in enumerate(schedule.stage_rank) if r == rank}
            executor = PipelineExecutor(group, rank, (1024,), torch.float32, torch.device("cpu"),
                                        overlap=args.pp_comm_overlap == "on")
            dist.barrier()
            trace = executor.run(schedule, stages)
            mine = (min(r.start for r in trace), max(r.end for r in trace), sum(r.end - r.start for r in trace),
                    sum(r.posted for r in trace), len(trace))
            everyone = [None] * p
            dist.all_gather_object(everyone, (mine, memory["peak"]))
            start = min(e[0][0] for e in everyone)
            end = max(e[0][1] for e in everyone)
            busy = max(e[0][2] for e in everyone)
            runs.append(((end - start - busy) / busy, sum(e[0][3] for e in everyone) / sum(e[0][4] for e in everyone)))
            peaks = [e[1] for e in everyone]
        sim = simulate(schedule, args.t_f / v, args.t_f / v, args.t_f / v)
        closed = closed_form_bubble(name, p, args.micro_batches, v) if name in ("afab", "1f1b", "interleaved") \
            else None
        bubble = statistics.median(b for b, _ in runs)
        rows.append((name, v, bubble, sim.bubble, closed, peaks, statistics.median(t for _, t in runs)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--t-f", type=float, default=0.04, help="seconds of one stage's forward of one micro-batch")
    parser.add_argument("--activation-mib", type=int, default=16, help="held per stage and micro-batch in flight")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pp-comm-overlap", choices=["on", "off"], default="off",
                        help="layout.pp_comm_overlap (training's default is on: a whole backward sends its input "
                             "gradient before it computes its weight gradients, so the previous stage starts "
                             "sooner and the bubble falls below the closed form, which assumes whole backwards)")
    args = parser.parse_args()
    p, m = args.pp, args.micro_batches
    print(f"pp = {p} ranks (gloo), m = {m} micro-batches, t_f = {args.t_f * 1e3:.0f} ms, t_b = t_w = t_f "
          f"(a whole backward 2 t_f), {args.activation_mib} MiB of activations per stage and micro-batch, "
          f"median of {args.repeats} runs, pp_comm_overlap {args.pp_comm_overlap}")
    rows = run_on_ranks(p, measure, args)
    print("\n| schedule | v | measured bubble | simulated | closed form | measured / closed | peak activations "
          "held per rank (MiB) | posting per action (ms) |\n|---|---|---|---|---|---|---|---|")
    results = {}
    for name, v, measured, simulated, closed, peaks, posting in rows:
        results[name] = measured
        ratio = f"{measured / closed:.3f}" if closed else "-"
        closed_text = f"{closed:.4f}" if closed is not None else "-"
        held = ", ".join(f"{b / MIB:.0f}" for b in peaks)
        print(f"| {name} | {v} | {measured:.4f} | {simulated:.4f} | {closed_text} | {ratio} | {held} | "
              f"{posting * 1e3:.2f} |")
    print()
    ok = True
    for name, _, measured, _, closed, _, _ in rows:
        if closed is not None:
            if args.pp_comm_overlap == "off":
                within = abs(measured - closed) <= 0.1 * closed
                verdict = "within" if within else "NOT within"
            else:  # the overlap may only take off the closed form
                within = measured <= 1.1 * closed
                verdict = "at most" if within else "NOT at most"
            ok &= within
            print(f"{name}: measured {measured:.4f} vs closed form {closed:.4f}: {verdict} 10 % above"
                  if args.pp_comm_overlap == "on" else
                  f"{name}: measured {measured:.4f} vs closed form {closed:.4f}: {verdict} 10 %")
    for name in ("zero-bubble", "dualpipev"):
        below = results[name] < results["1f1b"]
        ok &= below
        print(f"{name}: measured {results[name]:.4f} {'<' if below else '>='} 1f1b's {results['1f1b']:.4f}")
    afab, one = rows[0][5], rows[1][5]
    print(f"in-flight activations at peak: AFAB {max(afab) / MIB:.0f} MiB per rank (all {m} micro-batches), 1F1B "
          f"{', '.join(f'{b / MIB:.0f}' for b in one)} MiB on ranks 0..{p - 1} (p - r micro-batches)")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
