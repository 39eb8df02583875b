"""What `fivefold sweep` refuses or says about a grid before any run starts: the counts `expand` computes with, a
device this machine lacks, more local CPU processes than its cores run, repeated axis values, fields a run does
not use, `--gpus-per-node` without `--slurm`; and the labels, which show every field the grid varies. All with
`--dry-run` or `expand` (nothing is trained)."""

from __future__ import annotations

import os
import re
import textwrap
from pathlib import Path

import pytest
import torch

from fivefold.cli import main
from fivefold.config import ConfigError
from fivefold.sweep.cli import make_row
from fivefold.sweep.grid import expand, load_grid
from fivefold.sweep.runner import Outcome

BASE = """
[model]
preset = "tiny"

[train]
seq_len = 32
global_batch_size = 8
device = "cpu"
"""


def grid_file(tmp_path: Path, text: str, name: str = "grid.toml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def with_field(section: str, line: str, body: str = BASE) -> str:
    """`body` with `line` (`NAME = VALUE`) in its [section] (added at the end when it has none), in place of the
    field's line there."""
    body = re.sub(rf"(?m)^{re.escape(line.split(' = ')[0])} = .*\n", "", body)
    if f"[{section}]\n" in body:
        return body.replace(f"[{section}]\n", f"[{section}]\n{line}\n", 1)
    return body + f"\n[{section}]\n{line}\n"


def sweep(tmp_path: Path, grid: Path, capsys: pytest.CaptureFixture, *flags: str) -> tuple[int, str, str]:
    """`fivefold sweep GRID --results tmp/r.db --dry-run FLAGS`: (exit status, stdout, stderr)."""
    code = main(["sweep", str(grid), "--results", str(tmp_path / "r.db"), *flags])
    out = capsys.readouterr()
    return code, out.out, out.err


def refused(code: int, out: str, err: str, tmp_path: Path, *words: str) -> str:
    """A refusal: exit 2, one line on stderr holding `words`, no traceback, nothing run, no store."""
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert "Traceback" not in err and "would run" not in out
    for word in words:
        assert word in lines[0], (word, lines[0])
    assert not (tmp_path / "r.db").exists()
    return lines[0]


# ---------------------------------------------------------------------------------------------
# S2: the counts that expand() divides and multiplies by


@pytest.mark.parametrize(("section", "field", "value", "shown", "low"), [
    ("layout", "tp", "[0, 1]", "0", 1),
    ("layout", "pp", "0", "0", 1),
    ("layout", "cp", "-2", "-2", 1),
    ("layout", "ep", "[1, 0]", "0", 1),
    ("layout", "dp", "0", "0", 1),
    ("layout", "vpp", "-1", "-1", 1),
    ("layout", "tp", "1.5", "1.5", 1),
    ("layout", "tp", "true", "True", 1),
    ("layout", "tp", '"2"', "'2'", 1),
    ("layout", "micro_batch_size", "-4", "-4", 0),
    ("train", "global_batch_size", "0", "0", 1),
    ("train", "seq_len", "[0, 64]", "0", 1),
])
def test_bad_counts_are_refused_when_the_grid_is_read(tmp_path, capsys, section, field, value, shown, low):
    grid = grid_file(tmp_path, "devices = 2\n" + with_field(section, f"{field} = {value}"))
    with pytest.raises(ConfigError) as e:
        load_grid(grid)
    assert str(e.value).startswith(f"grid {section}.{field} = {shown}") and f">= {low}" in str(e.value)
    refused(*sweep(tmp_path, grid, capsys, "--dry-run"), tmp_path, f"grid {section}.{field} = {shown}",
            f"must be an integer >= {low}")


def test_a_batch_smaller_than_dp_is_an_invalid_run_not_a_crash(tmp_path):
    # 64 devices fill dp = 64, which does not divide a batch of 8: the validator's refusal, a label and a row
    plans, _ = expand(load_grid(grid_file(tmp_path, "devices = 64\n" + BASE)))
    (plan,) = plans
    assert plan.cfg.layout.dp == 64 and plan.invalid is not None
    assert "train.global_batch_size = 8 is not divisible by layout.dp = 64" in plan.invalid
    assert "dp64" in plan.label and "mbs0 ga0" in plan.label  # 8 // 64 = 0 sequences per rank
    row = make_row(plan, "g", 5, 2, Outcome("invalid", None, plan.invalid, None, float("nan"), "", ""), None, None,
                   1)
    assert row["micro_batch_size"] == 0 and row["grad_accum_steps"] == 0


# ---------------------------------------------------------------------------------------------
# S5: a device this machine does not have


def _missing_accelerator() -> str:
    have = torch.accelerator.current_accelerator().type if torch.accelerator.is_available() else None
    return "xpu" if have == "cuda" else "cuda"


def test_a_device_missing_here_is_refused_before_anything_runs(tmp_path, capsys):
    missing = _missing_accelerator()
    grid = grid_file(tmp_path, "steps = 1\nwarmup = 0\ndevices = 1\n" + BASE.replace('"cpu"', f'"{missing}"'))
    for flags in (("--dry-run",), ()):
        line = refused(*sweep(tmp_path, grid, capsys, *flags), tmp_path, f"grid train.device = '{missing}'",
                       "--slurm")
        assert "no accelerator" in line or "accelerator is" in line
    assert not (tmp_path / "r-runs").exists()
    # a name PyTorch does not know is no device anywhere: no --slurm hint
    unknown = grid_file(tmp_path, BASE.replace('"cpu"', '"nosuchdevice"'), "unknown.toml")
    line = refused(*sweep(tmp_path, unknown, capsys, "--dry-run"), tmp_path, "grid train.device = 'nosuchdevice'",
                   "is not a device PyTorch knows")
    assert "--slurm" not in line
    # one [[grid]] table on the missing device is enough
    mixed = grid_file(tmp_path, BASE + f'\n[[grid]]\ndevices = 1\n\n[[grid]]\ndevices = 1\ntrain = {{ device = '
                                       f'"{missing}" }}\n', "mixed.toml")
    refused(*sweep(tmp_path, mixed, capsys, "--dry-run"), tmp_path, f"'{missing}'")
    # the CPU and auto are here; under --slurm the jobs run elsewhere, so the device is not checked here
    for device in ("cpu", "auto"):
        ok = grid_file(tmp_path, "devices = 1\n" + BASE.replace('"cpu"', f'"{device}"'), f"{device}.toml")
        code, out, _ = sweep(tmp_path, ok, capsys, "--dry-run")
        assert code == 0 and "would run" in out
    code, out, err = sweep(tmp_path, grid, capsys, "--slurm", str(tmp_path / "jobs"))
    assert code == 0 and "wrote 1 scripts" in out, err
    (job,) = (tmp_path / "jobs").glob("*/job.sh")
    assert "#SBATCH --gpus-per-node=1" in job.read_text()  # an accelerator job asks for its GPUs


def pretend_accelerators(monkeypatch: pytest.MonkeyPatch, kind: str, count: int) -> None:
    """This machine seen as having `count` accelerators of `kind` (what `torch.accelerator` reports), of a model
    the accelerator table does not know (the planner's default profile, no device query)."""
    from fivefold.planner import predict

    monkeypatch.setattr(predict, "device_hardware", lambda device: None)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device(kind))
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: count)


