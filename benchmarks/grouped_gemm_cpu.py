"""The routed experts' grouped GEMMs on this CPU against a large fp32 matmul: the figure of the planner's `cpu`
kernel class `grouped_gemm_efficiency` (src/fivefold/planner/devices/kernels.toml, docs/planner.md).

    python benchmarks/grouped_gemm_cpu.py [--threads 1] [--repeats 5]

Times the forward and backward of `MoE.grouped_experts` (the model's own code: `torch.nn.functional.grouped_mm`
where it runs on the CPU, else one matmul per expert) on balanced slots for the tiny-moe shape and an OLMoE-shaped
expert set cut to fit (hidden 1024, expert ffn 512, 64 experts, top-8), and a 2048^3 fp32 matmul forward and backward
(the large GEMM whose speed the `cpu` preset's peak stands for, `gemm_efficiency = 1.0`); prints TFLOP/s and the ratio,
which is the grouped class's share of that peak. Best of `--repeats` after one warm-up.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

from fivefold.models.llama import MoE
from fivefold.presets import get_preset


def best_seconds(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def grouped_tflops(cfg, tokens: int, repeats: int) -> float:
    torch.manual_seed(0)
    moe = MoE(cfg)
    slots = tokens * cfg.top_k
    counts = torch.full((cfg.n_experts,), slots // cfg.n_experts, dtype=torch.int64)
    rows = torch.randn(slots, cfg.hidden, requires_grad=True)
    grad = torch.randn(slots, cfg.hidden)  # a dense output gradient, as the combine's backward gives

    def step() -> None:
        moe.grouped_experts(rows, counts).backward(grad)

    flops = 3 * 2 * cfg.mlp_matrices * slots * cfg.hidden * cfg.expert_ffn  # forward 2 m n k per matrix, backward 2x
    return flops / best_seconds(step, repeats) / 1e12


def matmul_tflops(n: int, repeats: int) -> float:
    a = torch.randn(n, n, requires_grad=True)
    b = torch.randn(n, n, requires_grad=True)
    grad = torch.randn(n, n)
    return 3 * 2 * n**3 / best_seconds(lambda: (a @ b).backward(grad), repeats) / 1e12


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    tiny = get_preset("tiny-moe")
    olmoe = dataclasses.replace(get_preset("olmoe-1b-7b"), hidden=1024, moe_ffn=512, n_layers=1)
    large = matmul_tflops(2048, args.repeats)
    out = {"torch": torch.__version__, "threads": args.threads, "matmul_2048_tflops": large}
    for name, cfg, tokens in (("tiny-moe", tiny, 2048), ("olmoe-cut", olmoe, 1024)):
        t = grouped_tflops(cfg, tokens, args.repeats)
        out[name] = {"tokens": tokens, "experts": cfg.n_experts, "top_k": cfg.top_k, "hidden": cfg.hidden,
                     "expert_ffn": cfg.expert_ffn, "grouped_tflops": t, "share_of_matmul": t / large}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
