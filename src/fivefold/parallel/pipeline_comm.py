"""Where pipeline parallel talks to other ranks: point-to-point sends between neighbouring stages on the pp group.

What is communicated: the forward pass F(i, s) sends its output activations (this rank's [micro-batch, local
sequence, hidden]) to the rank of stage s + 1; the backward pass B(i, s) sends the gradient with respect to its
input to the rank of stage s - 1. Nothing else: weights never move. Between two stages on the same rank (the
turn of the V in DualPipeV) the tensor is handed over locally by the executor, not sent. Tensors travel in the
compute dtype, the dtype of the activations the stages produce (the executor's `dtype`; a tensor of another dtype
is refused, never cast silently).

Ordering. Every rank knows every rank's action list (they come from `schedules.build_schedule`), so it knows
every message of the step, who sends it and when, before the step starts; shapes are known too, so receive
buffers are allocated up front. All the messages of the step are put in one global order, the order in which the
schedule's simulation (`schedules.simulate`) produces them, ties broken by the sending rank (`message_plan`).
Each rank posts its own sends and receives, to and from every peer, in that global order, as one
`batch_isend_irecv` per action (`posting_plan`): before the first action, the receives that come before its first
send; after each action that sends, its send together with the receives that follow it in the order, up to the
next send (usually including the next action's input, as Megatron's send-forward-receive-backward does). An
action that sends nothing posts nothing. A fused pair (DualPipeV's F and B run as two lanes, `Schedule.fused`) is
one unit, with its B's W where that comes next (`Schedule.unit`): both its inputs are posted before it, nothing
after its F (nor after its B when its W follows), and both its sends (in the global order, where the simulation
puts both at the pair's end) with the receives that follow after its last action.
Each operation of a batch is launched as a unit of its own (its own `batch_isend_irecv`, in the batch's order), so
that every receive has its own handle on every backend: a receive is waited for just before the action that needs
it, alone. A batch launched as one unit would have one handle on NCCL (one group), and waiting for an action's
input would then wait for every later message posted with it: a rank of AFAB or 1F1B whose first batch holds the
receives of several forwards would start only once the last of them had arrived, which serialised the stages
(the bubble of `benchmarks/pipeline_bubble.py`, pp 2 over 4 micro-batches: 1.01 instead of 0.25 under AFAB,
0.51 under 1F1B). Sends are waited for at the end of the step. Under `layout.pp_comm_overlap` (the default) a
whole backward (the schedules without a B / W split) also posts its batch once its input gradient exists, before
it computes its weight gradients, which its stage defers as a split schedule's W pass: the peer's backward starts
meanwhile. Only the moment of posting moves, never the order, so the argument below holds for both.

Why this cannot deadlock on a backend that runs a rank's point-to-point operations in issue order on one stream
(NCCL on one communicator: each unit launches after the one before it has completed; each send completes only
when the peer's matching receive is running, and the operations between one pair in one direction match in issue
order, tags ignored).
Take the earliest message in the global order that has not completed. Both its ranks have posted it: a rank posts
everything up to the receive it waits for, and a send is posted right after the action that produces it; the
order is causal (a message that an action needs is produced before any message that the action, or a later
action of the same rank, produces), so a rank is never stuck before posting an earlier message. Every unit
ahead of it in either rank's stream holds an earlier message, which has completed, so both units are at the
heads of their streams, the message matches, and the step moves on (no group is needed for this: the global
order, not a group, keeps two ranks from each sending first). The old posting (receives per pair of ranks
up to that pair's next send, each operation alone) lets rank 0 of the interleaved schedule with pp >= 3 queue a
receive from the last rank ahead of its first send to rank 1, and every rank waits forever.
tests/test_pipeline_p2p_replay.py replays every schedule under a model of such a backend, for both postings.

Communicators. The argument holds on one communicator, but there an operation may queue behind another edge's:
a middle rank's receive from its left neighbour waits, on the one stream, for its send to the right to be
received, though nothing in the schedule links the two. So training gives each edge direction a communicator of
its own (`edge_channel`: one per direction and class of neighbour pairs, so 2 for pp = 2, 4 beyond, 6 for an odd
interleaved pipeline, each with the pp group's members; `mesh.ProcessGrid.pp_channels`): on each, a rank only sends
to one peer or only receives from one, in the global order, and the argument above holds per communicator (the
earliest incomplete message is at the head of its edge's stream on both sides). In the replay model's timing
(`benchmarks/pipeline_streams.py`) one communicator makes the interleaved schedule 7-9 % slower than its dependencies
allow when a transfer takes 5 % of a forward and 31-34 % at 20 %; per-edge communicators make it 0-0.2 % and 4-6 %.

NCCL needs the first call on a group to involve every rank of it unless its communicator is initialised eagerly
(`init_process_group(device_id=...)`); the first batch of a step involves only some ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
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


def pair_class(i: int, p: int) -> int:
    """The class of neighbour pair i (pp ranks i and i + 1 mod p): pairs of one class share no rank (0 and 1
    alternate; the wrap-around pair (p - 1, 0) of an odd p is class 2)."""
    return 2 if i == p - 1 and p % 2 == 1 else i % 2


def edge_channel(src: int, dst: int, p: int) -> int:
    """Which of the pipeline's point-to-point communicators carries the messages from pp rank `src` to `dst`, two
    neighbours (the wrap-around pair p - 1 and 0 only under the interleaved schedule): one per direction and class
    of pairs (`pair_class`), so that no rank has two edges on one channel. Each of a rank's communicators then holds
    one edge's messages in one direction, the sends on the sender and the receives on the receiver."""
    if dst == src + 1:
        i, up = src, True
    elif dst == src - 1:
        i, up = dst, False
    elif (src, dst) == (p - 1, 0):
        i, up = p - 1, True
    elif (src, dst) == (0, p - 1):
        i, up = p - 1, False
    else:
        raise ValueError(f"pp ranks {src} and {dst} of {p} are not neighbours; pipeline messages go between "
                         "neighbouring stages only")
    return 2 * pair_class(i, p) + (0 if up else 1)


