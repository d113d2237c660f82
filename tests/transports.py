"""Every transport that speaks an utterance, as a client the bounds suite (``test_transport_bounds.py``) drives
the same way: start a long utterance (optionally on a socket with a small receive buffer that is never read),
and what the transport answers a refusal with. A transport added to the service joins :data:`TRANSPORTS`, and
every bound of the suite applies to it.

The suite runs on the demo bundle, whose random weights never end a turn early: a long text is a long stream.
"""

from __future__ import annotations

import asyncio
import json
import socket
from dataclasses import dataclass

LONG = " ".join(["The quick brown fox jumps over the lazy dog, and the model keeps on talking for a while."] * 8)
KEY = "transport-key-0123"


@dataclass(frozen=True)
class Http:
    name: str
    path: str
    label: str                    # mossrt_stalled_streams_total's transport / StreamMeter's
    endpoint: str                 # mossrt_requests_total's endpoint
    shape: str                    # "openai" | "elevenlabs": the error body
    streamed: bool = True         # bytes leave as frames are generated

    def body(self, text: str = LONG) -> dict:
        if self.shape == "openai":
            body = {"model": "x", "input": text, "response_format": "pcm", "max_frames": 3750}
            return {**body, "stream_format": "sse"} if self.name == "sse" else body
        return {"text": text}

    def error_code(self, payload: dict) -> str:
        return payload["error"]["code"] if self.shape == "openai" else payload["detail"]["status"]


@dataclass(frozen=True)
class Ws:
    name: str
    path: str
    label: str
    endpoint: str
    multi: bool = False           # ElevenLabs multi-context

    @property
    def ours(self) -> bool:
        return self.name == "ws"

    def url(self, base: str, query: str = "") -> str:
        return base.replace("http", "ws") + self.path + (("&" if "?" in self.path else "?") + query if query else "")

    def opening(self, text: str, end: bool = True) -> list[str]:
        """The messages that start an utterance of ``text`` (its end too when ``end``)."""
        if self.ours:
            msgs = [{"type": "session.update", "response_format": "pcm"}, {"type": "input.text", "text": text}]
            return [json.dumps(m) for m in msgs + ([{"type": "input.done"}] if end else [])]
        if self.multi:           # the end: a flush (speak it all), then close_context (isFinal after it)
            msgs = [{"text": " ", "context_id": "c1"}, {"text": text, "context_id": "c1"}]
            ending = [{"context_id": "c1", "flush": True}, {"context_id": "c1", "close_context": True}]
            return [json.dumps(m) for m in msgs + (ending if end else [])]
        msgs = [{"text": " "}, {"text": text}]           # stream-input's end: {"text": ""}
        return [json.dumps(m) for m in msgs + ([{"text": ""}] if end else [])]

    def error_code(self, message: dict) -> str | None:
        """The code of an error message (None for any other message)."""
        if self.ours:
            return message["error"]["code"] if message.get("type") == "error" else None
        return message.get("error")


EL_FORMAT = "?output_format=pcm_24000"
HTTP_TRANSPORTS = [
    Http("openai", "/v1/audio/speech", "http", "/v1/audio/speech", "openai"),
    Http("openai-whole", "/v1/audio/speech", "http", "/v1/audio/speech", "openai"),
    Http("sse", "/v1/audio/speech", "sse", "/v1/audio/speech", "openai"),
    Http("el-stream", "/v1/text-to-speech/default/stream" + EL_FORMAT, "elevenlabs_http",
         "/v1/text-to-speech/{voice_id}/stream", "elevenlabs"),
    Http("el-stream-timestamps", "/v1/text-to-speech/default/stream/with-timestamps" + EL_FORMAT, "elevenlabs_http",
         "/v1/text-to-speech/{voice_id}/stream/with-timestamps", "elevenlabs"),
    Http("el-with-timestamps", "/v1/text-to-speech/default/with-timestamps" + EL_FORMAT, "elevenlabs_http",
         "/v1/text-to-speech/{voice_id}/with-timestamps", "elevenlabs", streamed=False),
]
WS_TRANSPORTS = [
    Ws("ws", "/v1/audio/speech/stream", "ws", "/v1/audio/speech/stream"),
    Ws("el-stream-input", "/v1/text-to-speech/default/stream-input" + EL_FORMAT, "elevenlabs",
       "/v1/text-to-speech/{voice_id}/stream-input"),
    Ws("el-multi-stream-input", "/v1/text-to-speech/default/multi-stream-input" + EL_FORMAT, "elevenlabs",
       "/v1/text-to-speech/{voice_id}/multi-stream-input", multi=True),
]
WYOMING = "wyoming"           # the Wyoming listener (Home Assistant): a TCP connection of wyoming events
TRANSPORTS = [t.name for t in HTTP_TRANSPORTS + WS_TRANSPORTS] + ["localai", WYOMING]
BY_NAME = {t.name: t for t in HTTP_TRANSPORTS + WS_TRANSPORTS}


def small_buffer_socket(port: int, rcvbuf: int = 4096) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", port))
    return sock


def raw_upgrade(port: int, t: Ws, key: str | None = KEY, rcvbuf: int = 4096) -> tuple[socket.socket, bytes]:
    """A WebSocket handshake of ``t`` on a raw socket (the hostile client's: it writes frames itself, and reads
    only when it likes): the socket and the 101 response."""
    import base64
    import os

    sock = small_buffer_socket(port, rcvbuf)
    sock.settimeout(30)
    auth = (f"Authorization: Bearer {key}\r\n" if t.ours else f"xi-api-key: {key}\r\n") if key else ""
    sock.sendall(f"GET {t.path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                 f"Sec-WebSocket-Key: {base64.b64encode(os.urandom(16)).decode()}\r\nSec-WebSocket-Version: 13\r\n"
                 f"{auth}\r\n".encode())
    answer = b""
    while b"\r\n\r\n" not in answer:
        piece = sock.recv(4096)
        if not piece:
            break
        answer += piece
    return sock, answer


