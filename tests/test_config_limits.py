"""Config files that try to exhaust the machine: a YAML alias bomb, configs nested 100,000 deep in YAML, TOML and
JSON, an oversized file, a recursive YAML alias; and error messages that print a bounded repr of a huge value."""

from __future__ import annotations

import time
import tracemalloc

import pytest

from fivefold.cli import main
from fivefold.config import CONFIG_MAX_BYTES, SHOWN_CHARS, ConfigError, build_config, load_file, shown
from fivefold.train.metrics import peak_resident_bytes, reset_peak_resident


def alias_bomb(levels: int = 9) -> str:
    """The "billion laughs" of YAML inside one field: each level lists the previous one 9 times, 9**levels strings
    in all, and the field's error message would print the whole value."""
    names = "abcdefghijklmnop"
    lines = ["train:", "  lr:", f"    - &{names[0]} [" + ", ".join(['"lol"'] * 9) + "]"]
    for prev, name in zip(names, names[1:levels], strict=False):
        lines.append(f"    - &{name} [" + ", ".join([f"*{prev}"] * 9) + "]")
    return "\n".join(lines) + "\n"


def test_yaml_alias_bomb_is_refused_quickly_and_in_little_memory(tmp_path):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(alias_bomb())
    assert len(bomb.read_bytes()) < 1024
    small = tmp_path / "small.yaml"
    small.write_text("train: {lr: 0.001}\n")
    build_config(small)  # the first YAML read imports PyYAML: not the bomb's cost
    reset_peak_resident()  # the peak from here: an earlier test's would hide the bomb's growth
    rss_before = peak_resident_bytes()
    tracemalloc.start()
    start = time.perf_counter()
    with pytest.raises(ConfigError, match=r"expands to more than 100,000 values once its YAML aliases"):
        build_config(bomb)
    seconds = time.perf_counter() - start
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    grown_kib = (peak_resident_bytes() - rss_before) // 1024
    assert seconds < 1.0, seconds
    assert peak < 100 * 2**20, peak
    assert grown_kib < 100 * 1024, grown_kib


def test_alias_bomb_through_the_command_line_is_one_line(tmp_path, capsys):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(alias_bomb())
    assert main(["train", "--config", str(bomb), "--dry-run", "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "YAML aliases" in err and len(err) < 1000
    assert not (tmp_path / "run").exists()


def test_small_alias_use_still_loads(tmp_path):
    f = tmp_path / "ok.yaml"
    f.write_text("common: &c {lr: 0.001, max_steps: 3}\ntrain: *c\n")
    assert load_file(f)["train"] == {"lr": 0.001, "max_steps": 3}


@pytest.mark.parametrize("suffix, text", [
    (".yaml", "model: " + "[" * 100_000 + "]" * 100_000),
    (".yaml", "model:\n" + "".join(" " * i + f"k{i}:\n" for i in range(1, 1000))),
    (".json", '{"model": ' + "[" * 100_000 + "]" * 100_000 + "}"),
    (".toml", "model = " + "[" * 100_000 + "]" * 100_000),
    (".toml", "x = " + "{a = " * 20_000 + "1" + "}" * 20_000),
])
def test_deep_nesting_is_refused_without_recursion_error(tmp_path, suffix, text):
    f = tmp_path / f"deep{suffix}"
    f.write_text(text)
    with pytest.raises(ConfigError, match=r"nested deeper than 16 levels"):
        load_file(f)


def test_recursive_alias_and_oversized_file_are_refused(tmp_path):
    rec = tmp_path / "rec.yaml"
    rec.write_text("train: &t {lr: [*t]}\n")
    with pytest.raises(ConfigError, match="recursive"):
        load_file(rec)
    big = tmp_path / "big.toml"
    big.write_text("# " + "x" * CONFIG_MAX_BYTES + "\n")
    with pytest.raises(ConfigError, match=r"may hold at most 1,048,576 bytes"):
        load_file(big)


def test_error_messages_print_a_bounded_value(tmp_path):
    huge = "x" * 10_000_000
    assert len(shown(huge)) <= SHOWN_CHARS
    nested: list = []
    for _ in range(10_000):
        nested = [nested, nested]  # 2**10000 leaves if expanded
    assert len(shown(nested)) <= SHOWN_CHARS
    f = tmp_path / "c.json"
    f.write_text('{"train": {"lr": "' + "9" * 500_000 + 'x"}}')
    with pytest.raises(ConfigError) as e:
        build_config(f)
    assert "train.lr" in str(e.value) and len(str(e.value)) < 400
