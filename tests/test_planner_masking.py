"""`fivefold plan` prices the attention that runs: a document mask (`--doc-len N`, `--data DIR`) and a sliding window
(`--sliding-window N`) lower the attention's FLOPs and time; MFU counts the executed attention and the causal-equivalent
figure is reported beside it; bad values of the flags are refused in one line."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from fivefold.cli import main
from fivefold.data import TokenDataset, prepare_dataset
from fivefold.flops import DocumentLengths, active_matmul_params
from fivefold.planner.hardware import get_cluster
from fivefold.planner.layout import Layout
from fivefold.planner.profile import all_frameworks
from fivefold.planner.time import stage_times
from fivefold.presets import get_preset

MODEL, SEQ, LAYOUT = "llama-3.2-1b", 8192, "dp=8,micro_batch_size=4,zero=3,recompute=none"


def plan_json(capsys, *extra: str) -> dict:
    assert main(["plan", "--model", MODEL, "--seq-len", str(SEQ), "--global-batch", "1M", "--layout", LAYOUT,
                 "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def fixed_length_fraction(seq: int, length: int) -> float:
    """Documents of `length` tokens, windows of `seq` starting anywhere: a query at offset a into its document and
    position q sees min(a, q) + 1 keys; averaged over the offsets a (uniform over the document) and summed over q."""
    pairs = sum(min(a, q) + 1 for q in range(seq) for a in range(length)) / length
    return pairs / (seq * (seq + 1) / 2)


def executed_flops(cfg, seq: int, fraction: float) -> float:
    """6 x matmul parameters + causal attention's 6 L s H d scaled by the executed share."""
    return 6 * active_matmul_params(cfg) + 6 * cfg.n_layers * seq * cfg.n_heads * cfg.head_dim * fraction


def test_doc_len_lowers_attention_time_and_reports_both_mfus(capsys):
    causal, masked = plan_json(capsys), plan_json(capsys, "--doc-len", "1024")
    assert "attention" not in causal and "mfu_causal_equivalent" not in causal  # unmasked: the output as before
    fraction = fixed_length_fraction(SEQ, 1024)
    assert masked["attention_pairs_fraction"] == pytest.approx(fraction, rel=1e-12)
    assert masked["attention"]["pairs_fraction"] == pytest.approx(fraction, rel=1e-12)
    assert masked["attention"]["documents"] == {"source": "--doc-len 1024", "count": 1, "mean_tokens": 1024.0}
    assert masked["step_time_s"] < causal["step_time_s"] and masked["time_s"]["compute"] < causal["time_s"]["compute"]
    # MFU counts the executed attention; the causal-equivalent figure counts causal attention, at the same speed
    cfg = get_preset(MODEL)
    peak = masked["tokens_per_s_per_device"] / masked["mfu"]
    assert peak == pytest.approx(causal["tokens_per_s_per_device"] / causal["mfu"] * executed_flops(cfg, SEQ, 1)
                                 / executed_flops(cfg, SEQ, fraction), rel=1e-9)
    assert masked["mfu_causal_equivalent"] / masked["mfu"] == pytest.approx(
        executed_flops(cfg, SEQ, 1) / executed_flops(cfg, SEQ, fraction), rel=1e-9)


def test_masking_changes_the_attention_passes_only():
    # a stage's forward and input-gradient passes hold the attention; the weight-gradient pass none of it
    cfg = get_preset(MODEL)
    fw, hw = all_frameworks()["fivefold"], get_cluster("h100", None)
    lay = Layout(dp=8, micro_batch_size=4, zero=3, grad_accum_steps=4)
    base = stage_times(cfg, SEQ, lay, fw, hw)
    for masked, docs in ((dataclasses.replace(cfg, attn_mask="document"), DocumentLengths.of([1024])),
                         (dataclasses.replace(cfg, sliding_window=1024), None)):
        t = stage_times(masked, SEQ, lay, fw, hw, docs)
        assert t.f[0] < base.f[0] and t.b[0] < base.b[0] and t.w == base.w


