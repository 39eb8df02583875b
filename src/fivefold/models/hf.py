"""Hugging Face interoperability: fivefold's Llama (dense or MoE) <-> `LlamaForCausalLM` /
`MixtralForCausalLM` directories (`config.json` + safetensors). A config.json is read by `models.hf_config`
(without torch, for the planner), whose names this module re-exports.

Both sides use the rotate-half rotary layout and `[out, in]` linear weights, so dense weights map by
name alone. MoE experts are stored batched here (`w_gate [E, hidden, ffn]`) and per expert in
Mixtral files (`experts.{e}.w1.weight [ffn, hidden]`), so they are split and transposed.
Weights are read from safetensors only; pickled checkpoints are never loaded.
"""

from __future__ import annotations

import functools
import json
import os
import re
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fivefold.checkpoint_format import LazyTensor, stream_safetensors
from fivefold.config import ConfigError, ModelConfig, load_file, shown
from fivefold.data.prepare import find_eos, load_tokenizer
from fivefold.models.hf_config import (  # noqa: F401  (check_hf_values, read_config_json: re-exported)
    _MODEL_TYPES,
    _ROPE_SCALING_KEYS,
    LLAMA_ARCH,
    MISTRAL_ARCH,
    MIXTRAL_ARCH,
    OLMOE_ARCH,
    QWEN2_ARCH,
    QWEN2_MOE_ARCH,
    QWEN3_ARCH,
    QWEN3_MOE_ARCH,
    check_hf_values,
    model_config_from_hf,
    read_config_json,
)
from fivefold.models.llama import build_model

# tensors that older HF checkpoints carry but that are recomputed, not learned
_IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)
_MAX_LISTED = 5


class CheckpointError(ValueError):
    """Weights that cannot be read or do not match the model shape; the message lists what differs."""


# ---------------------------------------------------------------------------------------------
# Configs (written here; read by `models.hf_config`, which needs no torch)


