"""HTTP checks of a running mossrt container, from the host, as a client would see it (.ci/image-check.sh).

    python .ci/image_probe.py wait BASE PATH TIMEOUT -- ALIVE_CMD...
                                 poll GET BASE+PATH until 200 while ALIVE_CMD prints true; prints the seconds
    python .ci/image_probe.py speech BASE                 POST /v1/audio/speech (mp3 default, wav) and decode
    python .ci/image_probe.py drain BASE -- STOP_CMD...   stop the server while a speech stream is in flight

No proxies (CI may set http_proxy); every wait is bounded. Exit status 1 with the reason on failure.
"""

from __future__ import annotations

import http.client
import io
import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import av
import numpy as np
import soundfile as sf

OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))
SAMPLE_RATE = 24000
SPEECH_TIMEOUT_S = 120
# still streaming when the stop arrives, done well within the drain timeout: the demo bundle speaks 3.5
# frames (0.28 s) a text token and writes them far faster than real time, so one sentence (~5 s of audio)
# could end before the signal lands; five give ~25 s of audio
DRAIN_TEXT = " ".join([
    "The container keeps speaking while it drains, sentence after sentence, until the very end.",
    "A stream that was open when the stop came must finish whole, not be cut off halfway.",
    "The readiness probe says no at once, so the balancer sends nothing new this way.",
    "Meanwhile the listener stays open for a moment, and every open turn runs to its end.",
    "Only then does the process leave, with nothing lost and nothing left behind.",
])


class ProbeError(Exception):
    pass


def get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    """(status, body); status 0 when nothing answers."""
    try:
        with OPENER.open(url, timeout=timeout) as r:
            return r.status, r.read(400)
    except urllib.error.HTTPError as e:
        return e.code, e.read(400)
    except OSError as e:
        return 0, f"{type(e).__name__}: {e}".encode()


def post_speech(base: str, **body: Any) -> urllib.request.Request:
    payload = {"model": "tts-1", "input": "Hello from the container image check.", **body}
    return urllib.request.Request(base + "/v1/audio/speech", data=json.dumps(payload).encode(),
                                  headers={"Content-Type": "application/json"}, method="POST")


def wait(base: str, path: str, timeout: float, alive_cmd: list[str]) -> None:
    """Until GET PATH answers 200; gives up early once ALIVE_CMD (podman inspect) no longer prints true."""
    start = time.monotonic()
    status, body = 0, b""
    while time.monotonic() - start < timeout:
        status, body = get(base + path)
        if status == 200:
            print(f"{time.monotonic() - start:.1f}")
            return
        alive = subprocess.run(alive_cmd, capture_output=True, text=True, timeout=60).stdout.strip()
        if alive != "true":
            raise ProbeError(f"the container stopped before GET {path} answered 200 ({' '.join(alive_cmd)}: {alive!r})")
        time.sleep(0.5)
    raise ProbeError(f"GET {path} did not answer 200 within {timeout:.0f} s (last: {status} {body[:200]!r})")


def check_audio(what: str, samples: np.ndarray, rate: int) -> None:
    if rate != SAMPLE_RATE:
        raise ProbeError(f"{what}: sample rate {rate}, expected {SAMPLE_RATE}")
    if samples.size < SAMPLE_RATE // 10 or not np.isfinite(samples).all() or not np.abs(samples).max() > 0:
        raise ProbeError(f"{what}: {samples.size} samples, peak {np.abs(samples).max() if samples.size else 0}")
    print(f"{what}: {samples.size / SAMPLE_RATE:.2f} s of audio at {rate} Hz", file=sys.stderr)


def speech(base: str) -> None:
    with OPENER.open(post_speech(base), timeout=SPEECH_TIMEOUT_S) as r:  # the OpenAI default format: mp3
        mp3, ctype = r.read(), r.headers.get("content-type")
    if ctype != "audio/mpeg":
        raise ProbeError(f"default response_format answered {ctype}, expected audio/mpeg")
    with av.open(io.BytesIO(mp3), mode="r") as container:
        stream = container.streams.audio[0]
        pcm = np.concatenate([f.to_ndarray().reshape(-1) for f in container.decode(stream)])
        check_audio("mp3 (PyAV)", pcm, stream.rate)
    with OPENER.open(post_speech(base, response_format="wav"), timeout=SPEECH_TIMEOUT_S) as r:
        wav = r.read()
    samples, rate = sf.read(io.BytesIO(wav), dtype="float32")
    check_audio("wav (soundfile)", samples, rate)