def test_sliding_window_and_documents_combined(capsys):
    window = plan_json(capsys, "--sliding-window", "2048")
    band = sum(SEQ - j for j in range(2048)) / (SEQ * (SEQ + 1) / 2)
    assert window["attention_pairs_fraction"] == pytest.approx(band, rel=1e-12)
    assert window["attention"] | {"pairs_fraction": 0} == {
        "mask": "causal", "sliding_window": 2048, "pairs_per_sequence": band * SEQ * (SEQ + 1) / 2,
        "causal_pairs_per_sequence": SEQ * (SEQ + 1) // 2, "pairs_fraction": 0,
        "mfu_convention": window["attention"]["mfu_convention"]}
    both = plan_json(capsys, "--sliding-window", "256", "--doc-len", "1024")
    # documents of 1024 under a window of 256: a query at offset a sees min(a, q, 255) + 1 keys
    pairs = sum(min(a, q, 255) + 1 for q in range(SEQ) for a in range(1024)) / 1024
    assert both["attention_pairs_fraction"] == pytest.approx(pairs / (SEQ * (SEQ + 1) / 2), rel=1e-12)
    assert both["step_time_s"] < window["step_time_s"]


def test_data_histogram_prices_the_documents(tmp_path, capsys):
    texts = [" ".join(["w"] * n) for n in (10, 200, 3000, 50, 7000, 900)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    data = prepare_dataset([tmp_path / "docs.jsonl"], tmp_path / "data", vocab_size=260, val_fraction=0.0)
    train = json.loads((data / "index.json").read_text())["splits"]["train"]
    out = plan_json(capsys, "--data", str(data))
    # the documents' lengths read back from the token stream, priced by brute force over every start offset of a
    # stream that repeats them
    tokens = np.concatenate([np.asarray(s) for s in TokenDataset(data).shards])
    ends = np.flatnonzero(tokens == 0)
    lengths = np.diff(ends, prepend=-1).tolist()
    assert len(lengths) == 6 and sum(lengths) == train["num_tokens"]
    doc = np.repeat(np.arange(6 * 4), lengths * 4)
    period, seq = sum(lengths), SEQ
    pairs = 0
    for start in range(0, period):  # a query's keys: back to its document's start or the sequence's
        ids = doc[start:start + seq]
        first = np.searchsorted(ids, ids, side="left")  # each position's document start within the sequence
        pairs += int((np.arange(seq) - first + 1).sum())
    fraction = pairs / period / (seq * (seq + 1) / 2)
    assert out["attention_pairs_fraction"] == pytest.approx(fraction, rel=1e-9)
    assert out["attention"]["documents"]["count"] == 6
    assert out["attention"]["documents"]["source"] == f"--data {data}, train split"


@pytest.mark.parametrize("extra,message", [
    (["--doc-len", "0"], "--doc-len = 0 must be a whole number of tokens >= 1"),
    (["--doc-len", "-3"], "--doc-len = -3 must be a whole number of tokens >= 1"),
    (["--doc-len", "1.5"], "--doc-len = '1.5' is not an integer; it must be a whole number of tokens >= 1"),
    (["--doc-len", "many"], "--doc-len = 'many' is not an integer"),
    (["--doc-len", "512", "--data", "somewhere"], "--doc-len = 512 and --data = somewhere both give the documents' "
                                                  "lengths: give one"),
    (["--sliding-window", "0"], "--sliding-window = 0 must be a window of 1 .. --seq-len = 8192 positions"),
    (["--sliding-window", "8193"], "--sliding-window = 8193 must be a window of 1 .. --seq-len = 8192"),
    (["--data", "no/such/dir"], "--data = no/such/dir: no/such/dir: no index.json"),
])
def test_bad_masking_flags_are_one_clear_line(capsys, extra, message):
    assert main(["plan", "--model", MODEL, "--seq-len", str(SEQ), "--global-batch", "1M", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_data_without_a_histogram_is_refused(tmp_path, capsys):
    (tmp_path / "docs.jsonl").write_text(json.dumps({"text": "a b c"}) + "\n")
    data = prepare_dataset([tmp_path / "docs.jsonl"], tmp_path / "data", vocab_size=260, val_fraction=0.0)
    index = json.loads((data / "index.json").read_text())
    del index["splits"]["train"]["documents"]  # as a directory prepared before the lengths were recorded
    (data / "index.json").write_text(json.dumps(index))
    assert main(["plan", "--model", MODEL, "--seq-len", str(SEQ), "--global-batch", "1M", "--data", str(data)]) == 2
    err = capsys.readouterr().err.strip()
    assert f"--data = {data}: its index.json holds no histogram of document lengths" in err
    assert "--doc-len N" in err and len(err.splitlines()) == 1


def test_table_shows_both_mfus(capsys):
    assert main(["plan", "--model", MODEL, "--seq-len", str(SEQ), "--global-batch", "1M", "--top", "2",
                 "--doc-len", "1024"]) == 0
    out = capsys.readouterr().out
    assert "attention: documents of 1,024 tokens on average (--doc-len 1024): 12.0 % of causal attention's" in out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("layout"))
    assert lines[header].split()[-4:] == ["MFU", "%", "MFU", "c.e."]
    # docs/planner.md's worked example is this output
    doc = (Path(__file__).resolve().parents[1] / "docs" / "planner.md").read_text()
    assert "\n".join(lines[header - 1:header + 2]) in doc


def test_trainer_mfu_counts_the_executed_attention(tmp_path, capsys):
    # the trainer's logged FLOPs per token are the planner's: under a document mask, from the data's histogram
    texts = [" ".join(["w"] * n) for n in (3, 40, 9, 70, 25, 5, 120, 16) * 4]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    data = prepare_dataset([tmp_path / "docs.jsonl"], tmp_path / "data", vocab_size=260, val_fraction=0.1)
    seq = 64
    args = ["train", "--data", str(data), "--model.attn_mask", "document", "--max-steps", "1", "--train.seq_len",
            str(seq), "--train.global_batch_size", "2", "--train.eval_every", "0", "--run-dir", str(tmp_path / "run")]
    assert main(args) == 0
    record = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in record if "tflops_per_device" in r)
    logged = step["tflops_per_device"] * 1e12 / step["tokens_per_s_per_device"]
    cfg = dataclasses.replace(get_preset("tiny"), attn_mask="document")
    # the lengths counted from the stream, priced by counting each sequence start's pairs
    tokens = np.concatenate([np.asarray(s) for s in TokenDataset(data).shards])
    ends = np.flatnonzero(tokens == 0).tolist()
    ends += [len(tokens) - 1] if ends[-1] != len(tokens) - 1 else []  # the tail split cuts the last document
    lengths = np.diff(ends, prepend=-1).tolist()
    doc = np.repeat(np.arange(len(lengths) * 3), lengths * 3)
    period = sum(lengths)
    pairs = sum(int((np.arange(seq) - np.searchsorted(ids, ids) + 1).sum())
                for ids in (doc[s:s + seq] for s in range(period))) / period
    assert logged == pytest.approx(executed_flops(cfg, seq, pairs / (seq * (seq + 1) / 2)), rel=1e-9)
    assert "(causal-equivalent " in capsys.readouterr().out


def test_a_written_config_under_a_mask_runs_eager_and_validates(tmp_path, capsys):
    """`--write-config` after `--doc-len` writes the document mask, and so torch.compile off (the masked attention runs
    one kernel per document and the trainer refuses compile with it): the written file loads and `--dry-run` passes;
    the header's prediction is the eager one the search ranked by."""
    from fivefold.config import build_config

    out = tmp_path / "masked.toml"
    assert main(["plan", "--model", "llama-3.2-1b", "--doc-len", "1024", "--seq-len", "8192", "--global-batch", "1M",
                 "--write-config", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "ranked eager" in printed
    cfg = build_config(out)
    assert cfg.model.attn_mask == "document" and not cfg.train.compile
    assert "as configured" not in out.read_text().splitlines()[1]
    assert main(["train", "--config", str(out), "--dry-run", "--gpu", "h100"]) == 0
