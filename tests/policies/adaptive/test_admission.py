from __future__ import annotations

import random

import msgspec
import pytest

from policies import ClusterView, Objectives, Outcome, Reject, Turn, WorkerView, create_policy
from policies.adaptive import tuning
from policies.adaptive.admission import Admission, Deadlines
from policies.adaptive.tuning import FRESH_WINDOW, MAX_FACTOR, MAX_TRACKED_REQUESTS, PROBE_AFTER_S


def _staggered(sessions: int, turns: int, tag: str = "") -> list[tuple[str, str]]:
    """(session, request) of `sessions` sessions of `turns` turns each, one starting per
    round while those started before send their next turns, as steady traffic sends them."""
    return [
        (f"{tag}s{s}", f"{tag}s{s}-t{t}")
        for step in range(sessions + turns - 1)
        for t in range(turns)
        if 0 <= (s := step - t) < sessions
    ]


@pytest.mark.parametrize(
    ("turns", "continuing"),
    [(1, 0.0), (2, 0.5), (4, 0.75), (8, 0.875)],
    ids=["single turns", "2 turns", "4 turns", "8 turns"],
)
def test_the_share_of_turns_continuing_a_session(turns: int, continuing: float) -> None:
    admission = Admission()
    for session, request in _staggered(400, turns):
        admission.note(session, request)
    assert admission.continuing == pytest.approx(continuing, abs=0.05)
    assert admission.limit_ms(1000.0) == pytest.approx(1000.0 / (1.0 - admission.continuing))


def test_the_limit_is_bounded_when_nearly_every_turn_continues() -> None:
    admission = Admission()
    for session, request in _staggered(2, 400):
        admission.note(session, request)
    assert admission.continuing > 1.0 - 1.0 / MAX_FACTOR
    assert admission.limit_ms(100.0) == pytest.approx(100.0 * MAX_FACTOR)


def test_nothing_seen_rejects_at_the_objective() -> None:
    assert Admission().limit_ms(750.0) == 750.0


def test_a_turn_decided_again_counts_once() -> None:
    once, twice = Admission(), Admission()
    for session, request in _staggered(5, 3):
        once.note(session, request)
        twice.note(session, request)
        twice.note(session, request)
    assert twice.continuing == once.continuing
    assert once.continuing > 0.0


def test_forgotten_sessions_count_as_fresh() -> None:
    """Memory is bounded: past it the oldest sessions go first."""
    admission = Admission()
    for i in range(MAX_TRACKED_REQUESTS + 1):
        admission.note(f"s{i}", f"r{i}")
    assert admission.continuing == 0.0
    admission.note("s0", "r0-again")  # among the quarter forgotten
    assert admission.continuing == 0.0
    admission.note(f"s{MAX_TRACKED_REQUESTS}", "again")  # the newest, remembered
    assert admission.continuing > 0.0


def _worker(worker_id: str) -> WorkerView:
    return msgspec.convert({"worker_id": worker_id, "role": "decode", "healthy": True}, WorkerView)


def _turn(session: str, request: str, ttft_ms: float = 1000.0) -> Turn:
    return Turn(session_id=session, request_id=request, prompt_tokens=4000, uncached_tokens=4000,
                max_tokens=256, objectives=Objectives(ttft_ms=ttft_ms, itl_ms=50.0),
                arrival_s=10.0)  # fmt: skip


