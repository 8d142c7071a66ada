"""tether.common.net.free_port: never the same port twice in one process, even when the kernel offers it
again (a stack's trainer and scheduler were once given one port)."""

from __future__ import annotations

import socket

from tether.common import net


def test_free_port_never_hands_out_a_port_twice(monkeypatch):
    offered = iter([41001, 41001, 41002, 41001, 41003])

    class Probe:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def bind(self, address):
            self.port = next(offered)

        def getsockname(self):
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(net, "_HANDED_OUT", set())
    monkeypatch.setattr(net.socket, "socket", Probe)
    assert [net.free_port(), net.free_port(), net.free_port()] == [41001, 41002, 41003]


def test_free_port_is_bindable_and_distinct():
    ports = [net.free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))
