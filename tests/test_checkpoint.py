"""Checkpoint writing is atomic, loading needs no unpickling and refuses what does not match."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from fivefold.checkpoint_format import flat_rects
from fivefold.config import Config
from fivefold.models.llama import build_model
from fivefold.train import checkpoint as ckpt
from fivefold.train.build import single_device_engine


def _trained_state(seed: int):
    cfg = Config()
    engine = single_device_engine(build_model(cfg.model, seed=seed), cfg, torch.device("cpu"))
    engine.model(torch.randint(0, cfg.model.vocab_size, (2, 8))).sum().backward()
    engine.optimizer.step()
    return cfg, engine


def _save(run_dir, step, engine, cfg):
    """The trainer's own save (`Checkpointer.save`) of a single-process engine."""
    return ckpt.Checkpointer(run_dir, engine, cfg).save(step, tokens_seen=step * 10,
                                                         samples_consumed=step * cfg.train.global_batch_size)


def test_round_trip_exact(tmp_path):
    cfg, engine = _trained_state(0)
    path = _save(tmp_path, 5, engine, cfg)
    loaded = ckpt.load_checkpoint(path)
    assert loaded.state.step == 5 and loaded.state.tokens_seen == 50
    for k, v in engine.model.state_dict().items():
        if k != "lm_head.weight":
            assert torch.equal(loaded.reader.read(f"model.{k}"), v)
    # the loaded state drives a fresh engine: the same weights and AdamW state
    fresh = single_device_engine(build_model(cfg.model, seed=1), cfg, torch.device("cpu"))
    fresh.load_state_pieces(loaded.reader, loaded.steps)
    for (name, a), b in zip(engine.model.named_parameters(), fresh.model.parameters(), strict=True):
        assert torch.equal(a, b), name
        sa, sb = engine.optimizer.state[a], fresh.optimizer.state[b]
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa), name


def test_flat_ranges_become_contiguous_rectangles():
    """A ZeRO-1/2 slice of a flat bucket covers a row-major range of a parameter: its rectangles cover exactly that
    range, in order, each a contiguous run of the flat storage (checked against the elements' own indices)."""
    for shape in [(7,), (3, 5), (4, 3, 5), (2, 3, 4, 5)]:
        whole = torch.arange(torch.Size(shape).numel()).view(shape)
        for start in range(0, whole.numel(), 3):
            for end in range(start + 1, whole.numel() + 1, 4):
                rects = flat_rects(shape, start, end)
                assert len(rects) <= 2 * len(shape)
                got = []
                for off, size, lo, hi in rects:
                    block = whole[tuple(slice(o, o + s) for o, s in zip(off, size, strict=True))]
                    assert block.reshape(-1).tolist() == list(range(lo, hi))
                    got += list(range(lo, hi))
                assert got == list(range(start, end))


def test_interrupted_write_leaves_previous_checkpoint(tmp_path, monkeypatch):
    cfg, engine = _trained_state(0)
    first = _save(tmp_path, 1, engine, cfg)
    real_write = ckpt.write_safetensors

    def dying_write(path, tensors):
        with open(path, "wb") as f:  # the writer dies half-way through its pieces
            f.write(b"\x00" * 17)
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(ckpt, "write_safetensors", dying_write)
    with pytest.raises(KeyboardInterrupt):
        _save(tmp_path, 2, engine, cfg)
    monkeypatch.setattr(ckpt, "write_safetensors", real_write)
    assert ckpt.latest_checkpoint(tmp_path) == first  # the half-written step 2 is not a checkpoint
    assert (tmp_path / "checkpoints" / "step_00000002.tmp").exists()
    ckpt.load_checkpoint(first)
    # the next writer cleans up the leftover and writes step 2 properly
    second = _save(tmp_path, 2, engine, cfg)
    assert ckpt.latest_checkpoint(tmp_path) == second
    assert not (tmp_path / "checkpoints" / "step_00000002.tmp").exists()


