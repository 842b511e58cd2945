"""Hostile input through a running router (its app object on an ephemeral port, fake vLLM
workers): bad requests get OpenAI-shaped 4xx errors naming what was wrong and reach no worker
and no policy; ids and handoff parameters workers see are the router's own; one API key guards
every endpoint but /health; a policy swap imports nothing unasked; a worker failure on retry is
a 503, never the policy's 429."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest

from policies.types import ClusterView, Decision, Handoff, Outcome, Reject, Turn
from router.http.client import UpstreamBodyError, UpstreamPool
from router.turn.fields import ROUTER_OWNED_FIELDS
from tests.router.turn.fake_upstream import Stack, eventually, spec

HANDOFF = "tests.e2e.scripted_policies:AlwaysHandoff"
REJECT = "tests.router.turn.fake_upstream:RejectAll"
MESSAGES = [{"role": "user", "content": "hello"}]
BODY = {"model": "m", "messages": MESSAGES, "max_tokens": 3}


@pytest.fixture
async def stack(redis_url: str) -> AsyncIterator[Stack]:
    async with Stack(redis_url) as stack:
        yield stack


async def send(
    stack: Stack, url: str, body: Any = BODY, headers: dict[str, str] | None = None,
    raw: bytes | None = None, method: str = "POST", path: str = "/v1/chat/completions",
) -> tuple[int, dict[str, str], Any]:  # fmt: skip
    """(status, lowercased headers, body: decoded where JSON) of one request; a JSON
    Content-Type unless `headers` says otherwise."""
    sent = {"Content-Type": "application/json", **(headers or {})}
    data = raw if raw is not None else json.dumps(body).encode()
    async with stack.http.request(method, url + path, data=data, headers=sent) as response:
        got = {key.lower(): value for key, value in response.headers.items()}
        if got.get("content-type", "").startswith("application/json"):
            return response.status, got, await response.json(content_type=None)
        return response.status, got, await response.text()


def assert_error(body: Any, status: int, param: str | None) -> None:
    """An OpenAI-shaped error with this status and param."""
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["message"] and error["param"] == param, error


async def test_objective_headers_that_are_no_finite_positive_number_are_400(
    stack: Stack,
) -> None:
    # adaptive turns objectives into integers: a NaN there answered this turn and every later
    # one 500, an infinite ITL while a worker was busy 500 too
    a = await stack.worker("a", running=5)
    b = await stack.worker("b", running=5)
    router = await stack.router([spec(a), spec(b)], "adaptive")
    load = router.router.pool.workers["a"]

    async def scraped() -> bool:
        return load.load is not None and load.load.running == 5

    await eventually(scraped)
    for header, value in [("X-SLO-TTFT-Ms", "nan"), ("X-SLO-ITL-Ms", "inf"),
                          ("X-SLO-ITL-Ms", "-inf"), ("X-SLO-TTFT-Ms", "1e309"),
                          ("X-SLO-TTFT-Ms", "0"), ("X-SLO-ITL-Ms", "ten"),
                          ("X-SLO-TTFT-Ms", "3600001")]:  # fmt: skip
        status, _, body = await send(stack, router.url,
                                     headers={header: value, "X-Session-Id": "s-nan"})  # fmt: skip
        assert status == 400, (header, value, body)
        assert_error(body, 400, header)
    assert a.received == [] and b.received == []
    for session in ("s-nan", "s-other"):  # the router, and the policy, serve on
        status, _, body = await send(
            stack, router.url, headers={"X-Session-Id": session, "X-SLO-TTFT-Ms": "2000"}
        )
        assert status == 200, body


@pytest.mark.parametrize("name", ROUTER_OWNED_FIELDS)
async def test_handoff_fields_from_a_client_are_refused(stack: Stack, name: str) -> None:
    # forwarded as they were, a colocated turn's worker would pull KV from (or bootstrap
    # with) the client's host
    a = await stack.worker("a")
    router = await stack.router([spec(a)])
    value = {"remote_host": "169.254.169.254", "remote_port": 80} if name == "kv_transfer_params" \
        else "169.254.169.254"  # fmt: skip
    status, _, body = await send(stack, router.url, {**BODY, name: value})
    assert status == 400
    assert_error(body, 400, name)
    assert a.received == []


async def test_workers_get_the_routers_own_request_id_and_the_client_its_own(
    stack: Stack,
) -> None:
    p = await stack.worker("p")
    d = await stack.worker("d")
    router = await stack.router([spec(p, "prefill"), spec(d, "decode")], HANDOFF,
                                params={"prefill": "p", "decode": "d"})  # fmt: skip
    status, headers, _ = await send(stack, router.url, headers={"X-Request-Id": "client-7"})
    assert status == 200 and headers["x-request-id"] == "client-7"
    (prefill,), (decode,) = p.received, d.received
    ours = prefill.headers["x-request-id"]
    assert ours != "client-7" and decode.headers["x-request-id"] == ours  # one id, both legs
    assert prefill.body["kv_transfer_params"]["remote_host"] is None  # the router's own
    assert decode.body["kv_transfer_params"] == p.sent_params[0]  # what the prefill said
    (event,) = await router.decisions(stack.http)
    assert event["request_id"] == ours and event["client_request_id"] == "client-7"
    # a second client sending the same id gets its own turn id at the workers
    status, headers, _ = await send(stack, router.url, headers={"X-Request-Id": "client-7"})
    assert status == 200 and headers["x-request-id"] == "client-7"
    assert p.received[1].headers["x-request-id"] not in ("client-7", ours)
    # without one, the client is told the router's id
    status, headers, _ = await send(stack, router.url)
    assert status == 200 and headers["x-request-id"] == d.received[2].headers["x-request-id"]
    # an id that is no header-safe token is refused, answered with the router's own id
    status, headers, body = await send(stack, router.url, headers={"X-Request-Id": "r" * 300})
    assert status == 400 and len(headers["x-request-id"]) < 300
    assert_error(body, 400, "X-Request-Id")
    assert len(p.received) == 3


@pytest.mark.parametrize(
    "user", ["日本語のユーザー", "a\r\nX-Evil: 1", "a\x00b", "u" * 20_000, "trailing "]
)
async def test_a_user_that_is_not_header_safe_gets_a_stable_session_id(
    stack: Stack, user: str
) -> None:
    # echoed as it was, X-Session-Id answered 500 after the worker had answered (non-Latin-1,
    # CR/LF), or sent a header clients refuse (NUL) or a 20 KB header
    a = await stack.worker("a")
    router = await stack.router([spec(a)])
    sessions = []
    for _ in range(2):
        status, headers, body = await send(stack, router.url, {**BODY, "user": user})
        assert status == 200, body
        sessions.append(headers["x-session-id"])
    assert sessions[0] == sessions[1] and sessions[0].startswith("user-digest:")
    assert len(sessions[0]) <= 64
    assert [got.body["user"] for got in a.received] == [user, user]  # the body is untouched

    async def committed() -> bool:
        found, record = await router.session(stack.http, sessions[0])
        return found == 200 and record["turns"] == 2

    await eventually(committed)


async def raw_exchange(url: str, head: bytes, body: bytes) -> tuple[int, bytes]:
    """A request with any header bytes: (status, body)."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(head + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
        answer = await reader.read()
    finally:
        writer.close()
    status_line, _, rest = answer.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


