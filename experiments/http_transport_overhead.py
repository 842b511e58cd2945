"""Transport overhead: a minimal proxy on router.http against the same proxy on aiohttp.

Starts a fast backend (router.http's server with a canned completion, or a short SSE stream
when the body asks for one) and two minimal proxies in front of it, each in its own uvloop
process: one built from router.http's server and upstream pool, one from aiohttp's web server
and client. Both forward method, path, body and status and relay streams chunk by chunk. After
checking both proxies relay a JSON reply and a stream byte for byte, wrk measures each path
(POST with a small JSON body, 1 and 32 connections): p50/p99 latency, requests/s, the proxy's
CPU per request, and the ratios against the direct path. `--backend aiohttp` puts
bench.scripts.fast_backend (aiohttp) behind the proxies instead. Needs `wrk` on PATH.

    .venv/bin/python -m experiments.http_transport_overhead --duration 10
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import uvloop
from aiohttp import web

from bench.scripts.loadgen import cpu_seconds, free_port, run_wrk, wait_healthy
from router.http import HttpServer, Request, Response, StreamWriter, UpstreamPool

_BODY = b'{"model":"fast","prompt":"hello world","max_tokens":16}'
_REPLY = (
    b'{"id":"cmpl-fast","object":"text_completion","created":0,"model":"fast","choices":[{"index"'
    b':0,"text":" ok ok ok ok ok ok ok ok ok ok ok ok ok ok ok ok","logprobs":null,"finish_reason'
    b'":"length"}],"usage":{"prompt_tokens":8,"completion_tokens":16,"total_tokens":24}}'
)
_FRAME = b'data: {"choices":[{"index":0,"text":" ok","finish_reason":null}]}\n\n'
_STREAM_FRAMES = 16
_WRK_SCRIPT = f"""wrk.method = "POST"
wrk.body = '{_BODY.decode()}'
wrk.headers["Content-Type"] = "application/json"
"""
_FORWARDED = ("content-type", "authorization", "x-session-id", "x-request-id")


# -- the three servers (each runs in its own process)
async def _backend(request: Request, writer: StreamWriter) -> Response | None:
    if request.path == "/health":
        return Response(200, b"{}")
    if b'"stream":true' not in request.body:
        return Response(200, _REPLY)
    await writer.start(200, {"Content-Type": "text/event-stream"})
    for _ in range(_STREAM_FRAMES):
        await writer.write(_FRAME)
    await writer.write(b"data: [DONE]\n\n")
    await writer.end()
    return None


def _fast_proxy(upstream: str) -> HttpServer:
    pool = UpstreamPool()

    async def proxy(request: Request, writer: StreamWriter) -> Response | None:
        headers = {name: request.headers[name] for name in _FORWARDED if name in request.headers}
        reply = await pool.request(upstream, request.method, request.path, headers, request.body)
        content_type = reply.headers.get("content-type")
        if "chunked" not in reply.headers.get("transfer-encoding", ""):
            return Response(reply.status, await reply.read(), content_type=content_type)
        await writer.start(reply.status, {"Content-Type": content_type or "text/event-stream"})
        async for chunk in reply.iter_chunks():
            await writer.write(chunk)
        await writer.end()
        return None

    return HttpServer(proxy)


def _aiohttp_proxy(upstream: str) -> web.Application:
    async def proxy(request: web.Request) -> web.StreamResponse:
        session: aiohttp.ClientSession = request.app["session"]
        headers = {name: request.headers[name] for name in _FORWARDED if name in request.headers}
        body = await request.read()
        url = upstream + request.path_qs
        async with session.request(request.method, url, headers=headers, data=body) as reply:
            out_headers = {"Content-Type": reply.headers.get("Content-Type", "application/json")}
            if reply.headers.get("Transfer-Encoding") != "chunked":
                body = await reply.read()
                return web.Response(status=reply.status, body=body, headers=out_headers)
            response = web.StreamResponse(status=reply.status, headers=out_headers)
            await response.prepare(request)
            async for chunk in reply.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    async def session_context(app: web.Application) -> AsyncIterator[None]:
        app["session"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        yield
        await app["session"].close()

    app = web.Application()
    app.cleanup_ctx.append(session_context)
    app.router.add_route("*", "/{tail:.*}", proxy)
    return app


def _serve(role: str, port: int, upstream: str) -> None:
    uvloop.install()
    if role == "aiohttp-proxy":
        web.run_app(_aiohttp_proxy(upstream), host="127.0.0.1", port=port, access_log=None,
                    print=None)  # fmt: skip
        return
    server = HttpServer(_backend) if role == "backend" else _fast_proxy(upstream)

    async def run() -> None:
        await server.start("127.0.0.1", port)
        await asyncio.Event().wait()  # until terminated

    asyncio.run(run())


# -- measurement
def _fetch(url: str, body: bytes | None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=5) as response:
        return response.status, response.read()


def _versus(row: dict[str, float], direct: dict[str, float]) -> str:
    added_p50, added_p99 = row["p50_us"] - direct["p50_us"], row["p99_us"] - direct["p99_us"]
    return f"{added_p50:>+8.0f} {added_p99:>+8.0f} {row['rps'] / direct['rps']:>8.2f}"


def _check_relay(direct: str, proxy: str) -> None:
    """Both proxies must relay the backend's replies byte for byte, streams included."""
    stream_body = b'{"model":"fast","prompt":"hi","stream":true}'
    for body in (_BODY, stream_body):
        expected, got = (
            _fetch(direct + "/v1/completions", body),
            _fetch(proxy + "/v1/completions", body),
        )
        if got != expected:
            raise RuntimeError(f"{proxy} relayed {got!r}, the backend said {expected!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--role", choices=["backend", "fast-proxy", "aiohttp-proxy"])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--upstream", default="")
    parser.add_argument(
        "--backend",
        choices=["router.http", "aiohttp"],
        default="router.http",
        help="the fast backend: router.http's server, or bench.scripts.fast_backend (aiohttp)",
    )
    args = parser.parse_args()
    if args.role:
        _serve(args.role, args.port, args.upstream)
        return
    ports = {"direct": free_port(), "aiohttp": free_port(), "router.http": free_port()}
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    module = [sys.executable, "-m", "experiments.http_transport_overhead"]
    roles = {"direct": "backend", "aiohttp": "aiohttp-proxy", "router.http": "fast-proxy"}
    commands = {
        name: [*module, "--role", role, "--port", str(ports[name]), "--upstream", urls["direct"]]
        for name, role in roles.items()
    }
    if args.backend == "aiohttp":
        commands["direct"] = [sys.executable, "-m", "bench.scripts.fast_backend", "--port",
                              str(ports["direct"]), "--chunks", str(_STREAM_FRAMES)]  # fmt: skip
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as script:
        script.write(_WRK_SCRIPT)
    procs = {name: subprocess.Popen(command) for name, command in commands.items()}
    try:
        for url in urls.values():
            wait_healthy(url)
        for name in ("aiohttp", "router.http"):
            _check_relay(urls["direct"], urls[name])
        for url in urls.values():
            run_wrk(url + "/v1/completions", 4, 2, script.name)  # warm-up
        print(f"{'conns':>5} {'path':>12} {'p50 us':>8} {'p99 us':>8} {'req/s':>9} "
              f"{'+p50 us':>8} {'+p99 us':>8} {'x direct':>8} {'CPU us/req':>10}")  # fmt: skip
        for connections in (1, 32):
            rows: dict[str, dict[str, float]] = {}
            for name, url in urls.items():
                cpu_before = cpu_seconds(procs[name].pid)
                row = rows[name] = run_wrk(
                    url + "/v1/completions", connections, args.duration, script.name
                )
                cpu_us = (cpu_seconds(procs[name].pid) - cpu_before) / row["requests"] * 1e6
                versus = _versus(row, rows["direct"])
                print(f"{connections:>5} {name:>12} {row['p50_us']:>8.0f} {row['p99_us']:>8.0f} "
                      f"{row['rps']:>9.0f} {versus} {cpu_us:>10.0f}")  # fmt: skip
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            proc.wait(timeout=10)
        Path(script.name).unlink()


if __name__ == "__main__":
    main()
