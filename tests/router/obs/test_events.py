from __future__ import annotations

import io
import threading
from pathlib import Path

import msgspec
import pytest

import router.obs.events
from policies.types import Outcome, Prediction
from router.obs.events import EventLog, StageClock, StageEvents


def make_events(i: int) -> StageEvents:
    base = 1_700_000_000.0 + i
    return StageEvents(
        request_id=f"req-{i}",
        session_id=f"sess-{i % 7}",
        policy="adaptive",
        action="handoff",
        prefill_worker="p0",
        decode_worker="d1",
        predicted=Prediction(interference_ms=12.5, exposed_transfer_ms=3.0, ttft_ms=250.0),
        admitted=base,
        decided=base + 0.001,
        prefill_start=base + 0.002,
        prefill_end=base + 0.25,
        transfer_start=base + 0.25,
        transfer_end=base + 0.28,
        first_token=base + 0.3,
        last_token=base + 1.5,
        done=base + 1.5,
        prompt_tokens=10_000 + i,
        cached_tokens=4096,
        completion_tokens=128,
        transferred_bytes=(10_000 + i - 4096) * 131072,
        outcome="completed",
        http_status=200,
        first_token_convention="decode",
        realised=Prediction(interference_ms=10.0, exposed_transfer_ms=4.0, ttft_ms=300.0),
    )


def test_stage_clock_reads_the_wall_clock_once() -> None:
    ticks = iter([100.0, 100.5, 101.25, 103.0])
    wall_calls = []

    def wall() -> float:
        wall_calls.append(1)
        return 1_700_000_000.0

    clock = StageClock(monotonic=lambda: next(ticks), wall=wall)
    # The offset was taken at monotonic 100.0 = wall 1_700_000_000.0.
    assert [clock.now(), clock.now(), clock.now()] == [
        1_700_000_000.5,
        1_700_000_001.25,
        1_700_000_003.0,
    ]
    assert len(wall_calls) == 1


def test_to_outcome_turns_timestamps_into_stage_durations() -> None:
    events = StageEvents(
        request_id="r",
        session_id="s",
        action="handoff",
        prefill_worker="p0",
        decode_worker="d0",
        predicted=Prediction(ttft_ms=300.0),
        admitted=1000.0,
        decided=1000.125,
        prefill_start=1000.25,
        prefill_end=1000.5,
        transfer_start=1000.5,
        transfer_end=1000.5625,
        first_token=1000.625,
        last_token=1002.625,
        prompt_tokens=100,
        cached_tokens=64,
        completion_tokens=20,
        transferred_bytes=4096,
        outcome="completed",
    )
    assert events.to_outcome() == Outcome(
        request_id="r",
        session_id="s",
        action="handoff",
        prefill_worker="p0",
        decode_worker="d0",
        prompt_tokens=100,
        cached_tokens=64,
        completion_tokens=20,
        ok=True,
        queue_ms=125.0,
        prefill_ms=250.0,
        transfer_ms=62.5,
        transfer_bytes=4096,
        ttft_ms=625.0,
        decode_ms=2000.0,
        predicted=Prediction(ttft_ms=300.0),
    )


def test_to_outcome_of_a_failed_colocated_turn() -> None:
    events = StageEvents(
        request_id="r",
        session_id="s",
        action="colocate",
        prefill_worker="w",
        decode_worker="w",
        admitted=5.0,
        prefill_start=5.5,
        outcome="error",
    )
    outcome = events.to_outcome()
    assert (outcome.ok, outcome.queue_ms, outcome.transfer_ms, outcome.ttft_ms) == (
        False,
        500.0,
        None,
        None,
    )
    with pytest.raises(ValueError, match="never placed"):
        StageEvents(request_id="x", session_id="s", outcome="rejected").to_outcome()


@pytest.mark.parametrize(
    ("ring_size", "recorded", "limit", "expected"),
    [
        (3, 5, None, ["req-4", "req-3", "req-2"]),
        (3, 5, 2, ["req-4", "req-3"]),
        (3, 2, None, ["req-1", "req-0"]),
        (3, 0, None, []),
        (1024, 1500, 1, ["req-1499"]),
    ],
)
def test_ring_is_bounded_and_newest_first(
    ring_size: int, recorded: int, limit: int | None, expected: list[str]
) -> None:
    log = EventLog(ring_size=ring_size)
    for i in range(recorded):
        log.record(make_events(i))
    assert [e.request_id for e in log.recent(limit)] == expected
    assert len(log.recent()) == min(ring_size, recorded)
    assert log.writer is None


