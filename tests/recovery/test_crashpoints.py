"""Recovery suite: every registered crash point, reached by a real agent.

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

Each scenario also runs as a double crash (`test_double_crash`): the agent recovering from
the first crash is itself SIGKILLed at the first crash point its recovery reaches, whichever
that is (VIGIL_CRASH_AT=*#k), then a clean agent recovers and the same invariants are checked.

Every test also carries a *bystander* host, woken before the crash and never touched by the
workflow under test: whatever happens, it must be adopted with the same pid.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import psutil
import pytest
from sqlalchemy import func, insert, select, update

from models.states import (
    LIVE_GEN,
    Cause,
    GenState,
    HostKind,
    Outcome,
    ReloadState,
    RolloutState,
    TryOutcome,
    WakeState,
)
from models.store import emit, utcnow
from models.tables import (
    Attempt,
    BoxLease,
    Build,
    Chore,
    Delivery,
    DeliveryTry,
    Event,
    Generation,
    HeldBuild,
    Host,
    JobRun,
    Lease,
    Reload,
    Rollout,
    Wake,
    Watchdog,
)
from runners.backend.cglimits import MB, parent_dir, v1_mounts
from runners.backend.files import stage_build
from runners.base.doorbell import ring
from runners.base.pids import CTIME_TOLERANCE
from tests.conftest import FIXTURES, HELLO, Vigil, marked_pids, schema_template, wait_for
from tests.listening import app_has, holder_inodes
from tests.reloadapps import breaks_on_reload, reloadable
from workflows.config import hosts
from workflows.engine.recovery import ADOPTED
from workflows.generations.listeners import Listen
from workflows.lifecycle.wake import request_wake

pytestmark = pytest.mark.timeout(90)

TARGET = "app"
BYSTANDER = "bystander"
# Bounds on polls (met long before on a quiet box): room for CI running two suites at once.
CRASH_BOUND = 30.0  # seconds for a crashing agent to reach its point and die
READY_BOUND = 30.0
SETTLE = "0.5"  # canary settle window (VIGIL_SETTLE_SECONDS) for every agent here
TIER_MB = 64  # the tier-* variants: a real parent limit (cgroup v1 memory on these boxes)
MEMORY = v1_mounts().get("memory")


# -- harness ------------------------------------------------------------------------------


@pytest.fixture
def vigil(short_tmp: Path, containment: str) -> Iterator[Vigil]:
    """conftest's `vigil`."""
    v = Vigil(short_tmp / "state", {"VIGIL_CONTAINMENT": containment}, template=schema_template())
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


def expect_sigkill(v: Vigil, p: subprocess.Popen[bytes], point: str, offset: int,
                   hint: str = "point not reached?") -> str:
    """Wait for the agent started with VIGIL_CRASH_AT=point to die there; returns the name
    of the point it died at (crash.py logs it just before the SIGKILL)."""
    try:
        rc = p.wait(CRASH_BOUND)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"agent with VIGIL_CRASH_AT={point} did not die within "
                             f"{CRASH_BOUND}s ({hint}):\n{tail(v, offset)}") from None
    assert rc == -signal.SIGKILL, (
        f"agent with VIGIL_CRASH_AT={point} exited {rc}, not by SIGKILL:\n{tail(v, offset)}")
    died = re.findall(rb"logger=vigil\.crash crash point=(\S+)", v.agent_log()[offset:])
    assert len(died) == 1, f"expected one crash line, found {died}:\n{tail(v, offset)}"
    name = died[0].decode()
    assert point.partition("#")[0] in (name, "*"), f"VIGIL_CRASH_AT={point} died at {name}"
    return name


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
        if create_time is not None and abs(p.create_time() - create_time) > CTIME_TOLERANCE:
            return False  # the pid was reused
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def app_pids(v: Vigil) -> set[int]:
    """Live processes of this state dir that are not an agent (apps and their children)."""
    return set(marked_pids(v.state_dir, v.db_url)) - {a.pid for a in v.agents}


def env_of(pid: int) -> dict[str, str]:
    try:
        return psutil.Process(pid).environ()
    except psutil.Error:
        return {}


def alive_pid(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


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


def add_host(v: Vigil, name: str, build: Path, kind: HostKind = HostKind.instance,
             args: tuple[str, ...] = (), policy: dict[str, Any] | None = None,
             listen: bool = False, after: tuple[str, ...] = (), **opts: float) -> None:
    """What `vigil host add` does, in-process (the setup is not under test; this saves a
    CLI start-up per host on a busy box). `listen`: on a unix listener vigil holds, its
    readiness still GET / on its own socket (hello serves both)."""
    path, digest = stage_build(str(build), v.state_dir)
    listens = [Listen("http", f"unix:{listener_path(v)}")] if listen else []
    v.store.write(lambda s: hosts.add_host(
        s, name, kind=kind, build_path=path, digest=digest, source=str(build),
        args=list(args), env={}, cwd=None, drain_timeout=opts.get("drain_timeout", 10.0),
        health_timeout=opts.get("health_timeout", 10.0), policy=policy, listeners=listens,
        ready="http" if listen else None, after=list(after),
        probe={"watchdog": opts["watchdog"]} if "watchdog" in opts else None,
        memory_tier_mb=int(opts["memory_tier_mb"]) if "memory_tier_mb" in opts else None))


def listener_path(v: Vigil) -> Path:
    return v.state_dir.parent / "app-listen.sock"


def new_build(v: Vigil, source: Path = HELLO) -> Path:
    """A copy of `source` with other bytes: another digest, so another build (hello reports
    the sha256 of its own file as build=<12 hex> in every answer)."""
    path = v.state_dir.parent / f"next-{source.name}"
    path.write_bytes(source.read_bytes() + b"\n# the next build\n")
    path.chmod(0o755)
    return path


# -- flows: how to bring a workflow to its crash points and where it must end ---------------

JOB = FIXTURES / "job.py"  # a worker that runs argv[1] seconds and exits argv[2]
WORKER = FIXTURES / "worker.py"  # a worker that runs until SIGTERM


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
                  workflow was not ending it: same generation, same pid) or "ended" (dead);
                  "runs": a job's, current only until its run exits by itself.
    raised:       the target's parent limit is marked raised before the crash agent starts.
    attempt:      deploys: the expected (outcome, executed) of the one attempt; executed
                  None is not checked. The target then must serve the new build iff done.
    resumed:      deploys interrupted before the switch: the attempt above was abandoned
                  and written again (cause resumed, each naming the one it replaces, maybe
                  more than once); the expected (outcome, executed) of the last of them,
                  which then decides the build the target serves.
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
    resumed: tuple[str, bool | None] | None = None
    # Workers: the kind, its args and policy (workflows/lifecycle/workers.py), the settle window,
    # a step run after the crashes and before the clean agent, and which build the target
    # must run at the end ("live": the host's build; "first": the one it was added with).
    kind: HostKind = HostKind.instance
    args: tuple[str, ...] = ()
    policy: dict[str, Any] = field(default_factory=dict)
    settle: str = SETTLE
    between: Callable[[Vigil], None] | None = None
    on_build: str | None = None
    until: Callable[[Vigil], bool] | None = None  # what the clean agent does without an obligation
    listen: bool = False  # the target is on a listener vigil holds (workflows/generations/listeners.py)
    verify: Callable[[Vigil], None] | None = None  # more invariants of this workflow, checked last
    after: tuple[str, ...] = ()  # hosts (asleep, hello) the target starts after

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


