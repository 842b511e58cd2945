"""Case-insensitive HTTP header maps and the serialisation helpers shared by server and client."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from http import HTTPStatus
from typing import TypeVar, overload

import msgspec

_T = TypeVar("_T")


class Headers(Mapping[str, str]):
    """Received headers: names lowercased, repeated fields joined by ", " (as RFC 9110 allows)."""

    __slots__ = ("_map",)

    def __init__(self, fields: Mapping[str, str] | None = None) -> None:
        self._map: dict[str, str] = {}
        if fields:
            for name, value in fields.items():
                self.add(name.lower(), value)

    @classmethod
    def from_raw(cls, raw: list[tuple[bytes, bytes]]) -> Headers:
        """Build from the parser's (name, value) byte pairs; latin-1 keeps every byte."""
        headers = cls()
        known = headers._map
        for name_bytes, value_bytes in raw:
            name = name_bytes.decode("latin-1").lower()
            value = value_bytes.decode("latin-1")
            previous = known.get(name)
            known[name] = value if previous is None else f"{previous}, {value}"
        return headers

    def add(self, name: str, value: str) -> None:
        """Append one field; `name` must already be lowercase."""
        previous = self._map.get(name)
        self._map[name] = value if previous is None else f"{previous}, {value}"

    @overload
    def get(self, name: str, /) -> str | None: ...
    @overload
    def get(self, name: str, default: str, /) -> str: ...
    @overload
    def get(self, name: str, default: _T, /) -> str | _T: ...
    def get(self, name: str, default: object = None, /) -> object:
        return self._map.get(name.lower(), default)

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


_REASONS: dict[int, bytes] = {status.value: status.phrase.encode() for status in HTTPStatus}
_STATUS_LINES: dict[tuple[int, str], bytes] = {}
_ERROR_TYPES = {500: "internal_error"}
_encode = msgspec.json.Encoder().encode


def status_line(status: int, http_version: str = "1.1") -> bytes:
    """`HTTP/1.1 200 OK\\r\\n`, cached per (status, version)."""
    key = (status, http_version)
    line = _STATUS_LINES.get(key)
    if line is None:
        if not 100 <= status <= 999:
            raise ValueError(f"invalid HTTP status {status}")
        reason = _REASONS.get(status, b"Unknown")
        line = b"HTTP/%s %d %s\r\n" % (http_version.encode(), status, reason)
        _STATUS_LINES[key] = line
    return line


# the transport frames every message itself, so callers' copies of these are dropped
FRAMING_FIELDS = frozenset({"content-length", "transfer-encoding", "connection", "keep-alive"})


def encode_fields(headers: Mapping[str, str], skip: frozenset[str] = FRAMING_FIELDS) -> bytes:
    """`Name: value\\r\\n` lines, leaving out `skip` (lowercase names); refuses CR/LF in names
    or values (header injection)."""
    lines = []
    for name, value in headers.items():
        if name.lower() in skip:
            continue
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name or ":" in name:
            raise ValueError(f"invalid header field {name!r}")
        lines.append(f"{name}: {value}\r\n")
    return "".join(lines).encode("latin-1")


def error_body(status: int, message: str) -> bytes:
    """An OpenAI-shaped error document for errors raised by the transport itself."""
    return _encode(
        {
            "error": {
                "message": message,
                "type": _ERROR_TYPES.get(status, "invalid_request_error"),
                "param": None,
                "code": status,
            }
        }
    )
