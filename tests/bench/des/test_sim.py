"""The discrete-event simulator: exact timings, conservation, router semantics."""

from __future__ import annotations

import gc
import random

import msgspec
import pytest

from bench.des import SimConfig, simulate
from bench.des.ledger import LinkLedger
from bench.des.tokens import ASSISTANT_TAG, SYSTEM_TAG, USER_TAG, PromptBuilder
from bench.results.summary import RequestResult
from bench.stack.layout import ClusterSpec
from bench.traces.model import Conversation, Trace, TraceTurn
from bench.traces.workloads import ArrivalSpec, ThinkSpec, WorkloadSpec, generate_matrix
from policies import create_policy
from policies.costmodel.calibration import queue_ahead
from policies.params import NoParams
from policies.types import (
    ClusterView,
    Colocate,
    Decision,
    Handoff,
    Migrate,
    Outcome,
    Reject,
    Role,
    Turn,
)
from sim.engine.kvcache import extend_block_hashes
from sim.engine.presets import deployment_from_names
from sim.engine.roofline import CostModel

DEPLOYMENT = deployment_from_names("h200-sxm", "llama-3.1-8b")
KV_BYTES = DEPLOYMENT.kv_bytes_per_token


def config(roles: tuple[Role, ...], **overrides: object) -> SimConfig:
    """An exact cluster: no step noise, no NIC latency."""
    spec = ClusterSpec(len(roles), "h200-sxm", "llama-3.1-8b")
    fields: dict[str, object] = {"noise_sigma": 0.0, "nic_latency_s": 0.0, **overrides}
    return msgspec.convert(
        {"cluster": spec, "roles": roles, **fields}, SimConfig, from_attributes=True
    )


def single_turns(*prompts: int, arrival_s: float = 0.0, output: int = 4) -> Trace:
    conversations = tuple(
        Conversation(f"s{i}", (TraceTurn(arrival_s, prompt, output),))
        for i, prompt in enumerate(prompts)
    )
    return Trace("test", conversations)


def run(trace: Trace, policy: str, cfg: SimConfig) -> list[RequestResult]:
    result = simulate(trace, create_policy(policy), cfg)
    assert result.failure is None
    return sorted(result.results, key=lambda r: r.request_id)


def ttft_s(result: RequestResult) -> float:
    assert result.first_chunk_at is not None
    return result.first_chunk_at - result.sent_at


@pytest.mark.parametrize("new_tokens", [1, 100, 2048, 12000])
@pytest.mark.parametrize("overhead_s", [0.0, 0.001, 0.004])
def test_idle_worker_ttft_is_the_cost_model_prediction_plus_router_overhead(
    new_tokens: int, overhead_s: float
) -> None:
    [result] = run(single_turns(new_tokens), "colocate",
                   config(("mixed",), router_overhead_s=overhead_s))  # fmt: skip
    prompt = new_tokens + 2  # <|user|> ... <|assistant|>
    assert result.prompt_tokens == prompt
    predicted = CostModel(DEPLOYMENT).predict_prefill_s(prompt)
    assert ttft_s(result) == overhead_s + predicted


def test_handoff_ttft_is_prefill_transfer_and_one_token_step() -> None:
    cfg = config(("prefill", "decode"))
    [result] = run(single_turns(6000), "disaggregate", cfg)
    prompt = 6002
    model = CostModel(DEPLOYMENT)
    transfer = prompt * KV_BYTES / (cfg.nic_gbps * 1e9 / 8)
    expected = (2 * cfg.router_overhead_s + model.predict_prefill_s(prompt) + transfer
                + model.predict_prefill_s(1, prompt - 1))  # fmt: skip
    assert ttft_s(result) == pytest.approx(expected, rel=1e-12)
    assert result.action == "handoff"
    assert result.transferred_bytes == prompt * KV_BYTES
    assert result.exposed_transfer_ms == pytest.approx(transfer * 1000, rel=1e-12)
    assert result.cached_tokens == prompt - 1  # the pulled KV, as vLLM counts it


