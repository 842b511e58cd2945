"""The router's HTTP/1.1 data path: a lean server for clients and a pooled client for workers,
both asyncio protocols over httptools."""

from router.native import activate as _activate

_activate(__path__, __name__)  # before the imports below: they load the compiled modules

from router.http.client import (
    UpstreamBodyError,
    UpstreamConnectError,
    UpstreamError,
    UpstreamPool,
    UpstreamResponse,
    UpstreamTimeout,
)
from router.http.headers import Headers
from router.http.messages import Request, Response
from router.http.server import Handler, HttpServer
from router.http.stream import StreamWriter

__all__ = [
    "Handler",
    "Headers",
    "HttpServer",
    "Request",
    "Response",
    "StreamWriter",
    "UpstreamBodyError",
    "UpstreamConnectError",
    "UpstreamError",
    "UpstreamPool",
    "UpstreamResponse",
    "UpstreamTimeout",
]
