"""The stall model of the planner (`planner/time.py`: `stall_risk`, `drift_factor`), its p50/p90 step times, the
`--json` fields and the rank rule, and the gates of `plan validate` (`tools/gates.py`) on a table whose answers are
worked out by hand."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from fivefold.cli import main
from fivefold.config import ConfigError
from fivefold.planner.hardware import get_cluster
from fivefold.planner.layout import FRAMEWORKS, Layout
from fivefold.planner.search import estimate
from fivefold.presets import get_preset
from fivefold.tools.gates import STALL_EXCESS_PER_HANDOVER_S, Record, gates, is_stalled

PROFILE = Path(__file__).resolve().parents[1] / "src" / "fivefold" / "planner" / "profiles" / "nanotron-h100-efa.toml"
RISKY = dataclasses.replace(get_cluster("h100-efa"), stall_hazard_per_node=0.1, stall_s_per_handover=0.2,
                            stall_s_per_handover_deep=0.5, stall_growth_per_tp_doubling=0.1)


def _estimate(lay: Layout, hw=RISKY):
    return estimate(get_preset("llama3-8b"), 4096, lay, FRAMEWORKS["nanotron"], hw, False)


@pytest.mark.parametrize("pp, tp, dp, ga, per_handover", [
    (2, 1, 8, 16, 0.2),  # 16 GPUs: 2 nodes, pp = 2
    (4, 4, 4, 8, 0.5 * 1.1 ** 2),  # 64 GPUs: 8 nodes, pp > 2, tp 4 = two doublings
    (8, 8, 8, 4, 0.5 * 1.1 ** 3),  # 512 GPUs: 64 nodes
])
def test_stall_probability_and_quantiles_match_the_closed_form(pp, tp, dp, ga, per_handover):
    e = _estimate(Layout(dp=dp, tp=tp, pp=pp, micro_batch_size=1, grad_accum_steps=ga, sp=tp > 1))
    nodes = dp * tp * pp // 8
    p = 1 - 0.9 ** nodes
    added = 2 * (ga + pp - 1) * per_handover
    assert e.stall.probability == pytest.approx(p)
    assert e.stall.added_s == pytest.approx(added)
    clean = e.step_time_s
    # a two-point distribution: the q-quantile is clean while at least a share q of the steps is clean
    assert e.step_time_at(0.5) == pytest.approx(clean if p <= 0.5 else clean + added)
    assert e.step_time_at(0.9) == pytest.approx(clean if p <= 0.1 else clean + added)
    assert e.expected_step_time_s == pytest.approx(clean + p * added)
    risk = e.to_json()
    assert risk["stall_risk"] == pytest.approx(p)
    assert risk["step_time_p90_s"] == pytest.approx(e.step_time_at(0.9))
    tokens = dp * ga * 4096 / (dp * tp * pp)  # tokens per step per GPU
    assert risk["tokens_per_s_per_device_p90"] == pytest.approx(tokens / e.step_time_at(0.9))


def test_no_risk_without_a_pipeline_or_without_stall_data():
    flat = _estimate(Layout(dp=16, tp=1, pp=1, micro_batch_size=1, grad_accum_steps=16))
    assert flat.stall.probability == 0 and flat.step_time_at(0.9) == flat.step_time_s
    piped = _estimate(Layout(dp=8, pp=2, micro_batch_size=1, grad_accum_steps=16), get_cluster("h100"))
    assert piped.stall.probability == 0
    assert piped.step_time_at(0.5) == piped.step_time_at(0.9) == piped.expected_step_time_s == piped.step_time_s


def test_drift_grows_the_step_per_doubling_of_the_nodes():
    lay = Layout(dp=64, tp=1, pp=1, micro_batch_size=1, grad_accum_steps=4)  # 8 nodes
    plain = _estimate(lay, get_cluster("h100-efa"))
    drifted = _estimate(lay, dataclasses.replace(get_cluster("h100-efa"), drift_per_node_doubling=0.02))
    assert drifted.step_time_s == pytest.approx(plain.step_time_s * 1.02 ** 3)
    assert drifted.time_parts["scale_drift"] == pytest.approx(drifted.step_time_s - plain.step_time_s)
    one_node = Layout(dp=8, tp=1, pp=1, micro_batch_size=1, grad_accum_steps=32)
    assert _estimate(one_node, dataclasses.replace(get_cluster("h100-efa"), drift_per_node_doubling=0.02)
                     ).step_time_s == pytest.approx(_estimate(one_node, get_cluster("h100-efa")).step_time_s)


def test_a_hazard_of_one_or_more_is_refused(tmp_path):
    f = tmp_path / "hw.toml"
    f.write_text('base = "h100-efa"\nstall_hazard_per_node = 1.0\n')
    with pytest.raises(ConfigError, match="stall_hazard_per_node = 1.0 must be below 1"):
        get_cluster(None, f)


def test_plan_json_carries_p50_p90_and_the_stall_risk_and_ranks_by_the_rule(capsys):
    argv = ["plan", "--model", "tiny", "--hardware", str(PROFILE), "--nodes", "4", "--seq-len", "128",
            "--global-batch", "16K", "--zero", "0", "--recompute", "none", "--schedules", "1f1b", "--sp", "on",
            "--no-cp", "--json"]
    hazard = 0.0503  # the profile's
    for rank, key in (("expected", "expected_step_time_s"), ("p90", "step_time_p90_s")):
        assert main([*argv, "--rank", rank]) == 0
        candidates = json.loads(capsys.readouterr().out)["candidates"]
        assert any(c["layout"]["pp"] > 1 for c in candidates) and any(c["layout"]["pp"] == 1 for c in candidates)
        for c in candidates:
            p = 1 - (1 - hazard) ** 4 if c["layout"]["pp"] > 1 else 0.0
            assert c["stall_risk"] == pytest.approx(p)
            assert c["step_time_p50_s"] == pytest.approx(c["step_time_s"])  # p = 0.19: the typical step is clean
            assert c["step_time_p90_s"] == pytest.approx(c["step_time_s"] + (c["stall_added_s"] if p else 0.0))
        # the simulated head of the list is in the order of the rank rule's tokens/s
        rates = [c["tokens_per_s_per_device"] * c["step_time_s"] / c[key] for c in candidates[:64]]
        assert rates == sorted(rates, reverse=True)


def test_plan_without_stall_data_has_no_risk(capsys):
    assert main(["plan", "--model", "tiny", "--gpu", "h100", "--nodes", "2", "--seq-len", "128", "--global-batch",
                 "16K", "--zero", "0", "--recompute", "none", "--schedules", "1f1b", "--no-cp", "--json"]) == 0
    candidates = json.loads(capsys.readouterr().out)["candidates"]
    assert any(c["layout"]["pp"] > 1 for c in candidates)
    for c in candidates:
        assert c["stall_risk"] == 0.0
        assert c["step_time_p50_s"] == c["step_time_p90_s"] == c["expected_step_time_s"] == c["step_time_s"]


def _record(nodes: int, group: str, measured: float, clean: float = 1.0, handovers: int = 0, p: float = 0.0,
            added: float = 0.0, fits: bool = True, ok: bool = True) -> Record:
    return Record(nodes, (group, nodes), ok, fits, handovers, clean, clean + added, p, measured if ok else 0.0, 1.0)


def test_gates_on_a_table_with_known_answers():
    # 4 nodes, group a: three clean runs (errors -10 %, 0, +25 %: measured 1/0.9, 1, 0.8) and one stalled pipelined
    # run (10 hand-overs, 0.2 s each measured: 3.0 s against 1 s clean; predicted +1.5 s, chance 0.2)
    a = [_record(4, "a", 1 / 0.9), _record(4, "a", 1.0, clean=1.0), _record(4, "a", 0.8),
         _record(4, "a", 3.0, handovers=10, p=0.2, added=1.5)]
    # 8 nodes, group b: two pipelined runs with a chance 0.6, one stalled and one clean, and a crash picked first
    b = [_record(8, "b", 2.5, clean=1.0, handovers=10, p=0.6, added=1.5),
         _record(8, "b", 1.0, clean=1.0, handovers=10, p=0.6, added=1.5),
         _record(8, "b", 0.0, clean=0.1, ok=False)]
    assert [is_stalled(r) for r in a + b] == [False, False, False, True, True, False, False]
    assert STALL_EXCESS_PER_HANDOVER_S * 10 < 2.5 - 1.0  # above the rule: 0.15 s per hand-over
    table = gates(a + b)

    def gate(start: str):
        return next(g for g in table if g.label.startswith(start))

    step = gate("stall-aware step time")
    # 4 nodes: p50 = clean (chance 0.2): errors |-0.1|, 0, 0.25, |1/3 - 1| -> median (0.1 + 0.25) / 2
    assert step.by_nodes[4][0] == pytest.approx(0.175)
    # 8 nodes: p50 = stalled (chance 0.6): 2.5/2.5 - 1 = 0 and 2.5/1 - 1 = 1.5 -> 0.75
    assert step.by_nodes[8][0] == pytest.approx(0.75)
    assert step.overall[0] == pytest.approx(0.175)  # 0, 0, 0.1, 0.25, 2/3, 1.5
    assert step.holds(*step.by_nodes[4]) is False and step.holds(*step.by_nodes[8]) is False  # 11 % at 4-16
    signed = gate("clean runs, signed")
    assert signed.by_nodes[4][0] == pytest.approx(0.0)  # -0.1, 0, +0.25 -> 0
    assert signed.by_nodes[8][0] == pytest.approx(0.0)  # the one clean run: 1/1 - 1
    assert gate("clean runs, median").by_nodes[4][0] == pytest.approx(0.1)
    rate = gate("stall rate")
    assert rate.by_nodes[4][0] == pytest.approx(0.2 - 1.0) and rate.holds(*rate.by_nodes[4]) is False
    assert rate.by_nodes[8][0] == pytest.approx(0.6 - 0.5) and rate.holds(*rate.by_nodes[8]) is True
    stalled = gate("stalled runs")
    assert stalled.by_nodes[4][0] == pytest.approx(abs(2.5 / 3.0 - 1)) and stalled.by_nodes[8][0] == 0.0
    regret = gate("top-1 regret")
    # group a: the pick by expected tokens/s is a clean run predicted at 1 s (the first of the three ties),
    # measured 1/0.9 s against the best clean run's 0.8 s; group b: the pick (predicted 0.1 s) crashed
    assert regret.by_nodes[4][0] == pytest.approx(1 - 0.8 / (1 / 0.9))
    assert regret.by_nodes[8][0] == 1.0
    spearman_gate = gate("per-group Spearman")
    assert math.isnan(spearman_gate.by_nodes[8][0])  # two finished runs: no correlation
    assert spearman_gate.holds(0.9, 0.85) and not spearman_gate.holds(0.8, 0.85)
