"""File discovery: a TOML file of [[workers]] read again when it changes and on reload; a bad
file changes nothing."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from router.config import ConfigError, WorkerSpec
from router.fleet.discovery.file import FileSource, parse_workers_file
from router.fleet.discovery.source import WorkerDefaults


async def until(probe: Callable[[], bool], within_s: float = 5.0) -> None:
    async with asyncio.timeout(within_s):
        while True:
            if probe():
                return
            await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def running(source: FileSource, sets: list[tuple[WorkerSpec, ...]]) -> \
        AsyncIterator[None]:  # fmt: skip
    task = asyncio.create_task(source.run(sets.append))
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def write(path: Path, text: str) -> None:
    """Replace the file the way editors and ConfigMaps do: a new file renamed over it."""
    temporary = path.with_suffix(".new")
    temporary.write_text(text)
    os.replace(temporary, path)


def ids(sets: list[tuple[WorkerSpec, ...]]) -> list[str]:
    return [w.worker_id for w in sets[-1]] if sets else []


async def test_changes_and_reload_are_applied_and_a_bad_file_changes_nothing(
    tmp_path: Path,
) -> None:
    path = tmp_path / "workers.toml"
    write(path, '[[workers]]\nurl = "http://10.0.0.1:8000"\n')
    source = FileSource(str(path), interval_s=0.05, defaults=WorkerDefaults(role="decode"))
    sets: list[tuple[WorkerSpec, ...]] = []
    async with running(source, sets):
        await until(lambda: ids(sets) == ["10.0.0.1:8000"])
        assert sets[-1][0].role == "decode"  # the default role
        write(
            path,
            '[[workers]]\nurl = "http://10.0.0.1:8000"\n'
            '[[workers]]\nurl = "http://10.0.0.2:8000"\nrole = "prefill"\nid = "p"\n',
        )
        await until(lambda: ids(sets) == ["10.0.0.1:8000", "p"])
        assert sets[-1][1].role == "prefill"
        for bad in (
            '[[workers]]\nurl = "ftp://x:1"\n',
            "[[workers]\n",
            '[[workers]]\nurl = "http://a:1"\ncolour = "red"\n',
            '[[workers]]\nurl = "http://a:1"\n[[workers]]\nurl = "http://a:1"\n',
        ):
            write(path, bad)
            await asyncio.sleep(0.15)
            assert ids(sets) == ["10.0.0.1:8000", "p"], bad  # fmt: skip
        path.unlink()  # gone: the workers stay
        await asyncio.sleep(0.15)
        assert ids(sets) == ["10.0.0.1:8000", "p"]
        write(path, "")  # an empty file is an empty fleet
        await until(lambda: ids(sets) == [])
        count = len(sets)
        source.reload()  # read again even unchanged
        await until(lambda: len(sets) == count + 1)


@pytest.mark.parametrize(
    "text", ['workers = 3\n', '[[workers]]\nrole = "decode"\n', "\xff".encode("latin-1").decode(
        "latin-1")],
)  # fmt: skip
def test_parse_refuses(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_workers_file(text.encode("latin-1"), WorkerDefaults())
