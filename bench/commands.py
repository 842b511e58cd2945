"""`session-router demo` (and, later, `bench ...` and `up`)."""

from __future__ import annotations

import argparse
from typing import Any


def _run_demo(args: argparse.Namespace) -> int:
    import uvloop

    from bench.demo import run_demo

    uvloop.run(run_demo())
    return 0


def register(subparsers: Any) -> None:
    demo = subparsers.add_parser(
        "demo", help="a short tour of simulated workers (what `make demo` runs)"
    )
    demo.set_defaults(run=_run_demo)
