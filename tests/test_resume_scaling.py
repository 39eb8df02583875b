"""Resume that scales: a checkpoint has one index (`index.json`, merged at save), and each rank of a resume hashes
only the files it reads; no rank reads a rank's piece index (`rankN.json`) at all, and rank 0 hashes only its own
files and the small ones (it used to hash the whole checkpoint). Counted with hooks on a 4-rank resume, against
the files' sizes on disk; the resumed run continues the uninterrupted one."""

from __future__ import annotations

import json
from pathlib import Path

from tests.distributed import run_ranks
from tests.test_checkpoint_reshard import FP32, assert_close, resume_copy
from tests.test_train import dataset, small_config  # noqa: F401  (dataset is a fixture)

SMALL = ("trainer_state.json", "config.toml", "index.json")


def resume_counting(rank: int, world: int, run_dir: Path, data_dir: Path, overrides: dict[str, str]) -> dict:
    """Resume on this rank with hooks: the bytes it hashes per file, and the JSON files it reads (with repeats)."""
    import fivefold.checkpoint_format as fmt
    from fivefold.train.loop import train

    hashed: dict[str, list[int]] = {}
    json_reads: list[str] = []
    real_hash, real_json = fmt.hash_file, fmt._json

    def counting_hash(path: Path) -> str:
        hashed.setdefault(Path(path).name, []).append(Path(path).stat().st_size)
        return real_hash(path)

    def counting_json(path: Path):
        json_reads.append(Path(path).name)
        return real_json(path)

    fmt.hash_file, fmt._json = counting_hash, counting_json
    losses = train(small_config(run_dir, data_dir, **overrides), resume=True).losses
    return {"hashed": hashed, "json_reads": json_reads, "losses": losses}


def test_four_rank_resume_hashes_only_what_each_rank_reads(tmp_path, dataset):  # noqa: F811
    from tests.test_checkpoint_reshard import run

    layout = {**FP32, "layout.tp": "2", "layout.dp": "2", "layout.zero": "1", "train.max_steps": "4",
              "train.checkpoint_every": "2"}
    full = run(4, tmp_path / "full", dataset, layout)
    resume_copy(tmp_path / "full", tmp_path / "cut", 2)
    path = tmp_path / "cut" / "checkpoints" / "step_00000002"
    sizes = {f.name: f.stat().st_size for f in path.iterdir()}
    results = run_ranks(4, resume_counting, tmp_path / "cut", dataset, layout)
    assert_close(results[0]["losses"], full[2:])
    index = json.loads((path / "index.json").read_text())
    for rank, r in enumerate(results):
        hashed = r["hashed"]
        assert all(len(v) == 1 for v in hashed.values()), (rank, hashed)  # no file hashed twice
        assert not any(n.startswith("rank") and n.endswith(".json") for n in r["json_reads"]), r["json_reads"]
        assert sorted(r["json_reads"]) == sorted(set(r["json_reads"]))  # each JSON file read once
        # the small files and this rank's own RNG state, then only piece files that its rectangles come from
        assert set(SMALL) | {f"rng-rank{rank}.safetensors"} <= set(hashed), (rank, hashed)
        # each saved rank's piece index is verified by one rank, its own (resume does not read it: index.json)
        assert {n for n in hashed if n.startswith("rank") and n.endswith(".json")} == {f"rank{rank}.json"}
        pieces = {n for n in hashed if n.startswith("rank") and n.endswith(".safetensors")}
        assert pieces <= {p["file"] for e in index["tensors"].values() for p in e["pieces"]}
        assert not any(n.startswith("rng-") and n != f"rng-rank{rank}.safetensors" for n in hashed)
        assert {n: v[0] for n, v in hashed.items()} == {n: sizes[n] for n in hashed}  # whole files, as on disk
    rank0 = results[0]["hashed"]
    assert set(rank0) == set(SMALL) | {"rng-rank0.safetensors", "rank0.safetensors", "rank0.json"}, rank0
    whole = sum(v for n, v in sizes.items() if n not in ("manifest.json", "COMPLETE"))
    own = sum(v[0] for v in rank0.values())
    print(f"rank 0 hashed {own:,} of the checkpoint's {whole:,} bytes; the ranks hashed "
          f"{[sum(v[0] for v in r['hashed'].values()) for r in results]}")
    assert own < 0.4 * whole
