"""The `session-router` command: a thin dispatcher over the subcommands each package offers.

Each provider module exposes `register(subparsers)`, adding its subcommands with
`set_defaults(run=callable(args) -> int)`. Providers are imported here only, so no package
depends on the dispatcher.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from router.version import version

PROVIDERS = ("router.commands", "sim.commands", "bench.commands")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="session-router",
        description="Session-aware request router for LLM serving, with simulated workers "
        "and a trace-replay bench.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in PROVIDERS:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result: int = args.run(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
