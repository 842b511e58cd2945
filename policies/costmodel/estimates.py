"""Stage-time estimates: a roofline prior per quantity, corrected online from outcomes.

All times are in ms. With P parameters, L layers, H heads, d head dim, W weight bytes, kv KV
bytes per token, O the step overhead (1.5 ms), F = peak FLOP/s x tp x 0.6 and
B = HBM bytes/s x tp x 0.85 (the prior's efficiencies):

- prefill of n uncached tokens after c cached ones, in chunks of s tokens (one chunk of n
  unchunked), each chunk's step fused with the decode step of the r streams running beside
  it (mean context x; r = 0 on a prefill worker), as continuous batching runs them. A chunk of
  m tokens after b tokens of context costs
      linear    = (2 P m + r 2 P) / F
      attention = (4 L H d m (b + m / 2) + r 4 L H d x) / F
      memory    = (W + kv (b + m) + kv r (x + 1)) / B
  and the prefill = (number of chunks) x fo x O + max(fl x linear + fa x attention,
  fm x memory) of the full chunks summed + the same of the last chunk: the full chunks share
  one regime, a short last chunk may sit in the other.
- one decode step of b streams of mean context x:
      linear    = b 2 P / F
      attention = b 4 L H d x / F
      memory    = (W + kv b (x + 1)) / B
      step      = fo x O + max(fl x linear + fa x attention, fm x memory)
- queue wait behind q requests: max(0, base + fq x q x typical), where `typical` is the EWMA
  of the predicted prefill of each turn served (what a request ahead costs; q may count a
  request by its own predicted prefill over the mean placed, as `adaptive` does); the router
  measures the wait only inside a stage, the prefill leg of a split turn or the TTFT of a
  whole one, so each wait sample is that stage less its predicted prefill and the base
  (`policies.costmodel.calibration`, which holds the learning parts);
- link rate: EWMA of observed bytes / second per (src, dst) link (at `LINK_RATE_FACTOR` x
  rate), and over every link for a link not used yet;
- workload means: the answer length (completion tokens) and the shared prefix, the tokens a
  fresh session's first turn, run whole on one worker, found cached there (`observe_fresh`).

The base and the factors fo, fl, fa and fm are one model, fitted fleet-wide and per worker (a
worker starts from the fleet's fit when it first reports; a worker that never reported uses
the fleet's) by recursive least squares (`Correction`): a prefill stage that found no request
queued ahead teaches all five (base + prefill; else the stage is mostly queue wait, and
teaches the queue), a decode step the four factors. Each part of a stage teaches the roof that
binds it. Fitted together, the numbers do not take each other's share: a base learnt apart,
as the mean residual of factors, keeps a constant that flattens the prefill's slope across
prompt sizes; one compute factor cannot price a long session's attention (on CPUs its share
of peak is far below the weights' products'); a fixed step overhead hands a CPU's slow steps
to the memory factor, which then makes short prefills memory-bound. Two roofs let a prior GPU
whose compute and bandwidth ratios differ from the real one's (h200 prior, a100 truth: 3.2x
the FLOP/s but 2.4x the bandwidth) converge in both regimes. Factors stay within [0.05, 20],
the base within a minute; non-finite, non-positive, hour-long and failed observations are
ignored. Means (context, typical prefill, answer length, shared prefix) start as running
means with the prior as one sample, then turn into EWMAs.

Outcome counts: `worker_running_at_start` is read as the decode batch the turn joined (and, for
a turn prefilled where it decodes, the streams its prefill shared steps with, at the mean
observed context); `worker_waiting_at_start` as the requests queued ahead of it at its prefill
worker.
"""

from __future__ import annotations

from typing import NamedTuple

from policies.costmodel.calibration import FACTOR_MAX as FACTOR_MAX
from policies.costmodel.calibration import FACTOR_MIN as FACTOR_MIN
from policies.costmodel.calibration import (
    Average,
    Correction,
    QueueModel,
    plausible,
)
from policies.costmodel.priors import gpu_prior, model_prior
from policies.costmodel.roofline import RooflinePrior, Terms
from policies.types import Outcome

