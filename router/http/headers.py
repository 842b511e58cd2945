"""HTTP/1.1 for router.http, apart from connections: the received-header map, request parsing,
and response and request heads (the request and reply values are in `router.http.messages`)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Iterator, Mapping
from http import HTTPStatus
from typing import TypeVar, overload
from urllib.parse import parse_qsl, unquote

import httptools
import msgspec

from router.http.messages import Request

_T = TypeVar("_T")
_MAX_HEAD_BYTES = 64 * 1024  # request line and headers; llhttp itself sets no limit
# Raw header name -> its lowercased str: the same few names arrive on every request.
_LOWER_NAMES: dict[bytes, str] = {}
_LOWER_NAMES_MAX = 512  # a client sending ever-new names must not grow it without bound


class Headers(Mapping[str, str]):
    """Received headers: names lowercased, repeated fields joined by ", " (as RFC 9110 allows)."""

    __slots__ = ("_map",)

    def __init__(self, fields: Mapping[str, str] | None = None) -> None:
        self._map: dict[str, str] = {}
        for name, value in (fields or {}).items():
            self.add(name, value)

    @classmethod
    def from_raw(cls, raw: list[tuple[bytes, bytes]]) -> Headers:
        """Build from the parser's (name, value) byte pairs; latin-1 keeps every byte."""
        headers = cls()
        known = headers._map
        names = _LOWER_NAMES
        for name_bytes, value_bytes in raw:
            name = names.get(name_bytes)
            if name is None:
                name = name_bytes.decode("latin-1").lower()
                if len(names) < _LOWER_NAMES_MAX:
                    names[name_bytes] = name
            value = value_bytes.decode("latin-1")
            previous = known.get(name)
            known[name] = value if previous is None else f"{previous}, {value}"
        return headers

    def add(self, name: str, value: str) -> None:
        name = name.lower()
        previous = self._map.get(name)
        self._map[name] = value if previous is None else f"{previous}, {value}"

    @overload
    def get(self, name: str, /) -> str | None: ...
    @overload
    def get(self, name: str, default: str, /) -> str: ...
    @overload
    def get(self, name: str, default: _T, /) -> str | _T: ...
    def get(self, name: str, default: object = None, /) -> object:
        value = self._map.get(name)  # callers mostly ask in lower case already
        if value is None and not name.islower():
            value = self._map.get(name.lower())
        return default if value is None else value

    def __getitem__(self, name: str) -> str:
        return self._map[name.lower()]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.lower() in self._map

    def __iter__(self) -> Iterator[str]:
        return iter(self._map)

    def __len__(self) -> int:
        return len(self._map)

    def __repr__(self) -> str:
        return f"Headers({self._map!r})"


