"""Pipeline parallel against one process, with the method of tests/test_parallel_equivalence.py (K = 3 steps of a
tiny Llama in fp32 on CPU, the same global batches; losses to 1e-5, gradient norms and parameters to 1e-4
relative), on a 4-block model with 4 micro-batches per step (DualPipeV needs 2 pp of them), and with dp or tp
on the 2-block model where 4 stages are not needed (see PP_DP). Every rank also checks that it ran exactly its
action list, that every gradient bucket was reduced from a hook and that no deferred weight gradient was left.

Also: the executor calls each stage in exactly its rank's order and routes every message (synthetic stages);
the B / W split defers the linears' weight gradients to W; the stage split is the min-max optimum; the stages
initialise as the one-process model; resume; `fivefold train --nproc 2 --layout.pp 2`.

Fast (default run): pp2 1F1B and zero-bubble (MoE, capacity routing, untied); the executor, split and B / W
tests. Slow: the other schedules, ZeRO-1/2 x dp2, tp2 (+SP), cp2, dp2 x tp2 x pp2 (8 ranks), resume, the CLI.
"""

from __future__ import annotations

import sys

import pytest
import torch
from tests.distributed import run_ranks
from tests.test_parallel_equivalence import (
    STEPS,
    assert_matches_one_process,
    assert_switch_changes_nothing,
    tiny_config,
    train_steps,
)
from tests.test_parallel_launch import assert_cli_run_matches, check_resume
from tests.test_train import dataset, small_config  # noqa: F401  (dataset is a fixture)

from fivefold.config import dump_toml
from fivefold.parallel.schedules import build_schedule
from fivefold.train.checkpoint import latest_checkpoint
from fivefold.train.loop import train

PP = {"model.n_layers": "4", "layout.micro_batch_size": "2"}  # 4 blocks, 4 micro-batches of 2 sequences
# with dp or tp, the 2-block model of the other equivalence tests where 4 stages are not needed: the dense 4-block
# one is badly conditioned for the method (dp2 or tp2 + SP alone, without pp, already differ from one process by
# 1e-4 to 6e-4 there, in a few elements of the last block that AdamW amplifies), the 2-block one by about 1e-6
PP_DP = {"layout.micro_batch_size": "2"}


def pipeline_on_ranks(rank: int, world_size: int, layouts: list[dict[str, str]]) -> list:
    """On every rank: train each layout; rank 0 returns (losses, norms, state) of each, every rank checks that it
    ran its action list in order and that the data-parallel buckets were reduced from the gradient hooks."""
    from fivefold.flops import balanced_stage_layers
    from fivefold.parallel.pipeline import layer_ranges
    from fivefold.train.build import build_engine

    results = []
    for overrides in layouts:
        cfg = tiny_config(overrides)
        engine = build_engine(cfg, torch.device("cpu"))
        losses, norms, drops = train_steps(engine, cfg)
        schedule = engine.runner.schedule(cfg.grad_accum_steps)
        assert [r.action for r in engine.runner.traces[True]] == list(schedule.actions[engine.pp_rank])
        (forward,) = [s for (_, training), s in engine.runner.schedules.items() if not training]  # the evaluation's
        assert [r.action for r in engine.runner.traces[False]] == list(forward.actions[engine.pp_rank])
        counts = cfg.layout.stage_layers or balanced_stage_layers(cfg.model, schedule.n_stages, cfg.train.seq_len)
        for s, stage in engine.runner.stages.items():  # the split asked for (or the balanced one), stage by stage
            assert list(stage.layers) == [str(i) for i in layer_ranges(counts)[s]]
        dp = engine.data_parallel
        if cfg.layout.zero < 2:  # each bucket reduced once per step, launched by the hook of its last gradient
            assert dp.launched_in_backward == len(dp.buckets) * STEPS
        if engine.runner.queue is not None:
            assert len(engine.runner.queue) == 0  # every deferred weight gradient was computed by a W pass
        state = engine.model_state()
        results.append((losses, norms, drops, state if rank == 0 else None))
    return results


