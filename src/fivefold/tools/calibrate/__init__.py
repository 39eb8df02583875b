"""`fivefold calibrate`: measure the machine it runs on and write the hardware profile that `fivefold plan
--hardware FILE` (and the sweep's predictions) read.

What it measures, with local processes on the device's own backend (gloo on CPU, the accelerator's, e.g.
nccl, on GPUs), every figure the median of repeated timings:

* linear layers: forward, and backward (input and weight gradients), for the shapes of a block and of the output
  layer of the models of interest (`--model`, `--seq-len`) at micro-batches 1..32 (1..8 on accelerators) and the
  tp degrees up to `--nproc-max` that divide the model: TFLOP/s per (m, n, k);
* causal attention (`scaled_dot_product_attention`, grouped-query as the model), forward and backward;
* element-wise bandwidth by tensor size (the time beyond an operator's fixed cost), and that fixed cost: a
  chain of the operators a block runs besides its matmuls (norm, rotary, activation, adds, casts, views) on a
  tiny tensor, forward and backward, per operator;
* the optimizer step as the engine runs it (clip, AdamW, zero): bytes streamed per second and a cost per tensor;
* collectives: all-reduce, all-gather, reduce-scatter, all-to-all and send/recv, for every group size from 2 to
  the number of ranks running that divides it, and message sizes from 4 KiB to 16 MiB, while every rank takes
  part (the groups of one size run at once, as the groups of a layout's axis do);
* how much of an all-reduce hides behind compute running at the same time.

On a CPU the ranks of a node share its cores, and the sweep's runs put up to 4 ranks on 2 cores: every compute
figure is measured again with N processes running it at once (`--threads` intra-op threads each; by default each
rank's share of the cores, as `fivefold train` runs N local processes), for N = 1..`--nproc-max`. The profile holds
the figures measured with one rank at its top level and those with N ranks under `[ranks.N]`, each with its
`threads_per_rank`; the planner reads the table for the ranks a layout puts on a node
(`Cluster.on_node`). On an accelerator each rank has its own device, so compute is measured once.

Nothing here is fitted to training runs: the planner's predictions for the runs are built from these figures and
the model's shapes and operator counts.

The package: `targets` (what to measure: `Plan`, `Result`), `harness` (timing, the run's process groups),
`measure_compute` and `measure_comm` (the measurements), `ranks` (one group of ranks, started by the project's
launcher), `fit` (link constants), `profile` (the TOML profile) and `cli` (the `fivefold calibrate` verb).
"""

from __future__ import annotations

from fivefold.tools.calibrate.cli import add_arguments, calibrate, run
from fivefold.tools.calibrate.fit import fit_link
from fivefold.tools.calibrate.harness import (
           COLD_SPAN_BYTES,
           MAX_SETS,
           Clock,
           RankGroups,
           operand_sets,
           time_forward_backward,
)
from fivefold.tools.calibrate.measure_comm import monotone
from fivefold.tools.calibrate.profile import profile_tables, to_toml
from fivefold.tools.calibrate.targets import Plan, Result, make_plan, shapes_for

__all__ = ["COLD_SPAN_BYTES", "MAX_SETS", "Clock", "Plan", "RankGroups", "Result", "add_arguments", "calibrate",
           "fit_link", "time_forward_backward", "make_plan", "monotone", "operand_sets", "profile_tables", "run",
           "shapes_for", "to_toml"]
