"""The inputs of `fivefold data prepare`: find the `.txt`, `.jsonl` and `.parquet` files and read documents out
of them, failing with a DataError that names the file and the line or row."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fivefold.config import shown
from fivefold.data.format import (
    DataError,
)

SUPPORTED_EXTENSIONS = (".txt", ".jsonl", ".parquet")


@dataclass(frozen=True)
class Source:
    """One input file: where it is and how to read documents out of it."""

    path: Path
    kind: str  # "txt" | "jsonl" | "parquet"
    size: int
    mtime: float

    def describe(self, field: str) -> dict[str, Any]:
        entry: dict[str, Any] = {
            "path": str(self.path),
            "kind": self.kind,
            "size": self.size,
            "mtime": self.mtime,
        }
        if self.kind != "txt":
            entry["field"] = field
        return entry


# ---------------------------------------------------------------------------------------------------
# Finding and reading inputs


def find_sources(inputs: Sequence[str | Path]) -> list[Source]:
    """The input files named by `inputs` (files, or directories searched recursively), in a fixed order.

    Files in directories whose extension is not supported are skipped; a file named explicitly must have
    a supported extension.
    """
    if not inputs:
        raise DataError("no inputs given; name one or more .txt, .jsonl or .parquet files or directories")
    valid = ", ".join(SUPPORTED_EXTENSIONS)
    found: dict[Path, Source] = {}
    for given in inputs:
        path = Path(given).expanduser()
        if not path.exists():
            raise DataError(f"input {path}: no such file or directory")
        if path.is_dir():
            files = sorted(
                p
                for p in path.rglob("*")
                if p.is_file()
                and p.suffix.lower() in SUPPORTED_EXTENSIONS
                and not any(part.startswith(".") for part in p.relative_to(path).parts)
            )
            if not files:
                raise DataError(f"input directory {path}: no input files found (looked for {valid})")
        else:
            if path.suffix.lower() not in SUPPORTED_EXTENSIONS:
                raise DataError(
                    f"input {path}: unknown extension {shown(path.suffix or '(none)')}; valid: {valid}"
                )
            files = [path]
        for file in files:
            if not os.access(file, os.R_OK):
                raise DataError(f"input {file}: not readable (permission denied)")
            stat = file.stat()
            resolved = file.resolve()
            found.setdefault(resolved, Source(resolved, file.suffix.lower()[1:], stat.st_size, stat.st_mtime))
    return list(found.values())


def read_documents(source: Source, field: str) -> Iterator[tuple[int, str | None]]:
    """The documents of one input file as (number, text): a whole `.txt` file (number 0), or the `field` of each
    JSONL line (its line number) or Parquet row (its row number, from 1). Empty documents are yielded too, and a
    null JSONL value or Parquet row as None (the caller counts and skips both). Every text is checked to be
    Unicode that encodes as UTF-8 (JSON can spell an unpaired surrogate, which no tokenizer takes)."""
    if source.kind == "txt":
        yield 0, _read_text(source.path)
    elif source.kind == "jsonl":
        yield from _read_jsonl(source.path, field)
    elif source.kind == "parquet":
        yield from _read_parquet(source.path, field)
    else:
        raise DataError(f"input {source.path}: unknown kind {shown(source.kind)}")


def _check_encodable(value: str, where: str, field: str) -> None:
    """A DataError naming `where` and `field` unless `value` encodes as UTF-8 (an unpaired surrogate does not)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = value[e.start]
        raise DataError(
            f"{where}: field {shown(field)} holds an unpaired surrogate (\\u{ord(bad):04x} at character {e.start}), "
            "which is not Unicode text and cannot be encoded as UTF-8; remove or replace it"
        ) from None


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")  # strict UTF-8 decoding never yields a surrogate
    except UnicodeDecodeError as e:
        raise DataError(f"input {path}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    except OSError as e:
        raise DataError(f"input {path}: cannot read ({e.strerror})") from None


def _read_jsonl(path: Path, field: str) -> Iterator[tuple[int, str | None]]:
    try:
        with open(path, encoding="utf-8") as f:
            for line_number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(
                        f"input {path}, line {line_number}: invalid JSON ({e.msg} at column {e.colno})"
                    ) from None
                except RecursionError:
                    raise DataError(f"input {path}, line {line_number}: JSON nested too deep to read") from None
                if not isinstance(record, dict):
                    raise DataError(
                        f"input {path}, line {line_number}: expected a JSON object with field {shown(field)}, "
                        f"got a JSON {_json_type(record)}"
                    )
                if field not in record:
                    fields = ", ".join(repr(k) for k in list(record)[:10]) or "none"
                    raise DataError(
                        f"input {path}, line {line_number}: no field {shown(field)} "
                        f"(fields on this line: {fields}; "
                        "choose one with --field)"
                    )
                value = record[field]
                if value is None:  # null: no document, as a null Parquet row (counted and skipped by the caller)
                    yield line_number, None
                    continue
                if not isinstance(value, str):
                    raise DataError(
                        f"input {path}, line {line_number}: field {shown(field)} must be a string (or null), "
                        f"got a JSON {_json_type(value)}"
                    )
                _check_encodable(value, f"input {path}, line {line_number}", field)
                yield line_number, value
    except UnicodeDecodeError as e:
        raise DataError(f"input {path}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    except OSError as e:
        raise DataError(f"input {path}: cannot read ({e.strerror})") from None


def _json_type(value: object) -> str:
    """The JSON name of a parsed JSON value's type (object, array, string, number, boolean, null)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    return {dict: "object", list: "array", str: "string", int: "number", float: "number"}.get(
        type(value), type(value).__name__)


def _read_parquet(path: Path, field: str) -> Iterator[tuple[int, str | None]]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(
            f"input {path}: reading Parquet needs pyarrow (pip install pyarrow, or fivefold[parquet])"
        ) from None
    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"input {path}: not a readable Parquet file ({str(e).splitlines()[0]})") from None
    schema = parquet.schema_arrow
    if field not in schema.names:
        columns = ", ".join(repr(n) for n in schema.names[:20]) or "none"
        raise DataError(f"input {path}: no column {shown(field)} (columns: {columns}; choose one with --field)")
    column_type = schema.field(field).type
    if not (pa.types.is_string(column_type) or pa.types.is_large_string(column_type)):
        raise DataError(f"input {path}: column {shown(field)} must hold strings, it holds {column_type}")
    row = 0
    try:
        for batch in parquet.iter_batches(columns=[field], batch_size=1024):
            try:
                values = batch.column(0).to_pylist()
            except UnicodeDecodeError as e:  # a string column holding bytes that are not UTF-8
                raise DataError(f"input {path}, rows {row + 1} to {row + batch.num_rows}: column {shown(field)} "
                                f"holds a value that is not UTF-8 text ({e.reason})") from None
            for value in values:
                row += 1
                if value is not None:  # a null row is no document: None, counted and skipped by the caller
                    _check_encodable(value, f"input {path}, row {row}", field)
                yield row, value
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"input {path}, after row {row}: cannot read ({str(e).splitlines()[0]})") from None
