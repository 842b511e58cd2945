"""What the adaptive policy's chosen candidate becomes: its `Decision`, the terms it predicts
against the colocated reference, and the reason it gives (I against H + dQ + dC, in expected
objective misses; `policies.adaptive.scoring` has the formulas)."""

from __future__ import annotations

from policies.adaptive import tuning
from policies.adaptive.candidates import Candidate
from policies.types import Colocate, Decision, Handoff, Migrate, Prediction, Recompute


def predicted_terms(chosen: Candidate, reference: Candidate) -> Prediction:
    if chosen is reference:
        return Prediction(interference_ms=chosen.interference_ms, ttft_ms=chosen.ttft_ms)
    avoided = reference.interference_ms - chosen.interference_ms
    return Prediction(
        interference_ms=avoided if avoided > 0.0 else 0.0,
        exposed_transfer_ms=chosen.transfer_ms,
        queue_delta_ms=chosen.queue_ms - reference.queue_ms,
        compute_delta_ms=chosen.compute_ms - reference.compute_ms,
        ttft_ms=chosen.ttft_ms,
    )


def _separation(candidate: Candidate, reference: Candidate) -> tuple[float, float]:
    """(I avoided, H + dQ + dC) of `candidate` against the colocated `reference`, in expected
    objective misses (policies.adaptive.scoring)."""
    avoided = reference.interference - candidate.interference
    pacing = _share(candidate) - _share(reference)
    added = candidate.risk - reference.risk + tuning.TTFT_WEIGHT * pacing
    return avoided, added


def _share(candidate: Candidate) -> float:
    return (candidate.cost - candidate.misses) / tuning.TTFT_WEIGHT


def explain(
    best: Candidate,
    reference: Candidate,
    rival: Candidate | None,
    objective: float,
) -> str:
    """Why `best` won: against the colocated `reference`, or where it is the reference,
    against the `rival` (the best ranked of the others; None: none)."""
    if best is not reference:
        avoided, added = _separation(best, reference)
        text = f"{best.describe()}: {_inequality(best, avoided, added)}"
        if avoided <= added:
            text += f"; {reference.describe()} misses TTFT ({ms_text(reference.ttft_ms)})"
        return text
    if rival is None:
        return f"{best.describe()}: the only candidate"
    avoided, added = _separation(rival, reference)
    text = f"{best.describe()}: {_inequality(rival, avoided, added)} of {rival.describe()}"
    if rival.ttft_ms > objective:
        text += f", which misses TTFT ({ms_text(rival.ttft_ms)})"
    return text


def _inequality(candidate: Candidate, avoided: float, added: float) -> str:
    relation = ">" if avoided > added else "<="
    return (
        f"I={avoided:.2f} {relation} H+dQ+dC={added:.2f} misses "
        f"(H={ms_text(candidate.transfer_ms)}, TTFT {ms_text(candidate.ttft_ms)})"
    )


def ms_text(value: float) -> str:
    text = f"{value:.0f}"
    return ("0" if text == "-0" else text) + "ms"


def decision_of(
    candidate: Candidate, predicted: Prediction, reason: str, due_ms: float
) -> Decision:
    first = candidate.workers[0]
    hold = candidate.hold_ms / 1000.0
    match candidate.action:
        case "colocate":
            return Colocate(
                worker=first, predicted=predicted, reason=reason, hold_s=hold, due_ms=due_ms
            )
        case "recompute":
            return Recompute(
                worker=first, predicted=predicted, reason=reason, hold_s=hold, due_ms=due_ms
            )
        case "handoff":
            return Handoff(
                prefill_worker=first,
                decode_worker=candidate.workers[1],
                predicted=predicted,
                reason=reason,
                hold_s=hold,
                due_ms=due_ms,
            )
        case "migrate":
            return Migrate(
                source=first,
                destination=candidate.workers[1],
                predicted=predicted,
                reason=reason,
                due_ms=due_ms,
            )
    raise AssertionError(f"no decision for action {candidate.action!r}")
