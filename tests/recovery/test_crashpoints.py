"""Recovery suite (DESIGN §5): every registered crash point, reached by a real agent.

For each crash point a real workflow is driven with an agent started with
`VIGIL_CRASH_AT=<name>`; the agent must die there by SIGKILL. Then a clean agent is started,
and once it is ready and quiescent the invariants a crash must never break are checked:
`vigil check` passes; no process of the state dir lives outside the current generations;
every other generation is proven, its leader gone, its cgroup removed; a lease is held iff a
live generation needs it; a generation that was serving and that the workflow was not ending
kept its pid; and the host ends where the workflow was taking it (awake and answering on its
canonical link, on the right build, or asleep with nothing left).

A new crash point needs one entry in SCENARIOS (a new workflow also one Flow):
`test_every_crashpoint_has_a_scenario` fails until it is there.

Every test also carries a *bystander* host, woken before the crash and never touched by the
workflow under test: whatever happens, it must be adopted with the same pid.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest
from sqlalchemy import select

from models import schema
from models.states import LIVE_GEN, GenState, HostKind, WakeState
from models.tables import Attempt, Build, Generation, Host, Lease, Wake
from runners.doorbell import ring
from runners.files import stage_build
from runners.setup import open_store
from tests.conftest import FIXTURES, HELLO, Vigil, marked_pids, wait_for
from workflows import hosts
from workflows.wake import request_wake

pytestmark = pytest.mark.timeout(90)

TARGET = "app"
BYSTANDER = "bystander"
# Bounds on polls (met long before on a quiet box): room for CI running two suites at once.
CRASH_BOUND = 30.0  # seconds for a crashing agent to reach its point and die
READY_BOUND = 30.0
SETTLE = "0.5"  # canary settle window (VIGIL_SETTLE_SECONDS) for every agent here


# -- harness ------------------------------------------------------------------------------


@pytest.fixture
def vigil(short_tmp: Path, containment: str) -> Iterator[Vigil]:
    """conftest's `vigil`, with the store created in-process (`vigil db upgrade` is not
    under test here, and a CLI start-up per test adds up over this many scenarios)."""
    v = Vigil(short_tmp / "state", {"VIGIL_CONTAINMENT": containment})
    store = open_store(v.state_dir, v.db_url, create=True)
    try:
        schema.upgrade(store.engine)
    finally:
        store.dispose()
    try:
        yield v
    finally:
        v.cleanup()



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
    return p.poll() is None


def ready(v: Vigil, p: subprocess.Popen[bytes], offset: int) -> None:
    assert ready_or_dead(v, p, offset, READY_BOUND), (
        f"agent exited {p.returncode} before ready:\n{tail(v, offset)}")


def tail(v: Vigil, offset: int = 0) -> str:
    return v.agent_log()[offset:].decode(errors="replace")[-5000:]


def expect_sigkill(v: Vigil, p: subprocess.Popen[bytes], point: str, offset: int) -> None:
    try:
        rc = p.wait(CRASH_BOUND)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"agent with VIGIL_CRASH_AT={point} did not die within "
                             f"{CRASH_BOUND}s (point not reached?):\n{tail(v, offset)}") from None
    assert rc == -signal.SIGKILL, (
        f"agent with VIGIL_CRASH_AT={point} exited {rc}, not by SIGKILL:\n{tail(v, offset)}")


def get(sock_path: str, timeout: float = 5.0) -> bytes:
    """GET / over a unix socket (HTTP/1.0, read to EOF)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(sock_path)
        s.sendall(b"GET / HTTP/1.0\r\nHost: vigil\r\n\r\n")
        data = b""
        while chunk := s.recv(4096):
            data += chunk
    return data


def rows(v: Vigil, model: Any, *where: Any) -> list[Any]:
    return v.store.read(lambda s: s.execute(select(model).where(*where)).scalars().all())


def generations(v: Vigil, host: str | None = None) -> list[Generation]:
    return sorted(rows(v, Generation, *([Generation.host == host] if host else [])),
                  key=lambda g: g.id)


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
    return set(marked_pids(v.state_dir)) - {a.pid for a in v.agents}


def env_of(pid: int) -> dict[str, str]:
    try:
        return psutil.Process(pid).environ()
    except psutil.Error:
        return {}


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


