"""Run a function on N local CPU ranks (gloo) from a test, and collect what each rank returns.

    results = run_ranks(4, my_fn, arg1, arg2)   # my_fn(rank, world_size, arg1, arg2) on every rank

`my_fn` must be importable by name (a module-level function), because ranks are separate processes (forked from
a server process that has imported torch, `fresh_process_context`).
An exception on any rank fails the call with that rank's traceback. Results may hold tensors: they are pickled
by value (not through shared memory, which would vanish when the rank exits).
"""

from __future__ import annotations

import os
import pickle
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def adopt_environment(environ: dict[str, str]) -> None:
    """In a process of `fresh_process_context`: the test's environment as it was when the process was started,
    not the fork server's from when the server started."""
    os.environ.clear()
    os.environ.update(environ)


def _entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue,
           environ: dict[str, str]) -> None:
    adopt_environment(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)  # ranks share the machine's cores
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        queue.put((rank, True, pickle.dumps(result)))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(world_size: int, fn: Callable, *args: Any, timeout: float = 300.0) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; return the results in rank order.

    The rendezvous port is free when chosen but may be taken by another process before rank 0 binds it (tests
    run beside each other); then the ranks fail in `init_process_group` before running `fn`, and the run is
    started again on a new port (twice at most)."""
    for attempt in range(3):
        try:
            return _run_once(world_size, fn, args, timeout)
        except AssertionError as e:
            if attempt == 2 or not _port_taken(str(e)):
                raise
    raise AssertionError("unreachable")


def _port_taken(errors: str) -> bool:
    return "init_process_group" in errors and ("Address already in use" in errors or "EADDRINUSE" in errors)


# What the fork server imports once, so that no rank imports it again: torch (2-3 s of CPU in every process that
# imports it) and the engine's modules (another 2-3 s: fivefold's communication functions are marked
# `torch.compiler.disable`, which loads the compiler's front end). Importing changes no state a rank starts
# from: fivefold's modules read no environment variable and start no thread when imported; torch's import-time
# settings (TORCH_*, read by torch and torch._dynamo) come from the server's environment, as torch's always did
# here, and no test sets one.
PRELOAD = ["torch", "torch.distributed", "fivefold.train.build", "fivefold.train.loop", "fivefold.parallel.context"]


def fresh_process_context():
    """A multiprocessing context whose processes are forked from one server process that has imported torch and
    fivefold's engine once (`PRELOAD`, about 5 s of CPU per process otherwise); each process still starts from
    that clean state, never from the test process. The server's environment is the one it started with: pass the
    test's along."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _run_once(world_size: int, fn: Callable, args: tuple, timeout: float) -> list[Any]:
    ctx = fresh_process_context()
    queue = ctx.Queue()
    port = free_port()
    environ = dict(os.environ)
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue, environ), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    for _ in range(world_size):
        try:
            rank, ok, value = queue.get(timeout=timeout)
        except Exception:  # queue.Empty: a rank hangs
            errors.append(f"no answer from every rank within {timeout:.0f} s")
            break
        if ok:
            results[rank] = pickle.loads(value)
        else:
            errors.append(f"rank {rank} failed:\n{value}")
            break  # the other ranks may hang in a collective; stop them below
    for p in procs:
        p.join(timeout=timeout if not errors else 5)
        if p.is_alive():
            p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world_size)]
