"""Apps run as users of their own (issue 21 item 1), against real users made for the test
(`useradd` here, only when missing), the real agent and its real store: the app is that
user, with its groups and passwd entry; it serves on its own socket; it cannot open the
store, the control socket, another host's log file, nor read another app's
/proc/<pid>/environ; and the agent adopts and stops it after its own `kill -9`. Both spawn
paths run: the cgroup shim (root joins the cgroup, then setpriv) and Popen's own switch."""

from __future__ import annotations

import grp
import json
import os
import pwd
import signal
import subprocess
from pathlib import Path

import pytest

from models.tables import Build, Generation
from runners.backend.process import detect_cgroup_base
from tests.conftest import FIXTURES, HELLO, Vigil, on_postgresql, pid_dead, wait_for

USERS = ("vigil-t1", "vigil-t2")
PATH = "PATH=/usr/bin:/bin"  # the agent's own PATH may run through /root (0700)
CGROUP = detect_cgroup_base("auto")


def ensure_user(name: str) -> pwd.struct_passwd:
    """The test's user, made by useradd if this box lacks it (a system user, no home)."""
    try:
        return pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--user-group",
                        "--shell", "/usr/sbin/nologin", name], check=True)
        return pwd.getpwnam(name)


@pytest.fixture(scope="module")
def users() -> dict[str, pwd.struct_passwd]:
    if os.geteuid() != 0:
        pytest.skip("running apps as other users needs a root agent")
    return {n: ensure_user(n) for n in USERS}


@pytest.fixture(params=["cgroup", "marker"])
def containment(request: pytest.FixtureRequest) -> str:
    if request.param == "cgroup" and CGROUP is None:
        pytest.skip("no delegated cgroup v2 with cgroup.kill on this box")
    return str(request.param)


def one_line(path: Path) -> dict[str, object] | None:
    try:
        for line in path.read_text().splitlines():
            if line.startswith("{"):
                return dict(json.loads(line))
    except FileNotFoundError:
        return None
    return None


def uuid_of(vigil: Vigil, n: int) -> str:
    return str(vigil.store.read(lambda s: s.get(Generation, n).uuid))


def staged_path(vigil: Vigil, n: int) -> str:
    return str(vigil.store.read(lambda s: s.get(Build, s.get(Generation, n).build_id).path))


def gen_of(vigil: Vigil, host: str) -> tuple[int, int]:
    st = vigil.status(host)
    return int(st["generation"]), int(st["pid"])


def test_an_app_runs_as_its_user_and_reaches_nothing_of_the_agent(
        vigil: Vigil, users: dict[str, pwd.struct_passwd], short_tmp: Path) -> None:
    os.chmod(short_tmp, 0o755)  # mkdtemp's 0700 would keep every other user out
    t1, t2 = users["vigil-t1"], users["vigil-t2"]
    env_file = short_tmp / "app.env"
    env_file.write_text("# read at each start\nexport FROM_FILE='from the file'\n")
    secret = short_tmp / "token"
    secret.write_text("s3cr3t-token")
    os.chmod(secret, 0o600)  # the agent's (root's) to read; copied in for each app's user
    vigil.add_host("other", FIXTURES / "worker.py", "--kind", "worker", "--user", "vigil-t2",
                   "--env", PATH, "--env", "OTHER_SECRET=hunter2", "--credential",
                   f"token={secret}")
    vigil.add_host("web", HELLO, "--user", "vigil-t1", "--env", PATH)
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    vigil.run("wake", "other", "--wait")
    vigil.run("wake", "web", "--wait")  # healthy: it bound its socket in run/web/
    other_n, other_pid = gen_of(vigil, "other")
    targets = {"db": str(vigil.state_dir / "vigil.db"),
               "control": str(vigil.state_dir / "control.sock"),
               "log": str(vigil.state_dir / "logs" / "other" / f"g{other_n}.log"),
               # The other app's staged build: its path lies in this test's state dir
               # (a bare "worker.py" matched the other database's run of this very test).
               "other": staged_path(vigil, other_n),
               "cred": str(vigil.state_dir / "credentials" / uuid_of(vigil, other_n) / "token")}
    vigil.add_host("hostile", FIXTURES / "hostile.py", "--kind", "worker", "--user", "vigil-t1",
                   "--env", PATH, "--env", f"HOSTILE={json.dumps(targets)}",
                   "--env-file", str(env_file), "--pids-max", "64", "--limit-nofile", "512",
                   "--credential", f"token={secret}")
    vigil.run("wake", "hostile", "--wait")
    n, pid = gen_of(vigil, "hostile")
    log = vigil.state_dir / "logs" / "hostile" / f"g{n}.log"
    report = wait_for(lambda: one_line(log), 30, what="the hostile app's report")

    assert report["uid"] == report["euid"] == t1.pw_uid
    assert report["gid"] == t1.pw_gid
    assert report["groups"] == sorted(set(os.getgrouplist("vigil-t1", t1.pw_gid)))
    assert 0 not in report["groups"]  # not root's groups
    assert (report["home"], report["user"], report["logname"]) == (t1.pw_dir, "vigil-t1", "vigil-t1")
    assert report["from_file"] == "from the file"
    # SQLite: the file is closed to it. PostgreSQL: no file, and the URL is not in its env
    # (what the server lets a local user do is pg_hba.conf's: see docs/guides/production.md).
    assert report["db"] == ("No such file or directory" if on_postgresql() else "Permission denied")
    assert report["vigil_env"] == ["VIGIL_GENERATION", "VIGIL_HOST"]
    assert report["control"] == "Permission denied"
    assert report["log"] == "Permission denied"
    assert report["other_pid"] == other_pid
    assert report["environ"] == "Permission denied"
    assert report["other_cred"] == "Permission denied"
    assert report["own_cred"] == "s3cr3t-token" and report["cred_in_env"] is False
    own_creds = vigil.state_dir / "credentials" / uuid_of(vigil, n)
    assert (own_creds.stat().st_uid, own_creds.stat().st_mode & 0o777) == (t1.pw_uid, 0o500)
    # What the agent sees: every process of the app is the user's.
    for p in (pid, int(vigil.status("web")["pid"])):
        with open(f"/proc/{p}/status") as f:
            uid_line = next(line for line in f if line.startswith("Uid:"))
        assert int(uid_line.split()[1]) == t1.pw_uid
    assert grp.getgrgid(t2.pw_gid)  # the other app's own group exists
    shown = vigil.run("status", "--json").stdout + vigil.run("events", "--json").stdout
    assert "hunter2" not in shown and "s3cr3t" not in shown
    assert "s3cr3t" not in vigil.agent_log().decode()
    assert "from the file" not in vigil.run("events", "hostile").stdout

    agent.kill()  # kill -9: the apps run on; the next agent adopts them
    agent.wait(10)
    before = vigil.ready_count()
    agent = vigil.start_agent()
    vigil.wait_ready_after(agent, before)
    assert gen_of(vigil, "hostile") == (n, pid), "adopted, not restarted"
    vigil.run("stop", "hostile", "--wait")
    wait_for(lambda: pid_dead(pid), 10, what="the hostile app gone")
    wait_for(lambda: not own_creds.exists(), 10, what="its credentials removed once proven gone")
    vigil.run("stop", "other", "--wait")
    vigil.run("stop", "web", "--wait")
    vigil.quiesce()
    vigil.check()
    assert not vigil.app_pids()
    vigil.stop_agent(agent, signal.SIGTERM)