def orphan_target(v: Vigil) -> None:
    """Hand the target's lease to a box that is gone (expired a minute ago) and place the
    target on that box and on this one: this agent's next sweep takes it over."""
    me = (v.state_dir / "agent-id").read_text().strip()
    past = utcnow() - timedelta(seconds=60)

    def step(s):  # type: ignore[no-untyped-def]
        s.execute(update(Host).where(Host.name == TARGET).values(box=f"gone,{me}"))
        s.execute(update(Lease).where(Lease.host == TARGET).values(holder="gone", epoch=7))
        s.execute(insert(BoxLease).values(box="gone", epoch=7, expires_at=past))

    v.store.write(step)


def expire_box_lease(v: Vigil) -> None:
    """This box's lease expired a minute ago (its agent was away, say): its next renewal
    takes it anew at the next epoch and adopts the host leases nobody took meanwhile."""
    me = (v.state_dir / "agent-id").read_text().strip()
    v.store.write(lambda s: s.execute(update(BoxLease).where(BoxLease.box == me).values(
        expires_at=utcnow() - timedelta(seconds=60))))


# double_fork leaves a grandchild in its own session that ignores SIGTERM: ending such a
# generation needs the SIGKILL of its containment (*.killed points are reached only then),
# and a leak shows as a stray process.
STUBBORN = FIXTURES / "double_fork.py"

WAKE = Flow("wake", cli_wake, end="awake")
FAILED_WAKE = Flow("failed-wake", cli_wake, end="failed", build=FIXTURES / "bad_health.py",
                   host={"health_timeout": 1.0})
STOP = Flow("stop", cli_stop, end="asleep", build=STUBBORN, host={"drain_timeout": 1.0},
            pre_awake=True, target_fate="ended")
# A drain past the drive's hold (workflows/ending.HOLD, 2 s): the stop gives its slot back.
# 6 s, not 3.5: a drive that starts late on a loaded box (CI: 1.5 s after the SIGTERM) has
# no more than the hold left, waits it out and never reaches the point.
LONG_STOP = Flow("long-stop", cli_stop, end="asleep", build=FIXTURES / "serve_ignore_term.py",
                 host={"drain_timeout": 6.0}, pre_awake=True, target_fate="ended")
MEMBER = Flow("member", kill_leader, end="awake", pre_awake=True, target_fate="ended")
ADOPT = Flow("adopt", None, end="awake", pre_awake=True, setup_signal=signal.SIGKILL,
             target_fate="kept")
_DEPLOY = dict(end="awake", build=STUBBORN, host={"drain_timeout": 1.0, "health_timeout": 2.0},
               pre_awake=True)
# overlap: before the switch the attempt is abandoned (its successor killed, the old
# generation serving on) and the same request is written again, which the clean agent
# runs to its end: the old one is drained, the host serves the new build. At or after the
# switch, the attempt itself finishes.
OVERLAP_ABANDONED = Flow("overlap", cli_deploy("overlap"), **_DEPLOY, target_fate="kept",
                         attempt=("abandoned", True))
OVERLAP_RESUMED = OVERLAP_ABANDONED.but(target_fate="ended", resumed=("done", True))
OVERLAP_DONE = OVERLAP_ABANDONED.but(target_fate="ended", attempt=("done", True))
CANARY = OVERLAP_RESUMED.but(drive=cli_deploy("overlap", HELLO, "--canary"))
OVERLAP_FAILED = OVERLAP_ABANDONED.but(drive=cli_deploy("overlap", FIXTURES / "bad_health.py"),
                                       attempt=("failed", True))
# hold: the old generation is stopped first; recovery always goes on to the new build.
HOLD = Flow("hold", cli_deploy("hold"), **_DEPLOY, target_fate="ended", attempt=("done", True))
# takeover: the old owner's generation is ended (on this one machine the new owner's kill
# reaches it too) and a fresh wake serves the host from this box.
TAKEOVER = Flow("takeover", orphan_target, end="awake", pre_awake=True, target_fate="ended")


# Workers (workflows/lifecycle/workers.py).
def cli_converge(v: Vigil) -> None:
    v.run("deploy", TARGET, str(new_build(v, WORKER)), "--converge")


def set_max_run(seconds: float | None) -> Callable[[Vigil], None]:
    """The host's max-run, set in the store (no CLI edits a host yet): the next sweep
    recycles a worker up for longer; cleared again before the clean agent starts."""
    def step(v: Vigil) -> None:
        v.store.write(lambda s: s.execute(Host.__table__.update().where(Host.name == TARGET)
                                          .values(max_run=seconds)))

    return step


def crash_then_release(v: Vigil) -> None:
    """The worker crashes, its restart waits out a long backoff, and a release is queued:
    the restart gives way to the release attempt."""
    v.run("wake", TARGET)
    wait_for(lambda: rows(v, Event, Event.host == TARGET, Event.kind == "restart_scheduled"),
             20, what="the crash's restart")
    v.run("deploy", TARGET, str(new_build(v, WORKER)))


def converged(v: Vigil) -> bool:
    """The target runs its live build (a converge is paced, not an obligation)."""
    live = rows(v, Host, Host.name == TARGET)[0].build_id
    return any(g.build_id == live for g in generations(v, TARGET) if g.state is GenState.current)


_WORKER = dict(kind=HostKind.worker, build=WORKER, host={"drain_timeout": 1.0})
CONVERGE = Flow("converge", cli_converge, end="awake", pre_awake=True, target_fate="ended",
                policy={"converge_grace": 1.0}, on_build="live", until=converged, **_WORKER)
RECYCLE = Flow("recycle", set_max_run(0.5), end="awake", pre_awake=True, target_fate="ended",
               between=set_max_run(None), on_build="first", **_WORKER)
# The watchdog (workflows/lifecycle/watchdog.py): the pinger sends WATCHDOG=trigger (on
# SIGUSR1); fired, it is SIGABRTed, retired and restarted; its successor pings on.
PINGER = FIXTURES / "pinger.py"


def trigger_watchdog(v: Vigil) -> None:
    pid = v.status(TARGET)["pid"]
    assert pid, "target is not awake"
    os.kill(pid, signal.SIGUSR1)


