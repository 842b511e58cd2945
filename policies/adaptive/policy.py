"""`adaptive`: place each turn where I > H + dQ + dC says it costs goodput least.

For every turn the policy enumerates the feasible placements (policies.adaptive.scoring has the
formulas): the whole turn on the resident worker (colocate) or on any other decode/mixed worker
(recompute, or colocate for a new session), all with KV usage below `migrate_kv_usage` when any
is (past a screen of the least loaded on a large fleet, the emptiest caches and the fullest
workers with room); a handoff (shortlists: `policies.adaptive.shortlists`) from one of the
`shortlist` least-loaded prefill/mixed workers, the `shortlist` whose recent slow steps already
expose what decodes there, or the worker that prefilled the session's last split turn (its
prefix cache still holds that prompt), to the resident worker or to one of the decode
shortlist: the `shortlist` least loaded and the `shortlist` whose recent slow steps least
expose an answer decoded there; and, when the resident worker is overloaded
(`migrate_queue_threshold` requests waiting or KV usage at least `migrate_kv_usage`) or cannot
serve the turn itself, a migration of its state to one of those (run as a handoff from the
resident, whose cache holds the context); else a handoff prefills there only where that is a
slow step. A session without residency never migrates.

Terms are in expected objective misses: the streams beside a prefill its slow steps push past
their ITL budgets (harm, `policies.adaptive.scoring`; behind the prefill work placed there and
not yet done, `WorkLedger`, it shares slow batched steps), the slow steps the answer will meet
where it decodes (exposure, from the `StallLedger` of recent placements, `stall_window_s`) and
the KV cache it would fill there, the sessions' contexts the KV it adds evicts from the
workers' prefix caches (`CacheLedger`: each prefilled again when its session returns), and the
risk to the turn's own TTFT objective (its queue: the larger of the learned wait behind the
queue depth and the placed work ahead); where nothing is at risk, the faster placement that
takes less GPU time wins.
Choice: the candidate that meets the turn's own objectives (its TTFT, and its ITL: an
exposure below one slow gap over its budget; at a harm within one expected miss of the
reference's for a returning session, of the least harmful candidate's for a new one), at the
least cost (I > H + dQ + dC against the colocated reference; off the resident worker it must
win by `SEPARATION_MARGIN`); then the lower cost among the others; ties go to colocate,
handoff, migrate, recompute, then to the lower worker ids: the decision depends only on the
view, the estimates, the ledgers and the sessions seen (`policies.adaptive.admission`), never on the
order of the workers.
When the best candidate misses the objective, the turn is served best effort, unless it misses
by more than a rejection sheds (`policies.adaptive.admission`): then it is rejected with
`retry_after_s`, or served anyway with `on_infeasible=serve`. Every served turn is due at its TTFT
objective (`due_ms`; at most twice the laxest of the fresh sessions', once it for a light returning
turn, `policies.adaptive.admission.Deadlines`): a worker with priority scheduling admits it ahead of
the requests queued there but due later, so there the rejection counts only the placed work
due before it (and the prefill already running); the placement itself is scored first come,
first served.

`decide` records the placement in the ledgers under the request id (deciding the same turn
again replaces it, so it returns the same decision; a split turn's decode leg is counted on
its decode worker until its prefill is predicted to end, `LegLedger`); `observe` calibrates
the estimates, told what the placed prefill leg was assumed to find (a split turn's outcome
counts the decode leg's cache hit, and the prefill leg's only where its worker reported it),
takes the finished turn's work off the `WorkLedger`, learns the prefix fresh sessions
find cached anywhere (`Estimates.shared_prefix_tokens`), and tells the `CacheLedger` when the
session's turn ended (it learns the gaps until a session's next prefill begins).

The reference is the colocate on the resident worker, or else the best whole-turn candidate.
`predicted` is relative to it, in ms: interference_ms = the stall ms past the streams' slack
and the turn's own wait, I(reference) - I(chosen) (at least 0; for the reference itself, what
it accepts), exposed_transfer_ms = H, queue/compute deltas against the reference, ttft_ms of
the chosen. The reason states I and H + dQ + dC in expected misses.
"""

from __future__ import annotations

import math
from typing import ClassVar

