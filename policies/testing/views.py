"""Hand-built views for the adaptive policy's tests."""

from __future__ import annotations

import msgspec

from policies import Role, WorkerView

KV = 131072  # bytes of KV per token (llama-3.1-8b, bf16)


def w(worker_id: str, role: Role = "mixed", **fields: object) -> WorkerView:
    """A healthy worker; `fields` sets any other WorkerView field."""
    return msgspec.convert(
        {"worker_id": worker_id, "role": role, "healthy": True, **fields}, WorkerView
    )
