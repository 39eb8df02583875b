"""`fivefold plan`: search every layout (or estimate one) and print memory and time; `fivefold plan validate`
compares the model with published runs."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

from fivefold.config import (
    Config,
    ConfigError,
    ModelConfig,
    did_you_mean,
    divisors,
    dump_toml,
    finite_float,
    int_in,
    load_file,
    shown,
    write_text_atomic,
)
from fivefold.errors import CliError
from fivefold.flops import attention_fraction, attention_pairs, causal_pairs
from fivefold.layout import check_layout, layout_notes
from fivefold.outputs import check_target, keep_previous
from fivefold.planner.layout import Framework, Layout, check_runs_hsdp, parse_layout
from fivefold.planner.search import (
    MAX_BATCH_SEQUENCES,
    RANK_RULES,
    SLOW_BATCH_SEQUENCES,
    SearchSpace,
    announce_search,
    estimate,
    gib,
    parse_tokens,
    rank_key,
    search,
)

_SHAPE_KEYS = {"layers": "n_layers", "hidden": "hidden", "heads": "n_heads", "kv_heads": "n_kv_heads",
               "ffn": "ffn", "vocab": "vocab_size", "experts": "n_experts", "top_k": "top_k",
               "tied": "tied_embeddings", "moe_ffn": "moe_ffn", "shared_experts": "n_shared_experts", "mlp": "mlp"}
# the keys a shape must give (kv_heads defaults to heads: multi-head attention)
_SHAPE_REQUIRED = ("layers", "hidden", "heads", "ffn", "vocab")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _framework_names() -> list[str]:
    from fivefold.planner.profile import all_frameworks

    return list(all_frameworks())


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", nargs="?", choices=["search", "validate", "scaling"], default="search",
                   help="search (default), validate against published runs, or scaling over node counts")
    p.add_argument("--model", default="llama3-8b",
                   help="a preset, a shape 'layers=..,hidden=..,heads=..,kv_heads=..,ffn=..,vocab=..' "
                        "(kv_heads defaults to heads; optional experts=..,top_k=..,tied=true|false,mlp=swiglu|gelu), "
                        "or a Hugging Face config.json (Llama, Mixtral; GPT-NeoX and GPT-2 as GELU shapes)")
    p.add_argument("--gpu", help="h100 (the default), h100-pcie, h200, b200, a100-40gb, a100-80gb, mi300x, "
                                  "max1550, cpu, h100-efa; with --hardware, the base of a file that names none")
    p.add_argument("--hardware", help="TOML file describing the hardware (optionally base = PRESET)")
    p.add_argument("--nodes", default="1", help="nodes (scaling: a comma-separated list, e.g. 1,2,4,8)")
    p.add_argument("--weak", action="store_true", help="scaling: the global batch grows with the nodes")
    p.add_argument("--strong", action="store_true", help="scaling: the global batch stays")
    p.add_argument("--png", help="scaling: also plot the efficiency to this PNG (needs matplotlib)")
    p.add_argument("--gpus-per-node", type=int_in(1, 1024, "devices of one node"),
                   default=0, help="default: the hardware's")
    p.add_argument("--seq-len", type=int_in(2, 1 << 24, "tokens per sequence, up to 16M"), default=4096)
    p.add_argument("--global-batch", default="1M", help="tokens per step; K/M/G are powers of two (1M = 1048576)")
    p.add_argument("--top", type=int_in(1, 10_000, "rows of the table"), default=10)
    p.add_argument("--rank", choices=list(RANK_RULES), default="expected",
                   help="how layouts are ranked where the hardware profile has stall data (a pipelined step may "
                        "stall at its hand-overs): by the expected step time (default), or by the p90 step time "
                        "for the risk-averse; without stall data both are the clean step time")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--write-config", help="write the best layout as a `fivefold train` TOML config")
    p.add_argument("--train-tokens", help="--write-config: the run's token budget, e.g. 40G (default: 20 tokens "
                   "per parameter)")
    p.add_argument("--layout", help="estimate one layout, e.g. 'dp=4,tp=2,pp=1,micro_batch_size=1,zero=1,"
                                    "recompute=none' (mbs is short for micro_batch_size)")
    p.add_argument("--explain", action="store_true", help="say why the best layout wins")
    p.add_argument("--measure", action="store_true",
                   help="run the pick (or --layout) on this machine's device with `fivefold train --only-rank` for "
                   "the ranks that hold the most (first and last pipeline stage, an expert rank) and print measured "
                   "beside predicted")
    p.add_argument("--measure-steps", type=int_in(1, 1000, "timed steps of each rank"),
                   default=2, help="--measure: steps of each rank (default 2)")
    p.add_argument("--framework", choices=sorted(_framework_names()),
                   help="whose implementation to model (default: fivefold-cpu on a CPU profile, else fivefold; "
                        "nanotron: the playbook's benchmark settings)")
    p.add_argument("--features", default="", help="what the runs use beyond the layout, comma-separated: compile "
                   "(fused element-wise kernels), float8 (float8 linears), async-tp (micro-pipelined TP collectives)")
    p.add_argument("--mfu-convention", choices=["fivefold", "torchtitan", "playbook"], default="fivefold",
                   help="FLOPs per token of the MFU column: fivefold's (causal attention halved, the trainer's), "
                   "torchtitan's or the playbook's (full attention; the playbook also counts the embedding)")
    p.add_argument("--fp32-grad-accum", choices=["on", "off"], default=None,
                   help="gradients accumulated and reduced in fp32 (default: the framework's own; fivefold: on)")
    p.add_argument("--zero", default="0,1,2,3", help="ZeRO stages to consider")
    p.add_argument("--recompute", default="none,selective,full", help="recompute modes to consider")
    p.add_argument("--sp", choices=["on", "off", "both"], default="both", help="sequence parallel with tp>1")
    p.add_argument("--schedules", default="afab,1f1b,interleaved,zero-bubble,dualpipev")
    p.add_argument("--no-cp", action="store_true", help="do not consider context parallel")
    p.add_argument("--pad-vocab", type=int,
                   default=0, metavar="MULTIPLE",
                   help="round the vocabulary up to a multiple of this (e.g. 128: 50,257 -> 50,304), as Megatron's "
                        "make-vocab-size-divisible-by does, so that tp can split it; the written config keeps it")
    p.add_argument("--fix", help="search only layouts with these values, e.g. 'tp=8,pp=4' (keys: dp, tp, pp, cp, "
                                 "ep, mbs, zero, schedule, vpp, sp, recompute)")
    p.add_argument("--moe-imbalance", type=finite_float, default=1.0,
                   help="MoE routing: the busiest expert's load over the even share, >= 1 (default 1: balanced, as "
                        "published MoE benchmarks force it); prices the busiest ep rank's memory and step time")
    p.add_argument("--data", help="search, --layout, scaling: a prepared data directory (`fivefold data prepare`) "
                                  "whose histogram of document lengths prices document-masked attention; validate: "
                                  "CSV of runs (default in a clone: ../shared/data/playbook_benchmark_runs.csv beside "
                                  "the repository; required otherwise)")
    p.add_argument("--doc-len", metavar="N", help="price document masking (attention only within a document) with "
                   "documents of N tokens each, the end-of-document token included (or --data DIR for the data's "
                   "lengths)")
    p.add_argument("--sliding-window", metavar="N", help="price sliding-window attention: each query sees the N "
                   "latest positions, itself included (1 .. --seq-len; default: the model's own, none for presets)")
    p.add_argument("--results", help="validate: a `fivefold sweep` results store instead of the CSV (with "
                                     "--hardware FILE for the profile to predict with)")
    p.add_argument("--profile", help="validate: TOML of fitted constants (default: the packaged profile)")
    p.add_argument("--fit", action="store_true", help="validate: refit the constants on the 1- and 2-node rows")
    p.add_argument("--out", help="validate --fit: write the fitted profile here (readable by plan --hardware)")
    p.add_argument("--fit-fields", default="", help="validate --fit: fit only these constants (comma-separated; "
                   "matmul_efficiency alone is fitted on a fine grid, e.g. on one named row), default all")
    p.add_argument("--per-row", action="store_true", help="validate: every row's prediction beside its measurement "
                   "(a table, or a 'rows' list with --json)")


def _is_hf_config(spec: str) -> bool:
    """Whether `--model` names a Hugging Face config.json (or its directory) rather than a preset or a shape."""
    return spec.endswith(".json") or Path(spec).is_dir()


def load_model(spec: str) -> ModelConfig:
    """A preset name, a `key=value,...` shape, or a config.json path."""
    from fivefold.presets import get_preset

    if "=" in spec:
        values: dict = {"name": "custom"}
        given: dict[str, str] = {}
        for part in (x.strip() for x in spec.split(",")):
            key, _, value = (x.strip() for x in part.partition("="))
            if not part:
                raise CliError(f"--model shape {shown(spec)} has an empty item; give KEY=VALUE items separated by "
                               "single commas")
            if key not in _SHAPE_KEYS:
                raise CliError(f"--model shape key {shown(key)} is not known{did_you_mean(key, _SHAPE_KEYS)}; use: "
                               f"{', '.join(_SHAPE_KEYS)}")
            if key in given:
                raise CliError(f"--model shape gives {key} twice ({key}={given[key]} and {part}); keep one")
            given[key] = value
            field = _SHAPE_KEYS[key]
            if field == "tied_embeddings":
                if value.lower() not in _TRUE + _FALSE:
                    raise CliError(f"--model tied = {shown(value)} must be true or false")
                values[field] = value.lower() in _TRUE
            elif field == "mlp":
                values[field] = value.strip().lower()
            else:
                try:
                    values[field] = int(value)
                except ValueError:
                    raise CliError(f"--model {key} = {shown(value)} is not an integer") from None
        if "n_kv_heads" not in values and "n_heads" in values:
            values["n_kv_heads"] = values["n_heads"]
        cfg = ModelConfig(**values)
        cfg.validate("--model")  # the values given first (hidden not divisible by heads, ...)
        missing = [k for k in _SHAPE_REQUIRED if k not in given]
        if missing:
            raise CliError(f"--model shape {shown(spec)} lacks {', '.join(missing)}; a shape gives layers, hidden, "
                           "heads, ffn and vocab (kv_heads defaults to heads)")
        return cfg
    if _is_hf_config(spec):
        from fivefold.models.hf_config import model_config_from_hf, read_config_json  # no torch
        from fivefold.planner.shapes import gelu_shape_from_hf

        hf = read_config_json(spec)
        path = Path(spec)
        name = (path if path.is_dir() else path.parent).resolve().name
        return gelu_shape_from_hf(hf, name) or model_config_from_hf(hf, name)
    return get_preset(spec)


def pad_vocab(cfg: ModelConfig, multiple: int) -> ModelConfig:
    """The model with its vocabulary rounded up to a multiple of `multiple` (0: unchanged). The extra rows are
    never looked up; their logits take part in the softmax and learn to stay low, as in Megatron-LM."""
    if multiple == 0:
        return cfg
    if multiple < 0:
        raise CliError(f"--pad-vocab = {multiple} must be >= 1 (a multiple such as 64 or 128), or 0 for none")
    if multiple > 1 << 16:
        raise CliError(f"--pad-vocab = {multiple:,} must be at most 65,536 (a multiple such as 64 or 128)")
    padded = -(-cfg.vocab_size // multiple) * multiple
    return dataclasses.replace(cfg, vocab_size=padded)


def _space(args: argparse.Namespace) -> SearchSpace:
    try:
        zero = tuple(int(z) for z in args.zero.split(","))
    except ValueError:
        raise CliError(f"--zero {shown(args.zero)} must be a comma-separated list of 0..3") from None
    if not zero or any(z not in (0, 1, 2, 3) for z in zero):
        raise CliError(f"--zero {shown(args.zero)} must be a comma-separated list of 0..3, e.g. 0,1")
    rc = tuple(args.recompute.split(","))
    for r in rc:
        if r not in ("none", "selective", "full"):
            raise CliError(f"--recompute {shown(r)} is not one of none, selective, full")
    from fivefold.layout import SCHEDULES

    schedules = tuple(args.schedules.split(","))
    for name in schedules:
        if name not in SCHEDULES:
            raise CliError(f"--schedules item {shown(name)} is not one of {', '.join(SCHEDULES)}")
    sp = {"on": (True,), "off": (False,), "both": (False, True)}[args.sp]
    return SearchSpace(zero=zero, recompute=rc, sp=sp, schedules=schedules,
                       cp=not args.no_cp,
                       fp32_grad_accum=None if args.fp32_grad_accum is None else args.fp32_grad_accum == "on")


_FIX_DEGREES = ("dp", "tp", "pp", "cp", "ep", "micro_batch_size")
_FIX_KEYS = ("dp", "tp", "pp", "cp", "ep", "mbs", "micro_batch_size", "zero", "schedule", "vpp", "sp", "recompute")


def apply_fix(text: str, space: SearchSpace, n_gpus: int, gpus_per_node: int, batch_seqs: int,
              explicit: dict[str, str]) -> SearchSpace:
    """`--fix KEY=VALUE,...`: the search space restricted to these values, each checked against the cluster and
    the batch (`explicit`: the --zero/--recompute/--schedules/--sp options the user gave, which must allow it)."""
    from fivefold.layout import SCHEDULES

    def listed(n: int) -> str:
        found = divisors(n)
        return ", ".join(map(str, found[:24])) + (f", ... ({len(found)} in all)" if len(found) > 24 else "")

    fixed: dict[str, int] = {}
    updates: dict = {}
    for part in filter(None, (x.strip() for x in text.split(","))):
        key, eq, value = (x.strip() for x in part.partition("="))
        if not eq or key not in _FIX_KEYS:
            raise CliError(f"--fix item {shown(part)} is not KEY=VALUE with KEY one of: {', '.join(_FIX_KEYS)}"
                           f"{did_you_mean(key, _FIX_KEYS) if eq else ''}")
        key = "micro_batch_size" if key == "mbs" else key
        if key in fixed or key in updates:
            raise CliError(f"--fix gives {key} twice; keep one value")
        if key == "schedule":
            if value not in SCHEDULES:
                raise CliError(f"--fix schedule = {shown(value)} is not one of {', '.join(SCHEDULES)}")
            updates["schedules"] = (value,)
            continue
        if key == "recompute":
            if value not in ("none", "selective", "full"):
                raise CliError(f"--fix recompute = {shown(value)} is not one of none, selective, full")
            updates["recompute"] = (value,)
            continue
        if key == "sp":
            if value.lower() not in ("on", "off", "true", "false", "1", "0"):
                raise CliError(f"--fix sp = {shown(value)} must be on or off")
            updates["sp"] = (value.lower() in ("on", "true", "1"),)
            continue
        try:
            number = int(value)
        except ValueError:
            raise CliError(f"--fix {key} = {shown(value)} is not an integer") from None
        if key == "zero":
            if number not in (0, 1, 2, 3):
                raise CliError(f"--fix zero = {number} is not a ZeRO stage; use 0, 1, 2 or 3")
            updates["zero"] = (number,)
        elif key == "vpp":
            if number < 1:
                raise CliError(f"--fix vpp = {number} must be >= 1 (model chunks per pipeline rank)")
            updates["vpp"] = (number,)
            if number > 1:
                updates.setdefault("schedules", ("interleaved",))
        else:
            if number < 1:
                raise CliError(f"--fix {key} = {number} must be >= 1")
            if key in ("dp", "tp", "pp", "cp") and n_gpus % number:
                raise CliError(f"--fix {key} = {number} does not divide the {n_gpus} GPUs; values that do: "
                                  f"{listed(n_gpus)}")
            if key == "tp" and number > gpus_per_node:
                raise CliError(f"--fix tp = {number} is above the {gpus_per_node} GPUs of a node (tensor parallel "
                                  f"stays inside a node); use one of {listed(gpus_per_node)}")
            if key == "micro_batch_size" and batch_seqs % number:
                raise CliError(f"--fix mbs = {number} does not divide the global batch of {batch_seqs} sequences; "
                                  f"values that do: {listed(batch_seqs)}")
            fixed[key] = number
    product = math.prod(fixed.get(k, 1) for k in ("dp", "tp", "pp", "cp"))
    if n_gpus % product or (all(k in fixed for k in ("dp", "tp", "pp", "cp")) and product != n_gpus):
        raise CliError(f"--fix: dp x tp x pp x cp = {product} with the fixed degrees, which does not fit the "
                          f"{n_gpus} GPUs (the product must divide them, and equal them when all four are fixed)")
    if fixed.get("dp", 1) * fixed.get("micro_batch_size", 1) > batch_seqs or \
            batch_seqs % (fixed.get("dp", 1) * fixed.get("micro_batch_size", 1)):
        raise CliError(f"--fix: dp x mbs = {fixed.get('dp', 1) * fixed.get('micro_batch_size', 1)} must divide "
                          f"the global batch of {batch_seqs} sequences")
    for field, option in (("zero", "--zero"), ("recompute", "--recompute"), ("schedules", "--schedules"),
                          ("sp", "--sp")):
        if field in updates and field in explicit and not set(updates[field]) <= set(getattr(space, field)):
            raise CliError(f"--fix {field.rstrip('s')} = {updates[field][0]} is excluded by {option} "
                              f"{explicit[field]}; drop one of them")
    if "micro_batch_size" in fixed:
        updates["max_mbs"] = max(space.max_mbs, fixed["micro_batch_size"])
    if "cp" in fixed and fixed["cp"] > 1:
        updates["cp"] = True
    return dataclasses.replace(space, fixed=tuple(fixed.items()), **updates)


def _cluster(args: argparse.Namespace):
    from fivefold.planner import profile
    from fivefold.planner.hardware import get_cluster

    hw = get_cluster(args.gpu, args.hardware) if not args.hardware else profile.load(args.hardware, None, args.gpu)[1]
    if args.hardware and getattr(args, "gpu_given", False):
        _check_gpu(args)  # once the file has been read and checked
    if args.gpus_per_node:
        hw = dataclasses.replace(hw, gpus_per_node=args.gpus_per_node)
    return hw


def _mfu_scale(args: argparse.Namespace, cfg: ModelConfig, seq: int) -> float:
    """--mfu-convention: what multiplies fivefold's MFU (`planner/mfu.py`)."""
    from fivefold.planner.mfu import mfu_scale

    return mfu_scale(cfg, seq, getattr(args, "mfu_convention", None) or "fivefold", getattr(args, "docs", None))


