"""The LocalAI gRPC backend (``mossrt localai``) as a real process on loopback, driven through the
committed generated stubs: Health, LoadModel (bundle, bad options, checkpoint export), TTS to a WAV,
TTSStream against ``mossrt synth``, cancellation, bad requests, voices, Status, Free, bearer auth."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import re
import signal
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import soundfile as sf
from conftest import GOLDEN, TEST_DEVICE, golden
from service_helpers import LONG_TEXT, PCM_TOLERANCE, TEXT, Backend, pcm16, synth_reference

from app.localai import backend_pb2 as pb

RPC_TIMEOUT = 60
# LocalAI's backend/backend.proto at the commit the spec names (ecosystem.md: git blob 7be3d5a4)
UPSTREAM_PROTO_SHA256 = "6cd3c2259e329bbd45e6faf638abb745e4cdbfc7973a928ce9d42eb78eb7e24c"
TOKEN = "test-token-0123456789"


def rpc_error(call, *args, **kwargs) -> grpc.RpcError:
    """The error a call ends with (a streaming call is read to its end)."""
    kwargs.setdefault("timeout", RPC_TIMEOUT)
    with pytest.raises(grpc.RpcError) as info:
        result = call(*args, **kwargs)
        if hasattr(result, "__next__"):        # a streaming call fails while it is read
            list(result)
    return info.value


def stream(stub, text: str, **fields) -> tuple[list, bytes]:
    replies = list(stub.TTSStream(pb.TTSRequest(text=text, **fields), timeout=RPC_TIMEOUT))
    return replies, b"".join(r.audio for r in replies[1:])


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("localai")
    with Backend(tmp / "backend.log") as b:
        b.voices_dir = tmp / "voices"
        yield b


def load(backend, bundle: Path, *options: str) -> pb.Result:
    return backend.stub.LoadModel(pb.ModelOptions(
        Model=str(bundle), Options=["max_streams:1", "queue_timeout:3", f"voices_dir:{backend.voices_dir}",
                                    *options]), timeout=RPC_TIMEOUT)


@pytest.fixture
def loaded(backend, full_bundle_dir):
    """The backend with the test bundle loaded (LoadModel is idempotent: 'already loaded' costs nothing).
    One stream slot and a 3 s queue timeout: a stream left open would show as RESOURCE_EXHAUSTED."""
    r = load(backend, full_bundle_dir)
    assert r.success, r.message
    return backend


# ---------------------------------------------------------------------------------------------- stubs
def test_generated_stubs_are_current(tmp_path):
    """The committed backend_pb2*.py are what protoc makes of the committed (upstream, verbatim) proto."""
    from app.localai import protogen

    assert hashlib.sha256(protogen.PROTO.read_bytes()).hexdigest() == UPSTREAM_PROTO_SHA256
    protogen.generate(tmp_path)
    committed = {name: (protogen.HERE / name).read_text(encoding="utf-8") for name in protogen.MODULES}
    fresh = {name: (tmp_path / name).read_text(encoding="utf-8") for name in protogen.MODULES}
    assert protogen.PACKAGE_IMPORT in committed["backend_pb2_grpc.py"]
    generated_with = re.search(r"GRPC_GENERATED_VERSION = '([^']+)'", committed["backend_pb2_grpc.py"]).group(1)
    if importlib.metadata.version("grpcio-tools") == generated_with:
        assert fresh == committed, "stale stubs: run 'python -m app.localai.protogen'"
    else:       # another grpcio-tools stamps other version floors: compare what the proto decides
        def descriptor(src):
            return re.search(r"AddSerializedFile\((b'.*?')\)\n", src, re.S).group(1)

        def methods(src):
            return sorted(set(re.findall(r"'/backend\.Backend/(\w+)'", src)))

        assert descriptor(fresh["backend_pb2.py"]) == descriptor(committed["backend_pb2.py"])
        assert methods(fresh["backend_pb2_grpc.py"]) == methods(committed["backend_pb2_grpc.py"])


# ---------------------------------------------------------------------------------------------- lifecycle
def test_health_answers_exactly_ok(backend):
    assert backend.stub.Health(pb.HealthMessage(), timeout=RPC_TIMEOUT).message == b"OK"


def test_speech_before_load_model_is_a_failed_precondition(backend, tmp_path):
    assert backend.stub.Free(pb.HealthMessage(), timeout=RPC_TIMEOUT).success       # whatever ran before
    for call, req in ((backend.stub.TTS, pb.TTSRequest(text=TEXT, dst=str(tmp_path / "x.wav"))),
                      (backend.stub.TTSStream, pb.TTSRequest(text=TEXT))):
        err = rpc_error(call, req)
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "LoadModel" in err.details()
    assert backend.stub.Status(pb.HealthMessage(), timeout=RPC_TIMEOUT).state == pb.StatusResponse.UNINITIALIZED


def test_load_model(backend, full_bundle_dir, tmp_path):
    assert backend.stub.Free(pb.HealthMessage(), timeout=RPC_TIMEOUT).success
    bad = load(backend, full_bundle_dir, "temperature:0.5")
    assert not bad.success and "unknown option 'temperature'" in bad.message
    bad = load(backend, full_bundle_dir, "max_streams:2")
    assert not bad.success and "option 'max_streams' is given twice" in bad.message
    bad = backend.stub.LoadModel(pb.ModelOptions(Model=str(full_bundle_dir), Options=["threads:abc"]),
                                 timeout=RPC_TIMEOUT)
    assert not bad.success and "option threads: expected an integer" in bad.message
    missing = backend.stub.LoadModel(pb.ModelOptions(Model=str(tmp_path / "nothing")), timeout=RPC_TIMEOUT)
    assert not missing.success and "no such bundle or checkpoint" in missing.message
    no_codec = backend.stub.LoadModel(pb.ModelOptions(Model=str(GOLDEN / "checkpoints" / "tts")), timeout=RPC_TIMEOUT)
    assert not no_codec.success and "codec:" in no_codec.message

    ok = load(backend, full_bundle_dir)
    assert ok.success, ok.message
    assert "1 stream slots" in ok.message
    # LocalAI's layout: ModelPath = the models directory, Model relative to it
    again = backend.stub.LoadModel(pb.ModelOptions(Model=full_bundle_dir.name, ModelPath=str(full_bundle_dir.parent)),
                                   timeout=RPC_TIMEOUT)
    assert again.success and "already loaded" in again.message


def test_tts_writes_a_24khz_mono_16bit_wav(loaded, backend, tmp_path):
    (tmp_path / "audio").mkdir()                    # LocalAI's generated-content folder: LocalAI creates it
    dst = tmp_path / "audio" / "tts-1.wav"
    r = backend.stub.TTS(pb.TTSRequest(text=TEXT, dst=str(dst), voice="", language="en",
                                       instructions="speak slowly", params={"greedy": "true", "ref_text": "x"}),
                         timeout=RPC_TIMEOUT)
    assert r.success, r.message
    info = sf.info(dst)
    assert (info.samplerate, info.channels, info.subtype, info.format) == (24000, 1, "PCM_16", "WAV")
    normal, _ = sf.read(dst, dtype="int16")
    assert normal.size > 0 and normal.size % 1920 == 0
    fast = tmp_path / "fast.wav"
    assert backend.stub.TTS(pb.TTSRequest(text=TEXT, dst=str(fast), params={"greedy": "true", "speed": "2.0"}),
                            timeout=RPC_TIMEOUT).success
    assert abs(sf.info(fast).frames / normal.size - 0.5) < 0.05


def test_stream_equals_synth(loaded, backend, tmp_path, full_bundle_dir):
    replies, pcm = stream(backend.stub, TEXT, params={"greedy": "true", "seed": "1"})
    assert json.loads(replies[0].message) == {"sample_rate": 24000} and not replies[0].audio
    assert all(r.audio and not r.message for r in replies[1:])
    assert len(replies) > 3                          # chunks as frames come, not one buffer at the end
    got, ref = pcm16(pcm), synth_reference(tmp_path, full_bundle_dir, TEXT)
    assert got.shape == ref.shape and np.abs(got - ref).max() <= PCM_TOLERANCE


def test_cancelled_stream_is_closed_in_the_engine(loaded, backend, tmp_path):
    """Cancel after the first chunks: the client sees CANCELLED, the engine stream is cancelled and closed
    (with max_streams:1 the next request gets the only slot, not RESOURCE_EXHAUSTED), the server is fine."""
    call = backend.stub.TTSStream(pb.TTSRequest(text=LONG_TEXT, params={"greedy": "true"}), timeout=RPC_TIMEOUT)
    replies = iter(call)
    assert json.loads(next(replies).message) == {"sample_rate": 24000}
    next(replies), next(replies)
    call.cancel()
    with pytest.raises(grpc.RpcError) as info:
        for _ in replies:
            pass
    assert info.value.code() == grpc.StatusCode.CANCELLED
    frames = int(backend.wait_log(r"TTSStream: cancelled by the client after (\d+) frames").group(1))
    assert frames < 150                              # LONG_TEXT runs ~200 frames: it stopped early
    assert backend.stub.Health(pb.HealthMessage(), timeout=RPC_TIMEOUT).message == b"OK"
    r = backend.stub.TTS(pb.TTSRequest(text=TEXT, dst=str(tmp_path / "after.wav"), params={"greedy": "true"}),
                         timeout=RPC_TIMEOUT)
    assert r.success, r.message


@pytest.mark.parametrize("fields,words", [
    ({"text": ""}, "text is empty"),
    ({"text": "   "}, "text is empty"),
    ({"text": TEXT, "voice": "no-such-voice"}, "unknown voice 'no-such-voice'"),
    ({"text": TEXT, "params": {"temperature": "abc"}}, "params['temperature']: expected a number"),
    ({"text": TEXT, "params": {"greedy": "maybe"}}, "params['greedy']"),
    ({"text": TEXT, "params": {"max_frames": "0"}}, "max_frames"),
    ({"text": TEXT, "params": {"top_p": "1.5"}}, "top_p"),
    ({"text": TEXT, "params": {"seed": "-3"}}, "seed"),
    ({"text": TEXT, "params": {"speed": "9"}}, "params['speed']"),
    ({"text": "x" * 5000}, "limit is 4096"),
])
def test_bad_requests_are_invalid_argument(loaded, backend, tmp_path, fields, words):
    for call, req in ((backend.stub.TTSStream, pb.TTSRequest(**fields)),
                      (backend.stub.TTS, pb.TTSRequest(dst=str(tmp_path / "bad.wav"), **fields))):
        err = rpc_error(call, req)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and words in err.details(), err.details()
    assert not (tmp_path / "bad.wav").exists()


def test_dst_is_a_new_file_in_an_output_folder_and_refusals_look_alike(loaded, backend, tmp_path, full_bundle_dir):
    """``TTS`` never creates a folder, never replaces a file (a symlink included), never writes inside the
    model, bundle, voices or reference folders, and stays inside ``output_dir`` when that is set; every
    refused path gets the same message (the path aside), so ``dst`` cannot probe the file system."""
    existing = tmp_path / "existing.wav"
    existing.write_bytes(b"keep me")
    (tmp_path / "dangling.wav").symlink_to(tmp_path / "nowhere.wav")
    backend.voices_dir.mkdir(parents=True, exist_ok=True)
    refused = [tmp_path / "no" / "such" / "dir" / "x.wav", existing, tmp_path / "dangling.wav", tmp_path,
               backend.voices_dir / "new.wav", full_bundle_dir / "new.wav", "/nonexistent/x.wav"]
    if not os.access("/etc", os.W_OK):      # a folder this user cannot write (root can: there /etc/x.wav is
        refused.append("/etc/x.wav")        # a new file in a writable folder, written, and refused on the next run)
    messages = set()
    for dst in refused:
        err = rpc_error(backend.stub.TTS, pb.TTSRequest(text="Hello.", dst=str(dst)))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (dst, err.details())
        messages.add(err.details().replace(repr(str(dst)), "DST"))
    assert len(messages) == 1, messages
    assert existing.read_bytes() == b"keep me" and not (tmp_path / "no").exists()
    assert not (tmp_path / "nowhere.wav").exists() and not (backend.voices_dir / "new.wav").exists()
    # output_dir confines: a new file there is written, one elsewhere is refused alike
    out = tmp_path / "generated"
    out.mkdir()
    backend.stub.Free(pb.HealthMessage(), timeout=RPC_TIMEOUT)           # options apply to a fresh load
    r = backend.stub.LoadModel(pb.ModelOptions(Model=str(full_bundle_dir), Options=[
        "max_streams:1", "queue_timeout:3", f"voices_dir:{backend.voices_dir}", f"output_dir:{out}"]),
        timeout=RPC_TIMEOUT)
    assert r.success, r.message
    try:
        elsewhere = rpc_error(backend.stub.TTS, pb.TTSRequest(text="Hello.", dst=str(tmp_path / "free.wav")))
        assert elsewhere.details().replace(repr(str(tmp_path / "free.wav")), "DST") in messages
        ok = backend.stub.TTS(pb.TTSRequest(text="Hello.", dst=str(out / "a.wav")),
                              timeout=RPC_TIMEOUT)
        assert ok.success and sf.info(out / "a.wav").samplerate == 24000
    finally:
        backend.stub.Free(pb.HealthMessage(), timeout=RPC_TIMEOUT)        # the next tests load without it


def refusal_shape(details: str) -> str:
    """A refused dst's message with the path taken out (it is repeated, shortened when long)."""
    return re.sub(r"^dst '.*': ", "dst DST: ", details, flags=re.S)


