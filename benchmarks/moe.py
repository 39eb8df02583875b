"""MoE on the CPU: the grouped experts (`model.moe_impl = "grouped"`) against the padded ones, and the expert load
with and without auxiliary-loss-free bias balancing.

    python benchmarks/moe.py speed [--steps 10]   # tokens/s, grouped vs padded
    python benchmarks/moe.py balance [--steps 200]  # largest expert load / mean load after training

`speed` times forward + backward (no optimizer step) of (1) the `tiny-moe` preset on batches of 8 x 256 tokens and
(2) an OLMoE-shaped model cut to two layers (hidden 2048, 64 experts of 1024, top-8, 16 heads; vocabulary cut to
8,192 so that the embedding does not dominate) on 2 x 256 tokens: the median of the timed steps after two untimed.

`balance` trains `tiny-moe` for `--steps` optimizer steps on the bundled corpus (seq 256, global batch 16, lr 3e-3)
in three settings: no balancing at all, the Switch loss (aux_loss_coef 0.01, the default), and the bias
(aux_loss_coef 0, bias_update_rate 1e-3, DeepSeek-V3's rate); then routes 16 x 256 held-out tokens and prints, per
setting, the largest expert's share of the routed slots over the mean share, per layer and averaged.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

from fivefold.config import build_config
from fivefold.models.llama import MoE, build_model
from fivefold.presets import get_preset


def step_seconds(model: torch.nn.Module, tokens: torch.Tensor, steps: int) -> float:
    """Median seconds of forward + backward of the next-token loss, after two untimed steps."""
    times = []
    for i in range(steps + 2):
        start = time.perf_counter()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()) + 0.01 * model.moe_aux_loss()
        loss.backward()
        model.zero_grad(set_to_none=True)
        if i >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def speed(steps: int) -> None:
    olmoe = get_preset("olmoe-1b-7b")
    shapes = {
        "tiny-moe": (get_preset("tiny-moe"), 8, 256),
        "olmoe-shaped, 2 layers": (olmoe.__class__(**{**olmoe.__dict__, "n_layers": 2, "vocab_size": 8192}), 2, 256),
    }
    for name, (cfg, rows, seq) in shapes.items():
        tokens = torch.randint(0, cfg.vocab_size, (rows, seq + 1), generator=torch.Generator().manual_seed(0))
        results = {}
        for impl in ("grouped", "padded"):
            cfg.moe_impl = impl
            model = build_model(cfg, seed=0)
            results[impl] = rows * seq / step_seconds(model, tokens, steps)
            del model
        print(f"{name}: grouped {results['grouped']:,.0f} tokens/s, padded {results['padded']:,.0f} tokens/s "
              f"(x{results['grouped'] / results['padded']:.2f}), forward + backward, {rows} x {seq} tokens, "
              f"{torch.get_num_threads()} threads", flush=True)


def expert_loads(model: torch.nn.Module, batches: list[torch.Tensor]) -> list[torch.Tensor]:
    """Slots routed to each expert of each MoE layer over `batches` (routing as in training, bias included)."""
    loads: dict[int, torch.Tensor] = {}

    def count(index: int):
        def hook(moe: MoE, args: tuple) -> None:
            experts, _ = moe.route(args[0].reshape(-1, args[0].shape[-1]))
            counts = torch.bincount(experts.reshape(-1), minlength=moe.n_experts)
            loads[index] = loads.get(index, 0) + counts
        return hook

    moes = [m for m in model.modules() if isinstance(m, MoE)]
    handles = [m.register_forward_pre_hook(count(i)) for i, m in enumerate(moes)]
    with torch.no_grad():
        for tokens in batches:
            model(tokens)
    for h in handles:
        h.remove()
    return [loads[i] for i in range(len(moes))]


def balance(steps: int, only: str | None = None) -> None:
    from fivefold.train.build import build_engine
    from fivefold.train.loop import load_data, split_micro_batches

    settings = {
        "no balancing": {"model.aux_loss_coef": "0"},
        "Switch loss 0.01": {},
        "bias 1e-3, no aux loss": {"model.aux_loss_coef": "0", "model.bias_update_rate": "1e-3"},
    }
    for name, changes in settings.items():
        if only is not None and only != name:
            continue
        overrides = {"train.seq_len": "256", "train.global_batch_size": "16", "train.max_steps": str(steps),
                     "train.lr": "3e-3", "train.warmup_steps": "10", "train.device": "cpu", "train.dtype": "fp32",
                     "run_dir": tempfile.mkdtemp(), **changes}
        cfg = build_config(None, {**overrides}, preset="tiny-moe")
        cfg.validate()
        _, _, sampler, val_data = load_data(cfg, True, None)
        engine = build_engine(cfg, torch.device("cpu"))
        start = time.perf_counter()
        tokens = cfg.train.global_batch_size * cfg.train.seq_len
        for step in range(steps):
            engine.set_lr(step)
            inputs, targets = sampler.rank_batch(step, 0, 1)
            engine.forward_backward(split_micro_batches(inputs, targets, cfg.micro_batch_size, engine.device), tokens)
            engine.optimizer_step()
        loads = expert_loads(engine.model, [inputs for inputs, _ in val_data])
        ratios = [float(load.max() / load.float().mean()) for load in loads]
        print(f"{name}: max/mean expert load after {steps} steps, per layer "
              f"{', '.join(f'{r:.2f}' for r in ratios)}; mean {statistics.mean(ratios):.2f} "
              f"({time.perf_counter() - start:.0f} s)", flush=True)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=("speed", "balance"))
    parser.add_argument("--steps", type=int, default=0, help="timed steps (speed, 10) or training steps (balance, 200)")
    parser.add_argument("--setting", help="balance: only this setting (e.g. 'Switch loss 0.01')")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    if args.what == "speed":
        speed(args.steps or 10)
    else:
        balance(args.steps or 200, args.setting)


if __name__ == "__main__":
    main(sys.argv[1:])