def watchdog_fired(v: Vigil) -> None:
    (fired,) = rows(v, Event, Event.host == TARGET, Event.kind == "watchdog")
    assert fired.generation_id == generations(v, TARGET)[0].id
    assert not rows(v, Watchdog, Watchdog.fired_at.is_not(None)), "a fire left unfinished"


WATCHDOG = Flow("watchdog", trigger_watchdog, end="awake", pre_awake=True, target_fate="ended",
                kind=HostKind.worker, build=PINGER, policy={"restart_floor": 0.1},
                host={"drain_timeout": 1.0, "watchdog": 2.0}, verify=watchdog_fired)
COALESCE = Flow("coalesce", crash_then_release, end="awake", kind=HostKind.worker, build=JOB,
                args=("0.3", "1"), policy={"restart_floor": 30.0}, on_build="live",
                attempt=("done", False))
_ONE_SHOT = dict(kind=HostKind.worker, build=JOB, args=("0", "0"), policy={"one_shot": True},
                 settle="10")
ONE_SHOT_WAKE = Flow("one-shot-wake", cli_wake, end="ran", **_ONE_SHOT)
ONE_SHOT_DEPLOY = Flow("one-shot-deploy", cli_deploy("hold", JOB), end="ran",
                       attempt=("done", True), **_ONE_SHOT)


# Jobs (workflows/lifecycle/jobs.py): the target made a job in the store and enabled so that
# an instant is due at once (every day, enabled just before the last midnight: that midnight
# is due), or (skip) every second with runs of 3 s; disabled before the clean agent, which
# only finishes what is open.
def enable_job(every: float, since: timedelta) -> Callable[[Vigil], None]:
    def drive(v: Vigil) -> None:
        now = utcnow()
        start = (now.replace(hour=0, minute=0, second=0, microsecond=0) - timedelta(seconds=1)
                 if every >= 86400 else now - since)
        v.store.write(lambda s: s.execute(update(Host).where(Host.name == TARGET).values(
            every=every, runs_from=start, desired="up")))
        ring(v.state_dir)

    return drive


def disable_job(v: Vigil) -> None:
    v.store.write(lambda s: s.execute(update(Host).where(Host.name == TARGET).values(
        desired="down")))


def runs_once(v: Vigil) -> None:
    """Every run ended, none started twice: one generation at most per run, and every
    generation of the job is a run's, but a start proven never exec'd (no pid; its exec
    claim voided), whose run was started again; no claim is left once all are proven."""
    runs = rows(v, JobRun, JobRun.host == TARGET)
    assert runs and all(r.state.value in ("done", "failed", "skipped", "interrupted", "missed")
                        for r in runs), runs
    gens = {g.id: g for g in generations(v, TARGET)}
    named = [r.generation_id for r in runs if r.generation_id is not None]
    assert len(set(named)) == len(named) and set(named) <= set(gens), (named, gens)
    for g in set(gens) - set(named):
        assert gens[g].pid is None and "never exec'd" in (gens[g].end_reason or ""), gens[g]
    claims = v.state_dir / "claims"
    assert not claims.exists() or not list(claims.iterdir()), list(claims.iterdir())


def ran_again(v: Vigil) -> None:
    """The start interrupted before its exec: its run started again and done, once."""
    runs_once(v)
    (run,) = rows(v, JobRun, JobRun.host == TARGET)
    assert run.state.value == "done" and run.exit_status == 0, run.reason
    assert len(generations(v, TARGET)) == 2  # the voided start's (runs_once) and the run's


def claim_taken(v: Vigil) -> None:
    """The start interrupted after its exec: recorded with its evidence, not run again."""
    runs_once(v)
    (run,) = rows(v, JobRun, JobRun.host == TARGET)
    assert run.state.value == "interrupted" and "claim was taken" in (run.reason or ""), run.reason


_JOB = dict(kind=HostKind.worker, build=JOB, between=disable_job, verify=runs_once, end="asleep",
            target_fate="runs")
JOB_RUN = Flow("job-run", enable_job(86400.0, timedelta(0)), args=("3", "0"), **_JOB)  # type: ignore[arg-type]
JOB_SKIP = Flow("job-skip", enable_job(1.0, timedelta(seconds=0.5)), args=("3", "0"), **_JOB)  # type: ignore[arg-type]


def missed_once(v: Vigil) -> None:
    """Enabled 10 s before its agent's first turn (catch-up one): the instants before the
    last are one row, missed, written once; the last one ran (or was cut) once."""
    runs_once(v)
    runs = rows(v, JobRun, JobRun.host == TARGET)
    (missed,) = [r for r in runs if r.state.value == "missed"]
    assert "missed" in (missed.reason or "") and missed.wake_id is None, missed.reason
    assert all(r.scheduled_at > missed.scheduled_at for r in runs if r is not missed), runs


# every second, enabled 10 s ago: the first turn writes the missed instants' row, then the run
JOB_MISSED = Flow("job-missed", enable_job(1.0, timedelta(seconds=10)), args=("3", "0"),
                  **{**_JOB, "verify": missed_once})  # type: ignore[arg-type]


# A job run's --timeout and --retries (workflows/lifecycle/runpolicy.py): JOB_RUN's instant
# due at once, with the run policy's columns written first.
def enable_policy_job(**columns: float) -> Callable[[Vigil], None]:
    def drive(v: Vigil) -> None:
        v.store.write(lambda s: s.execute(update(Host).where(Host.name == TARGET).values(**columns)))
        enable_job(86400.0, timedelta(0))(v)

    return drive


def timed_out(v: Vigil) -> None:
    """The run of 600 s ended by its --timeout 1, once, its generation proven (checked by
    the harness: no process of it left); never retried."""
    (run,) = rows(v, JobRun, JobRun.host == TARGET)
    assert run.state.value == "failed" and "timeout" in (run.reason or ""), run.reason
    assert run.tries == 0 and [g.id for g in generations(v, TARGET)] == [run.generation_id]


def retried_once(v: Vigil) -> None:
    """Its first try exited 1 and was started again once, same row (tries 1): the second
    try failed too (two generations), or was interrupted by a second crash before its pid."""
    (run,) = rows(v, JobRun, JobRun.host == TARGET)
    every = generations(v, TARGET)
    assert all(g.state is GenState.proven for g in every), every
    gens = [g for g in every if g.pid is not None]  # a start never exec'd is started again
    assert run.tries == 1 and run.state.value in ("failed", "interrupted"), (run.state, run.reason)
    assert len(gens) <= 2, [(g.id, g.pid, g.end_reason) for g in every]
    if run.state.value == "failed":
        assert run.exit_status in (1, None) and len(gens) == 2, (run.exit_status, run.reason, gens)


JOB_TIMEOUT = JOB_RUN.but(name="job-timeout", drive=enable_policy_job(run_timeout=1.0),
                          args=("600", "0"), host={"drain_timeout": 1.0}, verify=timed_out)
