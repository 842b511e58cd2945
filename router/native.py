"""The router's hot path compiled to C with mypyc: which modules, building them, and loading
them only while they match their sources.

`session-router native build` compiles `MODULES` into `.native/` beside the checkout (`make
install` runs it; it needs a C compiler and Python's headers, and the router runs the same
without it, only slower). `router/__init__.py` and `router/http/__init__.py` call `activate`,
which puts the compiled modules ahead of the sources only while the manifest written with them
names the same Python and the same source hashes: an edited source is never shadowed by a stale
build. SESSION_ROUTER_NATIVE=0 runs the sources all the same.

mypyc drops a msgspec Struct's class options (frozen, forbid_unknown_fields) and breaks its
decoding, so a compiled module defines none: `build` refuses one that does.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from policies import native as policies_native

MODULES = (
    "router/http/headers.py",
    "router/http/server.py",
    "router/http/client.py",
    "router/http/stream.py",
    "router/turn/pipeline.py",
    "router/turn/legs.py",
    "router/turn/execute.py",
    "router/turn/relay.py",
    "router/errors.py",
    "router/obs/cells.py",
    "router/obs/metrics.py",
    "router/fleet/workers.py",
    "router/state/shared.py",
    "router/state/view.py",
    "router/state/write_queue.py",
    "router/state/batcher.py",
)
ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / ".native"
GROUP = "router_native"  # the shared library every compiled module links: top-level name
# the manifest, the library folder and the switch are those of every build
MANIFEST = policies_native.MANIFEST
LIBRARY = policies_native.LIBRARY
DISABLE = policies_native.DISABLE

BUILD = policies_native.CompiledBuild(ROOT, OUT, MODULES)
activate = BUILD.activate
_is_fresh = BUILD.is_fresh


def fingerprint(root: Path, modules: tuple[str, ...] = MODULES) -> dict[str, object]:
    """What a build is valid for: this Python, and each compiled module's source."""
    return policies_native.fingerprint(root, modules)


# `active` (the compiled modules are on the path) and `status` (why, or where from, for the
# serve command's log line) are the build's, read as this module's
__getattr__ = BUILD.attribute


def defines_struct(source: str) -> bool:
    """Whether a module's source defines a class deriving from a msgspec Struct."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            for base in node.bases:
                name = ast.unparse(base)
                if name == "Struct" or name.endswith(".Struct"):
                    return True
    return False


def build(
    root: Path = ROOT, out: Path = OUT, modules: tuple[str, ...] = MODULES, group: str = GROUP
) -> None:
    """Compile `modules` into `out` (their shared library named `group`) and write the
    manifest `activate` checks."""
    structs = [m for m in modules if defines_struct((root / m).read_text())]
    if structs:
        raise SystemExit(f"these modules define msgspec Structs and cannot be compiled: {structs}")
    from mypyc.build import mypycify  # a dev dependency: only building needs it
    from setuptools import setup

    # taken before compiling: a source edited meanwhile leaves the build stale, not "fresh"
    manifest = json.dumps(fingerprint(root, modules))
    shutil.rmtree(out, ignore_errors=True)  # no module left over from an earlier list
    here = Path.cwd()
    os.chdir(root)  # mypy reads the project's configuration, paths are the module names
    try:
        with tempfile.TemporaryDirectory() as temp:
            extensions = mypycify(list(modules), opt_level="3", group_name=group,
                                  target_dir=temp)  # fmt: skip
            command = ["-q", "build_ext", "--build-lib", str(out), "--build-temp", temp]
            setup(name=group, ext_modules=extensions, script_args=command)
    finally:
        os.chdir(here)
    (out / LIBRARY).mkdir(parents=True)
    for library in out.glob(group + "__mypyc*"):
        library.rename(out / LIBRARY / library.name)
    (out / MANIFEST).write_text(manifest)


def _run(args: argparse.Namespace) -> int:
    fresh = _is_fresh(ROOT, OUT)
    if args.action == "build" and not (args.if_stale and fresh):
        build()
        fresh = _is_fresh(ROOT, OUT)
    print("native hot path:", "on" if fresh else BUILD.status)
    # the adaptive policy's hot path (`policies.native` loads it; policies import no router)
    policy = policies_native.is_fresh()
    if args.action == "build" and not (args.if_stale and policy):
        build(ROOT, policies_native.OUT, policies_native.MODULES, policies_native.GROUP)
        policy = policies_native.is_fresh()
    print("native policies:", "on" if policy else policies_native.BUILD.status)
    return 0 if (fresh and policy) or args.action == "status" else 1


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "native", help="build the router's compiled hot path, or say whether it is fresh",
        description="Compile the router's and the adaptive policy's hot paths with mypyc into "
        ".native/ and .native-policies/ (build), or say whether the builds there match the "
        "sources (status).",
    )  # fmt: skip
    parser.add_argument("action", choices=("build", "status"))
    parser.add_argument("--if-stale", action="store_true", help="build only when not fresh")
    parser.set_defaults(run=_run)
