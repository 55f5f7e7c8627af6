"""`vigil logs HOST...`: the apps' output, each line prefixed by the generation that wrote
it (and its host, when several are shown), merged in the order the lines were written by
the times the log keeper records (runners/cli/loglines.py). Each generation has its own
file (runners/keepers/logkeeper.py), so the two of an overlap deploy never tear each
other's lines nor race a rotation."""

from __future__ import annotations

import json
import os
import re
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import click

from models.durations import AGE_UNITS
from models.errors import BadInput, NotFound
from runners.base.controls import escape_controls
from runners.cli.common import Env
from runners.cli.loglines import End, Following, Line, merged

_ANY = re.compile(r"g(\d+)\.log(?:\.(\d+))?")
DEFAULT_LINES = 50


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


class Since(click.ParamType):
    """How far back: a number and a unit (s, m, h, d, w: `10m`, `2h`), a bare number being
    seconds; refused in one line before anything is read."""

    name = "age"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        t = str(value).strip().lower()
        unit = t[-1:] if t[-1:] in AGE_UNITS else "s"
        try:
            seconds = float(t[:-1] if t[-1:] in AGE_UNITS else t) * AGE_UNITS[unit]
        except ValueError:
            seconds = -1.0
        if not 0 < seconds < float("inf"):
            raise BadInput(f"--since {value!r} is not a time back from now",
                           "give e.g. --since 10m (units s, m, h, d, w)")
        return seconds


class Shown:
    """How each line is printed: `[time] [host] gN | text`, or one JSON object a line."""

    def __init__(self, several: bool, stamps: bool, as_json: bool) -> None:
        self.several, self.stamps, self.as_json = several, stamps, as_json
        self.tty = sys.stdout.isatty()

    def __call__(self, line: Line) -> None:
        text = line.text.decode(errors="replace")
        at = datetime.fromtimestamp(line.at, UTC)
        if self.as_json:
            click.echo(json.dumps({"at": _iso(at, "microseconds"), "host": line.host,
                                   "generation": line.gen, "line": text}))
            return
        shown = escape_controls(text) if self.tty else text  # an app's ESC sequences
        # would act on the operator's terminal; a pipe or a file gets them as written
        prefix = f"{_iso(at, 'milliseconds')} " if self.stamps else ""
        prefix += f"{line.host} " if self.several else ""
        click.echo(f"{prefix}g{line.gen} | {shown}", color=not self.tty)  # no stripping


def _iso(at: datetime, timespec: str) -> str:
    return at.isoformat(timespec=timespec).replace("+00:00", "Z")


@click.command("logs")
@click.argument("names", nargs=-1)
@click.option("--all", "every", is_flag=True, help="Every host's output, merged by time.")
@click.option("--generation", "-g", "only", type=click.IntRange(min=1), default=None,
              help="Only generation N's output (see `vigil status` or `vigil events`).")
@click.option("--run", "run_id", type=click.IntRange(min=1), default=None,
              help="Only a job's run N's output (its generation; see `vigil runs NAME`).")
@click.option("--lines", "-n", type=click.IntRange(min=0), default=None,
              help=f"How many of the last lines to print [default: {DEFAULT_LINES}; with "
                   "--since, every line since then].")
@click.option("--since", type=Since(), default=None,
              help="Only the lines written in the last AGE (10m, 2h, 1d).")
@click.option("--follow", "-f", is_flag=True,
              help="Keep printing new lines, a new generation's too (Ctrl-C to end).")
@click.option("--timestamps/--no-timestamps", "-t", "stamps", default=None,
              help="Print when each line was written [default: on with --follow over "
                   "several hosts].")
@click.option("--json", "as_json", is_flag=True,
              help="One JSON object a line: at, host, generation, line.")