def add_host(v: Vigil, name: str, build: Path, **opts: float) -> None:
    """What `vigil host add` does, in-process (the setup is not under test; this saves a
    CLI start-up per host on a busy box)."""
    path, digest = stage_build(str(build), v.state_dir)
    v.store.write(lambda s: hosts.add_host(
        s, name, kind=HostKind.instance, build_path=path, digest=digest, source=str(build),
        args=[], env={}, cwd=None, drain_timeout=opts.get("drain_timeout", 10.0),
        health_timeout=opts.get("health_timeout", 10.0)))


def new_build(v: Vigil, source: Path = HELLO) -> Path:
    """A copy of `source` with other bytes: another digest, so another build (hello reports
    the sha256 of its own file as build=<12 hex> in every answer)."""
    path = v.state_dir.parent / f"next-{source.name}"
    path.write_bytes(source.read_bytes() + b"\n# the next build\n")
    path.chmod(0o755)
    return path


# -- flows: how to bring a workflow to its crash points and where it must end ---------------


@dataclass(frozen=True)
class Flow:
    """One workflow under test, run on the host TARGET.

    drive:        what is done once the first crash agent is ready (None: that agent is
                  expected to die during its own recovery).
    end:          "awake" (serving, exactly one current), "asleep" (stopped, nothing left),
                  or "failed" (asleep after a failed wake that was proven).
    build, host:  the target's build (or a function making one) and host options
                  (drain_timeout, health_timeout).
    pre_awake:    the target is woken by a clean setup agent before the crash agent starts.
    setup_signal: how the setup agent ends (SIGKILL for adoption scenarios).
    target_fate:  the target's generation that served before the crash: "kept" (the
                  workflow was not ending it: same generation, same pid) or "ended" (dead).
    raised:       the target's parent limit is marked raised before the crash agent starts.
    attempt:      deploys: the expected (outcome, executed) of the one attempt; executed
                  None is not checked. The target then must serve the new build iff done.
    """

    name: str
    drive: Callable[[Vigil], None] | None
    end: str
    build: Path | Callable[[Vigil], Path] = HELLO
    host: dict[str, float] = field(default_factory=dict)
    pre_awake: bool = False
    setup_signal: int = signal.SIGTERM
    target_fate: str | None = None
    raised: bool = False
    attempt: tuple[str, bool | None] | None = None

    def but(self, **changes: Any) -> Flow:
        return dataclasses.replace(self, **changes)


def cli_wake(v: Vigil) -> None:
    v.run("wake", TARGET)


def cli_stop(v: Vigil) -> None:
    v.run("stop", TARGET)


def kill_leader(v: Vigil) -> None:
    pid = v.status(TARGET)["pid"]
    assert pid, "target is not awake"
    os.kill(pid, signal.SIGKILL)


def cli_deploy(mode: str, source: Path = HELLO, *extra: str) -> Callable[[Vigil], None]:
    def drive(v: Vigil) -> None:
        v.run("deploy", TARGET, str(new_build(v, source)), "--mode", mode, *extra)

    return drive


# double_fork leaves a grandchild in its own session that ignores SIGTERM: ending such a
# generation needs the SIGKILL of its containment (*.killed points are reached only then),
# and a leak shows as a stray process.
STUBBORN = FIXTURES / "double_fork.py"

WAKE = Flow("wake", cli_wake, end="awake")
FAILED_WAKE = Flow("failed-wake", cli_wake, end="failed", build=FIXTURES / "bad_health.py",
                   host={"health_timeout": 1.0})
STOP = Flow("stop", cli_stop, end="asleep", build=STUBBORN, host={"drain_timeout": 1.0},
            pre_awake=True, target_fate="ended")
MEMBER = Flow("member", kill_leader, end="awake", pre_awake=True, target_fate="ended")
ADOPT = Flow("adopt", None, end="awake", pre_awake=True, setup_signal=signal.SIGKILL,
             target_fate="kept")
_DEPLOY = dict(end="awake", build=STUBBORN, host={"drain_timeout": 1.0, "health_timeout": 2.0},
               pre_awake=True)
# overlap: before the switch the attempt is abandoned and the old generation keeps serving;
# at or after it, the attempt finishes and the old one is drained.
OVERLAP_ABANDONED = Flow("overlap", cli_deploy("overlap"), **_DEPLOY, target_fate="kept",
                         attempt=("abandoned", True))
OVERLAP_DONE = OVERLAP_ABANDONED.but(target_fate="ended", attempt=("done", True))
CANARY = OVERLAP_ABANDONED.but(drive=cli_deploy("overlap", HELLO, "--canary"))
OVERLAP_FAILED = OVERLAP_ABANDONED.but(drive=cli_deploy("overlap", FIXTURES / "bad_health.py"),
                                       attempt=("failed", True))