def _features(args: argparse.Namespace) -> tuple[str, ...]:
    from fivefold.planner.features import parse_features

    return parse_features(getattr(args, "features", None) or "")


def _ranking(args: argparse.Namespace, compiled: bool, for_config: bool) -> str:
    """Whether the table ranks compiled or eager steps, and why (`plan --json`: "compiled")."""
    if for_config:
        return f"ranked with torch.compile, as {args.write_config} runs it (train.compile = true)"
    if compiled:
        return "ranked with torch.compile (--features compile)"
    return ("ranked eager, without torch.compile (--features compile ranks compiled steps, as --write-config does "
            "on an accelerator for the config it writes)")


def _predicted(compiled: bool) -> str:
    """Whether --layout's or scaling's prediction is of compiled or eager steps (`plan --layout --json`: "compiled")."""
    if compiled:
        return "predicted with torch.compile (--features compile)"
    return "predicted eager, without torch.compile (--features compile predicts compiled steps)"


def _framework(args: argparse.Namespace, hw) -> Framework:
    """--framework, else the [framework] of the --hardware profile, else fivefold (fivefold-cpu on a CPU); with
    the run's --features (torch.compile, float8, async TP: `planner/features.py`)."""
    from fivefold.planner import profile
    from fivefold.planner.features import with_features

    features = _features(args)
    if args.hardware:
        fw = profile.load(args.hardware, args.framework, args.gpu)[0]
        if fw is not None:
            return with_features(fw, features)
    return with_features(profile.all_frameworks()[args.framework or ("fivefold-cpu" if hw.is_cpu
                                                                     else "fivefold")], features)


