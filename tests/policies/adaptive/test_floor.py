"""`Scorer.handoff_floor` against the candidates it bounds: on seeded fleets whose ledgers hold
earlier placements, every split placement's floor is no later (TTFT, exposure, cost) than the
candidate itself, to the last bit, with the same harm: what lets `AdaptivePolicy.search` skip
the candidates whose floor already loses."""

from __future__ import annotations

import pytest

from policies.adaptive.policy import AdaptivePolicy
from policies.eligibility import DECODE_ROLES, PREFILL_ROLES, can_serve
from tests.policies.adaptive.test_shortlists import _outcome, _turns


@pytest.mark.parametrize(("count", "layout", "seed"), [(8, "mixed", 1), (12, "split", 2)])
def test_a_floor_bounds_its_candidate_exactly(count: int, layout: str, seed: int) -> None:
    policy = AdaptivePolicy()
    checked = 0
    for n, (turn, view) in enumerate(_turns(count, layout, 60, seed)):
        found = policy.search(turn, view)
        assert found is not None
        scorer = found.scorer
        prefills = [w for w in view.workers if can_serve(w, PREFILL_ROLES)]
        decodes = [w for w in view.workers if can_serve(w, DECODE_ROLES)]
        for prefill in prefills:
            for held in (None, scorer.hold(prefill)):
                if n % 2 and held is None:
                    continue
                for decode in decodes:
                    if decode is prefill:
                        continue
                    ttft, harm, exposure, cost = scorer.handoff_floor(prefill, decode, held)
                    for action in ("handoff", "migrate"):
                        candidate = scorer.handoff(prefill, decode, action, held)
                        assert harm == candidate.harm
                        assert ttft <= candidate.ttft_ms
                        assert exposure <= candidate.exposure
                        assert cost <= candidate.cost
                        checked += 1
        policy.observe(_outcome(turn, policy.decide(turn, view)))
    assert checked > 1000
