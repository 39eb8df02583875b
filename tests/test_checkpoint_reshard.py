"""Sharded checkpoints move between layouts: a checkpoint written under one layout and world size resumes under
another, weights and AdamW state included, and continues the uninterrupted run's losses (to 1e-5 relative in fp32
on CPU; layouts sum in other orders, so not bit for bit). Under its own layout every technique resumes bit for bit.

Reference: the uninterrupted run under the layout that wrote the checkpoint."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from tests.distributed import run_ranks
from tests.test_parallel_launch import check_resume
from tests.test_train import dataset, small_config  # noqa: F401  (dataset is a fixture)

from fivefold.train import checkpoint as ckpt
from fivefold.train.loop import train

FP32 = {"train.dtype": "fp32", "train.device": "cpu", "train.threads": "1", "layout.micro_batch_size": "2",
        "train.keep_checkpoints": "10"}
MOE = {"model.n_experts": "4", "model.top_k": "2"}


def train_on_ranks(rank: int, world_size: int, run_dir: Path, data_dir: Path, overrides: dict[str, str],
                   resume: bool) -> list[float]:
    return train(small_config(run_dir, data_dir, **overrides), resume=resume).losses


def run(world: int, run_dir: Path, data_dir: Path, overrides: dict[str, str], resume: bool = False) -> list[float]:
    if world == 1:
        return train(small_config(run_dir, data_dir, **overrides), resume=resume).losses
    return run_ranks(world, train_on_ranks, run_dir, data_dir, overrides, resume)[0]


def resume_copy(source: Path, target: Path, step: int) -> None:
    """A copy of run `source` as it was right after its checkpoint of `step` (newer checkpoints removed)."""
    shutil.copytree(source, target)
    for path in ckpt.checkpoint_dirs(target):
        if int(path.name.removeprefix(ckpt.CHECKPOINT_PREFIX)) > step:
            shutil.rmtree(path)


def assert_close(got: list[float], want: list[float], rel: float = 1e-5) -> None:
    assert len(got) == len(want)
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True))
    assert worst <= rel, (worst, got, want)


def check_change(tmp: Path, data_dir: Path, before: tuple[int, dict[str, str]], after: list[tuple[int, dict]],
                 steps: int = 6, cut: int = 3, model: dict[str, str] | None = None) -> None:
    """Train `steps` steps under layout `before` (world size, overrides) with a checkpoint at `cut`; resume that
    checkpoint under each layout of `after`: its losses of the steps after `cut` match the uninterrupted run's."""
    common = {**FP32, **(model or {}), "train.max_steps": str(steps), "train.checkpoint_every": str(cut)}
    full = run(before[0], tmp / "full", data_dir, {**common, **before[1]})
    for i, (world, layout) in enumerate(after):
        resume_copy(tmp / "full", tmp / f"resumed{i}", cut)
        rest = run(world, tmp / f"resumed{i}", data_dir, {**common, **layout}, resume=True)
        assert_close(rest, full[cut:])


def test_dp2_tp2_checkpoint_resumes_under_pp2_and_one_process(tmp_path, dataset):  # noqa: F811
    """The acceptance case: a dp2 x tp2 checkpoint at step 10 of a 20-step run resumes under pp2 (2 processes)
    and under one process; steps 11-20 equal the uninterrupted dp2 x tp2 run's within 1e-5 relative."""
    check_change(tmp_path, dataset, (4, {"layout.dp": "2", "layout.tp": "2"}),
                 [(2, {"layout.pp": "2"}), (1, {})], steps=20, cut=10)
    # each rank wrote only its own pieces: together one copy of every tensor
    path = ckpt.checkpoint_dir(tmp_path / "full", 10)
    written = sum(p["piece_shape"][0] * (p["piece_shape"][1] if len(p["piece_shape"]) > 1 else 1)
                  for r in range(4) for p in json.loads((path / f"rank{r}.json").read_text())["pieces"]
                  if p["name"].startswith("model."))
    model = ckpt.read_model_state(path)
    assert written == sum(t.numel() for t in model.values())


