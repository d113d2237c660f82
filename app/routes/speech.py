"""``POST /v1/audio/speech``: OpenAI's speech endpoint, streamed as frames are generated (audio or SSE, with word
timestamps when asked) or whole (``stream: false``).
Parses the body and renders the audio; the utterance, its stream and every bound are :mod:`app.session`'s."""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from ..alignment.characters import Span
from ..alignment.contract import FrameAligner
from ..alignment.words import WordTimestamps
from ..audio_formats import CONTENT_TYPES, whole_file
from ..errors import ApiError
from ..schemas import SpeechRequest
from ..service import TTSService
from ..session.http import StreamedResponse, StreamEnd, outs, whole
from ..session.policy import require_key
from ..session.pump import Audio, Ended, Failed
from ..session.speech import reply_headers, start_speech

router = APIRouter()
ENDPOINT = "/v1/audio/speech"


@router.post(ENDPOINT, dependencies=[Depends(require_key)], response_class=Response,
             responses={200: {"content": {t: {"schema": {"type": "string", "format": "binary"}}
                                          for t in sorted(set(CONTENT_TYPES.values()))}
                              | {"text/event-stream": {}},
                              "description": "audio, streamed as it is generated (or whole: stream false)"}})
async def create_speech(body: SpeechRequest, request: Request):
    if body.return_timestamps and body.stream_format != "sse":
        raise ApiError("invalid_value", "return_timestamps needs stream_format 'sse' (or POST /dev/captioned_speech)",
                       "return_timestamps")
    if not body.stream and body.stream_format == "sse":
        raise ApiError("invalid_value", "stream false is one audio body: not with stream_format 'sse'", "stream")
    utterance, end = await start_speech(body, request, "sse" if body.stream_format == "sse" else "http", ENDPOINT)
    headers = reply_headers(body, request)
    encoder = end.turn.encoder
    assert encoder is not None, "start_speech made the reply's encoder"
    content_type = encoder.content_type
    if not body.stream:
        audio = await whole(request, end, _joined(end, body.response_format))
        return Response(audio or b"", media_type=content_type, headers=headers)
    service: TTSService = request.app.state.service
    stall = service.policy.stall_timeout
    if body.stream_format == "sse":
        aligner = utterance.aligner() if body.return_timestamps else None
        return StreamedResponse(_sse(len(utterance.ids), end, aligner, utterance.text), end, stall,
                                media_type="text/event-stream", headers=headers)
    return StreamedResponse(_audio(end), end, stall, media_type=content_type, headers=headers)


async def _joined(end: StreamEnd, fmt: str) -> bytes:
    """The whole audio (``stream: false``); a failure after it began ends it where it failed, as a stream does."""
    return whole_file(fmt, b"".join([data async for data in _audio(end)]))


async def _audio(end: StreamEnd) -> AsyncIterator[bytes]:
    async for out in outs(end):
        if isinstance(out, Failed):
            return                               # logged and counted by outs; the body just ends
        data = out.data if isinstance(out, Audio) else out.tail
        if data:
            yield data


async def _sse(input_tokens: int, end: StreamEnd, aligner: FrameAligner | None, text: str) -> AsyncIterator[bytes]:
    meter = end.turn.meter
    words = WordTimestamps()                       # fed only when there is an aligner
    if aligner is not None:
        aligner.add(text)
    async for out in outs(end):
        if isinstance(out, Audio):
            if out.data:
                yield _event({"type": "speech.audio.delta", "audio": base64.b64encode(out.data).decode()})
            if aligner is not None and (done := words.add(_seconds(aligner.frame(out.frame.text_chars,
                                                                                 out.frame.audio)))):
                yield _timestamps(done)
        elif isinstance(out, Failed):             # instead of done
            yield _event({"type": "speech.audio.error", **out.error.body()})
            return
        elif isinstance(out, Ended):
            if out.tail:
                yield _event({"type": "speech.audio.delta", "audio": base64.b64encode(out.tail).decode()})
            if aligner is not None and (done := words.add(_seconds(aligner.rest())) + words.finish()):
                yield _timestamps(done)
            timing = meter.finish()
            stats = out.stats
            assert stats.finish_reason is not None, "an ended turn's stats say why it ended"
            yield _event({"type": "speech.audio.done",
                          "usage": {"input_tokens": input_tokens, "output_tokens": stats.frames,
                                    "total_tokens": input_tokens + stats.frames},
                          "finish_reason": stats.finish_reason.value,
                          "metrics": {**timing, "frames": stats.frames, "audio_seconds": round(meter.audio_s, 3),
                                      "elapsed_ms": timing["total_ms"]}})


def _seconds(span: Span | None) -> dict | None:
    return span.seconds() if span is not None else None


def _timestamps(words: list[dict]) -> bytes:
    """The SSE event of the words whose audio has been sent (after that audio's delta)."""
    return _event({"type": "speech.audio.timestamps", "timestamps": words})


def _event(payload: dict) -> bytes:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()
