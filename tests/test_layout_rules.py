"""One rule book for layouts (`fivefold.layout`): every layout the planner's search proposes passes the rules that
`fivefold train` applies, and `fivefold plan --layout` refuses what `fivefold train` refuses, with the same
message."""

from __future__ import annotations

import dataclasses

import pytest

from fivefold.cli import main
from fivefold.cli.plan import load_model
from fivefold.config import ConfigError, ModelConfig, build_config
from fivefold.layout import check_layout, layout_problem, stage_count, tensor_parallel_problem
from fivefold.models.presets import get_preset
from fivefold.parallel.schedules import stage_placement
from fivefold.planner.hardware import get_cluster
from fivefold.planner.layout import FIVEFOLD, Layout
from fivefold.planner.search import search


def _train_side(model: ModelConfig, lay: Layout, seq: int, batch: int) -> None:
    """What `fivefold train` runs before any process starts: Config.validate, then the engine's check_layout."""
    cfg = build_config(None, {"train.seq_len": str(seq), "train.global_batch_size": str(batch)})
    cfg.model = dataclasses.replace(model, max_seq_len=max(model.max_seq_len, seq))
    cfg.layout = lay.to_layout_config()
    cfg.validate()
    check_layout(cfg, lay.world_size)


SHAPE_MOE_ODD_FFN = "layers=4,hidden=128,heads=4,kv_heads=2,ffn=386,vocab=2048,experts=4,top_k=2,moe_ffn=128"


@pytest.mark.parametrize("model, seq, batch, world", [
    ("tiny", 128, 8, 2), ("tiny", 128, 16, 8), ("tiny", 129, 8, 2), ("tiny-moe", 128, 8, 4),
    pytest.param("tiny-moe", 64, 16, 8, marks=pytest.mark.slow),  # 20 s: the largest search of these
    (SHAPE_MOE_ODD_FFN, 128, 8, 2), ("llama3-8b", 4096, 256, 8),
])
def test_every_layout_the_search_proposes_passes_the_train_rules(model, seq, batch, world):
    cfg, hw = load_model(model), get_cluster("h100")
    result = search(cfg, seq, batch, world, FIVEFOLD, hw, top=0)
    assert result.candidates
    for e in result.candidates:
        lay = e.layout
        assert lay.world_size == world and lay.dp * lay.micro_batch_size * lay.grad_accum_steps == batch
        assert layout_problem(cfg, lay, world_size=world, seq_len=seq, global_batch_size=batch) is None, lay.short()
        _train_side(cfg, lay, seq, batch)


def test_the_search_uses_the_engines_tensor_parallel_rule_for_moe():
    """An MoE layer splits the expert ffn (moe_ffn) over tp, not the dense `ffn` that no layer uses: with ffn = 386
    and moe_ffn = 128 the engine runs tp = 2, so the search proposes it."""
    cfg = load_model(SHAPE_MOE_ODD_FFN)
    result = search(cfg, 128, 8, 2, FIVEFOLD, get_cluster("h100"), top=0)
    assert any(e.layout.tp == 2 for e in result.candidates)


def test_stage_count_is_the_schedules_placement():
    for name in ("afab", "1f1b", "interleaved", "zero-bubble", "dualpipev"):
        for p in (2, 3, 4):
            for v in ((1, 2, 3) if name == "interleaved" else (1,)):
                assert stage_count(name, p, v) == len(stage_placement(name, p, v))


LLAMA_VOCAB_50257 = "layers=32,hidden=4096,heads=32,kv_heads=8,ffn=14336,vocab=50257"

