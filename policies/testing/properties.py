"""The properties every placement policy must keep, as checks a policy author calls in a test.

Each `check_*` function runs one property over random sequences of turns and cluster views
(the strategies `clusters`, `turns` and `steps`, built with hypothesis) and raises
`PolicyPropertyError`, with the smallest failing sequence hypothesis finds, when the policy
breaks it.
`check_policy` runs them all. A policy is given as a factory, a callable that takes no
arguments and returns a fresh policy (the class itself when its `Params` have defaults, or
`lambda: create_policy("my-policy", {...})`); every example builds its own.

    from policies.testing import check_policy

    def test_my_policy_keeps_the_properties() -> None:
        check_policy(MyPolicy, may_hand_off=False)

Call the checks from plain test functions, not from inside a hypothesis `@given` test. They
run `DEFAULT_EXAMPLES` examples each (`max_examples` changes that), with no deadline, and
report one failure at a time; every other hypothesis setting (database, phases, seed) comes
from the active hypothesis profile.

This module is the only one in `policies` that imports hypothesis: install the `testing`
extra (`session-router[testing]`) to use it. The router never imports `policies.testing`.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.base import Policy
from policies.testing.views import KV
from policies.types import (
    ClusterView,
    Colocate,
    Decision,
    Handoff,
    Migrate,
    Objectives,
    Recompute,
    Reject,
    Residency,
    Role,
    Turn,
    WorkerView,
)

PolicyFactory = Callable[[], Policy]
"""A callable that takes no arguments and returns a fresh policy."""

Step = tuple[Turn, ClusterView]
"""One decision's input: the turn and the view of the cluster it is placed on."""

DEFAULT_EXAMPLES = 100
"""Random sequences each check tries unless told otherwise (hypothesis's own default)."""

_PREFILL_ROLES: tuple[Role, ...] = ("prefill", "mixed")
_DECODE_ROLES: tuple[Role, ...] = ("decode", "mixed")

_DECISION_TYPES = (Colocate, Handoff, Migrate, Recompute, Reject)
_decision_decoder = msgspec.json.Decoder(Decision)


class PolicyPropertyError(AssertionError):
    """A policy broke one of the properties every policy must keep."""


# -- strategies -----------------------------------------------------------------------------


@st.composite
def _clusters(draw: st.DrawFn) -> ClusterView:
    ids = draw(st.lists(st.text("abcdefgh", min_size=1, max_size=3), max_size=7, unique=True))
    workers = tuple(
        WorkerView(
            worker_id=worker_id,
            # Most workers accept new work, and hypothesis shrinks towards a healthy mixed
            # worker, which can take any: the properties' interesting cases, and the simplest.
            role=draw(st.sampled_from(("mixed", "decode", "prefill"))),
            healthy=draw(st.sampled_from((True, True, True, False))),
            draining=draw(st.sampled_from((False, False, False, True))),
            running=draw(st.integers(0, 64)),
            waiting=draw(st.integers(0, 64)),
            inflight=draw(st.integers(0, 16)),
        )
        for worker_id in ids
    )
    resident = draw(st.none() | st.sampled_from([*ids, "gone"]))
    residency = None
    if resident is not None:
        tokens = draw(st.integers(1, 100_000))
        residency = Residency(worker_id=resident, tokens=tokens, bytes=tokens * KV, epoch=1)
    return ClusterView(now_s=0.0, workers=workers, residency=residency)


def clusters() -> st.SearchStrategy[ClusterView]:
    """Cluster views at time 0: up to 7 workers with distinct ids of 1 to 3 letters from
    "abcdefgh", each of any role ("mixed", "decode", "prefill"), healthy 3 times in 4,
    draining 1 time in 4, with 0-64 running, 0-64 waiting and 0-16 in-flight requests (other
    fields at their defaults); no links. The session has no residency, or lives on one of the
    workers, or on "gone", a worker absent from the view; a residency holds 1-100000 tokens
    (`KV` bytes each), epoch 1. Failing examples shrink towards fewer workers, each healthy,
    not draining and "mixed"."""
    return _clusters()


