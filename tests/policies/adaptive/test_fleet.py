"""`FleetIndex` kept from view to view ranks the workers exactly as ranking each view afresh
does, and `adaptive` fed views that share their unchanged workers decides as it does on views
built whole every turn."""

from __future__ import annotations

import random
from collections.abc import Iterator

import msgspec
import pytest

from policies.adaptive.fleet import FleetIndex
from policies.adaptive.policy import AdaptivePolicy
from policies.eligibility import DECODE_ROLES, PREFILL_ROLES
from policies.types import (
    ClusterView,
    Decision,
    Objectives,
    Outcome,
    Residency,
    Role,
    Turn,
    WorkerChanges,
    WorkerView,
    action_of,
)

_ROLES: tuple[Role, ...] = ("mixed", "prefill", "decode")
_KV_LIMIT = 0.9
_MAX_SEQS = 40


def _worker(rng: random.Random, wid: str, role: Role) -> WorkerView:
    return WorkerView(
        worker_id=wid, role=role, healthy=rng.random() > 0.05, draining=rng.random() < 0.03,
        running=0 if role == "prefill" else rng.randint(0, 48),
        waiting=rng.choice((0, 0, 1, 3)), inflight=rng.randint(0, 60),
        kv_usage=rng.choice((0.1, 0.5, _KV_LIMIT, rng.uniform(0.0, 1.0))),
    )  # fmt: skip


def _expected(workers: tuple[WorkerView, ...]) -> dict[str, object]:
    """The rankings as one pass over the view builds them."""
    roomy, full, usages, prefill, streams = [], [], [], [], []
    for w in workers:
        if not w.healthy or w.draining:
            continue
        load = (w.inflight + w.running + 2 * w.waiting, w.worker_id)
        if w.role in DECODE_ROLES:
            (roomy if w.kv_usage < _KV_LIMIT else full).append(load)
            usages.append((w.kv_usage, w.worker_id))
        if w.role in PREFILL_ROLES:
            prefill.append(load)
            count = max(w.inflight - max(w.waiting, 0), max(w.running, 0))
            streams.append((min(count, _MAX_SEQS), w.worker_id))
    return {
        "index": {w.worker_id: w for w in workers},
        "roomy": sorted(roomy), "full": sorted(full), "usages": sorted(usages),
        "prefill": sorted(prefill), "streams": sorted(streams),
    }  # fmt: skip


def _held(fleet: FleetIndex) -> dict[str, object]:
    """The rankings as (value, id), from their keys, in the order `head` reads them."""
    held: dict[str, object] = {"index": fleet.index}
    for name in ("roomy", "full", "prefill", "streams"):
        ranking = getattr(fleet, name)
        keys = fleet.head(ranking, len(ranking))
        assert keys == fleet.head(ranking, len(ranking) + 1) == sorted(ranking)
        assert fleet.least(ranking, 3) == [fleet.id_of(k) for k in keys[:3]]
        assert fleet.most(ranking, 3) == [fleet.id_of(k) for k in keys[::-1][:3]]
        held[name] = [(fleet.value_of(k), fleet.id_of(k)) for k in keys]
    usages = sorted(fleet.usages)
    assert fleet.emptiest(4) == [fleet.id_of(rank) for _, rank in usages[:4]]
    held["usages"] = [(usage, fleet.id_of(rank)) for usage, rank in usages]
    return held


def _views(rng: random.Random, steps: int) -> Iterator[tuple[WorkerView, ...]]:
    """Views of a fleet whose workers change a few at a time (a scrape, an in-flight count
    alone), now and then all at once, join, leave, or come twice."""
    count = rng.choice((1, 2, 8, 40))
    workers = [_worker(rng, f"w{i}", rng.choice(_ROLES)) for i in range(count)]
    for _ in range(steps):
        match rng.randrange(10):
            case 0:  # a whole-fleet scrape
                workers = [_worker(rng, w.worker_id, w.role) for w in workers]
            case 1:  # one joins
                joining = _worker(rng, f"x{rng.randrange(1000)}", rng.choice(_ROLES))
                workers.insert(rng.randrange(len(workers) + 1), joining)
            case 2 if len(workers) > 1:  # one leaves
                workers.pop(rng.randrange(len(workers)))
            case 3:  # the same view again
                pass
            case 4:  # one is listed twice
                workers.append(rng.choice(workers))
            case 5 | 6:  # a leg sent or ended: one worker's in-flight count, nothing else
                i = rng.randrange(len(workers))
                moved = max(0, workers[i].inflight + rng.choice((-1, 1)))
                workers[i] = msgspec.structs.replace(workers[i], inflight=moved)
            case _:
                for _ in range(rng.randint(1, 3)):
                    i = rng.randrange(len(workers))
                    workers[i] = _worker(rng, workers[i].worker_id, workers[i].role)
        yield tuple(workers)


@pytest.mark.parametrize("seed", range(12))
def test_the_index_kept_ranks_as_a_fresh_one(seed: int) -> None:
    rng = random.Random(seed)
    kept = FleetIndex(_KV_LIMIT, _MAX_SEQS)
    for workers in _views(rng, 300):
        kept.sync(workers)
        fresh = FleetIndex(_KV_LIMIT, _MAX_SEQS)
        fresh.sync(workers)
        assert _held(kept) == _held(fresh) == _expected(workers)


