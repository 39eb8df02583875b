"""`fivefold plan`: the search, one-layout estimates, the written config, bad input, hardware files, the
closed forms the search uses against the schedules' action lists, and the validation against published runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fivefold.cli import main
from fivefold.config import ConfigError, build_config
from fivefold.errors import CliError
from fivefold.parallel.schedules import _peak_in_flight, build_schedule
from fivefold.planner.hardware import get_cluster
from fivefold.planner.layout import FIVEFOLD, Layout, parse_layout
from fivefold.planner.memory import stage_layers
from fivefold.planner.search import estimate, in_flight, parse_tokens, search
from fivefold.presets import get_preset
from fivefold.tools.validate import DEFAULT_DATA, spearman

PLAYBOOK = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "playbook_benchmark_runs.csv"
needs_data = pytest.mark.skipif(not PLAYBOOK.is_file(), reason="../shared/data is not beside the repository")


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["plan", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_llama3_8b_one_node_table_config_and_json(capsys, tmp_path):
    cfg_file = tmp_path / "best.toml"
    rc, out, _ = run_cli(capsys, "--model", "llama3-8b", "--gpu", "h100", "--nodes", "1", "--gpus-per-node", "8",
                         "--seq-len", "4096", "--global-batch", "1M", "--top", "5", "--write-config", str(cfg_file),
                         "--explain")
    assert rc == 0
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("layout"))
    rows = lines[header + 1:header + 6]
    tokens = [float(r.split()[-2].replace(",", "")) for r in rows]
    assert tokens == sorted(tokens, reverse=True) and tokens[0] > 0
    assert "rejected:" in out and "What binds:" in out
    conf = build_config(cfg_file)
    conf.validate()  # what `fivefold train --config FILE` does first
    assert conf.layout.dp * conf.layout.tp * conf.layout.pp * conf.layout.cp == 8
    assert conf.train.global_batch_size * conf.train.seq_len == 2**20
    assert conf.model.n_layers == 32 and conf.model.hidden == 4096

    rc, out, _ = run_cli(capsys, "--model", "llama3-8b", "--nodes", "1", "--global-batch", "1M", "--top", "3",
                         "--json")
    data = json.loads(out)
    cand = data["candidates"][0]
    for key in ("layout", "fits", "memory_bytes", "step_time_s", "tokens_per_s_per_gpu", "mfu", "time_s"):
        assert key in cand
    for knob in ("dp", "tp", "pp", "cp", "ep", "zero", "mbs", "grad_acc", "recompute", "sp", "schedule", "vpp",
                 "fp32_grad_accum"):
        assert knob in cand["layout"]
    first = cand["memory_bytes"]["first"]
    assert first["peak"] == pytest.approx(sum(v for k, v in first.items() if k != "peak"))
    assert cand["fits"] and 0 < cand["mfu"] < 1


def test_one_layout_breakdown(capsys):
    rc, out, _ = run_cli(capsys, "--model", "llama3-8b", "--nodes", "1", "--global-batch", "1M", "--json",
                         "--layout", "dp=2,tp=2,pp=2,mbs=1,zero=1,recompute=selective,sp=on,schedule=1f1b")
    data = json.loads(out)
    mem = data["memory_bytes"]
    assert set(mem) >= {"first", "last", "peak"}  # per stage for the first and the last pipeline stage
    for part in ("parameters", "gradients", "optimizer", "activations", "comm_buffers", "fixed_overhead"):
        assert part in mem["first"]
    assert mem["last"]["transient"] > 0  # the loss temporaries live on the last stage
    assert data["layout"]["grad_acc"] == 256 // 2
    for part in ("compute", "tp_comm", "pipeline_bubble", "dp_comm_exposed"):
        assert data["time_s"][part] >= 0
    assert data["time_s"]["tp_comm"] > 0 and data["time_s"]["pipeline_bubble"] > 0


def test_memory_follows_the_techniques():
    cfg, hw = get_preset("llama3-8b"), get_cluster("h100")

    def peak(**kw) -> float:
        lay = parse_layout(",".join(f"{k}={v}" for k, v in kw.items()), 256)
        return estimate(cfg, 4096, lay, FIVEFOLD, hw).peak_bytes

    assert peak(dp=8, zero=3) < peak(dp=8, zero=2) < peak(dp=8, zero=1) < peak(dp=8, zero=0)
    assert peak(dp=4, tp=2, sp="on") < peak(dp=4, tp=2, sp="off")
    assert peak(dp=8, recompute="full") < peak(dp=8, recompute="none")
    assert peak(dp=4, pp=2, schedule="1f1b") < peak(dp=4, pp=2, schedule="afab")
    assert peak(dp=4, cp=2) < peak(dp=8, micro_batch_size=2)


@pytest.mark.parametrize("name,p,m,v", [("afab", 4, 8, 1), ("1f1b", 4, 8, 1), ("1f1b", 4, 2, 1),
                                        ("interleaved", 4, 8, 2), ("interleaved", 8, 16, 2), ("interleaved", 4, 4, 4),
                                        ("zero-bubble", 4, 8, 1), ("dualpipev", 4, 8, 1), ("dualpipev", 3, 9, 1)])
def test_in_flight_closed_forms_match_the_action_lists(name, p, m, v):
    peaks = _peak_in_flight(build_schedule(name, p, m, v))
    assert in_flight(name, p, m, v) == (peaks[0], peaks[-1])


def test_parse_inputs():
    assert parse_tokens("1M") == 1_048_576 == 256 * 4096
    assert parse_tokens("4096K") == parse_tokens("4M") == 4 * 2**20
    assert parse_tokens("1G") == 2**30 and parse_tokens("12345") == 12345
    with pytest.raises(CliError, match="token count"):
        parse_tokens("lots")
    lay = parse_layout("dp=4,tp=2,pp=1,mbs=1,zero=1,recompute=none", 256)
    assert (lay.dp, lay.tp, lay.grad_accum_steps, lay.zero, lay.schedule) == (4, 2, 64, 1, "1f1b")
    with pytest.raises(ConfigError, match="recompute"):
        parse_layout("recompute=some", 256)
    with pytest.raises(ConfigError, match="does not divide the global batch"):
        parse_layout("dp=3", 256)


def test_hardware_presets_and_toml_override(tmp_path):
    for name in ("h100", "h100-pcie", "h200", "b200", "a100-40gb", "a100-80gb", "mi300x", "max1550", "cpu"):
        hw = get_cluster(name)
        assert hw.bf16_tflops > 0 and hw.memory_gib > 0 and hw.inter_node_gbps > 0
    f = tmp_path / "mine.toml"
    f.write_text('base = "h100"\nmemory_gib = 40\ninter_node_gbps = 25\n[busbw_gbps]\n1 = 400\n4 = 100\n')
    hw = get_cluster(None, f)
    assert hw.memory_gib == 40 and hw.bf16_tflops == get_cluster("h100").bf16_tflops
    assert hw.bus_bandwidth(2) == pytest.approx(200e9)  # log-interpolated between measured node counts
    f.write_text("tflops = 3\n")
    with pytest.raises(ConfigError, match="not known"):
        get_cluster(None, f)


def test_bad_input_says_what_to_change(capsys):
    rc, _, err = run_cli(capsys, "--model", "llama-9000")
    assert rc == 2 and "not a preset" in err
    rc, _, err = run_cli(capsys, "--gpu", "tpu-v9")
    assert rc == 2 and "h100" in err
    rc, _, err = run_cli(capsys, "--model", "tiny", "--global-batch", "1000", "--seq-len", "128")
    assert rc == 2 and "whole number of --seq-len" in err
    # 3 sequences on 64 GPUs, tp x pp at most 16 for this model: no dp divides the batch
    rc, _, err = run_cli(capsys, "--model", "tiny", "--nodes", "8", "--seq-len", "128", "--global-batch", "384",
                         "--no-cp")
    assert rc == 2 and "global batch" in err
    # a 405B model on one 40 GB GPU fits nowhere
    rc, _, err = run_cli(capsys, "--model", "llama3-405b", "--gpu", "a100-40gb", "--gpus-per-node", "1",
                         "--global-batch", "64K")
    assert rc == 2 and "use more nodes" in err
    assert "ZeRO-3" not in err and "allow" not in err  # the search tried both; ZeRO-3 shards nothing on one GPU
    rc, _, err = run_cli(capsys, "--model", "llama3-405b", "--gpu", "a100-40gb", "--gpus-per-node", "8",
                         "--global-batch", "64K", "--zero", "0,1")
    assert rc == 2 and err.rstrip().endswith("or allow ZeRO-3 (--zero).")
    rc, _, err = run_cli(capsys, "--model", "layers=2,hidden=100,heads=3")
    assert rc == 2 and "n_heads" in err


def test_shape_and_moe_models(capsys):
    rc, out, _ = run_cli(capsys, "--model", "layers=8,hidden=1024,heads=16,kv_heads=4,ffn=2816,vocab=32000",
                         "--global-batch", "256K", "--top", "2")
    assert rc == 0 and "custom on 1 x 8 h100" in out
    rc, out, _ = run_cli(capsys, "--model", "mixtral-mini", "--global-batch", "256K", "--json", "--top", "20")
    eps = {c["layout"]["ep"] for c in json.loads(out)["candidates"]}
    assert rc == 0 and eps  # expert parallel is part of the search for MoE models


@pytest.mark.slow  # a timed test: 29-35 s of CPU against its 30 s bound on the 2-core machine
def test_search_405b_on_16384_gpus_finishes():
    """The largest space asked about is searched whole (its time is a benchmark's figure:
    benchmarks/plan_search_time.py)."""
    cfg, hw = get_preset("llama3-405b"), get_cluster("h100")
    result = search(cfg, 8192, 2048, 16384, FIVEFOLD, hw, top=5)
    assert result.candidates and result.evaluated > 10_000


def test_spearman():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 2, 3], [1, 2, 2, 3]) == pytest.approx(1.0)


@needs_data
def test_validate_playbook_held_out(capsys):
    assert DEFAULT_DATA.resolve() == PLAYBOOK.resolve()
    rc, out, _ = run_cli(capsys, "validate", "--json")
    assert rc == 0
    held = json.loads(out)["held_out"]
    assert held["rows"] > 2000
    assert held["fits_agreement"] >= 0.85
    assert held["median_memory_error"] <= 0.15
    assert held["median_spearman"] >= 0.6
    assert held["median_top1_regret"] <= 0.10
    gates = {g["gate"]: g for g in json.loads(out)["gates"]}  # issue 32's, by held-out node count
    assert len(gates) == 7 and all(set(g["by_nodes"]) == {"4", "8", "16", "32", "64"} for g in gates.values())


def test_validate_without_data_is_a_clear_error(capsys, tmp_path):
    rc, _, err = run_cli(capsys, "validate", "--data", str(tmp_path / "none.csv"))
    assert rc == 2 and "does not exist" in err


def test_layout_fields_roundtrip():
    lay = Layout(dp=2, tp=2, sp=True, zero=1, micro_batch_size=2, grad_accum_steps=4, recompute="selective")
    conf = lay.to_layout_config()
    assert (conf.dp, conf.tp, conf.sp, conf.zero, conf.micro_batch_size, conf.recompute) == (2, 2, True, 1, 2,
                                                                                            "selective")


def test_time_parts_add_up_to_the_step():
    cfg, hw = get_preset("llama3-8b"), get_cluster("h100")
    for text in ("dp=8", "dp=2,tp=2,pp=2,sp=on,recompute=full", "dp=2,pp=4,schedule=interleaved,vpp=2",
                 "dp=4,cp=2,zero=3", "dp=2,pp=4,schedule=dualpipev"):
        e = estimate(cfg, 4096, parse_layout(text, 256), FIVEFOLD, hw)
        assert sum(e.time_parts.values()) == pytest.approx(e.step_time_s, rel=1e-9), text
        assert min(e.time_parts.values()) >= 0, text


def test_host_floor_bounds_each_stage():
    # a host that issues each block's forward and backward in 50 ms per micro-batch: far slower than the GPU, so
    # the step is ga x (blocks of the busiest stage) x 50 ms, plus what runs outside the micro-batches
    import dataclasses

    cfg, hw = get_preset("llama3-8b"), get_cluster("h100")
    fw = dataclasses.replace(FIVEFOLD, host_us_per_layer=50_000.0)
    one_node = parse_layout("dp=2,tp=2,pp=2,mbs=1", 64)  # 8 GPUs: the pipeline stays inside the node
    e = estimate(cfg, 4096, one_node, fw, hw)
    outside = e.time_parts["dp_comm_exposed"] + e.time_parts["zero_gather"] + e.time_parts["optimizer"]
    blocks = stage_layers(cfg, one_node, 4096)  # the stages as the planner balances them (with the output layer)
    # the busiest stage's micro-batches, then the 1F1B fill and drain through the other stage at its pace
    expect = one_node.grad_accum_steps * max(blocks) * 0.05 + min(blocks) * 0.05
    assert e.step_time_s - outside == pytest.approx(expect, rel=0.01)
    assert e.time_parts["host_wait"] > 0
    # across nodes each tensor-parallel rank adds the cross-node term per block; inside one node it does not
    cross = dataclasses.replace(fw, cross_node_pp_us_per_layer_tp=10_000.0)
    assert estimate(cfg, 4096, one_node, cross, hw).step_time_s == pytest.approx(e.step_time_s)
    two_nodes = parse_layout("dp=4,tp=2,pp=2,mbs=1", 64)  # 16 GPUs: pp is outermost, its hand-overs leave the node
    base = estimate(cfg, 4096, two_nodes, fw, hw)
    slower = estimate(cfg, 4096, two_nodes, cross, hw)
    per_micro_batch = max(stage_layers(cfg, two_nodes, 4096)) * 2 * 0.010
    assert slower.time_parts["host_wait"] - base.time_parts["host_wait"] == pytest.approx(
        two_nodes.grad_accum_steps * per_micro_batch, rel=1e-6)
    # no host time: the GPU never waits
    assert estimate(cfg, 4096, one_node, FIVEFOLD, hw).time_parts["host_wait"] == 0.0


def test_gradient_accumulation_copies_cost_their_bytes():
    # nanotron adds every bf16 gradient into its fp32 buffer after each micro-batch: 10 bytes per parameter of the
    # rank at the achieved HBM bandwidth (the device's share, planner/devices/kernels.toml), per micro-batch (pp1:
    # every parameter of the model over tp)
    import dataclasses

    from fivefold.flops import count_params
    from fivefold.planner.kernels import device_kernels

    cfg, hw = get_preset("llama3-8b"), get_cluster("h100")
    lay = dataclasses.replace(parse_layout("dp=4,tp=2,mbs=1", 64), fp32_grad_accum=True)
    plain = estimate(cfg, 4096, lay, FIVEFOLD, hw)
    copies = estimate(cfg, 4096, lay, dataclasses.replace(FIVEFOLD, grad_accum_copy_bytes=10.0), hw)
    params = count_params(cfg) / 2  # tp2: every weight sharded in two but the norms (a rounding error here)
    expect = lay.grad_accum_steps * params * 10.0 / (hw.hbm_gbps * 1e9 * device_kernels("h100").hbm_efficiency)
    assert copies.step_time_s - plain.step_time_s == pytest.approx(expect, rel=0.01)
    # without the fp32 accumulation buffer nothing is copied
    no_buffer = dataclasses.replace(lay, fp32_grad_accum=False)
    assert estimate(cfg, 4096, no_buffer, dataclasses.replace(FIVEFOLD, grad_accum_copy_bytes=10.0), hw
                    ).step_time_s == pytest.approx(estimate(cfg, 4096, no_buffer, FIVEFOLD, hw).step_time_s)


def test_nanotron_stage_split_follows_its_build_model():
    # nanotron's build_model: pipeline blocks in order (embedding, 16 blocks, final norm, output layer, cast, loss),
    # each on the current rank, which hands over once the cumulative parameter cost passes (r + 1) / pp of the
    # total. 1B-shaped model: a block costs 4 h^2 + 3 h ffn = 67.1 M, the output layer V h = 268.4 M (4 blocks).
    from fivefold.config import ModelConfig
    from fivefold.planner.layout import NANOTRON
    from fivefold.planner.time import params_stage_split, stage_split_problem

    cfg = ModelConfig(name="1B", n_layers=16, hidden=2048, n_heads=32, n_kv_heads=32, ffn=8192, vocab_size=131072,
                      max_seq_len=4096, tied_embeddings=True)
    # pp4: shares of 335.5 M; block 5 reaches 402.7 M > 335.5 M on rank 0 (blocks 0-5), blocks 6-10 on rank 1
    # (738 M > 671 M), 11-15 on rank 2 (1073.7 M > 1006.6 M), the output layer, cast and loss on rank 3
    assert params_stage_split(cfg, 4) == ([6, 5, 5, 0], 4)
    # pp8: the output layer passes rank 6's share, cast and loss go to rank 7: every rank holds a pipeline block
    assert params_stage_split(cfg, 8) == ([3, 3, 2, 3, 2, 3, 0, 0], 8)
    # pp16: the 16 blocks fill ranks 0-11, the output layer, cast and loss ranks 12-14: rank 15 gets nothing
    assert params_stage_split(cfg, 16)[1] == 15
    assert stage_split_problem(cfg, parse_layout("pp=16", 256), NANOTRON) is not None
    assert stage_split_problem(cfg, parse_layout("pp=8", 256), NANOTRON) is None
    assert stage_split_problem(cfg, parse_layout("pp=16", 256), FIVEFOLD) is None  # fivefold splits by FLOPs
    assert not estimate(cfg, 4096, parse_layout("pp=16", 256), NANOTRON, get_cluster("h100")).fits


def test_fix_restricts_the_search_to_the_fixed_values(capsys):
    # the --fix search returns exactly the unrestricted search's candidates that have those values, best first
    rc, out, _ = run_cli(capsys, "--model", "llama3-8b", "--nodes", "2", "--global-batch", "1M", "--fix",
                         "tp=4,pp=2,zero=1", "--json")
    fixed = json.loads(out)["candidates"]
    rc_all, out_all, _ = run_cli(capsys, "--model", "llama3-8b", "--nodes", "2", "--global-batch", "1M", "--json")
    assert rc == rc_all == 0
    expect = [c for c in json.loads(out_all)["candidates"]
              if (c["layout"]["tp"], c["layout"]["pp"], c["layout"]["zero"]) == (4, 2, 1)]
    def layouts(candidates: list[dict]) -> list[str]:
        return sorted(json.dumps(c["layout"], sort_keys=True) for c in candidates)

    assert fixed and layouts(fixed) == layouts(expect)
    # a fixed micro-batch above the default search range is searched
    rc, out, _ = run_cli(capsys, "--model", "llama3-8b", "--nodes", "1", "--global-batch", "1M", "--fix",
                         "tp=8,mbs=128,recompute=full", "--json")
    assert rc == 0 and {c["layout"]["micro_batch_size"] for c in json.loads(out)["candidates"]} == {128}


@pytest.mark.parametrize("fix, words", [
    ("tp=3", ["tp = 3", "32 GPUs", "1, 2, 4, 8, 16, 32"]),
    ("tp=16", ["tp = 16", "8 GPUs of a node", "1, 2, 4, 8"]),
    ("tpp=2", ["tpp=2", "dp, tp, pp"]),
    ("tp=8,pp=8,dp=4", ["256", "32 GPUs"]),
    ("mbs=3", ["mbs = 3", "256 sequences", "1, 2, 4"]),
    ("zero=4", ["zero = 4", "0, 1, 2 or 3"]),
    ("schedule=gpipe", ["gpipe", "1f1b"]),
    ("tp=two", ["tp", "'two'", "integer"]),
])
def test_fix_bad_values_say_what_works(capsys, fix, words):
    rc, _, err = run_cli(capsys, "--model", "llama3-8b", "--nodes", "4", "--global-batch", "1M", "--fix", fix)
    assert rc == 2
    for w in words:
        assert w in err, (w, err)
    # a fixed value that the explicit options exclude
    rc, _, err = run_cli(capsys, "--model", "llama3-8b", "--nodes", "4", "--zero", "0,1", "--fix", "zero=3")
    assert rc == 2 and "--zero 0,1" in err


def test_pad_vocab_lets_tp_split_an_odd_vocabulary(capsys, tmp_path):
    import tomllib

    shape = "layers=4,hidden=256,heads=8,ffn=1024,vocab=50257"  # 50,257 = 29 x 1,733: no tp > 1 divides it
    args = ["--model", shape, "--nodes", "1", "--gpus-per-node", "4", "--seq-len", "512", "--global-batch", "64K",
            "--no-cp", "--json"]
    rc, out, _ = run_cli(capsys, *args)
    assert rc == 0 and {c["layout"]["tp"] for c in json.loads(out)["candidates"]} == {1}
    best = tmp_path / "best.toml"
    rc, out, _ = run_cli(capsys, *args, "--pad-vocab", "128", "--fix", "tp=4", "--write-config", str(best))
    assert rc == 0 and {c["layout"]["tp"] for c in json.loads(out)["candidates"]} == {4}
    written = tomllib.loads(best.read_text())
    assert written["model"]["vocab_size"] == 50304 and written["layout"]["tp"] == 4  # 128 x 393
    rc, _, err = run_cli(capsys, "--model", shape, "--pad-vocab", "-8")
    assert rc == 2 and "--pad-vocab = -8" in err and ">= 1" in err


@pytest.mark.slow
@needs_data
def test_packaged_profile_is_the_fit_on_one_and_two_nodes():
    from fivefold.tools.validate import (
        FIT_NODES,
        STALL_FIELDS,
        TIME_GRID,
        fit_memory,
        fit_stall,
        fit_time,
        load_profile,
        read_runs_csv,
    )

    rows = [r for r in read_runs_csv(PLAYBOOK) if r.nodes in FIT_NODES]
    fw, hw = load_profile(None)
    fitted_fw = fit_memory(rows, fw)
    fitted_fw, fitted_hw = fit_time(rows, fitted_fw, hw)
    for name in ("activation_scale", "logits_bytes", "fixed_overhead_gib", "usable_memory_fraction"):
        assert getattr(fitted_fw, name) == pytest.approx(getattr(fw, name), abs=1e-3), name
    for table, name, _ in TIME_GRID:
        fitted, packaged = (fitted_fw, fw) if table == "framework" else (fitted_hw, hw)
        assert getattr(fitted, name) == getattr(packaged, name), name
    assert fitted_hw.pp_sync_us_per_node == hw.pp_sync_us_per_node == 0.0
    # the stall model and the drift, on the same rows with the fitted constants
    stall_hw = fit_stall(rows, fitted_fw, fitted_hw)
    for name in STALL_FIELDS:
        assert getattr(stall_hw, name) == pytest.approx(getattr(hw, name), abs=1e-4), name
    assert hw.stall_hazard_per_node > 0


def test_validate_reads_fivefold_rows(capsys, tmp_path):
    # fivefold's own results in the same columns, with the knobs nanotron fixes given per row
    head = ("model,n_layers,hidden,heads,kv_heads,ffn,vocab,tied_emb,seq_len,nodes,gpus,dp,tp,pp,mbs,grad_acc,zero,"
            "status,tok_s_gpu,mem_gb,framework,cp,recompute,sp,schedule\n")
    shape = "tiny,4,128,4,2,384,2048,True,128"
    rows = [f"{shape},1,2,2,1,1,1,8,0,ok,1000,0.5,fivefold,1,none,false,1f1b",
            f"{shape},1,2,1,2,1,1,8,0,ok,900,0.4,fivefold,1,full,true,1f1b",
            f"{shape},1,2,1,1,2,1,8,0,ok,800,0.4,fivefold,1,none,false,afab",
            f"{shape},4,8,8,1,1,1,2,1,crashed_or_oom,,,fivefold,1,none,false,1f1b"]
    f = tmp_path / "runs.csv"
    f.write_text(head + "\n".join(rows) + "\n")
    rc, out, _ = run_cli(capsys, "validate", "--data", str(f), "--json")
    result = json.loads(out)
    assert rc == 0 and result["fitted"]["rows"] == 3 and result["held_out"]["rows"] == 1
    assert "tiny/1n" in result["fitted"]["groups"]
    assert result["fitted"]["finished"] == 3


def test_search_never_proposes_sequence_parallel_the_engine_refuses():
    """Sequence parallel cuts the (cp-local) sequence over tp: with seq = 129 on 2 GPUs, tp2 + sp is rejected with
    its reason, tp2 without sp stays, and every proposed layout passes the engine's validator."""
    from fivefold.layout import check_layout

    cfg, hw = get_preset("tiny"), get_cluster("h100")
    result = search(cfg, 129, 8, 2, FIVEFOLD, hw, top=1000)
    assert result.rejected["sequence parallel with seq not divisible by tp x cp"] > 0
    assert not any(e.layout.sp for e in result.candidates) and any(e.layout.tp == 2 for e in result.candidates)
    for e in result.candidates:
        conf = build_config(None, {"model.preset": "tiny", "train.seq_len": 129, "train.global_batch_size": 8})
        conf.layout = e.layout.to_layout_config()
        check_layout(conf, 2)


