"""A lean HTTP/1.1 server for the router's data path: asyncio.Protocol + httptools.

Each connection serves one request at a time; pipelined requests wait in order. A request's
body is read whole before its handler runs as a task; the handler returns a `Response` or
streams chunks through its `StreamWriter`. A client that disconnects while its handler runs gets
that task cancelled at once: this is how the router abandons the upstream request. One that
leaves after its streamed answer has ended does not: the handler's work past the end (reading
the worker's stream to its close, the turn's bookkeeping) is no longer the client's to cancel.

A client that half-closes (shutdown(SHUT_WR)) after whole requests, before their answers
start, still gets them (a FIN once an answer has started means the client left). A FIN reads
the same whether the client half-closed or closed for good, so an HTTP/1.1 request whose answer
has not started gets an interim `100 Continue` then (RFC 9110 15.2: clients parse unexpected 1xx
answers): a client that closed for good answers it with a reset, which `_check_peer` sees
within a few milliseconds, and its handler is cancelled as before.

Slow and greedy clients are bounded: a request's head and body must arrive within
`read_timeout_s` of its first byte (408, then close: a trickle of bytes does not extend it);
an idle keep-alive connection closes after `keepalive_timeout_s`, and any connection after
`max_requests_per_connection` requests; beyond `max_connections` open connections a new one is
answered 503 and closed.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import socket
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, cast

from router.http import headers as wire
from router.http.headers import BadRequest, Headers, RequestReader
from router.http.messages import Request, Response
from router.http.stream import CLOSE, StreamWriter

_log = logging.getLogger(__name__)
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_KEEP_ALIVE = b"Connection: keep-alive\r\n"
_LINGER_S = 2.0  # after an error reply, how long the rest of a refused request is discarded
_CLOSE_FLUSH_S = 1.0  # at close(), how long a closing connection may take to flush
HEAD_HOLD_S = 0.02  # how long a stream's head waits for its first chunk
# after a client's FIN, its socket is checked for a reset after 1 ms, then at doubling
# intervals up to 50 ms (a reset comes back one round trip after the probe)
_PEER_CHECK_FIRST_S = 0.001
_PEER_CHECK_S = 0.05
_MAX_REFUSING = 256  # connections over the limit lingering on their 503; past it, reset at once
_FD_RESERVE = 1024  # descriptors beyond two per client connection (upstreams, Redis, files)


Handler = Callable[[Request, StreamWriter], Awaitable[Response | None]]


class _Connection(asyncio.Protocol):
    """One client connection: parses requests, runs one handler task at a time."""

    def __init__(self, server: HttpServer) -> None:
        self._server = server
        self._loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport = None  # type: ignore[assignment]  # set at once
        self._reader: RequestReader = None  # type: ignore[assignment]  # set at once
        self._queue: deque[Request] = deque()  # parsed, waiting for the request in flight
        self.task: asyncio.Task[None] | None = None
        self._failure: BadRequest | None = None  # answered once the requests ahead are done
        self._continue_pending = False
        self.closed = self.shutting_down = False
        self._reading_paused = self.write_paused = False
        self._drain_waiter: asyncio.Future[None] | None = None
        self._idle_timer: asyncio.TimerHandle | None = None  # waiting for a next request
        self._read_timer: asyncio.TimerHandle | None = None  # the request being read is due
        self._eof = False  # the client half-closed: answer what it sent, then close
        self._peer_timer: asyncio.TimerHandle | None = None  # after the EOF: reset yet?
        self._peer_delay = _PEER_CHECK_FIRST_S
        self._writer: StreamWriter | None = None  # the answer in progress (once its task runs)
        self._in_flight_http10 = False  # the request in flight is HTTP/1.0 (no 1xx answers)
        self._served = 0  # requests this connection has started to answer

    @property
    def last_answer(self) -> bool:
        """The client half-closed and nothing waits after the answer in progress."""
        return self._eof and not self._queue

    # -- transport callbacks
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass of it
        wire.set_nodelay(transport)
        peer = transport.get_extra_info("peername")
        remote = peer[0] if isinstance(peer, tuple) else None
        server = self._server
        self._reader = RequestReader(
            server.max_body_bytes, remote, self._on_request, self._on_expect_continue
        )
        if server.closing:
            server.connections.add(self)
            self.shutting_down = True
            transport.close()
        elif len(server.connections) >= server.max_connections:
            self._refuse()
        else:
            server.connections.add(self)
            self._arm_idle_timer()

    def data_received(self, data: bytes) -> None:
        if self._failure is not None or self.closed:
            return  # done for: the error goes out after the requests ahead of it
        reader = self._reader
        begun = reader.begun
        try:
            reader.feed(data)
        except BadRequest as failure:
            self._fail(failure)
            return
        if reader.in_message:
            # the deadline runs from a request's first byte: later bytes never move it
            if self._read_timer is None or reader.begun != begun:
                self._arm_read_timer()
            self._cancel_idle_timer()
        else:
            self._cancel_read_timer()
            if self.task is not None or self._queue:
                self._cancel_idle_timer()
        if self.task is not None and (self._queue or reader.in_message):
            self._pause_reading()  # pipelined bytes wait in the kernel, not in our memory

    def eof_received(self) -> bool | None:
        self._eof = True
        self._cancel_read_timer()  # a request cut short by the EOF can never complete
        started = self._writer is not None and self._writer.started
        if self.task is None or (started and not self._queue):
            return None  # nothing left to answer, or the client left during its answer: close
        # half-closed after whole requests, or gone: keep writing the answers, and find out
        if not started and not self._in_flight_http10:
            self.transport.write(_CONTINUE)
        self._peer_timer = self._loop.call_later(self._peer_delay, self._check_peer)
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._cancel_idle_timer()
        self._cancel_read_timer()
        if self._peer_timer is not None:
            self._peer_timer.cancel()
            self._peer_timer = None
        self._queue.clear()
        task = self.task
        # A handler whose answer is whole finishes, and the server counts this connection
        # until it has (its `close` waits for it; `_serve` tells it when).
        if task is None or self._writer is None or not self._writer.ended:
            self._server.connection_closed(self)
            if task is not None:
                task.cancel()
        self._wake_writer()

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self._wake_writer()

    # -- reader callbacks
    def _on_expect_continue(self) -> None:
        if self.task is None and not self._queue:
            self.transport.write(_CONTINUE)
        else:
            self._continue_pending = True  # must not cut into the response being written

    def _on_request(self, request: Request) -> None:
        self._continue_pending = False
        if self.shutting_down:
            return  # the connection closes after the request in flight
        if self.task is None and not self._queue:
            self._start(request)
        else:
            self._queue.append(request)

    # -- request lifecycle
    def _start(self, request: Request) -> None:
        self._in_flight_http10 = request.http_version == "1.0"
        self.task = self._loop.create_task(self._serve(request))

    async def _serve(self, request: Request) -> None:
        self._served += 1
        if self._served >= self._server.max_requests_per_connection:
            self.shutting_down = True  # the last one here: answered with Connection: close
            self._queue.clear()  # pipelined ones after it are never answered: clients resend
        writer = self._writer = StreamWriter(self, request)
        keep_alive = request.keep_alive
        try:
            response = await self._server.handler(request, writer)
            if self.closed:
                return
            if response is not None:
                if writer.started:
                    raise RuntimeError("handler returned a Response after streaming")
                self._respond(request, response, keep_alive)
            elif not writer.started:
                raise RuntimeError("handler returned None without streaming a response")
            else:
                await writer.end()  # a handler that forgot end() finished normally all the same
                keep_alive = writer.keep_alive
        except asyncio.CancelledError:
            self._abort()  # server shutdown or a dropped client; nothing half-written may stay
            raise
        except Exception:
            if self.closed:
                return  # the client left mid-write; there is nobody to answer
            _log.exception("handler failed for %s %s", request.method, request.path)
            if writer.started:
                self._abort()  # the status is out; a truncated stream must not look complete
                return
            self._respond(request, _error(500, "internal server error"), keep_alive)
        finally:
            self.task = self._writer = None
            writer._run_after_sent()
            if self.closed:
                self._server.connection_closed(self)  # the client left while this finished
        self._after_response(keep_alive)

    def _respond(self, request: Request, response: Response, keep_alive: bool) -> None:
        status, body = response.status, response.body
        bodiless = wire.is_bodiless(status)
        tail = b"" if bodiless else b"Content-Length: %d\r\n" % len(body)
        if not keep_alive or self.shutting_down or self.last_answer:
            tail += CLOSE
        elif request.http_version == "1.0":
            tail += _KEEP_ALIVE
        head = wire.response_head(status, response.headers, response.content_type, tail)
        send_body = body and not bodiless and request.method != "HEAD"
        if send_body:
            self.transport.writelines((head, body))  # one send, no copy of the body
        else:
            self.transport.write(head)

    def _after_response(self, keep_alive: bool) -> None:
        if self.closed:
            return
        if not keep_alive or self.shutting_down:
            self.transport.close()  # flushes what is buffered first
        elif self._queue:
            self._start(self._queue.popleft())
        elif self._failure is not None:
            self._send_failure(self._failure)
        elif self._eof:
            self.transport.close()  # the client sends nothing more
        else:
            if self._continue_pending:
                self._continue_pending = False
                self.transport.write(_CONTINUE)
            if self._reading_paused:
                self._reading_paused = False
                self.transport.resume_reading()
            if self._reader.in_message:  # a pipelined request waited unread: its time starts
                self._arm_read_timer()
            else:
                self._arm_idle_timer()

    def _fail(self, failure: BadRequest) -> None:
        self._failure = failure
        if self.task is None and not self._queue:
            self._send_failure(failure)
        else:
            self._pause_reading()

    def _send_failure(self, failure: BadRequest) -> None:
        self._cancel_read_timer()
        self._cancel_idle_timer()
        self._respond(_BLANK_REQUEST, _error(failure.status, str(failure)), keep_alive=False)
        if self._eof or not self.transport.can_write_eof():
            self.transport.close()
            return
        # Lingering close: closing with unread request bytes would send a reset that can
        # destroy the error reply before the client reads it; discard them for a while instead
        self.transport.write_eof()
        if self._reading_paused:
            self._reading_paused = False
            self.transport.resume_reading()
        self._loop.call_later(_LINGER_S, self._abort)

    # -- flow control, idle timeout, shutdown
    async def drain(self) -> None:
        if self.write_paused and not self.closed:
            if self._drain_waiter is None:
                self._drain_waiter = self._loop.create_future()
            await asyncio.shield(self._drain_waiter)  # shared; one cancelled waiter keeps it
        if self.closed:
            raise ConnectionResetError("client disconnected")

    def _wake_writer(self) -> None:
        waiter, self._drain_waiter = self._drain_waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _pause_reading(self) -> None:
        if not self._reading_paused and not self.closed:
            self._reading_paused = True
            self.transport.pause_reading()
        self._cancel_read_timer()  # the client is not to blame for what we do not read

    def _abort(self) -> None:
        if not self.closed:
            self.transport.abort()

    def _arm_idle_timer(self) -> None:
        """Wait `keepalive_timeout_s` for the next request's first byte; stray bytes (blank
        lines between requests) do not extend it."""
        self._cancel_idle_timer()
        self._idle_timer = self._loop.call_later(self._server.keepalive_timeout_s, self._on_idle)

    def _cancel_idle_timer(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None

    def _on_idle(self) -> None:
        self._idle_timer = None
        if self.closed or self.task is not None or self._queue or self._reader.in_message:
            return  # re-armed when the connection is idle again
        self.transport.close()

    def _arm_read_timer(self) -> None:
        self._cancel_read_timer()
        self._read_timer = self._loop.call_later(self._server.read_timeout_s, self._on_read_due)

    def _cancel_read_timer(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _on_read_due(self) -> None:
        self._read_timer = None
        if self.closed or self._failure is not None or not self._reader.in_message:
            return
        limit = self._server.read_timeout_s
        self._fail(BadRequest(408, f"request not received within {limit:g} s of its first byte"))

    def _check_peer(self) -> None:
        """After the client's FIN: a reset since (it closed for good) ends the connection."""
        self._peer_timer = None
        if self.closed or (self.task is None and not self._queue):
            return
        sock = self.transport.get_extra_info("socket")
        try:
            error = 0 if sock is None else sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        except OSError:
            error = 1
        if error:
            self.transport.abort()  # connection_lost cancels the handler
        else:
            self._peer_delay = min(2 * self._peer_delay, _PEER_CHECK_S)
            self._peer_timer = self._loop.call_later(self._peer_delay, self._check_peer)

    def _refuse(self) -> None:
        """Over the connection limit: a 503 (no request read) and a lingering close."""
        server = self._server
        server.refusing.add(self)
        if len(server.refusing) > _MAX_REFUSING:
            self.transport.abort()  # a flood: lingering would hold descriptors too
            return
        self._failure = BadRequest(503, "too many connections to this router; retry shortly")
        self._send_failure(self._failure)

    def shut_down(self) -> None:
        """Finish the request in flight (if any), then close."""
        self.shutting_down = True
        self._queue.clear()
        if self.task is None and not self.closed:
            self.transport.close()


