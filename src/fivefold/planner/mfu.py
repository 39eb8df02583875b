"""MFU as other frameworks count it (`fivefold plan --mfu-convention`): the same tokens/s and peak, another
FLOPs-per-token numerator. The planner's own (and the trainer's) is `fivefold.flops.training_flops_per_token`."""

from __future__ import annotations

from fivefold.config import ModelConfig, shown
from fivefold.flops import DocumentLengths, causal_equivalent, training_flops_per_token

CONVENTIONS = {
    "fivefold": "6 x matmul parameters (the output layer in, the embedding lookup out) + causal attention "
                "6 L s H d (fivefold.flops.training_flops_per_token, what `fivefold train` logs)",
    "torchtitan": "6 x (parameters - embedding) + 12 L s H d: attention not halved for causal masking "
                  "(torchtitan's get_num_flop_per_token)",
    "playbook": "6 N + 12 L h s with N counting the embedding table too (the Ultra-Scale Playbook's)",
}


def flops_per_token(cfg: ModelConfig, seq: int, convention: str, docs: DocumentLengths | None = None) -> float:
    """Training FLOPs per token under a convention (norm weights, < 0.01 % of the parameters, left out). fivefold's
    counts the attention the model's mask executes (`docs`: the documents' lengths under a document mask); the
    others count the whole score matrix whatever the mask, as their formulas do for a document mask."""
    if convention == "fivefold":
        return training_flops_per_token(cfg, seq, docs=docs)
    full = training_flops_per_token(causal_equivalent(cfg), seq, "full")
    if convention == "torchtitan":
        return full
    if convention == "playbook":  # the input embedding's table counted as well (once when tied to the output)
        return full + (0 if cfg.tied_embeddings else 6 * cfg.vocab_size * cfg.hidden)
    raise ValueError(f"MFU convention {shown(convention)} is not one of {', '.join(CONVENTIONS)}")


def mfu_scale(cfg: ModelConfig, seq: int, convention: str, docs: DocumentLengths | None = None) -> float:
    """What multiplies fivefold's MFU to give the convention's."""
    return flops_per_token(cfg, seq, convention, docs) / training_flops_per_token(cfg, seq, docs=docs)
