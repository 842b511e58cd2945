"""A continuous-batching engine that behaves like one vLLM instance, driven by a clock.

The caller drives it step by step: `begin_step()` freezes a batch and returns how long it
takes, the caller lets that much time pass (real or virtual), then `finish_step()` applies it.
The same engine therefore runs behind HTTP in real time and inside the discrete-event
simulator in virtual time.
"""

from __future__ import annotations

import heapq
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from sim.engine.clock import Clock
from sim.engine.kvcache import BlockManager, block_hash_at, extend_block_hashes
from sim.engine.presets import Deployment
from sim.engine.requests import EngineRequest, HeldBlocks, RequestStats, SeqState, StepOutput
from sim.engine.roofline import DEFAULT_EFFICIENCY, CostModel, Efficiency
from sim.engine.scheduler import schedule
from sim.worker.tokenizer import WordGenerator

_words_at = WordGenerator.token_ids_at

__all__ = [
    "Engine",
    "EngineConfig",
    "EngineRequest",
    "HeldBlocks",
    "RequestStats",
    "StepOutput",
]


@dataclass(frozen=True)
class EngineConfig:
    deployment: Deployment
    efficiency: Efficiency = DEFAULT_EFFICIENCY
    step_overhead_s: float = 0.0015
    noise_sigma: float = 0.02
    seed: int = 0
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    chunked_prefill: int | None = None  # max prefill tokens per request per step
    enable_prefix_caching: bool = True
    eos_probability: float = 0.0  # per generated token, after min_tokens, unless ignore_eos
    max_model_len: int | None = None  # default: the model's
    num_gpu_blocks_override: int | None = None  # as vLLM's flag: a KV cache of this many blocks
    # vLLM's --scheduling-policy: "fcfs" admits in arrival order, a request's priority ignored
    # (as vLLM 0.32; the worker refuses it where it follows an older vLLM); "priority" admits
    # the lowest priority value first, arrival order among equals.
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.chunked_prefill is not None and self.chunked_prefill < 1:
            raise ValueError(f"chunked_prefill must be >= 1, got {self.chunked_prefill}")
        if not 0.0 <= self.eos_probability <= 1.0:
            raise ValueError(f"eos_probability must be in [0, 1], got {self.eos_probability}")
        limit = self.deployment.model.max_model_len
        if self.max_model_len is not None and not 1 <= self.max_model_len <= limit:
            raise ValueError(f"max_model_len must be in [1, {limit}], got {self.max_model_len}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError("num_gpu_blocks_override must be >= 1")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(
                f"scheduling_policy must be fcfs or priority, got {self.scheduling_policy!r}"
            )


