"""`fivefold calibrate` and the calibrated time model: a quick calibration on 2 gloo ranks writes a profile that
loads and drives `fivefold plan --hardware`; the model's parts equal closed forms of the profile's figures; the
operator counts the model uses for fivefold's CPU path equal what the profiler counts in a real block."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch

from fivefold.cli import main
from fivefold.config import ConfigError
from fivefold.planner import comm
from fivefold.planner.features import with_features
from fivefold.planner.hardware import Cluster, get_cluster, interpolate
from fivefold.planner.layout import FIVEFOLD_CPU, Layout
from fivefold.planner.memory import model_state_bytes
from fivefold.planner.time import linear_shapes, optimizer_tensors, stage_times, step_time
from fivefold.presets import get_preset
from fivefold.tools.calibrate import Result, fit_link, monotone, profile_tables, to_toml
from fivefold.tools.calibrate.profile import write_profile
from fivefold.tools.calibrate.whole_step import (
    HEAP_RETENTION_MAX,
    SCALE_BOUNDS,
    dispatch_us,
    heap_retention,
    predicted_step,
    reference_config,
    reference_plan,
    step_scale,
)
from fivefold.train.loop import default_threads

TINY = get_preset("tiny")


@pytest.fixture(scope="module")
def quick_profile(tmp_path_factory):
    """`fivefold calibrate --quick` on this machine: 1 rank, then 2 gloo ranks."""
    path = tmp_path_factory.mktemp("calibrate") / "cpu.toml"
    assert main(["calibrate", "--quick", "--device", "cpu", "--nproc-max", "2", "--out", str(path)]) == 0
    return path


def test_quick_calibration_writes_a_profile_that_loads(quick_profile):
    hw = get_cluster(None, quick_profile)
    assert hw.name == "cpu-calibrated" and hw.cores >= 1 and hw.gpus_per_node == 2
    assert set(hw.by_ranks) == {2}
    # each rank count measured at the threads `fivefold train` gives that many local processes by default
    assert [hw.on_node(n).threads_per_rank for n in (1, 2)] == [default_threads(1), default_threads(2)]
    for view in (hw.on_node(1), hw.on_node(2)):
        assert view.linear and view.attention and view.loss and view.elementwise
        for table in (view.linear, view.attention, view.loss):
            for *_, fwd, bwd in table:
                assert 1e-6 < fwd < 100 and 1e-6 < bwd < 100  # TFLOP/s: a CPU core is not idle, nor a GPU
        assert all(0.01 < gbps < 1e4 for _, gbps in view.elementwise)
        assert 0.05 < view.kernel_overhead_us < 1e4 and 0.05 < view.backward_overhead_us < 1e4
        assert view.optimizer_gbps > 0 and view.optimizer_tensor_us > 0
    two = hw.on_node(2)
    assert 0.0 <= two.comm_overlap <= 1.0 and two.zero3_unit_us >= 0.0
    assert [size for size, _ in two.collective_wait] == [2] and 0 < two.collective_wait[0][1] < 1.0
    assert set(two.collectives) == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p"}
    for kind, groups in two.collectives.items():
        assert set(groups) == {2}, kind
        rows = groups[2]
        assert [b for b, _ in rows] == sorted(b for b, _ in rows) and all(1e-7 < s < 10 for _, s in rows)
    assert hw.intra_latency_us > 0 and hw.intra_node_gbps > 0
    # the reference model's whole step against the parts: a factor within its bounds, on every rank count
    assert SCALE_BOUNDS[0] <= hw.compute_scale <= SCALE_BOUNDS[1]
    assert hw.on_node(1).compute_scale == hw.on_node(2).compute_scale == hw.compute_scale
    # the selective policy's dispatch, measured on the same reference step: a host time per block, kept for every
    # rank count
    assert 0.0 <= hw.selective_dispatch_us < 1e6
    assert hw.on_node(2).selective_dispatch_us == hw.selective_dispatch_us
    # the reference step's resident set in a fresh process against its live tensors: glibc keeps some of what a
    # step frees, so more than 1 on Linux (1.5-2.3 in the sweeps of docs/sweeps.md), kept for every rank count
    assert 1.0 < hw.heap_retention <= HEAP_RETENTION_MAX
    assert hw.on_node(2).heap_retention == hw.heap_retention


def test_compute_scale_multiplies_every_compute_time_and_not_communication():
    """One process: every part of the step is compute (linears, attention, loss, element-wise, fixed costs,
    optimizer), so the step scales by the factor exactly; under tp 2 the all-reduces do not scale."""
    hw = _profile()
    scaled = dataclasses.replace(hw, compute_scale=1.7)
    one = Layout(micro_batch_size=4, grad_accum_steps=4)
    plain, slow = (step_time(TINY, 128, one, FIVEFOLD_CPU, h) for h in (hw, scaled))
    assert slow.step_time == pytest.approx(1.7 * plain.step_time, rel=1e-9)
    assert slow.parts["optimizer"] == pytest.approx(1.7 * plain.parts["optimizer"], rel=1e-9)
    tp = Layout(tp=2, micro_batch_size=4, grad_accum_steps=4)
    plain, slow = (step_time(TINY, 128, tp, FIVEFOLD_CPU, h) for h in (hw, scaled))
    assert slow.parts["tp_comm"] == plain.parts["tp_comm"] > 0
    assert slow.parts["compute"] == pytest.approx(1.7 * plain.parts["compute"], rel=1e-9)


def test_more_ranks_than_measured_multiply_the_whole_step_factor():
    hw = dataclasses.replace(_profile(), compute_scale=1.25, by_ranks={2: {"kernel_overhead_us": 12.0}})
    assert hw.on_node(2).compute_scale == 1.25  # measured with 2 ranks: the factor alone
    assert hw.on_node(4).compute_scale == pytest.approx(1.25 * 4 / 2)  # 4 ranks on 2 cores: twice as slow too


def test_the_reference_model_is_none_of_the_presets_and_its_step_is_priced_on_the_profile():
    cfg = reference_config(threads=1, steps=1)
    assert (cfg.model.n_layers, cfg.model.hidden, cfg.model.ffn, cfg.model.vocab_size) == (2, 128, 256, 1024)
    assert cfg.model.n_layers != TINY.n_layers and cfg.model.ffn != TINY.ffn
    assert predicted_step(_profile(), 1) > 0
    assert step_scale(2.0, 1.0) == 2.0 and step_scale(10.0, 1.0) == SCALE_BOUNDS[1]


def test_profile_drives_plan_hardware(quick_profile, capsys):
    code = main(["plan", "--hardware", str(quick_profile), "--model", "tiny", "--seq-len", "128", "--global-batch",
                 "2048", "--layout", "dp=2,mbs=4,zero=1", "--framework", "fivefold-cpu"])
    out = capsys.readouterr().out
    assert code == 0 and "step" in out and "2 x cpu" in out
    assert main(["plan", "--hardware", str(quick_profile), "--model", "tiny", "--seq-len", "128",
                 "--global-batch", "2048", "--framework", "fivefold-cpu", "--top", "3"]) == 0


def _small_tables() -> dict:
    one = Result(1, linear=[[128, 256, 128, 0.0312345, 0.0254321]], attention=[[8, 128, 32, 0.0051, 0.0042]],
                 loss=[[512, 2048, 128, 0.02, 0.5]], elementwise=[[65536, 41.5]], kernel_overhead_us=9.5,
                 backward_overhead_us=13.25, optimizer_gbps=2.5, optimizer_tensor_us=150.0)
    return profile_tables({1: one}, "cpu", {1: 2}, 1, "mine")


def test_a_dispatch_measured_at_zero_is_written_and_read_back(tmp_path):
    """On a loaded (or fast) machine the selective policy's step can take no longer than its parts predict, and
    calibrate writes `selective_dispatch_us = 0.0` (`dispatch_us` never goes below 0): the reader takes it, where it
    refused it before, which failed `plan --hardware` on a profile calibrate had just written."""
    path = tmp_path / "p.toml"
    write_profile(path, {**_small_tables(), "compute_scale": 1.1, "selective_dispatch_us": 0.0}, "a header")
    assert get_cluster(None, path).selective_dispatch_us == 0.0


def test_a_profile_its_reader_refuses_is_not_written(tmp_path):
    """Whatever calibrate measured, it never leaves a profile that `--hardware` refuses: the reader's message,
    naming the field and the profile's path, and no file (nor its temporary) left behind."""
    path = tmp_path / "p.toml"
    with pytest.raises(ConfigError, match=r"kernel_overhead_us = -1.0 must be > 0.*p\.toml was not written"):
        write_profile(path, {**_small_tables(), "kernel_overhead_us": -1.0}, "a header")
    assert list(tmp_path.iterdir()) == []


