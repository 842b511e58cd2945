"""`session-router bench ...`, `session-router up` and `session-router demo`.

Each bench module that offers commands exposes `register_bench(bench_subparsers)` (for
`session-router bench NAME`) and/or `register_top(subparsers)` (for top-level commands such as
`up` and `demo`), and is listed in `BENCH_MODULES`. Commands that draw reports need the `bench`
extra (matplotlib, rich); without it they say so instead of failing on an import.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from collections.abc import Callable
from typing import Any

BENCH_MODULES: tuple[str, ...] = ("bench.cli_live", "bench.cli_simulate")
EXTRA_MODULES = ("matplotlib", "rich")  # the `bench` extra
NEEDS_EXTRA = frozenset({"replay", "compare", "simulate", "demo"})


def register(subparsers: Any) -> None:
    bench = subparsers.add_parser(
        "bench", help="replay traces, simulate clusters, compare placement policies"
    )
    bench_commands = bench.add_subparsers(dest="bench_command", metavar="BENCH_COMMAND",
                                          required=True)  # fmt: skip
    for name in BENCH_MODULES:
        module = importlib.import_module(name)
        if hasattr(module, "register_bench"):
            module.register_bench(bench_commands)
        if hasattr(module, "register_top"):
            module.register_top(subparsers)
    for commands in (bench_commands.choices, subparsers.choices):
        for name, parser in commands.items():
            if name in NEEDS_EXTRA:
                parser.set_defaults(run=_with_extra(parser.get_default("run")))


def missing_extra() -> list[str]:
    """The modules of the `bench` extra this Python cannot import."""
    return [name for name in EXTRA_MODULES if importlib.util.find_spec(name) is None]


def _with_extra(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    def checked(args: argparse.Namespace) -> int:
        missing = missing_extra()
        if missing:
            print(f"this command needs {', '.join(missing)}: "
                  "pip install 'session-router[bench]'", file=sys.stderr)  # fmt: skip
            return 2
        return run(args)

    return checked
