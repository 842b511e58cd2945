"""Fuzz a running router from outside: generated bodies, headers and raw request heads.

Every case goes over its own raw socket to the router (so any byte can be sent) and must be
answered within a deadline with a status below 500; a 4xx must carry an OpenAI-shaped error
(`{"error": {"message", "type", "param", "code"}}`). After the run the router must still
answer `/health`. Needs hypothesis (the `testing` extra):

    python -m bench.scripts.fuzz --target http://127.0.0.1:8000 --cases 10000

Without --target it starts simulated workers and a router itself (`session-router up`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

HEALTH = b"GET /health HTTP/1.1\r\nHost: r\r\nConnection: close\r\n\r\n"
DEADLINE_S = 15.0  # a generated prompt may be long: the simulated worker answers it all

_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=40),
)  # fmt: skip
json_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.text(max_size=12), inner, max_size=4)),
    max_leaves=12,
)  # fmt: skip

_content = st.one_of(
    st.text(max_size=200),
    st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": json_values}), max_size=3),
    json_values,
)
_message = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                           "content": _content}),
    json_values,
)  # fmt: skip
# Fields the router reads or owns, each either sensible or anything at all.
_FIELDS: dict[str, st.SearchStrategy[object]] = {
    "model": st.one_of(st.just("llama-3.1-8b"), json_values),
    "stream": st.one_of(st.booleans(), json_values),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}),
                                json_values),
    "max_tokens": st.one_of(st.integers(1, 16), st.integers(-5, 2**40), json_values),
    "max_completion_tokens": st.one_of(st.integers(1, 16), json_values),
    "user": st.one_of(st.text(max_size=300), json_values),
    "n": st.one_of(st.just(1), json_values),
    "priority": st.one_of(st.integers(-(2**40), 2**40), json_values),
    "kv_transfer_params": json_values,
    "bootstrap_host": json_values,
    "bootstrap_port": json_values,
    "bootstrap_room": json_values,
}  # fmt: skip


@st.composite
def chat_bodies(draw: st.DrawFn) -> bytes:
    """A chat request: messages that are mostly well-formed, and a random subset of fields."""
    body: dict[str, object] = {}
    if draw(st.booleans()):
        body["messages"] = draw(st.lists(_message, min_size=0, max_size=4))
    else:
        body["messages"] = [{"role": "user", "content": draw(st.text(max_size=200))}]
    for name in draw(st.lists(st.sampled_from(sorted(_FIELDS)), max_size=5, unique=True)):
        body[name] = draw(_FIELDS[name])
    if body.get("max_tokens") is None:
        body["max_tokens"] = 4  # keep answers short where the body leaves it open
    return json.dumps(body).encode()


def _nested(depth: int) -> bytes:
    return b'{"messages": ' + b"[" * depth + b"]" * depth + b"}"


raw_bodies = st.one_of(
    st.binary(max_size=200),
    st.builds(lambda b, n: b[:n], chat_bodies(), st.integers(0, 80)),  # truncated JSON
    st.integers(100, 20_000).map(_nested),
    st.text(max_size=100).map(lambda t: t.encode("utf-16")),
)
_number_text = st.one_of(
    st.floats().map(repr),
    st.sampled_from(["nan", "NaN", "inf", "-inf", "1e309", "-1", "0", "", " 5", "5ms", "0x10"]),
)
_header_text = st.one_of(st.text(max_size=300), st.binary(max_size=64).map(
    lambda b: b.decode("latin-1")))  # fmt: skip
headers = st.fixed_dictionaries(
    {},
    optional={
        "X-Session-Id": _header_text,
        "X-SLO-TTFT-Ms": _number_text,
        "X-SLO-ITL-Ms": _number_text,
        "X-Request-Id": _header_text,
        "Content-Type": st.sampled_from(["application/json", "application/json; charset=utf-8",
                                         "text/plain", "application/x-www-form-urlencoded", ""]),
    },
)  # fmt: skip
_valid_head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: router\r\n"
               b"Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")  # fmt: skip
# (a connection that sends nothing at all is an idle keep-alive connection, not a request)
raw_heads = st.one_of(
    st.binary(min_size=1, max_size=300),
    st.builds(lambda cut, junk: _valid_head[:cut] + junk,
              st.integers(1, len(_valid_head)), st.binary(max_size=40)),
    st.sampled_from([
        b"GET / HTTP/1.1\r\nHost: r\r\nContent-Length: -1\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 7\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"POST /v1/completions HTTP/1.1\r\nX: " + b"a" * 70_000 + b"\r\n\r\n",
        b"BREW /coffee HTCPCP/1.0\r\n\r\n",
        b"GET /../../etc/passwd HTTP/1.1\r\nHost: r\r\n\r\n",
    ]),
)  # fmt: skip


@dataclass
class Tally:
    """What the router answered, by status, and every case that broke a rule."""

    statuses: Counter[int] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)

    @property
    def cases(self) -> int:
        return sum(self.statuses.values())


def exchange(
    host: str, port: int, request: bytes, deadline_s: float = DEADLINE_S, keep_alive: bool = False
) -> bytes:
    """Send `request` on a fresh connection and read until the router closes it. With
    `keep_alive` (a raw head that did not ask to close), an answer followed by silence is the
    router keeping the connection open, not a hang."""
    with socket.create_connection((host, port), timeout=deadline_s) as sock:
        sock.settimeout(deadline_s)
        started = time.monotonic()
        try:
            sock.sendall(request)
        except OSError:
            pass  # the router may refuse a head before it is all sent: read its answer
        chunks: list[bytes] = []
        while True:
            if time.monotonic() - started > deadline_s:
                raise TimeoutError("no end of answer within the deadline")
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                break
            except TimeoutError:
                if keep_alive and chunks and chunks[0].startswith(b"HTTP/1."):
                    break
                raise
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks)


def post(path: str, body: bytes, extra: dict[str, str]) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: router", "Connection: close",
             f"Content-Length: {len(body)}"]  # fmt: skip
    if "Content-Type" not in extra:
        lines.append("Content-Type: application/json")
    for name, value in extra.items():
        lines.append(f"{name}: {value.replace(chr(13), ' ').replace(chr(10), ' ')}")
    return "\r\n".join(lines).encode("latin-1", "replace") + b"\r\n\r\n" + body


def judge(answer: bytes, tally: Tally, case: str) -> None:
    """Check one reply: a status below 500; a 4xx with an OpenAI-shaped JSON error. A raw head
    may hold pipelined requests: every answer in the reply is checked."""
    if not answer:  # closed without an answer: allowed only for heads that are not HTTP
        tally.statuses[0] += 1
        return
    if not answer.startswith(b"HTTP/1."):
        tally.failures.append(f"{case}: not an HTTP answer: {answer[:80]!r}")
        return
    for reply in answer.split(b"HTTP/1.1 ")[1:] if answer.startswith(b"HTTP/1.1 ") else [answer]:
        _judge_one(b"HTTP/1.1 " + reply, tally, case)


def _judge_one(answer: bytes, tally: Tally, case: str) -> None:
    head, _, body = answer.partition(b"\r\n\r\n")
    try:
        status = int(head.split(b" ", 2)[1])
    except (IndexError, ValueError):
        return  # "HTTP/1.1 " inside a body: not the start of another answer
    if status == 100:
        return  # an interim answer: the final one follows
    tally.statuses[status] += 1
    if status >= 500:
        tally.failures.append(f"{case}: {status}: {body[:300]!r}")
    elif status >= 400 and b"chunked" not in head.lower():
        length = _content_length(head)
        try:
            error = json.loads(body[:length] if length is not None else body)["error"]
            ok = {"message", "type", "param", "code"} <= set(error) and error["message"]
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            tally.failures.append(f"{case}: {status} without an OpenAI error: {body[:200]!r}")


def _content_length(head: bytes) -> int | None:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def fuzz(target: str, cases: int, deadline_s: float = DEADLINE_S) -> Tally:
    """Run `cases` generated cases of each kind (bodies, headers, raw heads) at `target`; each
    must be answered (or its connection closed) within `deadline_s`."""
    parts = urlsplit(target)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    tally = Tally()
    profile = settings(max_examples=cases, deadline=None, database=None, derandomize=True,
                       suppress_health_check=list(HealthCheck))  # fmt: skip

    def guarded(name: str, request: bytes, keep_alive: bool = False) -> None:
        try:
            judge(exchange(host, port, request, deadline_s, keep_alive), tally, name)
        except TimeoutError:
            if keep_alive and not request.strip():
                tally.statuses[0] += 1  # blank lines before a request: an idle connection
                return
            tally.failures.append(f"{name}: no answer within {deadline_s} s: {request[:120]!r}")
        except ConnectionRefusedError:
            tally.failures.append(f"{name}: the router refused connections (did it crash?)")

    @profile
    @given(body=chat_bodies(), extra=headers)
    def bodies(body: bytes, extra: dict[str, str]) -> None:
        guarded("body", post("/v1/chat/completions", body, extra))

    @profile
    @given(body=raw_bodies, path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
    def raw(body: bytes, path: str) -> None:
        guarded("raw body", post(path, body, {}))

    @profile
    @given(head=raw_heads)
    def heads(head: bytes) -> None:
        guarded("raw head", head, keep_alive=True)

    for run in (bodies, raw, heads):
        run()
    try:
        health = exchange(
            host, port, b"GET /health HTTP/1.1\r\nHost: r\r\nConnection: close\r\n\r\n"
        )
        if not health.startswith(b"HTTP/1.1 200"):
            tally.failures.append(f"after the run /health answered {health[:60]!r}")
    except OSError as exc:
        tally.failures.append(f"after the run /health failed: {exc!r}")
    return tally


def _report(tally: Tally, seconds: float) -> str:
    statuses = ", ".join(f"{s or 'closed'}: {n}" for s, n in sorted(tally.statuses.items()))
    lines = [f"{tally.cases} cases in {seconds:.0f} s; answers {statuses}",
             f"failures: {len(tally.failures)}"]  # fmt: skip
    lines += [f"  {failure}" for failure in tally.failures[:50]]
    return "\n".join(lines)


# The local stack's router cuts a request head or body that is not whole within this long, so
# a truncated head must be answered (408) or closed well inside the fuzzer's deadline.
LOCAL_READ_TIMEOUT_S = 2.0


async def _with_local_stack(run: Callable[[str], Tally]) -> Tally:
    from bench.stack.layout import ClusterSpec, worker_roles
    from bench.stack.up import LocalStack, StackSpec, policy_params

    cluster = ClusterSpec(3, "h200-sxm", "llama-3.1-8b")
    params = policy_params("adaptive", {}, cluster)
    read_timeout = ("--client-read-timeout-s", str(LOCAL_READ_TIMEOUT_S))
    spec = StackSpec(cluster, tuple(worker_roles("adaptive", 3, 1)), "adaptive",
                     tuple(params.items()), log_dir=tempfile.mkdtemp(prefix="fuzz-"),
                     router_args=read_timeout)  # fmt: skip
    async with LocalStack(spec) as stack:
        return await asyncio.to_thread(run, stack.url)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", help="a running router (default: start a local stack)")
    parser.add_argument("--cases", type=int, default=10_000, help="cases of each kind")
    parser.add_argument(
        "--deadline-s",
        type=float,
        default=DEADLINE_S,
        help="longest wait for one answer (above the router's read timeout)",
    )
    args = parser.parse_args(argv)
    started = time.monotonic()
    if args.target:
        tally = fuzz(args.target, args.cases, args.deadline_s)
    else:
        tally = asyncio.run(_with_local_stack(lambda url: fuzz(url, args.cases, args.deadline_s)))
    print(_report(tally, time.monotonic() - started))
    return 1 if tally.failures else 0


if __name__ == "__main__":
    sys.exit(main())
