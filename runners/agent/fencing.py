"""Leases across boxes, on the agent's side: renewal, the self-fence deadline, and the
spawn guard. The killing itself is the fence keeper's (runners/keepers/fencekeeper.py).

Timing (TTL = `--lease-ttl`, default 30 s):

- renewal every TTL/6 (5 s), on a thread of its own, so a busy scheduler cannot delay it:
  one UPDATE of this box's lease row (workflows/leases/box.py), whatever its hosts;
- each renewal that commits moves the self-fence deadline to `t0 + TTL - margin`, with t0
  read on the monotonic clock *before* the renewal was sent (so the deadline never lies
  past the expiry the store records) and margin = TTL/3 (10 s);
- at the deadline the keeper SIGKILLs every generation another box could take over (within
  POLL = 50 ms), and the spawn guard refuses new spawns from `deadline - slack` on (a
  Poke: the spawn is retried as an interrupted one once a renewal commits again);
- another box takes over only once the stored expiry (>= t0 + TTL) has passed on its own
  clock: at least `margin` after the old owner's generations were killed. The margin
  covers the keeper's poll, the kill and its proof (milliseconds: SIGKILL of the
  containment) and the clock skew between boxes (NTP: well under a second); four renewals
  in a row may fail before the owner fences itself.

A host `--on-store-loss keep` is not fenced: the keeper leaves it running past the deadline
and the spawn guard lets it start. When a renewal goes through again, its lease, if still
this agent's, is re-taken with a new fence (workflows/leases/box.py: adopt) and
the app runs on untouched; if another box holds it now (that box reached the store while
this one could not), this box kills its copy at once (fence_lost), the other box's being
the host's generation. Another box takes a `keep` host over only once its own renewals
have gone through for a whole TTL (steady_for), so after an outage of the store itself the
owner renews first.

Active only on PostgreSQL (several boxes); on SQLite no other box exists and nothing here
runs, so a single box behaves exactly as before.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import psutil
from sqlalchemy import select

from models.states import LIVE_GEN
from models.store import emit
from models.tables import Generation, Host, Lease
from runners.agent.trust import Trouble, guarded
from runners.base.pids import pid_status
from runners.keepers.fencekeeper import keeper_pid, write_fence
from runners.keepers.spawn import kill_and_wait, reap, spawn, start_time
from workflows.base.context import Context, Poke
from workflows.base.ports import ProcRef, Spawned, SpawnSpec
from workflows.leases import placement

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

log = logging.getLogger("vigil.fencing")


@dataclass(frozen=True)
class Timing:
    ttl: float

    @property
    def renew_every(self) -> float:
        return self.ttl / 6

    @property
    def margin(self) -> float:
        return self.ttl / 3

    @property
    def spawn_slack(self) -> float:
        """No spawn this close to the deadline: it could outrun the keeper's kill."""
        return min(1.0, self.ttl / 10)


