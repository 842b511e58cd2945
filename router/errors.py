"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the right status."""

from __future__ import annotations

import math

import msgspec

from router.http import Response

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "upstream_timeout",
}
_encode = msgspec.json.Encoder().encode


def error_payload(status: int, message: str, param: str | None = None) -> bytes:
    return _encode(
        {
            "error": {
                "message": message,
                "type": _TYPES.get(status, "invalid_request_error"),
                "param": param,
                "code": status,
            }
        }
    )


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    retry_after_s: float | None = None,
    headers: dict[str, str] | None = None,
) -> Response:
    all_headers = dict(headers or {})
    if retry_after_s is not None:
        all_headers["Retry-After"] = str(max(1, math.ceil(retry_after_s)))
    return Response(status, error_payload(status, message, param), all_headers)


def stream_error_frames(status: int, message: str) -> bytes:
    """What a client gets when a stream fails after status 200 was committed."""
    return b"data: " + error_payload(status, message) + b"\n\ndata: [DONE]\n\n"


class RouterError(Exception):
    """Raised inside the router for a failure with a client-facing status."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s

    def response(self, headers: dict[str, str] | None = None) -> Response:
        return error_response(self.status, self.message, self.param, self.retry_after_s, headers)
