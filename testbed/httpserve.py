"""The tests' small HTTP servers (fake proxies, origins, shard servers): http.server's, made quiet
about callers that hang up."""

from __future__ import annotations

import sys
import threading
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class QuietServer(ThreadingHTTPServer):
    """``ThreadingHTTPServer`` that says nothing when a caller resets or drops its connection.

    Many tests stop reading on purpose (a cut shard, an error raised at once); socketserver would
    print each such connection's traceback from its own thread, outside pytest's capture of the test
    that caused it. Any other error in a handler is still printed.
    """

    def handle_error(self, request: object, client_address: object) -> None:
        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        super().handle_error(request, client_address)


class StaticServer(QuietServer):
    """Fixed bodies by path (``files``), or one body for every path (``every``), with Content-Length;
    404 for anything else. Serves from a thread of its own as soon as it is made: an origin of
    ``/download``. ``url`` is its base URL."""

    def __init__(self, files: Mapping[str, bytes] | None = None, *, every: bytes | None = None,
                 host: str = "127.0.0.1"):
        bodies = dict(files or {})

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                body = bodies.get(self.path, every)
                if body is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        super().__init__((host, 0), Handler)
        self.url = f"http://{host}:{self.server_address[1]}"
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.shutdown()
        self._thread.join(10)
        self.server_close()
