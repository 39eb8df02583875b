"""The layer rule of the package, checked on the source: every import (at module level, inside a function or
under TYPE_CHECKING) points down the layer order or stays inside its own part, and no two parts import each
other. `LAYERS` below is the one statement of the rule; docs/architecture.md explains it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

# Bottom to top: (layer, the modules or packages in it, what it may import besides its own layer).
# Above the base modules every entry is a folder (a package), so the tree shows the layers; a module belongs to the
# entry with the longest matching name; `None` means every layer below. Each entry is one part (a tuple: names that
# form one part): parts of one layer may import each other in one direction only.
LAYERS: list[tuple[str, list[str | tuple[str, ...]], list[str] | None]] = [
    # config (with the preset table it resolves `model.preset` from, the layout rule book whose batch rule
    # `Config.validate` applies, and the FLOPs formulas by which the rule book balances pipeline stages) and the
    # user-error types, device helpers, the accelerator table, the fault helpers (watchdog, parent-death signal)
    # and the checkpoint file format (the trainer writes it, export and generate read it), the confinement of file
    # names a directory's own index holds (checkpoints, prepared data), the files written for the user (kept as .bak)
    ("base", ["fivefold", ("fivefold.config", "fivefold.presets", "fivefold.layout", "fivefold.flops"),
              "fivefold.errors", "fivefold.device", "fivefold.accelerators", "fivefold.faults",
              "fivefold.checkpoint_format", "fivefold.pathnames", "fivefold.outputs"], None),
    # tokenizers, shards, the dataset and sampler: no model code
    ("data", ["fivefold.data"], None),
    # plain PyTorch Llama (dense and MoE), presets, Hugging Face conversion (with the tokenizer files), the fused
    # chunked loss, sampling
    ("models", ["fivefold.models"], None),
    # mechanisms only: the process grid, the wrappers, communication, pipeline schedules and executor
    ("parallel", ["fivefold.parallel"], None),
    # starting and joining processes: local launcher, SLURM script, the layout check before any process
    ("launch", ["fivefold.launch"], None),
    # the engines (one base, one step), the loop, optimizer, checkpoints, metrics
    ("train", ["fivefold.train"], None),
    # the planner models the engines, it does not call them: it reads only these lower parts
    ("planner", ["fivefold.planner"], ["base", "models", "fivefold.parallel.schedules"]),
    # tools that run or score the trainer: sweeps and their report, bench, calibrate (it times the training step,
    # so it sits above train and the planner it writes profiles for), the planner's validation against measured
    # runs, one rank alone beside the planner's prediction for it (`train --only-rank`)
    ("tools", ["fivefold.sweep", "fivefold.tools"], None),
    # the command line: `fivefold VERB`; `plan` also runs the planner's validation, `train --dry-run` the planner
    ("cli", ["fivefold.cli", "fivefold.__main__"], None),
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted((SRC / "fivefold").rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The fivefold modules that `path` imports anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "fivefold"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if base.split(".")[0] != "fivefold":
                continue
            for a in node.names:  # `from fivefold.train import checkpoint` imports the submodule
                out.add(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base)
    return out


def part_of(module: str) -> tuple[int, str]:
    """(layer index, part name) of a module: the entry with the longest matching name."""
    best: tuple[int, str] | None = None
    best_length = 0
    for index, (_, entries, _) in enumerate(LAYERS):
        for entry in entries:
            for name in (entry,) if isinstance(entry, str) else entry:
                exact_only = name == "fivefold"  # the root package's own module, not everything below it
                if (module == name or (not exact_only and module.startswith(name + "."))) and len(name) > best_length:
                    best, best_length = (index, entry if isinstance(entry, str) else " + ".join(entry)), len(name)
    if best is None:
        raise AssertionError(f"{module} is in no layer of tests/test_architecture.py LAYERS; place it there")
    return best


def allowed(src: str, dst: str) -> bool:
    (src_layer, src_part), (dst_layer, dst_part) = part_of(src), part_of(dst)
    if src_part == dst_part or dst_layer == src_layer:
        return True
    if dst_layer > src_layer:
        return False
    reads = LAYERS[src_layer][2]
    if reads is None:
        return True
    dst_layer_name = LAYERS[dst_layer][0]
    return dst_layer_name in reads or any(dst == r or dst.startswith(r + ".") for r in reads)


def violations(edges: dict[str, set[str]]) -> list[str]:
    """Every import that points up or outside what its layer may read, and every pair of parts that import each
    other (directly or through a longer cycle)."""
    out = [f"{src} imports {dst}: {LAYERS[part_of(src)[0]][0]} may not import {LAYERS[part_of(dst)[0]][0]}"
           for src, dsts in sorted(edges.items()) for dst in sorted(dsts) if not allowed(src, dst)]
    graph: dict[str, set[str]] = {}
    for src, dsts in edges.items():
        for dst in dsts:
            a, b = part_of(src)[1], part_of(dst)[1]
            if a != b:
                graph.setdefault(a, set()).add(b)

    def reaches(a: str, b: str) -> bool:
        seen, todo = set(), [a]
        while todo:
            node = todo.pop()
            if node == b:
                return True
            if node not in seen:
                seen.add(node)
                todo.extend(graph.get(node, ()))
        return False

    parts = sorted(graph)
    out += [f"{a} and {b} import each other" for i, a in enumerate(parts) for b in parts[i + 1:]
            if reaches(a, b) and reaches(b, a)]
    return out


def import_graph() -> dict[str, set[str]]:
    modules = source_modules()
    known = set(modules)
    return {name: imports_of(name, path, known) - {name} for name, path in modules.items()}


def test_every_module_has_a_layer():
    for name in source_modules():
        part_of(name)


def test_layers_above_the_base_are_folders():
    """Above the base modules each layer is a list of folders: the tree itself shows the layers, and a module's
    folder says which layer it is in (the verb modules of data, models and sweep stay in their packages)."""
    for _, entries, _ in LAYERS[1:]:
        for entry in entries:
            for name in (entry if isinstance(entry, tuple) else (entry,)):
                if name != "fivefold.__main__":
                    assert (SRC / name.replace(".", "/")).is_dir(), f"{name} is not a folder"


def test_imports_point_down_and_parts_do_not_import_each_other():
    assert violations(import_graph()) == []


def test_parallel_imports_neither_train_nor_planner():
    for src, dsts in import_graph().items():
        if src.startswith("fivefold.parallel"):
            assert not [d for d in dsts if d.startswith(("fivefold.train", "fivefold.planner"))], src


def test_nothing_below_the_command_line_imports_it():
    for src, dsts in import_graph().items():
        if part_of(src)[0] < len(LAYERS) - 1:
            assert "fivefold.cli" not in dsts, src


@pytest.mark.parametrize("edges, expected", [
    ({"fivefold.parallel.data": {"fivefold.train.engine"}}, "parallel may not import train"),
    ({"fivefold.models.llama": {"fivefold.cli"}}, "models may not import cli"),
    ({"fivefold.planner.time": {"fivefold.train.engine"}}, "planner may not import train"),
    ({"fivefold.planner.memory": {"fivefold.parallel.mesh"}}, "planner may not import parallel"),
    ({"fivefold.sweep.grid": {"fivefold.tools.bench"}, "fivefold.tools.bench": {"fivefold.sweep.store"}},
     "fivefold.sweep and fivefold.tools import each other"),
    ({"fivefold.train.loop": {"fivefold.planner.predict"}}, "train may not import planner"),
    ({"fivefold.planner.search": {"fivefold.tools.validate"}}, "planner may not import tools"),
])
def test_the_checker_finds_a_violation(edges, expected):
    """The rule above catches an upward import, a read outside the planner's list and two parts in a cycle."""
    assert any(expected in v for v in violations(edges)), violations(edges)


