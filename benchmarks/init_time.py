"""Time one rank takes to draw its initial weights: `models.llama.initial_values` over the regions that the rank
holds of a preset's blocks under tensor parallel (a column slice of o_proj and down_proj, a row slice of the other
projections, the norms whole), landing in tensors on the device. Prints the elements held, the elements drawn, the
seconds for `--blocks` blocks and that time scaled to the blocks of one pipeline stage (n_layers / pp).

    PYTHONPATH=src python benchmarks/init_time.py --preset llama-3.1-70b --tp 8 --pp 8 --blocks 1 --device cpu

No process group is made: the regions are those `parallel.parallelize.shard_regions` gives tp rank `--tp-rank`.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from fivefold.models import llama
from fivefold.models.llama import full_parameter_shapes, initial_values
from fivefold.parallel.tensor import tp_shard_dim
from fivefold.presets import get_preset


def rank_regions(shapes: dict[str, torch.Size], blocks: int, tp: int, tp_rank: int) -> dict[str, tuple]:
    """The (start, stop) per dim of every parameter of the first `blocks` blocks that tp rank `tp_rank` holds."""
    regions = {}
    for name, shape in shapes.items():
        if not name.startswith("layers.") or int(name.split(".")[1]) >= blocks:
            continue
        region = [(0, n) for n in shape]
        dim = tp_shard_dim(name) if tp > 1 else None
        if dim is not None:
            size = shape[dim] // tp
            region[dim] = (tp_rank * size, (tp_rank + 1) * size)
        regions[name] = tuple(region)
    return regions


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="llama-3.1-70b")
    parser.add_argument("--device", default="cpu")
    for flag, default, what in (("--tp", 8, "tensor-parallel size"), ("--tp-rank", 0, "the tp rank timed"),
                                ("--pp", 8, "pipeline stages (blocks per rank: n_layers / pp)"),
                                ("--blocks", 1, "blocks drawn (the time is scaled to a stage's)")):
        parser.add_argument(flag, type=int, default=default, help=what)
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = get_preset(args.preset)
    device = torch.device(args.device)
    shapes = full_parameter_shapes(cfg)
    regions = rank_regions(shapes, args.blocks, args.tp, args.tp_rank)
    draw = getattr(llama, "draw_initial_values", None)  # as `Llama.init_weights` does; older versions drew on the CPU
    held = sum(math.prod(b - a for a, b in r) for r in regions.values())
    sync = torch.accelerator.synchronize if device.type != "cpu" else (lambda: None)
    drawn = 0
    start = time.perf_counter()
    for name, region in regions.items():
        local = torch.empty([b - a for a, b in region], device=device)
        if draw is not None:
            drawn += draw(local, cfg, name, shapes[name], 0, region)
        else:
            local.copy_(initial_values(cfg, name, shapes[name], 0, region))
        del local
    sync()
    seconds = time.perf_counter() - start
    per_stage = cfg.n_layers // args.pp
    how = f"{drawn:,} values drawn on the device" if draw is not None else "drawn on the CPU"
    print(f"{args.preset} tp {args.tp} (rank {args.tp_rank}) on {device}: {held:,} elements held in {args.blocks} "
          f"block(s) ({how}) in {seconds:.2f} s; {per_stage} blocks per pp {args.pp} stage: "
          f"{seconds * per_stage / args.blocks:.1f} s per rank")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
