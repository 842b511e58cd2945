"""Generated bodies, headers and raw request heads against a running router (the adaptive
policy, simulated workers): no 5xx, no hang, no crash, every 4xx OpenAI-shaped. A few hundred
cases here; `python -m bench.scripts.fuzz --cases 10000` runs the same generators longer."""

from __future__ import annotations

import asyncio

from bench.scripts.fuzz import fuzz
from tests.e2e.conftest import SimCluster, StartRouter

CASES = 100  # of each kind: bodies with headers, raw bodies, raw heads
READ_TIMEOUT_S = 0.5  # a truncated head is answered (408) or closed this soon
DEADLINE_S = 10.0


async def test_fuzzed_requests_get_no_5xx_and_no_hang(
    sim4: SimCluster, start_router: StartRouter
) -> None:
    router = start_router(
        "--policy", "adaptive", "--prefill", sim4.urls[0], "--decode", sim4.urls[1],
        "--mixed", sim4.urls[2], "--client-read-timeout-s", str(READ_TIMEOUT_S),
    )  # fmt: skip
    tally = await asyncio.to_thread(fuzz, router.url, CASES, DEADLINE_S)
    assert tally.failures == []
    assert tally.cases >= 3 * CASES
    assert tally.statuses[200] > 0 and tally.statuses[400] > 0  # both kinds were exercised
    assert router.process.popen.poll() is None  # the router is still up