def test_more_processes_than_local_accelerators_are_refused_before_anything_runs(tmp_path, capsys, monkeypatch):
    """A local run starts one process per device: a run of the grid on more processes than this machine has
    accelerators is refused before any run starts (as a missing device is), naming the largest; --nproc-max skips
    it instead, and the CPU runs of the grid are not held to the accelerators' count."""
    kind = _missing_accelerator()  # a kind this machine lacks, so that nothing could start on it by mistake
    pretend_accelerators(monkeypatch, kind, 2)
    body = with_field("train", f'device = "{kind}"')
    grid = grid_file(tmp_path, "steps = 1\nwarmup = 0\ndevices = [1, 2, 4]\n" + body)
    for flags in (("--dry-run",), ()):
        line = refused(*sweep(tmp_path, grid, capsys, *flags), tmp_path, "1 run(s)", f"2 {kind} device(s)",
                       "dp4", f"train.device = '{kind}' on 4", "--nproc-max 2", "--slurm")
    assert line.startswith("fivefold sweep: error: 1 run(s) of the grid need more processes than")
    assert not (tmp_path / "r-runs").exists()
    # up to the count it would run; --nproc-max 2 skips (and lists) the run on 4
    code, out, err = sweep(tmp_path, grid_file(tmp_path, "devices = [1, 2]\n" + body, "two.toml"), capsys,
                           "--dry-run")
    assert code == 0 and "on 2 process(es)" in out, err
    code, out, err = sweep(tmp_path, grid, capsys, "--dry-run", "--nproc-max", "2")
    assert code == 0 and "needs 4 processes" in out and "on 2 process(es)" in out, err
    # one accelerator: every run above 1 is refused; the CPU's runs are held to its cores' bound only
    pretend_accelerators(monkeypatch, kind, 1)
    line = refused(*sweep(tmp_path, grid, capsys, "--dry-run"), tmp_path, "2 run(s)", f"1 {kind} device(s)")
    code, out, err = sweep(tmp_path, grid_file(tmp_path, "devices = [1, 2, 4]\n" + BASE, "cpu.toml"), capsys,
                           "--dry-run")
    assert code == 0 and "on 4 process(es)" in out, err


