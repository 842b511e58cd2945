"""Capture servers that answer like SGLang prefill and decode servers and record every request
they get; run as a script, they capture what SGLang's own router (`sglang-router`, in PD mode)
sends them for a bootstrap handoff, into tests/fixtures/sglang/router_pd.json.

    python -m tests.sglang_capture --router-python /path/to/venv/bin/python

The router is started as a child process of this one with its own virtualenv's python (it is
not a dependency of ours); the fixture it writes is what tests/router/engines/test_sglang_wire.py
holds our adapter to.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "sglang" / "router_pd.json"
# A /metrics page as SGLang 0.5.23's collectors render it (see the fixtures' README).
METRICS_PAGE = (FIXTURE.parent / "metrics_fresh.txt").read_text()

# A prompt holding one of these makes that server answer with the status (the router keeps the
# prompt as it is, so it is the marker both servers see).
FAIL_MARKERS = {"prefill": "FAIL-PREFILL-", "decode": "FAIL-DECODE-"}
# The prefill server answers after this delay: whether the decode leg arrived before the
# prefill answer shows whether the router sends the legs at once or one after the other.
PREFILL_DELAY_S = 0.3
# A decode server generates once its room's prefill is done (the KV has arrived); if that
# prefill failed or never came, it answers 500 when this wait runs out, as SGLang's decode
# server does once its bootstrap or transfer times out (shortened here).
KV_WAIT_S = 1.0
SERVED_MODEL = "tiny"


@dataclass
class Captured:
    server: str
    method: str
    path: str
    headers: dict[str, str]
    body: Any
    at: float  # monotonic seconds
    seq: int


@dataclass
class CaptureServer:
    """Answers like an SGLang server started with --disaggregation-mode `role`."""

    name: str
    role: str  # "prefill" or "decode"
    host: str
    bootstrap_port: int | None
    log: list[Captured]
    # bootstrap room (as JSON) -> whether its prefill succeeded; shared by a run's servers
    rooms: dict[str, asyncio.Future[bool]]
    answered_at: dict[int, float] = field(default_factory=dict)  # seq -> monotonic seconds
    answered: dict[int, asyncio.Future[None]] = field(default_factory=dict)  # seq -> done
    port: int = 0
    _runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, 0)
        await site.start()
        assert site._server is not None and site._server.sockets
        self.port = site._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body: Any = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode(errors="replace")
        seq = len(self.log)
        headers = {k.lower(): v for k, v in request.headers.items()}
        self.log.append(Captured(self.name, request.method, request.path, headers, body,
                                 time.monotonic(), seq))  # fmt: skip
        done = self.answered[seq] = asyncio.get_running_loop().create_future()
        try:
            return await self._answer(request, body)
        finally:
            self.answered_at[seq] = time.monotonic()
            done.set_result(None)

    async def _answer(self, request: web.Request, body: Any) -> web.StreamResponse:
        path = request.path
        if path in ("/health", "/health_generate"):
            return web.Response()
        if path in ("/model_info", "/get_model_info"):
            return web.json_response({"model_path": f"/models/{SERVED_MODEL}",
                                      "served_model_name": SERVED_MODEL,
                                      "tokenizer_path": f"/models/{SERVED_MODEL}",
                                      "is_generation": True})  # fmt: skip
        if path in ("/server_info", "/get_server_info"):
            return web.json_response({"model_path": f"/models/{SERVED_MODEL}",
                                      "served_model_name": SERVED_MODEL,
                                      "disaggregation_mode": self.role,
                                      "disaggregation_bootstrap_port": self.bootstrap_port,
                                      "dp_size": 1, "tp_size": 1, "version": "0.5.23"})  # fmt: skip
        if path == "/v1/models":
            return web.json_response({"object": "list", "data": [
                {"id": SERVED_MODEL, "object": "model", "owned_by": "sglang"}]})  # fmt: skip
        if path == "/metrics":
            return web.Response(text=METRICS_PAGE, content_type="text/plain")
        if request.method != "POST" or not isinstance(body, dict):
            return web.json_response({"error": {"message": "not found"}}, status=404)
        room = self._room(body)
        status = _failure_status(body, FAIL_MARKERS[self.role])
        if self.role == "prefill":
            await asyncio.sleep(PREFILL_DELAY_S)
            if not room.done():
                room.set_result(status is None)
        elif status is None:
            deadline = time.monotonic() + KV_WAIT_S
            try:
                arrived = await asyncio.wait_for(asyncio.shield(room), KV_WAIT_S)
            except TimeoutError:
                arrived = False
            if not arrived:
                await asyncio.sleep(deadline - time.monotonic())
                status = 500
        if status is not None:
            return web.json_response({"object": "error", "message": f"{self.name} failed",
                                      "type": "InternalServerError", "param": None,
                                      "code": status}, status=status)  # fmt: skip
        return await _generation(request, body, self.role, self.name)

    def _room(self, body: dict[str, Any]) -> asyncio.Future[bool]:
        key = json.dumps(body.get("bootstrap_room"))
        room = self.rooms.get(key)
        if room is None:
            room = self.rooms[key] = asyncio.get_running_loop().create_future()
        return room


def _failure_status(body: dict[str, Any], marker: str) -> int | None:
    text = json.dumps(body.get("prompt", body.get("messages", "")))
    at = text.find(marker)
    return None if at < 0 else int(text[at + len(marker) : at + len(marker) + 3])


async def _generation(
    request: web.Request, body: dict[str, Any], role: str, name: str
) -> web.StreamResponse:
    chat = request.path.endswith("/chat/completions")
    # A prefill server generates one token; the decode server the whole answer.
    words = [f"{name}-t0"] if role == "prefill" else [f"{name}-t{i}" for i in range(3)]
    usage = {"prompt_tokens": 7, "completion_tokens": len(words), "total_tokens": 7 + len(words),
             "prompt_tokens_details": {"cached_tokens": 0}}  # fmt: skip
    kind = "chat.completion" if chat else "text_completion"
    ident = f"{role}-{body.get('bootstrap_room')}"
    if not body.get("stream"):
        text = " ".join(words)
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "matched_stop": None,
                                  "logprobs": None}  # fmt: skip
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return web.json_response({"id": ident, "object": kind, "created": 1,
                                  "model": SERVED_MODEL, "choices": [choice],
                                  "usage": usage})  # fmt: skip
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for word in words:
        delta: dict[str, Any] = {"content": word} if chat else {}
        choice = {"index": 0, "delta": delta} if chat else {"index": 0, "text": word}
        chunk = {"id": ident, "object": f"{kind}.chunk", "created": 1, "model": SERVED_MODEL,
                 "choices": [{**choice, "finish_reason": None}]}  # fmt: skip
        await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
    if (body.get("stream_options") or {}).get("include_usage"):
        last = {"id": ident, "object": f"{kind}.chunk", "created": 1, "model": SERVED_MODEL,
                "choices": [], "usage": usage}  # fmt: skip
        await response.write(b"data: " + json.dumps(last).encode() + b"\n\n")
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


# What the client sends through the router: (name, path, body). Completions with three
# prefill servers in round robin, so each prefill address form is seen once.
CLIENT_HEADERS = {"Authorization": "Bearer sk-client", "X-Request-Id": "client-req-1",
                  "X-Custom-Header": "kept?", "traceparent":
                  "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}  # fmt: skip
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
SCENARIOS: list[tuple[str, str, dict[str, Any]]] = [
    ("completion", "/v1/completions",
     {"model": SERVED_MODEL, "prompt": "Once upon a time", "max_tokens": 8,
      "temperature": 0.0}),
    ("completion-2", "/v1/completions",
     {"model": SERVED_MODEL, "prompt": "Once upon a time", "max_tokens": 8}),
    ("completion-3", "/v1/completions",
     {"model": SERVED_MODEL, "prompt": "Once upon a time", "max_tokens": 8}),
    ("completion-stream", "/v1/completions",
     {"model": SERVED_MODEL, "prompt": "Once upon a time", "max_tokens": 8, "stream": True,
      "stream_options": {"include_usage": True}}),
    ("chat", "/v1/chat/completions",
     {"model": SERVED_MODEL, "messages": MESSAGES, "max_tokens": 8, "temperature": 0.2,
      "user": "u-1", "priority": 3}),
    ("chat-stream", "/v1/chat/completions",
     {"model": SERVED_MODEL, "messages": MESSAGES, "max_completion_tokens": 8, "stream": True,
      "stream_options": {"include_usage": True}}),
    ("chat-stream-no-usage", "/v1/chat/completions",
     {"model": SERVED_MODEL, "messages": MESSAGES, "max_tokens": 8, "stream": True}),
    ("completion-token-ids", "/v1/completions",
     {"model": SERVED_MODEL, "prompt": [11, 12, 13, 14], "max_tokens": 4}),
    ("completion-batch", "/v1/completions",
     {"model": SERVED_MODEL, "prompt": ["first prompt", "second prompt"], "max_tokens": 4}),
    ("prefill-fails-500", "/v1/completions",
     {"model": SERVED_MODEL, "prompt": "FAIL-PREFILL-500", "max_tokens": 4}),
    ("decode-fails-500", "/v1/completions",
     {"model": SERVED_MODEL, "prompt": "FAIL-DECODE-500", "max_tokens": 4}),
    ("prefill-fails-400-stream", "/v1/chat/completions",
     {"model": SERVED_MODEL, "messages": [{"role": "user", "content": "FAIL-PREFILL-400"}],
      "max_tokens": 4, "stream": True}),
]  # fmt: skip


async def _router_ready(http: aiohttp.ClientSession, url: str, deadline: float) -> None:
    while True:
        try:
            async with http.get(f"{url}/health") as response:
                if response.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"sglang-router at {url} not healthy in time")
        await asyncio.sleep(0.25)


async def start_servers(log: list[Captured]) -> list[CaptureServer]:
    """Three prefill servers (an IPv4 address with a bootstrap port, a host name without one,
    an IPv6 address with one) and a decode server, started."""
    rooms: dict[str, asyncio.Future[bool]] = {}
    servers = [
        CaptureServer("prefill-ipv4", "prefill", "127.0.0.1", 8998, log, rooms),
        CaptureServer("prefill-name", "prefill", "localhost", None, log, rooms),
        CaptureServer("prefill-ipv6", "prefill", "::1", 9001, log, rooms),
        CaptureServer("decode", "decode", "127.0.0.1", None, log, rooms),
    ]
    for server in servers:
        await server.start()
    return servers


async def run_scenarios(
    http: aiohttp.ClientSession, url: str, log: list[Captured], servers: list[CaptureServer],
    scenarios: list[tuple[str, str, dict[str, Any]]],
) -> list[dict[str, Any]]:  # fmt: skip
    """Send each scenario's request to the router at `url`; what the client got and what
    the servers were sent, per scenario."""
    out = []
    for name, path, body in scenarios:
        start = len(log)
        async with http.post(url + path, json=body, headers=CLIENT_HEADERS) as response:
            answer = {"status": response.status,
                      "content_type": response.headers.get("Content-Type"),
                      "body": (await response.read()).decode()}  # fmt: skip
        answered = time.monotonic()
        await asyncio.sleep(0.05)  # a leg sent last is on its way
        legs = [c for c in log[start:] if c.method == "POST"]
        by_name = {s.name: s for s in servers}
        async with asyncio.timeout(PREFILL_DELAY_S + KV_WAIT_S + 2):  # open legs end
            await asyncio.gather(*(by_name[c.server].answered[c.seq] for c in legs))
        decode_done = [s.answered_at.get(c.seq) for s in servers for c in legs
                       if s.name == c.server and s.role == "decode"]  # fmt: skip
        answer["before_decode_answered"] = any(t is None or answered < t for t in decode_done)
        out.append(_scenario(name, path, body, answer, legs, servers))
    return out


async def capture(router_python: str, version: str, port: int) -> dict[str, Any]:
    """Run SCENARIOS through sglang-router in front of capture servers; the fixture's data."""
    log: list[Captured] = []
    servers = await start_servers(log)
    args = [router_python, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
            "--port", str(port), "--pd-disaggregation", "--policy", "round_robin",
            "--log-level", "warn", "--disable-retries", "--disable-circuit-breaker"]  # fmt: skip
    for server in servers:
        if server.role == "prefill":
            bootstrap = "none" if server.bootstrap_port is None else str(server.bootstrap_port)
            args += ["--prefill", server.url, bootstrap]
        else:
            args += ["--decode", server.url]
    router = await asyncio.create_subprocess_exec(*args, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        timeout = aiohttp.ClientTimeout(total=20)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            await _router_ready(http, url, time.monotonic() + 60)
            await asyncio.sleep(1.0)  # its worker registration runs in the background
            startup = [(c.server, c.method, c.path) for c in log]
            scenarios = await run_scenarios(http, url, log, servers, SCENARIOS)
    finally:
        router.terminate()
        await asyncio.wait_for(router.wait(), timeout=10)
        for server in servers:
            await server.stop()
    fixture = {
        "router": {"package": "sglang-router",
                   "version": version,
                   "args": ["--pd-disaggregation", "--policy", "round_robin",
                            "--disable-retries", "--disable-circuit-breaker"]},
        "servers": {s.name: {"role": s.role, "url": s.url, "bootstrap_port": s.bootstrap_port}
                    for s in servers},
        "client_headers": CLIENT_HEADERS,
        "startup_requests": sorted({f"{m} {p}" for _, m, p in startup}),
        "scenarios": scenarios,
    }  # fmt: skip
    return fixture


def _scenario(
    name: str, path: str, body: dict[str, Any], answer: dict[str, Any], legs: list[Captured],
    servers: list[CaptureServer],
) -> dict[str, Any]:  # fmt: skip
    by_name = {s.name: s for s in servers}
    prefill_first = next((c for c in legs if by_name[c.server].role == "prefill"), None)
    out = []
    for leg in legs:
        server = by_name[leg.server]
        entry: dict[str, Any] = {"server": leg.server, "role": server.role, "path": leg.path,
                                 "headers": {k: v for k, v in leg.headers.items()
                                             if k not in ("host", "content-length")},
                                 "body": leg.body}  # fmt: skip
        if server.role == "decode" and prefill_first is not None:
            answered = by_name[prefill_first.server].answered_at.get(prefill_first.seq)
            entry["sent_before_prefill_answered"] = answered is None or leg.at < answered
        out.append(entry)
    return {"name": name, "client": {"path": path, "body": body}, "answer": answer, "legs": out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--router-python", required=True,
                        help="python of a virtualenv with sglang-router installed")  # fmt: skip
    parser.add_argument("--port", type=int, default=31000)
    parser.add_argument("--out", type=Path, default=FIXTURE)
    args = parser.parse_args()
    query = "import importlib.metadata as m; print(m.version('sglang-router'))"
    version = subprocess.run([args.router_python, "-c", query], capture_output=True, text=True,
                             check=True).stdout.strip()  # fmt: skip
    fixture = asyncio.run(capture(args.router_python, version, args.port))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(fixture, indent=1) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
