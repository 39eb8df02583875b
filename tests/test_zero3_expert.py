"""ZeRO-3 composed with expert parallel: dense weights sharded over dp x cp, each ep rank's experts over the ranks
that hold the same experts (edp = dp x cp / ep), against one process.

- Equivalence (the harness of tests/test_parallel_equivalence.py: K = 3 steps, accumulation 2, fp32, lr 1e-2):
  dp2 x ep2 (edp 1: the experts stay whole on their rank, no unit shards them) in the default run, dp4 x ep2
  (edp 2: the experts' own fully_shard units) slow. Losses and gradient norms within 1e-5 relative, each final
  parameter within 1e-5 (relative norm of the difference), 5e-5 for dp4 x ep2: there the parameters move up to
  1.6e-5 apart whatever the ZeRO stage (measured 2026-11-27: ZeRO-0 1.62e-5 and ZeRO-1 1.63e-5 on
  layers.0.attn.v_proj.weight, ZeRO-3 1.33e-5; the embedding 1.31e-5, 1.32e-5 and 1.15e-5), dp4's own summation
  order. The largest element difference, 3.0e-5 on an expert
  weight, is expert parallel's own: ZeRO-1 x ep2 differs from one process by the same 2.98e-5 on the same element
  (the experts' matmuls group the tokens otherwise, and AdamW's normalisation magnifies rounding on elements whose
  gradient is near zero), so an element-wise 1e-5 would fail whatever the ZeRO stage. Slow too: tp2 x dp2 x ep2
  (parameters within 1e-4: tp's own rounding) and cp2 x dp2 x ep2 (edp 2; 5e-5, cp's).
- The bytes each rank holds: dense / (dp x cp) + (its ep shard of the experts) / edp, times 4 bytes, for the
  parameters, the gradients and each AdamW moment (a closed-form count from the model's shapes).
- A sharded checkpoint written under dp2 x ep2 ZeRO-3 loads into one process and back into dp2 x ep2 ZeRO-3, and
  the continued losses match the uninterrupted run's within 1e-5.
- Collective order: every rank records each collective it issues (kind, group, element count); the members of
  each group must issue the same sequence on it. NCCL matches collectives on a communicator by their order, so a
  rank that skipped or reordered one (say an expert unit's reduce-scatter) would hang the others.
- A non-finite gradient on one rank skips the step on every rank (parameters and moments unchanged).
"""

from __future__ import annotations

import inspect
import json
import math

import pytest
import torch
import torch.distributed as dist
from tests.distributed import run_ranks
from tests.test_checkpoint_reshard import check_change
from tests.test_parallel_equivalence import MOE, STEPS, reference_run, tiny_config, train_steps
from tests.test_train import dataset  # noqa: F401  (a fixture)

from fivefold.config import build_config
from fivefold.train import checkpoint as ckpt

DP2_EP2 = {"layout.dp": "2", "layout.ep": "2", "layout.zero": "3", **MOE}
DP4_EP2 = {"layout.dp": "4", "layout.ep": "2", "layout.zero": "3", **MOE}


def train_on_ranks(rank: int, world_size: int, overrides: dict[str, str]) -> tuple:
    from fivefold.train.build import build_engine

    cfg = tiny_config(overrides)
    engine = build_engine(cfg, torch.device("cpu"))
    losses, norms, _ = train_steps(engine, cfg)
    return losses, norms, engine.model_state()


def assert_matches(overrides: dict[str, str], world_size: int, param_rel: float = 1e-5) -> None:
    losses, norms, state = run_ranks(world_size, train_on_ranks, overrides)[0]
    ref_losses, ref_norms, _, ref_state = reference_run(overrides)
    for step, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):
        assert abs(a - b) <= 1e-5 * abs(b), f"loss {step + 1}: {a} vs one process {b}"
    for step, (a, b) in enumerate(zip(norms, ref_norms, strict=True)):
        assert abs(a - b) <= 1e-5 * abs(b), f"grad norm {step + 1}: {a} vs one process {b}"
    assert state.keys() == ref_state.keys()
    for name, ref in ref_state.items():
        error = ((state[name] - ref).norm() / ref.norm()).item()
        assert error <= param_rel, f"{name} differs by {error:.2e} (relative) after {STEPS} steps"


def test_zero3_with_expert_parallel_dp2_ep2_matches_one_process():
    assert_matches(DP2_EP2, 2)


