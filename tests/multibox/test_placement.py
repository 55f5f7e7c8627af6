"""Placement and box names: bad input is refused with one line and changes nothing; a
lease is taken only by a box the host is placed on (SQLite, in-process, no agent)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import select, update

from models.store import utcnow
from models.tables import Host, Lease
from runners.wiring import make_context
from tests.conftest import HELLO, Vigil
from workflows.base.context import Poke
from workflows.leases.lease import acquire

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
    past = utcnow() - timedelta(seconds=1)
    store.write(lambda s: s.execute(update(Lease).values(expires_at=past)))
    with pytest.raises(Poke, match="only a box the host is placed on takes it over"):
        store.write(lambda s: acquire(s, ctx("b1"), "free"))
    assert store.write(lambda s: acquire(s, ctx("b2"), "web")) == 2
    assert store.read(lambda s: s.execute(select(Lease.holder, Lease.fence)
                                          .where(Lease.host == "web")).one()) == ("b2", 2)