class FenceGuard:
    def __init__(self, ctx: Context, timing: Timing, trouble: Trouble,
                 on_start: Callable[[], None] = lambda: None) -> None:
        self.ctx = ctx
        self.trouble = trouble  # True: the store itself failed and the agent has said so
        self.timing = timing
        self.deadline = 0.0  # monotonic; nothing may spawn before the first renewal
        self.held: set[str] = set()
        self.guarded: list[dict[str, Any]] = []  # fenced: the keeper kills them at the deadline
        self.kept: list[dict[str, Any]] = []  # `keep` hosts' generations: never killed by it
        # Monotonic time of the first renewal of the current unbroken run of them (None:
        # the last one failed); takeover of `keep` hosts waits on it (steady_for()).
        self.steady_since: float | None = None
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self._started: list[int] = []  # keepers this process started (its children)
        self._keeper_lock = threading.Lock()
        self.what = "fence keeper"
        self.on_start = on_start  # a keeper started: the keeper watch watches it at once
        me = psutil.Process()
        self._me = {"agent_pid": me.pid, "agent_ctime": me.create_time()}

    # -- the keeper ------------------------------------------------------------------------
    def ensure_keeper(self) -> None:
        with self._keeper_lock:
            reap(self._started)
            if keeper_pid(self.ctx.state_dir) is not None:
                return
            with self._lock:
                self._write()  # it reads our pid from the file first thing
            self._started.append(spawn("runners.keepers.fencekeeper", self.ctx.state_dir,
                                       "fencekeeper.log", site=True))
        self.on_start()

    # -- watched by the agent (runners/agent/helpers.py) --------------------------------------
    def running(self) -> tuple[int, float] | None:
        pid = keeper_pid(self.ctx.state_dir)
        ctime = None if pid is None or pid <= 0 else start_time(pid)
        return None if pid is None or ctime is None else (pid, ctime)

    def revive(self) -> None:
        self._keeper_if_needed()

    def check(self) -> None:
        """A stopped keeper (SIGSTOP: it has no socket to ask) cannot fence: it is killed
        (it holds nothing: the fence is in fence.json) and its exit restarts it."""
        now = self.running()
        if now is None:
            return
        st = pid_status(now[0])
        if st is not None and st[1] in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
            log.warning("fence keeper pid=%d is stopped: killed, a new one is started", now[0])
            kill_and_wait(*now)

    def _keeper_if_needed(self) -> None:
        """A keeper only while this box runs something another box could take over (a
        single-box store, placed nowhere, never needs one)."""
        if self.guarded:
            self.ensure_keeper()

    # -- renewal -----------------------------------------------------------------------------
    def start(self) -> threading.Thread:
        self.renew_now()
        self._keeper_if_needed()
        t = threading.Thread(target=self._loop, name="lease-renewal", daemon=True)
        t.start()
        return t

    def _loop(self) -> None:
        while not self.stop.wait(self.timing.renew_every):
            with guarded(self.trouble, log, "lease renewal round failed"):
                self.renew_now()
                self._keeper_if_needed()

    def renew_now(self) -> None:
        t0 = time.monotonic()
        try:
            held = self._renew()
        except Exception as exc:  # the deadline stays where it was: the keeper will fence
            self.steady_since = None
            if not self.trouble(exc) or self.deadline - time.monotonic() < self.timing.ttl / 3:
                log.warning("lease renewal failed (self-fence in %.1fs): %s",
                            self.deadline - time.monotonic(), exc)
            return
        watched = self.guarded + self.kept
        # Every watched host is checked against the leases as they are now, not only those
        # the renewal no longer returned: a renewal stopped (SIGSTOP) after its commit and
        # before this read saw them still held, and the next one would no longer watch them.
        (guarded, kept), taken = self.ctx.store.read(
            lambda s: (self._contestable(s), self._taken(s, {g["host"] for g in watched})))
        lost = [g for g in watched if g["host"] in taken]
        with self._lock:
            self.deadline = t0 + self.timing.ttl - self.timing.margin
            self.held = held
            self.guarded = guarded
            self.kept = kept
            if self.steady_since is None:
                self.steady_since = t0
            self._write()
        took = time.monotonic() - t0
        if took > self.timing.renew_every:  # what eats into the margin, said before it is gone
            log.warning("lease renewal took %.1fs (renewal every %.1fs, self-fence %.1fs after "
                        "the last one): the agent is short of CPU or the store is slow",
                        took, self.timing.renew_every, self.timing.ttl - self.timing.margin)
        if lost:
            self.fence_lost(lost)

    def _renew(self) -> set[str]:
        from workflows.leases.lease import renew_held

        return renew_held(self.ctx)

    def _contestable(self, s: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """This box's live generations another box could take over: those it fences (the
        keeper kills them at the deadline), and those of `keep` hosts (left running; killed
        only once their lease is found in another box's hands)."""
        rows = s.execute(select(Generation, Host.box, Host.on_store_loss)
                         .join(Lease, Lease.host == Generation.host)
                         .join(Host, Host.name == Generation.host)
                         .where(Lease.holder == self.ctx.agent_id,
                                Generation.state.in_(LIVE_GEN))).all()
        me = self.ctx.agent_id
        entries = [(_entry(g.uuid, g.host, g.pid, g.create_time, g.cgroup), box, loss)
                   for g, box, loss in rows]
        return ([e for e, box, loss in entries if placement.fenced(box, me, loss)],
                [e for e, box, loss in entries if placement.kept(box, me, loss)])

    def _taken(self, s: Any, hosts: set[str]) -> set[str]:
        """Of these hosts, those whose lease another agent holds now (not merely released)."""
        if not hosts:
            return set()
        return set(s.execute(select(Lease.host).where(Lease.host.in_(hosts),
                                                      Lease.holder != self.ctx.agent_id)).scalars())

    def fence_lost(self, lost: list[dict[str, Any]]) -> None:
        """Leases found lost: stop their generations now (the keeper may already have)."""
        for g in lost:
            ref = ProcRef(g["uuid"], g.get("pid"), g.get("create_time"), g.get("cgroup"))
            self.ctx.proc.kill_all(ref)
        hosts = sorted({g["host"] for g in lost})
        log.warning("self-fenced hosts=%s: their leases are lost", ",".join(hosts))
        try:
            def record(s: Session) -> None:
                for h in hosts:
                    emit(s, "self_fenced", h, agent=self.ctx.agent_id)
            self.ctx.store.write(record)
        except Exception:
            pass  # the event is advisory

    def _write(self) -> None:
        write_fence(self.ctx.state_dir, {**self._me, "deadline": self.deadline,
                                         "generations": self.guarded})

    # -- the spawn guard -------------------------------------------------------------------
    def before_spawn(self, spec: SpawnSpec) -> None:
        """Refuse a spawn too close to (or past) the deadline; otherwise list the new
        generation for the keeper *before* it exists (it is killed by its marker)."""
        box, loss = self.ctx.store.read(lambda s: s.execute(
            select(Host.box, Host.on_store_loss).where(Host.name == spec.host)).one())
        if not placement.fenced(box, self.ctx.agent_id, loss):
            return  # a `keep` host is not killed at the deadline: nothing to outrun
        with self._lock:
            left = self.deadline - time.monotonic()
            if left < self.timing.spawn_slack:
                # Not the build's failure, and not for good: the wake (or attempt) finds
                # its spawn interrupted on the next try and retries it once renewed.
                raise Poke(f"spawn of {spec.host} refused: this agent's leases were not "
                           f"renewed in time (self-fence deadline {'in' if left > 0 else 'passed'} "
                           f"{abs(left):.1f}s)")
            self.guarded = [*self.guarded, _entry(spec.generation_uuid, spec.host, None, None,
                                                  spec.cgroup)]
            self._write()
        self.ensure_keeper()  # before the process exists: the keeper kills it by its marker

    def steady_for(self) -> float:
        """Seconds this agent's renewals have gone through without a failure (0: the last
        one failed). A box takes over a `keep` host only once this passes a lease's length:
        after a store outage the owner, which kept the app running, renews first."""
        since = self.steady_since
        return 0.0 if since is None else time.monotonic() - since

    def close(self) -> None:
        self.stop.set()


def _entry(uuid: str, host: str, pid: int | None, ctime: float | None,
           cgroup: str | None) -> dict[str, Any]:
    return {"uuid": uuid, "host": host, "pid": pid, "create_time": ctime, "cgroup": cgroup}


class FencedProcess:
    """The ProcessPort with the spawn guard in front of spawn()."""

    def __init__(self, inner: Any, guard: FenceGuard) -> None:
        self._inner = inner
        self._guard = guard

    def spawn(self, spec: SpawnSpec) -> Spawned:
        self._guard.before_spawn(spec)
        return self._inner.spawn(spec)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)
