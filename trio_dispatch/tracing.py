"""Tracing (docs/tracing.md): OpenTelemetry spans around an enqueue and
around each delivery attempt, and the trace context carried to the
destination.

This is the one module that imports ``opentelemetry``, and only once a
span is due: with the ``[otel]`` extra missing, :data:`ACTIVE` is False and
every hot path pays one attribute check. Installed but with no tracer
provider set (the API's proxy), no span is started and nothing is written.

- Enqueue: a PRODUCER span ``create {kind}`` per dispatch; its context is
  written as W3C ``traceparent`` (and ``tracestate``) into the envelope
  metadata, with the payload, once.
- Delivery: a CONSUMER span ``process {kind}`` per attempt, *linked* to the
  creation context read back from the payload (not its child), current
  while the transport runs; a failed attempt sets ``error.type`` and an
  error status.
- Propagation: :func:`inject_headers` (webhook request) and
  :func:`inject_environment` (a command's ``TRACEPARENT``/``TRACESTATE``)
  write the current context.

Nothing here raises into an enqueue or a delivery for a tracing reason: a
payload without a usable trace context is processed without a link.
"""

from __future__ import annotations

import contextvars
import importlib.util
import json
import re
from collections.abc import Mapping, MutableMapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final

from ._version import __version__
from .attempt import TransportResult
from .signal import DISPATCH_SIGNAL_CLASS

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer, TracerProvider

    from .outbox.transitions import Claim


def _installed() -> bool:
    try:
        return importlib.util.find_spec("opentelemetry") is not None
    except (ImportError, ValueError):  # an import hook that refuses it
        return False


ACTIVE: bool = _installed()
"""Whether ``opentelemetry`` can be imported (it is not imported until a
span is due). Hot paths check it first; set it False to turn tracing off
in this process."""

MESSAGING_SYSTEM: Final = "trio_dispatch"
TRACEPARENT: Final = "traceparent"
TRACESTATE: Final = "tracestate"

# The head of every envelope we write (signal.dispatch_envelope_json):
# lion_class first, then our trace context, before any other metadata. A
# '"' after a space never occurs inside a JSON string (it would be '\"'),
# so this text can only be the envelope's own keys.
_TRACE_KEY: Final = f'"lion_class": {json.dumps(DISPATCH_SIGNAL_CLASS)}, "{TRACEPARENT}": "'
_TRACESTATE_KEY: Final = f'", "{TRACESTATE}": "'
_TRACEPARENT_LENGTH: Final = 55  # 00-<32 hex>-<16 hex>-<2 hex>
_TRACEPARENT_00: Final = re.compile("00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")
_HEAD_LIMIT: Final = 256  # only the id and created_at come before it


class _Api:
    """The opentelemetry names used here, imported on first need."""

    def __init__(self) -> None:
        from opentelemetry import context, trace
        from opentelemetry.trace import (
            Link,
            SpanContext,
            SpanKind,
            StatusCode,
            TraceFlags,
            TraceState,
        )
        from opentelemetry.trace.propagation.tracecontext import (
            TraceContextTextMapPropagator,
        )

        self.context = context
        self.trace = trace
        self.Link = Link
        self.PRODUCER = SpanKind.PRODUCER
        self.CONSUMER = SpanKind.CONSUMER
        self.ERROR = StatusCode.ERROR
        self.w3c = TraceContextTextMapPropagator()
        self.SpanContext = SpanContext
        self.TraceFlags = TraceFlags
        self.TraceState = TraceState

    def span_context(self, parent: str, state: str | None) -> Any:
        """The remote span context of a ``traceparent`` (version 00) and
        ``tracestate``, or None when it is not one: built directly, an
        attempt's cost with a tracer provider being mostly the SDK's own."""
        if _TRACEPARENT_00.fullmatch(parent) is None:
            return None
        trace_id, span_id = int(parent[3:35], 16), int(parent[36:52], 16)
        if not trace_id or not span_id:
            return None
        return self.SpanContext(
            trace_id,
            span_id,
            is_remote=True,
            trace_flags=self.TraceFlags(int(parent[53:55], 16)),
            trace_state=self.TraceState.from_header([state]) if state else None,
        )


