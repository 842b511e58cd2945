"""`WorkerPool.views` reads only the workers marked changed (a scrape, in-flight counts,
health, spec, draining, ejection, leaving), yet returns exactly what reading every worker
returns, names the views it built again (`changes`), and the adaptive policy told those
decides as one comparing every worker, on seeded sequences of changes."""

from __future__ import annotations

import random
from collections.abc import Mapping

import msgspec
import pytest

from policies.adaptive.policy import AdaptivePolicy
from policies.types import (
    ClusterView,
    Decision,
    Turn,
    WorkerView,
)
from router.config import WorkerSpec
from router.fleet.telemetry import WorkerLoad
from router.fleet.workers import EjectionConfig, ModelPool, WorkerPool, WorkerState, nic_bps
from tests.policies.adaptive.test_fleet import outcome_of, turn_of

_ROLES = ("mixed", "mixed", "prefill", "decode")


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class _Reference:
    """Every member's view as reading the whole pool builds it (the views before they were
    read by their marks): built again where what it shows changed, on the same `now`."""

    def __init__(self) -> None:
        self._built: dict[str, tuple[tuple[object, ...], WorkerView]] = {}

    def views(
        self, pool: WorkerPool, fleet: Mapping[str, int], now: float, owner: ModelPool | None
    ) -> tuple[WorkerView, ...]:
        members = (
            owner.members if owner is not None else tuple(pool.workers.values())
        )  # the pool's order: as it lists its workers
        return tuple(self._view(state, fleet, now) for state in members)

    def _view(self, state: WorkerState, fleet: Mapping[str, int], now: float) -> WorkerView:
        spec, load = state.spec, state.load
        inflight = max(state.inflight, fleet.get(spec.worker_id, 0))
        healthy = state.healthy and not state.ejected
        draining = state.draining or state.leaving
        shown = (spec, load, healthy, inflight, state.started_since_scrape, draining)
        known = self._built.get(spec.worker_id)
        if known is not None and known[0] == shown:
            return known[1]
        view = WorkerView(
            worker_id=spec.worker_id, role=spec.role, healthy=healthy,
            running=load.running if load else 0, waiting=load.waiting if load else 0,
            kv_usage=load.kv_usage if load else 0.0, inflight=inflight,
            started_since_scrape=state.started_since_scrape, draining=draining, node=spec.node,
            scraped_age_s=max(0.0, now - load.scraped_at) if load else 0.0,
            scraped_at_s=load.scraped_at if load else None,
            priority_scheduling=spec.priority_scheduling, nic_bps=nic_bps(spec.nic_gbps),
        )  # fmt: skip
        self._built[spec.worker_id] = (shown, view)
        return view


def _spec(i: int, rng: random.Random) -> WorkerSpec:
    return WorkerSpec(url=f"http://10.0.0.{i}:8000", id=f"w{i}", role=rng.choice(_ROLES),  # type: ignore[arg-type]
                      node=f"n{i // 4}", nic_gbps=rng.choice((100.0, 400.0)))  # fmt: skip


def _load(rng: random.Random, now: float) -> WorkerLoad:
    return WorkerLoad(rng.randint(0, 40), rng.choice((0, 0, 1, 4)), rng.uniform(0.0, 1.0),
                      None, None, scraped_at=now - rng.uniform(0.0, 0.2))  # fmt: skip


