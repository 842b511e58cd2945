"""The simulated workers in virtual time: one `sim.engine.engine.Engine` per worker on one clock,
and the `sim.fabric.links.Fabric` their KV transfers share.

An engine step is one event: `begin_step` gives its duration, the step's end is scheduled, and
at that time `finish_step` applies it and the next step begins. When the next step of the same
engine would end before any other pending event, it runs at once without a round trip through
the heap (nothing else can happen in between, so the result is identical and cheaper). Token
outputs are delivered to their `Leg` as chunk timestamps in a list, never as events.

An engine in steady decode runs a `sim.engine.decode_run.DecodeRun` instead: its steps up to the
next change are drawn at once and one event is scheduled at the last one's end. Whoever reads or
changes the engine in between goes through `engine(i)`, which first applies the steps that
have ended by now, and a request sent there ends the run after the step in flight.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from heapq import heappush
from typing import Any

from bench.des.config import SimConfig
from bench.des.loop import EventLoop
from sim.engine.decode_run import DecodeRun
from sim.engine.engine import Engine, EngineConfig, EngineRequest, RequestStats, StepOutput
from sim.engine.presets import deployment_from_names
from sim.fabric.links import Fabric

# on_finish(leg, finish_reason, stats, now)
FinishCallback = Callable[["Leg", str, RequestStats, float], None]

# The most steps one decode run plans ahead: a request that arrives ends the run early, and
# the end times computed past it are wasted (its noise draws are handed back).
MAX_RUN_STEPS = 256


class Leg:
    """One request the router sent to one worker; `chunks` are its token times.

    `tokens` collects the generated token ids when the caller needs them (the next turn of a
    session resends the answer), else it is None and nothing is copied.
    """

    __slots__ = ("chunks", "engine_id", "on_finish", "owner", "started", "tokens", "worker")

    def __init__(
        self, owner: Any, worker: int, on_finish: FinishCallback, keep_tokens: bool = False
    ) -> None:
        self.owner = owner
        self.worker = worker
        self.on_finish = on_finish
        # The scrape epoch in which it began answering (`ViewBuilder.begin`), else -1.
        self.started = -1
        self.engine_id = ""
        self.chunks: list[float] = []
        self.tokens: list[int] | None = [] if keep_tokens else None


class SimWorker:
    __slots__ = ("busy", "engine", "index", "role", "run", "wake_at", "worker_id")

    def __init__(self, index: int, worker_id: str, role: str, engine: Engine) -> None:
        self.index = index
        self.worker_id = worker_id
        self.role = role
        self.engine = engine
        self.busy = False  # a step is about to begin, in flight, or its end is being applied
        self.wake_at: float | None = None  # a pending wake-up for a held-block deadline
        self.run: DecodeRun | None = None  # the steady decode in flight, if any


def _ignore(leg: Leg) -> None:
    pass


class Cluster:
    def __init__(self, config: SimConfig, loop: EventLoop) -> None:
        spec = config.cluster
        self.deployment = deployment_from_names(spec.gpu, spec.model, spec.tp)
        self.kv_bytes_per_token = self.deployment.kv_bytes_per_token
        self.loop = loop
        # Called with each leg at its first token (`ViewBuilder.begin`).
        self.on_first_token: Callable[[Leg], None] = _ignore
        spine = None if config.spine_gbps is None else config.spine_gbps * 1e9 / 8
        self.fabric = Fabric(spine_bps=spine)
        nic_bps = config.nic_gbps * 1e9 / 8
        self.workers: list[SimWorker] = []
        ids = config.worker_ids
        for index, (worker_id, role) in enumerate(zip(ids, config.roles, strict=True)):
            engine_config = EngineConfig(
                deployment=self.deployment,
                seed=config.seed + index,
                noise_sigma=config.noise_sigma,
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                chunked_prefill=config.chunked_prefill,
                eos_probability=config.eos_probability,
                scheduling_policy=config.scheduling_policy,
            )
            engine = Engine(engine_config, loop.clock, engine_id=worker_id)
            engine.held_timeout_s = config.kv_hold_timeout_s
            self.workers.append(SimWorker(index, worker_id, role, engine))
            self.fabric.add_nic(worker_id, nic_bps, nic_bps, config.nic_latency_s)
        self.legs: dict[str, Leg] = {}
        self.steps = 0  # engine steps applied
        self.inline_steps = 0  # of which run without a heap round trip
        self.stale_events = 0  # run ends of runs cut short: heap events that did nothing
        self._leg_ids = 0
        self._transfers: dict[int, tuple[Callable[[Any], None], Any]] = {}
        self._fabric_generation = 0
        self._step_end_event = self._step_end  # bound once: pushed for every step
        self._run_end_event = self._run_end

    # -- requests ---------------------------------------------------------------------------
    def new_engine_id(self, request_id: str) -> str:
        self._leg_ids += 1
        return f"{request_id}-{self._leg_ids}"

    def submit(self, leg: Leg, request: EngineRequest) -> str | None:
        """Hand `request` to the leg's worker; the error text vLLM would answer, or None."""
        worker = self.workers[leg.worker]
        engine = worker.engine
        problem = engine.validate(len(request.prompt_token_ids), request.max_tokens)
        if problem is not None:
            return problem
        if worker.run is not None:  # the next step admits it: the batch changes
            self._cut_run(worker)
        leg.engine_id = request.request_id
        engine.add_request(request)
        self.legs[request.request_id] = leg
        self.kick(worker)
        return None

    def held_tokens(self, worker: int, engine_id: str) -> int | None:
        """Tokens of KV a finished prefill leg still holds there; None once released/expired."""
        target = self.workers[worker]
        engine = self.engine(worker)
        if engine.num_held and engine.expire_held():
            self.kick(target)  # expired holds freed blocks a waiting request may need
        held = engine.held_request(engine_id)
        return None if held is None else len(held.token_ids)

    def release_held(self, worker: int, engine_id: str) -> None:
        target = self.workers[worker]
        if self.engine(worker).release_held(engine_id):
            self.kick(target)  # freed blocks may admit a waiting request

    # -- engine steps -------------------------------------------------------------------------
    def kick(self, worker: SimWorker) -> None:
        """Begin the worker's next step now, unless one is in flight.

        The step begins in an event of its own at the current time, after the callbacks
        already due now: requests that arrive at the same instant join the same step, as they
        do when the live engine's runner wakes up.
        """
        if worker.busy:
            return
        worker.busy = True
        self.loop.at(self.loop.clock.now(), self._begin, worker)

    def _begin(self, worker: SimWorker) -> None:
        engine = worker.engine
        if engine.num_held:
            engine.expire_held()
        duration = engine.begin_step()
        if duration is None:
            worker.busy = False
            self._blocked(worker)
            return
        end = self.loop.clock.now() + duration
        if not (engine.steady_decode() and self._start_run(worker, end)):
            self.loop.at(end, self._step_end_event, worker)

    def _step_end(self, worker: SimWorker) -> None:
        engine = worker.engine
        loop = self.loop
        heap = loop.heap
        clock = loop.clock
        legs = self.legs
        now = clock.t
        steps = 0
        while True:
            steps += 1
            outputs: list[StepOutput] = engine.finish_step()
            for request_id, token_ids, reason, stats in outputs:
                leg = legs[request_id]
                if token_ids:
                    if not leg.chunks:
                        self.on_first_token(leg)
                    leg.chunks.append(now)
                    if leg.tokens is not None:
                        leg.tokens += token_ids
                if reason is not None:
                    del legs[request_id]
                    assert stats is not None
                    leg.on_finish(leg, reason, stats, now)
            if engine.num_held:
                engine.expire_held()
            duration = engine.begin_step()
            if duration is None:
                worker.busy = False
                self._blocked(worker)
                break
            end = now + duration
            if loop.stopped:
                break
            if engine.steady_decode() and self._start_run(worker, end):
                break
            if heap and heap[0][0] <= end:
                loop.seq += 1  # loop.at without its checks: `end` is in the future
                heappush(heap, (end, loop.seq, self._step_end_event, worker))
                break
            clock.t = now = end
        self.steps += steps
        self.inline_steps += steps - 1

    # -- steady decode runs ---------------------------------------------------------------------
    def engine(self, worker: int) -> Engine:
        """The worker's engine as of now: the steps of its decode run that have ended applied."""
        target = self.workers[worker]
        run = target.run
        if run is not None:
            self._deliver(run, run.steps_by(self.loop.clock.t))
        return target.engine

    def _start_run(self, worker: SimWorker, first_end: float) -> bool:
        """Run the steady step just begun and those after it as one `DecodeRun`, if worth it."""
        loop = self.loop
        run = None if loop.stopped else DecodeRun.plan(worker.engine, first_end, MAX_RUN_STEPS)
        if run is None:
            return False
        worker.run = run
        loop.seq += 1  # loop.at without its checks: the run ends in the future
        heappush(loop.heap, (run.ends[-1], loop.seq, self._run_end_event, (worker, run)))
        return True

    def _run_end(self, event: tuple[SimWorker, DecodeRun]) -> None:
        worker, run = event
        if worker.run is not run:
            self.stale_events += 1  # cut short: its last step ended as an ordinary one
            return
        self._deliver(run, run.steps - 1)
        worker.run = None
        self._step_end(worker)  # the last step finishes step by step

    def _cut_run(self, worker: SimWorker) -> None:
        """End the worker's run after the step in flight now, which ends as an ordinary one."""
        run = worker.run
        assert run is not None
        self._deliver(run, run.steps_by(self.loop.clock.t))
        worker.run = None
        end = run.truncate()
        loop = self.loop
        if not loop.stopped:
            loop.seq += 1
            heappush(loop.heap, (end, loop.seq, self._step_end_event, worker))

    def _deliver(self, run: DecodeRun, upto: int) -> None:
        """Apply the run's steps up to `upto` and hand their tokens to the legs."""
        done = run.advance(upto)
        if done is None:
            return
        times, outputs = done
        legs = self.legs
        for request_id, token_ids in outputs:
            leg = legs[request_id]
            if times and not leg.chunks:
                self.on_first_token(leg)
            leg.chunks += times
            if leg.tokens is not None:
                leg.tokens += token_ids
        self.steps += len(times)
        self.inline_steps += len(times)

    def settle(self) -> None:
        """Apply every run's steps that have ended by now (for the step counts)."""
        for worker in self.workers:
            if worker.run is not None:
                self.engine(worker.index)

    def _blocked(self, worker: SimWorker) -> None:
        """No step could start: wake at the next held-block deadline if work is waiting."""
        engine = worker.engine
        if not engine.has_work():
            return
        deadline = engine.next_held_deadline()
        if deadline is None or worker.wake_at == deadline:
            return
        worker.wake_at = deadline
        self.loop.at(max(deadline, self.loop.clock.now()), self._wake, worker)

    def _wake(self, worker: SimWorker) -> None:
        worker.wake_at = None
        self.kick(worker)

    # -- transfers ----------------------------------------------------------------------------
    def transfer(
        self, src: int, dst: int, nbytes: int, done: Callable[[Any], None], argument: Any
    ) -> None:
        """Move `nbytes` of KV from worker `src` to `dst`; then `done(argument)` runs."""
        now = self.loop.clock.now()
        fabric = self.fabric
        transfer_id = fabric.start(
            self.workers[src].worker_id, self.workers[dst].worker_id, nbytes, now
        )
        self._transfers[transfer_id] = (done, argument)
        self._reschedule(now)

    def _reschedule(self, now: float) -> None:
        self._fabric_generation += 1
        when = self.fabric.next_completion(now)
        if when is not None:
            # Never schedule at `now` for a transfer `advance` did not report (float residue).
            when = when if when > now else math.nextafter(now, math.inf)
            self.loop.at(when, self._fabric_due, self._fabric_generation)

    def _fabric_due(self, generation: int) -> None:
        if generation != self._fabric_generation:
            return  # superseded: a transfer started or finished since
        now = self.loop.clock.now()
        for transfer_id in self.fabric.advance(now):
            done, argument = self._transfers.pop(transfer_id)
            done(argument)
        self._reschedule(now)

    # -- telemetry ------------------------------------------------------------------------------
    def load(self, worker: int) -> tuple[int, int, float]:
        """(running, waiting, KV usage) as the worker's /metrics would report them now."""
        target = self.workers[worker]
        engine, run = target.engine, target.run
        if run is None:
            return engine.num_running, engine.num_waiting, engine.kv_usage
        # A run's batch holds until it ends: only its allocations change the gauges.
        usage = run.kv_usage(run.steps_by(self.loop.clock.t))
        return engine.num_running, engine.num_waiting, usage
