"""policies/ imports nothing of ours outside policies/ and no I/O library: the same policy
object runs in the live router and in the simulator."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

POLICIES = Path(__file__).resolve().parents[2] / "policies"
ALLOWED_THIRD_PARTY = {"msgspec"}
TESTING_KIT_ONLY = {"hypothesis", "pytest"}  # policies/testing, for plugin authors' tests
IO_MODULES = {"asyncio", "socket", "subprocess", "threading", "multiprocessing", "http",
              "urllib", "ssl", "select", "selectors", "io", "shutil", "sqlite3"}  # fmt: skip


def imported_roots(source: str) -> set[str]:
    roots: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize(
    "module", sorted(p.relative_to(POLICIES).as_posix() for p in POLICIES.rglob("*.py"))
)
def test_policy_modules_import_only_policies_and_pure_libraries(module: str) -> None:
    roots = imported_roots((POLICIES / module).read_text()) - {"__future__", "policies"}
    allowed = ALLOWED_THIRD_PARTY | (TESTING_KIT_ONLY if module.startswith("testing/") else set())
    foreign = {r for r in roots if r not in sys.stdlib_module_names and r not in allowed}
    assert not foreign, f"{module} imports {sorted(foreign)}"
    assert not roots & IO_MODULES, f"{module} imports I/O: {sorted(roots & IO_MODULES)}"


def test_the_check_sees_a_forbidden_import() -> None:
    assert imported_roots("from router.state.shared import SharedState\nimport asyncio") == {
        "router", "asyncio"
    }  # fmt: skip
