from __future__ import annotations

import json
import random
import shutil
from collections import Counter
from pathlib import Path

import pytest

from bench.traces.loaders import detect_format
from bench.traces.loaders.azure import load_azure, parse_timestamp_ns
from bench.traces.loaders.burstgpt import load_burstgpt
from bench.traces.loaders.mooncake import (
    MooncakeRecord,
    read_records,
    rebuild_sessions,
    shared_system_prefix,
)
from bench.traces.loaders.sharegpt import load_sharegpt
from bench.traces.model import Trace, load_trace

# the shared traces lie beside the checkout (../shared/traces), in CI as here
SHARED = Path(__file__).resolve().parents[4] / "shared" / "traces"
MOONCAKE = SHARED / "mooncake_synthetic_trace.jsonl"
AZURE_CONV = SHARED / "azure2023_AzureLLMInferenceTrace_conv.csv"
AZURE_CODE = SHARED / "azure2023_AzureLLMInferenceTrace_code.csv"
needs_shared = pytest.mark.skipif(not MOONCAKE.exists(), reason="shared traces not mounted")


def _turns_histogram(trace: Trace) -> dict[int, int]:
    return dict(Counter(len(c.turns) for c in trace.conversations))


# ---- the shared public traces --------------------------------------------------------------


@needs_shared
def test_mooncake_shared_file() -> None:
    trace = load_trace(MOONCAKE)
    assert trace.num_turns == 3993
    assert trace.source == "mooncake:mooncake_synthetic_trace.jsonl"
    assert trace.duration_s == 1022.025
    # No request strictly extends another's block list: all sessions are single-turn.
    assert len(trace.conversations) == 3993
    assert _turns_histogram(trace) == {1: 3993}
    records = read_records(MOONCAKE)
    assert shared_system_prefix([r.hash_ids for r in records]) == ()
    assert all(c.system_prefix_tokens == 0 for c in trace.conversations)
    first = trace.conversations[0].turns[0]
    assert (first.arrival_s, first.new_input_tokens, first.output_tokens) == (0.0, 40160, 6)
    assert first.prefix_blocks == tuple(range(79))
    # input_length covers every block of hash_ids, shared ones included.
    assert all(-(-r.input_length // 512) == len(r.hash_ids) for r in records)


@needs_shared
@pytest.mark.parametrize(
    ("path", "rows", "duration_s", "last"),
    [
        (AZURE_CONV, 19366, 3501.721937, (197, 183)),
        (AZURE_CODE, 8819, 3435.948056, (549, 173)),
    ],
)
def test_azure_shared_files(
    path: Path, rows: int, duration_s: float, last: tuple[int, int]
) -> None:
    trace = load_trace(path)
    assert trace.num_turns == rows == len(trace.conversations)
    assert trace.duration_s == duration_s
    turns = [c.turns[0] for c in trace.conversations]
    assert turns[0].arrival_s == 0.0
    assert turns[-1].arrival_s == duration_s
    assert (turns[-1].new_input_tokens, turns[-1].output_tokens) == last
    assert trace.conversations[-1].session_id == f"azure-{rows - 1}"


@needs_shared
def test_azure_second_row_offset_is_exact() -> None:
    trace = load_trace(AZURE_CONV)
    second = trace.conversations[1].turns[0]
    # 18:15:50.9951690 - 18:15:46.6805900
    assert second.arrival_s == 4.314579
    assert (second.new_input_tokens, second.output_tokens) == (396, 109)


@needs_shared
def test_detection_ignores_extension(tmp_path: Path) -> None:
    disguised = tmp_path / "mooncake.csv"
    shutil.copy(MOONCAKE, disguised)
    assert load_trace(disguised).source == "mooncake:mooncake.csv"
    disguised = tmp_path / "azure.jsonl"
    shutil.copy(AZURE_CODE, disguised)
    assert load_trace(disguised).num_turns == 8819


@pytest.mark.parametrize(
    ("head", "expected"),
    [
        (b'{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n', "mooncake"),
        (b"\xef\xbb\xbfTIMESTAMP,ContextTokens,GeneratedTokens\r\n2023-11-16 1", "azure"),
        (b"Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n", "burstgpt"),
        (b'  [{"id": "a", "conversations": []}]', "sharegpt"),
        (b'{"id": "a", "conversations": []}\n', "sharegpt"),
        (b"[1, 2, 3]", None),
        (b"TIMESTAMP,ContextTokens\n", None),
        (b"", None),
    ],
)
def test_detect_format(head: bytes, expected: str | None) -> None:
    assert detect_format(head) == expected


# ---- Mooncake session rebuilding ------------------------------------------------------------


def _rec(ts: float, length: int, out: int, blocks: list[int]) -> MooncakeRecord:
    return MooncakeRecord(ts, length, out, tuple(blocks))


def test_mooncake_rebuilds_turns_past_a_system_prefix() -> None:
    records = [
        _rec(0, 1500, 100, [0, 1, 2]),  # A turn 0 (system block 0)
        _rec(1000, 1400, 50, [0, 5, 6]),  # B turn 0: shares only the system prefix
        _rec(2000, 2600, 20, [0, 1, 2, 3, 4]),  # A turn 1
        _rec(3000, 2000, 10, [0, 1, 2, 9]),  # extends A turn 0, which is no longer latest
        _rec(4000, 1400, 5, [0, 5, 6]),  # identical to B turn 0: not a proper prefix
        _rec(5000, 2600, 7, [0, 1, 2, 3, 4, 8]),  # A turn 2; history larger than its input
        _rec(6000, 300, 3, [7]),  # no system prefix
        _rec(7000, 600, 1, [0, 10]),  # these two keep block 1 under half of all requests
        _rec(8000, 600, 1, [0, 11]),
    ]
    # Given out of order: rebuilding sorts by timestamp.
    conversations = rebuild_sessions(list(reversed(records)), block_tokens=512)
    assert [c.session_id for c in conversations] == [f"mooncake-{i}" for i in range(7)]
    shape = [
        [(t.arrival_s, t.new_input_tokens, t.output_tokens) for t in c.turns] for c in conversations
    ]
    assert shape == [
        [(0.0, 1500 - 512, 100), (2.0, 2600 - 1600, 20), (5.0, 0, 7)],
        [(1.0, 1400 - 512, 50)],
        [(3.0, 2000 - 512, 10)],
        [(4.0, 1400 - 512, 5)],
        [(6.0, 300, 3)],
        [(7.0, 600 - 512, 1)],
        [(8.0, 600 - 512, 1)],
    ]
    assert [c.system_prefix_tokens for c in conversations] == [512, 512, 512, 512, 0, 512, 512]
    assert conversations[0].turns[2].prefix_blocks == (0, 1, 2, 3, 4, 8)


def test_mooncake_system_prefix_alone_does_not_join_sessions() -> None:
    # Request 1's list [0, 1] is exactly the shared prefix: others must not continue it.
    records = [_rec(0, 1024, 1, [0, 1]), _rec(1, 1500, 1, [0, 1, 2]), _rec(2, 1500, 1, [0, 1, 3])]
    assert shared_system_prefix([r.hash_ids for r in records]) == (0, 1)
    assert [len(c.turns) for c in rebuild_sessions(records)] == [1, 1, 1]


@pytest.mark.parametrize(
    ("lists", "share", "expected"),
    [
        ([(0, 1, 2), (0, 1, 3), (0, 4), (5,)], 0.5, (0,)),
        ([(0, 1, 2), (0, 1, 3), (0, 1), (5,)], 0.5, (0, 1)),
        ([(0, 1, 2), (0, 1, 3), (0, 4), (5,)], 0.75, ()),
        ([(0, 1), (0, 1), (2, 3), (2, 3)], 0.5, ()),
        ([], 0.5, ()),
    ],
)
def test_shared_system_prefix(
    lists: list[tuple[int, ...]], share: float, expected: tuple[int, ...]
) -> None:
    assert shared_system_prefix(lists, share) == expected


def test_mooncake_loader_reads_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    rows = [
        {"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [1, 2]},
        {"timestamp": 250, "input_length": 1300, "output_length": 9, "hash_ids": [1, 2, 3]},
        {"timestamp": 300, "input_length": 10, "output_length": 1, "hash_ids": [4]},
        {"timestamp": 400, "input_length": 10, "output_length": 1, "hash_ids": [5]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    trace = load_trace(path)
    assert _turns_histogram(trace) == {2: 1, 1: 2}
    turns = trace.conversations[0].turns
    assert [(t.arrival_s, t.new_input_tokens) for t in turns] == [(0.0, 600), (0.25, 696)]


# ---- Azure ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "ns_after_midnight"),
    [
        ("2023-11-16 18:15:46.6805900", 65746_680590000),
        ("2023-11-16T00:00:00", 0),
        ("2023-11-16 00:00:01.5", 1_500_000_000),
        ("2023-11-16 00:00:00.000000001", 1),
    ],
)
def test_parse_timestamp_ns(text: str, ns_after_midnight: int) -> None:
    midnight = parse_timestamp_ns("2023-11-16 00:00:00")
    assert parse_timestamp_ns(text) - midnight == ns_after_midnight


@pytest.mark.parametrize(
    "text",
    ["2023-11-16", "2023-11-16 1:2", "2023-11-16 aa:bb:cc", "2023-11-16 00:00:00.1234567890"],
)
def test_parse_timestamp_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_timestamp_ns(text)


def test_azure_day_rollover_and_unsorted_rows(tmp_path: Path) -> None:
    path = tmp_path / "a.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\r\n"
        "2023-11-16 23:59:59.9000000,10,2\r\n"
        "2023-11-17 00:00:00.1500000,20,3\r\n"
        "2023-11-16 23:59:59.8000000,30,4\r\n"
    )
    trace = load_azure(path)
    assert [(c.session_id, c.turns[0].arrival_s) for c in trace.conversations] == [
        ("azure-2", 0.0),
        ("azure-0", 0.1),
        ("azure-1", 0.35),
    ]


# ---- BurstGPT -------------------------------------------------------------------------------

_BURST = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"


def test_burstgpt_single_turn_rows(tmp_path: Path) -> None:
    path = tmp_path / "b.csv"
    path.write_text(
        _BURST
        + "5,ChatGPT,472,18,490,Conversation log\n"
        + "45,ChatGPT,1087,0,1087,Conversation log\n"
        + "110.5,GPT-4,417,505,922,API log\n"
    )
    trace = load_trace(path)
    assert [
        (c.session_id, t.arrival_s, t.new_input_tokens, t.output_tokens, t.klass)
        for c in trace.conversations
        for t in c.turns
    ] == [
        ("burstgpt-0", 0.0, 472, 18, "ChatGPT/Conversation log"),
        ("burstgpt-2", 105.5, 417, 505, "GPT-4/API log"),
    ]
    assert load_burstgpt(path, include_failed=True).num_turns == 3


def test_burstgpt_sessions(tmp_path: Path) -> None:
    path = tmp_path / "b.csv"
    path.write_text(
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type,Session ID\n"
        "10,ChatGPT,100,20,120,Conversation log,s1\n"
        "11,ChatGPT,50,5,55,Conversation log,s2\n"
        "30,ChatGPT,200,40,240,Conversation log,s1\n"
        "40,ChatGPT,100,40,140,Conversation log,s1\n"
        "41,ChatGPT,7,1,8,API log,\n"
    )
    trace = load_burstgpt(path)
    shape = {
        c.session_id: [(t.arrival_s, t.new_input_tokens, t.output_tokens) for t in c.turns]
        for c in trace.conversations
    }
    assert shape == {
        "burstgpt-session-s1": [(0.0, 100, 20), (20.0, 80, 40), (30.0, 0, 40)],
        "burstgpt-session-s2": [(1.0, 50, 5)],
        "burstgpt-4": [(31.0, 7, 1)],
    }
    raw = load_burstgpt(path, request_includes_history=False)
    assert [t.new_input_tokens for t in raw.conversations[0].turns] == [100, 200, 100]


def test_burstgpt_missing_columns(tmp_path: Path) -> None:
    path = tmp_path / "b.csv"
    path.write_text("Timestamp,Model\n1,x\n")
    with pytest.raises(ValueError, match="missing columns"):
        load_burstgpt(path)


# ---- ShareGPT -------------------------------------------------------------------------------

_SHAREGPT = [
    {
        "id": "x",
        "conversations": [
            {"from": "system", "value": "be brief"},
            {"from": "human", "value": "hello there"},
            {"from": "gpt", "value": "hi how are you"},
            {"from": "human", "value": "fine"},
            {"from": "human", "value": "and you ?"},
            {"from": "gpt", "value": "good"},
            {"from": "gpt", "value": "very good indeed"},
            {"from": "human", "value": "unanswered"},
        ],
    },
    {"id": "empty", "conversations": [{"from": "gpt", "value": "orphan answer"}]},
    {"id": "x", "conversations": [{"from": "user", "value": ""}, {"from": "chatgpt"}]},
    {"conversations": [{"from": "human", "value": "a b c"}, {"from": "bard", "value": "d"}]},
]


@pytest.mark.parametrize("jsonl", [False, True])
def test_sharegpt(tmp_path: Path, jsonl: bool) -> None:
    path = tmp_path / "s.json"
    if jsonl:
        path.write_text("".join(json.dumps(e) + "\n" for e in _SHAREGPT))
    else:
        path.write_text(json.dumps(_SHAREGPT, indent=1))
    trace = load_trace(path)
    shape = [
        (
            c.session_id,
            c.system_prefix_tokens,
            [(t.new_input_tokens, t.output_tokens) for t in c.turns],
        )
        for c in trace.conversations
    ]
    assert shape == [
        ("x", 2, [(2, 4), (4, 4)]),
        ("x#1", 0, [(1, 1)]),
        ("sharegpt-3", 0, [(3, 1)]),
    ]
    rng = random.Random(0)
    starts = []
    now = 0.0
    for _ in range(3):
        now += rng.expovariate(1.0)
        starts.append(now)
    assert [[t.arrival_s for t in c.turns] for c in trace.conversations] == [
        [starts[0], starts[0]],
        [starts[1]],
        [starts[2]],
    ]
    assert all(t.think_s == 0.0 for c in trace.conversations for t in c.turns)


def test_sharegpt_rate_seed_and_think(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    path.write_text(json.dumps(_SHAREGPT))
    fast = load_sharegpt(path, rate_rps=4.0, seed=7, think_mean_s=3.0)
    again = load_sharegpt(path, rate_rps=4.0, seed=7, think_mean_s=3.0)
    assert fast == again
    rng = random.Random(7)
    first_start = rng.expovariate(4.0)
    think = rng.expovariate(1 / 3.0)
    turns = fast.conversations[0].turns
    assert (turns[0].arrival_s, turns[1].arrival_s, turns[1].think_s) == (
        first_start,
        first_start,
        think,
    )
    with pytest.raises(ValueError, match="rate_rps"):
        load_sharegpt(path, rate_rps=0)
