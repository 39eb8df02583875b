"""The cluster the planner models: one accelerator kind, how many per node, how many nodes, and the links.

The presets are `fivefold.accelerators`'s table (the vendors' peaks, which the trainer also reads for MFU;
`Cluster` inherits its fields) extended with what the time model needs: collective latencies, an achievable
share of the matmul peak, and optionally the measured bus bandwidth of collectives by node count (a calibrated
profile). Any field can be overridden from a TOML
file: `fivefold plan --hardware FILE` where FILE holds

    base = "h100"              # optional: start from a preset
    bf16_tflops = 989.4
    inter_node_gbps = 50
    [busbw_gbps]               # optional measured all-reduce bus bandwidth (GB/s) by nodes in the group
    1 = 436.0
    2 = 361.7

Without measured tables the time model costs compute by kernel class from the device's published figures
(`planner/devices/kernels.toml`, by `device`: the preset a file's `base` names).
`fivefold calibrate` writes such a file with measured tables instead of single constants: `linear` (forward
and backward TFLOP/s of a linear layer by shape m x n x k), `attention` (causal attention TFLOP/s by
batch x heads, sequence, head dim), `loss` (the fused output layer + cross-entropy by tokens, vocabulary,
hidden), `elementwise` (GB/s by tensor bytes), and, under `[ranks.N]`, the same
fields measured while N ranks run at once on the node (on a CPU they share its cores) plus
`[ranks.N.collectives.KIND]` tables of seconds by group size and message bytes, for KIND in all_reduce,
all_gather, reduce_scatter, all_to_all and p2p, and `collective_wait` (what a collective costs beyond its own
time when the ranks compute in between). `Cluster.on_node(ranks)` picks the values for a layout.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from fivefold.accelerators import HARDWARE, Hardware
from fivefold.config import ConfigError, did_you_mean, load_file, shown
from fivefold.planner.kernels import device_kernels


@dataclass(frozen=True)
class Cluster(Hardware):
    """A device of `fivefold.accelerators` (the one table of device facts: peaks, memory, links, devices per node),
    with what the time model adds. The device fields are inherited, so the two cannot drift apart."""

    device: str = ""  # the preset whose kernel figures apply (`planner/devices/kernels.toml`); kept by `base = ...`
    intra_latency_us: float = 2.0  # one ring step of a collective inside a node
    inter_latency_us: float = 5.0  # one ring step across nodes
    # achieved share of the peak on a large (8192^3) matmul: the preset's from kernels.toml (gemm_efficiency), a
    # profile's fitted value replaces it and scales the attention figures in proportion
    matmul_efficiency: float = 0.78
    kernel_overhead_us: float = 4.0  # per launched kernel (small shapes are latency bound)
    # measured all-reduce bus bandwidth by nodes spanned (GB/s); empty = derive from the link bandwidths
    busbw_gbps: dict[int, float] = field(default_factory=dict)
    # measured all-gather / reduce-scatter bus bandwidth by nodes spanned (GB/s); empty = 0.57 x busbw_gbps
    # across nodes (the ratio of the playbook's 64-node figures), busbw_gbps inside a node
    gather_busbw_gbps: dict[int, float] = field(default_factory=dict)
    # --- what `fivefold calibrate` measures (defaults: the closed forms above) ---
    cores: int = 0  # CPU cores that the ranks of a node share (0: every rank has its own device)
    threads_per_rank: int = 0  # intra-op threads per rank the measurements used (CPU)
    backward_overhead_us: float = 0.0  # per forward kernel, its backward's fixed cost; 0 = 1.5 x kernel_overhead_us
    optimizer_gbps: float = 0.0  # parameter + gradient + optimizer-state bytes the step streams per s; 0 = hbm / 2
    optimizer_tensor_us: float = 0.0  # fixed cost per parameter tensor of the optimizer step (clip, AdamW, zero)
    comm_overlap: float = 1.0  # share of a collective's time that can hide behind compute running at once
    zero3_unit_us: float = 0.0  # per ZeRO-3 unit and micro-batch: hooks, copies and frees beyond its collectives
    # per block and micro-batch, the host time of selective recompute's per-operator policy (the checkpoint's
    # dispatch mode in the forward and again in the recomputation), beyond the work it reruns: measured by `fivefold
    # calibrate` on a CPU, where the host's time is the step's; 0 on an accelerator, whose host runs ahead
    selective_dispatch_us: float = 0.0
    posted_p2p_wait_us: float = 0.0  # a send/recv posted before compute and waited after: cost beyond both
    # per micro-batch of a pipeline that leaves the node, per node of the job: the blocking stage hand-overs wait
    # for the slowest rank of the job, and that wait grows with the nodes (fitted on 2-node runs, docs/planner.md)
    pp_sync_us_per_node: float = 0.0
    # --- the cluster's risk (`planner/time.py`, `stall_risk`; fitted on the playbook's 1-2-node runs by
    # `plan validate --fit`; 0 = no stall data: clean runs only, p90 = p50) ---
    stall_hazard_per_node: float = 0.0  # chance per node of the job that a pipelined step stalls at its hand-overs
    stall_s_per_handover: float = 0.0  # seconds a stalled hand-over takes at pp = 2, tp = 1
    stall_s_per_handover_deep: float = 0.0  # the same at pp > 2 (0: as at pp = 2)
    stall_growth_per_tp_doubling: float = 0.0  # the stalled hand-over's growth per doubling of tp
    # the step's slowdown per doubling of the job's nodes beyond one: each blocking collective waits for the
    # slowest node of its ring or tree, whose expected lag grows with the log of the nodes
    drift_per_node_doubling: float = 0.0
    # (group size, seconds): what a blocking collective costs beyond its own time when ranks compute in between
    collective_wait: tuple[tuple[float, ...], ...] = ()
    # multiplies compute times: a calibrated CPU profile's whole training step against the sum of its parts
    # (`tools/calibrate/whole_step.py`), times the slowdown of more ranks on a node than were measured
    compute_scale: float = 1.0
    # a CPU run's resident set per byte of its live tensors at the peak: glibc keeps in its heap the chunks a step
    # frees (it returns to the system only the heap's top and chunks above its mmap threshold, which rises to the
    # largest freed), so a process holds more than its tensors; `fivefold calibrate` measures it on the reference
    # model's step in a fresh process (`tools/calibrate/whole_step.py`); 1 = not measured (the live tensors alone)
    heap_retention: float = 1.0
    linear: tuple[tuple[float, ...], ...] = ()  # (m, n, k, forward TFLOP/s, backward TFLOP/s)
    attention: tuple[tuple[float, ...], ...] = ()  # (batch x heads, seq, head_dim, fwd TFLOP/s, bwd TFLOP/s)
    loss: tuple[tuple[float, ...], ...] = ()  # fused output layer + cross-entropy: (tokens, vocab, hidden, TFLOP/s x2)
    elementwise: tuple[tuple[float, ...], ...] = ()  # (tensor bytes, GB/s)
    collectives: dict[str, dict[int, tuple[tuple[float, float], ...]]] = field(default_factory=dict)
    by_ranks: dict[int, dict] = field(default_factory=dict)  # ranks at once on a node -> fields measured so

    @property
    def is_cpu(self) -> bool:
        """A CPU profile: the built-in `cpu`, a file based on it (its `device`), or one `fivefold calibrate` measured
        (it has cores)."""
        return bool(self.cores) or self.device == "cpu" or self.name == "cpu"

    @property
    def has_stall_data(self) -> bool:
        """Whether the profile carries the cluster's stall risk (else every layout's p90 is its p50)."""
        return self.stall_hazard_per_node > 0

    @property
    def unit(self) -> str:
        """What one rank runs on, as output names it: a GPU, or on a CPU a device (one process per rank)."""
        return "device" if self.is_cpu else "GPU"

    def peak_flops(self, dtype: str = "bf16") -> float:
        return (self.bf16_tflops if dtype == "bf16" else self.fp32_tflops) * 1e12

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * 2**30

    def bus_bandwidth(self, nodes_spanned: int, gather: bool = False) -> float:
        """Bytes/s a ring collective moves per device over a group that spans this many nodes (`gather`: an
        all-gather or reduce-scatter, from `gather_busbw_gbps` when it is measured)."""
        table = self.gather_busbw_gbps if gather and self.gather_busbw_gbps else self.busbw_gbps
        if table:
            keys = sorted(table)
            if nodes_spanned in table:
                return table[nodes_spanned] * 1e9
            # log-linear interpolation between measured node counts, clamped at the ends
            lo = max([k for k in keys if k <= nodes_spanned], default=keys[0])
            hi = min([k for k in keys if k >= nodes_spanned], default=keys[-1])
            if lo == hi:
                return table[lo] * 1e9
            w = (math.log(nodes_spanned) - math.log(lo)) / (math.log(hi) - math.log(lo))
            return math.exp((1 - w) * math.log(table[lo]) + w * math.log(table[hi])) * 1e9
        return (self.intra_node_gbps if nodes_spanned <= 1 else self.inter_node_gbps) * 1e9

    def latency(self, nodes_spanned: int) -> float:
        return (self.intra_latency_us if nodes_spanned <= 1 else self.inter_latency_us) * 1e-6

    def on_node(self, ranks: int) -> Cluster:
        """This cluster as seen by one of `ranks` ranks running at once on a node: the fields measured with
        the most ranks not above `ranks` (compute slowed in proportion when more ranks than that share the
        cores), and the collective tables measured with exactly that many ranks when there are some."""
        if not self.by_ranks:
            return self
        ranks = max(1, ranks)
        below = [n for n in self.by_ranks if n <= ranks]
        values = dict(self.by_ranks[max(below)]) if below else {}
        if below and ranks > max(below) and self.cores and ranks > self.cores:
            values["compute_scale"] = self.compute_scale * ranks / max(max(below), self.cores)
        exact = self.by_ranks.get(ranks, {})
        values["collectives"] = exact.get("collectives") or values.get("collectives") or self.collectives
        return dataclasses.replace(self, by_ranks={}, **values)

    def backward_overhead(self) -> float:
        """Seconds of backward fixed cost per forward kernel."""
        return (self.backward_overhead_us or 1.5 * self.kernel_overhead_us) * 1e-6

    def linear_time(self, m: float, n: float, k: float) -> tuple[float, float] | None:
        """Measured forward and backward seconds of a linear layer [m, k] x [k, n], or None without a table."""
        if not self.linear:
            return None
        return self._table_seconds(self.linear, (m, n, k), 2 * m * n * k)

    def _table_seconds(self, table: tuple[tuple[float, ...], ...], key: tuple[float, float, float],
                       flops: float) -> tuple[float, float]:
        """Forward and backward seconds of `flops` forward (twice that backward) at the measured TFLOP/s of the
        table's rows around `key`."""
        f, b = interpolate(table, key)
        return self.compute_scale * flops / (f * 1e12), self.compute_scale * 2 * flops / (b * 1e12)

    def loss_time(self, tokens: float, vocab: float, hidden: float) -> tuple[float, float] | None:
        """Measured forward and backward seconds of the fused output layer + cross-entropy on one chunk of
        tokens (its matmuls counted as a linear layer's FLOPs), or None without a table."""
        if not self.loss:
            return None
        return self._table_seconds(self.loss, (tokens, vocab, hidden), 2 * tokens * vocab * hidden)

    def attention_time(self, batch_heads: float, seq: float, head_dim: float) -> tuple[float, float] | None:
        """Measured forward and backward seconds of causal attention, or None without a table."""
        if not self.attention:
            return None
        flops = 2 * batch_heads * seq * seq * head_dim  # causal: half of 4 b h s^2 d
        return self._table_seconds(self.attention, (batch_heads, seq, head_dim), flops)

    def elementwise_bandwidth(self, tensor_bytes: float) -> float:
        """Bytes/s that element-wise kernels stream on tensors of this size (the HBM bandwidth without a table)."""
        if not self.elementwise:
            return self.hbm_gbps * 1e9
        pts = tuple((x, y) for x, y in self.elementwise)
        return loglog(pts, tensor_bytes, extrapolate=False) * 1e9 / self.compute_scale

    def collective_time(self, kind: str, nbytes: float, size: int) -> float | None:
        """Measured seconds of one collective of `nbytes` over `size` ranks of this node, or None."""
        table = self.collectives.get(kind)
        if not table or nbytes <= 0:
            return None
        near = min(table, key=lambda s: (abs(s - size), -s))
        points = table[near]
        seconds = loglog(points, nbytes)
        # a group size that was not measured: scale by its ring steps (n - 1)
        seconds = seconds * (size - 1) / (near - 1) if near != size and near > 1 else seconds
        if self.collective_wait:  # in a step the peers are computing, not waiting at the collective
            seconds += min(self.collective_wait, key=lambda r: (abs(r[0] - size), -r[0]))[1]
        return seconds


