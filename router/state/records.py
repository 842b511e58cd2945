"""The shared-state records and configuration: plain frozen messages, no I/O.

A session with no residency (never committed, expired, or cleared) reads as None. Its epoch
still matters to compare-and-set: a commit with `expected_epoch=0` matches any session that
has no residency, whatever its stored epoch, so callers that saw None pass 0.
"""

from __future__ import annotations

import enum
import uuid
from typing import Final

import msgspec

from policies.plan import TransferKind as TransferKind
from policies.types import LinkView, Residency, Role


class Unknown(enum.Enum):
    """The local view has no answer for a session: ask Redis (`load_session`)."""

    UNKNOWN = "unknown"


UNKNOWN: Final = Unknown.UNKNOWN


def _replica_id() -> str:
    return uuid.uuid4().hex[:12]


class StateConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where the shared state lives and how fresh the local view is kept.

    In-flight hashes live for `max(8 x refresh_interval_s, 1 s)` after a replica's last
    heartbeat; link ledgers for `link_ttl_s` after their last write (capacities set by this
    replica are re-asserted well within that).
    """

    url: str
    prefix: str = "sr"
    replica_id: str = msgspec.field(default_factory=_replica_id)
    session_ttl_s: float = 3600.0
    worker_ttl_s: float = 30.0
    refresh_interval_s: float = 0.25
    # a batch's fixed cost (its round trip and the invalidation message every replica reads:
    # ~0.1 ms of CPU over router.state.redis_wire's lean connections) is paid once per interval,
    # spread over 5 turns at 1,000 turns/s, and other replicas learn a commit well before that
    # session's next turn (seconds later)
    batch_interval_s: float = 0.005
    reservation_lease_s: float = 30.0
    ewma_alpha: float = 0.3
    link_ttl_s: float = 3600.0
    # past these a command, or a connection (and its login), counts Redis unreachable: 1 s
    # fired falsely on CPU-starved machines, where a loop turn alone can take that long
    command_timeout_s: float = 2.0
    connect_timeout_s: float = 5.0
    session_cache_size: int = 100_000
    max_pending_writes: int = 100_000

    def __post_init__(self) -> None:
        positive = {
            "session_ttl_s": self.session_ttl_s,
            "worker_ttl_s": self.worker_ttl_s,
            "refresh_interval_s": self.refresh_interval_s,
            "reservation_lease_s": self.reservation_lease_s,
            "link_ttl_s": self.link_ttl_s,
            "command_timeout_s": self.command_timeout_s,
            "connect_timeout_s": self.connect_timeout_s,
            "session_cache_size": self.session_cache_size,
            "max_pending_writes": self.max_pending_writes,
        }
        for name, value in positive.items():
            if not value > 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.batch_interval_s < 0:
            raise ValueError(f"batch_interval_s must be >= 0, got {self.batch_interval_s}")
        if not 0 < self.ewma_alpha <= 1:
            raise ValueError(f"ewma_alpha must be in (0, 1], got {self.ewma_alpha}")
        if not self.prefix or not self.replica_id:
            raise ValueError("prefix and replica_id must be non-empty")

    @property
    def inflight_ttl_s(self) -> float:
        return max(8 * self.refresh_interval_s, 1.0)


class SessionRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A session's residency: its owner worker holds `tokens` of KV state (`bytes`)."""

    session_id: str
    worker_id: str
    tokens: int
    bytes: int
    turns: int
    epoch: int
    last_seen: float

    def to_residency(self) -> Residency:
        return Residency(
            worker_id=self.worker_id,
            tokens=self.tokens,
            bytes=self.bytes,
            epoch=self.epoch,
            turns=self.turns,
        )


class CommitResult(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The outcome of a compare-and-set: `record` is the stored residency after it."""

    ok: bool
    record: SessionRecord | None


class WorkerRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One worker's scraped load, stamped with when and by which replica."""

    worker_id: str
    role: Role
    url: str
    running: int
    waiting: int
    kv_usage: float
    scraped_at: float
    scraped_by: str


class Reservation(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Bytes admitted onto a link until `expires_at` (unix s, Redis clock) or release.

    `local_only` reservations were admitted while Redis was unreachable and exist only in
    this replica's view.
    """

    id: str
    src: str
    dst: str
    nbytes: int
    kind: TransferKind
    expires_at: float
    local_only: bool = False


class LinkState(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A link's ledger summed over all replicas: unexpired reservations by transfer kind.

    `migration_bytes` are the admitted background transfers (the ledger's bytes in flight);
    `handoff_bytes` the latency-critical reservations. `as_of` is the Redis time (unix s) the
    sums were taken at; 0 capacity or observed rate means not known yet.
    """

    src: str
    dst: str
    capacity_bps: float = 0.0
    observed_bps: float = 0.0
    handoff_bytes: int = 0
    migration_bytes: int = 0
    reservations: int = 0
    as_of: float = 0.0

    @property
    def reserved_bytes(self) -> int:
        return self.handoff_bytes + self.migration_bytes

    def to_view(self) -> LinkView:
        """The policy's view: handoff reservations as reserved, migrations as in flight."""
        return LinkView(
            src=self.src,
            dst=self.dst,
            capacity_bps=self.capacity_bps,
            observed_bps=self.observed_bps,
            bytes_in_flight=self.migration_bytes,
            reserved_bytes=self.handoff_bytes,
        )
