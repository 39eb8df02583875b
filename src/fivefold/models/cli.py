"""`fivefold models`: the model presets with their shapes and parameter counts (closed form)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from fivefold.flops import active_matmul_params, count_params
from fivefold.presets import PRESETS, aliases_of


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the presets as a JSON list")


def human_count(n: int | None) -> str:
    """1_235_814_400 -> '1.236B'; None -> '-'."""
    if n is None:
        return "-"
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.4g}{suffix}"
    return str(n)


def preset_rows() -> list[dict[str, Any]]:
    """One dict per preset: its shape, closed-form parameter counts, published size and note."""
    rows = []  # "ffn" is the per-expert hidden size for MoE presets
    for name, (cfg, published, note) in PRESETS.items():
        rows.append({
            "name": name, "n_layers": cfg.n_layers, "hidden": cfg.hidden, "n_heads": cfg.n_heads,
            "n_kv_heads": cfg.n_kv_heads, "ffn": cfg.expert_ffn if cfg.is_moe else cfg.ffn,
            "vocab_size": cfg.vocab_size, "max_seq_len": cfg.max_seq_len,
            "tied_embeddings": cfg.tied_embeddings,
            "n_experts": cfg.n_experts, "top_k": cfg.top_k if cfg.is_moe else 0,
            "n_shared_experts": cfg.n_shared_experts if cfg.is_moe else 0,
            "params": count_params(cfg), "active_matmul_params": active_matmul_params(cfg),
            "published_params": published, "note": note, "aliases": aliases_of(name),
        })
    return rows


def _experts_cell(row: dict[str, Any]) -> str:
    if not row["n_experts"]:
        return "-"
    shared = f"+{row['n_shared_experts']}sh" if row["n_shared_experts"] else ""
    return f"{row['n_experts']}x top{row['top_k']}{shared}"


def format_table(rows: list[dict[str, Any]]) -> str:
    header = ["name", "layers", "hidden", "heads/kv", "ffn", "vocab", "tied", "experts", "params",
              "published", "note"]
    cells = [[r["name"], str(r["n_layers"]), str(r["hidden"]), f"{r['n_heads']}/{r['n_kv_heads']}",
              str(r["ffn"]), str(r["vocab_size"]), "yes" if r["tied_embeddings"] else "no", _experts_cell(r),
              human_count(r["params"]), human_count(r["published_params"]), r["note"]] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(header)]
    numeric = {1, 2, 4, 5, 8, 9}

    def line(values: list[str]) -> str:
        padded = enumerate(zip(values, widths, strict=True))
        return "  ".join(v.rjust(w) if i in numeric else v.ljust(w) for i, (v, w) in padded).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths]), *(line(c) for c in cells)])


def run(args: argparse.Namespace) -> int:
    rows = preset_rows()
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(format_table(rows))
        print("\nparams: total parameters (tied weights once); published: the released model's count.")
        named = [r for r in rows if r["aliases"]]
        if named:
            print("aliases (accepted wherever a preset is named): " + "; ".join(
                f"{', '.join(r['aliases'])} = {r['name']}" for r in named))
        print("Use a preset with `fivefold train --preset NAME` (or an alias).")
    return 0