class Engine:
    """One simulated vLLM engine: scheduler, paged KV cache and cost model."""

    def __init__(self, config: EngineConfig, clock: Clock, engine_id: str = "engine-0") -> None:
        dep = config.deployment
        self.config = config
        self.clock = clock
        self.engine_id = engine_id
        self.max_model_len = config.max_model_len or dep.model.max_model_len
        num_blocks = config.num_gpu_blocks_override or dep.kv_capacity_blocks
        self.blocks = BlockManager(num_blocks, dep.block_size, config.enable_prefix_caching)
        self.cost_model = CostModel(
            dep, config.efficiency, config.step_overhead_s, config.noise_sigma, config.seed
        )
        self.held_timeout_s = 480.0
        self.num_preemptions = 0
        self.prompt_tokens_total = 0
        # vLLM's prompt_tokens_by_source, counted as each prompt is answered: they add up to
        # prompt_tokens_total.
        self.prompt_tokens_computed = 0
        self.prompt_tokens_local_hit = 0
        self.prompt_tokens_external = 0
        self.num_held_expired = 0  # held prefill legs freed unpulled at their deadline
        self.generation_tokens_total = 0
        self._words = WordGenerator(config.seed)
        self._eos_rng = random.Random(config.seed)
        self._waiting: deque[SeqState] = deque()
        self._running: list[SeqState] = []  # in admission order
        self._live: dict[str, SeqState] = {}
        self._held: dict[str, HeldBlocks] = {}
        self._held_heap: list[tuple[float, str]] = []
        self._batch: list[tuple[SeqState, int]] | None = None
        # The most recently begun step (for vllm:iteration_tokens_total and tests).
        self.last_step_tokens = 0
        self.last_step_requests = 0

    # -- gauges and counters ------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_held(self) -> int:
        return len(self._held)

    @property
    def kv_usage(self) -> float:
        return self.blocks.usage

    @property
    def prefix_cache_queries(self) -> int:
        return self.blocks.queries

    @property
    def prefix_cache_hits(self) -> int:
        return self.blocks.hits

    # -- requests -------------------------------------------------------------------------------
    def validate(self, prompt_tokens: int, max_tokens: int) -> str | None:
        """The error text vLLM would answer with (HTTP 400), or None when acceptable."""
        if prompt_tokens < 1:
            return "The decoder prompt cannot be empty"
        if max_tokens < 1:
            return f"max_tokens must be at least 1, got {max_tokens}."
        total = prompt_tokens + max_tokens
        if total > self.max_model_len:
            return (
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, you requested {total} tokens ({prompt_tokens} in the messages, "
                f"{max_tokens} in the completion). Please reduce the length of the messages "
                "or completion."
            )
        bs = self.blocks.block_size
        needed = -(-total // bs)
        if needed > self.blocks.num_blocks:
            return (
                f"This request needs {needed} KV cache blocks ({total} tokens) but the "
                f"engine has only {self.blocks.num_blocks} blocks of {bs} tokens."
            )
        return None

    def add_request(self, request: EngineRequest) -> None:
        problem = self.validate(len(request.prompt_token_ids), request.max_tokens)
        if problem is not None:
            raise ValueError(problem)
        if request.request_id in self._live:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        if not 0 <= request.min_tokens <= request.max_tokens:
            raise ValueError("min_tokens must be between 0 and max_tokens")
        if not 0 <= request.preloaded_tokens <= len(request.prompt_token_ids):
            raise ValueError("preloaded_tokens must be between 0 and the prompt length")
        seq = SeqState(request, self._words.request_key(request.request_id))
        if request.block_hashes:
            seq.hashes = self._given_hashes(seq.tokens, request.block_hashes)
        self._live[request.request_id] = seq
        self._enqueue(seq)

    def _given_hashes(self, prompt: list[int], given: list[int]) -> list[int]:
        """The caller's prompt block hashes, up to the prompt's full blocks, spot-checked."""
        bs = self.blocks.block_size
        hashes = given[: len(prompt) // bs]
        if hashes and block_hash_at(prompt, hashes, bs, len(hashes) - 1) != hashes[-1]:
            raise ValueError("block_hashes do not match the prompt at this block size")
        return hashes

    def abort_request(self, request_id: str) -> bool:
        """Drop a live request (or a held prefill leg) and free its blocks now."""
        seq = self._live.pop(request_id, None)
        if seq is None:
            return self.release_held(request_id)
        seq.aborted = True
        if seq.block_ids:
            self._running.remove(seq)
            self.blocks.free(seq.block_ids)
            seq.block_ids = []
        else:
            self._waiting.remove(seq)
        return True

    def has_work(self) -> bool:
        return bool(self._running or self._waiting)

    def cached_prefix_tokens(
        self, token_ids: Sequence[int], hashes: list[int] | None = None
    ) -> int:
        """Leading tokens whose full blocks are cached here (lookup only, no last-token rule).

        `hashes`: the sequence's block hashes as far as known (extended as needed).
        """
        return self.blocks.cached_prefix_tokens(token_ids, hashes)

    # -- steps ----------------------------------------------------------------------------------
    def begin_step(self) -> float | None:
        """Schedule and freeze the next step; its duration in seconds, or None if none can run.

        None with `has_work()` true means waiting requests cannot be admitted until blocks
        are freed (a finished step, an abort, or a held prefill leg released or expired).
        """
        if self._batch is not None:
            raise RuntimeError("begin_step called twice without finish_step")
        batch, decode_tokens, decode_sum, prefill_tokens, prefill_sum, pairs = schedule(self)
        if not batch:
            return None
        self._batch = batch
        self.last_step_tokens = decode_tokens + prefill_tokens
        self.last_step_requests = len(batch)
        return self.cost_model.sample_step_time(
            decode_tokens, decode_sum, prefill_tokens, prefill_sum, pairs
        )

    def steady_decode(self) -> bool:
        """Whether the frozen step decodes one token of every running request (prompts all
        answered), nothing waits and no EOS can be drawn: the steps that follow then have the
        same batch until a request finishes or arrives, or a block runs out
        (`sim.engine.decode_run`).
        """
        batch, running = self._batch, self._running
        if batch is None or self._waiting or len(batch) != len(running):
            return False
        if self.last_step_tokens != len(batch):  # a prefill among them
            return False
        if self.config.eos_probability > 0.0 and not all(s.request.ignore_eos for s in running):
            return False
        return all(s.first_token_time >= 0.0 for s in running)

    def finish_step(self) -> list[StepOutput]:
        """Apply the frozen step at clock.now(): write KV, sample tokens, finish requests."""
        batch = self._batch
        if batch is None:
            raise RuntimeError("finish_step called without begin_step")
        self._batch = None
        now = self.clock.now()
        blocks = self.blocks
        bs = blocks.block_size
        caching = blocks.enable_prefix_caching
        eos_p = self.config.eos_probability
        new_output = tuple.__new__  # StepOutput without its Python-level __new__
        outputs: list[StepOutput] = []
        emit = outputs.append
        sampled = 0
        any_finished = False
        for seq, n in batch:
            if seq.aborted:
                continue
            before = seq.num_computed
            computed = before + n
            seq.num_computed = computed
            tokens = seq.tokens
            if caching and computed // bs > before // bs:
                full = computed // bs
                hashes = seq.hashes
                if len(hashes) < full:
                    extend_block_hashes(tokens, hashes, bs, full)
                blocks.register_blocks(seq.block_ids, hashes, before // bs, full)
            if computed < len(tokens):
                continue  # a prefill chunk; the prompt is not complete yet
            if seq.first_token_time < 0.0:
                seq.first_token_time = now
                self.prompt_tokens_total += seq.prompt_len
                local_hit = seq.cached_tokens - seq.preloaded_stat
                self.prompt_tokens_local_hit += local_hit
                self.prompt_tokens_external += seq.external_tokens
                self.prompt_tokens_computed += seq.prompt_len - local_hit - seq.external_tokens
            g = seq.generated
            if eos_p > 0.0 and self._samples_eos(seq):
                emit(self._finish(seq, [], "stop", now))
                any_finished = True
                continue
            upcoming = seq.upcoming
            if not upcoming:  # words are computed a few at a time, in one pass
                upcoming = seq.upcoming = _words_at(seq.key, g, min(32, seq.max_tokens - g))
                upcoming.reverse()
            tid = upcoming.pop()
            tokens.append(tid)
            seq.generated = g + 1
            sampled += 1
            if g + 1 >= seq.max_tokens:
                emit(self._finish(seq, [tid], "length", now))
                any_finished = True
            else:
                emit(new_output(StepOutput, (seq.request_id, [tid], None, None)))
        self.generation_tokens_total += sampled
        if any_finished:
            self._running = [s for s in self._running if not s.finished]
        return outputs

    def _samples_eos(self, seq: SeqState) -> bool:
        """Whether the request samples EOS now (draws only when EOS is allowed)."""
        req = seq.request
        if seq.generated < req.min_tokens or req.ignore_eos:
            return False
        return self._eos_rng.random() < self.config.eos_probability

    def _finish(self, seq: SeqState, token_ids: list[int], reason: str, now: float) -> StepOutput:
        seq.finished = True
        del self._live[seq.request_id]
        hold = reason == "length" and seq.request.hold_blocks_on_finish
        if hold:
            self._hold(seq, now)
        else:
            self.blocks.free(seq.block_ids)
        seq.block_ids = []
        return StepOutput(seq.request_id, token_ids, reason, seq.stats(now, hold))

    def preempt(self, seq: SeqState) -> None:
        """Recompute preemption of a request the scheduler just removed from `running`."""
        self.blocks.free(seq.block_ids)
        seq.block_ids = []
        seq.num_computed = 0
        seq.preemptions += 1
        self.num_preemptions += 1
        self._enqueue(seq, ahead_of_equals=True)

    def _enqueue(self, seq: SeqState, ahead_of_equals: bool = False) -> None:
        """Into the waiting queue: at its end (a preempted request at its head), or under the
        priority policy after every request of a lower value (before its equals when preempted)."""
        waiting = self._waiting
        if self.config.scheduling_policy == "fcfs" or not waiting:
            if ahead_of_equals:
                waiting.appendleft(seq)
            else:
                waiting.append(seq)
            return
        priority = seq.request.priority
        index = len(waiting)
        # from the back: requests mostly arrive in deadline order, so this stops early
        while index > 0 and (
            waiting[index - 1].request.priority >= priority
            if ahead_of_equals
            else waiting[index - 1].request.priority > priority
        ):
            index -= 1
        waiting.insert(index, seq)

    # -- held prefill legs (P/D) ----------------------------------------------------------------
    def _hold(self, seq: SeqState, now: float) -> None:
        rid = seq.request_id
        if rid in self._held:  # the same id finished a prefill leg twice: keep the newest
            self.release_held(rid)
        deadline = now + self.held_timeout_s
        self._held[rid] = HeldBlocks(seq.tokens[: seq.num_computed], seq.block_ids, deadline)
        heapq.heappush(self._held_heap, (deadline, rid))

    def held_request(self, request_id: str) -> HeldBlocks | None:
        return self._held.get(request_id)

    def release_held(self, request_id: str) -> bool:
        """Free a finished prefill leg's blocks (after its KV was pulled); False if not held."""
        held = self._held.pop(request_id, None)
        if held is None:
            return False
        self.blocks.free(held.block_ids)
        if len(self._held_heap) > 2 * len(self._held) + 64:  # drop stale heap entries
            self._held_heap = [(d, r) for d, r in self._held_heap if self._is_live_hold(d, r)]
            heapq.heapify(self._held_heap)
        return True

    def _is_live_hold(self, deadline: float, request_id: str) -> bool:
        held = self._held.get(request_id)
        return held is not None and held.deadline == deadline

    def expire_held(self) -> int:
        """Release every hold whose deadline has passed at clock.now(); how many."""
        now = self.clock.now()
        count = 0
        # release_held may rebuild the heap, so read the attribute on every iteration.
        while self._held_heap and self._held_heap[0][0] <= now:
            deadline, rid = heapq.heappop(self._held_heap)
            if self._is_live_hold(deadline, rid):
                self.release_held(rid)
                count += 1
        self.num_held_expired += count
        return count

    def next_held_deadline(self) -> float | None:
        heap = self._held_heap
        while heap and not self._is_live_hold(*heap[0]):
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    # -- for the scheduler ------------------------------------------------------------------------
    @property
    def running(self) -> list[SeqState]:
        return self._running

    @property
    def waiting(self) -> deque[SeqState]:
        return self._waiting