@pytest.mark.parametrize("value", [b"s" * 257, "日本".encode(), b"caf\xe9", b"a\tb"])
async def test_an_unsafe_session_id_header_is_400(stack: Stack, value: bytes) -> None:
    # (other control characters the HTTP parser refuses itself, with a 400 of its own)
    a = await stack.worker("a")
    router = await stack.router([spec(a)])
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\n"
            b"Content-Type: application/json\r\nX-Session-Id: " + value + b"\r\n")  # fmt: skip
    status, body = await raw_exchange(router.url, head, json.dumps(BODY).encode())
    assert status == 400
    assert_error(json.loads(body), 400, "X-Session-Id")
    assert a.received == []


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]})
         .encode(), "messages[0].content[0].text"),
        (b'{"messages": ["hello"]}', "messages[0]"),
        (b'{"messages": [{"role": "user", "content": "x"}], "tools": ' + nested(10_000) + b"}",
         None),
        (b'{"messages": ' + nested(10_000) + b"}", None),
        (b'{"messages": [{"role": "user", "content": "x"}], "seed": "\xff"}', None),
        (b'{"messages": [{"role": "user", "content": "x"}], "temperature": 1e999}', None),
        (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 100000000000}',
         "max_tokens"),
        (b'{"messages": [{"role": "user", "content": "x"}], "priority": 1e3}', "priority"),
        (b'{"messages": [{"role": "user", "content": "x"}], "stream": "true"}', "stream"),
    ],
    ids=["text-not-a-string", "message-not-an-object", "nested-10000", "messages-nested",
         "not-utf8-elsewhere", "number-out-of-range", "max-tokens-huge", "priority-float",
         "stream-a-string"],
)  # fmt: skip
async def test_bad_bodies_are_400_before_any_worker_or_policy_sees_them(
    stack: Stack, raw: bytes, param: str | None
) -> None:
    # A handoff decodes the body again to write its legs: what got past admission then
    # failed there (invalid UTF-8 or an out-of-range number in a field the router does not
    # read, deep nesting) was a 500 after the policy had placed the turn.
    p = await stack.worker("p")
    d = await stack.worker("d")
    router = await stack.router([spec(p, "prefill"), spec(d, "decode")], HANDOFF,
                                params={"prefill": "p", "decode": "d"})  # fmt: skip
    status, _, body = await send(stack, router.url, raw=raw)
    assert status == 400
    assert_error(body, 400, param)
    assert p.received == [] and d.received == []
    (event,) = await router.decisions(stack.http, limit=5)
    assert event["action"] is None and event["http_status"] == 400  # no policy decided it
    status, _, body = await send(stack, router.url)
    assert status == 200, body


