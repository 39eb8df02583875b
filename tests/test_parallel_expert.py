"""Expert parallel: the token dispatch over an ep group against the single-process MoE on each rank's tokens,
including routing so skewed that one rank's experts receive no token, and capacity-based drops; the expert
state's shard and gather. Whole-engine equivalence is in tests/test_parallel_equivalence.py.

Tolerances: fp32. The dispatched rows are the same rows through the same batched matmuls, summed in another
order only where a token's top-k outputs are added, so results differ by float32 rounding (1e-6 relative).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from tests.distributed import run_ranks

from fivefold.config import ModelConfig
from fivefold.models.llama import MoE
from fivefold.parallel.expert import apply_expert_parallel, gather_expert_state, is_expert_param, shard_expert_state


def moe_config(capacity_factor: float = 0.0, impl: str = "grouped") -> ModelConfig:
    return ModelConfig(hidden=32, ffn=48, n_heads=4, n_kv_heads=2, n_experts=4, top_k=2,
                       capacity_factor=capacity_factor, n_shared_experts=1, moe_impl=impl)


def build_moe(cfg: ModelConfig, skew: bool) -> MoE:
    torch.manual_seed(0)
    moe = MoE(cfg)
    moe.reset_parameters()
    torch.nn.init.normal_(moe.router.weight, std=0.1)
    if skew:  # every token prefers experts 0 and 1, which ep rank 0 holds: rank 1's experts receive nothing
        with torch.no_grad():
            moe.router.weight[:2] += 5.0 * moe.router.weight.new_ones(2, cfg.hidden).sign()
    return moe


def rank_tokens(rank: int, cfg: ModelConfig) -> torch.Tensor:
    gen = torch.Generator().manual_seed(10 + rank)
    return torch.rand(2, 12, cfg.hidden, generator=gen)  # positive, so the skewed router row wins for all


def single_process(rank: int, cfg: ModelConfig, skew: bool) -> tuple:
    """Output, input gradient, parameter gradients and drop fraction of the plain MoE on `rank`'s tokens."""
    moe = build_moe(cfg, skew)
    x = rank_tokens(rank, cfg).requires_grad_()
    out = moe(x)
    (out.square().sum() + moe.aux_loss).backward()
    grads = {n: p.grad for n, p in moe.named_parameters()}
    return out.detach(), x.grad, grads, float(moe.drop_fraction)


def ep_ranks(rank: int, world_size: int, cases: list[tuple[bool, float, str]]) -> list[tuple]:
    return [ep_rank(rank, world_size, moe_config(capacity_factor, impl), skew) for skew, capacity_factor, impl in cases]


def ep_rank(rank: int, world_size: int, cfg: ModelConfig, skew: bool) -> tuple:
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleDict({"0": torch.nn.Module()})
    model.layers["0"].mlp = build_moe(cfg, skew)
    full_state = copy.deepcopy(model.state_dict())
    apply_expert_parallel(model, dist.group.WORLD)
    moe = model.layers["0"].mlp
    assert moe.w_gate.shape[0] == cfg.n_experts // world_size
    x = rank_tokens(rank, cfg).requires_grad_()
    out = moe(x)
    (out.square().sum() + moe.aux_loss).backward()
    grads = {n: p.grad.clone() for n, p in moe.named_parameters()}
    # the state round trip: gather every expert, then shard it again
    gathered = gather_expert_state(model.state_dict(), dist.group.WORLD)
    assert all(torch.equal(gathered[n], full_state[n]) for n in full_state)
    resharded = shard_expert_state(gathered, rank, world_size)
    assert all(torch.equal(resharded[n], t) for n, t in model.state_dict().items())
    return out.detach().numpy(), x.grad.numpy(), {n: g.numpy() for n, g in grads.items()}, float(moe.drop_fraction)


# (skewed routing, capacity factor, model.moe_impl)
CASES = [(skew, capacity_factor, impl) for impl in ("grouped", "padded")
         for skew, capacity_factor in ((False, 0.0), (True, 0.0), (True, 1.0))]


