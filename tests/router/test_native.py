"""router.native: the compiled hot path is loaded only while it matches its sources, and never
compiles a module that defines msgspec Structs."""

from __future__ import annotations

import json
import os
import sys
import sysconfig
from collections.abc import Callable
from pathlib import Path

import pytest

import router
import router.http
import router.turn.pipeline
from policies import native as policies_native
from router import native

_MODULE = "pkg/hot.py"
_DISABLED = os.environ.get(native.DISABLE) == "0"  # as the suite started (fixtures clear it)


def _tree(tmp_path: Path) -> tuple[Path, Path]:
    """A source tree with one module, and a build of it whose manifest matches."""
    root, out = tmp_path / "src", tmp_path / "out"
    (root / "pkg").mkdir(parents=True)
    (root / _MODULE).write_text("X = 1\n")
    (out / "pkg").mkdir(parents=True)
    (out / native.MANIFEST).write_text(json.dumps(native.fingerprint(root, (_MODULE,))))
    return root, out


@pytest.fixture(autouse=True)
def _fresh_state(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native.BUILD, "_fresh", {})
    monkeypatch.setattr(native.BUILD, "status", "off: not built")
    monkeypatch.setattr(native.BUILD, "active", False)
    monkeypatch.delenv(native.DISABLE, raising=False)


def test_a_fresh_build_goes_ahead_of_the_sources(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))
    root, out = _tree(tmp_path)
    path = [str(root / "pkg")]
    assert native.activate(path, "pkg", root, out, (_MODULE,))
    assert path == [str(out / "pkg"), str(root / "pkg")]
    # the shared library's folder is importable, the build's root is not: with it on sys.path
    # a spawned child's `import router` would find only the compiled modules
    assert str(out / native.LIBRARY) in sys.path and str(out) not in sys.path
    assert native.active and native.status == f"on: {out}"
    assert native.activate(path, "pkg", root, out, (_MODULE,))  # twice: inserted once
    assert path == [str(out / "pkg"), str(root / "pkg")]


@pytest.mark.parametrize(
    ("spoil", "reason"),
    [
        (lambda root, out: (root / _MODULE).write_text("X = 2\n"), "older than the sources"),
        (lambda root, out: (root / _MODULE).unlink(), "older than the sources"),
        (lambda root, out: (out / native.MANIFEST).unlink(), "not built"),
        (lambda root, out: (out / native.MANIFEST).write_text("{"), "not built"),
        (
            lambda root, out: (out / native.MANIFEST).write_text(
                json.dumps({**native.fingerprint(root, (_MODULE,)), "python": "2.7"})
            ),
            "older than the sources",
        ),
        (
            lambda root, out: (out / native.MANIFEST).write_text(
                json.dumps(native.fingerprint(root, ()))
            ),
            "older than the sources",
        ),
    ],
    ids=["edited", "removed", "no-manifest", "broken-manifest", "other-python", "other-modules"],
)
def test_a_stale_or_missing_build_leaves_the_sources(
    tmp_path: Path, spoil: Callable[[Path, Path], object], reason: str
) -> None:
    root, out = _tree(tmp_path)
    spoil(root, out)
    path = [str(root / "pkg")]
    assert not native.activate(path, "pkg", root, out, (_MODULE,))
    assert path == [str(root / "pkg")]
    assert not native.active and native.status.startswith("off") and reason in native.status


def test_it_can_be_switched_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root, out = _tree(tmp_path)
    monkeypatch.setenv(native.DISABLE, "0")
    path = [str(root / "pkg")]
    assert not native.activate(path, "pkg", root, out, (_MODULE,))
    assert path == [str(root / "pkg")]
    assert native.status == f"off: {native.DISABLE}=0"


@pytest.mark.parametrize(
    ("source", "defines"),
    [
        ("import msgspec\nclass A(msgspec.Struct, frozen=True):\n    x: int\n", True),
        ("from msgspec import Struct\nclass A(Struct):\n    x: int\n", True),
        ("class A:\n    Struct = 1\n", False),
        ("import dataclasses\n@dataclasses.dataclass\nclass A:\n    x: int\n", False),
    ],
)
def test_defines_struct(source: str, defines: bool) -> None:
    assert native.defines_struct(source) is defines


def test_build_refuses_a_module_that_defines_a_struct(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg/m.py").write_text("import msgspec\nclass A(msgspec.Struct):\n    x: int\n")
    with pytest.raises(SystemExit, match="define msgspec Structs"):
        native.build(tmp_path, tmp_path / "out", ("pkg/m.py",))


def test_a_source_edited_while_it_compiles_leaves_the_build_stale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mypyc.build

    root, out = tmp_path / "src", tmp_path / "out"
    (root / "pkg").mkdir(parents=True)
    (root / _MODULE).write_text("X = 1\n")

    def compile_while_edited(modules: list[str], **options: object) -> list[object]:
        (root / _MODULE).write_text("X = 2\n")  # saved by an editor as the compiler reads it
        return []

    monkeypatch.setattr(mypyc.build, "mypycify", compile_while_edited)
    native.build(root, out, (_MODULE,), "hotgroup")
    assert not native.BUILD.is_fresh(root, out, (_MODULE,))


def test_no_compiled_module_defines_a_struct() -> None:
    for module in native.MODULES:
        assert not native.defines_struct((native.ROOT / module).read_text()), module


def test_the_hot_path_runs_compiled_exactly_when_the_build_is_fresh() -> None:
    """In CI's compiled pass (make install built it) this checks the suite ran compiled."""
    compiled = router.turn.pipeline.__file__ is not None and router.turn.pipeline.__file__.endswith(
        str(sysconfig.get_config_var("EXT_SUFFIX"))
    )
    fresh = native._is_fresh(native.ROOT, native.OUT)
    assert compiled == (fresh and not _DISABLED)
    if compiled:
        assert str(native.OUT / "router") in router.__path__
        assert str(native.OUT / "router" / "http") in router.http.__path__


def test_the_status_command_says_what_activation_found(capsys: pytest.CaptureFixture[str]) -> None:
    from session_router_cli import main

    assert main(["native", "status"]) == 0
    router_line, policies_line = capsys.readouterr().out.splitlines()
    fresh = native._is_fresh(native.ROOT, native.OUT)
    assert (
        router_line == "native hot path: on"
        if fresh
        else router_line.startswith("native hot path: off")
    )
    policies = policies_native.is_fresh()
    assert (
        policies_line == "native policies: on"
        if policies
        else policies_line.startswith("native policies: off")
    )