JOB_RETRY = JOB_RUN.but(name="job-retry", drive=enable_policy_job(run_retries=1),
                        args=("0", "1"), policy={"restart_floor": 0.1}, verify=retried_once)


# Overlap policies (workflows/lifecycle/job_overlap.py): JOB_SKIP's runs of 3 s every second,
# the policy written first. queue: the next instant waits queued, made due when the run ends;
# replace: it waits while the run is stopped by the stop path (stop written, then proven).
def enable_overlap_job(policy: str) -> Callable[[Vigil], None]:
    def drive(v: Vigil) -> None:
        v.store.write(lambda s: s.execute(update(Host).where(Host.name == TARGET).values(
            overlap=policy)))
        enable_job(1.0, timedelta(seconds=0.5))(v)

    return drive


JOB_QUEUE = JOB_SKIP.but(name="job-queue", drive=enable_overlap_job("queue"))
JOB_REPLACE = JOB_SKIP.but(name="job-replace", drive=enable_overlap_job("replace"),
                           host={"drain_timeout": 1.0})

LISTEN_WAKE = WAKE.but(name="listen-wake", listen=True)


# Start order (workflows/lifecycle/order.py): the target starts after DEP, which is asleep
# when the target's wake is asked for; the wake waits (its row says on what), then DEP is
# woken and the target starts once DEP is ready.
DEP = "dep"


def wake_dep(v: Vigil) -> None:
    v.store.write(lambda s: request_wake(s, DEP))


def started_after_dep(v: Vigil) -> None:
    assert_serving(v, DEP)
    (ready,) = rows(v, Event, Event.host == DEP, Event.kind == "woke")
    gen = currents(v)[TARGET]
    assert gen.created_at >= ready.at, f"g{gen.id} of {TARGET} written before {DEP} was ready"
    assert rows(v, Event, Event.host == TARGET, Event.kind == "wake_waiting"), "it never waited"


WAITING_WAKE = WAKE.but(name="waiting-wake", after=(DEP,), between=wake_dep,
                        verify=started_after_dep)


# Rollouts (workflows/rollouts/driver.py) of the target alone: a good build (done), a build whose
# health fails (halted; the old generation keeps serving, the build is held down there), and
# a hold rollout of that build with --auto-revert (the host went down; the revert wakes it on
# the build it ran before).
def cli_rollout(source: Path, *extra: str) -> Callable[[Vigil], None]:
    def drive(v: Vigil) -> None:
        v.run("rollout", "start", str(new_build(v, source)), "--host", TARGET, *extra)

    return drive


def rollout_ended(outcome: str, serving: str) -> Callable[[Vigil], None]:
    """The rollout ended once, with `outcome`; the target was moved (done) by one attempt
    at most; it serves the rollout's build ("new") or the one it ran before ("old")."""
    def verify(v: Vigil) -> None:
        (r,) = rows(v, Rollout)
        assert r.state is RolloutState.ended and r.outcome is not None, (r.state, r.reason)
        assert r.outcome.value == outcome, f"rollout ended {r.outcome.value}: {r.reason}"
        assert len(rows(v, Event, Event.kind == "rollout_ended")) == 1, "the rollout ended twice"
        ours = rows(v, Attempt, Attempt.host == TARGET, Attempt.cause == Cause.rollout)
        moved = [a for a in ours if a.build_id == r.build_id and a.outcome is Outcome.done]
        assert len(moved) == (1 if serving == "new" else 0), [(a.id, a.outcome) for a in ours]
        assert not [a for a in ours if a.outcome is None], "a rollout attempt is still open"
        current = currents(v)[TARGET]
        first = generations(v, TARGET)[0].build_id
        assert current.build_id == (r.build_id if serving == "new" else first), (
            f"serving build #{current.build_id}, rollout's #{r.build_id}, first #{first}")
        if outcome in ("halted", "reverted"):
            assert rows(v, HeldBuild, HeldBuild.host == TARGET, HeldBuild.build_id == r.build_id), \
                "the failed build is not held down on the target"

    return verify


ROLLOUT = Flow("rollout", cli_rollout(HELLO), end="awake", pre_awake=True, target_fate="ended",
               verify=rollout_ended("done", "new"))
ROLLOUT_HALT = Flow("rollout-halt", cli_rollout(FIXTURES / "bad_health.py"), end="awake",
                    pre_awake=True, target_fate="kept", host={"health_timeout": 2.0},
                    verify=rollout_ended("halted", "old"))
ROLLOUT_REVERT = Flow("rollout-revert", cli_rollout(FIXTURES / "bad_health.py", "--mode", "hold",
                                                    "--auto-revert"),
                      end="awake", pre_awake=True, target_fate="ended", host={"health_timeout": 2.0},
                      verify=rollout_ended("reverted", "old"))


@dataclass(frozen=True)
class Scenario:
    flow: Flow
    # Crash points hit in order by successive agents before the clean one; the first agent
    # is the one driven, the later ones reach their point during recovery. Empty: (name,).
    chain: tuple[str, ...] = ()


# Notifications (workflows/notices/deliver.py): two events owed to a notifier whose command
# appends each event's id to a file; the agent dies at a step of a delivery. Each event
# reaches the receiver at least once, never zero: a try cut short is sent again.
NOTIFY_EVENTS = (("down", TARGET), ("rollout_halted", None))


def receiver(v: Vigil) -> tuple[Path, Path]:
    """The receiver script (written once per box) and the file it appends event ids to."""
    script, got = v.state_dir.parent / "receiver.py", v.state_dir.parent / "received"
    if not script.exists():
        script.write_text("import json, sys\n"
                          "event = json.load(sys.stdin)\n"
                          f"with open({str(got)!r}, 'a') as f:\n"
                          "    f.write(f\"{event['id']}\\n\")\n")
    return script, got


def owe_notifications(v: Vigil) -> None:
    script, _ = receiver(v)
    v.run("notify", "add", "pager", "--on", "down,rollout_halted", "--exec",
          f"{sys.executable} {script}")
    for kind, host in NOTIFY_EVENTS:
        v.store.write(lambda s, kind=kind, host=host: emit(s, kind, host, None, reason="test"))
    ring(v.state_dir)  # as a command that wrote an intent does


def each_event_received(v: Vigil) -> None:
    _, got = receiver(v)
    counts = Counter(int(line) for line in got.read_text().split())
    owed = rows(v, Delivery)
    assert len(owed) == len(NOTIFY_EVENTS), owed
    for d in owed:
        assert counts[d.event_id] >= 1, f"event {d.event_id} never reached the receiver: {counts}"
        assert d.delivered_at is not None, f"delivery #{d.id} not marked delivered"
    tries = rows(v, DeliveryTry)
    assert all(t.outcome is not None for t in tries), [(t.id, t.outcome) for t in tries]
    cut = [t for t in tries if t.outcome is TryOutcome.interrupted]
    if b"crash point=notify.sent" in v.agent_log():  # it ran, and was sent again
        assert cut and max(counts.values()) >= 2, (counts, cut)
    if b"crash point=notify.begun" in v.agent_log():
        assert cut, "the try cut short before its command ran is not closed as interrupted"


