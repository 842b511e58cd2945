"""OpenTelemetry spans per turn and per leg, with the `otel` extra and `--otel`.

The request path does no OpenTelemetry work: a traced turn gets a `TurnTrace` (plain data) at
admission, and each leg it sends draws a span id and carries it in its `traceparent`, so the
worker's own spans hang under the router's leg. The spans themselves are made when the turn
is settled (`TurnPipeline.settle`, off the critical path), from the turn's stage timestamps,
with the ids the legs already carried (`_PresetIds`). Without `--otel` nothing here runs and
`opentelemetry` is never imported.

Configuration is OpenTelemetry's own: OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES name the
router, OTEL_TRACES_SAMPLER(_ARG) sample (parent-based by default: a client's sampled flag is
followed), OTEL_TRACES_EXPORTER picks `otlp` (default), `console` or `none`, and the
OTEL_EXPORTER_OTLP_* variables (endpoint, protocol `http/protobuf` or `grpc`, headers,
certificates, timeout) configure the OTLP exporter. The sampling decision is taken at admission
with the provider's sampler, so the legs' `traceparent` flags agree with what is exported.
"""

from __future__ import annotations

import os
import random
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from router.config import ConfigError

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter

    from router.obs.events import StageEvents

TURN_SPAN = "session_router.turn"
LEG_SPAN = "session_router.leg"
_SAMPLED = 0x01


class TurnTrace:
    """One sampled turn's trace: its ids, and each leg's span id and send time."""

    __slots__ = ("flags", "legs", "parent_span_id", "path", "trace_id", "tracestate")

    def __init__(
        self, trace_id: int, parent_span_id: int | None, flags: int, tracestate: str | None,
        path: str,
    ) -> None:  # fmt: skip
        self.trace_id = trace_id
        self.parent_span_id = parent_span_id
        self.flags = flags
        self.tracestate = tracestate
        self.path = path
        # (worker id, prefill leg?, span id, sent at in unix seconds), in send order
        self.legs: list[tuple[str, bool, int, float]] = []

    def leg_headers(
        self, headers: dict[str, str], worker_id: str, prefill: bool, now: float
    ) -> dict[str, str]:
        """`headers` for one leg: its own span id in `traceparent`."""
        span_id = random.getrandbits(64) or 1
        self.legs.append((worker_id, prefill, span_id, now))
        leg = dict(headers)
        leg["traceparent"] = f"00-{self.trace_id:032x}-{span_id:016x}-{self.flags:02x}"
        return leg


class Tracing:
    """Turns traces into spans on an OpenTelemetry SDK tracer provider."""

    def __init__(self, provider: TracerProvider, ids: _PresetIds) -> None:
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._provider = provider
        self._ids = ids
        self._tracer = provider.get_tracer("session_router")
        self._propagator = TraceContextTextMapPropagator()
        self._trace = trace

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> Tracing:
        """A provider and exporter as the OTEL_* variables say; ConfigError without the
        `otel` extra."""
        environ = os.environ if environ is None else environ
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError as exc:
            raise ConfigError(
                f"--otel needs OpenTelemetry's SDK: pip install 'session-router[otel]' ({exc})"
            ) from exc
        ids = _PresetIds()
        resource = Resource.create({"service.name": "session-router"})
        if "OTEL_SERVICE_NAME" in environ or "service.name" in environ.get(
            "OTEL_RESOURCE_ATTRIBUTES", ""
        ):
            resource = Resource.create()  # the variables name the service
        provider = TracerProvider(resource=resource, id_generator=ids.generator())
        exporter = _exporter(environ)
        if exporter is not None:
            provider.add_span_processor(BatchSpanProcessor(exporter))
        return cls(provider, ids)

    @classmethod
    def with_exporter(cls, exporter: SpanExporter, sampler: Any = None) -> Tracing:
        """Spans handed to `exporter` as each turn settles (tests: the in-memory exporter)."""
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor

        ids = _PresetIds()
        provider = TracerProvider(sampler=sampler, id_generator=ids.generator())
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        return cls(provider, ids)

    def begin(self, headers: Mapping[str, str], path: str) -> TurnTrace | None:
        """The turn's trace, or None where the sampler drops it (its legs then carry the
        client's `traceparent` unchanged, as without tracing). `headers` are the legs':
        their `traceparent`, where present, is valid."""
        parent = self._propagator.extract(headers)
        parent_span = self._trace.get_current_span(parent).get_span_context()
        trace_id = parent_span.trace_id if parent_span.is_valid else _new_trace_id()
        decision = self._provider.sampler.should_sample(parent, trace_id, TURN_SPAN)
        if not decision.decision.is_sampled():  # type: ignore[no-untyped-call]
            return None
        return TurnTrace(
            trace_id=trace_id,
            parent_span_id=parent_span.span_id if parent_span.is_valid else None,
            flags=_SAMPLED,
            tracestate=headers.get("tracestate"),
            path=path,
        )

    def finish(self, turn: TurnTrace, events: StageEvents) -> None:
        """The turn's span and its legs' spans, from its stage timestamps."""
        from opentelemetry.trace import SpanKind, Status, StatusCode

        carrier = {"traceparent": f"00-{turn.trace_id:032x}-{turn.parent_span_id or 1:016x}-01"}
        if turn.tracestate is not None:
            carrier["tracestate"] = turn.tracestate
        parent = self._propagator.extract(carrier) if turn.parent_span_id is not None else None
        start = events.admitted or events.done or 0.0
        end = events.done or start
        self._ids.trace_id = turn.trace_id  # a root turn keeps the id its legs carried
        span = self._tracer.start_span(
            TURN_SPAN, context=parent, kind=SpanKind.SERVER, start_time=_ns(start),
            attributes=_turn_attributes(turn, events),
        )  # fmt: skip
        self._ids.trace_id = None
        failed = events.outcome in ("error", "cancelled")
        if failed:
            span.set_status(Status(StatusCode.ERROR, events.error or events.outcome or ""))
        under = self._trace.set_span_in_context(span)
        for index, (worker_id, prefill, span_id, sent) in enumerate(turn.legs):
            later = [leg[3] for leg in turn.legs[index + 1 :] if leg[1] == prefill]
            if later:  # a leg the turn went on from (a retry elsewhere)
                leg_end, leg_failed = later[0], True
            else:
                leg_end = (events.prefill_end if prefill else None) or end
                leg_failed = failed
            self._ids.span_id = span_id
            leg = self._tracer.start_span(
                LEG_SPAN, context=under, kind=SpanKind.CLIENT, start_time=_ns(sent),
                attributes={
                    "session_router.worker": worker_id,
                    "session_router.leg": "prefill" if prefill else "answer",
                    "http.request.method": "POST",
                    "url.path": turn.path,
                },
            )  # fmt: skip
            self._ids.span_id = None
            if leg_failed:
                leg.set_status(Status(StatusCode.ERROR))
            leg.end(end_time=_ns(max(leg_end, sent)))
        span.end(end_time=_ns(end))

    def shutdown(self) -> None:
        """Export what is buffered, then stop."""
        self._provider.shutdown()


