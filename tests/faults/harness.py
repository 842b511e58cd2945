"""The fault suite's harness: real processes, fake failing workers, a multi-turn streaming load
that records every byte's arrival, the checks every reply must pass, and the printed table.

Every wait here is bounded: a client call by `CALL_TIMEOUT_S` (past it the call *hung*, which
fails its test), a condition by `wait_until`'s timeout, a process start by its health wait.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import redis
from aiohttp import web

from router.state.embedded_redis import redis_server_binary
from tests.conftest import free_port
from tests.procs import Process

CALL_TIMEOUT_S = 15.0  # a client call taking longer hung (the suite's "no stream hangs")
DETECT_BOUND_S = 1.0  # an affected request ends (or moves on) this soon after detection
ERROR_KEYS = ("message", "type", "param", "code")
MODEL = "llama-3.1-8b"  # what the simulated workers serve; the fake workers say the same


# -- processes -------------------------------------------------------------------------------
@dataclass
class SimWorker:
    """One `session-router sim-worker` process: killed alone."""

    url: str
    process: Process

    @property
    def id(self) -> str:
        return self.url.split("://", 1)[1]

    def kill(self) -> float:
        """SIGKILL; returns the moment (monotonic) the signal was sent."""
        killed_at = time.monotonic()
        self.process.popen.send_signal(signal.SIGKILL)
        self.process.popen.wait(timeout=10)
        return killed_at


@dataclass
class RouterProc:
    url: str
    process: Process
    token: str
    prefix: str

    def kill(self) -> float:
        killed_at = time.monotonic()
        self.process.popen.send_signal(signal.SIGKILL)
        self.process.popen.wait(timeout=10)
        return killed_at

    async def admin(self, http: aiohttp.ClientSession, path: str) -> tuple[int, Any]:
        headers = {"Authorization": f"Bearer {self.token}"}
        async with asyncio.timeout(5):
            async with http.get(self.url + path, headers=headers) as response:
                return response.status, await response.json()

    async def session(self, http: aiohttp.ClientSession, session_id: str) -> dict[str, Any] | None:
        """The session's residency as this router answers it; None for 404."""
        status, body = await self.admin(http, f"/admin/sessions/{session_id}")
        if status == 404:
            return None
        assert status == 200, (status, body)
        return dict(body)

    async def workers(self, http: aiohttp.ClientSession) -> dict[str, dict[str, Any]]:
        status, body = await self.admin(http, "/admin/workers")
        assert status == 200, body
        return {row["id"]: row for row in body["workers"]}

    async def decisions(
        self, http: aiohttp.ClientSession, calls: Sequence[Call] = ()
    ) -> dict[str, dict[str, Any]]:
        """The router's recent stage events by request id, once they hold every one of `calls`
        that this router answered (a turn's events are recorded a moment after its reply)."""
        wanted = {c.request_id for c in calls if c.router == self.url and c.request_id}
        deadline = time.monotonic() + 5
        while True:
            status, body = await self.admin(http, "/admin/decisions?limit=1024")
            assert status == 200, body
            events = {event["request_id"]: event for event in body["decisions"]}
            missing = wanted - events.keys()
            if not missing:
                return events
            if time.monotonic() > deadline:
                raise AssertionError(f"no stage events for requests {sorted(missing)[:4]}")
            await asyncio.sleep(0.02)

    async def health(self, http: aiohttp.ClientSession) -> dict[str, Any]:
        async with asyncio.timeout(5):
            async with http.get(self.url + "/health") as response:
                return dict(await response.json())


class Fleet:
    """Every process one test starts; `stop` ends them all (a SIGKILLed one is only reaped)."""

    def __init__(self) -> None:
        self._processes: list[Process] = []

    async def sim_workers(self, count: int, *extra: str) -> list[SimWorker]:
        """`count` separate sim-worker processes, started together."""
        ports = [free_port() for _ in range(count)]
        workers = []
        for port in ports:
            process = Process(["sim-worker", "--port", str(port), "--noise", "0", *extra])
            self._processes.append(process)
            workers.append(SimWorker(f"http://127.0.0.1:{port}", process))
        for worker in workers:
            await asyncio.to_thread(worker.process.wait_healthy, [worker.url])
        return workers

    async def routers(
        self, redis_url: str, count: int, *args: str, prefix: str | None = None
    ) -> list[RouterProc]:
        """`count` router replicas sharing `redis_url` and one key prefix, started together."""
        prefix = prefix or f"faults-{uuid.uuid4().hex[:8]}"
        routers = []
        for _ in range(count):
            port, token = free_port(), uuid.uuid4().hex
            argv = ["serve", "--port", str(port), "--redis", redis_url, "--redis-prefix", prefix,
                    "--scrape-interval-ms", "100", "--admin-token", token, *args]  # fmt: skip
            process = Process(argv)
            self._processes.append(process)
            routers.append(RouterProc(f"http://127.0.0.1:{port}", process, token, prefix))
        for router in routers:
            await asyncio.to_thread(router.process.wait_healthy, [router.url])
        return routers

    def stop(self) -> None:
        for process in reversed(self._processes):
            process.stop(timeout_s=5)


