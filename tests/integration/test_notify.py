"""systemd's readiness protocol, spoken to a real datagram socket by the real agent (systemd
itself does not run on this box): READY=1 only once recovery has adopted the running app,
STOPPING=1 on SIGTERM, over a socket path and over the abstract namespace (`@name`)."""

from __future__ import annotations

import socket
import uuid
from pathlib import Path

from sqlalchemy import select

from models.tables import Event
from runners.base.sd_notify import notify
from tests.conftest import Vigil


def listen(address: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(address)
    s.settimeout(30)  # bound: the agent must be ready well within it
    return s


def messages(s: socket.socket) -> dict[str, str]:
    data = s.recv(4096).decode()
    return dict(line.split("=", 1) for line in data.splitlines())


def test_ready_after_recovery_and_stopping_on_term(vigil: Vigil, short_tmp: Path,
                                                    monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert notify("READY=1") is False  # not under systemd: nothing to do

    path = str(short_tmp / "notify.sock")
    with listen(path) as s:
        vigil.env["NOTIFY_SOCKET"] = path
        vigil.add_host("web")
        agent = vigil.start_agent()
        assert messages(s)["READY"] == "1"
        vigil.run("wake", "web", "--wait")
        pid = vigil.status("web")["pid"]
        vigil.stop_agent(agent)
        assert messages(s)["STOPPING"] == "1"

    name = f"vigil-test-{uuid.uuid4().hex}"
    with listen("\0" + name) as s:
        vigil.env["NOTIFY_SOCKET"] = "@" + name
        agent = vigil.start_agent()
        got = messages(s)
        # Sent after recovery: the app was already adopted (not restarted) when READY came.
        kinds = vigil.store.read(lambda db: db.execute(
            select(Event.kind).where(Event.host == "web")).scalars().all())
        assert got["READY"] == "1" and "adopted 1" in got["STATUS"], got
        assert "adopted" in kinds
        assert vigil.status("web")["pid"] == pid
        vigil.stop_agent(agent)
        assert messages(s)["STOPPING"] == "1"
