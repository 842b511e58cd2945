"""The router's version: the installed package's metadata, else the checkout's pyproject.toml."""

from __future__ import annotations

import importlib.metadata
import tomllib
from functools import cache
from pathlib import Path

DISTRIBUTION = "session-router"
_PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


@cache
def version() -> str:
    """`session-router`'s version as installed; run from a checkout that is not installed, the
    version its pyproject.toml declares; "unknown" when neither says."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return pyproject_version(_PYPROJECT)


def pyproject_version(path: Path) -> str:
    try:
        with path.open("rb") as file:
            found = tomllib.load(file).get("project", {}).get("version")
    except (OSError, tomllib.TOMLDecodeError):
        return "unknown"
    return str(found) if found else "unknown"