@pytest.mark.slow
def test_zero3_with_expert_parallel_dp4_ep2_matches_one_process():
    assert_matches(DP4_EP2, 4, param_rel=5e-5)


@pytest.mark.slow
@pytest.mark.parametrize("layout, param_rel", [({"layout.dp": "2", "layout.tp": "2"}, 1e-4),
                                               ({"layout.dp": "2", "layout.cp": "2"}, 5e-5)],
                         ids=["tp2 x dp2 x ep2", "cp2 x dp2 x ep2 (edp 2)"])
def test_zero3_with_expert_parallel_under_tp_or_cp_matches_one_process(layout, param_rel):
    """Under tp the parameters move 4e-5 apart whatever the ZeRO stage (ZeRO-1 x ep 3.8e-5, ZeRO-3 without ep
    4.2e-5, this layout 4.3e-5: tp's partial sums), so 1e-4 there; under cp 2e-5 (ZeRO-1 x ep 1.9e-5, ZeRO-3
    without ep 1.6e-5, this layout 1.5e-5: ring attention's merged blocks), so 5e-5."""
    assert_matches({**layout, "layout.ep": "2", "layout.zero": "3", **MOE}, 4, param_rel)


# --- one launch per layout: held bytes, the collectives each rank issued, the non-finite guard -------------------

# dims multiples of 4, so that fully_shard's dim-0 shards need no padding over 4 ranks (2 experts per ep rank: one
# per edp rank under dp4 x ep2)
MODEL = {"model.n_layers": "2", "model.hidden": "96", "model.n_heads": "12", "model.n_kv_heads": "12",
         "model.ffn": "192", "model.vocab_size": "384", **MOE, "train.seq_len": "8", "train.global_batch_size": "8",
         "layout.micro_batch_size": "1", "train.device": "cpu", "train.dtype": "fp32"}
COLLECTIVES = ("all_reduce", "all_gather_single", "reduce_scatter_single", "all_gather_into_tensor",
               "reduce_scatter_tensor", "all_to_all_single", "all_gather", "reduce_scatter", "all_to_all", "broadcast",
               "barrier")


def record_collectives(calls: list[tuple]) -> dict:
    """Wrap torch.distributed's collectives so that each call appends (kind, group's global ranks, element count)
    to `calls` (fully_shard and fivefold call them through the module, so the wrappers see every one). An
    all-to-all's count is left out: its splits differ by rank by design. Returns the originals."""
    originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def wrap(name, fn):
        signature = inspect.signature(fn)

        def call(*args, **kwargs):
            bound = signature.bind(*args, **kwargs).arguments
            group = bound.get("group") or dist.group.WORLD
            first = next((v for v in bound.values() if isinstance(v, torch.Tensor)), None)
            numel = None if "all_to_all" in name or first is None else first.numel()
            calls.append((name, tuple(dist.get_process_group_ranks(group)), numel))
            return fn(*args, **kwargs)
        return call

    for name, fn in originals.items():
        setattr(dist, name, wrap(name, fn))
    return originals


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def snapshot(engine) -> dict[str, torch.Tensor]:
    out = {}
    for i, p in enumerate(q for g in engine.optimizer.param_groups for q in g["params"]):
        out[f"param {i}"] = local(p).detach().clone()
        for key, value in engine.optimizer.state.get(p, {}).items():
            out[f"{key} {i}"] = local(value).detach().clone()
    return out


def steps_on_ranks(rank: int, world_size: int, layout: dict[str, str]) -> dict:
    """Two good steps, then one whose gradient has an inf on the last rank, then a good one; what each rank held,
    issued and kept."""
    from fivefold.train.build import build_engine

    cfg = build_config(None, {**MODEL, **layout})
    engine = build_engine(cfg, torch.device("cpu"))
    rows = cfg.train.global_batch_size // cfg.layout.dp
    g = torch.Generator().manual_seed(engine.dp_rank)  # the pipeline ranks of one dp rank read the same rows
    batches = [torch.randint(0, 384, (rows, 9), generator=g) for _ in range(4)]

    def micro(tokens):
        return [(t[:, :-1], t[:, 1:]) for t in tokens.split(cfg.layout.micro_batch_size)]

    calls: list[tuple] = []
    originals = record_collectives(calls)
    try:
        engine.forward_backward(micro(batches[0]), 64)
        engine.optimizer_step()
        engine.forward_backward(micro(batches[1]), 64)
        held = engine.state_bytes()  # gradients exist until the step
        engine.optimizer_step()
        before = snapshot(engine)
        engine.forward_backward(micro(batches[2]), 64)
        if rank == world_size - 1:  # one element of this rank's expert shard overflows
            w_down = next(p for n, p in engine.model.named_parameters() if n.endswith("mlp.w_down"))
            local(w_down.grad).view(-1)[0] = float("inf")
        bad_norm = float(engine.optimizer_step())
        after_bad = snapshot(engine)
        engine.forward_backward(micro(batches[3]), 64)
        engine.optimizer_step()
        after_good = snapshot(engine)
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return {"held": held, "calls": calls, "bad_norm": bad_norm, "pp_rank": getattr(engine, "pp_rank", 0),
            "kept": all(torch.equal(before[k], after_bad[k]) for k in before) and before.keys() == after_bad.keys(),
            "moved": any(not torch.equal(before[k], after_good[k]) for k in before if k.startswith("param"))}


