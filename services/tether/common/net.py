"""Small network helpers."""

from __future__ import annotations

import ipaddress
import socket
import threading

# The ports free_port handed out in this process. The probe socket is closed before the caller (often
# another process, started later) binds the port, and the kernel may then hand the same port to the
# next probe: a stack's trainer and scheduler were once given one port (make test-all, Dec 7).
_HANDED_OUT: set[int] = set()
_LOCK = threading.Lock()
_FORGET_AFTER = 16384  # past this many, start over rather than grow (or search) without end


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, and never one this process handed out before."""
    with _LOCK:
        if len(_HANDED_OUT) >= _FORGET_AFTER:
            _HANDED_OUT.clear()
        while True:
            with socket.socket() as s:
                s.bind((host, 0))
                port = int(s.getsockname()[1])
            if port not in _HANDED_OUT:
                _HANDED_OUT.add(port)
                return port


def is_loopback(host: str) -> bool:
    """Whether binding `host` listens on loopback only ("localhost", 127.0.0.0/8, ::1); "0.0.0.0",
    "::" and every other address reach beyond this machine."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False
