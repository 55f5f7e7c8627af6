"""The chaos driver: a seeded plan of actions (deploys overlap and hold, stops, wakes,
rollouts, and `kill -9` of one vigil process at a time: the agent, the fd holder, the log
keeper, the fence keeper, an app's leader or its child), each followed by a random pause,
so every kill lands at a random instant of whatever is in flight.

One death at a time: before a kill, the process killed last is waited back (the agent:
the one this driver restarts at once has said `ready`; a helper: vigil has started a new
one, waited a short bound: on main nothing restarts a dead helper until it is needed).
App processes are taken from generations the store says are current: a successor still
in its health check that is killed is, by design, the build's failure."""

from __future__ import annotations

import random
import subprocess
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import psutil
from sqlalchemy import text

from runners.keepers.fdholder import holder_pid
from runners.keepers.fencekeeper import keeper_pid as fence_pid
from runners.keepers.logkeeper import keeper_pid as log_pid
from tests.chaos.world import BOX, LABELS, HostSpec, generation_procs, kill_dead, same_process
from tests.conftest import Vigil, wait_for

HELPERS: dict[str, tuple[Callable, str]] = {
    "kill_holder": (holder_pid, "runners.keepers.fdholder"),
    "kill_logkeeper": (log_pid, "runners.keepers.logkeeper"),
    "kill_fencekeeper": (fence_pid, "runners.keepers.fencekeeper"),
}
WEIGHTS = {  # of each kind of action in a plan
    "deploy_overlap": 6, "deploy_hold": 4, "stop": 2, "wake": 3, "rollout": 1,
    "kill_agent": 4, "kill_holder": 3, "kill_logkeeper": 2, "kill_fencekeeper": 1,
    "kill_leader": 3, "kill_child": 1,
}
HELPER_BACK = 2.0  # seconds a killed helper is given to be started again
AGENT_READY = 120.0


@dataclass(frozen=True)
class Action:
    kind: str
    host: str | None
    build: str | None
    pause: float  # seconds after it, before the next action

    def __str__(self) -> str:
        what = " ".join(x for x in (self.host, self.build) if x)
        return f"{self.kind}{' ' + what if what else ''} +{self.pause:.2f}s"


def plan(seed: int, n: int, hosts: list[HostSpec]) -> list[Action]:
    rng = random.Random(seed)
    kinds, weights = zip(*WEIGHTS.items(), strict=True)
    out = []
    for _ in range(n):
        kind = rng.choices(kinds, weights)[0]
        host = rng.choice(hosts).name
        if kind == "rollout":  # its targets, in order
            host = ",".join(h.name for h in rng.sample(hosts, min(3, len(hosts))))
        build = rng.choice(LABELS)
        pause = round(rng.uniform(0.0, 0.8), 2)
        needs_host = kind in ("deploy_overlap", "deploy_hold", "stop", "wake", "kill_leader",
                              "kill_child", "rollout")
        out.append(Action(kind, host if needs_host else None,
                          build if kind.startswith(("deploy", "rollout")) else None, pause))
    return out


