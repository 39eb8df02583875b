"""How far the planner's stall-aware step-time model, fitted on the playbook's 1-2-node runs, can get on its 4-64-node
runs, and how far its form could get with its constants chosen on those runs themselves.

`fivefold plan validate` holds out the 1,538 finished runs of 4-64 nodes; a median step-time error of at most 15 %
there needs 769 of them within 15 %. The model (`planner/time.py`): a clean step time, times (1 + d) per doubling of
the nodes, and with chance 1 - (1 - h)^nodes a stall that adds a fixed time per pipeline hand-over; the point
prediction of a run is the p50 (the stalled time where a stall is more likely than not). This script prints how
many held-out runs are within 15 % for

* the planner as fitted (the packaged profile): the clean time, and the stall-aware p50;
* the same form with d and h chosen on the held-out rows (an oracle: what the form can express at best);
* a perfect stall classifier (each pipelined run predicted stalled exactly when it stalled, `tools/gates.py`'s
  rule) with the fitted drift, and with the best factor per node count on top (oracles: the bound of any model
  that predicts a run's stall only as a chance);
* repeats: one value per layout (runs that differ only in ZeRO 0/1 share it), the best for each.

and the stall rate by node count: observed, predicted by the per-node hazard (the fitted rule), and by a hazard per
node that one pipeline stage spans (chosen after looking at the held-out rates; fitted on the 1-2-node rows).

    python benchmarks/playbook_heldout_bounds.py [--data playbook_benchmark_runs.csv]
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections import defaultdict
from pathlib import Path

from fivefold.planner.search import estimate
from fivefold.planner.time import handovers
from fivefold.tools import validate
from fivefold.tools.gates import is_stalled

BAND = 0.15


def within(pred: list[float], meas: list[float]) -> int:
    return sum(abs(p / m - 1) <= BAND for p, m in zip(pred, meas, strict=True))


def best_within(meas: list[float]) -> int:
    """The most of these measurements that one predicted value can be within 15 % of."""
    t = sorted(meas)
    best, j = 0, 0
    for i in range(len(t)):
        while j < len(t) and t[j] / t[i] <= (1 + BAND) / (1 - BAND):
            j += 1
        best = max(best, j - i)
    return best


def p50(clean: float, added: float, probability: float) -> float:
    return clean + added if probability > 0.5 else clean


def hazard_mle(piped: list[tuple[float, bool]]) -> float:
    """The per-unit hazard h of (exposure, stalled) pairs: chance 1 - (1 - h)^exposure, by maximum likelihood."""
    return max((i / 10000 for i in range(1, 5000)), key=lambda h: sum(
        math.log(1 - (1 - h) ** x) if s else x * math.log(1 - h) for x, s in piped))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=validate.DEFAULT_DATA)
    args = ap.parse_args()
    fw, hw = validate.load_profile(None)
    runs = [r for r in validate.read_runs_csv(args.data) if r.ok and r.measured_step_time > 0]
    est = [estimate(r.model, r.seq, r.layout, fw, hw, True) for r in runs]  # as `plan validate`
    recs = [validate.record(r, e) for r, e in zip(runs, est, strict=True)]
    held = [i for i, r in enumerate(runs) if r.nodes not in validate.FIT_NODES]
    meas = [runs[i].measured_step_time for i in held]
    drift = hw.drift_per_node_doubling
    base = [recs[i].clean_s / (1 + drift) ** math.log2(runs[i].nodes) for i in held]  # without the drift
    added = [recs[i].stalled_s - recs[i].clean_s for i in held]
    nodes = [runs[i].nodes for i in held]
    n = len(held)
    print(f"held-out finished runs: {n}; a median error of at most 15 % needs {math.ceil(n / 2)} within 15 %")

    def report(name: str, pred: list[float]) -> None:
        errors = [abs(p / m - 1) for p, m in zip(pred, meas, strict=True)]
        print(f"  {name:58s} {within(pred, meas):5d} within 15 %, median error {100 * statistics.median(errors):.1f} %")

    report("the planner, clean time:", [recs[i].clean_s for i in held])
    report("the planner, stall-aware p50 (as fitted):", [recs[i].p50_s for i in held])
    best = max(((d / 200, h / 1000) for d in range(0, 11) for h in range(5, 101, 5)),
               key=lambda dh: within([p50(b * (1 + dh[0]) ** math.log2(k), a, 1 - (1 - dh[1]) ** k)
                                      for b, a, k in zip(base, added, nodes, strict=True)], meas))
    d, h = best
    report(f"oracle, the form, d = {100 * d:.1f} %, h = {h:.3f} chosen on held-out rows:",
           [p50(b * (1 + d) ** math.log2(k), a, 1 - (1 - h) ** k) for b, a, k in zip(base, added, nodes, strict=True)])
    stalled = [is_stalled(recs[i]) for i in held]
    known = [recs[i].stalled_s if s else recs[i].clean_s for i, s in zip(held, stalled, strict=True)]
    report("oracle, a perfect stall classifier:", known)
    by_nodes = defaultdict(list)
    for j, k in enumerate(nodes):
        by_nodes[k].append(j)
    total, detail = 0, []
    for k, js in sorted(by_nodes.items()):
        count, factor = max((within([known[j] * f for j in js], [meas[j] for j in js]), f)
                            for f in (0.8 + 0.01 * i for i in range(81)))
        total += count
        detail.append(f"{k}: {count}/{len(js)} x{factor:.2f}")
    print(f"  {'oracle, a perfect stall classifier x node count:':58s} {total:5d} ({', '.join(detail)})")
    layouts = defaultdict(list)
    for j, i in enumerate(held):
        r = runs[i]
        layouts[(r.model.name, r.nodes, r.layout.dp, r.layout.tp, r.layout.pp, r.layout.micro_batch_size,
                 r.layout.grad_accum_steps)].append(meas[j])
    twice = sum(len(g) > 1 for g in layouts.values())
    print(f"  {'oracle, repeats:':58s} {sum(map(best_within, layouts.values())):5d} (one value per layout, "
          f"{twice} layouts ran more than once)")
    stall_rates(runs, recs, hw)


def stall_rates(runs: list, recs: list, hw) -> None:
    """Observed and predicted stall rates of the pipelined runs by node count: the fitted per-node hazard, and a
    hazard per node that one pipeline stage spans (dp x tp GPUs / GPUs per node), fitted on the 1-2-node rows."""
    piped = [(r, x) for r, x in zip(runs, recs, strict=True) if handovers(r.layout)]
    span = lambda r: r.layout.dp * r.layout.tp / hw.gpus_per_node  # noqa: E731 - nodes one stage spans
    fitted = [(span(r), is_stalled(x)) for r, x in piped if r.nodes in validate.FIT_NODES]
    h_span = hazard_mle(fitted)
    per_node = hw.stall_hazard_per_node
    print(f"stall rate of the pipelined runs, observed / per-node hazard {per_node} / per stage-span hazard "
          f"{h_span:.4f} (after looking):")
    for k in sorted({r.nodes for r, _ in piped}):
        rows = [(r, x) for r, x in piped if r.nodes == k]
        observed = sum(is_stalled(x) for _, x in rows) / len(rows)
        by_span = statistics.fmean(1 - (1 - h_span) ** span(r) for r, _ in rows)
        print(f"  {k:3d} nodes: {observed:.2f} / {1 - (1 - per_node) ** k:.2f} / {by_span:.2f} ({len(rows)} runs)")


if __name__ == "__main__":
    main()
