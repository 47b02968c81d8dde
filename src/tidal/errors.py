"""The error tree. Foreign exceptions are translated into these at the boundary they cross.

Every error carries a one-line, human-readable message; the CLI prints it and exits non-zero.
"""

from __future__ import annotations


class TidalError(Exception):
    """Base of every error tidal raises on purpose."""

    exit_code = 1


class ConfigError(TidalError):
    """Bad configuration. ``field`` is the dotted path of the offending field."""

    exit_code = 2

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}" if field else message)


class UnknownPolicyError(ConfigError):
    """A policy name that is not in the registry."""


class LedgerError(TidalError):
    """An execution event that contradicts the ledger (e.g. an unknown execution id)."""


class RecordError(TidalError):
    """An execution record that cannot be trained on (inconsistent lengths or versions)."""


class InvariantViolation(TidalError):
    """A DESIGN.md invariant would be broken; raised instead of silently continuing."""


class TransitionError(TidalError):
    """A transition plan could not be built or executed."""


class TimeoutExpired(TidalError):
    """A bounded wait ran out of time."""
