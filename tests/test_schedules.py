"""Pipeline schedules: each rank's action list against the textbook order, and the simulator against the
closed forms of the playbook ((p-1)/m for AFAB and 1F1B, (p-1)/(v m) for interleaved)."""

from __future__ import annotations

from collections import Counter

import pytest

from fivefold.parallel.pipeline_comm import posting_plan
from fivefold.parallel.schedules import (
    Action,
    Schedule,
    ScheduleError,
    build_schedule,
    closed_form_bubble,
    held_points,
    render,
    simulate,
)


def kinds_prefix(acts, kind="F"):
    """How many actions of `kind` the list starts with (the warm-up)."""
    n = 0
    for a in acts:
        if a.kind != kind:
            break
        n += 1
    return n


def check_complete(s: Schedule):
    """Every (micro-batch, stage) gets exactly one F and one B (and one W when split), on the stage's rank,
    with F before B before W on that rank."""
    want = Counter()
    for stage in range(s.n_stages):
        for i in range(s.m):
            for k in ("F", "B") + (("W",) if s.split_backward else ()):
                want[(k, i, stage)] += 1
    got = Counter()
    for r, acts in enumerate(s.actions):
        pos = {}
        for j, a in enumerate(acts):
            assert s.stage_rank[a.stage] == r, f"{a} is on rank {r} but its stage lives on {s.stage_rank[a.stage]}"
            got[tuple(a)] += 1
            pos[tuple(a)] = j
        for (k, i, st), j in pos.items():
            if k == "B":
                assert pos[("F", i, st)] < j
            if k == "W":
                assert pos[("B", i, st)] < j
    assert got == want


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 3), (8, 16)])
def test_afab_and_1f1b_orders(p, m):
    afab = build_schedule("afab", p, m)
    check_complete(afab)
    for acts in afab.actions:
        assert [a.kind for a in acts] == ["F"] * m + ["B"] * m
        assert [a.micro_batch for a in acts] == list(range(m)) * 2
    one = build_schedule("1f1b", p, m)
    check_complete(one)
    for r, acts in enumerate(one.actions):
        warmup = min(p - r - 1, m)
        assert kinds_prefix(acts) == min(warmup + 1, m)  # warm-up forwards, then the first steady-state forward
        steady = acts[warmup:warmup + 2 * (m - warmup)]
        assert [a.kind for a in steady] == ["F", "B"] * (m - warmup)
        assert all(a.kind == "B" for a in acts[warmup + 2 * (m - warmup):])
    # in flight: AFAB holds every micro-batch, 1F1B at most p - r on rank r
    assert simulate(afab, 1, 2).peak_in_flight == (m,) * p
    assert simulate(one, 1, 2).peak_in_flight == tuple(min(p - r, m) for r in range(p))


@pytest.mark.parametrize("name", ["afab", "1f1b"])
@pytest.mark.parametrize("p,m", [(2, 2), (4, 8), (4, 32), (8, 8), (8, 32)])
def test_bubble_matches_closed_form(name, p, m):
    sim = simulate(build_schedule(name, p, m), t_f=1.0, t_b=2.0)
    assert sim.bubble == pytest.approx(closed_form_bubble(name, p, m))
    assert sim.makespan == pytest.approx((m + p - 1) * 3.0)


def test_playbook_bubble_vectors():
    # playbook figure, p = 8: m=1 -> 7, m=2 -> 3.5, m=4 -> 1.75, m=8 -> 0.875, m=32 -> 0.21875; m=32, v=8 -> 0.02734375
    for m, want in [(1, 7.0), (2, 3.5), (4, 1.75), (8, 0.875), (32, 0.21875)]:
        assert simulate(build_schedule("1f1b", 8, m), 1.0, 2.0).bubble == pytest.approx(want)
    sim = simulate(build_schedule("interleaved", 8, 32, 8), 1 / 8, 2 / 8)
    assert sim.bubble == pytest.approx(0.02734375)


def test_idle_ranks_in_1f1b():
    # rank r starts after r forwards have passed down the pipe; the last rank turns around at once
    p, m = 4, 8
    sim = simulate(build_schedule("1f1b", p, m), 1.0, 2.0)
    for r in range(p):
        assert sim.start[("F", 0, r)] == pytest.approx(r * 1.0)
    assert sim.start[("B", 0, p - 1)] == pytest.approx(p * 1.0)
    # the first rank waits for the first gradient: idle from its warm-up end until B0 arrives
    assert sim.start[("B", 0, 0)] == pytest.approx(p * 1.0 + (p - 1) * 2.0)