TYPICAL_PROMPT_TOKENS = 2048
TYPICAL_COMPLETION_TOKENS = 256
COMPLETION_TOKENS_MAX = 1 << 20
LINK_BPS_MIN = 1e6
LINK_BPS_MAX = 1e13
# A stage reported to last an hour or more is a broken clock, not a measurement.
STAGE_MS_MAX = 3.6e6
# Bounds the per-worker and per-link tables against a stream of unknown names.
MAX_TRACKED = 4096
# Per-worker factors within this of the fleet's are taken as the fleet's (noise, not speed).
WORKER_DEADBAND = 0.15
# The fit of the base and the roof factors remembers about this many samples over `rate`:
# four numbers need several samples each, more than one running mean does, and a decode
# stage's mean step scatters (the prefills that joined its steps, a batch that changed
# under it): remembering a few dozen, the fit wandered along what few samples pin (the
# memory roof against the step overhead) to its bounds.
FIT_MEMORY = 20.0
# A link's rate moves with what its two ends run (on CPUs a pull waits for the source engine's
# steps), faster than a GPU's speed: its EWMA follows at this many times `rate`.
LINK_RATE_FACTOR = 3.0
# The workload's mean context moves slowly and its samples are heavy-tailed.
CONTEXT_RATE_FRACTION = 0.2


