"""`fivefold train --model.attn_mask document` end to end on a prepared jsonl of a few hundred short documents:
the losses differ from the causal run's (documents no longer see each other), one process and `--nproc 2` under
cp2 and tp2 log the same losses (1e-4 relative, every step), and data without document boundaries is refused in
one line before any work."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fivefold.cli import main
from fivefold.data import prepare_dataset

SRC = Path(__file__).resolve().parents[1] / "src"
WORDS = ("the king queen lord castle sword river storm night morning bread wine horse field letter ring crown "
         "battle peace grief laughter song ship sea wind fire stone gold").split()


@pytest.fixture(scope="module")
def documents(tmp_path_factory) -> Path:
    """300 documents of 3 to 30 words, tokenized with a 320-token BPE vocabulary."""
    root = tmp_path_factory.mktemp("docs")
    rng = random.Random(5)
    lines = [json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 30)))})
             for _ in range(300)]
    (root / "docs.jsonl").write_text("\n".join(lines) + "\n")
    return prepare_dataset([root / "docs.jsonl"], root / "data", vocab_size=320, val_fraction=0.1)


def train_args(data: Path, run_dir: Path, *extra: str) -> list[str]:
    return ["train", "--data", str(data), "--max-steps", "20", "--run-dir", str(run_dir),
            "--model.n_layers", "2", "--model.hidden", "64", "--model.n_heads", "4", "--model.n_kv_heads", "2",
            "--model.ffn", "128", "--model.vocab_size", "320", "--train.seq_len", "64", "--train.global_batch_size",
            "4", "--train.warmup_steps", "2", "--train.lr", "3e-3", "--train.dtype", "fp32", "--train.device", "cpu",
            "--train.eval_every", "0", "--train.eval_batches", "1", "--train.checkpoint_every", "0",
            "--train.threads", "1", "--log.log_every", "1", "--log.progress", "none", *extra]


def logged_losses(run_dir: Path) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r]


def test_document_mask_trains_and_differs_from_causal(documents, tmp_path):
    assert main(train_args(documents, tmp_path / "doc", "--model.attn_mask", "document")) == 0
    assert main(train_args(documents, tmp_path / "causal")) == 0
    doc, causal = logged_losses(tmp_path / "doc"), logged_losses(tmp_path / "causal")
    assert len(doc) == len(causal) == 20 and doc[-1] < doc[0]
    # step 1 (the same weights): the masks alone differ; later the runs drift apart
    assert abs(doc[0] - causal[0]) > 1e-4 * causal[0]
    assert max(abs(a - b) / b for a, b in zip(doc, causal, strict=True)) > 1e-2


def test_first_logged_loss_is_the_mean_over_each_document_alone(documents, tmp_path):
    """The loop's loss convention against the independent reference: step 1's logged loss (the initial weights)
    equals the mean, over the trained targets, of each document piece of the first batch run alone."""
    from tests.test_document_mask import reference

    from fivefold.config import build_config
    from fivefold.data import BatchSampler, TokenDataset

    args = train_args(documents, tmp_path / "run", "--model.attn_mask", "document", "--train.global_batch_size", "2")
    args[args.index("--max-steps") + 1] = "1"
    assert main(args) == 0
    cfg = build_config(tmp_path / "run" / "config.toml")
    data = TokenDataset(documents, "train")
    inputs, targets = BatchSampler(data, cfg.train.seq_len, cfg.train.global_batch_size, cfg.train.seed).global_batch(0)
    losses, count, _ = reference(cfg, inputs, targets, data.eos_id)
    assert count < targets.numel()  # the EOS inputs' predictions are left out
    expected = losses.sum().item() / count
    assert abs(logged_losses(tmp_path / "run")[0] - expected) <= 1e-5 * expected


def test_the_last_finite_loss_is_the_logged_mean_over_the_trained_targets(documents, tmp_path):
    """The loss kept for a non-finite stop and the summary is the logged one: both are divided by the trained
    targets (not by every token of the batch)."""
    from fivefold.config import build_config
    from fivefold.train.loop import train

    args = train_args(documents, tmp_path / "run", "--model.attn_mask", "document")
    overrides = {flag[2:]: value for flag, value in zip(args[1::2], args[2::2], strict=True)
                 if flag.startswith("--") and "." in flag}
    cfg = build_config(None, {**overrides, "data.path": str(documents), "train.max_steps": "3",
                              "run_dir": str(tmp_path / "run")})
    result = train(cfg)
    step, loss = result.last_finite_loss
    assert step == 3 and abs(loss - result.losses[-1]) <= 1e-6 * result.losses[-1]


def test_the_trained_targets_of_a_step_are_read_from_the_data(documents):
    """Every rank knows the step's trained count without a collective: the sampler's count equals the masked
    targets of the global batch, and their sum over the data-parallel ranks' rows."""
    from fivefold.data import BatchSampler, TokenDataset
    from fivefold.models.masking import mask_document_targets

    data = TokenDataset(documents, "train")
    sampler = BatchSampler(data, 64, 6, seed=1)
    for step in range(3):
        want = int((mask_document_targets(*sampler.global_batch(step), data.eos_id) != -100).sum())
        assert want < 6 * 64  # the batch holds boundaries
        ranks = [sampler.step_batch(step, r, 3, data.eos_id) for r in range(3)]
        for r, (inputs, targets, trained) in enumerate(ranks):
            assert trained == want
            assert all(torch.equal(a, b) for a, b in zip((inputs, targets), sampler.rank_batch(step, r, 3),
                                                         strict=True))
        assert sum(int((mask_document_targets(i, t, data.eos_id) != -100).sum()) for i, t, _ in ranks) == want
        assert sampler.step_batch(step, 1, 3)[2] == 6 * 64


def test_data_without_boundaries_is_refused_before_any_work(documents, tmp_path, capsys):
    index = json.loads((documents / "index.json").read_text())
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in documents.iterdir():
        (bare / f.name).symlink_to(f)
    (bare / "index.json").unlink()
    (bare / "index.json").write_text(json.dumps({k: v for k, v in index.items() if k != "eos_id"}))
    assert main(train_args(bare, tmp_path / "run", "--model.attn_mask", "document")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.attn_mask = 'document' needs document boundaries" in err[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_cp2_tp2_and_dp2_log_the_losses_of_one_process(documents, tmp_path):
    assert main(train_args(documents, tmp_path / "one", "--model.attn_mask", "document")) == 0
    one = logged_losses(tmp_path / "one")
    for name, layout in (("cp", ["--layout.cp", "2"]), ("tp", ["--layout.tp", "2"]), ("dp", ["--layout.dp", "2"])):
        cmd = [sys.executable, "-m", "fivefold", *train_args(documents, tmp_path / name, "--model.attn_mask",
                                                             "document", "--nproc", "2", *layout)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                              env={**os.environ, "PYTHONPATH": str(SRC)})
        assert done.returncode == 0, done.stderr[-3000:]
        two = logged_losses(tmp_path / name)
        assert len(two) == len(one) == 20
        for step, (a, b) in enumerate(zip(two, one, strict=True), 1):
            assert abs(a - b) <= 1e-4 * b, f"{name}2, step {step}: {a} vs one process {b}"


def test_bench_refuses_document_masking_on_synthetic_tokens(capsys):
    assert main(["bench", "--model", "tiny", "--seq-len", "64", "--steps", "1", "--model.attn_mask", "document"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.attn_mask = 'document' needs document boundaries" in err[0]
