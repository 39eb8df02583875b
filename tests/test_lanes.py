"""Two lanes taking turns at their collectives (`parallel.lanes`, DualPipeV's overlapped F and B): the interleaving
is a function of the program, real gloo collectives of both lanes give what they give run one after the other,
and every rank issues them in the same order; an error in either lane reaches the caller."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from tests.distributed import run_ranks

from fivefold.parallel import lanes


class Noted:
    """A stand-in for a collective's work that records when it is waited for."""

    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def wait(self) -> None:
        self.log.append(f"wait {self.name}")


def test_lanes_hand_over_at_each_wait_and_nowhere_else():
    """Lane 0 runs until it waits, then lane 1 until it waits, and so on; a lane that ended leaves the other to
    run on; outside a pair `wait` only waits."""
    log: list[str] = []

    def lane(name: str, waits: int):
        def run():
            for i in range(waits):
                log.append(f"{name}{i} compute")
                lanes.wait(Noted(log, f"{name}{i}"))
            log.append(f"{name} end")
            return name
        return run

    before = lanes.totals["switches"]
    assert lanes.run_pair(lane("f", 3), lane("b", 1)) == ("f", "b")
    assert log == ["f0 compute", "b0 compute", "wait f0", "f1 compute", "wait b0", "b end",
                   "wait f1", "f2 compute", "wait f2", "f end"]
    assert lanes.totals["switches"] - before == 3 and not lanes.active()
    log.clear()
    lanes.wait(Noted(log, "alone"))
    assert log == ["wait alone"]


def test_an_error_in_either_lane_is_raised_after_both_end():
    ran = []

    def bad():
        lanes.wait(None)
        raise ValueError("lane failed")

    def good():
        lanes.wait(None)
        ran.append("good")

    for pair in ((bad, good), (good, bad)):
        ran.clear()
        with pytest.raises(ValueError, match="lane failed"):
            lanes.run_pair(*pair)
        assert ran == ["good"] and not lanes.active()
    with pytest.raises(RuntimeError, match="inside a running pair"):
        lanes.run_pair(lambda: lanes.run_pair(good, good), good)


def collectives_in_lanes(rank: int, world_size: int) -> dict:
    """Each lane all-reduces and all-gathers through `lanes.collective` and `tensor_comm` (asynchronously in a pair),
    computing between; the same sequence run plainly for reference. Returns both results and the issue order."""
    from fivefold.parallel.tensor_comm import all_gather, all_reduce

    group = dist.new_group(list(range(world_size)))
    order: list[str] = []

    def lane(name: str, seed: int):
        def run():
            x = torch.full((4, 6), float(seed + rank))
            out = []
            for i in range(3):
                x = torch.tanh(x @ torch.ones(6, 6) / 6 + i)  # compute between the collectives
                order.append(f"{name} all_reduce {i}")
                x = all_reduce(x, group)
                order.append(f"{name} all_gather {i}")
                out.append(all_gather(x, 0, group))
                y = x.clone()
                lanes.collective(dist.all_reduce, y, op=dist.ReduceOp.MAX, group=group)
                x = x + y
            return torch.stack(out), x
        return run

    before = lanes.totals["switches"]
    paired = lanes.run_pair(lane("f", 1), lane("b", 7))
    switches = lanes.totals["switches"] - before
    issued = list(order)
    plain = (lane("f", 1)(), lane("b", 7)())
    return {"paired": paired, "plain": plain, "order": issued, "switches": switches}


def test_two_lanes_of_gloo_collectives_give_the_sequential_results_in_one_issue_order():
    """2 gloo ranks: a pair of lanes with 9 collectives each equals the two lanes run one after the other, bit for
    bit; the lanes did take turns (the order is not one lane then the other), and both ranks issued the collectives
    in the same order (what a backend ordering a communicator by issue order, NCCL, needs)."""
    results = run_ranks(2, collectives_in_lanes)
    for r in results:
        for got, want in zip(r["paired"], r["plain"], strict=True):
            for a, b in zip(got, want, strict=True):
                assert torch.equal(a, b)
        assert r["switches"] >= 9
        assert r["order"][:2] == ["f all_reduce 0", "b all_reduce 0"]
    assert results[0]["order"] == results[1]["order"]
