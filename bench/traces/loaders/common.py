"""Helpers the format sniffers share: they look at a file's first bytes, never its name."""

from __future__ import annotations

_BOM = b"\xef\xbb\xbf"


def first_line(head: bytes) -> bytes:
    """The first non-blank line of `head`, without a UTF-8 BOM or surrounding whitespace."""
    text = head[len(_BOM) :] if head.startswith(_BOM) else head
    for line in text.split(b"\n"):
        stripped = line.strip()
        if stripped:
            return stripped
    return b""


def csv_columns(head: bytes) -> list[str]:
    """The header line's column names, stripped and lower-cased (no quoting support needed)."""
    line = first_line(head).decode("utf-8", errors="replace")
    return [name.strip().strip('"').lower() for name in line.split(",")]


def unique_id(candidate: str, taken: set[str]) -> str:
    """`candidate`, or `candidate#n` with the smallest n that is not yet taken; records it."""
    result = candidate
    n = 1
    while result in taken:
        result = f"{candidate}#{n}"
        n += 1
    taken.add(result)
    return result
