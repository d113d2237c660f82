"""Every bound a client session is held to, built once from the settings, and the gate it passes first.

The gate runs before any other work, on every transport: the ``Origin`` of a WebSocket upgrade (browsers
never apply CORS to WebSockets, so the server must: a page of this server, one of ``--cors-origin``, or no
``Origin`` at all, which is not a browser), then the API key. HTTP takes ``Authorization: Bearer <key>`` or
ElevenLabs' ``xi-api-key``; a WebSocket also ``?api_key=`` or the subprotocol ``mossrt.key.<key>`` (a browser
can set neither header on one); an ElevenLabs socket may send the key in its first message instead, within
``auth_timeout`` seconds, and does nothing else before it.
"""

from __future__ import annotations

import hmac
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from fastapi import Request
from starlette.datastructures import Headers

from engine.serving.stream import StreamState

from ..errors import ApiError
from ..settings import ServerSettings

SUBPROTOCOL_PREFIX = "mossrt.key."


DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}
# categories of characters that are never spoken: separators (spaces, NBSP, line/paragraph separators), controls
# and format characters (zero-width space and joiners, word joiner, BOM, bidi marks)
UNSPOKEN_CATEGORIES = ("Zs", "Zl", "Zp", "Cc", "Cf")


def speakable(text: str) -> bool:
    """Whether ``text`` has a character to speak: anything but Unicode whitespace, separators, controls and
    format characters (``" "``, NBSP, ``"\\u200b"``, ``"\\ufeff"``... alone are not). The one rule of every
    transport: unspeakable text is a keep-alive where the protocol has one, else refused as ``empty_input``."""
    return any(not ch.isspace() and unicodedata.category(ch) not in UNSPOKEN_CATEGORIES for ch in text)


def require_speakable(text: str, param: str = "input") -> None:
    """Refuse (400 ``empty_input``) a whole utterance with nothing to speak (see :func:`speakable`)."""
    if not speakable(text):
        raise ApiError("empty_input", f"{param} is empty or only whitespace", param)


@dataclass
class TextLedger:
    """The characters of one open turn's text: received (as sent) and read by the model (its frames'
    ``text_chars``, NFC as tokenized). Their difference is the text received but not yet spoken, the text
    buffer's measure (``--ws-max-buffered-chars`` counts characters, not the tokens they commit to)."""

    received: int = 0
    read: int = 0

    def took(self, chars: int) -> None:
        self.received += chars

    def saw_frame(self, text_chars: int) -> None:
        self.read = max(self.read, text_chars)

    def unspoken(self, stream: StreamState | None) -> int:
        """Characters of this turn not yet read by the model (``stream``: its ``StreamState``). A turn fed token
        ids counts each id not yet fed as one. Whenever the stream has nothing pending, everything received
        has been read: the count catches up, so text whose NFC form is shorter than as sent cannot add up."""
        if stream is None:
            return 0
        if not self.received:
            return stream.pending_text_ids            # token ids, or nothing received yet
        if not stream.pending_text_chars and not stream.pending_text_ids:
            self.read = self.received
            return 0
        return max(self.received - self.read, stream.pending_text_chars)


def origin_key(value: str) -> str | None:
    """An ``Origin`` as RFC 6454 serialises it — scheme and host lower-case, an IDN host as punycode, the
    scheme's default port elided — so that forms of one origin compare equal; ``"null"`` as itself; None
    for a value that is no origin (a path, query or userinfo, a list, a bad port or host). A trailing dot
    is kept: ``app.example.`` is another origin than ``app.example``, as browsers hold it."""
    value = value.strip()
    if value.lower() == "null":
        return "null"
    try:
        parts = urlsplit(value)
        port = parts.port
        host = parts.hostname
        if (not parts.scheme or not host or "@" in parts.netloc or parts.path or parts.query or parts.fragment
                or "://" not in value or any(c.isspace() or c in "?#" for c in value)):
            return None
        host = host if ":" in host else host.encode("idna").decode("ascii").lower()   # IPv6 as it is
    except (ValueError, UnicodeError):
        return None
    scheme = parts.scheme.lower()
    host = f"[{host}]" if ":" in host else host
    return f"{scheme}://{host}" + ("" if port is None or port == DEFAULT_PORTS.get(scheme) else f":{port}")


def bearer(value: str | None) -> str | None:
    """The key of an ``Authorization`` value: ``Bearer K`` → ``K`` (any case); anything else as it is."""
    if value is None:
        return None
    value = value.strip()
    return value[7:].strip() if value[:7].lower() == "bearer " else value


