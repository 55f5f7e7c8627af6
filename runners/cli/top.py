"""`vigil top`: a live view of every host, read-only from the store, redrawn about once a
second; `q` quits, the arrow keys and PgUp/PgDn scroll. Not on a terminal, it prints one
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
    the last events. q quits; arrows, PgUp/PgDn scroll. Not on
    a terminal: one plain table of every host."""
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
    offset, fit = 0, 1
    with keys() as fd, Live(console=console, screen=True, auto_refresh=False) as view:
        due = 0.0
        while True:
            if time.monotonic() >= due:
                fit, events = fit_rows(console.size.height)
                frame = read(store, env.state_dir, env.db, offset, fit, events, sampler)
                offset = frame.offset
                view.update(screen(frame, time.strftime("%H:%M:%S")), refresh=True)
                due = time.monotonic() + interval
            key = next_key(fd, max(0.0, due - time.monotonic()))
            if key in QUIT:
                return
            moved = scrolled(key, offset, fit)
            if moved != offset:
                offset, due = moved, 0.0  # redrawn at once


def scrolled(key: bytes | None, offset: int, fit: int) -> int:
    """The first row shown after `key` (read() keeps it within the hosts)."""
    if key in UP:
        return max(0, offset - 1)
    if key in DOWN:
        return offset + 1
    if key in PAGE_UP:
        return max(0, offset - fit)
    if key in PAGE_DOWN:
        return offset + fit
    if key in HOME:
        return 0
    if key in END:
        return 1 << 30
    return offset


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