@pytest.mark.parametrize(
    ("history_turns", "objective_ms", "rejected"),
    [
        (0, 300.0, True),
        (1, 300.0, True),
        (2, 300.0, False),
        (2, 150.0, True),
        (4, 120.0, False),
        (4, 80.0, True),
    ],
    ids=[
        "no history",
        "single-turn sessions",
        "2-turn sessions",
        "2-turn sessions, far miss",
        "4-turn sessions",
        "4-turn sessions, far miss",
    ],
)
def test_a_miss_is_rejected_by_what_rejection_sheds(
    history_turns: int, objective_ms: float, rejected: bool
) -> None:
    """A turn predicted at 400 ms: against a 300 ms objective, rejected when turns seldom
    continue a session (the rejection sheds its work), served best effort when about half of them do
    (the session would send it again, uncached, in its next turn: the limit is 300 ms / (1 -
    0.5)), and against 120 ms when 3 in 4 do (120 ms / 0.25); rejected all the same against
    150 ms and 80 ms."""
    policy = create_policy("adaptive")
    elsewhere = ClusterView(now_s=0.0, workers=(_worker("h1"),))  # keeps d1's ledgers clean
    policy.decide(_turn("busy", "busy-t0"), elsewhere)  # in flight throughout
    for session, request in _staggered(100, history_turns):
        policy.decide(_turn(session, request), elsewhere)
    for _ in range(60):  # a 4000-token prefill on d1 takes 400 ms
        policy.observe(Outcome(request_id="r", session_id="s", action="colocate",
                               prefill_worker="d1", decode_worker="d1", prompt_tokens=4000,
                               cached_tokens=0, completion_tokens=64, prefill_ms=400.0,
                               queue_ms=0.0, ok=True))  # fmt: skip
    decision = policy.decide(_turn("new", "new-t0", ttft_ms=objective_ms),
                             ClusterView(now_s=100.0, workers=(_worker("d1"),)))  # fmt: skip
    assert decision.predicted.ttft_ms == pytest.approx(400.0, rel=0.1)
    assert isinstance(decision, Reject) is rejected
    if not rejected:
        assert decision.reason.startswith("best effort, best colocate on d1 predicts TTFT")


@pytest.mark.parametrize(
    ("fresh", "objective", "due"),
    [
        ((), 14_000.0, 14_000.0),  # no session begun yet: its objective
        ((1000.0, 4000.0), 3000.0, 3000.0),
        ((1000.0, 4000.0), 14_000.0, 8000.0),  # at most twice the laxest fresh objective
    ],
    ids=["nothing fresh seen", "within the cap", "capped"],
)
def test_a_turn_is_due_at_its_objective_within_twice_the_fresh_ones(
    fresh: tuple[float, ...], objective: float, due: float
) -> None:
    deadlines = Deadlines()
    for fresh_objective in fresh:
        assert deadlines.due_ms(fresh_objective, fresh=True, new_tokens=1000) == fresh_objective
    # a returning turn heavier than the fresh ones; it moves no cap
    assert deadlines.due_ms(objective, fresh=False, new_tokens=10_000) == due
    assert deadlines.due_ms(objective, fresh=False, new_tokens=10_000) == due


@pytest.mark.parametrize(
    ("new_tokens", "due"),
    [
        (4000, 4000.0),  # as much as a fresh turn: its objective, within either cap
        (6000, 4000.0),  # 1.5 x the mean fresh turn's new tokens: still light
        (6001, 8000.0),  # heavier: twice the laxest fresh objective
        (16_000, 8000.0),
    ],
    ids=["fresh-sized", "light at the bound", "past the bound", "heavy"],
)
def test_a_light_returning_turn_is_due_no_later_than_the_laxest_fresh_one(
    new_tokens: int, due: float
) -> None:
    deadlines = Deadlines()
    for objective, tokens in ((1000.0, 2000), (4000.0, 6000)):  # a mean of 4000 new tokens
        deadlines.due_ms(objective, fresh=True, new_tokens=tokens)
    assert deadlines.due_ms(20_000.0, fresh=False, new_tokens=new_tokens) == due
    # its own objective where that is earlier
    assert deadlines.due_ms(3000.0, fresh=False, new_tokens=new_tokens) == 3000.0


def test_the_cap_follows_the_recent_fresh_turns() -> None:
    deadlines = Deadlines()
    deadlines.due_ms(4000.0, fresh=True, new_tokens=1000)
    assert deadlines.due_ms(20_000.0, fresh=False, new_tokens=10_000) == 8000.0
    for _ in range(FRESH_WINDOW):
        deadlines.due_ms(1000.0, fresh=True, new_tokens=5000)
    # the 4000 ms one fell out; so did its 1000 new tokens, and 6000 are light now
    assert deadlines.due_ms(20_000.0, fresh=False, new_tokens=10_000) == 2000.0
    assert deadlines.due_ms(20_000.0, fresh=False, new_tokens=6000) == 1000.0


