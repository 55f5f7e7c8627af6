"""Model-based test (issue 4 item 4): hypothesis drives random sequences of operator and
box events against the real workflows, in-process (tests/model/box.py: the real SQLite
store, process backend, health and files; no agent subprocess, so that hundreds of
examples fit in CI), and after every rule, once the agent is quiescent, checks `vigil
check`'s invariants (runners.cli.check.run_checks) plus a model of each host: the build it
serves (or none), the build it is configured with, whether it should be up, and that a
serving leader no rule replaced kept its pid (adopted, never restarted needlessly).

Rules: wake; stop; deploy a good build and deploy a bad one (fails health by its timeout
or by exiting), overlap or hold, with or without a canary settle; deploy superseding (a
second deploy queued behind the first, or written while the first one's successor is being
health-checked); SIGKILL an app's leader; kill -9 the agent and restart it (between steps;
every action rule may also crash the agent at a registered crash point it reaches, and
the restart may crash again in recovery); advance time (backoffs and maybe lease expiry
run out, the safety sweep runs).

Profiles: the default (CI) runs 40 examples of at most 4 rules each (plus the initial
wakes), on SQLite; `VIGIL_LONG=1` runs 2000 examples of at most 10 rules, shrinking
failures, on both databases.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import psutil
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from sqlalchemy import select, update
from sqlalchemy.orm import Session

import workflows.engine.obligations  # noqa: F401  (registers every crash point)
import workflows.engine.recovery  # noqa: F401
from models.facts import live
from models.states import Cause, Mode
from models.store import utcnow
from models.tables import Attempt, BoxLease, Build, Host, Lease
from runners.backend.files import LocalFiles
from runners.cli.check import run_checks
from tests.conftest import drop_db, pid_dead, wait_for
from tests.model.apps import write_app
from tests.model.box import Box, CrashTrap, template_db
from workflows.base import crash as crash_mod
from workflows.deploys.request import request_deploy
from workflows.lifecycle.stop import request_stop
from workflows.lifecycle.wake import request_wake

LONG = os.environ.get("VIGIL_LONG") == "1"
# CI does not shrink a failure (a shrink of real process runs can take many minutes); the
# failing steps are printed as found, at most stateful_step_count of them.
settings.register_profile("vigil-ci", max_examples=40, stateful_step_count=4, deadline=None,
                          database=None, print_blob=True,
                          phases=[Phase.explicit, Phase.reuse, Phase.generate],
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
settings.register_profile("vigil-long", settings.get_profile("vigil-ci"), max_examples=2000,
                          stateful_step_count=10, phases=list(Phase))
PROFILE = settings.get_profile("vigil-long" if LONG else "vigil-ci")
# The workflows under test are the same on both databases: the default run checks them
# on SQLite with 40 examples; VIGIL_LONG=1 runs 2,000 on each database.
pytestmark = [pytest.mark.backend("the long profile, over each store")] if LONG else []
if os.environ.get("VIGIL_MODEL_EXAMPLES"):  # a quick local run
    PROFILE = settings(PROFILE, max_examples=int(os.environ["VIGIL_MODEL_EXAMPLES"]))

HOSTS = ("a", "b")
# g0 is every host's build when it is added; `stubborn` ignores SIGTERM (its stop or drain
# ends in SIGKILL after the drain timeout).
GOOD = ("g0", "g1", "g2", "stubborn")
BAD = ("bad_exit", "bad_500", "bad_exit")  # bad_500 waits out the health timeout: rarer
BUILDS = {"g0": "good", "g1": "good", "g2": "good", "stubborn": "stubborn",
          "bad_500": "bad_500", "bad_exit": "bad_exit"}  # label -> app kind (tests/model/apps.py)

# An overlap deploy crashed before its switch is abandoned and written again (cause
# resumed), which runs to its end: one crash per rule never exhausts its 3 resumptions, so
# every overlap deploy that is not superseded takes effect (a good build switches).
ALL_POINTS = sorted(crash_mod.REGISTERED)
assert len(ALL_POINTS) > 30, "workflows.engine.obligations/recovery register them at import"
WAKE_POINTS = [p for p in ALL_POINTS if p.startswith(("wake.", "release."))]
STOP_POINTS = [p for p in ALL_POINTS if p.startswith(("stop.", "release."))]
DEPLOY_POINTS = [p for p in ALL_POINTS if p.startswith(("swap.", "member.", "wake."))]
KILL_POINTS = [p for p in ALL_POINTS if p.startswith(("member.", "wake.", "release."))]


def crash_at(likely: list[str]) -> st.SearchStrategy[str | None]:
    """No crash, a crash at a point this rule is likely to reach, or at any point."""
    return st.none() | st.sampled_from(likely) | st.sampled_from(ALL_POINTS)


@dataclass
class Stats:
    examples: int = 0
    steps: int = 0
    drives: int = 0
    restarts: int = 0
    pokes: int = 0
    skipped_backoff: int = 0
    armed: int = 0
    seconds: Counter[str] = field(default_factory=Counter)
    rules: Counter[str] = field(default_factory=Counter)
    fired: Counter[str] = field(default_factory=Counter)
    reached: set[str] = field(default_factory=set)


STATS = Stats()


@dataclass
class Env:
    """What every example shares: a template database and the app sources."""

    root: Path
    template: str  # template_db's URL
    sources: dict[str, Path]
    trap: CrashTrap


ENV: Env | None = None


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    global ENV
    root = Path(tempfile.mkdtemp(prefix="vgm", dir="/tmp"))
    src = root / "src"
    src.mkdir()
    sources = {label: write_app(src, kind, label) for label, kind in BUILDS.items()}
    trap = CrashTrap()
    with trap.installed():
        ENV = Env(root, template_db(root), sources, trap)
        try:
            yield ENV
        finally:
            drop_db(ENV.template)
            ENV = None
            # Each example's teardown ends its own processes; this catches an example that
            # failed before it could (an agent carries VIGIL_HOME under root, an instance
            # its socket there; apps get no VIGIL_HOME).
            for pid in leftovers(root):
                os.kill(pid, signal.SIGKILL)
            shutil.rmtree(root, ignore_errors=True)


def leftovers(root: Path) -> list[int]:
    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            env = p.environ()
            if any(env.get(k, "").startswith(f"{root}/")
                   for k in ("VIGIL_HOME", "VIGIL_SOCKET", "NOTIFY_SOCKET")):
                found.append(p.pid)
        except (psutil.Error, OSError):
            continue
    return found


class VigilMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        t0 = time.monotonic()
        assert ENV is not None
        self.env = ENV
        self.trap = ENV.trap
        self.trap.arm(None)
        self.fired_before = len(self.trap.fired)
        self.dir = Path(tempfile.mkdtemp(prefix="ex", dir=ENV.root))
        # synchronous=OFF: an in-process crash never loses the page cache, and fsyncs are
        # most of a step's cost here.
        self.box = Box(self.dir, ENV.template, synchronous="OFF")
        self.build_ids: dict[str, int] = {}  # staged when first deployed
        for h in HOSTS:
            # 1.5 s: a good build answers in tens of ms, but CI runs two suites at once on
            # two cores, and a start past 0.5 s there failed a good wake; bad_500 pays it.
            self.box.add_host(h, ENV.sources["g0"], health_timeout=1.5, drain_timeout=0.3)
        self._bid("g0")
        # The model: per host, the build it is configured with, the build it serves (None:
        # asleep), whether the operator wants it up; and the pid of each serving leader.
        self.config = {h: "g0" for h in HOSTS}
        self.serving: dict[str, str | None] = {h: None for h in HOSTS}
        self.up = {h: False for h in HOSTS}
        self.pids: dict[str, int] = {}
        STATS.examples += 1
        STATS.seconds["setup"] += time.monotonic() - t0

    # -- helpers ---------------------------------------------------------------------------
    def _run(self, name: str, crash_at: str | None) -> list[str]:
        """Drive to quiescence with `crash_at` armed; returns the crash points that fired."""
        STATS.rules[name] += 1
        STATS.steps += 1
        before = len(self.trap.fired)
        self.trap.arm(crash_at)
        if crash_at:
            STATS.armed += 1
        t0 = time.monotonic()
        try:
            self.box.quiesce()
        finally:
            self.trap.arm(None)
            STATS.seconds[name] += time.monotonic() - t0
        return self.trap.fired[before:]

    def _bid(self, label: str) -> int:
        if label not in self.build_ids:
            self.build_ids[label] = self.box.stage(self.env.sources[label])
        return self.build_ids[label]

    def _deploy_request(self, host: str, label: str, mode: Mode = Mode.overlap,
                        canary: bool = False) -> int:
        bid = self._bid(label)
        return self.box.store.write(lambda s: request_deploy(
            s, host, s.get(Build, bid), mode=mode, canary=canary, cause=Cause.release).id)

    def _apply_deploy(self, host: str, label: str, switched: bool) -> None:
        """The model of one overlap deploy that was not superseded."""
        if self.serving[host] is None:
            # Asleep: the build is set for the next start; a host that should be up wakes.
            self.config[host] = label
            if self.up[host]:
                self._apply_wake_start(host)
            return
        if label in GOOD and switched:
            self.config[host] = label
            self.serving[host] = label
            self.pids.pop(host, None)  # a new generation

    def _apply_wake_start(self, host: str) -> None:
        if self.serving[host] is None:
            good = self.config[host] in GOOD
            self.serving[host] = self.config[host] if good else None
            self.pids.pop(host, None)

    # -- rules -----------------------------------------------------------------------------
    @initialize(hosts=st.sampled_from([("a",), ("a", "b"), ()]))
    def start(self, hosts: tuple[str, ...]) -> None:
        """Most examples start with a host serving (else most of their steps do little)."""
        for h in hosts:
            self.wake(h, None)

    @rule(host=st.sampled_from(HOSTS), crash_at=crash_at(WAKE_POINTS))
    def wake(self, host: str, crash_at: str | None) -> None:
        self.box.store.write(lambda s: request_wake(s, host))
        self._run("wake", crash_at)
        self.up[host] = True
        self._apply_wake_start(host)

    @rule(host=st.sampled_from(HOSTS), crash_at=crash_at(STOP_POINTS))
    def stop(self, host: str, crash_at: str | None) -> None:
        self.box.store.write(lambda s: request_stop(s, host))
        self._run("stop", crash_at)
        self.up[host] = False
        self.serving[host] = None
        self.pids.pop(host, None)

    def _deploy(self, rule_name: str, host: str, label: str, mode: Mode, canary: bool,
                crash_at: str | None) -> None:
        self._deploy_request(host, label, mode, canary)
        self._run(rule_name, crash_at)
        STATS.rules[f"{rule_name}_{mode.value}{'_canary' if canary else ''}"] += 1
        if mode is Mode.hold and self.serving[host] is not None:
            # Hold: the old generation is stopped first; after a crash anywhere the attempt
            # is finished (the old one proven, the new build started again). A bad build
            # leaves the host down.
            if label in GOOD:
                self.config[host] = self.serving[host] = label
            else:
                self.serving[host] = None
            self.pids.pop(host, None)
            return
        self._apply_deploy(host, label, switched=True)

    @rule(host=st.sampled_from(HOSTS), label=st.sampled_from(GOOD), mode=st.sampled_from(Mode),
          canary=st.booleans(), crash_at=crash_at(DEPLOY_POINTS))
    def deploy_good(self, host: str, label: str, mode: Mode, canary: bool,
                    crash_at: str | None) -> None:
        self._deploy("deploy_good", host, label, mode, canary, crash_at)

    @rule(host=st.sampled_from(HOSTS), label=st.sampled_from(BAD), mode=st.sampled_from(Mode),
          canary=st.booleans(), crash_at=crash_at(DEPLOY_POINTS))
    def deploy_bad(self, host: str, label: str, mode: Mode, canary: bool,
                   crash_at: str | None) -> None:
        self._deploy("deploy_bad", host, label, mode, canary, crash_at)

    @rule(host=st.sampled_from(HOSTS), first=st.sampled_from(GOOD + BAD),
          second=st.sampled_from(GOOD + BAD), inflight=st.booleans(),
          crash_at=crash_at(DEPLOY_POINTS))
    def deploy_superseding(self, host: str, first: str, second: str, inflight: bool,
                           crash_at: str | None) -> None:
        """A second deploy supersedes the first: queued behind it, or written while the
        first one's successor is being health-checked. The first never takes effect."""
        first_id = self._deploy_request(host, first)
        # How many crashes had fired when the second deploy was written: only a crash after
        # that can have stopped the second one before its switch.
        requested: list[int] = []
        if inflight and self.serving[host] is not None:
            STATS.rules["superseding_inflight"] += 1

            def operator(socket_path: str) -> bool:
                a = self.box.store.read(lambda s: s.get(Attempt, first_id))
                if a.successor_id is None or not socket_path.endswith(f"/g{a.successor_id}.sock"):
                    return False
                self._deploy_request(host, second)
                requested.append(len(self.trap.fired))
                return True

            self.box.health.before = operator
        else:
            self._deploy_request(host, second)
            requested.append(len(self.trap.fired))
        self._run("deploy_superseding", crash_at)
        self.box.health.before = None
        if not requested:
            # The first crashed before its check: it was resumed (the newest request then)
            # and ran to its end; the second comes now.
            self._apply_deploy(host, first, switched=True)
            self._deploy_request(host, second)
            requested.append(len(self.trap.fired))
            self._run("deploy_superseding", None)
        first_row = self.box.store.read(lambda s: s.get(Attempt, first_id))
        assert first_row.outcome is not None and first_row.outcome.value != "done", \
            (first_row.outcome, first_row.reason)
        self._apply_deploy(host, second, switched=True)  # resumed if a crash cut it short

    @precondition(lambda self: any(self.serving.values()))
    @rule(data=st.data(), crash_at=crash_at(KILL_POINTS))
    def kill_leader(self, data: st.DataObject, crash_at: str | None) -> None:
        host = data.draw(st.sampled_from([h for h in HOSTS if self.serving[h] is not None]))
        pid = self.box.currents()[host].pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        # SIGKILL lands asynchronously; the agent's sweep runs every second, so it would see
        # the death on a later sweep. Here the sweep runs once, after the leader is gone.
        wait_for(lambda: pid_dead(pid), 5, interval=0.002, what=f"leader {pid} to die")
        self._run("kill_leader", crash_at)
        assert self.box.currents()[host].pid != pid, "the killed leader is still current"
        self.pids.pop(host, None)  # the agent restarts it (desired up) on the same build

    @rule(crash_at=st.none() | st.just("recover.adopted") | st.sampled_from(ALL_POINTS))
    def restart_agent(self, crash_at: str | None) -> None:
        """kill -9 between steps. `crash_at` may crash the recovery itself (then it
        recovers again), or else whatever the restarted agent finishes next."""
        self.trap.arm(crash_at)
        try:
            self.box.crash()
            still = self.trap.armed
        finally:
            self.trap.arm(None)
        self._run("restart_agent", still)

    @rule(past_lease_ttl=st.booleans(), crash_at=crash_at(KILL_POINTS))
    def advance_time(self, past_lease_ttl: bool, crash_at: str | None) -> None:
        """Time passes: every backoff runs out, and maybe every lease's expiry too (the agent
        stalled longer than its TTL); the safety sweep runs (and may crash) and renews them."""
        self.box.advance_time()
        if past_lease_ttl:  # the box's lease lapses, and with it every host lease it holds
            past = utcnow() - timedelta(seconds=1)

            def lapse(s: Session) -> None:
                s.execute(update(Lease).values(expires_at=past))
                s.execute(update(BoxLease).values(expires_at=past))

            self.box.store.write(lapse)
        self._run("advance_time", crash_at)
        lapsed = self.box.store.read(lambda s: s.execute(select(Lease.host).where(
            ~live(Lease.__table__, utcnow()))).scalars().all())
        assert not lapsed, f"the sweep renews every lease: {lapsed} lapsed"

    # -- the invariant -----------------------------------------------------------------------
    @invariant()
    def consistent(self) -> None:
        t0 = time.monotonic()
        try:
            self._consistent()
        finally:
            STATS.seconds["invariant"] += time.monotonic() - t0

    def _consistent(self) -> None:
        box = self.box
        assert box.open_rows() == [], "not quiescent"
        violations = run_checks(box.store, box.state_dir)
        assert violations == [], violations
        currents = box.currents()
        for h in HOSTS:
            want = self.serving[h]
            g = currents.get(h)
            got = None if g is None else \
                next(label for label, bid in self.build_ids.items() if bid == g.build_id)
            assert got == want, (f"host {h} serves {got}, the model says {want} (config "
                                 f"{self.config[h]}); its last events: {box.history(h)}")
            host = box.store.read(lambda s, h=h: s.get(Host, h))
            assert host.build_id == self.build_ids[self.config[h]], (h, host.build_id, self.config)
            if want is not None:
                assert LocalFiles().read_link(box.ctx.link_for(h)) == g.socket
                # A serving generation that the rule did not replace kept its leader.
                if h in self.pids:
                    assert g.pid == self.pids[h], f"host {h}: leader {self.pids[h]} replaced by {g.pid}"
                self.pids[h] = g.pid
            assert host.desired.value == ("up" if self.up[h] else "down")

    def teardown(self) -> None:
        STATS.drives += self.box.drives
        STATS.restarts += self.box.restarts
        STATS.pokes += len(self.box.pokes)
        STATS.skipped_backoff += self.box.skipped_backoff
        STATS.fired.update(self.trap.fired[self.fired_before:])
        STATS.reached |= self.trap.reached
        t0 = time.monotonic()
        try:
            self.box.close()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)
            STATS.seconds["teardown"] += time.monotonic() - t0


@pytest.mark.timeout(0 if LONG else 600)
def test_model(env: Env) -> None:
    start = time.monotonic()
    run_state_machine_as_test(VigilMachine, settings=PROFILE)
    took = time.monotonic() - start
    report = (f"model: {STATS.examples} examples, {STATS.steps} steps, {STATS.drives} drives, "
              f"{STATS.restarts} agent restarts, {STATS.armed} crashes armed, {STATS.pokes} pokes, "
              f"{STATS.skipped_backoff} backoffs skipped in {took:.1f}s; rules {dict(STATS.rules)}; "
              f"crash points fired {len(STATS.fired)}/{len(crash_mod.REGISTERED)}: "
              f"{dict(sorted(STATS.fired.items()))}; never reached: "
              f"{sorted(set(crash_mod.REGISTERED) - STATS.reached)}")
    print(report)
    print("seconds:", {k: round(v, 1) for k, v in STATS.seconds.most_common()})
    assert STATS.examples >= PROFILE.max_examples
    assert leftovers(env.root) == []
