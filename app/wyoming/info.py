"""``describe`` → ``info``: one TTS program, mossrt, with every voice a Wyoming request may name and streaming
input.

Home Assistant lists a program's installed voices per language and offers each by its ``description``; a voice's
``name`` is what comes back in ``synthesize``'s ``voice.name`` and goes to :meth:`TTSService.resolve_voice`."""

from __future__ import annotations

from wyoming.info import Attribution, Info, TtsProgram, TtsVoice

from ..service import MODEL_ID, TTSService

LANGUAGES = ["en", "zh"]             # what MOSS-TTS-Realtime was trained to read
ATTRIBUTION = Attribution(name="OpenMOSS", url="https://huggingface.co/OpenMOSS-Team/MOSS-TTS-Realtime")
KINDS = {"builtin": "the model's own voice", "openai": "OpenAI's name for the model's own voice",
         "uploaded": "uploaded voice"}


def describe(service: TTSService, version: str, uploaded: bool = True) -> Info:
    """The server's ``info``: the voices of :meth:`TTSService.list_voices` (``default``, OpenAI's names, then
    the uploaded ones by name, unless ``uploaded`` is false: ``--wyoming-voices builtin``). Reads the voice
    registry: call off the event loop."""
    voices = [TtsVoice(name=v.name if v.kind == "uploaded" else v.id, description=f"{v.name} ({KINDS[v.kind]})",
                       attribution=ATTRIBUTION, installed=True, version=version, languages=list(LANGUAGES))
              for v in service.list_voices() if uploaded or v.kind != "uploaded"]
    program = TtsProgram(name="mossrt", description=f"mossrt: {MODEL_ID}", attribution=ATTRIBUTION, installed=True,
                         version=version, voices=voices, supports_synthesize_streaming=True)
    return Info(tts=[program])