# hold: the old generation is stopped first; recovery always goes on to the new build.
HOLD = Flow("hold", cli_deploy("hold"), **_DEPLOY, target_fate="ended", attempt=("done", True))


@dataclass(frozen=True)
class Scenario:
    flow: Flow
    # Crash points hit in order by successive agents before the clean one; the first agent
    # is the one driven, the later ones reach their point during recovery. Empty: (name,).
    chain: tuple[str, ...] = ()


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
    # the last member out restores a raised parent limit (the box has no memory controller,
    # so the mark is set by hand: the restore then only clears it)
    "restore.done": Scenario(MEMBER.but(raised=True)),
    # adoption on start after the agent was SIGKILLed
    "recover.adopted": Scenario(ADOPT),
    # overlap deploy: abandoned before the switch (executed only once the spawn is written)
    "swap.admitted": Scenario(OVERLAP_ABANDONED.but(attempt=("abandoned", False))),
    "swap.raised": Scenario(OVERLAP_ABANDONED.but(attempt=("abandoned", False))),
    "swap.published": Scenario(OVERLAP_ABANDONED.but(attempt=("abandoned", False))),
    "swap.spawning": Scenario(OVERLAP_ABANDONED),
    "swap.execd": Scenario(OVERLAP_ABANDONED),
    "swap.spawned": Scenario(OVERLAP_ABANDONED),
    "swap.healthy": Scenario(OVERLAP_ABANDONED),
    "swap.settled": Scenario(CANARY),
    # ... finished at or after the switch
    "swap.switched": Scenario(OVERLAP_DONE),
    "swap.drain_termed": Scenario(OVERLAP_DONE),
    "swap.drain_killed": Scenario(OVERLAP_DONE),
    "swap.drained": Scenario(OVERLAP_DONE),
    # ... ended by the build's own failure (health 500)
    "swap.ended": Scenario(OVERLAP_FAILED),
    # hold deploy
    "swap.old_stopping": Scenario(HOLD),
    "swap.old_stopped": Scenario(HOLD),
    "swap.successor": Scenario(HOLD),
}

# The same points reached through another workflow (shared step names).
VARIANTS: dict[str, Scenario] = {
    "hold-swap.admitted": Scenario(HOLD, ("swap.admitted",)),
    "hold-swap.spawned": Scenario(HOLD, ("swap.spawned",)),
    "hold-swap.switched": Scenario(HOLD, ("swap.switched",)),
    "hold-swap.drain_killed": Scenario(HOLD, ("swap.drain_killed",)),
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
    ("swap.spawned", "swap.ended"),
    ("swap.switched", "swap.drain_killed"),
    ("swap.old_stopping", "swap.drain_killed"),
    ("swap.successor", "member.proven"),
]

# Scenarios run again with marker containment (no cgroup): the ones whose recovery must
# find processes the store has no pid for, or that escaped the leader's session.
MARKER_POINTS = ["wake.spawned", "wake.reaping", "stop.killed", "swap.execd"]


def registered() -> set[str]:
    import workflows.obligations  # noqa: F401  (imports every workflow, registering its points)
    import workflows.recovery  # noqa: F401
    from workflows import crash

    return set(crash.REGISTERED)


# -- the run --------------------------------------------------------------------------------

Snapshot = dict[str, tuple[int, int, float]]  # host -> (generation, pid, create_time)


def snapshot(v: Vigil) -> Snapshot:
    """The current generations whose leader still runs."""
    return {h: (g.id, g.pid, g.create_time) for h, g in currents(v).items()
            if g.pid is not None and same_process_alive(g.pid, g.create_time)}