async def test_completions_prompts_of_the_wrong_type_are_400(stack: Stack) -> None:
    a = await stack.worker("a")
    router = await stack.router([spec(a)])
    for prompt in (5, {"x": 1}, [1, "a"], [True], [[1], "a"], []):
        status, _, body = await send(stack, router.url, {"model": "m", "prompt": prompt},
                                     path="/v1/completions")  # fmt: skip
        assert status == 400, prompt
        assert_error(body, 400, "prompt")
    status, _, body = await send(stack, router.url, {"model": "m", "prompt": [[1, 2], [3]]},
                                 path="/v1/completions")  # fmt: skip
    assert status == 200, body
    assert a.bodies() == [{"model": "m", "prompt": [[1, 2], [3]]}]


async def test_the_api_key_guards_every_endpoint_but_health(stack: Stack) -> None:
    a = await stack.worker("a")
    router = await stack.router([spec(a)], api_key="k3y")
    url = router.url
    get = ("GET", b"")
    endpoints = [("/v1/models", *get), ("/metrics", *get), ("/ready", *get),
                 ("/nowhere", *get), ("/v1/chat/completions", "POST", json.dumps(BODY).encode()),
                 ("/v1/completions", "POST", b'{"prompt": "x"}')]  # fmt: skip
    for key in (None, "wrong", "k3y2", "k3"):
        headers = {} if key is None else {"Authorization": f"Bearer {key}"}
        for path, method, data in endpoints:
            status, got, body = await send(stack, url, raw=data, method=method, path=path,
                                           headers=headers)  # fmt: skip
            assert status == 401, (path, key)
            assert_error(body, 401, None)
            assert got["www-authenticate"] == "Bearer"
    assert a.received == []
    status, _, body = await send(stack, url, raw=b"", method="GET", path="/health")
    assert status == 200 and body["status"] == "ok"
    for path, method, data in endpoints:
        for scheme in ("Bearer", "bearer"):
            status, _, _ = await send(stack, url, raw=data, method=method, path=path,
                                      headers={"Authorization": f"{scheme} k3y"})  # fmt: skip
            assert status == (404 if path == "/nowhere" else 200), path
    assert len(a.received) == 4
    # /admin keeps its own token
    async with stack.http.get(url + "/admin/workers", headers=router.admin) as response:
        assert response.status == 200