def _turn(uncached: int, cached: int) -> Turn:
    return Turn(
        session_id="s",
        request_id="r",
        prompt_tokens=uncached + cached,
        uncached_tokens=uncached,
        max_tokens=64,
        objectives=Objectives(ttft_ms=1000.0, itl_ms=50.0),
        arrival_s=0.0,
    )


def turns() -> st.SearchStrategy[Turn]:
    """Turns of session "s", request "r", arriving at time 0: 0-10000 uncached prompt tokens
    plus 0-10000 cached ones, 64 tokens to generate, objectives TTFT 1000 ms and ITL 50 ms."""
    return st.builds(_turn, st.integers(0, 10_000), st.integers(0, 10_000))


def steps() -> st.SearchStrategy[list[Step]]:
    """Sequences of 1 to 6 steps, each a turn (`turns`) and an independent view (`clusters`),
    decided in order by one policy."""
    return st.lists(st.tuples(turns(), clusters()), min_size=1, max_size=6)


# -- checks ---------------------------------------------------------------------------------


def check_policy(
    factory: PolicyFactory,
    *,
    may_reject_without_prefill: bool = False,
    keeps_affinity: bool = True,
    may_hand_off: bool = True,
    handoff_min_uncached_tokens: int = 0,
    stateless: bool = True,
    max_examples: int = DEFAULT_EXAMPLES,
) -> None:
    """Run every property check on the policies `factory` builds: `check_feasible`,
    `check_affinity` (only when `keeps_affinity`), `check_handoff`, `check_deterministic`
    and `check_round_trip`, each with the keyword arguments it takes.

    The defaults describe a policy that rejects a turn only when no worker can decode, keeps
    sessions on their resident worker, may hand any turn off and keeps no state between
    turns; round-robin, for one, passes `may_reject_without_prefill=True`,
    `keeps_affinity=False` and `stateless=False`.
    """
    check_feasible(
        factory,
        may_reject_without_prefill=may_reject_without_prefill,
        max_examples=max_examples,
    )
    if keeps_affinity:
        check_affinity(factory, max_examples=max_examples)
    check_handoff(
        factory,
        may_hand_off=may_hand_off,
        handoff_min_uncached_tokens=handoff_min_uncached_tokens,
        max_examples=max_examples,
    )
    check_deterministic(factory, stateless=stateless, max_examples=max_examples)
    check_round_trip(factory, max_examples=max_examples)


def check_feasible(
    factory: PolicyFactory,
    *,
    may_reject_without_prefill: bool = False,
    max_examples: int = DEFAULT_EXAMPLES,
) -> None:
    """One policy deciding each sequence of `steps` in order returns, for every step, one of
    Colocate, Handoff, Migrate, Recompute or Reject with a non-empty `reason`, and:

    - Colocate and Recompute: `worker` is a worker of the view that can decode (it accepts
      new work, i.e. is healthy and not draining, and its role is "decode" or "mixed");
    - Recompute also: the session has a residency and `worker` is not the resident worker;
    - Handoff: `prefill_worker` differs from `decode_worker`; `prefill_worker` is a worker of
      the view that accepts new work in role "prefill" or "mixed"; `decode_worker` one that
      can decode;
    - Migrate: the session has a residency, `source` is the resident worker, `destination`
      is a worker of the view that can decode;
    - Reject: no worker of the view can decode; or, when `may_reject_without_prefill` (a
      policy that always prefills on a prefill-capable worker), none accepts new work in
      role "prefill" or "mixed".
    """

    @_settings(max_examples)
    @given(sequence=steps())
    def feasible(sequence: list[Step]) -> None:
        policy = factory()
        for index, (turn, view) in enumerate(sequence):
            decision = policy.decide(turn, view)
            _check_feasible(index, view, decision, may_reject_without_prefill)

    feasible()


