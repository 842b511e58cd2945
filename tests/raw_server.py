"""A bare asyncio TCP server on 127.0.0.1 for tests that script a worker byte by byte."""

from __future__ import annotations

import asyncio


def chunk(data: bytes) -> bytes:
    """`data` as one HTTP/1.1 chunk of a chunked body."""
    return b"%x\r\n%b\r\n" % (len(data), data)


class RawServer:
    """Serves each connection with `_serve`; `stop` closes every connection it accepted."""

    def __init__(self) -> None:
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)

    async def stop(self) -> None:
        for writer in self._writers:
            writer.close()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.append(writer)
        await self._serve(reader, writer)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError
