"""Faults under load, with real processes: each scenario runs several concurrent multi-turn
streaming sessions across one fault and checks that every request got a full answer or an
OpenAI-shaped error, that nothing hung, that every affected request ended (or moved on) within
`DETECT_BOUND_S` of the moment its fault was detectable, and that the sessions are consistent
afterwards. `pytest -s tests/faults` prints each scenario's row and the suite's table.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import aiohttp
import pytest
import redis

from tests.e2e.conftest import SimCluster
from tests.faults.harness import (
    DETECT_BOUND_S,
    Call,
    Client,
    FakeWorker,
    Fleet,
    RedisServer,
    RouterProc,
    Row,
    clients,
    final_turns,
    metric_total,
    report,
    run_load,
    unacceptable,
    wait_until,
)

pytestmark = [pytest.mark.e2e, pytest.mark.faults]


async def queued_on(http: aiohttp.ClientSession, url: str, at_least: int) -> bool:
    running = await metric_total(http, url, "vllm:num_requests_running")
    waiting = await metric_total(http, url, "vllm:num_requests_waiting")
    return running + waiting >= at_least


def _event(events: dict[str, dict[str, Any]], call: Call) -> dict[str, Any]:
    return events.get(call.request_id, {})


def knew_residency(event: dict[str, Any]) -> bool:
    """Whether the router placed the turn knowing its session's residency: on the resident
    worker, or elsewhere as a recompute since that worker was unavailable (`colocate`'s
    reasons; a new session's placement is a plain "least-loaded decode worker")."""
    return bool(event["reason"] == "resident worker" or event["action"] == "recompute")


def every_call(sessions: Sequence[Client]) -> list[Call]:
    return [call for client in sessions for call in client.calls]


def assert_bounded(row: Row) -> None:
    assert row.hung == 0
    assert row.max_delay_ms <= 1000 * DETECT_BOUND_S, row


async def assert_residency(
    http: aiohttp.ClientSession, router: RouterProc, sessions: Sequence[Client], final: list[Call],
    dead: str,
) -> None:  # fmt: skip
    """After its final turn (answered in full), each session lives where that turn was served,
    which is never the dead worker."""
    assert not unacceptable(final) and all(call.kind == "answer" for call in final), [
        (c.session, c.kind, c.problem) for c in final
    ]
    events = await router.decisions(http, final)
    for client, call in zip(sessions, final, strict=True):
        served = events[call.request_id]["decode_worker"]
        record = await router.session(http, client.session)
        assert record is not None, client.session
        assert record["worker_id"] == served != dead, (client.session, record, served)


async def agree(
    http: aiohttp.ClientSession, routers: Sequence[RouterProc], store: redis.Redis,
    served: dict[str, str],
) -> None:  # fmt: skip
    """Soon (commits are batched), every router's view and Redis hold the same residency for
    each session: the worker that served its last turn, with one epoch and turn count."""
    problems: list[str] = []

    async def check() -> bool:
        problems.clear()
        for session, worker in served.items():
            key = f"{routers[0].prefix}:session:{session}"
            stored = await asyncio.to_thread(store.hgetall, key)
            views = [await router.session(http, session) for router in routers]
            want = (worker, int(stored.get("epoch", -1)), int(stored.get("turns", -1)))
            got = [(v["worker_id"], v["epoch"], v["turns"]) if v else None for v in views]
            if stored.get("owner") != worker or any(g != want for g in got):
                problems.append(f"{session}: served by {worker}, redis {stored}, views {got}")
        return not problems

    try:
        await wait_until(check, 5, "routers and Redis agree on every session")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {problems}") from None


# -- 1. a prefill worker killed while its legs are in flight --------------------------------
async def test_prefill_worker_killed_while_legs_are_in_flight(
    steady: SimCluster, fleet: Fleet, redis_url: str, table: list[Row]
) -> None:
    (victim,) = await fleet.sim_workers(1, "--gpu", "a100-80g")  # a slow prefill
    (router,) = await fleet.routers(
        redis_url, 1, "--prefill", victim.url, "--decode", steady.urls[0],
        "--decode", steady.urls[1], "--policy", "disaggregate",
    )  # fmt: skip
    sessions = clients("pkill", 6, [router.url], words=3000)
    stop = asyncio.Event()
    async with aiohttp.ClientSession() as http:
        load = asyncio.ensure_future(run_load(http, sessions, stop, min_turns=2, max_tokens=24))

        async def prefilling() -> bool:  # one prefill answered, more queued or running
            done = await metric_total(http, victim.url, "vllm:request_success_total")
            return done >= 1 and await queued_on(http, victim.url, 2)

        await wait_until(prefilling, 10, "prefill legs under way on the victim", every_s=0.01)
        killed_at = victim.kill()
        await asyncio.sleep(1.0)
        stop.set()
        await load
        final = await final_turns(http, sessions, 24)
        calls = every_call(sessions)
        events = await router.decisions(http, calls)
        # a leg the kill broke: decode recomputes the prompt; one it refused: the turn is
        # decided once more (then colocated on a decode worker)
        affected = [
            (c, killed_at) for c in calls if c.in_flight_at(killed_at)
            and (_event(events, c).get("prefill_worker") == victim.id
                 or _event(events, c).get("retried"))
        ]  # fmt: skip
        recomputed = sum(_event(events, c).get("recomputed_tokens", 0) > 0 for c, _ in affected)
        retried = sum(bool(_event(events, c).get("retried")) for c, _ in affected)
        row = report("prefill worker killed (SIGKILL)", calls, affected,
                     f"{recomputed} recomputed on decode, {retried} decided again")  # fmt: skip
        table.append(row)
        assert not unacceptable(calls), unacceptable(calls)
        assert_bounded(row)
        assert row.affected >= 2
        await assert_residency(http, router, sessions, final, victim.id)
        assert (await router.workers(http))[victim.id]["healthy"] is False


# -- 2. a decode worker killed mid-stream --------------------------------------------------
async def test_decode_worker_killed_mid_stream(
    steady: SimCluster, fleet: Fleet, redis_url: str, table: list[Row]
) -> None:
    (victim,) = await fleet.sim_workers(1)
    (router,) = await fleet.routers(
        redis_url, 1, "--prefill", steady.urls[0], "--decode", victim.url,
        "--decode", steady.urls[1], "--policy", "disaggregate",
    )  # fmt: skip
    sessions = clients("dkill", 6, [router.url], words=400)
    stop = asyncio.Event()
    async with aiohttp.ClientSession() as http:
        load = asyncio.ensure_future(
            run_load(http, sessions, stop, min_turns=2, max_tokens=200, stagger_s=0.05)
        )
        await wait_until(lambda: queued_on(http, victim.url, 2), 10,
                         "two streams decoding on the victim")  # fmt: skip
        await asyncio.sleep(0.3)  # well into their streams
        killed_at = victim.kill()
        await asyncio.sleep(1.0)
        stop.set()
        await load
        final = await final_turns(http, sessions, 24)
        calls = every_call(sessions)
        events = await router.decisions(http, calls)
        affected = [
            (c, killed_at) for c in calls if c.in_flight_at(killed_at)
            and _event(events, c).get("decode_worker") == victim.id
        ]  # fmt: skip
        cut_short = sum(c.kind == "error" for c, _ in affected)
        row = report("decode worker killed mid-stream", calls, affected,
                     f"{cut_short} streams ended by an error event")  # fmt: skip
        table.append(row)
        assert not unacceptable(calls), unacceptable(calls)
        assert_bounded(row)
        assert cut_short >= 1 and cut_short == row.affected
        await assert_residency(http, router, sessions, final, victim.id)
        assert (await router.workers(http))[victim.id]["healthy"] is False


# -- 3. the prefill worker killed while decode workers pull its KV --------------------------
async def test_prefill_worker_killed_during_transfer(
    steady: SimCluster, fleet: Fleet, redis_url: str, table: list[Row]
) -> None:
    # a slow NIC: 2000 tokens of KV (262 MB) take ~0.35 s to pull from it; sessions start
    # 0.4 s apart, so that one pull at a time is under way
    (victim,) = await fleet.sim_workers(1, "--nic-gbps", "6")
    (router,) = await fleet.routers(
        redis_url, 1, "--prefill", victim.url, "--decode", steady.urls[1],
        "--decode", steady.urls[2], "--policy", "disaggregate",
    )  # fmt: skip
    sessions = clients("xkill", 6, [router.url], words=2000)
    stop = asyncio.Event()
    async with aiohttp.ClientSession() as http:
        load = asyncio.ensure_future(
            run_load(http, sessions, stop, min_turns=2, max_tokens=24, stagger_s=0.4)
        )

        async def answered_a_prefill() -> bool:
            return await metric_total(http, victim.url, "vllm:request_success_total") >= 1

        await wait_until(answered_a_prefill, 10, "a prefill leg answered", every_s=0.005)
        await asyncio.sleep(0.05)  # its answer reached the router, which sent the decode leg
        killed_wall, killed_at = time.time(), victim.kill()
        await asyncio.sleep(1.0)
        stop.set()
        await load
        final = await final_turns(http, sessions, 24)
        calls = every_call(sessions)
        events = await router.decisions(http, calls)
        affected = [
            (c, killed_at) for c in calls if c.in_flight_at(killed_at)
            and (_event(events, c).get("prefill_worker") == victim.id
                 or _event(events, c).get("retried"))
        ]  # fmt: skip
        # its prefill leg answered before the kill: its decode worker was to pull the KV
        pulling = [
            c for c, _ in affected
            if (_event(events, c).get("prefill_end") or killed_wall + 1) < killed_wall
        ]  # fmt: skip
        # the decode worker moved the KV (the source died mid-pull), or found the source gone
        # and prefilled itself: as on vLLM, no answer says which (the engines count failed
        # pulls), only that it was answered
        retried = sum(bool(_event(events, c).get("retried")) for c, _ in affected)
        row = report("prefill worker killed in transfer", calls, affected,
                     f"{len(pulling)} decode legs were pulling (each pulled or prefilled "
                     f"locally), {retried} decided again")  # fmt: skip
        table.append(row)
        assert not unacceptable(calls), unacceptable(calls)
        assert_bounded(row)
        assert pulling, "no decode worker was pulling at the kill"
        assert all(c.kind == "answer" for c in pulling)
        await assert_residency(http, router, sessions, final, victim.id)
        assert (await router.workers(http))[victim.id]["healthy"] is False


# -- 4. a worker that accepts and never answers ----------------------------------------------
DEADLINE_S = 0.5


async def test_worker_that_never_answers_is_left_at_its_deadline_and_ejected(
    steady: SimCluster, fleet: Fleet, redis_url: str, table: list[Row]
) -> None:
    hang = FakeWorker("hang")
    await hang.start()
    try:
        await _never_answers(hang, steady, fleet, redis_url, table)
    finally:
        await hang.stop()


async def _never_answers(
    hang: FakeWorker, steady: SimCluster, fleet: Fleet, redis_url: str, table: list[Row]
) -> None:
    (router,) = await fleet.routers(
        redis_url, 1, "--mixed", hang.url, "--mixed", steady.urls[0], "--mixed", steady.urls[1],
        "--policy", "colocate", "--first-byte-timeout-s", str(DEADLINE_S),
        "--head-timeout-s", str(DEADLINE_S), "--first-byte-ttft-multiple", "1",
        "--eject-consecutive-failures", "3",
    )  # fmt: skip
    headers = {"X-SLO-TTFT-Ms": "200"}  # first byte due by max(0.5 s, 1 x 200 ms)
    sessions = clients("hang", 12, [router.url], words=300)  # new ones every 0.1 s
    async with aiohttp.ClientSession() as http:
        await wait_until(lambda: _all_healthy(http, router), 5, "every worker scraped healthy")
        ejected_seen: list[float] = []

        async def watch() -> None:
            while not ejected_seen:
                if (await router.workers(http))[hang.id]["ejected"]:
                    ejected_seen.append(time.monotonic())
                await asyncio.sleep(0.02)

        watcher = asyncio.ensure_future(watch())
        try:
            await run_load(http, sessions, None, min_turns=3, max_tokens=24,
                           headers=headers, stagger_s=0.1)  # fmt: skip
            await wait_until(lambda: _done(watcher), 3, "the silent worker ejected")
        finally:
            watcher.cancel()
        # new sessions after the ejection: none of them goes there
        fresh = clients("hang-new", 4, [router.url], words=300)
        arrivals = len(hang.arrivals)
        final = await final_turns(http, [*sessions, *fresh], 24, headers)
        calls = every_call([*sessions, *fresh])
        events = await router.decisions(http, calls)
        affected = [
            (c, c.start + DEADLINE_S) for c in calls
            if events.get(c.request_id, {}).get("retried") or c.kind != "answer"
        ]  # fmt: skip
        row = report("worker never answers", calls, affected,
                     f"{arrivals} requests reached it, then ejected")  # fmt: skip
        table.append(row)
        assert not unacceptable(calls), unacceptable(calls)
        assert_bounded(row)
        assert row.affected >= 3 and arrivals >= 3
        assert all(at <= ejected_seen[0] for at in hang.arrivals), "a request after ejection"
        assert (await router.workers(http))[hang.id]["ejected"] is True
        await assert_residency(http, router, [*sessions, *fresh], final, hang.id)


async def _all_healthy(http: aiohttp.ClientSession, router: RouterProc) -> bool:
    rows = await router.workers(http)
    return all(row["healthy"] and row["load"] is not None for row in rows.values())


async def _done(task: asyncio.Future[None]) -> bool:
    return task.done()


# -- 5. a worker answering 500 to every completion ------------------------------------------
async def test_worker_answering_500_is_ejected_and_gets_no_new_sessions(
    steady: SimCluster, fleet: Fleet, redis_url: str, table: list[Row]
) -> None:
    failing = FakeWorker("error")
    await failing.start()
    try:
        await _answers_500(failing, steady, fleet, redis_url, table)
    finally:
        await failing.stop()


async def _answers_500(
    failing: FakeWorker, steady: SimCluster, fleet: Fleet, redis_url: str, table: list[Row]
) -> None:
    (router,) = await fleet.routers(
        redis_url, 1, "--mixed", failing.url, "--mixed", steady.urls[0],
        "--mixed", steady.urls[1], "--policy", "colocate", "--eject-consecutive-failures", "3",
    )  # fmt: skip
    sessions = clients("e500", 8, [router.url], words=300)
    async with aiohttp.ClientSession() as http:
        await wait_until(lambda: _all_healthy(http, router), 5, "every worker scraped healthy")
        await run_load(http, sessions, None, min_turns=3, max_tokens=24)
        workers = await router.workers(http)
        arrivals = len(failing.arrivals)
        fresh = clients("e500-new", 4, [router.url], words=300)
        final = await final_turns(http, [*sessions, *fresh], 24)
        calls = every_call([*sessions, *fresh])
        affected = [(c, c.start) for c in calls if c.kind == "error"]
        row = report("worker answers 500", calls, affected,
                     f"{arrivals} requests reached it, then ejected")  # fmt: skip
        table.append(row)
        assert not unacceptable(calls), unacceptable(calls)
        assert workers[failing.id]["ejected"] is True
        assert len(failing.arrivals) == arrivals, "an ejected worker got new requests"
        assert row.errors >= 3
        assert_bounded(row)
        await assert_residency(http, router, [*sessions, *fresh], final, failing.id)


# -- 6. Redis killed and restarted empty under two routers ----------------------------------
async def test_redis_killed_and_restarted_empty(
    steady: SimCluster, fleet: Fleet, table: list[Row]
) -> None:
    server = RedisServer()
    server.start()
    try:
        await _redis_outage(server, steady, fleet, table)
    finally:
        fleet.stop()
        server.stop()


async def _redis_outage(
    server: RedisServer, steady: SimCluster, fleet: Fleet, table: list[Row]
) -> None:
    mixed = [arg for url in steady.urls for arg in ("--mixed", url)]
    routers = await fleet.routers(server.url, 2, *mixed, "--policy", "colocate")
    sessions = clients("redis", 8, [r.url for r in routers], words=300)
    # and two roaming sessions, each turn to the other router (before, in and after the outage)
    roaming = clients("roam", 2, [routers[0].url], words=300)
    for client in roaming:
        client.router = lambda c=client: routers[len(c.calls) % 2].url  # type: ignore[misc]
    sessions += roaming
    stop = asyncio.Event()
    async with aiohttp.ClientSession() as http:
        load = asyncio.ensure_future(run_load(http, sessions, stop, min_turns=3, max_tokens=48))

        async def all_resident() -> bool:
            return all(any(c.kind == "answer" for c in s.calls) for s in sessions)

        await wait_until(all_resident, 10, "every session answered once")
        key = f"{routers[0].prefix}:session:"
        before: dict[str, dict[str, str]] = {}

        async def all_stored() -> bool:
            for c in sessions:
                before[c.session] = await asyncio.to_thread(server.hgetall, key + c.session)
            return all(before.values())

        await wait_until(all_stored, 5, "every session in Redis")
        killed_at = server.kill()

        async def degraded(flag: bool) -> bool:
            return all([(await r.health(http))["degraded"] is flag for r in routers])

        await wait_until(lambda: degraded(True), 5, "both routers degraded")
        await asyncio.sleep(1.0)  # turns go on meanwhile
        await asyncio.to_thread(server.start)  # empty: it persists nothing
        recovered_at = await wait_until(lambda: degraded(False), 10, "both routers recovered")
        await asyncio.sleep(0.5)
        stop.set()
        await load
        final = await final_turns(http, sessions, 24)
        calls = every_call(sessions)
        affected = [(c, killed_at) for c in calls if c.end > killed_at and c.start < recovered_at]
        during = [c for c in calls if killed_at < c.start < recovered_at]
        row = report("redis killed, restarted empty", calls, affected,
                     f"{len(during)} turns began in the {recovered_at - killed_at:.1f} s "
                     "outage, 2 routers")  # fmt: skip
        table.append(row)
        assert not unacceptable(calls), unacceptable(calls)
        assert row.errors == 0 and row.answered == row.requests  # served through the outage
        assert len(during) >= len(sessions)
        assert_bounded(row)
        # No turn after a session's first was placed as a new session's: each router knew its
        # residency all along, through the outage and the empty restart (a turn leaves its
        # worker only as a recompute, where that worker was unavailable)
        served = {}
        decisions = {r.url: await r.decisions(http, calls) for r in routers}
        for client, call in zip(sessions, final, strict=True):
            served[client.session] = decisions[call.router][call.request_id]["decode_worker"]
            turns = [decisions[c.router][c.request_id] for c in client.calls]
            history = [(round(c.start - killed_at, 3), t["decode_worker"], t["reason"])
                       for c, t in zip(client.calls, turns, strict=True)]  # fmt: skip
            # (a roaming session's second turn may reach the other router before the first
            # turn's commit reached Redis: commits are batched, nobody waits for them)
            later = turns[2:] if client in roaming else turns[1:]
            assert all(knew_residency(t) for t in later), (client.session, history)
        with server.client() as store:
            await agree(http, routers, store, served)
        for client in sessions:  # epochs and turn counts never went back
            stored, earlier = server.hgetall(key + client.session), before[client.session]
            assert int(stored["epoch"]) > int(earlier["epoch"])
            assert int(stored["turns"]) > int(earlier["turns"])


# -- 7. one of two routers killed ----------------------------------------------------------
COMMITTED_S = 0.25  # a router's commit is in Redis this soon (it batches every 5 ms)


async def test_one_of_two_routers_killed(
    steady: SimCluster, fleet: Fleet, redis_url: str, table: list[Row]
) -> None:
    mixed = [arg for url in steady.urls for arg in ("--mixed", url)]
    survivor, victim = await fleet.routers(redis_url, 2, *mixed, "--policy", "colocate")
    alive = {survivor.url: True, victim.url: True}

    def to(url: str) -> str:
        return url if alive[url] else survivor.url  # a client of the dead one fails over

    sessions = clients("rkill", 8, [survivor.url, victim.url], words=300)
    for client in sessions:
        home = client.router()
        client.router = lambda home=home: to(home)  # type: ignore[misc]
    stop = asyncio.Event()
    async with aiohttp.ClientSession() as http:
        load = asyncio.ensure_future(run_load(http, sessions, stop, min_turns=3, max_tokens=120))

        async def streaming_on_victim() -> bool:
            return any(c.router == victim.url and c.end == 0.0 and len(c.events) >= 120
                       for s in sessions for c in s.calls)  # fmt: skip

        await wait_until(lambda: _answered_once(sessions), 10, "every session answered once")
        await wait_until(streaming_on_victim, 5, "a stream well under way on the victim",
                         every_s=0.005)  # fmt: skip
        before = await victim.decisions(http)  # what it served: every session's owner
        killed_wall, killed_at = time.time(), victim.kill()
        alive[victim.url] = False
        await asyncio.sleep(1.0)
        stop.set()
        await load
        final = await final_turns(http, sessions, 24)
        calls = every_call(sessions)
        cut = [c for c in calls if c.router == victim.url and c.in_flight_at(killed_at)]
        others = [c for c in calls if c not in cut]
        affected = [(c, killed_at) for c in calls if c.in_flight_at(killed_at)]
        row = report("one of two routers killed", calls, affected,
                     f"{len(cut)} streams cut with the router")  # fmt: skip
        table.append(row)
        assert cut and all(c.kind == "cut" for c in cut)
        assert not unacceptable(others), unacceptable(others)
        on_survivor = [c for c in calls if c.router == survivor.url]
        assert all(c.kind == "answer" for c in on_survivor), "the other router's clients suffered"
        assert_bounded(row)
        events = await survivor.decisions(http, calls)
        owners = {e["session_id"]: e["decode_worker"] for e in before.values()}
        last_done: dict[str, float] = {}
        for e in before.values():
            last_done[e["session_id"]] = max(e["done"], last_done.get(e["session_id"], 0.0))
        checked = 0
        for client in sessions:
            if client.calls[0].router != victim.url:
                continue
            if last_done[client.session] > killed_wall - COMMITTED_S:
                continue  # its last commit may have died with the router, unsent
            # its first turn on the survivor found the session where the dead router left it
            moved = next(c for c in client.calls if c.router == survivor.url)
            event = events[moved.request_id]
            assert knew_residency(event), (client.session, event)
            assert event["decode_worker"] == owners[client.session] or (
                event["action"] == "recompute"
            )
            checked += 1
        assert checked >= 2, "too few sessions to check the failover with"
        served = {c.session: events[call.request_id]["decode_worker"]
                  for c, call in zip(sessions, final, strict=True)}  # fmt: skip
        store = redis.Redis.from_url(redis_url, decode_responses=True)
        try:
            await agree(http, [survivor], store, served)
        finally:
            store.close()

        async def no_stale_inflight() -> bool:
            rows = await survivor.workers(http)
            return all(row["fleet_inflight"] == 0 for row in rows.values())

        # the dead replica's in-flight counts expire with its heartbeat
        await wait_until(no_stale_inflight, 5, "the dead router's in-flight counts expired")


async def _answered_once(sessions: Sequence[Client]) -> bool:
    return all(any(c.kind == "answer" for c in s.calls) for s in sessions)