_api: _Api | None = None
_own_provider: TracerProvider | None = None
_tracer: Tracer | None = None
_tracer_from: object = None


def _load() -> _Api | None:
    global _api, ACTIVE
    if _api is None:
        try:
            _api = _Api()
        except ImportError:  # a namespace without the API: tracing stays off
            ACTIVE = False
            return None
        except OSError:  # no descriptor to read the module with: not this time
            return None
    return _api


def warm() -> None:
    """Import the API now, if it is installed (a worker does this as it
    starts), so that no attempt has to read modules from disk -- perhaps
    when the process is short of file descriptors."""
    if ACTIVE:
        _load()


def use_tracer_provider(provider: TracerProvider | None) -> None:
    """Take spans to ``provider`` instead of the global tracer provider
    (None: back to the global one). For an application that keeps a
    provider of its own, and for tests: the global one can be set only once
    per process."""
    global _own_provider, _tracer, _tracer_from
    if provider is not None and _load() is None:
        raise RuntimeError("tracing needs opentelemetry-api: pip install 'trio_dispatch[otel]'")
    _own_provider = provider
    _tracer = _tracer_from = None


def tracer() -> Tracer | None:
    """The tracer spans go to, or None when none should be started (the
    API missing, no tracer provider set, or one that raises)."""
    global _tracer, _tracer_from
    api = _load()
    if api is None:
        return None
    provider: Any = _own_provider
    if provider is None:
        provider = api.trace.get_tracer_provider()
        if isinstance(provider, api.trace.ProxyTracerProvider):
            return None  # no provider set: no span, nothing written
    if provider is not _tracer_from:
        try:
            _tracer = provider.get_tracer("trio_dispatch", __version__)
        except Exception:  # a provider that fails must not fail the outbox: no span
            return None
        _tracer_from = provider
    return _tracer


_FAILURE_HEAD: Final = re.compile(r"HTTP (\d{3})|timeout|exit (-?\d+)")


def error_type(result: TransportResult) -> str:
    """A failed attempt's ``error.type``, low in cardinality: the HTTP
    status (``"503"``), ``"timeout"``, ``"exit 3"``, ``"permanent"``,
    ``"not_sent"`` (a local resource error), else ``"_OTHER"``."""
    if result.local:
        return "not_sent"
    if result.permanent:
        return "permanent"
    head = _FAILURE_HEAD.match(result.error or "")
    if head is None:
        return "_OTHER"
    if head.group(1):
        return head.group(1)
    return head.group(0)


def _mark_failed(api: Any, span: Any, kind: str, description: str | None) -> None:
    """``error.type`` and an error status (its first 200 characters) on ``span``."""
    span.set_attribute("error.type", kind)
    span.set_status(api.ERROR, (description or "")[:200] or None)


def _error_type(exc: BaseException) -> str:
    cls = type(exc)
    if cls.__module__ == "builtins":
        return cls.__qualname__
    return f"{cls.__module__}.{cls.__qualname__}"