# ---------------------------------------------------------------------------------------------
# S13: more local CPU processes than the cores run


def test_more_cpu_processes_than_the_cores_run_need_nproc_max(tmp_path, capsys):
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    bound = max(4, 2 * cores)  # the documented rule: 2 processes per core, at least 4
    over = bound + 1
    batch = with_field("train", f"global_batch_size = {bound * over}")
    grid = grid_file(tmp_path, f"devices = [1, {bound}, {over}]\n" + batch)
    line = refused(*sweep(tmp_path, grid, capsys, "--dry-run"), tmp_path, "--nproc-max", f"{cores} cores",
                   f"at most {bound}", f"on {over}")
    assert line.count("run(s)") == 1 and line.startswith("fivefold sweep: error: 1 run(s)")
    refused(*sweep(tmp_path, grid, capsys), tmp_path, "--nproc-max")
    # --nproc-max says otherwise: runs above it skipped (and listed), or all of them run
    code, out, _ = sweep(tmp_path, grid, capsys, "--dry-run", "--nproc-max", str(bound))
    assert code == 0 and f"needs {over} processes" in out and f"on {bound} process(es)" in out
    code, out, _ = sweep(tmp_path, grid, capsys, "--dry-run", "--nproc-max", str(over))
    assert code == 0 and f"on {over} process(es)" in out
    # the bound itself is allowed
    at = grid_file(tmp_path, f"devices = {bound}\n" + with_field("train", f"global_batch_size = {bound}"), "at.toml")
    code, out, _ = sweep(tmp_path, at, capsys, "--dry-run")
    assert code == 0 and f"on {bound} process(es)" in out


# ---------------------------------------------------------------------------------------------
# S8: labels, repeated values, fields a run does not use