def train_config(cfg: ModelConfig, lay: Layout, seq: int, batch_seqs: int, dtype: str, accelerator: bool = True,
                 train_tokens: int | None = None, float8: bool = False) -> tuple[Config, str]:
    """The `fivefold train` config of `lay` for `cfg`, computing in `dtype` (the framework's precision), with the
    published hyperparameters of its size (`fivefold.train.recipes`) and a data path to fill in, checked by the same
    rules as `fivefold train` (`Config.validate`, then the layout rule book on the layout's world); and the
    recipe's source. `float8` (the plan priced float8 linears, `--features float8`): `train.float8 = "rowwise"`."""
    from fivefold.train.recipes import apply_recipe

    conf = Config()
    conf.model = dataclasses.replace(cfg, max_seq_len=max(cfg.max_seq_len, seq))
    conf.layout = lay.to_layout_config()
    conf.train.seq_len = seq
    conf.train.global_batch_size = batch_seqs
    conf.train.dtype = dtype
    conf.train.float8 = "rowwise" if float8 else "off"
    recipe = apply_recipe(conf, accelerator, train_tokens)
    conf.run_dir = f"runs/{cfg.name}"
    conf.validate()
    check_layout(conf, lay.world_size)
    return conf, recipe.source


def write_config(path: str, cfg: ModelConfig, lay: Layout, seq: int, batch_seqs: int, dtype: str,
                 nodes: int = 1, gpus_per_node: int = 1, accelerator: bool = True, prediction: str = "",
                 train_tokens: int | None = None, float8: bool = False) -> Config:
    """A `fivefold train` config of `lay` for `cfg` (`train_config`), with the launch lines in its header."""
    from fivefold.train.recipes import launch_lines

    conf, source = train_config(cfg, lay, seq, batch_seqs, dtype, accelerator, train_tokens, float8)
    header = [f"# written by `fivefold plan`: {lay.short()} on {nodes} x {gpus_per_node} devices",
              *([f"# predicted: {prediction}"] if prediction else []),
              f"# hyperparameters: {source}; max_steps: "
              + (f"{train_tokens:,} tokens" if train_tokens else "20 tokens per parameter"),
              "# fill in data.path (`fivefold data prepare FILES --tokenizer MODEL_DIR --out DIR`); launch with:",
              *(f"#   {line}" for line in launch_lines(["--config", str(path), "--run-dir", conf.run_dir],
                                                           nodes, gpus_per_node))]
    text = "\n".join(header) + "\n" + dump_toml(conf)
    target = Path(path)
    # never lose what is there (a filled-in data.path); compared as bytes, so that any file there is kept unread
    if target.is_file() and target.read_bytes() != text.encode():
        print(f"kept the previous {path} as {keep_previous(target)}")
    write_text_atomic(path, text)
    return conf


