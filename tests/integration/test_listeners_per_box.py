"""A listener address is unique per box among hosts whose placements can meet on one box
(issue 28 item 5), not store-wide: `host add b --box box2 --listen tcp:127.0.0.1:P` is
taken while host a on box1 has it; refused (one line, cause and fix, nothing written)
while the two could run on one box: both unplaced, one unplaced, box lists that overlap."""

from __future__ import annotations

import socket
import threading

import pytest
import sqlalchemy as sa

from models.errors import BadInput
from models.states import HostKind
from runners.backend.files import stage_build
from tests.conftest import HELLO, Vigil, wait_for
from tests.integration.test_cli_bad_input import refused
from tests.listening import free_port
from workflows.config.hosts import add_host, record_build


def add(v: Vigil, name: str, address: str, *boxes: str, check: bool = True) -> object:
    flags = [f for b in boxes for f in ("--box", b)]
    return v.run("host", "add", name, "--build", str(HELLO), "--listen", address, *flags,
                 check=check)


def hosts(v: Vigil) -> list[str]:
    return [h["host"] for h in v.json("host", "list")]


def test_an_address_is_refused_only_where_placements_meet(vigil: Vigil) -> None:
    port, other = free_port(), free_port()
    at = f"tcp:127.0.0.1:{port}"
    add(vigil, "a", at, "box1")
    add(vigil, "b", at, "box2")  # cannot meet a: box2 binds its own 127.0.0.1:port
    add(vigil, "c", f"tcp:0.0.0.0:{port}", "box3")  # a wildcard, on a box of its own
    refused(add(vigil, "d", at, check=False),  # type: ignore[arg-type]
            f"{at} is already host a's listener", "one is placed nowhere, so it may run on box1",
            "place the two hosts on different boxes")
    refused(add(vigil, "d", at, "box3", "box2", check=False),  # type: ignore[arg-type]
            "is already host b's listener", "both are placed on box2")
    refused(add(vigil, "d", f"tcp:127.0.0.1:{port}", "box3", check=False),  # type: ignore[arg-type]
            f"{at} is already host c's listener (tcp:0.0.0.0:{port})", "box3")
    add(vigil, "u1", f"tcp:127.0.0.1:{other}")
    refused(add(vigil, "u2", f"tcp:127.0.0.1:{other}", check=False),  # type: ignore[arg-type]
            "is already host u1's listener", "neither is placed, so both may run on any box")
    refused(add(vigil, "u2", f"tcp:127.0.0.1:{other}", "box9", check=False),  # type: ignore[arg-type]
            "is already host u1's listener", "one is placed nowhere, so it may run on box9")
    assert hosts(vigil) == ["a", "b", "c", "u1"]
    # `host set` of a listener goes through the same check, with the host's own placement.
    refused(vigil.run("host", "set", "b", "--listen", f"tcp:127.0.0.1:{other}", check=False),
            "is already host u1's listener", "one is placed nowhere")
    vigil.run("host", "set", "b", "--listen", f"tcp:127.0.0.2:{port}")
    rows = vigil.store.read(lambda s: s.execute(sa.text(
        "SELECT host, address FROM listeners ORDER BY host")).all())
    assert [tuple(r) for r in rows] == [("a", at), ("b", f"tcp:127.0.0.2:{port}"),
                                        ("c", f"tcp:0.0.0.0:{port}"),
                                        ("u1", f"tcp:127.0.0.1:{other}")]


def test_a_host_placed_elsewhere_is_not_probed_on_this_box(vigil: Vigil) -> None:
    """The CLI binds a new address to see that it is free only where the host may run: on
    box1, a host placed on box2 takes an address box1 holds for a host of its own."""
    (vigil.state_dir / "agent-id").write_text("box1\n")
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen(1)  # box1's own socket on the address
    at = f"tcp:127.0.0.1:{held.getsockname()[1]}"
    try:
        add(vigil, "there", at, "box2")
        refused(add(vigil, "here", at, "box1", check=False), "in use")  # type: ignore[arg-type]
    finally:
        held.close()
    assert hosts(vigil) == ["there"]


@pytest.mark.postgresql_only("two transactions at once on PostgreSQL (SQLite serializes writers)")
def test_two_hosts_added_at_once_cannot_both_take_an_address(vigil: Vigil) -> None:
    """The check is in the transaction, not an index: the second transaction waits on the
    first's lock (seen waiting in pg_stat_activity), then reads its committed row and is
    refused."""
    store = vigil.store
    path, digest = stage_build(str(HELLO), vigil.state_dir)
    store.write(lambda s: record_build(s, path, digest, str(HELLO)))  # not what they race on
    at = f"tcp:127.0.0.1:{free_port()}"
    from workflows.generations.listeners import parse_listen

    def adding(name: str, hold: threading.Event | None, inside: threading.Event | None) -> None:
        def step(s: sa.orm.Session) -> None:
            add_host(s, name, kind=HostKind.instance, build_path=path, digest=digest,
                     source=str(HELLO), args=[], env={}, cwd=None, drain_timeout=2.0,
                     health_timeout=5.0, box=None, listeners=[parse_listen(at, name)],
                     ready="notify")
            if inside is not None and hold is not None:
                inside.set()
                assert hold.wait(60)  # the transaction stays open, its lock held

        store.write(step)

    inside, hold = threading.Event(), threading.Event()
    first = threading.Thread(target=adding, args=("first", hold, inside))
    first.start()
    errors: list[BaseException] = []

    def second() -> None:
        try:
            adding("second", None, None)
        except BaseException as exc:
            errors.append(exc)

    try:
        assert inside.wait(60)
        t = threading.Thread(target=second)
        t.start()
        admin = sa.create_engine(store.url)
        try:
            def waiting() -> bool:
                with admin.connect() as c:
                    return bool(c.execute(sa.text(
                        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                        "AND wait_event_type = 'Lock' AND wait_event = 'advisory'")).scalar())
            wait_for(waiting, 30, what="the second transaction waiting on the first's lock")
        finally:
            admin.dispose()
    finally:
        hold.set()
        first.join(60)
    t.join(60)
    assert len(errors) == 1 and isinstance(errors[0], BadInput), errors
    assert "is already host first's listener" in str(errors[0].cause)
    assert hosts(vigil) == ["first"]

