"""The agent's open-file limit (issue 27 item 3): raised to the hard limit at start and said
so; a box whose limit cannot hold the apps placed on it gets one warning line at start
naming the limit and the fix, and the agent runs on (no crash, nothing changed)."""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

from tests.conftest import HELLO, ROOT, Vigil

HOSTS = 60  # more than a hard limit of 128 holds: 128 - open - 64, one fd an app


def agent_with_limit(v: Vigil, soft: int, hard: int) -> subprocess.Popen[bytes]:
    log = open(v.state_dir / "agent.out", "ab")
    p = subprocess.Popen([sys.executable, "-m", "runners.cli", "agent", "--safety-interval", "1"],
                         env=v.env, stdout=log, stderr=log, cwd=ROOT,
                         preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard)))
    log.close()
    v.agents.append(p)  # ended by the fixture, by pid
    return p


def hosts_file(tmp: Path, n: int) -> Path:
    f = tmp / "hosts.toml"
    f.write_text("".join(f'[hosts.h{i:03d}]\nbuild = "{HELLO}"\n\n' for i in range(n)))
    return f


def warnings(v: Vigil) -> list[str]:
    return [x for x in v.agent_log().decode().splitlines() if "open files:" in x]


def test_a_limit_too_low_for_the_hosts_is_one_line_at_start(vigil: Vigil, tmp_path: Path) -> None:
    vigil.run("apply", str(hosts_file(tmp_path, HOSTS)))
    p = agent_with_limit(vigil, 128, 128)
    vigil.wait_ready(p)
    lines = warnings(vigil)
    assert len(lines) == 1, lines
    assert "level=WARNING" in lines[0] and "the limit of 128 (hard 128)" in lines[0], lines
    assert f"and {HOSTS} may run on this box" in lines[0] and "LimitNOFILE=" in lines[0], lines
    assert vigil.status("h000")["state"] == "asleep"  # nothing was started or changed
    assert p.poll() is None


def test_the_soft_limit_is_raised_to_the_hard_one_and_said(vigil: Vigil, tmp_path: Path) -> None:
    vigil.run("apply", str(hosts_file(tmp_path, 3)))
    p = agent_with_limit(vigil, 256, 4096)
    vigil.wait_ready(p)
    lines = warnings(vigil)
    assert lines and "soft limit raised from 256 to 4096 (the hard limit)" in lines[0], lines
    assert not any("level=WARNING" in x for x in lines), lines
    with open(f"/proc/{p.pid}/limits") as f:
        row = next(x for x in f if x.startswith("Max open files"))
    assert row.split()[3:5] == ["4096", "4096"], row
