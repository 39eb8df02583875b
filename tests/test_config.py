"""Config loading, overrides, serialisation and validation errors."""

from __future__ import annotations

import re

import pytest

from fivefold.config import Config, ConfigError, build_config, dump_toml, parse_overrides, parse_text
from fivefold.train.optim import lr_at


def test_file_then_overrides(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('run_dir = "x"\n[train]\nlr = 0.01\nmax_steps = 50\n[layout]\ndp = 2\n')
    cfg = build_config(f, {"train.lr": "2e-3", "model.preset": "smollm-135m", "log.tensorboard": "true"})
    assert cfg.train.lr == 2e-3 and cfg.train.max_steps == 50 and cfg.layout.dp == 2 and cfg.run_dir == "x"
    assert cfg.model.name == "smollm-135m" and cfg.model.n_layers == 30 and cfg.log.tensorboard is True


def test_yaml_and_preset_in_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("model:\n  preset: llama-3.2-1b\n  n_layers: 2\ntrain:\n  seq_len: 64\n")
    cfg = build_config(f)
    assert cfg.model.hidden == 2048 and cfg.model.n_layers == 2 and cfg.train.seq_len == 64
    assert cfg.model.rope_scaling["factor"] == 32.0
    # a preset on the command line replaces the file's; the file's other model fields still apply
    cfg = build_config(f, {"model.preset": "smollm-135m"})
    assert cfg.model.hidden == 576 and cfg.model.n_layers == 2


def test_toml_round_trip(tmp_path):
    cfg = build_config(None, {"model.preset": "llama-3.1-8b", "layout.recompute": "full", "train.lr": "1e-4"})
    f = tmp_path / "out.toml"
    f.write_text(dump_toml(cfg))
    again = build_config(f)
    assert again.to_dict() == cfg.to_dict()


def test_parse_overrides_forms():
    assert parse_overrides(["--layout.dp", "2", "--train.lr=1e-3"]) == {"layout.dp": "2", "train.lr": "1e-3"}
    with pytest.raises(ConfigError, match="--section.field"):
        parse_overrides(["--bogus", "1"])
    with pytest.raises(ConfigError, match="needs a value"):
        parse_overrides(["--layout.dp"])


@pytest.mark.parametrize(
    "overrides, pattern",
    [
        ({"train.lr": "-1"}, r"train\.lr = -1\.0 must be > 0"),
        ({"train.lr": "fast"}, r"train\.lr = 'fast' is not a number"),
        ({"layout.dp": "1.5"}, r"layout\.dp = '1\.5' is not an integer"),
        ({"layout.recompute": "some"}, r"layout\.recompute = 'some' is not one of"),
        ({"train.bogus": "1"}, r"unknown config field 'train\.bogus'"),
        ({"model.n_heads": "3"}, r"model\.n_heads = 3 does not divide model\.hidden = 128.*\[1, 2, 4, 8"),
        ({"model.n_kv_heads": "3"}, r"model\.n_kv_heads = 3 does not divide model\.n_heads = 4.*\[1, 2, 4\]"),
        ({"train.seq_len": "4096"}, r"train\.seq_len = 4096 exceeds model\.max_seq_len = 512"),
        ({"train.global_batch_size": "30", "layout.dp": "4"}, r"not divisible by layout\.dp = 4.*\[28, 32\]"),
        ({"layout.micro_batch_size": "5"}, r"layout\.micro_batch_size = 5 does not divide.*32"),
        ({"model.preset": "gpt-5"}, r"model\.preset = 'gpt-5' is not a preset; choose one of: tiny"),
        ({"train.warmup_steps": "-1"}, r"train\.warmup_steps = -1 must be >= 0"),
        ({"data.val_fraction": "0.7"}, r"data\.val_fraction = 0\.7 must be in \(0, 0\.5\]"),
        ({"model.n_experts": "4", "model.top_k": "5"}, r"model\.top_k = 5 must be between 1 and n_experts = 4"),
    ],
)
def test_bad_values_name_field_and_rule(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern):
        build_config(None, overrides).validate()


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        build_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nlr = 1")
    with pytest.raises(ConfigError, match="bad.toml' is not valid"):
        build_config(bad)
    ini = tmp_path / "c.ini"
    ini.write_text("x")
    with pytest.raises(ConfigError, match="must end in .toml"):
        build_config(ini)


@pytest.mark.parametrize(("text", "said"), [
    ('[train]\nmax_steps = "2"\n', "train.max_steps = '2' is a quoted string, not an integer"),
    ('[train]\ncompile = "yes"\n', "train.compile = 'yes' is a quoted string, not a boolean"),
    ('[layout]\nstage_layers = [3, "1"]\n', "layout.stage_layers[1] = '1' is a quoted string, not an integer"),
    ('[model]\nsliding_window = "16"\n', "model.sliding_window = '16' is a quoted string, not an integer"),
])
def test_a_file_gives_integers_and_booleans_unquoted(tmp_path, text, said):
    """In a file the type is written: a quoted "2" for an integer field or "yes" for a boolean is refused, naming the
    field, the value and the type; the command line's overrides are strings and keep being parsed."""
    f = tmp_path / "c.toml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(said)):
        build_config(f)
    y = tmp_path / "c.yaml"
    y.write_text("train:\n  max_steps: '2'\n")
    with pytest.raises(ConfigError, match=re.escape("train.max_steps = '2' is a quoted string, not an integer")):
        build_config(y)
    cfg = build_config(None, {"train.max_steps": "2", "train.compile": "yes", "layout.stage_layers": "3,1"})
    assert cfg.train.max_steps == 2 and cfg.train.compile is True and cfg.layout.stage_layers == [3, 1]
    f.write_text('[train]\nmax_steps = 2\ncompile = true\nlr = "1e-3"\n[model]\nsliding_window = "null"\n')
    cfg = build_config(f)  # typed values; a float may be a string (YAML reads 1e-3 so); "null" stays TOML's null
    assert cfg.train.max_steps == 2 and cfg.train.compile is True and cfg.train.lr == 1e-3
    assert cfg.model.sliding_window is None


def test_lr_schedules_closed_form():
    t = Config().train
    t.lr, t.min_lr_ratio, t.warmup_steps, t.max_steps = 1.0, 0.1, 10, 110
    assert lr_at(0, t) == pytest.approx(0.1) and lr_at(9, t) == pytest.approx(1.0)
    assert lr_at(60, t) == pytest.approx(0.1 + 0.9 * 0.5)  # half-way through the cosine
    assert lr_at(110, t) == pytest.approx(0.1)
    t.lr_schedule, t.wsd_decay_fraction = "wsd", 0.2
    assert lr_at(50, t) == 1.0 and lr_at(90, t) == 1.0  # stable until 80 % of the post-warmup steps
    assert lr_at(100, t) == pytest.approx(1.0 - 0.9 * 0.5) and lr_at(110, t) == pytest.approx(0.1)


def test_list_fields_from_the_command_line_and_files(tmp_path):
    cfg = build_config(None, {"layout.stage_layers": "3, 1"})
    assert cfg.layout.stage_layers == [3, 1]
    path = tmp_path / "c.toml"
    path.write_text(dump_toml(cfg))
    assert "stage_layers = [3, 1]" in path.read_text()
    assert build_config(path).layout.stage_layers == [3, 1]
    assert build_config(None).layout.stage_layers == []
    with pytest.raises(ConfigError, match=r"layout\.stage_layers\[1\] = 'x' is not an integer"):
        build_config(None, {"layout.stage_layers": "3,x"})


def test_an_optional_field_reads_null_and_survives_toml_which_has_no_null(tmp_path):
    assert build_config(None, {"model.sliding_window": "16"}).model.sliding_window == 16
    for none in ("null", "None"):
        assert build_config(None, {"model.sliding_window": none}).model.sliding_window is None
    for window in (None, 16):
        cfg = build_config(None, {"model.sliding_window": str(window)})
        path = tmp_path / f"{window}.toml"
        path.write_text(dump_toml(cfg))
        assert ("sliding_window" in path.read_text()) == (window is not None)
        assert build_config(path).model.sliding_window == window


def test_a_run_saved_when_a_window_of_0_meant_none_resumes_without_one(tmp_path):
    from fivefold.train.loop import load_run_config

    cfg = build_config(None, {"model.sliding_window": "16"})
    (tmp_path / "config.toml").write_text(dump_toml(cfg).replace("sliding_window = 16", "sliding_window = 0"))
    (tmp_path / "tokenizer").mkdir()  # written with config.toml by every run that fivefold started
    resumed = load_run_config(tmp_path, {}, None)
    assert resumed.model.sliding_window is None
    resumed.validate()


@pytest.mark.parametrize(("text", "said"), [
    ("[train]\nlr = true\n", "train.lr = True is a boolean, not a number"),
    ("[model.rope_scaling]\nfactor = true\nlow_freq_factor = 1\nhigh_freq_factor = 4\n"
     "original_max_position_embeddings = 8192\n", "model.rope_scaling.factor = True is a boolean, not a number"),
    ("[model]\nname = [1, 2]\n", "model.name = [1, 2] is a list, not a string"),
    ("[data]\npath = 5\n", "data.path = 5 is a number, not a string"),
    ("run_dir = 7\n", "run_dir = 7 is a number, not a string"),
    ("[train]\ndevice = 0\n", "train.device = 0 is a number, not a string"),
    ("[log]\nwandb_project = {a = 1}\n", "log.wandb_project = {'a': 1} is a table, not a string"),
])
def test_a_file_value_of_another_type_is_refused_not_converted(tmp_path, text, said):
    """A boolean is not a number (float(True) would train at lr 1.0) and only text is a string (str() would make a
    list a model name, a number a data path): refused naming the field, the value and the type."""
    f = tmp_path / "c.toml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(said)):
        build_config(f)
    f.write_text('[train]\nlr = 1\ndevice = "cpu"\n[data]\npath = "d"\n[model]\nname = "m"\n')
    cfg = build_config(f)  # an integer for a float field, text for the strings: as before
    assert (cfg.train.lr, cfg.train.device, cfg.data.path, cfg.model.name) == (1.0, "cpu", "d", "m")


@pytest.mark.parametrize(("name", "text", "said"), [
    ("c.yaml", "train:\n  lr: 0.1\n  lr: 0.2\n", "gives 'lr' twice in one mapping (lines 2 and 3)"),
    ("c.yaml", "train:\n  lr: 0.1\ntrain:\n  max_steps: 3\n", "gives 'train' twice in one mapping (lines 1 and 3)"),
    ("c.json", '{"train": {"lr": 0.1, "lr": 0.2}}', "gives 'lr' twice in one object"),
])
def test_a_key_given_twice_is_refused_not_read_as_the_last(tmp_path, name, text, said):
    """YAML and JSON keep the last of a key given twice: a second `train:` section silently dropped the first's
    train.lr. TOML refuses it itself; so do YAML and JSON config files now."""
    f = tmp_path / name
    f.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(said)):
        build_config(f)
    f.write_text("train:\n  lr: 0.1\n  max_steps: 3\n" if name.endswith(".yaml")
                 else '{"train": {"lr": 0.1, "max_steps": 3}}')
    cfg = build_config(f)  # distinct keys read as before
    assert (cfg.train.lr, cfg.train.max_steps) == (0.1, 3)
    merged = parse_text("a: &x {k: 1}\nb:\n  <<: *x\n  j: 2\n", ".yaml", "t")  # a merge key (<<) is no repeat
    assert merged == {"a": {"k": 1}, "b": {"k": 1, "j": 2}}
