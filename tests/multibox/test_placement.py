"""Placement and box names: bad input is refused with one line and changes nothing; a
lease is taken only by a box the host is placed on (SQLite, in-process, no agent)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import func, select, update

from models.store import utcnow
from models.tables import BoxLease, Host, Lease
from runners.wiring import make_context
from tests.conftest import HELLO, Vigil
from workflows.base.context import Poke
from workflows.leases.lease import acquire, renew_in

pytestmark = pytest.mark.postgresql_only("several boxes share one PostgreSQL store")


@pytest.mark.parametrize("args", [("--box", "Web 1"), ("--box", "-x")])
def test_bad_box_name_is_refused(vigil: Vigil, args: tuple[str, ...]) -> None:
    cp = vigil.run("host", "add", "web", "--build", str(HELLO), *args, check=False)
    assert cp.returncode != 0
    lines = cp.stderr.strip().splitlines()
    assert len(lines) == 1 and "invalid box name" in lines[0] and "use 1-63" in lines[0], cp.stderr
    assert vigil.store.read(lambda s: s.get(Host, "web")) is None


def test_agent_refuses_another_box_name_for_its_state_dir(vigil: Vigil) -> None:
    (vigil.state_dir / "agent-id").write_text("web1\n")
    cp = vigil.run("agent", "--box", "web2", check=False, timeout=60)
    assert cp.returncode != 0
    assert cp.stderr.strip().splitlines()[-1].startswith("vigil: error: --box web2: the state "
                                                         "directory"), cp.stderr
    assert (vigil.state_dir / "agent-id").read_text() == "web1\n"


def test_lease_only_on_a_placed_box_and_taken_over_only_when_expired(vigil: Vigil) -> None:
    vigil.run("host", "add", "web", "--build", str(HELLO), "--box", "b1", "--box", "b2")
    vigil.run("host", "add", "free", "--build", str(HELLO))
    assert vigil.store.read(lambda s: s.get(Host, "web").box) == "b1,b2"
    store = vigil.store

    def ctx(agent: str):  # type: ignore[no-untyped-def]
        return make_context(vigil.state_dir, store, agent, lease_ttl=30.0)

    with pytest.raises(Poke, match="placed on b1,b2, not on this box"):
        store.write(lambda s: acquire(s, ctx("b3"), "web"))
    assert store.write(lambda s: acquire(s, ctx("b1"), "web")) == 1
    with pytest.raises(Poke, match="held by agent b1"):
        store.write(lambda s: acquire(s, ctx("b2"), "web"))
    # An unplaced host: any box takes it while free, nobody takes it over once expired.
    store.write(lambda s: acquire(s, ctx("b3"), "free"))
    past = utcnow() - timedelta(seconds=1)  # every box lease expired: their host leases lapse
    store.write(lambda s: s.execute(update(BoxLease).values(expires_at=past)))
    with pytest.raises(Poke, match="only a box the host is placed on takes it over"):
        store.write(lambda s: acquire(s, ctx("b1"), "free"))
    assert store.write(lambda s: acquire(s, ctx("b2"), "web")) == 2
    assert store.read(lambda s: s.execute(select(Lease.holder, Lease.fence)
                                          .where(Lease.host == "web")).one()) == ("b2", 2)


def test_lease_expiry_is_written_and_judged_by_the_store_s_clock(vigil: Vigil) -> None:
    """Every box writes and judges a lease's expiry by the server's time (issue 28 item 2):
    a box whose clock is off by a minute once wrote leases every other box read as expired
    (or as held a minute too long) from the start. Exactly the transaction's own now()."""
    vigil.run("host", "add", "web", "--build", str(HELLO))
    store, ttl = vigil.store, timedelta(seconds=30)
    ctx = make_context(vigil.state_dir, store, "b1", lease_ttl=ttl.total_seconds())

    def server_now(s):  # type: ignore[no-untyped-def]
        return s.execute(select(func.timezone("UTC", func.now()))).scalar_one()

    def lease(s):  # type: ignore[no-untyped-def]
        return s.execute(select(Lease.acquired_at, Lease.expires_at)
                         .where(Lease.host == "web")).one()

    now, (acquired, expires) = store.write(lambda s: (acquire(s, ctx, "web") and server_now(s),
                                                      lease(s)))
    assert (acquired, expires) == (now, now + ttl)
    # The renewal is the box lease's: one row, pushed to the server's now + TTL once past
    # half its length; the host's lease row is not written again.
    store.write(lambda s: s.execute(update(BoxLease).values(expires_at=server_now(s) + ttl / 3)))
    now, epoch, renewed = store.write(lambda s: (server_now(s), renew_in(s, ctx), s.execute(
        select(BoxLease.expires_at).where(BoxLease.box == "b1")).scalar_one()))
    assert epoch == 1 and renewed == now + ttl
    assert store.read(lease) == (acquired, expires)