def loglog(points: tuple[tuple[float, float], ...], x: float, extrapolate: bool = True) -> float:
    """Piecewise log-log interpolation of (x, y) points; below the first: its y (a latency); above the last:
    linear in x (bandwidth bound) when `extrapolate`, else the last y."""
    pts = sorted(points)
    if x <= pts[0][0]:
        return pts[0][1]
    if x >= pts[-1][0]:
        return pts[-1][1] * x / pts[-1][0] if extrapolate else pts[-1][1]
    for (x0, y0), (x1, y1) in itertools.pairwise(pts):
        if x0 <= x <= x1:
            w = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return math.exp((1 - w) * math.log(y0) + w * math.log(y1))
    raise AssertionError("unreachable")


def interpolate(points: tuple[tuple[float, ...], ...], key: tuple[float, ...]) -> tuple[float, ...]:
    """Values measured at scattered points (key..., value...) at `key`: a measured key gives its values;
    otherwise the geometric mean of the values of the points at most one octave (in log2 distance) farther than
    the nearest, weighted by inverse squared distance. Beyond the measured range this holds the nearest values
    rather than extrapolating."""
    dims = len(key)
    logs = [math.log2(max(x, 1e-9)) for x in key]
    scored = []
    for p in points:
        dist = math.sqrt(sum((math.log2(max(p[i], 1e-9)) - logs[i]) ** 2 for i in range(dims)))
        if dist < 1e-9:
            return tuple(p[dims:])
        scored.append((dist, p))
    nearest = min(d for d, _ in scored)
    near = [(1 / d**2, p) for d, p in scored if d <= nearest + 1]
    total = sum(w for w, _ in near)
    return tuple(math.exp(sum(w * math.log(p[dims + j]) for w, p in near) / total)
                 for j in range(len(points[0]) - dims))