NOTIFY = Flow("notify", owe_notifications, end="awake", pre_awake=True, target_fate="kept",
              verify=each_event_received)


# The store-wide chores (workflows/leases/chores.py): the setup agent let them go at its
# stop, the crash agent dies right after taking them; the next agent (the same box) holds
# them as they were, runs them, and the target app was never touched.
def chores_held(v: Vigil) -> None:
    (row,) = rows(v, Chore)
    box = (v.state_dir / "agent-id").read_text().strip()
    assert row.holder == box and row.epoch >= 2, (row.holder, row.epoch)
    assert b"crash point=chores.taken" in v.agent_log()
    assert v.agent_log().count(b"runs the store-wide chores") >= 2  # setup, and after the crash


# The box lease (workflows/leases/box.py): it expired under a running agent, whose next
# renewal takes it at a new epoch and adopts its hosts; the agent dies right after that
# commits. The next agent finds its box lease live at that epoch and its apps untouched.
def box_lease_retaken(v: Vigil) -> None:
    box = (v.state_dir / "agent-id").read_text().strip()
    (row,) = rows(v, BoxLease, BoxLease.box == box)
    assert row.epoch >= 2, row.epoch
    assert b"crash point=boxlease.taken" in v.agent_log()
    assert {lease.epoch for lease in rows(v, Lease)} == {row.epoch}


BOX_LEASE = Flow("box-lease", expire_box_lease, end="awake", pre_awake=True, target_fate="kept",
                 verify=box_lease_retaken)


CHORES = Flow("chores", None, end="awake", pre_awake=True, target_fate="kept",
              verify=chores_held)


# Reloads (workflows/deploys/reload.py): the target reloads in place on SIGHUP (its readiness
# probed again) and keeps its generation; one whose reload breaks it (it answers 500 from
# then on) is answered by an overlap restart of the same build, which serves.
def cli_reload(v: Vigil) -> None:
    v.run("reload", TARGET)


def reload_ended(state: ReloadState, answered: bool) -> Callable[[Vigil], None]:
    def verify(v: Vigil) -> None:
        (r,) = rows(v, Reload)
        assert r.state is state, (r.state, r.reason, r.last_error)
        assert (r.attempt_id is not None) == answered, r.attempt_id
        if answered:
            (a,) = rows(v, Attempt, Attempt.id == r.attempt_id)
            assert a.outcome is Outcome.done and a.cause is Cause.restart, (a.outcome, a.reason)
            assert currents(v)[TARGET].build_id == a.build_id == generations(v, TARGET)[0].build_id

    return verify


RELOAD = Flow("reload", cli_reload, end="awake", pre_awake=True, target_fate="kept",
              build=lambda v: reloadable(v.state_dir.parent),
              verify=reload_ended(ReloadState.done, False))
RELOAD_FAILED = Flow("reload-failed", cli_reload, end="awake", pre_awake=True,
                     target_fate="ended", build=lambda v: breaks_on_reload(v.state_dir.parent),
                     host={"health_timeout": 2.0},
                     verify=reload_ended(ReloadState.failed, True))


SCENARIOS: dict[str, Scenario] = {
    # a reload in place, and one not back ready (answered by a restart)
    "reload.intent": Scenario(RELOAD),
    "reload.sent": Scenario(RELOAD),
    "reload.ended": Scenario(RELOAD_FAILED),
    # wake of a good host
    "wake.leased": Scenario(WAKE),
    "wake.intent": Scenario(WAKE),
    "wake.spawned": Scenario(WAKE),
    "wake.recorded": Scenario(WAKE),
    "wake.current": Scenario(WAKE),
    # a wake held back by the start order, its row saying what it waits on
    "wake.waiting": Scenario(WAITING_WAKE),
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
    "obligation.waiting": Scenario(LONG_STOP),
    "release.done": Scenario(STOP),
    # the app's leader dies while the agent runs
    "member.exited": Scenario(MEMBER),
    "member.proven": Scenario(MEMBER),
    # the last member out restores a raised parent limit (the box has no memory controller,
    # so the mark is set by hand: the restore then only clears it)
    "restore.done": Scenario(MEMBER.but(raised=True)),
    # adoption on start after the agent was SIGKILLed
    "recover.adopted": Scenario(ADOPT),
    "takeover.done": Scenario(TAKEOVER),
    # overlap deploy: abandoned before the switch (executed only once the spawn is written),
    # then resumed by a new attempt that is done
    "swap.admitted": Scenario(OVERLAP_RESUMED.but(attempt=("abandoned", False))),
    "swap.raised": Scenario(OVERLAP_RESUMED.but(attempt=("abandoned", False))),
    "swap.published": Scenario(OVERLAP_RESUMED.but(attempt=("abandoned", False))),
    "swap.spawning": Scenario(OVERLAP_RESUMED),
    "swap.execd": Scenario(OVERLAP_RESUMED),
    "swap.spawned": Scenario(OVERLAP_RESUMED),
    # Without a canary, "healthy" is written in the switch's commit: a crash there is past it.
    "swap.healthy": Scenario(OVERLAP_DONE),
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
    # workers: drift noted, converged after the grace, recycled at max-run onto the
    # captured build, a restart coalesced with a queued release, one-shot runs
    "worker.drift": Scenario(CONVERGE),
    "worker.converging": Scenario(CONVERGE),
    "worker.recycling": Scenario(RECYCLE),
    "worker.coalesced": Scenario(COALESCE),
    "oneshot.clean_exit": Scenario(ONE_SHOT_WAKE),
    # a watchdog fired (WATCHDOG=trigger): its intent, then SIGABRT and the restart
    "watchdog.firing": Scenario(WATCHDOG),
    "watchdog.retired": Scenario(WATCHDOG),
    "oneshot.done": Scenario(ONE_SHOT_DEPLOY),
    # a job's run: its row and wake written, started, skipped while one runs; a run whose
    # agent died before its pid was written is reaped and recorded interrupted, never rerun
    "job.due": Scenario(JOB_RUN),
    "job.started": Scenario(JOB_RUN),
    "job.skipped": Scenario(JOB_SKIP),
    # overlap queue: the next instant queued, then made due once the run ended; replace:
    # the stop of the run it replaces written (then the stop path's own points)
    "job.queued": Scenario(JOB_QUEUE),
    "job.dequeued": Scenario(JOB_QUEUE),
    "job.replacing": Scenario(JOB_REPLACE),
    "job.missed": Scenario(JOB_MISSED),  # catch-up (workflows/lifecycle/catchup.py)
    "job.ended": Scenario(JOB_RUN, ("wake.spawned", "job.ended")),
    # a run past its --timeout (ended by the stop path), and a failed try started again
    "job.timeout": Scenario(JOB_TIMEOUT),
    "job.retried": Scenario(JOB_RETRY),
    # ... a start interrupted before its exec (the claim voided: the run started again,
    # once) or after it (the claim taken by its shim: recorded interrupted, not rerun)
    "job.evidence": Scenario(JOB_RUN, ("wake.intent", "job.evidence")),
    # the first wake of a host on a listener: the socket is opened and handed to the holder
    "listen.opening": Scenario(LISTEN_WAKE),
    "listen.bound": Scenario(LISTEN_WAKE),
    "listen.handed": Scenario(LISTEN_WAKE),
    "listen.held": Scenario(LISTEN_WAKE),
    # ... and the next agent finds it with the holder, not yet written held
    "listen.recovered": Scenario(LISTEN_WAKE, ("listen.handed", "listen.recovered")),
    # rollouts: a wave admitted and settled, its end; an attempt interrupted mid-swap written
    # again by the next agent; a halt on the build's failure, and the revert after it
    "rollout.wave_admitted": Scenario(ROLLOUT),
    "rollout.wave_settled": Scenario(ROLLOUT),
    "rollout.ended": Scenario(ROLLOUT),
    "rollout.reissued": Scenario(ROLLOUT, ("swap.spawned", "rollout.reissued")),
    "rollout.halted": Scenario(ROLLOUT_HALT),
    "rollout.revert_started": Scenario(ROLLOUT_REVERT),
    "rollout.revert_settled": Scenario(ROLLOUT_REVERT),
    # a delivery to a notifier's command
    "chores.taken": Scenario(CHORES),
    "boxlease.taken": Scenario(BOX_LEASE),
    "notify.begun": Scenario(NOTIFY),
    "notify.sent": Scenario(NOTIFY),
    "notify.recorded": Scenario(NOTIFY),
}

