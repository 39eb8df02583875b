"""glibc's thread cache off for the CPU processes fivefold starts (`device.cpu_allocator_env`): the local ranks of
`--nproc` on the CPU, a sweep's CPU runs and calibrate's reference run get it in their environment; accelerator
ranks, the launcher itself afterwards and a user's own GLIBC_TUNABLES keep theirs."""

from __future__ import annotations

import os
import sys

import pytest

import fivefold.launch as launch_module
from fivefold.device import TCACHE_TUNABLE, cpu_allocator_env
from fivefold.sweep.runner import subprocess_env

OFF = f"{TCACHE_TUNABLE}=0"
linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="GLIBC_TUNABLES is glibc's")


@linux
def test_the_cache_is_turned_off_beside_other_tunables_and_a_users_count_is_kept():
    assert cpu_allocator_env({"PATH": "/bin"}) == {"PATH": "/bin", "GLIBC_TUNABLES": OFF}
    assert cpu_allocator_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})["GLIBC_TUNABLES"] == \
        f"glibc.malloc.arena_max=2:{OFF}"
    mine = {"GLIBC_TUNABLES": f"{TCACHE_TUNABLE}=3"}
    assert cpu_allocator_env(mine) == mine
    src = {"A": "1"}
    cpu_allocator_env(src)
    assert src == {"A": "1"}  # a copy, never the caller's mapping


@linux
@pytest.mark.parametrize("cpu, seen", [(True, OFF), (False, None)])
def test_the_ranks_of_a_cpu_launch_inherit_it_and_the_launcher_gets_its_own_back(monkeypatch, cpu, seen):
    """torch's launcher starts the workers with its own process's environment: what `run` sees is what they get."""
    import torch.distributed.run as torch_run

    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    inside: list[str | None] = []
    monkeypatch.setattr(torch_run, "run", lambda args: inside.append(os.environ.get("GLIBC_TUNABLES")))
    assert launch_module.launch(2, ["--config", "x.toml"], verb="bench", cpu=cpu) == 0
    assert inside == [seen]
    assert "GLIBC_TUNABLES" not in os.environ


@linux
def test_a_sweeps_cpu_run_and_calibrates_reference_run_get_it():
    assert subprocess_env(cpu=True)["GLIBC_TUNABLES"].endswith(OFF)
    assert subprocess_env(cpu=False).get("GLIBC_TUNABLES") == os.environ.get("GLIBC_TUNABLES")