class BadRequest(Exception):
    """A request the server answers with `status` and closes the connection after."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def split_target(target: bytes) -> tuple[str, dict[str, str]]:
    """The percent-decoded path and the query (last value wins) of a request target."""
    if target.startswith(b"/"):
        path_bytes, _, query_bytes = target.partition(b"?")
        path_bytes = path_bytes.partition(b"#")[0]
    elif target == b"*":  # OPTIONS *
        return "*", {}
    else:  # absolute-form
        try:
            url = httptools.parse_url(target)
        except httptools.HttpParserInvalidURLError:
            raise BadRequest(400, "invalid request target") from None
        path_bytes, query_bytes = url.path or b"/", url.query or b""
    path = path_bytes.decode("latin-1")
    if "%" in path:
        try:
            path = unquote(path, errors="strict")
        except UnicodeError:
            raise BadRequest(400, "request path is not UTF-8") from None
    if not query_bytes:
        return path, {}
    return path, dict(parse_qsl(query_bytes.decode("latin-1"), keep_blank_values=True))


class RequestReader:
    """httptools callbacks assembling whole requests, within the head and body size limits.

    `feed` raises BadRequest for what the server must refuse; complete requests go to
    `on_request` in order, `on_expect_continue` is told when a client awaits `100 Continue`.
    """

    def __init__(
        self,
        max_body_bytes: int,
        remote: str | None,
        on_request: Callable[[Request], None],
        on_expect_continue: Callable[[], None],
    ) -> None:
        self._parser = httptools.HttpRequestParser(self)
        self._max_body = max_body_bytes
        self._remote = remote
        self._on_request = on_request
        self._on_expect_continue = on_expect_continue
        self.in_message = self.in_body = False  # where the parser is: in a request, its body
        self.begun = 0  # requests begun so far: tells the server a new one started in a read
        self._head_bytes = self._head_size = self._body_size = 0
        self._target = b""
        self._raw_headers: list[tuple[bytes, bytes]] = []
        self._headers = Headers()
        self._body: list[bytes] = []

    def feed(self, data: bytes) -> None:
        if not self.in_body:
            self._head_bytes += len(data)
        try:
            while True:
                try:
                    self._parser.feed_data(data)
                    break
                except httptools.HttpParserUpgrade as upgrade:
                    # Upgrade is not offered: that request is answered as plain HTTP/1.1 and
                    # parsing goes on after it (it had no body, see on_headers_complete)
                    data = data[upgrade.args[0] :]
                    if not data:
                        break
        except httptools.HttpParserCallbackError as exc:
            if isinstance(exc.__context__, BadRequest):
                raise exc.__context__ from None
            raise BadRequest(400, "malformed HTTP request") from exc
        except httptools.HttpParserError as exc:
            raise BadRequest(400, f"malformed HTTP request: {exc}") from None
        if not self.in_body and self._head_bytes > _MAX_HEAD_BYTES:
            raise BadRequest(431, "request head too large")

    def on_message_begin(self) -> None:
        self.in_message = True
        self.begun += 1
        self._head_size = 0
        self._target = b""
        self._raw_headers = []
        self._body = []
        self._body_size = 0

    def on_url(self, url: bytes) -> None:
        self._target += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._raw_headers.append((name, value))
        self._head_size += len(name) + len(value)

    def on_headers_complete(self) -> None:
        self.in_body = True
        self._head_bytes = 0
        if self._head_size + len(self._target) > _MAX_HEAD_BYTES:  # all of it came in one read
            raise BadRequest(431, "request head too large")
        headers = self._headers = Headers.from_raw(self._raw_headers)
        length = headers.get("content-length")
        if length is not None and int(length) > self._max_body:  # llhttp checked the digits
            raise BadRequest(413, f"request body over {self._max_body} bytes")
        if self._parser.should_upgrade() and (
            length not in (None, "0") or "transfer-encoding" in headers
        ):
            raise BadRequest(400, "Upgrade with a request body is not supported")
        expect = headers.get("expect")
        if (
            expect is not None
            and expect.lower() == "100-continue"
            and self._parser.get_http_version() == "1.1"
        ):
            self._on_expect_continue()

    def on_body(self, body: bytes) -> None:
        self._body_size += len(body)
        if self._body_size > self._max_body:
            raise BadRequest(413, f"request body over {self._max_body} bytes")
        self._body.append(body)

    def on_message_complete(self) -> None:
        self.in_message = self.in_body = False
        self._head_bytes = 0
        parser, parts = self._parser, self._body
        path, query = split_target(self._target)
        self._body = []
        self._on_request(
            Request(
                parser.get_method().decode("ascii"),
                path,
                query,
                self._headers,
                parts[0] if len(parts) == 1 else b"".join(parts),
                self._remote,
                parser.get_http_version(),
                parser.should_keep_alive(),
            )
        )


_REASONS: dict[int, bytes] = {status.value: status.phrase.encode() for status in HTTPStatus}
_STATUS_LINES: dict[int, bytes] = {}
# the transport frames every message itself, so callers' copies of these are dropped
FRAMING_FIELDS = frozenset({"content-length", "transfer-encoding", "connection", "keep-alive"})
_BODILESS_STATUSES = frozenset({204, 304})


def status_line(status: int) -> bytes:
    """`HTTP/1.1 200 OK\\r\\n` (cached); HTTP/1.1 is the reply version for 1.0 clients too."""
    line = _STATUS_LINES.get(status)
    if line is None:
        if not 100 <= status <= 999:
            raise ValueError(f"invalid HTTP status {status}")
        line = b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"Unknown"))
        _STATUS_LINES[status] = line
    return line


def _field(name: str, value: str) -> str:
    if "\r" in value or "\n" in value or "\r" in name or "\n" in name or ":" in name:
        raise ValueError(f"invalid header field {name!r}")  # header injection
    return f"{name}: {value}\r\n"


def response_head(
    status: int, headers: Mapping[str, str] | None, content_type: str | None, tail: bytes
) -> bytes:
    """Status line, `headers` (less framing fields), Content-Type unless `headers` has one,
    then `tail`: the framing and Connection lines the server chose."""
    lines = []
    for name, value in (headers or {}).items():
        lower = name.lower()
        if lower in FRAMING_FIELDS:
            continue
        if lower == "content-type":
            content_type = None  # the caller's own wins
        lines.append(_field(name, value))
    if content_type is not None:
        lines.append(_field("Content-Type", content_type))
    return status_line(status) + "".join(lines).encode("latin-1") + tail + b"\r\n"


def request_head(
    method: str, path: str, host: str, headers: Mapping[str, str], body_length: int
) -> bytes:
    """Request line and headers: Host unless given, Content-Length when there is a body or the
    method carries one; framing fields in `headers` are dropped."""
    if not path.startswith("/") or " " in path or "\r" in path or "\n" in path:
        raise ValueError(f"invalid request path {path!r}")
    lines = [f"{method} {path} HTTP/1.1\r\n"]
    for name, value in headers.items():
        lower = name.lower()
        if lower in FRAMING_FIELDS:
            continue
        if lower == "host":
            host = ""
        lines.append(_field(name, value))
    if host:
        lines.append(f"Host: {host}\r\n")
    if body_length or method in ("POST", "PUT", "PATCH"):
        lines.append(f"Content-Length: {body_length}\r\n")
    lines.append("\r\n")
    return "".join(lines).encode("latin-1")


def is_bodiless(status: int) -> bool:
    return status < 200 or status in _BODILESS_STATUSES


_ERROR_TYPES = {500: "internal_error", 503: "service_unavailable"}
_encode = msgspec.json.Encoder().encode


def error_body(status: int, message: str) -> bytes:
    """An OpenAI-shaped error document for errors the transport answers itself."""
    error = {
        "message": message,
        "type": _ERROR_TYPES.get(status, "invalid_request_error"),
        "param": None,
        "code": status,
    }
    return _encode({"error": error})


def set_nodelay(transport: asyncio.BaseTransport) -> None:
    """Small writes (one SSE frame) must leave at once, not wait for Nagle's timer."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