def run_scenario(v: Vigil, flow: Flow, chain: tuple[str, ...]) -> None:
    t0 = time.monotonic()

    def phase(what: str) -> None:  # shown with the captured output of a failing test
        print(f"{time.monotonic() - t0:6.2f}s {what}")

    v.env["VIGIL_SETTLE_SECONDS"] = SETTLE
    build = flow.build(v) if callable(flow.build) else flow.build
    add_host(v, BYSTANDER, HELLO)
    add_host(v, TARGET, build, **flow.host)

    # Setup: a clean agent wakes what must be serving before the crash.
    setup, off = start(v)
    awake = [BYSTANDER, TARGET] if flow.pre_awake else [BYSTANDER]
    for h in awake:  # the intent `vigil wake` writes; the agent picks it up on start
        v.store.write(lambda s, h=h: request_wake(s, h))
    ready(v, setup, off)
    ring(v.state_dir)
    for h in awake:
        wait_for(lambda h=h: v.status(h)["state"] == "awake", 20, what=f"{h} awake")
    rc = v.stop_agent(setup, flow.setup_signal)
    assert rc == (-signal.SIGKILL if flow.setup_signal == signal.SIGKILL else 0), tail(v, off)
    before = snapshot(v)
    assert set(before) == set(awake), before
    if flow.raised:
        v.store.write(lambda s: s.execute(Host.__table__.update().where(Host.name == TARGET)
                                          .values(raised=True)))
    phase("setup done")

    # The crashes.
    for i, point in enumerate(chain):
        agent, off = start(v, crash_at=point)
        if i == 0 and ready_or_dead(v, agent, off, READY_BOUND) and flow.drive is not None:
            phase(f"agent ready with {point}; driving")
            flow.drive(v)
        expect_sigkill(v, agent, point, off)
        phase(f"agent died at {point}")
    at_crash = snapshot(v)

    # Recovery by a clean agent.
    agent, off = start(v)
    ready(v, agent, off)
    phase("clean agent ready")
    try:
        v.quiesce(20)
        phase("quiescent")
        check_invariants(v, flow, before, at_crash)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n--- agent log ---\n{tail(v)}") from None
    assert agent.poll() is None, "the clean agent died"
    phase("checked")


