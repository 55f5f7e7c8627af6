"""Issue 37 ("hostile input, round three"), items 9, 10, 13 and 14 (part): a start-order
chain of a thousand hosts and a hosts file nested 100,000 deep, a scale storm, `logs -f`
under a fast writer and across a restart, and the one-line messages for a size above int64,
a corrupt `.times` line, a lone CR and `host show`'s settings. Through the CLI as a user
types it, against a real agent where one matters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import HELLO, Vigil, wait_for

pytestmark = pytest.mark.timeout(180)

CHAIN = 1000  # hosts in one start-order chain: deeper than Python's recursion limit


def chain_file(d: Path, n: int, extra: str = "") -> str:
    """A hosts file of n hosts, h1 after h0, h2 after h1, ... (none woken)."""
    body = [f'[hosts.h{i}]\nbuild = "{HELLO}"\n{extra}' + (f'after = ["h{i - 1}"]\n' if i else "")
            for i in range(n)]
    path = d / f"chain{n}{'x' if extra else ''}.toml"
    path.write_text("\n".join(body))
    return str(path)


def one_line(cp: object) -> str:
    """The error output of a refused command: one line, no traceback."""
    err = cp.stderr
    assert cp.returncode != 0 and "Traceback" not in err, err[-2000:]
    assert len(err.strip().splitlines()) == 1, err[-2000:]
    return str(err)


# -- item 9: a long start-order chain, a deeply nested hosts file -------------------------

def test_a_thousand_host_chain_applies_stops_and_is_removed(vigil: Vigil, tmp_path: Path) -> None:
    names = [f"h{i}" for i in range(CHAIN)]
    vigil.run("apply", chain_file(tmp_path, CHAIN))
    empty = tmp_path / "none.toml"
    empty.write_text("[hosts]\n")
    assert vigil.run("apply", str(empty)).stdout.count("- remove") == CHAIN  # dependents first
    vigil.run("apply", chain_file(tmp_path, CHAIN))
    # running = false: apply sorts the hosts to stop dependents first (none runs: no stop)
    assert "~ stop" not in vigil.run("apply", chain_file(tmp_path, CHAIN, "running = false\n")).stdout
    out = vigil.run("stop", *reversed(names)).stdout.splitlines()  # several: dependents first
    assert [line.split()[3] for line in out] == names[::-1], out[:3]


def test_a_chain_of_hosts_shuts_down_link_by_link(vigil: Vigil, tmp_path: Path) -> None:
    """Each stop of a chain waits for the stop of the host that starts after it; when that
    one ends it looks again at once, not after its backoff (down a chain of 1,000, the
    backoffs added up to hours: the box could not be shut down). The chain runs: asleep
    hosts with nothing owed are not stopped at all (issue 39 item 7)."""
    import time

    from sqlalchemy import select

    from models.states import GenState
    from models.tables import Event, Generation

    n = 30
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    vigil.run("apply", chain_file(tmp_path, n, extra="running = true\n"))
    wait_for(lambda: len(vigil.store.read(lambda s: s.execute(select(Generation.id).where(
        Generation.state == GenState.current)).all())) == n, 120, what=f"the chain of {n} up")
    began = time.monotonic()
    cp = vigil.run("shutdown", "--wait", "--timeout", "90", check=False, subprocess=True)
    assert cp.returncode == 0, (cp.stdout + cp.stderr)[-3000:]
    assert agent.wait(30) == 0 and time.monotonic() - began < 90
    stopped = list(vigil.store.read(lambda s: s.execute(select(Event.host).where(
        Event.kind == "stopped").order_by(Event.id)).scalars().all()))
    assert stopped == [f"h{i}" for i in reversed(range(n))], stopped[:5]  # dependents first


def test_an_asleep_chain_shuts_down_without_a_stop(vigil: Vigil, tmp_path: Path) -> None:
    """120 asleep hosts in a chain: nothing runs, nothing is owed, no stop is written."""
    from sqlalchemy import func, select

    from models.tables import Stop

    vigil.run("apply", chain_file(tmp_path, 120))
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    cp = vigil.run("shutdown", "--wait", "--timeout", "90", check=False, subprocess=True)
    assert cp.returncode == 0, (cp.stdout + cp.stderr)[-3000:]
    assert agent.wait(30) == 0
    assert vigil.store.read(lambda s: s.execute(select(func.count()).select_from(Stop)).scalar()) == 0


def test_a_hosts_file_nested_too_deep_is_refused_in_one_line(vigil: Vigil, tmp_path: Path) -> None:
    deep = tmp_path / "deep.toml"
    deep.write_text(f'[hosts.a]\nbuild = "{HELLO}"\nargs = ' + "[" * 100_000 + "]" * 100_000 + "\n")
    for args in (("apply", str(deep)), ("apply", "--dry-run", str(deep))):
        err = one_line(vigil.run(*args, check=False))
        assert "nested" in err and str(deep) in err, err
    assert vigil.json("status") == [] or not vigil.json("status")


# -- item 10: a scale storm leaves no instance behind ------------------------------------

def currents(v: Vigil, host: str) -> int:
    from sqlalchemy import func, select

    from models.states import GenState
    from models.tables import Generation

    return int(v.store.read(lambda s: s.execute(select(func.count()).where(
        Generation.host == host, Generation.state == GenState.current)).scalar_one()))


def starting(v: Vigil, host: str) -> bool:
    """A wake of `host` is past queued and not done: its instance may not serve yet."""
    from sqlalchemy import select

    from models.states import WakeState
    from models.tables import Wake

    busy = (WakeState.leased, WakeState.spawning, WakeState.checking)
    return v.store.read(lambda s: s.execute(select(Wake.id).where(
        Wake.host == host, Wake.state.in_(busy))).first()) is not None


def test_a_scale_storm_leaves_no_instance_behind(vigil: Vigil) -> None:
    """`scale sc 8; scale sc 1`, six times at once: a scale while the host's wakes run is
    refused in one line (a scale-down could not see an instance still starting), and once
    all is done the host runs exactly as many instances as the last scale taken said."""
    from tests.listening import free_port

    vigil.run("host", "add", "sc", "--build", str(HELLO), "--listen",
              f"http=tcp:127.0.0.1:{free_port()}", "--drain-timeout", "3")
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    vigil.run("wake", "sc", "--wait")
    refusals = []
    for _ in range(6):
        up = vigil.run("scale", "sc", "8", check=False)
        if "wake(s) queued" in up.stdout:  # down again while its wakes start (not serving yet)
            wait_for(lambda: starting(vigil, "sc"), 30, interval=0.005, what="a wake starting")
        for cp in (up, vigil.run("scale", "sc", "1", check=False)):
            if cp.returncode != 0:
                refusals.append(one_line(cp))
    assert refusals and all("cannot be scaled now" in r for r in refusals), refusals
    vigil.quiesce(90)
    want = vigil.json("host", "show", "sc")["instances"]
    wait_for(lambda: currents(vigil, "sc") == want, 30, what=f"{want} current generation(s)")
    vigil.check()
    vigil.run("scale", "sc", "1", "--wait")
    assert currents(vigil, "sc") == 1
    vigil.check()


# -- item 13: `logs -f` drops no line ----------------------------------------------------

class Follow:
    """`vigil logs HOST -f` as a real process; its lines gathered by a thread."""

    def __init__(self, v: Vigil, *args: str) -> None:
        import subprocess
        import sys
        import threading

        from tests.conftest import ROOT

        self.lines: list[str] = []
        self.p = subprocess.Popen([sys.executable, "-m", "runners.cli", "logs", *args, "-f"],
                                  env=v.env, cwd=ROOT, stdout=subprocess.PIPE)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:  # bytes: split at LF only, as written
            self.lines.append(line.decode())

    def seqs(self) -> dict[int, list[int]]:
        """Each generation's sequence numbers, as printed (`gN | STAMPED host seq time`)."""
        out: dict[int, list[int]] = {}
        for line in list(self.lines):
            gen, bar, word, _host, seq, _at = line.split()
            assert bar == "|" and word == "STAMPED", line
            out.setdefault(int(gen[1:]), []).append(int(seq))
        return out

    def end(self) -> None:
        import os
        import signal

        os.kill(self.p.pid, signal.SIGKILL)
        self.p.wait(10)
        self.reader.join(10)
        assert self.p.stdout is not None
        self.p.stdout.close()


