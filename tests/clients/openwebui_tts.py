"""Open WebUI's own TTS voice and model lists (``open_webui.routers.audio``: what its settings page and voice
menu call), unmodified, against a mossrt server: its ``openai`` engine at ``BASE/v1`` and its ``elevenlabs``
engine at ``BASE`` (``ELEVENLABS_API_BASE_URL``, read when Open WebUI is imported: the test sets it).

Run in Open WebUI's own venv (tests/clients/requirements-openwebui*.txt). Usage: openwebui_tts.py BASE KEY OUT.json
— writes {engine: {"voices": the /api/v1/audio/voices reply, "models": the /api/v1/audio/models reply}}."""

import asyncio
import json
import sys


async def main(base: str, key: str, out: str) -> None:
    from open_webui.models.config import Config
    from open_webui.routers import audio

    replies = {}
    for engine, url in (("openai", base + "/v1"), ("elevenlabs", base)):
        # what Open WebUI's admin settings save (update_audio_config), set the same way
        await Config.upsert({"audio.tts.engine": engine, "audio.tts.openai.api_base_url": url,
                             "audio.tts.openai.api_key": key, "audio.tts.api_key": key})
        replies[engine] = {"voices": await audio.get_voices(None, user=None),
                           "models": await audio.get_models(None, user=None)}
    with open(out, "w") as f:
        json.dump(replies, f)


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