def server_frames(data: bytes) -> list[tuple[int, bytes]]:
    """The (opcode, payload) of each whole unmasked frame in ``data`` (what a server sends)."""
    frames, i = [], 0
    while i + 2 <= len(data):
        length, at = data[i + 1] & 0x7F, i + 2
        if length >= 126:
            size = 2 if length == 126 else 8
            length, at = int.from_bytes(data[at:at + size], "big"), at + size
        if at + length > len(data):
            break
        frames.append((data[i] & 0x0F, data[at:at + length]))
        i = at + length
    return frames


async def ws_messages(w, until, timeout: float = 60) -> list:
    """Messages of ``w`` (decoded JSON, or bytes) until ``until(message)`` is true or the socket closes."""
    out = []
    deadline = asyncio.get_running_loop().time() + timeout
    import websockets

    while True:
        try:
            raw = await asyncio.wait_for(w.recv(), max(0.1, deadline - asyncio.get_running_loop().time()))
        except websockets.ConnectionClosed:
            return out
        msg = json.loads(raw) if isinstance(raw, str) else raw
        out.append(msg)
        if until(msg):
            return out


# ---------------------------------------------------------------------------------------------- Wyoming
async def wyoming_connect(server, sock: socket.socket | None = None):
    """(reader, writer) of a connection to the server's Wyoming listener (on ``sock`` when given)."""
    if sock is not None:
        return await asyncio.open_connection(sock=sock)
    return await asyncio.open_connection("127.0.0.1", server.wyoming_port)


def wyoming_opening(text: str, end: bool = True, voice: str | None = None) -> list:
    """The events of a streaming synthesis of ``text`` as Home Assistant sends them (with ``end``: the whole
    text again for backward compatibility, then the stop)."""
    from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop, SynthesizeVoice

    v = SynthesizeVoice(name=voice) if voice else None
    events = [SynthesizeStart(voice=v).event(), SynthesizeChunk(text=text).event()]
    return events + ([Synthesize(text=text, voice=v).event(), SynthesizeStop().event()] if end else [])


async def wyoming_send(writer, events) -> None:
    from wyoming.event import async_write_event

    for event in events:
        await async_write_event(event, writer)


async def wyoming_events(reader, until, timeout: float = 60) -> list:
    """Events from ``reader`` until ``until(event)`` is true or the connection closes."""
    from wyoming.event import async_read_event

    out = []
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            event = await asyncio.wait_for(async_read_event(reader),
                                           max(0.1, deadline - asyncio.get_running_loop().time()))
        except ConnectionError:
            return out
        if event is None:
            return out
        out.append(event)
        if until(event):
            return out


def wyoming_error(event) -> str | None:
    """The code of an ``error`` event (None for any other)."""
    return event.data.get("code") if event.type == "error" else None


# ---------------------------------------------------------------------------------------------- raw HTTP/2 (gRPC)
# The hostile gRPC client writes HTTP/2 frames itself (a header block of any size, pings it never reads the
# answers to), which no gRPC library lets it do.
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
H2_DATA, H2_HEADERS, H2_SETTINGS, H2_PING, H2_GOAWAY, H2_CONTINUATION = 0x0, 0x1, 0x4, 0x6, 0x7, 0x9
ENHANCE_YOUR_CALM = (0xB).to_bytes(4, "big")     # a GOAWAY's error code
H2_END_STREAM, H2_END_HEADERS, H2_ACK = 0x1, 0x4, 0x1


def h2_frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload


def hpack_int(value: int, prefix_bits: int, first: int = 0) -> bytes:
    """An HPACK integer (RFC 7541 5.1) in a first byte whose high bits are ``first``."""
    top = (1 << prefix_bits) - 1
    if value < top:
        return bytes([first | value])
    out, value = [first | top], value - top
    while value >= 128:
        out.append(value % 128 + 128)
        value //= 128
    return bytes(out + [value])


def hpack_literal(name: bytes, value: bytes) -> bytes:
    """A header field, literal name and value, not indexed (RFC 7541 6.2.2), without Huffman coding."""
    return b"\x00" + hpack_int(len(name), 7) + name + hpack_int(len(value), 7) + value


def hpack_indexed_name(index: int, value: bytes) -> bytes:
    """A header field whose name is entry ``index`` of the static table, literal value, not indexed."""
    return hpack_int(index, 4) + hpack_int(len(value), 7) + value


def grpc_request_head(path: str) -> bytes:
    """The HPACK block of a gRPC call's headers: POST, http (static entries 3, 6), ``path``, the gRPC
    content type."""
    return (b"\x83\x86" + hpack_indexed_name(4, path.encode()) + hpack_indexed_name(1, b"localhost")
            + hpack_literal(b"content-type", b"application/grpc") + hpack_literal(b"te", b"trailers"))


def h2_frames(data: bytes) -> list[tuple[int, int, int, bytes]]:
    """The (type, flags, stream, payload) of each whole frame in ``data`` (what a server sends)."""
    frames, i = [], 0
    while i + 9 <= len(data):
        length = int.from_bytes(data[i:i + 3], "big")
        if i + 9 + length > len(data):
            break
        frames.append((data[i + 3], data[i + 4], int.from_bytes(data[i + 5:i + 9], "big") & 0x7FFFFFFF,
                       data[i + 9:i + 9 + length]))
        i += 9 + length
    return frames
