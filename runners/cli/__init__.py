"""`vigil`: the one command. Everything but `vigil agent` writes intents to the store or
reads it, so it works whether the agent is up or down.

The group and main() live here; each topic's commands in a module of its own (hostcmds,
lifecycle, inspect, agent, db, schedule). Command modules import only click and the light
parts of models at import time: `vigil --help` must not pay for SQLAlchemy."""

from __future__ import annotations

import sys

import click

from models.errors import BadInput, VigilError
from runners.cli import (
    agent,
    completion,
    db,
    hostcmds,
    hostedit,
    importcmd,
    inspect,
    jobcmds,
    lifecycle,
    logs,
    notify,
    reloadcmds,
    schedule,
    teardown,
    top,
    ui,
)
from runners.cli.common import Env, opened
from runners.cli.rollout import rollout


@click.group()
@click.version_option(package_name="vigil", prog_name="vigil", message="%(prog)s %(version)s")
@click.option("--state-dir", envvar="VIGIL_HOME", default=None,
              help="State directory (env VIGIL_HOME; default: the nearest .vigil in the "
                   "current directory or above it, else ./.vigil).")
@click.option("--db", envvar="VIGIL_DB", default=None,
              help="Database URL overriding the SQLite file in the state dir (env VIGIL_DB).")
@click.option("--listen-db", envvar="VIGIL_LISTEN_DB", default=None,
              help="When --db is a pooler in transaction mode (PgBouncer): a direct URL of the "
                   "PostgreSQL server, for the agent's LISTEN session (env VIGIL_LISTEN_DB).")
@click.pass_context
def cli(ctx: click.Context, state_dir: str | None, db: str | None, listen_db: str | None) -> None:
    """vigil: a crash-safe process activator."""
    ctx.obj = Env(state_dir, db, listen_db)


for command in (db.db, hostcmds.host, hostcmds.apply_cmd, lifecycle.wake, lifecycle.stop,
                lifecycle.deploy, lifecycle.retry, lifecycle.restart, inspect.gc, inspect.status_cmd,
                inspect.obligations, inspect.events, logs.logs, schedule.schedule, inspect.check,
                inspect.crashpoints, agent.agent, rollout, teardown.shutdown, top.top,
                ui.ui, completion.completion, notify.notify, lifecycle.scale,
                importcmd.import_cmd):
    cli.add_command(command)
cli.add_command(jobcmds.runs)  # a job's runs, and one now
cli.add_command(jobcmds.run)
cli.add_command(reloadcmds.reload)  # vigil reload, vigil signal
cli.add_command(reloadcmds.signal_cmd)
hostedit.attach(hostcmds.host)
completion.attach(cli)  # host names and generations from the store, on the light path


def not_utf8(args: list[str]) -> BadInput | None:
    """An argument whose bytes are not UTF-8 (Python holds them as lone surrogates): names
    and paths are stored and sent as UTF-8 text, so it is refused before anything is done."""
    for arg in args:
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError:
            shown = arg.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
            return BadInput(f"argument {shown!r} is not valid UTF-8 (vigil keeps names and "
                            "paths as UTF-8 text)", "rename the file or directory to a UTF-8 "
                            "name, or pass a UTF-8 path to it (a symlink)")
    return None


def main(argv: list[str] | None = None) -> None:
    try:
        bad = not_utf8(sys.argv[1:] if argv is None else argv)
        if bad is not None:
            raise bad
        cli.main(args=argv, prog_name="vigil", standalone_mode=False)
    except click.exceptions.Abort:
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except VigilError as exc:
        click.echo(f"vigil: error: {exc.line()}", err=True)
        sys.exit(exc.exit_code)
    except Exception as exc:  # an OSError or the store's own failure (a DBAPIError): one line
        ours = isinstance(exc, OSError) or type(exc).__module__.split(".")[0] == "sqlalchemy"
        trouble = store_trouble(exc) if ours else None
        if trouble is None:
            raise
        click.echo(f"vigil: error: {trouble.line()}", err=True)
        sys.exit(trouble.exit_code)
    finally:
        while opened:
            opened.pop().dispose()


def store_trouble(exc: BaseException) -> VigilError | None:
    """A failure of the store itself (full, read-only, damaged, unreachable), as one line."""
    from models.store import Store
    from models.trouble import diagnose, explain

    trouble = diagnose(exc)
    if trouble is None:
        return None
    stores = [o for o in opened if isinstance(o, Store)]
    if stores:
        store = stores[-1]
        holder = store.lock_holder() if trouble.kind == "locked" else None
        return explain(trouble, store.url, holder=holder)
    env = click.get_current_context(silent=True)
    url = "sqlite:///vigil.db"
    if env is not None and isinstance(env.obj, Env):
        url = env.obj.db or f"sqlite:///{env.obj.state_dir / 'vigil.db'}"
    return explain(trouble, url)


if __name__ == "__main__":
    main()
