"""The simulator's link ledger against the live router's Lua scripts, on the same operations.

`bench.des.ledger.LinkLedger` restates `router.state.scripts` for virtual time; here both see
one seeded sequence of reservations and releases and must admit the same ones and end every
step with the same ledger."""

from __future__ import annotations

import random
from functools import partial

import pytest

from bench.des.ledger import LinkLedger
from bench.des.ledger import Reservation as SimReservation
from policies.plan import TransferKind
from router.state.records import LinkState, Reservation
from router.state.shared import SharedState
from tests.router.state.test_shared import eventually, prefix, running

__all__ = ["prefix"]  # the fixture, imported for pytest

LINK = ("w1", "w2")
LEASE_S = 600.0  # no lease runs out within a test: expiry is covered in test_replicas


def ledger_of(state: SharedState) -> tuple[int, int, int, float]:
    seen = state.link_views().get(LINK) or LinkState(src=LINK[0], dst=LINK[1])
    return seen.handoff_bytes, seen.migration_bytes, seen.reservations, seen.observed_bps


def sim_ledger_of(ledger: LinkLedger) -> tuple[int, int, int, float]:
    (view,) = [v for v in ledger.views(0.0) if (v.src, v.dst) == LINK]
    count = ledger._links[LINK].reservations
    return view.reserved_bytes, view.bytes_in_flight, count, view.observed_bps


def agrees(state: SharedState, expected: tuple[int, int, int, float]) -> bool:
    return ledger_of(state) == pytest.approx(expected, rel=1e-12)


def operations(seed: int, count: int) -> list[tuple[str, TransferKind, int, float]]:
    """("reserve", kind, bytes, 0) or ("release", -, bytes moved, seconds)."""
    rng = random.Random(seed)
    ops: list[tuple[str, TransferKind, int, float]] = []
    for _ in range(count):
        if rng.random() < 0.55:
            kind: TransferKind = "handoff" if rng.random() < 0.5 else "migration"
            ops.append(("reserve", kind, rng.choice([1, 300, 700, 1000, 1500, 4000]), 0.0))
        else:
            ops.append(("release", "handoff", rng.choice([0, 500, 2000]),
                        rng.choice([0.0, 0.5, 2.0])))  # fmt: skip
    return ops


@pytest.mark.parametrize(("seed", "capacity_bps"), [(1, 0.0), (2, 5.0), (3, 10.0), (4, 50.0)])
async def test_same_admissions_and_ledger(
    redis_url: str, prefix: str, seed: int, capacity_bps: float
) -> None:
    alpha = 0.3
    sim = LinkLedger([(*LINK, capacity_bps)], lease_s=LEASE_S, ewma_alpha=alpha)
    async with (
        running(redis_url, prefix, "a", ewma_alpha=alpha, reservation_lease_s=LEASE_S) as a,
        running(redis_url, prefix, "b") as b,  # reads the ledger back from Redis
    ):
        if capacity_bps:
            a.set_link_capacity(*LINK, capacity_bps)
            await eventually(lambda: (b.link_views().get(LINK) or LinkState(
                src=LINK[0], dst=LINK[1])).capacity_bps == capacity_bps)  # fmt: skip
        held: list[tuple[Reservation, SimReservation]] = []
        admitted = 0
        for op, kind, nbytes, seconds in operations(seed, 60):
            if op == "reserve":
                live = await a.reserve(*LINK, nbytes, kind)
                simulated = sim.reserve(*LINK, nbytes, kind, now=0.0)
                assert (live is None) == (simulated is None), (op, kind, nbytes)
                if live is not None and simulated is not None:
                    held.append((live, simulated))
                    admitted += 1
            elif held:
                live, simulated = held.pop(0)
                a.release(live, nbytes, seconds)
                sim.release(simulated, nbytes, seconds)
            await eventually(partial(agrees, b, sim_ledger_of(sim)))
        assert admitted > 5  # the sequence exercised the ledger, not only refusals