def hf_config_from_model_config(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The Hugging Face `config.json` dict of a fivefold ModelConfig, of the architecture `hf_architecture` names
    (for dense models LlamaForCausalLM, MistralForCausalLM with a sliding window, Qwen2ForCausalLM with q/k/v
    biases, Qwen3ForCausalLM with per-head query/key norms).

    Rotary settings are written under both the transformers 4 keys (`rope_theta`, `rope_scaling`) and
    the transformers 5 key (`rope_parameters`), so either version reads them.
    """
    cfg.validate()
    arch = hf_architecture(cfg)
    scaling: dict[str, Any] | None = None
    if cfg.rope_scaling:
        scaling = {"rope_type": "llama3", **{k: float(cfg.rope_scaling[k]) for k in _ROPE_SCALING_KEYS}}
        scaling["original_max_position_embeddings"] = int(scaling["original_max_position_embeddings"])
    rope_parameters = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if scaling:
        rope_parameters = {**scaling, "rope_theta": cfg.rope_theta}
    hf: dict[str, Any] = {
        "architectures": [arch],
        "model_type": {v: k for k, v in _MODEL_TYPES.items()}[arch],
        "hidden_size": cfg.hidden,
        "intermediate_size": cfg.expert_ffn if cfg.is_moe and arch in (MIXTRAL_ARCH, OLMOE_ARCH) else cfg.ffn,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_seq_len,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": scaling,
        "rope_parameters": rope_parameters,
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tied_embeddings,
        "hidden_act": "silu",
        "initializer_range": cfg.init_std,
        "attention_dropout": 0.0,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if arch in (QWEN3_MOE_ARCH, OLMOE_ARCH, QWEN2_MOE_ARCH):
        hf.update(num_experts=cfg.n_experts, num_experts_per_tok=cfg.top_k, norm_topk_prob=cfg.norm_topk,
                  router_aux_loss_coef=cfg.aux_loss_coef, attention_bias=False)
        if arch in (QWEN3_MOE_ARCH, QWEN2_MOE_ARCH):
            hf.update(moe_intermediate_size=cfg.expert_ffn, decoder_sparse_step=1, mlp_only_layers=[])
        if arch == QWEN2_MOE_ARCH:
            hf.update(qkv_bias=cfg.qkv_bias, shared_expert_intermediate_size=cfg.n_shared_experts * cfg.expert_ffn,
                      use_sliding_window=False)
    elif cfg.is_moe:
        hf.update(num_local_experts=cfg.n_experts, num_experts_per_tok=cfg.top_k,
                  router_aux_loss_coef=cfg.aux_loss_coef, sliding_window=cfg.sliding_window)
    elif arch in (QWEN2_ARCH, QWEN3_ARCH):
        window = cfg.sliding_window is not None
        hf.update(use_sliding_window=window, sliding_window=cfg.sliding_window,
                  max_window_layers=0 if window else cfg.n_layers,
                  layer_types=["sliding_attention" if window else "full_attention"] * cfg.n_layers)
    elif cfg.sliding_window:
        hf.update(sliding_window=cfg.sliding_window)
    else:
        hf.update(attention_bias=False, mlp_bias=False)
    return hf


def hf_architecture(cfg: ModelConfig) -> str:
    """The Hugging Face architecture that holds `cfg`: Llama (Mistral with a sliding window, Qwen2 with query/key/value
    biases, Qwen3 with per-head query/key norms) for dense models, and
    for MoE models Mixtral, Qwen3-MoE (per-head query/key norms) or OLMoE (whole-projection ones); ConfigError
    naming the field for what none of them has."""
    if not cfg.is_moe:
        if cfg.qk_norm == "full" or cfg.qk_norm == "head" and cfg.qkv_bias:
            raise ConfigError(f"model.qk_norm = {shown(cfg.qk_norm)} on a dense model cannot be exported"
                              + (" with model.qkv_bias = true" if cfg.qk_norm == "head" else "")
                              + f": {QWEN3_ARCH} has per-head norms ('head') and no biases")
        if cfg.qk_norm == "head":
            return QWEN3_ARCH
        if cfg.qkv_bias:
            return QWEN2_ARCH
        return MISTRAL_ARCH if cfg.sliding_window else LLAMA_ARCH
    qwen2 = cfg.qkv_bias or cfg.shared_expert_gate
    arch = QWEN2_MOE_ARCH if qwen2 else {"none": MIXTRAL_ARCH, "head": QWEN3_MOE_ARCH, "full": OLMOE_ARCH}[cfg.qk_norm]
    refused = [("router_scores", cfg.router_scores, "softmax"), ("bias_update_rate", cfg.bias_update_rate, 0.0)]
    if arch == QWEN2_MOE_ARCH:  # its shared expert is always gated
        refused += [("qk_norm", cfg.qk_norm, "none"), ("shared_expert_gate", cfg.shared_expert_gate, True)]
    elif cfg.n_shared_experts:
        raise ConfigError(
            f"model.n_shared_experts = {cfg.n_shared_experts} cannot be exported: {arch} has no shared experts "
            f"(only models with n_shared_experts = 0 export, or with shared_expert_gate = true as {QWEN2_MOE_ARCH})"
        )
    if arch == MIXTRAL_ARCH:
        refused.append(("norm_topk", cfg.norm_topk, True))
    if arch != MIXTRAL_ARCH:
        refused.append(("sliding_window", cfg.sliding_window, None))
    for field, value, supported in refused:
        if value != supported:
            raise ConfigError(f"model.{field} = {shown(value)} cannot be exported: {arch} routes with "
                              f"{field} = {shown(supported)}")
    return arch


# ---------------------------------------------------------------------------------------------
# State dicts


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """fivefold parameter names and shapes of a whole model (no `lm_head.weight` when tied, as the
    trainer's checkpoints store it). Built on the meta device: allocates nothing."""
    model = build_model(cfg, device="meta")
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if cfg.tied_embeddings:
        shapes.pop("lm_head.weight", None)
    return shapes


def check_tensors(
    found: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]], where: str
) -> None:
    """Raise CheckpointError listing the first few missing, unexpected and wrongly shaped tensors."""
    missing = [k for k in expected if k not in found]
    unexpected = [k for k in found if k not in expected]
    wrong = [f"{k}: {list(found[k])} (expected {list(expected[k])})"
             for k in expected if k in found and tuple(found[k]) != tuple(expected[k])]
    if not (missing or unexpected or wrong):
        return
    parts = []
    for label, items in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong)):
        if items:
            more = f" and {len(items) - _MAX_LISTED} more" if len(items) > _MAX_LISTED else ""
            parts.append(f"{len(items)} {label}: {', '.join(items[:_MAX_LISTED])}{more}")
    raise CheckpointError(f"{where} does not match the model config: " + "; ".join(parts))


