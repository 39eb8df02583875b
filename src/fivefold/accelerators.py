"""Accelerator specifications: peak throughput, memory and links. The trainer reads the peak for MFU;
the planner reads everything. Figures are the vendors' dense (no sparsity) numbers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the planner reads the table without torch (its pool's processes start faster)
    import torch


@dataclass(frozen=True)
class Hardware:
    name: str
    bf16_tflops: float  # dense bf16 tensor-core peak per device
    fp32_tflops: float  # fp32 (non tensor-core) peak per device
    memory_gib: float  # device memory that the framework can see
    hbm_gbps: float  # device memory bandwidth, GB/s
    intra_node_gbps: float  # per-device unidirectional bandwidth to peers in the node, GB/s
    inter_node_gbps: float  # per-device unidirectional network bandwidth across nodes, GB/s
    gpus_per_node: int = 8
    match: tuple[str, ...] = ()  # substrings of the device name that identify it


HARDWARE: dict[str, Hardware] = {
    "h100": Hardware("h100", 989.4, 66.9, 79.6, 3350, 450, 50, 8, ("H100 80GB HBM3", "H100 SXM")),
    "h100-pcie": Hardware("h100-pcie", 756.0, 51.2, 79.6, 2000, 64, 50, 8, ("H100 PCIe",)),
    "h200": Hardware("h200", 989.4, 66.9, 139.8, 4800, 450, 50, 8, ("H200",)),
    "b200": Hardware("b200", 2250.0, 80.0, 178.4, 8000, 900, 100, 8, ("B200",)),
    "a100-40gb": Hardware("a100-40gb", 312.0, 19.5, 39.4, 1555, 300, 25, 8, ("A100-SXM4-40GB", "A100 40GB")),
    "a100-80gb": Hardware("a100-80gb", 312.0, 19.5, 79.2, 2039, 300, 25, 8, ("A100-SXM4-80GB", "A100 80GB")),
    "mi300x": Hardware("mi300x", 1307.4, 163.4, 192.0, 5300, 448, 50, 8, ("MI300X",)),
    "max1550": Hardware("max1550", 838.9, 52.4, 128.0, 3277, 150, 25, 8, ("Max 1550",)),
    # A nominal CPU: this project's 2-core machine, its large fp32 matmul at 2 threads (0.125 TFLOP/s; the
    # planner's devices/kernels.toml says how it was measured); calibrate for real figures (`fivefold calibrate`).
    "cpu": Hardware("cpu", 0.125, 0.125, 16.0, 20, 10, 1.25, 1, ()),
}


def device_hardware(device: torch.device) -> Hardware | None:
    """The table's entry for `device`, looked up by its name; None for a CPU or a device not in the table."""
    if device.type == "cpu":
        return None
    import torch

    module = torch.get_device_module(device.type)
    name = module.get_device_name(device) if hasattr(module, "get_device_name") else ""
    return next((hw for hw in HARDWARE.values() if any(m.lower() in name.lower() for m in hw.match)), None)


def device_peak_tflops(device: torch.device, dtype: str = "bf16") -> float | None:
    """Dense peak of `device` in `dtype` (bf16 or fp32) looked up by its name; on a CPU the nominal `cpu` entry,
    which is also the planner's built-in cpu profile, so that `train`, `bench`, `sweep` and `plan` take MFU against
    one peak (a calibrated or configured one replaces it: `log.peak_tflops`, `--hardware`); None for an
    accelerator not in the table."""
    hw = HARDWARE["cpu"] if device.type == "cpu" else device_hardware(device)
    if hw is None:
        return None
    return hw.bf16_tflops if dtype == "bf16" else hw.fp32_tflops
