"""The seeds' parent memory limit on a real memory controller (issue 21 item 3): a host with
a memory tier runs each generation inside a parent cgroup of its own, limited to the tier;
an overlap deploy raises the parent to twice the tier while the old and the new generation
run side by side, and the last member out restores it. On these boxes the controller is
cgroup v1's (`<mount>/vigil/hosts/<box>/<host>`, runners/backend/cglimits.py); the crash
points of the raise and the restore are the variants tier-* of tests/recovery."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import select

from models.states import GenState
from models.tables import Generation, Host
from runners.backend.cglimits import MB, parent_dir, v1_mounts
from tests.conftest import HELLO, Vigil, wait_for

TIER = 64
MEMORY = v1_mounts().get("memory")
pytestmark = pytest.mark.skipif(MEMORY is None, reason="no writable cgroup v1 memory hierarchy")


def parent(v: Vigil, host: str) -> Path:
    box = (v.state_dir / "agent-id").read_text().strip()
    return Path(parent_dir(str(MEMORY), box, host))


def limit(v: Vigil, host: str) -> int:
    return int((parent(v, host) / "memory.limit_in_bytes").read_text())


def memory_cgroup(pid: int) -> str:
    """The pid's cgroup on the v1 memory hierarchy, as /proc says it."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return path
    raise AssertionError(f"pid {pid} has no memory cgroup")


def current(v: Vigil, host: str) -> Generation:
    return v.store.read(lambda s: s.execute(select(Generation).where(
        Generation.host == host, Generation.state == GenState.current)).scalar_one())


def inside_parent(v: Vigil, host: str, gen: Generation) -> bool:
    root = str(parent(v, host)).removeprefix(str(MEMORY))
    return gen.pid is not None and memory_cgroup(gen.pid) == f"{root}/{gen.uuid}"


def tiered_host(v: Vigil, tmp: Path, build: Path) -> None:
    hosts = tmp / "hosts.toml"
    hosts.write_text(f'[hosts.tiered]\nbuild = "{build}"\nmemory_tier_mb = {TIER}\n'
                     "drain_timeout = 5\nhealth_timeout = 10\n")
    v.run("apply", str(hosts))


def test_an_overlap_raises_the_parent_to_twice_the_tier_and_restores_it(
        vigil: Vigil, short_tmp: Path) -> None:
    vigil.env["VIGIL_SETTLE_SECONDS"] = "2"  # both generations run for at least this long
    tiered_host(vigil, short_tmp, HELLO)
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    vigil.run("wake", "tiered", "--wait")
    old = current(vigil, "tiered")
    assert limit(vigil, "tiered") == TIER * MB
    assert inside_parent(vigil, "tiered", old), memory_cgroup(old.pid or 0)

    nxt = short_tmp / "hello-next.py"
    nxt.write_bytes(HELLO.read_bytes() + b"\n# next\n")
    nxt.chmod(0o755)
    vigil.run("deploy", "tiered", str(nxt), "--mode", "overlap")
    wait_for(lambda: limit(vigil, "tiered") == 2 * TIER * MB, 30, interval=0.005,
             what="the parent raised to twice the tier during the overlap")
    assert vigil.store.read(lambda s: s.get(Host, "tiered").raised)
    wait_for(lambda: current(vigil, "tiered").id != old.id
             and not vigil.store.read(lambda s: s.get(Host, "tiered").raised), 60,
             what="the deploy done and the parent restored")
    new = current(vigil, "tiered")
    assert limit(vigil, "tiered") == TIER * MB
    assert inside_parent(vigil, "tiered", new)
    kinds = [e["kind"] for e in vigil.json("events", "tiered")]
    assert "restored" in kinds, kinds
    wait_for(lambda: not (parent(vigil, "tiered") / old.uuid).exists(), 30,
             what="the old generation's memory cgroup removed after its proof")
    vigil.run("stop", "tiered", "--wait")
    wait_for(lambda: not parent(vigil, "tiered").exists(), 30,
             what="the parent removed once no generation is left in it")
    vigil.stop_agent(agent)
