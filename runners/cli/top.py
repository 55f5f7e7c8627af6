"""`vigil top`: a live view of every host from the store, redrawn about once a second; `q`
quits, the arrow keys and PgUp/PgDn move the selected host (the rows follow it), r, s and w
restart, stop or wake it after a confirmation line (y). Not on a terminal, it prints one
plain table and ends. The rows and how they are drawn: runners/cli/topview.py."""

from __future__ import annotations

import os
import select
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import click

from runners.cli.common import SECONDS, Env

# Keys, as a terminal sends them: scrolling by a row, a page, to either end.
UP = (b"\x1b[A", b"\x1bOA", b"k")
DOWN = (b"\x1b[B", b"\x1bOB", b"j")
PAGE_UP = (b"\x1b[5~", b"b")
PAGE_DOWN = (b"\x1b[6~", b" ")
HOME = (b"\x1b[H", b"\x1b[1~", b"\x1bOH", b"g")
END = (b"\x1b[F", b"\x1b[4~", b"\x1bOF", b"G")
QUIT = (b"q", b"Q", b"\x03", b"\x04")


class Quit(Exception):
    """SIGTERM or SIGHUP: leave the screen as it was found."""


@click.command()
@click.option("--interval", type=SECONDS, default=1.0, show_default=True,
              help="Seconds between two redraws.")
@click.pass_obj
def top(env: Env, interval: float) -> None:
    """A live view of every host: state, generation, pid, up time, restarts by cause
    (c crash, r restart, y recycle, v converge), health, CPU % and RSS of the whole
    generation, open obligations with their ages, the deploy or rollout in flight (a host
    of instances: its sums, then a line for each slot); under them the agent's line and
    the last events. q quits; arrows, PgUp/PgDn select a host; r, s, w restart, stop or
    wake it (y confirms). Not on a terminal: one plain table of every host."""
    from runners.cli.topview import Sampler, plain, read

    store = env.store()
    sampler = Sampler()
    if not (sys.stdout.isatty() and sys.stdin.isatty()):
        first = read(store, env.state_dir, env.db, 0, None, 0, sampler)
        if any(r["usage"] is not None for r in first.rows):  # CPU % is over an interval
            time.sleep(0.25)
            first = read(store, env.state_dir, env.db, 0, None, 0, sampler)
        click.echo(plain(first), nl=False)
        return
    live(env, sampler, interval)


def live(env: Env, sampler: Any, interval: float) -> None:
    from rich.console import Console
    from rich.live import Live

    from runners.cli.topview import fit_rows, read, screen

    console = Console()
    store = env.store()
    at = Cursor()
    with keys() as fd, Live(console=console, screen=True, auto_refresh=False) as view:
        due = 0.0
        while True:
            if time.monotonic() >= due:
                at.fit, events = fit_rows(console.size.height)
                frame = read(store, env.state_dir, env.db, at.offset, at.fit, events, sampler)
                at.shown(frame.offset, frame.total, [r["host"] for r in frame.rows])
                view.update(screen(frame, time.strftime("%H:%M:%S"), at.host, at.said),
                            refresh=True)
                due = time.monotonic() + interval
            key = next_key(fd, max(0.0, due - time.monotonic()))
            if key is None:
                continue
            if key in QUIT and at.asked is None:
                return
            if at.pressed(key, env):
                due = 0.0  # redrawn at once


class Cursor:
    """Which host is selected (the arrows and pages move it, the rows shown follow), and
    an action asked of it: r, s or w asks to confirm on the line under the table; y does
    it as `vigil restart|stop|wake HOST` does, and that line says what was queued."""

    def __init__(self) -> None:
        self.index, self.offset, self.fit, self.total = 0, 0, 1, 0
        self.hosts: list[str] = []  # the hosts shown, from self.offset
        self.asked: str | None = None  # the action waiting for its y
        self.said: tuple[str, str] | None = None  # (line, style) under the table

    @property
    def host(self) -> str | None:
        at = self.index - self.offset
        return self.hosts[at] if 0 <= at < len(self.hosts) else None

    def shown(self, offset: int, total: int, hosts: list[str]) -> None:
        """The frame read: the cursor kept on a host that is shown."""
        self.offset, self.total, self.hosts = offset, total, hosts
        if hosts:
            self.index = min(max(self.index, offset), offset + len(hosts) - 1)

    def pressed(self, key: bytes, env: Env) -> bool:
        """Whether the key changed what is shown."""
        if self.asked is not None:
            verb, self.asked = self.asked, None
            self.said = act(env, verb, self.host) if key in YES and self.host else \
                (f"{verb} of {self.host}: not done", "dim")
            return True
        if key in ACTIONS and self.host is not None:
            self.asked = ACTIONS[key]
            self.said = (f"{self.asked} {self.host}? y: yes, any other key: no", "bold yellow")
            return True
        moved = moved_to(key, self.index, self.fit, self.total)
        if moved == self.index:
            return False
        self.index, self.said = moved, None
        if key in PAGE_UP:  # a page moves the rows shown by a page too
            self.offset = max(0, self.offset - self.fit)
        elif key in PAGE_DOWN:
            self.offset += self.fit  # read() keeps it within the hosts
        elif key in HOME:
            self.offset = 0
        elif key in END:
            self.offset = 1 << 30
        elif self.index < self.offset:
            self.offset = self.index
        elif self.index >= self.offset + len(self.hosts):
            self.offset = self.index - max(1, len(self.hosts)) + 1
        return True


ACTIONS = {b"r": "restart", b"s": "stop", b"w": "wake"}
YES = (b"y", b"Y")


def act(env: Env, verb: str, host: str | None) -> tuple[str, str]:
    """The action through the function its command calls; the line saying what it did."""
    from models.errors import VigilError

    try:
        out = env.quick().call(verb, name=host, **({"mode": "overlap"} if verb == "restart"
                                                    else {}))
    except VigilError as exc:
        return f"{verb} of {host}: {exc.line()}", "bold red"
    if "attempt" in out:
        return f"{verb} of {host}: attempt #{out['attempt']} queued", "bold green"
    row = out.get("wake", out.get("id"))
    if row is None:
        return f"{verb} of {host}: nothing to do ({out.get('state') or 'awake'})", "bold"
    return f"{verb} of {host}: {'stop' if verb == 'stop' else 'wake'} #{row} queued", "bold green"


def moved_to(key: bytes, index: int, fit: int, total: int) -> int:
    """The host selected after `key`, within the hosts."""
    if key in UP:
        index -= 1
    elif key in DOWN:
        index += 1
    elif key in PAGE_UP:
        index -= fit
    elif key in PAGE_DOWN:
        index += fit
    elif key in HOME:
        index = 0
    elif key in END:
        index = total - 1
    return max(0, min(index, total - 1))


def next_key(fd: int, timeout: float) -> bytes | None:
    """One key (an escape sequence whole) typed within `timeout`, else None."""
    ready, _, _ = select.select([fd], [], [], timeout)
    if not ready:
        return None
    data = os.read(fd, 32)
    if not data:  # the terminal went away
        return b"q"
    return data


@contextmanager
def keys() -> Iterator[int]:
    """The terminal's keys one at a time, unechoed (cbreak), put back as they were at the
    end, whether `q`, Ctrl-C, SIGTERM or SIGHUP ends it."""
    import termios
    import tty

    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)

    def on_signal(*_: object) -> None:
        raise Quit()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        tty.setcbreak(fd)
        yield fd
    except (Quit, KeyboardInterrupt):
        pass
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
