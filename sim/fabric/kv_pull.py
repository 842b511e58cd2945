"""The decode side of a vLLM NixlConnector-style handoff, between simulated workers.

The destination counts its own prefix-cache hit, asks the source's side channel (plain HTTP on
the source worker, metadata only) what it holds, moves only the missing KV bytes over the
modelled link, and tells the source to free its blocks. Any failure of the source falls back to
a local prefill, which the response reports.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
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
    status: PullStatus
    preloaded_tokens: int = 0
    transferred_bytes: int = 0
    seconds: float = 0.0
    reason: str = ""

    def headers(self) -> dict[str, str]:
        headers = {
            "x-kv-transfer": self.status,
            "x-kv-transfer-bytes": str(self.transferred_bytes),
            "x-kv-transfer-ms": f"{self.seconds * 1000:.3f}",
        }
        if self.reason:
            headers["x-kv-transfer-reason"] = self.reason
        return headers


_decode_held = msgspec.json.Decoder(HeldInfo).decode


class KvPuller:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        fabric: FabricRunner,
        local_engine_id: str,
        kv_bytes_per_token: int,
    ) -> None:
        self._session = session
        self._fabric = fabric
        self._local = local_engine_id
        self._kv_bytes_per_token = kv_bytes_per_token
        self._releases: set[asyncio.Task[None]] = set()

    async def pull(
        self, params: dict[str, Any], prompt_tokens: int, local_hit_tokens: int
    ) -> PullResult:
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
        missing = max(0, preload - local_hit_tokens)
        nbytes = missing * self._kv_bytes_per_token
        self._ensure_nic(info.engine_id, info.nic_gbps)
        seconds = await self._fabric.transfer(info.engine_id, self._local, nbytes)
        task = asyncio.get_running_loop().create_task(self._release(base, str(remote_id)))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)
        return PullResult("pulled", preload, nbytes, seconds)

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