@pytest.mark.parametrize("seed", range(12))
def test_the_index_told_the_changes_ranks_as_a_fresh_one(seed: int) -> None:
    """Told where a view changed since the one it indexed (`WorkerChanges`: every changed
    position, some unchanged ones too), it compares only those; told so of a view it did
    not index, it compares every worker."""
    rng = random.Random(seed)
    told = FleetIndex(_KV_LIMIT, _MAX_SEQS)
    before: tuple[WorkerView, ...] = ()
    for workers in _views(rng, 300):
        changes = None
        if len(before) == len(workers):
            moved = [i for i in range(len(workers)) if workers[i] is not before[i]]
            named = moved + rng.sample(range(len(workers)), min(2, len(workers)))
            since = before if rng.random() < 0.9 else tuple(list(before))  # not the one indexed
            changes = WorkerChanges(since=since, positions=tuple(named))
        told.sync(workers, changes)
        fresh = FleetIndex(_KV_LIMIT, _MAX_SEQS)
        fresh.sync(workers)
        assert _held(told) == _held(fresh) == _expected(workers)
        before = workers


def _fleet_turns(
    count: int, layout: str, turns: int, seed: int
) -> Iterator[tuple[Turn, ClusterView]]:
    """Turns on a fleet whose views change as the router's do: each turn a few workers are
    scraped again, the rest are the same objects (the view names them: `changes`)."""
    rng = random.Random(seed)
    roles: list[Role] = (
        ["mixed"] * count if layout == "mixed" else ["prefill", "decode"] * (count // 2)
    )
    decoders = [f"w{i}" for i, role in enumerate(roles) if role != "prefill"]
    workers = [_worker(rng, f"w{i}", role) for i, role in enumerate(roles)]
    now = 1000.0
    shared = tuple(workers)
    for n in range(turns):
        now += rng.expovariate(100.0)
        changed: list[int] = []
        for _ in range(rng.randint(0, 3)):
            i = rng.randrange(count)
            workers[i] = _worker(rng, workers[i].worker_id, workers[i].role)
            changed.append(i)
        changes = WorkerChanges(since=shared, positions=tuple(changed))
        if changed:
            shared = tuple(workers)
        turn, residency = turn_of(rng, n, now, decoders, turns)
        yield turn, ClusterView(now_s=now, workers=shared, residency=residency, changes=changes)


def turn_of(
    rng: random.Random, n: int, now: float, decoders: list[str], sessions: int
) -> tuple[Turn, Residency | None]:
    """A seeded turn of one of `sessions` sessions, most resident on one of `decoders`."""
    prompt = rng.choice((512, 2048, 8192))
    residency, uncached = None, prompt
    if rng.random() < 0.7:
        resident = rng.randrange(prompt // 2, prompt)
        uncached = prompt - resident
        residency = Residency(worker_id=rng.choice(decoders), tokens=resident,
                              bytes=resident * 131072, epoch=1)  # fmt: skip
    turn = Turn(
        session_id=f"s{rng.randrange(sessions)}", request_id=f"r{n}", prompt_tokens=prompt,
        uncached_tokens=uncached, max_tokens=rng.choice((64, 256)),
        objectives=Objectives(ttft_ms=1000.0 + 0.2 * prompt, itl_ms=100.0), arrival_s=now,
    )  # fmt: skip
    return turn, residency


def outcome_of(turn: Turn, decision: Decision) -> Outcome:
    """What a turn decided so reports when done: a made-up but deterministic outcome."""
    action = action_of(decision)
    worker = getattr(decision, "worker", None)
    ok = action != "reject"
    return Outcome(
        request_id=turn.request_id, session_id=turn.session_id, action=action,
        prefill_worker=getattr(decision, "prefill_worker", worker),
        decode_worker=getattr(decision, "decode_worker", worker),
        prompt_tokens=turn.prompt_tokens, cached_tokens=turn.prompt_tokens - turn.uncached_tokens,
        completion_tokens=turn.max_tokens if ok else 0, ok=ok,
        ttft_ms=200.0 + 0.05 * turn.uncached_tokens if ok else None,
        decode_ms=15.0 * turn.max_tokens if ok else None,
    )  # fmt: skip


@pytest.mark.parametrize(("count", "layout"), [(8, "mixed"), (64, "mixed"), (64, "split")])
def test_views_sharing_their_workers_are_decided_as_views_built_whole(
    count: int, layout: str
) -> None:
    kept, whole = AdaptivePolicy(), AdaptivePolicy()
    pending: list[tuple[Turn, Decision]] = []
    for turn, view in _fleet_turns(count, layout, 300, seed=count):
        copied = msgspec.structs.replace(
            view, workers=tuple(msgspec.structs.replace(w) for w in view.workers), changes=None
        )
        decision = kept.decide(turn, view)
        assert decision == whole.decide(turn, copied)
        pending.append((turn, decision))
        if len(pending) > 16:
            outcome = outcome_of(*pending.pop(0))
            kept.observe(outcome)
            whole.observe(outcome)
