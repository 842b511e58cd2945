"""Redis key naming for the shared state: one place, so the Lua scripts and Python agree.

Every key lives under `{prefix}:`; each record kind has its own namespace, so no id (which may
contain any character) can make two kinds collide. Link ids carry the source's length, so
`(a>b, c)` and `(a, b>c)` stay distinct.
"""

from __future__ import annotations


def link_id(src: str, dst: str) -> str:
    return f"{len(src)}.{src}>{dst}"


class Keys:
    __slots__ = (
        "channel",
        "inflight_prefix",
        "lease_prefix",
        "link_prefix",
        "links_index",
        "prefix",
        "replicas_index",
        "resv_prefix",
        "session_prefix",
        "worker_prefix",
        "workers_index",
    )

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.session_prefix = f"{prefix}:session:"
        self.worker_prefix = f"{prefix}:worker:"
        self.inflight_prefix = f"{prefix}:inflight:"
        self.link_prefix = f"{prefix}:link:"
        self.lease_prefix = f"{prefix}:lease:"
        self.resv_prefix = f"{prefix}:resv:"
        self.workers_index = f"{prefix}:index:workers"
        self.replicas_index = f"{prefix}:index:replicas"
        self.links_index = f"{prefix}:index:links"
        # a new name whenever the message format changes, so that replicas of two versions
        # during a rolling upgrade never misread each other (they only miss each other's)
        self.channel = f"{prefix}:invalidations"

    def session(self, session_id: str) -> str:
        return self.session_prefix + session_id

    def worker(self, worker_id: str) -> str:
        return self.worker_prefix + worker_id

    def inflight(self, replica_id: str) -> str:
        return self.inflight_prefix + replica_id

    def link(self, src: str, dst: str) -> tuple[str, str, str, str]:
        """The link's id and its keys: the ledger hash, lease expiries (ZSET), bytes (HASH)."""
        lid = link_id(src, dst)
        return lid, self.link_prefix + lid, self.lease_prefix + lid, self.resv_prefix + lid

    def pattern(self) -> str:
        """A SCAN pattern matching every key of this prefix (tests and tooling only)."""
        return f"{_glob_escape(self.prefix)}:*"


def _glob_escape(text: str) -> str:
    return "".join(f"\\{c}" if c in "*?[]\\" else c for c in text)