async def test_file_gets_every_record_in_order(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    log = EventLog(ring_size=16, path=str(path), flush_interval_s=0.01, batch_size=64)
    originals = [make_events(i) for i in range(2000)]
    for events in originals:
        log.record(events)
    await log.close()
    lines = path.read_bytes().splitlines()
    assert [msgspec.json.decode(line, type=StageEvents) for line in lines] == originals
    assert (log.written, log.dropped, log.failed) == (2000, 0, 0)
    # After close the ring still works; the file is finished.
    log.record(make_events(9999))
    assert log.recent(1)[0].request_id == "req-9999"
    assert len(path.read_bytes().splitlines()) == 2000


async def test_close_flushes_what_the_writer_has_not_written_yet(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    log = EventLog(path=str(path), flush_interval_s=3600.0, batch_size=10_000)
    for i in range(10):
        log.record(make_events(i))
    assert log.written == 0
    await log.close()
    decoded = [msgspec.json.decode(x, type=StageEvents) for x in path.read_bytes().splitlines()]
    assert [e.request_id for e in decoded] == [f"req-{i}" for i in range(10)]


class StuckDisk(io.BytesIO):
    """A file whose writes block until released, noting which threads touch it."""

    def __init__(self, release: threading.Event) -> None:
        super().__init__()
        self.release = release
        self.threads: set[int] = {threading.get_ident()}
        self.contents = b""

    def write(self, data: object) -> int:
        self.threads.add(threading.get_ident())
        self.release.wait()
        assert isinstance(data, bytes | bytearray)
        return super().write(data)

    def close(self) -> None:
        self.threads.add(threading.get_ident())
        self.contents = self.getvalue()
        super().close()


async def test_record_never_touches_disk_in_the_calling_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    release = threading.Event()
    disks: list[StuckDisk] = []

    def open_stuck(path: str) -> StuckDisk:
        disks.append(StuckDisk(release))
        return disks[-1]

    monkeypatch.setattr(router.obs.events, "_open_for_append", open_stuck)
    log = EventLog(path="unused.jsonl", flush_interval_s=0.001, batch_size=100)
    # 10k records while the disk is stuck: record must neither block nor write.
    for i in range(10_000):
        log.record(make_events(i))
    assert log.written == 0
    release.set()
    await log.close()
    [disk] = disks
    assert threading.get_ident() not in disk.threads
    assert log.writer is not None and disk.threads == {log.writer.ident}
    lines = disk.contents.splitlines()
    assert len(lines) == 10_000
    assert msgspec.json.decode(lines[-1], type=StageEvents) == make_events(9999)


async def test_overflowing_pending_buffer_drops_oldest_and_counts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    release = threading.Event()
    disks: list[StuckDisk] = []

    def open_stuck(path: str) -> StuckDisk:
        disks.append(StuckDisk(release))
        return disks[-1]

    monkeypatch.setattr(router.obs.events, "_open_for_append", open_stuck)
    log = EventLog(path="unused.jsonl", flush_interval_s=3600.0, batch_size=10_000, max_pending=5)
    for i in range(8):
        log.record(make_events(i))
    assert log.dropped == 3
    release.set()
    await log.close()
    assert [
        msgspec.json.decode(x, type=StageEvents).request_id for x in disks[0].contents.splitlines()
    ] == ["req-3", "req-4", "req-5", "req-6", "req-7"]


async def test_unwritable_path_keeps_the_ring(tmp_path: Path) -> None:
    log = EventLog(path=str(tmp_path / "missing-dir" / "events.jsonl"))
    log.record(make_events(1))
    await log.close()
    assert [e.request_id for e in log.recent()] == ["req-1"]


def test_to_outcome_of_a_held_turn_keeps_the_hold_out_of_its_queue() -> None:
    events = StageEvents(
        request_id="r", session_id="s", action="colocate", decode_worker="m0",
        admitted=1000.0, decided=1000.125, released=1000.625, prefill_start=1000.75,
        first_token=1001.0, last_token=1001.5, prompt_tokens=100, completion_tokens=20,
        outcome="completed",
    )  # fmt: skip
    outcome = events.to_outcome()
    assert outcome.held_ms == 500.0
    assert outcome.queue_ms == 125.0  # released -> sent
    assert outcome.ttft_ms == 1000.0  # as the client saw it, hold included