def _fmt_row(e, family: str, risk: bool = False) -> str:
    """A row of the search's table; with `risk` (a cluster with stall data) the step time and tokens/s are the
    p50's, followed by the p90's and the chance of a stall; under an attention mask the causal-equivalent MFU."""
    masked = f" {100 * e.mfu_causal_equivalent:8.1f}" if e.mfu_causal_equivalent is not None else ""
    if not risk:
        return (f"{e.layout.short():58s} {family:30s} {gib(e.peak_bytes):8.1f} {e.step_time_s:9.3f} "
                f"{e.tokens_per_s_per_device:12,.0f} {100 * e.mfu:6.1f}{masked}")
    p50, p90 = e.step_time_at(0.5), e.step_time_at(0.9)
    return (f"{e.layout.short():58s} {family:30s} {gib(e.peak_bytes):8.1f} {p50:9.3f} "
            f"{e.tokens_per_s_at(p50):12,.0f} {100 * e.mfu * e.step_time_s / p50:6.1f}{masked} {p90:9.3f} "
            f"{e.tokens_per_s_at(p90):12,.0f} {100 * e.stall.probability:7.1f}")


MAX_TRAIN_TOKENS = 1 << 60  # --train-tokens: far above any run (the largest train on about 2^44 tokens)
# the string options where '' would otherwise act as "not given" (a default GPU, a full search, nothing written)
_NOT_EMPTY = ("model", "gpu", "hardware", "layout", "write_config", "png", "train_tokens", "fix", "out", "data",
              "profile", "results", "nodes", "global_batch", "schedules", "zero", "recompute")
PNG_SUFFIXES = (".png", ".svg", ".pdf")


def _check_not_empty(args: argparse.Namespace) -> None:
    for name in _NOT_EMPTY:
        value = getattr(args, name, None)
        if isinstance(value, str) and not value.strip():
            raise CliError(f"--{name.replace('_', '-')} {shown(value)} is empty; give a value or leave the option out")


# the modes of `fivefold plan`: the search (the default action), --layout (one layout estimated), scaling, validate
_MODES = {"search": "the search (`fivefold plan`)", "layout": "`fivefold plan --layout`",
          "scaling": "`fivefold plan scaling`", "validate": "`fivefold plan validate`"}
_PLANS = ("search", "layout", "scaling")  # the modes that plan a model on a cluster
# the options that only some modes read: given to another, each would be silently ignored, so it is refused
# (`_check_applies`). --write-config and --fix under --layout have refusals of their own that say what to use instead
_APPLIES: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("weak", "strong", "png"), ("scaling",)),
    **dict.fromkeys(("results", "profile", "fit", "out", "fit_fields", "per_row"), ("validate",)),
    **dict.fromkeys(("top", "explain"), ("search",)),
    **dict.fromkeys(("write_config", "measure", "mfu_convention", "moe_imbalance"), ("search", "layout")),
    **dict.fromkeys(("zero", "recompute", "sp", "schedules", "no_cp", "rank"), ("search", "scaling")),
    **dict.fromkeys(("layout", "fix", "model", "gpu", "nodes", "gpus_per_node", "seq_len", "global_batch",
                     "framework", "features", "fp32_grad_accum", "pad_vocab", "doc_len", "sliding_window"), _PLANS),
}
# options that only mean something beside another: (option, the one it needs, what it does)
_NEEDS = (("train_tokens", "write_config", "sets the token budget of the config that --write-config writes"),
          ("measure_steps", "measure", "sets the steps of each rank that --measure runs"))


def _check_applies(args: argparse.Namespace) -> None:
    """Refuse, in one line, an option given (a value other than its default) to a mode that does not read it (the
    table `_APPLIES`), or without the option it goes with (`_NEEDS`): silently ignored, it would look as if it had
    been taken into account."""
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    defaults = vars(parser.parse_args([]))
    given = {name for name, default in defaults.items() if getattr(args, name, default) != default}
    mode = "layout" if args.action == "search" and args.layout is not None else args.action
    for name, modes in _APPLIES.items():
        if name in given and mode not in modes:
            where = " and ".join(", ".join(_MODES[m] for m in modes).rsplit(", ", 1))
            value = getattr(args, name)
            flag = f"--{name.replace('_', '-')}" + ("" if isinstance(value, bool) else f" {shown(value)}")
            raise CliError(f"{flag} applies to {where} only, and {_MODES[mode]} ignores it; drop it")
    if mode == "validate" and "hardware" in given and "results" not in given:
        raise CliError(f"--hardware {shown(args.hardware)} goes with --results (a sweep's store); `fivefold plan "
                       "validate` predicts the CSV's runs with --profile FILE: give it as --profile")
    if "explain" in given and "json" in given:
        raise CliError("--explain prints why the best layout wins below the table; --json prints no table: drop one "
                       "of them")
    for name, needed, what in _NEEDS:
        if name in given and needed not in given:
            flag = f"--{name.replace('_', '-')}"
            raise CliError(f"{flag} {shown(getattr(args, name))} {what}; add --{needed.replace('_', '-')} (or drop "
                           f"{flag})")


