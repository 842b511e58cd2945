"""OpenTelemetry spans per turn and per leg (router/obs/tracing.py), read back from the SDK's
in-memory exporter; the workers' requests carry each leg's own span id."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from router.app import Router
from router.config import ConfigError, PolicyConfig, RouterConfig
from router.obs.tracing import LEG_SPAN, TURN_SPAN, Tracing
from tests.procs import ROOT
from tests.router.turn.fake_upstream import RouterUnderTest, Stack, eventually, spec
from tests.router.turn.test_pipeline import HANDOFF, chat_body, post, stream

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
SAMPLED = f"00-{TRACE_ID}-{PARENT_ID}-01"
STATE = "congo=t61rcWkgMzE"


@pytest.fixture
async def stack(redis_url: str) -> AsyncIterator[Stack]:
    async with Stack(redis_url) as stack:
        yield stack


def traced(router: RouterUnderTest) -> InMemorySpanExporter:
    exporter = InMemorySpanExporter()
    router.router.pipeline.tracing = Tracing.with_exporter(exporter)
    return exporter


async def spans(router: RouterUnderTest, exporter: InMemorySpanExporter, count: int) -> list[
    ReadableSpan
]:  # fmt: skip
    """The spans once `count` are made (they are made as turns settle)."""

    async def made() -> bool:
        router.router.pipeline.settle()
        return len(exporter.get_finished_spans()) >= count

    await eventually(made)
    found = list(exporter.get_finished_spans())
    assert len(found) == count, [s.name for s in found]
    return found


def by_name(found: list[ReadableSpan]) -> tuple[ReadableSpan, list[ReadableSpan]]:
    (turn,) = [s for s in found if s.name == TURN_SPAN]
    return turn, [s for s in found if s.name == LEG_SPAN]


def traceparent_of(span: ReadableSpan) -> str:
    context = span.get_span_context()
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-01"


async def post_traced(
    stack: Stack, router: RouterUnderTest, headers: dict[str, str], stream_it: bool = False
) -> int:
    body = chat_body(temperature=0.0)
    if stream_it:
        body["stream"] = True
    async with stack.http.post(router.url + "/v1/chat/completions", json=body,
                               headers=headers) as response:  # fmt: skip
        await response.read()
        return response.status


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "stream"])
async def test_a_handoff_is_a_turn_span_with_a_prefill_and_an_answer_leg(
    stack: Stack, streamed: bool
) -> None:
    p = await stack.worker("p")
    d = await stack.worker("d")
    router = await stack.router([spec(p, "prefill"), spec(d, "decode")], HANDOFF,
                                params={"prefill": "p", "decode": "d"})  # fmt: skip
    exporter = traced(router)
    status = await post_traced(stack, router, {"traceparent": SAMPLED, "tracestate": STATE},
                               streamed)  # fmt: skip
    assert status == 200
    turn, legs = by_name(await spans(router, exporter, 3))
    # the turn: a server span under the client's, in the client's trace
    assert turn.kind is SpanKind.SERVER
    assert f"{turn.context.trace_id:032x}" == TRACE_ID
    assert turn.parent is not None and f"{turn.parent.span_id:016x}" == PARENT_ID
    assert turn.parent.is_remote
    attributes = dict(turn.attributes or {})
    assert attributes["session_router.action"] == "handoff"
    assert attributes["session_router.outcome"] == "completed"
    assert attributes["http.response.status_code"] == 200
    assert (attributes["session_router.prefill_worker"],
            attributes["session_router.decode_worker"]) == ("p", "d")  # fmt: skip
    assert turn.status.status_code is StatusCode.UNSET
    # the legs: client spans under the turn, each the parent the worker was told of
    assert [(dict(leg.attributes or {})["session_router.leg"],
             dict(leg.attributes or {})["session_router.worker"]) for leg in legs] == [
        ("prefill", "p"), ("answer", "d")]  # fmt: skip
    for leg, worker in zip(legs, (p, d), strict=True):
        assert leg.kind is SpanKind.CLIENT
        assert leg.parent is not None and leg.parent.span_id == turn.context.span_id
        assert leg.context.trace_id == turn.context.trace_id
        (got,) = worker.received
        assert got.headers["traceparent"] == traceparent_of(leg)
        assert got.headers["tracestate"] == STATE
        assert turn.start_time <= leg.start_time <= leg.end_time <= turn.end_time
    prefill, answer = legs
    assert prefill.end_time <= answer.start_time  # vLLM: the decode leg follows the prefill


async def test_a_turn_without_traceparent_starts_a_trace(stack: Stack) -> None:
    a = await stack.worker("a")
    router = await stack.router([spec(a)])
    exporter = traced(router)
    assert await post_traced(stack, router, {}) == 200
    turn, (leg,) = by_name(await spans(router, exporter, 2))
    assert turn.parent is None and turn.context.trace_id != 0
    assert leg.parent is not None and leg.parent.span_id == turn.context.span_id
    assert a.received[0].headers["traceparent"] == traceparent_of(leg)
    assert "tracestate" not in a.received[0].headers


async def test_an_unsampled_parent_is_followed_and_forwarded_unchanged(stack: Stack) -> None:
    a = await stack.worker("a")
    router = await stack.router([spec(a)])
    exporter = traced(router)
    unsampled = f"00-{TRACE_ID}-{PARENT_ID}-00"
    assert await post_traced(stack, router, {"traceparent": unsampled}) == 200
    router.router.pipeline.settle()
    assert exporter.get_finished_spans() == ()
    assert a.received[0].headers["traceparent"] == unsampled


async def test_a_failed_turn_and_its_leg_are_errors(stack: Stack) -> None:
    a = await stack.worker("a")
    router = await stack.router([spec(a)])
    exporter = traced(router)
    a.fail_next("status", status=500)
    status, _, _ = await post(stack, router, chat_body())
    assert status == 500
    turn, (leg,) = by_name(await spans(router, exporter, 2))
    assert turn.status.status_code is StatusCode.ERROR
    assert leg.status.status_code is StatusCode.ERROR
    assert dict(turn.attributes or {})["http.response.status_code"] == 500


async def test_a_streamed_turn_span_counts_its_tokens(stack: Stack) -> None:
    a = await stack.worker("a")
    router = await stack.router([spec(a)])
    exporter = traced(router)
    status, lines = await stream(stack, router, chat_body(), "s-1")
    assert status == 200 and lines[-1] == b"data: [DONE]"
    turn, (leg,) = by_name(await spans(router, exporter, 2))
    assert dict(turn.attributes or {})["session_router.completion_tokens"] == 3
    assert dict(turn.attributes or {})["session_router.ttft_s"] > 0
    assert dict(leg.attributes or {})["session_router.leg"] == "answer"


def config(**options: Any) -> RouterConfig:
    return RouterConfig(workers=(spec_url(),), policy=PolicyConfig(name="colocate"), **options)


def spec_url() -> Any:
    from router.config import WorkerSpec

    return WorkerSpec(url="http://127.0.0.1:9")


def test_tracing_is_off_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Router(config()).tracing is None
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert Router(config(otel=True)).tracing is not None


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, "otlp, console or none"),
        ({"OTEL_TRACES_EXPORTER": "otlp,console"}, "otlp, console or none"),
        ({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, "http/protobuf or grpc"),
        ({"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"}, "grpc exporter is not installed"),
    ],
)
def test_unusable_otel_settings_are_refused_at_start(environ: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Tracing.from_environment(environ)


@pytest.mark.parametrize("environ", [{}, {"OTEL_TRACES_EXPORTER": "console"},
                                     {"OTEL_TRACES_EXPORTER": "none"}])  # fmt: skip
def test_exporters_the_variables_name_are_made(environ: dict[str, str]) -> None:
    Tracing.from_environment(environ).shutdown()


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=60, check=False)  # fmt: skip


def test_without_otel_opentelemetry_is_never_imported() -> None:
    # redis-py imports OpenTelemetry's SDK for its own instruments where it is installed:
    # what it loads is not the router's
    result = run_python(
        "import sys\n"
        "import redis, redis.asyncio\n"
        "before = {m for m in sys.modules if m.startswith('opentelemetry')}\n"
        "from router.app import Router\n"
        "from router.config import RouterConfig, WorkerSpec\n"
        "Router(RouterConfig(workers=(WorkerSpec(url='http://127.0.0.1:9'),)))\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')\n"
        "             and m not in before))\n"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_otel_without_the_extra_is_refused_with_the_install_command() -> None:
    result = run_python(
        "import sys\n"
        "sys.modules['opentelemetry'] = None  # as if the extra were not installed\n"
        "from router.config import ConfigError\n"
        "from router.obs.tracing import Tracing\n"
        "try:\n    Tracing.from_environment({})\n"
        "except ConfigError as exc:\n    print(exc)\n"
    )
    assert result.returncode == 0, result.stderr
    assert "pip install 'session-router[otel]'" in result.stdout
