"""``POST /dev/captioned_speech``: Kokoro-FastAPI's audio with word timestamps (n8n, subtitle and read-along
apps), from the speech clock of the ElevenLabs ``/with-timestamps`` routes.

The body is OpenAI's speech request (``app.schemas.CaptionedSpeechRequest``). ``stream`` (default true):
one JSON object a line (``application/x-ndjson``), ``{"audio": <base64 of the encoded audio>, "audio_format":
<its content type>, "timestamps": [{"word", "start_time", "end_time"}, ...]}``, each line the audio of a frame
and the words spoken by its end (a frame an encoder holds back carries its words on to the next line; a last
line with no audio has the words still open at the end). ``stream: false``: one such object, the whole audio
and every word, re-timed knowing where the speech ended. Times are seconds from the start of the audio. See
docs/api-openai.md.
"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from ..alignment.contract import FrameAligner
from ..alignment.words import WordTimestamps, words_of
from ..audio_formats import whole_file
from ..schemas import CaptionedSpeechRequest
from ..service import TTSService
from ..session.aligned import AlignedAudio, aligned_audio, whole_aligned
from ..session.http import StreamedResponse, whole
from ..session.policy import require_key
from ..session.speech import reply_headers, start_speech

router = APIRouter()
ENDPOINT = "/dev/captioned_speech"
NDJSON = "application/x-ndjson"       # Kokoro-FastAPI says application/json of its lines; they are not one document


@router.post(ENDPOINT, dependencies=[Depends(require_key)],
             responses={200: {"content": {"application/json": {}, NDJSON: {}},
                              "description": "audio (base64) with word timestamps: one object (stream false), or "
                                             "one a line while it is generated"}})
async def captioned_speech(body: CaptionedSpeechRequest, request: Request):
    utterance, end = await start_speech(body, request, "http", ENDPOINT)
    aligner = utterance.aligner() if body.return_timestamps else None
    chunks = aligned_audio(end, aligner, utterance.text)
    encoder = end.turn.encoder
    assert encoder is not None, "start_speech made the reply's encoder"
    fmt = encoder.content_type
    headers = {**reply_headers(body, request),
               "Content-Disposition": f"attachment; filename=speech.{body.response_format}"}
    if not body.stream:
        reply = await whole(request, end, _whole(chunks, aligner, body.response_format))
        return JSONResponse({"audio": reply[0], "audio_format": fmt, "timestamps": reply[1]} if reply else {},
                            headers=headers)
    service: TTSService = request.app.state.service
    return StreamedResponse(_lines(chunks, fmt), end, service.policy.stall_timeout, media_type=NDJSON,
                            headers=headers)


async def _whole(chunks: AsyncIterator[AlignedAudio], aligner: FrameAligner | None,
                 fmt: str) -> tuple[str, list[dict] | None]:
    if aligner is None:
        audio = b"".join([data async for data, _, _ in chunks])
        return base64.b64encode(whole_file(fmt, audio)).decode(), None
    reply = await whole_aligned(chunks, aligner)
    audio = whole_file(fmt, base64.b64decode(reply["audio_base64"]))
    return base64.b64encode(audio).decode(), words_of(reply["alignment"])


async def _lines(chunks: AsyncIterator[AlignedAudio], fmt: str) -> AsyncIterator[bytes]:
    words = WordTimestamps()
    held: list[dict] = []              # words of frames whose audio the encoder has not given out yet
    async for data, alignment, _ in chunks:
        held += words.add(alignment)
        if data:
            yield _line(data, fmt, held)
            held = []
    held += words.finish()
    if held:                           # the last word, and any the last audio did not carry
        yield _line(b"", fmt, held)


def _line(data: bytes, fmt: str, timestamps: list[dict]) -> bytes:
    return (json.dumps({"audio": base64.b64encode(data).decode(), "audio_format": fmt, "timestamps": timestamps},
                       separators=(",", ":")) + "\n").encode()
