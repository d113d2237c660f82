"""Smoke test of an installed moss-tts-realtime backend, the way LocalAI drives it: start run.sh on a
free port, poll Health for "OK", LoadModel the built-in demo bundle (random weights: the audio is noise,
but every path runs), TTS to a WAV, TTSStream, Status, Free, then SIGTERM.

    make test            (or: venv/bin/python test.py)

MOSS_TTS_TEST_MODEL=/path/to/bundle tests a real bundle instead of the demo one.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest
import wave
from pathlib import Path

import grpc

from app.localai import backend_pb2 as pb
from app.localai import backend_pb2_grpc as pb_grpc

HERE = Path(__file__).resolve().parent
TEXT = "Hello from the moss-tts-realtime LocalAI backend."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class BackendTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.addr = f"127.0.0.1:{free_port()}"
        cls.log = open(Path(cls.tmp.name) / "backend.log", "w")
        cls.proc = subprocess.Popen(["bash", str(HERE / "run.sh"), "--addr", cls.addr], stdout=cls.log,
                                    stderr=subprocess.STDOUT, cwd=HERE)
        cls.channel = grpc.insecure_channel(cls.addr)
        cls.stub = pb_grpc.BackendStub(cls.channel)
        deadline = time.monotonic() + 60
        while True:                                  # LocalAI polls Health until it answers "OK"
            try:
                if cls.stub.Health(pb.HealthMessage(), timeout=2).message == b"OK":
                    break
            except grpc.RpcError:
                pass
            if cls.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the backend did not start:\n{(Path(cls.tmp.name) / 'backend.log').read_text()}")
            time.sleep(0.2)

    @classmethod
    def tearDownClass(cls):
        cls.channel.close()
        cls.proc.send_signal(signal.SIGTERM)
        status = cls.proc.wait(timeout=60)
        cls.log.close()
        cls.tmp.cleanup()
        assert status == 0, f"the backend exited with {status}"

    def test_load_speak_free(self):
        model = os.environ.get("MOSS_TTS_TEST_MODEL", "demo")
        voices = Path(self.tmp.name) / "voices"
        r = self.stub.LoadModel(pb.ModelOptions(Model=model, Options=["device:auto", f"voices_dir:{voices}"]),
                                timeout=600)
        self.assertTrue(r.success, r.message)
        self.assertEqual(self.stub.Status(pb.HealthMessage(), timeout=10).state, pb.StatusResponse.READY)

        dst = Path(self.tmp.name) / "tts.wav"
        r = self.stub.TTS(pb.TTSRequest(text=TEXT, dst=str(dst), params={"max_frames": "25"}), timeout=600)
        self.assertTrue(r.success, r.message)
        with wave.open(str(dst)) as w:
            self.assertEqual((w.getframerate(), w.getnchannels(), w.getsampwidth()), (24000, 1, 2))
            self.assertGreater(w.getnframes(), 0)

        replies = list(self.stub.TTSStream(pb.TTSRequest(text=TEXT, params={"max_frames": "25", "seed": "1"}),
                                           timeout=600))
        self.assertEqual(json.loads(replies[0].message), {"sample_rate": 24000})
        pcm = b"".join(r.audio for r in replies[1:])
        self.assertGreater(len(pcm), 0)
        self.assertEqual(len(pcm) % 2, 0)

        with self.assertRaises(grpc.RpcError) as err:
            self.stub.TTS(pb.TTSRequest(text="", dst=str(dst)), timeout=60)
        self.assertEqual(err.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)

        self.assertTrue(self.stub.Free(pb.HealthMessage(), timeout=60).success)
        with self.assertRaises(grpc.RpcError) as err:
            self.stub.TTS(pb.TTSRequest(text=TEXT, dst=str(dst)), timeout=60)
        self.assertEqual(err.exception.code(), grpc.StatusCode.FAILED_PRECONDITION)


if __name__ == "__main__":
    sys.exit(unittest.main())
