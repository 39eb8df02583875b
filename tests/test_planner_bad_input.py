"""Bad input to the planner's secondary paths (hardware TOMLs, the validate CSV, Hugging Face config.json, the plan
flags, the files it writes): one error line naming the field and the value, exit status 2, before the expensive
work; and the valid input of each changed parser still read as before."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from fivefold.cli import main
from fivefold.config import ConfigError
from fivefold.errors import CliError
from fivefold.models.hf import model_config_from_hf
from fivefold.outputs import keep_previous
from fivefold.planner.hardware import cluster_from_table, get_cluster
from fivefold.planner.search import divisors
from fivefold.tools.validate import read_runs_csv

TINY = ("--model", "tiny", "--gpu", "cpu", "--seq-len", "128", "--global-batch", "8K")


def refused(capsys, argv: list[str], *said: str) -> str:
    """`fivefold plan ARGV` ends with status 2 and one error line holding every string of `said`."""
    rc = main(["plan", *argv])
    out = capsys.readouterr()
    assert rc == 2, (rc, out.out, out.err)
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.err, out.err
    assert out.out == "", out.out  # refused before anything is printed
    for text in said:
        assert text in lines[0], lines[0]
    return lines[0]


# ---------------------------------------------------------------------------------------------
# 1. hardware TOML (`plan --hardware`, `plan validate --profile`)

HARDWARE_BAD = [
    ('matmul_efficiency = "fast"', ("matmul_efficiency", "'fast'", "not a number")),
    ("intra_latency_us = true", ("intra_latency_us", "True", "not a number")),
    ('hbm_gbps = "3350"', ("hbm_gbps", "'3350'", "not a number")),
    ("comm_overlap = inf", ("comm_overlap", "inf", "finite")),
    ("matmul_efficiency = nan", ("matmul_efficiency", "nan", "finite")),
    ("inter_latency_us = -inf", ("inter_latency_us", "-inf", "finite")),
    ("cores = 1.5", ("cores", "1.5", "whole number")),
    ("threads_per_rank = true", ("threads_per_rank", "True", "not an integer")),
    ("gpus_per_node = 0", ("gpus_per_node", "0", ">= 1")),
    # a huge negative integer is shown cut, not as its 309 digits; a field that may be 0 says so
    ("gpus_per_node = -1e308", ("gpus_per_node = -10000000000000000...", "must be >= 1")),
    ("comm_overlap = -0.5", ("comm_overlap = -0.5", "must be >= 0")),
    ("hbm_gbps = -1.0", ("hbm_gbps = -1.0", "must be > 0")),
    ("matmul_efficiency = 1e308", ("matmul_efficiency", "1e+308", "(0, 1]")),
    ("comm_overlap = 1.5", ("comm_overlap", "1.5", "[0, 1]")),
    ("stall_hazard_per_node = 1.0", ("stall_hazard_per_node", "1.0", "must be below 1")),
    ("busbw_gbps = {x = 100}", ("busbw_gbps key 'x'", "integer")),
    ("busbw_gbps = {0 = 100}", ("busbw_gbps key '0'", "integer >= 1")),
    ("busbw_gbps = {8 = 0}", ("busbw_gbps[8] = 0.0", "> 0")),
    # a device's own figures beyond any device: a unit typo, not a machine
    ("bf16_tflops = 1e30", ("bf16_tflops = 1e+30", "at most 100,000")),
    ("memory_gib = 1e-9", ("memory_gib = 1e-09", "between 0.01 and 100,000")),
    ("inter_node_gbps = 5e9", ("inter_node_gbps", "at most 1,000,000")),
    ('gather_busbw_gbps = {1 = "fast"}', ("gather_busbw_gbps[1]", "'fast'")),
    ("gather_busbw_gbps = {1 = nan}", ("gather_busbw_gbps[1]", "nan", "finite")),
    ("busbw_gbps = 5", ("busbw_gbps = 5", "table")),
    ("linear = [[1, 2, 3, inf, 5]]", ("linear row", "inf", "finite")),
    ("elementwise = [[true, 5]]", ("elementwise row", "True")),
    ("name = 5", ("name = 5", "string")),
    ('[ranks.2]\nmatmul_efficiency = "x"', ("[ranks.2] matmul_efficiency", "'x'")),
]


@pytest.mark.parametrize(("body", "said"), HARDWARE_BAD, ids=[b.split("=")[0].strip() + str(i)
                                                             for i, (b, _) in enumerate(HARDWARE_BAD)])
def test_hardware_field_refused(body: str, said: tuple[str, ...]):
    with pytest.raises(ConfigError) as e:
        cluster_from_table(__import__("tomllib").loads('base = "h100"\n' + body), "hw.toml")
    for text in said:
        assert text in str(e.value), str(e.value)


@pytest.mark.parametrize(("text", "said"), [
    ("", ("holds no fields",)),
    ("base = 3\n", ("base = 3", "not a preset")),
    ('base = "nosuch"\n', ("base = 'nosuch'", "not a preset")),
    ('base = "h100"\nbusbw_gbps = {8 = 0}\n', ("busbw_gbps[8]", "> 0")),  # once divided by zero in the search
    ('base = "h100"\nmatmul_efficiency = "fast"\n', ("--hardware matmul_efficiency = 'fast' is not a number",)),
])
def test_hardware_file_refused_by_plan_and_validate(capsys, tmp_path: Path, text: str, said: tuple[str, ...]):
    f, runs = tmp_path / "hw.toml", tmp_path / "runs.csv"
    f.write_text(text)
    runs.write_text(HEAD + ROW + "\n")
    refused(capsys, [*TINY, "--hardware", str(f)], *said)
    # validate reads the file as --profile, and says so (not --hardware, plan's flag)
    as_profile = [t.replace("--hardware", "--profile") for t in said]
    refused(capsys, ["validate", "--profile", str(f), "--data", str(runs)], "--profile", *as_profile)


def test_hardware_valid_fields_still_read(capsys, tmp_path: Path):
    hw = cluster_from_table({"base": "h100", "matmul_efficiency": 0.5, "comm_overlap": 0, "cores": 4.0,
                             "busbw_gbps": {"1": 400, "2": 300.5}, "stall_hazard_per_node": 0.01}, "hw.toml")
    assert hw.matmul_efficiency == 0.5 and hw.comm_overlap == 0.0 and hw.cores == 4 and isinstance(hw.cores, int)
    assert hw.busbw_gbps == {1: 400.0, 2: 300.5} and hw.memory_gib == get_cluster("h100").memory_gib
    f = tmp_path / "cpu.toml"
    f.write_text('base = "cpu"\nmatmul_efficiency = 1\n')
    assert main(["plan", *TINY, "--hardware", str(f), "--top", "1"]) == 0
    assert "cpu" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# 2. `plan validate --data CSV`

HEAD = ("model,n_layers,hidden,heads,kv_heads,ffn,vocab,tied_emb,seq_len,nodes,gpus,dp,tp,pp,mbs,grad_acc,zero,"
        "status,tok_s_gpu,mem_gb,mfu_pct\n")
ROW = "tiny,4,128,4,2,384,2048,True,128,1,2,2,1,1,1,8,0,ok,1000,0.5,30.1"


def _row(**changes: str) -> str:
    cells = dict(zip(HEAD.strip().split(","), ROW.split(","), strict=True))
    return ",".join({**cells, **changes}.values())


CSV_BAD = [
    ("binary", b"\x00\xff\x01", ("UTF-8",)),
    ("empty", b"", ("holds no runs",)),
    ("header only", HEAD.encode(), ("holds no runs",)),
    ("no columns", b"a,b\n1,2\n", ("lacks", "tied_emb", "n_layers", "status")),
    ("one column missing", (HEAD.replace(",mem_gb", "") + ROW.rsplit(",", 2)[0] + ",30\n").encode(),
     ("lacks the column(s) mem_gb;",)),
    ("short row", (HEAD + "tiny,4,128\n").encode(), ("row 1 has 3 cells", "21 columns")),
    ("long row", (HEAD + ROW + ",7\n").encode(), ("row 1 has 22 cells",)),
    ("not an integer", (HEAD + ROW + "\n" + _row(n_layers="x") + "\n").encode(), ("row 2", "n_layers = 'x'",
                                                                                  "not an integer")),
    ("a float integer", (HEAD + _row(dp="2.5") + "\n").encode(), ("row 1", "dp = '2.5'")),
    ("not a number", (HEAD + _row(tok_s_gpu="fast") + "\n").encode(), ("tok_s_gpu = 'fast'", "not a number")),
    ("nan", (HEAD + _row(tok_s_gpu="nan") + "\n").encode(), ("tok_s_gpu = 'nan'", "finite")),
    ("inf unused column", (HEAD + _row(mfu_pct="inf") + "\n").encode(), ("mfu_pct = 'inf'", "finite")),
    ("layout not the gpus", (HEAD + _row(tp="3") + "\n").encode(), ("dp x tp x pp x cp", "= 6", "gpus = 2")),
    ("micro-batch 0", (HEAD + _row(mbs="0") + "\n").encode(), ("row 1", "mbs = 0", ">= 1")),
    ("negative tp", (HEAD + _row(tp="-1") + "\n").encode(), ("tp = -1", ">= 1")),
    ("no nodes", (HEAD + _row(nodes="0") + "\n").encode(), ("nodes = 0", ">= 1")),
    ("zero 9", (HEAD + _row(zero="9") + "\n").encode(), ("zero = 9", "0, 1, 2, 3")),
    ("unknown status", (HEAD + _row(status="okay") + "\n").encode(), ("status = 'okay'", "crashed_or_oom")),
    ("empty status", (HEAD + _row(status="") + "\n").encode(), ("status = ''", "not one of")),
    ("not a boolean", (HEAD + _row(tied_emb="maybe") + "\n").encode(), ("tied_emb = 'maybe'", "true or false")),
    ("finished without tokens/s", (HEAD + _row(tok_s_gpu="") + "\n").encode(), ("tok_s_gpu = ''", "status ok")),
    ("negative tokens/s", (HEAD + _row(tok_s_gpu="-1000") + "\n").encode(), ("tok_s_gpu = '-1000'", "> 0")),
    ("negative memory", (HEAD + _row(mem_gb="-0.5") + "\n").encode(), ("mem_gb = '-0.5'", ">= 0")),
    ("unknown recompute", (HEAD.replace(",mfu_pct", ",recompute,mfu_pct") + ROW.replace(",30.1", ",selctive,30.1")
                           + "\n").encode(), ("recompute = 'selctive'", "none, selective, full")),
    ("unknown schedule", (HEAD.replace(",mfu_pct", ",schedule,mfu_pct") + ROW.replace(",30.1", ",1f1bb,30.1")
                          + "\n").encode(), ("schedule = '1f1bb'", "dualpipev")),
]


@pytest.mark.parametrize(("content", "said"), [c[1:] for c in CSV_BAD], ids=[c[0] for c in CSV_BAD])
def test_validate_csv_refused(capsys, tmp_path: Path, content: bytes, said: tuple[str, ...]):
    f = tmp_path / "runs.csv"
    f.write_bytes(content)
    line = refused(capsys, ["validate", "--data", str(f)], *said)
    assert "runs.csv" in line


def test_validate_csv_valid_rows_read_as_before(tmp_path: Path):
    f = tmp_path / "runs.csv"
    f.write_text(HEAD.replace(",mfu_pct", ",cp,mfu_pct") + ROW.replace(",30.1", ",,30.1") + "\n"
                 + _row(kv_heads="", status="crashed_or_oom", tok_s_gpu="", mem_gb="").replace(",30.1", ",1,30.1")
                 + "\n")
    ok, failed = read_runs_csv(f)
    assert (ok.model.n_layers, ok.model.n_kv_heads, ok.layout.dp, ok.layout.cp, ok.layout.grad_accum_steps) == \
        (4, 2, 2, 1, 8)
    assert ok.ok and ok.tok_s_gpu == 1000.0 and ok.mem_gib == 0.5 and ok.group == ("tiny", 1)
    assert not failed.ok and failed.model.n_kv_heads == 4 and failed.tok_s_gpu == 0.0


# ---------------------------------------------------------------------------------------------
# 3. Hugging Face config.json (`plan --model file.json`)

HF = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
      "intermediate_size": 128, "vocab_size": 300}
HF_BAD = [
    ({"hidden_size": "big"}, ("hidden_size = 'big'", "not an integer")),
    ({"hidden_size": 64.5}, ("hidden_size = 64.5", "not an integer")),
    ({"num_hidden_layers": True}, ("num_hidden_layers = True", "not an integer")),
    ({"num_key_value_heads": "2"}, ("num_key_value_heads = '2'", "not an integer")),
    ({"max_position_embeddings": [4096]}, ("max_position_embeddings = [4096]", "not an integer")),
    ({"vocab_size": None}, ("lacks 'vocab_size'",)),
    ({"rms_norm_eps": "small"}, ("rms_norm_eps = 'small'", "not a finite number")),
    ({"rope_theta": float("inf")}, ("rope_theta = inf", "not a finite number")),
    ({"rope_scaling": "x"}, ("rope_scaling = 'x'", "object or null")),
    ({"rope_scaling": [1]}, ("rope_scaling = [1]", "object or null")),
    ({"rope_parameters": 5}, ("rope_parameters = 5", "object or null")),
    ({"rope_scaling": {"rope_type": "llama3", "factor": "8", "low_freq_factor": 1, "high_freq_factor": 4,
                       "original_max_position_embeddings": 8192}}, ("factor = '8'", "not a finite number")),
]


def test_hf_config_refused_by_plan_and_valid_one_read(capsys, tmp_path: Path):
    f = tmp_path / "config.json"
    f.write_text(json.dumps({**HF, "hidden_size": "big"}))
    refused(capsys, ["--model", str(f), "--gpu", "cpu", "--seq-len", "128", "--global-batch", "8K"],
            "--model", "hidden_size = 'big'", "not an integer")
    cfg = model_config_from_hf({**HF, "hidden_size": 64.0, "rope_scaling": None}, "m")  # a whole float is a whole
    assert cfg.hidden == 64 and isinstance(cfg.hidden, int) and cfg.rope_scaling == {}


GPT2 = {"architectures": ["GPT2LMHeadModel"], "n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 300}
NEOX = {"architectures": ["GPTNeoXForCausalLM"], "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
        "intermediate_size": 256, "vocab_size": 300}
GELU_BAD = [
    (GPT2, {"n_embd": "big"}, ("n_embd = 'big'", "not an integer")),
    (GPT2, {"n_embd": 64.5}, ("n_embd = 64.5", "not an integer")),
    (GPT2, {"n_layer": True}, ("n_layer = True", "not an integer")),
    (GPT2, {"n_inner": float("nan")}, ("n_inner = nan", "not an integer")),
    (GPT2, {"n_positions": float("inf")}, ("n_positions = inf", "not an integer")),
    (NEOX, {"tie_word_embeddings": "no"}, ("tie_word_embeddings = 'no'", "not a boolean")),
    (NEOX, {"max_position_embeddings": "2048"}, ("max_position_embeddings = '2048'", "not an integer")),
    (NEOX, {"hidden_size": 0}, ("GPTNeoXForCausalLM", "hidden = 0", ">= 1")),
    (NEOX, {"vocab_size": None}, ("lacks 'vocab_size'",)),
]


HF_CONFIG_BAD = [(HF, change, said) for change, said in HF_BAD] + GELU_BAD


@pytest.mark.parametrize(("base", "change", "said"), HF_CONFIG_BAD,
                         ids=[f"{(b.get('architectures') or ['llama'])[0]}-{next(iter(c))}-{i}"
                              for i, (b, c, _) in enumerate(HF_CONFIG_BAD)])
def test_hf_config_value_refused(base: dict, change: dict, said: tuple[str, ...]):
    """A Hugging Face config read as `fivefold plan --model config.json` reads it (GPT-2 and GPT-NeoX by the GELU
    shapes' reader, the rest by Llama's), each value checked by `models.hf_config.check_hf_values`: a value of the
    wrong kind is named, not truncated (64.5), read as 1 (true), as true ("no") or a traceback ("big", nan, inf)."""
    from fivefold.planner.shapes import gelu_shape_from_hf

    config = {**base, **change}
    with pytest.raises(ConfigError) as e:
        gelu_shape_from_hf(config, "m") or model_config_from_hf(config, "m")
    for text in said:
        assert text in str(e.value), str(e.value)


def test_gelu_hf_config_refused_by_plan_and_valid_ones_read(capsys, tmp_path: Path):
    from fivefold.planner.shapes import gelu_shape_from_hf

    f = tmp_path / "config.json"
    f.write_text(json.dumps({**GPT2, "n_embd": "big"}))
    refused(capsys, ["--model", str(f), "--gpu", "cpu", "--seq-len", "128", "--global-batch", "8K"],
            "--model", "n_embd = 'big'", "not an integer")
    gpt2 = gelu_shape_from_hf({**GPT2, "n_inner": None, "n_embd": 64.0}, "m")  # null: the default; 64.0 is whole
    assert (gpt2.hidden, gpt2.ffn, gpt2.max_seq_len, gpt2.tied_embeddings) == (64, 256, 2048, True)
    neox = gelu_shape_from_hf({**NEOX, "tie_word_embeddings": True, "max_position_embeddings": 4096}, "m")
    assert (neox.ffn, neox.max_seq_len, neox.tied_embeddings, neox.mlp) == (256, 4096, True, "gelu")


FRAMEWORK_BAD = [
    ("name = 5", ("[framework] name = 5", "non-empty string")),
    ('base = ["x"]', ("[framework] base = ['x']", "non-empty string")),
    ("param_bytes = nan", ("[framework] param_bytes = nan", "finite")),
    ("logits_bytes = inf", ("[framework] logits_bytes = inf", "finite")),
    ("param_bytes = 2.5", ("[framework] param_bytes = 2.5", "whole number")),
    ("param_bytes = 0", ("[framework] param_bytes = 0", ">= 1")),
    ("dp_bucket_mib = -1.0", ("[framework] dp_bucket_mib = -1.0", ">= 0")),
    ("usable_memory_fraction = 1.5", ("[framework] usable_memory_fraction = 1.5", "(0, 1]")),
    ("usable_memory_fraction = 0", ("[framework] usable_memory_fraction = 0.0", "(0, 1]")),
    ("tp_overlap = 2.0", ("[framework] tp_overlap = 2.0", "[0, 1]")),
    ("activation_scale = -1.0", ("[framework] activation_scale = -1.0", "> 0")),
    ('compute_dtype = "fp16"', ("[framework] compute_dtype = 'fp16'", "bf16, fp32")),
    ("hsdp = 1", ("[framework] hsdp = 1", "type of its default")),
    ('logits_bytes = "10"', ("[framework] logits_bytes = '10'", "type of its default")),
    ("bogus = 1", ("[framework] field 'bogus' is not known",)),
]


@pytest.mark.parametrize(("body", "said"), FRAMEWORK_BAD, ids=[b.split("=")[0].strip() + str(i)
                                                               for i, (b, _) in enumerate(FRAMEWORK_BAD)])
def test_framework_table_field_refused(capsys, tmp_path: Path, body: str, said: tuple[str, ...]):
    """A profile's [framework] fields are checked as the hardware fields are (`hardware.checked_number`): known,
    of their default's type, finite, whole where the default is, and within their range, in one line naming the
    file, the field and the value."""
    from fivefold.planner.profile import framework_of

    f = tmp_path / "fw.toml"
    f.write_text(f'base = "h100"\n[framework]\n{body}\n')
    with pytest.raises(ConfigError) as e:
        framework_of(f)
    for text in (f"--hardware '{f}'", *said):
        assert text in str(e.value), str(e.value)
    refused(capsys, [*TINY, "--hardware", str(f)], *said)


def test_framework_table_valid_fields_still_read(tmp_path: Path):
    from fivefold.planner.profile import all_frameworks, framework_of

    assert {"fivefold", "nanotron", "torchtitan", "megatron", "deepspeed"} <= set(all_frameworks())  # packaged files
    f = tmp_path / "fw.toml"
    f.write_text('[framework]\nname = "mine"\nbase = "nanotron"\nkernels_per_layer = 19.0\nlogits_bytes = 4\n'
                 'tp_overlap = 1.0\nusable_memory_fraction = 1\ncompute_dtype = "fp32"\n')
    fw = framework_of(f)
    assert fw.name == "mine" and fw.kernels_per_layer == 19 and isinstance(fw.kernels_per_layer, int)
    assert fw.logits_bytes == 4.0 and fw.tp_overlap == 1.0 and fw.usable_memory_fraction == 1.0
    assert fw.compute_dtype == "fp32" and fw.stage_split == "params"  # the rest: nanotron's


# ---------------------------------------------------------------------------------------------
# 4. plan's flags

CLI_BAD = [
    ("global-batch huge", ["--model", "tiny", "--gpu", "cpu", "--global-batch", "4096G"],
     ("--global-batch", "'4096G'", "2^40")),
    ("global-batch sequences", ["--model", "tiny", "--gpu", "cpu", "--seq-len", "128", "--global-batch", "2G"],
     ("--global-batch", "16,777,216 sequences", "2^14")),
    ("global-batch nan", ["--model", "tiny", "--global-batch", "nan"], ("--global-batch", "'nan'")),
    ("train-tokens text", [*TINY, "--write-config", "w.toml", "--train-tokens", "garbage"],
     ("--train-tokens", "'garbage'")),
    ("train-tokens zero", [*TINY, "--write-config", "w.toml", "--train-tokens", "0"], ("--train-tokens", "'0'")),
    ("schedules", [*TINY, "--schedules", "1f1b,nosuch"], ("--schedules", "'nosuch'", "1f1b")),
    ("gpu empty", ["--model", "tiny", "--gpu", ""], ("--gpu ''", "empty")),
    ("layout empty", [*TINY, "--layout", ""], ("--layout ''", "empty")),
    ("write-config empty", [*TINY, "--write-config", ""], ("--write-config ''", "empty")),
    ("hardware empty", [*TINY, "--hardware", ""], ("--hardware ''", "empty")),
    ("png empty", ["scaling", *TINY, "--strong", "--nodes", "1,2", "--png", ""], ("--png ''", "empty")),
    ("fix empty", [*TINY, "--fix", ""], ("--fix ''", "empty")),
    ("validate data empty", ["validate", "--data", ""], ("--data ''", "empty")),
    ("shape empty item", ["--model", "layers=2,,hidden=64"], ("--model", "empty item")),
    ("shape duplicate", ["--model", "layers=2,hidden=64,layers=3"], ("layers twice", "layers=2", "layers=3")),
    ("shape tied", ["--model", "layers=2,hidden=64,heads=4,ffn=128,vocab=300,tied=maybe"],
     ("tied = 'maybe'", "true or false")),
    ("shape partial", ["--model", "layers=2,hidden=64"], ("lacks heads, ffn, vocab",)),
    ("layout mbs twice", [*TINY, "--layout", "dp=1,mbs=1,micro_batch_size=2"],
     ("micro_batch_size twice", "mbs=1", "micro_batch_size=2")),
    ("layout dp twice", [*TINY, "--layout", "dp=1,dp=2"], ("dp twice", "dp=1", "dp=2")),
    ("layout empty item", [*TINY, "--layout", "dp=1,,tp=1"], ("--layout", "empty item")),
    ("png extension", ["scaling", *TINY, "--strong", "--nodes", "1,2", "--png", "plot.txt"],
     ("--png 'plot.txt'", ".png")),
    ("png directory", ["scaling", *TINY, "--strong", "--nodes", "1,2", "--png", "."], ("--png '.'", "directory")),
    ("weak batch grows too far", ["scaling", "--model", "tiny", "--gpu", "cpu", "--seq-len", "128", "--global-batch",
                                  "512K", "--weak", "--nodes", "1,8"], ("--weak", "32,768", "16,384")),
    ("scaling without weak or strong", ["scaling", *TINY, "--nodes", "1,2"],
     ("plan scaling needs exactly one of --weak", "or --strong")),
    ("scaling with weak and strong", ["scaling", *TINY, "--weak", "--strong", "--nodes", "1,2"],
     ("plan scaling needs exactly one of --weak",)),
    ("scaling layout that does not divide", ["scaling", *TINY, "--strong", "--nodes", "1,2", "--layout", "tp=3"],
     ("--layout tp x pp x cp = 3 does not divide",)),
    ("scaling layout key", ["scaling", *TINY, "--strong", "--nodes", "1,2", "--layout", "nosuch=3"],
     ("--layout item 'nosuch=3'",)),
    ("nodes empty item", ["scaling", *TINY, "--strong", "--nodes", "1,,2"], ("--nodes '1,,2'", "empty item")),
    ("batch below a sequence", ["--model", "tiny", "--gpu", "cpu", "--global-batch", "100"],
     ("--global-batch = 100", "4096 tokens (one sequence)")),
    ("write-config directory", [*TINY, "--write-config", "."], ("--write-config '.'", "directory")),
    ("fit out directory", ["validate", "--fit", "--data", "runs.csv", "--out", "."], ("--out '.'", "directory")),
    ("out without fit", ["validate", "--data", "runs.csv", "--out", "x.toml"], ("--out 'x.toml'", "--fit")),
    # an option that the mode given does not read is refused, not silently ignored (`cli.plan._check_applies`)
    ("png without scaling", [*TINY, "--png", "x.png"],
     ("--png 'x.png' applies to `fivefold plan scaling` only", "the search (`fivefold plan`) ignores it")),
    ("weak without scaling", [*TINY, "--weak"], ("--weak applies to `fivefold plan scaling` only",)),
    ("strong under validate", ["validate", "--strong"], ("--strong applies to `fivefold plan scaling` only",
                                                         "`fivefold plan validate` ignores it")),
    ("fit outside validate", [*TINY, "--fit"], ("--fit applies to `fivefold plan validate` only",)),
    ("per-row outside validate", ["scaling", *TINY, "--strong", "--nodes", "1,2", "--per-row"],
     ("--per-row applies to `fivefold plan validate` only", "`fivefold plan scaling` ignores it")),
    ("results outside validate", [*TINY, "--results", "r.db"],
     ("--results 'r.db' applies to `fivefold plan validate`",)),
    ("profile outside validate", [*TINY, "--profile", "p.toml"], ("--profile 'p.toml' applies to",)),
    ("out outside validate", [*TINY, "--out", "o.toml"], ("--out 'o.toml' applies to `fivefold plan validate`",)),
    ("fit-fields outside validate", [*TINY, "--fit-fields", "matmul_efficiency"], ("--fit-fields",)),
    ("measure-steps without measure", [*TINY, "--measure-steps", "5"],
     ("--measure-steps 5 sets the steps", "add --measure")),
    ("train-tokens without write-config", [*TINY, "--train-tokens", "40G"],
     ("--train-tokens '40G' sets the token budget", "add --write-config")),
    ("explain with json", [*TINY, "--explain", "--json"], ("--explain", "--json prints no table")),
    ("explain with layout", [*TINY, "--layout", "dp=1,mbs=2", "--explain"],
     ("--explain applies to the search (`fivefold plan`) only", "`fivefold plan --layout` ignores it")),
    ("zero with layout", [*TINY, "--layout", "dp=1,mbs=2", "--zero", "1"],
     ("--zero '1' applies to the search (`fivefold plan`) and `fivefold plan scaling` only",)),
    ("rank with layout", [*TINY, "--layout", "dp=1,mbs=2", "--rank", "p90"], ("--rank 'p90'", "--layout` ignores")),
    ("write-config in scaling", ["scaling", *TINY, "--strong", "--nodes", "1,2", "--write-config", "w.toml"],
     ("--write-config 'w.toml' applies to", "`fivefold plan scaling` ignores it")),
    ("measure in scaling", ["scaling", *TINY, "--strong", "--nodes", "1,2", "--measure"], ("--measure applies to",)),
    ("mfu-convention in scaling", ["scaling", *TINY, "--strong", "--nodes", "1,2", "--mfu-convention", "playbook"],
     ("--mfu-convention 'playbook' applies to",)),
    ("model under validate", ["validate", "--model", "tiny"], ("--model 'tiny' applies to", "validate` ignores it")),
    ("doc-len under validate", ["validate", "--doc-len", "512"], ("--doc-len '512' applies to",)),
    ("hardware under validate without results", ["validate", "--hardware", "hw.toml"],
     ("--hardware 'hw.toml' goes with --results", "--profile")),
    # --results scores a sweep's store: the CSV's fitting flags would be silently ignored
    ("results with profile", ["validate", "--results", "s.db", "--profile", "p.toml"], ("--profile", "drop them")),
    ("results with out and fit-fields", ["validate", "--results", "s.db", "--out", "f.toml", "--fit-fields",
                                         "matmul_efficiency"], ("--out, --fit-fields", "does not combine")),
    # the layout's degrees against the cluster first: the batch's suggestions assume them
    ("layout not the cluster", ["--model", "tiny", "--seq-len", "128", "--global-batch", "4096", "--layout", "dp=3"],
     ("dp x tp x pp x cp = 3 x 1 x 1 x 1 = 3", "the cluster has 8 GPUs")),
    ("batch beyond the bound and not whole", ["--model", "tiny", "--seq-len", "128", "--global-batch",
                                              "999999999999"], ("at most 16,384",)),
    # a value that starts with '-' and is not a plain number reaches the option's own check
    ("negative node list", ["scaling", *TINY, "--strong", "--nodes", "-1,2"], ("--nodes '-1,2'", ">= 1")),
]


@pytest.mark.parametrize(("argv", "said"), [c[1:] for c in CLI_BAD], ids=[c[0] for c in CLI_BAD])
def test_plan_flag_refused(capsys, tmp_path: Path, monkeypatch, argv: list[str], said: tuple[str, ...]):
    monkeypatch.chdir(tmp_path)
    start = time.monotonic()
    line = refused(capsys, argv, *said)
    assert time.monotonic() - start < 10  # refused before the search (4096G once hung in the divisors)
    assert "batches: 0 " not in line


def test_plan_options_of_each_mode_still_combine_as_documented(capsys, tmp_path: Path, monkeypatch):
    """The combinations the docs show: scaling with --layout and its own options, the search with --write-config,
    --train-tokens and --explain, --layout with the options it reads (--measure-steps only with --measure)."""
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "scaling", *TINY, "--weak", "--nodes", "1,2", "--layout", "dp=1,mbs=1", "--json",
                 "--rank", "p90"]) == 0
    assert main(["plan", *TINY, "--top", "2", "--write-config", "best.toml", "--train-tokens", "1M", "--explain",
                 "--rank", "p90", "--fix", "tp=1"]) == 0
    assert main(["plan", *TINY, "--layout", "dp=1,mbs=1", "--mfu-convention", "playbook", "--features", "compile",
                 "--json"]) == 0
    capsys.readouterr()


def test_divisors_are_quick_and_right():
    assert divisors(1) == [1] and divisors(36) == [1, 2, 3, 4, 6, 9, 12, 18, 36] and divisors(49) == [1, 7, 49]
    start = time.monotonic()
    assert len(divisors(1 << 40)) == 41
    assert time.monotonic() - start < 1


def test_valid_shape_schedules_and_layout_still_work(capsys):
    rc = main(["plan", "--model", "layers=2,hidden=64,heads=4,ffn=128,vocab=300,tied=false", "--gpu", "cpu",
               "--seq-len", "128", "--global-batch", "8K", "--schedules", "1f1b,afab", "--top", "1"])
    assert rc == 0 and "custom" in capsys.readouterr().out
    rc = main(["plan", *TINY, "--layout", "dp=1,mbs=2,zero=0"])
    assert rc == 0 and "mbs2" in capsys.readouterr().out.replace(" ", "").replace("=", "")


# ---------------------------------------------------------------------------------------------
# 5. files the planner writes: an existing file is kept as NAME.bak, checked before the work


def test_keep_previous(tmp_path: Path):
    target = tmp_path / "out.toml"
    assert keep_previous(target) is None
    target.write_text("first")
    assert keep_previous(target) == tmp_path / "out.toml.bak" and not target.exists()
    target.write_text("second")
    assert keep_previous(target) == tmp_path / "out.toml.bak2"  # an older backup is never replaced
    assert (tmp_path / "out.toml.bak").read_text() == "first" and (tmp_path / "out.toml.bak2").read_text() == "second"
    with pytest.raises(CliError, match="is a directory"):
        keep_previous(tmp_path)


def test_write_config_over_a_binary_file_keeps_it(capsys, tmp_path: Path):
    target = tmp_path / "best.toml"
    target.write_bytes(b"\xff\xfe\x00\x01bin")
    assert main(["plan", *TINY, "--write-config", str(target), "--top", "1"]) == 0
    assert f"kept the previous {target} as {target}.bak" in capsys.readouterr().out
    assert (tmp_path / "best.toml.bak").read_bytes() == b"\xff\xfe\x00\x01bin" and "[layout]" in target.read_text()


def test_scaling_png_and_fit_out_keep_an_existing_file(capsys, tmp_path: Path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "keep.png"
    png.write_text("keep")
    assert main(["plan", "scaling", *TINY, "--strong", "--nodes", "1,2", "--png", str(png)]) == 0
    assert f"kept the previous {png} as {png}.bak" in capsys.readouterr().out
    assert (tmp_path / "keep.png.bak").read_text() == "keep" and png.read_bytes()[:4] == b"\x89PNG"
    runs, out = tmp_path / "runs.csv", tmp_path / "fit.toml"
    runs.write_text(HEAD + ROW + "\n" + _row(mbs="2", grad_acc="4") + "\n")
    out.write_text("keep")
    assert main(["plan", "validate", "--data", str(runs), "--fit", "--fit-fields", "matmul_efficiency",
                 "--out", str(out), "--json"]) == 0
    assert f"kept the previous {out} as {out}.bak" in capsys.readouterr().out
    assert (tmp_path / "fit.toml.bak").read_text() == "keep" and "matmul_efficiency" in out.read_text()


def test_scaling_takes_dp_from_the_gpus_and_says_so(capsys):
    """`plan scaling --layout`: dp is the GPUs over tp x pp x cp at each size, so a given dp is neither checked
    against the batch (dp 3 does not divide 64 sequences, dp 4 and 8 do) nor kept, and the output says so."""
    assert main(["plan", "scaling", "--model", "tiny", "--seq-len", "128", "--global-batch", "8K", "--strong",
                 "--nodes", "1,2", "--layout", "dp=3,tp=2"]) == 0
    out = capsys.readouterr().out
    assert "dp4 tp2" in out and "dp8 tp2" in out and "--layout dp = 3 is not kept" in out
    # the line says what is kept instead (it ended at "... ZeRO and recompute are", the sentence cut short)
    assert "the micro-batch, ZeRO and recompute are kept\n" in out


def test_mfu_uses_the_peak_the_step_time_uses(tmp_path: Path, capsys):
    """A calibrated profile's `[ranks.2]` peak times a two-rank layout; its MFU divides by that peak, not by the
    profile's top-level one (which gave 125 % before): MFU = tokens/s x FLOPs per token / the rank's peak."""
    from fivefold.flops import training_flops_per_token
    from fivefold.presets import get_preset

    f = tmp_path / "r2.toml"
    f.write_text('base = "cpu"\n[ranks.2]\nfp32_tflops = 1\nthreads_per_rank = 1\n')
    assert main(["plan", "--hardware", str(f), "--model", "tiny", "--seq-len", "128", "--global-batch", "1024",
                 "--layout", "dp=2,mbs=4", "--gpus-per-node", "2", "--json"]) == 0
    e = json.loads(capsys.readouterr().out)
    flops = training_flops_per_token(get_preset("tiny"), 128)
    assert e["mfu"] == pytest.approx(e["tokens_per_s_per_device"] * flops / 1e12, rel=1e-6) and e["mfu"] < 1


def test_gpus_per_node_zero_is_refused_not_read_as_the_default(capsys):
    with pytest.raises(SystemExit) as refused_:  # argparse's refusal, in one line
        main(["plan", *TINY, "--gpus-per-node", "0"])
    err = capsys.readouterr().err
    assert refused_.value.code == 2 and err.count("\n") == 1
    assert "argument --gpus-per-node: 0 is not between 1 and 1,024" in err


def test_calibrate_refuses_an_empty_or_repeated_model(capsys):
    for value in ("tiny,,", "tiny,tiny", ","):
        assert main(["calibrate", "--device", "cpu", "--model", value, "--out", "never.toml"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "has an empty or repeated item" in err
