"""The user-error types that every layer may raise and the command line prints without a traceback.

`ConfigError` (a bad config field) lives with the config in `fivefold.config`; `CliError` (files, run directories,
flags outside the config) lives here, at the bottom, so that no module needs to import the command line for it."""

from __future__ import annotations

from fivefold.config import ConfigError

__all__ = ["CliError", "ConfigError"]


class CliError(Exception):
    """A user error outside the config (files, run directories); printed without a traceback."""
