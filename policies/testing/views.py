"""Hand-built workers, cluster views and turns, for tests that place one turn on purpose."""

from __future__ import annotations

import msgspec

from policies.types import ClusterView, LinkView, Objectives, Residency, Role, Turn, WorkerView

KV = 131072  # bytes of KV per token (llama-3.1-8b, bf16)


def w(worker_id: str, role: Role = "mixed", **fields: object) -> WorkerView:
    """A healthy worker; `fields` sets any other WorkerView field."""
    return msgspec.convert(
        {"worker_id": worker_id, "role": role, "healthy": True, **fields}, WorkerView
    )


def view(
    *workers: WorkerView,
    resident: str | None = None,
    tokens: int = 4000,
    links: tuple[LinkView, ...] = (),
    now_s: float = 0.0,
) -> ClusterView:
    """A view of `workers` (and `links`) at `now_s`; with `resident`, the session's state
    lives on that worker: `tokens` tokens of `KV` bytes each, epoch 1."""
    residency = None
    if resident is not None:
        residency = Residency(worker_id=resident, tokens=tokens, bytes=tokens * KV, epoch=1)
    return ClusterView(now_s=now_s, workers=workers, links=links, residency=residency)


def turn(
    prompt: int = 2000,
    uncached: int | None = None,
    *,
    session: str = "s1",
    request: str = "r1",
    max_tokens: int = 128,
    ttft_ms: float = 1000.0,
    itl_ms: float = 50.0,
    arrival_s: float = 0.0,
) -> Turn:
    """A turn of `prompt` context tokens, `uncached` of them not resident anywhere (all of
    them, as for a session's first turn, when None)."""
    return Turn(
        session_id=session,
        request_id=request,
        prompt_tokens=prompt,
        uncached_tokens=prompt if uncached is None else uncached,
        max_tokens=max_tokens,
        objectives=Objectives(ttft_ms=ttft_ms, itl_ms=itl_ms),
        arrival_s=arrival_s,
    )