class Creations:
    """The ``create`` spans of one enqueue call, one per dispatch: started
    before its envelope is built (the envelope carries the span's context),
    ended when the call returns or raises (then with an error status)."""

    __slots__ = ("_api", "_tracer", "spans")

    def __init__(self, api: _Api, tracer_: Tracer) -> None:
        self._api = api
        self._tracer = tracer_
        self.spans: list[Span] = []

    def start(self, kind: object) -> dict[str, str]:
        """Start the span of one dispatch of ``kind``; return the envelope
        metadata carrying its context."""
        destination = kind if isinstance(kind, str) and kind else None
        attributes = {
            "messaging.system": MESSAGING_SYSTEM,
            "messaging.operation.name": "create",
        }
        if destination is not None:
            attributes["messaging.destination.name"] = destination
        span = self._tracer.start_span(
            "create" if destination is None else f"create {destination}",
            kind=self._api.PRODUCER,
            attributes=attributes,
        )
        self.spans.append(span)
        # W3C trace context, formatted as the propagator would (version 00).
        context = span.get_span_context()
        if not context.is_valid:
            return {}
        carrier = {
            TRACEPARENT: f"00-{context.trace_id:032x}-{context.span_id:016x}-"
            f"{context.trace_flags:02x}"
        }
        if context.trace_state:
            state = context.trace_state.to_header()
            if '"' not in state and "\\" not in state:  # else the head would not be read
                carrier[TRACESTATE] = state
        return carrier

    def restart(self) -> None:
        """Forget the spans started so far, never to end or export them: a
        unit of work the store runs again starts its own anew."""
        self.spans.clear()

    def forget(self, kept: int) -> None:
        """Forget the spans started after the first ``kept``, never to end or
        export them: the part of a unit of work that started them was
        rolled back."""
        del self.spans[kept:]

    def written(self, ids: Sequence[str]) -> None:
        """Name each span's message: the id the enqueue returns for it."""
        for span, dispatch_id in zip(self.spans, ids, strict=False):
            span.set_attribute("messaging.message.id", dispatch_id)

    def __enter__(self) -> Creations:
        return self

    def __exit__(
        self,
        typ: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for span in self.spans:
            if exc is not None:
                _mark_failed(self._api, span, _error_type(exc), str(exc))
            span.end()


def creations() -> Creations | None:
    """A :class:`Creations` for one enqueue call, or None when no span is
    due. Call only when :data:`ACTIVE`."""
    found = tracer()
    if found is None:
        return None
    assert _api is not None
    return Creations(_api, found)


def creation_context(payload: str) -> tuple[str, str | None] | None:
    """The ``(traceparent, tracestate)`` an enqueue wrote into ``payload``'s
    envelope metadata, or None. Reads only the envelope's head: our writer
    puts the trace context right after ``lion_class``; a payload of another
    shape is read in full, once."""
    start = payload.find(_TRACE_KEY, 0, _HEAD_LIMIT)
    if start < 0:
        return None if payload.startswith('{"id": "') else _parsed_context(payload)
    begin = start + len(_TRACE_KEY)
    end = begin + _TRACEPARENT_LENGTH
    if payload[end : end + 1] != '"':
        return None
    parent = payload[begin:end]
    state: str | None = None
    if payload.startswith(_TRACESTATE_KEY, end):
        state_begin = end + len(_TRACESTATE_KEY)
        state_end = payload.find('"', state_begin)
        if state_end > state_begin and "\\" not in payload[state_begin:state_end]:
            state = payload[state_begin:state_end]
    return parent, state


def _parsed_context(payload: str) -> tuple[str, str | None] | None:
    try:
        metadata = json.loads(payload).get("metadata")
    except (ValueError, AttributeError):
        return None
    if not isinstance(metadata, Mapping) or not isinstance(metadata.get(TRACEPARENT), str):
        return None
    state = metadata.get(TRACESTATE)
    return metadata[TRACEPARENT], state if isinstance(state, str) else None


_attempt: contextvars.ContextVar[Processing | None] = contextvars.ContextVar(
    "trio_dispatch_attempt", default=None
)


class Processing:
    """The ``process`` span of one attempt: started when made and current
    until it ends (so a transport's request or child carries it), linked to
    the dispatch's creation context. :meth:`record` gives it the attempt's
    result and ends it; leaving the block ends it too if :meth:`record` did
    not, with an error status for an exception on the way out. Enter, call
    and leave it in one task."""

    __slots__ = ("_api", "_attempt_token", "_failure", "_open", "_raised", "_token", "span")

    def __init__(self, api: _Api, tracer_: Tracer, claim: Claim) -> None:
        self._api = api
        self._failure: str | None = None
        links = []
        found = creation_context(claim.payload)
        if found is not None:
            linked = api.span_context(*found)
            if linked is not None:
                links.append(api.Link(linked))
        self.span = tracer_.start_span(
            f"process {claim.kind}",
            kind=api.CONSUMER,
            links=links,
            attributes={
                "messaging.system": MESSAGING_SYSTEM,
                "messaging.operation.name": "process",
                "messaging.message.id": claim.dispatch_id,
                "trio_dispatch.attempt": claim.attempt,
                "trio_dispatch.deliver_to": claim.deliver_to,
            },
        )
        self._token = api.context.attach(api.trace.set_span_in_context(self.span))
        self._raised: str | None = None
        self._open = True
        self._attempt_token = _attempt.set(self)

    def record(self, result: TransportResult | object) -> None:
        """The attempt's result: a :class:`TransportResult`, or anything
        else for an attempt that ended without one (worker shutdown: its
        ``reason`` says why). A failure sets ``error.type`` (see
        :func:`error_type`) and an error status."""
        if not self._open:
            return
        if isinstance(result, TransportResult):
            if not result.ok:
                self._fail(self._raised or error_type(result), result.error)
        else:
            self._fail("interrupted", str(getattr(result, "reason", "")))
        self._end()

    def _end(self) -> None:
        self._open = False
        _attempt.reset(self._attempt_token)
        self._api.context.detach(self._token)
        self.span.end()

    def _fail(self, kind: str, description: str | None) -> None:
        self._failure = kind
        _mark_failed(self._api, self.span, kind, description)

    def __enter__(self) -> Processing:
        return self

    def __exit__(
        self,
        typ: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._open:
            if exc is not None and self._failure is None:
                self._fail(_error_type(exc), str(exc))
            self._end()


def transport_raised(exc: BaseException) -> None:
    """Note on the current attempt's span that its transport raised ``exc``
    (recorded as a failure): ``error.type`` names the exception's class and
    the exception is recorded as an event. Call only when :data:`ACTIVE`."""
    attempt = _attempt.get()
    if attempt is not None and attempt._open:
        attempt._raised = _error_type(exc)
        attempt.span.record_exception(exc)


class _NotTraced:
    """What :func:`processing` returns when no span is due."""

    __slots__ = ()

    def record(self, result: object) -> None:
        pass

    def __enter__(self) -> _NotTraced:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


NOT_TRACED: Final = _NotTraced()

Attempt = Processing | _NotTraced
"""What :func:`processing` returns."""


def processing(claim: Claim) -> Attempt:
    """The span of one attempt of ``claim`` (see :class:`Processing`), or
    :data:`NOT_TRACED` when no span is due."""
    if not ACTIVE:
        return NOT_TRACED
    try:
        found = tracer()
        if found is None:
            return NOT_TRACED
        assert _api is not None
        return Processing(_api, found, claim)
    except Exception:  # a tracer that fails must not fail the delivery
        return NOT_TRACED


def inject_headers(headers: MutableMapping[str, str]) -> None:
    """Add the current context's ``traceparent`` (and ``tracestate``) to an
    outgoing request's headers; nothing when there is no valid span."""
    if ACTIVE and _load() is not None:
        assert _api is not None
        _api.w3c.inject(headers)


def inject_environment(env: MutableMapping[str, str]) -> None:
    """Set ``TRACEPARENT`` (and ``TRACESTATE``) in a child's environment
    from the current context; nothing when there is no valid span."""
    if ACTIVE and _load() is not None:
        assert _api is not None
        carrier: dict[str, str] = {}
        _api.w3c.inject(carrier)
        for key, value in carrier.items():
            env[key.upper()] = value
