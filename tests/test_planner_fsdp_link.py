"""ZeRO-3 without a pipeline: the parameter all-gathers and the gradient reduce-scatters of a step share one link
(one communicator runs its collectives in issue order, and both cross the same network links), so in the backward
a block's compute hides the next block's gather and its own reduce-scatter together (`time.fsdp_link_time`).
References: step-by-step hand computations of the two-resource queue, and its closed forms where the link or the
compute bounds the step."""

from __future__ import annotations

import dataclasses

import pytest

from fivefold.planner.hardware import get_cluster
from fivefold.planner.layout import Layout
from fivefold.planner.profile import all_frameworks
from fivefold.planner.time import fsdp_link_time, stage_times, step_time
from fivefold.presets import get_preset


def test_two_blocks_by_hand():
    """Blocks of forward 1 s and backward 2 s, gathers and reduce-scatters of 1 s. Link: gather 0 (0-1), gather 1
    (1-2, under block 0's forward, which starts at 1); the forward ends at 3; the backward's gather of block 0 runs
    3-4 (exposed), block 0's backward 4-6 with the gather of block 1 under it (4-5), its reduce-scatter 6-7 under
    block 1's backward (6-8), whose reduce-scatter runs 8-9: the step ends at 9 against 6 s of compute."""
    assert fsdp_link_time(1.0, 1.0, 1.0, 2.0, 2, 1, 1.0) == pytest.approx(3.0)
    # nothing hidden: every collective whole, the gathers twice per micro-batch
    assert fsdp_link_time(1.0, 1.0, 1.0, 2.0, 2, 1, 0.0) == pytest.approx(2 * (2 + 1))
    # half of the link time hideable: the blend of the two, as `time.exposed`
    assert fsdp_link_time(1.0, 1.0, 1.0, 2.0, 2, 1, 0.5) == pytest.approx(0.5 * 3 + 0.5 * 6)


@pytest.mark.parametrize("micro_batches", [1, 2, 5, 64])
def test_compute_bound_leaves_the_first_gathers_and_the_last_scatter(micro_batches):
    """Collectives far shorter than a block's compute: each micro-batch waits for its forward's first gather and its
    backward's first, and for its last block's reduce-scatter (the next micro-batch's first gather queues behind it;
    after the last micro-batch the step waits for it); the others run under compute."""
    g, s, blocks = 0.01, 0.02, 16
    assert fsdp_link_time(g, s, 1.0, 2.0, blocks, micro_batches, 1.0) == pytest.approx(micro_batches * (2 * g + s))


@pytest.mark.parametrize("micro_batches", [1, 3, 40])
def test_link_bound_takes_the_link_time(micro_batches):
    """Collectives far longer than the compute: the link is busy the whole step except while each micro-batch's last
    forward block computes (its gather done, the backward's first not yet issued), so the step is the link's time
    plus one forward block per micro-batch."""
    g, s, f, b, blocks = 5.0, 7.0, 1.0, 2.0, 8
    link = micro_batches * blocks * (2 * g + s)
    compute = micro_batches * blocks * (f + b)
    exposed = fsdp_link_time(g, s, f, b, blocks, micro_batches, 1.0)
    assert exposed == pytest.approx(link + micro_batches * f - compute)


def test_backward_hides_gather_and_scatter_together():
    """In the backward a block's compute must hide gather + scatter: with each alone shorter than it and both
    together longer, the steady state exposes their excess, which charging each against its own compute misses."""
    g, s, f, b, blocks, m = 0.6, 0.6, 1.0, 1.0, 40, 8
    exposed = fsdp_link_time(g, s, f, b, blocks, m, 1.0)
    # per micro-batch the link carries blocks x (2g + s) = 72 s against 80 s of compute, but the backward half
    # carries 48 s against 40: 8 s per micro-batch in the steady state, plus at most each micro-batch's first two
    # gathers, its last scatter and one block of compute at its edges
    steady = m * blocks * (g + s - b)
    assert steady < exposed <= steady + m * (2 * g + s + b)
    # charged separately (each collective against its own block's compute, as before) nothing would show
    assert max(0.0, g - f) + max(0.0, s - b) == 0


def test_fsdp_across_nodes_exposes_the_shared_link():
    """Llama-3.1-70B, FSDP (dp 8, one GPU per node in each group) x tp 4 on 8 nodes of 4 H200, torchtitan: a block's
    bf16 gather and fp32 reduce-scatter cross the network in the backward; the step's exposed ZeRO-3 time is at
    least the micro-batches x blocks x (gather + scatter - backward) of the steady state, and the step is longer
    than with the compute alone."""
    titan = all_frameworks()["torchtitan"]
    cfg = get_preset("llama-3.1-70b")
    hw = dataclasses.replace(get_cluster("h200"), gpus_per_node=4)
    lay = Layout(dp=8, tp=4, zero=3, micro_batch_size=1, grad_accum_steps=16)
    m, blocks = 16, cfg.n_layers
    report = step_time(cfg, 8192, lay, titan, hw)
    # with nothing hidden the parts are the link's whole time: the gathers twice per micro-batch, the scatters once
    bare = step_time(cfg, 8192, lay, titan, dataclasses.replace(hw, comm_overlap=0.0))
    g, s = bare.parts["zero_gather"] / (2 * m * blocks), bare.parts["dp_comm_exposed"] / (m * blocks)
    times = stage_times(cfg, 8192, lay, titan, hw.on_node(4))
    f, b = times.f[0] / blocks, (times.b[0] + times.w[0]) / blocks
    assert g < f and s < b < g + s  # each alone hides under its block; together they outlast the backward
    steady = m * blocks * (g + s - b)
    exposed = report.parts["zero_gather"] + report.parts["dp_comm_exposed"]
    assert steady < exposed <= steady + m * (2 * g + s + b)


def test_a_bucket_holds_at_least_one_parameter_tensor():
    """fivefold's engine never splits a parameter over gradient buckets (`parallel.data.make_buckets`), so a bucket
    of one element makes one bucket per parameter tensor, not one per element: the step with dp_bucket_size = 1
    costs what one bucket per tensor costs (each tensor's all-reduce latency), far from a million latencies."""
    from fivefold.planner.layout import FIVEFOLD
    from fivefold.planner.time import parameter_tensors

    cfg = get_preset("tiny")
    cpu = dataclasses.replace(get_cluster("h100"), comm_overlap=0.0)
    lay = Layout(dp=2, zero=1, micro_batch_size=4, grad_accum_steps=1)
    tiny_buckets = dataclasses.replace(lay, dp_bucket_size=1)
    per_tensor = step_time(cfg, 64, tiny_buckets, FIVEFOLD, cpu).parts["dp_comm_exposed"]
    whole = step_time(cfg, 64, lay, FIVEFOLD, cpu).parts["dp_comm_exposed"]  # one bucket (Megatron's rule)
    # the extra latency of about one all-reduce per tensor, over two ranks in a node (2 ring steps each)
    extra = (parameter_tensors(cfg, cfg.n_layers) - 1) * 2 * cpu.intra_latency_us * 1e-6
    assert per_tensor - whole == pytest.approx(extra, rel=0.2)
