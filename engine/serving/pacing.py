"""Codec pacing: when each stream's generated frames are decoded to audio, and handing them back in order.

A turn's first frame is decoded at once, later frames in chunks that grow along the codec schedule (fewer,
larger calls), but never later than the stream's playback needs them; one batched codec call per tick, and
frames are handed back, in order, once their audio exists.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from engine.audio.codec import MAX_FRAMES_PER_CALL
from engine.audio.codec_stream import StreamingDecoder
from engine.model.buckets import bucket_for
from engine.serving.isolation import fail_entry, run_isolated
from engine.serving.slots import SlotEntry, SlotTable
from engine.serving.stream import Frame
from engine.serving.tick import TickResult

if TYPE_CHECKING:
    from engine.model.tts import TTSModel


def frames_to_decode(available: int, ended: bool, target: int, ahead_s: float | None, tick_s: float,
                     codec_call_s: float, frame_s: float) -> int:
    """How many of a stream's ``available`` generated frames the codec decodes now (0: wait for more).

    A chunk of ``target`` frames (the schedule's size for this call) once there are that many; everything
    when the turn has ended. Earlier, with fewer frames, only to keep playback going: when the listener's
    remaining audio (``ahead_s``) would run out before the next tick and codec call could deliver. A listener
    already starved (``ahead_s <= 0``) of a stream that generates slower than real time gains nothing from
    small calls, which cost the codec's whole weight read each: such a stream keeps the schedule's chunk,
    the fastest way through its remaining audio.
    """
    if ended:
        return min(available, MAX_FRAMES_PER_CALL)
    if available >= target:
        return target
    if ahead_s is not None and ahead_s <= 2 * (tick_s + codec_call_s) and (ahead_s > 0 or tick_s < frame_s):
        return available
    return 0


class CodecPacer:
    """The codec calls of a runner's ticks over ``table``'s slots: which pending frames are due, their batched
    decode, and their hand-back. ``codec_schedule``: frames per codec call along a turn (the last repeats)."""

    def __init__(self, model: TTSModel, table: SlotTable, decoder: StreamingDecoder, codec_schedule: tuple[int, ...],
                 bucket_sizes: tuple[int, ...]):
        self.model = model
        self.table = table
        self.decoder = decoder
        self.codec_schedule = codec_schedule
        # the only frame counts a codec call takes (fixed shapes per batch): the schedule's sizes and 1, so
        # any due count splits into them (see call_frames)
        self.call_sizes = tuple(sorted(set(codec_schedule) | {1}))
        self.bucket_sizes = bucket_sizes
        self.warmed = False                         # warm_up ran: codec calls take bucketed stream counts
        self._frame_s = model.codec.frame_seconds
        self._tick_s = 0.0                          # running mean of a working tick's duration
        self._codec_call_s = 0.0                    # running mean of a codec call's duration

    def warm_up(self) -> None:
        """The codec's calls at each bucket's stream count and each of ``call_sizes``, on rows of 0 frames."""
        self.decoder.warm([(n, frames) for n in self.bucket_sizes for frames in self.call_sizes])
        self.warmed = True

    def note_tick(self, spent: float) -> None:
        """A working tick took ``spent`` seconds (the running mean that paces early decodes)."""
        self._tick_s = spent if not self._tick_s else 0.8 * self._tick_s + 0.2 * spent

    def call_frames(self, wanted: int) -> int:
        """Frames of the next codec call when ``wanted`` are due: the largest allowed size not above it; the
        rest stays pending for the next tick (one call per tick, so a failed call is retried whole)."""
        return max(n for n in self.call_sizes if n <= wanted)

    def _due(self, e: SlotEntry, now: float) -> list[Frame]:
        """The pending frames whose audio is decoded now: the head of the pending list up to the turn's
        chunk size, all of it when the turn ended, or when waiting longer would starve the listener."""
        turn = e.pending[0].turn
        if e.codec_turn != turn:     # the previous turn is all handed back: start this one's codec stream
            self.decoder.reset(e.slot)   # each turn's audio is its own codec stream (as upstream)
            e.codec_turn, e.chunks, e.play_start, e.audio_s = turn, 0, None, 0.0
        same = [f for f in e.pending if f.turn == turn]
        audio = [f for f in same if f.needs_audio]
        if not audio:
            return []
        ended = len(same) < len(e.pending) or e.stream.turn_serial != turn or e.stream.turn_done or e.stream.closed
        ahead = None if e.play_start is None else e.play_start + e.audio_s - now
        target = self.codec_schedule[min(e.chunks, len(self.codec_schedule) - 1)]
        return audio[:frames_to_decode(len(audio), ended, target, ahead, self._tick_s, self._codec_call_s,
                                       self._frame_s)]

    def seconds_until_audio_due(self) -> float | None:
        """When pending frames are next due: 0 now (frames to decode or hand back), the seconds until some
        listener's audio runs low enough for pending frames to be decoded early, or None when nothing changes
        until a stream does."""
        now, soonest = time.monotonic(), None
        for e in self.table.entries:
            if not e.pending:
                continue
            if not e.pending[0].needs_audio or self._due(e, now):
                return 0.0
            if e.play_start is not None:
                wait = e.play_start + e.audio_s - now - 2 * (self._tick_s + self._codec_call_s)
                if wait > 0:
                    soonest = wait if soonest is None else min(soonest, wait)
        return soonest

    def hand_back(self, result: TickResult) -> None:
        """Decode the due frames (one batched codec call), then hand back every stream's frames whose audio
        exists, in order, and the turns whose frames are all handed back."""
        now = time.monotonic()
        due = [(e, fs) for e in self.table.entries if e.pending for fs in [self._due(e, now)] if fs]
        if due:
            self._decode(due, result)
        for e in self.table.entries:
            while e.pending and (e.pending[0].audio is not None or not e.pending[0].needs_audio):
                frame = e.pending.pop(0)
                result.frames.append((e.stream, frame))
            if not e.pending:
                for turn, stats in e.stream.take_finished():
                    result.turn_ends.append((e.stream, turn, stats))

    def _decode(self, due: list[tuple[SlotEntry, list[Frame]]], result: TickResult) -> None:
        size = self.call_frames(max(len(fs) for _, fs in due))
        due = [(e, fs[:size]) for e, fs in due]

        def run(group: list[tuple[SlotEntry, list[Frame]]]) -> list[np.ndarray]:
            hi = max(e.slot for e, _ in group) + 1
            if self.warmed:             # the warmed shapes: rows past the highest due slot ride with 0 frames
                hi = bucket_for(hi, self.bucket_sizes)
            codes = np.zeros((hi, size, self.model.codec.num_quantizers), np.int64)
            count = np.zeros(hi, np.int64)
            for e, fs in group:
                for i, f in enumerate(fs):
                    codes[e.slot, i, : len(f.codes)] = f.codes
                count[e.slot] = len(fs)
            t0 = time.perf_counter()
            audio = self.decoder.decode_checked(codes, count)
            spent = time.perf_counter() - t0
            self._codec_call_s = spent if not self._codec_call_s else 0.8 * self._codec_call_s + 0.2 * spent
            return [audio[e.slot] for e, _ in group]

        def commit(item: tuple[SlotEntry, list[Frame]], audio: np.ndarray) -> None:
            e, fs = item
            spf = self.model.codec.samples_per_frame
            for i, f in enumerate(fs):
                f.audio = audio[i * spf:(i + 1) * spf]
            e.chunks += 1
            e.play_start = time.monotonic() if e.play_start is None else e.play_start
            e.audio_s += len(fs) * self._frame_s

        result.worked = True
        failed_before = len(result.failed)
        run_isolated(run, commit, due, lambda item, exc: fail_entry(item[0], exc, result))
        for stream, _ in result.failed[failed_before:]:     # a stream whose audio failed: hand back what it has
            for e in self.table.entries:
                if e.stream is stream:
                    for f in e.pending:
                        if f.audio is None:
                            f.audio = np.zeros(0, np.float32)
