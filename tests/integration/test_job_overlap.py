"""A job's overlap policies (issue 40 item 4) through the real CLI and the real agent: a job
every second whose runs last 2.5 s. skip writes skipped rows; queue runs each queued run
after the last, never two at once; replace ends the running one by the stop path, proven
gone, before the new one starts; allow runs them side by side. Each run's process writes,
as it starts, whether the run before it is still alive (read from /proc, a zombie counts
as gone), so "never two at once" is seen by the runs themselves, not inferred from rows."""

from __future__ import annotations

import json
import textwrap
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from models.tables import Event
from tests.conftest import Vigil, pid_dead, wait_for

pytestmark = pytest.mark.timeout(180)
# Where the policy decides under the host's row lock (FOR UPDATE: PostgreSQL's writers of one
# job would otherwise both see no open run; SQLite has one writer at a time).
LOCKED = pytest.mark.backend("the overlap's decision under the host's row lock")

# Appends "S <pid> <VIGIL_SCHEDULED_AT> <previous pid> <previous alive 0|1>" to argv[1] as it
# starts (the previous: the last S line's), runs argv[2] seconds, then appends "E <pid>".
RUN = textwrap.dedent('''\
    #!/usr/bin/env python3
    import os, sys, time
    out = sys.argv[1]

    def alive(pid):
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    starts = [ln.split() for ln in open(out).read().splitlines() if ln.startswith("S ")] \\
        if os.path.exists(out) else []
    prev = int(starts[-1][1]) if starts else 0
    with open(out, "a") as f:
        f.write(f"S {os.getpid()} {os.environ['VIGIL_SCHEDULED_AT']} {prev} "
                f"{int(bool(prev) and alive(prev))}\\n")
    time.sleep(float(sys.argv[2]))
    with open(out, "a") as f:
        f.write(f"E {os.getpid()}\\n")
    ''')


def job_script(tmp_path: Path) -> Path:
    path = tmp_path / "run.py"
    path.write_text(RUN)
    path.chmod(0o755)
    return path


def starts(out: Path) -> list[tuple[int, str, int, bool]]:
    if not out.exists():
        return []
    return [(int(p[1]), p[2], int(p[3]), p[4] == "1") for p in
            (ln.split() for ln in out.read_text().splitlines() if ln.startswith("S "))]


def ends(out: Path) -> int:
    return sum(ln.startswith("E ") for ln in out.read_text().splitlines()) if out.exists() else 0


def runs(v: Vigil, host: str) -> list[dict[str, Any]]:
    return list(json.loads(v.run("runs", host, "--json", "--limit", "1000").stdout))


def written(v: Vigil, kind: str) -> list[dict[str, Any]]:
    """The details of the job's events of `kind` (a run's reason at its end is its end's)."""
    rows = v.store.read(lambda s: s.execute(select(Event.detail).where(
        Event.host == "slow", Event.kind == kind).order_by(Event.id)).scalars().all())
    return [json.loads(d) for d in rows]


def at(t: str) -> datetime:
    return datetime.fromisoformat(t)


def overlapping_job(v: Vigil, tmp_path: Path, policy: str) -> Path:
    out = tmp_path / "ran.txt"
    v.add_host("slow", job_script(tmp_path), "--kind", "job", "--every", "1",
               "--overlap", policy, "--arg", str(out), "--arg", "2.5", "--drain-timeout", "5")
    v.wait_ready(v.start_agent(None, "--sweep-interval", "0.2"))
    v.run("wake", "slow")
    return out


def stop_all(v: Vigil) -> list[dict[str, Any]]:
    v.run("stop", "slow", "--wait", "--timeout", "60")
    v.quiesce(30)
    v.check()
    assert v.app_pids() == []
    rows = runs(v, "slow")
    for r in sorted(rows, key=lambda r: r["id"]):  # shown when a test fails
        print(r["id"], r["scheduled_at"], r["state"], r["started_at"], r["ended_at"],
              r["generation"], r["reason"])
    assert all(r["state"] not in ("due", "running", "queued") for r in rows), rows
    return rows


def test_skip_writes_skipped_rows_and_never_two_at_once(vigil: Vigil, tmp_path: Path) -> None:
    out = overlapping_job(vigil, tmp_path, "skip")
    wait_for(lambda: len(starts(out)) >= 2, 30, what="two runs")
    rows = stop_all(vigil)
    skipped = [r for r in rows if r["state"] == "skipped"]
    assert skipped and all("overlap skip" in r["reason"] and r["generation"] is None
                           for r in skipped), rows
    assert not any(alive for *_, alive in starts(out)), starts(out)


@LOCKED
def test_queue_runs_the_queued_one_after_the_last_never_two_at_once(vigil: Vigil,
                                                                  tmp_path: Path) -> None:
    out = overlapping_job(vigil, tmp_path, "queue")
    wait_for(lambda: ends(out) >= 3, 40, what="three runs run to their end")
    rows = stop_all(vigil)
    ran = starts(out)
    assert not any(alive for *_, alive in ran), f"a run started beside the last: {ran}"
    queued = {e["run"]: e["running"] for e in written(vigil, "run_queued")}
    assert all(e["was"] == "queued" for e in written(vigil, "run_due") if e["run"] in queued)
    was_queued = [r for r in rows if r["id"] in queued]
    assert len([r for r in was_queued if r["state"] == "done"]) >= 2, rows
    # One waits at most: the instants due while one waited are skipped, saying so.
    assert any("already waits" in (r["reason"] or "") for r in rows if r["state"] == "skipped")
    done = sorted((r for r in rows if r["started_at"] and r["ended_at"]),
                  key=lambda r: at(r["started_at"]))
    for a, b in zip(done, done[1:], strict=False):
        assert at(b["started_at"]) >= at(a["ended_at"]), (a, b)
    for r in was_queued:
        if r["state"] == "done":  # queued behind the run before it, started after its end
            (prev,) = [p for p in rows if p["id"] == queued[r["id"]]]
            assert at(r["started_at"]) >= at(prev["ended_at"]), (prev, r)
            assert r["duration"] >= 2.4, r


