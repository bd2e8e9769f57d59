"""The OpenAI-compatible HTTP server: `quickdraft serve` (see docs/serving.md).

One thread owns the engine and runs the continuous-batching loop (`engine_loop.py`); HTTP
handlers (`api.py`) talk to it through a thread-safe inbox. Prometheus metrics live in
`metrics.py`, the request/response shapes in `protocol.py`.
"""

from quickdraft.server.config import ServerConfig
from quickdraft.server.server import QuickdraftServer, run_server

__all__ = ["QuickdraftServer", "ServerConfig", "run_server"]