def channel_count(p: int, wrap: bool) -> int:
    """How many point-to-point communicators a pipeline of p ranks uses (`edge_channel`): 2 for p = 2, 4 beyond,
    6 for an odd p whose schedule wraps from the last rank to the first (`wrap`, the interleaved schedule)."""
    if p < 2:
        return 0
    return 2 if p == 2 else 6 if wrap and p % 2 == 1 else 4


def remote_input(schedule: Schedule, action) -> tuple[str, int, int] | None:
    """The message (its producing action's key) that `action` receives from another rank before it runs, or None
    (it starts from the tokens or its loss, or its input is handed over on its own rank)."""
    kind, mb, s = action
    if kind == "W" or (kind == "F" and s == 0) or (kind == "B" and s == schedule.n_stages - 1):
        return None
    producer = s - 1 if kind == "F" else s + 1
    return (kind, mb, producer) if schedule.stage_rank[producer] != schedule.stage_rank[s] else None


@lru_cache(maxsize=256)
def channels_needed(schedule: Schedule) -> int:
    """How many point-to-point communicators the messages of `schedule` use (`edge_channel`): the highest one + 1."""
    return max((edge_channel(m.src, m.dst, schedule.p) + 1 for m in message_plan(schedule)), default=0)


@dataclass(frozen=True)
class Op:
    """One side of a message: this rank sends it (`send`) or receives it; `tag` is its place in the global order
    (backends that match by tag, like gloo, use it; NCCL matches by issue order, which the plan keeps)."""

    send: bool
    message: Message
    tag: int
    channel: int  # the communicator it goes on (`edge_channel`), worked out once with the plan

    def peer(self) -> int:
        return self.message.dst if self.send else self.message.src


@lru_cache(maxsize=256)
def posting_plan(schedule: Schedule, rank: int) -> tuple[tuple[Op, ...], ...]:
    """What pp rank `rank` posts as one batch before its first action (item 0) and after each of its actions
    (item k + 1 after action k); an empty batch posts nothing. Raises if the order is not causal (a send would have
    to be posted before the action producing it ran, or an action's input would not be posted before it)."""
    ops = [Op(m.src == rank, m, tag, edge_channel(m.src, m.dst, schedule.p))
           for tag, m in enumerate(message_plan(schedule)) if rank in (m.src, m.dst)]
    pos = 0

    def receives() -> list[Op]:
        nonlocal pos
        out = []
        while pos < len(ops) and not ops[pos].send:
            out.append(ops[pos])
            pos += 1
        return out

    batches = [tuple(receives())]
    posted = {op.message.key for op in batches[0]}
    where, last = schedule.stage_rank, schedule.n_stages - 1
    actions, fused = schedule.actions[rank], schedule.fused_at(rank)
    k = 0
    while k < len(actions):
        group = schedule.unit(rank, k, fused)  # a fused pair (with its B's W): both inputs before it
        for action in group:
            needed = remote_input(schedule, action)
            if needed is not None and needed not in posted:
                raise RuntimeError(f"pipeline schedule {schedule.name}: rank {rank}'s action {tuple(action)} "
                                   f"needs message {needed} before the global order lets it be posted")
        sends = {tuple(a) for a in group if a.kind != "W" and not (a.kind == "F" and a.stage == last)
                 and not (a.kind == "B" and a.stage == 0) and where[consumer_stage(a.kind, a.stage)] != rank}
        batch: list[Op] = []
        while sends:  # the group's sends are the next messages of the global order (a pair's: in either order)
            if pos >= len(ops) or not ops[pos].send or ops[pos].message.key not in sends:
                raise RuntimeError(f"pipeline schedule {schedule.name}: rank {rank}'s sends {sorted(sends)} are "
                                   f"out of the global order (next planned: "
                                   f"{ops[pos].message.key if pos < len(ops) else None})")
            sends.discard(ops[pos].message.key)
            batch.append(ops[pos])
            pos += 1
        if batch:
            batch += receives()
        posted.update(op.message.key for op in batch)
        batches += [()] * (len(group) - 1)  # after a pair's F (and B, if its W follows): nothing, all leave at its end
        batches.append(tuple(batch))
        k += len(group)
    if pos != len(ops):
        raise RuntimeError(f"pipeline schedule {schedule.name}: rank {rank} never posts {ops[pos].message}")
    return tuple(batches)