def test_replace_ends_the_old_run_proven_gone_before_the_new_one_starts(vigil: Vigil,
                                                                        tmp_path: Path) -> None:
    out = overlapping_job(vigil, tmp_path, "replace")
    wait_for(lambda: len(starts(out)) >= 3, 40, what="three runs")
    rows = stop_all(vigil)
    ran = starts(out)
    assert not any(alive for *_, alive in ran), f"a run started before the one it replaced was gone: {ran}"
    replaced = [r for r in rows if (r["reason"] or "").startswith("replaced by run #")]
    assert len(replaced) >= 2 and all(r["state"] == "failed" for r in replaced), rows
    queued = {e["run"]: e["reason"] for e in written(vigil, "run_queued")}
    for old in replaced:
        new_id = int(old["reason"].removeprefix("replaced by run #"))
        (new,) = [r for r in rows if r["id"] == new_id]
        assert queued[new_id] == f"replaces run #{old['id']}: overlap replace", new
        # (A run replaced within a fraction of a second of its start may be ended before
        # its process wrote its line: no pid to look at then.)
        old_pid = next((p for p, t, *_ in ran if t == old["scheduled_at"]), None)
        assert old_pid is None or pid_dead(old_pid)
        seen = [(prev, alive) for p, t, prev, alive in ran if t == new["scheduled_at"]]
        if old_pid is not None and seen:  # both wrote: the old one was gone at the new one's start
            assert seen == [(old_pid, False)], (old, new, ran)


@LOCKED
def test_allow_runs_overlap(vigil: Vigil, tmp_path: Path) -> None:
    out = overlapping_job(vigil, tmp_path, "allow")
    wait_for(lambda: sum(alive for *_, alive in starts(out)) >= 2 and ends(out) >= 2, 40,
             what="two runs each started beside the one before, two run to their end")
    wait_for(lambda: len(vigil.obligations()) >= 2, 10, what="two runs open at once")
    vigil.run("status", "slow")  # a job with runs in two slots is shown (table and JSON)
    assert vigil.json("status", "slow")
    rows = stop_all(vigil)
    assert not [r for r in rows if r["state"] == "skipped"], rows
    spans = sorted((at(r["started_at"]), at(r["ended_at"])) for r in rows
                   if r["started_at"] and r["ended_at"])
    assert any(b[0] < a[1] for a, b in zip(spans, spans[1:], strict=False)), (
        f"no two runs overlap: {spans}")
    done = [r for r in rows if r["state"] == "done"]
    assert done and all(r["duration"] >= 2.4 for r in done), done


@pytest.mark.parametrize("args, says", [
    (("--kind", "worker", "--overlap", "queue"), "--overlap is for a job; this host is a worker"),
    (("--kind", "job", "--every", "5", "--overlap", "sometimes"), "--overlap sometimes: not a policy"),
])
def test_bad_overlap_is_one_line(vigil: Vigil, tmp_path: Path, args: tuple[str, ...],
                                 says: str) -> None:
    cp = vigil.run("host", "add", "j", "--build", str(job_script(tmp_path)), *args, check=False)
    assert cp.returncode != 0
    assert says in cp.stderr and len(cp.stderr.strip().splitlines()) == 1, cp.stderr
    assert vigil.run("host", "list", "--json").stdout.strip() in ("[]", "")


def test_overlap_set_shown_and_in_the_hosts_file(vigil: Vigil, tmp_path: Path) -> None:
    script = job_script(tmp_path)
    vigil.add_host("j", script, "--kind", "job", "--every", "1h", "--overlap", "queue")
    assert vigil.json("host", "show", "j")["overlap"] == "queue"
    assert "overlap:" in vigil.run("host", "show", "j").stdout
    cp = vigil.run("host", "set", "j", "--overlap", "replace", "--dry-run")
    assert "overlap" in cp.stdout and "dry run" in cp.stdout, cp.stdout
    assert vigil.json("host", "show", "j")["overlap"] == "queue"
    vigil.run("host", "set", "j", "--overlap", "allow")
    assert vigil.json("host", "show", "j")["overlap"] == "allow"
    vigil.add_host("w", script, "--kind", "worker")
    cp = vigil.run("host", "set", "w", "--overlap", "queue", check=False)
    assert cp.returncode != 0 and len(cp.stderr.strip().splitlines()) == 1, cp.stderr
    assert "overlap is for a job; this host is a worker" in cp.stderr, cp.stderr
    cp = vigil.run("host", "set", "j", "--overlap", "often", check=False)
    assert cp.returncode != 0 and "must be one of skip, queue, replace, allow" in cp.stderr
    assert vigil.json("host", "show", "j")["overlap"] == "allow"
    f = tmp_path / "hosts.toml"
    f.write_text(f'[hosts.j]\nbuild = "{script}"\nkind = "job"\nevery = "1h"\noverlap = "replace"\n')
    vigil.run("apply", str(f))
    assert vigil.json("host", "show", "j")["overlap"] == "replace"
    f.write_text(f'[hosts.j]\nbuild = "{script}"\nkind = "worker"\noverlap = "replace"\n')
    cp = vigil.run("apply", str(f), check=False)
    assert cp.returncode != 0 and len(cp.stderr.strip().splitlines()) == 1, cp.stderr
    assert "hosts.j.overlap: overlap is for a job" in cp.stderr, cp.stderr