class RedisServer:
    """A redis-server of the test's own on a TCP port: killed, and restarted empty there."""

    def __init__(self) -> None:
        self.port = free_port()
        self._dir = Path(tempfile.mkdtemp(prefix="faults-redis-"))
        self._popen: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Start (empty: it persists nothing) and wait until it answers PING."""
        args = [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1",
                "--save", "", "--appendonly", "no", "--dir", str(self._dir),
                "--loglevel", "warning", "--logfile", str(self._dir / "redis.log")]  # fmt: skip
        self._popen = subprocess.Popen(args, stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 10
        while True:
            try:
                if self.ping():
                    return
            except redis.RedisError:
                pass
            if time.monotonic() > deadline or self._popen.poll() is not None:
                raise RuntimeError(f"redis-server on port {self.port} did not start")
            time.sleep(0.02)

    def kill(self) -> float:
        assert self._popen is not None
        killed_at = time.monotonic()
        self._popen.send_signal(signal.SIGKILL)
        self._popen.wait(timeout=10)
        return killed_at

    def stop(self) -> None:
        if self._popen is not None and self._popen.poll() is None:
            self._popen.kill()
            self._popen.wait(timeout=10)
        shutil.rmtree(self._dir, ignore_errors=True)

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2,
                           socket_connect_timeout=2, decode_responses=True)  # fmt: skip

    def ping(self) -> bool:
        with self.client() as client:
            return bool(client.ping())

    def hgetall(self, key: str) -> dict[str, str]:
        with self.client() as client:
            return dict(client.hgetall(key))


# -- fake workers ----------------------------------------------------------------------------
_METRICS = (
    "# TYPE vllm:num_requests_running gauge\n"
    f'vllm:num_requests_running{{model_name="{MODEL}"}} 0.0\n'
    "# TYPE vllm:num_requests_waiting gauge\n"
    f'vllm:num_requests_waiting{{model_name="{MODEL}"}} 0.0\n'
    "# TYPE vllm:kv_cache_usage_perc gauge\n"
    f'vllm:kv_cache_usage_perc{{model_name="{MODEL}"}} 0.0\n'
)


class FakeWorker:
    """An in-process worker that every scrape finds healthy and idle (vLLM's load gauges at 0,
    `/v1/models`), so policies keep choosing it, and that fails every completion its own way:
    `hang` reads the whole request and never writes a byte; `error` answers 500 at once, with
    the plain-text body an ASGI server gives for an unhandled exception."""

    def __init__(self, mode: str) -> None:
        assert mode in ("hang", "error")
        self.mode = mode
        self.arrivals: list[float] = []  # monotonic, one per completion request
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def id(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._completion)
        app.router.add_post("/v1/completions", self._completion)
        self._runner = web.AppRunner(
            app, handler_cancellation=True, shutdown_timeout=0.5, access_log=None
        )
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=_METRICS, content_type="text/plain")

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def _models(self, request: web.Request) -> web.Response:
        model = {"id": MODEL, "object": "model", "owned_by": "vllm", "max_model_len": 131072}
        return web.json_response({"object": "list", "data": [model]})

    async def _completion(self, request: web.Request) -> web.Response:
        self.arrivals.append(time.monotonic())
        await request.read()
        if self.mode == "error":
            return web.Response(status=500, text="Internal Server Error")
        await asyncio.Event().wait()  # cancelled when the router gives up on the connection
        raise AssertionError("unreachable")


# -- the load ----------------------------------------------------------------------------------
@dataclass
class Call:
    """One client request as the client saw it; times are time.monotonic()."""

    session: str
    router: str
    turn: int
    start: float
    events: list[float] = field(default_factory=list)  # the head, then every line
    end: float = 0.0
    status: int = 0
    kind: str = ""  # answer | error | cut (connection lost) | hung
    text: str = ""
    request_id: str = ""
    detail: str = ""  # the error's message, or what was wrong
    problem: str = ""  # why the reply is not acceptable; "" when it is

    @property
    def first_event(self) -> float:
        return self.events[0] if self.events else self.end

    def in_flight_at(self, moment: float) -> bool:
        return self.start < moment < self.end

    def delay_after(self, moment: float) -> float | None:
        """Seconds from `moment` (or this call's start, if later) to its next sign of life: a
        byte or its end. None when it had ended by then."""
        if self.end <= moment:
            return None
        moment = max(moment, self.start)
        later = [t for t in self.events if t > moment]
        return (later[0] if later else self.end) - moment


def error_shape_problem(body: Any) -> str:
    """'' when `body` is an OpenAI error object, else what is wrong with it."""
    if not isinstance(body, dict) or not isinstance(body.get("error"), dict):
        return f"not an OpenAI error: {str(body)[:120]!r}"
    error = body["error"]
    missing = [key for key in ERROR_KEYS if key not in error]
    if missing:
        return f"error object lacks {missing}: {error}"
    if not isinstance(error["message"], str) or not error["message"]:
        return f"error without a message: {error}"
    return ""


def _check_stream(call: Call, lines: list[bytes], max_tokens: int) -> None:
    data = [line[6:] for line in lines if line.startswith(b"data: ")]
    if not data or data[-1] != b"[DONE]":
        call.kind, call.problem = "error", f"stream did not end with data: [DONE]: {lines[-3:]}"
        return
    frames = [json.loads(raw) for raw in data[:-1]]
    errors = [i for i, frame in enumerate(frames) if "error" in frame]
    if errors:
        call.kind = "error"
        frame = frames[errors[0]]
        call.detail = str(frame["error"].get("message", ""))[:200]
        call.problem = error_shape_problem(frame)
        if errors != [len(frames) - 1]:
            call.problem = call.problem or "an error event not followed by data: [DONE]"
        return
    parts, usage, finish = [], None, None
    for frame in frames:
        usage = frame.get("usage") or usage
        for choice in frame.get("choices", []):
            parts.append(choice.get("delta", {}).get("content") or "")
            finish = choice.get("finish_reason") or finish
    call.kind, call.text = "answer", "".join(parts)
    if not call.text or finish is None:
        call.problem = f"answer without content or finish_reason: {lines[-4:]}"
    elif usage is None or usage.get("completion_tokens") != max_tokens:
        call.problem = f"short answer: usage {usage}, wanted {max_tokens} tokens"


async def one_call(
    http: aiohttp.ClientSession, call: Call, messages: list[dict[str, str]], max_tokens: int,
    headers: dict[str, str] | None = None,
) -> Call:  # fmt: skip
    """`call`, one streamed chat turn, read as raw SSE lines, bounded by CALL_TIMEOUT_S; its
    fields fill in as it goes (`end` stays 0.0 until it ended)."""
    body = {"messages": messages, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    router, session = call.router, call.session
    lines: list[bytes] = []
    try:
        async with asyncio.timeout(CALL_TIMEOUT_S):
            async with http.post(router + "/v1/chat/completions", json=body,
                                 headers={"X-Session-ID": session, **(headers or {})}
                                 ) as response:  # fmt: skip
                call.events.append(time.monotonic())
                call.status = response.status
                call.request_id = response.headers.get("X-Request-Id", "")
                if response.status != 200:
                    raw = await response.read()
                    call.end = time.monotonic()
                    call.kind = "error"
                    try:
                        parsed = json.loads(raw)
                    except ValueError:
                        parsed = raw[:200].decode(errors="replace")
                    call.problem = error_shape_problem(parsed)
                    call.detail = f"{response.status} {str(parsed)[:200]}"
                    return call
                async for line in response.content:
                    call.events.append(time.monotonic())
                    if line.strip():
                        lines.append(line.strip())
        call.end = time.monotonic()
        _check_stream(call, lines, max_tokens)
    except TimeoutError:
        call.end = time.monotonic()
        call.kind, call.problem = "hung", f"no end within {CALL_TIMEOUT_S} s"
    except aiohttp.ClientError as exc:
        call.end = time.monotonic()
        call.kind, call.detail = "cut", f"{type(exc).__name__}: {exc}"
        call.problem = f"connection lost: {call.detail}"
    return call


def prompt(session: str, words: int) -> str:
    """`words` distinct words (the simulated tokenizer's tokens), unique to the session."""
    return f"{session} " + " ".join(f"w{i}" for i in range(words - 1))


@dataclass
class Client:
    """One session's client: its turns, in order, each to `router()` at the time."""

    session: str
    router: Callable[[], str]
    messages: list[dict[str, str]]
    calls: list[Call] = field(default_factory=list)

    async def turn(
        self, http: aiohttp.ClientSession, max_tokens: int, headers: dict[str, str] | None = None
    ) -> Call:
        call = Call(self.session, self.router(), len(self.calls), time.monotonic())
        self.calls.append(call)  # in flight (end == 0.0) until one_call returns
        await one_call(http, call, self.messages, max_tokens, headers)
        if call.kind == "answer":  # else the client asks the same again next turn
            follow_up = f"and then? ({len(self.calls)})"
            self.messages += [{"role": "assistant", "content": call.text},
                              {"role": "user", "content": follow_up}]  # fmt: skip
        return call


def clients(
    prefix: str, count: int, routers: Sequence[str], words: int
) -> list[Client]:  # fmt: skip
    """Sessions spread over `routers` round robin (each keeps its router)."""
    out = []
    for i in range(count):
        session = f"{prefix}-{uuid.uuid4().hex[:6]}-{i}"
        url = routers[i % len(routers)]
        out.append(Client(session, lambda url=url: url,  # type: ignore[misc]
                          [{"role": "user", "content": prompt(session, words)}]))  # fmt: skip
    return out


async def run_load(
    http: aiohttp.ClientSession, sessions: Sequence[Client], stop: asyncio.Event | None, *,
    min_turns: int, max_tokens: int, headers: dict[str, str] | None = None,
    max_turns: int = 40, stagger_s: float = 0.0,
) -> None:  # fmt: skip
    """Every session takes turns back to back: at least `min_turns`, then until `stop`; the
    i-th starts `i x stagger_s` late (so that least-loaded placement spreads new sessions)."""

    if stop is None:
        stop = asyncio.Event()
        stop.set()  # `min_turns` each

    async def loop(client: Client, delay: float) -> None:
        await asyncio.sleep(delay)
        for turn in range(max_turns):
            if turn >= min_turns and stop.is_set():
                return
            await client.turn(http, max_tokens, headers)

    async with asyncio.timeout(CALL_TIMEOUT_S * 4):
        await asyncio.gather(*(loop(c, i * stagger_s) for i, c in enumerate(sessions)))


async def final_turns(
    http: aiohttp.ClientSession, sessions: Sequence[Client], max_tokens: int,
    headers: dict[str, str] | None = None,
) -> list[Call]:  # fmt: skip
    """One more turn per session, after the fault: each must be answered in full."""
    return list(await asyncio.gather(*(c.turn(http, max_tokens, headers) for c in sessions)))


async def wait_until(
    check: Callable[[], Awaitable[bool]], timeout_s: float, what: str, every_s: float = 0.02
) -> float:
    """Poll `check` until true; returns when (monotonic). Fails the test after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        if await check():
            return time.monotonic()
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        await asyncio.sleep(every_s)


async def metric_total(http: aiohttp.ClientSession, url: str, name: str) -> float:
    """The sum of a metric's series on `url`'s /metrics (0 when unreachable)."""
    try:
        async with asyncio.timeout(1):
            async with http.get(url + "/metrics") as response:
                text = await response.text()
    except (aiohttp.ClientError, TimeoutError):
        return 0.0
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


# -- the report ------------------------------------------------------------------------------
@dataclass
class Row:
    scenario: str
    requests: int
    answered: int
    errors: int
    cut: int
    hung: int
    affected: int
    max_delay_ms: float
    note: str = ""


HEADER = (f"{'scenario':<34} {'requests':>8} {'answered':>8} {'errors':>6} {'cut':>4} "
          f"{'hung':>4} {'affected':>8} {'max delay after detection':>26}")  # fmt: skip


def format_row(row: Row) -> str:
    delay = f"{row.max_delay_ms:.0f} ms"
    line = (f"{row.scenario:<34} {row.requests:>8} {row.answered:>8} {row.errors:>6} "
            f"{row.cut:>4} {row.hung:>4} {row.affected:>8} {delay:>26}")  # fmt: skip
    return f"{line}  {row.note}" if row.note else line


def report(
    scenario: str, calls: Sequence[Call], affected: Sequence[tuple[Call, float]], note: str = ""
) -> Row:
    """The scenario's row: `affected` pairs each affected call with the moment its fault was
    detectable; its delay is from then to the call's next sign of life (or end)."""
    delays = [d for call, moment in affected if (d := call.delay_after(moment)) is not None]
    row = Row(
        scenario=scenario,
        requests=len(calls),
        answered=sum(c.kind == "answer" and not c.problem for c in calls),
        errors=sum(c.kind == "error" for c in calls),
        cut=sum(c.kind == "cut" for c in calls),
        hung=sum(c.kind == "hung" for c in calls),
        affected=len(delays),
        max_delay_ms=1000 * max(delays, default=0.0),
        note=note,
    )
    print(f"\n{HEADER}\n{format_row(row)}")
    return row


def unacceptable(calls: Sequence[Call]) -> list[str]:
    """Every call that is neither a full answer nor an OpenAI-shaped error, described."""
    return [f"{c.session} turn {c.turn} ({c.kind}, {c.status}): {c.problem}"
            for c in calls if c.problem]  # fmt: skip