def test_p2p_time_on_the_critical_path():
    p, m, c = 4, 6, 0.25
    sim = simulate(build_schedule("afab", p, m), 1.0, 2.0, p2p=c)
    assert sim.makespan == pytest.approx(m * 3.0 + (p - 1) * (3.0 + 2 * c))


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (4, 16, 4), (8, 16, 2)])
def test_interleaved(p, m, v):
    s = build_schedule("interleaved", p, m, v)
    check_complete(s)
    assert s.stage_rank == tuple(st % p for st in range(p * v))
    for r, acts in enumerate(s.actions):
        warmup = min((p - r - 1) * 2 + (v - 1) * p, m * v)
        assert kinds_prefix(acts) == warmup + (1 if warmup < m * v else 0)
        first = [a for a in acts if a.kind == "F"][:p]  # the first p micro-batches run on chunk 0 first
        assert [a.micro_batch for a in first] == list(range(p))
        assert all(a.stage == r for a in first)
    sim = simulate(s, 1.0 / v, 2.0 / v)
    assert sim.bubble == pytest.approx(closed_form_bubble("interleaved", p, m, v))
    assert sim.bubble < simulate(build_schedule("1f1b", p, m), 1.0, 2.0).bubble


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 12), (8, 32), (4, 64)])
def test_zero_bubble_h1(p, m):
    s = build_schedule("zero-bubble", p, m)
    check_complete(s)
    one = simulate(build_schedule("1f1b", p, m), 1.0, 2.0)
    sim = simulate(s, 1.0, 1.0, 1.0)
    # same memory as 1F1B: at most p - r micro-batches between F and B on rank r
    assert sim.peak_in_flight == one.peak_in_flight
    # ZB-H1 bubble (p-1)(F + B_full - 2W) with F = B = W: a third of 1F1B's (p-1)(F + B_full)
    assert sim.makespan - max(sim.busy) == pytest.approx((p - 1) * 1.0)
    assert one.makespan - max(one.busy) == pytest.approx((p - 1) * 3.0)
    for r, acts in enumerate(s.actions):
        assert kinds_prefix(acts) == min(p - r, m)  # 1F1B's warm-up, then the first steady forward
    # held from F to W: rank r at most p - r activations and r pending W passes (r + 1 between a B and its W), p
    # in all, whatever m (W passes that drift to the cool-down instead pile up with m: 56 pending on the first of 4
    # ranks at m = 64)
    for r, points in enumerate(held_points("zero-bubble", p, m)):
        assert max(a for a, _ in points) == min(p - r, m) and max(w for _, w in points) <= r + 1
        assert max(a + w for a, w in points) <= p


def test_held_points_count_pending_weight_passes():
    """Counted from the action list independently: 1F1B holds no W; ZB-H1's last rank ends holding one micro-batch's
    activations and p - 1 pending W passes, then p."""
    assert held_points("1f1b", 4, 8)[0] == ((4.0, 0.0),)
    assert held_points("zero-bubble", 4, 8)[3] == ((0.0, 4.0), (1.0, 3.0))
    assert held_points("zero-bubble", 4, 64) == held_points("zero-bubble", 4, 8)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 10), (8, 16)])
def test_dualpipev(p, m):
    s = build_schedule("dualpipev", p, m)
    check_complete(s)
    for r, acts in enumerate(s.actions):
        assert {a.stage for a in acts} == {r, 2 * p - 1 - r}
        # phase 1: 2(p-r-1) forwards of chunk 0, then phase 2 alternates chunk 0 and chunk 1 forwards
        assert all(a == Action("F", i, r) for i, a in enumerate(acts[:2 * (p - r - 1)]))
        phase2 = acts[2 * (p - r - 1):2 * (p - r - 1) + 2 * (r + 1)]
        assert [a.stage for a in phase2] == [r, 2 * p - 1 - r] * (r + 1)
    sim = simulate(s, 0.5, 0.5, 0.5)
    one = simulate(build_schedule("1f1b", p, m), 1.0, 2.0)
    assert max(sim.busy) == pytest.approx(max(one.busy))
    assert sim.bubble < one.bubble
    assert sim.bubble < simulate(build_schedule("zero-bubble", p, m), 1.0, 1.0, 1.0).bubble
    # every rank holds about p + 1 micro-batches' stage activations, evenly over the ranks
    assert max(sim.peak_in_flight) <= p + 1


