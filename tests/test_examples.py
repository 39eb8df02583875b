"""The example configs of real runs: each loads, validates (`fivefold train --config FILE --dry-run`) and fits by
the planner, its prediction is the one printed in docs/multi-node.md; `fivefold plan --write-config` writes the
same kind of file (published hyperparameters, a data path to fill in, compile on accelerators, the launch line);
the SLURM script's time, partition, account and set-up file."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from fivefold.cli import main
from fivefold.config import build_config
from fivefold.flops import count_params
from fivefold.planner.layout import Layout
from fivefold.presets import get_preset
from fivefold.train.recipes import DATA_PLACEHOLDER, published_recipe, warmup_steps

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted(p for p in (ROOT / "examples").glob("*.toml") if not p.name.startswith("sweep-"))
DOCS = (ROOT / "docs" / "multi-node.md").read_text()


def test_the_real_run_examples_are_there():
    names = {p.stem for p in EXAMPLES}
    assert {"llama3.1-8b-1x8-h100", "llama3.1-70b-4x8-h100", "olmoe-1b-7b-2x8-h100"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_config_validates_fits_and_its_prediction_is_in_the_docs(path, capsys):
    cfg = build_config(path)
    cfg.validate()
    t = cfg.train
    recipe = published_recipe(count_params(cfg.model), cfg.model.is_moe)
    assert (t.lr, t.min_lr_ratio, t.lr_schedule, t.weight_decay, t.beta2) == (
        recipe.lr, recipe.min_lr_ratio, "cosine", recipe.weight_decay, recipe.beta2)
    assert t.warmup_steps == warmup_steps(recipe, t.global_batch_size * t.seq_len, t.max_steps)
    assert t.global_batch_size * t.seq_len == 4 * 2**20  # 4M tokens per step, as Llama 2/3 and OLMoE
    assert cfg.data.path == DATA_PLACEHOLDER and t.compile and t.dtype == "bf16" and t.checkpoint_every > 0

    assert main(["train", "--config", str(path), "--dry-run", "--gpu", "h100"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("config OK") and "fits, peak" in out and "does not exist yet" in out
    header = path.read_text().splitlines()
    predicted = next(line for line in header if line.startswith("# predicted: ")).removeprefix("# predicted: ")
    peak, step, tokens, mfu = re.match(r"([\d.]+) GiB peak per device, step ([\d.]+) s, ([\d,]+) tokens/s per "
                                       r"device, MFU ([\d.]+) %", predicted).groups()
    assert f"peak {peak} GiB" in out and f"step {step} s" in out and f"{tokens} tokens/s per device" in out
    assert f"MFU {mfu} %" in out
    assert predicted in DOCS  # docs/multi-node.md prints the planner's prediction of every example
    layout = header[0].split(": ", 1)[1].rsplit(" on ", 1)[0]
    assert layout in DOCS
    launch = next(line for line in header if line.startswith("#   ")).removeprefix("#   ")
    assert launch in DOCS


def test_write_config_writes_a_real_run(tmp_path, capsys):
    out = tmp_path / "best.toml"
    assert main(["plan", "--model", "llama3-8b", "--gpu", "h100", "--nodes", "1", "--gpus-per-node", "8",
                 "--seq-len", "4096", "--global-batch", "1M", "--top", "3", "--write-config", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"fivefold train --config {out} --run-dir runs/llama-3.1-8b --nproc 8" in printed
    cfg = build_config(out)
    t = cfg.train
    assert (t.lr, t.lr_schedule, t.min_lr_ratio, t.eps) == (3e-4, "cosine", 0.1, 1e-5)  # Llama 2 7B
    assert t.warmup_steps == 2000 * 4  # 2000 steps of 4M tokens, in steps of 1M tokens
    assert t.max_steps == -(-20 * count_params(cfg.model) // 2**20)  # 20 tokens per parameter
    assert t.compile and cfg.data.path == DATA_PLACEHOLDER and t.checkpoint_every == 500
    assert f"#   fivefold train --config {out} --run-dir runs/llama-3.1-8b --nproc 8" in out.read_text()
    # the header predicts the run as configured (compiled), as `--dry-run` does
    predicted = next(line for line in out.read_text().splitlines() if line.startswith("# predicted: "))
    assert predicted.endswith("(with torch.compile, as configured)")
    # and picks the best layout of that compiled run, not of an eager one
    assert f"ranked with torch.compile, as {out} runs it" in printed
    assert main(["plan", "--model", "llama3-8b", "--gpu", "h100", "--nodes", "1", "--gpus-per-node", "8",
                 "--seq-len", "4096", "--global-batch", "1M", "--top", "1", "--features", "compile", "--json"]) == 0
    best = json.loads(capsys.readouterr().out)["candidates"][0]["layout"]
    written = out.read_text().splitlines()[0].split(": ", 1)[1].rsplit(" on ", 1)[0]
    assert written == Layout(**{k: v for k, v in best.items() if k not in ("mbs", "grad_acc")}).short()
    step = re.search(r"step ([\d.]+) s", predicted).group(1)
    assert main(["train", "--config", str(out), "--dry-run", "--gpu", "h100"]) == 0
    assert f"step {step} s" in capsys.readouterr().out
    # writing again over a file the user changed keeps theirs beside the new one
    edited = out.read_text().replace(DATA_PLACEHOLDER, "/data/mine")
    out.write_text(edited)
    assert main(["plan", "--model", "llama3-8b", "--gpu", "h100", "--nodes", "1", "--gpus-per-node", "8",
                 "--seq-len", "4096", "--global-batch", "1M", "--top", "1", "--write-config", str(out)]) == 0
    assert f"kept the previous {out} as {out}.bak" in capsys.readouterr().out
    assert (tmp_path / "best.toml.bak").read_text() == edited and DATA_PLACEHOLDER in out.read_text()
    # a token budget, and several nodes: the SLURM and torchrun lines; on a CPU profile: no compile
    out2 = tmp_path / "two.toml"
    assert main(["plan", "--model", "llama3-8b", "--nodes", "2", "--global-batch", "1M", "--top", "1",
                 "--write-config", str(out2), "--train-tokens", "10G"]) == 0
    printed = capsys.readouterr().out
    assert "--slurm train.sbatch --nodes 2 --nproc 8" in printed and "torchrun --nnodes 2" in printed
    assert build_config(out2).train.max_steps == 10 * 2**30 // 2**20
    out3 = tmp_path / "cpu.toml"
    assert main(["plan", "--model", "tiny", "--gpu", "cpu", "--gpus-per-node", "2", "--seq-len", "128",
                 "--global-batch", "4096", "--top", "1", "--write-config", str(out3)]) == 0
    assert not build_config(out3).train.compile and build_config(out3).train.lr == 6e-4


def test_write_config_keeps_a_small_models_budget_and_warms_up_within_it(tmp_path, capsys):
    """GPT-3 125M's warm-up (375M tokens) is 18x the whole 20-tokens-per-parameter budget of the tiny preset: the
    run keeps its budget and warms up over a tenth of it, instead of being stretched to the warm-up's length."""
    out = tmp_path / "tiny.toml"
    assert main(["plan", "--model", "tiny", "--gpu", "cpu", "--gpus-per-node", "2", "--seq-len", "128",
                 "--global-batch", "2048", "--write-config", str(out)]) == 0
    capsys.readouterr()
    t = build_config(out).train
    budget_steps = -(-20 * count_params(get_preset("tiny")) // (t.global_batch_size * t.seq_len))
    assert t.max_steps == budget_steps and t.warmup_steps == budget_steps // 10
    out = tmp_path / "tiny-long.toml"  # a budget long enough for the whole published warm-up: kept as published
    assert main(["plan", "--model", "tiny", "--gpu", "cpu", "--gpus-per-node", "2", "--seq-len", "128",
                 "--global-batch", "2048", "--train-tokens", "8G", "--write-config", str(out)]) == 0
    capsys.readouterr()
    t = build_config(out).train
    assert t.warmup_steps == round(375_000_000 / 2048) and t.max_steps == 8 * 2**30 // 2048


def test_slurm_script_takes_time_partition_account_and_setup(tmp_path, capsys):
    setup = tmp_path / "setup.sh"
    setup.write_text("module load cuda\nexport NCCL_DEBUG=WARN\n")
    script = tmp_path / "job.sh"
    assert main(["train", "--slurm", str(script), "--nodes", "2", "--nproc", "4", "--layout.dp", "8",
                 "--run-dir", "/shared/runs/x", "--time", "2-00:00:00", "--partition", "gpu", "--account", "proj",
                 "--setup", str(setup)]) == 0
    text = script.read_text()
    assert "#SBATCH --time=2-00:00:00" in text and "#SBATCH --partition=gpu" in text
    assert "#SBATCH --account=proj" in text
    assert text.index(f"source {setup}") < text.index("set -euo pipefail") < text.index("srun torchrun")
    # written again: the script that was there (perhaps edited) is kept as job.sh.bak, not lost
    script.write_text(text + "# my edit\n")
    assert main(["train", "--slurm", str(script), "--nodes", "2", "--nproc", "4", "--layout.dp", "8",
                 "--run-dir", "/shared/runs/x", "--time", "1:00:00"]) == 0
    assert (tmp_path / "job.sh.bak").read_text().endswith("# my edit\n") and "--time=1:00:00" in script.read_text()
    # the resuming script of a chain is written before the first job has started the run
    resume = tmp_path / "resume.sh"
    assert main(["train", "--slurm", str(resume), "--nodes", "2", "--nproc", "4", "--layout.dp", "8",
                 "--run-dir", str(tmp_path / "run"), "--resume"]) == 0
    assert f"--run-dir {tmp_path / 'run'} --resume" in resume.read_text()
    capsys.readouterr()
    assert main(["train", "--slurm", str(tmp_path / "b.sh"), "--nodes", "2", "--nproc", "4", "--layout.dp", "8",
                 "--time", "90 minutes"]) == 2
    assert "--time '90 minutes' is not a SLURM time limit; use HH:MM:SS" in capsys.readouterr().err
    for bad in ("99:99:99", "1:60:00", "1-24:00:00"):
        assert main(["train", "--slurm", str(tmp_path / "b.sh"), "--nodes", "2", "--nproc", "4", "--layout.dp", "8",
                     "--time", bad]) == 2
        assert f"--time '{bad}' is not a SLURM time limit" in capsys.readouterr().err
    assert main(["train", "--slurm", str(tmp_path / "b.sh"), "--nodes", "2", "--nproc", "4", "--layout.dp", "8",
                 "--setup", str(tmp_path / "nope.sh")]) == 2
    assert "--setup" in capsys.readouterr().err and not (tmp_path / "b.sh").exists()


def test_plan_validate_names_the_data_it_needs_and_where_it_comes_from(tmp_path, capsys):
    assert main(["plan", "validate", "--data", str(tmp_path / "runs.csv")]) == 2
    err = capsys.readouterr().err
    assert "playbook_benchmark_runs.csv" in err and "Ultra-Scale Playbook" in err and "--data FILE" in err
