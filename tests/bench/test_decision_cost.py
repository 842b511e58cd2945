"""bench.scripts.decision_cost: the turns it times, and that each decision's outcome is observed
once, `inflight` turns later."""

from __future__ import annotations

import itertools

import pytest

from bench.scripts.decision_cost import fleet_roles, time_decisions, turns
from policies import create_policy
from policies.types import ClusterView, Colocate, Decision, Outcome, Turn


@pytest.mark.parametrize(
    ("count", "layout", "roles"),
    [
        (2, "mixed", ["mixed", "mixed"]),
        (4, "split", ["prefill", "decode", "prefill", "decode"]),
    ],
)
def test_fleet_roles(count: int, layout: str, roles: list[str]) -> None:
    assert fleet_roles(count, layout) == roles


def test_an_unknown_layout_is_refused() -> None:
    with pytest.raises(ValueError, match="mixed or split"):
        fleet_roles(2, "ring")


def test_turns_are_the_same_for_a_seed_and_consistent_with_their_views() -> None:
    roles = fleet_roles(6, "split")
    first = list(turns(roles, 200, seed=3))
    assert first == list(turns(roles, 200, seed=3))
    assert first != list(turns(roles, 200, seed=4))
    returning = 0
    for turn, view in first:
        assert [w.role for w in view.workers] == roles
        assert len(view.links) == 6 * 5  # the full mesh, no self-links
        assert view.now_s == turn.arrival_s
        residency = view.residency
        if residency is None:
            assert turn.uncached_tokens == turn.prompt_tokens
            continue
        returning += 1
        holder = view.worker(residency.worker_id)
        assert holder is not None and holder.role == "decode"
        assert 0 < residency.tokens < turn.prompt_tokens
        assert turn.uncached_tokens == turn.prompt_tokens - residency.tokens
    assert 100 < returning < 180  # about 70% return
    # the clock moves on, and every view shares one links tuple as the router's do
    assert all(a[1].now_s < b[1].now_s for a, b in itertools.pairwise(first))
    assert len({id(view.links) for _, view in first}) == 1


class _Recording:
    name = "recording"

    def __init__(self) -> None:
        self.decided: list[str] = []
        self.observed: list[tuple[str, int]] = []

    def decide(self, turn: Turn, view: ClusterView) -> Decision:
        self.decided.append(turn.request_id)
        return Colocate(worker=view.workers[0].worker_id)

    def observe(self, outcome: Outcome) -> None:
        self.observed.append((outcome.request_id, len(self.decided)))
        assert outcome.ok and outcome.action == "colocate"
        assert outcome.decode_worker == "w0"


def test_each_outcome_is_observed_once_inflight_turns_later() -> None:
    policy = _Recording()
    samples = time_decisions(policy, fleet_roles(2, "mixed"), 50, inflight=8, seed=1)
    assert len(samples) == 50 and all(s >= 0.0 for s in samples)
    assert [rid for rid, _ in policy.observed] == policy.decided[:42]
    assert all(decided == int(rid[1:]) + 9 for rid, decided in policy.observed)


@pytest.mark.parametrize("name", ["adaptive", "colocate", "round-robin", "threshold"])
@pytest.mark.parametrize("layout", ["mixed", "split"])
def test_every_builtin_policy_places_the_timed_turns_in_the_fleet(name: str, layout: str) -> None:
    roles = fleet_roles(4, layout)
    policy = create_policy(name)
    placed: list[Decision] = []

    class Watching:
        name = "watching"

        def decide(self, turn: Turn, view: ClusterView) -> Decision:
            decision = policy.decide(turn, view)
            placed.append(decision)
            return decision

        def observe(self, outcome: Outcome) -> None:
            policy.observe(outcome)

    time_decisions(Watching(), roles, 60, inflight=4, seed=2)
    named = {f"w{i}" for i in range(4)}
    for decision in placed:
        for field in ("worker", "prefill_worker", "decode_worker"):
            value = getattr(decision, field, None)
            assert value is None or value in named


def test_with_a_scrape_interval_each_worker_is_drawn_once_an_interval_and_shared_between() -> None:
    """Each view names the workers built again since the view before (`changes`): those
    scraped since, and the turn's two in-flight moves."""
    roles = fleet_roles(16, "mixed")
    interval = 0.25
    timed = list(turns(roles, 400, seed=5, scrape_interval_s=interval))
    assert timed == list(turns(roles, 400, seed=5, scrape_interval_s=interval))
    scraped: dict[str, list[float]] = {}
    for (_, before), (_, after) in itertools.pairwise(timed):
        changed = [(a, b) for a, b in zip(before.workers, after.workers, strict=True) if a is not b]
        # the view names every worker built again since the view before (and no other)
        assert after.changes is not None and after.changes.since is before.workers
        pairs = zip(before.workers, after.workers, strict=True)
        rebuilt = {i for i, (a, b) in enumerate(pairs) if a is not b}
        assert rebuilt == set(after.changes.positions)
        # the turn's two in-flight moves, and the workers scraped since the turn before
        moved = [b for a, b in changed if b.scraped_at_s == a.scraped_at_s]
        assert len(moved) <= 2
        assert sum(abs(b.inflight - a.inflight) for a, b in changed if b in moved) <= 2
        for _, worker in changed:
            if worker not in moved:
                assert worker.scraped_at_s == after.now_s
                scraped.setdefault(worker.worker_id, []).append(after.now_s)
    span = timed[-1][1].now_s - timed[0][1].now_s
    for times in scraped.values():
        # at the first turn past each due time (turns come about 5 ms apart)
        assert all(0.5 * interval < b - a < 1.5 * interval for a, b in itertools.pairwise(times))
        assert span / interval - 2 <= len(times) <= span / interval + 1