from policies.adaptive import tuning
from policies.adaptive.admission import Admission, Deadlines
from policies.adaptive.candidates import Candidate
from policies.adaptive.decision import decision_of, explain, ms_text, predicted_terms
from policies.adaptive.fleet import FleetIndex
from policies.adaptive.ledgers.cache import CacheLedger, kv_capacity_tokens
from policies.adaptive.ledgers.legs import LegLedger, StallLedger, forget_oldest
from policies.adaptive.ledgers.streams import Leg, StreamLedger
from policies.adaptive.ledgers.work import WorkLedger
from policies.adaptive.params import AdaptiveParams as AdaptiveParams
from policies.adaptive.ranking import Key, Search, rank_key
from policies.adaptive.scoring import Hold, Scorer
from policies.adaptive.shortlists import (
    decode_shortlist,
    prefill_shortlist,
)
from policies.costmodel.calibration import Average
from policies.costmodel.estimates import Estimates, PrefillLeg
from policies.eligibility import DECODE_ROLES, can_serve, reject_no_worker
from policies.types import (
    Action,
    ClusterView,
    Decision,
    LinkView,
    Outcome,
    Reject,
    Turn,
    WorkerView,
)


class AdaptivePolicy:
    """Colocate, hand off, migrate, recompute or reject, whichever costs least (see module)."""

    name: ClassVar[str] = "adaptive"
    Params: ClassVar[type[AdaptiveParams]] = AdaptiveParams

    def __init__(self, params: AdaptiveParams | None = None, *, exhaustive: bool = False) -> None:
        self.params = p = params if params is not None else AdaptiveParams()
        # Score every worker, not the shortlists' few (what the shortlists are tested against).
        self._exhaustive = exhaustive
        self.estimates = Estimates.from_presets(
            p.gpu, p.model, p.tp, chunk_tokens=p.chunked_prefill, rate=p.learning_rate
        )
        # The router reuses one links tuple between ledger refreshes: index it once per tuple,
        # not once per turn (a fleet of N workers has up to N^2 links).
        self._fleet = FleetIndex(p.migrate_kv_usage, p.max_num_seqs)
        self._indexed_links: tuple[LinkView, ...] = ()
        self._link_index: dict[tuple[str, str], LinkView] = {}
        self._stalls = StallLedger(p.stall_window_s)
        self._work = WorkLedger()
        self._coming = LegLedger()
        self._done = StreamLedger(p.stall_window_s)
        self._cache = CacheLedger(
            kv_capacity_tokens(p.gpu, p.model, p.tp), p.cache_window_s, p.learning_rate
        )
        self._now_s = -math.inf  # the latest view's time
        self._observed_s = -math.inf  # the latest view's time when an outcome came
        # Fresh sessions' first turns placed whole: what they find cached is shared.
        self._fresh: dict[str, None] = {}
        self._admission = Admission()
        self._deadlines = Deadlines()
        # The mean prefill this policy places (predicted when placed): a placed request's
        # size in the queue ahead of later ones, relative to it.
        self._placed_prefill: Average | None = None
        # What each placed turn's prefill leg was assumed to find (outcomes count a split
        # turn's cache hit at its decode leg).
        self._legs: dict[str, tuple[Action, PrefillLeg]] = {}
        # Per session, the worker that prefilled its last split turn and that prompt's size:
        # its prefix cache still holds it (the residency names only the decode worker).
        # Keyed by request too, so deciding a turn again sees what it saw the first time.
        self._prefixes: dict[str, tuple[_Prefix, ...]] = {}

    def decide(self, turn: Turn, view: ClusterView) -> Decision:
        found = self.search(turn, view)
        if found is None:
            return reject_no_worker("decode")
        best, reference, rival = found.best, found.reference, found.rival
        p = self.params
        index = found.index
        residency = view.residency
        predicted = predicted_terms(best, reference)
        objective = turn.objectives.ttft_ms
        self._admission.note(turn.session_id, turn.request_id)
        limit = self._admission.limit_ms(objective)
        new_tokens = turn.prompt_tokens - best.leg.cached
        due = self._deadlines.due_ms(objective, residency is None, new_tokens)
        rejected = (
            p.on_infeasible == "reject"
            and not self._probe(best, view, index, turn.request_id)
            and self._passing_ttft(best, view, index, due, turn.request_id) > limit
        )
        # The placed prefill's slow steps expose the answers decoding beside it later on.
        self._stalls.place(
            turn.request_id, None if rejected else best.workers[0], view.now_s, best.slow_steps
        )
        # Its prefill keeps that worker busy: the turns placed there next wait behind it.
        hold_s = best.hold_ms / 1000.0
        self._work.place(
            turn.request_id,
            None if rejected else best.workers[0],
            view.now_s + hold_s,
            best.work_ms,
            self._weigh(best.prefill_ms) if not rejected else 1.0,
            view.now_s + due / 1000.0,
        )
        # Its decode leg takes a slot and KV where it goes, unseen until its prefill ends.
        split = not rejected and len(best.workers) > 1
        self._coming.place(
            turn.request_id,
            best.workers[1] if split else None,
            view.now_s + best.sent_ms / 1000.0,
            best.leg_tokens,
        )
        # Until when it occupies its workers: a held prefill waits for them to be done.
        legs = () if rejected else _ends(best, view.now_s)
        run = None  # when a held prefill runs, and its slow steps
        if hold_s > 0.0 and not rejected:
            release = view.now_s + hold_s
            run = (release, release + best.prefill_ms / 1000.0, best.slow_steps)
        self._done.place(turn.request_id, legs, view.now_s, run)
        self._cache.place(turn.request_id, () if rejected else best.fills, view.now_s)
        if residency is not None and not rejected:
            # Its context stayed cached (or not) until its prefill began, after its queue.
            self._cache.returned(turn.session_id, view.now_s + best.queue_ms / 1000.0)
        self._fresh.pop(turn.request_id, None)
        self._legs.pop(turn.request_id, None)
        if not rejected:
            if best.action in ("handoff", "migrate"):
                _remember(self._prefixes, turn, best.workers[0])
            self._legs[turn.request_id] = (best.action, best.leg)
            forget_oldest(self._legs)
        if residency is None and not rejected and best.action == "colocate":
            self._fresh[turn.request_id] = None
            forget_oldest(self._fresh)
        verdict = f"best {best.describe()} predicts TTFT {ms_text(best.ttft_ms)} > "
        if rejected:
            reason = f"reject: {verdict}{ms_text(limit)}"
            return Reject(retry_after_s=p.retry_after_s, predicted=predicted, reason=reason)
        if best.ttft_ms > objective:
            # still due when it was: behind the turns due earlier, ahead of later ones
            reason = f"best effort, {verdict}{ms_text(objective)}"
            return decision_of(best, predicted, reason, due)
        reason = explain(best, reference, rival, objective)
        return decision_of(best, predicted, reason, due)

    def search(self, turn: Turn, view: ClusterView) -> Search | None:
        """The best candidate for `turn` on `view`, the reference and the rival the reason
        names (None: no worker can decode it); it places nothing."""
        p = self.params
        now = view.now_s
        if now > self._now_s:
            self._now_s = now
        # The fleet's workers by id and ranked by load, re-ranked only where their views
        # changed since the last turn (`FleetIndex`): the terms are computed only for the
        # workers the shortlists keep (`policies.adaptive.shortlists`).
        fleet = self._fleet
        fleet.sync(view.workers, view.changes)
        index = fleet.index
        roomy_keys = fleet.roomy  # decode-capable with KV usage below migrate_kv_usage
        full_keys = fleet.full  # decode-capable, the others
        kv_limit = p.migrate_kv_usage
        self._work.settle_pending(index, now)
        if not roomy_keys and not full_keys:
            return None
        residency = view.residency
        source = index.get(residency.worker_id) if residency is not None else None
        resident = source if source is not None and can_serve(source, DECODE_ROLES) else None
        links = view.links
        if links is not self._indexed_links:
            self._link_index = {(link.src, link.dst): link for link in links}
            self._indexed_links = links
        prefix = _prefix_of(self._prefixes, turn)
        skip = resident.worker_id if resident is not None else ""
        # A new answer goes where its KV fits: a full cache preempts the streams running there.
        roomy = len(roomy_keys) - (resident is not None and resident.kv_usage < kv_limit)
        pooled = len(roomy_keys) if roomy > 0 else len(roomy_keys) + len(full_keys)
        exhaustive = self._exhaustive
        screened = pooled if exhaustive else tuning.SCREENED_WORKERS
        if roomy > 0:
            chosen = fleet.least(roomy_keys, screened, skip)
        else:  # the least loaded of both rankings
            pool = sorted(
                fleet.head(roomy_keys, screened + 1) + fleet.head(full_keys, screened + 1)
            )
            chosen = fleet.least(pool, screened, skip)
        if pooled > screened + 1:
            # and the emptiest caches: where a turn's KV evicts least and crowds no stream
            taken = set(chosen)
            emptiest = fleet.emptiest(p.shortlist + len(taken) + 1)
            chosen += _unscreened(emptiest, taken, skip, p.shortlist)
            # and the fullest with room: where an answer packs best (`TurnTerms.pace`); a
            # screen of the least loaded alone never offers a decode hub, and a fleet past
            # the screen spread its answers over workers that then hosted no slow prefill
            fullest = fleet.most(roomy_keys, p.shortlist + 1)
            chosen += _unscreened(fullest, set(chosen), skip, p.shortlist)
        screen = [index[wid] for wid in chosen]
        # Up to the screen's size, every decode-capable worker prices a context prefilled
        # again; past it, the workers scored here do (the least loaded: it errs low).
        decoders = len(roomy_keys) + len(full_keys)
        small = exhaustive or decoders <= tuning.SCREENED_WORKERS
        # the three prefill-capable workers with the fewest streams (`TurnTerms._avoided`)
        calmest = [(fleet.value_of(k), fleet.id_of(k)) for k in fleet.head(fleet.streams, 3)]
        scorer = Scorer(
            turn,
            view,
            self.estimates,
            links=self._link_index,
            horizon_s=p.link_horizon_s,
            default_bps=p.default_link_bps,
            stalls=self._stalls,
            prefix=prefix,
            work=self._work,
            max_seqs=p.max_num_seqs,
            legs=self._coming,
            done=self._done,
            max_hold_s=p.max_hold_s,
            continuing=self._admission.continuing,
            cache=self._cache,
            index=index,
            host_fresh_s=0.0 if small else tuning.HOST_RATE_FRESH_S,
            prefill_streams=calmest,
        )
        key = rank_key(turn)
        others = decode_shortlist(screen, p.shortlist, scorer)
        decode_targets = [resident, *others] if resident is not None else others
        prefills = prefill_shortlist(
            fleet, p.shortlist, prefix, scorer, None if exhaustive else self._stalls
        )
        if not small:
            scored = {w.worker_id: w for w in (resident, *screen, *prefills) if w is not None}
            scorer.refill_from([w for w in scored.values() if can_serve(w, DECODE_ROLES)])
        # A whole turn can go to any of them (one candidate each); splits to the shortlist.
        whole = [scorer.whole(worker) for worker in (resident, *screen) if worker is not None]
        # Colocating where the state lives is what any separation must beat.
        reference = whole[0] if resident is not None else min(whole, key=key)
        # Held twins: the same placements once the streams their prefill would stall end.
        holds = [(w, scorer.hold(w)) for w in (resident, *screen) if w is not None]
        whole += [scorer.whole(w, held) for w, held in holds if held is not None]
        # The split placements, each ranked first by its floor (`Scorer.handoff_floor`): only
        # those whose floor could still win (or come second: the reason names the runner-up)
        # are scored.
        splits: list[_Split] = []
        mover = None
        if (
            source is not None
            and source.accepts_new_work
            and (resident is None or _overloaded(source, p))
        ):
            # The router runs a migration as a handoff from the source: the state moves on.
            mover = source
            for destination in others:
                if destination.kv_usage < p.migrate_kv_usage:
                    splits.append((source, destination, "migrate", None))
        for prefill in prefills:
            # Else the answer (the session) leaves only to get away from a slow prefill.
            if prefill is mover or (prefill is source and not scorer.slow_prefill(prefill)):
                continue
            held = scorer.hold(prefill)
            for decode in decode_targets:
                if decode is not prefill:
                    splits.append((prefill, decode, "handoff", None))
                    if held is not None:
                        splits.append((prefill, decode, "handoff", held))
        floors = [scorer.handoff_floor(split[0], split[1], split[3]) for split in splits]
        if resident is not None:
            rank = rank_key(turn, reference)
        else:  # a new session's turn may not stall the streams running where it prefills
            least = min(c.harm for c in whole)
            for floor in floors:
                least = floor[1] if floor[1] < least else least
            rank = rank_key(turn, least_harm=least)
        # (key, the order exhaustive scoring lists it in: the first of equals wins)
        ref_entry: tuple[Key, int] = (rank(reference), 0)
        rival: tuple[Key, int] | None = None
        rival_candidate: Candidate | None = None
        for order, candidate in enumerate(whole):
            if candidate is not reference:
                entry = (rank(candidate), order)
                if rival is None or entry < rival:
                    rival, rival_candidate = entry, candidate
            else:
                ref_entry = (ref_entry[0], order)
        ranked = sorted(
            (rank.floor(floors[order], split[2], (split[0].worker_id, split[1].worker_id)), order)
            for order, split in enumerate(splits)
        )
        first = len(whole)
        for bound, order in ranked:
            if rival is not None and bound > rival[0]:
                break  # it, and every one ranked after it, loses to the rival
            prefill, decode, action, held = splits[order]
            candidate = scorer.handoff(prefill, decode, action, held)
            entry = (rank(candidate), first + order)
            if rival is None or entry < rival:
                rival, rival_candidate = entry, candidate
        best = reference
        if rival is not None and rival_candidate is not None and rival < ref_entry:
            best = rival_candidate
        return Search(best, reference, rival_candidate, scorer, index)

    def _passing_ttft(
        self,
        best: Candidate,
        view: ClusterView,
        workers: dict[str, WorkerView],
        due_ms: float,
        request_id: str,
    ) -> float:
        """`best`'s predicted TTFT where its worker admits the earliest due first (priority
        scheduling; `due_ms` after now): the turn passes the placed work queued there that is
        due after it."""
        worker = workers.get(best.workers[0])
        if worker is None or not worker.priority_scheduling:
            return best.ttft_ms
        due_s = view.now_s + due_ms / 1000.0
        share = self._work.due_share(worker.worker_id, view.now_s, due_s, request_id)
        return best.ttft_ms - best.queue_ms * (1.0 - share)

    def _probe(
        self, best: Candidate, view: ClusterView, workers: dict[str, WorkerView], request_id: str
    ) -> bool:
        """Whether to serve a predicted miss to learn from it (`tuning.PROBE_AFTER_S`): no
        outcome came for a while, none of this policy's placed turns is still to report and
        `best`'s workers are idle. The prediction then rests on old outcomes alone, and
        rejecting would keep it there for good after the fleet recovered."""
        if view.now_s - self._observed_s <= tuning.PROBE_AFTER_S:
            return False
        if len(self._legs) > (request_id in self._legs):
            return False
        for worker_id in best.workers:
            worker = workers.get(worker_id)
            if worker is None or worker.inflight > 0 or worker.running > 0 or worker.waiting > 0:
                return False
        return True

    def _weigh(self, prefill_ms: float) -> float:
        """A placed prefill's size in mean placed prefills (`WorkLedger.queued`)."""
        mean = self._placed_prefill
        if mean is None:
            self._placed_prefill = Average(prefill_ms, self.params.learning_rate)
            return 1.0
        weight = prefill_ms / mean.value if mean.value > 0.0 else 1.0
        mean.add(prefill_ms)
        return weight

    def observe(self, outcome: Outcome) -> None:
        if outcome.ok:  # a rejection, or a failure, teaches the estimates nothing
            self._observed_s = self._now_s
        placed = self._legs.pop(outcome.request_id, None)
        leg = placed[1] if placed is not None and placed[0] == outcome.action else None
        self.estimates.observe(outcome, leg)
        self._cache.ended(outcome.request_id, outcome.session_id, self._now_s)
        self._stalls.forget(outcome.request_id)
        self._work.finish(outcome.request_id, self._now_s)
        self._coming.finish(outcome.request_id)
        self._done.finish(outcome.request_id)
        if outcome.request_id in self._fresh:
            del self._fresh[outcome.request_id]
            self.estimates.observe_fresh(outcome)


