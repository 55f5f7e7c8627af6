"""A job run's --timeout and --retries through the real CLI and the real agent (issue 40,
item 4; workflows/lifecycle/runpolicy.py): a timeout ends a run's whole tree by the stop
path, every pid proven gone, the run failed naming the timeout, its deadline kept across the
agent's kill -9; a run failing twice then succeeding with --retries 2 is one row, done,
tries 2; retries spent end in failed; bad input is one line."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from models.tables import Event
from tests.conftest import FIXTURES, Vigil, pid_dead, wait_for

pytestmark = pytest.mark.timeout(180)

FORKING_RUN = FIXTURES / "forking_run.py"  # writes "<leader> <child>" to argv[1]; the child ignores TERM
FLAKY_RUN = FIXTURES / "flaky_run.py"  # appends its pid to argv[1]; exits 1 for its first argv[2] tries


def runs(v: Vigil, host: str) -> list[dict[str, Any]]:
    return list(json.loads(v.run("runs", host, "--json").stdout))


def agent(v: Vigil) -> Any:
    p = v.start_agent(None, "--sweep-interval", "0.2")
    v.wait_ready(p)
    return p


def events(v: Vigil, kind: str) -> list[Event]:
    return list(v.store.read(lambda s: s.execute(select(Event).where(Event.kind == kind))
                             .scalars().all()))


def pids_of(path: Path) -> list[int]:
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def on_proc(pid: int) -> bool:
    """The pid still has a /proc entry that is not a zombie (a zombie has exited)."""
    try:
        return " Z " not in Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2][:3]
    except (FileNotFoundError, ProcessLookupError):  # gone between the open and the read
        return False


def ended(v: Vigil, host: str) -> dict[str, Any] | None:
    rows = runs(v, host)
    return rows[0] if rows and rows[0]["state"] in ("done", "failed") else None


def test_a_timeout_ends_a_run_and_the_child_it_forked(vigil: Vigil, tmp_path: Path) -> None:
    out = tmp_path / "pids"
    vigil.add_host("slow", FORKING_RUN, "--kind", "job", "--every", "1d", "--timeout", "2s",
                   "--drain-timeout", "3", "--arg", str(out))
    agent(vigil)
    vigil.run("run", "slow")
    leader, child = wait_for(lambda: pids_of(out), 30, what="the run and its child")
    assert on_proc(leader) and on_proc(child)
    row = wait_for(lambda: ended(vigil, "slow"), 30, what="the run ended by its timeout")
    assert row["state"] == "failed" and "timeout" in row["reason"], row
    assert "--timeout 2 s" in row["reason"], row
    # every pid of its tree gone: polled by pid on /proc, bounded (the child ignored SIGTERM)
    wait_for(lambda: not on_proc(leader) and not on_proc(child), 15, what="both pids gone")
    assert pid_dead(leader) and pid_dead(child)
    (timed_out,) = events(vigil, "run_timeout")
    assert timed_out.generation_id == row["generation"]
    vigil.quiesce(30)  # the member proven, nothing owed
    vigil.check()
    assert vigil.app_pids() == []
    # it ran its bound, and not much more: the deadline is started_at + 2 s, the tick's
    # timer woken for it (not the 2 s backstop), the leader gone at the stop signal
    assert 2.0 <= row["duration"] < 2.0 + 3.0, row


def test_a_timeout_is_kept_across_the_agents_kill_9(vigil: Vigil, tmp_path: Path) -> None:
    out = tmp_path / "pids"
    vigil.add_host("slow", FORKING_RUN, "--kind", "job", "--every", "1d", "--timeout", "4",
                   "--drain-timeout", "2", "--arg", str(out))
    p = agent(vigil)
    vigil.run("run", "slow")
    leader, child = wait_for(lambda: pids_of(out), 30, what="the run and its child")
    wait_for(lambda: runs(vigil, "slow")[0]["state"] == "running", 10, what="the run running")
    os.kill(p.pid, signal.SIGKILL)  # its timer dies with it; the deadline is in the row
    p.wait()
    agent(vigil)
    row = wait_for(lambda: ended(vigil, "slow"), 30, what="the run ended by its timeout")
    assert row["state"] == "failed" and "timeout" in row["reason"], row
    wait_for(lambda: not on_proc(leader) and not on_proc(child), 15, what="both pids gone")
    vigil.quiesce(30)
    vigil.check()
    assert vigil.app_pids() == []


def test_a_run_failing_twice_then_succeeding_with_retries_2(vigil: Vigil, tmp_path: Path) -> None:
    out = tmp_path / "tries"
    vigil.add_host("flaky", FLAKY_RUN, "--kind", "job", "--every", "1d", "--retries", "2",
                   "--restart-floor", "0.2", "--arg", str(out), "--arg", "2")
    agent(vigil)
    vigil.run("run", "flaky")
    row = wait_for(lambda: ended(vigil, "flaky"), 30, what="the run's end")
    (only,) = runs(vigil, "flaky")  # one row for the three tries
    assert only == row
    assert (row["state"], row["tries"], row["exit_status"]) == ("done", 2, 0), row
    tried = pids_of(out)
    assert len(tried) == 3 and len(set(tried)) == 3, tried  # three processes, one each try
    retried = events(vigil, "run_retry")
    assert [json.loads(e.detail)["tries"] for e in retried] == [1, 2], [e.detail for e in retried]
    assert all(json.loads(e.detail)["delay"] > 0 for e in retried)  # the restart backoff, not at once
    assert all(pid_dead(pid) for pid in tried)
    vigil.quiesce(30)
    vigil.check()


def test_retries_spent_end_failed_and_a_timeout_is_not_retried(vigil: Vigil,
                                                                 tmp_path: Path) -> None:
    out = tmp_path / "tries"
    vigil.add_host("bad", FLAKY_RUN, "--kind", "job", "--every", "1d", "--retries", "1",
                   "--restart-floor", "0.2", "--arg", str(out), "--arg", "100")
    pids = tmp_path / "pids"
    vigil.add_host("slow", FORKING_RUN, "--kind", "job", "--every", "1d", "--timeout", "1",
                   "--retries", "3", "--drain-timeout", "1", "--arg", str(pids))
    agent(vigil)
    vigil.run("run", "bad")
    vigil.run("run", "slow")
    row = wait_for(lambda: ended(vigil, "bad"), 30, what="the run's end")
    assert (row["state"], row["tries"], row["exit_status"]) == ("failed", 1, 1), row
    assert len(pids_of(out)) == 2
    slow = wait_for(lambda: ended(vigil, "slow"), 30, what="the timed-out run's end")
    assert (slow["state"], slow["tries"]) == ("failed", 0) and "timeout" in slow["reason"], slow
    vigil.quiesce(30)
    assert len(runs(vigil, "slow")) == 1 and len(pids_of(pids)) == 2  # started once
    vigil.check()
    assert vigil.app_pids() == []


@pytest.mark.parametrize("args, says", [
    (("--kind", "worker", "--timeout", "5"), "--timeout is for a job; this host is a worker"),
    (("--kind", "instance", "--retries", "1"), "--retries is for a job; this host is a instance"),
    (("--kind", "job", "--every", "5", "--timeout", "0.5"), "--timeout 0.5: a run's bound is between 1 s"),
    (("--kind", "job", "--every", "5", "--timeout", "5x"), "--timeout 5x: not a period"),
    (("--kind", "job", "--every", "5", "--retries", "-1"), "--retries -1: a run is tried again 0 to 100"),
])
def test_bad_timeout_or_retries_is_one_line(vigil: Vigil, args: tuple[str, ...], says: str) -> None:
    cp = vigil.run("host", "add", "j", "--build", str(FLAKY_RUN), *args, check=False)
    assert cp.returncode != 0
    assert says in cp.stderr and len(cp.stderr.strip().splitlines()) == 1, cp.stderr
    assert vigil.run("host", "list", "--json").stdout.strip() in ("[]", "")


def test_host_set_and_the_hosts_file_take_them(vigil: Vigil, tmp_path: Path) -> None:
    vigil.add_host("rep", FLAKY_RUN, "--kind", "job", "--every", "1h")
    info = vigil.json("host", "show", "rep")
    assert (info["timeout"], info["retries"]) == (None, 0)
    cp = vigil.run("host", "set", "rep", "--timeout", "30m", "--retries", "2", "--dry-run")
    assert "dry run" in cp.stdout and vigil.json("host", "show", "rep")["timeout"] is None
    vigil.run("host", "set", "rep", "--timeout", "30m", "--retries", "2")
    info = vigil.json("host", "show", "rep")
    assert (info["timeout"], info["retries"]) == (1800.0, 2)
    cp = vigil.run("host", "set", "rep", "--retries", "101", check=False)
    assert cp.returncode != 0 and len(cp.stderr.strip().splitlines()) == 1, cp.stderr
    vigil.run("host", "set", "rep", "--unset", "timeout")
    assert vigil.json("host", "show", "rep")["timeout"] is None
    f = tmp_path / "hosts.toml"
    f.write_text(f'[hosts.nightly]\nbuild = "{FLAKY_RUN}"\nkind = "job"\nevery = "1d"\n'
                 'timeout = "2h"\nretries = 3\n')
    vigil.run("apply", str(f))
    info = vigil.json("host", "show", "nightly")
    assert (info["timeout"], info["retries"]) == (7200.0, 3)
    f.write_text(f'[hosts.nightly]\nbuild = "{FLAKY_RUN}"\nkind = "worker"\nretries = 3\n')
    cp = vigil.run("apply", str(f), check=False)
    assert cp.returncode != 0 and "retries is for a job" in cp.stderr, cp.stderr
    assert vigil.json("host", "show", "nightly")["retries"] == 3  # nothing changed


def test_a_failed_start_is_retried(vigil: Vigil, tmp_path: Path) -> None:
    out, cwd = tmp_path / "tries", tmp_path / "work"
    cwd.mkdir()
    vigil.add_host("moved", FLAKY_RUN, "--kind", "job", "--every", "1d", "--retries", "1",
                   "--restart-floor", "5", "--cwd", str(cwd), "--arg", str(out), "--arg", "0")
    cwd.rmdir()  # its start fails: no working dir
    agent(vigil)
    vigil.run("run", "moved")
    retried = wait_for(lambda: events(vigil, "run_retry"), 30, what="the failed start retried")
    assert "start failed" in json.loads(retried[0].detail)["reason"], retried[0].detail
    assert runs(vigil, "moved")[0]["state"] == "due"  # owed while it waits its backoff (4-6 s)
    assert [o for o in vigil.obligations() if o["kind"] == "job_run"]
    cwd.mkdir()  # the next try starts
    row = wait_for(lambda: ended(vigil, "moved"), 30, what="the run's end")
    assert (row["state"], row["tries"], row["exit_status"]) == ("done", 1, 0), row
    assert len(pids_of(out)) == 1  # the first try never ran
    vigil.quiesce(30)
    vigil.check()