def test_plan_says_whether_it_ranks_compiled_or_eager(capsys, tmp_path):
    """The table's ranking is labelled (text and --json "compiled"): eager by default, compiled with --features
    compile or with --write-config on an accelerator; the compiled ranking is the compiled model's (faster)."""
    base = ["--model", "llama-3.2-1b", "--gpu", "h100", "--nodes", "1", "--gpus-per-node", "4", "--seq-len", "4096",
            "--global-batch", "1M", "--top", "1"]
    rc, eager, _ = run_cli(capsys, *base)
    assert rc == 0 and "ranked eager, without torch.compile" in eager and "ranked with torch.compile" not in eager
    rc, compiled, _ = run_cli(capsys, *base, "--features", "compile")
    assert rc == 0 and "ranked with torch.compile (--features compile)" in compiled and "ranked eager" not in compiled
    rc, written, _ = run_cli(capsys, *base, "--write-config", str(tmp_path / "best.toml"))
    assert rc == 0 and f"ranked with torch.compile, as {tmp_path / 'best.toml'} runs it" in written
    speeds = {}
    for flags in ([], ["--features", "compile"]):
        rc, out, _ = run_cli(capsys, *base, *flags, "--json")
        data = json.loads(out)
        assert rc == 0 and data["compiled"] == bool(flags)
        speeds[bool(flags)] = data["candidates"][0]["tokens_per_s_per_device"]
    assert speeds[True] > speeds[False]


