"""ElevenLabs ``output_format`` names onto :class:`app.audio_formats.StreamEncoder` settings."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..audio_formats import StreamEncoder
from ..errors import ApiError

DEFAULT_OUTPUT_FORMAT = "mp3_44100_128"   # ElevenLabs' default
PCM_RATES = (8000, 16000, 22050, 24000, 44100, 48000)
MP3_FORMATS = {(22050, 32), (24000, 48), (44100, 32), (44100, 64), (44100, 96), (44100, 128), (44100, 192)}
OPUS_KBPS = (32, 64, 96, 128, 192)
_NAME = re.compile(r"^(pcm|ulaw|alaw|mp3|opus)_(\d{4,5})(?:_(\d{2,3}))?$")


@dataclass(frozen=True)
class OutputFormat:
    name: str
    encoding: str            # a StreamEncoder format
    sample_rate: int
    bit_rate: int | None = None

    def encoder(self, model_rate: int) -> StreamEncoder:
        return StreamEncoder(self.encoding, model_rate, out_rate=self.sample_rate, bit_rate=self.bit_rate)


def supported_names() -> list[str]:
    return ([f"pcm_{r}" for r in PCM_RATES] + ["ulaw_8000", "alaw_8000"]
            + [f"mp3_{r}_{k}" for r, k in sorted(MP3_FORMATS)] + [f"opus_48000_{k}" for k in OPUS_KBPS])


def parse_output_format(name: str | None) -> OutputFormat:
    """``pcm_16000``, ``ulaw_8000``, ``mp3_44100_128``, ``opus_48000_64``, ...; ``mp3_44100`` (no bitrate,
    as older clients send) means 128 kb/s. Anything else is a 400 naming the accepted values."""
    name = name or DEFAULT_OUTPUT_FORMAT
    m = _NAME.match(name)
    ok = False
    if m:
        kind, rate, kbps = m.group(1), int(m.group(2)), int(m.group(3)) if m.group(3) else None
        if kind == "pcm":
            ok = rate in PCM_RATES and kbps is None
        elif kind in ("ulaw", "alaw"):
            ok = rate == 8000 and kbps is None
        elif kind == "mp3":
            kbps = kbps or 128
            ok = (rate, kbps) in MP3_FORMATS
        else:
            ok = rate == 48000 and kbps in OPUS_KBPS
    if not ok:
        raise ApiError("invalid_output_format",
                       f"unsupported output_format {name!r}; use one of {', '.join(supported_names())}",
                       "output_format")
    return OutputFormat(name, kind, rate, kbps * 1000 if kbps else None)