def _layer_names(i: int, cfg: ModelConfig) -> list[tuple[str, str]]:
    """(fivefold, HF) names of layer i's tensors shared by dense and MoE blocks."""
    ff, hf = f"layers.{i}.", f"model.layers.{i}."
    pairs = [(f"{ff}attn.{p}_proj.weight", f"{hf}self_attn.{p}_proj.weight") for p in "qkvo"]
    pairs += [(f"{ff}attn_norm.weight", f"{hf}input_layernorm.weight"),
              (f"{ff}mlp_norm.weight", f"{hf}post_attention_layernorm.weight")]
    if cfg.qk_norm != "none":
        pairs += [(f"{ff}attn.{p}_norm.weight", f"{hf}self_attn.{p}_norm.weight") for p in "qk"]
    if cfg.qkv_bias:
        pairs += [(f"{ff}attn.{p}_proj.bias", f"{hf}self_attn.{p}_proj.bias") for p in "qkv"]
    if cfg.is_moe and cfg.n_shared_experts:  # Qwen2-MoE's shared expert and its gate
        pairs += [(f"{ff}mlp.shared.{p}.weight", f"{hf}mlp.shared_expert.{p}.weight")
                  for p in ("gate_proj", "up_proj", "down_proj")]
        pairs.append((f"{ff}mlp.shared_gate.weight", f"{hf}mlp.shared_expert_gate.weight"))
    return pairs


