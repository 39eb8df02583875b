"""One rule book for layouts (`fivefold.layout`): every layout the planner's search proposes passes the rules that
`fivefold train` applies, and `fivefold plan --layout` refuses what `fivefold train` refuses, with the same
message."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fivefold.cli import main
from fivefold.cli.plan import load_model
from fivefold.config import ConfigError, LayoutConfig, ModelConfig, build_config
from fivefold.layout import check_layout, layout_notes, layout_problem, stage_count, tensor_parallel_problem
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


# fields set where they mean nothing: (world, layout, the note's "field = value", its reason)
NOTED = [
    (1, {"schedule": "dualpipev"}, "layout.schedule = 'dualpipev'", "with layout.pp = 1: "),
    (2, {"tp": 2, "etp": 2}, "layout.etp = 2", "on a dense model (model.n_experts = 0): "),
    (1, {"dp_bucket_size": 1000}, "layout.dp_bucket_size = 1000", "with layout.dp x layout.cp = 1 x 1 = 1: "),
    (2, {"tp": 2, "dp_bucket_size": 1000}, "layout.dp_bucket_size = 1000", "with layout.dp x layout.cp = 1 x 1 = 1: "),
    (1, {"pp_comm_overlap": "false"}, "layout.pp_comm_overlap = false", "with layout.pp = 1: "),
]


@pytest.mark.parametrize("world, layout, field_value, reason", NOTED,
                         ids=["-".join(f"{k}{v}" for k, v in r[1].items()) for r in NOTED])
def test_a_field_that_means_nothing_is_accepted_with_one_note(capsys, tmp_path, world, layout, field_value, reason):
    """Not refused (a pipelined run resumed on one process keeps its schedule), but `fivefold train` (its
    --dry-run too) and `fivefold plan --layout` say in one line which field, which value and why it has no
    effect."""
    argv = ["train", "--preset", "tiny", "--nproc", str(world), "--run-dir", str(tmp_path / "run"), "--train.device",
            "cpu", *[a for k, v in layout.items() for a in (f"--layout.{k}", str(v))]]
    rc = main([*argv, "--dry-run"])
    out = capsys.readouterr().out
    assert rc == 0, out
    notes = [line.removeprefix("note: ") for line in out.splitlines() if line.startswith("note: layout.")]
    assert len(notes) == 1 and notes[0].startswith(f"{field_value} has no effect {reason}"), out
    # a run says it at start (on its way to a run that --slurm only writes the script of, as every run does)
    assert main([*argv, "--slurm", str(tmp_path / "job.sh")]) == 0
    err = capsys.readouterr().err
    assert [line.removeprefix("fivefold: note: ") for line in err.splitlines() if "note:" in line] == notes, err
    rc = main(["plan", "--model", "tiny", "--gpu", "h100", "--gpus-per-node", str(world), "--layout",
               ",".join(f"{k}={v}" for k, v in {"micro_batch_size": 1, **layout}.items())])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert [line.removeprefix("fivefold plan: note: ") for line in err.splitlines()
            if line.startswith("fivefold plan: note: ")] == notes


@pytest.mark.parametrize("model, layout", [
    ("tiny", {}),
    ("tiny", {"pp": 2, "schedule": "dualpipev"}),
    ("tiny-moe", {"tp": 2, "etp": 2}),
    ("tiny", {"dp": 2, "dp_bucket_size": 1000}),
    ("tiny", {"cp": 2, "dp_bucket_size": 1000}),
    # whole experts under tp (etp = 1): their gradients are reduced in buckets over the tp ranks, dp x cp = 1 or not
    ("tiny-moe", {"tp": 2, "dp_bucket_size": 1000}),
    ("tiny", {"pp": 2, "pp_comm_overlap": False}),
    ("tiny", {"dp": 2, "zero": 1, "dp_overlap_param_gather": False}),
])
def test_no_note_where_the_field_takes_effect(model, layout):
    assert layout_notes(get_preset(model), LayoutConfig(**layout)) == []


def test_the_noted_fields_change_nothing_in_a_one_process_run():
    """The reference: the same one-process training without the fields that draw notes (a schedule without a
    pipeline, a bucket size without data parallel), step by step and weight by weight."""
    from tests.test_parallel_equivalence import tiny_config, train_steps

    from fivefold.train.build import build_engine

    runs = []
    for extra in ({}, {"layout.schedule": "dualpipev", "layout.dp_bucket_size": "1000"}):
        cfg = tiny_config(extra)
        if not extra:
            cfg.layout.dp_bucket_size = None  # tiny_config's small buckets are a field that draws a note here
        assert len(layout_notes(cfg.model, cfg.layout)) == (2 if extra else 0)
        engine = build_engine(cfg, torch.device("cpu"))
        runs.append((train_steps(engine, cfg), {k: v.clone() for k, v in engine.model.state_dict().items()}))
    (plain, plain_state), (noted, noted_state) = runs
    assert plain == noted
    assert plain_state.keys() == noted_state.keys() and all(torch.equal(plain_state[k], noted_state[k])
                                                            for k in plain_state)


@pytest.mark.parametrize("schedule", ["afab", "1f1b", "interleaved", "zero-bubble", "dualpipev"])
def test_the_pipeline_overlap_is_noted_exactly_where_it_changes_nothing(schedule):
    """`layout.pp_comm_overlap` reaches a pipelined rank in two places: which weight gradients its stages defer
    (`build.weight_grad_queue`) and whether a whole backward (a schedule without a B / W split) posts its batch
    before running them (`PipelineExecutor.run`, which then runs the deferred work; with nothing deferred the
    post comes after the whole backward either way). Where both are the same with the switch on and off (ZeRO-3,
    the split schedules) a set switch is noted; where they differ it is not."""
    from fivefold.parallel.schedules import build_schedule
    from fivefold.train.build import weight_grad_queue

    for zero in (0, 1, 2, 3):
        seen = {}
        for on in ("true", "false"):
            cfg = build_config(None, {"model.preset": "tiny", "model.n_layers": "4", "layout.pp": "2",
                                      "layout.dp": "2", "layout.zero": str(zero), "layout.schedule": schedule,
                                      "layout.vpp": "2" if schedule == "interleaved" else "1",
                                      "layout.micro_batch_size": "2", "train.global_batch_size": "16",
                                      "layout.pp_comm_overlap": on})
            cfg.validate()
            check_layout(cfg, 4)
            queue = weight_grad_queue(cfg)
            split = build_schedule(schedule, 2, cfg.grad_accum_steps, cfg.layout.vpp).split_backward
            deferred = None if queue is None else queue.first_block_only
            posted_before_deferred = cfg.layout.overlaps_pp_comm and not split and queue is not None
            noted = [n for n in layout_notes(cfg.model, cfg.layout) if n.startswith("layout.pp_comm_overlap")]
            seen[on] = ((deferred, posted_before_deferred), noted)
        (behaviour_on, noted_on), (behaviour_off, noted_off) = seen["true"], seen["false"]
        changes_nothing = behaviour_on == behaviour_off
        assert changes_nothing == (zero == 3 or schedule in ("zero-bubble", "dualpipev")), (zero, seen)
        assert bool(noted_on) == bool(noted_off) == changes_nothing, (zero, seen)
        if changes_nothing:
            assert noted_on[0].startswith("layout.pp_comm_overlap = true has no effect ")
            assert noted_off[0].startswith("layout.pp_comm_overlap = false has no effect ")
