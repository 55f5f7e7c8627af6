"""Instances: N processes of one build on a host's held listeners, each a generation in its
own slot (workflows/generations/slots.py). Refused without listeners, in one line."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from models.tables import Host
from tests.conftest import HELLO, Vigil, pid_dead, wait_for
from tests.integration.test_cli_bad_input import dump, refused
from tests.listening import Client, free_port


def test_instances_without_listeners_are_refused_in_one_line(vigil: Vigil, tmp_path: Path) -> None:
    before = dump(vigil)
    cp = vigil.run("host", "add", "web", "--build", str(HELLO), "--instances", "2", check=False)
    refused(cp, "--instances 2 needs held listeners", "add --listen")
    hosts = tmp_path / "hosts.toml"
    hosts.write_text(f'[hosts.web]\nbuild = "{HELLO}"\ninstances = 3\n')
    line = refused(vigil.run("apply", str(hosts), check=False), "instances 3 needs held listeners")
    assert f"{hosts}:3: hosts.web.instances" in line, line
    cp = vigil.run("host", "add", "web", "--build", str(HELLO), "--instances", "0",
                   "--listen", f"tcp:127.0.0.1:{free_port()}", check=False)
    refused(cp, "--instances must be a count from 1 to 64, not 0")
    assert dump(vigil) == before


@pytest.mark.parametrize("kind", ["worker"])
def test_a_worker_runs_one_instance(vigil: Vigil, kind: str) -> None:
    before = dump(vigil)
    cp = vigil.run("host", "add", "w", "--build", str(HELLO), "--kind", kind, "--instances", "2",
                   check=False)
    refused(cp, "a worker host runs one process")
    assert dump(vigil) == before


def slots_up(v: Vigil, host: str, n: int, timeout: float = 60) -> list[dict]:
    """Wait until all `n` slots of `host` have a current generation; its slots."""
    def up() -> bool:
        st = v.status(host)
        return sum(1 for x in st.get("slots", []) if x["generation"]) == n
    wait_for(up, timeout, interval=0.05, what=f"{n} instances of {host} up")
    return v.status(host)["slots"]


def add_instances(v: Vigil, port: int, n: int, *extra: str) -> None:
    v.run("host", "add", "web", "--build", str(HELLO), "--listen", f"http=tcp:127.0.0.1:{port}",
          "--instances", str(n), "--drain-timeout", "5", *extra)


def test_instances_wake_restart_in_their_slot_and_stop_together(vigil: Vigil) -> None:
    """A wake brings every slot up (each its own pid, all on the one socket); a kill -9 of
    one instance restarts that slot alone, the others keep their pids; a stop ends them all."""
    port = free_port()
    add_instances(vigil, port, 3)
    vigil.wait_ready(vigil.start_agent())
    vigil.run("wake", "web", "--wait")
    slots = slots_up(vigil, "web", 3)
    assert [x["slot"] for x in slots] == [0, 1, 2]
    pids = [x["pid"] for x in slots]
    assert len(set(pids)) == 3
    table = vigil.run("status").stdout
    assert "3/3" in table and "web/2" in table, table
    with Client(port) as client:
        os.kill(pids[1], signal.SIGKILL)
        wait_for(lambda: slots_up(vigil, "web", 3)[1]["pid"] not in (None, pids[1]), 60,
                 what="slot 1 restarted")
        restarted = slots_up(vigil, "web", 3)[1]["pid"]
        wait_for(lambda: restarted in client.pids, 30, interval=0.05,
                 what=f"an answer from the restarted instance (pid {restarted})")
    after = slots_up(vigil, "web", 3)
    assert after[0]["pid"] == pids[0] and after[2]["pid"] == pids[2]
    # The instance killed may hold the one request in flight (it accepted it): that one is
    # reset, as any server's killed worker's. Nothing else fails: the others serve on.
    assert len(client.failures) <= 1, client.failures[:5]
    assert all(f.startswith(("ConnectionResetError", "answer b''")) for f in client.failures)
    vigil.quiesce(30)
    vigil.check()
    vigil.run("stop", "web", "--wait", timeout=60)
    assert all(pid_dead(p) for p in [*pids, after[1]["pid"]])
    assert vigil.status("web")["state"] in ("asleep", "down")
    vigil.quiesce(30)
    vigil.check()


def answered_on(client: Client, more: int = 5) -> None:
    """The client is answered `more` times after this point (nothing waits in a backlog)."""
    after = client.ok
    wait_for(lambda: client.ok >= after + more or bool(client.failures), 30, interval=0.02,
             what=f"{more} more answers")


def holds(pid: int, inode: int) -> bool:
    """The process has the socket open: one of its fds names socket:[inode]. (An fd that
    closes while they are read, an answered connection, is skipped, not a miss.)"""
    want = f"socket:[{inode}]"
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == want:
                return True
        except OSError:
            continue
    return False


class Serving:
    """Samples, every 50 ms from /proc, how many instances of the host hold the shared
    socket and are current (their pid is a live process whose fds include the socket's
    inode); the fewest seen.

    A sample is the store's current pids read before and after the /proc reads, kept only
    when the two agree. A switch committed between them (the old pid was read current, then
    the drain's SIGTERM closed its listener before its fds were read) would count one short
    though its successor already served: such a torn sample is read again (`torn` counts
    them; `torn_short` those that alone would have counted fewer than the most seen)."""

    def __init__(self, v: Vigil, host: str, inode: int) -> None:
        import threading

        self.v, self.host, self.inode = v, host, inode
        self.fewest: int | None = None
        self.most = 0
        self.samples = 0
        self.torn = 0
        self.torn_short = 0
        self.short: list[tuple[float, list[tuple[int, int, bool]]]] = []  # below the most seen
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _current(self) -> list[tuple[int, int]]:
        st = self.v.status(self.host)  # one instance (scaled down to it): as before slots
        return [(x.get("slot", 0), x["pid"]) for x in st.get("slots", [st]) if x["pid"]]

    def count(self, between: Callable[[], object] = lambda: None) -> int | None:
        """Instances current and holding the socket, or None for a torn sample (`between`
        runs between the store's read and /proc's, for the test of a torn one)."""
        current = self._current()
        between()
        seen = [(slot, pid, holds(pid, self.inode)) for slot, pid in current]
        n = sum(1 for *_, ok in seen if ok)
        if self._current() != current:
            self.torn += 1
            self.torn_short += n < self.most
            return None
        if n < self.most:
            self.short.append((time.time(), seen))
        return n

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            n = self.count()
            while n is None and not self._stop.is_set():
                n = self.count()
            if n is None:
                return
            self.samples += 1
            self.most = max(self.most, n)
            self.fewest = n if self.fewest is None else min(self.fewest, n)

    def __enter__(self) -> Serving:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(5)


@pytest.mark.parametrize("mode", ["overlap", "hold"])
def test_deploys_of_instances_fail_no_request(vigil: Vigil, short_tmp: Path, mode: str) -> None:
    """Each deploy replaces every instance (overlap: one slot at a time, never fewer than
    N current; hold: all stopped, then all started, the socket held throughout)."""
    from tests.listening import serving_inode

    n, deploys = 3, 3
    builds = serve_builds_hello(short_tmp)
    port = free_port()
    vigil.run("host", "add", "web", "--build", str(builds[0]), "--listen",
              f"http=tcp:127.0.0.1:{port}", "--instances", str(n), "--drain-timeout", "5")
    vigil.wait_ready(vigil.start_agent())
    vigil.run("wake", "web", "--wait")
    before = {x["generation"] for x in slots_up(vigil, "web", n)}
    inode = serving_inode(vigil, "web")
    with Client(port) as client, Serving(vigil, "web", inode) as serving:
        for i in range(deploys):
            cp = vigil.run("deploy", "web", str(builds[(i + 1) % 2]), "--mode", mode, "--wait",
                           timeout=120)
            assert f"done (mode {mode}" in cp.stdout, cp.stdout
            now = slots_up(vigil, "web", n)
            assert not {x["generation"] for x in now} & before, now
            before = {x["generation"] for x in now}
        answered_on(client)
    assert not client.failures, client.failures[:5]
    assert client.ok > deploys
    if mode == "overlap":
        assert serving.samples > 10 and serving.fewest == n, (serving.fewest, serving.samples)
    vigil.quiesce(30)
    vigil.check()


def test_a_sample_torn_by_a_switch_is_read_again(vigil: Vigil, short_tmp: Path) -> None:
    """The soak's measure itself: current pids read from the store, then a whole deploy
    (every old instance switched out, drained and gone), then their fds read from /proc. Read
    that way the sample counts none serving, though 2 new instances serve throughout: the
    sampler reads the store again and drops such a torn sample. (This is what made the
    4-instance soak see 3 of 4 on a loaded box: one switch, and its old instance's exit,
    inside one sample.)"""
    from tests.listening import serving_inode

    builds = serve_builds_hello(short_tmp)
    port = free_port()
    vigil.run("host", "add", "web", "--build", str(builds[0]), "--listen",
              f"http=tcp:127.0.0.1:{port}", "--instances", "2", "--drain-timeout", "5")
    vigil.wait_ready(vigil.start_agent())
    vigil.run("wake", "web", "--wait")
    old = [x["pid"] for x in slots_up(vigil, "web", 2)]
    serving = Serving(vigil, "web", serving_inode(vigil, "web"))  # not started: sampled here
    assert serving.count() == 2
    serving.most = 2

    def deploy() -> None:
        vigil.run("deploy", "web", str(builds[1]), "--wait", timeout=120)
        wait_for(lambda: all(pid_dead(p) for p in old), 30, what="the old instances gone")

    assert serving.count(between=deploy) is None
    assert (serving.torn, serving.torn_short) == (1, 1)  # the read of the old pids counted 0
    assert serving.count() == 2 and not serving.short
    vigil.quiesce(30)
    vigil.check()


def serve_builds_hello(tmp: Path) -> list[Path]:
    """Two builds of hello (different bytes, so different digests)."""
    out = []
    for i in range(2):
        p = tmp / f"hello{i}.py"
        p.write_text(HELLO.read_text() + f"\n# build {i}\n")
        p.chmod(0o755)
        out.append(p)
    return out


def test_scale_up_and_down_under_load_fail_no_request(vigil: Vigil) -> None:
    """`vigil scale web 4` wakes slots 2 and 3 beside the two that serve; `vigil scale web
    1` stops slots 3, 2 and 1 (each drained and proven); no request fails and never fewer
    than the smaller count serve."""
    from tests.listening import serving_inode

    port = free_port()
    add_instances(vigil, port, 2)
    vigil.wait_ready(vigil.start_agent())
    vigil.run("wake", "web", "--wait")
    first = slots_up(vigil, "web", 2)
    inode = serving_inode(vigil, "web")
    with Client(port) as client, Serving(vigil, "web", inode) as serving:
        cp = vigil.run("scale", "web", "4", "--wait")
        assert "2 -> 4 instances" in cp.stdout and "4 instance(s) serving" in cp.stdout, cp.stdout
        grown = slots_up(vigil, "web", 4)
        assert [x["pid"] for x in grown[:2]] == [x["pid"] for x in first]
        assert all(holds(x["pid"], inode) for x in grown)
        cp = vigil.run("scale", "web", "1", "--wait")
        assert "4 -> 1 instances (3 stop(s) queued" in cp.stdout, cp.stdout
        answered_on(client)
    st = vigil.status("web")
    assert "slots" not in st and st["pid"] == first[0]["pid"], st  # one: shown as before
    assert all(pid_dead(x["pid"]) for x in grown[1:])
    assert not client.failures, client.failures[:5]
    assert serving.fewest is not None and serving.fewest >= 1
    refused(vigil.run("scale", "web", "0", check=False), "scale must be a count from 1 to 64")
    vigil.quiesce(30)
    vigil.check()


def test_four_instances_through_deploys_an_agent_kill_and_scaling(vigil: Vigil,
                                                                  short_tmp: Path) -> None:
    """The issue's measure: 4 instances on one TCP port under a closed-loop client, through
    10 overlap deploys (never fewer than 4 serving, sampled from /proc every 50 ms), an
    overlap deploy whose agent is SIGKILLed mid-way (after its first slot is switched: the
    next agent finishes it, as a resumed attempt), 5 hold deploys (the socket held; the
    connections wait in its backlog), then scale 4 -> 6 -> 4: no request fails."""
    from tests.listening import serving_inode

    n = 4
    builds = serve_builds_hello(short_tmp)
    port = free_port()
    vigil.run("host", "add", "web", "--build", str(builds[0]), "--listen",
              f"http=tcp:127.0.0.1:{port}", "--instances", str(n), "--drain-timeout", "5")
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    vigil.run("wake", "web", "--wait")
    slots_up(vigil, "web", n)
    inode = serving_inode(vigil, "web")
    with Client(port) as client:
        with Serving(vigil, "web", inode) as overlap:
            for i in range(10):
                cp = vigil.run("deploy", "web", str(builds[(i + 1) % 2]), "--wait", timeout=120)
                assert "done (mode overlap" in cp.stdout, cp.stdout
            deploys = (overlap.fewest, overlap.samples, list(overlap.short))
            before = vigil.ready_count()
            vigil.run("deploy", "web", str(builds[1]))
            wait_for(lambda: _switched_slots(vigil, 11), 60,
                     what="the first slot of attempt #11 switched")
            agent.kill()
            agent.wait(10)
            t0 = time.monotonic()
            vigil.wait_ready_after(vigil.start_agent(), before)
            ready_s = time.monotonic() - t0
            vigil.quiesce(120)
        # Which window fell short, if one did: the 10 deploys, or the kill and its recovery.
        assert deploys[0] == n, ("through the 10 overlap deploys", deploys)
        assert overlap.samples > 20 and overlap.fewest == n, ("across the agent's kill",
            overlap.fewest, overlap.samples, overlap.short, vigil.run("events", "web").stdout[-4000:])
        live = vigil.store.read(lambda s: s.get(Host, "web").build_id)
        assert {x["build_id"] for x in slots_up(vigil, "web", n)} == {live}
        for i in range(5):
            cp = vigil.run("deploy", "web", str(builds[i % 2]), "--mode", "hold", "--wait",
                           timeout=120)
            assert "done (mode hold" in cp.stdout, cp.stdout
        assert serving_inode(vigil, "web") == inode
        vigil.run("scale", "web", "6", "--wait")
        vigil.run("scale", "web", "4", "--wait")
        answered_on(client)
    print(f"\n{client.ok} requests answered, {len(client.failures)} failed; overlap: fewest "
          f"serving {overlap.fewest} of {n} in {overlap.samples} samples ({overlap.torn} torn, "
          f"{overlap.torn_short} of them short); restarted agent ready in {ready_s:.1f} s")
    assert not client.failures, client.failures[:5]
    assert len(slots_up(vigil, "web", n)) == n
    vigil.quiesce(30)
    vigil.check()


def _switched_slots(v: Vigil, attempt: int) -> bool:
    from sqlalchemy import select

    from models.tables import Event

    return v.store.read(lambda s: s.execute(select(Event.id).where(
        Event.kind == "switched_slot", Event.detail.contains(f'"attempt": {attempt}'))).first()
        is not None)


def test_a_deploy_while_a_scale_down_stops_is_refused_or_waits(vigil: Vigil,
                                                               short_tmp: Path) -> None:
    """While a scale-down's stop of a slot is open, the operator's deploy, retry and restart
    are refused in one line naming the stop (nothing changed); an attempt the agent's own
    machinery writes meanwhile (here a scheduled restart's) waits at admission for the stops,
    then replaces the instances left: it is not cancelled as if the host were stopping."""
    from models.states import Cause, Mode
    from models.tables import Attempt, Build
    from workflows.deploys.request import request_deploy

    builds = serve_builds_hello(short_tmp)
    port = free_port()
    vigil.run("host", "add", "web", "--build", str(builds[0]), "--listen",
              f"http=tcp:127.0.0.1:{port}", "--instances", "3", "--drain-timeout", "5")
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    vigil.run("wake", "web", "--wait")
    pids = [x["pid"] for x in slots_up(vigil, "web", 3)]
    vigil.stop_agent(agent)  # the apps run on; the scale's stops stay queued, open
    assert "3 -> 1 instances (2 stop(s) queued" in vigil.run("scale", "web", "1").stdout
    before = dump(vigil)
    for cp, what in [(vigil.run("deploy", "web", str(builds[1]), check=False), "deployed"),
                     (vigil.run("restart", "web", check=False), "restarted")]:
        refused(cp, f"host web cannot be {what} now: it is scaling down to 1 instance(s) "
                "and stop #", "of slot 2 is still open", "vigil scale web 1 --wait")
    assert dump(vigil) == before

    def scheduled(s):  # type: ignore[no-untyped-def]
        build = s.get(Build, s.get(Host, "web").build_id)
        return request_deploy(s, "web", build, mode=Mode.overlap, canary=False,
                              cause=Cause.restart).id

    attempt = vigil.store.write(scheduled)
    vigil.wait_ready(vigil.start_agent())
    wait_for(lambda: vigil.store.read(lambda s: s.get(Attempt, attempt).outcome) is not None,
             60, what=f"attempt #{attempt} ended")
    a = vigil.store.read(lambda s: s.get(Attempt, attempt))
    assert a.outcome.value == "done", (a.outcome, a.reason)
    vigil.quiesce(30)
    st = vigil.status("web")
    assert "slots" not in st and st["pid"] not in pids, st  # one instance, replaced after
    assert all(pid_dead(p) for p in pids)
    vigil.check()


def test_each_instance_backs_off_by_its_own_restart_streak(vigil: Vigil) -> None:
    """Slot 1 killed twice in quick succession waits out a backoff before its third start
    (its streak 2, in status and the metrics); slot 2's first quick exit after that restarts
    at once, streak 1: a sibling's crash loop is not its own. Scaled away, a slot's streak
    is forgotten."""
    port = free_port()
    from tests.integration.test_operator import scrape, value

    add_instances(vigil, port, 3, "--restart-floor", "3", "--restart-cap", "3")
    metrics = free_port()
    vigil.wait_ready(vigil.start_agent(None, "--metrics-listen", f"127.0.0.1:{metrics}"))
    vigil.run("wake", "web", "--wait")
    slots_up(vigil, "web", 3)
    m = scrape(metrics)
    assert [value(m, "vigil_instance_up", host="web", slot=str(k)) for k in range(3)] == [1, 1, 1]

    def restarts() -> list[dict]:
        return [e["detail"] for e in vigil.json("events", "web") if e["kind"] == "restart_scheduled"]

    def kill(slot: int, n: int) -> None:
        pid = slots_up(vigil, "web", 3)[slot]["pid"]
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: len(restarts()) == n, 30, what=f"restart {n} scheduled")

    kill(1, 1)
    kill(1, 2)  # its second quick exit: waits the floor, 3 s
    st = vigil.status("web")
    assert [x.get("restart_streak") for x in st["slots"]] == [0, 2, 0], st
    m = scrape(metrics)
    assert [value(m, "vigil_instance_restart_streak", host="web", slot=str(k))
            for k in range(3)] == [0, 2, 0]
    assert value(m, "vigil_instance_up", host="web", slot="1") in (0, 1)  # waiting, or back
    kill(2, 3)
    got = [(r.get("slot"), r["streak"], r["delay"]) for r in restarts()]
    assert [(sl, n) for sl, n, _ in got] == [(1, 1), (1, 2), (2, 1)], got
    assert got[0][2] == got[2][2] == 0.0 and 2.4 - 0.001 <= got[1][2] <= 3.6 + 0.001, got  # ±20 %
    slots_up(vigil, "web", 3)
    vigil.run("scale", "web", "1", "--wait")
    vigil.run("scale", "web", "3", "--wait")
    st = vigil.status("web")
    assert [x["restart_streak"] for x in st["slots"]] == [0, 0, 0], st
    vigil.quiesce(30)
    vigil.check()