# a split placement: prefill worker, decode worker, action, its hold
_Split = tuple[WorkerView, WorkerView, Action, Hold | None]


def _ends(chosen: Candidate, now_s: float) -> tuple[Leg, ...]:
    """Each leg of the chosen placement and when it is predicted done on its worker: a split
    turn's prefill leg when its KV is sent, its answer after its decode."""
    last = now_s + (chosen.ttft_ms + chosen.decode_ms) / 1000.0
    if len(chosen.workers) == 1:
        return ((chosen.workers[0], last),)
    return (chosen.workers[0], now_s + chosen.sent_ms / 1000.0), (chosen.workers[1], last)


_Prefix = tuple[str, str, int]  # request, prefill worker, prompt tokens


def _prefix_of(table: dict[str, tuple[_Prefix, ...]], turn: Turn) -> tuple[str, int] | None:
    """Where the session's last split turn before this one was prefilled, and its prompt."""
    for request, worker, tokens in reversed(table.get(turn.session_id, ())):
        if request != turn.request_id:
            return worker, tokens
    return None


def _remember(table: dict[str, tuple[_Prefix, ...]], turn: Turn, worker: str) -> None:
    kept = [e for e in table.pop(turn.session_id, ()) if e[0] != turn.request_id]
    table[turn.session_id] = (*kept[-1:], (turn.request_id, worker, turn.prompt_tokens))
    forget_oldest(table)


def _unscreened(workers: list[str], screened: set[str], skip: str, count: int) -> list[str]:
    """The first `count` of `workers` neither `screened` nor `skip`."""
    return [w for w in workers if w not in screened and w != skip][:count]


def _overloaded(worker: WorkerView, params: AdaptiveParams) -> bool:
    return (
        worker.waiting >= params.migrate_queue_threshold
        or worker.kv_usage >= params.migrate_kv_usage
    )