# (plan --model, train model arguments, world, seq_len, global batch in sequences, layout, part of the message)
REFUSED = [
    ("llama3-8b", ["--preset", "llama3-8b"], 3, 4096, 256, {"tp": 3},
     "layout.tp = 3 does not divide model.n_heads = 32"),
    (LLAMA_VOCAB_50257, ["--preset", "llama3-8b", "--model.vocab_size", "50257"], 4, 4096, 256, {"tp": 4},
     "layout.tp = 4 does not divide model.vocab_size = 50257"),
    ("tiny-moe", ["--preset", "tiny-moe"], 4, 128, 8, {"dp": 2, "pp": 2, "ep": 4, "zero": 3},
     "layout.ep = 4 does not divide layout.dp x layout.cp = 2 x 1"),
    ("tiny", ["--preset", "tiny"], 4, 100, 8, {"cp": 4}, "cannot be split for context parallel with cp = 4"),
    ("tiny-moe", ["--preset", "tiny-moe"], 3, 128, 6, {"dp": 3, "ep": 3},
     "layout.ep = 3 does not divide model.n_experts = 4"),
    ("tiny-moe", ["--preset", "tiny-moe"], 2, 128, 8, {"dp": 2, "ep": 4},
     "layout.ep = 4 does not divide layout.dp x layout.cp = 2 x 1"),
    ("tiny-moe", ["--preset", "tiny-moe"], 4, 128, 8,
     {"dp": 2, "pp": 2, "ep": 2, "zero": 3, "schedule": "dualpipev", "micro_batch_size": 4},
     "layout.schedule = dualpipev with layout.pp = 2 needs at least 4 micro-batches per step"),
    ("tiny", ["--preset", "tiny"], 2, 128, 8, {"dp": 2, "ep": 2}, "on a dense model"),
    ("tiny", ["--preset", "tiny"], 2, 129, 8, {"tp": 2, "sp": "true"},
     "train.seq_len = 129 is not divisible by layout.tp = 2"),
    ("tiny", ["--preset", "tiny"], 2, 128, 8, {"dp": 2, "sp": "true"}, "layout.sp = true needs tensor parallel"),
    ("tiny", ["--preset", "tiny"], 2, 128, 8, {"tp": 2, "zero": 1}, "layout.zero = 1 with layout.dp = 1"),
    ("tiny", ["--preset", "tiny"], 8, 128, 8, {"pp": 8}, "layout.pp = 8 exceeds model.n_layers = 4"),
    ("tiny", ["--preset", "tiny"], 2, 128, 8, {"pp": 2, "vpp": 2, "schedule": "1f1b"},
     "applies to the interleaved schedule only"),
    ("tiny", ["--preset", "tiny"], 2, 128, 8, {"pp": 2, "vpp": 2, "schedule": "interleaved", "micro_batch_size": 8},
     "needs at least 2 micro-batches per step, a multiple of layout.pp = 2"),
    ("tiny", ["--preset", "tiny"], 4, 128, 8, {"pp": 4, "schedule": "dualpipev"},
     "the V of dualpipev, 2 x layout.pp = 2 x 4 = 8 stages exceed model.n_layers = 4"),
    ("tiny", ["--preset", "tiny"], 3, 128, 8, {"dp": 3},
     "train.global_batch_size = 8 is not divisible by layout.dp = 3"),
    ("tiny", ["--preset", "tiny"], 2, 128, 8, {"dp": 2, "micro_batch_size": 3},
     "layout.micro_batch_size = 3 does not divide the per-rank batch"),
    ("tiny", ["--preset", "tiny"], 2, 128, 8, {"dp": 2, "zero": 3, "dp_bucket_size": 1000},
     "layout.dp_bucket_size = 1000 with layout.zero = 3"),
    ("tiny", ["--preset", "tiny"], 2, 128, 8, {"dp": 2, "dp_overlap_param_gather": "true"},
     "layout.dp_overlap_param_gather = true with layout.zero = 0, dp x cp = 2"),
    ("tiny", ["--preset", "tiny"], 2, 128, 8, {"dp": 2, "zero": 3, "dp_overlap_param_gather": "true"},
     "layout.dp_overlap_param_gather = true with layout.zero = 3"),
    ("tiny", ["--preset", "tiny"], 2, 128, 8, {"tp": 2, "tp_comm_overlap": "true"},
     "layout.tp_comm_overlap = true with layout.tp = 2, layout.sp = false"),
    ("tiny", ["--preset", "tiny"], 2, 128, 8, {"dp": 2, "tp_comm_overlap": "true"},
     "layout.tp_comm_overlap = true with layout.tp = 1"),
    ("tiny", ["--preset", "tiny"], 2, 128, 8, {"pp": 2, "schedule": "dualpipev", "pp_fb_overlap": "true"},
     "layout.pp_fb_overlap = true with layout.schedule = dualpipev, pp = 2, tp x cp x ep = 1, zero = 0"),
    ("tiny", ["--preset", "tiny"], 4, 128, 8, {"pp": 2, "tp": 2, "schedule": "1f1b", "pp_fb_overlap": "true"},
     "layout.pp_fb_overlap = true with layout.schedule = 1f1b, pp = 2, tp x cp x ep = 2, zero = 0"),
]


