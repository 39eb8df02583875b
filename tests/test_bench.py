"""`fivefold bench` smoke test on CPU."""

from __future__ import annotations

import json

from fivefold.cli import main
from fivefold.flops import training_flops_per_token
from fivefold.presets import get_preset


def test_bench_cpu_json(capsys, tmp_path):
    out = tmp_path / "bench.json"
    out.write_text("my notes\n")  # a file already there is kept as bench.json.bak, not overwritten
    assert main(["bench", "--model", "tiny", "--seq-len", "64", "--micro-batch", "2", "--grad-accum", "2",
                 "--steps", "2", "--warmup", "1", "--json", "--log.peak_tflops", "0.5", "--out", str(out)]) == 0
    r = json.loads(capsys.readouterr().out)
    assert (tmp_path / "bench.json.bak").read_text() == "my notes\n" and json.loads(out.read_text()) == r
    tokens_per_step = 2 * 2 * 64
    assert r["tokens_per_s"] == r["tokens_per_s_per_device"]
    assert abs(r["tokens_per_s"] * r["step_time_s"] - tokens_per_step) < 1e-6 * tokens_per_step
    flops = training_flops_per_token(get_preset("tiny"), 64)
    assert abs(r["tflops_per_device"] - r["tokens_per_s"] * flops / 1e12) < 1e-9
    assert abs(r["mfu"] - r["tflops_per_device"] / 0.5) < 1e-9
    assert set(r["time_split_s"]) == {"forward", "backward", "optimizer"}
    assert all(v > 0 for v in r["time_split_s"].values())


def test_bench_seq_len_above_the_models_max_is_refused_as_train_refuses_it(capsys):
    """--seq-len sets train.seq_len: above model.max_seq_len it is refused by the rule `fivefold train` applies
    (`Config.validate`), not run on silently extended rotary tables; raising model.max_seq_len allows it."""
    argv = ["bench", "--model", "tiny", "--seq-len", "1024", "--steps", "1", "--warmup", "0"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "train.seq_len = 1024 exceeds model.max_seq_len = 512" in err and "raise model.max_seq_len" in err
    assert main(["train", "--train.seq_len", "1024", "--dry-run"]) == 2  # the same line from train
    assert "train.seq_len = 1024 exceeds model.max_seq_len = 512" in capsys.readouterr().err
    from argparse import Namespace

    from fivefold.tools.bench import bench_config

    args = Namespace(model="tiny", config=None, seq_len=1024, micro_batch=1, grad_accum=1, steps=1, warmup=0,
                     dtype=None, compile=False, trace=None, profile=0, out=None,
                     overrides=["--model.max_seq_len", "1024"])
    cfg = bench_config(args)
    assert cfg.train.seq_len == 1024 and cfg.model.max_seq_len == 1024


def test_bench_takes_the_config_files_model_and_batch(tmp_path, capsys):
    """A config file's `model.preset`, micro-batch and accumulation are what bench times, unless a flag names
    others: its defaults do not silently replace the file's (a file with `preset` was refused, and micro-batch 8 in
    the file ran as 1 x 1)."""
    from argparse import Namespace

    from fivefold.tools.bench import bench_config

    cfg_file = tmp_path / "c.toml"
    cfg_file.write_text('[model]\npreset = "smollm-135m"\n[train]\nglobal_batch_size = 24\n'
                        '[layout]\nmicro_batch_size = 4\n')

    def args(**flags) -> Namespace:
        base = dict(model=None, config=str(cfg_file), seq_len=64, micro_batch=None, grad_accum=None, steps=1,
                    warmup=0, dtype=None, compile=False, trace=None, profile=0, out=None, overrides=[])
        return Namespace(**{**base, **flags})

    a = args()
    cfg = bench_config(a)
    assert (cfg.model.name, a.micro_batch, a.grad_accum, cfg.train.global_batch_size) == ("smollm-135m", 4, 6, 24)
    a = args(micro_batch=2)  # a flag wins; the accumulation is then the flag's default, 1
    cfg = bench_config(a)
    assert (a.micro_batch, a.grad_accum, cfg.train.global_batch_size) == (2, 1, 2)
    a = args(model="tiny", grad_accum=3)
    cfg = bench_config(a)
    assert (cfg.model.name, a.micro_batch, a.grad_accum, cfg.train.global_batch_size) == ("tiny", 4, 3, 12)
    a = args(config=None)  # without a file: tiny, one sequence, one micro-batch, as before
    cfg = bench_config(a)
    assert (cfg.model.name, a.micro_batch, a.grad_accum) == ("tiny", 1, 1)
    # and the whole command with the file: one sequence of 64 tokens x 4 x 6 per step
    cfg_file.write_text('[model]\npreset = "tiny"\n[train]\nglobal_batch_size = 8\n[layout]\nmicro_batch_size = 4\n')
    assert main(["bench", "--config", str(cfg_file), "--seq-len", "32", "--steps", "1", "--warmup", "0",
                 "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["micro_batch_size"], r["grad_accum_steps"]) == (4, 2)
    assert abs(r["tokens_per_s"] * r["step_time_s"] - 8 * 32) < 1e-6 * 8 * 32
