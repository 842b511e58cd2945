"""The decode side of a vLLM NixlConnector handoff, between simulated workers.

The destination counts its own prefix-cache hit, asks the source's side channel (plain HTTP on
the source worker, metadata only) what it holds, moves the blocks it lacks over the modelled
link, and tells the source to free its blocks. NIXL reads whole KV blocks, so a pull moves
`ceil(tokens / block_size) - local blocks` blocks of `block_size * kv_bytes_per_token` bytes
(vLLM 0.32, observed: 1,107 tokens at 128 a block moved 9 blocks). Any failure of the source
falls back to a local prefill.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any, Literal

import aiohttp
import msgspec

from sim.worker.realtime import FabricRunner

log = logging.getLogger("sim.fabric.kv_pull")

PullStatus = Literal["pulled", "fallback"]
_SIDE_CHANNEL_TIMEOUT = aiohttp.ClientTimeout(total=5.0)


class HeldInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What the source's side channel reports about a finished prefill leg's held blocks."""

    engine_id: str
    num_tokens: int
    num_blocks: int
    nic_gbps: float


@dataclass(frozen=True, slots=True)
class PullResult:
    """What one decode leg's pull did. `transferred_bytes` 0 with "pulled": the destination
    held every block already, nothing crossed the link (and NIXL posts no transfer)."""

    status: PullStatus
    preloaded_tokens: int = 0
    transferred_bytes: int = 0
    seconds: float = 0.0
    post_seconds: float = 0.0
    descriptors: int = 0
    reason: str = ""

    @property
    def moved(self) -> bool:
        return self.status == "pulled" and self.transferred_bytes > 0


_decode_held = msgspec.json.Decoder(HeldInfo).decode


def remote_block_ids(params: dict[str, Any]) -> list[int] | None:
    """The source's block ids of the first KV group, from a prefill reply's
    `remote_block_ids`: a list per KV group (vLLM 0.32) or one flat list (older vLLM); None
    where absent. Raises ValueError on anything else."""
    value = params.get("remote_block_ids")
    if value is None:
        return None
    if not isinstance(value, list):
        raise ValueError("remote_block_ids must be a list")
    groups = value if value and all(isinstance(g, list) for g in value) else [value]
    for group in groups:
        if not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in group):
            raise ValueError("remote_block_ids must hold non-negative integer block ids")
    return list(groups[0]) if groups else []


def descriptor_count(block_ids: Sequence[int], num_layers: int) -> int:
    """NIXL descriptors for reading `block_ids`: one per run of consecutive blocks per layer
    (9 consecutive blocks of a 2-layer model made 2 in the capture)."""
    if not block_ids:
        return 0
    runs = 1 + sum(1 for a, b in pairwise(block_ids) if b != a + 1)
    return runs * num_layers


class KvPuller:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        fabric: FabricRunner,
        local_engine_id: str,
        kv_bytes_per_token: int,
        block_size: int,
        num_layers: int,
    ) -> None:
        self._session = session
        self._fabric = fabric
        self._local = local_engine_id
        self._block_bytes = block_size * kv_bytes_per_token
        self._block_size = block_size
        self._num_layers = num_layers
        self._releases: set[asyncio.Task[None]] = set()

    async def pull(
        self, params: dict[str, Any], prompt_tokens: int, local_hit_tokens: int
    ) -> PullResult:
        """Pull what a prefill reply's `params` offer; `local_hit_tokens` (whole blocks) are
        cached here already. `params` were checked with `remote_block_ids`."""
        host, port = params.get("remote_host"), params.get("remote_port")
        remote_id = params.get("remote_request_id")
        if not host or not port or not remote_id:
            return PullResult("fallback", reason="incomplete kv_transfer_params")
        base = f"http://{host}:{port}/kv"
        try:
            async with self._session.get(
                f"{base}/held/{remote_id}", timeout=_SIDE_CHANNEL_TIMEOUT
            ) as response:
                if response.status != 200:
                    return PullResult("fallback", reason=f"source answered {response.status}")
                info = _decode_held(await response.read())
        except (aiohttp.ClientError, TimeoutError, msgspec.DecodeError) as exc:
            return PullResult("fallback", reason=f"source unreachable: {type(exc).__name__}")
        preload = min(info.num_tokens, prompt_tokens)
        have = local_hit_tokens // self._block_size
        need = -(-preload // self._block_size)
        blocks = max(0, need - have)
        result = PullResult("pulled", preload)
        if blocks:
            ids = remote_block_ids(params) or []
            # without the source's ids (or too few of them) the blocks count as one run
            pulled = ids[have:need] if len(ids) >= need else range(blocks)
            nbytes = blocks * self._block_bytes
            self._ensure_nic(info.engine_id, info.nic_gbps)
            took = await self._fabric.transfer(info.engine_id, self._local, nbytes)
            result = PullResult(
                "pulled", preload, nbytes, took.seconds, took.post_seconds,
                descriptor_count(pulled, self._num_layers),
            )  # fmt: skip
        task = asyncio.get_running_loop().create_task(self._release(base, str(remote_id)))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)
        return result

    def _ensure_nic(self, engine_id: str, nic_gbps: float) -> None:
        # A source in another process is known only through its side channel: model its NIC
        # locally (congestion from that source's other destinations is then not seen).
        fabric = self._fabric.fabric
        if not fabric.has_nic(engine_id):
            rate = nic_gbps * 1e9 / 8
            fabric.add_nic(engine_id, egress_bps=rate, ingress_bps=rate)

    async def _release(self, base: str, remote_id: str) -> None:
        try:
            async with self._session.post(
                f"{base}/release/{remote_id}", timeout=_SIDE_CHANNEL_TIMEOUT
            ) as response:
                await response.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            # The source frees the blocks itself after its abort timeout.
            log.debug("release of %s failed: %s", remote_id, exc)
