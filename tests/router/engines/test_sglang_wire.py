"""Our SGLang adapter against captures of SGLang's own router (sglang-router 0.3.2 in PD mode in
front of capture servers, tests/sglang_capture.py) and /metrics pages rendered by SGLang
0.5.23's own metric collectors (tests/fixtures/sglang/README.md says how each was made)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from router.engines import sglang
from router.fleet.telemetry import WorkerLoad, parse_worker_load

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "sglang"
CAPTURE = json.loads((FIXTURES / "router_pd.json").read_text())
SERVERS: dict[str, dict[str, Any]] = CAPTURE["servers"]
HANDOFFS = [s for s in CAPTURE["scenarios"] if s["legs"]]
BOOTSTRAP = ("bootstrap_host", "bootstrap_port", "bootstrap_room")

# What sglang-router 0.3.2 changes in a body besides the bootstrap fields: it parses the body
# into its own request types and writes them back, so it adds its defaults for SGLang's
# sampling extensions (the same values the server assumes when they are absent), renames chat's
# `max_tokens` to `max_completion_tokens`, rounds `temperature` through float32, and drops
# fields its types lack (`user`, `priority`). Our legs keep the client's body as it came.
ROUTER_DEFAULTS = {
    "/v1/completions": {"echo": False, "no_stop_trim": False, "ignore_eos": False,
                        "skip_special_tokens": True, "return_hidden_states": False},
    "/v1/chat/completions": {"logprobs": False, "no_stop_trim": False, "ignore_eos": False,
                             "continue_final_message": False, "skip_special_tokens": True,
                             "separate_reasoning": True, "stream_reasoning": True,
                             "return_hidden_states": False},
}  # fmt: skip
ROUTER_DROPS = {"user", "priority"}


def _legs(scenario: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    (prefill,) = [leg for leg in scenario["legs"] if leg["role"] == "prefill"]
    (decode,) = [leg for leg in scenario["legs"] if leg["role"] == "decode"]
    return prefill, decode


def _ours(scenario: dict[str, Any], seed: int = 0) -> tuple[dict[str, Any], dict[str, Any]]:
    prefill, _ = _legs(scenario)
    server = SERVERS[prefill["server"]]
    host = sglang.bootstrap_host(server["url"])
    return sglang.legs(scenario["client"]["body"], host, server["bootstrap_port"],
                       random.Random(seed))  # fmt: skip


@pytest.mark.parametrize("scenario", HANDOFFS, ids=[s["name"] for s in HANDOFFS])
def test_both_legs_go_at_once_to_the_clients_path_with_one_body(scenario: dict[str, Any]) -> None:
    prefill, decode = _legs(scenario)
    # SGLang's router: the client's path on both servers, the decode leg sent before the
    # prefill server answered, the identical body to both
    assert prefill["path"] == decode["path"] == scenario["client"]["path"]
    assert decode["sent_before_prefill_answered"] is True
    assert prefill["body"] == decode["body"]
    ours_prefill, ours_decode = _ours(scenario)
    assert ours_prefill == ours_decode


@pytest.mark.parametrize("scenario", HANDOFFS, ids=[s["name"] for s in HANDOFFS])
def test_bootstrap_fields_have_sglang_routers_values_and_types(scenario: dict[str, Any]) -> None:
    theirs = _legs(scenario)[0]["body"]
    ours = _ours(scenario)[0]
    assert theirs["bootstrap_host"] == ours["bootstrap_host"]
    assert theirs["bootstrap_port"] == ours["bootstrap_port"]
    for body in (theirs, ours):
        rooms = body["bootstrap_room"]
        rooms = rooms if isinstance(rooms, list) else [rooms]
        assert all(type(room) is int and 0 <= room < 2**63 for room in rooms)
        assert len(set(rooms)) == len(rooms)  # one room per prompt of a batch
    assert type(theirs["bootstrap_room"]) is type(ours["bootstrap_room"])
    if isinstance(theirs["bootstrap_room"], list):
        assert len(theirs["bootstrap_room"]) == len(ours["bootstrap_room"])
    assert _ours(scenario, seed=1)[0]["bootstrap_room"] != ours["bootstrap_room"]


@pytest.mark.parametrize("scenario", HANDOFFS, ids=[s["name"] for s in HANDOFFS])
def test_other_fields_differ_only_by_sglang_routers_rewrites(scenario: dict[str, Any]) -> None:
    path, client = scenario["client"]["path"], scenario["client"]["body"]
    theirs = {k: v for k, v in _legs(scenario)[0]["body"].items() if k not in BOOTSTRAP}
    ours = {k: v for k, v in _ours(scenario)[0].items() if k not in BOOTSTRAP}
    assert ours == client  # nothing of the client's rewritten, nothing added
    expected = {k: v for k, v in client.items() if k not in ROUTER_DROPS}
    if path == "/v1/chat/completions" and "max_tokens" in expected:
        expected["max_completion_tokens"] = expected.pop("max_tokens")
    expected.setdefault("stream", False)
    expected |= ROUTER_DEFAULTS[path]
    if "temperature" in expected:
        assert theirs["temperature"] == pytest.approx(expected.pop("temperature"), rel=1e-6)
        theirs.pop("temperature")
    assert theirs == expected


def test_the_capture_covers_each_prefill_address_form() -> None:
    seen = {_legs(s)[0]["server"] for s in HANDOFFS}
    assert seen == {name for name, server in SERVERS.items() if server["role"] == "prefill"}
    hosts = {_legs(s)[0]["server"]: _legs(s)[0]["body"]["bootstrap_host"] for s in HANDOFFS}
    hosts = {name: host if isinstance(host, str) else host[0] for name, host in hosts.items()}
    # the URL's host as written, an IPv6 address in its brackets, a missing port as null
    assert hosts == {"prefill-ipv4": "127.0.0.1", "prefill-name": "localhost",
                     "prefill-ipv6": "[::1]"}  # fmt: skip


@pytest.mark.parametrize(
    ("url", "host"),
    [
        ("http://10.0.0.5:30000", "10.0.0.5"),
        ("http://prefill-0.svc:30000/", "prefill-0.svc"),
        ("http://prefill-0.svc", "prefill-0.svc"),
        ("https://user:secret@prefill-0.svc:8443/api", "prefill-0.svc"),
        ("http://[fd00::19d]:30000", "[fd00::19d]"),
        ("http://[::1]", "[::1]"),
    ],
)
def test_bootstrap_host_of_a_worker_url(url: str, host: str) -> None:
    assert sglang.bootstrap_host(url) == host


def test_one_prompt_of_token_ids_gets_single_bootstrap_values() -> None:
    # sglang-router 0.3.2 refuses a token-id prompt (422); SGLang's server takes it as one
    # prompt, so it gets one room, not one per token
    (refused,) = [s for s in CAPTURE["scenarios"] if s["name"] == "completion-token-ids"]
    assert refused["answer"]["status"] == 422 and not refused["legs"]
    leg, _ = sglang.legs({"prompt": [11, 12, 13]}, "h", 8998, random.Random(0))
    assert leg["bootstrap_host"] == "h" and leg["bootstrap_port"] == 8998
    assert isinstance(leg["bootstrap_room"], int)
    batch, _ = sglang.legs({"prompt": [[11, 12], [13]]}, "h", None, random.Random(0))
    assert batch["bootstrap_host"] == ["h", "h"] and batch["bootstrap_port"] == [None, None]


def test_client_headers_sglang_router_forwards() -> None:
    # for the record (our router sends its own X-Request-Id and the client's Authorization
    # only with forward_auth: tests/e2e/test_sglang_parity.py)
    prefill, decode = _legs(HANDOFFS[0])
    for leg in (prefill, decode):
        assert leg["headers"]["x-request-id"] == CAPTURE["client_headers"]["X-Request-Id"]
        assert "authorization" in leg["headers"] and "traceparent" in leg["headers"]
        assert "x-custom-header" not in leg["headers"]


def _page(name: str) -> str:
    return (FIXTURES / name).read_text()


@pytest.mark.parametrize(
    ("page", "expected"),
    [
        # 3 running, 2 queued, a quarter of the KV pool used; 150 prompt tokens (one streamed
        # request of 50), 64 of them found in the device cache
        ("metrics_served.txt", WorkerLoad(3, 2, 0.25, 64, 150, 5.0)),
        # requests served, none with a hit: SGLang has written no cached-token series yet
        ("metrics_nohit.txt", WorkerLoad(3, 2, 0.25, 0, 50, 5.0)),
        # nothing served yet: no token counter series at all
        ("metrics_fresh.txt", WorkerLoad(3, 2, 0.25, None, None, 5.0)),
    ],
)
def test_load_from_sglang_metrics_pages(page: str, expected: WorkerLoad) -> None:
    assert parse_worker_load(_page(page), "sglang", now=5.0) == expected


def test_every_metric_name_we_read_is_on_sglangs_page() -> None:
    declared = {line.split()[2] for line in _page("metrics_served.txt").splitlines()
                if line.startswith("# TYPE ")}  # fmt: skip
    metrics = sglang.METRICS
    for names in (metrics.running, metrics.waiting, metrics.kv_usage, metrics.prefix_hits,
                  metrics.prefix_queries):  # fmt: skip
        assert names and set(names) <= declared
    # SGLang counts no KV pulls: the router reads none from its page
    assert metrics.pulls == metrics.pull_seconds == metrics.pull_bytes == ()
    # the labels a scheduler's gauges carry, which the replica label must be one of when
    # data parallelism adds it
    running = next(line for line in _page("metrics_served.txt").splitlines()
                   if line.startswith("sglang:num_running_reqs{"))  # fmt: skip
    labels = running[running.index("{") + 1 : running.index("}")].split(",")
    assert {"model_name", "engine_type", "tp_rank", "pp_rank"} <= {
        label.split("=")[0] for label in labels
    }
