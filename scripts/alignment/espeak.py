"""espeak-ng (Debian's ``libespeak-ng1``) through its C API: speech for a text at a rate, and the time each word
starts in it, from espeak-ng's own word events (the position in the text of each word and the sample at which
its sound begins). The ground truth the speech clock is measured against."""

from __future__ import annotations

import ctypes
import ctypes.util
from dataclasses import dataclass

import numpy as np

AUDIO_OUTPUT_SYNCHRONOUS, POS_CHARACTER, CHARS_UTF8 = 2, 1, 1
EVENT_LIST_TERMINATED, EVENT_WORD = 0, 1
PARAM_RATE = 1
TARGET_RATE = 24000


class _Id(ctypes.Union):
    _fields_ = [("number", ctypes.c_int), ("name", ctypes.c_char_p), ("string", ctypes.c_char * 8)]


class _Event(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("unique_identifier", ctypes.c_uint), ("text_position", ctypes.c_int),
                ("length", ctypes.c_int), ("audio_position", ctypes.c_int), ("sample", ctypes.c_int),
                ("user_data", ctypes.c_void_p), ("id", _Id)]


_Callback = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.POINTER(_Event))


@dataclass(frozen=True)
class Word:
    start: int          # index of its first character in the text
    length: int         # characters
    time_s: float       # when its sound begins


@dataclass(frozen=True)
class Speech:
    text: str
    audio: np.ndarray   # float32 mono at TARGET_RATE
    words: list[Word]

    @property
    def seconds(self) -> float:
        return len(self.audio) / TARGET_RATE


class Espeak:
    """One espeak-ng engine (the library is a process-wide singleton: make one)."""

    def __init__(self) -> None:
        name = ctypes.util.find_library("espeak-ng") or "libespeak-ng.so.1"
        try:
            self._lib = ctypes.CDLL(name)
        except OSError as e:
            raise RuntimeError(f"espeak-ng is not installed ({e}): apt-get install espeak-ng") from None
        self.rate = self._lib.espeak_Initialize(AUDIO_OUTPUT_SYNCHRONOUS, 500, None, 0)
        if self.rate <= 0:
            raise RuntimeError("espeak-ng failed to initialise (no espeak-ng-data?)")
        self._pcm: list[np.ndarray] = []
        self._words: list[tuple[int, int, int]] = []
        self._callback = _Callback(self._on_synth)      # kept referenced: the library calls it
        self._lib.espeak_SetSynthCallback(self._callback)

    def _on_synth(self, wav, n, events) -> int:
        if n > 0:
            self._pcm.append(np.ctypeslib.as_array(wav, shape=(n,)).copy())
        i = 0
        while events[i].type != EVENT_LIST_TERMINATED:
            e = events[i]
            if e.type == EVENT_WORD:
                self._words.append((e.text_position, e.length, e.sample))
            i += 1
        return 0

    def speak(self, text: str, voice: str = "en", wpm: int = 175) -> Speech:
        """``text`` spoken by ``voice`` at ``wpm`` words a minute, at 24 kHz, with its words' start times."""
        import soxr

        if self._lib.espeak_SetVoiceByName(voice.encode()) != 0:
            raise ValueError(f"espeak-ng has no voice {voice!r}")
        self._lib.espeak_SetParameter(PARAM_RATE, wpm, 0)
        self._pcm, self._words = [], []
        data = text.encode("utf-8")
        if self._lib.espeak_Synth(data, len(data) + 1, 0, POS_CHARACTER, 0, CHARS_UTF8, None, None) != 0:
            raise RuntimeError("espeak_Synth failed")
        self._lib.espeak_Synchronize()
        pcm = np.concatenate(self._pcm).astype(np.float32) / 32768.0 if self._pcm else np.zeros(0, np.float32)
        audio = soxr.resample(pcm, self.rate, TARGET_RATE).astype(np.float32)
        words = [Word(pos - 1, length, sample / self.rate) for pos, length, sample in self._words
                 if 0 < pos <= len(text) and text[pos - 1:pos - 1 + length].strip()]
        return Speech(text, audio, words)
