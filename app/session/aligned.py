"""An HTTP reply's audio with its character alignment: each frame's encoded audio beside the span it aligns,
streamed (the ElevenLabs ``/stream/with-timestamps`` lines, the captioned speech's lines) or whole, re-timed
knowing where the speech ended (``/with-timestamps``, ``stream: false``)."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterable, AsyncIterator
from typing import NamedTuple, TypedDict

from ..alignment.contract import FrameAligner
from ..alignment.paired import normalized_span
from .http import StreamEnd, outs
from .pump import Audio, Failed

# Span.seconds(): ``characters`` and their ``character_start_times_seconds`` / ``character_end_times_seconds``
Alignment = dict[str, list[object]]


class AlignedAudio(NamedTuple):
    """A frame's encoded audio (or the encoder's tail) and its alignments, in seconds from the start (None:
    nothing aligned, or no aligner)."""

    data: bytes
    alignment: Alignment | None              # over the text as sent
    normalized: Alignment | None             # over the text the model read (the same unless normalized)


class WholeAligned(TypedDict):
    """The whole reply, in ElevenLabs' ``/with-timestamps`` shape."""

    audio_base64: str
    alignment: Alignment
    normalized_alignment: Alignment


async def aligned_audio(end: StreamEnd, aligner: FrameAligner | None, text: str) -> AsyncIterator[AlignedAudio]:
    """Each frame's :class:`AlignedAudio`, then the tail's. ``aligner``: an
    :class:`~app.alignment.paired.Alignments` (the normalized alignment is its own), any other aligner (the
    same span twice), or None (no alignment)."""
    if aligner is not None:
        aligner.add(text)
    async for out in outs(end):
        if isinstance(out, Failed):
            return                               # logged and counted by outs; the body just ends
        if aligner is None:
            span = None
        elif isinstance(out, Audio):
            span = aligner.frame(out.frame.text_chars, out.frame.audio)
        else:
            span = aligner.rest()
        norm = normalized_span(aligner, span)
        yield AlignedAudio(out.data if isinstance(out, Audio) else out.tail,
                           span.seconds() if span is not None else None, norm.seconds() if norm is not None else None)


def _merged() -> Alignment:
    return {"characters": [], "character_start_times_seconds": [], "character_end_times_seconds": []}


async def whole_aligned(chunks: AsyncIterable[AlignedAudio], aligner: FrameAligner) -> WholeAligned:
    """The whole reply: its audio once, and its alignments (``chunks`` of :func:`aligned_audio`) re-timed
    knowing where the speech ended (the speech clock; the read clock's spans as they came)."""
    audio: list[bytes] = []
    merged, normalized = _merged(), _merged()
    async for data, alignment, normalized_part in chunks:
        audio.append(data)
        for whole_of, part in ((merged, alignment), (normalized, normalized_part)):
            if part:
                for key in whole_of:
                    whole_of[key] += part[key]
    final = aligner.final()
    if final is not None:
        merged = final.seconds()
        norm = normalized_span(aligner, final)
        normalized = norm.seconds() if norm is not None else normalized
    return {"audio_base64": base64.b64encode(b"".join(audio)).decode(), "alignment": merged,
            "normalized_alignment": normalized}
