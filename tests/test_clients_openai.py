"""OpenAI-compatible clients, unmodified, against a real ``mossrt serve`` on the demo bundle: the openai SDK
(``stream: false``, ``instructions``, Kokoro's voice mixing) and Open WebUI's own TTS voice and model lists
(its ``openai`` and ``elevenlabs`` engines; Open WebUI runs from its own venv, ``.venv-openwebui`` or
``$MOSSRT_OPENWEBUI_VENV``, built from tests/clients/requirements-openwebui*.txt when missing), with and without
``--api-key`` and ``--keyless-route``."""

from __future__ import annotations

import io
import json
import os
import subprocess

import httpx
import numpy as np
import pytest
import soundfile as sf
from service_helpers import Server, assert_same_audio, pcm16
from test_elevenlabs_clients import CLIENTS, client_python

KEY = "test-key-0123456789"
TEXT = "Hello from the other side."
SHORT = {"seed": 7, "greedy": True, "max_frames": 12}         # the demo bundle speaks to its frame limit


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve_openai_clients")
    with Server(None, tmp / "voices", tmp / "server.log", "--max-streams", "2") as s:
        yield s


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve_openai_keyed")
    with Server(None, tmp / "voices", tmp / "server.log", "--max-streams", "2", "--api-key", KEY,
                "--keyless-route", "/v1/audio/voices", "--keyless-route", "/v1/audio/models") as s:
        yield s


