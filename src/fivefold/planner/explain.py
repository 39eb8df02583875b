"""Plain-words reasons for the pick: which constraint binds, which alternatives came close, what they lose."""

from __future__ import annotations

from fivefold.planner.search import Estimate, SearchResult, gib

_PART_WORDS = {
    "compute": "compute (incl. recomputation)", "tp_comm": "tensor-parallel communication",
    "cp_comm": "context-parallel communication", "ep_comm": "expert all-to-all",
    "pipeline_bubble": "pipeline bubble", "dp_comm_exposed": "exposed data-parallel gradient reduction",
    "zero_gather": "ZeRO parameter gathers", "optimizer": "optimizer step",
}


def _family(e: Estimate) -> tuple:
    la = e.layout
    return la.tp, la.pp, la.cp, la.ep


def _biggest_difference(best: Estimate, other: Estimate) -> str:
    diffs = {k: other.time_parts.get(k, 0.0) - best.time_parts.get(k, 0.0) for k in _PART_WORDS}
    key = max(diffs, key=lambda k: diffs[k])
    if diffs[key] <= 0:
        return "about the same time budget"
    return f"+{diffs[key]:.3g} s of {_PART_WORDS[key]} per step"


def explain(result: SearchResult, memory_limit: float, global_batch_seqs: int, n_close: int = 4) -> str:
    if not result.candidates:
        return "No layout fits; see the rejected families above."
    best = result.candidates[0]
    la = best.layout
    lines = [f"Best: {la.short()} at {best.tokens_per_s_per_device:,.0f} tokens/s per GPU "
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
    if not binds:
        binds.append("compute: the step is almost all useful compute; nothing else binds")
    lines.append("What binds: " + "; ".join(binds) + ".")
    seen = {_family(best)}
    close = []
    for e in result.candidates[1:]:
        if _family(e) in seen:
            continue
        seen.add(_family(e))
        close.append(e)
        if len(close) >= n_close:
            break
    if close:
        lines.append("Closest alternatives with another tp/pp/cp/ep:")
        for e in close:
            loss = 100 * (1 - e.tokens_per_s_per_device / best.tokens_per_s_per_device)
            lines.append(f"  {e.layout.short()}: {loss:.1f} % slower, {_biggest_difference(best, e)}")
    same = [e for e in result.candidates[1:] if _family(e) == _family(best)][:2]
    for e in same:
        loss = 100 * (1 - e.tokens_per_s_per_device / best.tokens_per_s_per_device)
        lines.append(f"  same grid, {e.layout.short()}: {loss:.1f} % slower, {_biggest_difference(best, e)}")
    return "\n".join(lines)