def test_every_field_the_grid_varies_is_in_the_label(tmp_path):
    grid = load_grid(grid_file(tmp_path, """
        devices = [1, 2]
        [model]
        preset = "tiny"
        n_layers = [1, 2]
        [layout]
        zero = [0, 1]
        fp32_grad_accum = [true, false]
        [train]
        seq_len = [32, 64]
        global_batch_size = 8
        lr = [1e-3, 1e-2]
        device = "cpu"
        dtype = ["fp32", "bf16"]
        """))
    plans, dropped = expand(grid)
    assert len(plans) == 2 ** 7 and not dropped  # 7 axes of 2 values: every combination a run of its own
    assert len({p.label for p in plans}) == len({p.key for p in plans}) == len(plans)
    for p in plans:
        c = p.cfg
        assert p.model == f"tiny n_layers={c.model.n_layers}"
        assert p.label.startswith(f"{p.model} | dp{c.layout.dp} tp1 z{c.layout.zero} ")
        for part in (f"seq_len={c.train.seq_len}", f"lr={c.train.lr}", f"dtype={c.train.dtype}",
                     f"fp32_grad_accum={c.layout.fp32_grad_accum}"):
            assert f" {part}" in p.label, (part, p.label)
        assert "global_batch_size" not in p.label and "device=" not in p.label  # fixed fields are not


def test_labels_tell_apart_what_differs_between_grid_tables(tmp_path):
    grid = load_grid(grid_file(tmp_path, BASE + """
        [[grid]]
        devices = 1
        train = { seq_len = 64 }

        [[grid]]
        devices = 1
        layout = { schedule = "afab" }
        """))
    plans, _ = expand(grid)
    labels = sorted(p.label for p in plans)
    assert len(plans) == 2 and labels[0] != labels[1]
    by_seq = {p.cfg.train.seq_len: p.label for p in plans}
    assert by_seq[64].endswith("seq_len=64 schedule=1f1b") and by_seq[32].endswith("seq_len=32 schedule=afab")
    # a preset axis under one model name: the preset is in the model label
    named = expand(load_grid(grid_file(tmp_path, BASE.replace('preset = "tiny"', 'preset = ["tiny", "tiny-moe"]\n'
                                                              'name = "m"'), "named.toml")))[0]
    assert sorted(p.model for p in named) == ["m preset=tiny", "m preset=tiny-moe"]


def test_seq_len_axis_gets_two_labels_on_the_command_line(tmp_path, capsys):
    grid = grid_file(tmp_path, BASE.replace("seq_len = 32", "seq_len = [64, 128]\nmax_steps = 1000"))
    code, out, err = sweep(tmp_path, grid, capsys, "--dry-run")
    would = [ln for ln in out.splitlines() if "would run" in ln]
    assert code == 0 and len(would) == 2
    assert any("seq_len=64 on" in ln for ln in would) and any("seq_len=128 on" in ln for ln in would)
    # a fixed field that the runs do not use: one note line, naming it
    (note,) = err.strip().splitlines()
    assert note.startswith("fivefold sweep: note: grid train.max_steps = 1000 is ignored")


@pytest.mark.parametrize(("field", "values"), [
    ("data.path", '["/nonexistent/a", "/nonexistent/b"]'),
    ("train.max_steps", "[10, 20]"),
    ("train.eval_every", "[1, 2]"),
    ("log.log_every", "[1, 5]"),
    ("log.peak_tflops", "[100.0, 200.0]"),
])
def test_a_field_runs_do_not_use_cannot_vary(tmp_path, capsys, field, values):
    section, name = field.split(".")
    body = with_field(section, f"{name} = {values}", with_field("train", "lr = [1e-3, 1e-2]"))
    grid = grid_file(tmp_path, "devices = 1\n" + body)
    with pytest.raises(ConfigError, match=f"^grid {field} = .* varies"):
        load_grid(grid)
    refused(*sweep(tmp_path, grid, capsys, "--dry-run"), tmp_path, f"grid {field} = ", "varies")


def test_fixed_unused_fields_are_noted_once_and_used_ones_not(tmp_path):
    grid = load_grid(grid_file(tmp_path, BASE + """
        [data]
        path = "/nonexistent/a"
        [log]
        log_every = 3
        peak_tflops = 100.0
        [[grid]]
        devices = 1
        [[grid]]
        devices = 2
        """))
    assert [n.split(" = ")[0] for n in grid.notes] == ["grid data.path", "grid log.log_every"]
    assert all("is ignored: " in n for n in grid.notes)
    plans, _ = expand(grid)
    assert len(plans) == 2  # what they ignore does not merge runs


