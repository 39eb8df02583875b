"""Hugging Face `config.json` -> fivefold's `ModelConfig`, without torch: the architectures fivefold reads, the
checks of each value read, and the reading itself. `models.hf` (the weights, which need torch) re-exports these
names; the planner (`fivefold plan --model config.json`, `planner.shapes`) imports them from here, so that it runs
without importing torch (tests/test_architecture.py).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from fivefold.config import ConfigError, ModelConfig, load_file, shown

LLAMA_ARCH = "LlamaForCausalLM"
MIXTRAL_ARCH = "MixtralForCausalLM"
MISTRAL_ARCH = "MistralForCausalLM"  # Llama's weights and blocks with a sliding window (`sliding_window`)
QWEN2_ARCH = "Qwen2ForCausalLM"  # Llama's with query/key/value biases, and a window in none or every layer
QWEN3_ARCH = "Qwen3ForCausalLM"  # Llama's with per-head query/key norms, and a window as Qwen2's
QWEN3_MOE_ARCH = "Qwen3MoeForCausalLM"  # Mixtral's routing with per-head query/key norms, top-k normalisation optional
OLMOE_ARCH = "OlmoeForCausalLM"  # the same with query/key norms over the whole projections
QWEN2_MOE_ARCH = "Qwen2MoeForCausalLM"  # query/key/value biases and a shared expert with a sigmoid gate
_MODEL_TYPES = {"llama": LLAMA_ARCH, "mixtral": MIXTRAL_ARCH, "mistral": MISTRAL_ARCH, "qwen2": QWEN2_ARCH,
                "qwen3": QWEN3_ARCH, "qwen3_moe": QWEN3_MOE_ARCH, "olmoe": OLMOE_ARCH, "qwen2_moe": QWEN2_MOE_ARCH}
_MOE_ARCHS = (MIXTRAL_ARCH, QWEN3_MOE_ARCH, OLMOE_ARCH, QWEN2_MOE_ARCH)
# model.qk_norm of each architecture (else "none")
_QK_NORMS = {QWEN3_ARCH: "head", QWEN3_MOE_ARCH: "head", OLMOE_ARCH: "full"}
_ROPE_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def read_config_json(config: dict[str, Any] | str | Path) -> dict[str, Any]:
    """A Hugging Face `config.json` as a dict (given as a dict, the file, or its directory)."""
    if isinstance(config, dict):
        return config
    path = Path(config)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"Hugging Face config {shown(str(path))} does not exist")
    return load_file(path, "Hugging Face config", suffix=".json", unique_keys=False)  # bounded in size and nesting


def _architecture(hf: dict[str, Any]) -> str:
    archs = hf.get("architectures") or []
    if archs:
        arch = archs[0]
    else:
        arch = _MODEL_TYPES.get(str(hf.get("model_type", "")), str(hf.get("model_type")))
    if arch not in _MODEL_TYPES.values():
        raise ConfigError(
            f"Hugging Face architecture {shown(arch)} is not supported; fivefold reads "
            f"{', '.join(_MODEL_TYPES.values())}"
        )
    return arch


# the config.json values read as integers and as real numbers (each may be absent; null where the reader allows it)
_HF_INT_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                "num_key_value_heads", "max_position_embeddings", "head_dim", "sliding_window", "max_window_layers",
                "num_local_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                "shared_expert_intermediate_size")
_HF_FLOAT_KEYS = ("rope_theta", "rms_norm_eps", "initializer_range", "router_aux_loss_coef")
_HF_BOOL_KEYS = ("tie_word_embeddings",)  # read as true/false: a string "no" is not read as true


def check_hf_values(hf: dict[str, Any], ints: tuple[str, ...] = _HF_INT_KEYS, floats: tuple[str, ...] = _HF_FLOAT_KEYS,
                    bools: tuple[str, ...] = _HF_BOOL_KEYS) -> None:
    """Every value fivefold reads from a config.json (the keys `ints`, `floats` and `bools`, each may be absent or
    null) is a value of its kind (an integer field: a whole number, 64.5 and "big" refused rather than truncated or
    a traceback; a real field: finite; a boolean: true or false), named in the error. The planner's GELU shapes
    (`planner.shapes`) check their own keys with it."""
    for key in ints:
        value = hf.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
                or not float(value).is_integer():
            raise ConfigError(f"Hugging Face config {key} = {shown(value)} is not an integer")
    for key in floats:
        value = hf.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)
                                  or not math.isfinite(value)):
            raise ConfigError(f"Hugging Face config {key} = {shown(value)} is not a finite number")
    for key in bools:
        value = hf.get(key)
        if value is not None and not isinstance(value, bool):
            raise ConfigError(f"Hugging Face config {key} = {shown(value)} is not a boolean (true or false)")


def _rope_settings(hf: dict[str, Any]) -> tuple[float, dict[str, float]]:
    """rope_theta and the Llama-3 scaling dict from either the transformers 4 keys (`rope_theta`,
    `rope_scaling`) or the transformers 5 `rope_parameters` dict."""
    for key in ("rope_scaling", "rope_parameters"):
        if hf.get(key) is not None and not isinstance(hf[key], dict):
            raise ConfigError(f"Hugging Face config {key} = {shown(hf[key])} must be an object or null")
    params = hf.get("rope_parameters") or {}
    theta = hf.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling") or params
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if rope_type == "default":
        return float(theta), {}
    if rope_type != "llama3":
        raise ConfigError(
            f"Hugging Face rope_type = {shown(rope_type)} is not supported; fivefold implements 'default' and "
            "'llama3'"
        )
    missing = [k for k in _ROPE_SCALING_KEYS if k not in scaling]
    if missing:
        raise ConfigError(f"Hugging Face rope_scaling of type 'llama3' lacks keys {missing}")
    for key in ("rope_theta", *_ROPE_SCALING_KEYS):
        value = theta if key == "rope_theta" else scaling[key]
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise ConfigError(f"Hugging Face rope_scaling {key} = {shown(value)} is not a finite number")
    return float(theta), {k: float(scaling[k]) for k in _ROPE_SCALING_KEYS}


def model_config_from_hf(config: dict[str, Any] | str | Path, name: str | None = None) -> ModelConfig:
    """The fivefold ModelConfig of a Hugging Face `config.json` (a dict, the file, or its directory).

    Reads the architectures of `_MODEL_TYPES` (Mistral and Mixtral with their `sliding_window`, null meaning none;
    Qwen2 and Qwen3 with their window when `use_sliding_window` puts it in every layer); raises ConfigError for anything
    fivefold's model cannot represent (another architecture, biases on other linears, ...).
    """
    hf = read_config_json(config)
    if name is None and not isinstance(config, dict):
        path = Path(config)
        name = (path if path.is_dir() else path.parent).resolve().name
    arch = _architecture(hf)
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        if hf.get(key) is None:
            raise ConfigError(f"Hugging Face config lacks {shown(key)}, which {arch} requires")
    check_hf_values(hf)
    hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(
            f"Hugging Face hidden_act = {shown(hf['hidden_act'])} is not supported; fivefold uses 'silu'"
        )
    for key in ("attention_bias", "mlp_bias", *(("qkv_bias",) if arch != QWEN2_MOE_ARCH else ())):
        if hf.get(key):
            raise ConfigError(f"Hugging Face {key} = true is not supported; fivefold's linears have no bias")
    head_dim = hf.get("head_dim")  # read as model.head_size when it is not hidden / heads (Qwen3-MoE)
    head_size = int(head_dim) if head_dim is not None and heads and int(head_dim) * heads != hidden else None
    window = _layer_window(hf) if arch in (QWEN2_ARCH, QWEN3_ARCH) else hf.get("sliding_window")
    if window and arch == LLAMA_ARCH:
        raise ConfigError(
            f"Hugging Face sliding_window = {hf['sliding_window']} is not read for {LLAMA_ARCH}, which attends to "
            f"the whole causal context (use null, or {MISTRAL_ARCH} for a windowed model)"
        )
    _refuse_unsupported_moe_features(hf, arch)
    theta, scaling = _rope_settings(hf)
    is_mixtral = arch in _MOE_ARCHS
    cfg = ModelConfig(
        name=name or str(hf.get("_name_or_path") or ("hf-mixtral" if is_mixtral else "hf-llama")),
        n_layers=int(hf["num_hidden_layers"]),
        hidden=hidden,
        n_heads=heads,
        n_kv_heads=int(hf.get("num_key_value_heads") or heads),
        ffn=int(hf["intermediate_size"]),
        vocab_size=int(hf["vocab_size"]),
        max_seq_len=int(hf.get("max_position_embeddings", 131072 if is_mixtral else 2048)),
        rope_theta=theta,
        rope_scaling=scaling,
        norm_eps=float(hf.get("rms_norm_eps", 1e-5 if is_mixtral else 1e-6)),
        tied_embeddings=bool(hf.get("tie_word_embeddings", False)),
        init_std=float(hf.get("initializer_range", 0.02)),
        sliding_window=int(window) if window else None,
        qkv_bias=arch == QWEN2_ARCH,  # Qwen2's query, key and value projections always have biases
        head_size=head_size,
        qk_norm=_QK_NORMS.get(arch, "none"),
    )
    if is_mixtral:
        cfg.n_experts = int(hf.get("num_local_experts") or hf.get("num_experts") or 8)
        cfg.top_k = int(hf.get("num_experts_per_tok", 2))
        cfg.n_shared_experts = 0
        expert_ffn = int(hf.get("moe_intermediate_size") or 0) if arch in (QWEN3_MOE_ARCH, QWEN2_MOE_ARCH) else 0
        cfg.moe_ffn = expert_ffn if expert_ffn != cfg.ffn else 0
        cfg.capacity_factor = 0.0  # the routing of all three is dropless
        cfg.aux_loss_coef = float(hf.get("router_aux_loss_coef", cfg.aux_loss_coef))
        cfg.norm_topk = arch == MIXTRAL_ARCH or bool(hf.get("norm_topk_prob", False))
        if arch == QWEN2_MOE_ARCH:
            cfg.qkv_bias = bool(hf.get("qkv_bias", True))
            cfg.n_shared_experts = _shared_experts(int(hf.get("shared_expert_intermediate_size") or 0), cfg.expert_ffn)
            cfg.shared_expert_gate = cfg.n_shared_experts > 0
    try:
        cfg.validate()
    except ConfigError as e:
        raise ConfigError(f"the Hugging Face config gives a model fivefold cannot build: {e}") from None
    return cfg


# Hugging Face MoE settings that fivefold's model does not have: (key, the value fivefold's model has, what it is)
_UNSUPPORTED_MOE = (
    ("decoder_sparse_step", 1, "dense MLPs between the MoE layers"),
    ("mlp_only_layers", [], "dense MLPs in the listed layers"),
    ("use_sliding_window", False, "a sliding window in some layers"),
    ("clip_qkv", None, "clipping of the query, key and value projections"),
    ("shared_expert_intermediate_size", 0, "a shared expert with a sigmoid gate"),
)


def _layer_window(hf: dict[str, Any]) -> int | None:
    """Qwen2's and Qwen3's sliding window, which fivefold runs only in every layer or in none: from `layer_types`
    (transformers 5) or else `use_sliding_window` with `max_window_layers` (the layers from that index on slide)."""
    layers = int(hf["num_hidden_layers"])
    kinds = hf.get("layer_types")
    if kinds is None:
        start = int(hf.get("max_window_layers", layers)) if hf.get("use_sliding_window") else layers
        kinds = ["full_attention"] * min(start, layers) + ["sliding_attention"] * max(0, layers - start)
    if set(kinds) - {"full_attention", "sliding_attention"} or len(set(kinds)) > 1:
        raise ConfigError(f"Hugging Face layer_types = {shown(sorted(set(kinds)))} (a sliding window in some "
                          "layers) is not supported; fivefold's window is in every layer or in none")
    if kinds and kinds[0] == "sliding_attention":
        if not hf.get("sliding_window"):
            raise ConfigError("Hugging Face use_sliding_window = true without a sliding_window size")
        return int(hf["sliding_window"])
    return None


def _shared_experts(width: int, expert_ffn: int) -> int:
    """Qwen2-MoE's shared expert of `width` as fivefold's shared experts, which are `expert_ffn` wide each."""
    if width % expert_ffn:
        raise ConfigError(f"Hugging Face shared_expert_intermediate_size = {width} is not a multiple of "
                          f"moe_intermediate_size = {expert_ffn}; fivefold's shared experts are as wide as the "
                          "routed ones")
    return width // expert_ffn


def _refuse_unsupported_moe_features(hf: dict[str, Any], arch: str) -> None:
    """One line naming a MoE feature of the config that fivefold's model does not have."""
    if arch not in _MOE_ARCHS:
        return
    for key, supported, what in _UNSUPPORTED_MOE:
        value = hf.get(key)
        if arch == QWEN2_MOE_ARCH and key == "shared_expert_intermediate_size":
            continue  # read as shared experts of the routed experts' width
        if value is not None and value != supported and not (key == "decoder_sparse_step" and value == 0):
            raise ConfigError(f"Hugging Face {key} = {shown(value)} ({what}) is not supported; fivefold's MoE "
                              f"layers need {key} = {shown(supported)}")