@pytest.mark.parametrize("nic_gbps", [100.0, 400.0])
def test_two_handoffs_sharing_one_nic_take_twice_as_long(nic_gbps: float) -> None:
    roles: tuple[Role, ...] = ("prefill", "prefill", "decode")
    cfg = config(roles, nic_gbps=nic_gbps)
    [alone] = run(single_turns(4000), "disaggregate", cfg)
    both = run(single_turns(4000, 4000), "disaggregate", cfg)
    assert alone.exposed_transfer_ms is not None
    expected = 4002 * KV_BYTES / (nic_gbps * 1e9 / 8) * 1000
    assert alone.exposed_transfer_ms == pytest.approx(expected, rel=1e-12)
    for result in both:  # both pulls cross the decode worker's ingress at once
        assert result.exposed_transfer_ms == pytest.approx(2 * expected, rel=1e-12)


def test_prefill_first_token_convention_streams_the_prefill_token_first() -> None:
    cfg = config(("prefill", "decode"), first_token="prefill")
    [result] = run(single_turns(3000, output=8), "disaggregate", cfg)
    model = CostModel(DEPLOYMENT)
    prefill_end = cfg.router_overhead_s + model.predict_prefill_s(3002)
    assert result.chunk_times[0] == prefill_end
    assert len(result.chunk_times) == result.completion_tokens == 8
    # the transfer is now inside the first inter-token gap
    assert result.exposed_transfer_ms is not None
    assert result.chunk_times[1] - result.chunk_times[0] > result.exposed_transfer_ms / 1000


class EveryThirdRejected:
    """Rejects every third turn (of sessions other than "too-long"), colocates the rest on
    the least busy worker."""

    name = "every-third"
    Params = NoParams

    def __init__(self, params: NoParams | None = None) -> None:
        self.turns = 0
        self.outcomes: list[Outcome] = []

    def decide(self, turn: Turn, view: ClusterView) -> Decision:
        if turn.session_id != "too-long":
            self.turns += 1
        if turn.session_id != "too-long" and self.turns % 3 == 0:
            return Reject(reason="test")
        worker = min(view.workers, key=lambda w: (w.inflight + w.running, w.worker_id))
        return Colocate(worker=worker.worker_id)

    def observe(self, outcome: Outcome) -> None:
        self.outcomes.append(outcome)


def test_every_turn_ends_completed_rejected_or_errored() -> None:
    spec = WorkloadSpec(
        prompt_tokens=(512, 3000), output_tokens=(16,), reuse=("none", "multi-turn"),
        turns=(3,), sessions_per_class=5, arrival=ArrivalSpec(rate_rps=20.0),
        think=ThinkSpec(mean_s=0.2),
    )  # fmt: skip
    trace = generate_matrix(spec)
    long = Conversation("too-long", (TraceTurn(0.05, 140_000, 8),))  # over max_model_len
    trace = msgspec.structs.replace(trace, conversations=(*trace.conversations, long))
    policy = EveryThirdRejected()
    result = simulate(trace, policy, config(("mixed", "mixed")))
    statuses = [r.status for r in result.results]
    assert len(result.results) == trace.num_turns
    assert len({r.request_id for r in result.results}) == trace.num_turns
    assert statuses.count("rejected") == (trace.num_turns - 1) // 3
    errors = [r for r in result.results if r.status == "error"]
    assert [(r.session_id, r.http_status) for r in errors] == [("too-long", 400)]
    assert "maximum context length" in errors[0].error
    assert statuses.count("completed") == trace.num_turns - (trace.num_turns - 1) // 3 - 1
    completed = [r for r in result.results if r.status == "completed"]
    assert all(len(r.chunk_times) == r.completion_tokens == 16 for r in completed)
    assert [o.ok for o in policy.outcomes] == [r.status == "completed" for r in result.results]
    rejected = [r for r in result.results if r.status == "rejected"]
    assert all(r.http_status == 429 and r.chunk_times == [] for r in rejected)


class Recorder:
    """Colocates on w0 (then on the resident worker) and keeps every turn and view."""

    name = "recorder"
    Params = NoParams

    def __init__(self, params: NoParams | None = None) -> None:
        self.seen: list[tuple[Turn, ClusterView]] = []

    def decide(self, turn: Turn, view: ClusterView) -> Decision:
        self.seen.append((turn, view))
        if view.residency is not None:
            return Colocate(worker=view.residency.worker_id)
        return Colocate(worker="w0")

    def observe(self, outcome: Outcome) -> None:
        pass


