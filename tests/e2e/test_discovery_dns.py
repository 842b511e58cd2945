"""DNS discovery in a real router process: a headless Service's records (a DNS server on a
local UDP port in this test) are its workers, all at one port on two loopback addresses;
SIGHUP resolves again at once (the re-resolution period here is an hour)."""

from __future__ import annotations

import asyncio
import signal
from typing import Any

import aiohttp

from bench.stack.up import free_port_block
from tests.e2e.conftest import StartRouter
from tests.e2e.helpers import chat
from tests.fake_dns import FakeDns
from tests.procs import Process

NAME = "vllm.ns.svc.cluster.local"


async def workers(http: aiohttp.ClientSession, url: str, token: str) -> dict[str, Any]:
    async with http.get(url + "/admin/workers",
                        headers={"Authorization": f"Bearer {token}"}) as response:  # fmt: skip
        return {w["id"]: w for w in (await response.json())["workers"]}


async def test_records_are_workers_and_sighup_resolves_again(start_router: StartRouter) -> None:
    port = free_port_block("127.0.0.1", 1)
    hosts = ("127.0.0.1", "127.0.0.2")
    sims = [Process(["sim-worker", "--host", host, "--port", str(port), "--noise", "0"])
            for host in hosts]  # fmt: skip
    dns = FakeDns(records={NAME: ["127.0.0.1"]})
    await dns.start()
    try:
        for host, sim in zip(hosts, sims, strict=True):
            sim.wait_healthy([f"http://{host}:{port}"])
        router = await asyncio.to_thread(
            start_router, "--discovery", "dns", "--discovery-dns-name", NAME,
            "--discovery-dns-server", f"127.0.0.1:{dns.port}", "--discovery-port", str(port),
            "--discovery-interval-s", "3600", "--departure-grace-s", "0",
        )  # fmt: skip
        async with aiohttp.ClientSession() as http:
            assert set(await workers(http, router.url, router.admin_token)) == {
                f"127.0.0.1:{port}"}  # fmt: skip
            dns.records[NAME] = ["127.0.0.2"]
            router.process.popen.send_signal(signal.SIGHUP)
            async with asyncio.timeout(10):
                while True:
                    found = set(await workers(http, router.url, router.admin_token))
                    if found == {f"127.0.0.2:{port}"}:  # the old one drained, forgotten
                        break
                    await asyncio.sleep(0.05)
            _, usage, response = await chat(http, router.url,
                                            [{"role": "user", "content": "hi"}])  # fmt: skip
            assert response.status == 200 and usage["completion_tokens"] == 8
        assert router.process.popen.poll() is None  # SIGHUP did not end it
    finally:
        dns.stop()
        for sim in sims:
            sim.stop()
