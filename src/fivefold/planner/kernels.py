"""Compute figures by kernel class and device, from `devices/kernels.toml` (each figure with its source).

The step-time model (`time.py`) costs a block's work by kernel class when no calibrated profile measures it:
GEMMs at the device's large-GEMM efficiency times a shape term (small dimensions run slower), causal attention
from a table of published FlashAttention speeds by head dim and sequence length, element-wise kernels (norms,
rotary, SwiGLU, residual adds, the optimizer step) by HBM bandwidth at the device's achieved share, and an MoE
layer's routed experts as grouped GEMMs at the device's achieved share for them (`grouped_gemm_efficiency`).
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from fivefold.config import ConfigError, shown

KERNELS_FILE = Path(__file__).resolve().parent / "devices" / "kernels.toml"
GEMM_REFERENCE_DIM = 8192.0  # the shape (8192^3) at which `gemm_efficiency` is stated
ATTENTION_BACKWARD_FLOPS = 2.5  # FlashAttention's convention: the backward counts 2.5 x the forward's FLOPs
FIGURES = ("gemm_efficiency", "gemm_half_dim", "fp8_gemm_speedup", "hbm_efficiency", "grouped_gemm_efficiency")


@dataclass(frozen=True)
class DeviceKernels:
    """One device's figures (see the header of kernels.toml); `sources` names where each comes from."""

    device: str
    gemm_efficiency: float
    gemm_half_dim: float
    fp8_gemm_speedup: float
    hbm_efficiency: float
    # achieved share of the dense peak of an MoE layer's routed experts as dropless grouped GEMMs
    # (`torch.nn.functional.grouped_mm` on accelerators; one matmul per expert on the CPU)
    grouped_gemm_efficiency: float = 0.0
    tiles: int = 1
    # (kernel, head_dim, seq, forward TFLOP/s, backward TFLOP/s), already scaled for this device
    attention: tuple[tuple[str, float, float, float, float], ...] = ()
    sources: dict[str, str] = field(default_factory=dict)

    def gemm_factor(self, m: float, n: float, k: float) -> float:
        """The shape term: f(m) f(n) f(k) / f(8192)^3 with f(x) = x / (x + d0); 1 at the reference shape, falling
        for small dimensions, a little above 1 for larger ones."""
        d0 = self.gemm_half_dim
        ref = GEMM_REFERENCE_DIM / (GEMM_REFERENCE_DIM + d0)
        return math.prod(max(x, 1.0) / (max(x, 1.0) + d0) / ref for x in (m, n, k))

    def attention_tflops(self, kernel: str, head_dim: float, seq: float) -> tuple[float, float] | None:
        """Forward and backward TFLOP/s of causal attention (FlashAttention's FLOP convention) with this kernel
        (else the device's first kernel), the nearest head dim, interpolated in log sequence length and held
        beyond the table's ends; None when the device has no attention rows (attention then runs as a GEMM)."""
        if not self.attention:
            return None
        kernels = [r[0] for r in self.attention]
        name = kernel if kernel in kernels else kernels[0]
        rows = [r for r in self.attention if r[0] == name]
        dims = sorted({r[1] for r in rows})
        dim = min(dims, key=lambda d: (abs(math.log2(d) - math.log2(max(head_dim, 1.0))), -d))
        pts = sorted((r[2], r[3], r[4]) for r in rows if r[1] == dim)
        if seq <= pts[0][0]:
            return pts[0][1], pts[0][2]
        if seq >= pts[-1][0]:
            return pts[-1][1], pts[-1][2]
        for (s0, f0, b0), (s1, f1, b1) in zip(pts, pts[1:], strict=False):
            if s0 <= seq <= s1:
                w = (math.log(seq) - math.log(s0)) / (math.log(s1) - math.log(s0))
                return f0 + w * (f1 - f0), b0 + w * (b1 - b0)
        raise AssertionError("unreachable")


def _number(table: dict, key: str, where: str, minimum: float = 0.0) -> float:
    value = table.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= minimum:
        raise ConfigError(f"{where}: {key} = {shown(value)} must be a number > {minimum}")
    source = table.get(f"{key}_source")
    if not isinstance(source, str) or not source.strip():
        raise ConfigError(f"{where}: {key} has no {key}_source naming where the figure comes from")
    return float(value)


def parse(data: dict, where: str = str(KERNELS_FILE)) -> dict[str, DeviceKernels]:
    """Every device of a kernels file, each figure checked and its source required."""
    out: dict[str, DeviceKernels] = {}
    raw_rows: dict[str, list] = {}
    for device, table in data.items():
        if not isinstance(table, dict):
            raise ConfigError(f"{where}: [{device}] must be a table")
        raw_rows[device] = table.get("attention", [])
    for device, table in data.items():
        here = f"{where} [{device}]"
        values = {key: _number(table, key, here) for key in FIGURES}
        sources = {key: table[f"{key}_source"] for key in FIGURES}
        tiles = int(table.get("tiles", 1))
        if tiles < 1:
            raise ConfigError(f"{here}: tiles = {tiles} must be >= 1")
        if tiles > 1:
            sources["tiles"] = str(table.get("tiles_source", ""))
            if not sources["tiles"]:
                raise ConfigError(f"{here}: tiles = {tiles} has no tiles_source")
        rows = []
        origin = table.get("attention_from")
        if origin is None:
            for row in raw_rows[device]:
                keys = ("kernel", "head_dim", "seq", "fwd_tflops", "bwd_tflops", "source")
                if not isinstance(row, dict) or any(k not in row for k in keys) or not str(row["source"]).strip():
                    raise ConfigError(f"{here}: attention row {shown(row)} must give {', '.join(keys)}")
                if min(row["head_dim"], row["seq"], row["fwd_tflops"], row["bwd_tflops"]) <= 0:
                    raise ConfigError(f"{here}: attention row {shown(row)} must have positive numbers")
                rows.append((str(row["kernel"]), float(row["head_dim"]), float(row["seq"]), float(row["fwd_tflops"]),
                             float(row["bwd_tflops"])))
            sources["attention"] = "; ".join(sorted({str(r["source"]) for r in raw_rows[device]}))
        elif origin != "gemm":
            if origin not in raw_rows or not raw_rows[origin]:
                raise ConfigError(f"{here}: attention_from = {shown(origin)} names no device with attention rows")
            scale = _number({"s": table.get("attention_scale"), "s_source": table.get("attention_source")}, "s", here)
            rows = [(str(r["kernel"]), float(r["head_dim"]), float(r["seq"]), scale * float(r["fwd_tflops"]),
                    scale * float(r["bwd_tflops"])) for r in raw_rows[origin]]
            sources["attention"] = str(table["attention_source"])
        else:
            sources["attention"] = str(table.get("attention_source", "attention at the GEMM efficiency"))
        out[device] = DeviceKernels(device, tiles=tiles, attention=tuple(rows), sources=sources, **values)
    return out


@lru_cache(maxsize=1)
def all_devices() -> dict[str, DeviceKernels]:
    return parse(tomllib.loads(KERNELS_FILE.read_text()))


def device_kernels(device: str) -> DeviceKernels:
    """The figures of a device of `fivefold.accelerators` (by its preset name); h100's for a device not listed."""
    devices = all_devices()
    return devices.get(device) or devices["h100"]