@pytest.mark.parametrize(("field", "values", "value"), [
    ("layout.micro_batch_size", "[4, 4, 4]", "4"),
    ("train.lr", "[1e-3, 0.001]", "0.001"),
    ("layout.recompute", '["full", "none", "full"]', "'full'"),
])
def test_a_value_repeated_in_an_axis_is_refused(tmp_path, capsys, field, values, value):
    section, name = field.split(".")
    grid = grid_file(tmp_path, with_field(section, f"{name} = {values}"))
    with pytest.raises(ConfigError, match=f"^grid {field} = .* lists {value} more than once"):
        load_grid(grid)
    refused(*sweep(tmp_path, grid, capsys, "--dry-run"), tmp_path, f"grid {field}", "more than once")
    dup_devices = grid_file(tmp_path, "devices = [2, 2]\n" + BASE, "dev.toml")
    refused(*sweep(tmp_path, dup_devices, capsys, "--dry-run"), tmp_path, "grid devices = [2, 2]")


# ---------------------------------------------------------------------------------------------
# A document mask: every run of it would fail in fivefold bench, so the grid is refused when it is read


@pytest.mark.parametrize(("where", "body", "shown"), [
    ("fixed", with_field("model", 'attn_mask = "document"'), "grid model.attn_mask = 'document' cannot"),
    ("an axis", with_field("model", 'attn_mask = ["causal", "document"]'),
     "grid model.attn_mask = 'document' (in model.attn_mask = ['causal', 'document']) cannot"),
    ("a [[grid]] table", BASE + '\n[[grid]]\ndevices = 1\n\n[[grid]]\ndevices = 1\nmodel = { attn_mask = '
                                '"document" }\n', "grid model.attn_mask = 'document' cannot"),
])
def test_a_document_mask_is_refused_when_the_grid_is_read(tmp_path, capsys, where, body, shown):
    # the reference: fivefold bench, which each run is, refuses the mask when it starts
    assert main(["bench", "--model", "tiny", "--model.attn_mask", "document", "--steps", "1", "--warmup", "0",
                 "--train.device", "cpu"]) == 2
    assert "model.attn_mask = 'document'" in capsys.readouterr().err
    grid = grid_file(tmp_path, "steps = 2\nwarmup = 1\n" + body)
    with pytest.raises(ConfigError, match=re.escape(shown)):
        load_grid(grid)
    for flags in (("--dry-run",), ()):  # nothing runs, no store, no runs' folder
        refused(*sweep(tmp_path, grid, capsys, *flags), tmp_path, shown, "random tokens", "attn_mask = 'causal'")
    assert not (tmp_path / "r-runs").exists()
    # the causal mask alone sweeps as before
    causal = grid_file(tmp_path, "steps = 2\nwarmup = 1\n" + body.replace('"document"', '"causal"')
                       .replace('["causal", "causal"]', '"causal"'), "causal.toml")
    code, out, err = sweep(tmp_path, causal, capsys, "--dry-run")
    assert code == 0 and "would run" in out, err


# ---------------------------------------------------------------------------------------------
# S14.1: --gpus-per-node belongs to --slurm; a CPU job asks for no GPU


def test_gpus_per_node_needs_slurm(tmp_path, capsys):
    grid = grid_file(tmp_path, "devices = 1\n" + BASE)
    refused(*sweep(tmp_path, grid, capsys, "--dry-run", "--gpus-per-node", "4"), tmp_path, "--gpus-per-node 4",
            "--slurm")
    code, out, err = sweep(tmp_path, grid, capsys, "--slurm", str(tmp_path / "jobs"), "--gpus-per-node", "4")
    assert code == 0 and "wrote 1 scripts" in out, err
    (job,) = (tmp_path / "jobs").glob("*/job.sh")
    text = job.read_text()
    assert "#SBATCH --gpus-per-node" not in text and "--nproc-per-node 1 " in text
