"""A headless Service's DNS records: every A and AAAA record is a worker, at `discovery_port`.

Resolved every `discovery_interval_s` (and on SIGHUP) with dnspython's asyncio resolver, from
/etc/resolv.conf (its search domains too) or a given server. A name that does not exist, or
has no records, is an empty fleet; a resolution that fails (timeout, server failure) changes
nothing: the last set stays. A worker's id is its `host:port`, as a static worker's is.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging

import dns.asyncresolver
import dns.exception
import dns.resolver

from router.config import ConfigError, WorkerSpec
from router.fleet.discovery.source import OnWorkers, WorkerDefaults

log = logging.getLogger("router.fleet.discovery.dns")


def parse_server(server: str) -> tuple[str, int]:
    """`host`, `host:port`, `[v6]:port` or a bare IPv6 address -> (address, port)."""
    text = server.strip()
    port = 53
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        if rest:
            port = _port(rest.removeprefix(":"), server)
    elif text.count(":") == 1:
        host, _, raw_port = text.partition(":")
        port = _port(raw_port, server)
    else:
        host = text
    try:
        ipaddress.ip_address(host)
    except ValueError as exc:
        raise ConfigError(f"discovery_dns_server {server!r}: want an IP address[:port]") from exc
    return host, port


def _port(raw: str, server: str) -> int:
    if not raw.isdigit() or not 0 < int(raw) < 65536:
        raise ConfigError(f"discovery_dns_server {server!r}: bad port")
    return int(raw)


class DnsSource:
    name = "dns"

    def __init__(
        self,
        dns_name: str,
        defaults: WorkerDefaults,
        interval_s: float,
        server: str | None = None,
        timeout_s: float = 2.0,
    ) -> None:
        self.dns_name = dns_name
        self._defaults = defaults
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        if server is None:
            self._resolver = dns.asyncresolver.Resolver()  # /etc/resolv.conf
            self._search = True
        else:
            host, port = parse_server(server)
            self._resolver = dns.asyncresolver.Resolver(configure=False)
            self._resolver.nameservers = [host]
            self._resolver.port = port
            self._search = False
        self._wake = asyncio.Event()

    def reload(self) -> None:
        self._wake.set()

    async def run(self, on_workers: OnWorkers) -> None:
        last: tuple[WorkerSpec, ...] | None = None
        while True:
            self._wake.clear()
            try:
                addresses = await self.resolve()
            except dns.exception.DNSException as exc:
                log.warning("DNS %s failed, workers kept: %s", self.dns_name, exc)
            else:
                workers = tuple(self._spec(address) for address in addresses)
                if workers != last:
                    log.info("DNS %s: %d workers", self.dns_name, len(workers))
                    last = workers
                    on_workers(workers)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._interval_s):
                    await self._wake.wait()

    async def resolve(self) -> list[str]:
        """Every A and AAAA address of the name, sorted; DNSException where either query
        failed (a name without records of a type is no failure)."""
        answers = await asyncio.gather(self._query("A"), self._query("AAAA"))
        return sorted({address for answer in answers for address in answer})

    async def _query(self, rdtype: str) -> list[str]:
        try:
            answer = await self._resolver.resolve(
                self.dns_name, rdtype, search=self._search, lifetime=self._timeout_s
            )
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            return []
        return [record.to_text() for record in answer]

    def _spec(self, address: str) -> WorkerSpec:
        defaults = self._defaults
        return WorkerSpec(url=defaults.url(address), role=defaults.role, engine=defaults.engine)