@pytest.mark.slow  # heavy; expert checkpoints stay in the fast run (test_zero3_expert.py)
def test_whole_experts_under_tp_checkpoint_resumes_in_one_process_and_split(tmp_path, dataset):  # noqa: F811
    """dp2 x tp2 with whole experts (etp = 1) under ZeRO-1: the experts' AdamW moments are cut over the edp ranks,
    all four here (both tp ranks of both dp ranks), so every rank writes its own slices (the dense weights' second
    tp replica writes none of theirs); together one copy of every tensor, and the checkpoint resumes in one process
    and with experts split over tp."""
    check_change(tmp_path, dataset, (4, {"layout.dp": "2", "layout.tp": "2", "layout.zero": "1"}),
                 [(1, {}), (2, {"layout.tp": "2", "layout.etp": "2"})], model=MOE)
    path = ckpt.checkpoint_dir(tmp_path / "full", 3)
    pieces = [p for r in range(4) for p in json.loads((path / f"rank{r}.json").read_text())["pieces"]]
    written = sum(math.prod(p["piece_shape"]) for p in pieces if p["name"].startswith("model."))
    assert written == sum(t.numel() for t in ckpt.read_model_state(path).values())
    for r in range(4):  # the tp rank 1s too: their slices of the experts' moments exist nowhere else
        names = [p["name"] for p in json.loads((path / f"rank{r}.json").read_text())["pieces"]]
        assert any(n.startswith("exp_avg.") and n.rsplit(".", 1)[-1] in ("w_gate", "w_up", "w_down") for n in names), r


@pytest.mark.slow  # heavy; the fast run keeps the same feature's other tests
def test_hsdp_checkpoint_resumes_under_fsdp_and_one_process(tmp_path, dataset):  # noqa: F811
    """HSDP (dp4, shard groups of 2, 2 replicas): each shard is written once, by its first replica, and the
    checkpoint resumes under plain ZeRO-3 over dp2, under one process and under HSDP x pp2."""
    check_change(tmp_path, dataset, (4, {"layout.dp": "4", "layout.zero": "3", "layout.dp_shard": "2"}),
                 [(2, {"layout.dp": "2", "layout.zero": "3"}), (1, {}),
                  (4, {"layout.dp": "2", "layout.pp": "2", "layout.zero": "3", "layout.dp_shard": "1"})])
    path = ckpt.checkpoint_dir(tmp_path / "full", 3)
    written = sum(math.prod(p["piece_shape"]) for r in range(4)
                  for p in json.loads((path / f"rank{r}.json").read_text())["pieces"] if p["name"].startswith("model."))
    assert written == sum(t.numel() for t in ckpt.read_model_state(path).values())


def test_one_process_checkpoint_loads_into_zero2_and_back(tmp_path, dataset):  # noqa: F811
    """One process -> dp2 ZeRO-2 (flat slices of buckets) -> one process again."""
    check_change(tmp_path / "a", dataset, (1, {}), [(2, {"layout.dp": "2", "layout.zero": "2"})])
    check_change(tmp_path / "b", dataset, (2, {"layout.dp": "2", "layout.zero": "2"}), [(1, {})])


def uninterrupted_sampler(data_dir: Path, batch: int):
    from fivefold.data import BatchSampler, TokenDataset

    seed = small_config(Path("unused"), data_dir).train.seed
    return BatchSampler(TokenDataset(data_dir, "train"), 32, batch, seed)


