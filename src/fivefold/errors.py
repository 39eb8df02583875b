"""The user-error types that every layer may raise and the command line prints without a traceback.

`ConfigError` (a bad config field) lives with the config in `fivefold.config`; `CliError` (files, run directories,
flags outside the config) lives here, at the bottom, so that no module needs to import the command line for it."""

from __future__ import annotations

from fivefold.config import ConfigError

__all__ = ["EXIT_ENVIRONMENT", "CliError", "ConfigError", "EnvironmentFailure"]

EXIT_ENVIRONMENT = 5  # the machine failed the run: no space, a read-only or forbidden directory, a lost rank


class CliError(Exception):
    """A user error outside the config (files, run directories); printed without a traceback."""


class EnvironmentFailure(Exception):
    """The machine failed a run that was right (no space, a read-only or forbidden directory, a rank that died or
    never joined): one line saying what failed, where, what is safe on disk and how to continue, printed without a
    traceback, exit status EXIT_ENVIRONMENT. An empty message prints nothing (a rank whose peer failed and said so)."""

    def __init__(self, message: str, peer: bool = False) -> None:
        super().__init__(message)
        self.peer = peer  # it reports losing another rank: the launcher names that rank first
