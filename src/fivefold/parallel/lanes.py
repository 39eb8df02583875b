"""Two pieces of work run as two lanes that take turns at their collectives: one's communication under the other's
compute (DualPipeV's overlapped forward and backward of two micro-batches, `pipeline.PipelineExecutor`).

`run_pair(first, second)` runs `first` in the calling thread and `second` in a worker thread, one at a time: a
baton says which lane may run. The first lane starts. A lane keeps the baton until it needs the result of a
collective it launched (`wait(work)`, or `collective(...)`, which launches asynchronously and waits): it hands the
baton to the other lane and takes it back when that lane waits for a collective of its own, or ends. So while one
lane's collective is in flight, the other lane computes.

Why this is safe on a backend that orders a communicator's collectives by issue order (NCCL): the lanes switch only
at `wait`, a point of the program, never on time or on what another rank does, and only one lane runs at a time, so
the interleaving of the two lanes' collectives is a function of the program. Every rank of a group runs the same
program on data of the same shapes, so every rank issues the group's collectives in the same order, as in a run
without lanes; only that order differs from the sequential one. Collectives launched outside `wait` and
`collective` (the data-parallel gradient hooks' asynchronous reductions) are still issued at points of the program.

Outside `run_pair` both functions are the plain synchronous calls. Where a piece of autograd's backward runs in
another thread (an accelerator's autograd worker), the lane is whichever holds the baton: only one lane's code runs
at a time, so the code that reaches `wait` is always the holder's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


class _Baton:
    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.holder = 0
        self.done = [False, False]
        self.switches = 0  # hand-overs so far (tests)

    def switch(self) -> None:
        """The holder hands the baton to the other lane (unless that one has ended) and waits to get it back."""
        with self.cond:
            me = self.holder
            if self.done[1 - me]:
                return
            self.holder = 1 - me
            self.switches += 1
            self.cond.notify_all()
            self.cond.wait_for(lambda: self.holder == me)

    def start(self, lane: int) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.holder == lane)

    def end(self, lane: int) -> None:
        with self.cond:
            self.done[lane] = True
            self.holder = 1 - lane
            self.cond.notify_all()


_ACTIVE: _Baton | None = None


def active() -> bool:
    """Whether two lanes are running (collectives then launch asynchronously and hand the baton over). Inside a
    compiled graph never: what it traces stays the plain synchronous collective, and the lanes do not switch
    there."""
    return _ACTIVE is not None and not torch.compiler.is_compiling()


def wait(work: dist.Work | None) -> None:
    """Wait for `work` (None: nothing); in a pair of lanes, first let the other lane run until it waits too."""
    if active():
        _ACTIVE.switch()
    if work is not None:
        work.wait()


def collective(launch: Callable[..., dist.Work | None], *args: Any, **kwargs: Any) -> None:
    """`launch(*args, **kwargs)`, a `torch.distributed` collective, synchronously; in a pair of lanes launched
    asynchronously and waited for through `wait`."""
    if not active():
        launch(*args, **kwargs)
    else:
        wait(launch(*args, async_op=True, **kwargs))


def run_pair(first: Callable[[], Any], second: Callable[[], Any]) -> tuple[Any, Any]:
    """Run `first` (in this thread) and `second` (in a worker thread) as two lanes; their results. An exception
    in either is raised here once both have ended."""
    global _ACTIVE
    if _ACTIVE is not None:
        raise RuntimeError("lanes.run_pair inside a running pair")
    baton = _Baton()
    results: list[Any] = [None, None]
    errors: list[BaseException | None] = [None, None]

    # the worker runs on the caller's accelerator and stream (both are per thread), as its autograd does
    on = torch.accelerator.is_available()
    device, stream = (torch.accelerator.current_device_index(), torch.accelerator.current_stream()) if on else (
        None, None)

    def lane(index: int, work: Callable[[], Any]) -> None:
        if index:
            if device is not None:
                torch.accelerator.set_device_index(device)
                torch.accelerator.set_stream(stream)
            baton.start(index)
        try:
            results[index] = work()
        except BaseException as e:  # raised in the caller's thread below
            errors[index] = e
        finally:
            baton.end(index)

    _ACTIVE = baton
    worker = threading.Thread(target=lane, args=(1, second), name="fivefold-lane", daemon=True)
    try:
        worker.start()
        lane(0, first)
        worker.join()
    finally:
        _ACTIVE = None
    totals["pairs"] += 1
    totals["switches"] += baton.switches
    for error in errors:
        if error is not None:
            raise error
    return results[0], results[1]


totals = {"pairs": 0, "switches": 0}  # pairs run and hand-overs in this process (tests, benchmarks)