def _from_base(name: str) -> Cluster:
    hw = HARDWARE[name]
    return Cluster(**{f.name: getattr(hw, f.name) for f in dataclasses.fields(Hardware)}, device=name,
                   matmul_efficiency=device_kernels(name).gemm_efficiency)


PRESETS: dict[str, Cluster] = {name: _from_base(name) for name in HARDWARE}
# the nominal CPU: selective recompute's per-operator dispatch as `fivefold calibrate` measures it on this project's
# 2-core machine (torch 2.13.0+cpu, 2 threads, 2026-11-28: the reference step 10.0 to 11.8 ms per block slower under
# selective recompute in four measurements, about 1 ms of it the element-wise work rerun; docs/planner.md)
PRESETS["cpu"] = dataclasses.replace(PRESETS["cpu"], selective_dispatch_us=10_000.0)
# The playbook's cluster (H100 80GB, NVLink inside nodes, AWS EFA between): the all-reduce bus bandwidth it
# measured at 256 MB (GB/s, by nodes), and the all-gather's. A calibrated profile of the kind `fivefold
# calibrate` produces.
PRESETS["h100-efa"] = dataclasses.replace(
    PRESETS["h100"], name="h100-efa",
    busbw_gbps={1: 436.0, 2: 361.7, 4: 160.1, 8: 99.6, 16: 84.7, 32: 64.9, 64: 32.9},
    # and its all-gather (reduce-scatter within 3 %: 249.7/181.6/115.8/68.6/54.5/27.9/11.1)
    gather_busbw_gbps={1: 249.8, 2: 184.6, 4: 119.0, 8: 69.0, 16: 55.0, 32: 28.0, 64: 11.0},
)


