"""Wakes that fail: the build's own failure (bad health, exit at start) and a staged build
that is gone or altered. The wake fails with a reason, nothing is left running, the lease
is given back and the invariants hold."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import FIXTURES, Vigil, wait_for


def generations(vigil: Vigil) -> list[tuple]:
    with vigil.store.engine.connect() as conn:
        return [tuple(r) for r in conn.exec_driver_sql("SELECT id, state, pid FROM generations")]


def settled_asleep(vigil: Vigil, host: str) -> None:
    vigil.quiesce(10)
    wait_for(lambda: vigil.app_pids() == [], 5, what=f"no process left (left: {vigil.app_pids()})")
    st = vigil.status(host)
    assert st["state"] == "asleep" and st["lease"] is None and st["pid"] is None, st


@pytest.mark.parametrize("fixture, words", [
    ("bad_health.py", ("health", "500")),
    ("exit_fast.py", ("exit",)),
])
def test_build_failing_its_start_leaves_nothing(vigil: Vigil, fixture: str, words: tuple[str, ...]) -> None:
    vigil.add_host("bad", FIXTURES / fixture, "--health-timeout", "1")
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    cp = vigil.run("wake", "bad", "--wait", check=False)
    assert cp.returncode != 0
    err = cp.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in cp.stdout + cp.stderr, err
    for w in words:
        assert w in err, f"{w!r} not in {err!r}"
    settled_asleep(vigil, "bad")
    # It ran and was proven gone: exactly one generation, proven.
    gens = generations(vigil)
    assert [g[1] for g in gens] == ["proven"], gens
    vigil.check()


def _staged(vigil: Vigil) -> Path:
    (path,) = [p for p in (vigil.state_dir / "builds").rglob("*") if p.is_file()]
    return path


@pytest.mark.parametrize("damage", ["deleted", "modified"])
def test_damaged_staged_build_is_refused_before_anything_runs(vigil: Vigil, damage: str) -> None:
    vigil.add_host("hello")
    staged = _staged(vigil)
    if damage == "deleted":
        staged.unlink()
    else:
        staged.write_bytes(staged.read_bytes() + b"\n# tampered\n")
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    cp = vigil.run("wake", "hello", "--wait", check=False)
    assert cp.returncode != 0
    err = cp.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in cp.stdout + cp.stderr, err
    assert "staged build" in err and "vigil deploy" in err, err
    if damage == "deleted":
        assert "cannot be read (No such file or directory)" in err, err
    else:
        assert "does not match its digest" in err, err
    settled_asleep(vigil, "hello")
    assert generations(vigil) == [], "nothing may be spawned for a damaged build"
    events = vigil.json("events", "hello")
    failed = [e for e in events if e["kind"] == "wake_failed"]
    assert failed and failed[-1]["detail"]["executed"] is False, events
    if damage == "modified":
        vigil.check()