def test_a_dst_the_file_system_cannot_take_is_the_one_refusal(loaded, backend, tmp_path):
    """From the reproduction: a NUL byte in dst was INTERNAL 'ValueError: embedded null byte' and a 4,096-character
    file name INTERNAL 'File name too long', each with a traceback in the log. Both (and ``~``, taken literally,
    as in ``voice``) are the one documented INVALID_ARGUMENT, before any audio is generated; nothing logged."""
    before = backend.log()
    good = rpc_error(backend.stub.TTS, pb.TTSRequest(text="Hello.", dst=str(tmp_path / "no" / "x.wav")))
    for dst in (str(tmp_path / "a\0b.wav"), str(tmp_path / ("n" * 4096 + ".wav")), str(tmp_path / ("n" * 300)),
                "~/x.wav", f"~{os.environ.get('USER', 'root')}/x.wav", str(tmp_path) + "/"):
        err = rpc_error(backend.stub.TTS, pb.TTSRequest(text="Hello.", dst=dst))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (dst[:80], err.code(), err.details()[:300])
        assert refusal_shape(err.details()) == refusal_shape(good.details()), err.details()[:300]
        assert len(err.details()) < 400, len(err.details())
    new = backend.log()[len(before):]
    assert "Traceback" not in new and "unexpected error" not in new and "TTS:" not in new, new[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == [], list(tmp_path.iterdir())


def test_a_folder_swapped_for_a_link_while_generating_gets_no_wav(loaded, backend, tmp_path):
    """From the reproduction: the dst folder swapped for a symbolic link to the voices folder while the audio
    was generated put the WAV in the voices folder. The folder is opened once, when it is checked, and the WAV
    created relative to it: it lands in the folder that was checked (moved aside here), never through the link."""
    backend.voices_dir.mkdir(parents=True, exist_ok=True)
    out, moved = tmp_path / "out", tmp_path / "out-checked"
    out.mkdir()
    before = set(backend.voices_dir.iterdir())
    call = backend.stub.TTS.future(pb.TTSRequest(text=LONG_TEXT, dst=str(out / "swapped.wav"),
                                                 params={"greedy": "true"}), timeout=RPC_TIMEOUT)
    deadline = time.monotonic() + RPC_TIMEOUT
    while backend.stub.Status(pb.HealthMessage(), timeout=10).state != pb.StatusResponse.BUSY:
        assert time.monotonic() < deadline and not call.done(), "the TTS never generated"
        time.sleep(0.01)
    out.rename(moved)
    out.symlink_to(backend.voices_dir, target_is_directory=True)
    assert backend.stub.Status(pb.HealthMessage(), timeout=10).state == pb.StatusResponse.BUSY, \
        "the swap came after the generation (not the case tested)"
    r = call.result()
    assert r.success, r.message
    assert set(backend.voices_dir.iterdir()) == before, "the WAV went through the link"
    assert sf.info(moved / "swapped.wav").samplerate == 24000


def test_tts_without_dst_and_other_model_identity(loaded, backend):
    err = rpc_error(backend.stub.TTS, pb.TTSRequest(text=TEXT))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "dst" in err.details()
    # LocalAI's distributed-mode guard: a request for another model is refused with its sentinel
    err = rpc_error(backend.stub.TTSStream, pb.TTSRequest(text=TEXT, ModelIdentity="some-other-model"))
    assert err.code() == grpc.StatusCode.NOT_FOUND and "model identity mismatch" in err.details()


def test_voices_by_registered_name_and_by_reference_file(loaded, backend, tmp_path, full_bundle_dir):
    from app.voices import VoiceRegistry
    from engine.runtime.bundle import Bundle

    codes = np.random.default_rng(0).integers(0, 1024, size=(20, 16))
    VoiceRegistry(backend.voices_dir, Bundle(full_bundle_dir, device="cpu").identity).add("narrator", codes)
    _, by_name = stream(backend.stub, TEXT, voice="narrator", params={"greedy": "true"})
    _, default = stream(backend.stub, TEXT, voice="default", params={"greedy": "true"})
    assert by_name and by_name != default

    ref = backend.voices_dir / "ref.wav"            # reference files live in the voices (or model) directory
    sf.write(ref, golden("codec/codec_short.npz")["wav"], 24000)
    _, by_file = stream(backend.stub, TEXT, voice=str(ref), params={"greedy": "true"})
    _, by_relative_name = stream(backend.stub, TEXT, voice="ref.wav", params={"greedy": "true"})
    expect = synth_reference(tmp_path, full_bundle_dir, TEXT, "--voice", str(ref))
    got = pcm16(by_file)
    assert got.shape == expect.shape and np.abs(got - expect).max() <= PCM_TOLERANCE
    relative = pcm16(by_relative_name)
    assert relative.shape == got.shape and np.abs(relative - got).max() <= PCM_TOLERANCE


def test_reference_files_are_confined_and_errors_tell_no_file_apart(loaded, backend, tmp_path):
    """Issue 14 item 13: a request's voice file must lie in the model or voices directory (resolved: no
    ``..``, no ``~user``, no symlink out); everything else is the same "unknown voice" error, whether the file
    exists, is audio, or is missing."""
    outside = tmp_path / "outside.wav"
    sf.write(outside, golden("codec/codec_short.npz")["wav"], 24000)   # a valid reference, but outside
    link = backend.voices_dir / "link-out.wav"
    link.unlink(missing_ok=True)
    link.symlink_to(outside)
    messages = {}
    for voice in ("/etc/passwd", "/nonexistent/file", "~root/.bashrc", str(outside), "link-out.wav",
                  str(link), "../" * 12 + "etc/passwd", f"{backend.voices_dir}/../{tmp_path.name}/outside.wav"):
        err = rpc_error(backend.stub.TTS, pb.TTSRequest(text=TEXT, voice=voice, dst=str(tmp_path / "o.wav")))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (voice, err.details())
        messages[voice] = err.details().replace(repr(voice), "VOICE")
    assert len(set(messages.values())) == 1, messages
    assert "unknown voice VOICE" in next(iter(messages.values()))


def test_status_ready_with_memory(loaded, backend):
    status = backend.stub.Status(pb.HealthMessage(), timeout=RPC_TIMEOUT)
    assert status.state == pb.StatusResponse.READY
    # total: this process, and its engine core process when the engine runs in one (engine_process on)
    memory = status.memory
    assert memory.total > 0 and memory.breakdown["rss"] + memory.breakdown.get("engine_core", 0) == memory.total
    assert status.memory.breakdown["stream_slots"] > 0


def test_the_engine_may_run_in_a_core_process(backend, full_bundle_dir, tmp_path):
    """``engine_process:on``: the engine runs in a process of the backend's own (python -m engine.core) that
    speaks the same bytes, is counted in Status' memory, and leaves with Free."""
    def children() -> list[int]:
        pids = []
        for task in Path(f"/proc/{backend.proc.pid}/task").iterdir():
            for c in (task / "children").read_text().split():
                if "engine.core" in Path(f"/proc/{c}/cmdline").read_text():
                    pids.append(int(c))
        return pids

    def speak(name: str) -> bytes:
        dst = tmp_path / f"{name}.wav"
        r = backend.stub.TTS(pb.TTSRequest(text=TEXT, dst=str(dst), params={"greedy": "true"}), timeout=RPC_TIMEOUT)
        assert r.success, r.message
        return dst.read_bytes()

    assert backend.stub.Free(pb.HealthMessage(), timeout=RPC_TIMEOUT).success
    assert load(backend, full_bundle_dir, "engine_process:off").success and not children()
    inline = speak("inline")
    assert backend.stub.Free(pb.HealthMessage(), timeout=RPC_TIMEOUT).success
    r = load(backend, full_bundle_dir, "engine_process:on")
    assert r.success, r.message
    (core,) = children()
    assert speak("core") == inline
    memory = backend.stub.Status(pb.HealthMessage(), timeout=RPC_TIMEOUT).memory
    assert memory.breakdown["engine_core"] > 0 and memory.total > memory.breakdown["rss"]
    assert backend.stub.Free(pb.HealthMessage(), timeout=RPC_TIMEOUT).success
    deadline = time.monotonic() + 30
    while Path(f"/proc/{core}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{core}").exists(), "Free stopped (and reaped) the engine core"


def test_free_unloads_the_model(loaded, backend, tmp_path):
    r = backend.stub.Free(pb.HealthMessage(), timeout=RPC_TIMEOUT)
    assert r.success, r.message
    err = rpc_error(backend.stub.TTS, pb.TTSRequest(text=TEXT, dst=str(tmp_path / "x.wav")))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert backend.stub.Status(pb.HealthMessage(), timeout=RPC_TIMEOUT).state == pb.StatusResponse.UNINITIALIZED


def test_load_model_exports_a_checkpoint_once(backend, tmp_path):
    """parameters.model = a Hugging Face checkpoint: exported (by the exporter the CLI injects) into the
    cache once, then served; a second LoadModel reuses the export."""
    from export.demo import TOKENIZER_JSON

    cache = tmp_path / "cache"
    options = [f"codec:{GOLDEN / 'checkpoints' / 'codec'}", f"tokenizer:{TOKENIZER_JSON}", f"cache_dir:{cache}"]
    r = load(backend, GOLDEN / "checkpoints" / "tts", *options)
    assert r.success, r.message
    exported = [p for p in cache.iterdir()]
    assert len(exported) == 1 and (exported[0] / "manifest.json").is_file() and "already" not in r.message
    _, pcm = stream(backend.stub, TEXT, params={"greedy": "true"})
    assert len(pcm) > 0
    assert backend.stub.Free(pb.HealthMessage(), timeout=RPC_TIMEOUT).success
    again = load(backend, GOLDEN / "checkpoints" / "tts", *options)
    assert again.success and list(cache.iterdir()) == exported
    backend.wait_log("using the bundle exported earlier")
    assert backend.stub.Free(pb.HealthMessage(), timeout=RPC_TIMEOUT).success


def test_without_an_exporter_a_checkpoint_is_refused_clearly():
    """app.localai never imports export: a server built without the injected exporter says what to do."""
    from app.localai import MossTTSBackend

    r = MossTTSBackend(exporter=None).LoadModel(pb.ModelOptions(
        Model=str(GOLDEN / "checkpoints" / "tts"), Options=[f"codec:{GOLDEN / 'checkpoints' / 'codec'}"]), None)
    assert not r.success and "without a checkpoint exporter" in r.message and "mossrt export" in r.message


def test_bundle_given_at_start_is_loaded_before_load_model(tmp_path, full_bundle_dir):
    """--bundle: Health answers at once, the model loads in the background (Status BUSY, then READY), and
    LocalAI's LoadModel naming the same bundle only checks it."""
    with Backend(tmp_path / "preload.log", "--bundle", str(full_bundle_dir), "--voices-dir", str(tmp_path / "v")) as b:
        assert b.stub.Health(pb.HealthMessage(), timeout=RPC_TIMEOUT).message == b"OK"
        # from the first call on the bundle is known: BUSY, never UNINITIALIZED (the server once listened
        # before the bundle was registered: CI's loaded run saw UNINITIALIZED), and a TTS is told to retry
        deadline = time.monotonic() + 60
        while (state := b.stub.Status(pb.HealthMessage(), timeout=RPC_TIMEOUT).state) != pb.StatusResponse.READY:
            assert state == pb.StatusResponse.BUSY and time.monotonic() < deadline, state
            try:
                b.stub.TTS(pb.TTSRequest(text=TEXT, dst=str(tmp_path / "early.wav")), timeout=RPC_TIMEOUT)
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.UNAVAILABLE and "still loading" in e.details(), e
            time.sleep(0.1)
        _, pcm = stream(b.stub, TEXT, params={"greedy": "true"})       # served before any LoadModel
        assert len(pcm) > 0
        r = b.stub.LoadModel(pb.ModelOptions(Model=str(full_bundle_dir), Threads=2), timeout=RPC_TIMEOUT)
        assert r.success and "already loaded" in r.message, r.message
        assert b.log().count("loading ") == 1                             # not loaded a second time


def test_the_bundle_given_at_start_is_known_before_the_listener_opens(tmp_path, full_bundle_dir):
    """``preload``'s ``listen`` (``serve`` passes the gRPC server's start) runs once the bundle is registered:
    the first call that can arrive sees Status BUSY, not UNINITIALIZED (which CI's loaded run saw when the
    server listened first), and the model then loads and serves."""
    from app.localai import MossTTSBackend, ServerDefaults

    backend = MossTTSBackend(ServerDefaults(voices_dir=tmp_path / "v", device=TEST_DEVICE))
    at_listen = []
    backend.preload(full_bundle_dir, listen=lambda: at_listen.append(backend.Status(pb.HealthMessage(), None).state))
    try:
        assert at_listen == [pb.StatusResponse.BUSY]
        deadline = time.monotonic() + 60
        while backend.Status(pb.HealthMessage(), None).state != pb.StatusResponse.READY:
            assert time.monotonic() < deadline, "not READY after 60 s"
            time.sleep(0.05)
    finally:
        backend.close()


def test_sigterm_while_the_bundle_loads_exits_0(tmp_path, full_bundle_dir):
    """SIGTERM while --bundle's model is still loading: the process exits 0 with no traceback. The load
    cannot be interrupted; the interpreter's teardown meeting it inside onnxruntime aborted the process
    ("terminate called without an active exception", status -6: CI's loaded run).

    The signal is made to meet the load, whatever the machine's speed: the process is frozen (SIGSTOP) once
    it logs that it is loading, the log read then says the model is not ready, SIGTERM is queued, and only
    then does the process continue, so the signal is delivered before the model can be ready. 1,024 slots
    make the load (every batch bucket warmed) long beside the stop that follows the signal; a try in which
    the load still finished first tested nothing and is retried."""
    for attempt in range(5):
        b = Backend(tmp_path / f"cut{attempt}.log", "--bundle", str(full_bundle_dir), "--max-streams", "1024",
                    "--voices-dir", str(tmp_path / "v"))
        try:
            b.wait_log(r"INFO mossrt\.localai: loading ", 120)
            b.proc.send_signal(signal.SIGSTOP)
            frozen_before_ready = "ready in" not in b.log()
            b.proc.send_signal(signal.SIGTERM)
            b.proc.send_signal(signal.SIGCONT)
            status = b.proc.wait(timeout=120)
        finally:
            b.stop()
        log = b.log()
        assert status == 0 and "terminate called" not in log and "Traceback" not in log, \
            f"exit {status}:\n{log[-3000:]}"
        assert "stopping: running calls get" in log, log[-3000:]          # the signal was handled, not fatal
        if frozen_before_ready and "ready in" not in log:   # the signal met the load, which never ended
            return
    pytest.fail("the load finished before the process exited in each of 5 tries: no load was cut, nothing was tested")


# ---------------------------------------------------------------------------------------------- auth
def test_bearer_token_is_required_when_configured(tmp_path):
    with Backend(tmp_path / "auth.log", env={"LOCALAI_GRPC_AUTH_TOKEN": TOKEN}) as b:
        for metadata in ((), (("authorization", "Bearer wrong-token"),), (("authorization", TOKEN),)):
            err = rpc_error(b.stub.Health, pb.HealthMessage(), metadata=metadata)
            assert err.code() == grpc.StatusCode.UNAUTHENTICATED
        err = rpc_error(b.stub.TTSStream, pb.TTSRequest(text=TEXT))               # a streaming method too
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED
        auth = (("authorization", f"Bearer {TOKEN}"),)
        assert b.stub.Health(pb.HealthMessage(), metadata=auth, timeout=RPC_TIMEOUT).message == b"OK"
        err = rpc_error(b.stub.TTSStream, pb.TTSRequest(text=TEXT), metadata=auth)
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION                   # past auth: no model yet


# ---------------------------------------------------------------------------------------------- packaging
def test_packaging_documents_every_option_and_param():
    """The LocalAI packaging README lists every LoadModel option and TTS param the backend accepts, and
    run.sh hands LocalAI's arguments (--addr) to `mossrt localai`."""
    from app.localai import MODEL_OPTIONS, TTS_PARAMS

    pkg = Path(__file__).resolve().parents[1] / "localai" / "moss-tts-realtime"
    readme = (pkg / "README.md").read_text(encoding="utf-8")
    for key in [*MODEL_OPTIONS, *TTS_PARAMS]:
        assert f"`{key}`" in readme, f"README.md does not document {key!r}"
    assert 'exec mossrt localai ${MOSSRT_LOCALAI_FLAGS:-} "$@"' in (pkg / "run.sh").read_text()
    for name in ("run.sh", "install.sh"):
        assert os.access(pkg / name, os.X_OK), f"{name} is not executable"
    for name in ("requirements.txt", "requirements-cpu.txt", "requirements-cublas12.txt",
                 "requirements-cublas13.txt", "Makefile"):
        assert (pkg / name).is_file()
