"""Recovery suite (DESIGN §5): every registered crash point, reached by a real agent.

For each crash point the test drives a real workflow with an agent started with
`VIGIL_CRASH_AT=<name>`, checks that the agent died by SIGKILL there, starts a clean agent,
waits until it is ready and quiescent, and then checks the invariants a crash must never
break: `vigil check` passes, no process of the state dir lives outside the current
generations, leases are held iff something needs them, a generation that was serving and
that the workflow was not ending kept its pid, and the host ends where the workflow was
taking it (awake and answering on its canonical link, or asleep with nothing left).

Adding a crash point means adding one entry to SCENARIOS (and, for a new workflow, one Flow);
`test_every_crashpoint_has_a_scenario` fails until it is there.

Every test also carries a *bystander* host, woken before the crash and never touched by the
workflow under test: whatever happens, it must be adopted and keep its pid.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest
from sqlalchemy import select

from models.states import LIVE_GEN, GenState, HostKind, WakeState
from models.tables import Generation, Lease, Wake
from runners.doorbell import ring
from runners.files import stage_build
from tests.conftest import FIXTURES, HELLO, Vigil, marked_pids, wait_for
from workflows import hosts
from workflows.wake import request_wake

TARGET = "app"
BYSTANDER = "bystander"
CRASH_BOUND = 15.0  # seconds for a crashing agent to reach its point and die
READY_BOUND = 15.0


# -- harness ------------------------------------------------------------------------------


def start(v: Vigil, crash_at: str | None = None) -> tuple[subprocess.Popen[bytes], int]:
    """Start an agent; returns it and the offset of its first line in agent.out (every agent
    of a state dir appends to the same log, so readiness is read after that offset)."""
    offset = len(v.agent_log())
    return v.start_agent(crash_at), offset


def ready_or_dead(v: Vigil, p: subprocess.Popen[bytes], offset: int, timeout: float) -> bool:
    """Wait until the agent logged `ready` (True) or exited (False)."""
    marker = b"level=INFO logger=vigil.agent ready"
    wait_for(lambda: p.poll() is not None or marker in v.agent_log()[offset:], timeout,
             what="agent ready or dead")
    return p.poll() is None and marker in v.agent_log()[offset:]


def ready(v: Vigil, p: subprocess.Popen[bytes], offset: int) -> None:
    assert ready_or_dead(v, p, offset, READY_BOUND), (
        f"agent exited {p.returncode} before ready:\n{tail(v, offset)}")


def tail(v: Vigil, offset: int = 0) -> str:
    return v.agent_log()[offset:].decode(errors="replace")[-4000:]


def expect_sigkill(v: Vigil, p: subprocess.Popen[bytes], point: str, offset: int) -> None:
    try:
        rc = p.wait(CRASH_BOUND)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"agent with VIGIL_CRASH_AT={point} did not die within "
                             f"{CRASH_BOUND}s (point not reached?):\n{tail(v, offset)}") from None
    assert rc == -signal.SIGKILL, (
        f"agent with VIGIL_CRASH_AT={point} exited {rc}, not by SIGKILL:\n{tail(v, offset)}")


def get(sock_path: str, timeout: float = 5.0) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(sock_path)
        s.sendall(b"GET / HTTP/1.0\r\nHost: vigil\r\n\r\n")
        data = b""
        while chunk := s.recv(4096):
            data += chunk
    return data


def generations(v: Vigil, host: str | None = None) -> list[Generation]:
    def q(s):  # type: ignore[no-untyped-def]
        stmt = select(Generation).order_by(Generation.id)
        if host is not None:
            stmt = stmt.where(Generation.host == host)
        return s.execute(stmt).scalars().all()

    return v.store.read(q)


def currents(v: Vigil) -> dict[str, Generation]:
    out: dict[str, Generation] = {}
    for g in generations(v):
        if g.state is GenState.current:
            assert g.host not in out, f"host {g.host} has two current generations"
            out[g.host] = g
    return out


def same_process_alive(pid: int, create_time: float | None) -> bool:
    """The process that had this pid at create_time still runs (not a zombie)."""
    try:
        p = psutil.Process(pid)
        if create_time is not None and abs(p.create_time() - create_time) > 0.05:
            return False  # the pid was reused
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def app_pids(v: Vigil) -> set[int]:
    """Live processes of this state dir that are not an agent (apps and their children)."""
    agents = {a.pid for a in v.agents}
    return set(marked_pids(v.state_dir)) - agents


def describe(pids: set[int]) -> str:
    out = []
    for pid in sorted(pids):
        try:
            p = psutil.Process(pid)
            env = p.environ()
            out.append(f"pid {pid} host={env.get('VIGIL_HOST')} gen={env.get('VIGIL_GENERATION')} "
                       f"cmd={' '.join(p.cmdline())[:120]}")
        except psutil.Error:
            out.append(f"pid {pid} (gone)")
    return "; ".join(out)


# -- flows: how to bring a workflow to its crash points and where it must end ---------------


@dataclass(frozen=True)
class Flow:
    """One workflow under test, run on the host TARGET.

    build, host:     the target's build (or a function making one) and host options
                     (drain_timeout, health_timeout).
    pre_awake:       the target is woken (by a clean setup agent) before the crash agent starts.
    setup_signal:    how the setup agent ends (SIGKILL for adoption scenarios).
    drive:           what is done once the first crash agent is ready (None: it is expected to
                     die during its own recovery).
    end:             "awake" (serving, exactly one current), "asleep" (nothing left), or
                     "failed" (asleep after a failed wake that was proven).
    target_fate:     what happens to the pid that was current before the crash: "kept" (the
                     workflow was not ending it) or "ended" (it must be dead); None: no pid.
    """

    name: str
    drive: Callable[[Vigil], None] | None
    end: str
    build: Path | Callable[[Vigil], Path] = HELLO
    host: dict[str, float] = field(default_factory=dict)
    pre_awake: bool = False
    setup_signal: int = signal.SIGTERM
    target_fate: str | None = None


def wrapped(fixture: Path) -> Callable[[Vigil], Path]:
    """A build that execs a fixture from where it lives (staging copies only the script,
    and a fixture that finds hello.py by a relative path must run from tests/fixtures)."""

    def make(v: Vigil) -> Path:
        build = v.state_dir.parent / f"{fixture.stem}.sh"
        build.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{fixture}"\n')
        build.chmod(0o755)
        return build

    return make


def add_host(v: Vigil, name: str, build: Path, **opts: float) -> None:
    """What `vigil host add` does, in-process (the setup is not under test; this saves a
    CLI start-up per host on a busy box)."""
    path, digest = stage_build(str(build), v.state_dir)
    v.store.write(lambda s: hosts.add_host(
        s, name, kind=HostKind.instance, build_path=path, digest=digest, source=str(build),
        args=[], env={}, cwd=None, drain_timeout=opts.get("drain_timeout", 10.0),
        health_timeout=opts.get("health_timeout", 10.0)))


def cli_wake(v: Vigil) -> None:
    v.run("wake", TARGET)


def cli_stop(v: Vigil) -> None:
    v.run("stop", TARGET)


def kill_leader(v: Vigil) -> None:
    pid = v.status(TARGET)["pid"]
    assert pid, "target is not awake"
    os.kill(pid, signal.SIGKILL)


WAKE = Flow("wake", cli_wake, end="awake")
FAILED_WAKE = Flow("failed-wake", cli_wake, end="failed", build=FIXTURES / "bad_health.py",
                   host={"health_timeout": 1.0})
# double_fork leaves a grandchild in its own session that ignores SIGTERM: the stop must
# SIGKILL the containment (stop.killed is reached only then), and any leak shows.
STOP = Flow("stop", cli_stop, end="asleep", build=wrapped(FIXTURES / "double_fork.py"),
            host={"drain_timeout": 1.0}, pre_awake=True, target_fate="ended")
MEMBER = Flow("member", kill_leader, end="awake", pre_awake=True, target_fate="ended")
ADOPT = Flow("adopt", None, end="awake", pre_awake=True, setup_signal=signal.SIGKILL,
             target_fate="kept")


@dataclass(frozen=True)
class Scenario:
    flow: Flow
    # Crash points hit in order by successive agents before the clean one; the first agent
    # is the one driven, the later ones reach their point during recovery. Empty: (name,).
    chain: tuple[str, ...] = field(default=())


SCENARIOS: dict[str, Scenario] = {
    # wake of a good host
    "wake.leased": Scenario(WAKE),
    "wake.intent": Scenario(WAKE),
    "wake.spawned": Scenario(WAKE),
    "wake.recorded": Scenario(WAKE),
    "wake.current": Scenario(WAKE),
    # failed wake (health answers 500)
    "wake.failing": Scenario(FAILED_WAKE),
    "wake.killed": Scenario(FAILED_WAKE),
    "wake.proven": Scenario(FAILED_WAKE),
    # an interrupted wake reaped by the next agent (the point is reached during recovery)
    "wake.reaping": Scenario(WAKE, ("wake.spawned", "wake.reaping")),
    "wake.reaped": Scenario(WAKE, ("wake.recorded", "wake.reaped")),
    # stop of an awake host, and the lease given back after it
    "stop.intent": Scenario(STOP),
    "stop.unlinked": Scenario(STOP),
    "stop.termed": Scenario(STOP),
    "stop.killed": Scenario(STOP),
    "stop.proven": Scenario(STOP),
    "release.done": Scenario(STOP),
    # the app's leader dies while the agent runs
    "member.exited": Scenario(MEMBER),
    "member.proven": Scenario(MEMBER),
    # adoption on start after the agent was SIGKILLed
    "recover.adopted": Scenario(ADOPT),
}

# Double crashes: crash at the first point, restart crashing at the second (reached during
# recovery), then restart clean. The flow is the first point's.
PAIRS: list[tuple[str, ...]] = [
    ("wake.recorded", "wake.reaping"),
    ("wake.spawned", "wake.reaping", "wake.reaped"),
    ("wake.failing", "wake.killed"),
    ("stop.termed", "stop.killed"),
    ("stop.killed", "release.done"),
    ("member.exited", "member.proven"),
    ("wake.current", "recover.adopted"),
]


def registered() -> set[str]:
    import workflows.obligations  # noqa: F401  (imports every workflow, registering its points)
    import workflows.recovery  # noqa: F401
    from workflows import crash

    return set(crash.REGISTERED)


# -- the run --------------------------------------------------------------------------------


def run_scenario(v: Vigil, flow: Flow, chain: tuple[str, ...]) -> None:
    t0 = time.monotonic()

    def phase(what: str) -> None:  # shown with the captured output of a failing test
        print(f"{time.monotonic() - t0:6.2f}s {what}")

    build = flow.build(v) if callable(flow.build) else flow.build
    add_host(v, BYSTANDER, HELLO)
    add_host(v, TARGET, build, **flow.host)

    # Setup: a clean agent wakes what must be serving before the crash.
    setup, off = start(v)
    awake = [BYSTANDER, TARGET] if flow.pre_awake else [BYSTANDER]
    for h in awake:  # the intents the CLI writes; the agent picks them up on start
        v.store.write(lambda s, h=h: request_wake(s, h))
    ready(v, setup, off)
    phase("setup agent ready")
    ring(v.state_dir)
    for h in awake:
        wait_for(lambda h=h: v.status(h)["state"] == "awake", 20, what=f"{h} awake")
    rc = v.stop_agent(setup, flow.setup_signal)
    assert rc == (-signal.SIGKILL if flow.setup_signal == signal.SIGKILL else 0), tail(v, off)
    before = {h: (g.id, g.pid, g.create_time) for h, g in currents(v).items()}
    assert set(before) == set(awake)
    phase("setup done")

    # The crashes.
    for i, point in enumerate(chain):
        agent, off = start(v, crash_at=point)
        if i == 0 and ready_or_dead(v, agent, off, READY_BOUND) and flow.drive is not None:
            phase(f"agent ready with {point}; driving")
            flow.drive(v)
        expect_sigkill(v, agent, point, off)
        phase(f"agent died at {point}")
    # What served when the last agent died (and still runs) must be adopted, never restarted.
    at_crash = {h: (g.id, g.pid, g.create_time) for h, g in currents(v).items()
                if g.pid is not None and same_process_alive(g.pid, g.create_time)}

    # Recovery by a clean agent.
    agent, off = start(v)
    ready(v, agent, off)
    phase("clean agent ready")
    v.quiesce(20)
    phase("quiescent")
    try:
        check_invariants(v, flow, before, at_crash)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n--- agent log ---\n{tail(v)}") from None
    phase("checked")
    assert agent.poll() is None, "the clean agent died"


Snapshot = dict[str, tuple[int, int, float]]  # host -> (generation, pid, create_time)


def check_invariants(v: Vigil, flow: Flow, before: Snapshot, at_crash: Snapshot) -> None:
    v.check()
    cur = currents(v)

    # A generation the workflow was not ending kept its pid (and its generation): what
    # served before the workflow started, and what served (alive) when the agent died.
    kept = [(h, before[h]) for h in [BYSTANDER] + ([TARGET] if flow.target_fate == "kept" else [])]
    kept += list(at_crash.items())
    for host, (gid, pid, ctime) in kept:
        assert host in cur and cur[host].id == gid and cur[host].pid == pid, (
            f"{host}: g{gid} pid {pid} was serving before the crash but now "
            f"{'g%d pid %s' % (cur[host].id, cur[host].pid) if host in cur else 'nothing'} is")
        assert same_process_alive(pid, ctime), f"{host}: pid {pid} is not the same live process"
    if flow.target_fate == "ended":
        _, pid, ctime = before[TARGET]
        assert not same_process_alive(pid, ctime), f"{TARGET}: old pid {pid} still runs"

    # No process of this state dir outside the current generations (leader + descendants).
    allowed: set[int] = set()
    for g in cur.values():
        assert g.pid is not None
        allowed.add(g.pid)
        try:
            allowed |= {c.pid for c in psutil.Process(g.pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            pass
    stray = app_pids(v) - allowed
    assert not stray, f"processes outside the current generations: {describe(stray)}"

    # Every non-current generation is proven, its recorded leader gone, its cgroup removed.
    for g in generations(v):
        if g.state is GenState.current:
            continue
        assert g.state is GenState.proven, f"g{g.id} of {g.host} is {g.state.value} at quiescence"
        if g.pid is not None:
            assert not same_process_alive(g.pid, g.create_time), f"g{g.id} pid {g.pid} runs"
        if g.cgroup:
            assert not os.path.exists(g.cgroup), f"g{g.id}: cgroup {g.cgroup} left behind"

    # Leases: held iff a live generation needs one (quiescent: no obligation is open).
    def leases(s):  # type: ignore[no-untyped-def]
        return {lease.host: lease for lease in s.execute(select(Lease)).scalars()}

    held = v.store.read(leases)
    live_hosts = {g.host for g in generations(v) if g.state in LIVE_GEN}
    assert set(held) == live_hosts, (f"leases held by {sorted(held)} but live generations on "
                                     f"{sorted(live_hosts)}")
    assert not v.obligations()

    # The bystander and, for wakes, the target serve on their canonical links.
    for host in {BYSTANDER} | ({TARGET} if flow.end == "awake" else set()):
        assert_serving(v, host, cur)
    if flow.end in ("asleep", "failed"):
        st = v.status(TARGET)
        assert st["state"] == "asleep", st
        assert TARGET not in cur
        assert not [g for g in generations(v, TARGET) if g.state in LIVE_GEN]
        assert not [pid for pid in app_pids(v) if _host_of(pid) == TARGET], "target left a process"
        assert not os.path.lexists(v.state_dir / "run" / f"{TARGET}.sock"), "canonical link left"
        if flow.end == "asleep":
            assert st["desired"] == "down", st
        else:
            wakes = v.store.read(lambda s: s.execute(select(Wake.state).where(
                Wake.host == TARGET)).scalars().all())
            assert wakes and all(w is WakeState.failed for w in wakes), wakes


def assert_serving(v: Vigil, host: str, cur: dict[str, Generation]) -> None:
    st = v.status(host)
    assert st["state"] == "awake" and st["desired"] == "up", st
    gens = [g for g in generations(v, host) if g.state is GenState.current]
    assert len(gens) == 1, f"{host}: {len(gens)} current generations"
    g = gens[0]
    link = v.state_dir / "run" / f"{host}.sock"
    assert os.readlink(link) == g.socket, f"{host}: {link} -> {os.readlink(link)}, not {g.socket}"
    reply = get(str(link))
    assert reply.startswith(b"HTTP/1.0 200") and f"pid={g.pid}".encode() in reply, reply[:200]


def _host_of(pid: int) -> str | None:
    try:
        return psutil.Process(pid).environ().get("VIGIL_HOST")
    except psutil.Error:
        return None


# -- tests ------------------------------------------------------------------------------------


def test_every_crashpoint_has_a_scenario() -> None:
    names = registered()
    missing = names - set(SCENARIOS)
    assert not missing, (f"crash points without a recovery scenario: {sorted(missing)}; "
                         "add one entry each to SCENARIOS in tests/recovery/test_crashpoints.py")
    unknown = set(SCENARIOS) - names
    assert not unknown, f"SCENARIOS names crash points nobody defines: {sorted(unknown)}"
    for name, sc in SCENARIOS.items():
        chain = sc.chain or (name,)
        assert chain[-1] == name and set(chain) <= names, (name, chain)
    for chain in PAIRS:
        assert set(chain) <= names and chain[0] in SCENARIOS, chain


def test_cli_lists_the_registered_crashpoints(vigil: Vigil) -> None:
    listed = set(vigil.run("crashpoints").stdout.split())
    assert listed == registered()


@pytest.mark.parametrize("point", sorted(SCENARIOS))
def test_crash_at(vigil: Vigil, point: str) -> None:
    sc = SCENARIOS[point]
    run_scenario(vigil, sc.flow, sc.chain or (point,))


@pytest.mark.parametrize("chain", PAIRS, ids=["+".join(c) for c in PAIRS])
def test_double_crash(vigil: Vigil, chain: tuple[str, ...]) -> None:
    run_scenario(vigil, SCENARIOS[chain[0]].flow, chain)


@pytest.mark.parametrize("containment", ["marker"])
@pytest.mark.parametrize("point", sorted(SCENARIOS))
def test_crash_at_marker(vigil: Vigil, point: str) -> None:
    sc = SCENARIOS[point]
    run_scenario(vigil, sc.flow, sc.chain or (point,))