def get_cluster(name: str | None = None, file: str | Path | None = None) -> Cluster:
    """A preset by name, or a TOML file (optionally `base = "PRESET"` plus fields to override)."""
    if file is None:
        key = (name or "h100").lower()
        if key not in PRESETS:
            raise ConfigError(f"--gpu {shown(name)} is not known{did_you_mean(name, PRESETS)}; choose one of: "
                              f"{', '.join(PRESETS)}, "
                              "or describe the hardware in a TOML file (--hardware FILE)")
        return PRESETS[key]
    path = Path(file)
    return cluster_from_table(load_file(path, "--hardware", suffix=".toml"), str(path), name, path.stem)


def cluster_from_table(data: dict, where: str, name: str | None = None, default_name: str = "hardware") -> Cluster:
    """The cluster of a profile's parsed TOML (`get_cluster`'s file, or the tables `fivefold calibrate` is about to
    write): its `base` preset (else `name`, else h100) with the fields given, each checked."""
    if not data:
        raise ConfigError(f"--hardware {shown(where)} holds no fields; give base = \"PRESET\" and the fields to "
                          "override (or --gpu PRESET for a preset as it is)")
    data = hardware_table(data, where)
    data_keys = set(data)
    base_name = data.pop("base", name or "h100")
    if "base" in data_keys and (not isinstance(base_name, str) or base_name.lower() not in PRESETS):
        raise ConfigError(f"--hardware {shown(where)}: base = {shown(base_name)} is not a preset"
                          f"{did_you_mean(base_name, PRESETS)}; choose one of: "
                          f"{', '.join(PRESETS)}")
    base = get_cluster(base_name)
    ranks = data.pop("ranks", {})
    values = _parse_fields(data, "--hardware")
    if not isinstance(ranks, dict):
        raise ConfigError("--hardware [ranks] must be a table of [ranks.N] tables (N = ranks at once on a node)")
    by_ranks = {}
    for key, section in ranks.items():
        if not str(key).isdigit() or int(key) < 1 or not isinstance(section, dict):
            raise ConfigError(f"--hardware [ranks.{key}] must be named by a number of ranks >= 1 and be a table")
        by_ranks[int(key)] = _parse_fields(dict(section), f"--hardware [ranks.{key}]")
    if by_ranks:
        values["by_ranks"] = by_ranks
    values.setdefault("name", default_name)
    return dataclasses.replace(base, **values)


