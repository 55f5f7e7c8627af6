"""Input found by attacking vigil (issue 16): each is refused with one line (cause; fix),
a non-zero exit and nothing changed; where bad values are already in a store (written by
hand or by an older vigil), the agent fails the step once instead of retrying it forever."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import sqlalchemy as sa

from models.tables import Attempt, Generation, Host
from tests.conftest import HELLO, Vigil, wait_for
from tests.integration.test_cli_bad_input import dump, refused

HOSTS = f"""\
[hosts.web]
build = "{HELLO}"
env = {{ GREETING = "hi" }}
args = ["--flag"]
"""


def apply_refused(vigil: Vigil, short_tmp: Path, text: str, *words: str) -> None:
    """`vigil apply` of `text`: one line naming the file and the words, exit 2, no change."""
    f = short_tmp / "hosts.toml"
    f.write_text(HOSTS)
    vigil.run("apply", str(f))
    before = dump(vigil)
    f.write_text(text)
    cp = vigil.run("apply", str(f), check=False)
    assert cp.returncode == 2, cp.stdout + cp.stderr
    line = refused(cp, str(f), *words)
    assert "Traceback" not in line
    assert dump(vigil) == before


# -- 1. env and args no process can be started with ---------------------------------------

@pytest.mark.parametrize(("edit", "words"), [
    (('GREETING = "hi"', '"C=D" = "x"'), ("hosts.web.env", "'C=D'", "'='")),
    (('GREETING = "hi"', '"" = "x"'), ("hosts.web.env", "empty")),
    (('GREETING = "hi"', '"A\\u0000B" = "x"'), ("hosts.web.env", "NUL")),
    (('GREETING = "hi"', 'GREETING = "a\\u0000b"'), ("hosts.web.env", "GREETING", "NUL")),
    (('args = ["--flag"]', 'args = ["a\\u0000b"]'), ("hosts.web.args", "NUL")),
])
def test_apply_refuses_env_and_args_no_process_can_take(vigil: Vigil, short_tmp: Path,
                                                        edit: tuple[str, str],
                                                        words: tuple[str, ...]) -> None:
    apply_refused(vigil, short_tmp, HOSTS.replace(*edit), *words)


@pytest.mark.parametrize(("extra", "words"), [
    (("--env", "A\x00B=x"), ("--env", "NUL")),
    (("--env", "A=x\x00y"), ("--env", "NUL")),
    (("--arg", "a\x00b"), ("--arg", "NUL")),
])
def test_host_add_refuses_env_and_args_no_process_can_take(vigil: Vigil, extra: tuple[str, ...],
                                                           words: tuple[str, ...]) -> None:
    vigil.add_host("hello")
    before = dump(vigil)
    staged = sorted(p.name for p in (vigil.state_dir / "builds").iterdir())
    # In-process: a NUL cannot be passed in a real process's argv.
    refused(vigil.run("host", "add", "ok", "--build", str(HELLO), *extra, check=False), *words)
    assert dump(vigil) == before
    assert sorted(p.name for p in (vigil.state_dir / "builds").iterdir()) == staged


def _poison(vigil: Vigil, host: str, **values: object) -> None:
    """Store values no process can be started with, as a hand edit (or an older vigil) would."""
    with vigil.store.engine.begin() as conn:
        conn.execute(sa.update(Host).where(Host.name == host).values(
            **{k: json.dumps(v) for k, v in values.items()}))


def _generations(vigil: Vigil, host: str) -> int:
    return vigil.store.read(lambda s: s.execute(
        sa.select(sa.func.count()).select_from(Generation).where(Generation.host == host)).scalar())


@pytest.mark.parametrize("poison", [{"env": {"C=D": "x"}}, {"args": ["a\x00b"]}])
def test_stored_unstartable_host_fails_its_wake_once_and_stops(vigil: Vigil,
                                                               poison: dict[str, object]) -> None:
    vigil.add_host("bad")
    _poison(vigil, "bad", **poison)
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    cp = vigil.run("wake", "bad", "--wait", "--timeout", "20", check=False)
    line = refused(cp, "wake of bad failed", "spawn")
    assert "timed out" not in line, line
    time.sleep(1)  # a loop would write a generation every ~250 ms: give it the time to show
    assert _generations(vigil, "bad") == 1
    started = time.monotonic()
    vigil.run("stop", "bad", "--wait", "--timeout", "20")
    assert time.monotonic() - started < 10
    vigil.quiesce(10)
    assert vigil.app_pids() == []
    vigil.check()


def test_deploy_whose_spawn_can_never_succeed_fails_unexecuted(vigil: Vigil) -> None:
    vigil.add_host("hello")
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    vigil.run("wake", "hello", "--wait")
    _poison(vigil, "hello", args=["a\x00b"])
    cp = vigil.run("deploy", "hello", str(HELLO), "--wait", "--timeout", "30", check=False)
    assert cp.returncode != 0, cp.stdout + cp.stderr
    a = vigil.store.read(lambda s: s.execute(
        sa.select(Attempt).order_by(Attempt.id.desc()).limit(1)).scalar_one())
    assert (a.outcome.value, a.executed) == ("failed", False), (a.outcome, a.executed, a.reason)
    assert vigil.status("hello")["state"] == "awake"  # the old one keeps serving
    wait_for(lambda: not vigil.obligations(), 10, what="quiescence")
    vigil.check()


# -- 3. durations: finite, above 0, at most a day --------------------------------------------

BAD_SECONDS = ("inf", "1e300", "nan", "-1", "0", "86401")


@pytest.mark.parametrize("value", BAD_SECONDS)
@pytest.mark.parametrize("option", [
    ("--drain-timeout",), ("--health-timeout",), ("--kind", "worker", "--max-run"),
    ("--kind", "worker", "--restart-floor"), ("--kind", "worker", "--restart-cap"),
    ("--kind", "worker", "--restart-reset"), ("--kind", "worker", "--converge-grace"),
])
def test_host_add_refuses_unbounded_durations(vigil: Vigil, option: tuple[str, ...],
                                              value: str) -> None:
    before = dump(vigil)
    refused(vigil.run("host", "add", "ok", "--build", str(HELLO), *option, value, check=False),
            option[-1], "seconds", "86400")
    assert dump(vigil) == before
    assert not (vigil.state_dir / "builds").exists() or not any(
        (vigil.state_dir / "builds").iterdir()), "nothing may be staged"


@pytest.mark.parametrize("value", BAD_SECONDS)
@pytest.mark.parametrize("command", [("wake", "hello", "--wait"), ("stop", "hello", "--wait"),
                                     ("deploy", "hello", str(HELLO), "--wait"),
                                     ("retry", "hello", "--wait")])
def test_wait_timeout_refused_before_anything_is_queued(vigil: Vigil, command: tuple[str, ...],
                                                        value: str) -> None:
    vigil.add_host("hello")
    before = dump(vigil)
    refused(vigil.run(*command, "--timeout", value, check=False), "--timeout", "seconds")
    assert dump(vigil) == before


@pytest.mark.parametrize("value", ("inf", "nan", "-1", "1e300"))
@pytest.mark.parametrize("option", ["--safety-interval", "--sweep-interval", "--lease-ttl"])
def test_agent_refuses_unbounded_intervals(vigil: Vigil, option: str, value: str) -> None:
    refused(vigil.run("agent", option, value, check=False, timeout=30), option)


@pytest.mark.parametrize("value", ("inf", "nan", "-1", "1e300", "0", "86401"))
@pytest.mark.parametrize("key", ["drain_timeout", "health_timeout"])
def test_apply_refuses_unbounded_durations(vigil: Vigil, short_tmp: Path, key: str,
                                           value: str) -> None:
    apply_refused(vigil, short_tmp, HOSTS + f"{key} = {value}\n",
                  f"hosts.web.{key}", "seconds", "86400")


@pytest.mark.parametrize("value", ("inf", "nan", "-1", "1e300"))
def test_apply_refuses_unbounded_worker_durations(vigil: Vigil, short_tmp: Path,
                                                  value: str) -> None:
    apply_refused(vigil, short_tmp, HOSTS + f'[hosts.jobs]\nbuild = "{HELLO}"\nkind = "worker"\n'
                  f"restart_cap = {value}\n", "hosts.jobs.restart_cap", "seconds")


# -- 11. accepted but meaningless ---------------------------------------------------------------

def test_cron_that_never_fires_is_refused(vigil: Vigil) -> None:
    vigil.add_host("hello")
    before = dump(vigil)
    refused(vigil.run("schedule", "add", "hello", "--cron", "0 0 31 2 *", check=False),
            "'0 0 31 2 *' never fires", "crontab")
    assert dump(vigil) == before
    vigil.run("schedule", "add", "hello", "--cron", "0 0 29 2 *")  # rare, but it fires


@pytest.mark.parametrize("url", ["sqlite://", "sqlite:///:memory:", "sqlite:///file::memory:?uri=true",
                                 "sqlite:///file:x?mode=memory&uri=true"])
def test_in_memory_database_is_refused(short_tmp: Path, url: str) -> None:
    v = Vigil(short_tmp / "mem", {"VIGIL_DB": url})
    v.env["VIGIL_DB"] = url  # whatever the database under test: this URL
    try:
        for args in (("db", "upgrade"), ("status",), ("host", "add", "x", "--build", str(HELLO))):
            refused(v.run(*args, check=False), "in memory", "a file")
            assert not v.state_dir.exists() or list(v.state_dir.iterdir()) == [], args
    finally:
        v.cleanup()


@pytest.mark.parametrize("args", [("events", "nope"), ("events", "nope", "--json"),
                                  ("retry", "nope"), ("retry", "nope", "--wait")])
def test_events_and_retry_of_unknown_host(vigil: Vigil, args: tuple[str, ...]) -> None:
    vigil.add_host("hello")
    before = dump(vigil)
    cp = vigil.run(*args, check=False)
    refused(cp, "no host named 'nope'", "vigil host list")
    assert cp.returncode == 3
    assert dump(vigil) == before


def test_events_of_a_removed_host_still_show(vigil: Vigil) -> None:
    vigil.add_host("gone")
    vigil.run("host", "rm", "gone")
    kinds = [e["kind"] for e in vigil.json("events", "gone")]
    assert kinds == ["host_added", "host_removed"], kinds


# -- 10. unix socket paths longer than the kernel takes ------------------------------------------

def _long_box(short_tmp: Path, length: int) -> Vigil:
    """A box whose state dir path is `length` bytes long."""
    name = "d" * (length - len(str(short_tmp)) - 1)
    v = Vigil(short_tmp / name)
    assert len(str(v.state_dir)) == length
    v.run("db", "upgrade")
    return v


def test_host_whose_socket_path_is_too_long_is_refused(short_tmp: Path) -> None:
    v = _long_box(short_tmp, 60)
    try:
        before = dump(v)
        host = "h" * 40  # 60 + /run/ + 40 + /g<n>.sock: over 107 bytes
        refused(v.run("host", "add", host, "--build", str(HELLO), check=False),
                "107 bytes", "shorter state dir", "host name")
        f = short_tmp / "hosts.toml"
        f.write_text(f'[hosts.{host}]\nbuild = "{HELLO}"\n')
        refused(v.run("apply", str(f), check=False), "107 bytes", "shorter")
        assert dump(v) == before
        v.run("host", "add", "h" * 20, "--build", str(HELLO))  # fits
        v.run("host", "add", host, "--build", str(HELLO), "--kind", "worker")  # no socket
    finally:
        v.cleanup()


def test_agent_whose_doorbell_path_is_too_long_is_refused(short_tmp: Path) -> None:
    v = _long_box(short_tmp, 100)  # + /agent.sock: 110 bytes
    try:
        refused(v.run("agent", check=False, timeout=30), "107 bytes", "shorter state dir")
    finally:
        v.cleanup()


def test_agent_refuses_a_stored_host_whose_socket_path_no_longer_fits(short_tmp: Path) -> None:
    v = _long_box(short_tmp, 60)
    try:
        v.run("host", "add", "web", "--build", str(HELLO))
        with v.store.engine.begin() as conn:  # as if added under a shorter state dir
            conn.execute(sa.update(Host).values(name="w" * 40))
        refused(v.run("agent", check=False, timeout=30), "107 bytes", "host " + "w" * 40)
    finally:
        v.cleanup()


# -- 12. fix texts must be safe ---------------------------------------------------------------------

@pytest.mark.parametrize("command", ["host add", "deploy"])
def test_symlink_build_never_gets_a_fix_that_changes_its_target(vigil: Vigil, short_tmp: Path,
                                                                command: str) -> None:
    target = short_tmp / "passwd"
    target.write_text("root:x:0:0::/root:/bin/sh\n")
    target.chmod(0o644)
    link = short_tmp / "passwdlink"
    link.symlink_to(target)
    vigil.add_host("hello")
    before = dump(vigil)
    args = (("host", "add", "ok", "--build", str(link)) if command == "host add"
            else ("deploy", "hello", str(link)))
    line = refused(vigil.run(*args, check=False), "symlink", str(target), "not executable")
    assert "chmod" not in line, line
    assert dump(vigil) == before
    assert target.stat().st_mode & 0o777 == 0o644


# -- 14. umask 000 --------------------------------------------------------------------------------

def test_every_directory_is_created_with_its_final_mode_under_umask_000(short_tmp: Path) -> None:
    old = os.umask(0)  # inherited by the CLI (in-process and real) and the agent
    v = Vigil(short_tmp / "parent" / "state")
    try:
        v.run("db", "upgrade")
        v.add_host("hello")
        seen = {p: oct(p.stat().st_mode & 0o777) for p in [v.state_dir, *v.state_dir.rglob("*")]
                if p.is_dir()}
        assert (v.state_dir / "builds") in seen
        assert all(m == "0o700" for m in seen.values()), seen  # before any agent ran
        agent = v.start_agent()
        v.wait_ready(agent)
        v.run("wake", "hello", "--wait")
        dirs = {p: oct(p.stat().st_mode & 0o777) for p in [short_tmp / "parent", v.state_dir,
                                                            *v.state_dir.rglob("*")] if p.is_dir()}
        assert {v.state_dir / "logs", v.state_dir / "run" / "hello"} <= set(dirs)
        assert all(m == "0o700" for m in dirs.values()), dirs
        (log,) = (v.state_dir / "logs" / "hello").glob("g*.log")  # the generation's output
        assert log.stat().st_mode & 0o077 == 0, oct(log.stat().st_mode)
    finally:
        os.umask(old)
        v.cleanup()