LAYOUTS = {"dp2-ep2": (2, {"layout.dp": "2", "layout.ep": "2", "layout.zero": "3"}),
           "dp4-ep2": (4, {"layout.dp": "4", "layout.ep": "2", "layout.zero": "3"}),
           "dp2-pp2-ep2": (4, {"layout.dp": "2", "layout.pp": "2", "layout.ep": "2", "layout.zero": "3"}),
           "dp4-pp2-ep2": (8, {"layout.dp": "4", "layout.pp": "2", "layout.ep": "2", "layout.zero": "3"}),
           "hsdp2-dp4-ep2": (4, {"layout.dp": "4", "layout.ep": "2", "layout.zero": "3", "layout.dp_shard": "2"}),
           "hsdp2-dp4-pp2-ep2": (8, {"layout.dp": "4", "layout.pp": "2", "layout.ep": "2", "layout.zero": "3",
                                     "layout.dp_shard": "2"})}
RESULTS: dict[str, list[dict]] = {}


def results(name: str) -> list[dict]:
    if name not in RESULTS:  # one launch serves the three tests of a layout
        world, layout = LAYOUTS[name]
        RESULTS[name] = run_ranks(world, steps_on_ranks, layout)
    return RESULTS[name]


def check_held_bytes(name: str) -> None:
    """Parameters, gradients and AdamW's two moments: dense / (dp x cp) + expert shard / edp, 4 bytes each (8 for
    the moments), measured on every rank and predicted by the planner. Under HSDP the shard group replaces dp x cp,
    and its ranks that hold the same experts (dp_shard / ep) replace edp."""
    from fivefold.models.llama import build_model
    from fivefold.planner.layout import FIVEFOLD_CPU, Layout
    from fivefold.planner.memory import model_state_bytes

    world, layout = LAYOUTS[name]
    cfg = build_config(None, {**MODEL, **layout})
    ep, dp, pp, dp_shard = cfg.layout.ep, cfg.layout.dp, cfg.layout.pp, cfg.layout.dp_shard
    shard = dp_shard or dp  # the ranks one shard set spans (cp = 1 here)
    for rank, result in enumerate(results(name)):
        model = build_model(cfg.model, device="meta")
        if pp > 1:  # the rank's stage: block 0 and the embedding on the first, block 1 and the output on the last
            keep = ("embed.", "layers.0.") if result["pp_rank"] == 0 else ("norm.", "lm_head.", "layers.1.")
            shapes = {n: p.numel() for n, p in model.named_parameters(remove_duplicate=False) if n.startswith(keep)}
        else:
            shapes = {n: p.numel() for n, p in model.named_parameters()}
        experts = sum(n for name_, n in shapes.items() if name_.rsplit(".", 1)[-1] in ("w_gate", "w_up", "w_down"))
        dense = sum(shapes.values()) - experts
        elements = dense // shard + experts // ep // (shard // ep)
        assert experts > 0 and dense % shard == 0 and experts % (ep * (shard // ep)) == 0
        want = {"parameters": 4 * elements, "gradients": 4 * elements, "optimizer": 8 * elements}
        assert result["held"] == want, f"{name}, rank {rank}: {result['held']} vs {want}"
        # the planner's memory model predicts the same bytes (fivefold on CPU: fp32 parameters are the masters)
        which = "first" if pp == 1 or result["pp_rank"] == 0 else "last"
        predicted = model_state_bytes(cfg.model, Layout(dp=dp, ep=ep, pp=pp, zero=3, dp_shard=dp_shard), FIVEFOLD_CPU,
                                      which, seq=cfg.train.seq_len)
        assert predicted == {**want, "grad_accum_buffer": 0}, predicted


def test_held_bytes_are_dense_over_dp_and_experts_over_edp():
    check_held_bytes("dp2-ep2")


def replay_blocking(programs: list[list[tuple]]) -> int:
    """NCCL, strictest reading: each rank runs its collectives in issue order, and one completes only when every
    member of its group has it next (same kind and size). Returns how many completed; all of them unless some
    ranks wait on each other for ever."""
    position = [0] * len(programs)
    done, progress = 0, True
    while progress:
        progress = False
        for rank, program in enumerate(programs):
            if position[rank] == len(program):
                continue
            op = program[position[rank]]
            members = op[1]
            if all(position[m] < len(programs[m]) and programs[m][position[m]] == op for m in members):
                for m in members:
                    position[m] += 1
                done += 1
                progress = True
    return done


def check_collective_order(name: str) -> None:
    programs = [r["calls"] for r in results(name)]
    groups = {op[1] for program in programs for op in program}
    for group in groups:  # the members of each group issue the same collectives on it, in the same order
        sequences = {m: [op for op in programs[m] if op[1] == group] for m in group}
        first = sequences[group[0]]
        for m in group:
            assert sequences[m] == first, f"{name}: ranks {group[0]} and {m} differ on group {group}"
    ops = sum(1 for rank, p in enumerate(programs) for op in p if op[1][0] == rank)  # each collective once
    assert replay_blocking(programs) == ops, f"{name}: the blocking replay stops: the ranks would deadlock"
    kinds = {op[0] for p in programs for op in p}
    assert {"all_gather_single", "reduce_scatter_single", "all_to_all_single", "all_reduce"} <= kinds, kinds


def test_collectives_issue_in_the_same_order_on_every_group():
    check_collective_order("dp2-ep2")


def test_non_finite_gradient_skips_the_step_on_every_rank():
    for rank, result in enumerate(results("dp2-ep2")):
        assert result["bad_norm"] == float("inf"), rank
        assert result["kept"], f"rank {rank}: parameters or moments changed in a skipped step"
        assert result["moved"], f"rank {rank}: the good step after it changed nothing"


def check_bytes_collectives_and_guard(name: str) -> set[tuple[int, ...]]:
    """Held bytes, per-group collective order and the non-finite guard of run `name` on every rank; returns the
    two-rank groups that reduce-scattered (the edp groups)."""
    check_held_bytes(name)
    check_collective_order(name)
    for rank, result in enumerate(results(name)):
        assert result["bad_norm"] == float("inf") and result["kept"] and result["moved"], rank
    programs = [r["calls"] for r in results(name)]
    return {op[1] for p in programs for op in p if op[0] == "reduce_scatter_single" and len(op[1]) == 2}


@pytest.mark.slow
def test_zero3_expert_over_edp2_bytes_collectives_and_guard():
    """dp4 x ep2: the experts are fully_shard units over edp groups of two ranks ({0, 2} and {1, 3})."""
    edp_groups = check_bytes_collectives_and_guard("dp4-ep2")
    assert edp_groups == {(0, 2), (1, 3)}, edp_groups


def test_zero3_expert_under_pipeline_bytes_collectives_and_guard():
    """dp2 x pp2 x ep2 (edp 1; `pipeline_zero3` with the experts cut as plain ZeRO-3 cuts them): the bytes of each
    pipeline rank's stage, the per-group collective order with its blocking replay (the dp x cp groups of each
    stage, the ep all-to-alls, the tied embedding's and the pipeline's all-reduces) and the non-finite guard."""
    check_bytes_collectives_and_guard("dp2-pp2-ep2")


@pytest.mark.slow
def test_zero3_expert_under_pipeline_over_edp2_bytes_collectives_and_guard():
    """dp4 x pp2 x ep2 on 8 ranks: each stage's experts are fully_shard units over edp groups of two ranks."""
    edp_groups = check_bytes_collectives_and_guard("dp4-pp2-ep2")
    assert len(edp_groups) == 4, edp_groups  # two per pipeline stage


# --- checkpoints ----------------------------------------------------------------------------------------------


def test_zero3_expert_checkpoint_loads_into_one_process_and_back(tmp_path, dataset):  # noqa: F811
    """Written under dp2 x ep2 ZeRO-3, resumed in one process; written in one process, resumed under dp2 x ep2
    ZeRO-3: the losses after the checkpoint continue the uninterrupted run's within 1e-5 relative."""
    check_change(tmp_path / "out", dataset, (2, DP2_EP2), [(1, {})], model=MOE)
    check_change(tmp_path / "in", dataset, (1, {}), [(2, DP2_EP2)], model=MOE)


@pytest.mark.slow
def test_zero3_expert_over_edp2_checkpoint_moves_between_layouts(tmp_path, dataset):  # noqa: F811
    check_change(tmp_path, dataset, (4, DP4_EP2), [(1, {}), (2, DP2_EP2)], model=MOE)


def hsdp_replica_all_reduces(name: str) -> set[tuple[int, ...]]:
    """The groups of run `name` that all-reduced more than the norm's and the guard's two floats: HSDP's
    replicas, summing the reduce-scattered shards."""
    return {op[1] for r in results(name) for op in r["calls"] if op[0] == "all_reduce" and (op[2] or 0) > 2}


def test_hsdp_with_expert_parallel_bytes_collectives_and_guard():
    """dp4 x ep2 with shard groups of 2: the bytes of the shard group's states, the per-group collective order
    with its blocking replay, the non-finite guard; the shards are all-reduced over the replicas {0, 2} and
    {1, 3} (the dense weights' and the experts' alike)."""
    check_bytes_collectives_and_guard("hsdp2-dp4-ep2")
    assert {(0, 2), (1, 3)} <= hsdp_replica_all_reduces("hsdp2-dp4-ep2")


@pytest.mark.slow
def test_hsdp_with_expert_parallel_under_pipeline_bytes_collectives_and_guard():
    """The same with pp2 on 8 ranks: each stage's units on the two 2D meshes."""
    check_bytes_collectives_and_guard("hsdp2-dp4-pp2-ep2")
    assert len(hsdp_replica_all_reduces("hsdp2-dp4-pp2-ep2")) >= 4  # two replica groups per stage


def test_hsdp_with_expert_parallel_matches_one_process():
    """HSDP x ep: dp4 x ep2 with shard groups of 2. The dense weights shard over each pair and are all-reduced over
    the 2 replicas; each ep rank's experts shard over the members of its shard group that hold them (one here) and
    are all-reduced over the replicas too. The gradient norm divides both by the replicas."""
    assert_matches({**DP4_EP2, "layout.dp_shard": "2"}, 4)


@pytest.mark.slow  # heavy; the fast run keeps the same feature's other tests
def test_hsdp_with_expert_parallel_checkpoint_moves_between_layouts(tmp_path, dataset):  # noqa: F811
    """Written under HSDP x ep (dp4 x ep2, shard groups of 2): each shard, the experts' too, is written once (by
    its first replica), and the checkpoint resumes in one process and under HSDP x ep again."""
    hsdp = {**DP4_EP2, "layout.dp_shard": "2"}
    check_change(tmp_path, dataset, (4, hsdp), [(1, {}), (4, hsdp)], model=MOE)
    path = ckpt.checkpoint_dir(tmp_path / "full", 3)
    written = sum(math.prod(p["piece_shape"]) for r in range(4)
                  for p in json.loads((path / f"rank{r}.json").read_text())["pieces"] if p["name"].startswith("model."))
    assert written == sum(t.numel() for t in ckpt.read_model_state(path).values())


@pytest.mark.slow
@pytest.mark.parametrize("layout, world, param_rel", [
    ({**DP4_EP2, "layout.dp_shard": "2", "layout.pp": "2"}, 8, 1e-5),
    ({"layout.dp": "2", "layout.cp": "2", "layout.ep": "2", "layout.zero": "3", "layout.dp_shard": "1", **MOE}, 4,
     5e-5)], ids=["dp4 x ep2 x pp2, shard groups of 2", "dp2 x cp2 x ep2, shard groups of cp2"])
def test_hsdp_with_expert_parallel_under_pp_or_cp_matches_one_process(layout, world, param_rel):
    """HSDP x ep under pp2 (each of the 2 stages' units on the 2D meshes; 8 ranks) and under cp2 (a shard group of
    the 2 cp ranks of one dp rank, each holding one ep rank's experts whole, 2 replicas; 5e-5 as for cp x ep
    without HSDP: ring attention's rounding)."""
    assert_matches(layout, world, param_rel)
