"""A turn's plan: the legs a decision becomes and the KV they move, computed once.

The live router (`router.turn.execute`) and the discrete-event simulator (`bench.des.router`)
both carry out a `Plan`, never the decision itself, so the two cannot drift apart on which
worker runs which leg, which link a turn reserves, or how many bytes it moves. Every KV size in
bytes comes from `kv_bytes`.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from policies.types import (
    Action,
    Colocate,
    Decision,
    Handoff,
    Migrate,
    Recompute,
    Reject,
    Residency,
    action_of,
)

TransferKind = Literal["handoff", "migration"]


class Transfer(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The KV a two-leg plan moves from its first leg's worker to its second's, and the class
    of link reservation it takes: a handoff is latency-critical and always admitted, a
    migration only where the link has room."""

    kind: TransferKind
    source: str
    destination: str
    tokens: int
    bytes: int


class Plan(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a decision becomes.

    `answering_worker` runs the leg whose tokens reach the client (None only for a reject);
    `prefill_worker` runs a first leg that prefills and hands its KV over (None for one leg).
    `recomputed_tokens`: the session's context the turn prefills again by choice. A migration
    the link refuses runs whole on its source instead (`refused_link_worker`).
    """

    action: Action
    answering_worker: str | None
    prefill_worker: str | None = None
    transfer: Transfer | None = None
    recomputed_tokens: int = 0
    refused_link_worker: str | None = None

    @property
    def legs(self) -> int:
        return 0 if self.answering_worker is None else 1 if self.prefill_worker is None else 2


def kv_bytes(tokens: int, kv_bytes_per_token: int) -> int:
    """The KV cache bytes of `tokens` tokens: the one formula for bytes moved and resident."""
    return tokens * kv_bytes_per_token


def tokens_to_move(prompt_tokens: int, residency: Residency | None, destination: str) -> int:
    """The prompt tokens a handoff to `destination` moves there: past the session's context
    where it is resident (at least the turn's own token), else all of them."""
    if residency is None or residency.worker_id != destination:
        return prompt_tokens
    return prompt_tokens - residency.tokens if prompt_tokens > residency.tokens else 1


def plan_turn(
    decision: Decision, prompt_tokens: int, residency: Residency | None, kv_bytes_per_token: int
) -> Plan:
    """The plan of `decision` for a turn of `prompt_tokens` whose session is at `residency`."""
    action = action_of(decision)
    if isinstance(decision, Reject):
        return Plan(action, None)
    if isinstance(decision, Colocate):
        return Plan(action, decision.worker)
    if isinstance(decision, Recompute):
        recomputed = residency.tokens if residency is not None else 0
        return Plan(action, decision.worker, recomputed_tokens=recomputed)
    if isinstance(decision, Handoff):
        tokens = tokens_to_move(prompt_tokens, residency, decision.decode_worker)
        transfer = Transfer("handoff", decision.prefill_worker, decision.decode_worker, tokens,
                            kv_bytes(tokens, kv_bytes_per_token))  # fmt: skip
        return Plan(action, decision.decode_worker, decision.prefill_worker, transfer)
    assert isinstance(decision, Migrate)
    tokens = residency.tokens if residency is not None else 0
    nbytes = residency.bytes if residency is not None else 0
    transfer = Transfer("migration", decision.source, decision.destination, tokens, nbytes)
    return Plan(action, decision.destination, decision.source, transfer,
                refused_link_worker=decision.source)  # fmt: skip
