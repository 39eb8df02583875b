"""Model shapes the planner reads beyond what the engine builds: Hugging Face configs of GELU-MLP decoders.

`fivefold plan --model config.json` reads Llama and Mixtral configs as the engine does (`models.hf_config`, which
needs no torch); for GPT-NeoX (`GPTNeoXForCausalLM`: Pythia, GPT-NeoX-20B) and GPT-2 (`GPT2LMHeadModel`) it reads
the shape the planner needs, with `mlp = "gelu"`: layers, hidden, heads, MLP width, vocabulary, tied or not. What
the planner does not model is left out and named in `NOT_MODELLED`: biases and LayerNorm shifts (h or ffn per
matrix), GPT-2's learned position table (n_positions x h; the planner's blocks use rotary), GPT-NeoX's parallel
residual (the same matmuls, one norm fewer) and partial rotary.
"""

from __future__ import annotations

from typing import Any

from fivefold.config import ConfigError, ModelConfig, shown
from fivefold.models.hf_config import check_hf_values

NOT_MODELLED = "biases, LayerNorm shifts, learned position embeddings, parallel residual, partial rotary"
GELU_ACTIVATIONS = ("gelu", "gelu_new", "gelu_fast", "gelu_pytorch_tanh", "gelu_python")


def gelu_shape_from_hf(hf: dict[str, Any], name: str) -> ModelConfig | None:
    """The planner's shape of a GPT-NeoX or GPT-2 config (None for another architecture)."""
    arch = (hf.get("architectures") or [""])[0] or {"gpt_neox": "GPTNeoXForCausalLM", "gpt2": "GPT2LMHeadModel"}.get(
        str(hf.get("model_type", "")), "")
    if arch == "GPTNeoXForCausalLM":
        keys = {"n_layers": "num_hidden_layers", "hidden": "hidden_size", "n_heads": "num_attention_heads",
                "ffn": "intermediate_size", "vocab_size": "vocab_size"}
        act, tied = hf.get("hidden_act", "gelu"), bool(hf.get("tie_word_embeddings", False))
        seq = "max_position_embeddings"
    elif arch == "GPT2LMHeadModel":
        keys = {"n_layers": "n_layer", "hidden": "n_embd", "n_heads": "n_head", "vocab_size": "vocab_size"}
        act, tied, seq = hf.get("activation_function", "gelu_new"), True, "n_positions"
    else:
        return None
    missing = [k for k in keys.values() if hf.get(k) is None]
    if missing:
        raise ConfigError(f"Hugging Face config ({arch}) lacks {', '.join(map(repr, missing))}")
    # the values read, each of its kind (whole numbers, true/false), as the Llama configs' (`models.hf_config`)
    check_hf_values(hf, ints=(*keys.values(), seq, *(("n_inner",) if arch == "GPT2LMHeadModel" else ())), floats=(),
                    bools=("tie_word_embeddings",) if arch == "GPTNeoXForCausalLM" else ())
    if act not in GELU_ACTIVATIONS:
        raise ConfigError(f"Hugging Face config ({arch}): activation {shown(act)} is not a GELU; the planner "
                          f"models GELU "
                          f"({', '.join(GELU_ACTIVATIONS)}) and SwiGLU MLPs")
    values = {field: int(hf[key]) for field, key in keys.items()}
    if arch == "GPT2LMHeadModel":
        values["ffn"] = int(hf.get("n_inner") or 4 * values["hidden"])
    cfg = ModelConfig(name=name, n_kv_heads=values["n_heads"], max_seq_len=int(hf.get(seq) or 2048),
                      tied_embeddings=tied, mlp="gelu", **values)
    try:
        cfg.validate("--model")
    except ConfigError as e:
        raise ConfigError(f"the Hugging Face config ({arch}) gives a shape the planner cannot model: {e}") from None
    return cfg
