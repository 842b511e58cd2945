"""Which workers `adaptive` scores a turn's legs on: a few per role, never the whole fleet.

Scoring every pair of prefill and decode workers grows with the square of the fleet; the
shortlists keep it to a few candidates each, those likeliest to win: the least loaded, the ones
a placement there costs least, and the one holding the session's prefix.
"""

from __future__ import annotations

from policies.adaptive.scoring import Scorer
from policies.eligibility import load_score
from policies.types import WorkerView


def decode_shortlist(workers: list[WorkerView], count: int, scorer: Scorer) -> list[WorkerView]:
    """The `count` least-loaded workers, and the `count` whose slow steps least expose an
    answer decoded there."""
    if len(workers) <= count:
        return workers
    chosen = _least_loaded(workers, count)
    calm = sorted(workers, key=lambda w: (scorer.exposure(w), *_load_key(w)))[:count]
    return chosen + [w for w in calm if all(w is not c for c in chosen)]


def prefill_shortlist(
    workers: list[WorkerView], count: int, prefix: tuple[str, int] | None, scorer: Scorer
) -> list[WorkerView]:
    """The `count` least-loaded prefill workers, the `count` whose recent slow steps already
    expose what decodes there (another prefill costs the answers decoding elsewhere nothing),
    and the one holding the session's prefix."""
    chosen = _least_loaded(workers, count)
    if len(workers) > count:
        busy = sorted(workers, key=lambda w: (-scorer.stall_rate(w), *_load_key(w)))[:count]
        chosen += [w for w in busy if all(w is not c for c in chosen)]
    if prefix is not None and all(w.worker_id != prefix[0] for w in chosen):
        chosen = chosen + [w for w in workers if w.worker_id == prefix[0]]
    return chosen


def _least_loaded(workers: list[WorkerView], count: int) -> list[WorkerView]:
    if len(workers) > count:
        return sorted(workers, key=_load_key)[:count]
    return workers


def _load_key(worker: WorkerView) -> tuple[int, str]:
    return load_score(worker), worker.worker_id
