"""`vigil logs HOST`: an app's output, each line prefixed by the generation that wrote it.

Each generation writes its own file, `<state>/logs/<host>/g<N>.log` (rotated to .1, .2, ...
by the box's log keeper, runners/keepers/logkeeper.py): two generations run at once during an overlap
deploy, and with a file each neither can tear the other's lines nor race its rotation."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import click

from models.errors import NotFound
from runners.base.controls import escape_controls
from runners.cli.common import Env

_BASE = re.compile(r"g(\d+)\.log")
_ANY = re.compile(r"g(\d+)\.log(?:\.(\d+))?")
BLOCK = 1 << 16


REMOVED = ".removed"  # <state>/logs/.removed/<host>-<time>: the output of removed hosts


def set_aside(state_dir: Path, name: str) -> None:
    """After `host rm` (or apply's removal) commits: the removed host's output moves to
    logs/.removed/<name>-<UTC time>, so a host added again under the name starts with
    none (before, `vigil logs` showed the old host's lines as its own). Kept there for
    the operator; nothing of vigil reads or prunes it."""
    import time

    directory = state_dir / "logs" / name
    if not directory.is_dir():
        return
    aside = state_dir / "logs" / REMOVED
    aside.mkdir(mode=0o700, exist_ok=True)
    try:
        directory.rename(aside / f"{name}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}")
    except OSError as exc:
        click.echo(f"vigil: the output of removed host {name} stays in {directory} ({exc})",
                   err=True)


def generations(directory: Path) -> list[int]:
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return sorted({int(m[1]) for n in names if (m := _ANY.fullmatch(n))})


def files_of(directory: Path, n: int) -> list[Path]:
    """Generation n's files, oldest first (g<n>.log.2, g<n>.log.1, g<n>.log)."""
    rotated = []
    for name in os.listdir(directory):
        m = _ANY.fullmatch(name)
        if m and int(m[1]) == n and m[2] is not None:
            rotated.append((int(m[2]), directory / name))
    out = [p for _, p in sorted(rotated, reverse=True)]
    base = directory / f"g{n}.log"
    return [*out, base] if base.exists() else out


def tail(path: Path, want: int) -> list[bytes]:
    """The last `want` lines of a file, read backwards by blocks (a file may be large)."""
    if want <= 0:
        return []
    try:
        f = open(path, "rb")
    except OSError:
        return []
    with f:
        end = f.seek(0, os.SEEK_END)
        data = b""
        pos = end
        while pos > 0 and data.count(b"\n") <= want:
            step = min(BLOCK, pos)
            pos -= step
            f.seek(pos)
            data = f.read(step) + data
    lines = data.splitlines()
    return lines[-want:]


def last_lines(directory: Path, gens: list[int], want: int) -> list[tuple[int, bytes]]:
    out: list[tuple[int, bytes]] = []
    for n in reversed(gens):  # newest first until enough
        for path in reversed(files_of(directory, n)):
            if len(out) >= want:
                break
            out = [(n, line) for line in tail(path, want - len(out))] + out
    return out[-want:] if want else []


def emit(n: int, line: bytes, tty: bool = False) -> None:
    """One line of output; on a terminal its control bytes escaped (an app's ESC sequences
    would act on the operator's terminal), elsewhere (a pipe, a file) as the app wrote them."""
    text = line.decode(errors="replace")
    click.echo(f"g{n} | {escape_controls(text) if tty else text}", color=not tty)  # no stripping


@click.command("logs")
@click.argument("name")
@click.option("--generation", "-g", "only", type=click.IntRange(min=1), default=None,
              help="Only generation N's output (see `vigil status` or `vigil events`).")
@click.option("--lines", "-n", type=click.IntRange(min=0), default=50, show_default=True,
              help="How many of the last lines to print.")
@click.option("--follow", "-f", is_flag=True,
              help="Keep printing new lines, a new generation's too (Ctrl-C to end).")
@click.pass_obj
def logs(env: Env, name: str, only: int | None, lines: int, follow: bool) -> None:
    """An app's output (stdout and stderr), each line prefixed with the generation that
    wrote it (`g17 | ...`). Each generation's file is capped and rotated by the agent's
    --log-max-bytes and --log-files."""
    directory = env.state_dir / "logs" / name
    gens = generations(directory)
    if not gens:
        env.quick().call("status", name=name)  # an unknown host: `no host named ...`
        if not follow:
            click.echo(f"vigil: no output of {name} yet ({directory})", err=True)
            return
    if only is not None:
        if only not in gens and not follow:
            raise NotFound(f"no output of generation {only} of {name} is kept",
                           f"see which are with `vigil logs {name}` (the newest "
                           "generations' files are kept)")
        gens = [only]
    tty = sys.stdout.isatty()
    for n, line in last_lines(directory, gens, lines):
        emit(n, line, tty)
    if follow:
        _follow(directory, only, tty)


def _follow(directory: Path, only: int | None, tty: bool, interval: float = 0.2) -> None:
    """Print what is appended to each generation's file, across rotations and new
    generations, until SIGTERM or Ctrl-C."""
    import signal
    import time

    stop = [False]

    def on_term(*_: object) -> None:
        stop[0] = True

    previous = signal.signal(signal.SIGTERM, on_term)
    opened: dict[int, tuple[object, int]] = {}  # generation -> (file, inode)
    partial: dict[int, bytes] = {}
    try:
        for n in generations(directory):  # start at the end of what was printed
            if only is None or n == only:
                _open(opened, directory, n, at_end=True)
        while True:
            last = stop[0]  # after SIGTERM, one more pass: what was written before it prints
            for n in generations(directory):
                if (only is None or n == only) and n not in opened:
                    _open(opened, directory, n, at_end=False)  # a new generation: all of it
            for n in list(opened):
                f, inode = opened[n]
                data = partial.pop(n, b"") + f.read()  # type: ignore[attr-defined]
                *done, rest = data.split(b"\n")
                for line in done:
                    emit(n, line, tty)
                if rest:
                    partial[n] = rest
                try:
                    now = os.stat(directory / f"g{n}.log").st_ino
                except FileNotFoundError:
                    continue
                if now != inode:  # rotated: the old file is drained, go on in the new one
                    f.close()  # type: ignore[attr-defined]
                    _open(opened, directory, n, at_end=False)
            if last:
                break
            time.sleep(interval)
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        for f, _ in opened.values():
            f.close()  # type: ignore[attr-defined]


def _open(opened: dict[int, tuple[object, int]], directory: Path, n: int, at_end: bool) -> None:
    try:
        f = open(directory / f"g{n}.log", "rb")
    except FileNotFoundError:
        return
    if at_end:
        f.seek(0, os.SEEK_END)
    opened[n] = (f, os.fstat(f.fileno()).st_ino)
