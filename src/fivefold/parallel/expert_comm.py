"""The communication of expert parallel: the all-to-all exchanges over an ep group.

`exchange_counts` tells every rank how many tokens each other rank will send to each of its experts (a fixed
size all-to-all of E integers per rank); `all_to_all` then moves the token rows themselves with uneven split
sizes (`all_to_all_single` with input and output split sizes, which gloo supports), and its backward moves
the gradients the opposite way with the splits swapped.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from fivefold.parallel import lanes


def exchange_counts(send_counts: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """`send_counts` [ep, local_experts]: rows this rank sends to each expert of each ep rank. Returns
    [ep, local_experts]: rows each ep rank sends to each expert of this rank."""
    received = torch.empty_like(send_counts)
    lanes.collective(dist.all_to_all_single, received, send_counts.contiguous(), group=group)
    return received


def _send_back(ctx, grad: torch.Tensor) -> torch.Tensor:
    """The backward of an exchange: the received rows' gradients go back to the ranks that sent the rows."""
    sent_grad = grad.new_empty(sum(ctx.send_splits), *grad.shape[1:])
    lanes.collective(dist.all_to_all_single, sent_grad, grad.contiguous(), ctx.send_splits, ctx.recv_splits,
                     group=ctx.group)
    return sent_grad


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows: torch.Tensor, send_splits: list[int], recv_splits: list[int],
                group: ProcessGroup) -> torch.Tensor:
        ctx.send_splits, ctx.recv_splits, ctx.group = send_splits, recv_splits, group
        received = rows.new_empty(sum(recv_splits), *rows.shape[1:])
        lanes.collective(dist.all_to_all_single, received, rows.contiguous(), recv_splits, send_splits, group=group)
        return received

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _send_back(ctx, grad), None, None, None


class _KeptAllToAll(torch.autograd.Function):
    """`_AllToAll` whose rows already arrived: its forward returns `kept`, the rows an earlier forward of the same
    exchange received (a selective recomputation's replay), without communicating; its backward sends the gradients
    back as `_AllToAll`'s does."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, kept: torch.Tensor, send_splits: list[int], recv_splits: list[int],
                group: ProcessGroup) -> torch.Tensor:
        ctx.send_splits, ctx.recv_splits, ctx.group = send_splits, recv_splits, group
        return kept.view_as(kept)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _send_back(ctx, grad), None, None, None, None


class _AllToAllStart(torch.autograd.Function):
    """`_AllToAll` whose forward only launches the exchange (`async_op`): the received rows are valid after
    `_AllToAllWait`. Backward exchanges the gradients synchronously: the work that autograd may run beside it
    (the shared experts' backward) can hold tensor-parallel collectives, and collectives of two communicators in
    flight at once are what NCCL does not order. (Inside a pair of lanes, DualPipeV's overlapped F and B, every
    exchange is launched asynchronously and waited for at a hand-over: there the two lanes' collectives interleave
    at points of the program, in one order on every rank, `parallel.lanes`.)"""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, send_splits: list[int], recv_splits: list[int], group: ProcessGroup,
                pending: list) -> torch.Tensor:
        ctx.send_splits, ctx.recv_splits, ctx.group = send_splits, recv_splits, group
        received = rows.new_empty(sum(recv_splits), *rows.shape[1:])
        pending.append(dist.all_to_all_single(received, rows.contiguous(), recv_splits, send_splits, group=group,
                                              async_op=True))
        return received

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _send_back(ctx, grad), None, None, None, None


class _AllToAllWait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, received: torch.Tensor, pending: list) -> torch.Tensor:
        lanes.wait(pending.pop())
        return received.view_as(received)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def all_to_all_beside(rows: torch.Tensor, send_splits: list[int], recv_splits: list[int], group: ProcessGroup,
                      beside) -> tuple[torch.Tensor, object]:
    """`all_to_all` with `beside()` (compute without collectives: the shared experts) run while the rows travel;
    returns (the rows received, what `beside` returned). On accelerators the exchange runs on the communicator's
    own stream while `beside` runs on the compute stream; on the CPU gloo moves the rows in its own thread."""
    pending: list = []
    received = _AllToAllStart.apply(rows, send_splits, recv_splits, group, pending)
    result = beside()
    return _AllToAllWait.apply(received, pending), result


def all_to_all(rows: torch.Tensor, send_splits: list[int], recv_splits: list[int],
               group: ProcessGroup) -> torch.Tensor:
    """Send the first `send_splits[0]` rows of `rows` to ep rank 0, the next `send_splits[1]` to rank 1, ...;
    return the rows received, `recv_splits[r]` from rank r, in rank order (differentiable)."""
    return _AllToAll.apply(rows, send_splits, recv_splits, group)


def kept_all_to_all(rows: torch.Tensor, kept: torch.Tensor, send_splits: list[int], recv_splits: list[int],
                    group: ProcessGroup) -> torch.Tensor:
    """`all_to_all` of `rows` whose result `kept` an earlier forward received: no communication forward, the
    gradients sent back in backward."""
    return _KeptAllToAll.apply(rows, kept, send_splits, recv_splits, group)
