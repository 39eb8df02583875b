"""`fivefold data prepare INPUT... --out DIR` and `fivefold data info DIR`."""

from __future__ import annotations

import argparse
import sys

from fivefold.config import finite_float, shown
from fivefold.data.format import SPLITS, TOKENIZER_FILE, DataError, document_lengths, histogram_line
from fivefold.data.prepare import (
    DEFAULT_SHARD_TOKENS,
    DEFAULT_VAL_FRACTION,
    DEFAULT_VOCAB_SIZE,
    SUPPORTED_EXTENSIONS,
    prepare_dataset,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="data_verb", metavar="SUBVERB", required=True)
    prepare = sub.add_parser(
        "prepare",
        help="tokenize text files into token shards",
        description=(
            f"Tokenize {', '.join(SUPPORTED_EXTENSIONS)} files (or directories of them) into train/val token "
            "shards. Each .txt file is one document; each JSONL line or Parquet row is one document."
        ),
    )
    prepare.add_argument("inputs", nargs="+", metavar="INPUT", help="files or directories to tokenize")
    prepare.add_argument("--out", required=True, metavar="DIR", help="output directory (created)")
    prepare.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="a Hugging Face tokenizer.json, or a Hugging Face model directory holding one, to use as-is "
        "(default: train a byte-level BPE tokenizer)",
    )
    prepare.add_argument(
        "--vocab-size",
        type=int,
        metavar="N",
        help=f"vocabulary size of the trained tokenizer (default {DEFAULT_VOCAB_SIZE}; not with --tokenizer)",
    )
    prepare.add_argument(
        "--field",
        default="text",
        metavar="NAME",
        help="JSONL field / Parquet column with the text (default text)",
    )
    prepare.add_argument(
        "--val-fraction",
        type=finite_float,
        metavar="F",
        default=DEFAULT_VAL_FRACTION,
        help=f"share of the corpus held out for validation (default {DEFAULT_VAL_FRACTION})",
    )
    prepare.add_argument(
        "--shard-tokens",
        type=int,
        metavar="N",
        default=DEFAULT_SHARD_TOKENS,
        help=f"most tokens per shard file (default {DEFAULT_SHARD_TOKENS:,})",
    )
    prepare.add_argument(
        "--eos-token", metavar="TEXT", help="end-of-text token of a given tokenizer (default: found by name)"
    )
    prepare.add_argument("--overwrite", action="store_true", help="replace a previous prepare output in DIR")
    prepare.add_argument("--quiet", action="store_true", help="no progress lines")
    info = sub.add_parser(
        "info", help="summarise a prepared directory", description="Summarise a prepared directory."
    )
    info.add_argument("directory", metavar="DIR")
    info.add_argument("--verify", action="store_true", help="also check every shard's sha256")


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _run_prepare(args: argparse.Namespace) -> int:
    if args.tokenizer is not None and args.vocab_size is not None:
        raise DataError(f"--vocab-size {args.vocab_size} sizes the tokenizer that prepare trains, but --tokenizer "
                        f"{args.tokenizer} is used as it is, with its own vocabulary; drop --vocab-size")
    out = prepare_dataset(
        args.inputs,
        args.out,
        tokenizer=args.tokenizer,
        vocab_size=DEFAULT_VOCAB_SIZE if args.vocab_size is None else args.vocab_size,
        field=args.field,
        val_fraction=args.val_fraction,
        shard_tokens=args.shard_tokens,
        overwrite=args.overwrite,
        eos_token=args.eos_token,
        progress=None if args.quiet else _progress,
        warn=_progress,  # warnings are said under --quiet too
    )
    print(summary(str(out)))
    return 0


def summary(directory: str, verify: bool = False) -> str:
    """A few lines describing a prepared directory (opening each split checks its shard sizes)."""
    from fivefold.data.dataset import TokenDataset, read_index

    index = read_index(directory, tokenizer=True)
    tokenizer = index["tokenizer"]  # read_index checked every field used below but the descriptive ones (.get)
    split_info = index.get("split") if isinstance(index.get("split"), dict) else {}
    how = (
        f"trained byte-level BPE, {tokenizer['trained_vocab_size']} requested"
        if tokenizer.get("trained_vocab_size")
        else f"from {tokenizer.get('source')}"
    )
    lines = [
        f"{directory}",
        f"  tokenizer   {tokenizer.get('file', TOKENIZER_FILE)} ({how}); vocab_size {index['vocab_size']}, "
        f"eos {shown(index.get('eos_token'))} = {index.get('eos_id')}, dtype {index['dtype']}",
        f"  split       {split_info.get('method')}, val_fraction {split_info.get('val_fraction')}",
    ]
    for split in SPLITS:
        entry = index["splits"][split]
        num_tokens = entry.get("num_tokens", sum(shard["num_tokens"] for shard in entry.get("shards", [])))
        if num_tokens:
            dataset = TokenDataset(directory, split)
            if verify:
                dataset.verify()
        lines.append(
            f"  {split:<11} {num_tokens:,} tokens, {entry.get('num_documents', 0):,} whole documents, "
            f"{len(entry.get('shards', []))} shard(s)"
        )
        if num_tokens:
            lines.append(_documents_line(index, split))
    sources = index.get("sources") if isinstance(index.get("sources"), list) else []
    skipped = index.get("skipped_documents") if isinstance(index.get("skipped_documents"), dict) else {}
    were = ", ".join(f"{count:,} {kind}" for kind, count in skipped.items() if isinstance(count, int) and count)
    lines.append(f"  sources     {len(sources)} file(s)" + (", sha256 verified" if verify else "")
                 + (f"; documents skipped: {were}" if were else ""))
    return "\n".join(lines)


def _documents_line(index: dict, split: str) -> str:
    """The split's documents (delimited by the end-of-document token): count, mean and longest length in tokens,
    and the power-of-two histogram of lengths; or that the directory predates their record."""
    lengths = document_lengths(index, split)
    if lengths is None:
        return ("              documents not recorded (prepared before document lengths were): prepare again to "
                "record them")
    longest = index["splits"][split]["documents"].get("longest")
    longest_text = f"{longest:,}" if isinstance(longest, int) else shown(longest)
    return (f"              documents: {lengths.documents:,}, mean {lengths.mean:,.1f} tokens, longest "
            f"{longest_text}; lengths {histogram_line(lengths)}")


def run(args: argparse.Namespace) -> int:
    if args.data_verb == "prepare":
        return _run_prepare(args)
    print(summary(args.directory, verify=args.verify))
    return 0
