"""`vigil apply FILE.toml`: a bad file names the line and the key and changes nothing; a
good one adds, updates and removes hosts; `--dry-run` only prints; a changed build of an
awake host becomes a deploy attempt (cause config); an awake host left out of the file
is refused (nothing applied) until it is stopped."""

from __future__ import annotations

from pathlib import Path

import pytest

from models.tables import Attempt, Host
from tests.conftest import HELLO, Vigil, wait_for
from tests.integration.test_cli_bad_input import dump

WORKER = HELLO.parent.parent.parent / "tests" / "fixtures" / "worker.py"

GOOD = f"""\
# hosts under version control
[hosts.web]
build = "{HELLO}"
env = {{ GREETING = "hi" }}
drain_timeout = 5

[hosts.jobs]
build = "{WORKER}"
kind = "worker"
"""


@pytest.mark.parametrize(("edit", "where"), [
    (("drain_timeout = 5", "drain_timeout = -1"), ":5: hosts.web.drain_timeout: must be a positive"),
    (('kind = "worker"', 'kind = "worker"\nrestarts = 3'), ":10: hosts.jobs.restarts: unknown key"),
    (('GREETING = "hi"', "GREETING = 1"), ":4: hosts.web.env: GREETING must be a string"),
    ((f'build = "{WORKER}"', 'build = "missing.py"'), ':8: hosts.jobs.build: "missing.py" is not'),
    (("[hosts.jobs]", "[hosts.Jobs]"), ":7: hosts.Jobs: invalid host name"),
    (('kind = "worker"', 'kind = "daemon"'), ':9: hosts.jobs.kind: must be "instance", "worker" or "job"'),
    (("drain_timeout = 5", 'socket_mode = "0644"'), ":5: hosts.web.socket_mode: 0644 does not let"),
    (("drain_timeout = 5", "drain_timeout = "), "invalid TOML"),
    (("drain_timeout = 5", "max_run = 2"), ":5: hosts.web.max_run: applies to workers"),
    (('kind = "worker"', 'kind = "worker"\nrestart_floor = 4\nrestart_cap = 2'),
     ":11: hosts.jobs.restart_cap: restart_cap 2 is below restart_floor 4"),
    (('kind = "worker"', 'kind = "worker"\none_shot = "yes"'), ":10: hosts.jobs.one_shot: must be"),
])
def test_bad_file_names_line_and_key_and_changes_nothing(vigil: Vigil, short_tmp: Path,
                                                          edit: tuple[str, str], where: str) -> None:
    f = short_tmp / "hosts.toml"
    f.write_text(GOOD)
    vigil.run("apply", str(f))
    before = dump(vigil)
    f.write_text(GOOD.replace(*edit))
    cp = vigil.run("apply", str(f), check=False)
    assert cp.returncode == 2, cp.stdout + cp.stderr
    lines = cp.stderr.strip().splitlines()
    assert len(lines) == 1 and where in lines[0] and str(f) in lines[0], cp.stderr
    assert dump(vigil) == before


def test_apply_adds_updates_deploys_and_removes(vigil: Vigil, short_tmp: Path) -> None:
    f = short_tmp / "hosts.toml"
    f.write_text(GOOD)
    dry = vigil.run("apply", "--dry-run", str(f)).stdout
    assert "+ add web" in dry and "+ add jobs" in dry and "nothing changed" in dry
    assert vigil.json("host", "list") == []
    out = vigil.run("apply", str(f)).stdout
    assert "+ add web" in out and "+ add jobs" in out
    assert "= keep web" in vigil.run("apply", str(f)).stdout  # idempotent
    # Worker policy keys are host fields like the others.
    f.write_text(GOOD.replace('kind = "worker"', 'kind = "worker"\nrestart_floor = 0.5\nmax_run = 60'))
    assert "~ update jobs" in vigil.run("apply", str(f)).stdout
    policy = vigil.store.read(lambda s: (lambda h: (h.restart_floor, h.max_run, h.restart_cap))(
        s.get(Host, "jobs")))
    assert policy == (0.5, 60.0, 30.0)
    f.write_text(GOOD)

    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    vigil.run("wake", "web", "--wait")
    old_pid = vigil.status("web")["pid"]

    # A new build for the awake host, a changed timeout, and jobs left out of the file.
    new = short_tmp / "hello.py"
    new.write_bytes(HELLO.read_bytes() + b"\n# build 2\n")
    new.chmod(0o755)
    f.write_text('[hosts.web]\nbuild = "hello.py"\nenv = { GREETING = "hi" }\ndrain_timeout = 7\n')
    plan = vigil.run("apply", "--dry-run", str(f)).stdout
    assert "~ deploy web: drain_timeout 5.0 -> 7.0, build" in plan
    assert "cause config" in plan and "- remove jobs" in plan

    # An awake host left out of the file is refused, and then nothing at all is applied.
    vigil.run("wake", "jobs", "--wait")
    before = dump(vigil, frozenset({("agents", "heartbeat_at"),
                                                           ("leases", "expires_at")}))
    cp = vigil.run("apply", str(f), check=False)
    assert cp.returncode == 4 and "host jobs is not in the file but cannot be removed" in cp.stderr
    assert "vigil stop jobs --wait" in cp.stderr
    assert dump(vigil, frozenset({("agents", "heartbeat_at"),
                                                         ("leases", "expires_at")})) == before
    vigil.run("stop", "jobs", "--wait")

    out = vigil.run("apply", str(f)).stdout
    assert "- remove jobs" in out and "(attempt #" in out, out
    attempt_id = int(out.split("(attempt #")[1].split(")")[0])
    a = wait_for(lambda: vigil.store.read(lambda s: s.get(Attempt, attempt_id)).outcome and
                 vigil.store.read(lambda s: s.get(Attempt, attempt_id)), 60,
                 what=f"attempt #{attempt_id} to end")
    assert (a.outcome.value, a.cause.value) == ("done", "config"), a.reason
    vigil.quiesce()
    st = vigil.status("web")
    assert st["pid"] != old_pid and st["build_digest"] == a.digest
    kinds = [(e["kind"], e["detail"].get("cause")) for e in vigil.json("events", "web")]
    assert ("deploy_requested", "config") in kinds and ("host_updated", None) in kinds
    assert [h["host"] for h in vigil.json("host", "list")] == ["web"]
    vigil.check()
    vigil.stop_agent(agent)


def test_shipped_example_file_plans(vigil: Vigil) -> None:
    out = vigil.run("apply", "--dry-run", str(HELLO.parent.parent / "hosts.toml")).stdout
    assert "+ add hello: instance" in out
