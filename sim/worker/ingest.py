"""Request ingestion off the event loop: parse, tokenise and hash a prompt on one thread.

vLLM tokenises in its API server, apart from the engine core, so a long prompt's arrival does
not hold up the decode steps of the streams already running. Here every simulated worker of a
process shares one event loop: tokenising a 40k-token prompt on it (~17 ms) would delay every
stream's next token. So each request is parsed on the process's one ingest thread (one, because
the tokeniser's caches assume a single caller), which also computes the prompt's block hashes
the engine would otherwise compute on the loop when it schedules the prefill.
"""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from sim.engine.kvcache import extend_block_hashes
from sim.worker.protocol import Kind, ParsedRequest, parse_request


@dataclass(frozen=True, slots=True)
class Ingested:
    request: ParsedRequest
    block_hashes: list[int]  # of the prompt's full blocks


def ingest_now(raw: bytes, kind: Kind, served_model: str, block_size: int) -> Ingested:
    """Parse and hash on the calling thread (raises OpenAIError for a bad request)."""
    request = parse_request(raw, kind, served_model)
    tokens = request.prompt_token_ids
    hashes: list[int] = []
    extend_block_hashes(tokens, hashes, block_size, len(tokens) // block_size)
    return Ingested(request, hashes)


async def ingest(raw: bytes, kind: Kind, served_model: str, block_size: int) -> Ingested:
    """`ingest_now` on the process's ingest thread."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_executor(), ingest_now, raw, kind, served_model, block_size)


_shared: tuple[int, ThreadPoolExecutor] | None = None


def _executor() -> ThreadPoolExecutor:
    """The process's one ingest thread (again in a forked child, which inherits the object
    but not the thread)."""
    global _shared
    if _shared is None or _shared[0] != os.getpid():
        _shared = (os.getpid(), ThreadPoolExecutor(1, thread_name_prefix="sim-ingest"))
    return _shared[1]