def _torch_modules_after(code: str) -> str:
    """The torch modules in `sys.modules` after `code` ran in a fresh interpreter (in one process: no search pool),
    as the last line it prints."""
    import subprocess
    import sys

    code = ("import os, sys\n"
            "os.environ['FIVEFOLD_PLAN_WORKERS'] = '1'\n"
            f"{code}\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout.strip().splitlines()[-1]


def test_the_planner_searches_without_importing_torch():
    """The planner's search (and so each process of its pool, `planner.search.SearchPool`) imports and runs without
    torch: a constant it shares with the engine lives in a torch-free module (`layout.LOSS_CHUNK_TOKENS`)."""
    assert _torch_modules_after(
        "from fivefold.planner.hardware import get_cluster\n"
        "from fivefold.planner.layout import FIVEFOLD\n"
        "from fivefold.planner.search import search\n"
        "from fivefold.presets import get_preset\n"
        "r = search(get_preset('llama3-8b'), 4096, 16, 8, FIVEFOLD, get_cluster('h100'), None, 3)\n"
        "assert r.candidates") == "[]"


@pytest.mark.parametrize("config", [
    {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
     "intermediate_size": 128, "vocab_size": 300},
    {"architectures": ["GPT2LMHeadModel"], "n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 300},
], ids=["llama", "gpt2"])
def test_the_planner_reads_a_hugging_face_config_without_importing_torch(tmp_path: Path, config: dict):
    """`fivefold plan --model config.json` reads the config (`models.hf_config`, and `planner.shapes` for the GELU
    shapes) and plans without torch, as a preset does: the engine's `models.hf` (weights, torch) is not imported."""
    import json

    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    argv = ["plan", "--model", str(path), "--gpu", "cpu", "--seq-len", "128", "--global-batch", "8K", "--top", "1"]
    assert _torch_modules_after("from fivefold.cli import main\n"
                                f"assert main({argv!r}) == 0\n"
                                "assert 'fivefold.models.hf' not in sys.modules") == "[]"
