"""The planner's bytes against the real model on CPU.

Model states: closed form of the planner against the real module's parameter shapes, sharded the way the
engine issues specify (tp splits projections, the vocabulary and the experts' MLPs; norms and the router
are replicated; ZeRO shards a flat buffer over dp), and against a real AdamW step on one device.
Activations: the planner's count against the bytes autograd really saves during a forward pass, measured
with `torch.autograd.graph.saved_tensors_hooks` (distinct storages, parameters excluded), for several
(batch, seq) shapes, dense and MoE, with recompute none / selective (op-level policy, `parallel/recompute.py`; the
outputs it keeps out of autograd's sight counted too, see tests/test_recompute.py) / full (block) applied with
`torch.utils.checkpoint` as the engine applies them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from fivefold.config import ConfigError
from fivefold.errors import CliError
from fivefold.flops import active_matmul_params, count_params
from fivefold.models.llama import build_model
from fivefold.models.loss import linear_cross_entropy_sum
from fivefold.parallel.recompute import apply_recompute
from fivefold.planner.layout import FIVEFOLD, FIVEFOLD_CPU, Layout
from fivefold.planner.memory import forward_saved_bytes, model_state_bytes, rank_memory
from fivefold.presets import get_preset

TOL = 0.05  # the acceptance bound; the counts below are in fact exact for these shapes

# how tensor parallel splits each parameter (by name suffix): the dim that is split, or None if replicated
_TP_DIM = {"q_proj.weight": 0, "k_proj.weight": 0, "v_proj.weight": 0, "o_proj.weight": 1, "gate_proj.weight": 0,
           "up_proj.weight": 0, "down_proj.weight": 1, "embed.weight": 0, "lm_head.weight": 0, "w_gate": 2,
           "w_up": 2, "w_down": 1}


def per_rank_numel(model: torch.nn.Module, tp: int, ep: int, split_experts: bool = True) -> tuple[int, int]:
    """(dense, expert) parameters one rank holds, from the module's real shapes (the routed experts' ffn dim split
    over tp only when `split_experts`, `layout.etp = tp`)."""
    dense = expert = 0
    for name, p in model.named_parameters():  # tied weights appear once
        dim = next((d for suffix, d in _TP_DIM.items() if name.endswith(suffix)), None)
        shape = list(p.shape)
        if name.endswith(("w_gate", "w_up", "w_down")):
            shape[0] //= ep
            if not split_experts:
                dim = None
        if name.endswith(("k_proj.weight", "v_proj.weight")):  # kv heads split, or replicated when tp > kv heads
            shape[0] = max(shape[0] // model.cfg.head_dim // tp, 1) * model.cfg.head_dim
        elif dim is not None:
            shape[dim] //= tp
        n = math.prod(shape)
        if name.endswith(("w_gate", "w_up", "w_down")):
            expert += n
        else:
            dense += n
    return dense, expert


@pytest.mark.parametrize("preset,etp", [("tiny", 1), ("tiny-moe", 1), ("tiny-moe", "tp")])
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("dp,zero", [(1, 0), (2, 0), (2, 1), (2, 2), (4, 3), (3, 3)])
def test_model_state_bytes_exact(preset, etp, tp, dp, zero):
    """Whole experts (etp = 1, the default) are held whole by every tp rank and ZeRO-sharded over dp / ep x tp
    ranks (the tp ranks reduce them with the edp ranks); with etp = tp each tp rank holds 1/tp of every expert's
    ffn dim, sharded over dp / ep."""
    cfg = get_preset(preset)
    model = build_model(cfg, "meta")
    ep = 2 if cfg.is_moe and dp % 2 == 0 else 1
    etp = tp if etp == "tp" else etp
    lay = Layout(dp=dp, tp=tp, zero=zero, ep=ep, etp=etp)
    whole = tp > 1 and etp == 1
    dense, expert = per_rank_numel(model, tp, ep, split_experts=not whole)

    def shard(n: int, parts: int, on: bool) -> int:
        return -(-n // parts) if on else n

    dpe = dp // ep * (tp if whole else 1)
    want = {
        "parameters": 4 * (shard(dense, dp, zero >= 3) + shard(expert, dpe, zero >= 3)),
        "gradients": 4 * (shard(dense, dp, zero >= 2) + shard(expert, dpe, zero >= 2)),
        "optimizer": 8 * (shard(dense, dp, zero >= 1) + shard(expert, dpe, zero >= 1)),
        "grad_accum_buffer": 0,
    }
    # the engine's fp32 gradient buckets are the fp32 accumulation: the same bytes with fp32_grad_accum (the
    # default) and without it, no separate buffer
    assert lay.fp32_grad_accum
    assert model_state_bytes(cfg, lay, FIVEFOLD_CPU, seq=128) == want
    assert model_state_bytes(cfg, dataclasses.replace(lay, fp32_grad_accum=False), FIVEFOLD_CPU, seq=128) == want


def test_model_states_match_a_real_adamw_step():
    from fivefold.config import Config
    from fivefold.train.build import single_device_engine

    cfg = Config()
    cfg.model = get_preset("tiny-moe")
    model = build_model(cfg.model, "cpu", seed=0)
    engine = single_device_engine(model, cfg, torch.device("cpu"))
    x = torch.randint(0, cfg.model.vocab_size, (2, 16))
    engine.forward_backward([(x, x)], x.numel())
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    engine.clip_grad_norm(1.0)
    engine.optimizer.step()
    states = engine.optimizer.state.values()
    moments = sum(s[k].numel() * s[k].element_size() for s in states for k in ("exp_avg", "exp_avg_sq"))
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    pred = model_state_bytes(cfg.model, Layout(), FIVEFOLD_CPU, seq=cfg.train.seq_len)
    assert (pred["parameters"], pred["gradients"], pred["optimizer"]) == (params, grads, moments)


def test_playbook_zero_table():
    # playbook widget, 8B on dp=8: ZeRO-1 optimizer 60 -> 7.5 GiB, ZeRO-2 gradients 15 -> 1.875, ZeRO-3 params
    cfg = get_preset("llama-3.1-8b")
    bf16 = dataclasses.replace(FIVEFOLD, param_bytes=2, grad_bytes=2, master_bytes=0, optim_bytes=8)
    z0 = model_state_bytes(cfg, Layout(dp=8, zero=0), bf16, seq=4096)
    for zero, key in [(1, "optimizer"), (2, "gradients"), (3, "parameters")]:
        z = model_state_bytes(cfg, Layout(dp=8, zero=zero), bf16, seq=4096)
        assert z[key] == pytest.approx(z0[key] / 8, rel=1e-6)
    assert z0["optimizer"] / 2**30 == pytest.approx(59.828, rel=2e-3)


# ---------------------------------------------------------------------------------------------
# Activations


def measure_saved_bytes(cfg, batch: int, seq: int, recompute: str = "none", bf16: bool = False,
                        bf16_weights: bool = False, prepare=None) -> int:
    """Bytes of the distinct storages autograd saves during one forward (the engine's fused loss included);
    `bf16_weights`: on bf16 working weights (lean mixed precision) instead of fp32 ones; `prepare(model)` changes
    the model first."""
    model = build_model(cfg, "cpu", seed=0)
    if prepare is not None:
        prepare(model)
    if bf16_weights:
        model.to(torch.bfloat16)
    if recompute == "full":
        for block in model.layers.values():
            block.forward = (lambda f: lambda x, c, s, m=None: checkpoint(f, x, c, s, m, use_reentrant=False))(
                block.forward)
    elif recompute == "selective":  # the engine's op-level policy; its kept outputs are counted as well
        from tests.test_recompute import held_bytes

        apply_recompute(model, "selective")
        g = torch.Generator().manual_seed(0)
        x = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
        exclude = {t.untyped_storage().data_ptr() for t in [x, *model.parameters()]}
        return held_bytes(lambda: linear_cross_entropy_sum(model.forward_hidden(x), model.lm_head.weight, x, 8192,
                                                           torch.float32), exclude)[0]
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen.setdefault(st.data_ptr(), st.nbytes())
        return t

    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            hidden = model.forward_hidden(x)
            linear_cross_entropy_sum(hidden, model.lm_head.weight, x, 8192,
                                     torch.bfloat16 if bf16 else torch.float32)
    return sum(seen.values())


SHAPES = [(1, 64), (2, 16), (4, 128), (3, 256)]


@pytest.mark.parametrize("batch,seq", SHAPES)
@pytest.mark.parametrize("preset", ["tiny", "tiny-moe-capacity"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_activation_bytes_fp32(preset, batch, seq, recompute):
    if preset == "tiny-moe-capacity":  # capacity routing makes the packed expert tensors' size deterministic; the
        # planner counts the padded experts' tensors (the grouped default's are not modelled yet)
        cfg = dataclasses.replace(get_preset("tiny-moe"), capacity_factor=1.25, moe_impl="padded")
    else:
        cfg = get_preset(preset)
    measured = measure_saved_bytes(cfg, batch, seq, recompute)
    predicted = forward_saved_bytes(cfg, batch, seq, Layout(recompute=recompute), FIVEFOLD_CPU)
    assert predicted == pytest.approx(measured, rel=TOL)


def test_recompute_orders_memory():
    cfg = get_preset("tiny")
    none, sel, full = (forward_saved_bytes(cfg, 4, 128, Layout(recompute=r), FIVEFOLD_CPU)
                       for r in ("none", "selective", "full"))
    assert full < sel < none


@pytest.mark.parametrize("batch,seq", [(2, 64), (4, 128)])
def test_activation_bytes_bf16_lean(batch, seq):
    """fivefold on an accelerator (the `fivefold` framework): bf16 working weights under autocast, no weight casts."""
    cfg = get_preset("tiny")
    measured = measure_saved_bytes(cfg, batch, seq, bf16=True, bf16_weights=True)
    rep = rank_memory(cfg, seq, Layout(micro_batch_size=batch), FIVEFOLD, in_flight=1.0)
    assert rep.parts["bf16_weight_copies"] == 0
    assert rep.parts["activations"] == pytest.approx(measured, rel=TOL)


@pytest.mark.parametrize("batch,seq", [(2, 64), (4, 128)])
def test_activation_bytes_bf16_autocast_over_fp32_weights(batch, seq):
    # autocast over fp32 weights (other frameworks' mixed precision): the saved bytes include the bf16 weight
    # casts, which the planner counts separately, and the fp32 residual stream
    cfg = get_preset("tiny")
    measured = measure_saved_bytes(cfg, batch, seq, bf16=True)
    autocast = dataclasses.replace(FIVEFOLD, param_bytes=4, autocast_weight_copies=True, residual_bytes=4)
    rep = rank_memory(cfg, seq, Layout(micro_batch_size=batch), autocast, in_flight=1.0)
    predicted = rep.parts["activations"] + rep.parts["bf16_weight_copies"]
    assert predicted == pytest.approx(measured, rel=TOL)


@pytest.mark.parametrize("dp", [2, 4])
def test_zero3_under_pipeline_and_expert_parallel_gathers_the_experts_over_edp(dp):
    """ZeRO-3 with pp and ep: the rank's stages stay gathered for the step as without ep, the routed experts (this
    ep rank's 1/ep) among them only when edp = dp / ep > 1; with edp = 1 they are whole plain tensors, counted
    with the model states (dense / dp + experts / ep / edp), against the real stages of the first pipeline rank."""
    from fivefold.parallel.expert import is_expert_param
    from fivefold.parallel.pipeline import build_stages
    from fivefold.parallel.schedules import stage_placement
    from fivefold.planner.memory import stage_layers

    cfg = get_preset("tiny-moe")
    ep = 2
    lay = Layout(dp=dp, pp=2, ep=ep, zero=3, micro_batch_size=1, grad_accum_steps=8 // dp)
    stages = build_stages(cfg, stage_layers(cfg, lay, 128), stage_placement("1f1b", 2, 1), 0, torch.device("meta"), 0)
    named = [(n, p.numel()) for stage in stages.values() for n, p in stage.named_parameters()]
    experts = sum(k for n, k in named if is_expert_param(n)) // ep  # this ep rank's
    dense = sum(k for _, k in named) - experts * ep
    edp = dp // ep
    gathered = dense + (experts if edp > 1 else 0)
    # fully_shard has no gradient buckets: the gathered weights and unsharded gradients are the buffers
    assert rank_memory(cfg, 128, lay, FIVEFOLD_CPU, in_flight=1).parts["comm_buffers"] == gathered * (4 + 4)
    states = model_state_bytes(cfg, lay, FIVEFOLD_CPU, seq=128)
    assert states["parameters"] == 4 * (dense // dp + experts // edp)
    assert states["gradients"] == states["parameters"] and states["optimizer"] == 2 * states["parameters"]


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("fp32_grads", [False, True])
def test_lean_state_bytes_follow_the_distributed_optimizer(zero, fp32_grads):
    """fivefold's parallel engine under lean mixed precision, by the playbook's ZeRO table (k = 12): ZeRO-0
    2 + g + 12, ZeRO-1 2 + g + 12/N_d, ZeRO-2 2 + (g + 12)/N_d, ZeRO-3 16/N_d (fully_shard's fp32 shards and
    gradients, 4 + 4 + 8), with g = 2 (bf16 gradients) or 4 (fp32 gradient buckets); tests/test_parallel_memory.py
    measures the engine's ZeRO-1 bytes against the same numbers."""
    from fivefold.planner.layout import FIVEFOLD_LEAN

    cfg = get_preset("tiny")
    dp = 4
    n = count_params(cfg)
    assert n % dp == 0
    g = 4 if fp32_grads else 2
    want = {0: (2 + g + 12) * n, 1: (2 + g) * n + 12 * n // dp, 2: 2 * n + (g + 12) * n // dp, 3: 16 * n // dp}[zero]
    got = model_state_bytes(cfg, Layout(dp=dp, zero=zero, fp32_grad_accum=fp32_grads), FIVEFOLD_LEAN, seq=128)
    assert sum(got.values()) == want


@pytest.mark.parametrize("schedule", ["1f1b", "dualpipev"])
def test_zero3_under_pipeline_keeps_the_stages_gathered(schedule):
    """ZeRO-3 with pp (`parallel.pipeline_zero3`): besides the dp-sharded states, the rank's whole stages stay
    gathered for the step and their gradients unsharded until the last backward; against the parameters of the
    real stages that the engine builds on the first pipeline rank (both tied-embedding copies under DualPipeV)."""
    from fivefold.parallel.pipeline import build_stages
    from fivefold.parallel.schedules import stage_placement
    from fivefold.planner.memory import stage_layers

    cfg = get_preset("tiny")
    lay = Layout(dp=2, pp=2, zero=3, schedule=schedule, micro_batch_size=1, grad_accum_steps=4)
    stages = build_stages(cfg, stage_layers(cfg, lay, 128), stage_placement(schedule, 2, 1), 0, torch.device("meta"), 0)
    held = sum(p.numel() for stage in stages.values() for p in stage.parameters())
    fp32 = rank_memory(cfg, 128, lay, FIVEFOLD_CPU, in_flight=1).parts["comm_buffers"]
    assert fp32 == held * (4 + 4)  # fp32 weights and gradients (no bucket under fully_shard)
    bf16 = rank_memory(cfg, 128, lay, FIVEFOLD, in_flight=1).parts["comm_buffers"]
    assert bf16 == held * (2 + 4)  # bf16 gathers, gradients accumulated in the fp32 reduce dtype
    states = model_state_bytes(cfg, lay, FIVEFOLD_CPU, seq=128)
    assert states["parameters"] == 4 * held // 2 and states["gradients"] == 4 * held // 2


# ---------------------------------------------------------------------------------------------
# A GELU MLP (GPT-2 / GPT-NeoX): modelled by the planner, not built by the engine


def _gelu_mlps(model: torch.nn.Module) -> None:
    """Each block's MLP becomes down(gelu(up(x))), the GELU MLP of GPT-2 and GPT-NeoX."""
    for block in model.layers.values():
        mlp = block.mlp
        del mlp.gate_proj
        mlp.forward = (lambda m: lambda x: m.down_proj(torch.nn.functional.gelu(m.up_proj(x))))(mlp)


@pytest.mark.parametrize("batch,seq", [(2, 64), (3, 256)])
@pytest.mark.parametrize("bf16", [False, True])
def test_gelu_mlp_activation_bytes(batch, seq, bf16):
    """The planner's count for mlp = "gelu" against a real GELU block (the engine's model with each MLP swapped for
    up, GELU, down): fp32, and bf16 autocast over fp32 weights (the norm output is cast once, for up alone)."""
    swiglu = get_preset("tiny")
    gelu = dataclasses.replace(swiglu, mlp="gelu")
    measured = measure_saved_bytes(swiglu, batch, seq, bf16=bf16, prepare=_gelu_mlps)
    if bf16:
        autocast = dataclasses.replace(FIVEFOLD, param_bytes=4, autocast_weight_copies=True, residual_bytes=4)
        rep = rank_memory(gelu, seq, Layout(micro_batch_size=batch), autocast, in_flight=1.0)
        predicted = rep.parts["activations"] + rep.parts["bf16_weight_copies"]
    else:
        predicted = forward_saved_bytes(gelu, batch, seq, Layout(), FIVEFOLD_CPU)
    assert predicted == pytest.approx(measured, rel=TOL)
    # and the SwiGLU count of the same shape is larger by the gate's share: not the same number
    assert forward_saved_bytes(swiglu, batch, seq, Layout(), FIVEFOLD_CPU) > forward_saved_bytes(
        gelu, batch, seq, Layout(), FIVEFOLD_CPU)


def test_gelu_mlp_parameters_match_gpt_neox_without_biases():
    """count_params of a GELU model against Hugging Face's GPT-NeoX of the same shape, whose weights (not biases)
    are the same matrices: embedding, q|k|v, o, up, down, the norms' scales, untied output layer."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.GPTNeoXConfig(hidden_size=128, num_attention_heads=4, intermediate_size=384, num_hidden_layers=3,
                                    vocab_size=2048, tie_word_embeddings=False, rotary_pct=1.0)
    with torch.device("meta"):
        model = transformers.GPTNeoXForCausalLM(hf)
    weights = sum(p.numel() for n, p in model.named_parameters() if not n.endswith(".bias"))
    cfg = dataclasses.replace(get_preset("tiny"), n_layers=3, n_kv_heads=4, tied_embeddings=False, mlp="gelu")
    assert count_params(cfg) == weights
    # every weight but the embedding lookup and the norms' scales is a matmul of each token (MFU's 6 per parameter)
    norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n and n.endswith(".weight"))
    assert active_matmul_params(cfg) == weights - model.gpt_neox.embed_in.weight.numel() - norms
    assert count_params(dataclasses.replace(cfg, mlp="swiglu")) == weights + 3 * 128 * 384  # plus a gate per block


def test_the_engine_refuses_a_gelu_mlp():
    from fivefold.config import Config
    from fivefold.models.llama import Llama

    cfg = Config()
    cfg.model.mlp = "gelu"
    with pytest.raises(ConfigError, match="model.mlp = 'gelu'.*SwiGLU"):
        cfg.validate()
    with pytest.raises(ConfigError, match="model.mlp = 'gelu'"):
        Llama(cfg.model)
    cfg.model.mlp = "relu"
    with pytest.raises(ConfigError, match=r"model.mlp = 'relu' must be one of swiglu, gelu"):
        cfg.model.validate()


def test_gelu_mlp_in_the_search():
    """`--model ...,mlp=gelu` plans a GELU model: its layouts cost a third less MLP compute than the SwiGLU model of
    the same shape, and the trainer's config of it is refused by name (the engine builds SwiGLU only)."""
    from fivefold.cli.plan import load_model
    from fivefold.planner.hardware import get_cluster
    from fivefold.planner.search import estimate

    shape = "layers=8,hidden=2048,heads=16,ffn=8192,vocab=50304"
    gelu, swiglu = load_model(shape + ",mlp=gelu"), load_model(shape)
    assert gelu.mlp == "gelu" and swiglu.mlp == "swiglu"
    lay = Layout(dp=4, tp=2, micro_batch_size=2, grad_accum_steps=4)
    hw = get_cluster("h100")
    g, s = (estimate(c, 2048, lay, FIVEFOLD, hw) for c in (gelu, swiglu))
    assert g.step_time_s < s.step_time_s and g.peak_bytes < s.peak_bytes
    from fivefold.cli.plan import add_arguments, run

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", shape + ",mlp=gelu", "--write-config", "best.toml"])
    with pytest.raises(CliError, match="--write-config: the model's MLP is 'gelu'"):
        run(args)


@pytest.mark.parametrize("arch", ["gpt_neox", "gpt2"])
def test_plan_reads_gelu_hf_configs(arch, tmp_path, capsys):
    """`--model config.json` of GPT-NeoX and GPT-2 (GELU MLPs): the shape's parameters equal the Hugging Face
    model's weights without biases (and without GPT-2's learned position table); what is not modelled is said."""
    transformers = pytest.importorskip("transformers")
    from fivefold.cli import main
    from fivefold.cli.plan import load_model

    if arch == "gpt_neox":
        hf = transformers.GPTNeoXConfig(hidden_size=128, num_attention_heads=4, intermediate_size=384,
                                        num_hidden_layers=3, vocab_size=2048, tie_word_embeddings=False,
                                        architectures=["GPTNeoXForCausalLM"])
        cls = transformers.GPTNeoXForCausalLM
    else:
        hf = transformers.GPT2Config(n_embd=128, n_head=4, n_layer=3, vocab_size=2048, n_positions=256,
                                     architectures=["GPT2LMHeadModel"])
        cls = transformers.GPT2LMHeadModel
    hf.to_json_file(tmp_path / "config.json")
    with torch.device("meta"):
        model = cls(hf)
    weights = sum(p.numel() for n, p in model.named_parameters() if not n.endswith(".bias") and "wpe" not in n)
    cfg = load_model(str(tmp_path / "config.json"))
    assert cfg.mlp == "gelu" and cfg.ffn == (384 if arch == "gpt_neox" else 4 * 128)
    assert cfg.tied_embeddings == (arch == "gpt2")
    assert count_params(cfg) == weights
    assert main(["plan", "--model", str(tmp_path), "--gpu", "cpu", "--gpus-per-node", "2", "--seq-len", "128",
                 "--global-batch", "4096", "--top", "1"]) == 0
    assert "read as a GELU-MLP shape; not modelled: biases" in capsys.readouterr().out
    bad = {**hf.to_dict(), ("hidden_act" if arch == "gpt_neox" else "activation_function"): "relu"}
    (tmp_path / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ConfigError, match="activation 'relu' is not a GELU"):
        load_model(str(tmp_path))


@pytest.mark.parametrize("seq", [128, 4096])
def test_pipeline_ranks_hold_the_blocks_the_engine_splits_at_the_runs_sequence(seq):
    """The planner's pipeline ranks hold the blocks the engine gives them for the run's sequence length: the split
    balances compute with the output layer, whose share of a stage's work falls as the sequence grows (the tiny model
    splits 3 + 1 at 128 tokens, 2 + 2 at 4,096). Measured against the parameters of the stages the engine builds
    from the run's config (`parallel.pipeline.stage_layer_counts`, on the meta device); the planner once split at
    4,096 tokens whatever the run's length, and counted 2 of the first rank's 3 blocks at 128."""
    from fivefold.config import build_config
    from fivefold.parallel.pipeline import build_stages, stage_layer_counts
    from fivefold.parallel.schedules import stage_placement
    from fivefold.planner.predict import layout_of

    cfg = build_config(None, {"model.name": "tiny", "model.max_seq_len": str(seq), "train.seq_len": str(seq),
                              "layout.pp": "2", "layout.micro_batch_size": "1", "train.global_batch_size": "4",
                              "train.device": "cpu", "train.dtype": "fp32"})
    counts = stage_layer_counts(cfg)
    assert counts == ([3, 1] if seq == 128 else [2, 2])  # the two lengths split differently
    lay = layout_of(cfg)
    for pp_rank, which in enumerate(("first", "last")):
        stages = build_stages(cfg.model, counts, stage_placement("1f1b", 2, 1), pp_rank, torch.device("meta"), 0)
        held = sum(p.numel() for stage in stages.values() for p in stage.parameters())
        assert model_state_bytes(cfg.model, lay, FIVEFOLD_CPU, which, seq=seq)["parameters"] == 4 * held, which
    # and the activations of the first rank are those of its 3 (or 2) blocks
    one = rank_memory(cfg.model, seq, lay, FIVEFOLD_CPU, in_flight=1).parts["activations"]
    single = forward_saved_bytes(cfg.model, 1, seq, dataclasses.replace(lay, pp=1), FIVEFOLD_CPU)
    per_block = (single - forward_saved_bytes(
        dataclasses.replace(cfg.model, n_layers=cfg.model.n_layers - 1), 1, seq, dataclasses.replace(lay, pp=1),
        FIVEFOLD_CPU))
    assert one == pytest.approx(counts[0] * per_block, rel=0.05)
