"""Guards on work: every count that multiplies work is bounded by a rule the message states (or warned about with
the time it implies), and NaN and infinity are refused by every float flag of every verb."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pytest

from fivefold.cli import VERBS, main
from fivefold.config import finite_float

# (the text the one-line message must hold, argv): each exits 2 at once, before any work
GUARDED: list[tuple[str, str]] = [
    ("--nodes", "plan --nodes 100000000"),
    ("--nodes", "plan scaling --weak --nodes " + ",".join(str(2**i) for i in range(40))),
    ("--top", "plan --top 100000000"),
    ("--seq-len", "plan --seq-len 100000000000"),
    ("--pad-vocab", "plan --pad-vocab 1000000000000"),
    ("--gpus-per-node", "plan --gpus-per-node 100000"),
    ("--moe-imbalance", "plan --moe-imbalance nan"),
    ("--steps", "bench --steps 1000000000000"),
    ("--warmup", "bench --warmup 1000000000"),
    ("--profile", "bench --profile 1000000"),
    ("--max-new-tokens", "generate --checkpoint x --max-new-tokens 1000000000"),
    ("--seed", "generate --checkpoint x --seed 100000000000000000000000"),
    ("--top-p", "generate --checkpoint x --top-p nan"),
    ("--temperature", "generate --checkpoint x --temperature inf"),
    ("--timeout", "sweep grid.toml --results r.db --timeout nan"),
    ("--val-fraction", "data prepare afile --out d2 --val-fraction nan"),
    ("--threads", "calibrate --threads 100000"),
    ("train.threads", "train --train.threads 5000"),
    ("combinations", "sweep big.toml --results r.db"),
    ("grid steps", "sweep steps.toml --results r.db"),
]


@pytest.fixture()
def inputs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "afile").write_text("x")
    base = '[train]\nseq_len = 32\nglobal_batch_size = 4\ndevice = "cpu"\n'
    axis = "[" + ", ".join(str(i) for i in range(1, 101)) + "]"
    (tmp_path / "grid.toml").write_text("steps = 2\n" + base)
    (tmp_path / "big.toml").write_text(f"steps = 2\n{base}seed = {axis}\nmax_steps = {axis}\n"
                                       f"[layout]\nmicro_batch_size = {axis}\n")  # 10^6 combinations
    (tmp_path / "steps.toml").write_text("steps = 1000000000\n" + base)
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize(("field", "argv"), GUARDED, ids=[a[:60] for _, a in GUARDED])
def test_work_is_bounded(field: str, argv: str, inputs: Path, capsys: pytest.CaptureFixture) -> None:
    before = sorted(p.name for p in inputs.iterdir())
    start = time.perf_counter()
    try:
        code = main(argv.split())
    except SystemExit as e:  # argparse's refusals
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err and field in err, err
    assert time.perf_counter() - start < 20  # at once, not after expanding or searching
    assert sorted(p.name for p in inputs.iterdir()) == before


def float_flags(parser: argparse.ArgumentParser, verb: str) -> list[tuple[str, str]]:
    out = []
    for action in parser._actions:  # noqa: SLF001 (argparse offers no public list of a parser's arguments)
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            for name, sub in action.choices.items():
                out += float_flags(sub, f"{verb} {name}")
        elif action.type is float or action.type is finite_float:
            out.append((verb, action.option_strings[0]))
    return out


def test_every_float_flag_of_every_verb_refuses_nan_and_inf() -> None:
    import importlib

    found = []
    for verb, (module, _) in VERBS.items():
        parser = argparse.ArgumentParser()
        importlib.import_module(module).add_arguments(parser)
        found += float_flags(parser, verb)
    assert len(found) >= 5
    assert all(verb and flag for verb, flag in found)
    for verb, flag in found:
        parser = argparse.ArgumentParser()
        importlib.import_module(VERBS[verb.split()[0]][0]).add_arguments(parser)
        action = next(a for a in _all_actions(parser) if flag in a.option_strings)
        assert action.type is finite_float, f"{verb} {flag} takes a plain float"
        for bad in ("nan", "inf", "-inf"):
            with pytest.raises(argparse.ArgumentTypeError, match="finite"):
                action.type(bad)


def _all_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    out = []
    for action in parser._actions:  # noqa: SLF001
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            for sub in action.choices.values():
                out += _all_actions(sub)
        else:
            out.append(action)
    return out
