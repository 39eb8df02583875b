"""Plain-words reasons for the pick: which constraint binds, which alternatives came close, what they lose."""

from __future__ import annotations

from fivefold.planner.search import Estimate, SearchResult, gib

_PART_WORDS = {
    "compute": "compute", "recompute": "recomputation", "tp_comm": "tensor-parallel communication",
    "cp_comm": "context-parallel communication", "ep_comm": "expert all-to-all",
    "pipeline_bubble": "pipeline bubble", "pipeline_wait": "pipeline waits across nodes",
    "dp_comm_exposed": "exposed data-parallel gradient reduction",
    "zero_gather": "ZeRO parameter gathers", "optimizer": "optimizer step",
    "host_wait": "GPU waiting for the host (kernel issue)",
}


# candidates closer than this to the best are ties: the step-time model's median error on the rows it was
# fitted on (the playbook's 1-2-node runs, docs/planner.md) is about 7 %; held out it is worse
TIE = 0.07


def family(e: Estimate) -> tuple:
    """The layout family a user starts from: the model-parallel grid and whether the weights are sharded
    (FSDP / ZeRO-3); ZeRO 0-2, the micro-batch, the schedule and recompute are variants inside it."""
    la = e.layout
    return la.tp, la.pp, la.cp, la.ep, la.zero >= 3, la.dp_shard > 0


# the layouts users start from, shown with their gap to the best when the table does not show them: plain FSDP
# (ZeRO-3 over all of dp, no model-parallel grid; not HSDP) and dp x tp (ZeRO 0-2, tp > 1, nothing else)
BASELINES = {
    "FSDP": lambda e: e.layout.zero >= 3 and not e.layout.dp_shard and family(e)[:4] == (1, 1, 1, 1),
    "dp x tp": lambda e: e.layout.zero < 3 and e.layout.tp > 1 and family(e)[1:4] == (1, 1, 1),
}


def family_name(e: Estimate) -> str:
    la = e.layout
    grid = [f"{k}{v}" for k, v in (("tp", la.tp), ("pp", la.pp), ("cp", la.cp), ("ep", la.ep)) if v > 1]
    if la.zero >= 3 and la.dp_shard:
        return f"HSDP ({la.zero_replicas} x shard {la.dp_shard})" + (" x " + " x ".join(grid) if grid else "")
    if la.zero >= 3:
        return "FSDP (ZeRO-3)" + (" x " + " x ".join(grid) if grid else "")
    return "dp" + (" x " + " x ".join(grid) if grid else " only")


def slower(best: Estimate, e: Estimate) -> str:
    loss = 1 - e.tokens_per_s_per_device / best.tokens_per_s_per_device
    if loss < TIE:
        return f"a tie ({100 * loss:.1f} % slower, within the model's {100 * TIE:.0f} % uncertainty)"
    return f"{100 * loss:.1f} % slower"




def _biggest_difference(best: Estimate, other: Estimate) -> str:
    diffs = {k: other.time_parts.get(k, 0.0) - best.time_parts.get(k, 0.0) for k in _PART_WORDS}
    key = max(diffs, key=lambda k: diffs[k])
    if diffs[key] <= 0:
        return "about the same time budget"
    return f"+{diffs[key]:.3g} s of {_PART_WORDS[key]} per step"


def explain(result: SearchResult, memory_limit: float, global_batch_seqs: int, n_close: int = 4,
            unit: str = "GPU") -> str:
    if not result.candidates:
        return "No layout fits; see the rejected families above."
    best = result.candidates[0]
    la = best.layout
    lines = [f"Best: {la.short()} at {best.tokens_per_s_per_device:,.0f} tokens/s per {unit} "
             f"(MFU {100 * best.mfu:.1f} %, step {best.step_time_s:.3g} s, peak {gib(best.peak_bytes):.1f} GiB "
             f"of {gib(memory_limit):.1f} GiB)."]
    binds = []
    if best.peak_bytes > 0.85 * memory_limit:
        binds.append(f"memory: the pick uses {100 * best.peak_bytes / memory_limit:.0f} % of the device; "
                     "layouts with less sharding or less recompute do not fit")
    if la.grad_accum_steps == 1:
        binds.append(f"global batch: dp x micro_batch_size = {la.dp} x {la.micro_batch_size} already equals the "
                     f"{global_batch_seqs} "
                     "sequences of the batch, so more data parallel is impossible")
    total = best.step_time_s
    comm = sum(best.time_parts.get(k, 0.0) for k in ("tp_comm", "cp_comm", "ep_comm", "dp_comm_exposed",
                                                       "zero_gather"))
    if comm > 0.15 * total:
        binds.append(f"bandwidth: {100 * comm / total:.0f} % of the step is exposed communication")
    bubble = best.time_parts.get("pipeline_bubble", 0.0)
    if bubble > 0.1 * total:
        binds.append(f"pipeline bubble: {100 * bubble / total:.0f} % of the step")
    recompute = best.time_parts.get("recompute", 0.0)
    if recompute > 0.02 * total:
        binds.append(f"recompute ({la.recompute}): {100 * recompute / total:.0f} % of the step re-runs forward "
                     "work, the price of fitting in memory")
    cp = best.time_parts.get("cp_comm", 0.0)
    if la.cp > 1:
        binds.append(f"context parallel: its K/V ring costs {100 * cp / total:.1f} % of the step exposed"
                     + (" (hidden behind the attention it overlaps)" if cp < 0.005 * total else ""))
    if not binds:
        binds.append("compute: the step is almost all useful compute; nothing else binds")
    lines.append("What binds: " + "; ".join(binds) + ".")
    seen = {family(best)}
    close = []
    for e in result.candidates[1:]:
        if family(e) in seen:
            continue
        seen.add(family(e))
        close.append(e)
        if len(close) >= n_close:
            break
    if close:
        lines.append("Closest alternatives of another family (tp/pp/cp/ep grid, FSDP or not):")
        for e in close:
            lines.append(f"  {e.layout.short()}: {slower(best, e)}, {_biggest_difference(best, e)}")
    same = [e for e in result.candidates[1:] if family(e) == family(best)][:2]
    for e in same:
        lines.append(f"  same grid, {e.layout.short()}: {slower(best, e)}, {_biggest_difference(best, e)}")
    return "\n".join(lines)
