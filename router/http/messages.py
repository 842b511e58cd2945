"""A parsed request and an ordinary reply: frozen messages, in a module of their own because
the compiled HTTP modules (`router.native`) cannot define msgspec Structs (mypyc drops their
class options)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from router.http.headers import Headers


class Request(msgspec.Struct, frozen=True):
    """One parsed request, body included."""

    method: str
    path: str  # percent-decoded, without the query
    query: dict[str, str]
    headers: Headers
    body: bytes
    remote: str | None
    http_version: str  # "1.1" / "1.0"
    keep_alive: bool = True  # what the client asked for (version and Connection header)


class Response(msgspec.Struct, frozen=True):
    """An ordinary (non-streamed) reply; sent with Content-Length."""

    status: int = 200
    body: bytes = b""
    headers: Mapping[str, str] | None = None
    content_type: str | None = "application/json"
