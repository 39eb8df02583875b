"""What stops a run early: a streak of non-finite steps, or SIGTERM / SIGINT.

The engine skips a step whose loss or gradient norm is not finite on any rank (on the device, see
`Engine.step_guarded`) and reports [skipped, stop asked] with the same values on every rank. `StepGuard` keeps, on
the device, the length of the current streak of skipped steps, their total and whether a stop was asked; the host
reads them at the steps where it synchronises anyway (logging, checkpoints, the last step), and at every other step
the values of the step before, so it never waits for the step in flight. Every rank reads the same values at the
same steps, so every rank stops at the same step.

`StopSignals` turns the first SIGTERM, SIGINT or SIGHUP into a request that the loop answers after its current step
(write a checkpoint, exit with 128 + the signal's number); a second one of them abandons the step or the save at once
(`faults.SaveAbandoned`).
"""

from __future__ import annotations

import signal
import threading
from collections import deque
from dataclasses import dataclass
from types import FrameType

import torch

from fivefold.faults import SaveAbandoned, quiet_hung_up_terminal


@dataclass
class GuardState:
    step: int  # the step these counts are after
    bad_run: int  # steps skipped in a row up to `step`
    skipped: int  # steps skipped in all
    stop_asked: bool  # a stop signal reached some rank


class StepGuard:
    def __init__(self, device: torch.device, skipped_before: int = 0) -> None:
        self.device = device
        self.counts = torch.tensor([0, skipped_before, 0], dtype=torch.int64, device=device)
        # this rank's part of the mean train loss of the last step that updated, and that step (on the device)
        self.last_loss = torch.full((), float("nan"), device=device)
        self.last_step = torch.zeros((), dtype=torch.int64, device=device)
        self.pending: deque[tuple[int, torch.Tensor, torch.Event | None]] = deque(maxlen=2)

    def update(self, step: int, flags: torch.Tensor, loss: torch.Tensor) -> None:
        """Add step `step`'s flags [skipped, stop asked] (device tensor) and this rank's part of its mean loss, and
        start copying the counts to the host."""
        f = flags.to(torch.int64)
        self.last_loss = torch.where(f[0] > 0, self.last_loss, loss.detach().float())
        self.last_step = torch.where(f[0] > 0, self.last_step, step)
        self.counts = torch.stack([(self.counts[0] + f[0]) * f[0], self.counts[1] + f[0],
                                   torch.maximum(self.counts[2], f[1])])
        if self.device.type == "cpu":
            self.pending.append((step, self.counts.clone(), None))
            return
        host = torch.empty(3, dtype=torch.int64, pin_memory=True)
        host.copy_(self.counts, non_blocking=True)
        event = torch.Event(device=self.device)
        event.record()
        self.pending.append((step, host, event))

    def read(self, current: bool) -> GuardState | None:
        """The counts after the newest step (`current`: waits for it) or after the one before (waits for that one
        only); None before the first step."""
        if not self.pending or (not current and len(self.pending) < 2):
            return None
        step, host, event = self.pending[-1] if current else self.pending[0]
        if event is not None:
            event.synchronize()
        bad_run, skipped, stop = (int(v) for v in host.tolist())
        return GuardState(step, bad_run, skipped, bool(stop))


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class StopSignals:
    """While active (a context manager), the first SIGTERM, SIGINT or SIGHUP sets `asked` (and `name`) instead of
    killing the process; a second one raises `faults.SaveAbandoned`. After SIGHUP (a closed terminal) output to the
    terminal goes to /dev/null. Only installs handlers in the main thread."""

    def __init__(self) -> None:
        self.asked = False
        self.name = ""
        self.number = 0
        self.previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGHUP:
            quiet_hung_up_terminal()
        if self.asked:
            raise SaveAbandoned(signum)
        self.asked, self.number, self.name = True, signum, signal.Signals(signum).name

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                self.previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        self.previous.clear()
