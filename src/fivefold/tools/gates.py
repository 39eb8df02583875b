"""The gates of `fivefold plan validate`: the stall-aware step time, the clean runs, the stall rate and the ranking,
by node count, each with its figure and whether it holds (docs/planner.md, "Gates").

Every rule here was fixed on the 1-2-node rows of the playbook's runs before the held-out rows were scored with
it; the bounds are the issue's (32). What each figure compares:

* stall-aware step time: the p50 step time (`Estimate.step_time_at(0.5)`: the clean time, or the stalled one
  where the chance of a stall passes one half) against every finished run;
* clean runs: the clean prediction against the runs that did not stall (`is_stalled`);
* stall rate: the mean predicted chance of a stall of the pipelined runs against the share that stalled; the
  stalled runs' time: the clean time + what a stall adds, against the stalled runs;
* ranking: inside each (model, nodes) group, the Spearman correlation of the p50 tokens/s (each run's point
  prediction, as for the step time) with the measured, and the top-1 regret of the pick of `plan`'s rank rule
  (the best expected tokens/s among the rows predicted to fit) against the best clean run of the group (a pick
  that crashed: 100 %).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass

from fivefold.planner.score import spearman
from fivefold.planner.time import StallRisk

# Fixed on the 1-2-node rows before the held-out rows were looked at: a pipelined run stalled when its measured
# step exceeds the clean prediction by more than this per hand-over (there: the 113 clean pipelined runs by at
# most 0.014 s, the 10 stalled ones by at least 0.239 s; 0.1 s lies between, nearer the clean side)
STALL_EXCESS_PER_HANDOVER_S = 0.1

# the bounds: (label, bound, node counts it applies to; None: every held-out node count)
ALL_TIME_BOUND = 0.15  # the median over every held-out row
ALL_TIME_BY_NODES = {4: 0.11, 8: 0.11, 16: 0.11, 32: 0.18}  # 64 nodes reported, not gated
CLEAN_BOUND, CLEAN_NODES = 0.10, (4, 8, 16, 32)
CLEAN_SIGNED_BOUND = 0.07  # at every held-out node count
STALL_RATE_BOUND = 0.15  # at every held-out node count
STALLED_TIME_BOUND = 0.15  # the median over every stalled held-out row
SPEARMAN_BOUND, SPEARMAN_NODES = 0.85, (4, 8, 16, 32)
REGRET_BOUND = 0.10  # the median over every held-out group


@dataclass(frozen=True)
class Record:
    """One run and its prediction: the clean and stalled step times, the chance of a stall, what the rank rule
    ranks by, and what was measured (`ok` False: it crashed or ran out of memory; times then 0)."""

    nodes: int
    group: tuple
    ok: bool
    fits: bool
    handovers: int  # 0 without a pipeline
    clean_s: float
    stalled_s: float
    stall_probability: float
    measured_s: float
    tokens_per_device: float  # tokens per step per device

    @property
    def risk(self) -> StallRisk:
        return StallRisk(self.stall_probability, self.stalled_s - self.clean_s, self.handovers)

    @property
    def p50_s(self) -> float:
        return self.risk.quantile(self.clean_s, 0.5)

    @property
    def expected_s(self) -> float:
        return self.risk.expected(self.clean_s)

    @property
    def measured_tok_s(self) -> float:
        return self.tokens_per_device / self.measured_s if self.measured_s else 0.0


def is_stalled(r: Record) -> bool:
    """A pipelined run whose measured step exceeds the clean prediction by `STALL_EXCESS_PER_HANDOVER_S` per
    hand-over."""
    return r.ok and r.handovers > 0 and r.measured_s - r.clean_s > STALL_EXCESS_PER_HANDOVER_S * r.handovers


@dataclass
class Gate:
    """One line of the gates: its figure by node count (and over all held-out rows), each with its bound (None:
    reported, not gated) and whether it holds."""

    label: str
    percent: bool  # the figure is a share (printed in %), else a plain number
    by_nodes: dict[int, tuple[float, float | None]]
    overall: tuple[float, float | None] | None = None
    signed: bool = False  # the bound is on the absolute value
    at_least: bool = False  # the figure must reach the bound (else: stay below it)

    def holds(self, figure: float, bound: float | None) -> bool | None:
        if bound is None or figure != figure:  # not gated, or no rows (NaN)
            return None
        if self.at_least:
            return figure >= bound
        return (abs(figure) if self.signed else figure) <= bound

    @property
    def all_hold(self) -> bool:
        cells = list(self.by_nodes.values()) + ([self.overall] if self.overall else [])
        return all(self.holds(f, b) is not False for f, b in cells)


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _group_figures(records: list[Record]) -> dict[tuple, tuple[float, float]]:
    """(Spearman, top-1 regret) of each group (NaN where it has fewer than 3 finished rows, or no clean run)."""
    groups: dict[tuple, list[Record]] = defaultdict(list)
    for r in records:
        groups[r.group].append(r)
    out = {}
    for g, rows in groups.items():
        ok = [r for r in rows if r.ok]
        rho = spearman([r.tokens_per_device / r.p50_s for r in ok], [r.measured_tok_s for r in ok]) \
            if len(ok) >= 3 else float("nan")
        clean = [r.measured_tok_s for r in ok if not is_stalled(r)]
        fit = [r for r in rows if r.fits]
        regret = float("nan")
        if clean and fit:
            pick = max(fit, key=lambda r: r.tokens_per_device / r.expected_s)
            regret = 1 - pick.measured_tok_s / max(clean) if pick.ok else 1.0
        out[g] = (rho, regret)
    return out


def gates(records: list[Record]) -> list[Gate]:
    """The gates over these (held-out) records, by node count."""
    nodes = sorted({r.nodes for r in records})
    ok = [r for r in records if r.ok and r.measured_s > 0]
    at = {n: [r for r in ok if r.nodes == n] for n in nodes}
    err = lambda p, r: p / r.measured_s - 1  # noqa: E731 - predicted / measured - 1
    clean = {n: [r for r in rows if not is_stalled(r)] for n, rows in at.items()}
    stalled = {n: [r for r in rows if is_stalled(r)] for n, rows in at.items()}
    piped = {n: [r for r in rows if r.handovers > 0] for n, rows in at.items()}
    groups = _group_figures(records)
    by_group_nodes: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for g, figures in groups.items():
        by_group_nodes[next(r.nodes for r in records if r.group == g)].append(figures)

    def stall_rate(n: int) -> float:
        rows = piped[n]
        if not rows:
            return float("nan")
        return statistics.fmean(r.stall_probability for r in rows) - sum(map(is_stalled, rows)) / len(rows)

    rhos = [rho for n in SPEARMAN_NODES for rho, _ in by_group_nodes.get(n, []) if rho == rho]
    regrets = [g for n in nodes for _, g in by_group_nodes[n] if g == g]
    return [
        Gate("stall-aware step time (p50), median |error|", True,
             {n: (_median([abs(err(r.p50_s, r)) for r in at[n]]), ALL_TIME_BY_NODES.get(n)) for n in nodes},
             (_median([abs(err(r.p50_s, r)) for r in ok]), ALL_TIME_BOUND)),
        Gate("clean runs, median |error|", True,
             {n: (_median([abs(err(r.clean_s, r)) for r in clean[n]]), CLEAN_BOUND if n in CLEAN_NODES else None)
              for n in nodes}),
        Gate("clean runs, signed median error", True,
             {n: (_median([err(r.clean_s, r) for r in clean[n]]), CLEAN_SIGNED_BOUND) for n in nodes}, signed=True),
        Gate("stall rate, predicted - observed", False, {n: (stall_rate(n), STALL_RATE_BOUND) for n in nodes},
             signed=True),
        Gate("stalled runs' time, median |error|", True,
             {n: (_median([abs(err(r.stalled_s, r)) for r in stalled[n]]), None) for n in nodes},
             (_median([abs(err(r.stalled_s, r)) for n in nodes for r in stalled[n]]), STALLED_TIME_BOUND)),
        Gate("per-group Spearman (p50 tok/s), median", False,
             {n: (_median([rho for rho, _ in by_group_nodes[n] if rho == rho]),
                  SPEARMAN_BOUND if n in SPEARMAN_NODES else None) for n in nodes},
             (_median(rhos), SPEARMAN_BOUND), at_least=True),
        Gate("top-1 regret vs the best clean run, median", True,
             {n: (_median([g for _, g in by_group_nodes[n] if g == g]), None) for n in nodes},
             (_median(regrets), REGRET_BOUND)),
    ]


def stall_counts(records: list[Record]) -> dict[int, tuple[int, int, float]]:
    """By node count: stalled runs, pipelined finished runs, and the mean predicted chance of a stall."""
    out = {}
    for n in sorted({r.nodes for r in records}):
        piped = [r for r in records if r.nodes == n and r.ok and r.handovers > 0]
        out[n] = (sum(map(is_stalled, piped)), len(piped),
                  statistics.fmean(r.stall_probability for r in piped) if piped else float("nan"))
    return out


def format_gates(table: list[Gate]) -> list[str]:
    """The gates as lines: one per gate, its figure at each node count and over all held-out rows, each marked ok,
    FAIL, or nothing where it is reported and not gated."""
    nodes = sorted({n for g in table for n in g.by_nodes})
    lines = [f"{'gate':46s} " + " ".join(f"{str(n) + ' nodes':>13s}" for n in nodes) + f" {'all held out':>13s}"]

    def cell(g: Gate, figure: float, bound: float | None) -> str:
        if figure != figure:
            return f"{'-':>13s}"
        text = f"{100 * figure:+.1f} %" if g.percent and g.signed else (
            f"{100 * figure:.1f} %" if g.percent else f"{figure:+.2f}" if g.signed else f"{figure:.3f}")
        mark = {True: " ok", False: " FAIL", None: ""}[g.holds(figure, bound)]
        return f"{text + mark:>13s}"

    for g in table:
        row = " ".join(cell(g, *g.by_nodes[n]) if n in g.by_nodes else f"{'':13s}" for n in nodes)
        lines.append(f"{g.label:46s} {row} " + (cell(g, *g.overall) if g.overall else f"{'':13s}"))
    return lines