_BLANK_REQUEST = Request("GET", "", {}, Headers(), b"", None, "1.1", keep_alive=False)


def _error(status: int, message: str) -> Response:
    headers = {"Retry-After": "1"} if status == 503 else None
    return Response(status, wire.error_body(status, message), headers)


class HttpServer:
    """Serves `handler` over HTTP/1.1 with keep-alive and pipelining (limits: module doc)."""

    def __init__(
        self,
        handler: Handler,
        *,
        max_body_bytes: int = 32 * 2**20,
        keepalive_timeout_s: float = 75.0,
        head_hold_s: float = HEAD_HOLD_S,
        read_timeout_s: float = 30.0,
        max_connections: int = 4096,
        max_requests_per_connection: int = 10_000,
    ) -> None:
        limits = {
            "keepalive_timeout_s": keepalive_timeout_s,
            "read_timeout_s": read_timeout_s,
            "max_connections": max_connections,
            "max_requests_per_connection": max_requests_per_connection,
        }
        for name, value in limits.items():
            if not value > 0:
                raise ValueError(f"{name} must be positive, got {value}")
        self.handler = handler
        self.max_body_bytes = max_body_bytes
        self.keepalive_timeout_s = keepalive_timeout_s
        self.head_hold_s = head_hold_s
        self.read_timeout_s = read_timeout_s
        self.max_connections = max_connections
        self.max_requests_per_connection = max_requests_per_connection
        self.connections: set[_Connection] = set()
        self.refusing: set[_Connection] = set()  # over the limit, lingering on their 503
        self.closing = False
        self._server: asyncio.Server | None = None
        self._all_closed = asyncio.Event()

    async def start(self, host: str, port: int, backlog: int = 2048) -> None:
        if self._server is not None:
            raise RuntimeError("server already started")
        _fd_headroom(self.max_connections)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Connection(self), host, port, backlog=backlog, reuse_address=True
        )

    @property
    def port(self) -> int:
        # uvloop's `sockets` is a list where typeshed says tuple (the compiled hot path checks
        # declared types): read it as any sequence
        sockets: Sequence[Any] = getattr(self._server, "sockets", None) or ()
        if not sockets:
            raise RuntimeError("server not started")
        port: int = sockets[0].getsockname()[1]
        return port

    def connection_closed(self, conn: _Connection) -> None:
        self.refusing.discard(conn)
        self.connections.discard(conn)
        if not self.connections:
            self._all_closed.set()

    async def close(self, grace_s: float = 10.0) -> None:
        """Stop accepting; let handlers in flight finish within `grace_s`, then cancel them."""
        if self._server is None or self.closing:
            return
        self.closing = True
        self._server.close()
        for conn in list(self.refusing):
            conn.transport.abort()
        for conn in list(self.connections):
            conn.shut_down()  # idle ones close now, busy ones after their response
        busy = [conn.task for conn in self.connections if conn.task is not None]
        if busy:
            _, late = await asyncio.wait(busy, timeout=grace_s)
            for task in late:
                task.cancel()
        if self.connections:  # transports still flushing their last bytes to the client
            self._all_closed.clear()
            try:
                await asyncio.wait_for(self._all_closed.wait(), timeout=_CLOSE_FLUSH_S)
            except TimeoutError:
                for conn in list(self.connections):
                    conn.transport.abort()
        await self._server.wait_closed()


def _fd_headroom(max_connections: int) -> None:
    """Raise the soft descriptor limit so that `max_connections` clients, an upstream
    connection each and a reserve fit: the connection limit, not EMFILE, must refuse clients,
    and running out of descriptors would fail upstream connections for clients already in."""
    want = 2 * max_connections + _FD_RESERVE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= want:
        return
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (OSError, ValueError):
            target = soft
    if target < want:
        _log.warning(
            "descriptor limit %d is below the %d that %d client connections may need; "
            "raise `ulimit -n` or lower max_connections",
            target, want, max_connections,
        )  # fmt: skip
