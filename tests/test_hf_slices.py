"""Starting from Hugging Face weights by slices (`--hf`, `models.hf.HfSliceReader`), checked against `transformers` and
the whole-file import: a Llama, a Mixtral and a Qwen2 (q/k/v biases); under tp2 x pp2 every rank reads exactly the
bytes of the rectangles it holds (counted), never gathers the model to check shapes, and holds the same weights and
computes the same loss as one process started from the same directory and as `transformers` itself; any rectangle of
a Mixtral expert tensor read alone equals that rectangle of the whole-file import.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tests.distributed import run_ranks

from fivefold.config import Config, build_config
from fivefold.models.hf import CheckpointError, HfSliceReader, load_hf, model_config_from_hf

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, ROWS = 96, 16, 4
REL = 1e-5  # fp32 on both sides; the sums differ only in order (tp all-reduces, the pipeline's loss)


CLASSES = {"llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def save_transformers(path: Path, kind: str) -> Path:
    """A random Llama (untied, GQA, in several safetensors files), Mixtral or Qwen2 written by `transformers`, its
    norms (and Qwen2's q/k/v biases) random too so that a misplaced tensor shows."""
    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False)
    torch.manual_seed(11)
    if kind == "mixtral":
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, **common))
    elif kind == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(intermediate_size=96, **common))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(intermediate_size=96, **common))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "proj.bias")):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(str(path), max_shard_size="100KB")
    return path


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=torch.Generator().manual_seed(3))
    return tokens[:, :-1], tokens[:, 1:]


def transformers_loss(hf_dir: Path, kind: str) -> float:
    cls = getattr(transformers, CLASSES[kind])
    model = cls.from_pretrained(str(hf_dir), attn_implementation="eager").float().eval()
    inputs, targets = batch()
    with torch.no_grad():
        logits = model(inputs).logits.float()
    return float(torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1)))


def run_config(hf_dir: Path, layout: dict[str, str]) -> Config:
    cfg = build_config(None, {"train.seq_len": str(SEQ), "train.global_batch_size": str(ROWS), "train.dtype": "fp32",
                              "train.device": "cpu", "layout.micro_batch_size": "2", **layout})
    cfg.model = model_config_from_hf(hf_dir)
    cfg.validate()
    return cfg


def start_from_hf(rank: int, world_size: int, hf_dirs: list[Path], layout: dict[str, str]) -> list[dict]:
    """For each directory: build the engine of `layout`, start it from the directory with the model's gather made to
    fail (the shapes must be checked without it), and return the bytes read, the bytes this rank's parameters hold,
    the loss of one batch and (on rank 0) the whole model state."""
    from fivefold.train.build import build_engine
    from fivefold.train.engine import Engine
    from fivefold.train.loop import evaluate, init_from_hf

    results = []
    for hf_dir in hf_dirs:
        cfg = run_config(hf_dir, layout)
        engine = build_engine(cfg, torch.device("cpu"))
        gather = Engine.full_model_state

        def refuse(self):
            raise AssertionError("the --hf start gathered the model")

        Engine.full_model_state = refuse
        try:
            read = init_from_hf(engine, hf_dir)
        finally:
            Engine.full_model_state = gather
        held = sum(p.numel() * 4 for _, p in engine.named_plain_parameters())  # the files hold fp32
        loss = evaluate(engine, [batch()], cfg.micro_batch_size)
        state = engine.model_state()
        results.append({"read": read, "held": held, "loss": loss, "state": state if rank == 0 else None})
    return results


def test_tp2_pp2_ranks_read_only_their_rectangles_and_match_one_process(tmp_path: Path) -> None:
    """A Llama, a Mixtral (its experts tp-sharded: rectangles of transposed per-expert tensors) and a Qwen2 (its q/k/v
    biases tp-sharded with their weights' rows)."""
    hf_dirs = [save_transformers(tmp_path / kind, kind) for kind in CLASSES]
    one = start_from_hf(0, 1, hf_dirs, {})
    four = run_ranks(4, start_from_hf, hf_dirs, {"layout.tp": "2", "layout.pp": "2"})
    for case, hf_dir in enumerate(hf_dirs):
        assert len(list(hf_dir.glob("model-*.safetensors"))) > 1  # a sharded directory: rectangles across files
        _, reference = load_hf(hf_dir)
        whole_bytes = sum(v.numel() * 4 for v in reference.values())
        expected_loss = transformers_loss(hf_dir, hf_dir.name)
        assert one[case]["read"] == whole_bytes
        for rank, ranks in enumerate(four):
            # exactly the bytes of what the rank holds (its stage's tp shards, its replicated norms)
            assert ranks[case]["read"] == ranks[case]["held"], (hf_dir.name, rank)
            assert ranks[case]["read"] < whole_bytes / 2, (hf_dir.name, rank)
        for result in (one[case], four[0][case]):
            assert result["state"].keys() == reference.keys()
            for name, value in reference.items():
                assert torch.equal(result["state"][name], value.float()), (hf_dir.name, name)
        for result in [one[case], *(ranks[case] for ranks in four)]:
            assert result["loss"] == pytest.approx(expected_loss, rel=REL), hf_dir.name
        assert four[0][case]["loss"] == pytest.approx(one[case]["loss"], rel=REL), hf_dir.name


def test_any_rectangle_of_an_expert_tensor_reads_alone(tmp_path: Path) -> None:
    """Rectangles across experts and across both transposed dims read only their bytes and equal the whole
    import's; a directory whose tensors do not match the model is refused from the headers, naming the tensor."""
    hf_dir = save_transformers(tmp_path / "hf", "mixtral")
    cfg, whole = load_hf(hf_dir)
    reader = HfSliceReader(hf_dir, cfg)
    for name, offsets, shape in [("layers.0.mlp.w_gate", (1, 8, 5), (2, 40, 30)),
                                 ("layers.1.mlp.w_down", (3, 0, 17), (1, 48, 3)),
                                 ("layers.1.attn.k_proj.weight", (16, 3), (16, 9))]:
        before = reader.bytes_read
        part = reader.read(f"model.{name}", offsets, shape)
        cut = tuple(slice(o, o + n) for o, n in zip(offsets, shape, strict=True))
        assert torch.equal(part, whole[name][cut]), name
        assert reader.bytes_read - before == part.numel() * 4, name
    wrong = model_config_from_hf(hf_dir)
    wrong.n_layers = 3
    with pytest.raises(CheckpointError, match=r"19 missing: model\.layers\.2\.self_attn\.q_proj\.weight"):
        HfSliceReader(hf_dir, wrong)