def test_cpu_profiles_say_per_device_not_per_gpu(capsys):
    """On a CPU profile a rank is a process on a device, not a GPU: the table, the baselines and --layout say
    per device; an accelerator's say per GPU."""
    args = ["--model", "tiny", "--nodes", "1", "--gpus-per-node", "2", "--seq-len", "128", "--global-batch", "4096",
            "--top", "1"]
    rc, cpu, _ = run_cli(capsys, *args, "--gpu", "cpu")
    assert rc == 0 and "tok/s/device" in cpu and "tokens/s per device" in cpu and "GPU" not in cpu
    rc, one, _ = run_cli(capsys, *args[:-2], "--gpu", "cpu", "--layout", "dp=2,mbs=1")  # --top: the search's
    assert rc == 0 and "tokens/s per device" in one and "GPU" not in one
    rc, gpu, _ = run_cli(capsys, *args, "--gpu", "h100")
    assert rc == 0 and "tok/s/GPU" in gpu and "tokens/s per GPU" in gpu and "per device" not in gpu


# the start-up check of `fivefold train` / `fivefold bench` against `fivefold plan --layout`: (model, sequences in the
# global batch, layout); llama-3.2-1b at micro-batch 32 x 4096 tokens with full recompute fits an H100 although its
# whole-batch fp32 logits alone (62.6 GiB) and 16 bytes per parameter (18.5 GiB) would not: the chunked loss never
# holds them
STARTUP_LAYOUTS = [
    ("llama-3.2-1b", 32, {"micro_batch_size": 32, "recompute": "full"}),
    ("llama-3.2-1b", 32, {"micro_batch_size": 32, "recompute": "selective"}),
    ("llama-3.2-1b", 32, {"micro_batch_size": 32, "recompute": "none"}),
    ("llama-3.2-1b", 32, {"micro_batch_size": 1, "recompute": "none"}),
    ("llama-3.2-1b", 64, {"dp": 8, "zero": 1, "micro_batch_size": 8, "recompute": "none"}),
    ("llama-3.2-1b", 64, {"dp": 4, "tp": 2, "sp": True, "micro_batch_size": 16, "recompute": "full"}),
    ("llama-3.2-1b", 64, {"dp": 4, "pp": 2, "micro_batch_size": 16, "recompute": "none", "schedule": "afab"}),
    ("llama3-8b", 8, {"micro_batch_size": 1, "recompute": "full"}),
    ("llama3-8b", 64, {"dp": 8, "zero": 0, "micro_batch_size": 1, "recompute": "full"}),
    ("llama3-8b", 64, {"dp": 8, "zero": 3, "micro_batch_size": 1, "recompute": "full"}),
    ("llama3-8b", 64, {"dp": 8, "zero": 3, "micro_batch_size": 8, "recompute": "none"}),
    ("llama3-8b", 64, {"dp": 2, "tp": 4, "sp": True, "zero": 1, "micro_batch_size": 1, "recompute": "selective"}),
    ("llama3-8b", 64, {"dp": 2, "pp": 4, "zero": 1, "micro_batch_size": 1, "recompute": "none"}),
]


