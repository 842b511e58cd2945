"""A watched file of workers: TOML `[[workers]]` entries as in the router's configuration.

Read again when it changes (its size, modification time or inode: an editor's rename and a
Kubernetes ConfigMap's symlink swap both count) and on SIGHUP, with no restart. A file that
cannot be read or holds a bad entry changes nothing (the error is logged): the last good set
stays. An entry without `role` or `engine` gets `discovery_role` / `discovery_engine`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tomllib
from typing import Any

import msgspec

from router.config import ConfigError, WorkerSpec, check_workers
from router.fleet.discovery.source import OnWorkers, WorkerDefaults

log = logging.getLogger("router.fleet.discovery.file")
MAX_FILE_BYTES = 4 * 1024 * 1024


class _WorkersFile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    workers: tuple[WorkerSpec, ...] = ()


def parse_workers_file(raw: bytes, defaults: WorkerDefaults) -> tuple[WorkerSpec, ...]:
    """The workers a file's bytes list; ConfigError naming what is wrong."""
    if len(raw) > MAX_FILE_BYTES:
        raise ConfigError(f"larger than {MAX_FILE_BYTES} bytes")
    try:
        document: dict[str, Any] = tomllib.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"not UTF-8 TOML: {exc}") from exc
    entries = document.get("workers", [])
    if isinstance(entries, list):
        document["workers"] = [
            {"role": defaults.role, "engine": defaults.engine, **entry}
            if isinstance(entry, dict) else entry
            for entry in entries
        ]  # fmt: skip
    try:
        workers = msgspec.convert(document, _WorkersFile, strict=True).workers
    except msgspec.ValidationError as exc:
        raise ConfigError(str(exc)) from exc
    check_workers(workers)
    return workers


class FileSource:
    name = "file"

    def __init__(self, path: str, interval_s: float, defaults: WorkerDefaults) -> None:
        self.path = path
        self._check_every_s = min(1.0, interval_s)
        self._defaults = defaults
        self._wake = asyncio.Event()
        self._signature: tuple[int, int, int] | None = None

    def reload(self) -> None:
        self._wake.set()

    async def run(self, on_workers: OnWorkers) -> None:
        while True:
            forced = self._wake.is_set()
            self._wake.clear()
            self._check(on_workers, forced)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._check_every_s):
                    await self._wake.wait()

    def _check(self, on_workers: OnWorkers, forced: bool) -> None:
        try:
            stat = os.stat(self.path)
        except OSError as exc:
            if self._signature is not None or forced:
                log.warning("workers file %s unreadable, workers kept: %s", self.path, exc)
            self._signature = None
            return
        signature = (stat.st_mtime_ns, stat.st_size, stat.st_ino)
        if signature == self._signature and not forced:
            return
        self._signature = signature
        try:
            with open(self.path, "rb") as file:
                raw = file.read(MAX_FILE_BYTES + 1)
            workers = parse_workers_file(raw, self._defaults)
        except (OSError, ConfigError) as exc:
            log.warning("workers file %s not applied, workers kept: %s", self.path, exc)
            return
        log.info("workers file %s: %d workers", self.path, len(workers))
        on_workers(workers)
