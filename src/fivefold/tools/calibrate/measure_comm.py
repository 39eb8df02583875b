"""Communication measurements of `fivefold calibrate`: collectives by kind, group size and message bytes, how much
of an all-reduce hides behind compute, what a blocking collective or a posted ring shift costs beyond its own
time when ranks compute between calls, and the fixed cost of a ZeRO-3 unit."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fivefold.models.llama import Block, rope_cos_sin
from fivefold.parallel.tensor_comm import all_gather_into, reduce_scatter_into
from fivefold.planner.hardware import loglog
from fivefold.tools.calibrate.harness import Clock, RankGroups, Say, size_text
from fivefold.tools.calibrate.targets import KIB, Plan


def compute_burst(clock: Clock, dtype: torch.dtype) -> Callable[[], None]:
    """A few milliseconds of matmuls: the compute that ranks do between communications in the wait timings."""
    a = torch.randn(128, 384, device=clock.device, dtype=dtype)
    b = torch.randn(384, 128, device=clock.device, dtype=dtype)

    def compute() -> None:
        for _ in range(16):
            a @ b

    return compute


def measure_collectives(clock: Clock, groups: RankGroups, plan: Plan, say: Say,
                        reverse: bool = False) -> dict[str, dict[int, list]]:
    """Seconds per call by kind, group size and message bytes (the buffer each rank contributes for all-reduce
    and all-to-all, the full buffer for all-gather and reduce-scatter, one message for send/recv)."""
    out: dict[str, dict[int, list]] = {k: {} for k in plan.kinds}
    device, world, rank = clock.device, groups.world, groups.rank
    for size, group in groups.by_size.items():
        peer = rank ^ 1  # send/recv between neighbours
        for kind in plan.kinds:
            if kind == "p2p" and size != 2:
                continue
            rows = []
            for nbytes in plan.message_bytes[::-1] if reverse else plan.message_bytes:
                numel = max(size, nbytes // 4 // size * size)
                full = torch.zeros(numel, device=device)
                part = torch.zeros(numel // size, device=device)
                other = torch.zeros(numel, device=device)
                call: Callable[[], object]
                if kind == "all_reduce":
                    def call(full=full, group=group):
                        return dist.all_reduce(full, group=group)
                elif kind == "all_gather":
                    def call(full=full, part=part, group=group):
                        return all_gather_into(full, part, group=group)
                elif kind == "reduce_scatter":
                    def call(full=full, part=part, group=group):
                        return reduce_scatter_into(part, full, group=group)
                elif kind == "all_to_all":
                    def call(full=full, other=other, group=group):
                        return dist.all_to_all_single(other, full, group=group)
                else:
                    def call(full=full, peer=peer):  # one message each way: half the round trip
                        if rank % 2 == 0:
                            dist.send(full, peer)
                            dist.recv(full, peer)
                        else:
                            dist.recv(full, peer)
                            dist.send(full, peer)
                seconds = clock.time(call)[0]
                rows.append([numel * 4, seconds / 2 if kind == "p2p" else seconds])
            out[kind][size] = sorted(rows)  # every rank holds the same figures (see `Clock.time`)
        say(f"collectives over groups of {size} of {world} ranks: all-reduce " + ", ".join(
            f"{size_text(int(b))} {1e3 * s:.3g} ms" for b, s in out['all_reduce'][size]))
    return {k: v for k, v in out.items() if v}


def monotone(rows: list[list[float]]) -> list[list[float]]:
    """(bytes, seconds) rows with each time no longer than any larger message's: a smaller message cannot take
    longer, so a slower figure is noise (a burst of other work, a first call)."""
    out = [list(r) for r in rows]
    for i in range(len(out) - 2, -1, -1):
        out[i][1] = min(out[i][1], out[i + 1][1])
    return out


def measure_zero3_unit(clock: Clock, model, collectives: dict, say: Say) -> float:
    """Seconds per micro-batch that one ZeRO-3 unit (`fully_shard` around a block of `model`, as the engine
    wraps each block) costs beyond its two all-gathers and one reduce-scatter: hooks, copies in and out, frees.
    A block on 8 tokens, sharded over all ranks, against the same block unsharded; the collectives of the
    block's bytes (from this calibration's tables) are subtracted."""
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    def build() -> nn.Module:
        torch.manual_seed(0)
        block = Block(model).to(clock.device)
        block.attn.core = lambda q, k, v, mask=None: F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
        return block

    class Root(nn.Module):  # the engine's root unit around the whole micro-batch (it holds no parameters here)
        def __init__(self, block: nn.Module) -> None:
            super().__init__()
            self.block = block

        def forward(self, *args: torch.Tensor) -> torch.Tensor:
            return self.block(*args)

    plain, sharded = build(), build()
    root = Root(sharded)
    mesh = DeviceMesh.from_group(dist.group.WORLD, clock.device.type)
    unit, outer = fully_shard(sharded, mesh=mesh), fully_shard(root, mesh=mesh)
    for u in (unit, outer):
        u.set_gradient_divide_factor(1.0)
        u.set_force_sum_reduction_for_comms(True)
    x = torch.randn(1, 8, model.hidden, device=clock.device, requires_grad=True)
    cos, sin = rope_cos_sin(model, torch.arange(8, device=clock.device))

    def step(module: nn.Module) -> Callable[[], None]:
        def run() -> None:
            module(x, cos, sin).sum().backward()
        return run

    t_plain, t_sharded = clock.time(step(plain), step(root))
    nbytes = sum(p.numel() for p in plain.parameters()) * 4
    world = dist.get_world_size()

    def table(kind: str) -> float:
        rows = collectives.get(kind, {}).get(world)
        if not rows:
            return 0.0
        return loglog(tuple((b, sec) for b, sec in rows), nbytes)

    overhead = max(0.0, t_sharded - t_plain - 2 * table("all_gather") - table("reduce_scatter"))
    say(f"ZeRO-3 unit: {1e3 * (t_sharded - t_plain):.2f} ms per micro-batch with its collectives, "
        f"{1e3 * overhead:.2f} ms beyond them")
    return overhead


def measure_collective_wait(clock: Clock, groups: RankGroups, dtype: torch.dtype, say: Say) -> list[list[float]]:
    """Seconds a blocking collective costs beyond its own time when the ranks compute between calls, as in a
    training step, by group size: a rank reaching the collective waits for its peers, which on shared cores may
    not be running at that moment. (compute, then a 64 KiB all-reduce) - compute alone - the all-reduce alone."""
    compute = compute_burst(clock, dtype)
    buffer = torch.zeros(16 * KIB, device=clock.device)
    rows = []
    for size, group in groups.by_size.items():
        def communicate(group=group) -> None:
            dist.all_reduce(buffer, group=group)

        def both(group=group) -> None:
            compute()
            dist.all_reduce(buffer, group=group)

        t_compute, t_comm, t_both = clock.time(compute, communicate, both)
        rows.append([size, max(t_both - t_compute - t_comm, 1e-7)])
    say("collective wait between compute: " + ", ".join(f"groups of {int(n)} {1e3 * w:.2f} ms" for n, w in rows))
    return rows


def measure_posted_p2p_wait(clock: Clock, groups: RankGroups, dtype: torch.dtype, say: Say) -> float:
    """Seconds a ring shift posted before compute and waited for after it (context parallel's K/V transfers)
    adds beyond the compute and its own time: on shared cores the transfer progresses only when the
    communication thread gets a core. (post a 128 KiB shift around all ranks, compute, wait) - compute - the
    shift alone."""
    compute = compute_burst(clock, dtype)
    send = torch.zeros(32 * KIB, device=clock.device)
    received = torch.empty_like(send)
    world, rank = groups.world, groups.rank

    def post() -> list:
        return dist.batch_isend_irecv([dist.P2POp(dist.isend, send, (rank + 1) % world),
                                       dist.P2POp(dist.irecv, received, (rank - 1) % world)])

    def shift() -> None:
        for work in post():
            work.wait()

    def both() -> None:
        works = post()
        compute()
        for work in works:
            work.wait()

    t_compute, t_shift, t_both = clock.time(compute, shift, both)
    wait = max(t_both - t_compute - t_shift, 0.0)
    say(f"ring shift posted before compute: {1e3 * wait:.2f} ms beyond compute {1e3 * t_compute:.2f} ms and the "
        f"shift alone {1e3 * t_shift:.2f} ms")
    return wait


def measure_overlap(clock: Clock, dtype: torch.dtype, say: Say) -> float:
    """Share of an all-reduce over all ranks that hides behind matmuls running at the same time: (compute +
    communication - both at once) / the shorter of the two, in [0, 1]."""
    a = torch.randn(256, 256, device=clock.device, dtype=dtype)
    buffer = torch.zeros(2**20, device=clock.device)

    def compute() -> None:
        for _ in range(8):
            a @ a

    def communicate() -> None:
        dist.all_reduce(buffer)

    def both() -> None:
        work = dist.all_reduce(buffer, async_op=True)
        compute()
        work.wait()

    t_compute, t_comm, t_both = clock.time(compute, communicate, both)
    overlap = (t_compute + t_comm - t_both) / max(min(t_compute, t_comm), 1e-12)
    overlap = min(1.0, max(0.0, overlap))
    say(f"overlap of an all-reduce with compute: {overlap:.2f} (compute {1e3 * t_compute:.2f} ms, all-reduce "
        f"{1e3 * t_comm:.2f} ms, both {1e3 * t_both:.2f} ms)")
    return overlap