def test_expert_dispatch_matches_single_process_moe():
    per_rank = run_ranks(2, ep_ranks, CASES)
    for index, (skew, capacity_factor, impl) in enumerate(CASES):
        check_case([cases[index] for cases in per_rank], moe_config(capacity_factor, impl), skew)


def check_case(results: list[tuple], cfg: ModelConfig, skew: bool) -> None:
    references = [single_process(rank, cfg, skew) for rank in range(2)]
    for (out, x_grad, grads, drop), (ref_out, ref_x_grad, ref_grads, ref_drop) in zip(results, references,
                                                                                      strict=True):
        torch.testing.assert_close(torch.from_numpy(out), ref_out, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(torch.from_numpy(x_grad), ref_x_grad, atol=1e-6, rtol=1e-5)
        assert drop == ref_drop  # the same slots dropped: capacity per source rank and expert as in one process
        for name, g in grads.items():
            if not is_expert_param(name):  # router and shared expert: replicated, gradients of the rank's tokens
                torch.testing.assert_close(torch.from_numpy(g), ref_grads[name], atol=1e-6, rtol=1e-5)
    # each rank's experts got the gradients of both ranks' tokens routed to them
    for name in ("w_gate", "w_up", "w_down"):
        got = torch.cat([torch.from_numpy(r[2][name]) for r in results], 0)
        torch.testing.assert_close(got, references[0][2][name] + references[1][2][name], atol=1e-6, rtol=1e-5)
    if cfg.capacity_factor:
        assert references[0][3] > 0.1  # the skew really overflows experts 0 and 1
    if skew:
        assert not torch.from_numpy(results[1][2]["w_gate"]).any()  # rank 1's experts saw no token


def test_expert_parameter_names():
    assert is_expert_param("layers.3.mlp.w_gate") and is_expert_param("layers.0.mlp.w_down")
    assert not is_expert_param("layers.0.mlp.router.weight")
    assert not is_expert_param("layers.0.mlp.shared.gate_proj.weight")
    state = {"layers.0.mlp.w_up": torch.arange(8.0).view(4, 2), "embed.weight": torch.ones(3)}
    shard = shard_expert_state(state, 1, 2)
    assert shard["layers.0.mlp.w_up"].tolist() == [[4.0, 5.0], [6.0, 7.0]] and shard["embed.weight"] is state[
        "embed.weight"]


def dispatched_rows(rank: int, world_size: int, etps: tuple[str, ...]) -> list[int]:
    """Per etp: the rows this rank sent through the expert all-to-alls (dispatch and combine) in one training step
    of dp2 x tp2 x ep2."""
    from tests.test_parallel_equivalence import MOE, tiny_config

    import fivefold.parallel.expert as expert
    from fivefold.train.build import build_engine

    sent = [0]
    original = expert.all_to_all

    def counting(rows, send_splits, recv_splits, group):
        sent[0] += sum(send_splits)
        return original(rows, send_splits, recv_splits, group)

    expert.all_to_all = counting
    counts = []
    try:
        for etp in etps:
            cfg = tiny_config({"layout.dp": "2", "layout.tp": "2", "layout.ep": "2", "layout.etp": etp, **MOE})
            engine = build_engine(cfg, torch.device("cpu"))
            tokens = torch.randint(0, cfg.model.vocab_size, (cfg.train.global_batch_size // 2, cfg.train.seq_len + 1),
                                   generator=torch.Generator().manual_seed(engine.dp_rank))
            sent[0] = 0
            engine.forward_backward([(tokens[:, :-1], tokens[:, 1:])], cfg.train.global_batch_size * cfg.train.seq_len)
            counts.append(sent[0])
    finally:
        expert.all_to_all = original
    return counts


def test_whole_experts_dispatch_each_token_once_per_tp_group():
    """dp2 x tp2 x ep2: with whole experts (etp = 1) the four ranks together send every routed slot of the global
    batch once to its expert and once back, 2 x tokens x top_k x layers rows; with experts split over tp (etp = 2)
    each tp rank sends all of its dp rank's slots, twice as many."""
    from tests.test_parallel_equivalence import tiny_config

    per_rank = run_ranks(4, dispatched_rows, ("1", "2"))
    cfg = tiny_config({"model.n_experts": "4", "model.top_k": "2"})
    slots = cfg.train.global_batch_size * cfg.train.seq_len * cfg.model.top_k * cfg.model.n_layers
    whole, split = (sum(rank[i] for rank in per_rank) for i in range(2))
    assert whole == 2 * slots, (whole, slots)
    assert split == 2 * 2 * slots, (split, slots)
    assert per_rank[0][0] > 0 and per_rank[1][0] > 0  # both tp ranks of a dp rank dispatch (their own halves)


def shared_beside_dispatch(rank: int, world_size: int, impl: str) -> list[str]:
    """The forward's order of events on this rank of an ep2 MoE layer with a shared expert: each all-to-all launched
    (async or not), each wait of an asynchronous one, the shared expert's forward."""
    import fivefold.parallel.expert_comm as comm

    events: list[str] = []
    original = comm.dist.all_to_all_single

    def recording(*args, async_op: bool = False, **kwargs):
        work = original(*args, async_op=async_op, **kwargs)
        events.append("launch async" if async_op else "all-to-all")
        if work is None:
            return None

        class Recorded:
            def wait(self, *a, **k):
                events.append("wait")
                return work.wait(*a, **k)

        return Recorded()

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleDict({"0": torch.nn.Module()})
    model.layers["0"].mlp = build_moe(moe_config(impl=impl), skew=False)
    apply_expert_parallel(model, dist.group.WORLD)
    moe = model.layers["0"].mlp
    moe.shared.register_forward_hook(lambda *_: events.append("shared"))
    comm.dist.all_to_all_single = recording
    try:
        moe(rank_tokens(rank, moe_config(impl=impl)))
    finally:
        comm.dist.all_to_all_single = original
    return events


def test_shared_experts_run_while_the_dispatch_travels():
    """Every rank: the counts' all-to-all, the dispatch launched asynchronously, the shared expert, the wait for the
    dispatched rows, then the combine's all-to-all (the values themselves: test_expert_dispatch_matches_...)."""
    for impl in ("grouped", "padded"):
        for events in run_ranks(2, shared_beside_dispatch, impl):
            assert events == ["all-to-all", "launch async", "shared", "wait", "all-to-all"], (impl, events)


def exchanges_under_recompute(rank: int, world_size: int, impl: str) -> dict:
    """One step of an MoE model under ep2 (with a shared expert, which runs beside the dispatch) in each recompute
    mode: the loss, the gradient norm and the all-to-alls that ran."""
    from tests.test_parallel_equivalence import step_in_each_recompute_mode

    return step_in_each_recompute_mode(rank, {"model.n_experts": "4", "model.top_k": "2",
                                              "model.n_shared_experts": "1", "model.moe_impl": impl,
                                              "layout.dp": "2", "layout.ep": "2"}, dist, "all_to_all_single")


@pytest.mark.parametrize("impl", ["grouped", "padded"])
def test_selective_recompute_runs_no_exchange_again(impl):
    """Selective recompute keeps what the expert-parallel exchanges received (the counts, the dispatched rows and the
    returned outputs): its step runs exactly the all-to-alls of a step without recompute (3 forward per MoE layer:
    counts, dispatch, combine; 2 backward: the rows' gradients both ways), where full recompute runs the forward's
    3 again; the loss and the gradient norm equal those without recompute."""
    layers = 2
    for out in run_ranks(2, exchanges_under_recompute, impl):
        (loss, norm, none), (_, _, selective), (_, _, full) = out["none"], out["selective"], out["full"]
        assert none == selective == 5 * layers
        assert full == none + 3 * layers
        for mode in ("selective", "full"):
            assert out[mode][0] == pytest.approx(loss, rel=1e-6)
            assert out[mode][1] == pytest.approx(norm, rel=1e-5)
