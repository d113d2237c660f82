"""Reading one Wyoming event within the session's message bound.

The ``wyoming`` package's own reader (``wyoming.event.async_read_event``) reads a ``data_length`` or
``payload_length`` of any size, and ends the connection without a word on malformed JSON. This one reads the
same framing (a JSON header line, then that many bytes of JSON data, then that many bytes of payload) and
refuses, before reading it, an event over ``max_bytes``: the caller answers the refusal with an ``error``
event. The events themselves are the package's (:class:`wyoming.event.Event`)."""

from __future__ import annotations

import asyncio
import json

from wyoming.event import Event

from ..errors import ApiError, json_error
from ..session.channel import FrameRefused


def _json(raw: bytes):
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:      # what json_error names invalid_json
        err = json_error(e)
        assert err is not None, "json_error names every ValueError and RecursionError"
        raise FrameRefused(err) from None


def _length(header: dict, key: str) -> int:
    value = header.get(key)
    if value is None:
        return 0
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise FrameRefused(ApiError("invalid_message", f"{key} must be a byte count"))
    return value


async def read_event(reader: asyncio.StreamReader, max_bytes: int) -> Event | None:
    """The next event, or None when the client closed the connection (also in the middle of an event)."""
    try:
        line = await reader.readline()
    except ValueError:                  # a header line over the reader's own limit (64 KiB)
        raise FrameRefused(ApiError("message_too_large", f"events are limited to {max_bytes} bytes")) from None
    if not line:
        return None
    header = _json(line)
    if not isinstance(header, dict) or not isinstance(header.get("type"), str):
        raise FrameRefused(ApiError("invalid_message", "every event is a JSON object with a string \"type\""))
    data_length, payload_length = _length(header, "data_length"), _length(header, "payload_length")
    if len(line) + data_length + payload_length > max_bytes:
        raise FrameRefused(ApiError("message_too_large", f"events are limited to {max_bytes} bytes"))
    try:
        extra = _json(await reader.readexactly(data_length)) if data_length else {}
        payload = await reader.readexactly(payload_length) if payload_length else None
    except asyncio.IncompleteReadError:
        return None
    data = header.get("data") or {}
    if not isinstance(data, dict) or not isinstance(extra, dict):
        raise FrameRefused(ApiError("invalid_message", "an event's data is a JSON object"))
    return Event(type=header["type"], data={**data, **extra}, payload=payload)
