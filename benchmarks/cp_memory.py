"""Context parallel and activation memory: how long a sequence trains one step on a fixed memory budget with
cp = 1, 2, 4 (CPU, gloo ranks spawned here, fp32, the `tiny` model, one sequence per micro-batch).

Memory measured: the bytes of the tensors autograd saves for backward on each rank (activations, recorded by
`torch.autograd.graph.saved_tensors_hooks`, each storage counted once, parameters left out). With ring
attention nothing of size seq^2 is saved, so the saved bytes per rank grow as seq / cp. For each cp the
script trains one step (forward, backward, AdamW) at sequence lengths doubling from --start-seq while the
busiest rank stays within the budget, then bisects to --granularity tokens. It also prints the saved bytes
per rank at one fixed length (--fixed-seq) for every cp.

    python benchmarks/cp_memory.py                                  # budget 64 MiB, fixed length 4096
    python benchmarks/cp_memory.py --budget-mib 64 --cps 1 2 4 --fixed-seq 8192
"""

from __future__ import annotations

import argparse
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fivefold.models.llama import build_model
from fivefold.models.loss import linear_cross_entropy_sum
from fivefold.parallel.context import apply_context_parallel, shard_batch
from fivefold.presets import get_preset

MIB = 2**20


def saved_activation_bytes_of_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seq_len: int,
                                   rank: int, cp: int) -> tuple[int, float]:
    """Train one step on a random sequence; return (saved activation bytes on this rank, step seconds)."""
    generator = torch.Generator().manual_seed(seq_len)
    tokens = torch.randint(0, model.cfg.vocab_size, (1, seq_len + 1), generator=generator)
    inputs, targets, positions = shard_batch(tokens[:, :-1], tokens[:, 1:], rank, cp)
    parameter_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in parameter_storages:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        hidden = model.forward_hidden(inputs, positions)
        loss = linear_cross_entropy_sum(hidden, model.lm_head.weight, targets) / seq_len
    saved = sum(seen.values())  # everything saved is alive at the end of the forward: the peak
    loss.backward()
    for p in model.parameters():  # the dp x cp gradient reduction, here over cp only
        dist.all_reduce(p.grad)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return saved, time.perf_counter() - start


def busiest_rank_bytes(model, optimizer, seq_len: int, rank: int, cp: int) -> tuple[int, float]:
    saved, seconds = saved_activation_bytes_of_step(model, optimizer, seq_len, rank, cp)
    worst = torch.tensor([saved, seconds], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return int(worst[0]), float(worst[1])


def _rank_entry(rank: int, world_size: int, port: int, fn, args: tuple, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # the ranks share the machine's cores
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    result = fn(rank, world_size, *args)
    if rank == 0:
        queue.put(result)
    dist.destroy_process_group()


def run_on_ranks(world_size: int, fn, *args):
    """Run module-level `fn(rank, world_size, *args)` on `world_size` spawned gloo ranks; return rank 0's result
    (plain Python values: they are pickled by value)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_rank_entry, args=(r, world_size, port, fn, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    result = queue.get(timeout=3600)
    for p in procs:
        p.join()
    return result


def longest_sequence(rank: int, cp: int, args: argparse.Namespace):
    model = build_model(get_preset("tiny"), seed=0)
    if cp > 1:
        apply_context_parallel(model, dist.group.WORLD)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    budget = args.budget_mib * MIB
    measured: dict[int, tuple[int, float]] = {}

    def fits(seq_len: int) -> bool:
        measured[seq_len] = busiest_rank_bytes(model, optimizer, seq_len, rank, cp)
        return measured[seq_len][0] <= budget

    fixed = busiest_rank_bytes(model, optimizer, args.fixed_seq, rank, cp)
    low, high = 0, args.start_seq * cp
    while fits(high):  # doubling
        low, high = high, 2 * high
    while high - low > args.granularity:  # bisection on multiples of the granularity
        mid = (low + high) // 2 // args.granularity * args.granularity
        low, high = (mid, high) if fits(mid) else (low, mid)
    return cp, fixed, low, measured


def run_cp(cp: int, args: argparse.Namespace):
    result = run_on_ranks(cp, longest_sequence, args)
    if result[2] == 0:
        raise SystemExit(f"not even {args.start_seq * cp} tokens fit in {args.budget_mib:g} MiB with cp = {cp}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--budget-mib", type=float, default=64.0, help="saved activation bytes per rank")
    parser.add_argument("--fixed-seq", type=int, default=4096)
    parser.add_argument("--start-seq", type=int, default=512, help="first length tried, times cp")
    parser.add_argument("--granularity", type=int, default=128)
    args = parser.parse_args()
    cfg = get_preset("tiny")
    print(f"model tiny ({cfg.n_layers} layers, hidden {cfg.hidden}, {cfg.n_heads} heads / {cfg.n_kv_heads} kv), "
          f"fp32, 1 sequence, CPU gloo, torch {torch.__version__}; budget {args.budget_mib:g} MiB of saved "
          f"activations per rank")
    rows = [run_cp(cp, args) for cp in args.cps]
    print(f"\nsaved activation MiB per rank at seq {args.fixed_seq}:")
    print("  cp   MiB/rank   x cp=1   step s")
    base = rows[0][1][0]
    for cp, (saved, seconds), _, _ in rows:
        print(f"  {cp:>2}   {saved / MIB:8.2f}   {saved / base:6.3f}   {seconds:6.2f}")
    print(f"\nlongest sequence that trains one step within {args.budget_mib:g} MiB per rank:")
    print("  cp   longest seq   MiB/rank there   x cp=1")
    base_len = rows[0][2]
    for cp, _, longest, measured in rows:
        print(f"  {cp:>2}   {longest:>11}   {measured[longest][0] / MIB:14.2f}   {longest / base_len:6.2f}")


if __name__ == "__main__":
    main()
