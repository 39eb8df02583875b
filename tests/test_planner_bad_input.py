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
    ("matmul_efficiency = 1e308", ("matmul_efficiency", "1e+308", "(0, 1]")),
    ("comm_overlap = 1.5", ("comm_overlap", "1.5", "[0, 1]")),
    ("stall_hazard_per_node = 1.0", ("stall_hazard_per_node", "1.0", "must be below 1")),
    ("busbw_gbps = {x = 100}", ("busbw_gbps key 'x'", "integer")),
    ("busbw_gbps = {0 = 100}", ("busbw_gbps key '0'", "integer >= 1")),
    ("busbw_gbps = {8 = 0}", ("busbw_gbps[8] = 0.0", "> 0")),
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
    refused(capsys, ["validate", "--profile", str(f), "--data", str(runs)], *said)


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


@pytest.mark.parametrize(("change", "said"), HF_BAD, ids=[next(iter(c)) + str(i) for i, (c, _) in enumerate(HF_BAD)])
def test_hf_config_value_refused(change: dict, said: tuple[str, ...]):
    with pytest.raises(ConfigError) as e:
        model_config_from_hf({**HF, **change}, "m")
    for text in said:
        assert text in str(e.value), str(e.value)


def test_hf_config_refused_by_plan_and_valid_one_read(capsys, tmp_path: Path):
    f = tmp_path / "config.json"
    f.write_text(json.dumps({**HF, "hidden_size": "big"}))
    refused(capsys, ["--model", str(f), "--gpu", "cpu", "--seq-len", "128", "--global-batch", "8K"],
            "--model", "hidden_size = 'big'", "not an integer")
    cfg = model_config_from_hf({**HF, "hidden_size": 64.0, "rope_scaling": None}, "m")  # a whole float is a whole
    assert cfg.hidden == 64 and isinstance(cfg.hidden, int) and cfg.rope_scaling == {}


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
    ("nodes empty item", ["scaling", *TINY, "--strong", "--nodes", "1,,2"], ("--nodes '1,,2'", "empty item")),
    ("batch below a sequence", ["--model", "tiny", "--gpu", "cpu", "--global-batch", "100"],
     ("--global-batch = 100", "4096 tokens (one sequence)")),
    ("write-config directory", [*TINY, "--write-config", "."], ("--write-config '.'", "directory")),
    ("fit out directory", ["validate", "--fit", "--data", "runs.csv", "--out", "."], ("--out '.'", "directory")),
    ("out without fit", ["validate", "--data", "runs.csv", "--out", "x.toml"], ("--out 'x.toml'", "--fit")),
]


@pytest.mark.parametrize(("argv", "said"), [c[1:] for c in CLI_BAD], ids=[c[0] for c in CLI_BAD])
def test_plan_flag_refused(capsys, tmp_path: Path, monkeypatch, argv: list[str], said: tuple[str, ...]):
    monkeypatch.chdir(tmp_path)
    start = time.monotonic()
    line = refused(capsys, argv, *said)
    assert time.monotonic() - start < 10  # refused before the search (4096G once hung in the divisors)
    assert "batches: 0 " not in line


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
