"""File names read from files a directory describes itself with (a checkpoint's manifest and index, a prepared
dataset's index.json): each confined to that directory, so that a damaged or hostile index cannot point a reader at
any other file."""

from __future__ import annotations

from pathlib import Path

__all__ = ["name_inside"]


def name_inside(root: Path, name: object, links_may_leave: bool = False) -> tuple[Path | None, str]:
    """`root / name` and "" where `name` is a plain relative name (a string, no absolute path, no `..`, no NUL)
    that resolves, links followed, inside `root` (`links_may_leave`: a link the user put in the directory may lead
    elsewhere, as a prepared dataset's shards shared between directories do); else None and why not (for the
    caller's error)."""
    text = name if isinstance(name, str) else ""
    if not text or "\0" in text or Path(text).is_absolute() or ".." in Path(text).parts:
        return None, "is not a relative name inside the directory (an absolute path or `..` is refused)"
    path = root / text
    if not links_may_leave and not path.resolve().is_relative_to(root.resolve()):
        return None, f"resolves outside the directory (to {path.resolve()})"
    return path, ""