def run(args: argparse.Namespace) -> int:
    _check_not_empty(args)
    _check_applies(args)
    args.gpu_given = args.gpu is not None
    args.gpu = args.gpu or "h100"  # the default device
    if args.action == "validate":
        from fivefold.tools.validate import run_validate

        return run_validate(args)
    _check_options(args)
    cfg = _attention_model(args, _plan_model(args))
    check_moe_imbalance(args.moe_imbalance, cfg)
    hw = _cluster(args)
    fw = _framework(args, hw)
    _resolve_nodes(args)
    n_gpus = args.nodes * hw.gpus_per_node
    from fivefold.planner.scaling import parse_nodes

    largest = parse_nodes(args.nodes_list)[-1] if args.action == "scaling" else args.nodes
    check_search_size(largest, hw.gpus_per_node, hw.unit)
    tokens = parse_tokens(args.global_batch)
    seq = args.seq_len
    batch_seqs = tokens // seq
    space = _fixed_space(args, n_gpus, hw.gpus_per_node, batch_seqs)
    if args.action == "scaling":
        from fivefold.planner.scaling import run_scaling

        masked = _attention_line(args, cfg, seq)
        preface = (*([masked] if masked else []), _predicted("compile" in _features(args)))
        return run_scaling(args, cfg, fw, hw, space, seq, batch_seqs, args.docs, preface)
    if args.layout:
        return _estimate_layout(args, cfg, fw, hw, seq, batch_seqs, n_gpus)
    return _search_layouts(args, cfg, fw, hw, space, seq, tokens, n_gpus)


def _check_gpu(args: argparse.Namespace) -> None:
    """A given --gpu may not name another device than the --hardware file's own `base` (the file read and checked
    already): the file's would be used, and the flag dropped without a word."""
    from fivefold.planner.hardware import PRESETS

    data = load_file(args.hardware, "--hardware", suffix=".toml")
    base = (data["hardware"] if isinstance(data.get("hardware"), dict) else data).get("base")
    if isinstance(base, str) and base.lower() in PRESETS and base.lower() != args.gpu.lower():
        raise CliError(f"--gpu {shown(args.gpu)} and --hardware {shown(args.hardware)} (base = {shown(base)}) name "
                       "two devices; give one (the file describes its device)")


def _check_options(args: argparse.Namespace) -> None:
    """The numeric options and --write-config's target, before any model is read (argparse has bounded
    --seq-len, --top and --gpus-per-node, and made every float finite)."""
    if args.moe_imbalance < 1:
        raise CliError(f"--moe-imbalance = {args.moe_imbalance} must be >= 1: the busiest expert's load over the even "
                       "share (1 = balanced routing, the default)")
    _check_attention_options(args)
    _check_batch(args)
    if args.train_tokens is not None:
        parse_tokens(args.train_tokens, "--train-tokens", MAX_TRAIN_TOKENS)
    if args.write_config:
        check_target(args.write_config, "--write-config", "best.toml")
    if args.png is not None:
        check_target(args.png, "--png", "scaling.png", parent_must_exist=False)  # the plot makes its directory
        if Path(args.png).suffix.lower() not in PNG_SUFFIXES:
            raise CliError(f"--png {shown(args.png)} must end in {', '.join(PNG_SUFFIXES)} (the formats the plot is "
                           "written in)")


def _check_batch(args: argparse.Namespace) -> None:
    """--global-batch: a token count within the planner's bounds and a whole number of --seq-len sequences."""
    tokens, seq = parse_tokens(args.global_batch), args.seq_len
    if tokens // seq > MAX_BATCH_SEQUENCES:  # first: a whole-number suggestion above the bound would be refused next
        raise CliError(f"--global-batch = {tokens:,} tokens is {tokens // seq:,} sequences of {seq}; the planner takes "
                       f"at most {MAX_BATCH_SEQUENCES:,} (2^{MAX_BATCH_SEQUENCES.bit_length() - 1}) sequences per "
                       "step: a smaller batch or longer sequences")
    if tokens % seq:
        below, above = tokens // seq * seq, (tokens // seq + 1) * seq
        if above // seq > MAX_BATCH_SEQUENCES:
            above = 0
        nearest = (f"batches: {below} or {above} tokens" if below and above else
                   f"batch: {below or above} tokens" + ("" if below else " (one sequence)"))
        raise CliError(f"--global-batch = {tokens} tokens is not a whole number of --seq-len = {seq} sequences; "
                       f"nearest valid {nearest}")
    if tokens // seq > SLOW_BATCH_SEQUENCES and args.layout is None:
        print(f"fivefold plan: warning: a global batch of {tokens // seq:,} sequences: the search may take a minute "
              "(it simulates every micro-batch of the pipelined layouts)", file=sys.stderr)


def check_moe_imbalance(imbalance: float, cfg: ModelConfig) -> None:
    """--moe-imbalance against the model: an expert sees a token at most once, so its load is at most every token,
    n_experts / top_k times the even share (and a dense model has no routing to skew)."""
    if imbalance == 1.0:
        return
    if not cfg.is_moe:
        raise CliError(f"--moe-imbalance = {imbalance} applies to MoE models; {cfg.name} is dense: leave it out")
    most = cfg.n_experts / cfg.top_k
    if imbalance > most:
        raise CliError(f"--moe-imbalance = {imbalance} must be at most n_experts / top_k = {cfg.n_experts} / "
                       f"{cfg.top_k} = {most:g}: an expert gets each token at most once")


def moe_routing_json(cfg: ModelConfig, imbalance: float) -> dict:
    """What `plan --json` says of an MoE model's routing (nothing for a dense model)."""
    if not cfg.is_moe:
        return {}
    return {"moe_routing": {"imbalance": imbalance, "balanced": imbalance == 1.0,
                            "source": "assumed balanced, as published MoE benchmarks force it" if imbalance == 1.0
                            else "--moe-imbalance"}}


def moe_routing_line(cfg: ModelConfig, imbalance: float) -> str | None:
    """The plan's line on an MoE model's routing (None for a dense model)."""
    if not cfg.is_moe:
        return None
    if imbalance == 1.0:
        return "routing assumed balanced (as published MoE benchmarks force it); --moe-imbalance to change"
    return (f"routing: the busiest expert gets {imbalance:g} x the even share (--moe-imbalance): the busiest ep "
            "rank's memory and step time follow it")


def _whole_number(flag: str, value: str, rule: str) -> int:
    """`value` of `flag` as an integer, else a CliError naming the flag, the value and the rule."""
    try:
        return int(value)
    except ValueError:
        raise CliError(f"{flag} = {value!r} is not an integer; it must be {rule}") from None


