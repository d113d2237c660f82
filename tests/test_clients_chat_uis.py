"""SillyTavern's and LibreChat's OpenAI-compatible TTS and n8n's HTTP Request node, against a real ``mossrt serve``
(demo bundle): none installs here (all are Node.js servers), so each test sends exactly the request their code
sends, headers included, and reads the answer as they do (docs/clients.md).

- SillyTavern (``public/scripts/extensions/tts/openai-compatible.js`` and the ``/api/openai/custom/generate-voice``
  proxy of ``src/endpoints/openai.js``): POSTs to the "Provider Endpoint" as entered, ``Authorization: Bearer
  <key>`` (``Bearer`` with no key: fetch trims the value's trailing space), ``{input, response_format: "mp3",
  voice, speed, model}``; the voices are the "Available Voices" typed in (default: OpenAI's six), the speed a
  slider of 0.25..4; the answer is read
  whole and played as ``audio/mpeg``.
- LibreChat (``api/server/services/Files/Audio/TTSService.js``, ``speech.tts.openai`` of librechat.yaml):
  POSTs to ``url`` ``{input, model, voice}``, ``Authorization: Bearer <apiKey>`` (the string ``undefined``
  when no apiKey is set), streams the answer into its player as ``audio/mpeg``.
- n8n's HTTP Request node (n8n-nodes-base 2.41, ``nodes/HttpRequest/V3/HttpRequestV3.node.js``), set up as
  docs/clients.md says: the JSON body as entered, Header Auth's header as entered, and the ``accept`` header of
  its default (auto-detected) response format; an ``application/json`` answer is parsed, an ``audio/*`` one
  becomes a binary file.
"""

from __future__ import annotations

import base64
import io

import av
import httpx
import pytest

# the servers of the OpenAI clients' tests: the demo bundle, and with --api-key KEY (speech needs the key)
from test_clients_openai import KEY, keyed, server, upload  # noqa: F401 - fixtures

PREVIEW = "The quick brown fox jumps over the lazy dog"          # SillyTavern's en-US voice preview
SILLYTAVERN_VOICES = ["alloy", "echo", "fable", "onyx", "nova", "shimmer"]   # its default "Available Voices"
N8N_TEXT = "Your parcel left the warehouse this morning and arrives on Friday."
N8N_ACCEPT = ("application/json,text/html,application/xhtml+xml,application/xml,text/*;q=0.9, image/*;q=0.8, "
              "*/*;q=0.7")                                       # the node's accept for an auto-detected response


def mp3_seconds(data: bytes) -> float:
    """The answer decoded as the browser's <audio> does an audio/mpeg body: 24 kHz, some audio."""
    with av.open(io.BytesIO(data), format="mp3") as f:
        stream = f.streams.audio[0]
        samples = sum(frame.samples for frame in f.decode(stream))
        assert stream.rate == 24000
    return samples / 24000


def sillytavern(server, voice: str, key: str | None, speed: float = 1, model: str = "tts-1") -> httpx.Response:
    return httpx.post(server.base + "/v1/audio/speech", timeout=180,
                      headers={"Content-Type": "application/json",
                               "Authorization": f"Bearer {key}" if key else "Bearer"},
                      json={"input": PREVIEW, "response_format": "mp3", "voice": voice, "speed": speed,
                            "model": model})


def librechat(server, voice: str, api_key: str | None, model: str = "tts-1") -> bytes:
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {api_key}" if api_key else "undefined"}
    with httpx.stream("POST", server.base + "/v1/audio/speech", headers=headers, timeout=180,
                      json={"input": "Hello from LibreChat.", "model": model, "voice": voice}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"] == "audio/mpeg"
        return b"".join(r.iter_bytes())


def n8n(server, path: str, body: dict, key: str | None) -> httpx.Response:
    headers = {"accept": N8N_ACCEPT, "content-type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"                 # Header Auth: name Authorization, value Bearer KEY
    return httpx.post(server.base + path, headers=headers, json=body, timeout=180)


@pytest.mark.parametrize("voice", SILLYTAVERN_VOICES)
def test_sillytavern_default_voices_without_a_key(server, voice):
    r = sillytavern(server, voice, key=None)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "audio/mpeg" and mp3_seconds(r.content) > 0


def test_sillytavern_an_uploaded_voice_the_speed_slider_and_any_model_name(server):
    upload(server, "narrator")
    for speed in (0.25, 4):
        r = sillytavern(server, "narrator", key=None, speed=speed, model="whatever-is-typed")
        assert r.status_code == 200, r.text
        assert mp3_seconds(r.content) > 0


def test_sillytavern_with_a_key(keyed):
    assert sillytavern(keyed, "alloy", key=KEY).status_code == 200
    r = sillytavern(keyed, "alloy", key=None)                       # no key saved
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_sillytavern_unknown_voice_is_a_clear_error(server):
    r = sillytavern(server, "not-uploaded", key=None)
    assert r.status_code == 400 and r.json()["error"]["code"] == "voice_not_found"


@pytest.mark.parametrize("voice", ["alloy", "default"])
def test_librechat_openai_provider(server, voice):
    assert mp3_seconds(librechat(server, voice, api_key=None)) > 0     # "Authorization: undefined" is ignored


def test_librechat_with_an_api_key(keyed):
    assert mp3_seconds(librechat(keyed, "nova", api_key=KEY)) > 0
    r = httpx.post(keyed.base + "/v1/audio/speech", headers={"Authorization": "undefined"}, timeout=60,
                   json={"input": "Hello.", "model": "tts-1", "voice": "nova"})
    assert r.status_code == 401


def test_n8n_captioned_speech(keyed):
    """The n8n node of docs/clients.md: Kokoro's ``/dev/captioned_speech`` with ``"stream": false``. One JSON object
    (n8n parses it): ``audio`` a base64 MP3 (what its Convert to File node decodes), ``timestamps`` every word of
    the input once, in order, within the audio. Without the header: 401."""
    body = {"input": N8N_TEXT, "voice": "default", "response_format": "mp3", "stream": False}
    r = n8n(keyed, "/dev/captioned_speech", body, key=KEY)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("application/json")
    seconds = mp3_seconds(base64.b64decode(r.json()["audio"]))
    words = r.json()["timestamps"]
    assert [w["word"] for w in words] == N8N_TEXT.split()
    assert [w["start_time"] for w in words] == sorted(w["start_time"] for w in words)
    assert all(0 <= w["start_time"] <= w["end_time"] <= seconds + 1e-3 for w in words), (words, seconds)
    assert n8n(keyed, "/dev/captioned_speech", body, key=None).status_code == 401


def test_n8n_openai_speech_is_one_file(keyed):
    """Plain audio from the node: ``/v1/audio/speech`` with ``"stream": false`` is one ``audio/mpeg`` body with its
    Content-Length (n8n makes it a binary file by that type)."""
    r = n8n(keyed, "/v1/audio/speech", {"model": "tts-1", "input": N8N_TEXT, "voice": "default",
                                        "response_format": "mp3", "stream": False}, key=KEY)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "audio/mpeg" and "transfer-encoding" not in r.headers
    assert r.headers["content-length"] == str(len(r.content)) and mp3_seconds(r.content) > 0