@dataclass(frozen=True)
class SessionPolicy:
    """The bounds of one client session, whatever its transport (docs/operations.md lists every bound)."""

    api_keys: tuple[str, ...]
    keyless_routes: tuple[str, ...]   # read-only routes a client may GET without a key
    cors_origins: tuple[str, ...]
    queue_timeout: float          # a turn waits this long for a stream slot, then no_capacity (429)
    stall_timeout: float          # a send the client does not take within this ends its stream
    text_timeout: float           # an open turn waiting for text this long gets its text ended
    idle_timeout: float           # a socket with no turn running and no message this long is closed
    auth_timeout: float           # a socket that authenticates in its first message must send it by then
    max_message_bytes: int        # one WebSocket message
    max_buffered_chars: int       # text received but not yet spoken, per socket (every context together)
    max_turns: int                # turns of one socket
    max_contexts: int             # open contexts of one ElevenLabs multi-context socket

    def check_buffer(self, waiting: int, incoming: int) -> None:
        """The text buffer bound: ``waiting`` characters not yet spoken (:class:`TextLedger`, and text of the
        session waiting outside the stream) and ``incoming`` together at most ``max_buffered_chars``."""
        if waiting + incoming > self.max_buffered_chars:
            raise ApiError("text_buffer_full", f"text buffer full: at most {self.max_buffered_chars} characters "
                                               "may wait to be spoken; send more once audio has caught up")

    @classmethod
    def from_settings(cls, s: ServerSettings) -> "SessionPolicy":
        return cls(api_keys=tuple(s.api_keys), keyless_routes=tuple(s.keyless_routes),
                   cors_origins=tuple(s.cors_origins), queue_timeout=s.queue_timeout,
                   stall_timeout=s.stall_timeout, text_timeout=s.ws_text_timeout, idle_timeout=s.ws_idle_timeout,
                   auth_timeout=s.ws_auth_timeout, max_message_bytes=s.ws_max_message_bytes,
                   max_buffered_chars=s.ws_max_buffered_chars, max_turns=s.ws_max_turns,
                   max_contexts=s.ws_max_contexts)

    # ------------------------------------------------------------------ the gate
    @property
    def keys_required(self) -> bool:
        return bool(self.api_keys)

    def key_valid(self, candidate: str | None) -> bool:
        """Whether ``candidate`` (a key, or ``Bearer <key>``) is one of the keys (constant time per key)."""
        key = bearer(candidate)
        return key is not None and any(hmac.compare_digest(key.encode(), k.encode()) for k in self.api_keys)

    def http_key_error(self, headers: Mapping[str, str], method: str = "", path: str = "") -> ApiError | None:
        """The 401 of an HTTP request without a valid key (None when keys are off, it has one, or it reads one
        of ``keyless_routes``)."""
        if not self.keys_required or (method in ("GET", "HEAD") and path in self.keyless_routes):
            return None
        if self.key_valid(headers.get("authorization")) or self.key_valid(headers.get("xi-api-key")):
            return None
        return ApiError("invalid_api_key", "missing or invalid API key: send 'Authorization: Bearer <key>' "
                                           "(or 'xi-api-key: <key>')")

    def origin_allowed(self, headers: Headers) -> bool:
        """A WebSocket upgrade's ``Origin`` (Starlette ``Headers``): none (not a browser), ``*``, one listed
        (compared as :func:`origin_key` serialises both; ``null`` only when listed), or an http(s) page of
        this server's own ``Host``. Two ``Origin`` headers, or a value that is no origin, are refused."""
        values = headers.getlist("origin")
        if not values:
            return True
        if len(values) > 1:             # a browser sends one: which one a proxy or a check reads is anyone's guess
            return False
        if "*" in self.cors_origins:
            return True
        origin = origin_key(values[0])
        if origin is None:
            return False
        if origin in {origin_key(o) for o in self.cors_origins}:
            return True
        scheme = origin.split("://", 1)[0]
        return scheme in ("http", "https") and origin == origin_key(f"{scheme}://{headers.get('host', '')}")

    def websocket_credentials(self, headers: Mapping[str, str], query: Mapping[str, str]) -> tuple[bool, str | None]:
        """(authorized by the handshake, the subprotocol to accept with). ``Authorization``, ElevenLabs'
        ``xi-api-key``, ``?api_key=`` and the ``mossrt.key.<key>`` subprotocol are each accepted."""
        protocols = [p.strip() for p in headers.get("sec-websocket-protocol", "").split(",") if p.strip()]
        chosen = next((p for p in protocols if p.startswith(SUBPROTOCOL_PREFIX)), None)
        if not self.keys_required:
            return True, chosen
        candidates = (headers.get("authorization"), headers.get("xi-api-key"), query.get("api_key"),
                      chosen[len(SUBPROTOCOL_PREFIX):] if chosen else None)
        return any(self.key_valid(c) for c in candidates), chosen


async def require_key(request: Request) -> None:
    """FastAPI dependency of the ``/v1`` HTTP routes (async: it never waits in the shared thread pool). The
    request guard has already refused keyless requests before their bodies; this keeps each route's
    requirement explicit wherever it is mounted."""
    err = request.app.state.service.policy.http_key_error(request.headers, request.method, request.url.path)
    if err is not None:
        raise err