def _check_attention_options(args: argparse.Namespace) -> None:
    """--doc-len, --data and --sliding-window, before any model or data is read."""
    if args.doc_len is not None:
        rule = "a whole number of tokens >= 1 (the documents' length, end-of-document token included), e.g. 1024"
        args.doc_len = _whole_number("--doc-len", args.doc_len, rule)
        if args.doc_len < 1:
            raise CliError(f"--doc-len = {args.doc_len} must be {rule}")
        if args.data is not None:
            raise CliError(f"--doc-len = {args.doc_len} and --data = {args.data} both give the documents' lengths: "
                           "give one (--doc-len N: every document N tokens; --data DIR: the data's histogram)")
    if args.sliding_window is not None:
        rule = f"a window of 1 .. --seq-len = {args.seq_len} positions (leave it out for none)"
        args.sliding_window = _whole_number("--sliding-window", args.sliding_window, rule)
        if not 1 <= args.sliding_window <= args.seq_len:
            raise CliError(f"--sliding-window = {args.sliding_window} must be {rule}")


def _attention_model(args: argparse.Namespace, cfg: ModelConfig) -> ModelConfig:
    """The model with the attention that --doc-len / --data (a document mask) and --sliding-window price; sets
    `args.docs` (the documents' lengths, or None) and `args.docs_source` (where they come from)."""
    from fivefold.flops import DocumentLengths

    args.docs, args.docs_source = None, ""
    if args.sliding_window is not None:
        cfg = dataclasses.replace(cfg, sliding_window=args.sliding_window)
    if args.doc_len is not None:
        args.docs, args.docs_source = DocumentLengths.of([args.doc_len]), f"--doc-len {args.doc_len}"
    elif args.data is not None:
        from fivefold.data.dataset import read_index
        from fivefold.data.format import DataError, document_lengths

        try:
            args.docs = document_lengths(read_index(args.data), "train")
        except DataError as e:
            raise CliError(f"--data = {args.data}: {e}") from None
        if args.docs is None:
            raise CliError(f"--data = {args.data}: its index.json holds no histogram of document lengths (prepared "
                           "before fivefold recorded them), which document masking is priced from; prepare it again "
                           f"(`fivefold data prepare INPUT... --out {args.data} --overwrite`) or give --doc-len N")
        args.docs_source = f"--data {args.data}, train split"
    if args.docs is not None:
        cfg = dataclasses.replace(cfg, attn_mask="document")
    return cfg


def _attention_json(args: argparse.Namespace, cfg: ModelConfig, seq: int) -> dict:
    """What `plan --json` says of a masked model's attention (nothing for plain causal attention)."""

    if not cfg.masks_attention:
        return {}
    docs = args.docs if cfg.attn_mask == "document" else None
    described = {"mask": cfg.attn_mask, "sliding_window": cfg.sliding_window}
    if docs is not None:
        described["documents"] = {"source": args.docs_source, "count": docs.documents, "mean_tokens": docs.mean}
    return {"attention": described | {
        "pairs_per_sequence": float(attention_pairs(seq, cfg.sliding_window, docs)),
        "causal_pairs_per_sequence": causal_pairs(seq),
        "pairs_fraction": attention_fraction(cfg, seq, docs),
        "mfu_convention": "mfu counts the attention executed (fivefold's convention, --mfu-convention applies to "
                          "it); mfu_causal_equivalent counts causal attention over the whole sequence"}}


def _tokens(n: float) -> str:
    return f"{n:,.0f}" if n == int(n) else f"{n:,.1f}"


def _attention_line(args: argparse.Namespace, cfg: ModelConfig, seq: int) -> str | None:
    """The table's line on a masked model's attention (None for plain causal attention)."""
    described = _attention_json(args, cfg, seq).get("attention")
    if described is None:
        return None
    what = [f"documents of {_tokens(d['mean_tokens'])} tokens on average ({d['source']})"
            for d in [described.get("documents")] if d]
    what += [f"a sliding window of {cfg.sliding_window:,}"] if cfg.sliding_window else []
    return (f"attention: {' and '.join(what)}: {100 * described['pairs_fraction']:.1f} % of causal attention's "
            "(q, k) pairs executed; MFU counts them, the causal-equivalent MFU ('MFU c.e.') counts causal attention "
            "over the whole sequence")


def _plan_model(args: argparse.Namespace) -> ModelConfig:
    """--model with --pad-vocab applied; a GELU shape is said so, and refused with --write-config."""
    try:
        cfg = pad_vocab(load_model(args.model), args.pad_vocab)
    except ConfigError as e:  # a preset, a Hugging Face config or NAME=VALUE fields: say which flag
        raise CliError(f"--model {shown(args.model)}: {e}") from None
    if cfg.mlp == "gelu" and _is_hf_config(args.model):
        from fivefold.planner.shapes import NOT_MODELLED

        print(f"{args.model}: read as a GELU-MLP shape; not modelled: {NOT_MODELLED}")
    if args.write_config and cfg.mlp != "swiglu":
        raise CliError(f"--write-config: the model's MLP is {shown(cfg.mlp)}, and the engine builds SwiGLU MLPs only; "
                       "plan without --write-config")
    return cfg


MAX_SEARCH_DEVICES = 1 << 20  # the planner's largest cluster: 1,048,576 devices (the largest built hold ~100,000)
SLOW_SEARCH_DEVICES = 1 << 14  # above this the search takes minutes on a laptop


def check_search_size(nodes: int, gpus_per_node: int, unit: str) -> None:
    """Refuse a cluster beyond MAX_SEARCH_DEVICES (its search would run for hours), warn above SLOW_SEARCH_DEVICES."""
    devices = nodes * gpus_per_node
    if devices > MAX_SEARCH_DEVICES:
        raise CliError(f"--nodes = {nodes:,} x {gpus_per_node} {unit}s per node = {devices:,} devices: the planner "
                       f"searches clusters of at most {MAX_SEARCH_DEVICES:,} devices (2^20; the largest built hold "
                       f"about 100,000); use at most {max(MAX_SEARCH_DEVICES // gpus_per_node, 1):,} nodes")
    if devices > SLOW_SEARCH_DEVICES:
        print(f"fivefold plan: warning: {devices:,} devices: the layout search takes a minute or more (it weighs "
              "every divisor of the device count as a degree)", file=sys.stderr)


def _resolve_nodes(args: argparse.Namespace) -> None:
    """--nodes as a number (`plan scaling`: the first of its list, the list kept as `args.nodes_list`)."""
    if args.action == "scaling":
        args.nodes_list = args.nodes
        args.nodes = int(args.nodes.split(",")[0]) if args.nodes.split(",")[0].strip().isdigit() else 1
    else:
        try:
            args.nodes = int(args.nodes)
        except ValueError:
            raise CliError(f"--nodes = {shown(args.nodes)} must be a number of nodes (a list only for "
                           "`plan scaling`)") from None
    if args.nodes < 1:
        raise CliError(f"--nodes = {args.nodes} must be >= 1")