# The same points reached through another workflow (shared step names).
def tier_limit(v: Vigil) -> Path:
    box = (v.state_dir / "agent-id").read_text().strip()
    return Path(parent_dir(MEMORY or "", box, TARGET)) / "memory.limit_in_bytes"


def at_tier(v: Vigil) -> None:
    """The target's parent is back at its tier, and its current generation inside it."""
    assert int(tier_limit(v).read_text()) == TIER_MB * MB, tier_limit(v).read_text()
    g = [g for g in generations(v, TARGET) if g.state is GenState.current][0]
    cgroups = Path(f"/proc/{g.pid}/cgroup").read_text()
    assert f"/vigil/hosts/{tier_limit(v).parent.parent.name}/{TARGET}/{g.uuid}\n" in cgroups, \
        cgroups


VARIANTS: dict[str, Scenario] = {
    "hold-swap.admitted": Scenario(HOLD, ("swap.admitted",)),
    "hold-swap.spawned": Scenario(HOLD, ("swap.spawned",)),
    "hold-swap.switched": Scenario(HOLD, ("swap.switched",)),
    "hold-swap.drain_killed": Scenario(HOLD, ("swap.drain_killed",)),
    # a worker whose agent died is adopted (pid and create_time match); a worker's pending
    # generation with no process is proven and dropped, and the start retried
    "worker-recover.adopted": Scenario(ADOPT.but(kind=HostKind.worker, build=WORKER),
                                       ("recover.adopted",)),
    "worker-wake.intent": Scenario(WAKE.but(kind=HostKind.worker, build=WORKER), ("wake.intent",)),
    # a job's run interrupted before its exec: started again (same row), once
    "job-wake.intent": Scenario(JOB_RUN.but(verify=ran_again), ("wake.intent",)),
    "job-wake.spawned": Scenario(JOB_RUN.but(verify=claim_taken), ("wake.spawned", "job.evidence")),
    # the parent limit on a real memory controller (v1 here): raised, then restored
    "tier-swap.raised": Scenario(OVERLAP_RESUMED.but(
        host={**_DEPLOY["host"], "memory_tier_mb": TIER_MB}, verify=at_tier,  # type: ignore[dict-item]
        attempt=("abandoned", False)), ("swap.raised",)),
    "tier-restore.done": Scenario(MEMBER.but(raised=True, host={"memory_tier_mb": TIER_MB},
                                             verify=at_tier), ("restore.done",)),
}

# Double crashes: every scenario is run again with its recovering agent crashed a second
# time, at the first crash point its recovery reaches (VIGIL_CRASH_AT=*#k, k-th point of any
# name) once it has passed the adoptions on start, which every recovery does first and which
# would otherwise always be the first point (the bystander is adopted in every scenario).
# Points whose recovery is adoption alone (nothing past it is left to do) are crashed at the
# first adoption instead, and the clean agent after them is armed past its adoptions: it
# must reach nothing, which proves the entry here right.
ADOPTION_ONLY = {
    "boxlease.taken",  # the hosts were adopted at the new epoch; the next agent renews it
    "chores.taken",  # the app was only adopted; the restarted agent renews its own chores
    "recover.adopted",  # adoption was what it was doing
    "wake.current",  # the wake is done but for the link, which adoption repoints
    "swap.drained",  # the attempt is done
    "release.done",  # the lease is given back
    "rollout.ended",  # the rollout and its attempt are done
    "job.missed",  # a missed row is final, owes nothing; the job is disabled before recovery
}

ADOPTION_WRONG = ": its point is in ADOPTION_ONLY, but recovery reaches a point past adoption"

DOUBLE = sorted(SCENARIOS)  # every point is double-crashed (asserted below)
# VIGIL_LONG=1 also crashes the recovering agent deeper: at its 2nd and 3rd point past the
# adoptions (skipped, saying so, where the recovery reaches fewer). Depth 2 includes the
# hand-written chains this replaced (stop.termed+stop.killed, swap.switched+swap.drain_killed,
# swap.old_stopping+swap.drain_killed).
DEPTHS = [1, 2, 3] if os.environ.get("VIGIL_LONG") == "1" else [1]
# The crash matrix runs on SQLite: the order recovery's steps take and the proof without a
# cgroup do not depend on the store. The single crashes at the steps that are the store's
# protocol (leases, claims, chores, deliveries, the intents' commits, the overlap switch's
# guarded move) run on PostgreSQL too: there, another transaction can commit between a
# step's reads and its write (READ COMMITTED), which SQLite's one writer never lets happen.
STORE_POINTS = {
    "boxlease.taken", "chores.taken", "takeover.done", "release.done", "obligation.waiting",
    "notify.begun", "notify.recorded", "notify.sent", "member.proven", "swap.switched",
    "rollout.wave_admitted", "wake.intent", "stop.intent", "reload.intent", "job.due",
    "job.queued",  # the overlap's decision under the host's row lock (FOR UPDATE on PostgreSQL)
}
ON_BOTH = pytest.mark.backend("a step of the store's protocol: leases, claims, intents")

