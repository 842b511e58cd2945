"""Policy parameters: the error type and the shared empty parameter set.

Every policy class declares `Params`, a frozen msgspec Struct with forbid_unknown_fields=True.
The registry builds it from strings (command line), typed values (TOML) or JSON (admin call)
with `msgspec.convert(..., strict=False)`, so a typo or a bad value fails at construction,
never in the middle of serving. Range checks live in `__post_init__` and raise
`PolicyConfigError`.
"""

from __future__ import annotations

import msgspec


class PolicyConfigError(ValueError):
    """A policy spec or its parameters are invalid (unknown name, key, type or value)."""


class NoParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The parameter set of a policy that takes none."""


def require_non_negative(name: str, value: int | float) -> None:
    """Raise `PolicyConfigError` naming the parameter when `value` is below zero."""
    if value < 0:
        raise PolicyConfigError(f"{name} must be >= 0, got {value}")