@pytest.mark.parametrize("new_batch", [16, 12, 4])
def test_a_changed_global_batch_continues_at_the_same_sample(dataset, new_batch):  # noqa: F811
    """The data position is samples consumed: after 3 steps of 8 (samples 0-23), a batch of 16, 12 or 4 reads
    samples 24, 25, ... of the uninterrupted order, none repeated or skipped. Reference: the windows of the
    uninterrupted sampler of batch 8, concatenated."""
    from types import SimpleNamespace


    old = uninterrupted_sampler(dataset, 8)
    order = [int(w) for step in range(12) for w in old.window_indices(step)]
    cfg = small_config(Path("unused"), dataset, **{"train.global_batch_size": str(new_batch)})
    loaded = SimpleNamespace(state=ckpt.TrainerState(step=3, tokens_seen=3 * 8 * 32), path=Path("step_00000003"),
                             data={"global_batch_size": 8, "seq_len": 32, "samples_consumed": 24})
    new = ckpt.resumed_sampler(uninterrupted_sampler(dataset, new_batch), loaded, cfg, is_first=False)
    read = [int(w) for step in range(3, 6) for w in new.window_indices(step)]
    assert read == order[24:24 + 3 * new_batch]
    assert new.samples_before(6) == 24 + 3 * new_batch
    # a checkpoint without the count (written before it existed) consumed `step` batches of its own size
    del loaded.data["samples_consumed"]
    again = ckpt.resumed_sampler(uninterrupted_sampler(dataset, new_batch), loaded, cfg, is_first=False)
    assert [int(w) for w in again.window_indices(3)] == order[24:24 + new_batch]


def test_resume_with_a_doubled_global_batch(tmp_path, dataset, capsys):  # noqa: F811
    """End to end: a batch-8 run stopped at its step-3 checkpoint resumes with batch 16. Its first step's loss is the
    loss of the step-3 weights on samples 24-39 of the uninterrupted order (computed here by a fresh engine
    loaded from that checkpoint), and its checkpoint records 3 x 8 + 2 x 16 samples consumed."""
    from fivefold.train.build import build_engine

    train(small_config(tmp_path / "run", dataset, **FP32), stop_after=3)
    cfg = small_config(tmp_path / "run", dataset, **{**FP32, "train.global_batch_size": "16", "train.max_steps": "5"})
    engine = build_engine(cfg, torch.device("cpu"))
    step3 = ckpt.load_checkpoint(ckpt.checkpoint_dir(tmp_path / "run", 3))
    ckpt.Checkpointer(tmp_path / "run", engine, cfg).load_state(step3)
    old = uninterrupted_sampler(dataset, 8)
    inputs, targets = (torch.cat(parts) for parts in zip(old.global_batch(3), old.global_batch(4), strict=True))
    want = engine.eval_loss_sum(inputs, targets).item() / targets.numel()
    capsys.readouterr()
    resumed = train(cfg, resume=True)
    assert "continues at sample 24" in capsys.readouterr().err
    assert abs(resumed.losses[0] - want) <= 1e-5 * want, (resumed.losses[0], want)
    state = json.loads((ckpt.checkpoint_dir(tmp_path / "run", 5) / "trainer_state.json").read_text())
    assert state["samples_consumed"] == 3 * 8 + 2 * 16 and state["tokens_seen"] == (3 * 8 + 2 * 16) * 32


def test_a_changed_sequence_length_or_seed_is_refused_with_the_field(tmp_path, dataset):  # noqa: F811
    train(small_config(tmp_path / "run", dataset, **FP32), stop_after=3)
    with pytest.raises(ckpt.CheckpointError, match=r"train.seq_len = 32, this run has 16"):
        train(small_config(tmp_path / "run", dataset, **{**FP32, "train.seq_len": "16"}), resume=True)
    seed = small_config(tmp_path / "run", dataset, **FP32).train.seed
    with pytest.raises(ckpt.CheckpointError, match=rf"train.seed = {seed}, this run has {seed + 1}.*sample order"):
        train(small_config(tmp_path / "run", dataset, **{**FP32, "train.seed": str(seed + 1)}), resume=True)