# Scenarios run again with marker containment (no cgroup): the ones whose recovery must
# find processes the store has no pid for, or that escaped the leader's session.
MARKER_POINTS = ["wake.spawned", "wake.reaping", "stop.killed", "swap.execd"]


def registered() -> set[str]:
    from runners.base.workflows import every_workflow
    from workflows.base import crash

    every_workflow()  # every workflow module: each registers its points at import

    return set(crash.REGISTERED)


# -- the run --------------------------------------------------------------------------------

Snapshot = dict[str, tuple[int, int, float]]  # host -> (generation, pid, create_time)


def snapshot(v: Vigil) -> Snapshot:
    """The current generations whose leader still runs."""
    return {h: (g.id, g.pid, g.create_time) for h, g in currents(v).items()
            if g.pid is not None and same_process_alive(g.pid, g.create_time)}


def finished(v: Vigil, p: subprocess.Popen[bytes], offset: int) -> bool:
    """Wait until the agent died or is ready with nothing left open. In that second case
    stop it, and say whether it ended cleanly (its recovery ran to the end without reaching
    its crash point; one reached after the last row closed still counts as a crash)."""
    marker = b"level=INFO logger=vigil.agent ready"
    wait_for(lambda: p.poll() is not None
             or (marker in v.agent_log()[offset:] and not v.obligations()),
             CRASH_BOUND, what="agent dead or finished")
    return p.poll() is None and v.stop_agent(p) == 0


def adoptions(v: Vigil) -> int:
    """How many times the next agent reaches recover.adopted before anything else: its
    recovery passes it once, after the one transaction that adopts or retires every current
    generation on a leased host, when there is any (workflows/engine/recovery.py; every agent of a
    state dir has the same id, so every lease is its own)."""
    return min(1, v.store.read(lambda s: s.execute(
        select(func.count()).select_from(Generation).join(Lease, Lease.host == Generation.host)
        .where(Generation.state == GenState.current)).scalar_one()))


def run_scenario(v: Vigil, flow: Flow, chain: tuple[str, ...], depth: int = 0) -> str | None:
    """Crash along `chain`, then (depth > 0) crash the recovering agent once more at the
    depth-th point its recovery reaches past its adoptions (see DOUBLE); recover with a
    clean agent and check. Returns the point of the second crash, if any."""
    t0 = time.monotonic()

    def phase(what: str) -> None:  # shown with the captured output of a failing test
        print(f"{time.monotonic() - t0:6.2f}s {what}")

    v.env["VIGIL_SETTLE_SECONDS"] = flow.settle
    build = flow.build(v) if callable(flow.build) else flow.build
    add_host(v, BYSTANDER, HELLO)
    for dep in flow.after:
        add_host(v, dep, HELLO)
    add_host(v, TARGET, build, flow.kind, flow.args, flow.policy, flow.listen, flow.after,
             **flow.host)

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
        if "memory_tier_mb" in flow.host:  # a real parent: raised as an overlap raises it
            tier_limit(v).write_text(str(2 * int(flow.host["memory_tier_mb"]) * MB))
    phase("setup done")

    # The crashes.
    for i, point in enumerate(chain):
        agent, off = start(v, crash_at=point)
        if i == 0 and ready_or_dead(v, agent, off, READY_BOUND) and flow.drive is not None:
            phase(f"agent ready with {point}; driving")
            flow.drive(v)
        expect_sigkill(v, agent, point, off)
        phase(f"agent died at {point}")
    at_crash = [snapshot(v)]
    if flow.between is not None:
        flow.between(v)

    second = None
    clean_at = None  # the clean agent is armed only to prove ADOPTION_ONLY right
    if depth:
        n = adoptions(v)
        only = chain[-1] in ADOPTION_ONLY
        at = "*#1" if only else f"*#{n + depth}"
        agent, off = start(v, crash_at=at)
        if depth > 1 and finished(v, agent, off):
            pytest.skip(f"recovery from {chain[-1]} reaches fewer than {depth} points "
                        f"past its {n} adoptions")
        second = expect_sigkill(v, agent, at, off, hint=(
            f"recovery from {chain[-1]} reached no crash point past its {n} adoptions; "
            "if that is right, add it to ADOPTION_ONLY"))
        assert (second == ADOPTED) == only, (
            f"the second crash ({at}, {n} adoptions ahead) hit {second}")
        phase(f"recovering agent died at {second} ({at})")
        at_crash.append(snapshot(v))
        if only:
            clean_at = f"*#{adoptions(v) + 1}"

    # Recovery by a clean agent (armed past its adoptions after an ADOPTION_ONLY point:
    # dying there would prove the entry wrong).
    agent, off = start(v, crash_at=clean_at)
    ready(v, agent, off)
    phase("clean agent ready")
    try:
        if flow.until is not None:
            wait_for(lambda: flow.until(v), 30, what=f"{flow.name} to finish")  # type: ignore[misc]
        v.quiesce(20)
        phase("quiescent")
        check_invariants(v, flow, before, at_crash)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n--- agent log ---\n{tail(v)}") from None
    assert agent.poll() is None, (
        f"the clean agent (VIGIL_CRASH_AT={clean_at}) died{ADOPTION_WRONG if clean_at else ''}:"
        f"\n{tail(v, off)}")
    phase("checked")
    return second


def check_invariants(v: Vigil, flow: Flow, before: Snapshot, at_crash: list[Snapshot]) -> None:
    v.check()
    cur = currents(v)

    # A generation the workflow was not ending kept its generation and pid: what served
    # before the workflow started, and what served (alive) when each crashed agent died.
    # (A hold swap crashed right after its admission still has the old one current: the
    # workflow is ending it, as target_fate "ended" says.)
    kept = [(h, before[h]) for h in [BYSTANDER] + ([TARGET] if flow.target_fate == "kept" else [])]
    kept += [(h, snap) for crash in at_crash for h, snap in crash.items()
             if not (h == TARGET and (flow.target_fate == "runs" or (
                 flow.target_fate == "ended" and snap == before[TARGET])))]
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
    # A process that ended between the scan and the read of its environment is no leak
    # (its environment reads as empty once it is gone): only live ones count.
    stray = {pid for pid in stray if alive_pid(pid)}
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
    if flow.listen:
        assert_listening(v, TARGET)
    if flow.end == "awake" and flow.kind is HostKind.worker:
        assert_running(v, TARGET, flow)
    elif flow.end == "awake":
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
        elif flow.end == "ran":  # a one-shot worker's run exited 0, exactly once
            assert len(rows(v, Event, Event.host == TARGET, Event.kind == "clean_exit")) == 1
        else:
            wakes = [w.state for w in rows(v, Wake, Wake.host == TARGET)]
            assert wakes and all(w is WakeState.failed for w in wakes), wakes
    if flow.attempt is not None:
        check_attempt(v, flow, cur.get(TARGET))
    if flow.verify is not None:
        flow.verify(v)


