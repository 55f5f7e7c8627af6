"""What every command module shares: the state dir and store of one invocation, the
duration option type, JSON and table output, and the one polling loop of the --wait
commands. Imports nothing heavy: `vigil --help` must not pay for SQLAlchemy."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from models.durations import parse_seconds
from models.errors import BadInput, VigilError
from runners.cli.output import show as show  # rich is imported only when a table is printed
from runners.cli.output import table as table

if TYPE_CHECKING:
    from models.store import Store

T = TypeVar("T")


class Seconds(click.ParamType):
    """A duration option: finite, above 0, at most a day (models/durations.py), refused
    with one line before the command does anything."""

    name = "seconds"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        return parse_seconds(str(value), param.opts[0] if param else "a duration")


SECONDS = Seconds()


def options(*decorators: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Several click options as one decorator; `--help` lists them in the order given."""
    def apply(f: Any) -> Any:
        for option in reversed(decorators):
            f = option(f)
        return f

    return apply

opened: list[Any] = []  # stores and agent connections, closed when the command ends (main
# may run in-process)


STATE_DIR = ".vigil"
NO_AGENT_GRACE = 2.0  # a --wait with no agent acting fails after this long


def default_state_dir(cwd: Path) -> Path:
    """Without --state-dir or VIGIL_HOME: the nearest `.vigil` in the current directory or
    one above it (as git finds `.git`), else `./.vigil`, which `vigil db upgrade` creates."""
    for d in (cwd, *cwd.parents):
        if (d / STATE_DIR).is_dir():
            return d / STATE_DIR
    return cwd / STATE_DIR


def unsafe_default(state_dir: Path) -> VigilError | None:
    """Why the state dir the search chose must not be used, or None: a link, or one in a
    directory others can write (they could swap it for a link between a check and a use;
    `ln -s /etc /tmp/.vigil` would have root lock down /etc). Named by --state-dir it is
    the operator's choice, and only a link is refused (models/statedir.py)."""
    from models.errors import StoreNotReady
    from models.statedir import refuse_link
    from runners.backend.safefiles import writable_by_others

    try:
        refuse_link(state_dir)
    except StoreNotReady as exc:
        exc.cause = exc.cause.replace("state directory", "the default state dir", 1)
        return exc
    who = writable_by_others(str(state_dir.parent))
    if who is None:
        return None
    return StoreNotReady(f"the default state dir {state_dir} is in {state_dir.parent}, a "
                         f"directory others can write ({who}): one of them could swap it for "
                         "a link to any directory",
                         "pass --state-dir (or VIGIL_HOME) naming it if it is yours, or keep "
                         "the state dir where only you can write")


class Env:
    """One invocation's state dir and database (its store opened on first use), and the
    agent's control socket when an agent answers there."""

    def __init__(self, state_dir: str | None, db: str | None, listen_db: str | None = None) -> None:
        self.by_default = state_dir is None
        self._state_dir = (default_state_dir(Path.cwd()) if state_dir is None
                           else Path(state_dir).absolute())
        # Raised at the first use, so a command that needs no state dir still runs there.
        self.refusal = unsafe_default(self._state_dir) if state_dir is None else None
        self.db = db
        self.listen_db = listen_db  # --listen-db: db is a pooler in transaction mode
        self._store: Store | None = None
        self._quick: Quick | None = None

    @property
    def state_dir(self) -> Path:
        if self.refusal is not None:
            raise self.refusal
        return self._state_dir

    def store(self, *, create: bool = False, at_head: bool = True,
              lock_wait: float | None = None) -> Store:
        if self._store is None:
            from models import schema
            from models.errors import StoreNotReady
            from runners.wiring import CLI_LOCK_WAIT, open_store

            try:
                self._store = open_store(self.state_dir, self.db, create=create,
                                         lock_wait=lock_wait or CLI_LOCK_WAIT,
                                         listen_db=self.listen_db)
            except StoreNotReady as exc:
                if self.by_default and exc.cause.startswith("no "):
                    exc.cause += (" (the default state dir: the nearest .vigil in the current "
                                  "directory or above it)")
                raise
            opened.append(self._store)
            if at_head:
                schema.require_head(self._store.engine)
        return self._store

    def quick(self) -> Quick:
        if self._quick is None:
            self._quick = Quick(self)
        return self._quick