def test_profile_round_trips_through_toml(tmp_path):
    """What calibrate measured is what `--hardware` reads back (6 significant digits)."""
    one = Result(1, linear=[[128, 256, 128, 0.0312345, 0.0254321]], attention=[[8, 128, 32, 0.0051, 0.0042]],
                 loss=[[512, 2048, 128, 0.02, 0.5]],
                 elementwise=[[65536, 41.5], [16777216, 7.25]], kernel_overhead_us=9.5, backward_overhead_us=13.25,
                 optimizer_gbps=2.5, optimizer_tensor_us=150.0)
    two = dataclasses.replace(one, ranks=2, kernel_overhead_us=11.0, comm_overlap=0.25,
                              collectives={"all_reduce": {2: [[4096, 1.5e-4], [4194304, 4.5e-3]]},
                                           "p2p": {2: [[4096, 6.0e-5]]}})
    path = tmp_path / "p.toml"
    path.write_text(to_toml(profile_tables({1: one, 2: two}, "cpu", {1: 2, 2: 1}, 2, "mine"), "a header"))
    hw = get_cluster(None, path)
    assert hw.name == "mine" and hw.linear == ((128, 256, 128, 0.0312345, 0.0254321),)
    assert hw.loss == ((512, 2048, 128, 0.02, 0.5),)
    assert hw.kernel_overhead_us == 9.5 and hw.backward_overhead_us == 13.25 and hw.optimizer_tensor_us == 150.0
    view = hw.on_node(2)
    assert view.kernel_overhead_us == 11.0 and view.comm_overlap == 0.25
    assert (hw.threads_per_rank, view.threads_per_rank) == (2, 1)
    assert view.collectives["all_reduce"][2] == ((4096, 1.5e-4), (4194304, 4.5e-3))
    # the link constants for other group sizes come from the 2-rank all-reduce (exact for two points)
    latency, bandwidth = 1e-6 * hw.intra_latency_us, 1e9 * hw.intra_node_gbps
    for nbytes, seconds in two.collectives["all_reduce"][2]:
        assert 2 * latency + nbytes / bandwidth == pytest.approx(seconds, rel=1e-4)