def _fixed_space(args: argparse.Namespace, n_gpus: int, gpus_per_node: int, batch_seqs: int) -> SearchSpace:
    """The search space of the options, restricted by --fix (which does not combine with --layout)."""
    space = _space(args)
    if args.fix:
        if args.layout:
            raise CliError("--fix restricts the search; --layout estimates one layout: give one of them")
        defaults = {"zero": "0,1,2,3", "recompute": "none,selective,full", "sp": "both",
                    "schedules": "afab,1f1b,interleaved,zero-bubble,dualpipev"}
        explicit = {k: getattr(args, k) for k, v in defaults.items() if getattr(args, k) != v}
        space = apply_fix(args.fix, space, n_gpus, gpus_per_node, batch_seqs, explicit)
    return space


def _estimate_layout(args: argparse.Namespace, cfg: ModelConfig, fw: Framework, hw, seq: int, batch_seqs: int,
                     n_gpus: int) -> int:
    """--layout: the one layout's memory by part and step time by cause (or its JSON)."""
    if args.write_config:
        raise CliError("--write-config writes the best layout of a search, not --layout's: drop --layout, and pin "
                       "the layout's values with --fix (e.g. --fix 'dp=4,tp=2,pp=1') to have that layout written")
    lay = parse_layout(args.layout, batch_seqs, fw.default_fp32_grad_accum if args.fp32_grad_accum is None
                       else args.fp32_grad_accum == "on", n_gpus, f" ({args.nodes} nodes x {hw.gpus_per_node})")
    lay = dataclasses.replace(lay, fp32_grad_accum=lay.fp32_grad_accum or args.fp32_grad_accum == "on")
    check_runs_hsdp(lay, fw)
    # the layout refused as `fivefold train` refuses it: its rules do not depend on the MLP's kind (the engine
    # alone builds SwiGLU only), so a shape the search takes, a GELU one included, is taken here too
    train_config(dataclasses.replace(cfg, mlp="swiglu"), lay, seq, batch_seqs, fw.compute_dtype)
    for line in layout_notes(cfg, lay):  # accepted as `fivefold train` accepts it, with its notes
        print(f"fivefold plan: note: {line}", file=sys.stderr)
    e = estimate(cfg, seq, lay, fw, hw, True, moe_imbalance=args.moe_imbalance, docs=args.docs)
    e.mfu *= _mfu_scale(args, cfg, seq)
    measured = measure(args, cfg, lay, seq, batch_seqs, fw) if args.measure else None
    compiled = "compile" in _features(args)
    if args.json:
        print(json.dumps({**e.to_json(), **_attention_json(args, cfg, seq), **moe_routing_json(cfg, args.moe_imbalance),
                          "compiled": compiled,
                          **({"measured": measured} if measured else {})}, indent=2))
        return 0
    print(f"{cfg.name} on {n_gpus} x {hw.name}, seq {seq}, batch {batch_seqs} sequences: {lay.short()}")
    print(_predicted(compiled))
    print(f"fits: {'yes' if e.fits else 'NO'} (peak {gib(e.peak_bytes):.2f} GiB of {hw.memory_gib} GiB)")
    for rank, parts in e.memory.items():
        print(f"  memory, {rank} pipeline rank:")
        for k, v in parts.items():
            print(f"    {k:20s} {gib(v):9.3f} GiB")
    print(f"  step {e.step_time_s:.4f} s, {e.tokens_per_s_per_device:,.0f} tokens/s per {hw.unit}, "
          f"MFU {100 * e.mfu:.1f} %" + ("" if e.mfu_causal_equivalent is None else
                                        f" (causal-equivalent {100 * e.mfu_causal_equivalent:.1f} %)"))
    for line in (_attention_line(args, cfg, seq), moe_routing_line(cfg, args.moe_imbalance)):
        if line:
            print(f"  {line}")
    if hw.has_stall_data:
        print(f"  stall risk {100 * e.stall.probability:.1f} % (+{e.stall.added_s:.3f} s over {e.stall.handovers} "
              f"hand-overs): p50 step {e.step_time_at(0.5):.4f} s, p90 {e.step_time_at(0.9):.4f} s, expected "
              f"{e.expected_step_time_s:.4f} s")
    for k, v in e.time_parts.items():
        print(f"    {k:20s} {v:9.4f} s")
    if measured:
        from fivefold.tools.only_rank import print_measured

        print_measured(measured)
    return 0


def _search_layouts(args: argparse.Namespace, cfg: ModelConfig, fw: Framework, hw, space: SearchSpace, seq: int,
                    tokens: int, n_gpus: int) -> int:
    """Every layout: the best of each family as a table (or every candidate as JSON), --write-config's file."""
    batch_seqs = tokens // seq
    accelerator = not hw.is_cpu
    # the written config compiles on an accelerator (not under an attention mask: `recipes.apply_recipe`)
    compiled_for_config = (bool(args.write_config) and accelerator and not fw.compiled
                           and not cfg.masks_attention)
    if compiled_for_config:  # the written config turns torch.compile on: rank the layouts as that run will go
        from fivefold.planner.features import with_features

        fw = with_features(fw, ("compile",))
    compiled = compiled_for_config or "compile" in _features(args)
    result = search(cfg, seq, batch_seqs, n_gpus, fw, hw, space, 0, args.moe_imbalance, args.docs,
                    args.rank, announce_search())  # every one
    if not result.candidates:
        _no_candidates(result, cfg, hw, n_gpus, batch_seqs, args)
        return 2
    if args.write_config:
        best = result.candidates[0]
        write_config(args.write_config, cfg, best.layout, seq, batch_seqs, fw.compute_dtype, args.nodes,
                     hw.gpus_per_node, accelerator=accelerator,
                     prediction=f"{gib(best.peak_bytes):.1f} GiB peak per device, step {best.step_time_s:.2f} s, "
                                f"{best.tokens_per_s_per_device:,.0f} tokens/s per device, MFU {100 * best.mfu:.1f} %"
                                + (" (with torch.compile, as configured)" if compiled_for_config else ""),
                     train_tokens=parse_tokens(args.train_tokens, "--train-tokens", MAX_TRAIN_TOKENS)
                     if args.train_tokens is not None else None,
                     float8=fw.float8_linears)
    for e in result.candidates:  # the written config's header keeps fivefold's MFU (what the trainer logs)
        e.mfu *= _mfu_scale(args, cfg, seq)
    measured = None
    if args.measure:
        measured = measure(args, cfg, result.candidates[0].layout, seq, batch_seqs, fw)
    if args.json:
        print(json.dumps({"model": cfg.name, "gpus": n_gpus, "hardware": hw.name, "seq_len": seq,
                          "global_batch_tokens": tokens, "evaluated": result.evaluated,
                          "rejected": dict(result.rejected.most_common()), "compiled": compiled,
                          **_attention_json(args, cfg, seq), **moe_routing_json(cfg, args.moe_imbalance),
                          "candidates": [e.to_json() for e in result.candidates],
                          **({"measured": measured} if measured else {})}, indent=2))
        return 0
    _print_search(args, result, cfg, fw, hw, space, seq, tokens, compiled_for_config)
    if measured:
        from fivefold.tools.only_rank import print_measured

        print(f"measured, the best layout {result.candidates[0].layout.short()}:")
        print_measured(measured)
    return 0


