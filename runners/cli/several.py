"""What a command over several hosts shares (`wake`, `stop`, `restart`, `status`): HOST
arguments that may be names or globs (`'web*'`), or `--all`, resolved once against the
hosts the store knows before any intent is written; then each host its own request, a
failure of one said on its own line without stopping the others, and the command's exit
code non-zero when any failed."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from typing import Any, TypeVar

import click

from models.errors import BadInput, NotFound, VigilError
from runners.cli.common import Env

T = TypeVar("T")
GLOB = frozenset("*?[")


def targets(f: Callable[..., Any]) -> Callable[..., Any]:
    """The HOST... argument and --all, as decorators."""
    f = click.option("--all", "every", is_flag=True, help="Every host the store knows.")(f)
    return click.argument("names", nargs=-1, metavar="HOST...")(f)


def resolve(env: Env, patterns: tuple[str, ...], every: bool, *,
            required: bool = True) -> list[str]:
    """The hosts named: each name must exist and each glob match at least one (else one
    line, nothing written). One plain name is passed as it is: its command's own request
    says when it does not exist, as it always did."""
    if every and patterns:
        raise BadInput("give host names or --all, not both", "drop the names, or drop --all")
    if not every and not patterns:
        if not required:
            return []
        raise BadInput("no host given", "name one or several (HOST..., a glob such as "
                       "'web*'), or give --all")
    if not every and len(patterns) == 1 and not GLOB & set(patterns[0]):
        return list(patterns)
    known: list[str] = env.quick().call("names")
    if every:
        if not known:
            raise NotFound("no hosts are defined", "add one with `vigil host add`")
        return known
    out: list[str] = []
    for p in patterns:
        if GLOB & set(p):
            hits = [n for n in known if fnmatch.fnmatchcase(n, p)]
            if not hits:
                raise NotFound(f"no host matches {p!r}", "see `vigil host list`")
        elif p in known:
            hits = [p]
        else:
            raise NotFound(f"no host named {p!r}", "see `vigil host list`")
        out += [h for h in hits if h not in out]
    return out


class Each:
    """Runs one host's part of a command. With one host an error is raised as it is (its
    one line, its exit code); with several it is said on its own line and the others go on;
    `end()` then raises one line naming every host that failed."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.failed: list[tuple[str, VigilError]] = []

    def run(self, host: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T | None:
        if len(self.names) == 1:
            return fn(*args, **kwargs)
        try:
            return fn(*args, **kwargs)
        except VigilError as exc:
            click.echo(f"vigil: error: {exc.line()}", err=True)
            self.failed.append((host, exc))
            return None

    def end(self, verb: str) -> None:
        if not self.failed:
            return
        hosts = ", ".join(n for n, _ in self.failed)
        err = VigilError(f"{verb} failed for {len(self.failed)} of {len(self.names)} hosts "
                         f"({hosts})", "see each host's line above")
        err.exit_code = self.failed[0][1].exit_code
        raise err