class _PresetIds:
    """Ids for the SDK: the one set here for the span being made (the id its leg already
    carried), else random."""

    def __init__(self) -> None:
        self.trace_id: int | None = None
        self.span_id: int | None = None

    def generator(self) -> Any:
        from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator

        preset = self
        fallback = RandomIdGenerator()

        class Generator(IdGenerator):
            def generate_span_id(self) -> int:
                return preset.span_id or fallback.generate_span_id()

            def generate_trace_id(self) -> int:
                return preset.trace_id or fallback.generate_trace_id()

        return Generator()


def _new_trace_id() -> int:
    return random.getrandbits(128) or 1


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def _turn_attributes(turn: TurnTrace, events: StageEvents) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        "http.request.method": "POST",
        "url.path": turn.path,
        "session_router.request_id": events.request_id,
        "session_router.policy": events.policy,
        "session_router.prompt_tokens": events.prompt_tokens,
        "session_router.cached_tokens": events.cached_tokens,
        "session_router.completion_tokens": events.completion_tokens,
        "session_router.recomputed_tokens": events.recomputed_tokens,
        "session_router.transferred_bytes": events.transferred_bytes,
        "session_router.retried": events.retried,
    }
    optional = {
        "http.response.status_code": events.http_status,
        "session_router.action": events.action,
        "session_router.outcome": events.outcome,
        "session_router.prefill_worker": events.prefill_worker,
        "session_router.decode_worker": events.decode_worker,
    }
    attributes.update({key: value for key, value in optional.items() if value is not None})
    if events.first_token is not None and events.admitted is not None:
        attributes["session_router.ttft_s"] = events.first_token - events.admitted
    return attributes


def _exporter(environ: Mapping[str, str]) -> SpanExporter | None:
    """OTEL_TRACES_EXPORTER's exporter: otlp (by OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL),
    console, or none."""
    names = [n.strip() for n in environ.get("OTEL_TRACES_EXPORTER", "otlp").split(",")]
    chosen = [n for n in names if n and n != "none"]
    if not chosen:
        return None
    if len(chosen) > 1 or chosen[0] not in ("otlp", "console"):
        raise ConfigError(
            f"OTEL_TRACES_EXPORTER={environ.get('OTEL_TRACES_EXPORTER')!r}: the router "
            "exports to one of otlp, console or none"
        )
    if chosen[0] == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    protocol = (
        environ.get(
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "")
        ).strip()
        or "http/protobuf"
    )
    try:
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (  # type: ignore[import-not-found]
                OTLPSpanExporter,
            )
        elif protocol == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        else:
            raise ConfigError(f"OTLP protocol {protocol!r}: want http/protobuf or grpc")
    except ImportError as exc:
        raise ConfigError(
            f"the OTLP {protocol} exporter is not installed: pip install "
            f"opentelemetry-exporter-otlp-proto-{'grpc' if protocol == 'grpc' else 'http'} "
            f"({exc})"
        ) from exc
    exporter: SpanExporter = OTLPSpanExporter()  # reads OTEL_EXPORTER_OTLP_* itself
    return exporter