def _error(capsys, argv: list[str]) -> str:
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    return err.split(": error: ", 1)[1].strip()


@pytest.mark.parametrize("plan_model, train_model, world, seq, batch, layout, expected", REFUSED,
                         ids=[f"{r[0][:12]}-{'-'.join(f'{k}{v}' for k, v in r[5].items())}" for r in REFUSED])
def test_plan_refuses_what_train_refuses_with_the_same_message(capsys, tmp_path, plan_model, train_model, world,
                                                                seq, batch, layout, expected):
    layout = {"micro_batch_size": 1, **layout}  # train's default is the whole per-rank batch, the planner's 1
    planned = _error(capsys, ["plan", "--model", plan_model, "--gpu", "h100", "--gpus-per-node", str(world),
                              "--seq-len", str(seq), "--global-batch", str(seq * batch),
                              "--layout", ",".join(f"{k}={v}" for k, v in layout.items())])
    # --slurm: `fivefold train` checks the layout for --nodes x --nproc processes and would only write a script
    script = tmp_path / "job.sh"
    trained = _error(capsys, ["train", *train_model, "--slurm", str(script), "--nproc", str(world),
                              "--train.seq_len", str(seq), "--train.global_batch_size", str(batch),
                              *[a for k, v in layout.items() for a in (f"--layout.{k}", str(v))]])
    assert not script.exists()
    assert expected in trained
    assert planned == trained


def test_check_layout_raises_the_first_problem():
    cfg = build_config(None, {"model.preset": "tiny", "layout.tp": "3", "layout.pp": "8"})
    with pytest.raises(ConfigError, match="world size 2"):
        check_layout(cfg, 2)
    problem = layout_problem(get_preset("tiny"), cfg.layout, world_size=24, seq_len=128, global_batch_size=8)
    assert problem is not None and problem.rule.startswith("tp does not divide")
    assert "layout.tp = 3 does not divide model.n_heads = 4" in problem.message


def test_tp_splits_qkv_biases_and_the_gated_shared_expert():
    gated = dataclasses.replace(get_preset("tiny-moe"), n_shared_experts=1, shared_expert_gate=True, qkv_bias=True)
    assert tensor_parallel_problem(gated, 2) is None


def test_a_bucket_of_no_elements_is_refused_and_megatrons_rule_is_the_default(capsys):
    """`layout.dp_bucket_size` 0 is refused in one line naming the field; left out, the buckets follow Megatron's
    rule, max(40 M, 1 M x dp x cp) elements; and the planner prices the parameter all-gather of ZeRO-1 as exposed
    only with its overlap switched off."""
    assert _error(capsys, ["train", "--preset", "tiny", "--layout.dp_bucket_size", "0"]).startswith(
        "layout.dp_bucket_size = 0 must be >= 1 (elements per gradient bucket)")
    assert build_config(None, {"layout.dp": "8", "layout.cp": "8"}).layout.dp_bucket_elements == 64_000_000
    assert build_config(None, {"layout.dp": "2"}).layout.dp_bucket_elements == 40_000_000
    assert build_config(None, {"layout.dp_bucket_size": "1000"}).layout.dp_bucket_elements == 1000
    from fivefold.planner.time import step_time

    cfg, hw = load_model("llama3-8b"), get_cluster("h100")
    parts = {on: step_time(cfg, 4096, Layout(dp=8, zero=1, dp_overlap_param_gather=on, grad_accum_steps=4), FIVEFOLD,
                           hw).parts for on in (None, False)}
    gathered = [k for k in parts[False] if "gather" in k]
    assert gathered and all(parts[None][k] < parts[False][k] for k in gathered), (parts[None], parts[False])