def check_attempt(v: Vigil, flow: Flow, current: Generation | None) -> None:
    assert flow.attempt is not None
    attempts = sorted(rows(v, Attempt, Attempt.host == TARGET), key=lambda a: a.id)
    first = attempts[0]
    assert first.outcome is not None and (first.outcome.value, first.executed) == (
        flow.attempt[0], first.executed if flow.attempt[1] is None else flow.attempt[1]), (
        f"attempt #{first.id} ended {first.outcome} executed={first.executed} ({first.reason}), "
        f"expected {flow.attempt}")
    if flow.resumed is None:
        assert len(attempts) == 1, f"{len(attempts)} attempts: {describe_attempts(attempts)}"
        a, (outcome, executed) = first, flow.attempt
    else:
        check_chain(attempts)
        a, (outcome, executed) = attempts[-1], flow.resumed
        assert a.outcome is not None and a.outcome.value == outcome, (
            f"attempt #{a.id} ended {a.outcome} ({a.reason}), expected {outcome}")
    if executed is not None:
        assert a.executed is executed, f"attempt #{a.id} executed={a.executed}, expected {executed}"
    host = rows(v, Host, Host.name == TARGET)[0]
    if flow.end == "ran":  # one-shot: nothing is current, the run's clean exit is recorded
        assert current is None and host.build_id == a.build_id and a.clean_exit is True, a
        assert rows(v, Build, Build.id == a.build_id)[0].good_at is not None
        return
    assert current is not None
    if outcome == "done" and flow.kind is HostKind.worker:
        assert current.build_id == a.build_id == host.build_id
    elif outcome == "done":
        assert current.build_id == a.build_id == host.build_id, (
            f"serving build #{current.build_id}, deployed #{a.build_id}, host's #{host.build_id}")
        digest = rows(v, Build, Build.id == a.build_id)[0].digest
        reply = get(str(v.state_dir / "run" / f"{TARGET}.sock"))
        assert f"build={digest[:12]}".encode() in reply, reply[:200]
    else:
        assert current.build_id == host.build_id != a.build_id, (
            f"serving build #{current.build_id}, host's #{host.build_id}, attempt's #{a.build_id}")


def check_chain(attempts: list[Attempt]) -> None:
    """An interrupted request and the attempts that wrote it again: each one after the
    first has cause resumed and names the one before, which was abandoned saying so; the
    same build, mode and canary all along."""
    assert len(attempts) >= 2, f"not resumed: {describe_attempts(attempts)}"
    for prev, nxt in zip(attempts, attempts[1:], strict=False):
        assert prev.outcome is Outcome.abandoned, describe_attempts(attempts)
        assert nxt.cause is Cause.resumed and nxt.resumed_from == prev.id, describe_attempts(attempts)
        assert f"resumed as attempt #{nxt.id}" in (prev.reason or ""), prev.reason
        assert (nxt.build_id, nxt.mode, nxt.canary) == (prev.build_id, prev.mode, prev.canary)


def describe_attempts(attempts: list[Attempt]) -> str:
    return "; ".join(f"#{a.id} {a.cause.value} from={getattr(a, 'resumed_from', None)} "
                     f"{a.outcome.value if a.outcome else a.step.value}: {a.reason}"
                     for a in attempts)


def assert_running(v: Vigil, host: str, flow: Flow) -> None:
    """A worker: awake, wanted up, exactly one current generation whose leader runs, on the
    build the flow names."""
    st = v.status(host)
    assert st["state"] == "awake" and st["desired"] == "up", st
    (g,) = [g for g in generations(v, host) if g.state is GenState.current]
    assert same_process_alive(g.pid, g.create_time), f"{host}: g{g.id} pid {g.pid} is not running"
    h = rows(v, Host, Host.name == host)[0]
    if flow.on_build == "live":
        assert g.build_id == h.build_id, f"g{g.id} runs build #{g.build_id}, live #{h.build_id}"
    elif flow.on_build == "first":
        assert g.build_id == generations(v, host)[0].build_id, f"g{g.id} left its build"


def assert_listening(v: Vigil, host: str) -> None:
    """The host's listener is held, and it is the very socket its current generation has
    and the fd holder keeps (the inode the store recorded); one socket on the path."""
    st = v.status(host)
    (lst,) = st["listeners"]
    assert lst["state"] == "held", st
    inode = lst["inode"]
    assert inode in holder_inodes(v).values(), (inode, holder_inodes(v))
    assert app_has(st["pid"], inode), f"{host}: pid {st['pid']} lacks socket:[{inode}]"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(str(listener_path(v)))
        s.sendall(b"GET / HTTP/1.0\r\n\r\n")
        assert s.recv(64).startswith(b"HTTP/1.0 200")


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
    no_double = names - set(DOUBLE)
    assert not no_double, f"crash points never double-crashed: {sorted(no_double)}"
    assert ADOPTION_ONLY <= set(SCENARIOS), ADOPTION_ONLY - set(SCENARIOS)
    assert set(MARKER_POINTS) <= set(SCENARIOS)
    assert STORE_POINTS <= set(SCENARIOS), STORE_POINTS - set(SCENARIOS)


def test_cli_lists_the_registered_crashpoints(vigil: Vigil) -> None:
    listed = set(vigil.run("crashpoints").stdout.split())
    assert listed == registered()


@pytest.mark.parametrize("point", [pytest.param(p, marks=ON_BOTH) if p in STORE_POINTS else p
                                   for p in sorted(SCENARIOS)])
def test_crash_at(vigil: Vigil, point: str) -> None:
    sc = SCENARIOS[point]
    run_scenario(vigil, sc.flow, sc.chain or (point,))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_crash_variant(vigil: Vigil, variant: str) -> None:
    if variant.startswith("tier-") and MEMORY is None:
        pytest.skip("no writable cgroup v1 memory hierarchy for a real parent limit")
    sc = VARIANTS[variant]
    run_scenario(vigil, sc.flow, sc.chain)


@pytest.mark.parametrize("depth", DEPTHS, ids=lambda d: f"depth{d}")
@pytest.mark.parametrize("point", DOUBLE)
def test_double_crash(vigil: Vigil, point: str, depth: int) -> None:
    sc = SCENARIOS[point]
    if depth > 1 and point in ADOPTION_ONLY:
        pytest.skip(f"recovery from {point} is adoption alone")
    second = run_scenario(vigil, sc.flow, sc.chain or (point,), depth)
    print(f"double crash {point}+{second}")


@pytest.mark.parametrize("containment", ["marker"])
@pytest.mark.parametrize("point", MARKER_POINTS)
def test_crash_at_with_marker_containment(vigil: Vigil, point: str) -> None:
    sc = SCENARIOS[point]
    run_scenario(vigil, sc.flow, sc.chain or (point,))
