"""Published pre-training hyperparameters by model size, and the command lines that start a run.

`fivefold plan --write-config` and the configs in `examples/` take their optimizer settings from here:

| model                     | peak LR | warm-up          | decay                  | source                         |
|---------------------------|---------|------------------|------------------------|--------------------------------|
| dense, under 1B params    | 6e-4    | 375M tokens      | cosine to 10 % of peak | GPT-3 paper, table 2.1 (125M)  |
| dense, 1B to 20B          | 3e-4    | 2000 steps x 4M  | cosine to 10 % of peak | Llama 2 paper, 7B and 13B      |
| dense, 20B to 200B        | 1.5e-4  | 2000 steps x 4M  | cosine to 10 % of peak | Llama 2 paper, 34B and 70B     |
| dense, 200B and more      | 8e-5    | 8000 steps x 4M  | cosine to 1 % of peak  | Llama 3 paper, 405B            |
| mixture of experts        | 4e-4    | 10B tokens       | cosine to 10 % of peak | OLMoE paper (OLMoE-1B-7B)      |

All use AdamW with beta1 0.9, beta2 0.95, weight decay 0.1 and gradient clipping at 1.0 (eps 1e-5 for the
Llama runs, 1e-8 for OLMoE). Warm-up is kept in tokens, so that it does not change with the global batch, and
takes at most a tenth of the run (the published warm-ups are 0.1-0.5 % of their runs; GPT-3 125M's 375M tokens
are more than a whole 20-tokens-per-parameter budget of a model under 19M parameters, whose run they would
otherwise have stretched to the warm-up's length).
Llama 3 publishes the 405B's settings only; for 8B and 70B the Llama 2 recipe of the same size is used.
The token budget is 20 tokens per parameter (Chinchilla's compute-optimal ratio) unless `fivefold plan
--train-tokens` gives one; set train.max_steps to yours.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass

from fivefold.config import Config
from fivefold.flops import count_params

LLAMA_BATCH_TOKENS = 4 * 1024 * 1024  # Llama 2 / 3: 4M tokens per step
CHINCHILLA_TOKENS_PER_PARAM = 20
WARMUP_MAX_SHARE = 0.1  # the warm-up's largest share of the run's steps
DATA_PLACEHOLDER = "/path/to/prepared-data"  # `fivefold data prepare FILES --tokenizer MODEL_DIR --out DIR`


@dataclass(frozen=True)
class Recipe:
    lr: float
    min_lr_ratio: float
    warmup_tokens: int
    eps: float
    source: str
    beta1: float = 0.9
    beta2: float = 0.95
    weight_decay: float = 0.1
    grad_clip: float = 1.0


def published_recipe(params: int, is_moe: bool) -> Recipe:
    """The published hyperparameters closest to a model of `params` parameters (see the table above)."""
    if is_moe:
        return Recipe(4e-4, 0.1, 10_000_000_000, 1e-8, "OLMoE-1B-7B (Muennighoff et al. 2024)")
    if params < 1_000_000_000:
        return Recipe(6e-4, 0.1, 375_000_000, 1e-8, "GPT-3 125M (Brown et al. 2020, table 2.1)")
    if params < 20_000_000_000:
        return Recipe(3e-4, 0.1, 2000 * LLAMA_BATCH_TOKENS, 1e-5, "Llama 2 7B/13B (Touvron et al. 2023)")
    if params < 200_000_000_000:
        return Recipe(1.5e-4, 0.1, 2000 * LLAMA_BATCH_TOKENS, 1e-5, "Llama 2 34B/70B (Touvron et al. 2023)")
    return Recipe(8e-5, 0.01, 8000 * LLAMA_BATCH_TOKENS, 1e-5, "Llama 3 405B (Grattafiori et al. 2024)")


def warmup_steps(recipe: Recipe, batch_tokens: int, run_steps: int) -> int:
    """The recipe's warm-up in steps of `batch_tokens`, at most a tenth of a run of `run_steps` (at least 1)."""
    return max(1, min(round(recipe.warmup_tokens / batch_tokens), math.floor(WARMUP_MAX_SHARE * run_steps)))


def apply_recipe(conf: Config, accelerator: bool, train_tokens: int | None = None) -> Recipe:
    """Set `conf.train` to the published recipe of its model for its global batch: LR, warm-up, cosine decay,
    AdamW settings, a token budget (`train_tokens`, default 20 per parameter), evaluation and checkpoints;
    compile on accelerators (not under an attention mask, which runs eager); a data path to fill in."""
    t = conf.train
    params = count_params(conf.model)
    recipe = published_recipe(params, conf.model.is_moe)
    batch_tokens = t.global_batch_size * t.seq_len
    t.lr, t.min_lr_ratio, t.lr_schedule = recipe.lr, recipe.min_lr_ratio, "cosine"
    budget = train_tokens if train_tokens else CHINCHILLA_TOKENS_PER_PARAM * params
    steps = math.ceil(budget / batch_tokens)
    t.warmup_steps = warmup_steps(recipe, batch_tokens, steps)
    t.max_steps = max(t.warmup_steps + 1, steps)
    t.beta1, t.beta2, t.eps = recipe.beta1, recipe.beta2, recipe.eps
    t.weight_decay, t.grad_clip = recipe.weight_decay, recipe.grad_clip
    t.eval_every, t.eval_batches = 1000, 16
    t.checkpoint_every, t.keep_checkpoints = 500, 3
    # compiled on accelerators, but for an attention mask, whose attention runs one kernel per document
    t.compile = accelerator and not conf.model.masks_attention
    conf.data.path = DATA_PLACEHOLDER
    return recipe


def launch_lines(argv: list[str], nodes: int, gpus_per_node: int) -> list[str]:
    """The commands that start `fivefold train ARGV` (the run's own arguments, its --run-dir among them, e.g.
    `--config FILE --run-dir DIR`) on `nodes` x `gpus_per_node` devices (on several nodes: a shared file system,
    which every node reads and the first rank writes)."""
    given = " ".join(map(shlex.quote, argv))
    if nodes == 1:
        return [f"fivefold train {given} --nproc {gpus_per_node}"]
    return [
        f"fivefold train {given} --slurm train.sbatch --nodes {nodes} "
        f"--nproc {gpus_per_node} --time 48:00:00 --partition PARTITION --account ACCOUNT --setup setup.sh "
        "&& sbatch train.sbatch",
        f"torchrun --nnodes {nodes} --nproc-per-node {gpus_per_node} --rdzv-backend c10d "
        f"--rdzv-endpoint HEAD_NODE:29500 --rdzv-id RUN_ID -m fivefold train {given}",
    ]