class Quick:
    """Where a quick command runs: through the agent's control socket when an agent on
    this state dir answers for the same store, else on the store itself. Either way the
    same function of runners/quick/ops.py does the work."""

    def __init__(self, env: Env) -> None:
        self.env = env
        self._client: Any = None
        self._tried = False

    @property
    def via_agent(self) -> bool:
        return self._connect() is not None

    def _connect(self) -> Any:
        if not self._tried:
            from runners.quick.client import Client

            self._tried = True
            self._client = Client.connect(self.env.state_dir, self.env.db)
            if self._client is not None:
                opened.append(self._client)
        return self._client

    def drop(self) -> None:
        if self._client is not None:
            self._client.dispose()
        self._client, self._tried = None, True

    def call(self, op: str, **args: Any) -> Any:
        from runners.quick import client

        c = self._connect()
        if c is not None and op in client.INTENTS and not self._answers(c):
            c = None  # stopped or wedged: nothing is sent it, the intent goes to the store
        if c is not None:
            try:
                # A read that the agent is slow to answer (stopped, wedged) is read from the
                # store instead; an intent waits longer (a deploy stages its build first).
                return c.call(op, client.REPLY_TIMEOUT if op in client.INTENTS
                              else client.READ_TIMEOUT, **args)
            except client.OtherStore:
                self.drop()
            except client.Lost as exc:
                self.drop()
                if op in client.INTENTS:
                    what = f"{op} of {args.get('name')}"
                    raise VigilError(f"the agent on {self.env.state_dir} ended before it "
                                     f"answered ({exc}): the {what} may or may not be written",
                                     f"see `vigil obligations` and `vigil events "
                                     f"{args.get('name')}`") from None
                # a read: the store gives the same answer
        return self.direct(op, **args)

    def _answers(self, c: Any) -> bool:
        """Before an intent is sent: the agent answers at all (a SIGSTOPped agent's socket
        still takes connections). Otherwise the intent goes to the store, never in doubt."""
        from runners.quick import client

        try:
            c.call("hello", client.CONNECT_TIMEOUT)
            return True
        except (client.Lost, client.OtherStore, VigilError):
            self.drop()
            return False

    def direct(self, op: str, **args: Any) -> Any:
        from runners.quick import ops

        out = ops.run(self.env.store(), self.env.state_dir, op, args)
        if op in ops.INTENTS:  # this box's agent; the boxes it is for: rung by the store
            ring_doorbell(self.env.state_dir)
        return out

    def no_agent_guard(self, what: str, where: Callable[[], str | None] = lambda: None
                       ) -> Callable[[float], None]:
        """For poll(): raise, one line, once no agent has acted for NO_AGENT_GRACE seconds
        (an agent being restarted takes its lock again within that). `where`: the state or
        step the row was last read at (None or `queued`: no agent has taken it on)."""
        absent: list[float] = []
        checked: list[float] = [-1.0]

        def idle(elapsed: float) -> None:
            if self.via_agent or elapsed - checked[0] < 0.25:
                return
            checked[0] = elapsed
            from runners.quick import ops

            if ops.agent_acting(self.env.store(), self.env.state_dir):
                absent.clear()
                return
            if not absent:
                absent.append(elapsed)
            elif elapsed - absent[0] >= NO_AGENT_GRACE:
                at = where()
                # An agent that died mid-way left its last step written: the next goes on.
                ends = ("stays queued until one runs" if at in (None, "queued") else
                        f"was at {at} when its agent went; the next agent goes on from there")
                raise VigilError(f"no agent is running on {self.env.state_dir}: {what} {ends}",
                                 "start it with `vigil agent start` (the intent is kept; "
                                 "see `vigil obligations`)")

        return idle


def ring_doorbell(state_dir: Path) -> None:
    """A new intent row is in the store: ring this box's agent. On PostgreSQL the row's own
    trigger rang the boxes its host is placed on (migration 0031, runners/base/wakeup.py)."""
    from runners.base.doorbell import ring as ring_agent

    ring_agent(state_dir)


def ring(env: Env) -> None:
    """A change tied to no box (a rollout's pause, a host's config, whose placement may
    have just moved): ring this box's agent and, on PostgreSQL, every box's."""
    from runners.base.wakeup import notify_boxes

    ring_doorbell(env.state_dir)
    notify_boxes(env.store())


def echo_json(data: Any) -> None:
    import json

    click.echo(json.dumps(data, indent=2, default=str))


def socket_options(group: str | None, mode: str | None) -> tuple[str | None, int | None]:
    from runners.backend.sockets import check_group, parse_mode

    try:
        if group is not None:
            check_group(group)
    except ValueError as exc:
        raise BadInput(f"--socket-group: {exc}", "name an existing group (see `getent group`)") from None
    try:
        return group, parse_mode(mode) if mode is not None else None
    except ValueError as exc:
        raise BadInput(f"--socket-mode: {exc}", "pass an octal mode such as 0660") from None


def poll(read: Callable[[], T], settled: Callable[[T, float], bool], *, timeout: float,
         late: Callable[[T], str], tick: Callable[[T, float], None] | None = None,
         idle: Callable[[float], None] | None = None,
         interval: float | Callable[[T], float] = 0.05,
         fix: str = "watch `vigil obligations`; the agent keeps working on it") -> T:
    """The loop of every --wait: read, report (`tick`), stop once `settled`; past `timeout`
    fail saying `late(last value)` (where it still is). `idle(elapsed)` runs between reads
    (it may raise: no agent). `interval`: the pause between reads, or after a given value."""
    started = time.monotonic()
    while True:
        value = read()
        elapsed = time.monotonic() - started
        if tick is not None:
            tick(value, elapsed)
        if settled(value, elapsed):
            return value
        if elapsed > timeout:
            raise VigilError(f"timed out after {timeout:.0f}s: {late(value)}", fix)
        if idle is not None:
            idle(elapsed)
        pause = interval(value) if callable(interval) else interval
        if pause > 0:
            time.sleep(pause)