@click.pass_obj
def logs(env: Env, names: tuple[str, ...], every: bool, only: int | None, run_id: int | None,
         lines: int | None, since: float | None, follow: bool, stamps: bool | None,
         as_json: bool) -> None:
    """The apps' output (stdout and stderr) in the order it was written, each line prefixed
    with the generation that wrote it (`g17 | ...`) and, with several hosts, the host's
    name. Each generation's file is capped and rotated by the agent's --log-max-bytes and
    --log-files."""
    if run_id is not None:
        only = _run_generation(env, names, every, only, run_id)
    hosts = _hosts(env, names, every, only)
    several = every or len(hosts) > 1
    shown = Shown(several, stamps if stamps is not None else follow and several, as_json)
    sources = [(h, env.state_dir / "logs" / h) for h in hosts]
    picked = [(h, d, _generations(env, h, d, only, follow)) for h, d in sources]
    want = lines if lines is not None else (None if since is not None else DEFAULT_LINES)
    ends: dict[tuple[str, int], End] | None = {} if follow else None
    printed: set[str] = set()
    for line in merged(picked, want, time.time() - since if since is not None else None, ends):
        printed.add(line.host)
        shown(line)
    if ends is None and want != 0:  # files there, and empty (or nothing that recent)
        for h, d, gens in picked:
            if gens and h not in printed:
                when = " in that time" if since is not None else " yet"
                click.echo(f"vigil: no output of {h}{when} ({d})", err=True)
    if ends is not None:  # from exactly where that print stopped
        _follow(sources, only, shown, env.state_dir / "logs" if every else None, ends)


def _run_generation(env: Env, names: tuple[str, ...], every: bool, only: int | None,
                    run_id: int) -> int:
    """--run N: the generation a job's run ran as, read from the store."""
    if only is not None or every or len(names) != 1:
        raise BadInput("--run names one job's run", "give exactly one host with --run, "
                       "and no --generation or --all")
    from workflows.config.jobview import run_generation

    return env.store().read(lambda s: run_generation(s, names[0], run_id))


def _hosts(env: Env, names: tuple[str, ...], every: bool, only: int | None) -> list[str]:
    if every and names:
        raise BadInput("--all and host names were both given", "give one or the other")
    if not every and not names:
        raise BadInput("no host given", "give a host (`vigil logs web`), several, or --all")
    if only is not None and (every or len(names) != 1):
        raise BadInput("--generation names one host's generation",
                       "give exactly one host with --generation")
    if every:
        return sorted(d.name for d in (env.state_dir / "logs").glob("*/")
                      if not d.name.startswith("."))
    return list(dict.fromkeys(names))


def _generations(env: Env, name: str, directory: Path, only: int | None,
                 follow: bool) -> list[int]:
    gens = generations(directory)
    if not gens:
        env.quick().call("status", name=name)  # an unknown host: `no host named ...`
        if not follow:
            click.echo(f"vigil: no output of {name} yet ({directory})", err=True)
    if only is not None:
        if only not in gens and not follow:
            raise NotFound(f"no output of generation {only} of {name} is kept",
                           f"see which are with `vigil logs {name}` (the newest "
                           "generations' files are kept)")
        return [only]
    return gens


def _follow(sources: list[tuple[str, Path]], only: int | None, shown: Shown,
            root: Path | None, ends: dict[tuple[str, int], End], interval: float = 0.2) -> None:
    """Print what is appended to each generation's file, across rotations and new
    generations (and, with --all, new hosts), merged by time, until SIGTERM or Ctrl-C:
    a generation the first print read from where it stopped (`ends`), any other from its
    start (one that began meanwhile has lines no print showed)."""
    import signal

    stop = [False]

    def on_term(*_: object) -> None:
        stop[0] = True

    previous = signal.signal(signal.SIGTERM, on_term)
    followed: dict[tuple[str, int], Following] = {}
    try:
        while True:
            last = stop[0]  # after SIGTERM, one more pass: what was written before it prints
            if root is not None:  # --all: a host whose output dir appears joins
                sources = _all_sources(root, sources)
            for host, directory in sources:
                for n in generations(directory):
                    if (only is None or n == only) and (host, n) not in followed:
                        followed[host, n] = Following(host, directory, n, ends.get((host, n)))
            batch = [line for f in followed.values() for line in f.lines()]
            for line in sorted(batch, key=lambda line: line.at):
                shown(line)
            if last:
                break
            time.sleep(interval)
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        for f in followed.values():
            f.close()


def _all_sources(root: Path, sources: list[tuple[str, Path]]) -> list[tuple[str, Path]]:
    known = {h for h, _ in sources}
    new = [(d.name, d) for d in sorted(root.glob("*/"))
           if not d.name.startswith(".") and d.name not in known]
    return sources + new
