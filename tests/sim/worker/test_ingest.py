"""sim.worker.ingest: requests are parsed, tokenised and hashed on one thread, off the event
loop."""

from __future__ import annotations

import json
import threading

import pytest

from sim.engine.kvcache import extend_block_hashes
from sim.worker import ingest as ingest_module
from sim.worker.ingest import ingest, ingest_now
from sim.worker.protocol import OpenAIError, ParsedRequest, parse_request

BODY = json.dumps({
    "model": "m",
    "messages": [{"role": "user", "content": " ".join(f"w{i}" for i in range(1000))}],
    "max_tokens": 4,
}).encode()  # fmt: skip


def test_ingest_now_is_the_parse_plus_the_prompts_full_block_hashes() -> None:
    got = ingest_now(BODY, "chat", "m", 16)
    parsed = parse_request(BODY, "chat", "m")
    assert got.request == parsed
    expected: list[int] = []
    tokens = parsed.prompt_token_ids
    extend_block_hashes(tokens, expected, 16, len(tokens) // 16)
    assert got.block_hashes == expected and len(expected) == len(tokens) // 16 > 0


async def test_every_request_is_ingested_on_the_one_ingest_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    threads: set[str] = set()

    def parse_and_note(raw: bytes, kind: str, model: str) -> ParsedRequest:
        threads.add(threading.current_thread().name)
        return parse_request(raw, kind, model)  # type: ignore[arg-type]

    monkeypatch.setattr(ingest_module, "parse_request", parse_and_note)
    results = [await ingest(BODY, "chat", "m", 16) for _ in range(3)]
    assert [r.request for r in results] == [parse_request(BODY, "chat", "m")] * 3
    assert len(threads) == 1
    [name] = threads
    assert name.startswith("sim-ingest") and name != threading.current_thread().name


async def test_a_bad_request_fails_with_vllms_error() -> None:
    with pytest.raises(OpenAIError) as failure:
        await ingest(b"{not json", "chat", "m", 16)
    assert failure.value.status == 400


@pytest.mark.parametrize(
    ("extra", "priority"),
    [({}, 0), ({"priority": -3}, -3), ({"priority": 1700000002500}, 1700000002500)],
)
def test_the_requests_priority_is_read(extra: dict[str, int], priority: int) -> None:
    raw = json.dumps({"model": "m", "prompt": "hello", **extra}).encode()
    assert parse_request(raw, "completion", "m").priority == priority
