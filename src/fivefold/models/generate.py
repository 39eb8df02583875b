"""`fivefold generate`: sample text from a checkpoint or a Hugging Face directory with fivefold's own model.

The model runs on one device with its key/value cache (`Llama.forward_cached`): the prompt once, then one
token per step. Greedy decoding (`--temperature 0`) picks the most likely token, as `transformers`'
`generate(do_sample=False)` does; otherwise tokens are sampled at the temperature from the smallest set of
tokens whose probability reaches `--top-p`. Generation stops at the end-of-text token or after
`--max-new-tokens`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from fivefold.config import finite_float, int_in
from fivefold.errors import CliError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", metavar="PATH",
                        help="a checkpoint directory, or a run directory (its newest complete checkpoint)")
    source.add_argument("--hf", metavar="DIR", help="a Hugging Face Llama/Mixtral directory (e.g. an export)")
    parser.add_argument("--prompt", default="", help="the text to continue (default: start of a document)")
    parser.add_argument("--max-new-tokens", type=int_in(1, 1 << 20, "no model here attends to more tokens"),
                        default=100, help="tokens to generate at most (default 100)")
    parser.add_argument("--temperature", type=finite_float, default=0.8,
                        help="sampling temperature; 0 = greedy, the most likely token (default 0.8)")
    parser.add_argument("--top-p", type=finite_float, default=0.95,
                        help="sample from the most likely tokens whose probabilities sum to this (default 0.95)")
    parser.add_argument("--seed", type=int_in(0, 2**63 - 1, "a 64-bit seed"),
                        default=0, help="sampling seed (default 0)")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | ... (default auto)")
    parser.add_argument("--tokenizer", metavar="PATH", help="a tokenizer.json or a directory holding one "
                        "(default: the run's or the Hugging Face directory's)")


def sample_next(logits: torch.Tensor, temperature: float, top_p: float,
                generator: torch.Generator | None) -> torch.Tensor:
    """Next token ids [batch] from the last position's logits [batch, vocab]."""
    if temperature <= 0:
        return logits.argmax(-1)
    # the largest logit subtracted first: a temperature so small that a difference over it overflows still gives
    # exp(-inf) = 0 to the others and 1 to the largest (greedy in the limit), never inf / inf; and a temperature
    # below float32's smallest normal number would round to 0 in the division (0 / 0 for the largest logit)
    logits = logits.float()
    temperature = max(temperature, torch.finfo(torch.float32).tiny)
    probs = torch.softmax((logits - logits.amax(dim=-1, keepdim=True)) / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # keep each token whose preceding tokens' mass is still below top_p (so at least the first)
        keep = sorted_probs.cumsum(-1) - sorted_probs < top_p
        keep[..., 0] = True  # a top_p below float32's range rounds to 0, and `0 < 0` would keep nothing
        sorted_probs = sorted_probs * keep
        choice = torch.multinomial(sorted_probs, 1, generator=generator)
        return order.gather(-1, choice).squeeze(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(model, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
             eos_id: int | None = None, seed: int = 0) -> list[int]:
    """The new token ids after `prompt_ids` (at most `max_new_tokens`, the end-of-text token included when
    reached), from fivefold's `Llama` with its key/value cache."""
    if not prompt_ids:
        raise ValueError("generate needs at least one prompt token")
    device = model.embed.weight.device
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    limit = model.cfg.max_seq_len - len(prompt_ids)
    if limit <= 0:
        raise ValueError(f"the prompt has {len(prompt_ids)} tokens; model.max_seq_len = {model.cfg.max_seq_len} "
                         "leaves none to generate")
    cache = model.new_cache()
    logits = model.forward_cached(torch.tensor([prompt_ids], device=device), cache)
    out: list[int] = []
    for _ in range(min(max_new_tokens, limit)):
        token = sample_next(logits[:, -1], temperature, top_p, generator)
        out.append(int(token.item()))
        if eos_id is not None and out[-1] == eos_id:
            break
        logits = model.forward_cached(token[:, None], cache)
    return out


def _load(args: argparse.Namespace, device: torch.device):
    """(model, tokenizer directory or None) from --checkpoint or --hf."""
    from fivefold.checkpoint_format import PieceError
    from fivefold.models.hf import CheckpointError, load_state_dict_into, model_from_hf
    from fivefold.models.hf_cli import (
        check_tokenizer,
        find_tokenizer_dir,
        read_checkpoint_weights,
        resolve_checkpoint,
    )
    from fivefold.models.llama import build_model

    try:
        if args.hf:
            hf_dir = Path(args.hf)
            model = model_from_hf(hf_dir, device=device)
            own = hf_dir if (hf_dir / "tokenizer.json").is_file() else None
            tokenizer_dir = find_tokenizer_dir(hf_dir, args.tokenizer) if args.tokenizer else own
            check_tokenizer(tokenizer_dir, own, model.cfg.vocab_size, args.tokenizer)
            return model, tokenizer_dir
        opened, note = resolve_checkpoint(Path(args.checkpoint))  # verified as a resume verifies it
        if note:
            print(note)
        ckpt, cfg = opened.path, opened.cfg
        tokenizer_dir = find_tokenizer_dir(ckpt, args.tokenizer)
        check_tokenizer(tokenizer_dir, find_tokenizer_dir(ckpt, None), cfg.vocab_size, args.tokenizer)
        model = build_model(cfg, device="meta")
        model.to_empty(device=device)
        if cfg.tied_embeddings:
            model.lm_head.weight = model.embed.weight
        try:
            weights = read_checkpoint_weights(opened)
        except PieceError as e:
            raise CliError(str(e)) from None
        load_state_dict_into(model, weights)
        return model, tokenizer_dir
    except CheckpointError as e:
        raise CliError(str(e)) from None


def run(args: argparse.Namespace) -> int:
    from fivefold.device import present_device
    from fivefold.models.hf import tokenizer_special_tokens

    if args.max_new_tokens < 1:
        raise CliError(f"--max-new-tokens = {args.max_new_tokens} must be >= 1, e.g. 100")
    if args.temperature < 0:
        raise CliError(f"--temperature = {args.temperature} must be >= 0 (0 = greedy), e.g. 0.8")
    if not 0 < args.top_p <= 1:
        raise CliError(f"--top-p = {args.top_p} must be in (0, 1], e.g. 0.95")
    device = present_device(args.device, "--device")
    model, tokenizer_dir = _load(args, device)
    model.eval()
    if tokenizer_dir is None:
        raise CliError("no tokenizer found beside the model (RUN_DIR/tokenizer/ or the directory's tokenizer.json); "
                       "pass --tokenizer PATH (the prepared data's tokenizer.json)")
    from fivefold.data import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir / "tokenizer.json")
    eos_id = tokenizer.token_to_id(tokenizer_special_tokens(tokenizer_dir)["eos_token"])
    prompt_ids = tokenizer.encode(args.prompt).ids if args.prompt else [eos_id]
    room = model.cfg.max_seq_len - len(prompt_ids)
    if room < 1:
        raise CliError(f"--prompt is {len(prompt_ids):,} tokens; the model attends to model.max_seq_len = "
                       f"{model.cfg.max_seq_len:,} tokens, which leaves none to generate; give a shorter prompt")
    if args.max_new_tokens > room:
        print(f"fivefold generate: note: --max-new-tokens = {args.max_new_tokens:,}: at most {room:,} new tokens "
              f"fit after the {len(prompt_ids):,}-token prompt in model.max_seq_len = {model.cfg.max_seq_len:,}",
              file=sys.stderr)
    new_ids = generate(model, prompt_ids, args.max_new_tokens, args.temperature, args.top_p, eos_id, args.seed)
    text = tokenizer.decode([i for i in new_ids if i != eos_id])
    print(args.prompt + text)
    return 0
