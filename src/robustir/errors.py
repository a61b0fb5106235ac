"""Errors that tell a user which file, which line, what is wrong and how to fix it."""

from __future__ import annotations

from pathlib import Path


class RobustIRError(Exception):
    """Base class for every error robustir raises on purpose (the CLI prints these without a traceback)."""


class DataError(RobustIRError, ValueError):
    """Malformed input data.

    The message always names the file (and line / field when known), the problem, and a fix, e.g.::

        data/train.jsonl, line 12, field 'pos': expected a list of strings, got str.
        Fix: wrap the passage in a list: "pos": ["..."].
    """

    def __init__(
        self,
        path: str | Path | None,
        problem: str,
        *,
        line: int | None = None,
        field: str | None = None,
        fix: str | None = None,
    ) -> None:
        self.path = str(path) if path is not None else None
        self.line = line
        self.field = field
        self.problem = problem
        self.fix = fix
        where = [self.path or "<input>"]
        if line is not None:
            where.append(f"line {line}")
        if field is not None:
            where.append(f"field '{field}'")
        message = ", ".join(where) + f": {problem}"
        if fix:
            message += f"\n  Fix: {fix}"
        super().__init__(message)


class ConfigError(RobustIRError, ValueError):
    """A bad configuration value or command-line override."""


class EndpointError(RobustIRError, RuntimeError):
    """An LLM endpoint that cannot be used (unreachable, keeps failing, or answers nonsense)."""
