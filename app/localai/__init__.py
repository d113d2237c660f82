"""LocalAI gRPC backend ``moss-tts-realtime``: LocalAI's ``Backend`` service (``backend.proto``, verbatim)
for MOSS-TTS-Realtime. Start it with ``mossrt localai --addr HOST:PORT``; see ``localai/moss-tts-realtime``
for the LocalAI packaging and ``server.py`` for the protocol details and the modules by job.
"""

from .lifecycle import ServerDefaults
from .options import BACKEND_NAME, MODEL_OPTIONS, TTS_PARAMS
from .server import MossTTSBackend, build_server, serve

__all__ = ["BACKEND_NAME", "MODEL_OPTIONS", "TTS_PARAMS", "MossTTSBackend", "ServerDefaults", "build_server", "serve"]
