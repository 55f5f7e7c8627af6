"""`vigil completion bash|zsh|fish`: click's own shell completion, with host names and
generation numbers read from the store. A completion runs at every TAB, so it takes the light
path: the SQLite file through the standard library's sqlite3 (PostgreSQL through psycopg, the
driver alone), never SQLAlchemy or the models; a store it cannot read completes nothing."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import click
from click.shell_completion import CompletionItem, get_completion_class

SHELLS = ("bash", "zsh", "fish")
COMPLETE_VAR = "_VIGIL_COMPLETE"  # click's default for prog_name "vigil"
NEW_NAMES = {("host", "add")}  # a new host's name: nothing stored to complete it from
TIMEOUT = 1.0  # seconds a completion waits for a busy store


@click.command("completion")
@click.argument("shell", type=click.Choice(SHELLS))
@click.pass_context
def completion(ctx: click.Context, shell: str) -> None:
    """The shell code that completes vigil's commands, options, host names and generation
    numbers, e.g. `eval "$(vigil completion bash)"` in ~/.bashrc (zsh: ~/.zshrc; fish:
    `vigil completion fish | source` in ~/.config/fish/config.fish)."""
    cls = get_completion_class(shell)
    if cls is None:  # click.Choice has refused any other shell already
        raise click.BadParameter(shell)
    click.echo(cls(ctx.find_root().command, {}, "vigil", COMPLETE_VAR).source())


def where(ctx: click.Context) -> tuple[Path, str | None]:
    """The state dir and database URL the command being completed would use: its --state-dir
    and --db as typed so far, else the environment, else the nearest .vigil."""
    from runners.cli.common import default_state_dir, unsafe_default

    root = ctx.find_root().params
    state_dir = root.get("state_dir") or os.environ.get("VIGIL_HOME")
    db = root.get("db") or os.environ.get("VIGIL_DB")
    if state_dir:
        return Path(state_dir).absolute(), db
    found = default_state_dir(Path.cwd())
    refusal = unsafe_default(found)
    if refusal is not None:  # read no store a planted link aims at (query offers nothing)
        raise refusal
    return found, db


def query(ctx: click.Context, sql: str, *args: Any) -> list[Any]:
    """The first column of `sql`'s rows (`?` placeholders), from the store read-only."""
    try:
        state_dir, db = where(ctx)
        if db and db.startswith("postgresql"):
            return _postgresql(db, sql, args)
        path = (db.split(":///", 1)[1] if db and db.startswith("sqlite:///")
                else str(state_dir / "vigil.db"))
        return _sqlite(path, sql, args) if os.path.exists(path) else []
    except Exception:  # noqa: BLE001  (a store it cannot read: nothing to offer, no traceback at TAB)
        return []


def _sqlite(path: str, sql: str, args: tuple[Any, ...]) -> list[Any]:
    import sqlite3

    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=TIMEOUT)
    try:
        return [r[0] for r in conn.execute(sql, args)]
    finally:
        conn.close()


def _postgresql(url: str, sql: str, args: tuple[Any, ...]) -> list[Any]:
    import psycopg

    url = url.replace("postgresql+psycopg://", "postgresql://", 1)
    with psycopg.connect(url, connect_timeout=int(TIMEOUT) + 1, prepare_threshold=None) as conn:
        return [r[0] for r in conn.execute(sql.replace("?", "%s"), args)]  # type: ignore[arg-type]


def hosts(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[CompletionItem]:
    like = incomplete.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
    names = query(ctx, "SELECT name FROM hosts WHERE name LIKE ? ESCAPE '\\' ORDER BY name", like)
    typed = set(ctx.params.get(param.name or "") or ()) if param.nargs != 1 else set()
    return [CompletionItem(n) for n in names if n not in typed]  # not offered twice


def generations(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[CompletionItem]:
    """The host's generations, newest first (the host is the command's NAME argument)."""
    host = ctx.params.get("name") or typed_host(ctx)
    if not host:
        return []
    found = query(ctx, "SELECT id FROM generations WHERE host = ? ORDER BY id DESC", host)
    return [CompletionItem(str(n)) for n in found if str(n).startswith(incomplete)]


def typed_host(ctx: click.Context) -> str | None:
    """NAME as typed before an option still waiting for its value (`vigil logs web -g <TAB>`):
    click's parse stops at that option, before the arguments; the words every shell's
    completion passes in COMP_WORDS still have it."""
    from click.shell_completion import split_arg_string

    words = [w for w in split_arg_string(os.environ.get("COMP_WORDS", ""))[1:]
             if not w.startswith("-")]
    if ctx.info_name not in words:
        return None
    after = words[words.index(ctx.info_name) + 1:]
    for word in after:
        if query(ctx, "SELECT name FROM hosts WHERE name = ?", word):
            return word
    return None


def attach(command: click.Command, path: tuple[str, ...]) -> None:
    """Give the host arguments (NAME, HOST...) and --generation options of `command` (at
    `path`, e.g. ("host", "add")) and of its subcommands their completion from the store; a
    command module declares none of it itself."""
    if isinstance(command, click.Group):
        for name, sub in command.commands.items():
            attach(sub, (*path, name))
        return
    for param in command.params:
        if isinstance(param, click.Argument) and param.name in ("name", "names") \
                and path not in NEW_NAMES:
            param._custom_shell_complete = hosts
        elif isinstance(param, click.Option) and "--generation" in param.opts:
            param._custom_shell_complete = generations
