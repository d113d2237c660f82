"""``python -m mossrt.api_worker``: one of ``mossrt serve --api-workers N``'s API processes. It reads its
orders as JSON on stdin (the settings, the engine core's address and pid, the listening socket's file
descriptor it inherited, its index), serves the app on that socket with the core joined, and exits as
``mossrt serve`` does (0 after SIGTERM's drain, 70 when the engine core died)."""

from __future__ import annotations

import json
import logging
import socket
import sys


def main() -> None:
    from app.server import configure_logging, create_app
    from app.settings import ServerSettings
    from engine.core.client import CoreAddress
    from engine.runtime.bundle import Bundle

    from .serve import exit_now, run_app

    orders = json.loads(sys.stdin.read())
    settings = ServerSettings(**orders["settings"])
    configure_logging(settings)
    log = logging.getLogger("mossrt.app")
    assert settings.bundle is not None, "the supervisor names the bundle it opened"
    bundle = Bundle(settings.bundle, device=settings.device, threads=settings.threads or None, defer_refusal=True,
                    shared_pool=True)       # the manifest and tokenizer: the graphs open in the core
    wyoming = orders.get("wyoming_fd")
    app = create_app(settings, bundle, CoreAddress(orders["core_address"], orders["core_pid"]),
                     socket.socket(fileno=wyoming) if wyoming is not None else None)
    listener = socket.socket(fileno=orders["fd"])
    log.info("API worker %d serving", orders["index"])
    exit_now(run_app(settings, app, sockets=[listener]))


if __name__ == "__main__":
    main()
