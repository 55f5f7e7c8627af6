"""`vigil agent install`: the unit it prints passes `systemd-analyze verify`, is written where
systemd does not run with one line saying so; and an agent started by a unit with
`Delegate=yes` (stood in for: a real agent with $INVOCATION_ID in a cgroup made for it)
keeps itself in a leaf of that subtree and each generation's cgroup beside it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from sqlalchemy import select

from models.tables import Generation
from runners.backend.cgroups import AGENT_LEAF, cgroup2_mount, detect_cgroup_base
from tests.conftest import HELLO, ROOT, Vigil, pid_dead, wait_for

VENV_VIGIL = str(Path(sys.executable).parent / "vigil")  # what ExecStart must name
ANALYZE = shutil.which("systemd-analyze") or "/usr/bin/systemd-analyze"
needs_analyze = pytest.mark.skipif(not os.access(ANALYZE, os.X_OK),
                                   reason="systemd-analyze not installed (Debian's systemd)")


def _verify(unit_text: str, where: Path, user: bool) -> subprocess.CompletedProcess[str]:
    where.mkdir(mode=0o700)
    unit = where / "vigil-agent.service"
    unit.write_text(unit_text)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(where)}  # --user: a runtime dir of its own
    argv = [ANALYZE, "verify", *(["--user"] if user else []), str(unit)]
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)


@needs_analyze
def test_print_passes_systemd_analyze_verify(vigil: Vigil, short_tmp: Path) -> None:
    vigil.add_host("small", HELLO, "--limit-nofile", "512")
    vigil.add_host("big", HELLO, "--limit-nofile", "1000000")
    config = short_tmp / "config"
    config.mkdir()
    printed = vigil.run("agent", "install", "--print", env={"XDG_CONFIG_HOME": str(config)}).stdout
    lines = printed.splitlines()
    for want in ("Type=notify", "Delegate=yes", "KillMode=process", "Restart=always",
                 f"ExecStart={VENV_VIGIL} agent", f"Environment=VIGIL_HOME={vigil.state_dir}",
                 "LimitNOFILE=1000000", "WantedBy=multi-user.target"):
        assert want in lines, (want, printed)
    done = _verify(printed, short_tmp / "system", user=False)
    assert done.returncode == 0 and not done.stderr.strip(), done.stderr
    user = vigil.run("agent", "install", "--user", "--print",
                     env={"XDG_CONFIG_HOME": str(config)}).stdout
    assert "WantedBy=default.target" in user and str(config / "systemd" / "user") in user
    done = _verify(user, short_tmp / "user", user=True)
    assert done.returncode == 0 and not done.stderr.strip(), done.stderr
    assert list(config.iterdir()) == []  # --print writes nothing


def test_default_nofile_without_hosts_and_no_store(vigil: Vigil, short_tmp: Path) -> None:
    printed = vigil.run("agent", "install", "--print").stdout
    assert "LimitNOFILE=524288" in printed.splitlines()
    cp = vigil.run("--state-dir", str(short_tmp / "none"), "agent", "install", "--print",
                   check=False)
    assert cp.returncode != 0 and cp.stdout == ""
    assert "no vigil state directory" in cp.stderr and "vigil db upgrade" in cp.stderr


@pytest.mark.skipif(os.path.isdir("/run/systemd/system"), reason="systemd runs here: "
                    "install would enable the unit")
def test_install_where_systemd_does_not_run(vigil: Vigil, short_tmp: Path) -> None:
    config = short_tmp / "config"
    env = {"XDG_CONFIG_HOME": str(config)}
    cp = vigil.run("agent", "install", "--user", env=env)
    unit = config / "systemd" / "user" / "vigil-agent.service"
    assert cp.stdout.splitlines() == [
        f"systemd is not running here: wrote {unit}; where it runs, "
        "`systemctl --user enable --now vigil-agent`"], cp.stdout
    assert unit.read_text() == vigil.run("agent", "install", "--user", "--print", env=env).stdout
    assert oct(unit.stat().st_mode & 0o777) == "0o644"
    blocked = short_tmp / "blocked"
    blocked.write_text("a file where the config dir would be")
    cp = vigil.run("agent", "install", "--user", env={"XDG_CONFIG_HOME": str(blocked)},
                   check=False)
    assert cp.returncode != 0 and cp.stdout == "", cp.stdout
    assert cp.stderr.count("\n") <= 2 and f"cannot write {blocked}" in cp.stderr, cp.stderr


def _subtree_or_skip() -> str:
    mount = cgroup2_mount()
    if not mount or detect_cgroup_base("auto") is None:  # probes a child's cgroup.kill
        pytest.skip("no writable cgroup v2 hierarchy with cgroup.kill on this box")
    return mount


def _cgroup_of(pid: int) -> str:
    with open(f"/proc/{pid}/cgroup") as f:
        return next(ln[3:].strip() for ln in f if ln.startswith("0::"))


def _procs(cg: str) -> list[int]:
    try:
        with open(os.path.join(cg, "cgroup.procs")) as f:
            return [int(x) for x in f.read().split()]
    except FileNotFoundError:
        return []


def _who(cg: str) -> list[str]:
    """Each process in the cgroup: pid and command line."""
    out = []
    for pid in _procs(cg):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            out.append(f"{pid} {cmd}")
        except OSError:
            out.append(str(pid))
    return out


def _clean(subtree: str) -> None:
    """Every process still in the subtree (each started by this test) ended by pid, then
    its cgroups removed, deepest first."""
    for d, _, _ in os.walk(subtree, topdown=False):
        for pid in _procs(d):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        wait_for(lambda d=d: not _procs(d), 10, what=f"{d} empty")  # type: ignore[misc]
        os.rmdir(d)


def test_agent_under_delegation_keeps_cgroups_in_its_subtree(vigil: Vigil) -> None:
    mount = _subtree_or_skip()
    rel = f"test-deleg-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    subtree = os.path.join(mount, rel)
    os.mkdir(subtree)  # what systemd makes for a unit with Delegate=yes
    try:
        vigil.add_host("hello")
        log = open(vigil.state_dir / "agent.out", "ab")
        # systemd starts the unit's process in the unit's cgroup, with $INVOCATION_ID set
        agent = subprocess.Popen(
            ["/bin/sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', subtree,
             sys.executable, "-m", "runners.cli", "agent", "--safety-interval", "1"],
            env={**vigil.env, "INVOCATION_ID": uuid.uuid4().hex}, stdout=log, stderr=log,
            cwd=ROOT)
        log.close()
        vigil.agents.append(agent)  # the fixture's teardown stops it by pid
        vigil.wait_ready(agent)
        assert _cgroup_of(agent.pid) == f"/{rel}/{AGENT_LEAF}"
        vigil.run("wake", "hello", "--wait")
        pid = vigil.status("hello")["pid"]
        cg = vigil.store.read(lambda s: s.execute(select(Generation.cgroup).where(
            Generation.host == "hello", Generation.pid == pid)).scalar_one())
        assert cg is not None and os.path.dirname(cg) == subtree, cg  # beside the agent's leaf
        assert _cgroup_of(pid) == f"/{rel}/{os.path.basename(cg)}"
        assert _procs(subtree) == []  # no process in the inner node
        assert not os.path.exists(os.path.join(mount, "vigil", os.path.basename(cg)))
        vigil.run("stop", "hello", "--wait")
        assert pid_dead(pid)
        wait_for(lambda: not os.path.exists(cg), 10, what="the generation's cgroup removed")
        vigil.check()
        cp = vigil.run("shutdown", "--wait", timeout=120)  # the agent and its keepers
        assert agent.wait(10) == 0, cp.stdout
        leaf = os.path.join(subtree, AGENT_LEAF)  # a keeper may still be exiting: bounded
        try:
            wait_for(lambda: not _procs(leaf), 10, what="the agent's leaf empty")
        except AssertionError as exc:
            raise AssertionError(f"{exc}: {_who(leaf)}") from None
    finally:
        _clean(subtree)