def assert_pipeline_equivalent(layouts: list[dict[str, str]], world_size: int) -> None:
    results = run_ranks(world_size, pipeline_on_ranks, layouts)[0]
    for overrides, (losses, norms, drops, state) in zip(layouts, results, strict=True):
        assert_matches_one_process(overrides, losses, norms, drops, state)


class RoutingStage:
    """A synthetic stage that records what it ran and checks that each input is the one its action needs, in
    `dtype`: F(i, s) outputs 1000 i + s, B(i, s) outputs -(1000 i + s)."""

    def __init__(self, stage: int, n_stages: int, calls: list, dtype: torch.dtype = torch.float32) -> None:
        self.stage, self.last, self.calls, self.dtype = stage, stage == n_stages - 1, calls, dtype

    def full(self, value: float) -> torch.Tensor:
        return torch.full((2, 3), value, dtype=self.dtype)

    def forward(self, mb, x):
        self.calls.append(("F", mb, self.stage))
        if self.stage > 0:
            assert x.dtype == self.dtype and torch.equal(x, self.full(1000 * mb + self.stage - 1)), (mb, self.stage, x)
        return None if self.last else self.full(1000.0 * mb + self.stage)

    def backward_input(self, mb, grad):
        self.calls.append(("B", mb, self.stage))
        if not self.last:
            assert grad.dtype == self.dtype and torch.equal(grad, self.full(-(1000 * mb + self.stage + 1))), \
                (mb, self.stage, grad)
        return None if self.stage == 0 else self.full(-(1000.0 * mb + self.stage))

    def backward_weight(self, mb):
        self.calls.append(("W", mb, self.stage))


def executor_on_ranks(rank: int, world_size: int) -> None:
    import itertools

    import torch.distributed as dist

    from fivefold.parallel.pipeline import PipelineExecutor
    from fivefold.parallel.schedules import build_schedule, forward_schedule

    group = dist.new_group(list(range(world_size)))
    cases = [("afab", 4, 1), ("1f1b", 5, 1), ("interleaved", 6, 2), ("zero-bubble", 5, 1), ("dualpipev", 7, 1)]
    for (name, m, v), dtype, overlap in itertools.product(cases, (torch.float32, torch.bfloat16), (False, True)):
        schedules = [build_schedule(name, world_size, m, v), forward_schedule(name, world_size, m, v)]
        if name == "dualpipev":  # its F and B pairs run as two lanes, with the B's W in its lane or after the pair
            schedules += [build_schedule(name, world_size, m, v, overlap_fb=True, pair_w=w) for w in (False, True)]
        for schedule in schedules:
            calls: list = []
            stages = {s: RoutingStage(s, schedule.n_stages, calls, dtype) for s, r in enumerate(schedule.stage_rank)
                      if r == rank}
            executor = PipelineExecutor(group, rank, (2, 3), dtype, torch.device("cpu"), overlap=overlap)
            trace = executor.run(schedule, stages)
            expected = []
            for a in schedule.actions[rank]:
                expected.append(tuple(a))
                if a.kind == "B" and not schedule.split_backward:
                    expected.append(("W", a.micro_batch, a.stage))  # a whole backward: its W right after its B
            assert calls == expected, (name, rank)
            assert [r.action for r in trace] == list(schedule.actions[rank])
            for k in schedule.fused_at(rank):  # a pair's actions (its W too, under pair_w) run as one unit
                unit = {(r.start, r.end) for r in trace[k:k + len(schedule.unit(rank, k))]}
                assert len(unit) == 1, (name, rank, k)
            if schedule.pair_w:
                assert any(len(schedule.unit(rank, k)) == 3 for k in schedule.fused_at(rank))


def test_executor_runs_each_rank_s_actions_in_order_and_routes_every_message():
    """Three ranks, every schedule and its forward-only variant, in fp32 and bf16, with the point-to-point overlap
    (`layout.pp_comm_overlap`: a whole backward's input gradient posted before its weight gradients) and without:
    each stage is called in exactly the order of its rank's action list, and every activation and gradient reaches
    the action that needs it, in the dtype the stages produce."""
    run_ranks(3, executor_on_ranks)


