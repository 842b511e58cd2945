"""What a placement decision costs in CPU, per policy and fleet size.

A router replica calls `decide` once per turn and `observe` once per finished turn, on its one
event loop: their cost bounds the turns a replica places per CPU second and adds to every
turn's latency. This times both, outside any I/O, on synthetic fleets of N workers (all mixed,
or half prefill and half decode) whose scraped load varies from turn to turn, with the fleet's
full mesh of links (one tuple, reused as the router reuses it between ledger refreshes). Most
turns return to a session resident on some decode-capable worker; each turn's outcome is
observed after `--inflight` later turns were placed, as turns finish in a live router. The
fleets and turns come from `--seed`, so two runs (two commits) time the same decisions. Each
sample is CPU time (`time.process_time`): on a shared machine, wall time also counts the turns
the process waited for a core.

    .venv/bin/python -m bench.scripts.decision_cost --workers 2,8,16,64,256,512
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import statistics
import time
from collections import deque
from collections.abc import Iterator

import msgspec

from policies import create_policy
from policies.base import Policy
from policies.types import (
    ClusterView,
    Decision,
    LinkView,
    Objectives,
    Outcome,
    Residency,
    Turn,
    WorkerChanges,
    WorkerView,
    action_of,
)

_PROMPTS = (512, 2048, 4096, 16384)
_KV_BYTES_PER_TOKEN = 131072


def fleet_roles(count: int, layout: str) -> list[str]:
    if layout == "mixed":
        return ["mixed"] * count
    if layout == "split":
        return ["prefill" if i % 2 == 0 else "decode" for i in range(count)]
    raise ValueError(f"unknown layout {layout!r}: mixed or split")


def _links(count: int) -> tuple[LinkView, ...]:
    return tuple(
        LinkView(src=f"w{i}", dst=f"w{j}", capacity_bps=50e9, latency_s=20e-6)
        for i in range(count) for j in range(count) if i != j
    )  # fmt: skip


def _drawn(rng: random.Random, i: int, role: str, scraped_at_s: float | None = None) -> WorkerView:
    """Worker `i` as a scrape finds it: its load drawn from `rng`."""
    return WorkerView(
        worker_id=f"w{i}", role=role, healthy=True,  # type: ignore[arg-type]
        running=0 if role == "prefill" else rng.randint(0, 48),
        waiting=rng.choice((0, 0, 0, 1, 2, 5)), kv_usage=rng.uniform(0.05, 0.95),
        inflight=rng.randint(0, 48), node=f"n{i // 8}",
        scraped_age_s=rng.uniform(0.0, 0.1), scraped_at_s=scraped_at_s,
    )  # fmt: skip


def turns(
    roles: list[str], count: int, seed: int, scrape_interval_s: float = 0.0
) -> Iterator[tuple[Turn, ClusterView]]:
    """`count` turns, each with the fleet as its decision sees it: with `scrape_interval_s`
    0, every worker's load drawn again for every turn; else each worker scraped once an
    interval (at a phase of its own) and two in-flight counts moved by one per turn (a leg
    sent, one ended), the other workers' views shared with the turn before, as the router
    and the simulator share them (and name the ones built again: `ClusterView.changes`)."""
    rng = random.Random(seed)
    links = _links(len(roles))
    decoders = [f"w{i}" for i, role in enumerate(roles) if role != "prefill"]
    now = 1_000_000.0
    views: list[WorkerView] = []
    due: list[float] = []  # each worker's next scrape
    workers: tuple[WorkerView, ...] = ()
    for n in range(count):
        now += rng.expovariate(200.0)
        changes = None
        if scrape_interval_s <= 0.0:
            workers = tuple(_drawn(rng, i, role) for i, role in enumerate(roles))
        elif not views:
            views = [_drawn(rng, i, role, now) for i, role in enumerate(roles)]
            due = [now + rng.uniform(0.0, scrape_interval_s) for _ in roles]
            workers = tuple(views)
        else:
            changed: list[int] = []  # the views built again: the view's `changes`
            for i, role in enumerate(roles):
                if due[i] <= now:
                    views[i] = _drawn(rng, i, role, now)
                    due[i] += scrape_interval_s * (1 + (now - due[i]) // scrape_interval_s)
                    changed.append(i)
            for _ in range(2):
                i = rng.randrange(len(roles))
                moved = views[i].inflight + rng.choice((-1, 1))
                views[i] = msgspec.structs.replace(views[i], inflight=moved if moved > 0 else 0)
                changed.append(i)
            changes = WorkerChanges(since=workers, positions=tuple(changed))
            workers = tuple(views)
        prompt = rng.choice(_PROMPTS)
        residency = None
        uncached = prompt
        if rng.random() < 0.7:
            resident = rng.randrange(prompt // 2, prompt)
            uncached = prompt - resident
            residency = Residency(worker_id=rng.choice(decoders), tokens=resident,
                                  bytes=resident * _KV_BYTES_PER_TOKEN, epoch=1)  # fmt: skip
        turn = Turn(
            session_id=f"s{rng.randrange(count)}", request_id=f"r{n}", prompt_tokens=prompt,
            uncached_tokens=uncached, max_tokens=rng.choice((64, 256, 512)),
            objectives=Objectives(ttft_ms=1000.0 + 0.2 * prompt, itl_ms=100.0), arrival_s=now,
        )  # fmt: skip
        yield turn, ClusterView(now_s=now, workers=workers, links=links, residency=residency,
                                kv_bytes_per_token=_KV_BYTES_PER_TOKEN,
                                changes=changes)  # fmt: skip


def _outcome(turn: Turn, decision: Decision) -> Outcome:
    action = action_of(decision)
    prefill = getattr(decision, "prefill_worker", None) or getattr(decision, "worker", None)
    decode = getattr(decision, "decode_worker", None) or getattr(decision, "worker", None)
    ok = action != "reject"
    cached = turn.prompt_tokens - turn.uncached_tokens
    return Outcome(
        request_id=turn.request_id, session_id=turn.session_id, action=action,
        prefill_worker=prefill, decode_worker=decode, prompt_tokens=turn.prompt_tokens,
        cached_tokens=cached, completion_tokens=turn.max_tokens if ok else 0, ok=ok,
        queue_ms=5.0 if ok else None, prefill_ms=0.05 * turn.uncached_tokens if ok else None,
        ttft_ms=10.0 + 0.05 * turn.uncached_tokens if ok else None,
        decode_ms=20.0 * turn.max_tokens if ok else None,
    )  # fmt: skip


def time_decisions(
    policy: Policy, roles: list[str], count: int, inflight: int, seed: int,
    scrape_interval_s: float = 0.0,
) -> list[float]:  # fmt: skip
    """Seconds of `decide` plus the `observe` of the turn it retires, per turn."""
    pending: deque[tuple[Turn, Decision]] = deque()
    clock = time.process_time
    samples: list[float] = []
    for turn, view in turns(roles, count, seed, scrape_interval_s):
        started = clock()
        decision = policy.decide(turn, view)
        if len(pending) >= inflight:
            policy.observe(_outcome(*pending.popleft()))
        samples.append(clock() - started)
        pending.append((turn, decision))
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--policies", default="adaptive,colocate,round-robin,threshold")
    parser.add_argument("--workers", default="2,8,16,64,256,512", help="fleet sizes")
    parser.add_argument("--layouts", default="mixed,split")
    parser.add_argument("--decisions", type=int, default=600)
    parser.add_argument("--warmup", type=int, default=100, help="turns not timed, first")
    parser.add_argument("--inflight", type=int, default=32)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--scrape-interval", type=float, default=0.0, metavar="S",
        help="each worker's load drawn again once every S seconds, its view shared between "
        "(the router's default is 0.25); 0: every worker's for every turn",
    )  # fmt: skip
    parser.add_argument("--profile", metavar="FILE", help="cProfile everything into FILE")
    args = parser.parse_args()
    profile = cProfile.Profile() if args.profile else None
    print(f"{'policy':>12} {'workers':>8} {'layout':>6} {'mean us':>8} {'p50 us':>8} "
          f"{'p99 us':>8} {'per core/s':>10}")  # fmt: skip
    for name in args.policies.split(","):
        for count in (int(n) for n in args.workers.split(",")):
            for layout in args.layouts.split(","):
                roles = fleet_roles(count, layout)
                policy = create_policy(name)
                if profile is not None:
                    profile.enable()
                samples = time_decisions(
                    policy,
                    roles,
                    args.warmup + args.decisions,
                    args.inflight,
                    args.seed,
                    args.scrape_interval,
                )[args.warmup :]
                if profile is not None:
                    profile.disable()
                mean = statistics.fmean(samples)
                p50 = statistics.median(samples)
                p99 = statistics.quantiles(samples, n=100)[98]
                print(f"{name:>12} {count:>8} {layout:>6} {mean * 1e6:>8.1f} {p50 * 1e6:>8.1f} "
                      f"{p99 * 1e6:>8.1f} {1 / mean:>10.0f}")  # fmt: skip
    if profile is not None:
        profile.dump_stats(args.profile)
        pstats.Stats(args.profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