def test_never_overwrites(tmp_path):
    cfg, engine = _trained_state(0)
    path = _save(tmp_path, 3, engine, cfg)
    before = (path / "rank0.safetensors").read_bytes()
    with pytest.raises(ckpt.CheckpointError, match="already exists"):
        _save(tmp_path, 3, engine, cfg)
    assert (path / "rank0.safetensors").read_bytes() == before


def test_corrupted_and_mismatched(tmp_path):
    cfg, engine = _trained_state(0)
    path = _save(tmp_path, 4, engine, cfg)
    (path / "index.json").write_bytes(b"garbage")
    with pytest.raises(ckpt.CheckpointError, match="index.json is corrupted"):
        ckpt.load_checkpoint(path)
    (path / "index.json").unlink()
    ckpt.write_manifest(path)  # as a checkpoint written before the one index: each rank's part is read
    (path / "rank0.json").write_bytes(b"garbage")
    with pytest.raises(ckpt.CheckpointError, match="rank0.json is corrupted"):
        ckpt.load_checkpoint(path)
    other = Config()
    other.model.hidden = 64
    expected = {k: v for k, v in build_model(other.model).state_dict().items() if k != "lm_head.weight"}
    loaded = {k: v for k, v in engine.model.state_dict().items() if k != "lm_head.weight"}
    with pytest.raises(ckpt.CheckpointError, match=r"embed\.weight: checkpoint \(2048, 128\) vs model \(2048, 64\)"):
        ckpt.check_model_shapes({k: tuple(v.shape) for k, v in loaded.items()},
                                {k: tuple(v.shape) for k, v in expected.items()}, path)
    (path / "COMPLETE").unlink()
    with pytest.raises(ckpt.CheckpointError, match="not a complete checkpoint"):
        ckpt.load_checkpoint(path)


def test_pickles_are_never_loaded(tmp_path):
    """A checkpoint file holding a pickle (as torch.save writes) is refused, not executed."""
    cfg, engine = _trained_state(0)
    path = _save(tmp_path, 6, engine, cfg)
    torch.save({"x": torch.zeros(1)}, path / "rank0.safetensors")
    with pytest.raises(ckpt.CheckpointError, match="rank0.safetensors is corrupted"):
        ckpt.read_model_state(path)
    ckpt.write_manifest(path)  # even with matching checksums the pickle is refused, not unpickled
    with pytest.raises(ckpt.CheckpointError, match="rank0.safetensors is corrupted"):
        ckpt.read_model_state(path)
    save_file({"x": torch.zeros(1)}, str(path / "rank0.safetensors"))  # valid file, wrong names
    ckpt.write_manifest(path)
    with pytest.raises(ckpt.CheckpointError, match="rank0.safetensors is corrupted"):
        ckpt.read_model_state(path)


def test_background_save_writes_the_synchronous_files_and_skips_a_non_finite_state(tmp_path, capsys):
    """A background save (`AsyncSave`: a thread writes the state, on the CPU the live tensors themselves) writes the
    same bytes as a synchronous save of the same state, even when the state changes right after the save: the next
    step's update first waits for the writer to have read it (`Engine.wait_for_state_readers`, as `optimizer_step`
    does); a state with NaN is not written and the older checkpoint stays, as for a synchronous save."""
    cfg, engine = _trained_state(0)
    sync = _save(tmp_path / "sync", 1, engine, cfg)
    saver = ckpt.Checkpointer(tmp_path / "async", engine, cfg)
    assert saver.save(1, 10, cfg.train.global_batch_size, background=True) is None  # still being written
    assert engine.state_readers  # the live state is being read: the next update must wait
    engine.wait_for_state_readers()
    assert not engine.state_readers
    with torch.no_grad():  # the next step's update, while the thread may still finish the checkpoint
        for p in engine.model.parameters():
            p.add_(1.0)
    written = saver.wait()
    assert written is not None and (written / "COMPLETE").exists()
    for name in ("rank0.safetensors", "index.json", "trainer_state.json"):
        assert (written / name).read_bytes() == (sync / name).read_bytes(), name
    with torch.no_grad():
        next(engine.model.parameters())[0] = float("nan")
    # the reference: the first piece this rank writes that holds a NaN, found element by element
    poisoned = next(p.name for p in engine.state_pieces()[0] if torch.isnan(p.tensor).any())
    assert saver.save(2, 20, 2 * cfg.train.global_batch_size, background=True) is None
    assert saver.wait() is None
    assert ("not writing the checkpoint of step 2: the weights or optimizer state hold NaN or inf, first in tensor "
            f"'{poisoned}'; the older checkpoints are kept") in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "async" / "checkpoints").iterdir()] == [written.name]


