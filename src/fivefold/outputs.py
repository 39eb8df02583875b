"""Files the command line writes for the user (`plan --write-config`, `plan validate --fit --out`, `plan scaling
--png`, ...): the target checked before the expensive work, and a file already there kept as `NAME.bak` rather
than overwritten."""

from __future__ import annotations

from pathlib import Path

from fivefold.config import ConfigError, check_writable_dir, shown
from fivefold.errors import CliError

__all__ = ["check_target", "keep_previous"]


def check_target(path: str | Path, flag: str, example: str = "out.toml", parent_must_exist: bool = True) -> Path:
    """`flag`'s output file `path`, refused up front (before a search, a fit or a benchmark) when it is empty, a
    directory, in a directory that does not exist (`parent_must_exist`; otherwise the nearest existing one must be a
    directory), or where nothing can be written (a probe file is made and removed)."""
    text = str(path)
    if not text:
        raise CliError(f"{flag} '' is empty; give a file name such as {example}")
    target = Path(text)
    if target.is_dir():
        raise CliError(f"{flag} {shown(text)} is a directory; give a file name such as {example}")
    if target.parent.exists() and not target.parent.is_dir():
        raise CliError(f"{flag} {shown(text)}: {shown(str(target.parent))} is a file, not a directory")
    if parent_must_exist and not target.parent.is_dir():
        raise CliError(f"{flag} {shown(text)}: directory {shown(str(target.parent))} does not exist; create it first "
                       "or write into an existing one")
    try:
        check_writable_dir(target.parent, flag)
    except ConfigError as e:
        raise CliError(f"{flag} {shown(text)}: {str(e).removeprefix(flag + ' ')}") from None
    return target


def keep_previous(path: str | Path) -> Path | None:
    """Move a file already at `path` aside so that writing there loses nothing: to `NAME.bak`, or, when that is
    taken by an older backup, `NAME.bak2`, `NAME.bak3`, ... (no backup is ever replaced); the backup's path, or None
    when nothing was there. A directory at `path` is refused (CliError)."""
    target = Path(path)
    if target.is_dir():
        raise CliError(f"{shown(str(path))} is a directory; give a file name")
    if not target.exists() and not target.is_symlink():
        return None
    backup, n = target.with_name(target.name + ".bak"), 1
    while backup.exists() or backup.is_symlink():
        n += 1
        backup = target.with_name(f"{target.name}.bak{n}")
    target.replace(backup)
    return backup
