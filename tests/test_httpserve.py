"""The tests' HTTP server helper: quiet about callers that hang up, loud about anything else."""

from __future__ import annotations

import http.client
import threading
from http.server import BaseHTTPRequestHandler

import pytest

from testbed.httpserve import QuietServer


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path == "/hung-up":
            raise ConnectionResetError(104, "Connection reset by peer")
        raise ValueError("a bug in the handler")


@pytest.mark.parametrize(("path", "printed"), [("/hung-up", False), ("/bug", True)])
def test_only_a_caller_that_hung_up_is_not_printed(capfd: pytest.CaptureFixture[str], path: str,
                                                   printed: bool) -> None:
    server = QuietServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        connection = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=10)
        connection.request("GET", path)
        # socketserver prints a handler's error before it closes the connection, so it is out by now
        with pytest.raises(http.client.RemoteDisconnected):
            connection.getresponse()
        connection.close()
    finally:
        server.shutdown()
        server.server_close()
    err = capfd.readouterr().err
    assert ("ValueError: a bug in the handler" in err) is printed
    assert "ConnectionResetError" not in err