def test_views_carry_scrape_staleness_and_live_inflight_counts() -> None:
    long_then_short = (
        Conversation("s0", (TraceTurn(0.0, 20000, 4),)),
        Conversation("s1", (TraceTurn(0.5, 100, 4),)),
    )
    trace = Trace("t", long_then_short)
    policy = Recorder()
    simulate(trace, policy, config(("mixed", "mixed"), scrape_interval_s=1.0))
    (_, first), (_, second) = policy.seen
    assert [w.scraped_at(first.now_s) for w in first.workers] == [0.0, 0.0]
    assert second.now_s == 0.5
    # the views built at the scrape are shared: their scrape time says how old they are
    assert [w.scraped_at_s for w in second.workers] == [0.0, 0.0]
    assert [second.now_s - w.scraped_at(second.now_s) for w in second.workers] == [0.5, 0.5]
    w0 = second.workers[0]
    # the 20k-token prefill is running, but the last scrape (t=0) saw an idle worker
    assert (w0.running, w0.waiting, w0.inflight) == (0, 0, 1)


class SplitRecorder(Recorder):
    """Hands every turn off from w0 to w1 and keeps every turn and view."""

    def decide(self, turn: Turn, view: ClusterView) -> Decision:
        self.seen.append((turn, view))
        return Handoff(prefill_worker="w0", decode_worker="w1")


@pytest.mark.parametrize(
    ("interval_s", "started", "running"),
    [(10.0, 1, 0), (0.25, 0, 1)],  # no scrape since its decode leg began; one since
)
def test_views_count_the_legs_answering_since_the_scrape(
    interval_s: float, started: int, running: int
) -> None:
    # A handoff's decode leg brings its KV: from its send it queues no prefill there, which a
    # scrape older than it cannot show (it would count it queued).
    turns = (Conversation("s0", (TraceTurn(0.0, 2000, 400),)),
             Conversation("s1", (TraceTurn(0.5, 100, 4),)))  # fmt: skip
    policy = SplitRecorder()
    simulate(Trace("t", turns), policy, config(("mixed", "mixed"), scrape_interval_s=interval_s))
    (_, first), (_, second) = policy.seen
    assert [w.started_since_scrape for w in first.workers] == [0, 0]
    prefill, decode = second.workers
    assert (prefill.inflight, prefill.started_since_scrape) == (0, 0)
    assert (decode.inflight, decode.started_since_scrape, decode.running) == (1, started, running)
    assert queue_ahead(decode) == 0


def test_a_colocated_turn_counts_as_answering_from_its_first_token() -> None:
    turns = tuple(Conversation(f"s{i}", (TraceTurn(at, 100, 400),))
                  for i, at in enumerate((0.0, 0.001, 0.5)))  # fmt: skip
    policy = Recorder()
    simulate(Trace("t", turns), policy, config(("mixed",), scrape_interval_s=10.0))
    _, (_, second), (_, third) = policy.seen
    # Sent since the scrape at 0: in flight, not yet answering, so queued ahead of the next.
    assert (second.workers[0].inflight, second.workers[0].started_since_scrape) == (1, 0)
    assert queue_ahead(second.workers[0]) == 1
    # Both answer by 0.5 s: the scrape at 0 saw neither, and neither is queued.
    assert (third.workers[0].inflight, third.workers[0].started_since_scrape) == (2, 2)
    assert queue_ahead(third.workers[0]) == 0


