"""A free TCP port on this machine, for a rendezvous that planc starts itself."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port the operating system has just given out and released (loopback)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
