"""A process group that stands in for every other rank: `fivefold train --only-rank K` runs rank K of a layout of
N ranks in one process, at full size, with every collective and point-to-point answered locally.

`StandInGroup` is a Python subclass of the public `torch.distributed.ProcessGroup`, registered as the backend
`standin` with `torch.distributed.Backend.register_backend` for the CPU and this machine's accelerator type;
`init_standin(K, N)` starts the world with `init_process_group("standin", store=HashStore(), rank=K,
world_size=N)`, so that `new_group`, `DeviceMesh.from_group`, `fully_shard` and every `torch.distributed` call
of the engine see rank K of N. Each operation finishes at once, on the calling stream, and leaves in its outputs
finite values of the right shape and dtype: a reduction keeps this rank's value, a gather repeats this rank's
part in every slot, a reduce-scatter keeps this rank's slice of its own input, an all-to-all returns what it
sends when the sizes agree (balanced MoE routing makes them agree) and zeros otherwise, a receive zeros. The
values mean nothing; the shapes, dtypes and allocations are those of rank K in the real run.

Private names, and why: a Python `ProcessGroup` has no C++ backend behind it, so c10d hands it the name it
registers the group under through `_set_group_name` (an underscore method of `ProcessGroup` that c10d calls on
every new group) and reads it back through `group_name` / `getGroupName` (`DeviceMesh` keys its groups by it).
Overriding `_set_group_name` on this subclass is the one touch of a private name; nothing private is imported.
`distributed_c10d` calls these methods on the group; their names changed between PyTorch releases (2.11 calls
`_allgather_base`, `_reduce_scatter_base`, `alltoall_base`, `allgather_into_tensor_coalesced` and
`reduce_scatter_tensor_coalesced` where 2.13 calls `all_gather_single`, `reduce_scatter_single`,
`all_to_all_single` and their `_coalesced` forms), so both sets are implemented. tests/test_only_rank.py runs each
collective that the engine uses through the group, and fails when PyTorch calls a method that is not here.

What it cannot serve: PyTorch's functional (traceable) collectives, which DTensor redistribution and async tensor
parallel use: they resolve the group in C++ and call its C++ backend, which a Python group does not have.
fivefold's engine does not use them on a training step (its tensor and context parallel call `torch.distributed`
directly, and `fully_shard` gathers and reduce-scatters through `torch.distributed`); `fivefold.tools.only_rank` refuses
by name the configurations that would reach them.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.futures import Future

__all__ = ["BACKEND", "StandInGroup", "init_standin", "register_standin"]

BACKEND = "standin"


class _Done(dist.Work):
    """A finished piece of work (the stand-in answers every operation at once)."""

    def __init__(self, result: object = None) -> None:
        super().__init__()
        self.future: Future = Future()
        self.future.set_result(result)

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def get_future(self) -> Future:
        return self.future

    def synchronize(self) -> None:
        pass


def _fill(out: torch.Tensor, source: torch.Tensor) -> None:
    """Copy `source` into `out` where their sizes agree (flat, in order), zeros elsewhere."""
    n = min(out.numel(), source.numel())
    flat = out.view(-1)
    if n:
        flat[:n].copy_(source.reshape(-1)[:n])
    if n < out.numel():
        flat[n:].zero_()


def _each(single, outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> _Done:
    """A coalesced collective: its single form on each (output, input) pair."""
    for out, inp in zip(outputs, inputs, strict=True):
        single(out, inp)
    return _Done(outputs)


class StandInGroup(dist.ProcessGroup):
    """Rank `rank` of a group of `size` whose other members are stood in for (see the module docstring)."""

    def __init__(self, rank: int, size: int) -> None:
        super().__init__(rank, size)
        self._standin_name = ""

    # --- identity: a Python group has no C++ backend to hold its name ---------------------------------
    def getBackendName(self) -> str:  # noqa: N802 (PyTorch's name)
        return BACKEND

    def _set_group_name(self, name: str) -> None:  # the one private name: c10d calls it on every new group
        self._standin_name = name

    def getGroupName(self) -> str:  # noqa: N802 (PyTorch's name)
        return self._standin_name

    @property
    def group_name(self) -> str:
        return self._standin_name

    # --- reductions and broadcasts: this rank's value stands for the result ---------------------------
    def allreduce(self, tensors, opts=None):
        return _Done(tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        return _Done(tensors)

    def reduce(self, tensors, opts=None):
        return _Done(tensors)

    def broadcast(self, tensors, opts=None):
        return _Done(tensors)

    def barrier(self, opts=None):
        return _Done()

    # --- gathers: this rank's part in every slot --------------------------------------------------------
    def allgather(self, output_lists, inputs, opts=None):
        for outs, inp in zip(output_lists, inputs, strict=True):
            for out in outs:
                out.copy_(inp)
        return _Done(output_lists)

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        return self.allgather(output_lists, inputs, opts)

    def all_gather_single(self, output, input, opts=None):
        source = input.reshape(-1)
        for slot in output.view(-1, input.numel()):  # in place (the input is one of the slots): the others
            if slot.data_ptr() != source.data_ptr():
                slot.copy_(source)
        return _Done([output])

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        return _each(self.all_gather_single, outputs, inputs)

    def gather(self, output_lists, inputs, opts=None):
        return self.allgather(output_lists, inputs, opts)

    # --- reduce-scatters: this rank's slice of its own input --------------------------------------------
    def reduce_scatter(self, outputs, input_lists, opts=None):
        for out, ins in zip(outputs, input_lists, strict=True):
            out.copy_(ins[min(self.rank(), len(ins) - 1)])
        return _Done(outputs)

    def reduce_scatter_single(self, output, input, opts=None):
        n = output.numel()
        start = self.rank() * n if (self.rank() + 1) * n <= input.numel() else 0
        _fill(output, input.reshape(-1)[start:start + n])
        return _Done([output])

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        return _each(self.reduce_scatter_single, outputs, inputs)

    def scatter(self, outputs, input_lists, opts=None):
        for out, ins in zip(outputs, input_lists, strict=True):
            _fill(out, ins[self.rank()] if ins else out.new_zeros(0))
        return _Done(outputs)

    # --- all-to-all: what this rank sends comes back when the sizes agree --------------------------------
    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        _fill(output, input)
        return _Done([output])

    def alltoall(self, outputs, inputs, opts=None):
        for out, inp in zip(outputs, inputs, strict=True):
            _fill(out, inp)
        return _Done(outputs)

    # --- point-to-point: sends vanish, receives get zeros ------------------------------------------------
    def send(self, tensors, dst, tag=0):
        return _Done()

    def recv(self, tensors, src, tag=0):
        for t in tensors:
            t.zero_()
        return _Done(tensors)

    def recv_anysource(self, tensors, tag=0):
        return self.recv(tensors, 0, tag)

    # --- the names PyTorch 2.11 calls ---------------------------------------------------------------------
    def _allgather_base(self, output, input, opts=None):
        return self.all_gather_single(output, input, opts)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        return self.all_gather_single_coalesced(outputs, inputs, opts)

    def _reduce_scatter_base(self, output, input, opts=None):
        return self.reduce_scatter_single(output, input, opts)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        return self.reduce_scatter_single_coalesced(outputs, inputs, opts)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        return self.all_to_all_single(output, input, output_split_sizes, input_split_sizes, opts)


def _device_types() -> list[str]:
    """The CPU and this machine's accelerator type (cuda, xpu, ...), whatever that is."""
    types = ["cpu"]
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if acc is not None:
        types.append(acc.type)
    return types


def register_standin() -> None:
    """Register the `standin` backend once per process."""
    if BACKEND in dist.Backend.backend_list:
        return
    dist.Backend.register_backend(BACKEND, lambda store, rank, size, timeout: StandInGroup(rank, size),
                                  devices=_device_types())


def init_standin(rank: int, world_size: int) -> None:
    """Start the world as rank `rank` of `world_size` with every other rank stood in for."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the world of {world_size} ranks (0 .. {world_size - 1})")
    register_standin()
    dist.init_process_group(BACKEND, store=dist.HashStore(), rank=rank, world_size=world_size)