def test_residency_is_committed_on_the_serving_worker_after_each_turn() -> None:
    turns = (TraceTurn(0.0, 1000, 10), TraceTurn(0.0, 200, 10, think_s=0.1))
    trace = Trace("t", (Conversation("chat", turns, system_prefix_tokens=50),))
    policy = Recorder()
    result = simulate(trace, policy, config(("mixed", "mixed")))
    (turn0, view0), (turn1, view1) = policy.seen
    first, second = result.results
    assert view0.residency is None and turn0.uncached_tokens == turn0.prompt_tokens
    assert turn0.prompt_tokens == 1 + 50 + 1 + 1000 + 1
    residency = view1.residency
    assert residency is not None
    assert (residency.worker_id, residency.tokens, residency.epoch, residency.turns) == (
        "w0", first.prompt_tokens + first.completion_tokens, 1, 1)  # fmt: skip
    assert residency.bytes == residency.tokens * KV_BYTES
    # the next prompt resends the answer: prompt + 10 generated + <|user|> 200 <|assistant|>
    assert turn1.prompt_tokens == turn0.prompt_tokens + 10 + 202
    assert turn1.uncached_tokens == turn1.prompt_tokens - residency.tokens
    # the last generated token's KV was never written: everything before it is a cache hit
    assert second.cached_tokens == (turn0.prompt_tokens + 9) // 16 * 16
    assert first.done_at is not None
    assert second.sent_at == pytest.approx(first.done_at + 0.1)


class Observed:
    """A policy that keeps what `observe` is told, around another one."""

    name = "observed"
    Params = NoParams

    def __init__(self, inner: str) -> None:
        self.inner = create_policy(inner)
        self.outcomes: list[Outcome] = []

    def decide(self, turn: Turn, view: ClusterView) -> Decision:
        return self.inner.decide(turn, view)

    def observe(self, outcome: Outcome) -> None:
        self.outcomes.append(outcome)


