"""Redis key naming for the shared state: one place, so the Lua scripts and Python agree.

Every key lives under `{prefix}:`; each record kind has its own namespace, so no id (which may
contain any character) can make two kinds collide. Link ids carry the source's length, so
`(a>b, c)` and `(a, b>c)` stay distinct.

On Redis Cluster (`cluster=True`) every script must touch keys of one hash slot. The fleet's
keys (workers, replicas' in-flight counts, link ledgers and the indexes over them) share the
hash tag `{prefix}`: one slot, so the refresh and link scripts see all of them at once. Each
session goes to one of `SESSION_BUCKETS` buckets by a CRC-32 of its id, tagged `{prefix.sN}`:
a batch's session writes make one script call per bucket, and the buckets spread over the
primaries. A session's record and the invalidation its write publishes stay in one call.
"""

from __future__ import annotations

import zlib

# session buckets on Redis Cluster: enough to spread over a few dozen primaries, few enough
# that a batch of writes still makes few calls
SESSION_BUCKETS = 64


def link_id(src: str, dst: str) -> str:
    return f"{len(src)}.{src}>{dst}"


class Keys:
    __slots__ = (
        "buckets",
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

    def __init__(self, prefix: str, cluster: bool = False) -> None:
        if cluster and ("{" in prefix or "}" in prefix):
            raise ValueError(f"a Redis Cluster key prefix cannot hold braces: {prefix!r}")
        self.prefix = prefix
        self.buckets = SESSION_BUCKETS if cluster else 1
        fleet = f"{{{prefix}}}" if cluster else prefix
        self.session_prefix = f"{prefix}:session:"
        self.worker_prefix = f"{fleet}:worker:"
        self.inflight_prefix = f"{fleet}:inflight:"
        self.link_prefix = f"{fleet}:link:"
        self.lease_prefix = f"{fleet}:lease:"
        self.resv_prefix = f"{fleet}:resv:"
        self.workers_index = f"{fleet}:index:workers"
        self.replicas_index = f"{fleet}:index:replicas"
        self.links_index = f"{fleet}:index:links"
        # a new name whenever the message format changes, so that replicas of two versions
        # during a rolling upgrade never misread each other (they only miss each other's)
        self.channel = f"{prefix}:invalidations"

    def session(self, session_id: str) -> str:
        return self.session_prefix_of(self.bucket(session_id)) + session_id

    def bucket(self, session_id: str) -> int:
        """The session's bucket: always 0 on a standalone Redis."""
        if self.buckets == 1:
            return 0
        return zlib.crc32(session_id.encode()) % self.buckets

    def session_prefix_of(self, bucket: int) -> str:
        """The key prefix of a bucket's sessions (a script call's sessions share one)."""
        if self.buckets == 1:
            return self.session_prefix
        return f"{{{self.prefix}.s{bucket}}}:session:"

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
        if self.buckets == 1:
            return f"{_glob_escape(self.prefix)}:*"
        return f"\\{{{_glob_escape(self.prefix)}[.}}]*"


def _glob_escape(text: str) -> str:
    return "".join(f"\\{c}" if c in "*?[]\\" else c for c in text)