def check_affinity(factory: PolicyFactory, *, max_examples: int = DEFAULT_EXAMPLES) -> None:
    """One policy deciding each sequence of `steps` in order keeps the session on its
    resident worker whenever it can: at every step where the session has a residency whose
    worker is in the view and can decode (accepts new work, role "decode" or "mixed"), the
    decision is a Colocate on that worker or a Handoff that decodes on it. Steps without such
    a worker are not checked. (Round-robin, blind to sessions by design, does not keep it.)
    """

    @_settings(max_examples)
    @given(sequence=steps())
    def affinity(sequence: list[Step]) -> None:
        policy = factory()
        for index, (turn, view) in enumerate(sequence):
            decision = policy.decide(turn, view)
            residency = view.residency
            if residency is None or not _can(view, residency.worker_id, _DECODE_ROLES):
                continue
            resident = residency.worker_id
            match decision:
                case Colocate(worker=worker) if worker == resident:
                    pass
                case Handoff(decode_worker=decode) if decode == resident:
                    pass
                case _:
                    raise PolicyPropertyError(
                        f"step {index}: {decision!r} abandons the eligible resident worker "
                        f"{resident!r}"
                    )

    affinity()


def check_handoff(
    factory: PolicyFactory,
    *,
    may_hand_off: bool = True,
    handoff_min_uncached_tokens: int = 0,
    max_examples: int = DEFAULT_EXAMPLES,
) -> None:
    """One policy deciding each sequence of `steps` in order hands a turn off (a Handoff
    decision) only where the policy allows it: never when `may_hand_off` is False, otherwise
    only for a turn with at least `handoff_min_uncached_tokens` uncached prompt tokens.
    With the defaults (any turn may be handed off) only the decisions' being made is checked.
    """

    @_settings(max_examples)
    @given(sequence=steps())
    def handoff(sequence: list[Step]) -> None:
        policy = factory()
        for index, (turn, view) in enumerate(sequence):
            decision = policy.decide(turn, view)
            if not isinstance(decision, Handoff):
                continue
            if not may_hand_off:
                raise PolicyPropertyError(
                    f"step {index}: {decision!r} hands off, which this policy never does"
                )
            if turn.uncached_tokens < handoff_min_uncached_tokens:
                raise PolicyPropertyError(
                    f"step {index}: {decision!r} hands off a turn of {turn.uncached_tokens} "
                    f"uncached tokens, below {handoff_min_uncached_tokens}"
                )

    handoff()


def check_deterministic(
    factory: PolicyFactory, *, stateless: bool = True, max_examples: int = DEFAULT_EXAMPLES
) -> None:
    """Decisions depend only on the policy's inputs, never on chance or on the order of a
    view's workers. For each sequence of `steps`, with `expected` the decisions of one fresh
    policy deciding it in order:

    - a second fresh policy deciding the same sequence in order returns `expected`;
    - a fresh policy deciding the sequence with each view's workers permuted returns
      `expected`;
    - when `stateless` (the policy keeps no state between turns; round-robin does), a fresh
      policy deciding each step twice in a row returns that step's expected decision both
      times.

    Decisions are compared with `==`, every field included (reason and predictions).
    """

    @_settings(max_examples)
    @given(sequence=steps(), data=st.data())
    def deterministic(sequence: list[Step], data: st.DataObject) -> None:
        expected = _decide_all(factory(), sequence)
        again = _decide_all(factory(), sequence)
        if again != expected:
            raise PolicyPropertyError(
                f"a second policy decided the same sequence differently: {again!r} "
                f"instead of {expected!r}"
            )
        shuffled = [
            (
                turn,
                msgspec.structs.replace(
                    view, workers=tuple(data.draw(st.permutations(view.workers)))
                ),
            )
            for turn, view in sequence
        ]
        reordered = _decide_all(factory(), shuffled)
        if reordered != expected:
            raise PolicyPropertyError(
                f"reordering the views' workers changed the decisions: {reordered!r} "
                f"instead of {expected!r}"
            )
        if not stateless:
            return
        policy = factory()
        for index, ((turn, view), decision) in enumerate(zip(sequence, expected, strict=True)):
            for attempt in ("first", "second"):
                repeated = policy.decide(turn, view)
                if repeated != decision:
                    raise PolicyPropertyError(
                        f"step {index}, decided a {attempt} time on one policy: {repeated!r} "
                        f"instead of {decision!r} (a stateless policy keeps no state "
                        "between turns)"
                    )

    deterministic()


