"""A DNS server on a local UDP port for tests: A and AAAA records the test sets.

Answers from `records` (name -> addresses, IPv4 and IPv6 mixed); a name it does not know is
NXDOMAIN; `failing` makes it answer SERVFAIL. Built on dnspython's message codec.
"""

from __future__ import annotations

import asyncio
import ipaddress
from dataclasses import dataclass, field
from typing import cast

import dns.message
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset


class _Protocol(asyncio.DatagramProtocol):
    def __init__(self, server: FakeDns) -> None:
        self._server = server
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        assert self.transport is not None
        self.transport.sendto(self._server.answer(data), addr)


@dataclass
class FakeDns:
    records: dict[str, list[str]] = field(default_factory=dict)
    failing: bool = False
    queries: int = 0
    port: int = 0
    _transport: asyncio.DatagramTransport | None = None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_datagram_endpoint(
            lambda: _Protocol(self), local_addr=("127.0.0.1", 0)
        )
        self._transport = transport
        self.port = transport.get_extra_info("sockname")[1]

    def stop(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def answer(self, data: bytes) -> bytes:
        self.queries += 1
        query = dns.message.from_wire(data)
        response = dns.message.make_response(query)
        if self.failing:
            response.set_rcode(dns.rcode.SERVFAIL)
            return response.to_wire()
        for question in query.question:
            name = question.name.to_text().rstrip(".")
            if name not in self.records:
                response.set_rcode(dns.rcode.NXDOMAIN)
                continue
            version = 4 if question.rdtype == dns.rdatatype.A else 6
            found = [a for a in self.records[name] if ipaddress.ip_address(a).version == version]
            if found:
                rrset = dns.rrset.from_text_list(question.name, 5, dns.rdataclass.IN,
                                                 question.rdtype, found)  # fmt: skip
                response.answer.append(rrset)
        return response.to_wire()