@dataclass
class Driver:
    v: Vigil
    hosts: list[HostSpec]
    builds: dict[str, str]  # label -> staged path given to the CLI
    meant_up: dict[str, bool] = field(default_factory=dict)
    kills: Counter = field(default_factory=Counter)  # done, by kind
    skipped: Counter = field(default_factory=Counter)  # nothing of that kind ran then
    log: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.agent: subprocess.Popen[bytes] | None = None
        self.back: Callable[[], bool] = lambda: True  # the last victim is back
        self.ready: Callable[[], bool] = lambda: False  # the agent started last is ready
        self.back_bound = 0.0

    # -- the agent ---------------------------------------------------------------------
    def start_agent(self) -> None:
        before = self.v.ready_count()
        self.agent = self.v.start_agent(None, "--box", BOX)
        agent = self.agent
        self.ready = lambda: agent.poll() is not None or self.v.ready_count() > before
        self.back, self.back_bound = self.ready, AGENT_READY

    def agent_ready(self) -> None:
        wait_for(self.ready, AGENT_READY, interval=0.05, what="the agent ready")
        if self.agent is None or self.agent.poll() is not None:
            raise AssertionError(f"the agent exited:\n{self.v.agent_log().decode()[-3000:]}")

    # -- actions -----------------------------------------------------------------------
    def run(self, actions: list[Action]) -> None:
        for i, a in enumerate(actions):
            line = self.do(a)
            self.log.append(f"{i:3d} {a}: {line}")
            time.sleep(a.pause)

    def do(self, a: Action) -> str:
        if a.kind.startswith("kill_"):
            try:  # one death at a time: the last one is back first (bounded)
                wait_for(self.back, self.back_bound, interval=0.02, what="the last victim back")
            except AssertionError:
                pass  # a helper vigil did not start again: the kill goes ahead regardless
            return self.kill(a)
        if a.kind in ("deploy_overlap", "deploy_hold"):
            mode = a.kind.split("_")[1]
            return self.cli("deploy", a.host or "", self.builds[a.build or "a"], "--mode", mode)
        if a.kind == "rollout":
            targets = (a.host or "").split(",")
            return self.cli("rollout", "start", self.builds[a.build or "a"], "--waves", "1,100%",
                            *[x for h in targets for x in ("--host", h)])
        if a.kind in ("stop", "wake"):
            line = self.cli(a.kind, a.host or "")
            if not line.startswith("rc="):
                self.meant_up[a.host or ""] = a.kind == "wake"
            return line
        raise ValueError(a.kind)

    def cli(self, *args: str) -> str:
        cp = self.v.run(*args, check=False)
        out = (cp.stdout + cp.stderr).strip().splitlines()
        first = out[0] if out else ""
        return first if cp.returncode == 0 else f"rc={cp.returncode} {first}"

    def kill(self, a: Action) -> str:
        if a.kind == "kill_agent":
            if self.agent is None or self.agent.poll() is not None:
                self.skipped[a.kind] += 1
                return "no agent running"
            pid = self.agent.pid
            self.agent.kill()
            self.agent.wait(30)
            self.kills[a.kind] += 1
            self.start_agent()  # at once: the operator's supervisor would
            return f"killed agent {pid}, started {self.agent.pid if self.agent else '?'}"
        if a.kind in HELPERS:
            return self.kill_helper(a.kind)
        return self.kill_app(a)

    def kill_helper(self, kind: str) -> str:
        find, module = HELPERS[kind]
        pid = find(self.v.state_dir)
        p = same_process(pid, (module, str(self.v.state_dir))) if pid and pid > 0 else None
        if p is None:
            self.skipped[kind] += 1
            return "not running"
        kill_dead(p)
        self.kills[kind] += 1
        state = self.v.state_dir
        self.back = lambda: (find(state) or pid) != pid
        self.back_bound = HELPER_BACK
        return f"killed {module} {pid}"

    def kill_app(self, a: Action) -> str:
        currents = self.v.store.read(lambda s: dict(s.execute(text(
            "SELECT uuid, pid FROM generations WHERE host = :h AND state = 'current'"),
            {"h": a.host}).all()))
        procs = [p for p in generation_procs(self.v.state_dir, self.v.db_url) if p.marker in currents]
        if a.kind == "kill_leader":
            procs = [p for p in procs if p.pid == currents[p.marker]]
        else:
            procs = [p for p in procs if p.pid != currents[p.marker]]
        if not procs:
            self.skipped[a.kind] += 1
            return "no such process"
        try:
            kill_dead(psutil.Process(procs[0].pid))
        except psutil.NoSuchProcess:
            self.skipped[a.kind] += 1
            return "gone before the kill"
        self.kills[a.kind] += 1
        self.back, self.back_bound = (lambda: True), 0.0
        return f"killed pid {procs[0].pid} of {a.host}"
