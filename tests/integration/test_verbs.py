"""The verbs an operator reaches for on the second day (issue 22), each through the CLI as
typed: `restart HOST...`, several hosts, a glob or `--all` for wake, stop and restart, with
one line per host and every host its own obligation."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import FIXTURES, HELLO, Vigil


def _current(vigil: Vigil, host: str) -> tuple[int | None, int | None]:
    st = vigil.status(host)
    return st["generation"], st["pid"]


def test_wake_stop_restart_take_several_hosts_globs_and_all(vigil: Vigil) -> None:
    for name in ("web1", "web2", "api"):
        vigil.add_host(name, HELLO)
    vigil.add_host("job", FIXTURES / "worker.py", "--kind", "worker")
    agent = vigil.start_agent()
    vigil.wait_ready(agent)

    cp = vigil.run("wake", "web*", "--wait")
    assert sorted(cp.stdout.splitlines()) == sorted(
        f"host {h} awake: generation g{vigil.status(h)['generation']} pid {vigil.status(h)['pid']}"
        for h in ("web1", "web2")), cp.stdout
    assert vigil.status("api")["state"] == "asleep"

    cp = vigil.run("wake", "--all", "--wait")
    assert "host web1 is already awake" in cp.stdout and "host api awake" in cp.stdout
    assert "host job awake" in cp.stdout, cp.stdout

    before = {h: _current(vigil, h) for h in ("web1", "web2", "api", "job")}
    cp = vigil.run("restart", "web1", "job", "--wait")
    lines = cp.stdout.splitlines()
    assert len(lines) == 4, cp.stdout  # each: its attempt done, then its generation settled
    assert lines[0].startswith("host web1: attempt #") and "done (mode overlap" in lines[0]
    assert lines[1].startswith("host web1: generation g") and "settled" in lines[1]
    assert lines[2].startswith("host job: attempt #") and "done (mode hold" in lines[2]
    assert lines[3].startswith("host job: generation g") and "settled" in lines[3]
    for h in ("web1", "job"):
        assert _current(vigil, h)[0] != before[h][0]
    for h in ("web2", "api"):  # not named: untouched
        assert _current(vigil, h) == before[h]
    with vigil.store.engine.connect() as conn:
        causes = conn.exec_driver_sql("SELECT host, cause FROM attempts ORDER BY id").all()
    assert [tuple(c) for c in causes] == [("web1", "restart"), ("job", "restart")]

    cp = vigil.run("restart", "web2", "--mode", "hold", "--wait")  # one host: its steps shown
    assert "stopping" in cp.stdout or "spawning" in cp.stdout, cp.stdout
    assert "done (mode hold" in cp.stdout.splitlines()[-2]
    assert "host web2: generation g" in cp.stdout.splitlines()[-1] and "settled" in cp.stdout

    cp = vigil.run("stop", "--all", "--wait")
    assert sorted(ln.split(" stopped")[0] for ln in cp.stdout.splitlines()) == [
        "host api", "host job", "host web1", "host web2"], cp.stdout
    vigil.quiesce()
    assert vigil.app_pids() == []

    cp = vigil.run("restart", "api", "--wait")  # a host that does not run is woken
    assert "host api is not running: wake #" in cp.stdout and "host api awake" in cp.stdout
    vigil.check()


def test_bad_targets_are_refused_before_anything_is_written(vigil: Vigil) -> None:
    vigil.add_host("web1", HELLO)
    before = vigil.obligations()
    for args, code, line in (
            (("wake",), 2, "no host given; name one or several"),
            (("wake", "web1", "--all"), 2, "give host names or --all, not both"),
            (("stop", "db*"), 3, "no host matches 'db*'"),
            (("restart", "web1", "nosuch"), 3, "no host named 'nosuch'"),
            (("restart", "nosuch"), 3, "no host named 'nosuch'")):
        cp = vigil.run(*args, check=False)
        assert cp.returncode == code and line in cp.stderr, (args, cp.stderr)
    assert vigil.obligations() == before
    with vigil.store.engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT count(*) FROM wakes").scalar_one() == 0


def test_one_refused_host_does_not_stop_the_others(vigil: Vigil) -> None:
    """A restart refused for one host (a deploy in flight) is its own line; the others are
    written; the exit code says one failed."""
    vigil.add_host("a", HELLO)
    vigil.add_host("b", HELLO)
    vigil.run("wake", "a", "b")  # no agent: the intents wait in the store
    vigil.run("deploy", "a", str(HELLO))
    cp = vigil.run("restart", "a", "b", check=False)
    assert cp.returncode == 4, cp.stdout + cp.stderr
    assert "host a is deploying (attempt #1): a restart would supersede it" in cp.stderr
    assert "restart failed for 1 of 2 hosts (a)" in cp.stderr
    assert "host b is not running: wake #" in cp.stdout


def test_status_takes_several_hosts_and_globs(vigil: Vigil) -> None:
    for name in ("web1", "web2", "api"):
        vigil.add_host(name, HELLO)
    assert [r["host"] for r in vigil.json("status", "web*")] == ["web1", "web2"]
    assert [r["host"] for r in vigil.json("status", "api", "web2")] == ["api", "web2"]
    assert [r["host"] for r in vigil.json("status")] == ["api", "web1", "web2"]
    cp = vigil.run("status", "db*", check=False)
    assert cp.returncode == 3 and "no host matches 'db*'" in cp.stderr


def test_canary_deploy_shows_its_settle_as_progress(vigil: Vigil, short_tmp: Path) -> None:
    """Before: `deploy --canary --wait` printed nothing for the whole settle window."""
    vigil.env["VIGIL_SETTLE_SECONDS"] = "3"
    vigil.add_host("web", HELLO)
    vigil.wait_ready(vigil.start_agent())
    vigil.run("wake", "web", "--wait")
    new = short_tmp / "hello2.py"
    new.write_text(HELLO.read_text() + "# another build\n")
    new.chmod(0o755)
    cp = vigil.run("deploy", "web", str(new), "--canary", "--wait")
    lines = cp.stdout.splitlines()
    settling = [ln for ln in lines if "settling: the successor is up" in ln]
    assert len(settling) >= 2, cp.stdout
    assert lines.index(settling[0]) > next(i for i, ln in enumerate(lines) if ln.endswith("healthy"))
