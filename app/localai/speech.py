"""The LocalAI backend's speech: ``TTS`` (a WAV written to ``dst``) and ``TTSStream`` (the sample rate, then
s16le PCM as frames are generated), both from one PCM pump that the client's cancellation stops."""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Generator

import grpc
import numpy as np

from engine.errors import EngineError
from engine.serving.handles import QueueSink
from engine.serving.stream import FinishReason

from ..audio_formats import StreamEncoder
from ..metrics import Metrics, StreamMeter
from ..session.pump import Audio, Ended, Failed, TurnAudio, blocking_pump
from ..session.utterance import Utterance, prepare_utterance
from . import backend_pb2
from .lifecycle import Loaded, ModelLifecycle
from .options import TTSParams, parse_tts_params
from .output import DstRefused, DstWriteFailed, OutputFile
from .rpc_status import Abort
from .voices import VoiceFiles

log = logging.getLogger("mossrt.localai")
pb: Any = backend_pb2           # its message classes are built at import time: no type knows them

EVENT_POLL_SECONDS = 0.25                               # how often a waiting request looks at its RPC


@dataclass(frozen=True)
class _Job:
    utterance: Utterance
    speed: float
    sample_rate: int


class _SendWatch:
    """A call's sends, watched by one thread: a send that takes longer than ``seconds`` calls ``on_stall``
    once (the stall timeout, as for every transport)."""

    def __init__(self, seconds: float, on_stall: Callable[[], None]):
        self.seconds, self.on_stall = seconds, on_stall
        self._since: float | None = None
        self._stop = threading.Event()
        threading.Thread(target=self._run, name="localai-send-watch", daemon=True).start()

    def sending(self) -> None:
        self._since = time.monotonic()

    def sent(self) -> None:
        self._since = None

    def close(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(min(0.25, self.seconds / 4)):
            since = self._since
            if since is not None and time.monotonic() - since > self.seconds:
                self.on_stall()
                return


class Speech:
    """``TTS`` and ``TTSStream`` on the model ``lifecycle`` holds, with the voices ``voices`` resolves; every
    failure is raised (an :class:`Abort` or an error ``rpc_status`` maps), never answered here."""

    def __init__(self, lifecycle: ModelLifecycle, voices: VoiceFiles, metrics: Metrics):
        self.lifecycle = lifecycle
        self.voices = voices
        self.metrics = metrics

    def tts(self, request: Any, context: grpc.ServicerContext | None) -> Any:
        """The utterance written as a WAV to ``request.dst``; a ``Result``."""
        loaded = self.lifecycle.require(request)
        job = self._prepare(loaded, request)
        with self._check_dst(loaded, request.dst) as out:        # its folder held open until written
            pcm = b"".join(self._pcm(loaded, job, context, "TTS"))
            samples = np.frombuffer(pcm, dtype="<i2")
            try:
                out.write_wav(samples, job.sample_rate)
            except DstRefused as e:
                raise Abort(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
            except DstWriteFailed as e:
                raise Abort(grpc.StatusCode.INTERNAL, str(e)) from None
        return pb.Result(success=True, message=f"{samples.size / job.sample_rate:.2f} s -> {out.path}")

    def stream(self, request: Any, context: grpc.ServicerContext | None) -> Generator[Any, None, None]:
        """The sample rate, then the audio as it is generated. gRPC's send of each reply waits for the caller
        to take it (flow control): one it does not take within the stall timeout cancels the call, which
        closes the stream (its slot freed), as every other transport does."""
        loaded = self.lifecycle.require(request)
        job = self._prepare(loaded, request)
        pieces = self._pcm(loaded, job, context, "TTSStream")
        stall = loaded.service.policy.stall_timeout

        def stalled():
            self.metrics.stalled.labels("localai").inc()
            log.warning("TTSStream: the caller took no audio for %g s; call cancelled", stall)
            if context is not None:
                context.cancel()

        watch = _SendWatch(stall, stalled)
        try:
            first = next(pieces, None)           # the turn is admitted (or failed) before any reply is sent
            replies = [pb.Reply(message=json.dumps({"sample_rate": job.sample_rate}).encode())]
            for data in itertools.chain([first], pieces):
                if data:
                    replies.append(pb.Reply(audio=data))
                for reply in replies:
                    watch.sending()
                    yield reply                  # returns once gRPC has sent it
                    watch.sent()
                replies = []
        finally:
            watch.close()
            pieces.close()

    # ------------------------------------------------------------------ request plumbing
    def _prepare(self, loaded: Loaded, request: Any) -> _Job:
        service = loaded.service
        p: TTSParams = parse_tts_params(request.params)
        if p.ignored:
            log.debug("ignoring params %s", ", ".join(p.ignored))
        voice = self.voices.resolve(loaded, request.voice)
        utterance = prepare_utterance(service, request.text, voice, p.sampling, p.max_frames, param="text")
        return _Job(utterance, speed=p.speed, sample_rate=loaded.model.codec.sample_rate)

    def _pcm(self, loaded: Loaded, job: _Job, context: grpc.ServicerContext | None,
             rpc: str) -> Generator[bytes, None, None]:
        """The utterance as s16le PCM (at the job's speed), a piece per frame as the scheduler delivers it, then
        the encoder's tail.

        Cancellation: a callback registered on the RPC cancels the engine's turn and closes the stream the
        moment gRPC sees the client go (cancel, deadline, disconnect), whichever thread this one is in; the
        pump notices within EVENT_POLL_SECONDS and ends with CANCELLED. The stream is closed however the
        loop ends (its KV slot freed at the next step boundary)."""
        service = loaded.service
        gone = threading.Event()          # the client went away
        finished = threading.Event()      # the turn ended normally (or this generator is done)
        box: list = []                    # the handle, once admitted

        def on_rpc_done():
            if not finished.is_set():
                gone.set()
                for handle in box:
                    try:
                        handle.cancel()
                    except EngineError:
                        pass
                    handle.close()

        frames = 0
        t0 = time.monotonic()
        handle = None
        try:
            if context is not None and not context.add_callback(on_rpc_done):
                raise Abort(grpc.StatusCode.CANCELLED, "the client went away")
            wait = service.settings.queue_timeout
            left = context.time_remaining() if context is not None else None
            if left is not None:
                wait = max(0.0, min(wait, left))
            handle = job.utterance.start_blocking(service, QueueSink(), wait)
            box.append(handle)
            if gone.is_set():
                handle.close()
            meter = StreamMeter(self.metrics, "localai")
            turn = TurnAudio(meter, encoder=StreamEncoder("pcm", job.sample_rate, job.speed))
            client_gone = lambda: gone.is_set() or (context is not None and not context.is_active())
            for out in blocking_pump(handle, turn, client_gone, EVENT_POLL_SECONDS):
                if isinstance(out, Audio):
                    frames += 1
                    yield out.data
                elif isinstance(out, Failed):
                    if self.lifecycle.loaded is not loaded:
                        raise Abort(grpc.StatusCode.UNAVAILABLE, "the model was unloaded (Free) during the request")
                    raise out.error
                elif isinstance(out, Ended):
                    if out.stats.finish_reason == FinishReason.CANCELLED or gone.is_set():
                        gone.set()
                        raise Abort(grpc.StatusCode.CANCELLED, "cancelled by the client")
                    finished.set()
                    log.info("%s: %d frames (%s) in %.2f s", rpc, frames,
                             out.stats.finish_reason.value if out.stats.finish_reason else "done",
                             time.monotonic() - t0)
                    yield out.tail
                    return
            gone.set()                                   # the pump returned: the client is gone
            raise Abort(grpc.StatusCode.CANCELLED, "cancelled by the client")
        except GeneratorExit:
            gone.set()
            raise
        finally:
            finished.set()
            if handle is not None:
                handle.close()
            if gone.is_set():
                log.info("%s: cancelled by the client after %d frames; stream closed", rpc, frames)

    @staticmethod
    def _check_dst(loaded: Loaded, dst: str) -> OutputFile:
        """Where ``TTS`` may write (app/localai/output.py): a new file (LocalAI names a new one in its
        generated-content folder, which it has created) in an existing, writable folder, inside ``output_dir``
        when that option is set, and never inside the model, voices or reference folders; its folder is
        opened now and the WAV written relative to it. Every refused path gets the same error, so ``dst``
        cannot probe the file system."""
        if not dst.strip():
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, "dst: the output WAV path is empty")
        opts = loaded.config.options
        protected: list[str | Path | None] = [loaded.config.model_path, loaded.bundle_dir, loaded.service.voices.dir,
                                              opts.reference_dir]
        try:
            return OutputFile(dst, protected, opts.output_dir)
        except DstRefused as e:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
