"""``python -m engine.core --address ipc://... --config-json '{...}' [--parent-pid N]``: the engine core
process (started by the service; see engine.core.client)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading

from .config import CoreConfig
from .local import LocalEngine
from .process import CoreServer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.core", description=__doc__)
    parser.add_argument("--address", required=True)
    parser.add_argument("--config-json", required=True)
    parser.add_argument("--parent-pid", type=int, default=None)
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("mossrt")
    root.handlers[:] = [handler]
    root.setLevel(args.log_level.upper())
    root.propagate = False
    engine = LocalEngine(CoreConfig.from_json(args.config_json))
    server = CoreServer(engine, args.address, args.parent_pid)
    threading.Thread(target=engine.load, name="mossrt-load", daemon=True).start()
    server.run()
    logging.shutdown()
    sys.stderr.flush()
    os._exit(0)          # as mossrt serve: no interpreter teardown over the loaded sessions


if __name__ == "__main__":
    sys.exit(main())
