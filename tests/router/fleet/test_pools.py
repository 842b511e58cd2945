"""WorkerPool membership and model pools: who joins, leaves, drains and is forgotten; which
workers a turn for a model may go to; what the policy sees. Membership: a source's set
reconciled against the fleet, and /admin changes."""

from __future__ import annotations

import pytest

from router.config import WorkerSpec
from router.fleet.membership import Membership, MembershipError
from router.fleet.telemetry import parse_models
from router.fleet.workers import WorkerPool


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def worker(name: str, role: str = "mixed", port: int = 1) -> WorkerSpec:
    return WorkerSpec(url=f"http://{name}:{port}", id=name, role=role)  # type: ignore[arg-type]


def pool_of(*names: str, grace: float = 5.0) -> tuple[WorkerPool, Clock]:
    clock = Clock()
    return WorkerPool([worker(n) for n in names], clock=clock, departure_grace_s=grace), clock


@pytest.mark.parametrize(
    ("models", "asked", "expected"),
    [
        ({}, "x", ["a", "b", "c"]),  # nobody listed models: anyone may serve
        ({}, None, ["a", "b", "c"]),
        ({"a": ("x",), "b": ("x",), "c": ("y",)}, "x", ["a", "b"]),
        ({"a": ("x",), "b": ("x",), "c": ("y",)}, "y", ["c"]),
        ({"a": ("x",), "b": ("x",), "c": ("y",)}, "z", None),  # 404
        ({"a": ("x",), "b": ("x",), "c": ("y",)}, None, None),  # which one? 400
        ({"a": ("x",), "b": ("x", "x-lora")}, None, None),
        ({"a": ("x",)}, None, ["a"]),  # one model: a turn naming none is for it
        ({"a": ("x",)}, "x", ["a"]),  # b, c not listed yet: in no model's pool
        ({"a": ("x", "x-lora"), "b": ("x",)}, "x-lora", ["a"]),
    ],
)
def test_pool_for(
    models: dict[str, tuple[str, ...]], asked: str | None, expected: list[str] | None
) -> None:
    pool, _ = pool_of("a", "b", "c")
    for worker_id, served in models.items():
        assert pool.set_models(worker_id, served)
    found = pool.pool_for(asked)
    if expected is None:
        assert found is None
        return
    assert found is not None and sorted(found.ids) == expected
    assert [v.worker_id for v in pool.views({}, 0.0, found)] == expected


def test_a_leaving_worker_drains_then_is_forgotten() -> None:
    pool, clock = pool_of("a", "b", grace=5.0)
    pool.set_models("a", ("x",))
    pool.set_models("b", ("x",))
    x = pool.pool_for("x")
    assert x is not None and x.serving == 2 and pool.healthy_count() == 2
    pool.workers["b"].inflight = 1  # a turn in flight there
    assert pool.leave("b") and not pool.leave("b")
    x = pool.pool_for("x")
    assert x is not None and x.serving == 1 and pool.healthy_count() == 1
    (view,) = [v for v in pool.views({}, 0.0, x) if v.worker_id == "b"]
    assert view.draining and not view.accepts_new_work  # shown, but no new work placed
    clock.now += 60
    assert pool.reap() == []  # its turn is not done
    pool.workers["b"].inflight = 0
    assert pool.reap() == ["b"]
    x = pool.pool_for("x")
    assert x is not None and sorted(x.ids) == ["a"] and "b" not in pool.workers


def test_the_grace_holds_a_drained_worker_a_while() -> None:
    pool, clock = pool_of("a", "b", grace=5.0)
    pool.leave("b")
    clock.now += 4.9
    assert pool.reap() == []
    clock.now += 0.2
    assert pool.reap() == ["b"]


def test_a_worker_back_at_a_new_address_lists_its_models_again() -> None:
    pool, _ = pool_of("a")
    pool.set_models("a", ("x",))
    pool.leave("a")
    pool.add(worker("a"))  # back as it was: keeps its models
    assert pool.pool_for("x") is not None and not pool.workers["a"].leaving
    pool.add(worker("a", port=2))  # a new process: in no pool until it lists its models
    assert pool.model_names() == [] and pool.workers["a"].spec.url == "http://a:2"


def test_reconcile_joins_leaves_and_respects_other_origins() -> None:
    pool, _ = pool_of("s")
    joined: list[str] = []
    left: list[str] = []
    members = Membership(pool, lambda st: joined.append(st.spec.worker_id), left.append)
    assert members.reconcile("dns", [worker("a"), worker("b"), worker("s", port=9)]) == (
        ["a", "b"], [])  # fmt: skip
    assert pool.workers["s"].spec.url == "http://s:1"  # the static one stays
    assert members.reconcile("dns", [worker("a"), worker("b")]) == ([], [])
    assert members.reconcile("dns", [worker("b", port=2), worker("c")]) == (["b", "c"], ["a"])
    assert pool.workers["a"].leaving and left == ["a"]
    assert members.reconcile("dns", []) == ([], ["b", "c"])
    assert {w: members.origin(w) for w in pool.workers} == {"s": "static", "a": None,
                                                           "b": None, "c": None}  # fmt: skip


@pytest.mark.parametrize(
    ("origin", "action", "status"),
    [("static", "remove", None), ("admin", "remove", None), ("dns", "remove", 409),
     ("none", "remove", 404), ("static", "add", 409), ("none", "add", None)],
)  # fmt: skip
def test_admin_changes(origin: str, action: str, status: int | None) -> None:
    pool, _ = pool_of("s")
    members = Membership(pool, lambda st: None, lambda w: None)
    target = "s"
    if origin == "admin":
        members.add(worker("n"))
        target = "n"
    elif origin == "dns":
        members.reconcile("dns", [worker("d")])
        target = "d"
    elif origin == "none":
        target = "z"
    try:
        if action == "add":
            members.add(worker(target))
        else:
            members.remove(target)
    except MembershipError as exc:
        assert exc.status == status
    else:
        assert status is None
        assert pool.workers[target].leaving == (action == "remove")


@pytest.mark.parametrize(
    ("body", "ids"),
    [
        (b'{"object":"list","data":[{"id":"m"},{"id":"m-lora","parent":"m"}]}', ["m", "m-lora"]),
        (b'{"data":[{"id":"m"},{"id":"m"}]}', ["m"]),
        (b'{"data":[]}', []),
        (b'{"data":[{"name":"m"}]}', ValueError),
        (b'{"data":[{"id":""}]}', ValueError),
        (b'{"data":[{"id":7}]}', ValueError),
        (b'{"data":{"id":"m"}}', ValueError),
        (b"[]", ValueError),
        (b"not json", ValueError),
    ],
)
def test_parse_models(body: bytes, ids: object) -> None:
    if ids is ValueError:
        with pytest.raises(ValueError):
            parse_models(body)
    else:
        assert [m["id"] for m in parse_models(body)] == ids
