"""pipecat's ElevenLabsTTSService, unmodified, against a server: run in pipecat's own venv (it pins
protobuf<7, which ours cannot share). Usage: python pipecat_elevenlabs.py WS_URL OUT.json

Speaks two bot utterances as an LLM would (token-streamed text frames between LLMFullResponseStart/End),
then a third that is interrupted after 1.5 s of its audio while its text is still streaming, a fourth, and a
fifth interrupted after 1.5 s of audio once the LLM has finished (pipecat has sent flush and close_context: the
interruption sends a second close_context). Writes the PCM of each (base64), the word timestamps pipecat derived
from the alignment, and for an interrupted one what it had when the interruption was queued."""

from __future__ import annotations

import asyncio
import base64
import json
import sys

from pipecat.frames.frames import (
    EndFrame,
    InterruptionFrame,
    LLMFullResponseEndFrame,
    LLMFullResponseStartFrame,
    LLMTextFrame,
    TTSAudioRawFrame,
    TTSStoppedFrame,
    TTSTextFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.runner import PipelineRunner
from pipecat.pipeline.task import PipelineParams, PipelineTask
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.services.elevenlabs.tts import ElevenLabsTTSService
from pipecat.services.tts_service import TextAggregationMode


class Collector(FrameProcessor):
    def __init__(self):
        super().__init__()
        self.utterances: list[dict] = []
        self.current: dict | None = None
        self.stopped = asyncio.Event()
        self.heard = asyncio.Event()            # the current utterance has heard_bytes of audio
        self.heard_bytes = 0

    def _cur(self) -> dict:
        if self.current is None:
            self.current = {"pcm": b"", "words": []}
            self.utterances.append(self.current)
        return self.current

    async def process_frame(self, frame, direction: FrameDirection):
        await super().process_frame(frame, direction)
        if isinstance(frame, TTSAudioRawFrame):
            self._cur()["pcm"] += frame.audio
            self._cur()["rate"] = frame.sample_rate
            if self.heard_bytes and len(self._cur()["pcm"]) >= self.heard_bytes:
                self.heard.set()
        elif isinstance(frame, TTSTextFrame):
            self._cur()["words"].append([frame.text, frame.pts])
        elif isinstance(frame, InterruptionFrame) and self.current is not None:
            # what had come out of the TTS service when the interruption passed it
            self.current["at_interruption"] = {"pcm_bytes": len(self.current["pcm"]),
                                               "words": len(self.current["words"])}
        elif isinstance(frame, TTSStoppedFrame):
            self.current = None
            self.stopped.set()
        await self.push_frame(frame, direction)


async def utterance(task: PipelineTask, tokens: list[str]) -> None:
    await task.queue_frames([LLMFullResponseStartFrame(), *[LLMTextFrame(t) for t in tokens],
                             LLMFullResponseEndFrame()])


async def interrupted(task: PipelineTask, collector: Collector, frames: list) -> None:
    """Queue ``frames``, interrupt once 1.5 s of their audio has come (the collector notes what had come
    when the interruption reaches it)."""
    collector.heard.clear()
    collector.heard_bytes = int(1.5 * 24000) * 2
    await task.queue_frames(frames)
    await asyncio.wait_for(collector.heard.wait(), 120)
    collector.heard_bytes = 0
    await task.queue_frame(InterruptionFrame())
    await asyncio.sleep(1.5)
    collector.current = None            # an interrupted utterance gets no TTSStoppedFrame


def tts_pipeline(url: str) -> tuple[PipelineTask, Collector]:
    """ElevenLabsTTSService on ``url`` (24 kHz, token aggregation) into a collector, as a pipeline task."""
    tts = ElevenLabsTTSService(api_key="unused-key", url=url, sample_rate=24000,
                               settings=ElevenLabsTTSService.Settings(voice="default", model="eleven_flash_v2_5"),
                               text_aggregation_mode=TextAggregationMode.TOKEN)
    collector = Collector()
    task = PipelineTask(Pipeline([tts, collector]), params=PipelineParams(audio_out_sample_rate=24000),
                        cancel_on_idle_timeout=False)
    return task, collector


async def main(url: str, out: str) -> None:
    text = json.loads(sys.stdin.read())
    task, collector = tts_pipeline(url)
    run = asyncio.create_task(PipelineRunner(handle_sigint=False).run(task))
    result: dict = {}
    try:
        for key in ("first", "second"):
            collector.stopped.clear()
            await utterance(task, text[key])
            await asyncio.wait_for(collector.stopped.wait(), 120)
        # the LLM is still writing when the user barges in: no LLMFullResponseEndFrame before the interruption
        await interrupted(task, collector, [LLMFullResponseStartFrame(), *[LLMTextFrame(t) for t in text["long"]]])
        collector.stopped.clear()
        await utterance(task, text["after"])
        await asyncio.wait_for(collector.stopped.wait(), 120)
        # the LLM has finished (flush and close_context sent) when the user barges in
        await interrupted(task, collector, [LLMFullResponseStartFrame(), *[LLMTextFrame(t) for t in text["long"]],
                                            LLMFullResponseEndFrame()])
        result["utterances"] = [{"pcm": base64.b64encode(u["pcm"]).decode(), "rate": u.get("rate"),
                                 "words": u["words"], "at_interruption": u.get("at_interruption")}
                                for u in collector.utterances]
    finally:
        await task.queue_frame(EndFrame())
        await asyncio.wait_for(run, 60)
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
