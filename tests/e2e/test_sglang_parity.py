"""Our router in front of the same capture servers as SGLang's own router was
(tests/fixtures/sglang/router_pd.json), given the same requests: the legs it sends are held to
what sglang-router 0.3.2 sent, and its answers to what sglang-router answered, with the
differences we chose spelled out."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp

from tests.e2e.conftest import StartRouter
from tests.sglang_capture import (
    CLIENT_HEADERS,
    FIXTURE,
    SCENARIOS,
    Captured,
    CaptureServer,
    run_scenarios,
    start_servers,
)

CAPTURE = json.loads(FIXTURE.read_text())
THEIRS = {s["name"]: s for s in CAPTURE["scenarios"]}
# prefill server -> (bootstrap_host, bootstrap_port) as sglang-router sent them
THEIR_BOOTSTRAP = {
    leg["server"]: (leg["body"]["bootstrap_host"], leg["body"]["bootstrap_port"])
    for s in CAPTURE["scenarios"] for leg in s["legs"]
    if leg["role"] == "prefill" and isinstance(leg["body"]["bootstrap_host"], str)
}  # fmt: skip


async def test_our_router_against_sglang_routers_capture(
    start_router: StartRouter, tmp_path: Path
) -> None:
    """Every scenario once through our router (policy disaggregate) in front of capture
    servers; each check below compares with the capture."""
    log: list[Captured] = []
    servers = await start_servers(log)
    try:
        lines = ['policy = { name = "disaggregate" }']
        for server in servers:
            lines += ["[[workers]]", f'url = "{server.url}"', f'role = "{server.role}"',
                      'engine = "sglang"', f'id = "{server.name}"']  # fmt: skip
            if server.bootstrap_port is not None:
                lines.append(f"bootstrap_port = {server.bootstrap_port}")
        config = tmp_path / "router.toml"
        config.write_text("\n".join(lines) + "\n")
        router = await asyncio.to_thread(start_router, "--config", str(config))
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
            await _scraped(http, router.url, servers)
            scenarios = await run_scenarios(http, router.url, log, servers, SCENARIOS)
    finally:
        for server in servers:
            await server.stop()
    ours = {s["name"]: s for s in scenarios}
    _check_handoff_legs(ours)
    _check_usage_asked(ours)
    _check_headers(ours)
    for name, status, theirs_status in FAILURES:
        _check_failed_legs(ours, name, status, theirs_status)
    _check_token_id_prompt(ours)


async def _scraped(http: aiohttp.ClientSession, url: str, servers: list[CaptureServer]) -> None:
    """Until the router has read every worker's /metrics page (SGLang's, as rendered)."""
    async with asyncio.timeout(20):
        while True:
            async with http.get(f"{url}/v1/models") as response:
                assert response.status == 200
            if all(any(c.path == "/metrics" for c in s.log if c.server == s.name) for s in servers):
                return
            await asyncio.sleep(0.1)


def _legs(scenario: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    (prefill,) = [leg for leg in scenario["legs"] if leg["role"] == "prefill"]
    (decode,) = [leg for leg in scenario["legs"] if leg["role"] == "decode"]
    return prefill, decode


def _check_handoff_legs(ours: dict[str, Any]) -> None:
    for name in ("completion", "completion-stream", "chat", "chat-stream", "completion-batch"):
        prefill, decode = _legs(ours[name])
        their_prefill = _legs(THEIRS[name])[0]
        # both at once, to the client's path, with one body
        assert prefill["path"] == decode["path"] == their_prefill["path"], name
        assert decode["sent_before_prefill_answered"] is True, name
        assert prefill["body"] == decode["body"], name
        body = prefill["body"]
        host, port = THEIR_BOOTSTRAP[prefill["server"]]
        if isinstance(body["bootstrap_room"], list):  # a batch: one of each per prompt
            n = len(THEIRS[name]["client"]["body"]["prompt"])
            assert body["bootstrap_host"] == [host] * n and body["bootstrap_port"] == [port] * n
            assert isinstance(their_prefill["body"]["bootstrap_room"], list)
            assert len(set(body["bootstrap_room"])) == n
        else:
            assert (body["bootstrap_host"], body["bootstrap_port"]) == (host, port), name
            assert isinstance(body["bootstrap_room"], int)
            assert isinstance(their_prefill["body"]["bootstrap_room"], int)
        client = ours[name]["client"]["body"]
        assert {k: v for k, v in body.items() if not k.startswith("bootstrap_")} == client, name
        # the client gets the decode server's answer, as from sglang-router
        assert ours[name]["answer"]["status"] == THEIRS[name]["answer"]["status"] == 200
        assert "decode-t2" in ours[name]["answer"]["body"]
        assert "decode-t2" in THEIRS[name]["answer"]["body"]


def _check_usage_asked(ours: dict[str, Any]) -> None:
    # our own need (exact token counts per turn), where sglang-router passes the body as it is
    prefill, decode = _legs(ours["chat-stream-no-usage"])
    assert prefill["body"] == decode["body"]
    assert prefill["body"]["stream_options"] == {"include_usage": True}
    assert "stream_options" not in _legs(THEIRS["chat-stream-no-usage"])[0]["body"]
    answer = ours["chat-stream-no-usage"]["answer"]
    assert answer["status"] == 200 and '"usage"' not in answer["body"]
    assert answer["body"].rstrip().endswith("data: [DONE]")


def _check_headers(ours: dict[str, Any]) -> None:
    prefill, decode = _legs(ours["completion"])
    their_prefill, _ = _legs(THEIRS["completion"])
    for leg in (prefill, decode):
        headers = leg["headers"]
        assert headers["traceparent"] == CLIENT_HEADERS["traceparent"]
        # sglang-router forwards the client's id and credentials; ours names the turn with its
        # own id (the same on both legs) and forwards credentials only with --forward-auth
        assert headers["x-request-id"] not in ("", CLIENT_HEADERS["X-Request-Id"])
        assert "authorization" not in headers and "x-custom-header" not in headers
    assert prefill["headers"]["x-request-id"] == decode["headers"]["x-request-id"]
    assert their_prefill["headers"]["x-request-id"] == CLIENT_HEADERS["X-Request-Id"]


# (scenario, our status, sglang-router's status). A failed prefill: sglang-router waits for the
# decode server's own failure once its KV wait runs out and answers that; ours answers the
# prefill's failure at once and cancels the decode leg.
FAILURES = [
    ("decode-fails-500", 500, 500),
    ("prefill-fails-500", 500, 500),
    ("prefill-fails-400-stream", 400, 500),
]


def _check_failed_legs(ours: dict[str, Any], name: str, status: int, theirs_status: int) -> None:
    answer, theirs = ours[name]["answer"], THEIRS[name]["answer"]
    assert (answer["status"], theirs["status"]) == (status, theirs_status)
    assert answer["content_type"].startswith("application/json")
    assert "message" in json.loads(answer["body"])["error"]
    prefill_failed = name.startswith("prefill")
    assert answer["before_decode_answered"] is prefill_failed, (name, answer)
    assert theirs["before_decode_answered"] is False


def _check_token_id_prompt(ours: dict[str, Any]) -> None:
    # sglang-router 0.3.2 refuses it (422); an SGLang server takes it as one prompt
    assert THEIRS["completion-token-ids"]["answer"]["status"] == 422
    prefill, decode = _legs(ours["completion-token-ids"])
    assert prefill["body"] == decode["body"]
    assert isinstance(prefill["body"]["bootstrap_room"], int)
    assert ours["completion-token-ids"]["answer"]["status"] == 200
