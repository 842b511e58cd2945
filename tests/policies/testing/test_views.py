from __future__ import annotations

from policies import ClusterView, Objectives, Residency, Turn, WorkerView
from policies.testing import KV, turn, view, w


def test_w_is_a_healthy_worker_with_any_other_field() -> None:
    assert w("a") == WorkerView(worker_id="a", role="mixed", healthy=True)
    assert w("b", "decode", waiting=3, draining=True) == WorkerView(
        worker_id="b", role="decode", healthy=True, waiting=3, draining=True
    )


def test_view_without_a_resident_is_a_new_session() -> None:
    a, b = w("a"), w("b", "prefill")
    assert view(a, b) == ClusterView(now_s=0.0, workers=(a, b))


def test_view_with_a_resident_holds_its_tokens_there() -> None:
    cluster = view(w("a"), resident="a", tokens=100, now_s=5.0)
    assert cluster.now_s == 5.0
    assert cluster.residency == Residency(worker_id="a", tokens=100, bytes=100 * KV, epoch=1)


def test_turn_of_a_new_session_has_its_whole_prompt_uncached() -> None:
    assert turn(3000) == Turn(
        session_id="s1",
        request_id="r1",
        prompt_tokens=3000,
        uncached_tokens=3000,
        max_tokens=128,
        objectives=Objectives(ttft_ms=1000.0, itl_ms=50.0),
        arrival_s=0.0,
    )
    later = turn(3000, 200, session="s2", request="r9", ttft_ms=500.0, arrival_s=2.0)
    assert (later.session_id, later.request_id) == ("s2", "r9")
    assert (later.prompt_tokens, later.uncached_tokens) == (3000, 200)
    assert (later.objectives.ttft_ms, later.arrival_s) == (500.0, 2.0)