def test_bad_input_and_deadlock():
    with pytest.raises(ScheduleError, match="at least 8 micro-batches"):
        build_schedule("dualpipev", 4, 6)
    with pytest.raises(ScheduleError, match="multiple of pp = 4"):
        build_schedule("interleaved", 4, 6, 2)
    with pytest.raises(ScheduleError, match="not known"):
        build_schedule("gpipe2", 2, 2)
    # rank 0 waits for a backward that rank 1 only runs after a forward that needs rank 0's second forward
    bad = Schedule("bad", 2, 2, 1, ((Action("F", 0, 0), Action("B", 0, 0), Action("F", 1, 0), Action("B", 1, 0)),
                                    (Action("F", 1, 1), Action("F", 0, 1), Action("B", 0, 1), Action("B", 1, 1))),
                   (0, 1), False)
    with pytest.raises(ScheduleError, match="deadlocks"):
        simulate(bad, 1, 2)
    assert "rank 1: F0 B0" in render(build_schedule("1f1b", 2, 2))


def test_a_fused_pair_starts_with_both_inputs_and_its_outputs_leave_at_its_end():
    """DualPipeV's overlapped order (`overlap_fb`): the same action lists, with each F followed by a B of the rank's
    other chunk fused (the F0B1 / F1B0 pairs); in the simulation a pair starts once both inputs are in and both its
    actions end together; at the sum of the two as the pair's time the makespan is the sequential one, and a pair
    that takes 0.5 less takes 0.5 per pair off each rank's busy time without lengthening the step."""
    fused, plain = build_schedule("dualpipev", 2, 4, overlap_fb=True), build_schedule("dualpipev", 2, 4)
    assert fused.actions == plain.actions and not plain.fused
    assert fused.fused[0] == (7, 10, 15)  # rank 0: F3.0 B1.3, F2.3 B0.0, F3.3 B1.0 (render above)
    sim = simulate(fused, 1.0, 1.0, 1.0)
    assert sim.makespan == simulate(plain, 1.0, 1.0, 1.0).makespan
    for r, ks in enumerate(fused.fused):
        assert ks
        for k in ks:
            f, b = fused.actions[r][k], fused.actions[r][k + 1]
            assert f.kind == "F" and b.kind == "B" and f.stage != b.stage
            assert sim.start[tuple(f)] == sim.start[tuple(b)]
            assert sim.end[tuple(f)] == sim.end[tuple(b)] == sim.start[tuple(f)] + 2
    fast = simulate(fused, 1.0, 1.0, 1.0, pair_seconds=lambda f, b: 1.5)
    for r, ks in enumerate(fused.fused):
        assert fast.busy[r] == pytest.approx(sim.busy[r] - 0.5 * len(ks))
    assert fast.makespan <= sim.makespan
    assert not build_schedule("1f1b", 2, 4, overlap_fb=True).fused  # DualPipeV's alone


def test_a_fused_pair_with_its_w_runs_the_whole_backward_beside_the_forward():
    """`pair_w` (tp with sp, where W gathers its input again): each pair whose B's own W comes next runs that W
    too, as one unit of three actions that starts once both inputs are in and ends together; its outputs leave
    after the W, so at the plain sum of the parts the step is longer than with the W after the pair, and the
    posting plan posts nothing after the F nor after the B. Without `pair_w` the units are the pairs alone."""
    plain = build_schedule("dualpipev", 2, 4, overlap_fb=True)
    whole = build_schedule("dualpipev", 2, 4, overlap_fb=True, pair_w=True)
    assert whole.actions == plain.actions and whole.fused == plain.fused and whole.pair_w and not plain.pair_w
    seen: list = []
    sim = simulate(whole, 1.0, 1.0, 1.0, pair_seconds=lambda *unit: seen.append(unit) or float(len(unit)))
    assert sim.makespan > simulate(plain, 1.0, 1.0, 1.0).makespan
    for r, ks in enumerate(whole.fused):
        acts = whole.actions[r]
        plan = posting_plan(whole, r)
        for k in ks:
            assert plain.unit(r, k) == acts[k:k + 2]
            unit = whole.unit(r, k)
            f, b = unit[:2]
            if acts[k + 2] == ("W", b.micro_batch, b.stage):
                assert unit == acts[k:k + 3] and unit in seen
                assert sim.start[tuple(unit[2])] == sim.start[tuple(f)]
                assert sim.end[tuple(unit[2])] == sim.end[tuple(f)] == sim.start[tuple(f)] + 3
                assert plan[k + 1] == plan[k + 2] == ()  # nothing after the F, nothing after the B
            else:
                assert unit == acts[k:k + 2]
        assert any(len(whole.unit(r, k)) == 3 for k in ks)
        assert [len(whole.unit(r, k)) for k in range(len(acts)) if k not in ks] == [1] * (len(acts) - len(ks))
