"""More pipecat voice agents than the server has slots, each pipecat's ElevenLabsTTSService unmodified on its
own socket: run in pipecat's own venv. Usage: python pipecat_agents.py WS_URL OUT.json, with stdin
``{"agents": N, "turns": [[token, ...], ...], "pause_s": S}``.

Every agent speaks every turn (token-streamed between LLMFullResponseStart/End), listens ``pause_s`` between
turns, and keeps its socket open until every agent has spoken every turn, as overlapping calls do: a server
whose slots belong to open sockets can never serve the agents beyond its slots. Writes each agent's
utterances (PCM base64, rate, words)."""

from __future__ import annotations

import asyncio
import base64
import json
import sys

from pipecat.frames.frames import EndFrame
from pipecat.pipeline.runner import PipelineRunner
from pipecat_elevenlabs import tts_pipeline, utterance

TURN_TIMEOUT_S = 300        # beyond the server's queue timeout: a refused turn fails here, it never hangs


async def agent(url: str, turns: list[list[str]], pause_s: float, all_spoken: asyncio.Barrier) -> list[dict]:
    task, collector = tts_pipeline(url)
    run = asyncio.create_task(PipelineRunner(handle_sigint=False).run(task))
    try:
        for i, tokens in enumerate(turns):
            if i:
                await asyncio.sleep(pause_s)            # the user speaks; the socket stays open
            collector.stopped.clear()
            await utterance(task, tokens)
            await asyncio.wait_for(collector.stopped.wait(), TURN_TIMEOUT_S)
        await asyncio.wait_for(all_spoken.wait(), TURN_TIMEOUT_S * len(turns))
    finally:
        await task.queue_frame(EndFrame())
        await asyncio.wait_for(run, 60)
    return [{"pcm": base64.b64encode(u["pcm"]).decode(), "rate": u.get("rate"), "words": u["words"]}
            for u in collector.utterances]


async def main(url: str, out: str) -> None:
    plan = json.loads(sys.stdin.read())
    all_spoken = asyncio.Barrier(plan["agents"])
    agents = await asyncio.gather(*[agent(url, plan["turns"], plan["pause_s"], all_spoken)
                                    for _ in range(plan["agents"])])
    with open(out, "w") as f:
        json.dump({"agents": agents}, f)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