def hardware_table(data: dict, where: str) -> dict:
    """The hardware fields of a profile (one format for `plan`, `validate` and `calibrate`): top-level fields,
    or a [hardware] table (what `plan validate --fit` writes); a [framework] table is the framework's
    (`fivefold.planner.profile`)."""
    data = {k: v for k, v in data.items() if k != "framework"}
    nested = data.pop("hardware", None)
    if nested is not None:
        if not isinstance(nested, dict):
            raise ConfigError(f"--hardware {shown(where)}: [hardware] must be a table of hardware fields")
        clash = sorted(set(nested) & set(data))
        if clash:
            raise ConfigError(f"--hardware {shown(where)}: {', '.join(clash)} given both at the top level and under "
                              "[hardware]; keep one")
        data = {**nested, **data}
    return data


_TABLE_WIDTH = {"linear": 5, "attention": 5, "loss": 5, "elementwise": 2, "collective_wait": 2}
_INT_FIELDS = {"gpus_per_node", "cores", "threads_per_rank"}
# fields that may be 0 (0 = "not measured, derive it"; the stall and drift fields: no stall data)
_MAY_BE_ZERO = {"backward_overhead_us", "optimizer_gbps", "optimizer_tensor_us", "comm_overlap", "zero3_unit_us",
                "posted_p2p_wait_us", "pp_sync_us_per_node", "selective_dispatch_us"}