def drain(base: str, stop_cmd: list[str]) -> None:
    """A pcm stream is open and has sent audio; then STOP_CMD runs (podman stop). The stream must end
    complete (the server drains it), and /ready must stop answering 200 for good."""
    ready_after_stop: list[int] = []
    stopping = threading.Event()

    def poll_ready() -> None:
        while stopping.is_set():
            ready_after_stop.append(get(base + "/ready", timeout=2)[0])
            time.sleep(0.2)

    req = post_speech(base, input=DRAIN_TEXT, response_format="pcm")
    with OPENER.open(req, timeout=SPEECH_TIMEOUT_S) as r:
        first = r.read(4096)
        if not first:
            raise ProbeError("the speech stream sent no audio")
        stopping.set()
        start = time.monotonic()
        stop = subprocess.Popen(stop_cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        poller = threading.Thread(target=poll_ready, daemon=True)
        poller.start()
        time.sleep(1.0)  # the stop signal reaches the server while the stream is open
        try:
            rest = r.read()
        except http.client.IncompleteRead as e:
            cut_at = len(first) + len(e.partial)
            raise ProbeError(f"the stream in flight at the stop was cut off after {cut_at} bytes") from e
    got = len(first) + len(rest)
    try:
        _, stop_errors = stop.communicate(timeout=SPEECH_TIMEOUT_S)
        stop_rc = stop.returncode
    except subprocess.TimeoutExpired as e:
        stop.kill()
        raise ProbeError(f"{' '.join(stop_cmd)} did not return within {SPEECH_TIMEOUT_S} s") from e
    elapsed = time.monotonic() - start
    stopping.clear()
    poller.join(timeout=5)
    if stop_rc != 0:
        raise ProbeError(f"{' '.join(stop_cmd)} exited {stop_rc}: {stop_errors.strip()}")
    if got % 2 or got < SAMPLE_RATE * 2:
        raise ProbeError(f"the stream in flight at the stop ended after {got} bytes (cut off, not drained)")
    # the first polls may come before the signal lands; once /ready answers 503 it never answers 200 again.
    # A 0 (no answer within 2 s) is not a turn: on a loaded machine a poll can time out before the signal.
    turned = next((i for i, status in enumerate(ready_after_stop) if status not in (200, 0)), None)
    if turned is None and ready_after_stop and ready_after_stop[-1] == 0:
        turned = len(ready_after_stop) - 1       # the listener closed between two polls: no 503 seen
    if turned is None or 200 in ready_after_stop[turned:]:
        raise ProbeError(f"/ready did not stay non-200 once the stop began (in order, 0 = no answer): "
                         f"{ready_after_stop}")
    print(f"stream in flight finished: {got / 2 / SAMPLE_RATE:.2f} s of audio; /ready after the stop: "
          f"{summarize(ready_after_stop)} (0 = no answer)", file=sys.stderr)
    print(f"{elapsed:.1f}")


def summarize(statuses: list[int]) -> str:
    """Statuses in order with repeats counted: [200, 200, 503, 0] -> '200 x2, 503, 0'."""
    runs: list[list[int]] = []
    for status in statuses:
        if runs and runs[-1][0] == status:
            runs[-1][1] += 1
        else:
            runs.append([status, 1])
    return ", ".join(f"{s} x{n}" if n > 1 else str(s) for s, n in runs) or "none"


def main(argv: list[str]) -> int:
    try:
        match argv:
            case ["wait", base, path, timeout, "--", *alive_cmd] if alive_cmd:
                wait(base, path, float(timeout), alive_cmd)
            case ["speech", base]:
                speech(base)
            case ["drain", base, "--", *stop_cmd] if stop_cmd:
                drain(base, stop_cmd)
            case _:
                print(__doc__, file=sys.stderr)
                return 2
    except (ProbeError, OSError, av.error.FFmpegError, sf.LibsndfileError) as e:
        print(f"[image_probe] FAIL: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
