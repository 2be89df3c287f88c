"""The tests' small HTTP servers (fake proxies, origins, shard servers): http.server's, made quiet
about callers that hang up."""

from __future__ import annotations

import sys
from http.server import ThreadingHTTPServer


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
