"""How much of ring attention's key/value transfer time the overlap hides (CPU, gloo ranks spawned here).

Per rank and sequence length it times, as the median of --repeats runs after a barrier and the slowest rank:
the ring attention forward with each transfer posted before the block's compute (`overlap`), the same with
each transfer awaited before the compute (`serial`), and the cp-1 key/value ring shifts alone (`transfer`).
serial ~ compute + transfer, so the hidden share of the transfer time is (serial - overlap) / transfer.
Shapes are the `tiny` model's attention (4 query heads, 2 key/value heads, head dim 32), fp32, one sequence.

    python benchmarks/cp_overlap.py --cps 2 4 --seqs 1024 4096 16384
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from cp_memory import run_on_ranks

from fivefold.parallel.context import ring_attention_forward, ring_shift
from fivefold.presets import get_preset


def timed(fn, repeats: int) -> float:
    """Median seconds of `fn` over the slowest rank."""
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    median = torch.tensor(statistics.median(times), dtype=torch.float64)
    dist.all_reduce(median, op=dist.ReduceOp.MAX)
    return float(median)


def time_ring(rank: int, cp: int, args: argparse.Namespace) -> list[tuple]:
    group, cfg = dist.group.WORLD, get_preset("tiny")
    rows = []
    for seq in args.seqs:
        local = seq // cp
        q = torch.randn(1, cfg.n_heads, local, cfg.head_dim)
        k, v = torch.randn(2, 1, cfg.n_kv_heads, local, cfg.head_dim)
        kv = torch.stack([k, v])

        def shifts(kv=kv) -> None:
            for _ in range(cp - 1):
                kv = ring_shift(kv, group).wait()

        overlap = timed(lambda q=q, k=k, v=v: ring_attention_forward(q, k, v, group), args.repeats)
        serial = timed(lambda q=q, k=k, v=v: ring_attention_forward(q, k, v, group, overlap=False), args.repeats)
        transfer = timed(shifts, args.repeats)
        rows.append((seq, kv.numel() * kv.element_size(), overlap, serial, transfer))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cps", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--seqs", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    print(f"ring attention forward, tiny shapes, fp32, CPU gloo, torch {torch.__version__}, median of "
          f"{args.repeats}")
    print("  cp     seq   KV MiB/hop   overlap ms   serial ms   transfer ms   hidden share")
    for cp in args.cps:
        for seq, hop_bytes, overlap, serial, transfer in run_on_ranks(cp, time_ring, args):
            hidden = (serial - overlap) / transfer
            print(f"  {cp:>2}  {seq:>6}   {hop_bytes / 2**20:10.2f}   {overlap * 1e3:10.2f}   {serial * 1e3:9.2f}"
                  f"   {transfer * 1e3:11.2f}   {hidden:12.0%}")


if __name__ == "__main__":
    main()
