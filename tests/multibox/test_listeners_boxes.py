"""Two boxes each serve the same TCP port for a host of their own (issue 28 item 5): a
listener address is unique per box among hosts whose placements can meet, not store-wide.

Both "boxes" are state dirs on this one machine, so one port number can be bound twice
only on two addresses: box a serves 127.0.0.1:P and box b 127.0.0.2:P (both on Linux's
loopback, 127.0.0.0/8, with no setup). That the very same address is taken by the store
for hosts on different boxes is shown beside it: a third host placed on b is given a's
127.0.0.1:P (accepted, never woken: this machine cannot bind it twice) and the in-process
tests in tests/integration/test_listeners_per_box.py refuse and accept each case."""

from __future__ import annotations

import socket

import pytest

from tests.conftest import HELLO, wait_for
from tests.integration.test_cli_bad_input import refused
from tests.listening import free_port
from tests.multibox.test_multibox import serving, wake_all

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.postgresql_only("several boxes share one PostgreSQL store")]


def answer(address: str, port: int) -> str:
    with socket.create_connection((address, port), timeout=10) as s:
        s.sendall(b"GET / HTTP/1.0\r\nHost: t\r\n\r\n")
        data = b""
        while chunk := s.recv(4096):
            data += chunk
    return data.decode()


def test_two_boxes_each_serve_the_same_port_for_their_own_host(boxes) -> None:  # type: ignore[no-untyped-def]
    a, b = boxes("a"), boxes("b")
    port = free_port()
    a.start()
    b.start()
    for name, box, ip in (("on-a", "a", "127.0.0.1"), ("on-b", "b", "127.0.0.2")):
        a.run("host", "add", name, "--build", str(HELLO), "--box", box,
              "--listen", f"http=tcp:{ip}:{port}")
    # The same address as on-a's, for a host of box b: taken (run from box a, whose agent
    # holds the address now: the CLI binds it to probe only where the host may run).
    a.run("host", "add", "also-b", "--build", str(HELLO), "--box", "b",
          "--listen", f"http=tcp:127.0.0.1:{port}")
    refused(a.run("host", "add", "both", "--build", str(HELLO), "--box", "a", "--box", "b",
                  "--listen", f"http=tcp:127.0.0.1:{port}", check=False),
            "is already host on-a's listener", "both are placed on a")
    wake_all(a, ["on-a", "on-b"])
    wait_for(lambda: serving(a, ["on-a", "on-b"], {"a", "b"}), 90, interval=0.2,
             what="both hosts awake")

    for name, box, ip in (("on-a", a, "127.0.0.1"), ("on-b", b, "127.0.0.2")):
        pid = a.status(name)["pid"]
        assert pid in box.app_procs()[name], (name, box.name, box.app_procs())
        reply = answer(ip, port)  # through the listener vigil holds on that box
        assert reply.startswith("HTTP/1.0 200") and f"pid={pid} " in reply, (name, reply)
    assert "on-b" not in a.app_procs() and "on-a" not in b.app_procs()
    a.check()
