"""The versioned signal envelope stored as a dispatch's payload (docs/payload.md).

The JSON form is a wire contract: field names, order and meaning match the
source design, with ``metadata.lion_class`` naming the concrete class here.
``DispatchSignal.attempt`` is written once at enqueue (0) and never rewritten;
the row's ``attempt`` column is the current attempt.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import threading
import time
import uuid
from collections.abc import Mapping
from typing import Any, Final, Literal

SIGNAL_SCHEMA_VERSION: Final = 1


@dataclasses.dataclass(kw_only=True)
class Element:
    """An identified, timestamped value with free-form metadata."""

    id: str = dataclasses.field(default_factory=lambda: str(uuid.UUID(bytes=uuid7_bytes())))
    created_at: float = dataclasses.field(default_factory=time.time)
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_dict(self, mode: Literal["python", "json"] = "python") -> dict[str, Any]:
        """The fields in declaration order; ``metadata.lion_class`` names the
        concrete class. ``mode="json"`` returns only JSON-native values."""
        out: dict[str, Any] = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "metadata":
                value = {**value, "lion_class": _class_path(type(self))}
            out[field.name] = value
        if mode == "json":
            return dict(_jsonable(out))
        return out


@dataclasses.dataclass(kw_only=True)
class Signal(Element):
    """A message between roles, versioned by ``schema_version``."""

    data: Any = None
    emitter_role: str | None = None
    schema_version: int = SIGNAL_SCHEMA_VERSION


@dataclasses.dataclass(kw_only=True)
class DispatchSignal(Signal):
    """The payload envelope of one dispatch."""

    dispatch_id: str = ""
    kind: str = ""
    deliver_to: str = ""
    attempt: int = 0
    ack_token: str | None = None
    body: dict[str, Any] = dataclasses.field(default_factory=dict)


def _class_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, uuid.UUID):
        return str(value)
    return value


DISPATCH_SIGNAL_CLASS: Final = _class_path(DispatchSignal)
"""``metadata.lion_class`` of every envelope: the first key of its metadata."""
_ENVELOPE_HEAD: Final = (
    '{{"id": "{id}", "created_at": {created_at!r}, '
    f'"metadata": {{{{"lion_class": {json.dumps(DISPATCH_SIGNAL_CLASS)}{{metadata}}}}}}, '
    '"data": null, "emitter_role": null, '
    f'"schema_version": {SIGNAL_SCHEMA_VERSION}, '
    '"dispatch_id": {dispatch_id}, "kind": {kind}, "deliver_to": {deliver_to}, '
    '"attempt": 0, "ack_token": {ack_token}, "body": '
)


class _RandomPool(threading.local):
    """``os.urandom`` bytes drawn 1 KiB at a time and handed out 16 at a
    time, each chunk once.

    One ``os.urandom(16)`` per id releases the GIL for its system call, and
    with the store's writer thread busy, getting the GIL back can cost more
    than the call: pooled, 64 concurrent producers enqueue ~12% faster. Each
    thread has its own pool; ``popleft`` hands a chunk out in one step, so a
    signal handler that enqueues mid-call still gets other bytes; and a
    forked child drops its parent's chunks unused (the generation moved)."""

    size = 1024

    def __init__(self) -> None:
        self.chunks: collections.deque[bytes] = collections.deque()
        self.generation = _fork_generation


_fork_generation = 0


def _after_fork_in_child() -> None:
    global _fork_generation
    _fork_generation += 1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

_pool = _RandomPool()


def _random_chunk() -> bytes:
    """16 fresh random bytes from this thread's pool (see :class:`_RandomPool`)."""
    pool = _pool
    if pool.generation != _fork_generation:
        pool.chunks.clear()
        pool.generation = _fork_generation
    try:
        return pool.chunks.popleft()
    except IndexError:
        fresh = os.urandom(_RandomPool.size)
        pool.chunks.extend(fresh[i : i + 16] for i in range(16, _RandomPool.size, 16))
        return fresh[:16]


def uuid4_bytes() -> bytes:
    """16 random bytes with the version-4 and RFC 4122 variant bits set:
    a ``uuid.uuid4()`` without the object, from ``os.urandom`` (pooled)."""
    raw = bytearray(_random_chunk())
    raw[6] = (raw[6] & 0x0F) | 0x40
    raw[8] = (raw[8] & 0x3F) | 0x80
    return bytes(raw)


_v7_ms = 0
_v7_seq = 0
_V7_SEQ_MAX: Final = 0xFFF


def uuid7_bytes() -> bytes:
    """A time-ordered UUIDv7 (RFC 9562): 48 bits of Unix milliseconds, the
    version, a 12-bit sequence that rises within a millisecond (method 1 of
    RFC 9562 section 6.2, started at a random value below 1,024 each new
    millisecond; on overflow the timestamp is advanced a millisecond so the
    order holds), the variant, and 62 random bits.

    Ids made one after another sort in that order (on one process), so an
    index keyed by them grows at its right edge instead of at random pages.
    Uniqueness does not rest on the sequence: two threads drawing in the same
    millisecond still differ in their 62 random bits.
    """
    global _v7_ms, _v7_seq
    rnd = int.from_bytes(_random_chunk(), "big")
    ms = time.time_ns() // 1_000_000
    if ms > _v7_ms:
        _v7_ms, _v7_seq = ms, rnd & 0x3FF
    else:
        _v7_seq += 1
        if _v7_seq > _V7_SEQ_MAX:
            _v7_ms, _v7_seq = _v7_ms + 1, 0
    # ms(48) | version 7 (4) | seq(12) | variant 0b10 (2) | random (62)
    value = (_v7_ms << 80) | (0x7 << 76) | (_v7_seq << 64) | (0x2 << 62) | (rnd >> 66)
    return value.to_bytes(16, "big")


def uuid_text(raw: bytes) -> str:
    """``str(uuid.UUID(bytes=raw))`` without the object."""
    h = raw.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def dispatch_envelope_json(
    *,
    dispatch_id: str,
    kind: str,
    deliver_to: str,
    ack_token: str | None,
    body_json: str,
    metadata: Mapping[str, Any] | None = None,
) -> str:
    """The JSON text of a fresh ``DispatchSignal`` (attempt 0) whose body is
    the already-serialised ``body_json``: the same text as
    ``json.dumps(DispatchSignal(...).to_dict(mode="json"), ensure_ascii=False)``,
    built without serialising the body a second time (the enqueue hot path).
    ``metadata`` (JSON values) joins ``lion_class`` in the envelope's
    metadata: a schedule's tick, a trace context."""
    quote = _quote
    head = _ENVELOPE_HEAD.format(
        id=uuid_text(uuid7_bytes()),
        created_at=time.time(),
        dispatch_id=quote(dispatch_id),
        kind=quote(kind),
        deliver_to=quote(deliver_to),
        ack_token="null" if ack_token is None else quote(ack_token),
        metadata=""
        if not metadata
        else "".join(
            f", {quote(str(key))}: {json.dumps(value, ensure_ascii=False)}"
            for key, value in metadata.items()
            if key != "lion_class"
        ),
    )
    return f"{head}{body_json}}}"


# JSON string quoting, non-ASCII kept (json.dumps(..., ensure_ascii=False) of a str).
_quote: Final = json.encoder.encode_basestring  # the C one where built
