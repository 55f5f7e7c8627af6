"""`vigil logs` over several hosts (issue 23): the log keeper records when it took each
piece of an app's output, so `vigil logs --all --since 1m` returns 20 chatty hosts' lines
merged in the order they were written. Each app writes its own sequence number and the
time it wrote the line; the order is checked against both."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.conftest import FIXTURES, Vigil, wait_for

pytestmark = pytest.mark.timeout(300)
HOSTS = 20
STAMPED = FIXTURES / "stamped.py"


def hosts_file(tmp: Path) -> Path:
    path = tmp / "hosts.toml"
    path.write_text("".join(f'[hosts.chat{i:02d}]\nbuild = "{STAMPED}"\nkind = "worker"\n\n'
                            for i in range(HOSTS)))
    return path


def entries(v: Vigil, *args: str) -> list[dict[str, object]]:
    out = v.run("logs", *args, "--json").stdout
    return [json.loads(line) for line in out.splitlines()]


def test_all_hosts_lines_since_a_minute_come_in_the_order_they_were_written(
        vigil: Vigil, short_tmp: Path) -> None:
    vigil.run("apply", str(hosts_file(short_tmp)))
    vigil.wait_ready(vigil.start_agent())
    vigil.run("wake", "--all", "--wait", timeout=120)
    logs = vigil.state_dir / "logs"
    wait_for(lambda: all(sum(f.stat().st_size for f in (logs / f"chat{i:02d}").glob("g*.log"))
                         > 2000 for i in range(HOSTS)), 60, what="every host has written")
    got = entries(vigil, "--all", "--since", "1m")
    ended = time.time()
    assert len({e["host"] for e in got}) == HOSTS and len(got) > 20 * HOSTS
    ats = [e["at"] for e in got]
    assert ats == sorted(ats)  # merged by time across hosts
    last_seq: dict[object, int] = {}
    for e in got:
        word, host, seq, wrote = str(e["line"]).split()
        assert word == "STAMPED" and host == e["host"]
        assert last_seq.get(host, -1) + 1 == int(seq), (host, seq)  # none lost, none moved
        last_seq[host] = int(seq)
    # Stamped when the keeper took it, not when it was read back: after the app wrote it
    # (and before the command ended); and the merged order is the apps' own, up to how long a
    # line waits in its pipe for the keeper (bounded generously: a loaded 2-core box).
    stamped = [(stamp(e["at"]), float(str(e["line"]).split()[3])) for e in got]
    # (The newest lines, not yet in a record, have the file's mtime: the kernel's coarse
    # clock, up to a tick, 4-10 ms, behind the app's time.time().)
    early = [(at, wrote) for at, wrote in stamped if not wrote - 0.02 <= at <= ended]
    assert not early, early[:5]
    assert max(at - wrote for at, wrote in stamped) < 5.0
    wrote_in_order = [wrote for _, wrote in stamped]
    late = sum(1 for a, b in zip(wrote_in_order, wrote_in_order[1:], strict=False) if b < a - 1.0)
    assert late == 0, late

    one = vigil.run("logs", "chat03", "-n", "5").stdout.splitlines()
    assert len(one) == 5 and all(" | STAMPED chat03 " in line for line in one), one
    two = vigil.run("logs", "chat03", "chat04", "-n", "6", "--timestamps").stdout.splitlines()
    assert len(two) == 6 and {line.split()[1] for line in two} == {"chat03", "chat04"}
    assert all(line.split()[0].endswith("Z") for line in two)
    follow_all(vigil)


def follow_all(v: Vigil) -> None:
    """`--follow` over several hosts: new lines of every host, each with its time."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    p = subprocess.Popen([sys.executable, "-m", "runners.cli", "logs", "--all", "-n", "0", "-f"],
                         env=v.env, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        seen: set[str] = set()
        assert p.stdout is not None
        for line in p.stdout:
            at, host, _gen, bar, word, *_ = line.split()
            assert at.endswith("Z") and bar == "|" and word == "STAMPED", line
            seen.add(host)
            if len(seen) == HOSTS:
                break
    finally:
        p.kill()
        p.wait(10)
        p.stdout.close()  # type: ignore[union-attr]


def stamp(iso: object) -> float:
    from datetime import datetime

    return datetime.fromisoformat(str(iso).replace("Z", "+00:00")).timestamp()


def test_bad_log_selections_are_one_line_each(vigil: Vigil) -> None:
    vigil.add_host("hello")
    for args, cause in ((["--all", "hello"], "--all and host names were both given"),
                        ([], "no host given"),
                        (["hello", "hello2", "-g", "1"], "--generation names one host"),
                        (["hello", "--since", "soon"], "--since 'soon' is not a time back")):
        cp = vigil.run("logs", *args, check=False)
        assert cp.returncode != 0 and cause in cp.stderr, (args, cp.stderr)
        assert len(cp.stderr.strip().splitlines()) <= 2, cp.stderr
