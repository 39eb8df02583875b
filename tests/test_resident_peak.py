"""A CPU run's peak memory is its own: a process started by a larger one does not read its parent's peak resident
set as its own (Linux's `ru_maxrss` keeps the parent's mark across the fork and the exec; `VmHWM` does not)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[1] / "src")

# a parent that touches 1 GiB, then starts a child that reports its peak as a CPU run reads it (`peak_memory`) and
# as ru_maxrss
PARENT = r"""
import json, subprocess, sys
held = bytearray(1 << 30)
held[:: 4096] = b"x" * len(held[:: 4096])  # every page touched
child = ("import json, resource, torch; from fivefold.train.metrics import peak_memory; "
         "print(json.dumps([peak_memory(torch.device('cpu'))['resident'], "
         "resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024]))")
print(subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, check=True).stdout.strip())
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="VmHWM is Linux's")
def test_a_child_of_a_larger_process_reads_its_own_peak():
    env = {"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", PARENT], capture_output=True, text=True, env=env, check=True)
    own, inherited = json.loads(out.stdout.strip().splitlines()[-1])
    assert inherited >= 1 << 30  # the mark the child started with: its parent's
    assert own < 0.75 * (1 << 30), own  # the child's own peak: the interpreter and torch, well below 1 GiB
    assert own > 10 * 2**20  # and not nothing


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="Linux's")
def test_the_peak_can_be_reset_to_now_so_that_a_later_growth_shows():
    """`reset_peak_resident`: after a large buffer is freed, the peak falls back to the resident set now, so a test
    that measures growth from there sees growth, not an earlier test's peak."""
    from fivefold.train.metrics import peak_resident_bytes, reset_peak_resident

    held = bytearray(256 << 20)
    held[:: 4096] = b"x" * len(held[:: 4096])
    high = peak_resident_bytes()
    del held
    assert reset_peak_resident()
    low = peak_resident_bytes()
    assert low < high - (192 << 20), (high, low)
    again = bytearray(64 << 20)
    again[:: 4096] = b"x" * len(again[:: 4096])
    assert peak_resident_bytes() - low >= 48 << 20  # the growth from the reset shows
    del again
