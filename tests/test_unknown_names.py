"""An unknown name (a config field, a preset, a device, a hardware or framework field, a plan key, a feature, a grid
key) is refused naming it, the names it could be and, when one is close (a typo, a field of another section), that
one: `(did you mean 'train.lr'?)`."""

from __future__ import annotations

from pathlib import Path

import pytest

from fivefold.cli import main
from fivefold.config import ConfigError, build_config, did_you_mean


@pytest.mark.parametrize(("overrides", "hint"), [
    ({"train.lrr": "1"}, "'train.lr'"),
    ({"trian.lr": "1"}, "'train'"),
    ({"lr": "1"}, "'train.lr'"),  # a field of a section given at the top level
    ({"train.hidden": "64"}, "'model.hidden'"),  # a field of another section
    ({"model.layers": "2"}, "'model.n_layers'"),
    ({"model.preset": "llama-3-8b"}, "'llama3-8b'"),
])
def test_a_config_field_or_preset_close_to_a_known_one_is_named(overrides, hint):
    with pytest.raises(ConfigError, match=rf"\(did you mean {hint}\?\)"):
        build_config(None, overrides)


def test_nothing_close_adds_no_hint():
    assert did_you_mean("bogus", ["lr", "seed"]) == ""
    with pytest.raises(ConfigError) as e:
        build_config(None, {"train.bogus": "1"})
    assert "did you mean" not in str(e.value) and "known fields here: async_checkpoint" in str(e.value)


@pytest.mark.parametrize(("files", "argv", "hint"), [
    ({}, "plan --gpu h1000", "'h100'"),
    ({"hw.toml": "bf16_tflop = 3\n"}, "plan --hardware hw.toml", "'bf16_tflops'"),
    ({"hw.toml": 'base = "h10"\n'}, "plan --hardware hw.toml", "'h100'"),
    ({"hw.toml": '[framework]\nname = "fivefold"\ntp_overlaps = 0.5\n'}, "plan --hardware hw.toml",
     "'tp_overlap'"),
    ({}, "plan --layout dp=1,tpp=1", "'tp'"),
    ({}, "plan --fix mb=2", "'mbs'"),
    ({}, "plan --model layer=2,hidden=64,heads=4,ffn=128,vocab=100", "'layers'"),
    ({}, "plan --features compil", "'compile'"),
    ({"g.toml": "stepz = 2\n[train]\nseq_len = 32\n"}, "sweep g.toml --results r.db --dry-run", "'steps'"),
    ({"g.toml": "[train]\nseq_len = 32\n[[grid]]\ndevics = 1\n"}, "sweep g.toml --results r.db --dry-run",
     "'devices'"),
    ({}, "train --dry-run --train.lrr 1", "'train.lr'"),
])
def test_the_command_line_names_the_close_one(files, argv, hint, tmp_path: Path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    assert main(argv.split()) == 2
    err = capsys.readouterr().err
    assert f"(did you mean {hint}?)" in err and "Traceback" not in err, err