class SideChannelStage:
    """A stage of two-rank AFAB whose work depends on the other rank's progress outside the pipeline: the first
    stage's forward of micro-batch 1 waits (on another group) for a token that the last stage sends from its forward
    of micro-batch 0. That forward can only run if the last stage's receive of micro-batch 0 returns before the
    first stage's forward of micro-batch 1 has sent: a receive that also waited for the later messages posted with it
    (the last stage's first batch holds the receives of every forward) never returns, and the side channel's
    timeout ends the step with an error instead."""

    def __init__(self, stage: int, side: object) -> None:
        self.stage, self.side = stage, side

    def forward(self, mb, x):
        import torch.distributed as dist

        token = torch.zeros(1)
        if self.stage == 0 and mb == 1:
            dist.recv(token, group=self.side, group_src=1)
        if self.stage == 1 and mb == 0:
            dist.send(torch.ones(1), group=self.side, group_dst=0)
        return torch.zeros(2, 3) if self.stage == 0 else None

    def backward_input(self, mb, grad):
        return torch.zeros(2, 3) if self.stage == 1 else None

    def backward_weight(self, mb):
        pass


def receive_alone_on_ranks(rank: int, world_size: int) -> list:
    import datetime

    import torch.distributed as dist

    from fivefold.parallel.pipeline import PipelineExecutor

    group = dist.new_group([0, 1])
    side = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=30))
    done = []
    for overlap in (False, True):
        schedule = build_schedule("afab", 2, 4)
        executor = PipelineExecutor(group, rank, (2, 3), torch.float32, torch.device("cpu"), overlap=overlap)
        executor.run(schedule, {rank: SideChannelStage(rank, side)})
        done.append(overlap)
    return done


def test_a_receive_waits_for_its_own_message_alone():
    """Each point-to-point operation is its own unit with its own handle (`PointToPoint.post`), with the overlap
    switch on and off: a rank starts an action as soon as that action's input has arrived, not once every message
    posted beside it has (which serialised AFAB and 1F1B: the last stage waited for every forward before its
    first). Checked by a dependency that deadlocks otherwise (`SideChannelStage`)."""
    assert run_ranks(2, receive_alone_on_ranks, timeout=120) == [[False, True]] * 2


def test_a_message_in_another_dtype_is_refused():
    """The stages send what they produce in the executor's dtype; a tensor of another dtype is an error, not a
    silent cast (checked before anything is posted, so no process group is needed)."""
    from fivefold.parallel.pipeline_comm import PointToPoint
    from fivefold.parallel.schedules import build_schedule

    schedule = build_schedule("1f1b", 2, 2)
    p2p = PointToPoint(schedule, 0, None, (2, 3), torch.bfloat16, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="torch.float32 .* but the stages communicate torch.bfloat16"):
        p2p.post(1, {("F", 0, 0): torch.zeros(2, 3)})
    with pytest.raises(RuntimeError, match="sends"):
        p2p.post(1, {})


def test_stage_split_is_the_most_balanced_by_compute():
    """Against brute force over every split into consecutive runs of blocks: the split's busiest stage (blocks,
    plus the output layer and loss in block units on the last stage) is the least possible."""
    import itertools

    from fivefold.config import ModelConfig
    from fivefold.flops import balanced_stage_layers, head_cost_in_layers

    for n_layers in range(2, 13):
        for stages in range(2, min(n_layers, 6) + 1):
            for vocab in (256, 2048, 32768):
                cfg = ModelConfig(n_layers=n_layers, vocab_size=vocab)
                head = head_cost_in_layers(cfg, 128)

                def busiest(split: list[int], head: float = head) -> float:
                    return max(*split[:-1], split[-1] + head)

                best = min(busiest([b - a for a, b in zip((0, *cuts), (*cuts, n_layers), strict=True)])
                           for cuts in itertools.combinations(range(1, n_layers), stages - 1))
                split = balanced_stage_layers(cfg, stages, 128)
                assert sum(split) == n_layers and min(split) >= 1
                assert busiest(split) == pytest.approx(best), (n_layers, stages, vocab, split)


