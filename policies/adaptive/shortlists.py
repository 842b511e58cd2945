"""Which workers `adaptive` scores a turn's legs on: a few per role, never the whole fleet.

Scoring every pair of prefill and decode workers grows with the square of the fleet, and
scoring every worker at all with the fleet; the shortlists keep it to a few candidates each,
those likeliest to win: the least loaded, the ones a placement there costs least, and the one
holding the session's prefix. What picks them reads no more of a worker than its load
(`load_score`, ranked as the views change: `policies.adaptive.fleet`) and the `StallLedger`'s
order (its own heap), so a turn's cost stays flat as the fleet grows; an exhaustive search
(`exhaustive`) ranks every worker by its terms instead.
"""

from __future__ import annotations

from policies.adaptive.fleet import FleetIndex
from policies.adaptive.ledgers.legs import StallLedger
from policies.adaptive.scoring import Scorer
from policies.eligibility import PREFILL_ROLES, can_serve
from policies.types import WorkerView


def decode_shortlist(screen: list[WorkerView], count: int, scorer: Scorer) -> list[WorkerView]:
    """Of `screen` (least loaded first), the `count` least loaded and the `count` whose slow
    steps least expose an answer decoded there."""
    if len(screen) <= count:
        return screen
    chosen = screen[:count]
    calm = sorted(screen, key=lambda w: (scorer.exposure(w), *_load_key(w)))[:count]
    return chosen + [w for w in calm if all(w is not c for c in chosen)]


def prefill_shortlist(
    fleet: FleetIndex,
    count: int,
    prefix: tuple[str, int] | None,
    scorer: Scorer,
    stalls: StallLedger | None = None,
) -> list[WorkerView]:
    """The `count` least-loaded prefill workers (`FleetIndex.prefill` ranks them), the `count`
    whose recent slow steps already expose what decodes there (another prefill costs the
    answers decoding elsewhere nothing: the `StallLedger`'s busiest, else every worker
    ranked), and the one holding the session's prefix."""
    workers = fleet.index
    keys = fleet.prefill
    chosen = [workers[wid] for wid in fleet.least(keys, count)]
    if len(keys) > count:
        if stalls is None:
            pool = [workers[fleet.id_of(key)] for key in keys]
            busy = sorted(pool, key=lambda w: (-scorer.stall_rate(w), *_load_key(w)))[:count]
        else:
            busy = _busiest(fleet, count, scorer, stalls)
        chosen += [w for w in busy if all(w is not c for c in chosen)]
    if prefix is not None and all(w.worker_id != prefix[0] for w in chosen):
        holder = workers.get(prefix[0])
        if holder is not None and can_serve(holder, PREFILL_ROLES):
            chosen.append(holder)
    return chosen


def _busiest(
    fleet: FleetIndex, count: int, scorer: Scorer, stalls: StallLedger
) -> list[WorkerView]:
    """The `count` prefill workers (of `fleet.prefill`) with the most slow steps lately, then
    the least loaded of those with none: the ledger's busiest few, each ranked by its rate now
    (a decision repeated for its turn leaves its own steps out)."""
    workers = fleet.index
    hosts: list[tuple[float, int, str, WorkerView]] = []
    for wid in stalls.busiest(2 * count + 2):
        worker = workers.get(wid)
        if worker is not None and can_serve(worker, PREFILL_ROLES):
            rate = scorer.stall_rate(worker)
            if rate > 0.0:
                hosts.append((-rate, *_load_key(worker), worker))
    hosts.sort(key=lambda host: host[:3])
    busy = [host[3] for host in hosts[:count]]
    if len(busy) < count:
        taken = {w.worker_id for w in busy}
        calm = [wid for wid in fleet.least(fleet.prefill, count + len(busy)) if wid not in taken]
        busy += [workers[wid] for wid in calm[: count - len(busy)]]
    return busy


def _load_key(worker: WorkerView) -> tuple[int, str]:
    return worker.inflight + worker.running + 2 * worker.waiting, worker.worker_id