def upload(server, name: str, key: str | None = None) -> str:
    t = np.arange(24000) / 24000
    buf = io.BytesIO()
    sf.write(buf, 0.3 * np.sin(2 * np.pi * 220 * t), 24000, format="WAV")
    r = httpx.post(server.base + "/v1/audio/voices", data={"name": name},
                   files={"audio_sample": ("ref.wav", buf.getvalue(), "audio/wav")},
                   headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["id"]


def open_webui(server, tmp_path, key: str = "unused-key") -> dict:
    """Open WebUI's get_voices / get_models route functions, for each engine pointed at ``server``."""
    python = client_python("openwebui")
    (tmp_path / "frontend" / "static").mkdir(parents=True, exist_ok=True)
    out = tmp_path / "openwebui.json"
    env = {**os.environ, "ELEVENLABS_API_BASE_URL": server.base, "DATA_DIR": str(tmp_path / "data"),
           "FRONTEND_BUILD_DIR": str(tmp_path / "frontend"), "STATIC_DIR": str(tmp_path / "static"),
           "WEBUI_SECRET_KEY": "open-webui-test-secret"}
    (tmp_path / "data").mkdir(exist_ok=True)
    proc = subprocess.run([str(python), str(CLIENTS / "openwebui_tts.py"), server.base, key, str(out)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_openai_sdk_stream_false_is_one_body_with_its_length(server):
    """``stream: false`` answers the audio whole with its Content-Length (not chunked): the same audio as the
    streamed reply; a WAV carries its real sizes."""
    from openai import OpenAI

    client = OpenAI(base_url=server.base + "/v1", api_key="unused")
    whole = client.audio.speech.with_raw_response.create(model="tts-1", voice="alloy", input=TEXT,
                                                         response_format="pcm", extra_body={"stream": False, **SHORT})
    assert whole.headers["content-length"] == str(len(whole.content)) and "transfer-encoding" not in whole.headers
    with client.audio.speech.with_streaming_response.create(model="tts-1", voice="alloy", input=TEXT,
                                                            response_format="pcm", extra_body=SHORT) as streamed:
        assert streamed.headers.get("transfer-encoding") == "chunked"
        assert_same_audio(pcm16(b"".join(streamed.iter_bytes())), pcm16(whole.content))
    assert len(whole.content) == 12 * 3840
    wav = client.audio.speech.with_raw_response.create(model="tts-1", voice="alloy", input=TEXT, response_format="wav",
                                                       extra_body={"stream": False, **SHORT}).content
    assert int.from_bytes(wav[4:8], "little") == len(wav) - 8 and int.from_bytes(wav[40:44], "little") == len(wav) - 44
    assert sf.info(io.BytesIO(wav)).frames == 12 * 1920
    with pytest.raises(Exception) as e:
        client.audio.speech.create(model="tts-1", voice="alloy", input=TEXT,
                                   extra_body={"stream": False, "stream_format": "sse", **SHORT})
    assert e.value.status_code == 400 and e.value.body["param"] == "stream"


def test_instructions_are_answered_as_not_used(server):
    """MOSS-TTS-Realtime has no instruction input: ``instructions`` is named in ``X-Mossrt-Ignored``."""
    from openai import OpenAI

    client = OpenAI(base_url=server.base + "/v1", api_key="unused")
    kw = dict(model="gpt-4o-mini-tts", voice="coral", input=TEXT, response_format="pcm", extra_body=SHORT)
    told = client.audio.speech.with_raw_response.create(instructions="Speak cheerfully.", **kw)
    assert told.headers["x-mossrt-ignored"] == "instructions"
    plain = client.audio.speech.with_raw_response.create(**kw)
    assert "x-mossrt-ignored" not in plain.headers
    assert_same_audio(pcm16(plain.content), pcm16(told.content))          # the audio is not changed by it


def test_kokoro_voice_mixing_is_its_own_error(server):
    from openai import BadRequestError, OpenAI

    client = OpenAI(base_url=server.base + "/v1", api_key="unused")
    for voice, code in (("af_bella+af_sky", "voice_mixing_unsupported"), ("af_bella(0.3)+alloy(0.7)",
                                                                           "voice_mixing_unsupported"),
                        ("af_bella", "voice_not_found")):
        with pytest.raises(BadRequestError) as e:
            client.audio.speech.create(model="tts-1", voice=voice, input=TEXT, extra_body=SHORT)
        assert e.value.body["code"] == code and e.value.body["param"] == "voice", voice


def test_open_webui_lists_the_servers_voices_and_models(server, tmp_path):
    """Open WebUI's voice menu and model list, from its own functions, for its OpenAI engine (``{base}/audio/
    voices`` and ``/audio/models``) and its ElevenLabs engine (``/v1/voices``, ``/v1/models`` with
    ``xi-api-key``): the built-in voice, OpenAI's names (OpenAI engine) and an uploaded voice."""
    vid = upload(server, "Grace")
    listed = httpx.get(server.base + "/v1/audio/voices").json()
    assert [v["id"] for v in listed["data"]] == [vid]                    # OpenAI's list: the registered voices
    got = open_webui(server, tmp_path)
    voices = {v["id"]: v["name"] for v in got["openai"]["voices"]["voices"]}
    assert voices == {v["id"]: v["name"] for v in listed["voices"]}
    assert voices["default"] == "Default" and voices["alloy"] == "Alloy" and voices[vid] == "Grace"
    assert "moss-tts-realtime" in [m["id"] for m in got["openai"]["models"]["models"]]
    eleven = {v["id"]: v["name"] for v in got["elevenlabs"]["voices"]["voices"]}
    assert eleven == {"default": "Default", vid: "Grace"}
    assert got["elevenlabs"]["models"]["models"][0] == {"id": "moss-tts-realtime", "name": "MOSS-TTS-Realtime"}


def test_keyless_routes_let_open_webui_list_without_a_key(keyed, tmp_path):
    """With ``--api-key``, Open WebUI's OpenAI engine lists voices and models with no key (its code sends none):
    ``--keyless-route`` opens exactly those reads; everything else still needs the key."""
    vid = upload(keyed, "Keyed", key=KEY)
    assert httpx.post(keyed.base + "/v1/audio/voices", data={"name": "x"}).status_code == 401
    for path in ("/v1/models", f"/v1/audio/voices/{vid}", "/v1/voices", "/v2/voices", "/v1/user"):
        assert httpx.get(keyed.base + path).status_code == 401, path
    assert httpx.post(keyed.base + "/v1/audio/speech", json={"model": "tts-1", "input": TEXT}).status_code == 401
    assert httpx.post(keyed.base + "/dev/captioned_speech", json={"input": TEXT}).status_code == 401
    got = open_webui(keyed, tmp_path, key=KEY)
    assert vid in {v["id"] for v in got["openai"]["voices"]["voices"]}
    assert "moss-tts-realtime" in [m["id"] for m in got["openai"]["models"]["models"]]
    assert vid in {v["id"] for v in got["elevenlabs"]["voices"]["voices"]}     # it sends its key


def test_keyless_routes_are_a_setting_off_by_default():
    from pydantic import ValidationError

    from app.session.policy import SessionPolicy
    from app.settings import ServerSettings

    headers = {}
    closed = SessionPolicy.from_settings(ServerSettings(api_keys=[KEY]))
    assert closed.http_key_error(headers, "GET", "/v1/audio/voices").code == "invalid_api_key"
    opened = SessionPolicy.from_settings(ServerSettings(api_keys=[KEY], keyless_routes="/v1/audio/voices,/v2/voices"))
    assert opened.http_key_error(headers, "GET", "/v1/audio/voices") is None
    assert opened.http_key_error(headers, "POST", "/v1/audio/voices").code == "invalid_api_key"
    assert opened.http_key_error(headers, "GET", "/v1/audio/voices/voice_1").code == "invalid_api_key"
    with pytest.raises(ValidationError):
        ServerSettings(keyless_routes=["/v1/audio/speech"])