def test_stages_hold_their_blocks_and_initialise_as_one_process():
    """Every rank's stages together are the one-process model, parameter for parameter (same names, same values),
    for the three stage placements; the tied output layer is a copy on the last rank, the same parameter when
    the first and last stages share a rank."""
    from fivefold.models.llama import build_model
    from fivefold.parallel.pipeline import build_stages, layer_ranges
    from fivefold.parallel.schedules import stage_placement

    cfg = tiny_config({**PP, "model.n_layers": "8"})
    full = build_model(cfg.model, "cpu", seed=5).state_dict()
    for name, p, v, counts in [("1f1b", 2, 1, [5, 3]), ("interleaved", 2, 2, [2, 2, 2, 2]),
                               ("dualpipev", 2, 1, [3, 2, 2, 1])]:
        placement = stage_placement(name, p, v)
        seen: dict[str, torch.Tensor] = {}
        for rank in range(p):
            stages = build_stages(cfg.model, counts, placement, rank, torch.device("cpu"), seed=5)
            assert sorted(stages) == [s for s, r in enumerate(placement) if r == rank]
            for s, stage in stages.items():
                assert list(stage.layers) == [str(i) for i in layer_ranges(counts)[s]]
                assert (stage.embed is not None) == (s == 0) and (stage.lm_head is not None) == (s == len(counts) - 1)
                seen.update(stage.state_dict())
            if 0 in stages and len(counts) - 1 in stages:
                assert stages[len(counts) - 1].lm_head.weight is stages[0].embed.weight
        assert seen.keys() == full.keys(), name
        assert all(torch.equal(seen[k], full[k]) for k in full), name


