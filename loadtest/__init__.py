"""Load generator for ``mossrt serve``: concurrent streams over HTTP (``POST /v1/audio/speech``, pcm) and the
WebSocket (``/v1/audio/speech/stream``, LLM-paced text deltas), measured from the client's side.

``python -m loadtest --help``; in-process: ``loadtest.run([...argv...])`` returns the report dict.
"""

from .cli import main, run

__all__ = ["main", "run"]