@pytest.mark.parametrize(
    "content_type",
    [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=b",
     "application/json; charset=latin-1", "application/jsonp"],
)  # fmt: skip
async def test_a_turn_needs_a_json_content_type(stack: Stack, content_type: str | None) -> None:
    # a browser posts a cross-site form without asking first: it must not run as a turn
    a = await stack.worker("a")
    router = await stack.router([spec(a)])
    headers = {"Content-Type": content_type} if content_type is not None else {}
    data = json.dumps(BODY).encode()
    async with stack.http.post(
        router.url + "/v1/chat/completions",
        data=data,
        headers=headers,
        skip_auto_headers=["Content-Type"],
    ) as response:
        status, body = response.status, await response.json(content_type=None)
    assert status == 415
    assert_error(body, 415, "Content-Type")
    assert a.received == []
    status, _, _ = await send(
        stack, router.url, headers={"Content-Type": "Application/JSON; charset=UTF-8"}
    )
    assert status == 200


async def test_a_policy_swap_imports_a_module_only_when_allowed(stack: Stack) -> None:
    a = await stack.worker("a")
    router = await stack.router([spec(a)])
    url, admin = router.url + "/admin/policy", router.admin
    for name in (REJECT, "os:system", "subprocess:Popen"):
        async with stack.http.put(url, json={"name": name}, headers=admin) as response:
            assert response.status == 403
            assert_error(await response.json(), 403, "name")
    async with stack.http.get(url, headers=admin) as response:
        assert await response.json() == {"name": "colocate"}
    async with stack.http.put(url, json={"name": "round-robin"}, headers=admin) as response:
        assert response.status == 200  # registered policies swap as before
    async with stack.http.put(url, json={"name": "colocate"}, headers=admin) as response:
        assert response.status == 200
    allowed = await stack.router([spec(a)], allow_policy_import=True)
    async with stack.http.put(allowed.url + "/admin/policy", json={"name": REJECT},
                              headers=allowed.admin) as response:  # fmt: skip
        assert response.status == 200
    # the policy a router started with is no new import: swapping back to it is allowed
    started = await stack.router([spec(a)], REJECT)
    for name in ("round-robin", REJECT):
        async with stack.http.put(started.url + "/admin/policy", json={"name": name},
                                  headers=started.admin) as response:  # fmt: skip
            assert response.status == 200, name


class _NoParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    pass


class SplitOrReject:
    """Hand off from the first prefill worker to the first decode worker; with no prefill
    worker left, reject (429) rather than colocate: a strict split."""

    Params = _NoParams
    name = "split-or-reject"

    def __init__(self, params: _NoParams | None = None) -> None:
        pass

    def decide(self, turn: Turn, view: ClusterView) -> Decision:
        def first(role: str) -> str | None:
            ids = sorted(w.worker_id for w in view.workers
                         if w.role == role and w.accepts_new_work)  # fmt: skip
            return ids[0] if ids else None

        prefill, decode = first("prefill"), first("decode")
        if prefill is None or decode is None:
            return Reject(retry_after_s=9.0, reason="no prefill worker")
        return Handoff(prefill, decode, reason="split")

    def observe(self, outcome: Outcome) -> None:
        return None


async def test_a_worker_failure_the_policy_cannot_place_around_is_503_not_429(
    stack: Stack,
) -> None:
    p = await stack.worker("p")
    d = await stack.worker("d")
    router = await stack.router([spec(p, "prefill"), spec(d, "decode")],
                                f"{__name__}:SplitOrReject")  # fmt: skip
    p.fail_next("drop")  # the prefill worker goes before it answers
    status, headers, body = await send(stack, router.url)
    assert status == 503, body
    assert_error(body, 503, None)
    assert "p" in body["error"]["message"] and "unreachable" in body["error"]["message"]
    assert int(headers["retry-after"]) >= 1
    assert d.received == []
    (event,) = await router.decisions(stack.http)
    assert event["retried"] is True and event["http_status"] == 503


async def test_a_connection_lost_mid_response_says_how() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n0123456789")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    pool = UpstreamPool()
    try:
        port = server.sockets[0].getsockname()[1]
        response = await pool.request(f"http://127.0.0.1:{port}", "GET", "/", {})
        with pytest.raises(UpstreamBodyError) as error:
            await response.read()
    finally:
        await pool.close()
        server.close()
        await server.wait_closed()
    assert "None" not in str(error.value) and "closed by the worker" in str(error.value)