def test_startup_check_agrees_with_plan_layout(capsys: pytest.CaptureFixture) -> None:
    """The start-up memory check (`check_fits` on an H100, as `fivefold train` runs it there) refuses exactly the
    layouts that `fivefold plan --layout` says do not fit, and its figure is the plan's predicted peak."""
    from fivefold.planner.predict import check_fits, on_one_node

    seq = 4096
    answers = []
    for model, batch_seqs, layout in STARTUP_LAYOUTS:
        world = layout.get("dp", 1) * layout.get("tp", 1) * layout.get("pp", 1)
        text = ",".join(f"{k}={'on' if v is True else v}" for k, v in layout.items())
        assert main(["plan", "--model", model, "--seq-len", str(seq), "--global-batch", str(batch_seqs * seq),
                     "--gpus-per-node", str(world), "--layout", text, "--json"]) == 0
        planned = json.loads(capsys.readouterr().out)
        cfg = build_config(None, {"model.preset": model, "train.seq_len": str(seq), "train.device": "cuda",
                                  "train.global_batch_size": str(batch_seqs),
                                  **{f"layout.{k}": str(v).lower() for k, v in layout.items()}})
        try:
            check_fits(cfg, on_one_node(get_cluster("h100"), world), "cuda")
            refused = None
        except ConfigError as e:
            refused = str(e)
        assert (refused is None) == planned["fits"], (model, text, refused, planned["memory_bytes"]["peak"])
        if refused is not None:  # the figure: the plan's peak against the device's memory
            assert f"peak of {planned['memory_bytes']['peak'] / 2**30:,.1f} GiB per device" in refused, refused
            assert "79.6 GiB" in refused
            assert f"layout.micro_batch_size = {layout['micro_batch_size']}" in refused or "model.hidden" in refused
        answers.append(planned["fits"])
    assert answers[:3] == [True, False, False]  # the llama-3.2-1b case fits with full recompute, not without
    assert answers.count(True) >= 4 and answers.count(False) >= 4, answers


def test_every_shape_the_search_takes_layout_takes(capsys) -> None:
    """A GELU shape (GPT-2 small): `plan --layout` estimates each of the search's best layouts to the same step time
    and peak (it used to refuse the shape through the trainer's config, which builds SwiGLU only)."""
    model = "layers=12,hidden=768,heads=12,ffn=3072,vocab=50257,mlp=gelu"
    common = ["plan", "--model", model, "--seq-len", "1024", "--global-batch", "512K", "--json"]
    assert main(common + ["--top", "5"]) == 0
    candidates = json.loads(capsys.readouterr().out)["candidates"][:5]
    for c in candidates:
        lay = c["layout"]
        spec = ",".join(f"{k}={lay[k]}" for k in ("dp", "tp", "pp", "cp", "ep", "zero", "mbs", "recompute",
                                                   "schedule", "vpp"))
        spec += f",sp={'on' if lay['sp'] else 'off'}"
        assert main(common + ["--layout", spec]) == 0
        one = json.loads(capsys.readouterr().out)
        assert one["step_time_s"] == pytest.approx(c["step_time_s"], rel=1e-9), spec
        assert one["memory_bytes"]["peak"] == pytest.approx(c["memory_bytes"]["peak"], rel=1e-9), spec
