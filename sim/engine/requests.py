"""The engine's request types: what goes in, what comes out, and the per-request state."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


@dataclass
class EngineRequest:
    """One generation request as the engine receives it (token ids already rendered)."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_time: float
    min_tokens: int = 0
    ignore_eos: bool = False
    hold_blocks_on_finish: bool = False  # P/D prefill leg (do_remote_decode)
    preloaded_tokens: int = 0  # KV for this many leading prompt tokens was pulled
    # Under the "priority" scheduling policy, lower values are admitted first (vLLM's request
    # `priority`); equal values keep their arrival order.
    priority: int = 0
    # The prompt's chained block hashes (`sim.engine.kvcache.extend_block_hashes` at the engine's
    # block size), when the caller has them already: legs and turns of one prompt share them.
    block_hashes: list[int] | None = None


@dataclass(frozen=True)
class RequestStats:
    """Per-request accounting, attached to a request's finishing output.

    `cached_tokens` counts prompt tokens not computed at first scheduling (a local prefix
    hit or pulled KV; the last prompt token is always computed); `preloaded_tokens` is the part
    of those that came from a pull rather than the local prefix cache.
    """

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    arrival_time: float
    first_scheduled_time: float
    first_token_time: float
    finished_time: float
    num_preemptions: int
    held_blocks: bool
    preloaded_tokens: int = 0

    @property
    def local_hit_tokens(self) -> int:
        """The prompt tokens found in the local prefix cache: vLLM 0.32's `cached_tokens`
        (pulled KV is not counted there)."""
        return self.cached_tokens - self.preloaded_tokens


class StepOutput(NamedTuple):
    """What one step produced for one request.

    A request that samples EOS finishes with "stop" and emits no token for it: the EOS is
    not part of the text and not counted in completion_tokens.
    """

    request_id: str
    token_ids: list[int]  # tokens generated for this request in this step (usually 1)
    finish_reason: str | None  # None, "stop", "length"
    stats: RequestStats | None  # set on the finishing output only


class HeldBlocks(NamedTuple):
    """A finished prefill leg's KV, kept referenced until pulled (released) or expired."""

    token_ids: list[int]  # the tokens whose KV the blocks hold
    block_ids: list[int]
    deadline: float


class SeqState:
    """The engine's mutable state of one live request (waiting or running)."""

    __slots__ = (
        "aborted",
        "block_ids",
        "cached_tokens",
        "external_tokens",
        "finished",
        "first_scheduled_time",
        "first_token_time",
        "generated",
        "hashes",
        "key",
        "max_tokens",
        "num_computed",
        "preemptions",
        "preloaded",
        "preloaded_stat",
        "prompt_len",
        "request",
        "request_id",
        "tokens",
        "upcoming",
    )

    def __init__(self, request: EngineRequest, key: int) -> None:
        self.request = request
        self.request_id = request.request_id
        self.tokens = list(request.prompt_token_ids)  # prompt, then generated tokens
        self.prompt_len = len(self.tokens)
        self.key = key  # WordGenerator request key
        self.max_tokens = request.max_tokens
        self.upcoming: list[int] = []  # the next generated token ids, the next one last
        self.preloaded = request.preloaded_tokens  # cleared once used (not after preemption)
        self.num_computed = 0  # tokens whose KV is written
        self.generated = 0
        self.block_ids: list[int] = []
        self.hashes: list[int] = []  # chained hashes of full blocks, computed lazily
        self.cached_tokens = 0
        self.preloaded_stat = 0
        # The prompt tokens that came by transfer as vLLM's prompt_tokens_by_source counts
        # them: the whole pulled span beyond the local hit, its recomputed last token included.
        self.external_tokens = 0
        self.first_scheduled_time = -1.0
        self.first_token_time = -1.0
        self.preemptions = 0
        self.aborted = False
        self.finished = False

    def stats(self, finished_time: float, held: bool) -> RequestStats:
        return RequestStats(
            prompt_tokens=self.prompt_len,
            cached_tokens=self.cached_tokens,
            completion_tokens=self.generated,
            arrival_time=self.request.arrival_time,
            first_scheduled_time=self.first_scheduled_time,
            first_token_time=self.first_token_time,
            finished_time=finished_time,
            num_preemptions=self.preemptions,
            held_blocks=held,
            preloaded_tokens=self.preloaded_stat,
        )
