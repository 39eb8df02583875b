"""fivefold's training step against a plain Hugging Face `transformers` loop, in one process.

Both train the same shape at the same micro-batch and sequence length on synthetic tokens: fivefold through
its engine (fused chunked loss, fused AdamW, optional `torch.compile` of the blocks), transformers as
`LlamaForCausalLM` (SDPA attention) + `torch.optim.AdamW` under bf16 autocast (fp32 on CPU). Prints both
throughputs and their ratio.

    python benchmarks/hf_side_by_side.py --model llama-3.2-1b --seq-len 4096 --micro-batch 2 --steps 10 --compile
    python benchmarks/hf_side_by_side.py --model tiny --seq-len 128 --micro-batch 4 --steps 5   # CPU smoke run
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch

from fivefold.config import Config
from fivefold.device import resolve_device, use_bf16
from fivefold.flops import training_flops_per_token
from fivefold.presets import get_preset
from fivefold.train.build import build_engine
from fivefold.train.metrics import resolve_peak_tflops, synchronize


def hf_llama_config(cfg):
    from transformers import LlamaConfig

    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling:
        rope = {"rope_type": "llama3", "rope_theta": cfg.rope_theta, **cfg.rope_scaling}
    return LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden, intermediate_size=cfg.ffn,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
        max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps, rope_parameters=rope,
        tie_word_embeddings=cfg.tied_embeddings, attention_bias=False, mlp_bias=False,
    )


def time_steps(step, steps: int, warmup: int, device: torch.device) -> float:
    for _ in range(warmup):
        step()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    synchronize(device)
    return (time.perf_counter() - start) / steps


def time_fivefold(cfg: Config, device: torch.device, inputs: torch.Tensor, targets: torch.Tensor, steps: int,
                  warmup: int) -> float:
    engine = build_engine(cfg, device)

    def step() -> None:
        engine.forward_backward([(inputs, targets)], inputs.numel())
        engine.optimizer_step()

    return time_steps(step, steps, warmup, device)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--compile", action="store_true", help="torch.compile fivefold's blocks")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()

    cfg = Config()
    cfg.model = get_preset(args.model)
    cfg.model.max_seq_len = max(cfg.model.max_seq_len, args.seq_len)
    cfg.train.seq_len, cfg.train.global_batch_size = args.seq_len, args.micro_batch
    cfg.train.compile, cfg.train.warmup_steps = args.compile, 0
    device = resolve_device("auto")
    bf16 = use_bf16(cfg, device)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.model.vocab_size, (args.micro_batch, args.seq_len + 1), generator=gen).to(device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    n_tokens = inputs.numel()

    t_fivefold = time_fivefold(cfg, device, inputs, targets, args.steps, args.warmup)
    torch.compiler.reset()  # compiled graphs keep references to the engine's tensors
    gc.collect()
    if device.type != "cpu" and hasattr(torch.accelerator, "empty_cache"):
        torch.accelerator.empty_cache()

    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(hf_llama_config(cfg.model), attn_implementation="sdpa").to(device)
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-4, fused=device.type != "cpu")

    def hf_step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = hf(input_ids=inputs).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    t_hf = time_steps(hf_step, args.steps, args.warmup, device)
    flops = training_flops_per_token(cfg.model, args.seq_len)
    peak = resolve_peak_tflops(0.0, device)
    result = {
        "model": cfg.model.name, "device": str(device), "torch": torch.__version__, "seq_len": args.seq_len,
        "micro_batch": args.micro_batch, "dtype": "bf16" if bf16 else "fp32", "compile": args.compile,
        "fivefold_tokens_per_s": n_tokens / t_fivefold, "transformers_tokens_per_s": n_tokens / t_hf,
        "ratio": t_hf / t_fivefold,
        "fivefold_mfu": n_tokens / t_fivefold * flops / 1e12 / peak if peak else None,
        "transformers_mfu": n_tokens / t_hf * flops / 1e12 / peak if peak else None,
    }
    if args.json:
        print(json.dumps(result))
        return
    print(f"{result['model']} on {device} ({result['dtype']}, seq {args.seq_len}, micro-batch {args.micro_batch})")
    print(f"  fivefold      {result['fivefold_tokens_per_s']:>12,.0f} tokens/s")
    print(f"  transformers  {result['transformers_tokens_per_s']:>12,.0f} tokens/s")
    print(f"  ratio         {result['ratio']:.2f}x")


if __name__ == "__main__":
    main()
