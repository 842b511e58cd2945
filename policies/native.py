"""The adaptive policy's hot path compiled to C with mypyc: which modules, and loading them
only while they match their sources.

`session-router native build` (`router.native`, which builds the router's hot path beside it)
compiles `MODULES` into `.native-policies/` beside the checkout. The packages holding them call
`activate` from their `__init__`, which puts the compiled modules ahead of the sources only
while the manifest written with them names the same Python and the same source hashes: an
edited source is never shadowed by a stale build, and without a build (no C compiler) the
policy runs its sources, the same only slower. SESSION_ROUTER_NATIVE=0 runs the sources all the
same. This module only reads builds, and imports nothing outside `policies`; its
`CompiledBuild` loads the router's hot path too (`router.native`), which may import `policies`
where `policies` may import no `router`.

A module defining a msgspec Struct cannot be compiled (mypyc drops its class options), nor one
whose classes an interpreted one subclasses.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
from pathlib import Path

MODULES = (
    "policies/adaptive/admission.py",
    "policies/adaptive/candidates.py",
    "policies/adaptive/decision.py",
    "policies/adaptive/fleet.py",
    "policies/adaptive/policy.py",
    "policies/adaptive/ranking.py",
    "policies/adaptive/scoring.py",
    "policies/adaptive/shortlists.py",
    "policies/adaptive/terms.py",
    "policies/adaptive/ledgers/cache.py",
    "policies/adaptive/ledgers/legs.py",
    "policies/adaptive/ledgers/streams.py",
    "policies/adaptive/ledgers/work.py",
    "policies/costmodel/calibration.py",
    "policies/costmodel/estimates.py",
    "policies/costmodel/roofline.py",
)
ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / ".native-policies"
MANIFEST = "manifest.json"
LIBRARY = "lib"  # the folder of the shared library, beside the compiled packages
LAYOUT = 2  # how a build is laid out in `out`; a build of another layout is stale
GROUP = "policies_native"  # the shared library every compiled module links: top-level name
DISABLE = "SESSION_ROUTER_NATIVE"


class CompiledBuild:
    """One mypyc build in `out` of `modules` under `root`: whether it is fresh, and putting it
    ahead of the sources. `active` and `status` say whether it is on, and why (or where
    from). The router's hot path (`router.native`) is another build of this kind."""

    def __init__(self, root: Path, out: Path, modules: tuple[str, ...]) -> None:
        self.root, self.out, self.modules = root, out, modules
        self.active = False
        self.status = "off: not built"
        self._fresh: dict[tuple[Path, Path, tuple[str, ...]], bool] = {}

    def attribute(self, name: str) -> bool | str:
        """`active` and `status`, as the attributes of the module it builds for (that
        module's `__getattr__`)."""
        if name == "active":
            return self.active
        if name == "status":
            return self.status
        raise AttributeError(f"no attribute {name!r}")

    def activate(
        self, package_path: list[str], package: str, root: Path | None = None,
        out: Path | None = None, modules: tuple[str, ...] | None = None,
    ) -> bool:  # fmt: skip
        """Put the compiled modules of `package` ahead of its sources on `package_path` (the
        package's `__path__`), when the build in `out` is of `modules` as they are now and
        not disabled."""
        root, out = root or self.root, out or self.out
        modules = self.modules if modules is None else modules
        if os.environ.get(DISABLE, "1") == "0":
            self.status = f"off: {DISABLE}=0"
            return False
        fresh = self._fresh.get((root, out, modules))
        if fresh is None:
            fresh = self._fresh[(root, out, modules)] = self.is_fresh(root, out, modules)
        compiled = out.joinpath(*package.split("."))
        if not fresh or not compiled.is_dir():
            return False
        library = str(out / LIBRARY)
        if library not in sys.path:
            # the shared library is a top-level module, alone in its folder: `out` itself on
            # sys.path would make a fresh `import` of the package (a spawned child inherits
            # sys.path) a namespace package of only the compiled modules
            sys.path.append(library)
        if str(compiled) not in package_path:
            package_path.insert(0, str(compiled))
        self.active, self.status = True, f"on: {out}"
        return True

    def is_fresh(
        self, root: Path | None = None, out: Path | None = None,
        modules: tuple[str, ...] | None = None,
    ) -> bool:  # fmt: skip
        """Whether the build in `out` is of `modules` as they are now, on this Python."""
        root, out = root or self.root, out or self.out
        modules = self.modules if modules is None else modules
        try:
            built = json.loads((out / MANIFEST).read_text())
        except (OSError, ValueError):
            self.status = "off: not built (make install builds it)"
            return False
        try:
            current: dict[str, object] | None = fingerprint(root, modules)
        except OSError:
            current = None
        if built != current:
            self.status = "off: the build is older than the sources (make native rebuilds it)"
            return False
        return True


def fingerprint(root: Path, modules: tuple[str, ...] = MODULES) -> dict[str, object]:
    """What a build is valid for: this Python, and each compiled module's source."""
    sources = {m: hashlib.sha256((root / m).read_bytes()).hexdigest() for m in modules}
    return {"python": sys.version, "ext": sysconfig.get_config_var("EXT_SUFFIX"),
            "layout": LAYOUT, "sources": sources}  # fmt: skip


BUILD = CompiledBuild(ROOT, OUT, MODULES)
activate = BUILD.activate
is_fresh = BUILD.is_fresh


# `active` and `status` are the build's, read as this module's
__getattr__ = BUILD.attribute
