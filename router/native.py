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
import hashlib
import json
import os
import shutil
import sys
import sysconfig
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
MANIFEST = "manifest.json"
LIBRARY = "lib"  # the folder of the shared library, beside the compiled packages
LAYOUT = 2  # how a build is laid out in `out`; a build of another layout is stale
GROUP = "router_native"  # the shared library every compiled module links: top-level name
DISABLE = "SESSION_ROUTER_NATIVE"

active = False  # the compiled modules are on the path
status = "off: not built"  # why (or where from), for the serve command's log line
_fresh: dict[tuple[Path, Path, tuple[str, ...]], bool] = {}


def fingerprint(root: Path, modules: tuple[str, ...] = MODULES) -> dict[str, object]:
    """What a build is valid for: this Python, and each compiled module's source."""
    sources = {m: hashlib.sha256((root / m).read_bytes()).hexdigest() for m in modules}
    return {"python": sys.version, "ext": sysconfig.get_config_var("EXT_SUFFIX"),
            "layout": LAYOUT, "sources": sources}  # fmt: skip


def activate(
    package_path: list[str], package: str, root: Path = ROOT, out: Path = OUT,
    modules: tuple[str, ...] = MODULES,
) -> bool:  # fmt: skip
    """Put the compiled modules of `package` ahead of its sources on `package_path` (the
    package's `__path__`), when the build in `out` is of `modules` as they are now and not
    disabled."""
    global active, status
    if os.environ.get(DISABLE, "1") == "0":
        status = f"off: {DISABLE}=0"
        return False
    fresh = _fresh.get((root, out, modules))
    if fresh is None:
        fresh = _fresh[(root, out, modules)] = _is_fresh(root, out, modules)
    compiled = out.joinpath(*package.split("."))
    if not fresh or not compiled.is_dir():
        return False
    library = str(out / LIBRARY)
    if library not in sys.path:
        # the shared library is a top-level module, alone in its folder: `out` itself on
        # sys.path would make a fresh `import router` (a spawned child inherits sys.path) a
        # namespace package of only the compiled modules
        sys.path.append(library)
    if str(compiled) not in package_path:
        package_path.insert(0, str(compiled))
    active, status = True, f"on: {out}"
    return True


def _is_fresh(root: Path, out: Path, modules: tuple[str, ...] = MODULES) -> bool:
    global status
    try:
        built = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        status = "off: not built (make install builds it)"
        return False
    try:
        current: dict[str, object] | None = fingerprint(root, modules)
    except OSError:
        current = None
    if built != current:
        status = "off: the build is older than the sources (make native rebuilds it)"
        return False
    return True


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
    (out / LIBRARY).mkdir()
    for library in out.glob(group + "__mypyc*"):
        library.rename(out / LIBRARY / library.name)
    (out / MANIFEST).write_text(json.dumps(fingerprint(root, modules)))


def _run(args: argparse.Namespace) -> int:
    fresh = _is_fresh(ROOT, OUT)
    if args.action == "build" and not (args.if_stale and fresh):
        build()
        fresh = _is_fresh(ROOT, OUT)
    print("native hot path:", "on" if fresh else status)
    # the adaptive policy's hot path (`policies.native` loads it; policies import no router)
    policy = policies_native.is_fresh()
    if args.action == "build" and not (args.if_stale and policy):
        build(ROOT, policies_native.OUT, policies_native.MODULES, policies_native.GROUP)
        policy = policies_native.is_fresh()
    print("native policies:", "on" if policy else policies_native.status)
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
