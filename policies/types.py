"""The data a placement policy decides on and returns: pure messages, no I/O.

The same structs flow from the live router and from the discrete-event simulator, so a
policy cannot tell which one is calling it.
"""

from __future__ import annotations

from typing import Literal

import msgspec

Role = Literal["prefill", "decode", "mixed"]
Action = Literal["colocate", "handoff", "migrate", "recompute", "reject"]


class Objectives(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Per-turn service objectives: time to first token and inter-token gap, in ms."""

    ttft_ms: float
    itl_ms: float


class Turn(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One request of a session, as the router sees it before placing it.

    `prompt_tokens` is the whole context (history plus new input); `uncached_tokens` is the
    part not already resident on the session's worker (equal to `prompt_tokens` for a new
    session). Both are estimates until the worker reports usage.
    """

    session_id: str
    request_id: str
    prompt_tokens: int
    uncached_tokens: int
    max_tokens: int
    objectives: Objectives
    arrival_s: float


class WorkerView(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What the router knows of one worker, with the age of that knowledge."""

    worker_id: str
    role: Role
    healthy: bool
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    inflight: int = 0
    # Of `inflight`, this router's requests that began answering since the last scrape (their
    # first token is out, or they are decode legs bringing their KV): that scrape counted
    # them waiting, or not at all, but none of them queues a prefill there any more.
    started_since_scrape: int = 0
    draining: bool = False
    node: str = ""
    scraped_age_s: float = 0.0
    # When it was scraped, on the clock of the view's `now_s`; where set, a policy reads its
    # age as now_s minus it (`scraped_at`) and `scraped_age_s` is the age when this view of
    # the worker was built: a view built per scrape and shared between turns stays true.
    scraped_at_s: float | None = None
    # The engine admits queued requests by their `priority` (vLLM's --scheduling-policy
    # priority), so a decision's `due_ms` orders its queue.
    priority_scheduling: bool = False
    # Its NIC's rate, bytes per second (0: not known): see `ClusterView.links`.
    nic_bps: float = 0.0

    @property
    def accepts_new_work(self) -> bool:
        return self.healthy and not self.draining

    def scraped_at(self, now_s: float) -> float:
        """When the worker was scraped, on the clock of `now_s` (the view's)."""
        at = self.scraped_at_s
        return now_s - self.scraped_age_s if at is None else at


class LinkView(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A transfer path between two workers; rates in bytes per second.

    `bytes_in_flight` and `reserved_bytes` are summed over all router replicas (the Redis
    ledger), so one replica sees the congestion its peers export.
    """

    src: str
    dst: str
    capacity_bps: float
    observed_bps: float = 0.0
    bytes_in_flight: int = 0
    reserved_bytes: int = 0
    latency_s: float = 0.0


class Residency(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where a session's KV state is believed to live, and how large it is."""

    worker_id: str
    tokens: int
    bytes: int
    epoch: int
    turns: int = 0


class WorkerChanges(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where a view's `workers` may differ from an earlier view's, `since` (a tuple of the
    same length): only at `positions`; every other position holds the same `WorkerView`
    object. The view's builder knows which workers it rebuilt; a policy that keeps state per
    worker and saw `since` re-reads only those, not the whole fleet (one that did not
    compares the workers itself)."""

    since: tuple[WorkerView, ...]
    positions: tuple[int, ...]


class ClusterView(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A snapshot of the fleet for one decision.

    `links` lists the links that carry or have reserved bytes, or whose capacity is their own;
    a link it leaves out between two workers of `workers` that both know their NIC rate, from
    a prefill-capable one to another decode-capable one, is idle at the lower of the two
    rates (`link`). A fleet of N workers has up to N x (N - 1) links: listing only those keeps
    the view as small as the transfers under way. `changes`, where given, says which of
    `workers` changed since an earlier view's (`WorkerChanges`).
    """

    now_s: float
    workers: tuple[WorkerView, ...]
    links: tuple[LinkView, ...] = ()
    residency: Residency | None = None
    kv_bytes_per_token: int = 131072
    changes: WorkerChanges | None = None

    def worker(self, worker_id: str) -> WorkerView | None:
        for worker in self.workers:
            if worker.worker_id == worker_id:
                return worker
        return None

    def link(self, src: str, dst: str) -> LinkView | None:
        for link in self.links:
            if link.src == src and link.dst == dst:
                return link
        rate = idle_link_bps(self.worker(src), self.worker(dst))
        return LinkView(src=src, dst=dst, capacity_bps=rate) if rate > 0.0 else None


def idle_link_bps(src: WorkerView | None, dst: WorkerView | None) -> float:
    """The capacity of the link from `src` to `dst` that a `ClusterView` leaves out of its
    `links` (idle: nothing in flight or reserved), 0 where there is no such link: from a
    prefill-capable worker to another decode-capable one, the lower of their NIC rates."""
    if src is None or dst is None or src.worker_id == dst.worker_id:
        return 0.0
    if src.role == "decode" or dst.role == "prefill":
        return 0.0
    rate = src.nic_bps if src.nic_bps < dst.nic_bps else dst.nic_bps
    return rate if rate > 0.0 else 0.0


class Prediction(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The terms of I > H + dQ + dC for the chosen placement, in ms (0 when not estimated)."""

    interference_ms: float = 0.0
    exposed_transfer_ms: float = 0.0
    queue_delta_ms: float = 0.0
    compute_delta_ms: float = 0.0
    ttft_ms: float = 0.0


_NO_PREDICTION = Prediction()


class Colocate(
    msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="action", tag="colocate"
):
    """Prefill and decode the turn on one worker (normally the resident one).

    `hold_s` (here and on `Handoff` and `Recompute`): the router holds the turn that long
    before it sends the prefill (the streams decoding on the prefill worker end meanwhile, so
    the prefill's long steps stall none of them); at most the turn's TTFT objective.
    `due_ms` (on every decision that serves the turn): its first token is due this long after
    its arrival; workers with priority scheduling then admit it ahead of the requests due
    later (`engine_priority`). None: no priority is sent, the workers' arrival order holds.
    """

    worker: str
    predicted: Prediction = _NO_PREDICTION
    reason: str = ""
    due_ms: float | None = None
    hold_s: float = 0.0


class Handoff(
    msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="action", tag="handoff"
):
    """Prefill on one worker, transfer the KV, decode on another."""

    prefill_worker: str
    decode_worker: str
    predicted: Prediction = _NO_PREDICTION
    reason: str = ""
    due_ms: float | None = None
    hold_s: float = 0.0


class Migrate(
    msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="action", tag="migrate"
):
    """Move the session's resident state from `source` to `destination`, then serve there."""

    source: str
    destination: str
    predicted: Prediction = _NO_PREDICTION
    reason: str = ""
    due_ms: float | None = None


class Recompute(
    msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="action", tag="recompute"
):
    """Serve on a worker without the state, prefilling the whole context again."""

    worker: str
    predicted: Prediction = _NO_PREDICTION
    reason: str = ""
    due_ms: float | None = None
    hold_s: float = 0.0


class Reject(
    msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="action", tag="reject"
):
    """Refuse the turn now; the client may retry after `retry_after_s`."""

    retry_after_s: float = 1.0
    predicted: Prediction = _NO_PREDICTION
    reason: str = ""


Decision = Colocate | Handoff | Migrate | Recompute | Reject


def hold_of(decision: Decision, ttft_objective_ms: float) -> float:
    """The seconds the router holds a decision's turn before sending it: its `hold_s`, at
    most the turn's TTFT objective (0 for one that holds nothing, or NaN)."""
    hold = getattr(decision, "hold_s", 0.0)
    if not hold > 0.0:
        return 0.0
    limit = ttft_objective_ms / 1000.0
    return hold if hold < limit else (limit if limit > 0.0 else 0.0)


def engine_priority(arrival_s: float, due_ms: float) -> int:
    """The `priority` a turn's requests carry to workers with priority scheduling: when its
    first token is due, in whole ms of the clock `arrival_s` is on (wall-clock time in the
    router, so that its replicas agree), lower first as vLLM admits them."""
    return round(arrival_s * 1000.0 + due_ms)


def engine_priority_of(decision: Decision, arrival_s: float) -> int | None:
    """The `engine_priority` of a decision's turn, None where it says no due time."""
    due: float | None = getattr(decision, "due_ms", None)
    return None if due is None else engine_priority(arrival_s, due)


def action_of(decision: Decision) -> Action:
    """The action word of a decision (its msgspec tag)."""
    tag: Action = type(decision).__struct_config__.tag  # type: ignore[assignment]
    return tag


class Outcome(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What actually happened to a placed turn, fed back to `Policy.observe`.

    Times are in ms and are None for stages the turn did not go through (no transfer on a
    colocated turn). `ok` is False when the turn failed after placement.
    `worker_running_at_start` is the number of decode streams running on the turn's decode
    worker when it was placed (the batch it decoded beside); `worker_waiting_at_start` the
    queue ahead of it on its prefill worker (the decode worker for a colocated turn).
    `held_ms`: the router held the turn that long before sending it (`Colocate.hold_s`); its
    TTFT includes it, `queue_ms` (the router's own queue stage, after the hold) does not.
    `prefill_cached_tokens`: of a split turn, the tokens its prefill leg found cached on the
    prefill worker, where that worker reported them (`cached_tokens` counts the decode leg's).
    """

    request_id: str
    session_id: str
    action: Action
    prefill_worker: str | None
    decode_worker: str | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ok: bool
    queue_ms: float | None = None
    prefill_ms: float | None = None
    transfer_ms: float | None = None
    transfer_bytes: int = 0
    ttft_ms: float | None = None
    itl_p99_ms: float | None = None
    decode_ms: float | None = None
    worker_running_at_start: int = 0
    worker_waiting_at_start: int = 0
    predicted: Prediction = _NO_PREDICTION
    held_ms: float = 0.0
    prefill_cached_tokens: int | None = None