def test_with_nothing_in_flight_a_predicted_miss_is_served_to_learn_from() -> None:
    """Rejections report nothing: with no outcome for a while, none of its turns in flight and
    the worker idle, a policy that rejected on its last outcomes would reject forever after the
    fleet recovered. It serves the turn (best effort), and rejects again while that one is
    still to report, on fresh outcomes, or where the worker is busy."""
    policy = create_policy("adaptive")
    for _ in range(60):  # a 4000-token prefill on d1 takes 400 ms
        policy.observe(Outcome(request_id="r", session_id="s", action="colocate",
                               prefill_worker="d1", decode_worker="d1", prompt_tokens=4000,
                               cached_tokens=0, completion_tokens=64, prefill_ms=400.0,
                               queue_ms=0.0, ok=True))  # fmt: skip
    view = ClusterView(now_s=100.0, workers=(_worker("d1"),))
    probe = policy.decide(_turn("a", "a-t0", ttft_ms=300.0), view)
    assert not isinstance(probe, Reject)
    assert probe.reason.startswith("best effort, best colocate on d1 predicts TTFT")
    # the same request decided again (a retry) is no other turn in flight
    assert not isinstance(policy.decide(_turn("a", "a-t0", ttft_ms=300.0), view), Reject)
    assert isinstance(policy.decide(_turn("b", "b-t0", ttft_ms=300.0), view), Reject)
    policy.observe(Outcome(request_id="a-t0", session_id="a", action="colocate",
                           prefill_worker="d1", decode_worker="d1", prompt_tokens=4000,
                           cached_tokens=0, completion_tokens=64, prefill_ms=100.0,
                           queue_ms=0.0, ok=True))  # fmt: skip
    # that outcome is news: a miss predicted from it is rejected, until it grows old
    assert isinstance(policy.decide(_turn("c", "c-t0", ttft_ms=300.0), view), Reject)
    policy.observe(Outcome(request_id="b-t0", session_id="b", action="reject",
                           prefill_worker=None, decode_worker=None, prompt_tokens=4000,
                           cached_tokens=0, completion_tokens=0, ok=False))  # fmt: skip
    later = ClusterView(now_s=100.0 + PROBE_AFTER_S + 0.1, workers=(_worker("d1"),))
    assert not isinstance(policy.decide(_turn("d", "d-t0", ttft_ms=300.0), later), Reject)
    busy = msgspec.structs.replace(_worker("d1"), running=1)
    idle_long = ClusterView(now_s=200.0, workers=(busy,))
    assert isinstance(policy.decide(_turn("e", "e-t0", ttft_ms=300.0), idle_long), Reject)


@pytest.mark.parametrize("seed", range(4))
def test_due_times_kept_as_the_window_slides_equal_a_search_of_it(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The laxest fresh objective and the fresh turns' mean prefill, kept as turns come and
    leave the window, are those of the window searched whole every turn."""
    monkeypatch.setattr(tuning, "FRESH_WINDOW", 16)
    rng = random.Random(seed)
    deadlines = Deadlines()
    window: list[tuple[float, int]] = []
    for _ in range(500):
        objective = rng.choice((500.0, 1000.0, 1000.0, rng.uniform(200.0, 5000.0)))
        fresh, tokens = rng.random() < 0.4, rng.randrange(1, 4000)
        if fresh:
            window = [*window, (objective, tokens)][-16:]
        expected = objective
        if window:
            laxest = max(o for o, _ in window)
            cap = tuning.DUE_CAP_FACTOR * laxest
            total = sum(t for _, t in window)
            if not fresh and tokens <= tuning.LIGHT_FACTOR * total / len(window):
                cap = laxest
            expected = min(objective, cap)
        assert deadlines.due_ms(objective, fresh, tokens) == expected