def check_round_trip(factory: PolicyFactory, *, max_examples: int = DEFAULT_EXAMPLES) -> None:
    """Every decision of one policy deciding each sequence of `steps` in order survives the
    wire: encoded as JSON (`msgspec.json.encode`) and decoded as the tagged union `Decision`
    (tag field "action"), it is equal to the decision and of the same type."""

    @_settings(max_examples)
    @given(sequence=steps())
    def round_trip(sequence: list[Step]) -> None:
        policy = factory()
        for index, (turn, view) in enumerate(sequence):
            decision = policy.decide(turn, view)
            try:
                encoded = msgspec.json.encode(decision)
            except (msgspec.EncodeError, TypeError) as error:
                raise PolicyPropertyError(
                    f"step {index}: {decision!r} does not encode: {error}"
                ) from error
            try:
                decoded = _decision_decoder.decode(encoded)
            except msgspec.DecodeError as error:
                raise PolicyPropertyError(
                    f"step {index}: {decision!r} encodes as {encoded!r}, which does not decode "
                    f"as a Decision: {error}"
                ) from error
            if decoded != decision or type(decoded) is not type(decision):
                raise PolicyPropertyError(
                    f"step {index}: {decision!r} encodes as {encoded!r}, which decodes as "
                    f"{decoded!r}"
                )

    round_trip()


# -- helpers --------------------------------------------------------------------------------


def _settings(max_examples: int) -> settings:
    # Decisions take microseconds, but a policy's first call may warm caches: no deadline.
    # One failure reported at a time, so the error raised is a PolicyPropertyError.
    return settings(max_examples=max_examples, deadline=None, report_multiple_bugs=False)


def _decide_all(policy: Policy, sequence: list[Step]) -> list[Decision]:
    return [policy.decide(turn, view) for turn, view in sequence]


def _can(view: ClusterView, worker_id: str, roles: tuple[Role, ...]) -> bool:
    worker = view.worker(worker_id)
    return worker is not None and worker.accepts_new_work and worker.role in roles


def _any_can(view: ClusterView, roles: tuple[Role, ...]) -> bool:
    return any(worker.accepts_new_work and worker.role in roles for worker in view.workers)


def _check_feasible(
    index: int, view: ClusterView, decision: object, may_reject_without_prefill: bool
) -> None:
    def fail(problem: str) -> PolicyPropertyError:
        return PolicyPropertyError(f"step {index}: {decision!r} {problem}")

    if not isinstance(decision, _DECISION_TYPES):
        raise fail("is not a Decision (Colocate, Handoff, Migrate, Recompute or Reject)")
    if not decision.reason:
        raise fail("gives no reason")
    residency = view.residency
    match decision:
        case Colocate(worker=worker) | Recompute(worker=worker):
            if not _can(view, worker, _DECODE_ROLES):
                raise fail(f"serves on {worker!r}, not a worker of the view that can decode")
            if isinstance(decision, Recompute):
                if residency is None:
                    raise fail("recomputes a session that has no residency")
                if worker == residency.worker_id:
                    raise fail(f"recomputes on the resident worker {worker!r}")
        case Handoff(prefill_worker=prefill, decode_worker=decode):
            if prefill == decode:
                raise fail("hands off from a worker to itself")
            if not _can(view, prefill, _PREFILL_ROLES):
                raise fail(f"prefills on {prefill!r}, not a worker of the view that can prefill")
            if not _can(view, decode, _DECODE_ROLES):
                raise fail(f"decodes on {decode!r}, not a worker of the view that can decode")
        case Migrate(source=source, destination=destination):
            if residency is None:
                raise fail("migrates a session that has no residency")
            if source != residency.worker_id:
                raise fail(f"migrates from {source!r}, not the resident {residency.worker_id!r}")
            if not _can(view, destination, _DECODE_ROLES):
                raise fail(f"migrates to {destination!r}, not a worker of the view that can decode")
        case Reject():
            if _any_can(view, _DECODE_ROLES) and not (
                may_reject_without_prefill and not _any_can(view, _PREFILL_ROLES)
            ):
                raise fail(
                    "rejects although a worker can decode"
                    + (" and one can prefill" if may_reject_without_prefill else "")
                )