def _moe_names(i: int, cfg: ModelConfig) -> tuple[str, tuple[tuple[str, str], ...]]:
    """(the HF prefix of layer i's MoE block, (fivefold batched expert weight, HF per-expert name) pairs)."""
    if hf_architecture(cfg) == MIXTRAL_ARCH:
        return f"model.layers.{i}.block_sparse_moe.", _EXPERT_WEIGHTS
    return f"model.layers.{i}.mlp.", (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj"))


def _dense_mlp_names(i: int) -> list[tuple[str, str]]:
    return [(f"layers.{i}.mlp.{p}.weight", f"model.layers.{i}.mlp.{p}.weight")
            for p in ("gate_proj", "up_proj", "down_proj")]


# fivefold batched expert weight -> Mixtral per-expert name (w1 = gate, w3 = up, w2 = down)
_EXPERT_WEIGHTS = (("w_gate", "w1"), ("w_up", "w3"), ("w_down", "w2"))


def name_map(cfg: ModelConfig) -> list[tuple[str, str, int | None]]:
    """(Hugging Face name, fivefold name, expert) of every tensor of `cfg`'s Hugging Face directory, in the order
    they are written (`lm_head` omitted when tied, as HF does). `expert` is None when the two tensors are the same;
    else the HF tensor is expert `expert` of fivefold's batched weight, transposed (`w_gate [E, hidden, ffn]`[e]
    is `experts.{e}.w1.weight [ffn, hidden]` transposed)."""
    out: list[tuple[str, str, int | None]] = [("model.embed_tokens.weight", "embed.weight", None)]
    for i in range(cfg.n_layers):
        out += [(hf, ff, None) for ff, hf in _layer_names(i, cfg)]
        if not cfg.is_moe:
            out += [(hf, ff, None) for ff, hf in _dense_mlp_names(i)]
            continue
        moe, expert_names = _moe_names(i, cfg)
        out.append((moe + "gate.weight", f"layers.{i}.mlp.router.weight", None))
        out += [(f"{moe}experts.{e}.{hf_name}.weight", f"layers.{i}.mlp.{ff_name}", e)
                for ff_name, hf_name in expert_names for e in range(cfg.n_experts)]
    out.append(("model.norm.weight", "norm.weight", None))
    if not cfg.tied_embeddings:
        out.append(("lm_head.weight", "lm_head.weight", None))
    return out


def to_hf_state_dict(state_dict: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """fivefold names -> Hugging Face names (contiguous tensors; `lm_head` omitted when tied, as HF does).

    Raises CheckpointError when the tensors do not match `cfg`, ConfigError when the model cannot be
    expressed in Hugging Face's format (shared experts).
    """
    hf_architecture(cfg)  # refuses what no Hugging Face architecture holds
    sd = dict(state_dict)
    if cfg.tied_embeddings:
        sd.pop("lm_head.weight", None)
    check_tensors({k: tuple(v.shape) for k, v in sd.items()}, expected_shapes(cfg), "the fivefold state dict")
    out = {hf: sd[ff] if e is None else sd[ff][e].t() for hf, ff, e in name_map(cfg)}
    return {k: v.detach().contiguous() for k, v in out.items()}


def expected_hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor names and shapes of `cfg` (from the meta model's, nothing allocated): an expert's is its
    slot of fivefold's batched weight, transposed."""
    hf_architecture(cfg)  # refuses what no Hugging Face architecture holds
    shapes = expected_shapes(cfg)
    return {hf: shapes[ff] if e is None else (shapes[ff][2], shapes[ff][1]) for hf, ff, e in name_map(cfg)}


def from_hf_state_dict(hf_sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Hugging Face names -> fivefold names (no `lm_head.weight` when tied, as the trainer stores it).

    Accepts and drops a tied checkpoint's redundant `lm_head.weight` and old `rotary_emb.inv_freq`
    buffers; raises CheckpointError listing mismatched names and shapes otherwise.
    """
    sd = {k: v for k, v in hf_sd.items() if not k.endswith(_IGNORED_HF_SUFFIXES)}
    if cfg.tied_embeddings:
        sd.pop("lm_head.weight", None)
    found = {k: tuple(v.shape) for k, v in sd.items()}
    check_tensors(found, expected_hf_shapes(cfg), "the Hugging Face weights")
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, list[torch.Tensor]] = {}
    for hf, ff, e in name_map(cfg):
        if e is None:
            out[ff] = sd[hf]
        else:
            experts.setdefault(ff, []).append(sd[hf].t())
    out.update({ff: torch.stack(parts) for ff, parts in experts.items()})
    return {k: v.contiguous() for k, v in out.items()}


def not_a_directory(path: Path) -> CheckpointError:
    """The error for a Hugging Face directory that is not one: a file (e.g. its model.safetensors), or nothing."""
    why = "is a file; give the directory that holds it" if path.is_file() else "does not exist"
    return CheckpointError(f"Hugging Face directory {shown(str(path))} {why}")


class HfSliceReader:
    """The weights of a Hugging Face directory as the fivefold-named global tensors of a checkpoint
    (`model.<param>`, a tied output layer stored once as the embedding), read by rectangles
    (`checkpoint_format.TensorReader`): `read` takes from each safetensors file only the bytes of the rectangle
    asked for (`get_slice`), converted on the fly (one Mixtral expert's `[ffn, hidden]`, transposed, is a slot of
    fivefold's batched `[E, hidden, ffn]`; dense tensors map by name, both sides using the rotate-half rotary
    layout and separate q/k/v and gate/up projections). The names and shapes in the files' headers are checked
    against `cfg`'s (built on the meta device) when the reader is made, before any weight is read. Each read opens
    the file it needs and lets go of it, so that no mapped page stays in this process's memory. `bytes_read`: the
    bytes of the rectangles read so far."""

    def __init__(self, hf_dir: str | Path, cfg: ModelConfig) -> None:
        self.hf_dir = Path(hf_dir)
        if not self.hf_dir.is_dir():
            raise not_a_directory(self.hf_dir)
        self.files: dict[str, Path] = {}
        found: dict[str, tuple[int, ...]] = {}
        for path in _safetensors_files(self.hf_dir):
            for name, shape in safetensors_shapes(path).items():
                if not name.endswith(_IGNORED_HF_SUFFIXES):
                    self.files[name], found[name] = path, shape
        if cfg.tied_embeddings:
            found.pop("lm_head.weight", None)
        check_tensors(found, expected_hf_shapes(cfg), f"the Hugging Face weights in {self.hf_dir}")
        self.sources: dict[str, list[tuple[str, int | None]]] = {}
        for hf, ff, e in name_map(cfg):
            self.sources.setdefault(f"model.{ff}", []).append((hf, e))
        self.shapes = {f"model.{k}": v for k, v in expected_shapes(cfg).items()}
        self.bytes_read = 0

    def names(self) -> list[str]:
        return list(self.shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.shapes[name]

    def read(self, name: str, offsets: tuple[int, ...] | None = None, shape: tuple[int, ...] | None = None,
             dtype: torch.dtype | None = None) -> torch.Tensor:
        """The rectangle at `offsets` of `shape` (default: all) of `name` (in the files' dtype unless `dtype`)."""
        full = self.shapes[name]
        offsets = tuple(offsets) if offsets is not None else (0,) * len(full)
        shape = tuple(shape) if shape is not None else full
        cut = [slice(o, o + n) for o, n in zip(offsets, shape, strict=True)]
        out: torch.Tensor | None = None
        for hf, expert in self.sources[name]:
            if expert is None:
                out = self._slice(hf, tuple(cut))
            elif cut[0].start <= expert < cut[0].stop:
                part = self._slice(hf, (cut[2], cut[1])).t()  # HF [ffn, hidden] -> fivefold [hidden, ffn]
                if out is None:
                    out = torch.empty(shape, dtype=part.dtype)
                out[expert - cut[0].start] = part
        assert out is not None, name  # every rectangle of a known name has a source
        return out if dtype is None else out.to(dtype)

    def _slice(self, hf: str, index: tuple[slice, ...]) -> torch.Tensor:
        from safetensors import safe_open

        path = self.files[hf]
        try:
            with safe_open(str(path), framework="pt") as f:
                # a copy: safetensors may hand back a view of the file's mapping, which closing it releases
                part = f.get_slice(hf)[index].clone(memory_format=torch.contiguous_format)
        except Exception as e:  # safetensors raises its own error type (and OSError) for damaged files
            raise CheckpointError(f"cannot read {shown(hf)} from safetensors file {shown(str(path))}: {e}") from None
        self.bytes_read += part.numel() * part.element_size()
        return part


# ---------------------------------------------------------------------------------------------
# Directories


def check_output_dir(out_dir: str | Path, overwrite: bool) -> Path:
    """Refuse a file, or a non-empty directory unless `overwrite`; called before any expensive work."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"output {shown(str(out))} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise CheckpointError(
            f"output directory {shown(str(out))} is not empty; choose an empty or new directory, or pass "
            "overwrite (--overwrite) to replace its config.json and model.safetensors"
        )
    return out


MAX_SHARD_BYTES = 5 * 10**9  # of one safetensors file of an export, as `transformers`' save_pretrained ("5GB")
INDEX_FILE = "model.safetensors.index.json"
_SHARD_FILE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")


def export_hf(
    model_or_state_dict: nn.Module | dict[str, torch.Tensor],
    cfg: ModelConfig,
    out_dir: str | Path,
    overwrite: bool = False,
    tokenizer_dir: Path | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> Path:
    """Write a model (or its fivefold state dict) as a Hugging Face directory (`write_hf_dir`)."""
    sd = model_or_state_dict
    if isinstance(sd, nn.Module):
        sd = sd.state_dict()
    hf_architecture(cfg)  # refuses what no Hugging Face architecture holds
    sd = dict(sd)
    if cfg.tied_embeddings:
        sd.pop("lm_head.weight", None)
    check_tensors({k: tuple(v.shape) for k, v in sd.items()}, expected_shapes(cfg), "the fivefold state dict")
    return write_hf_dir(lambda ff, e: sd[ff].detach() if e is None else sd[ff][e].detach(), lambda ff: sd[ff].dtype,
                        cfg, out_dir, overwrite, tokenizer_dir, max_shard_bytes)


def write_hf_dir(read: Callable[[str, int | None], torch.Tensor], dtype_of: Callable[[str], torch.dtype],
                 cfg: ModelConfig, out_dir: str | Path, overwrite: bool = False, tokenizer_dir: Path | None = None,
                 max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
    """Write `config.json` and the weights that `transformers` loads as LlamaForCausalLM (MixtralForCausalLM for
    MoE), and with `tokenizer_dir` (a directory holding tokenizer.json) the tokenizer files and
    generation_config.json, so that AutoTokenizer and `generate` work on it.

    The weights are streamed: `read(fivefold name, expert)` gives one tensor (expert None) or one expert of a
    batched weight at a time, when the file being written reaches it, and it is dropped once written, so that the
    writer holds one tensor (`dtype_of(fivefold name)`: its dtype, for the headers). Files of at most
    `max_shard_bytes` (one tensor larger than that alone) are written one after the other: `model.safetensors`
    when one is enough, else `model-0000i-of-0000n.safetensors` and `model.safetensors.index.json`, as
    `transformers` writes them. Files are written to a temporary directory beside `out_dir`, then moved into
    place. A non-empty `out_dir` is refused unless `overwrite`, which replaces the files written here, removes the
    weight files and shard index of an earlier export that this one does not write, and keeps any others."""
    out = check_output_dir(out_dir, overwrite)
    shapes = expected_hf_shapes(cfg)
    tensors = [LazyTensor(hf, dtype_of(ff), shapes[hf], functools.partial(_hf_tensor, read, ff, e))
               for hf, ff, e in name_map(cfg)]
    shards: list[list[LazyTensor]] = [[]]
    for t in tensors:
        if shards[-1] and sum(x.nbytes for x in shards[-1]) + t.nbytes > max_shard_bytes:
            shards.append([])
        shards[-1].append(t)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    hf_config = hf_config_from_model_config(cfg, dtype=dtype_of("embed.weight"))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()  # not mkdtemp, whose 0700 would keep the export from the team whatever the umask
    try:
        if tokenizer_dir is not None:
            hf_config.update(write_tokenizer_files(tokenizer_dir, tmp, cfg))
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        for name, shard in zip(names, shards, strict=True):
            stream_safetensors(tmp / name, shard, metadata={"format": "pt"})
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(t.nbytes for t in tensors)},
                     "weight_map": {t.name: name for name, shard in zip(names, shards, strict=True) for t in shard}}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        if not out.exists():
            os.rename(tmp, out)
            return out
        written = {path.name for path in tmp.iterdir()}
        for path in tmp.iterdir():
            os.replace(path, out / path.name)
        for path in out.iterdir():  # an earlier export's weights would mislead loaders
            stale = path.name in ("model.safetensors", INDEX_FILE) or _SHARD_FILE.match(path.name)
            if stale and path.name not in written:
                path.unlink()
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out


def _hf_tensor(read: Callable[[str, int | None], torch.Tensor], ff: str, expert: int | None) -> torch.Tensor:
    """The Hugging Face tensor of fivefold tensor `ff` (one expert of it, transposed), contiguous on the CPU."""
    value = read(ff, expert)
    return (value if expert is None else value.t()).to("cpu").contiguous()


# the files of a Hugging Face tokenizer that an export carries over from the run (others are written)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def tokenizer_special_tokens(tokenizer_dir: Path) -> dict[str, str]:
    """bos/eos/pad token texts of a tokenizer directory: those its tokenizer_config.json names, else its
    end-of-text token (fivefold's data puts one after every document) for all three."""
    named: dict[str, str] = {}
    config = tokenizer_dir / "tokenizer_config.json"
    if config.is_file():
        data = load_file(config, "tokenizer config", suffix=".json", unique_keys=False)
        for key in ("bos_token", "eos_token", "pad_token"):
            value = data.get(key)
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                named[key] = value
    eos = named.get("eos_token") or find_eos(load_tokenizer(tokenizer_dir / "tokenizer.json"),
                                             str(tokenizer_dir))[1]
    return {"bos_token": named.get("bos_token", eos), "eos_token": eos, "pad_token": named.get("pad_token", eos)}


def write_tokenizer_files(tokenizer_dir: Path, out: Path, cfg: ModelConfig) -> dict[str, int]:
    """Copy the tokenizer of `tokenizer_dir` into the Hugging Face directory `out` with a tokenizer_config.json and
    special_tokens_map.json that name bos/eos/pad (kept when the directory has its own), and write
    generation_config.json. Returns the special token ids."""
    tokenizer = load_tokenizer(tokenizer_dir / "tokenizer.json")
    special = tokenizer_special_tokens(tokenizer_dir)
    ids = {k.removesuffix("_token") + "_token_id": tokenizer.token_to_id(v) for k, v in special.items()}
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copyfile(tokenizer_dir / name, out / name)
    if not (tokenizer_dir / "tokenizer_config.json").is_file():
        config = {"tokenizer_class": "PreTrainedTokenizerFast", **special, "model_max_length": cfg.max_seq_len,
                  "clean_up_tokenization_spaces": False}
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    if not (tokenizer_dir / "special_tokens_map.json").is_file():
        (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    generation = {**ids, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return ids


def _safetensors_files(hf_dir: Path) -> list[Path]:
    single = hf_dir / "model.safetensors"
    if single.is_file():
        return [single]
    index = hf_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError, RecursionError) as e:
            raise CheckpointError(f"shard index {shown(str(index))} is not valid: {shown(e)}") from None
        files = []
        for name in sorted(set(weight_map.values())):
            shard = hf_dir / name
            # a shard name must stay inside the directory
            if Path(name).name != name or not shard.is_file():
                raise CheckpointError(
                    f"shard {shown(name)} listed in {shown(str(index))} is not a file in {shown(str(hf_dir))}"
                )
            files.append(shard)
        return files
    pickles = sorted(p.name for p in hf_dir.glob("*.bin"))
    hint = f" (found {pickles}: pickled weights are not read; re-save them as safetensors)" if pickles else ""
    raise CheckpointError(f"{shown(str(hf_dir))} has no model.safetensors or model.safetensors.index.json{hint}")


def safetensors_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """The names and shapes of one safetensors file's tensors, from its header alone, or CheckpointError naming it."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    except Exception as e:  # safetensors raises its own error type (and OSError) for damaged files
        raise CheckpointError(f"cannot read safetensors file {shown(str(path))}: {e}") from None


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of one safetensors file, or CheckpointError naming the file."""
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except Exception as e:  # safetensors raises its own error type (and OSError) for damaged files
        raise CheckpointError(f"cannot read safetensors file {shown(str(path))}: {e}") from None


def load_hf(hf_dir: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read a Hugging Face Llama/Mixtral directory (single or sharded safetensors) as a fivefold
    ModelConfig and state dict with fivefold names."""
    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise not_a_directory(hf_dir)
    cfg = model_config_from_hf(hf_dir)
    hf_sd: dict[str, torch.Tensor] = {}
    for f in _safetensors_files(hf_dir):
        hf_sd.update(read_safetensors(f))
    return cfg, from_hf_state_dict(hf_sd, cfg)


def load_state_dict_into(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Load a fivefold state dict that omits the tied `lm_head.weight` into a whole model."""
    sd = dict(state_dict)
    if getattr(model, "cfg", None) is not None and model.cfg.tied_embeddings and "lm_head.weight" not in sd:
        sd["lm_head.weight"] = sd["embed.weight"]
    model.load_state_dict(sd, strict=True)


def model_from_hf(hf_dir: str | Path, device: torch.device | str = "cpu") -> nn.Module:
    """A fivefold Llama built from a Hugging Face directory."""
    cfg, sd = load_hf(hf_dir)
    model = build_model(cfg, device=device)
    load_state_dict_into(model, sd)
    return model
