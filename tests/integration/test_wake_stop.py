"""Wake and stop round trips through the real CLI and the real agent."""

from __future__ import annotations

import socket

from tests.conftest import Vigil, pid_dead, wait_for


def get(sock_path: str) -> bytes:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(5)
    s.connect(sock_path)
    s.sendall(b"GET / HTTP/1.0\r\n\r\n")
    data = b""
    while chunk := s.recv(4096):
        data += chunk
    s.close()
    return data


def test_wake_serve_stop_round_trip(vigil: Vigil) -> None:
    vigil.add_host("hello")
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    vigil.run("wake", "hello", "--wait")
    st = vigil.status("hello")
    assert st["state"] == "awake" and st["pid"]
    reply = get(str(vigil.state_dir / "run" / "hello.sock"))
    assert b"200 OK" in reply and f"pid={st['pid']}".encode() in reply
    vigil.check()
    vigil.run("stop", "hello", "--wait")
    assert pid_dead(st["pid"])
    assert vigil.status("hello")["state"] == "asleep"
    assert vigil.obligations() == []
    vigil.check()
    # asleep again: the lease was given back
    assert vigil.status("hello")["lease"] is None
    wait_for(lambda: agent.poll() is None, 1)
