"""Time to verify and load a checkpoint on 1, 2 and 4 CPU ranks (gloo): each world saves a checkpoint of the same
model under dp with ZeRO-1, then every rank runs `Checkpointer.load` on it (open the small files against the
manifest, read this rank's rectangles, hashing each piece file it opens, agree on the result). Prints, per world,
the slowest rank's seconds and the bytes each rank hashed.

    PYTHONPATH=src python benchmarks/resume_verify.py [--hidden 512] [--layers 8]
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, run_dir: str, hidden: int, layers: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    import fivefold.checkpoint_format as fmt
    from fivefold.config import build_config
    from fivefold.train.build import build_engine
    from fivefold.train.checkpoint import Checkpointer, checkpoint_dir

    hashed = [0]
    real = fmt.hash_file

    def counting(path: Path) -> str:
        hashed[0] += Path(path).stat().st_size
        return real(path)

    fmt.hash_file = counting
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = build_config(None, {"model.n_layers": str(layers), "model.hidden": str(hidden), "model.n_heads": "8",
                              "model.n_kv_heads": "8", "model.ffn": str(4 * hidden), "model.vocab_size": "8192",
                              "train.seq_len": "32", "train.global_batch_size": "4", "layout.micro_batch_size": "1",
                              "layout.dp": str(world), "layout.zero": "1" if world > 1 else "0",
                              "train.device": "cpu", "train.dtype": "fp32", "data.path": "/nonexistent/bench",
                              "run_dir": run_dir})
    engine = build_engine(cfg, torch.device("cpu"))
    checkpointer = Checkpointer(Path(run_dir), engine, cfg, rank, world, is_first=rank == 0)
    checkpointer.save(1, 0, 4)
    engine.barrier()
    t0 = time.perf_counter()
    checkpointer.load([checkpoint_dir(Path(run_dir), 1)])
    seconds = time.perf_counter() - t0
    queue.put((rank, seconds, hashed[0]))
    if world > 1:
        dist.destroy_process_group()


def measure(world: int, hidden: int, layers: int) -> tuple[float, list[int], int]:
    with tempfile.TemporaryDirectory() as run_dir:
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        port = _free_port()
        procs = [ctx.Process(target=_rank, args=(r, world, port, run_dir, hidden, layers, queue)) for r in range(world)]
        for p in procs:
            p.start()
        results = sorted(queue.get(timeout=600) for _ in procs)
        for p in procs:
            p.join()
        total = sum(f.stat().st_size for f in (Path(run_dir) / "checkpoints").rglob("*") if f.is_file())
    return max(s for _, s, _ in results), [b for _, _, b in results], total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    print(f"verify + load of a checkpoint (hidden {args.hidden}, {args.layers} layers, fp32 weights and AdamW "
          "moments), CPU gloo ranks")
    for world in (1, 2, 4):
        seconds, hashed, total = measure(world, args.hidden, args.layers)
        print(f"  {world} rank(s): {seconds:.2f} s (slowest rank); checkpoint {total / 2**20:.1f} MiB; bytes hashed "
              f"per rank: {', '.join(f'{b / 2**20:.1f} MiB' for b in hashed)}")


if __name__ == "__main__":
    main()
