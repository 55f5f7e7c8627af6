"""What every workflow step is handed: the store, who we are, and the ports."""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from models.store import Store
from workflows.base.paths import CLAIMS
from workflows.base.ports import (
    Files,
    HealthPort,
    LimitPort,
    ListenerPort,
    NoticePort,
    ProcessPort,
    ReadinessPort,
    SocketPort,
)


class Result(str, enum.Enum):
    """How one try at an obligation ended: gone, progress or poked."""

    gone = "gone"  # the row is no longer there (or no longer names the current incarnation)
    progress = "progress"  # it moved: resolved or advanced to its next state
    poked = "poked"  # nothing changed; keep the backoff
    waiting = "waiting"  # nothing wrong: due again at a time of the row's own (Until)
    held = "held"  # nothing wrong: it waits on another obligation in flight (Held); paced as poked


class Poke(Exception):
    """Nothing could be done this time; the message becomes the row's last_error."""


class Held(Poke):
    """Nothing is wrong: the row waits on another obligation in flight (an attempt, a
    member's proof, a stop, a wake). Paced like any poke; the agent logs it at INFO."""


class Until(Poke):
    """Nothing is to be done before `at` (naive UTC), a due time the row itself keeps (a
    rollout's pause between waves): the row is next due then, with no backoff counted."""

    def __init__(self, at: datetime, why: str) -> None:
        super().__init__(why)
        self.at = at


class SystemClock:
    def now(self) -> float:
        return time.time()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


@dataclass
class Context:
    store: Store
    agent_id: str
    state_dir: Path
    proc: ProcessPort
    health: HealthPort
    files: Files
    limits: LimitPort | None = None
    sockets: SocketPort | None = None  # None: sockets stay owner-only
    listeners: ListenerPort | None = None  # the box's listening sockets (the agent's)
    ready: ReadinessPort | None = None  # sd_notify and probe-command readiness (the agent's)
    notices: NoticePort | None = None  # sending notifications (the agent's)
    clock: SystemClock = field(default_factory=SystemClock)
    lease_ttl: float = 30.0
    proof_wait: float = 2.0  # how long a proof may poll for the kernel to finish a kill
    settle_seconds: float = 10.0  # canary settle window
    shutting_down: threading.Event = field(default_factory=threading.Event)
    on_proof_failed: Callable[[], None] = lambda: None  # counted by the agent's metrics
    # Generations (uuid) this agent has asked to stop (its host's stop signal or command)
    # that are not proven gone yet: a drain waited for in short holds asks once, not at
    # every look.
    termed: set[str] = field(default_factory=set)
    # Attempts a drive of this agent left mid-way (a step failed and so did writing its end,
    # e.g. on a full disk), with why: the next drive says that, not that the agent restarted.
    cut_short: dict[int, str] = field(default_factory=dict)

    @property
    def run_dir(self) -> Path:
        return self.state_dir / "run"

    def socket_for(self, host: str, n: int) -> str:
        return str(self.run_dir / host / f"g{n}.sock")

    def notify_for(self, host: str, n: int) -> str:
        """A generation's own NOTIFY_SOCKET (as long as its g<n>.sock, which fits)."""
        return str(self.run_dir / host / f"n{n}.sock")

    def link_for(self, host: str) -> str:
        return str(self.run_dir / f"{host}.sock")

    def log_for(self, host: str, n: int) -> str:
        """Generation n's output (rotated beside it: .1, .2, ...; runners/keepers/logkeeper.py)."""
        return str(self.state_dir / "logs" / host / f"g{n}.log")

    def claim_for(self, generation_uuid: str) -> str:
        """A job run's exec claim (SpawnSpec.exec_claim): its execution evidence."""
        return str(self.state_dir / CLAIMS / generation_uuid)

    def wait_until(self, cond, timeout: float, interval: float = 0.02) -> bool:  # type: ignore[no-untyped-def]
        """Poll cond() until it holds or timeout seconds pass."""
        deadline = self.clock.now() + timeout
        while True:
            if cond():
                return True
            if self.clock.now() >= deadline:
                return False
            self.clock.sleep(interval)
