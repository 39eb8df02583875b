"""Parallel mechanisms: the process grid (`mesh`), data parallel and ZeRO (`data`), tensor and sequence parallel
(`tensor`), expert parallel (`expert`), context parallel (`context`), pipeline parallel (`pipeline`, its schedules
in `schedules`, its point-to-point exchange in `pipeline_comm`), recompute (`recompute`), applied to a plain model
in order by `parallelize` (steps 1 to 5 on each model part, data parallel once). Each technique keeps its
communication primitives in a `*_comm.py` beside it.

This package holds mechanisms only: it imports neither `fivefold.train` (the engine that drives these mechanisms,
`fivefold.train.engine`, built by `fivefold.train.build`) nor `fivefold.planner`. Processes are started by
`fivefold.launch`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fivefold.parallel.mesh import ProcessGrid

__all__ = ["ProcessGrid"]


def __getattr__(name: str) -> Any:
    # imported on first use, so that the torch-free modules here (`schedules`, used by the planner) do not pull in
    # torch.distributed with the package
    if name == "ProcessGrid":
        from fivefold.parallel.mesh import ProcessGrid

        return ProcessGrid
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