class Estimates:
    """Prefill, decode-step, queue-wait and link-rate estimates for one deployment kind.

    Reads are pure; only `observe` changes state, so decisions between two observations are
    deterministic.
    """

    def __init__(
        self, prior: RooflinePrior, *, chunk_tokens: int | None = None, rate: float = 0.1
    ) -> None:
        if chunk_tokens is not None and chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1 or None, got {chunk_tokens}")
        if not 0.0 < rate <= 1.0:
            raise ValueError(f"rate must be in (0, 1], got {rate}")
        self.prior = prior
        self.chunk_tokens = chunk_tokens
        self.rate = rate
        # One fit per GPU, shared by prefill and decode: the roofs are the hardware's, and
        # each stage teaches the roof it binds (decode steps the bandwidth, long prefills the
        # FLOP/s). Separate fits let a short, memory-bound prefill predicted as compute-bound
        # (its memory factor never taught) inflate the compute one. The base's prior spread
        # is the uncorrected prefill of a typical prompt, which the typical prefill starts at.
        typical_ms = Correction().predict(
            prior.prefill_terms(TYPICAL_PROMPT_TOKENS, 0, chunk_tokens)
        )
        self._prefill = Correction(base_spread_ms=typical_ms)
        self._decode = self._prefill
        self._prefill_by_worker: dict[str, Correction] = {}
        self._decode_by_worker = self._prefill_by_worker
        self._link_bps: dict[tuple[str, str], float] = {}
        self._fleet_link_bps: float | None = None
        # The context of a stream found decoding: each answer's mean context weighted by how
        # long it decodes (its tokens), a ratio of two running means. Long answers fill the
        # batches for longer than short ones, whatever their share of the turns.
        context_rate = rate * CONTEXT_RATE_FRACTION
        self._stream_tokens = Average(float(TYPICAL_COMPLETION_TOKENS), context_rate)
        self._context_tokens = Average(
            float(TYPICAL_PROMPT_TOKENS * TYPICAL_COMPLETION_TOKENS), context_rate
        )
        self._completion = Average(float(TYPICAL_COMPLETION_TOKENS), rate * CONTEXT_RATE_FRACTION)
        self._shared = Average(0.0, rate)
        self._typical_prefill = Average(typical_ms, rate)
        self._queue = QueueModel(self._typical_prefill.value, rate)

    @classmethod
    def from_presets(
        cls,
        gpu: str = "h200-sxm",
        model: str = "llama-3.1-8b",
        tp: int = 1,
        *,
        chunk_tokens: int | None = None,
        rate: float = 0.1,
    ) -> Estimates:
        """Estimates seeded from named presets (PolicyConfigError for unknown names)."""
        prior = RooflinePrior(gpu_prior(gpu), model_prior(model), tp)
        return cls(prior, chunk_tokens=chunk_tokens, rate=rate)

    def prefill_chunks(self, uncached: int) -> int:
        """Engine steps a prefill of `uncached` tokens takes (1 unless chunked prefill)."""
        chunk = self.chunk_tokens
        if chunk is None or uncached <= chunk:
            return 1
        return -(-uncached // chunk)

    def prefill_ms(
        self, uncached: int, cached: int = 0, worker: str | None = None, running: int = 0
    ) -> float:
        """Time to prefill `uncached` new tokens (at least one) after `cached` reused ones, in
        steps shared with `running` decode streams of the mean observed context."""
        n = uncached if uncached > 1 else 1
        terms = self.prior.prefill_terms(
            n,
            cached if cached > 0 else 0,
            self.chunk_tokens,
            running,
            self.mean_context_tokens,
        )
        correction = self._worker_correction(worker)
        return correction.predict(terms)

    def prefill_work_ms(self, uncached: int, cached: int = 0, worker: str | None = None) -> float:
        """The arithmetic of that prefill alone (its compute roof): what it adds to a step it
        shares with others, whose overhead and weight reads are paid once for all."""
        terms = self.prior.prefill_terms(uncached if uncached > 1 else 1, max(cached, 0))
        correction = self._worker_correction(worker)
        linear, attention = terms[1] + terms[4], terms[2] + terms[5]
        return correction.linear * linear + correction.attention * attention

    def decode_step_ms(self, batch: int, context: float, worker: str | None = None) -> float:
        """One decode step of `batch` streams (at least one) of `context` tokens each."""
        terms = self.prior.decode_terms(batch if batch > 1 else 1, context if context > 0 else 0)
        correction = self._worker_correction(worker)
        return correction.predict(terms)

    def _worker_correction(self, worker: str | None) -> Correction:
        """The worker's own factors where they differ from the fleet's by more than
        `WORKER_DEADBAND` (a slower or faster GPU), else the fleet's: within it the difference
        is what each worker happened to observe, and ranking workers by it would herd turns
        onto whichever looks a few percent faster."""
        fleet = self._prefill
        own = self._prefill_by_worker.get(worker) if worker is not None else None
        if own is None:
            return fleet
        if abs(own.overhead / fleet.overhead - 1.0) > WORKER_DEADBAND:
            return own
        if abs(own.linear / fleet.linear - 1.0) > WORKER_DEADBAND:
            return own
        if abs(own.attention / fleet.attention - 1.0) > WORKER_DEADBAND:
            return own
        if abs(own.memory / fleet.memory - 1.0) > WORKER_DEADBAND:
            return own
        return fleet

    @property
    def mean_context_tokens(self) -> float:
        """The mean context of a decode stream running beside others, as seen so far: each
        answer's mean context weighted by its decode tokens (a ratio of EWMAs)."""
        tokens = self._stream_tokens.value
        return self._context_tokens.value / tokens if tokens > 0.0 else 0.0

    @property
    def mean_completion_tokens(self) -> float:
        """The mean length of the answers seen so far, in tokens (EWMA)."""
        return self._completion.value

    @property
    def shared_prefix_tokens(self) -> float:
        """The prefix a fresh session finds cached on a worker it never ran on (EWMA)."""
        return self._shared.value

    def observe_fresh(self, outcome: Outcome) -> None:
        """Learn the shared prefix from a session's first turn, run whole on one worker."""
        if outcome.ok and outcome.action == "colocate" and outcome.prompt_tokens > 0:
            self._shared.add(min(max(0, outcome.cached_tokens), outcome.prompt_tokens))

    @property
    def typical_prefill_ms(self) -> float:
        """What one queued request's prefill takes in this workload (EWMA of predictions)."""
        return self._typical_prefill.value

    @property
    def base_ms(self) -> float:
        """What a turn that finds no queue waits besides its prefill (fitted with the roofs)."""
        return self._prefill.base

    def queue_wait_ms(self, depth: float) -> float:
        """Wait before a new request's prefill starts behind `depth` queued requests (a
        fraction or a multiple of one where a request's prefill is known to be short or long)."""
        return self._queue.wait_ms(depth, self._typical_prefill.value, self._prefill.base)

    def link_bps(self, src: str, dst: str) -> float | None:
        """Observed transfer rate of the link src -> dst, None until a transfer reported."""
        return self._link_bps.get((src, dst))

    def expected_link_bps(self, src: str, dst: str) -> float | None:
        """The link's observed rate, else that of every link's transfers (a link the fleet has
        not used yet is taken to run like those it has: the same fabric, the same engines'
        connector), None before any transfer reported."""
        known = self._link_bps.get((src, dst))
        return known if known is not None else self._fleet_link_bps

    def factors(self, worker: str | None = None) -> dict[str, float]:
        """The current correction factors (fleet-wide, or of `worker`), for reports."""
        prefill = self._prefill_by_worker.get(worker, self._prefill) if worker else self._prefill
        decode = self._decode_by_worker.get(worker, self._decode) if worker else self._decode
        return {
            "prefill_overhead": prefill.overhead,
            "prefill_linear": prefill.linear,
            "prefill_attention": prefill.attention,
            "prefill_memory": prefill.memory,
            "decode_overhead": decode.overhead,
            "decode_linear": decode.linear,
            "decode_attention": decode.attention,
            "decode_memory": decode.memory,
            "queue": self._queue.factor,
        }

    def observe(self, outcome: Outcome, prefill: PrefillLeg | None = None) -> None:
        """Calibrate from one placed turn; failed turns and missing stages teach nothing.

        `prefill`: what the placement assumed of its prefill leg (the cached tokens and the
        decode streams on its worker); a split turn's outcome counts the decode leg's own
        prefix-cache hit (vLLM counts no pulled KV there) and, where the prefill worker
        reported it, the prefill leg's (`Outcome.prefill_cached_tokens`), which replaces the
        assumed one."""
        if not outcome.ok:
            return
        running = max(0, outcome.worker_running_at_start)
        if 0 < outcome.completion_tokens < COMPLETION_TOKENS_MAX:
            self._completion.add(outcome.completion_tokens)
        decoded = plausible(outcome.decode_ms, STAGE_MS_MAX) and outcome.completion_tokens >= 2
        if decoded:
            self._observe_decode(outcome, running)
        queued = outcome.queue_ms
        if queued is not None and not 0.0 <= queued < STAGE_MS_MAX:
            queued = None
        stage = _prefill_stage(outcome, queued)
        leg = prefill if prefill is not None else _leg_of(outcome, running)
        found = outcome.prefill_cached_tokens
        if found is not None and outcome.action not in WHOLE_ACTIONS:
            # What the prefill leg found, not what its placement assumed: a prefix cached
            # where none was assumed would otherwise teach a faster GPU.
            leg = leg._replace(cached=found)
        if stage is not None:
            self._observe_prefill(outcome, leg, stage, queued or 0.0)
        elif queued is not None:
            self._queue.observe(
                queued - self._prefill.base, _ahead(leg, outcome), self._typical_prefill.value
            )
        if decoded or stage is not None:
            self._observe_size(outcome, leg)
        if plausible(outcome.transfer_ms, STAGE_MS_MAX) and outcome.transfer_bytes > 0:
            self._observe_transfer(outcome)

    def _observe_decode(self, outcome: Outcome, running: int) -> None:
        assert outcome.decode_ms is not None
        step = outcome.decode_ms / (outcome.completion_tokens - 1)
        context = max(0, outcome.prompt_tokens) + 0.5 * outcome.completion_tokens
        # The streams beside it at the mean context, as a prediction counts them
        # (`TurnTerms._decode_on`): taken at this turn's own, a long context would teach a
        # slower memory roof for a whole batch of short ones, and a short one a faster.
        batch = running + 1
        beside = (running * self.mean_context_tokens + context) / batch
        terms = self.prior.decode_terms(batch, beside)
        self._learn(self._decode, self._decode_by_worker, outcome.decode_worker, terms, step, False)
        decoded = outcome.completion_tokens - 1
        self._stream_tokens.add(decoded)
        self._context_tokens.add(context * decoded)

    def _observe_prefill(
        self, outcome: Outcome, leg: PrefillLeg, stage: float, queued: float
    ) -> None:
        """`stage` = the engine's queue wait + the prefill: the part the prefill predicted for
        it cannot explain is queue wait; a turn that found no queue teaches the roofs."""
        prompt = max(0, outcome.prompt_tokens)
        cached = min(max(0, leg.cached), prompt)
        uncached = max(1, prompt - cached)
        terms = self.prior.prefill_terms(
            uncached, cached, self.chunk_tokens, max(0, leg.beside), self.mean_context_tokens
        )
        worker = outcome.prefill_worker or outcome.decode_worker
        correction = self._prefill_by_worker.get(worker or "", self._prefill)
        predicted = correction.predict(terms)
        depth = _depth(outcome)
        ahead = leg.ahead_ms if leg.ahead_ms > 0.0 else 0.0
        # The stage also holds the wait for the prefill work placed ahead (no scrape counts a
        # running prefill): taken off, a turn that found no queue waited the base and its
        # prefill. A ledger counting too much or too little ahead teaches the opposite error,
        # which corrects it; behind more than this prefill, the ledger's error would drown it.
        own = stage - ahead
        if depth == 0 and ahead < predicted and own > 0.0:
            self._learn(self._prefill, self._prefill_by_worker, worker, terms, own, True)
        depth_ahead = _ahead(leg, outcome)
        if depth_ahead > 0:
            excess = queued + stage - predicted - self._prefill.base
            self._queue.observe(excess, depth_ahead, self._typical_prefill.value)

    def _observe_size(self, outcome: Outcome, leg: PrefillLeg) -> None:
        """What a request ahead in a queue costs: this workload's prefill, as predicted (an
        observed prefill stage also holds the wait before it)."""
        prompt = max(0, outcome.prompt_tokens)
        cached = min(max(0, leg.cached), prompt)
        worker = outcome.prefill_worker or outcome.decode_worker
        self._typical_prefill.add(self.prefill_ms(prompt - cached, cached, worker))

    def _observe_transfer(self, outcome: Outcome) -> None:
        src, dst = outcome.prefill_worker, outcome.decode_worker
        if src is None or dst is None or src == dst:
            return
        assert outcome.transfer_ms is not None
        bps = min(
            max(outcome.transfer_bytes * 1000.0 / outcome.transfer_ms, LINK_BPS_MIN), LINK_BPS_MAX
        )
        rate = min(1.0, LINK_RATE_FACTOR * self.rate)
        fleet = self._fleet_link_bps
        self._fleet_link_bps = bps if fleet is None else fleet + rate * (bps - fleet)
        key = (src, dst)
        known = self._link_bps.get(key)
        if known is None:
            if len(self._link_bps) < MAX_TRACKED:
                self._link_bps[key] = bps
            return
        self._link_bps[key] = known + rate * (bps - known)

    def _learn(
        self,
        fleet: Correction,
        by_worker: dict[str, Correction],
        worker: str | None,
        terms: Terms,
        observed: float,
        with_base: bool,
    ) -> None:
        memory = FIT_MEMORY / self.rate
        if worker is not None:
            own = by_worker.get(worker)
            if own is None and len(by_worker) < MAX_TRACKED:
                own = by_worker[worker] = fleet.copy()
            if own is not None:
                own.update(terms, observed, with_base, memory)
        fleet.update(terms, observed, with_base, memory)


WHOLE_ACTIONS = ("colocate", "recompute")


class PrefillLeg(NamedTuple):
    """A turn's prefill as placed: tokens cached on its worker, decode streams beside it,
    the ms of prefill work placed there before it and not yet done (no scrape counts a
    prefill already running, however long), and the requests queued ahead of it as
    `Estimates.queue_wait_ms` counts them (None: the outcome's `worker_waiting_at_start`)."""

    cached: int
    beside: int
    ahead_ms: float = 0.0
    queued: float | None = None


def _prefill_stage(outcome: Outcome, queued: float | None) -> float | None:
    """The engine's queue wait + the prefill, in ms: the prefill leg of a split turn, or the
    TTFT of a turn run whole (less the router's own queue stage); None when unmeasured."""
    if plausible(outcome.prefill_ms, STAGE_MS_MAX):
        return outcome.prefill_ms
    if outcome.action in WHOLE_ACTIONS and plausible(outcome.ttft_ms, STAGE_MS_MAX):
        assert outcome.ttft_ms is not None
        stage = outcome.ttft_ms - (queued or 0.0) - outcome.held_ms
        return stage if stage > 0.0 else None
    return None


def _leg_of(outcome: Outcome, running: int) -> PrefillLeg:
    """The prefill leg as the outcome tells it: its cached tokens, and the decode streams
    beside it where the turn decoded on the same worker (a split one's prefill worker: none)."""
    beside = running if outcome.action in WHOLE_ACTIONS else 0
    return PrefillLeg(outcome.cached_tokens, beside)


def _ahead(leg: PrefillLeg, outcome: Outcome) -> float:
    """The requests queued ahead of the turn when it was placed."""
    return leg.queued if leg.queued is not None else _depth(outcome)


def _depth(outcome: Outcome) -> int:
    return outcome.worker_waiting_at_start if outcome.worker_waiting_at_start > 0 else 0