def _print_search(args: argparse.Namespace, result, cfg: ModelConfig, fw: Framework, hw, space: SearchSpace,
                  seq: int, tokens: int, compiled_for_config: bool) -> None:
    """The search's table: the best of each family, the baselines' gaps, the rejections, what was written."""
    from fivefold.planner.explain import BASELINES, TIE, family, family_name

    batch_seqs = tokens // seq
    print(f"{cfg.name} on {args.nodes} x {hw.gpus_per_node} {hw.name}, seq {seq}, global batch {tokens:,} tokens "
          f"({batch_seqs} sequences), {fw.name} engine: {result.evaluated:,} layouts tried with "
          f"{len(space.recompute)} recompute mode(s) each, {result.evaluated * len(space.recompute):,} in all, "
          f"{len(result.candidates):,} fit")
    risk = hw.has_stall_data
    other = next(rule for rule in RANK_RULES if rule != args.rank)
    print(_ranking(args, compiled_for_config or "compile" in _features(args), compiled_for_config)
          + (f"; by the {args.rank} step time of {hw.name}'s stall model (--rank {other} for the other rule)"
             if risk else ""))
    if args.pad_vocab:
        print(f"vocabulary padded to {cfg.vocab_size:,} (a multiple of {args.pad_vocab}, --pad-vocab)")
    print(f"the best of each layout family (tp/pp/cp/ep grid, FSDP or not), best first; 'tie': within "
          f"{100 * TIE:.0f} % of the best, the model's own uncertainty")
    if getattr(args, "mfu_convention", "fivefold") != "fivefold":
        from fivefold.planner.mfu import CONVENTIONS

        print(f"MFU as {args.mfu_convention} counts it: {CONVENTIONS[args.mfu_convention]}")
    masked = _attention_line(args, cfg, seq)
    if masked:
        print(masked)
    routing = moe_routing_line(cfg, args.moe_imbalance)
    if routing:
        print(routing)
    print(f"{'layout':58s} {'family':30s} {'peak GiB':>8s} {'p50 s' if risk else 'step s':>9s} "
          f"{'tok/s/' + hw.unit:>12s} {'MFU %':>6s}" + (f" {'MFU c.e.':>8s}" if masked else "")
          + (f" {'p90 s':>9s} {'p90 tok/s':>12s} {'stall %':>7s}" if risk else ""))
    best = result.candidates[0]
    rate = lambda e: -rank_key(args.rank)(e)  # noqa: E731 - tokens/s per device at the rank rule's step time
    shown: dict = {}
    for e in result.candidates:
        if family(e) not in shown:
            shown[family(e)] = e
    rows = list(shown.values())[:max(args.top, 1)]
    for e in rows:
        tie = " (tie)" if e is not best and 1 - rate(e) / rate(best) < TIE else ""
        print(_fmt_row(e, f"{family_name(e)}{tie}", risk))
    # the baselines users start from, with their gap, when they are not shown already
    for name, test in BASELINES.items():
        base = next((e for e in result.candidates if test(e)), None)
        if base is None:
            print(f"baseline {name}: " + ("none in the --fix search" if args.fix else "no layout of that family fits"))
        elif base not in rows:
            gap = 100 * (1 - rate(base) / rate(best))
            print(f"baseline {name}: {base.layout.short()}, {base.tokens_per_s_per_device:,.0f} tokens/s per "
                  f"{hw.unit}, "
                  f"{gap:.1f} % slower than the best")
    if result.rejected:
        print("rejected:")
        for reason, n in result.rejected.most_common():
            print(f"  {n:7,d}  {reason} (e.g. {result.examples[reason]})")
    if args.write_config:
        from fivefold.train.recipes import launch_lines

        on = f" --gpu {args.gpu}" if args.gpu and not args.hardware else ""  # the device it was planned for
        print(f"wrote {args.write_config}: fill in its data.path, check it with `fivefold train --config "
              f"{args.write_config} --dry-run{on}`, then start it with:")
        for line in launch_lines(["--config", args.write_config, "--run-dir", f"runs/{cfg.name}"], args.nodes,
                                 hw.gpus_per_node):
            print(f"  {line}")
    if args.explain:
        from fivefold.planner.explain import explain

        print(explain(result, hw.memory_bytes, batch_seqs, unit=hw.unit))


def measure(args: argparse.Namespace, cfg: ModelConfig, lay: Layout, seq: int, batch_seqs: int,
            fw: Framework) -> list[dict]:
    """`--measure`: the layout's ranks that hold the most, each alone (`fivefold.tools.only_rank.measure_ranks`)."""
    from fivefold.tools.only_rank import measure_ranks

    if args.measure_steps < 1:
        raise CliError(f"--measure-steps = {args.measure_steps} must be >= 1")
    from fivefold.device import resolve_device

    # compiled on an accelerator, as `--write-config` writes it; eager on the CPU
    accelerator = resolve_device("auto").type != "cpu"
    conf, _ = train_config(cfg, lay, seq, batch_seqs, fw.compute_dtype, accelerator, float8=fw.float8_linears)
    return measure_ranks(conf, args.measure_steps, sys.stdout if not args.json else sys.stderr)


def _no_candidates(result, cfg: ModelConfig, hw, n_gpus: int, batch_seqs: int, args: argparse.Namespace) -> None:
    """Say what to change when nothing fits or nothing reaches the batch."""
    msg = [f"fivefold plan: no layout of {cfg.name} on {n_gpus} x {hw.name} works:"]
    for reason, n in result.rejected.most_common():
        msg.append(f"  {n:7,d}  {reason} (e.g. {result.examples[reason]})")
    if result.closest_misfit is not None:
        e = result.closest_misfit
        # only what the search left out can help: ZeRO-3 (with more than one GPU to shard over) and full recompute
        allow = [what for what, left_out in (
            ("ZeRO-3 (--zero)", "3" not in args.zero.split(",") and n_gpus > 1),
            ("full recompute (--recompute)", "full" not in args.recompute.split(",")),
        ) if left_out]
        msg.append(f"The smallest layout needs {gib(e.peak_bytes):.1f} GiB per {hw.unit} ({e.layout.short()}) but the "
                   f"device has {hw.memory_gib} GiB: use more nodes (--nodes), a GPU with more memory"
                   + (f", a shorter --seq-len, or allow {' and '.join(allow)}." if allow else
                      ", or a shorter --seq-len."))
    elif result.evaluated == 0 and args.fix:
        msg.append(f"No layout with --fix {args.fix} passes the rules above: change or drop a fixed value.")
    elif result.evaluated == 0:
        msg.append(f"No dp divides the global batch of {batch_seqs} sequences on {n_gpus} GPUs: choose a global "
                   f"batch that is a multiple of a power of two sequences (e.g. {max(n_gpus, batch_seqs)} x "
                   f"{args.seq_len} tokens) or another number of nodes.")
    print("\n".join(msg), file=sys.stderr)
