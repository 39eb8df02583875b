"""The cluster the planner models: one accelerator kind, how many per node, how many nodes, and the links.

The presets extend `fivefold.hardware` (the vendors' peaks, which the trainer also reads for MFU) with what the
time model needs: collective latencies, an achievable share of the matmul peak, and optionally the measured
bus bandwidth of collectives by node count (a calibrated profile). Any field can be overridden from a TOML
file: `fivefold plan --hardware FILE` where FILE holds

    base = "h100"              # optional: start from a preset
    bf16_tflops = 989.4
    inter_node_gbps = 50
    [busbw_gbps]               # optional measured all-reduce bus bandwidth (GB/s) by nodes in the group
    1 = 436.0
    2 = 361.7
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from fivefold.config import ConfigError
from fivefold.hardware import HARDWARE


@dataclass(frozen=True)
class Cluster:
    name: str
    bf16_tflops: float  # dense peak per device
    fp32_tflops: float
    memory_gib: float  # what the framework can allocate per device
    hbm_gbps: float
    intra_node_gbps: float  # per device, unidirectional, to peers inside the node
    inter_node_gbps: float  # per device, unidirectional, across nodes
    gpus_per_node: int = 8
    intra_latency_us: float = 2.0  # one ring step of a collective inside a node
    inter_latency_us: float = 5.0  # one ring step across nodes
    matmul_efficiency: float = 0.78  # best achievable share of the peak on large matmuls
    kernel_overhead_us: float = 4.0  # per launched kernel (small shapes are latency bound)
    # measured all-reduce bus bandwidth by nodes spanned (GB/s); empty = derive from the link bandwidths
    busbw_gbps: dict[int, float] = field(default_factory=dict)

    def peak_flops(self, dtype: str = "bf16") -> float:
        return (self.bf16_tflops if dtype == "bf16" else self.fp32_tflops) * 1e12

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * 2**30

    def bus_bandwidth(self, nodes_spanned: int) -> float:
        """Bytes/s a ring collective moves per device over a group that spans this many nodes."""
        if self.busbw_gbps:
            keys = sorted(self.busbw_gbps)
            if nodes_spanned in self.busbw_gbps:
                return self.busbw_gbps[nodes_spanned] * 1e9
            # log-linear interpolation between measured node counts, clamped at the ends
            lo = max([k for k in keys if k <= nodes_spanned], default=keys[0])
            hi = min([k for k in keys if k >= nodes_spanned], default=keys[-1])
            if lo == hi:
                return self.busbw_gbps[lo] * 1e9
            w = (math.log(nodes_spanned) - math.log(lo)) / (math.log(hi) - math.log(lo))
            return math.exp((1 - w) * math.log(self.busbw_gbps[lo]) + w * math.log(self.busbw_gbps[hi])) * 1e9
        return (self.intra_node_gbps if nodes_spanned <= 1 else self.inter_node_gbps) * 1e9

    def latency(self, nodes_spanned: int) -> float:
        return (self.intra_latency_us if nodes_spanned <= 1 else self.inter_latency_us) * 1e-6


def _from_base(name: str) -> Cluster:
    hw = HARDWARE[name]
    return Cluster(name, hw.bf16_tflops, hw.fp32_tflops, hw.memory_gib, hw.hbm_gbps, hw.intra_node_gbps,
                   hw.inter_node_gbps, hw.gpus_per_node)


PRESETS: dict[str, Cluster] = {name: _from_base(name) for name in HARDWARE}
# The playbook's cluster (H100 80GB, NVLink inside nodes, AWS EFA between): the all-reduce bus bandwidth it
# measured at 256 MB (GB/s, by nodes). A calibrated profile of the kind `fivefold calibrate` produces.
PRESETS["h100-efa"] = dataclasses.replace(
    PRESETS["h100"], name="h100-efa",
    busbw_gbps={1: 436.0, 2: 361.7, 4: 160.1, 8: 99.6, 16: 84.7, 32: 64.9, 64: 32.9},
)


def get_cluster(name: str | None = None, file: str | Path | None = None) -> Cluster:
    """A preset by name, or a TOML file (optionally `base = "PRESET"` plus fields to override)."""
    if file is None:
        key = (name or "h100").lower()
        if key not in PRESETS:
            raise ConfigError(f"--gpu {name!r} is not known; choose one of: {', '.join(PRESETS)}, "
                              "or describe the hardware in a TOML file (--hardware FILE)")
        return PRESETS[key]
    path = Path(file)
    if not path.is_file():
        raise ConfigError(f"--hardware {str(path)!r} does not exist or is not a file")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--hardware {str(path)!r} is not valid TOML: {e}") from None
    base = get_cluster(str(data.pop("base", name or "h100")))
    fields = {f.name: f for f in dataclasses.fields(Cluster)}
    values: dict = {}
    for key, value in data.items():
        if key not in fields:
            raise ConfigError(f"--hardware field {key!r} is not known; known fields: {', '.join(fields)}")
        if key == "busbw_gbps":
            value = {int(k): float(v) for k, v in value.items()}
        elif key == "name":
            value = str(value)
        elif key == "gpus_per_node":
            value = int(value)
        else:
            value = float(value)
            if value <= 0:
                raise ConfigError(f"--hardware {key} = {value} must be > 0")
        values[key] = value
    values.setdefault("name", path.stem)
    return dataclasses.replace(base, **values)