def test_the_finiteness_check_sees_one_bad_element_and_no_false_one():
    """`first_nonfinite` reads each tensor's sum and only looks element by element where the sum is not finite: one
    NaN or infinity anywhere is found, and named (the first such tensor), and large finite values whose sum overflows
    are still finite."""
    from types import SimpleNamespace

    from fivefold.train.checkpoint import first_nonfinite

    engine = SimpleNamespace(device=torch.device("cpu"), grid=None)

    def pieces(*tensors):
        return [SimpleNamespace(name=f"t{i}", tensor=t) for i, t in enumerate(tensors)]

    big = torch.full((1000,), 3e38)  # finite, but their sum overflows to inf
    assert first_nonfinite(engine, pieces(torch.randn(10, 10), big, torch.arange(5), big.bfloat16())) is None
    for bad in (float("nan"), float("inf"), -float("inf")):
        t = torch.randn(100_000)
        t[77_777] = bad
        assert first_nonfinite(engine, pieces(torch.randn(3), t)) == "tensor 't1'", bad
        assert first_nonfinite(engine, pieces(big, t.bfloat16(), t)) == "tensor 't1'", bad


# the pieces of each of three ranks in the test below: (names, indices of the pieces that hold a NaN or an inf)
RANK_PIECES = {0: (["model.a", "exp_avg.a"], []),
               1: (["model.b", "exp_avg.b", "exp_avg_sq.b"], [2, 1]),  # its first bad one in its order: exp_avg.b
               2: (["model.c", "exp_avg_sq.c"], [0])}


def report_nonfinite_on_rank(rank: int, world: int, bad: bool) -> tuple[str | None, int]:
    """`first_nonfinite` on this rank's pieces (`RANK_PIECES`, poisoned where `bad`) with the engine's own agreement
    over gloo, and the broadcasts it made."""
    from types import SimpleNamespace

    from fivefold.train import checkpoint
    from fivefold.train.engine import Engine

    names, poisoned = RANK_PIECES[rank]
    tensors = [torch.randn(64) for _ in names]
    for i in poisoned if bad else []:
        tensors[i][i + 3] = float("nan") if i % 2 else float("inf")
    engine = SimpleNamespace(device=torch.device("cpu"), grid=SimpleNamespace(rank=rank, world_size=world))
    engine.agree = lambda flags: Engine.agree(engine, flags)
    broadcasts = []
    real = checkpoint.dist.broadcast
    checkpoint.dist.broadcast = lambda *a, **k: (broadcasts.append(a), real(*a, **k))[1]
    try:
        where = checkpoint.first_nonfinite(engine, [SimpleNamespace(name=n, tensor=t)
                                                    for n, t in zip(names, tensors, strict=True)])
    finally:
        checkpoint.dist.broadcast = real
    return where, len(broadcasts)


def test_the_finiteness_check_names_the_lowest_rank_that_found_one_on_every_rank():
    """On several ranks every rank gets the same line: the first non-finite tensor of the lowest rank that holds one
    (ranks 1 and 2 do here; rank 1's first, in its order), named with that rank. A finite state costs the one
    reduction there was before, and no broadcast."""
    from tests.distributed import run_ranks

    # the reference: the lowest rank with a poisoned piece, and its first poisoned piece in piece order
    source = min(r for r, (_, bad) in RANK_PIECES.items() if bad)
    name = RANK_PIECES[source][0][min(RANK_PIECES[source][1])]
    assert run_ranks(3, report_nonfinite_on_rank, True) == [(f"tensor '{name}', found by rank {source} of 3", 1)] * 3
    assert run_ranks(3, report_nonfinite_on_rank, False) == [(None, 0)] * 3
