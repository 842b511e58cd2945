"""`session-router bench ...`, `session-router up` and `session-router demo`.

Each bench module that offers commands exposes `register_bench(bench_subparsers)` (for
`session-router bench NAME`) and/or `register_top(subparsers)` (for top-level commands such as
`up` and `demo`), and is listed in `BENCH_MODULES`.
"""

from __future__ import annotations

import importlib
from typing import Any

BENCH_MODULES: tuple[str, ...] = ("bench.cli_live", "bench.cli_simulate")


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
