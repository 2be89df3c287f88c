"""Free TCP ports on a local address, for servers the tests and benchmarks start."""

from __future__ import annotations

import socket


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` different ports nobody listens on right now (all bound at once, then released)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now: for a server to start on, or for "destination unreachable"."""
    (port,) = free_ports(1, host)
    return port
