"""The uvicorn internals mossrt relies on still exist, with the kind it uses them as. mossrt/serve.py's draining
server and app/protocol_bounds.py's bounded HTTP and WebSocket protocols subclass uvicorn's classes, override
some of their methods and call or read others; none of these names is uvicorn's public API, so a release can
rename one and the override would silently stop running (or the call fail mid-request). pyproject.toml pins
uvicorn below its next minor release; raising that pin is safe once this file passes. No server is started."""

from __future__ import annotations

import asyncio
import inspect

import pytest
from uvicorn import Config, Server
from uvicorn.protocols import utils
from uvicorn.protocols.http import httptools_impl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from uvicorn.server import ServerState


async def _app(scope, receive, send) -> None:
    """An ASGI app for the constructors; never called."""


def _instances() -> dict[str, object]:
    """One of each class, constructed as uvicorn does (no socket, no loop running): their instance attributes."""
    config = Config(_app, ws="websockets-sansio")
    config.load()
    loop = asyncio.new_event_loop()
    try:
        return {"Server": Server(config),
                "HttpToolsProtocol": HttpToolsProtocol(config, ServerState(), {}, _loop=loop),
                "WebSocketsSansIOProtocol": WebSocketsSansIOProtocol(config, ServerState(), {}, _loop=loop)}
    finally:
        loop.close()


CLASSES = {"Server": Server, "HttpToolsProtocol": HttpToolsProtocol, "RequestResponseCycle": RequestResponseCycle,
           "WebSocketsSansIOProtocol": WebSocketsSansIOProtocol}

# (class, name, kind, who relies on it): "method" a plain function on the class, "coroutine" an async one,
# "attribute" set on every instance by the constructor
HOOKS = [
    ("Server", "handle_exit", "method", "serve.py: the first signal starts the drain"),
    ("Server", "shutdown", "coroutine", "serve.py: open WebSockets closed with 'draining' before uvicorn's 1012"),
    ("Server", "_wait_tasks_to_complete", "coroutine", "serve.py: the wait bounded by the shutdown window"),
    ("Server", "_captured_signals", "attribute", "serve.py: the signal re-raised after the drain"),
    ("Server", "server_state", "attribute", "serve.py: connections and tasks cut at the window's end"),
    ("Server", "should_exit", "attribute", "serve.py: the drain's end stops the server"),
    ("Server", "force_exit", "attribute", "serve.py: a second signal ends the wait"),
    ("HttpToolsProtocol", "connection_made", "method", "protocol_bounds: send buffer, header timer"),
    ("HttpToolsProtocol", "data_received", "method", "protocol_bounds: the head's size counted as it is fed"),
    ("HttpToolsProtocol", "_unset_keepalive_if_required", "method", "protocol_bounds: _feed, uvicorn's copy"),
    ("HttpToolsProtocol", "_should_upgrade", "method", "protocol_bounds: _feed, and an upgrade's field bound"),
    ("HttpToolsProtocol", "_unsupported_upgrade_warning", "method", "protocol_bounds: _feed, uvicorn's copy"),
    ("HttpToolsProtocol", "handle_websocket_upgrade", "method", "protocol_bounds: _feed, uvicorn's copy"),
    ("HttpToolsProtocol", "send_400_response", "method", "protocol_bounds: _feed, uvicorn's copy"),
    ("HttpToolsProtocol", "on_message_begin", "method", "protocol_bounds: per-request counters"),
    ("HttpToolsProtocol", "on_url", "method", "protocol_bounds: the URL bound"),
    ("HttpToolsProtocol", "on_header", "method", "protocol_bounds: the field-count bound"),
    ("HttpToolsProtocol", "on_headers_complete", "method", "protocol_bounds: the head's end"),
    ("HttpToolsProtocol", "on_message_complete", "method", "protocol_bounds: the next head's count"),
    ("HttpToolsProtocol", "on_response_complete", "method", "protocol_bounds: the header timer re-armed"),
    ("HttpToolsProtocol", "connection_lost", "method", "protocol_bounds: the header timer cancelled"),
    ("HttpToolsProtocol", "parser", "attribute", "protocol_bounds: _feed"),
    ("HttpToolsProtocol", "cycle", "attribute", "protocol_bounds: an idle connection's header timer"),
    ("HttpToolsProtocol", "loop", "attribute", "protocol_bounds: timers"),
    ("HttpToolsProtocol", "logger", "attribute", "protocol_bounds: _feed"),
    ("HttpToolsProtocol", "transport", "attribute", "serve.py: a connection cut at the window's end"),
    ("WebSocketsSansIOProtocol", "data_received", "method", "protocol_bounds: a refused handshake answered"),
    ("WebSocketsSansIOProtocol", "handle_ping", "method", "protocol_bounds: no pong over the high-water mark"),
    ("WebSocketsSansIOProtocol", "pause_writing", "method", "protocol_bounds: the backlog timer armed"),
    ("WebSocketsSansIOProtocol", "resume_writing", "method", "protocol_bounds: the backlog timer cancelled"),
    ("WebSocketsSansIOProtocol", "connection_lost", "method", "protocol_bounds: the backlog timer cancelled"),
    ("WebSocketsSansIOProtocol", "handle_parser_exception", "method", "protocol_bounds: closed below the app"),
    ("WebSocketsSansIOProtocol", "keepalive_timeout", "method", "protocol_bounds: closed below the app"),
    ("WebSocketsSansIOProtocol", "send", "coroutine", "protocol_bounds: a closed socket's sends are void"),
    ("WebSocketsSansIOProtocol", "handshake_initiated", "attribute", "protocol_bounds: a refused handshake"),
    ("WebSocketsSansIOProtocol", "conn", "attribute", "protocol_bounds: websockets' sans-I/O connection"),
    ("WebSocketsSansIOProtocol", "writable", "attribute", "protocol_bounds: the write flow control"),
    ("WebSocketsSansIOProtocol", "loop", "attribute", "protocol_bounds: the backlog timer"),
    ("WebSocketsSansIOProtocol", "transport", "attribute", "serve.py, protocol_bounds: a socket cut"),
]