def gaps(seqs: list[int]) -> list[tuple[int, int]]:
    return [(a, b) for a, b in zip(seqs, seqs[1:], strict=False) if b != a + 1]


def test_logs_follow_drops_no_line_of_a_fast_writer_nor_of_a_new_generation(vigil: Vigil) -> None:
    from tests.conftest import FIXTURES

    vigil.run("host", "add", "fast", "--build", str(FIXTURES / "stamped.py"), "--kind", "worker",
              "--env", "STAMPED_EVERY=0.00005")
    vigil.wait_ready(vigil.start_agent())
    vigil.run("wake", "fast", "--wait")
    first = vigil.status("fast")["generation"]
    logs = vigil.state_dir / "logs" / "fast"
    wait_for(lambda: sum(f.stat().st_size for f in logs.glob("g*.log")) > 100_000, 30,
             what="the writer well under way")
    follow = Follow(vigil, "fast", "-n", "5")
    try:
        wait_for(lambda: len(follow.seqs().get(first, [])) > 20_000, 60, interval=0.1,
                 what="20,000 lines followed")
        vigil.run("restart", "fast", "--wait")
        new = vigil.status("fast")["generation"]
        wait_for(lambda: len(follow.seqs().get(new, [])) > 20_000, 60, interval=0.1,
                 what="20,000 lines of the new generation followed")
    finally:
        follow.end()
    seqs = follow.seqs()
    assert not gaps(seqs[first]), gaps(seqs[first])[:5]  # from the first print on, every line
    assert seqs[new][0] == 0 and not gaps(seqs[new]), (seqs[new][:3], gaps(seqs[new])[:5])


