"""Without the `bench` extra (matplotlib, rich) the router, the simulated workers and the
simulator still import and run; the bench commands that draw reports say what to install."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.procs import ROOT

# A Python in which the bench extra is not installed: importing it fails as it would there.
WITHOUT_EXTRA = textwrap.dedent(
    """
    import importlib.abc, sys

    class NotInstalled(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] in ("matplotlib", "rich"):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, NotInstalled())
    import importlib.util
    importlib.util.find_spec = lambda name, package=None: (
        None if name.split(".")[0] in ("matplotlib", "rich") else _find(name, package))
    """
)


def run_without_extra(code: str) -> subprocess.CompletedProcess[str]:
    prelude = "import importlib.util\n_find = importlib.util.find_spec\n" + WITHOUT_EXTRA
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_router_and_simulator_import_without_the_bench_extra() -> None:
    result = run_without_extra(
        """
        import router.app, router.turn.pipeline, sim.worker.server, sim.cluster, bench.des
        import bench.simulate, bench.stack.up
        import session_router_cli
        session_router_cli.build_parser()
        for name in ("matplotlib", "rich"):
            assert name not in sys.modules, name
        print("ok")
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_a_report_command_names_the_missing_extra() -> None:
    result = run_without_extra(
        """
        import session_router_cli
        sys.exit(session_router_cli.main(["bench", "simulate", "no-such-trace.jsonl"]))
        """
    )
    assert result.returncode == 2
    assert "pip install 'session-router[bench]'" in result.stderr
    assert "Traceback" not in result.stderr