class PointToPoint:
    """The sends and receives of one pp rank for one step of `schedule`; every tensor has `shape` and `dtype`.

    The executor calls `post(k, sent)` before its first action (k = 0, nothing sent) and after each action
    (k = index + 1, with what that action sends, keyed by the producing action (kind, micro-batch, stage)), and
    `receive(key)` for an action's input."""

    def __init__(self, schedule: Schedule, rank: int, group: ProcessGroup, shape: tuple[int, ...],
                 dtype: torch.dtype, device: torch.device, channels: Sequence[ProcessGroup] = ()) -> None:
        self.group, self.rank, self.shape, self.dtype, self.device = group, rank, shape, dtype, device
        self.plan = posting_plan(schedule, rank)
        # each edge's messages on its own communicator (`Op.channel`; each has the pp group's members in its
        # order), or all on `group`
        self.channels = tuple(channels)
        if self.channels and channels_needed(schedule) > len(self.channels):
            raise ValueError(f"pipeline rank {rank}: schedule {schedule.name} over {schedule.p} ranks needs "
                             f"{channels_needed(schedule)} point-to-point communicators (`edge_channel`), got "
                             f"{len(self.channels)}")
        self.batches: dict[int, tuple[list[dist.Work], list[torch.Tensor]]] = {}  # in flight: works, sent tensors
        # key -> (batch, buffer, the receive's own handle)
        self.received: dict[tuple[str, int, int], tuple[int, torch.Tensor, dist.Work]] = {}

    def _group(self, op: Op) -> ProcessGroup:
        return self.channels[op.channel] if self.channels else self.group

    def post(self, index: int, sent: dict[tuple[str, int, int], torch.Tensor]) -> None:
        ops = self.plan[index]
        planned = {op.message.key for op in ops if op.send}
        if set(sent) != planned:
            raise RuntimeError(f"pipeline rank {self.rank}, batch {index}: sends {sorted(sent)} but the plan has "
                               f"{sorted(planned)}")
        self._release()
        p2p, tensors = [], []
        receives: list[tuple[tuple[str, int, int], torch.Tensor, int]] = []  # key, buffer, its place in p2p
        for op in ops:
            if op.send:
                tensor = sent[op.message.key].detach()
                if tensor.dtype != self.dtype or tuple(tensor.shape) != tuple(self.shape):
                    raise RuntimeError(f"pipeline message {op.message.key} is {tensor.dtype} {tuple(tensor.shape)}, "
                                       f"but the stages communicate {self.dtype} {tuple(self.shape)} (every "
                                       "micro-batch of one schedule the same shape, in the dtype the stages "
                                       "produce)")
                tensor = tensor.contiguous()
                tensors.append(tensor)
                p2p.append(dist.P2POp(dist.isend, tensor, group=self._group(op), tag=op.tag, group_peer=op.peer()))
            else:
                buffer = torch.empty(self.shape, dtype=self.dtype, device=self.device)
                receives.append((op.message.key, buffer, len(p2p)))
                p2p.append(dist.P2POp(dist.irecv, buffer, group=self._group(op), tag=op.tag, group_peer=op.peer()))
        if p2p:
            # each operation a unit of its own, in the plan's order: its own handle on every backend (one group of
            # several would be one handle on NCCL, and a receive would wait for the later messages posted with it)
            works = [work for op in p2p for work in dist.batch_isend_irecv([op])]
            if len(works) != len(p2p):
                raise RuntimeError(f"pipeline rank {self.rank}: {len(p2p)} point-to-point operations returned "
                                   f"{len(works)} handles")
            self.batches[index] = (works, tensors)
            for key, buffer, place in receives:
                self.received[key] = (index, buffer, works[place])

    def _release(self) -> None:
        """Let go of the sent tensors of batches that have completed."""
        for index in [i for i, (works, _) in self.batches.items() if all(w.is_completed() for w in works)]:
            self._wait(index)

    def _wait(self, index: int) -> None:
        works, _ = self.batches.pop(index, ((), ()))
        for work in works:
            work.wait()

    def receive(self, key: tuple[str, int, int]) -> torch.Tensor:
        if key not in self.received:
            raise RuntimeError(f"pipeline message {key} is needed before its receive was posted")
        index, buffer, own = self.received.pop(key)
        # not the sends posted with it: they complete when their peers get to them. Each handle is waited once (a
        # gloo receive waited again waits for a second message): taken out of its batch, unless the batch was
        # released whole already
        works = self.batches[index][0] if index in self.batches else []
        for i, work in enumerate(works):
            if work is own:
                del works[i]
                own.wait()
                break
        return buffer

    def finish(self) -> None:
        """Wait for the batches still in flight; every planned message must have been exchanged and used."""
        for index in list(self.batches):
            self._wait(index)
        if self.received:
            raise RuntimeError(f"pipeline step ended with messages received but unused: {sorted(self.received)}")