@pytest.mark.parametrize("first_block_only", [False, True])
def test_weight_gradients_wait_for_the_w_pass(first_block_only):
    """The B / W split: after B the linears of the blocks have no gradient (the norms do), W adds it, and the
    result equals a plain backward's. A whole backward's overlap (`first_block_only`) defers the first block's
    alone: the others' linears have their gradients after B."""
    from fivefold.models.llama import build_model
    from fivefold.parallel.pipeline import WeightGradQueue, defer_weight_grads

    cfg = tiny_config(PP)
    reference, model = build_model(cfg.model, "cpu", seed=3), build_model(cfg.model, "cpu", seed=3)
    queue = WeightGradQueue(first_block_only)
    defer_weight_grads(model, queue)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    grad = torch.randn(2, 16, cfg.model.hidden, generator=torch.Generator().manual_seed(1))
    reference.forward_hidden(tokens).backward(grad)
    with queue.collect((0, 0)):
        model.forward_hidden(tokens).backward(grad)
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.startswith("layers.")]
    deferred = [n for n in linears if n.startswith("layers.0.")] if first_block_only else linears
    assert len(linears) == 7 * cfg.model.n_layers and len(queue) == len(deferred) == 7 * (
        1 if first_block_only else cfg.model.n_layers)
    params = dict(model.named_parameters())
    assert all((params[f"{n}.weight"].grad is None) == (n in deferred) for n in linears)
    assert params["layers.0.attn_norm.weight"].grad is not None and params["embed.weight"].grad is not None
    queue.run((0, 0))
    assert len(queue) == 0
    for name, p in reference.named_parameters():
        if name != "lm_head.weight":
            torch.testing.assert_close(params[name].grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_the_w_pass_holds_one_weight_gradient_at_a_time():
    """W computes each deferred weight's gradient and accumulates it before computing the next, as a plain
    backward does: the GPU run of the 70B example's first stage under zero-bubble held its whole bf16 weight
    gradient (8.9 GiB) at once when W computed them all before accumulating any. Counted with weak references to
    the gradients W computes (alive ones: not yet freed after their accumulation), in the deferred order."""
    import weakref

    from fivefold.models.llama import build_model
    from fivefold.parallel.pipeline import WeightGradQueue, defer_weight_grads

    cfg = tiny_config(PP)
    model = build_model(cfg.model, "cpu", seed=3)
    queue = WeightGradQueue()
    defer_weight_grads(model, queue)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with queue.collect((0, 0)):
        model.forward_hidden(tokens).square().sum().backward()
    computed: list[weakref.ref] = []
    most_alive, order = 0, []

    def counting(weight, compute):
        def run():
            nonlocal most_alive
            most_alive = max(most_alive, sum(r() is not None for r in computed))
            order.append(weight)
            grad = compute()
            computed.append(weakref.ref(grad))
            return grad
        return weight, run

    items = queue.pending[(0, 0)]
    deferred = [w for w, _ in items]
    queue.pending[(0, 0)] = [counting(w, c) for w, c in items]
    queue.run((0, 0))
    assert len(computed) == 7 * cfg.model.n_layers and order == deferred  # every weight, in backward's order
    assert most_alive == 0  # no earlier gradient was alive when the next was computed
    assert all(w.grad is not None for w in deferred)


MOE = {"model.n_experts": "4", "model.top_k": "2"}


def test_pp2_1f1b_and_zero_bubble_match_one_process():
    """1F1B with tied embeddings on the two ranks (their gradients summed between them); zero-bubble with the
    B / W split on the MoE model, untied, with each stage's load-balancing loss and capacity-based routing (the
    drop fraction of the layers of both ranks equals the reference's)."""
    assert_pipeline_equivalent([
        {**PP, "layout.pp": "2"},
        {**PP, **MOE, "model.capacity_factor": "1.0", "layout.pp": "2", "layout.schedule": "zero-bubble",
         "model.tied_embeddings": "false"},
    ], world_size=2)


def test_pipeline_overlap_changes_no_loss():
    """1F1B and AFAB (whole backwards, whose weight gradients the overlap defers behind the input gradient's send;
    q/k/v with biases keep theirs in the backward) with `layout.pp_comm_overlap` on and off: the same losses and
    gradient norms (within 1e-6), matching one process."""
    layouts = [{**PP, "layout.pp": "2", "layout.schedule": schedule, "layout.pp_comm_overlap": on, **extra}
               for schedule, extra in (("1f1b", {}), ("afab", {}), ("1f1b", {"model.qkv_bias": "true"}))
               for on in ("true", "false")]
    assert_switch_changes_nothing(layouts, run_ranks(2, pipeline_on_ranks, layouts)[0])


def record_collectives(issued: list) -> None:
    """Make every collective this process issues through `torch.distributed` (and the single-tensor names that
    `tensor_comm` and `data` bind at import) append (the group's ranks, the operation, the first tensor's shape and
    dtype) to `issued`, in issue order."""
    import torch.distributed as dist

    from fivefold.parallel import data, tensor_comm

    def wrap(name, fn):
        def recorded(*args, **kwargs):
            group = kwargs.get("group")
            ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(
                range(dist.get_world_size()))
            tensor = args[0][0] if isinstance(args[0], list) else args[0]  # all_gather's output list
            issued.append((ranks, name, tuple(tensor.shape), str(tensor.dtype)))
            return fn(*args, **kwargs)
        return recorded

    for name in ("all_reduce", "all_to_all_single", "all_gather", "broadcast"):
        setattr(dist, name, wrap(name, getattr(dist, name)))
    for module in (tensor_comm, data):
        module.all_gather_into = wrap("all_gather_into", module.all_gather_into)
        module.reduce_scatter_into = wrap("reduce_scatter_into", module.reduce_scatter_into)


def lanes_on_ranks(rank: int, world_size: int, layouts: list[dict[str, str]]) -> list:
    """`pipeline_on_ranks` of each layout, with the pairs of lanes it ran and their hand-overs on this rank, and the
    collectives this rank issued (`record_collectives`)."""
    from fivefold.parallel import lanes

    issued: list = []
    record_collectives(issued)
    out = []
    for overrides in layouts:
        before = dict(lanes.totals)
        issued.clear()
        (result,) = pipeline_on_ranks(rank, world_size, [overrides])
        out.append((result, {k: lanes.totals[k] - before[k] for k in before}, list(issued)))
    return out


def test_dualpipev_forward_backward_overlap_changes_no_loss():
    """pp2 x tp2 + sp of the MoE model under DualPipeV, `layout.pp_fb_overlap` on and off: on, each rank runs its
    F0B1 / F1B0 pairs as two lanes that hand over at the tensor-parallel collectives (one micro-batch's all-gathers
    and reduce-scatters under the other's compute; the backward's lane runs its W too, whose input gathers again,
    `fb_pairs_run_w`), and every member of every group issues the group's collectives in one order (what
    NCCL needs of a communicator), an order that differs from the sequential one; the losses and gradient norms
    match one process and equal those with the overlap off within 1e-6, where no pair runs."""
    layouts = [{**PP, **MOE, "layout.pp": "2", "layout.tp": "2", "layout.sp": "true", "layout.schedule": "dualpipev",
                "layout.pp_fb_overlap": on} for on in ("true", "false")]
    ranks = run_ranks(4, lanes_on_ranks, layouts)
    assert_switch_changes_nothing(layouts, [result for result, _, _ in ranks[0]])
    m = tiny_config(layouts[0]).grad_accum_steps
    assert tiny_config(layouts[0]).layout.fb_pairs_run_w and not tiny_config(layouts[1]).layout.fb_pairs_run_w
    pairs = [len(p) for p in build_schedule("dualpipev", 2, m, overlap_fb=True).fused]
    for rank, per_layout in enumerate(ranks):
        (_, on, _), (_, off, _) = per_layout
        assert on["pairs"] == pairs[rank // 2] * STEPS and on["switches"] >= 2 * on["pairs"], (rank, on)
        assert off == {"pairs": 0, "switches": 0}
    # what NCCL needs of one communicator: every member of a group issues the group's collectives in one order (the
    # same operations on the same shapes); with the lanes the order differs from the sequential one
    for layout in range(2):
        per_group: dict[tuple, dict[int, list]] = {}
        for rank, per_layout in enumerate(ranks):
            for group, *op in per_layout[layout][2]:
                per_group.setdefault(group, {}).setdefault(rank, []).append(tuple(op))
        assert any(len(group) == 2 and group[1] - group[0] == 1 for group in per_group)  # the tp groups
        for group, sequences in per_group.items():
            assert sorted(sequences) == list(group), (group, sorted(sequences))
            first = sequences[group[0]]
            assert all(sequences[r] == first for r in group), group
    for rank in range(4):
        on_order = [op for op in ranks[rank][0][2] if op[0] == (rank // 2 * 2, rank // 2 * 2 + 1)]
        off_order = [op for op in ranks[rank][1][2] if op[0] == (rank // 2 * 2, rank // 2 * 2 + 1)]
        assert sorted(on_order) == sorted(off_order) and on_order != off_order, rank


@pytest.mark.slow
def test_pp2_other_schedules_match_one_process():
    """AFAB with an explicit split; interleaved with v = 2 (4 stages, rank r holding stages r and r + 2); DualPipeV
    (rank 0 holds the first and the last stage, so the tied weight is one parameter there); zero-bubble with
    recompute."""
    assert_pipeline_equivalent([
        {**PP, "layout.pp": "2", "layout.schedule": "afab", "layout.stage_layers": "1,3"},
        {**PP, "layout.pp": "2", "layout.schedule": "interleaved", "layout.vpp": "2"},
        {**PP, "layout.pp": "2", "layout.schedule": "dualpipev"},
        {**PP, "layout.pp": "2", "layout.schedule": "zero-bubble", "layout.recompute": "full"},
        {**PP, **MOE, "layout.pp": "2", "layout.schedule": "dualpipev", "layout.recompute": "selective"},
    ], world_size=2)


@pytest.mark.slow
def test_pp2_with_zero_and_tensor_parallel_matches_one_process():
    """4 ranks: pp2 x dp2 under ZeRO-1 and ZeRO-2 (reduce-scatters while micro-batches interleave); pp2 x tp2 with
    sequence parallel under zero-bubble (the fused q/k/v and gate/up projections defer their weight gradients,
    gathering their input again in W) and DualPipeV (the tied weight re-tied after tp on rank 0); pp2 x dp2 with
    ep2 and capacity-based routing."""
    assert_pipeline_equivalent([
        {**PP_DP, "layout.pp": "2", "layout.dp": "2", "layout.zero": "1"},
        {**PP_DP, "layout.pp": "2", "layout.dp": "2", "layout.zero": "2", "layout.micro_batch_size": "1",
         "layout.schedule": "zero-bubble", "layout.fp32_grad_accum": "true"},
        {**PP_DP, "layout.pp": "2", "layout.tp": "2", "layout.sp": "true", "layout.schedule": "zero-bubble"},
        {**PP, **MOE, "layout.pp": "2", "layout.tp": "2", "layout.schedule": "dualpipev"},
        # expert parallel folded over dp2 on each stage: the experts' own buckets are reduced over edp
        {**PP_DP, **MOE, "model.capacity_factor": "1.0", "layout.pp": "2", "layout.dp": "2", "layout.ep": "2",
         "layout.zero": "1", "layout.schedule": "zero-bubble"},
        # the balancing bias of each stage's MoE layers, moved alike on both stages' ep ranks
        {**PP_DP, **MOE, "model.bias_update_rate": "0.05", "layout.pp": "2", "layout.dp": "2", "layout.ep": "2",
         "layout.zero": "1"},
    ], world_size=4)


@pytest.mark.slow
def test_pp2_with_context_parallel_matches_one_process():
    """4 ranks: pp2 x cp2 (each rank holds its zig-zag chunks of every sequence, the rotary positions reach every
    stage, the transfers are [micro-batch, seq / cp, hidden]); with tp2 + SP (8 ranks would be dp2 x tp2 x pp2's
    test); with the MoE model under DualPipeV and ZeRO-1 over cp."""
    assert_pipeline_equivalent([
        {**PP_DP, "layout.pp": "2", "layout.cp": "2"},
        {**PP_DP, "layout.pp": "2", "layout.cp": "2", "layout.schedule": "zero-bubble", "layout.recompute": "full"},
        {**PP, **MOE, "layout.pp": "2", "layout.cp": "2", "layout.schedule": "dualpipev", "layout.zero": "1"},
    ], world_size=4)


@pytest.mark.slow
def test_dp2_tp2_pp2_matches_one_process():
    """8 ranks: dp2 x tp2 (+SP) x pp2, 1F1B with ZeRO-1, and zero-bubble with ZeRO-2 and full recompute."""
    assert_pipeline_equivalent([
        {**PP_DP, "layout.dp": "2", "layout.tp": "2", "layout.pp": "2", "layout.zero": "1", "layout.sp": "true"},
        {**PP_DP, "layout.dp": "2", "layout.tp": "2", "layout.pp": "2", "layout.zero": "2",
         "layout.schedule": "zero-bubble", "layout.recompute": "full"},
    ], world_size=8)


@pytest.mark.slow
def test_resume_under_pp2_is_exact(tmp_path, dataset):  # noqa: F811
    """Cut after step 3 and resumed: the losses, the validation loss and the checkpointed model are bit for bit
    those of the uninterrupted run (each pp rank writes its own optimizer shard)."""
    check_resume(tmp_path, dataset, 2, {"layout.pp": "2", "layout.schedule": "zero-bubble"})
    assert sorted(p.name for p in latest_checkpoint(tmp_path / "cut").glob("rank*.safetensors")) == [
        "rank0.safetensors", "rank1.safetensors"]


@pytest.mark.slow
def test_train_nproc_2_pp2_matches_one_process(tmp_path, dataset):  # noqa: F811
    """`fivefold train --nproc 2 --layout.pp 2` end to end (launcher, data, forward-only evaluation, checkpoint)
    against the one-process run: losses and validation loss to 1e-5, the checkpointed model to 1e-4."""
    overrides = {"train.max_steps": "4", "train.checkpoint_every": "0", "train.dtype": "fp32",
                 "train.device": "cpu", "train.threads": "1", "layout.micro_batch_size": "2", "model.n_layers": "3",
                 "train.eval_every": "2"}
    single = train(small_config(tmp_path / "one", dataset, **overrides))
    config = tmp_path / "config.toml"
    config.write_text(dump_toml(small_config(tmp_path / "two", dataset, **overrides)))
    cmd = [sys.executable, "-m", "fivefold", "train", "--nproc", "2", "--config", str(config), "--layout.pp", "2",
           "--run-dir", str(tmp_path / "two")]
    records = assert_cli_run_matches(cmd, tmp_path / "two", single)
    assert sorted(r["step"] for r in records if "val_loss" in r) == [0, 2, 4]  # the forward-only pipeline