# (class, method, what its source must contain, why): uvicorn's behaviour an override or a copy relies on
CALLS = [
    ("Server", "shutdown", "self._wait_tasks_to_complete()", "the overridden wait is what the shutdown awaits"),
    ("Server", "shutdown", "connection.shutdown()", "what serve.py's shutdown runs before: each connection's own "
                                                     "close (1012 for a WebSocket)"),
    ("Server", "handle_exit", "self._captured_signals.append", "serve.py's handle_exit records the signal as "
                                                                 "uvicorn's does"),
    ("Server", "capture_signals", "self._captured_signals", "the recorded signal is raised again at the end"),
    ("HttpToolsProtocol", "data_received", "self._unset_keepalive_if_required()", "_feed copies data_received"),
    ("HttpToolsProtocol", "data_received", "self.parser.feed_data(data)", "_feed copies data_received"),
    ("HttpToolsProtocol", "data_received", "self._should_upgrade()", "_feed copies data_received"),
    ("HttpToolsProtocol", "data_received", "self.handle_websocket_upgrade()", "_feed copies data_received"),
    ("HttpToolsProtocol", "data_received", "self._unsupported_upgrade_warning()", "_feed copies data_received"),
    ("HttpToolsProtocol", "data_received", "self.send_400_response(", "_feed copies data_received"),
    ("HttpToolsProtocol", "handle_websocket_upgrade", "self.transport.set_protocol(", "an upgraded connection's "
                                                                                      "bytes leave the HTTP bounds"),
    ("HttpToolsProtocol", "on_message_begin", 'self.url = b""', "the URL bound counts from each request's start"),
    ("HttpToolsProtocol", "on_url", "self.url += url", "the URL is kept by on_url (the refusal's path)"),
    ("RequestResponseCycle", "__init__", "self.response_complete", "an idle connection's header timer"),
    ("WebSocketsSansIOProtocol", "handle_events", "self.handle_ping()", "a ping's pong goes through handle_ping"),
    ("WebSocketsSansIOProtocol", "send", "self.writable.wait()", "the application's sends wait for the "
                                                                 "transport's buffer to drain"),
    ("WebSocketsSansIOProtocol", "pause_writing", "self.writable.clear()", "the write flow control"),
    ("WebSocketsSansIOProtocol", "resume_writing", "self.writable.set()", "the write flow control"),
    ("WebSocketsSansIOProtocol", "run_asgi", "except ClientDisconnected", "a send on a socket closed below the "
                                                                          "application ends its session quietly"),
]


@pytest.fixture(scope="module")
def instances() -> dict[str, object]:
    return _instances()


@pytest.mark.parametrize("owner, name, kind, why", HOOKS, ids=[f"{o}.{n}" for o, n, _, _ in HOOKS])
def test_a_hook_exists_with_its_kind(instances, owner, name, kind, why):
    """Each name is still there, as a method uvicorn defines (not asyncio.Protocol's no-op: uvicorn 0.52.0's
    WebSocket protocol inherited pause_writing, and the ping-flood bound was silently gone) or an attribute
    its constructor sets."""
    where = f"uvicorn {owner}.{name} ({why})"
    if kind == "attribute":
        assert name in vars(instances[owner]), f"{where}: no longer an instance attribute"
        return
    defined_by = next((c for c in CLASSES[owner].__mro__ if name in vars(c)), None)
    assert defined_by is not None and defined_by.__module__.startswith("uvicorn."), \
        f"{where}: no longer defined by uvicorn (found on {defined_by})"
    member = vars(defined_by)[name]
    assert inspect.isfunction(member), f"{where}: no longer a method ({member!r})"
    assert inspect.iscoroutinefunction(member) == (kind == "coroutine"), f"{where}: no longer a {kind}"


@pytest.mark.parametrize("owner, method, text, why", CALLS, ids=[f"{o}.{m}:{t}" for o, m, t, _ in CALLS])
def test_uvicorn_still_calls_what_an_override_relies_on(owner, method, text, why):
    """uvicorn's own code still does what an override or a copy of it assumes (read from its source)."""
    source = inspect.getsource(getattr(CLASSES[owner], method))
    assert text in source, f"uvicorn {owner}.{method} no longer contains {text!r}: {why}"


def test_the_module_level_names_exist():
    """The module-level names app/protocol_bounds.py imports."""
    assert isinstance(httptools_impl.STATUS_LINE, dict) and httptools_impl.STATUS_LINE[431].startswith(
        b"HTTP/1.1 431 "), "uvicorn httptools_impl.STATUS_LINE (protocol_bounds.refusal's status line)"
    assert issubclass(utils.ClientDisconnected, Exception), \
        "uvicorn protocols.utils.ClientDisconnected (protocol_bounds: a closed socket's sends raise it)"