def check_invariants(v: Vigil, flow: Flow, before: Snapshot, at_crash: Snapshot) -> None:
    v.check()
    cur = currents(v)

    # A generation the workflow was not ending kept its generation and pid: what served
    # before the workflow started, and what served (alive) when the last agent died.
    # (A hold swap crashed right after its admission still has the old one current: the
    # workflow is ending it, as target_fate "ended" says.)
    kept = [(h, before[h]) for h in [BYSTANDER] + ([TARGET] if flow.target_fate == "kept" else [])]
    kept += [(h, snap) for h, snap in at_crash.items()
             if not (h == TARGET and flow.target_fate == "ended" and snap == before[TARGET])]
    for host, (gid, pid, ctime) in kept:
        now = f"g{cur[host].id} pid {cur[host].pid}" if host in cur else "nothing"
        assert host in cur and cur[host].id == gid and cur[host].pid == pid, (
            f"{host}: g{gid} pid {pid} was serving at the crash but now {now} is")
        assert same_process_alive(pid, ctime), f"{host}: pid {pid} is not the same live process"
    if flow.target_fate == "ended":
        gid, pid, ctime = before[TARGET]
        assert not same_process_alive(pid, ctime), f"{TARGET}: g{gid}'s pid {pid} still runs"

    # No process of this state dir outside the current generations: each one's leader, its
    # descendants, and what carries its marker (double_fork's grandchild is reparented).
    allowed: set[int] = set()
    for g in cur.values():
        assert g.pid is not None
        allowed.add(g.pid)
        try:
            allowed |= {c.pid for c in psutil.Process(g.pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            pass
    uuids = {g.uuid for g in cur.values()}
    stray = {pid for pid in app_pids(v) - allowed
             if env_of(pid).get("VIGIL_GENERATION") not in uuids}
    assert not stray, f"processes outside the current generations: {describe(stray)}"

    # Every other generation is proven, its recorded leader gone, its cgroup removed.
    for g in generations(v):
        if g.state is GenState.current:
            continue
        assert g.state is GenState.proven, f"g{g.id} of {g.host} is {g.state.value} at quiescence"
        if g.pid is not None:
            assert not same_process_alive(g.pid, g.create_time), f"g{g.id} pid {g.pid} runs"
        if g.cgroup:
            assert not os.path.exists(g.cgroup), f"g{g.id}: cgroup {g.cgroup} left behind"

    # Leases (check covers it; the store says so too): held iff a live generation needs one,
    # since nothing is open at quiescence. No parent limit stays raised with no member.
    assert not v.obligations()
    held = {lease.host for lease in rows(v, Lease)}
    live_hosts = {g.host for g in generations(v) if g.state in LIVE_GEN}
    assert held == live_hosts, f"leases held on {sorted(held)}, live generations on {sorted(live_hosts)}"
    assert not [h.name for h in rows(v, Host) if h.raised], "a parent limit is still marked raised"

    assert_serving(v, BYSTANDER)
    if flow.end == "awake":
        assert_serving(v, TARGET)
    else:
        st = v.status(TARGET)
        assert st["state"] == "asleep", st
        assert TARGET not in cur and not [g for g in generations(v, TARGET) if g.state in LIVE_GEN]
        left = [pid for pid in app_pids(v) if env_of(pid).get("VIGIL_HOST") == TARGET]
        assert not left, f"the target left processes: {describe(set(left))}"
        assert not os.path.lexists(v.state_dir / "run" / f"{TARGET}.sock"), "canonical link left"
        if flow.end == "asleep":
            assert st["desired"] == "down", st
        else:
            wakes = [w.state for w in rows(v, Wake, Wake.host == TARGET)]
            assert wakes and all(w is WakeState.failed for w in wakes), wakes
    if flow.attempt is not None:
        check_attempt(v, flow, cur[TARGET])


def check_attempt(v: Vigil, flow: Flow, current: Generation) -> None:
    assert flow.attempt is not None
    attempts = rows(v, Attempt, Attempt.host == TARGET)
    assert len(attempts) == 1, f"{len(attempts)} attempts"
    a = attempts[0]
    outcome, executed = flow.attempt
    assert a.outcome is not None and a.outcome.value == outcome, (
        f"attempt #{a.id} ended {a.outcome} ({a.reason}), expected {outcome}")
    if executed is not None:
        assert a.executed is executed, f"attempt #{a.id} executed={a.executed}, expected {executed}"
    host = rows(v, Host, Host.name == TARGET)[0]
    if outcome == "done":
        assert current.build_id == a.build_id == host.build_id, (
            f"serving build #{current.build_id}, deployed #{a.build_id}, host's #{host.build_id}")
        digest = rows(v, Build, Build.id == a.build_id)[0].digest
        reply = get(str(v.state_dir / "run" / f"{TARGET}.sock"))
        assert f"build={digest[:12]}".encode() in reply, reply[:200]
    else:
        assert current.build_id == host.build_id != a.build_id, (
            f"serving build #{current.build_id}, host's #{host.build_id}, attempt's #{a.build_id}")


def assert_serving(v: Vigil, host: str) -> None:
    """Awake, wanted up, exactly one current generation, the canonical link pointing at its
    socket and answering GET / from that very process."""
    st = v.status(host)
    assert st["state"] == "awake" and st["desired"] == "up", st
    gens = [g for g in generations(v, host) if g.state is GenState.current]
    assert len(gens) == 1, f"{host}: {len(gens)} current generations"
    g = gens[0]
    link = v.state_dir / "run" / f"{host}.sock"
    target = os.readlink(link) if os.path.lexists(link) else None
    assert target == g.socket, f"{host}: {link} -> {target}, not g{g.id}'s {g.socket}"
    reply = get(str(link))
    assert reply.startswith(b"HTTP/1.0 200") and f"pid={g.pid}".encode() in reply, reply[:200]


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
    for sc in VARIANTS.values():
        assert sc.chain and set(sc.chain) <= names, sc.chain
    for chain in PAIRS:
        assert set(chain) <= names and chain[0] in SCENARIOS, chain
    assert set(MARKER_POINTS) <= set(SCENARIOS)


def test_cli_lists_the_registered_crashpoints(vigil: Vigil) -> None:
    listed = set(vigil.run("crashpoints").stdout.split())
    assert listed == registered()


@pytest.mark.parametrize("point", sorted(SCENARIOS))
def test_crash_at(vigil: Vigil, point: str) -> None:
    sc = SCENARIOS[point]
    run_scenario(vigil, sc.flow, sc.chain or (point,))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_crash_variant(vigil: Vigil, variant: str) -> None:
    sc = VARIANTS[variant]
    run_scenario(vigil, sc.flow, sc.chain)


@pytest.mark.parametrize("chain", PAIRS, ids=["+".join(c) for c in PAIRS])
def test_double_crash(vigil: Vigil, chain: tuple[str, ...]) -> None:
    run_scenario(vigil, SCENARIOS[chain[0]].flow, chain)


@pytest.mark.parametrize("containment", ["marker"])
@pytest.mark.parametrize("point", MARKER_POINTS)
def test_crash_at_with_marker_containment(vigil: Vigil, point: str) -> None:
    sc = SCENARIOS[point]
    run_scenario(vigil, sc.flow, sc.chain or (point,))
