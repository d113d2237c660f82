"""The ElevenLabs SDK (2.78, unmodified) against a real ``mossrt serve`` on the demo bundle: the account and
catalogue calls clients make before they speak — ``voices.get``, ``voices.search``, ``models.list``,
``user.get`` — and ``GET /v1/models`` answered in each protocol's shape."""

from __future__ import annotations

import httpx
import pytest
from service_helpers import Server
from test_clients_openai import upload


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve_elevenlabs_sdk")
    with Server(None, tmp / "voices", tmp / "server.log", "--max-streams", "2") as s:
        s.voice_ids = [upload(s, name) for name in ("Ada", "Brian", "Cleo")]
        yield s


def client(server, key: str | None = "unused-key"):
    from elevenlabs import ElevenLabs

    return ElevenLabs(api_key=key, base_url=server.base)


def test_voices_get(server):
    from elevenlabs.core.api_error import ApiError

    c = client(server)
    assert c.voices.get("default").name == "Default" and c.voices.get("default").category == "premade"
    ada = c.voices.get(server.voice_ids[0], with_settings=True)
    assert (ada.voice_id, ada.name, ada.category) == (server.voice_ids[0], "Ada", "cloned")
    assert ada.created_at_unix is not None
    with pytest.raises(ApiError) as e:
        c.voices.get("no-such-voice")
    assert e.value.status_code == 400 and e.value.body["detail"]["status"] == "voice_not_found"


def test_voices_search(server):
    c = client(server)
    everything = c.voices.search(page_size=100, include_total_count=True)
    assert [v.voice_id for v in everything.voices] == ["default", *server.voice_ids]
    assert everything.total_count == 4 and not everything.has_more
    found = c.voices.search(search="bri")
    assert [v.name for v in found.voices] == ["Brian"]
    assert [v.name for v in c.voices.search(category="premade").voices] == ["Default"]
    assert [v.name for v in c.voices.search(voice_type="personal").voices] == ["Ada", "Brian", "Cleo"]
    assert [v.name for v in c.voices.search(voice_ids=server.voice_ids[1:]).voices] == ["Brian", "Cleo"]
    assert [v.name for v in c.voices.search(sort="name", sort_direction="desc").voices] == ["Default", "Cleo",
                                                                                           "Brian", "Ada"]
    pages, token = [], None                      # paging with has_more and next_page_token
    while True:
        page = c.voices.search(page_size=3, next_page_token=token)
        pages.append([v.voice_id for v in page.voices])
        if not page.has_more:
            break
        token = page.next_page_token
    assert pages == [["default", *server.voice_ids[:2]], [server.voice_ids[2]]]


def test_models_list_and_user_get(server):
    for c in (client(server), client(server, key=None)):       # with its key header, and without one
        models = c.models.list()
        assert models[0].model_id == "moss-tts-realtime" and models[0].can_do_text_to_speech
        assert {m.model_id for m in models} >= {"moss-tts-realtime", "tts-1"}
    user = client(server).user.get()
    assert user.subscription.status == "active" and user.subscription.voice_slots_used == 3
    assert user.subscription.can_use_instant_voice_cloning


def test_v1_models_is_each_protocols_list(server):
    """``xi-api-key`` (or the ElevenLabs SDK's own header) gets ElevenLabs' array; anything else OpenAI's list."""
    from openai import OpenAI

    assert [m.id for m in OpenAI(base_url=server.base + "/v1", api_key="k").models.list()][0] == "moss-tts-realtime"
    assert httpx.get(server.base + "/v1/models").json()["object"] == "list"
    eleven = httpx.get(server.base + "/v1/models", headers={"xi-api-key": "k"}).json()
    assert isinstance(eleven, list) and eleven[0]["model_id"] == "moss-tts-realtime"
