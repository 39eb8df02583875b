"""Named model shapes (`ModelConfig`s): the config resolves `model.preset` from this table, `fivefold models` lists
them with their parameter counts."""

from __future__ import annotations

import dataclasses

from fivefold.config import ConfigError, ModelConfig, did_you_mean, shown

_LLAMA31_SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192.0}
_LLAMA32_SCALING = {**_LLAMA31_SCALING, "factor": 32.0}

# (shape, published parameter count or None, note)
PRESETS: dict[str, tuple[ModelConfig, int | None, str]] = {
    "tiny": (ModelConfig(name="tiny"), None, "test model; trains in minutes on CPU"),
    "tiny-moe": (
        ModelConfig(name="tiny-moe", n_experts=4, top_k=2, n_shared_experts=1, moe_ffn=128),
        None, "test MoE: 4 experts, top-2, one shared expert",
    ),
    "smollm-135m": (
        ModelConfig(name="smollm-135m", n_layers=30, hidden=576, n_heads=9, n_kv_heads=3, ffn=1536,
                    vocab_size=49152, max_seq_len=2048, tied_embeddings=True),
        134_515_008, "HuggingFaceTB/SmolLM-135M",
    ),
    "smollm-360m": (
        ModelConfig(name="smollm-360m", n_layers=32, hidden=960, n_heads=15, n_kv_heads=5, ffn=2560,
                    vocab_size=49152, max_seq_len=2048, tied_embeddings=True),
        361_821_120, "HuggingFaceTB/SmolLM-360M",
    ),
    "smollm-1.7b": (
        ModelConfig(name="smollm-1.7b", n_layers=24, hidden=2048, n_heads=32, n_kv_heads=32, ffn=8192,
                    vocab_size=49152, max_seq_len=2048, tied_embeddings=True),
        1_711_376_384, "HuggingFaceTB/SmolLM-1.7B",
    ),
    "llama-3.2-1b": (
        ModelConfig(name="llama-3.2-1b", n_layers=16, hidden=2048, n_heads=32, n_kv_heads=8, ffn=8192,
                    vocab_size=128256, max_seq_len=131072, rope_theta=500000.0,
                    rope_scaling=dict(_LLAMA32_SCALING), tied_embeddings=True),
        1_235_814_400, "meta-llama/Llama-3.2-1B",
    ),
    "llama-3.2-3b": (
        ModelConfig(name="llama-3.2-3b", n_layers=28, hidden=3072, n_heads=24, n_kv_heads=8, ffn=8192,
                    vocab_size=128256, max_seq_len=131072, rope_theta=500000.0,
                    rope_scaling=dict(_LLAMA32_SCALING), tied_embeddings=True),
        3_212_749_824, "meta-llama/Llama-3.2-3B",
    ),
    "llama-3.1-8b": (
        ModelConfig(name="llama-3.1-8b", n_layers=32, hidden=4096, n_heads=32, n_kv_heads=8, ffn=14336,
                    vocab_size=128256, max_seq_len=131072, rope_theta=500000.0,
                    rope_scaling=dict(_LLAMA31_SCALING), tied_embeddings=False),
        8_030_261_248, "meta-llama/Llama-3.1-8B",
    ),
    "llama-3.1-70b": (
        ModelConfig(name="llama-3.1-70b", n_layers=80, hidden=8192, n_heads=64, n_kv_heads=8, ffn=28672,
                    vocab_size=128256, max_seq_len=131072, rope_theta=500000.0,
                    rope_scaling=dict(_LLAMA31_SCALING), tied_embeddings=False),
        70_553_706_496, "meta-llama/Llama-3.1-70B",
    ),
    "llama-3.1-405b": (
        ModelConfig(name="llama-3.1-405b", n_layers=126, hidden=16384, n_heads=128, n_kv_heads=8, ffn=53248,
                    vocab_size=128256, max_seq_len=131072, rope_theta=500000.0,
                    rope_scaling=dict(_LLAMA31_SCALING), tied_embeddings=False),
        405_853_388_800, "meta-llama/Llama-3.1-405B",
    ),
    # The Ultra-Scale Playbook's benchmark shapes (nanotron, full multi-head attention, vocab 131072).
    "playbook-1b": (
        ModelConfig(name="playbook-1b", n_layers=16, hidden=2048, n_heads=32, n_kv_heads=32, ffn=8192,
                    vocab_size=131072, max_seq_len=4096, tied_embeddings=True),
        None, "playbook benchmark '1B' (1.34B)",
    ),
    "playbook-3b": (
        ModelConfig(name="playbook-3b", n_layers=28, hidden=3072, n_heads=32, n_kv_heads=32, ffn=8192,
                    vocab_size=131072, max_seq_len=4096, tied_embeddings=True),
        None, "playbook benchmark '3B' (3.57B)",
    ),
    "playbook-8b": (
        ModelConfig(name="playbook-8b", n_layers=32, hidden=4096, n_heads=32, n_kv_heads=32, ffn=14336,
                    vocab_size=131072, max_seq_len=4096, tied_embeddings=False),
        None, "playbook benchmark '8B' (8.86B)",
    ),
    "playbook-80b": (
        ModelConfig(name="playbook-80b", n_layers=80, hidden=8192, n_heads=64, n_kv_heads=64, ffn=28672,
                    vocab_size=131072, max_seq_len=4096, tied_embeddings=False),
        None, "playbook benchmark '80B' (80.0B)",
    ),
    "mixtral-mini": (
        ModelConfig(name="mixtral-mini", n_layers=8, hidden=512, n_heads=8, n_kv_heads=2, ffn=1024,
                    vocab_size=32000, max_seq_len=4096, rope_theta=1e6, tied_embeddings=False,
                    n_experts=8, top_k=2),
        None, "small Mixtral-style MoE: 8 experts, top-2",
    ),
    "olmoe-1b-7b": (
        ModelConfig(name="olmoe-1b-7b", n_layers=16, hidden=2048, n_heads=16, n_kv_heads=16, ffn=1024,
                    vocab_size=50304, max_seq_len=4096, tied_embeddings=False, n_experts=64, top_k=8),
        None, "allenai/OLMoE-1B-7B's shape (64 experts, top-8; without its QK-norm)",
    ),
    "olmoe-1b-7b-0924": (
        ModelConfig(name="olmoe-1b-7b-0924", n_layers=16, hidden=2048, n_heads=16, n_kv_heads=16, ffn=1024,
                    vocab_size=50304, max_seq_len=4096, tied_embeddings=False, n_experts=64, top_k=8,
                    qk_norm="full", norm_topk=False, aux_loss_coef=0.01),
        None, "allenai/OLMoE-1B-7B-0924 as published: QK-norm over the whole projections, top-8 of 64 unnormalised",
    ),
    "qwen2.5-7b": (
        ModelConfig(name="qwen2.5-7b", n_layers=28, hidden=3584, n_heads=28, n_kv_heads=4, ffn=18944,
                    vocab_size=152064, max_seq_len=131072, rope_theta=1e6, norm_eps=1e-6, tied_embeddings=False,
                    qkv_bias=True),
        7_615_616_512, "Qwen/Qwen2.5-7B: q/k/v biases",
    ),
    "qwen3-8b": (
        ModelConfig(name="qwen3-8b", n_layers=36, hidden=4096, n_heads=32, n_kv_heads=8, ffn=12288,
                    vocab_size=151936, max_seq_len=40960, rope_theta=1e6, norm_eps=1e-6, tied_embeddings=False,
                    qk_norm="head"),
        8_190_735_360, "Qwen/Qwen3-8B: per-head query/key norms",
    ),
    "qwen3-30b-a3b": (
        ModelConfig(name="qwen3-30b-a3b", n_layers=48, hidden=2048, n_heads=32, n_kv_heads=4, head_size=128,
                    ffn=6144, moe_ffn=768, vocab_size=151936, max_seq_len=40960, rope_theta=1e6, norm_eps=1e-6,
                    tied_embeddings=False, n_experts=128, top_k=8, qk_norm="head", aux_loss_coef=0.001),
        30_532_122_624, "Qwen/Qwen3-30B-A3B: 128 experts, top-8; heads of 128 (4,096 wide against hidden 2,048)",
    ),
    "qwen1.5-moe-a2.7b": (
        ModelConfig(name="qwen1.5-moe-a2.7b", n_layers=24, hidden=2048, n_heads=16, n_kv_heads=16, ffn=5632,
                    moe_ffn=1408, vocab_size=151936, max_seq_len=8192, rope_theta=1e6, norm_eps=1e-6,
                    tied_embeddings=False, n_experts=60, top_k=4, norm_topk=False, n_shared_experts=4,
                    shared_expert_gate=True, qkv_bias=True),
        14_315_784_192, "Qwen/Qwen1.5-MoE-A2.7B (Qwen2-MoE): 60 experts, top-4, a gated shared expert 4x as wide",
    ),
    "mixtral-8x7b": (
        ModelConfig(name="mixtral-8x7b", n_layers=32, hidden=4096, n_heads=32, n_kv_heads=8, ffn=14336,
                    vocab_size=32000, max_seq_len=32768, rope_theta=1e6, tied_embeddings=False, n_experts=8,
                    top_k=2, aux_loss_coef=0.02),
        46_702_792_704, "mistralai/Mixtral-8x7B-v0.1: 8 experts, top-2",
    ),
}