def _change(pool: WorkerPool, rng: random.Random, clock: _Clock, fleet: dict[str, int],
            count: int) -> dict[str, int]:  # fmt: skip
    """One change of the kinds the router makes; the fleet's counts (a new mapping where
    another replica's changed, as a snapshot replaces them)."""
    ids = list(pool.workers)
    wid = rng.choice(ids)
    state = pool.workers[wid]
    match rng.randrange(12):
        case 0 | 1 | 2:  # a scrape
            pool.on_scrape(wid, _load(rng, clock.now), rng.random() > 0.1)
        case 3:  # a failed scrape
            pool.on_scrape(wid, None, rng.random() > 0.5)
        case 4 | 5:  # a leg of this replica's sent or ended, on both counts (as a leg does)
            delta = 1 if state.inflight == 0 or rng.random() < 0.5 else -1
            state.inflight += delta
            fleet[wid] = fleet.get(wid, 0) + delta
        case 6:  # a leg began answering
            state.started_since_scrape += 1
        case 7:  # another replica's counts: a new snapshot
            fleet = dict(fleet)
            fleet[wid] = rng.randint(0, 30)
        case 8:  # draining by /admin, or failing legs (ejection)
            if rng.random() < 0.5:
                state.draining = not state.draining
            else:
                pool.record_failure(wid)
        case 9:  # time passes: ejections end
            clock.now += rng.uniform(0.0, 20.0)
        case 10:  # leaving, joining, or a worker whose address changed
            if rng.random() < 0.4 and len(ids) > 2:
                pool.leave(wid)
                pool.reap()
            else:
                pool.add(_spec(rng.randrange(count + 4), rng))
        case _:  # the models it lists
            pool.set_models(wid, rng.choice(((), ("m",), ("m", "n"), ("n",))))
    return fleet


@pytest.mark.parametrize("seed", range(10))
def test_views_read_by_their_marks_are_the_views_read_whole(seed: int) -> None:
    rng = random.Random(seed)
    count = rng.choice((3, 8, 20))
    clock = _Clock()
    ejection = EjectionConfig(consecutive_failures=2, base_s=5.0, max_s=20.0, max_percent=40.0)
    pool = WorkerPool([_spec(i, rng) for i in range(count)], ejection, clock=clock,
                      departure_grace_s=0.0)  # fmt: skip
    reference = _Reference()
    fleet: dict[str, int] = {}
    last: dict[object, tuple[WorkerView, ...]] = {}
    now = 5000.0
    for _ in range(600):
        for _ in range(rng.randint(1, 3)):
            fleet = _change(pool, rng, clock, fleet, count)
        now += rng.uniform(0.0, 0.05)
        model = rng.choice((None, "m", "n"))
        owner = pool.pool_for(model)
        if owner is None:
            continue
        views = pool.views(fleet, now, owner)
        assert views == reference.views(pool, fleet, now, owner)
        before = last.get(owner)
        changes = pool.changes(owner)
        if before is not None and views is not before:
            # a new tuple names every position whose view is another object, and only those
            assert changes is not None and changes.since is before
            moved = [i for i, (a, b) in enumerate(zip(views, before, strict=True)) if a is not b]
            assert sorted(changes.positions) == moved and moved
        if before is not None and views == before:
            assert views is before  # nothing changed: the same tuple
        last[owner] = views


@pytest.mark.parametrize("seed", range(3))
def test_the_policy_told_the_changes_decides_as_one_reading_every_worker(seed: int) -> None:
    rng = random.Random(seed)
    count = 24
    clock = _Clock()
    pool = WorkerPool([_spec(i, rng) for i in range(count)], clock=clock, departure_grace_s=0.0)
    told, whole = AdaptivePolicy(), AdaptivePolicy()
    fleet: dict[str, int] = {}
    pending: list[tuple[Turn, Decision]] = []
    now = 5000.0
    for n in range(300):
        for _ in range(rng.randint(0, 3)):
            fleet = _change(pool, rng, clock, fleet, count)
        now += rng.expovariate(100.0)
        owner = pool.pool_for(None)
        if owner is None:  # several models listed: a turn for one of them
            owner = pool.pool_for("m") or pool.pool_for("n")
        assert owner is not None
        workers = pool.views(fleet, now, owner)
        decoders = [w.worker_id for w in workers if w.role != "prefill"] or ["w0"]
        turn, residency = turn_of(rng, n, now, decoders, 200)
        view = ClusterView(now_s=now, workers=workers, residency=residency,
                           changes=pool.changes(owner))  # fmt: skip
        copied = msgspec.structs.replace(
            view, workers=tuple(msgspec.structs.replace(w) for w in workers), changes=None
        )
        decision = told.decide(turn, view)
        assert decision == whole.decide(turn, copied)
        pending.append((turn, decision))
        if len(pending) > 16:
            outcome = outcome_of(*pending.pop(0))
            told.observe(outcome)
            whole.observe(outcome)
