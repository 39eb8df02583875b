"""Tokenizers for `fivefold data prepare`: load a given `tokenizer.json`, find its end-of-text token, or train a
byte-level BPE tokenizer on the corpus."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from fivefold.config import shown
from fivefold.data.format import (
    DataError,
)

EOS_TOKEN = "<|endoftext|>"
# end-of-text tokens of common tokenizers (GPT-2, Llama 3, Llama 2 / Mistral, Gemma), tried in this order
EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
BYTE_LEVEL_MIN_VOCAB = 257  # 256 byte symbols + the end-of-text token
DEFAULT_VOCAB_SIZE = 2048
# the largest vocabulary `data prepare` trains: 64 times the largest published ones (Gemma's 262,144); the BPE trainer
# reserves memory in proportion to the vocabulary asked for, and aborts the process (in Rust) when it cannot
MAX_TRAINED_VOCAB = 1 << 24


def load_tokenizer(path: str | Path):
    """A `tokenizers.Tokenizer` read from a `tokenizer.json` file, or a DataError saying why not."""
    from tokenizers import Tokenizer

    path = Path(path).expanduser()
    if not path.is_file():
        raise DataError(f"tokenizer {path}: no such file (give a Hugging Face tokenizer.json)")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises its own Exception subclass for any parse error
        first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(f"tokenizer {path}: not a readable tokenizer.json ({first_line})") from None


def find_eos(tokenizer, where: str, eos_token: str | None = None, given: bool = False) -> tuple[int, str]:
    """The (id, text) of the tokenizer's end-of-text token: `eos_token` if given, else the first of
    EOS_CANDIDATES that the vocabulary holds. `given`: `eos_token` is the user's --eos-token (an ordinary word is
    refused)."""
    candidates = (eos_token,) if eos_token else EOS_CANDIDATES
    for token in candidates:
        token_id = tokenizer.token_to_id(token)
        if token_id is not None:
            added = {t.content for t in tokenizer.get_added_tokens_decoder().values()}
            # an ordinary word of the text (not an added token, no marker's brackets or slashes): every
            # occurrence in the text would end a document
            if given and eos_token and token not in added and token.lstrip("Ġ▁ ").isalnum():
                listed = ", ".join(sorted(map(shown, added))[:5]) or "it has none"
                raise DataError(f"tokenizer {where}: --eos-token {shown(eos_token)} is an ordinary word of its "
                                "vocabulary, which text encodes to, so every occurrence would end a document; give "
                                f"its end-of-text marker, one of its added tokens ({listed})")
            return int(token_id), token
    if eos_token:
        raise DataError(f"tokenizer {where}: has no token {shown(eos_token)} (--eos-token)")
    raise DataError(
        f"tokenizer {where}: has none of the end-of-text tokens {', '.join(EOS_CANDIDATES)}; "
        "name its end-of-text token with --eos-token"
    )


def tokenizer_vocab_size(tokenizer) -> int:
    """One more than the largest token id, so that every id the tokenizer emits is below it."""
    return max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1


def check_vocab_size(vocab_size: int) -> None:
    """A DataError unless a byte-level BPE tokenizer of `vocab_size` ids can be trained: from BYTE_LEVEL_MIN_VOCAB to
    MAX_TRAINED_VOCAB."""
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < BYTE_LEVEL_MIN_VOCAB:
        raise DataError(
            f"--vocab-size {shown(vocab_size)} is too small: a byte-level BPE tokenizer needs at least "
            f"{BYTE_LEVEL_MIN_VOCAB} ids (256 bytes + {EOS_TOKEN}); try {BYTE_LEVEL_MIN_VOCAB}, 512 or 2048"
        )
    if vocab_size > MAX_TRAINED_VOCAB:
        raise DataError(
            f"--vocab-size {vocab_size:,} is too large: a trained tokenizer has at most {MAX_TRAINED_VOCAB:,} ids "
            f"(2^24; the BPE trainer reserves memory per requested id, and ids are stored as uint16 up to 65,536 or "
            f"uint32); try 2048, 32768 or 65536"
        )


def train_bpe_tokenizer(documents: Iterator[str], vocab_size: int):
    """A byte-level BPE tokenizer (GPT-2 style pre-tokenization) trained on `documents`, with
    `<|endoftext|>` as id 0. The vocabulary may end up smaller than `vocab_size` on a tiny corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    check_vocab_size(vocab_size)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer=trainer)
    return tokenizer
