"""Loaders for public trace formats, one module each, chosen by a file's content.

Each module offers `sniff(head: bytes) -> bool` (looks at the first bytes only) and a
`load_<format>(path, ...) -> Trace` with keyword options; `bench.traces.model.load_trace` tries the
native format first, then `FORMATS` in order.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from bench.traces.loaders import azure, burstgpt, mooncake, sharegpt
from bench.traces.model import Trace

Sniffer = Callable[[bytes], bool]
Loader = Callable[[Path], Trace]

FORMATS: tuple[tuple[str, Sniffer, Loader], ...] = (
    ("mooncake", mooncake.sniff, mooncake.load_mooncake),
    ("azure", azure.sniff, azure.load_azure),
    ("burstgpt", burstgpt.sniff, burstgpt.load_burstgpt),
    ("sharegpt", sharegpt.sniff, sharegpt.load_sharegpt),
)


def detect_format(head: bytes) -> str | None:
    """The name of the first foreign format whose sniffer accepts `head`, else None."""
    for name, sniff, _ in FORMATS:
        if sniff(head):
            return name
    return None


def load_foreign(path: Path, head: bytes) -> Trace:
    for _, sniff, load in FORMATS:
        if sniff(head):
            return load(path)
    tried = ", ".join(["native", *(name for name, _, _ in FORMATS)])
    raise ValueError(f"{path}: unrecognised trace format (tried {tried})")