class Range(NamedTuple):
    """Where a field's number may lie: from `low` to `high` (None: no bound that side), each end itself allowed
    where `low_closed` / `high_closed`; `rule` says so in the error message. The hardware fields' shares
    (`_SHARES`) and a profile's [framework] numbers (`profile._FRAMEWORK_RANGES`) are checked with it."""
    low: float | None
    low_closed: bool
    high: float | None
    high_closed: bool
    rule: str

    def holds(self, value: float) -> bool:
        return ((self.low is None or value > self.low or (value == self.low and self.low_closed))
                and (self.high is None or value < self.high or (value == self.high and self.high_closed)))


# shares, chances and ratios (checked after the sign rule of `_parse_fields`, whose message a negative one gets)
_SHARES = {"matmul_efficiency": Range(0.0, False, 1.0, True, "a share of the matmul peak, in (0, 1]"),
           "comm_overlap": Range(0.0, True, 1.0, True, "a share of a collective's time, in [0, 1]"),
           "stall_hazard_per_node": Range(0.0, True, 1.0, False, "below 1 (a chance per node)"),
           "heap_retention": Range(1.0, True, None, True, ">= 1 (resident bytes per byte of live tensors)")}
# a device's own figures: beyond these bounds a value is a typo (a unit off by 10^3 or more), not a device
_DEVICE_BOUNDS = {"bf16_tflops": Range(0.0, False, 1e5, True, "at most 100,000 (TFLOP/s of one device)"),
                  "fp32_tflops": Range(0.0, False, 1e5, True, "at most 100,000 (TFLOP/s of one device)"),
                  "memory_gib": Range(0.01, True, 1e5, True, "between 0.01 and 100,000 (GiB of one device)"),
                  **dict.fromkeys(("hbm_gbps", "intra_node_gbps", "inter_node_gbps"),
                                  Range(0.0, False, 1e6, True, "at most 1,000,000 (GB/s of one device)"))}
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")


