"""Metrics of a run: throughput, model TFLOP/s and MFU, peak memory, written as JSON lines.

Each logged step appends one object to `metrics.jsonl` with the keys `step, loss, lr, grad_norm,
tokens_per_s, tokens_per_s_per_device, tflops_per_device, mfu, peak_memory_bytes` (and `moe_drop_fraction`,
the share of routed slots that capacity-based MoE routing dropped in the step, when model.capacity_factor > 0);
validations append `{"step", "val_loss"}`. FLOPs per token come from `fivefold.flops.training_flops_per_token`
(the planner's function too), so MFU counts model FLOPs only: recomputation does not raise it.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import torch

from fivefold.accelerators import device_peak_tflops
from fivefold.config import ConfigError, LogConfig, write_text_atomic


def peak_memory(device: torch.device, baseline: int = 0) -> dict[str, int]:
    """Peak allocated and reserved bytes on the accelerator since the last reset, or the process's peak resident
    set size on CPU (which also counts the Python interpreter and libraries); with a `baseline` (`memory_baseline`)
    also that peak above it, `resident_above_baseline`."""
    if device.type != "cpu":
        module = torch.get_device_module(device.type)
        if hasattr(module, "max_memory_allocated"):
            return {"allocated": int(module.max_memory_allocated(device)),
                    "reserved": int(module.max_memory_reserved(device))}
    peak = {"resident": peak_resident_bytes()}
    if baseline:
        peak["resident_above_baseline"] = max(peak["resident"] - baseline, 0)
    return peak


def peak_resident_bytes() -> int:
    """This process's peak resident set size: on Linux the high-water mark of its own memory (`VmHWM` of
    /proc/self/status), else `getrusage`'s `ru_maxrss`. Linux's `ru_maxrss` starts a process at the peak of the
    one that started it (the mark survives the fork and the exec): a run started by a larger process, such as
    `fivefold calibrate` or a test suite starting `fivefold bench`, read its parent's peak as its own (262 MiB
    above the baseline for a step whose own peak was 36)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def reset_peak_resident() -> bool:
    """Lower this process's peak resident set (`VmHWM`) to its resident set now (Linux 4.0+: /proc/self/clear_refs),
    so that `peak_resident_bytes` then measures from here; whether it could."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_memory_bytes(device: torch.device) -> int:
    """The peak of `peak_memory`: allocated on an accelerator, resident on the CPU."""
    peak = peak_memory(device)
    return peak.get("allocated", peak.get("resident", 0))


def planned_peak(peak: dict[str, int]) -> int:
    """What of a `peak_memory` the planner's predicted peak describes: the allocated bytes on an accelerator; on the
    CPU the resident set above the baseline where one was measured (the planner counts the run's tensors, not the
    interpreter and libraries), else the whole resident set."""
    return peak.get("allocated", peak.get("resident_above_baseline", peak.get("resident", 0)))


def resident_bytes() -> int:
    """The process's resident set size now (Linux), or 0 where /proc is missing."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def memory_baseline(device: torch.device) -> int:
    """On the CPU, the resident bytes before the model is built, after one small step of every kind of kernel the
    model uses, so that the CPU libraries' one-time buffers (tens of MiB) land in the baseline rather than in the
    run's peak: what a run's measured peak is compared with the planner's above (0 on an accelerator, whose
    allocator counts the tensors themselves, and where /proc is missing)."""
    if device.type != "cpu":
        return 0
    linear = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(linear.parameters(), foreach=True)
    q, k, v = (torch.randn(1, 2, 8, 16, requires_grad=True) for _ in range(3))
    attn = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    (torch.nn.functional.cross_entropy(linear(torch.randn(8, 64)), torch.zeros(8, dtype=torch.long))
     + attn.sum()).backward()
    opt.step()
    return resident_bytes()


def gather_ints(values: list[int], device: torch.device) -> list[list[int]]:
    """Every rank's `values`, in rank order (one collective; this rank's alone when not distributed)."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return [values]
    out = torch.zeros(torch.distributed.get_world_size(), len(values), dtype=torch.int64, device=device)
    out[torch.distributed.get_rank()] = torch.tensor(values, dtype=torch.int64)
    torch.distributed.all_reduce(out)
    return out.tolist()


def synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize()


def resolve_peak_tflops(configured: float, device: torch.device, dtype: str = "bf16") -> float | None:
    """The dense peak used for MFU: configured, else the device's in the compute dtype (`device_peak_tflops`: the
    nominal cpu entry on a CPU), else None."""
    return configured if configured > 0 else device_peak_tflops(device, dtype)


def peak_source(configured: float, device: torch.device) -> str:
    """Where the MFU's peak comes from, where a reader must be told: the nominal CPU peak."""
    if configured > 0 or device.type != "cpu":
        return ""
    return " of the nominal CPU peak (the planner's cpu profile; log.peak_tflops sets a measured one)"


