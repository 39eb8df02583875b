"""Where pipeline parallel talks to other ranks: point-to-point sends between neighbouring stages on the pp group.

What is communicated: the forward pass F(i, s) sends its output activations (this rank's [micro-batch, local
sequence, hidden]) to the rank of stage s + 1; the backward pass B(i, s) sends the gradient with respect to its
input to the rank of stage s - 1. Nothing else: weights never move. Between two stages on the same rank (the
turn of the V in DualPipeV) the tensor is handed over locally by the executor, not sent.

Ordering. Every rank knows every rank's action list (they come from `schedules.build_schedule`), so it knows
every message of the step, who sends it and when, before the step starts; shapes are known too, so receive
buffers are allocated up front. The messages of each pair of ranks are put in one global order, the order in
which the schedule's simulation (`schedules.simulate`) produces them, ties broken by the sending rank. Both ranks
of a pair issue their sends and receives in that order, with the message's position in it as the tag. This
matters on NCCL, where the sends and receives of a pair of ranks run in issue order on one stream: if one rank
issued "send x, receive y" and its neighbour "send y, receive x", both streams would wait forever. The order is
causal (a message a rank needs before it can produce another comes first in the simulation too), so a rank never
has to issue a send it has not produced yet. Receives are posted as early as that order allows: before every
action, each pair's receives are posted up to the next send of that pair, so transfers overlap with compute.
Sends are asynchronous and waited for at the end of the step.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from fivefold.parallel.schedules import Schedule, simulate


@dataclass(frozen=True)
class Message:
    """The activation (`kind` "F", to stage + 1) or input gradient (`kind` "B", to stage - 1) that action
    (kind, micro_batch, stage) produces, from pp rank `src` to pp rank `dst`."""

    kind: str
    micro_batch: int
    stage: int
    src: int
    dst: int

    @property
    def key(self) -> tuple[str, int, int]:
        return self.kind, self.micro_batch, self.stage


def consumer_stage(kind: str, stage: int) -> int:
    """The stage that consumes what action (kind, stage) produces."""
    return stage + 1 if kind == "F" else stage - 1


@lru_cache(maxsize=64)
def message_plan(schedule: Schedule) -> tuple[Message, ...]:
    """Every message that crosses ranks in one step of `schedule`, in the global order described above (built
    once per schedule: every step of a run replays the same plan)."""
    sim = simulate(schedule, t_f=1.0, t_b=1.0, t_w=1.0)
    n, where = schedule.n_stages, schedule.stage_rank
    messages = []
    for acts in schedule.actions:
        for a in acts:
            if a.kind == "W" or (a.kind == "F" and a.stage == n - 1) or (a.kind == "B" and a.stage == 0):
                continue
            src, dst = where[a.stage], where[consumer_stage(a.kind, a.stage)]
            if src != dst:
                messages.append(Message(a.kind, a.micro_batch, a.stage, src, dst))
    return tuple(sorted(messages, key=lambda m: (sim.end[m.key], m.src, m.kind, m.micro_batch, m.stage)))


class PointToPoint:
    """The sends and receives of one pp rank for one step of `schedule`; every tensor has `shape` and `dtype`.

    `send(key, tensor)` and `receive(key)` take the producing action's (kind, micro-batch, stage)."""

    def __init__(self, schedule: Schedule, rank: int, group: ProcessGroup, shape: tuple[int, ...],
                 dtype: torch.dtype, device: torch.device) -> None:
        self.group, self.rank, self.shape, self.dtype, self.device = group, rank, shape, dtype, device
        self.ops: dict[int, list[Message]] = {}  # peer -> this pair's messages in the global order
        for msg in message_plan(schedule):
            if self.rank in (msg.src, msg.dst):
                self.ops.setdefault(msg.dst if msg.src == self.rank else msg.src, []).append(msg)
        self.position = dict.fromkeys(self.ops, 0)
        self.tags = {(peer, msg.key): tag for peer, msgs in self.ops.items() for tag, msg in enumerate(msgs)}
        self.pending: dict[tuple[str, int, int], tuple[dist.Work, torch.Tensor]] = {}
        self.sends: list[tuple[dist.Work, torch.Tensor]] = []

    def _post_until(self, peer: int, stop: tuple[str, int, int] | None) -> None:
        """Post this pair's receives in order, up to the next send (or up to and including the send `stop`)."""
        msgs, pos = self.ops[peer], self.position[peer]
        while pos < len(msgs) and msgs[pos].dst == self.rank:
            msg = msgs[pos]
            buffer = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            work = dist.irecv(buffer, group=self.group, group_src=peer, tag=pos)
            self.pending[msg.key] = (work, buffer)
            pos += 1
        self.position[peer] = pos
        if stop is not None:
            if pos >= len(msgs) or msgs[pos].key != stop:
                raise RuntimeError(f"pipeline send {stop} to rank {peer} is out of the planned order "
                                   f"(next planned: {msgs[pos].key if pos < len(msgs) else None})")
            self.position[peer] = pos + 1

    def post_receives(self) -> None:
        """Post every receive that the order allows now, and let go of the sends that have completed (called before
        each action, so that a sent tensor is not held to the end of the step)."""
        self.sends = [(work, tensor) for work, tensor in self.sends if not work.is_completed()]
        for peer in self.ops:
            self._post_until(peer, None)

    def send(self, key: tuple[str, int, int], tensor: torch.Tensor, peer: int) -> None:
        self._post_until(peer, key)
        tensor = tensor.detach().contiguous()
        self.sends.append((dist.isend(tensor, group=self.group, group_dst=peer, tag=self.tags[(peer, key)]), tensor))
        self._post_until(peer, None)

    def receive(self, key: tuple[str, int, int], peer: int) -> torch.Tensor:
        if key not in self.pending:
            self._post_until(peer, None)
        if key not in self.pending:
            raise RuntimeError(f"pipeline message {key} from rank {peer} is needed before the planned order "
                               "allows its receive: the schedule is not causal")
        work, buffer = self.pending.pop(key)
        work.wait()
        return buffer

    def finish(self) -> None:
        """Wait for the outstanding sends; every planned message must have been exchanged."""
        for work, _ in self.sends:
            work.wait()
        self.sends.clear()
        left = [peer for peer, msgs in self.ops.items() if self.position[peer] != len(msgs)]
        if left or self.pending:
            raise RuntimeError(f"pipeline step ended with messages not exchanged (peers {left}, "
                               f"received but unused {sorted(self.pending)})")