def test_a_split_turns_outcome_reports_what_its_prefill_leg_found_cached() -> None:
    """The decode leg's hit is the pulled KV; the prefill leg's is the prefill worker's own
    cache: nothing for the first turn, the last prompt (whole blocks) for the next."""
    turns = (TraceTurn(0.0, 1000, 10), TraceTurn(0.0, 200, 10, think_s=0.1))
    policy = Observed("disaggregate")
    result = simulate(Trace("t", (Conversation("chat", turns),)), policy,
                      config(("prefill", "decode")))  # fmt: skip
    first, second = result.results
    assert [o.action for o in policy.outcomes] == ["handoff", "handoff"]
    assert [o.prefill_cached_tokens for o in policy.outcomes] == [
        0, first.prompt_tokens // 16 * 16]  # fmt: skip
    assert [o.cached_tokens for o in policy.outcomes] == [
        first.prompt_tokens - 1, second.prompt_tokens - 1]  # fmt: skip


def test_a_whole_turns_outcome_reports_no_prefill_leg() -> None:
    policy = Observed("colocate")
    simulate(single_turns(1000), policy, config(("mixed",)))
    assert [o.prefill_cached_tokens for o in policy.outcomes] == [None]


def test_a_handoff_reserves_only_the_kv_its_decode_worker_lacks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reserved: list[tuple[str, str, int]] = []
    reserve = LinkLedger.reserve

    def recording(self: LinkLedger, src: str, dst: str, nbytes: int, *args: object) -> object:
        reserved.append((src, dst, nbytes))
        return reserve(self, src, dst, nbytes, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(LinkLedger, "reserve", recording)
    turns = (TraceTurn(0.0, 4000, 10), TraceTurn(0.0, 300, 10, think_s=0.1))
    trace = Trace("t", (Conversation("chat", turns),))
    result = simulate(trace, create_policy("disaggregate"), config(("prefill", "decode")))
    first, second = result.results
    held = first.prompt_tokens + first.completion_tokens  # the residency after turn 1
    assert reserved == [
        ("w0", "w1", first.prompt_tokens * KV_BYTES),  # a new session: all of it
        ("w0", "w1", (second.prompt_tokens - held) * KV_BYTES),  # past what w1 holds
    ]
    # What the decode worker pulled: its cache holds the first turn in whole KV blocks, less
    # the last token's KV (never written).
    pulled = second.transferred_bytes // KV_BYTES
    assert second.prompt_tokens - held < pulled <= second.prompt_tokens - held + 16


class LinkWatcher:
    """disaggregate, writing down the reserved bytes on its links at every decision."""

    name = "link-watcher"
    Params = NoParams

    def __init__(self) -> None:
        self._policy = create_policy("disaggregate")
        self.reserved: list[tuple[float, int]] = []

    def decide(self, turn: Turn, view: ClusterView) -> Decision:
        self.reserved.append((view.now_s, sum(link.reserved_bytes for link in view.links)))
        return self._policy.decide(turn, view)

    def observe(self, outcome: Outcome) -> None:
        self._policy.observe(outcome)


def test_a_handoff_gives_its_link_reservation_back_when_the_pull_ends() -> None:
    # The first turn's KV has crossed the link long before its 400-token answer ends: a turn
    # arriving meanwhile sees the link free (its bytes no longer load it).
    trace = Trace("t", (
        Conversation("long", (TraceTurn(0.0, 4000, 400),)),
        Conversation("later", (TraceTurn(1.0, 300, 4),)),
    ))  # fmt: skip
    watcher = LinkWatcher()
    result = simulate(trace, watcher, config(("prefill", "decode")))
    first = next(r for r in result.results if r.session_id == "long")
    assert first.first_chunk_at is not None and first.done_at is not None
    assert first.first_chunk_at < 1.0 < first.done_at  # still decoding when "later" arrives
    assert watcher.reserved == [(0.0, 0), (1.0, 0)]
    assert first.transferred_bytes == first.prompt_tokens * KV_BYTES  # still reported


class AlwaysMigrate:
    """Serves new sessions on w0; later turns migrate the session to w1."""

    name = "always-migrate"
    Params = NoParams

    def __init__(self, params: NoParams | None = None) -> None:
        pass

    def decide(self, turn: Turn, view: ClusterView) -> Decision:
        if view.residency is None:
            return Colocate(worker="w0")
        return Migrate(source=view.residency.worker_id, destination="w1")

    def observe(self, outcome: Outcome) -> None:
        pass


@pytest.mark.parametrize(
    ("lease_s", "action", "served_by_w1"), [(30.0, "migrate", True), (1e-9, "colocate", False)]
)
def test_a_migration_runs_as_a_handoff_unless_the_link_defers_it(
    lease_s: float, action: str, served_by_w1: bool
) -> None:
    turns = (TraceTurn(0.0, 3000, 8), TraceTurn(0.0, 100, 8), TraceTurn(0.0, 100, 8))
    trace = Trace("t", (Conversation("chat", turns),))
    cfg = config(("mixed", "mixed"), reservation_lease_s=lease_s)
    result = simulate(trace, AlwaysMigrate(), cfg)
    _, second, third = result.results
    assert second.action == action
    if served_by_w1:  # w1 pulled everything of the prompt it did not hold
        assert second.transferred_bytes == second.prompt_tokens * KV_BYTES
        assert third.action == "migrate" and third.transferred_bytes > 0
    else:
        assert second.transferred_bytes == 0 and second.exposed_transfer_ms is None


def test_prompts_extend_the_previous_turn_with_its_answer() -> None:
    turns = (TraceTurn(0.0, 40, 5, prefix_blocks=(7,)), TraceTurn(0.0, 30, 5))
    conversation = Conversation("c", turns, system_prefix_tokens=10)
    builder = PromptBuilder(block_tokens=32)
    first = builder.first_prompt(conversation)
    assert len(first) == 1 + 10 + 1 + 40 + 1
    assert (first[0], first[11], first[-1]) == (SYSTEM_TAG, USER_TAG, ASSISTANT_TAG)
    answer = [1, 2, 3, 4, 5]
    second = builder.next_prompt(conversation, 1, first, answer)
    assert second[: len(first)] == first
    assert second[len(first) : len(first) + 5] == answer
    assert len(second) == len(first) + 5 + 1 + 30 + 1
    # the same block at the same place gives the same ids in another session
    other = builder.first_prompt(Conversation("d", turns, system_prefix_tokens=10))
    assert other[1:11] == first[1:11] and other[12:34] == first[12:34]
    assert other[34:52] != first[34:52]  # past the known block: unique to each session
    # a run of block 7 names it (and the offset) first, then takes the shared ids
    assert first[2:11] == list(range(-1, -10, -1)) and first[13:34] == list(range(-11, -32, -1))
    assert _distinct_ids(first)[12:34] == list(range(first[1] + 10, first[1] + 32))


def _distinct_ids(prompt: list[int]) -> list[int]:
    """The layout with its own id for every (block, offset): a shared id continues its run."""
    out: list[int] = []
    for token in prompt:
        out.append(out[-1] + 1 if token < 0 else token)
    return out


def _common(a: list[int], b: list[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def _conversations(seed: int) -> list[Conversation]:
    """Sessions over a few shared blocks: spans start inside blocks and end past them."""
    rng = random.Random(seed)
    out = []
    for i in range(12):
        turns = tuple(
            TraceTurn(0.0, rng.randint(0, 70), 3, prefix_blocks=tuple(
                rng.choice([(1, 2, 3), (1, 2), (1, 4), (2,), ()])[: rng.randint(0, 3)]
            )) for _ in range(rng.randint(1, 3))
        )  # fmt: skip
        out.append(Conversation(f"c{i}", turns, system_prefix_tokens=rng.choice([0, 0, 5, 40])))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_prompts_share_a_prefix_exactly_when_distinct_ids_would(seed: int) -> None:
    builder = PromptBuilder(block_tokens=32)
    prompts = []
    for conversation in _conversations(seed):
        prompt = builder.first_prompt(conversation)
        prompts.append(prompt)
        for index in range(1, len(conversation.turns)):
            prompt = builder.next_prompt(conversation, index, prompt, [5, 6, 7])
            prompts.append(prompt)
    distinct = [_distinct_ids(p) for p in prompts]
    assert all(min(d) >= 0 for d in distinct)
    for a in range(len(prompts)):
        for b in range(a):
            assert _common(prompts[a], prompts[b]) == _common(distinct[a], distinct[b])


@pytest.mark.parametrize("kv_block_size", [16, 7, 40])
def test_prompt_hashes_are_the_engines(kv_block_size: int) -> None:
    builder = PromptBuilder(block_tokens=32, kv_block_size=kv_block_size)
    for conversation in _conversations(7):
        hashes: list[int] = []
        prompt = builder.first_prompt(conversation, hashes)
        for index in range(len(conversation.turns)):
            if index:
                prompt = builder.next_prompt(conversation, index, prompt, [9, 8, 7], hashes)
            expected: list[int] = []
            extend_block_hashes(prompt, expected, kv_block_size, len(prompt) // kv_block_size)
            assert hashes == expected


def test_an_empty_trace_simulates_to_nothing() -> None:
    result = simulate(Trace("empty", ()), create_policy("colocate"), config(("mixed",)))
    assert (result.results, result.failure, result.stats.virtual_s) == ([], None, 0.0)


@pytest.mark.parametrize("collecting", [True, False])
def test_a_run_leaves_the_cyclic_collector_as_it_was(collecting: bool) -> None:
    (gc.enable if collecting else gc.disable)()
    try:
        simulate(single_turns(100, 200), create_policy("colocate"), config(("mixed",)))
        assert gc.isenabled() == collecting
    finally:
        gc.enable()


class OutcomeRecorder(Recorder):
    """Colocates like `Recorder` and keeps every outcome."""

    def __init__(self, params: NoParams | None = None) -> None:
        super().__init__(params)
        self.outcomes: list[Outcome] = []

    def observe(self, outcome: Outcome) -> None:
        self.outcomes.append(outcome)


def test_outcomes_carry_the_load_seen_at_placement_as_the_live_router_fills_them() -> None:
    # Three turns on w0 within one scrape interval: the scrape at t=0 saw w0 idle, so the
    # queue ahead of each is the legs in flight there not yet answering (by 0.2 s the first
    # one's 0.12 s prefill is done, the second's is not); the streams running come from the
    # scrape.
    trace = Trace(
        "t", tuple(Conversation(f"s{i}", (TraceTurn(0.1 * i, 4000, 4),)) for i in range(3))
    )
    policy = OutcomeRecorder()
    simulate(trace, policy, config(("mixed", "mixed"), scrape_interval_s=10.0))
    by_request = {o.request_id: o for o in policy.outcomes}
    placed = [by_request[turn.request_id] for turn, _ in policy.seen]
    assert [o.worker_waiting_at_start for o in placed] == [0, 1, 1]
    assert [o.worker_running_at_start for o in placed] == [0, 0, 0]
    # Turns run whole report no prefill stage: their TTFT holds the queue wait and prefill.
    assert all(o.prefill_ms is None and o.ttft_ms is not None for o in placed)
    assert all(o.queue_ms is not None and o.queue_ms < 1e-6 for o in placed)