class Throughput:
    """Tokens per second over the steps since the last report (host time between synchronised points)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.tokens = 0

    def add(self, tokens: int) -> None:
        self.tokens += tokens

    def report(self) -> float:
        now = time.perf_counter()
        rate = self.tokens / max(now - self.start, 1e-9)
        self.start, self.tokens = now, 0
        return rate


def step_record(
    step: int, loss: float, lr: float, grad_norm: float, tokens_per_s: float, n_devices: int,
    flops_per_token: float, peak_tflops: float | None, peak_memory: int,
) -> dict[str, Any]:
    per_device = tokens_per_s / n_devices
    tflops = per_device * flops_per_token / 1e12
    return {
        "step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
        "tokens_per_s": tokens_per_s, "tokens_per_s_per_device": per_device,
        "tflops_per_device": tflops, "mfu": tflops / peak_tflops if peak_tflops else None,
        "peak_memory_bytes": peak_memory,
    }


def check_logging_backends(log: LogConfig) -> None:
    """Raise ConfigError when log.tensorboard or log.wandb is on but its package is missing (before anything
    is written)."""
    for enabled, field, module, extra in ((log.tensorboard, "log.tensorboard", "tensorboard", "tensorboard"),
                                          (log.wandb, "log.wandb", "wandb", "wandb")):
        if enabled and importlib.util.find_spec(module) is None:
            raise ConfigError(f"{field} = true needs the {module} package, which is not installed: "
                              f"pip install 'fivefold[{extra}]' (or set {field} = false)")


def format_duration(seconds: float) -> str:
    """3725.2 -> '1:02:05'; 65 -> '1:05'."""
    s = int(round(seconds))
    h, m = divmod(s // 60, 60)
    return f"{h}:{m:02d}:{s % 60:02d}" if h else f"{m}:{s % 60:02d}"


class MetricsWriter:
    """Appends JSON lines to `metrics.jsonl`, prints progress with elapsed time and ETA, and mirrors scalars to
    TensorBoard and Weights & Biases when configured."""

    def __init__(self, run_dir: Path, max_steps: int, progress: str, tensorboard: bool,
                 stream: TextIO | None = None, wandb_run: dict[str, Any] | None = None,
                 start_step: int = 0) -> None:
        self.path = run_dir / "metrics.jsonl"
        self.max_steps = max_steps
        self.stream = stream or sys.stdout
        is_tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.mode = ("bar" if is_tty else "plain") if progress == "auto" else progress
        self.start_step, self.start_time = start_step, time.perf_counter()
        self.file = open(self.path, "a")
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tensorboard"))
        self.wandb = None
        if wandb_run is not None:  # {"project", "mode", "name", "config"}
            import wandb

            (run_dir / "wandb").mkdir(parents=True, exist_ok=True)
            self.wandb = wandb.init(project=wandb_run["project"], mode=wandb_run["mode"], name=wandb_run["name"],
                                    config=wandb_run["config"], dir=str(run_dir))
        self._bar_open = False

    def timing(self, step: int) -> str:
        """'elapsed 1:05 eta 3:10' for `step` of max_steps (the ETA from this call's mean step time)."""
        elapsed = time.perf_counter() - self.start_time
        done = step - self.start_step
        if done <= 0:
            return f"elapsed {format_duration(elapsed)}"
        return f"elapsed {format_duration(elapsed)} eta {format_duration(elapsed / done * (self.max_steps - step))}"

    def write(self, record: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self.file.write(json.dumps(clean) + "\n")
        self.file.flush()
        scalars = {k: v for k, v in record.items() if k != "step" and isinstance(v, int | float)}
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, record["step"])
        if self.wandb is not None:
            self.wandb.log(scalars, step=record["step"])
        self._show(record)

    def _show(self, r: dict[str, Any]) -> None:
        if self.mode == "none":
            return
        if "val_loss" in r:
            line = f"step {r['step']:>6}/{self.max_steps}  val_loss {r['val_loss']:.4f}"
        else:
            mfu = f"  mfu {100 * r['mfu']:.1f}%" if r.get("mfu") is not None else ""
            line = (f"step {r['step']:>6}/{self.max_steps}  loss {r['loss']:.4f}  lr {r['lr']:.2e}  "
                    f"gnorm {r['grad_norm']:.3f}  {r['tokens_per_s']:,.0f} tok/s{mfu}  "
                    f"mem {r['peak_memory_bytes'] / 2**20:,.0f} MiB  {self.timing(r['step'])}")
        if self.mode == "bar" and "val_loss" not in r:
            done = int(30 * r["step"] / self.max_steps)
            self.stream.write(f"\r[{'#' * done}{'.' * (30 - done)}] {line}")
            self._bar_open = True
        else:
            if self._bar_open:
                self.stream.write("\n")
                self._bar_open = False
            self.stream.write(line + "\n")
        self.stream.flush()

    def print(self, text: str) -> None:
        """A line that always shows (the start line, warnings, the summary): `progress = none` silences only the
        step lines."""
        if self._bar_open:
            self.stream.write("\n")
            self._bar_open = False
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self._bar_open:
            self.stream.write("\n")
        self.file.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def truncate_metrics(run_dir: Path, after_step: int) -> None:
    """Drop records of steps after `after_step` (written by a run that was killed after its last checkpoint),
    so that a resumed run's log has each step once. Rewritten through a temporary file and a rename."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= after_step:
                kept.append(line)
        except json.JSONDecodeError:
            continue  # a line cut short by the kill
    write_text_atomic(path, "".join(k + "\n" for k in kept))