# other names `get_preset` accepts (wherever a preset is named: --preset, plan --model), listed by `fivefold models`
ALIASES = {"llama3.2-1b": "llama-3.2-1b", "llama3.2-3b": "llama-3.2-3b", "llama3-8b": "llama-3.1-8b",
            "llama3.1-8b": "llama-3.1-8b", "llama3-70b": "llama-3.1-70b", "llama3.1-70b": "llama-3.1-70b",
            "llama3-405b": "llama-3.1-405b", "llama3.1-405b": "llama-3.1-405b",
            "1b": "playbook-1b", "3b": "playbook-3b", "8b": "playbook-8b", "80b": "playbook-80b"}


def get_preset(name: str) -> ModelConfig:
    """A fresh copy of the named preset's shape; raises ConfigError listing the valid names."""
    key = ALIASES.get(name.lower(), name.lower())
    if key not in PRESETS:
        raise ConfigError(f"model.preset = {shown(name)} is not a preset{did_you_mean(name, [*PRESETS, *ALIASES])}; "
                          f"choose one of: {', '.join(PRESETS)} (or an "
                          f"alias: {', '.join(ALIASES)}; `fivefold models` lists them)")
    return dataclasses.replace(PRESETS[key][0], rope_scaling=dict(PRESETS[key][0].rope_scaling))


def aliases_of(name: str) -> list[str]:
    """The aliases that name preset `name`."""
    return [alias for alias, target in ALIASES.items() if target == name]