LAYOUT_CHANGES = {
    "zero0-dp2 -> zero3-dp2": ((2, {"layout.dp": "2"}), [(2, {"layout.dp": "2", "layout.zero": "3"})], None),
    "zero3-dp2 -> tp2-zero1": ((2, {"layout.dp": "2", "layout.zero": "3"}),
                               [(4, {"layout.dp": "2", "layout.tp": "2", "layout.zero": "1"})], None),
    "zero1-dp2 -> cp2-sp-tp2": ((2, {"layout.dp": "2", "layout.zero": "1"}),
                                [(4, {"layout.cp": "2", "layout.tp": "2", "layout.sp": "true"})], None),
    "pp2-1f1b -> pp2-interleaved": ((2, {"layout.pp": "2"}),
                                    [(2, {"layout.pp": "2", "layout.schedule": "interleaved", "layout.vpp": "2"}),
                                     (4, {"layout.pp": "2", "layout.dp": "2", "layout.zero": "2"})],
                                    {"model.n_layers": "4"}),
    "ep2-zero1 -> one process and tp2": ((2, {"layout.dp": "2", "layout.ep": "2", "layout.zero": "1"}),
                                         [(1, {}), (2, {"layout.tp": "2"})], MOE),
    "cp2-zero3 -> dualpipev": ((2, {"layout.cp": "2", "layout.zero": "3"}),
                               [(2, {"layout.pp": "2", "layout.schedule": "dualpipev"})], {"model.n_layers": "4"}),
}


@pytest.mark.slow
@pytest.mark.parametrize("change", list(LAYOUT_CHANGES), ids=list(LAYOUT_CHANGES))
def test_layout_changes(tmp_path, dataset, change):  # noqa: F811
    before, after, model = LAYOUT_CHANGES[change]
    check_change(tmp_path, dataset, before, after, model=model)


SAME_LAYOUT_FAST = {
    "zero1": (2, {"layout.dp": "2", "layout.zero": "1"}),
    "tp2-sp": (2, {"layout.tp": "2", "layout.sp": "true"}),
}
SAME_LAYOUT_SLOW = {
    "zero2": (2, {"layout.dp": "2", "layout.zero": "2"}),
    "tp2": (2, {"layout.tp": "2"}),
    "cp2": (2, {"layout.cp": "2"}),
    "pp2-afab": (2, {"layout.pp": "2", "layout.schedule": "afab"}),
    "pp2-1f1b": (2, {"layout.pp": "2", "layout.schedule": "1f1b"}),
    "pp2-interleaved": (2, {"layout.pp": "2", "layout.schedule": "interleaved", "layout.vpp": "2",
                            "model.n_layers": "4"}),
    "pp2-dualpipev": (2, {"layout.pp": "2", "layout.schedule": "dualpipev", "model.n_layers": "4"}),
    "ep2-zero0": (2, {"layout.dp": "2", "layout.ep": "2", **MOE}),
    "pp2-zero1-dp2": (4, {"layout.pp": "2", "layout.dp": "2", "layout.zero": "1"}),
}


@pytest.mark.parametrize("name", list(SAME_LAYOUT_FAST), ids=list(SAME_LAYOUT_FAST))
def test_resume_under_the_same_layout_is_exact(tmp_path, dataset, name):  # noqa: F811
    world, layout = SAME_LAYOUT_FAST[name]
    check_resume(tmp_path, dataset, world, layout)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SAME_LAYOUT_SLOW), ids=list(SAME_LAYOUT_SLOW))
def test_resume_under_the_same_layout_is_exact_slow(tmp_path, dataset, name):  # noqa: F811
    world, layout = SAME_LAYOUT_SLOW[name]
    check_resume(tmp_path, dataset, world, layout)


def test_pieces_read_any_rectangle(tmp_path):
    """A tensor written as a tp-like split along dim 1 and read back as row blocks (another layout's shards)."""
    from fivefold.checkpoint_format import PieceReader, write_safetensors

    full = torch.randn(6, 8)
    write_safetensors(tmp_path / "a.safetensors", [("0", full[:, :4].contiguous()), ("1", full[:, 4:].contiguous())])
    index = {"w": {"shape": [6, 8], "pieces": [
        {"file": "a.safetensors", "key": "0", "offsets": [0, 0], "shape": [6, 4]},
        {"file": "a.safetensors", "key": "1", "offsets": [0, 4], "shape": [6, 4]}]}}
    reader = PieceReader(tmp_path, index)
    assert torch.equal(reader.read("w"), full)
    assert torch.equal(reader.read("w", (2, 3), (3, 4)), full[2:5, 3:7])
