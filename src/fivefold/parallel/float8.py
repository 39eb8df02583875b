"""Float8 training of the blocks' linears through torchao (`train.float8`; `pip install 'fivefold[float8]'`).

What runs in float8: every block's q/k/v, o, gate/up and down projections (the shared experts' too), as torchao's
`Float8Linear`: each forward casts the input and the weight to float8 with dynamic scales and multiplies them with
`torch._scaled_mm`, and the backward does the same for the output gradient. The weights, their gradients and the
optimizer state keep their dtypes (fp32 masters, bf16 working weights under lean mixed precision), so checkpoints
are those of a run without float8. What stays in high precision: the embedding, the output layer, the MoE router
and the shared-expert gate (small, and sensitive to rounding), the routed experts' batched weights (not linear
modules), attention and the norms.

Recipes (`train.float8`):
* `rowwise`: one scale per row of each operand (e4m3 for inputs, weights and gradients), torchao's recipe for
  accuracy; needs float8 matmuls with row scales (compute capability 9.0 or newer: Hopper, Blackwell);
* `tensorwise`: one scale per tensor (e4m3 forward, e5m2 gradients), the fastest; under ZeRO-3 the weights are
  all-gathered in float8 (one byte per element instead of two), `fully_shard` casting each shard before the
  gather; needs compute capability 8.9 or newer (Ada, Hopper, Blackwell).

On the CPU PyTorch runs the float8 matmuls with reference kernels: correct and slow, for tests and for a config's
plumbing, never for speed.

How it composes:
* tensor parallel: converted after the shards are cut, so each rank's linears quantize their own slices. Under
  sequence parallel the input is all-gathered in high precision and goes through the modules, so the fused,
  overlapped collective matmuls of `tensor_comm` (`layout.tp_comm_overlap`) are not used for these linears. Row
  scales of a row-parallel linear's input span the rank's slice of the features, not all of them, so a tp run's
  rounding differs slightly from one process's;
* selective recompute keeps the float8 matmuls' outputs as it keeps the matmuls' (`recompute.SAVED_OPS`);
* a pipeline's B / W split defers only plain linears' weight gradients, so a float8 linear computes its weight
  gradient in its backward;
* torch.compile fuses the scale computations and casts (the fast configuration on GPUs).
"""

from __future__ import annotations

import importlib.util
import logging

import torch
from torch import nn

from fivefold.config import ConfigError, shown

RECIPES = ("rowwise", "tensorwise")
# the linear modules of a block that run in float8 (attention's and every dense / shared-expert MLP's)
FLOAT8_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# the oldest compute capability with float8 matmuls of each recipe's scaling
MIN_CAPABILITY = {"rowwise": (9, 0), "tensorwise": (8, 9)}


def torchao_missing(recipe: str) -> str | None:
    """Why `train.float8 = recipe` cannot run for lack of torchao, or None."""
    if importlib.util.find_spec("torchao") is None:
        return (f"train.float8 = {shown(recipe)} runs the linears through torchao, which is not installed; "
                "pip install 'fivefold[float8]' (or torchao), or use train.float8 = 'off'")
    return None


def device_capability(device: torch.device) -> tuple[int, int] | None:
    """The compute capability `device` reports through its device module (None where it reports none)."""
    capability = getattr(torch.get_device_module(device.type), "get_device_capability", None)
    have = capability(device) if capability is not None else None
    return tuple(have) if isinstance(have, tuple) else None


def device_problem(recipe: str, device_type: str, capability: tuple[int, int] | None) -> str | None:
    """Why a `device_type` device of `capability` cannot run `recipe`'s float8 matmuls, or None. The CPU runs them
    (reference kernels, for tests); an accelerator must report at least `MIN_CAPABILITY[recipe]`."""
    if device_type == "cpu":
        return None
    need = MIN_CAPABILITY[recipe]
    shown_need = ".".join(map(str, need))
    if capability is None:
        return (f"train.float8 = {shown(recipe)}: no float8 matmul is known on {device_type} devices (float8 needs a "
                f"compute capability of {shown_need} or newer); use train.float8 = 'off'")
    if capability < need:
        other = [r for r in RECIPES if capability >= MIN_CAPABILITY[r]]
        hint = f"use train.float8 = {shown(other[0])} or 'off'" if other else "use train.float8 = 'off'"
        return (f"train.float8 = {shown(recipe)} needs float8 matmuls with {recipe} scales (compute capability "
                f"{shown_need} or newer); this {device_type} device has {'.'.join(map(str, capability))}; {hint}")
    return None


def check_float8(recipe: str, device: torch.device) -> None:
    """Refuse `train.float8 = recipe` where it cannot run (torchao absent, a device without float8 matmuls)."""
    if recipe == "off":
        return
    problem = torchao_missing(recipe) or device_problem(
        recipe, device.type, None if device.type == "cpu" else device_capability(device))
    if problem:
        raise ConfigError(problem)


def import_float8():
    """torchao's float8 training API (`torchao.float8`), imported with its import-time warnings silenced: the CUDA
    kernel libraries of other PyTorch builds that it fails to load (float8 training does not use them) and a
    deprecation notice of PyTorch's pytree registry, which every rank would otherwise print on every run."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        import torchao.float8
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
    return torchao.float8


def gathers_float8(cfg) -> bool:
    """Whether ZeRO-3's `fully_shard` gathers the float8 linears' weights in float8 (the tensorwise recipe)."""
    return cfg.train.float8 == "tensorwise" and cfg.layout.zero == 3 and cfg.layout.world_size > 1


def precompute_weight_scales(parts) -> None:
    """Under the float8 all-gather, every float8 weight's scale from its updated shards in one all-reduce per model
    part over its ZeRO-3 group (torchao's `precompute_float8_dynamic_scale_for_fsdp`), after the optimizer step,
    instead of one all-reduce per weight before each of its all-gathers. Every rank of the group calls it at the
    same point of the step, so the all-reduces meet in one order."""
    ao = import_float8()
    for part in parts:
        ao.precompute_float8_dynamic_scale_for_fsdp(part)


def is_float8_linear(module: nn.Module, fqn: str) -> bool:
    """Whether `module`, named `fqn` in its model, is one of the linears float8 converts (`FLOAT8_LINEARS`)."""
    return type(module) is nn.Linear and fqn.rsplit(".", 1)[-1] in FLOAT8_LINEARS


def apply_float8(model: nn.Module, recipe: str, float8_all_gather: bool = False) -> None:
    """Convert the blocks' linears of `model` (`FLOAT8_LINEARS`) to torchao's `Float8Linear` with `recipe` (a
    validated `train.float8`), in place and keeping every parameter (same objects, same names);
    `float8_all_gather` (the tensorwise recipe under ZeRO-3, `gathers_float8`): `fully_shard` gathers the weights in
    float8. Apply after tensor parallel, before recompute and compile."""
    ao = import_float8()
    config = (ao.Float8LinearConfig(enable_fsdp_float8_all_gather=True) if float8_all_gather
              else ao.Float8LinearConfig.from_recipe_name(recipe))
    ao.convert_to_float8_training(model, config=config, module_filter_fn=is_float8_linear)
    for module in model.modules():  # tensor parallel's fused collective matmuls read the weights directly
        if hasattr(module, "fused_matmuls"):
            module.fused_matmuls = False