def checked_number(value, where: str, key: str, integer: bool = False, within: Range | None = None) -> float:
    """`value` of field `key` as a finite number (an integer where `integer`) in the range `within` where given,
    else a ConfigError naming it: TOML's true/false, strings, nan and inf are refused, not read as 1, a crash or a
    nan table."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        kind = "an integer" if integer else "a number"
        raise ConfigError(f"{where} {key} = {shown(value)} is not {kind}")
    if not math.isfinite(value):
        raise ConfigError(f"{where} {key} = {shown(value)} must be a finite number (nan and inf are refused)")
    if integer and not float(value).is_integer():
        raise ConfigError(f"{where} {key} = {shown(value)} must be a whole number")
    number = int(value) if integer else float(value)
    if within is not None and not within.holds(number):
        raise ConfigError(f"{where} {key} = {shown(number)} must be {within.rule}")
    return number


def _bandwidth_table(value, where: str, key: str) -> dict[int, float]:
    """busbw_gbps / gather_busbw_gbps: nodes spanned (an integer >= 1) -> GB/s (finite, > 0)."""
    if not isinstance(value, dict) or not value:
        raise ConfigError(f"{where} {key} = {shown(value)} must be a non-empty table of nodes spanned = GB/s, "
                          "e.g. [busbw_gbps] 1 = 436.0")
    table = {}
    for nodes, gbps in value.items():
        if not str(nodes).strip().isdigit() or int(nodes) < 1:
            raise ConfigError(f"{where} {key} key {shown(nodes)} must be a number of nodes (an integer >= 1)")
        gbps = checked_number(gbps, where, f"{key}[{nodes}]")
        if gbps <= 0:
            raise ConfigError(f"{where} {key}[{nodes}] = {gbps} must be > 0 (GB/s)")
        table[int(nodes)] = gbps
    return table


def _parse_fields(data: dict, where: str) -> dict:
    """Cluster fields from a TOML table, each checked (name, type, finiteness, sign, range) with the field named."""
    fields = {f.name for f in dataclasses.fields(Cluster)} - {"by_ranks", "match"}
    values: dict = {}
    for key, value in data.items():
        if key not in fields:
            raise ConfigError(f"{where} field {shown(key)} is not known{did_you_mean(key, fields)}; known fields: "
                              f"{', '.join(sorted(fields))}")
        if key in ("busbw_gbps", "gather_busbw_gbps"):
            value = _bandwidth_table(value, where, key)
        elif key in ("name", "device"):
            if not isinstance(value, str) or not value.strip():
                raise ConfigError(f"{where} {key} = {shown(value)} must be a non-empty string")
        elif key in _INT_FIELDS:
            value = checked_number(value, where, key, integer=True)
            low = 1 if key == "gpus_per_node" else 0
            if value < low:
                raise ConfigError(f"{where} {key} = {shown(value)} must be >= {low}")
        elif key in _TABLE_WIDTH:
            value = _table(value, _TABLE_WIDTH[key], f"{where} {key}")
        elif key == "collectives":
            value = _collectives(value, where)
        else:
            value = checked_number(value, where, key)
            may_be_zero = key in _MAY_BE_ZERO or key.startswith(("stall_", "drift_"))
            if value < 0 or (value == 0 and not may_be_zero):
                raise ConfigError(f"{where} {key} = {shown(value)} must be {'>= 0' if may_be_zero else '> 0'}")
            if key in _SHARES or key in _DEVICE_BOUNDS:  # after the sign rule: a negative share is told "> 0"
                value = checked_number(value, where, key, within=_SHARES.get(key) or _DEVICE_BOUNDS[key])
        values[key] = value
    return values


def _table(rows, width: int, where: str) -> tuple[tuple[float, ...], ...]:
    """Rows of `width` positive finite numbers."""
    if not isinstance(rows, list) or not rows:
        raise ConfigError(f"{where} must be a non-empty list of [{width} numbers] rows")
    out = []
    for row in rows:
        if not isinstance(row, list) or len(row) != width or not all(
                isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and x > 0 for x in row):
            raise ConfigError(f"{where} row {shown(row)} must be {width} positive finite numbers")
        out.append(tuple(float(x) for x in row))
    return tuple(out)


def _collectives(data, where: str) -> dict[str, dict[int, tuple[tuple[float, float], ...]]]:
    """[collectives.KIND] tables: group size -> [[bytes, seconds], ...]."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where} collectives must be a table of [collectives.KIND] tables")
    out = {}
    for kind, groups in data.items():
        if kind not in COLLECTIVES:
            raise ConfigError(f"{where} collectives.{kind} is not known; known: {', '.join(COLLECTIVES)}")
        if not isinstance(groups, dict):
            raise ConfigError(f"{where} collectives.{kind} must map group sizes to [[bytes, seconds], ...]")
        table = {}
        for size, rows in groups.items():
            if not str(size).isdigit() or int(size) < 2:
                raise ConfigError(f"{where} collectives.{kind} group size {shown(size)} must be a number >= 2")
            table[int(size)] = _table(rows, 2, f"{where} collectives.{kind}.{size}")
        out[kind] = table
    return out