def test_bad_profile_fields_are_named(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('base = "cpu"\n[ranks.2]\nkernel_overhead = 3.0\n')
    with pytest.raises(ConfigError, match=r"\[ranks.2\] field 'kernel_overhead' is not known"):
        get_cluster(None, path)
    path.write_text('base = "cpu"\nlinear = [[1, 2, 3]]\n')
    with pytest.raises(ConfigError, match="linear row .* must be 5 positive finite numbers"):
        get_cluster(None, path)
    path.write_text('base = "cpu"\n[ranks.2.collectives.broadcast]\n2 = [[4096, 0.001]]\n')
    with pytest.raises(ConfigError, match="collectives.broadcast is not known"):
        get_cluster(None, path)


def test_calibrate_refuses_bad_arguments(capsys):
    for flag, value, rule in (("--threads", "-1", "is not between 0 and"),
                              ("--threads", "100000", "is not between 0 and"),
                              ("--nproc-max", "-1", "is not between 0 and 4,096")):
        with pytest.raises(SystemExit) as refused:  # argparse's refusal, in one line
            main(["calibrate", "--device", "cpu", flag, value])
        err = capsys.readouterr().err
        assert refused.value.code == 2 and err.count("\n") == 1 and f"argument {flag}: {int(value):,} {rule}" in err
        assert flag != "--threads" or "this machine's CPU cores" in err


# ---------------------------------------------------------------------------------------------------------------
# The time model's parts against closed forms of the profile


def _profile(**extra) -> Cluster:
    """A CPU profile whose tables hold exactly the tiny model's shapes at micro-batch 4, tp 1 and 2."""
    linear, attention = [], []
    for tp in (1, 2):
        for i, (m, n, k) in enumerate(linear_shapes(TINY, 512, tp, fused=False)):
            linear.append((m, n, k, 0.01 * (i + 1), 0.004 * (i + 2)))
        linear.append((512, TINY.vocab_size / tp, TINY.hidden, 0.02, 0.015))
        attention.append((4 * TINY.n_heads / tp, 128, TINY.head_dim, 0.003, 0.002))
    base = dataclasses.replace(get_cluster("cpu"), gpus_per_node=4, cores=2)
    return dataclasses.replace(base, linear=tuple(linear), attention=tuple(attention),
                               elementwise=((2**10, 40.0), (2**20, 20.0), (2**24, 5.0)), kernel_overhead_us=10.0,
                               backward_overhead_us=14.0, **extra)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("loss_table", [False, True])
def test_block_time_is_flops_over_measured_throughput_plus_fixed_costs(tp, loss_table):
    hw = _profile()
    if loss_table:  # the output layer + loss measured as one
        hw = dataclasses.replace(hw, loss=tuple((512, TINY.vocab_size / t, TINY.hidden, 0.01 * t, 0.3)
                                                for t in (1, 2)))
    lay = Layout(tp=tp, micro_batch_size=4, grad_accum_steps=4)
    times = stage_times(TINY, 128, lay, FIVEFOLD_CPU, hw)
    tokens = 4 * 128
    lin_f = lin_b = 0.0
    for m, n, k in linear_shapes(TINY, tokens, tp, fused=False):
        row = next(r for r in hw.linear if r[:3] == (m, n, k))
        lin_f += 2 * m * n * k / (row[3] * 1e12)
        lin_b += 4 * m * n * k / (row[4] * 1e12)
    attn_flops = 2 * 4 * TINY.n_heads / tp * 128 * 128 * TINY.head_dim
    attn_row = next(r for r in hw.attention if r[0] == 4 * TINY.n_heads / tp)
    act = _elementwise_bytes(tokens, tp, sp=False)
    # operand of 512 x 128 fp32 = 256 KiB: log-log between 1 KiB (40 GB/s) and 1 MiB (20 GB/s)
    bandwidth = math.exp(math.log(40.0) + (math.log(20.0) - math.log(40.0)) * 8 / 10) * 1e9
    fixed_f = FIVEFOLD_CPU.kernels_per_layer * 10e-6
    fixed_b = FIVEFOLD_CPU.kernels_per_layer * 14e-6
    forward = lin_f + attn_flops / (attn_row[3] * 1e12) + act / bandwidth + fixed_f
    t_tp = 2 * comm.all_reduce(tokens * TINY.hidden * 4, tp, 1, hw) if tp > 1 else 0.0
    per_block_f = (times.f[0] - _head_f(hw, tp, tokens)) / TINY.n_layers
    assert per_block_f == pytest.approx(forward + t_tp, rel=1e-9)
    backward = lin_b + 2 * attn_flops / (attn_row[4] * 1e12) + 2 * act / bandwidth + fixed_b + t_tp
    per_block_bw = (times.b[0] + times.w[0] - _head_b(hw, tp, tokens)) / TINY.n_layers
    assert per_block_bw == pytest.approx(backward, rel=1e-9)


def _elementwise_bytes(tokens: int, tp: int, sp: bool) -> float:
    """A tiny block's element-wise bytes on one rank, eager, fp32 (twice the bf16 class counts): two RMSNorms (36)
    and two residual adds (6) per hidden-state element (1/tp of the sequence with sp), the rotation (20) of q and k,
    SwiGLU (10) on the MLP's share."""
    rotated = (TINY.n_heads // tp + max(TINY.n_kv_heads // tp, 1)) * TINY.head_dim
    seq_tokens = tokens / tp if sp else tokens
    return 2 * (2 * seq_tokens * TINY.hidden * (36 + 6) + tokens * (rotated * 20 + TINY.ffn / tp * 10))


@pytest.mark.parametrize("tp, sp", [(1, False), (2, False), (2, True)])
def test_selective_recompute_costs_what_its_policy_reruns_plus_the_measured_dispatch(tp, sp):
    """fivefold's policy keeps every projection's output and the attention kernel's, so a block's selective
    recompute reruns its element-wise operators (their bytes and fixed costs), pays the profile's per-operator
    dispatch, and communicates again under tensor parallel except where the overlapped sp linears keep their
    collectives' outputs. Closed form on the measured tables, as the test above."""
    hw = _profile(selective_dispatch_us=700.0)
    tokens = 4 * 128
    act = _elementwise_bytes(tokens, tp, sp)
    bandwidth = hw.elementwise_bandwidth(tokens * TINY.hidden * 4 / (tp if sp else 1))
    expected = act / bandwidth + FIVEFOLD_CPU.kernels_per_layer * 10e-6 + 700e-6
    lays = {mode: Layout(tp=tp, sp=sp, micro_batch_size=4, grad_accum_steps=4, recompute=mode)
            for mode in ("none", "selective")}
    times = {mode: stage_times(TINY, 128, lay, FIVEFOLD_CPU, hw) for mode, lay in lays.items()}
    assert times["selective"].comm_per_layer["recompute"] == pytest.approx(expected, rel=1e-9)
    again = times["selective"].comm_per_layer["tp_comm"] - times["none"].comm_per_layer["tp_comm"]
    if tp > 1 and not sp:  # the two all-reduces of the forward run again
        assert again == pytest.approx(2 * comm.all_reduce(tokens * TINY.hidden * 4, tp, 1, hw), rel=1e-9)
    else:  # nothing to communicate, or kept by the overlapped linears
        assert again == 0.0
    # the recompute lands in the backward, once per block, with its communication
    extra = (times["selective"].b[0] - times["none"].b[0]) / TINY.n_layers
    assert extra == pytest.approx(expected + again, rel=1e-9)
    # compiled blocks apply the policy when they are traced: no dispatch at run time
    compiled = with_features(FIVEFOLD_CPU, ["compile"])
    assert stage_times(TINY, 128, lays["selective"], compiled, hw).comm_per_layer["recompute"] == stage_times(
        TINY, 128, lays["selective"], compiled, dataclasses.replace(hw, selective_dispatch_us=0.0)
    ).comm_per_layer["recompute"] > 0
    # a framework whose policy leaves the MLP's matmuls to recompute reruns their share of the linears' forward
    mlp_too = dataclasses.replace(FIVEFOLD_CPU, selective_saved_matmuls="q,k,v,o")
    shapes = linear_shapes(TINY, tokens, tp, fused=False)
    mlp_f = sum(2 * m * n * k / (next(r for r in hw.linear if r[:3] == (m, n, k))[3] * 1e12) for m, n, k in shapes[4:])
    more = stage_times(TINY, 128, lays["selective"], mlp_too, hw).comm_per_layer["recompute"]
    assert more - expected == pytest.approx(mlp_f, rel=1e-9) and mlp_f > 0
    # the published frameworks' pricing: the attention core's forward alone
    attention = dataclasses.replace(FIVEFOLD_CPU, selective_reruns="attention")
    attn_row = next(r for r in hw.attention if r[0] == 4 * TINY.n_heads / tp)
    attn_f = 2 * 4 * TINY.n_heads / tp * 128 * 128 * TINY.head_dim / (attn_row[3] * 1e12)
    assert stage_times(TINY, 128, lays["selective"], attention, hw).comm_per_layer["recompute"] == pytest.approx(
        attn_f, rel=1e-9)


def test_the_reference_parts_timed_beside_the_step_are_the_reference_models_own():
    """`compute_scale` sets the reference step against its own parts timed just before and after it: the plan cut to
    the shapes the planner reads for that step (every one of its linears, its attention and loss, one hidden-state
    tensor for the element-wise operators), once, on one rank, without the ZeRO-3 unit."""
    import argparse

    from fivefold.tools.calibrate.targets import for_group, make_plan

    plan, _ = make_plan(argparse.Namespace(model="", seq_len=0, nproc_max=2, quick=False, threads=0), "cpu")
    ref = reference_plan(for_group(plan, 1))
    cfg = reference_config(1, 1)
    tokens = cfg.layout.micro_batch_size * cfg.train.seq_len
    assert sorted(ref.linear) == sorted({tuple(int(x) for x in s) for s in linear_shapes(cfg.model, tokens, 1, False)})
    assert ref.attention == [(4, 4, 4, 128, 32)] and ref.loss == [(512, 1024, 128)]
    assert ref.elementwise_numel == [tokens * cfg.model.hidden]
    assert ref.compute and ref.passes == 1 and ref.model is None and ref.threads == for_group(plan, 1).threads


def test_selective_dispatch_is_the_unexplained_difference_per_block():
    """`calibrate`'s selective_dispatch_us: (measured selective - plain) - (predicted selective - plain), per block of
    the reference model (2), in µs, never below 0."""
    assert dispatch_us((0.040, 0.060), (0.038, 0.042)) == pytest.approx(1e6 * 0.016 / 2)
    assert dispatch_us((0.040, 0.041), (0.038, 0.042)) == 0.0


def _head_row(hw: Cluster, tp: int) -> tuple[float, ...]:
    return next(r for r in hw.loss or hw.linear if r[:3] == (512, TINY.vocab_size / tp, TINY.hidden))


def _head_f(hw: Cluster, tp: int, tokens: int) -> float:
    row = _head_row(hw, tp)
    logits_bw = hw.elementwise_bandwidth(512 * TINY.vocab_size / tp * 4)
    logits = 0.0 if hw.loss else tokens * TINY.vocab_size / tp * FIVEFOLD_CPU.logits_bytes * 2 / logits_bw
    head = (2 * 512 * TINY.vocab_size / tp * TINY.hidden / (row[3] * 1e12) + logits
            + FIVEFOLD_CPU.kernels_per_micro_batch * 10e-6)
    if tp > 1:  # embedding output all-reduce (half in forward), loss statistics
        head += comm.all_reduce(tokens * TINY.hidden * 4, tp, 1, hw) / 2
        head += comm.all_reduce(512 * 4, tp, 1, hw) + comm.all_reduce(2 * 512 * 4, tp, 1, hw)
    return head


def _head_b(hw: Cluster, tp: int, tokens: int) -> float:
    row = _head_row(hw, tp)
    head = 4 * 512 * TINY.vocab_size / tp * TINY.hidden / (row[4] * 1e12) + FIVEFOLD_CPU.kernels_per_micro_batch * 14e-6
    return head + (comm.all_reduce(tokens * TINY.hidden * 4, tp, 1, hw) / 2 if tp > 1 else 0.0)


def test_collective_time_is_the_measured_table():
    rows = ((4096, 1e-4), (65536, 4e-4), (4194304, 8e-3))
    hw = _profile(collectives={"all_reduce": {2: rows}, "reduce_scatter": {2: rows}})
    assert comm.all_reduce(65536, 2, 1, hw) == pytest.approx(4e-4)
    # between points: log-log; beyond the last: bandwidth bound; below the first: its latency
    geometric = math.exp((math.log(4e-4) + math.log(8e-3)) / 2)
    assert comm.all_reduce(math.sqrt(65536 * 4194304), 2, 1, hw) == pytest.approx(geometric)
    assert comm.all_reduce(2 * 4194304, 2, 1, hw) == pytest.approx(16e-3)
    assert comm.all_reduce(100, 2, 1, hw) == pytest.approx(1e-4)
    # in buckets: one measured call per bucket of the bucket's size
    assert comm.reduce_scatter(4 * 65536, 2, 1, hw, bucket=65536) == pytest.approx(4 * 4e-4)
    # a group size that was not measured: its ring steps relative to the nearest measured one
    assert comm.all_reduce(65536, 4, 1, hw) == pytest.approx(3 * 4e-4)
    # a kind that was not measured falls back to the link formula
    assert comm.all_gather(65536, 2, 1, hw) == pytest.approx(65536 / 2 / (hw.intra_node_gbps * 1e9)
                                                             + hw.intra_latency_us * 1e-6)


def test_collectives_in_a_step_add_the_measured_wait():
    rows = ((4096, 1e-4), (4194304, 8e-3))
    hw = _profile(collectives={"all_reduce": {2: rows, 4: rows}}, collective_wait=((2, 3e-4), (4, 2e-3)))
    assert comm.all_reduce(4096, 2, 1, hw) == pytest.approx(1e-4 + 3e-4)
    assert comm.all_reduce(4096, 4, 1, hw) == pytest.approx(1e-4 + 2e-3)
    assert comm.all_reduce(2 * 4096, 2, 1, hw, bucket=4096) == pytest.approx(2 * (1e-4 + 3e-4))  # per call


def test_zero3_adds_the_measured_unit_cost_per_micro_batch():
    rows = ((4096, 1e-4), (4194304, 8e-3))
    base = _profile(collectives={"all_gather": {2: rows}, "reduce_scatter": {2: rows}})
    lay = Layout(dp=2, zero=3, micro_batch_size=2, grad_accum_steps=4)
    plain = step_time(TINY, 128, lay, FIVEFOLD_CPU, base).parts["zero_gather"]
    costly = step_time(TINY, 128, lay, FIVEFOLD_CPU, dataclasses.replace(base, zero3_unit_us=500.0))
    # 4 micro-batches x (4 blocks + the root unit) x 0.5 ms
    assert costly.parts["zero_gather"] - plain == pytest.approx(4 * 5 * 500e-6)


def test_step_adds_optimizer_and_unhidden_gradient_reduction():
    rows = ((4096, 1e-4), (4194304, 8e-3))
    hw = _profile(collectives={"all_reduce": {2: rows}}, optimizer_gbps=2.0, optimizer_tensor_us=100.0,
                  comm_overlap=0.0)
    lay = Layout(dp=2, micro_batch_size=4, grad_accum_steps=2)
    report = step_time(TINY, 128, lay, FIVEFOLD_CPU, hw)
    states = model_state_bytes(TINY, lay, FIVEFOLD_CPU, "first", seq=128)
    expected_opt = (states["parameters"] + states["gradients"] + states["optimizer"]) / 2e9 + \
        optimizer_tensors(TINY, lay, FIVEFOLD_CPU, 128) * 100e-6
    assert report.parts["optimizer"] == pytest.approx(expected_opt)
    assert optimizer_tensors(TINY, lay, FIVEFOLD_CPU, 128) == 4 * 9 + 2  # tiny: tied embedding, final norm
    # nothing overlaps: the whole all-reduce of the fp32 gradients is exposed
    assert report.parts["dp_comm_exposed"] == pytest.approx(comm.all_reduce(states["gradients"], 2, 1, hw))


def test_ranks_on_a_node_select_their_measurements():
    hw = dataclasses.replace(_profile(), by_ranks={2: {"kernel_overhead_us": 20.0, "collectives": {}},
                                                   4: {"kernel_overhead_us": 45.0}})
    assert hw.on_node(1).kernel_overhead_us == 10.0
    assert hw.on_node(2).kernel_overhead_us == 20.0 and hw.on_node(3).kernel_overhead_us == 20.0
    assert hw.on_node(4).compute_scale == 1.0
    eight = hw.on_node(8)  # twice the ranks of the most measured, on 2 cores: every compute time doubles
    assert eight.kernel_overhead_us == 45.0 and eight.compute_scale == 2.0
    assert eight.linear_time(512, 128, 128)[0] == pytest.approx(2 * hw.linear_time(512, 128, 128)[0])


def test_interpolation_of_scattered_measurements():
    points = ((100, 100, 100, 1.0, 2.0), (400, 100, 100, 4.0, 8.0))
    assert interpolate(points, (100, 100, 100)) == (1.0, 2.0)
    assert interpolate(points, (200, 100, 100)) == pytest.approx((2.0, 4.0))  # halfway in log2: geometric mean
    assert interpolate(points, (10_000, 100, 100))[0] == pytest.approx(4.0, rel=0.05)  # held, not extrapolated


def test_collective_tables_never_slower_for_smaller_messages():
    rows = [[4096, 5e-3], [16384, 1e-3], [65536, 2e-3], [262144, 1.5e-3], [1 << 20, 4e-3]]
    assert monotone(rows) == [[4096, 1e-3], [16384, 1e-3], [65536, 1.5e-3], [262144, 1.5e-3], [1 << 20, 4e-3]]


def test_fit_link_recovers_latency_and_bandwidth():
    latency, bandwidth = 50e-6, 1.5e9
    rows = [[b, 2 * latency + b / bandwidth] for b in (4096, 65536, 1 << 20, 16 << 20)]
    fitted = fit_link(rows, 2)
    assert fitted[0] == pytest.approx(latency, rel=1e-6) and fitted[1] == pytest.approx(bandwidth, rel=1e-6)


def test_cpu_operator_counts_are_the_blocks():
    """FIVEFOLD_CPU's fixed-cost operators per block and per micro-batch are what the profiler counts in the
    engine's forward and backward of one micro-batch (the top-level operators of the forward, each with its
    backward; linears and the attention kernel are timed by shape)."""
    from torch.profiler import ProfilerActivity, profile

    from fivefold.config import build_config
    from fivefold.models.llama import build_model
    from fivefold.train.build import single_device_engine

    def count(layers: int) -> tuple[int, int]:
        cfg = build_config(None, {"model.preset": "tiny", "model.n_layers": str(layers), "train.device": "cpu"})
        engine = single_device_engine(build_model(cfg.model, device=torch.device("cpu"), seed=0), cfg,
                                        torch.device("cpu"))
        tokens = torch.randint(0, cfg.model.vocab_size, (1, 33))
        micro = [(tokens[:, :-1], tokens[:, 1:])]
        engine.forward_backward(micro, 32)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            engine.forward_backward(micro, 32)
        # RMSNorm is one autograd function: its forward's operators are its event's children
        top = [name for e in prof.events() if e.cpu_parent is None and not e.name.startswith("autograd::")
               for name in ([c.name for c in e.cpu_children] if e.name == "RMSNormFunction" else [e.name])]
        timed = sum(name in ("aten::linear", "aten::scaled_dot_product_attention") for name in top)
        return len(top) - timed, timed

    two, four = count(2), count(4)
    per_layer = (four[0] - two[0]) // 2
    assert per_layer == FIVEFOLD_CPU.kernels_per_layer
    assert (four[1] - two[1]) // 2 == 8  # q, k, v, o, gate, up, down and the attention kernel
    # outside the blocks: embedding, rotary tables, final norm and the fused output layer + loss (one operator,
    # timed as the output layer's linear)
    assert four[0] - 4 * per_layer - 1 == FIVEFOLD_CPU.kernels_per_micro_batch


def test_timed_operands_rotate_through_sets_beyond_the_caches():
    """Each timed call of a compute figure finds its operands uncached: the sets rotated through span at least
    `COLD_SPAN_BYTES` (up to `MAX_SETS` copies), and successive calls use different sets."""
    from fivefold.tools.calibrate import COLD_SPAN_BYTES, MAX_SETS, Clock, operand_sets, time_forward_backward

    assert operand_sets(3 * 2**20) == math.ceil(COLD_SPAN_BYTES / (3 * 2**20)) <= MAX_SETS
    assert operand_sets(1024) == MAX_SETS and operand_sets(10 * COLD_SPAN_BYTES) == 1
    made, used = [], []

    def make():
        x = torch.randn(4, 4, requires_grad=True)
        made.append(x)
        return (lambda: (used.append(x), x * 2)[1]), [x], torch.ones(4, 4)

    fwd, bwd = time_forward_backward(Clock(torch.device("cpu"), 1, 0.0), make, 8 * 2**20)
    assert len(made) == operand_sets(8 * 2**20) == 12 and fwd > 0 and bwd > 0
    assert len(used) >= 5 and all(a is not b for a, b in itertools.pairwise(used))  # one set per call, in turn
    assert [id(t) for t in used] == [id(made[i % len(made)]) for i in range(len(used))]


def test_tied_embedding_gradient_sum_across_pipeline_ends_is_timed():
    """With tied embeddings on pp > 1, the first and last pipeline ranks sum the embedding's gradient once per
    step: one all-reduce of vocab x hidden gradient bytes over 2 ranks; none when DualPipeV keeps both ends on
    rank 0 or the model is untied."""
    hw = get_cluster("cpu")
    lay = Layout(pp=2, micro_batch_size=2, grad_accum_steps=4)
    rep = step_time(TINY, 128, lay, FIVEFOLD_CPU, hw)
    st = comm.strides(lay)
    expect = comm.all_reduce(TINY.vocab_size * TINY.hidden * FIVEFOLD_CPU.grad_bytes, 2, st["pp"], hw.on_node(2))
    assert TINY.tied_embeddings and rep.parts["dp_comm_exposed"] == pytest.approx(expect) and expect > 0
    untied = dataclasses.replace(TINY, tied_embeddings=False)
    assert step_time(untied, 128, lay, FIVEFOLD_CPU, hw).parts["dp_comm_exposed"] == 0.0
    dualpipe = dataclasses.replace(lay, schedule="dualpipev", vpp=2)
    assert step_time(TINY, 128, dualpipe, FIVEFOLD_CPU, hw).parts["dp_comm_exposed"] == 0.0


def test_plan_and_result_reach_the_started_processes_unchanged():
    """The plan travels to each started process, and rank 0's figures back, as JSON: what arrives equals what
    was sent (shapes as tuples, the model's config, group sizes as numbers)."""
    import argparse
    import json

    from fivefold.tools.calibrate import Plan, make_plan

    args = argparse.Namespace(model="tiny,llama-3.2-1b", seq_len=0, nproc_max=2, quick=True, threads=1)
    plan, levels = make_plan(args, "cpu")
    assert levels == [1, 2] and plan.model == TINY and plan.linear and isinstance(plan.linear[0], tuple)
    assert Plan.from_json(json.loads(json.dumps(plan.to_json()))) == plan
    result = Result(2, linear=[[128, 256, 128, 0.03, 0.02]], comm_overlap=0.5,
                    collectives={"all_reduce": {2: [[4096, 1.5e-4]]}})
    assert Result.from_json(json.loads(json.dumps(result.to_json()))) == result


def test_zero3_under_pipeline_gathers_once_per_step():
    """Under pp the stages stay gathered for the step (`parallel.pipeline_zero3`): the gathers and reduce-scatters
    are charged once per step, whatever the micro-batch count; without pp they grow with it."""
    rows = ((4096, 1.0), (4194304, 2.0))  # slow enough that compute hides none of it
    hw = _profile(collectives={"all_gather": {2: rows}, "reduce_scatter": {2: rows}})

    def comm_parts(pp: int, m: int) -> tuple[float, float]:
        lay = Layout(dp=2, pp=pp, zero=3, micro_batch_size=1, grad_accum_steps=m)
        parts = step_time(TINY, 128, lay, FIVEFOLD_CPU, hw).parts
        return parts["zero_gather"], parts["dp_comm_exposed"]

    assert comm_parts(2, 4) == pytest.approx(comm_parts(2, 8))
    assert comm_parts(2, 4)[0] > 0
    assert comm_parts(1, 8)[0] > 1.5 * comm_parts(1, 4)[0]


def test_heap_retention_is_resident_over_live_within_its_bounds():
    """calibrate's `heap_retention`: the resident bytes above the baseline per live byte, never below 1 (an allocator
    that returns everything) nor above `HEAP_RETENTION_MAX`, and 1 where the resident set could not be read."""
    assert heap_retention(36 * 2**20, 20 * 2**20) == 1.8
    assert heap_retention(10 * 2**20, 20 * 2**20) == 1.0
    assert heap_retention(1000 * 2**20, 20 * 2**20) == HEAP_RETENTION_MAX
    assert heap_retention(0, 20 * 2**20) == 1.0


def test_calibrate_restarts_under_the_runs_allocator(tmp_path):
    """On a Linux CPU, calibrate started from the command line without glibc's thread cache setting restarts itself
    with the cache off (as the runs it profiles have it: its one-rank tables and whole step are timed in its own
    process), once; with the setting there, or called in-process (`main([...])`), or on an accelerator, it does not.
    The restarted command is the same, and imports this fivefold first."""
    import argparse
    import os
    import subprocess
    import sys
    from pathlib import Path

    import fivefold
    from fivefold.device import TCACHE_TUNABLE
    from fivefold.tools.calibrate.cli import restart_command

    if not sys.platform.startswith("linux"):
        pytest.skip("glibc's tunables are Linux's")
    args = argparse.Namespace(worker=None, device="cpu", command_line=["calibrate", "--quick", "--out", "p.toml"])
    bare = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    argv, env = restart_command(args, bare)
    assert argv == [sys.executable, "-m", "fivefold", "calibrate", "--quick", "--out", "p.toml"]
    assert env["GLIBC_TUNABLES"] == f"{TCACHE_TUNABLE}=0"
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(Path(fivefold.__file__).resolve().parents[1])
    _, env = restart_command(args, {**bare, "GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert env["GLIBC_TUNABLES"] == f"glibc.malloc.arena_max=2:{TCACHE_TUNABLE}=0"  # the user's kept
    assert restart_command(args, {**bare, "GLIBC_TUNABLES": f"{TCACHE_TUNABLE}=3"}) is None  # the user's own count
    assert restart_command(argparse.Namespace(**{**vars(args), "command_line": None}), bare) is None  # in-process
    assert restart_command(argparse.Namespace(**{**vars(args), "worker": "job.json"}), bare) is None  # a rank
    # end to end: the restart happens once, then the restarted process goes on (here to its check of --out)
    out = tmp_path / "missing" / "p.toml"
    done = subprocess.run([sys.executable, "-m", "fivefold", "calibrate", "--device", "cpu", "--out", str(out)],
                          env={**bare, "PYTHONPATH": str(Path(fivefold.__file__).resolve().parents[1])},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stdout.count("calibrate: restarting with GLIBC_TUNABLES=glibc.malloc.tcache_count=0") == 1
    assert "--out" in done.stderr and "does not exist" in done.stderr