# -- item 14 (part): one line each, nothing changed ---------------------------------------

def test_a_size_beyond_what_can_be_stored_is_refused_at_parse(vigil: Vigil, tmp_path: Path) -> None:
    for key, value in (("memory_max", '"9000000T"'), ("limit_core", '"9000000T"'),
                       ("memory_tier_mb", str(2**70))):
        hosts = tmp_path / f"{key}.toml"
        hosts.write_text(f'[hosts.big]\nbuild = "{HELLO}"\n{key} = {value}\n')
        for args in (("apply", "--dry-run", str(hosts)), ("apply", str(hosts))):
            err = one_line(vigil.run(*args, check=False))
            assert key in err and "OverflowError" not in err, err
    for opt in ("--memory-max", "--limit-core"):
        err = one_line(vigil.run("host", "add", "big", "--build", str(HELLO), opt, "9000000T",
                                 check=False))
        assert opt in err, err
    assert not vigil.json("host", "list")  # nothing written


def test_corrupt_times_records_and_a_lone_cr_in_logs(vigil: Vigil) -> None:
    """A `.times` record saying inf, nan or a time before 1970 is skipped, not a traceback;
    a lone CR is part of its line in `logs` as in `logs -f` (only LF ends a line)."""
    vigil.add_host("w")
    d = vigil.state_dir / "logs" / "w"
    d.mkdir(parents=True, exist_ok=True)
    (d / "g1.log").write_bytes(b"one\ntwo\rhalf\nthree\r\n")
    (d / "g1.times").write_bytes(b"4 inf\n13 nan\n20 -1e11\n21 1e300\n")
    for args in ((), ("--json",), ("--since", "1h"), ("-t",)):
        cp = vigil.run("logs", "w", *args, check=False)
        assert cp.returncode == 0 and "Traceback" not in cp.stderr, cp.stderr[-2000:]
    assert vigil.run("logs", "w").stdout.split("\n") == ["g1 | one", "g1 | two\rhalf",
                                                          "g1 | three", ""]
    follow = Follow(vigil, "w", "-n", "0")
    try:
        def pinged() -> bool:  # a line written once the follow runs is printed
            with open(d / "g1.log", "ab") as f:
                f.write(b"ping\n")
            return bool(follow.lines)
        wait_for(pinged, 20, interval=0.2, what="the follow under way")
        with open(d / "g1.log", "ab") as f:
            f.write(b"four\rfive\r\n")
        wait_for(lambda: "g1 | four\rfive\n" in follow.lines, 20, what="the follow's line")
    finally:
        follow.end()
    assert follow.lines[-1] == "g1 | four\rfive\n", follow.lines


def test_host_show_shows_user_group_env_files_credentials_and_limits(
        vigil: Vigil, tmp_path: Path) -> None:
    """Every setting, as documented; an env file's values and a credential's contents never
    (its name and path only)."""
    env_file, cred = tmp_path / "app.env", tmp_path / "token"
    env_file.write_text("DB_PASSWORD=Sup3rS3cret\n")
    cred.write_text("t0pS3cret\n")
    vigil.add_host("x", HELLO, "--user", "nobody", "--group", "nogroup", "--env-file",
                   str(env_file), "--env-file", "-/no/such.env", "--credential", f"tok={cred}",
                   "--memory-max", "64M", "--cpu-quota", "20%", "--pids-max", "50",
                   "--limit-nofile", "1024", "--limit-core", "0")
    info = vigil.json("host", "show", "x")
    assert (info["user"], info["group"]) == ("nobody", "nogroup"), info
    assert info["env_file"] == [str(env_file), "-/no/such.env"]
    assert info["credentials"] == {"tok": str(cred)}
    assert {k: info[k] for k in ("memory_max", "cpu_quota", "pids_max", "limit_nofile",
                                 "limit_core")} == {"memory_max": 64 << 20, "cpu_quota": 20,
                                                    "pids_max": 50, "limit_nofile": 1024,
                                                    "limit_core": 0}
    out = vigil.run("host", "show", "x").stdout
    for line in ("user:               nobody", "group:              nogroup",
                 f"env file:           {env_file}, -/no/such.env", f"credentials:        tok={cred}",
                 "memory max:         64M", "cpu quota:          20%", "pids max:           50",
                 "limit nofile:       1024", "limit core:         0"):
        assert f"  {line}\n" in out, (line, out)
    assert "Sup3rS3cret" not in out + json.dumps(info) and "t0pS3cret" not in out + json.dumps(info)
