"""`vigil`: the one command. Everything but `vigil agent` writes intents to the store or
reads it, so it works whether the agent is up or down.

The group and main() live here; each topic's commands in a module of its own (hostcmds,
lifecycle, inspect, agent, db, schedule), imported when one of its commands runs. Command modules import only click and the light
parts of models at import time: `vigil --help` must not pay for SQLAlchemy."""

from __future__ import annotations

import importlib
import sys

import click

from models.errors import BadInput, VigilError
from runners.cli import completion
from runners.cli.common import Env, opened

# Each command by the module that defines it (module:attribute), imported only when that
# command is asked for: a run of one command (`vigil agent` above all) imports click and its
# own module, not the 28 others (33 ms of CPU of every start on the development machine).
# `vigil --help` lists them all, so it loads them all.
COMMANDS = {
    "agent": "agent:agent", "apply": "hostcmds:apply_cmd", "check": "inspect:check",
    "completion": "completion:completion", "crashpoints": "inspect:crashpoints", "db": "db:db",
    "deploy": "lifecycle:deploy", "events": "inspect:events", "gc": "inspect:gc",
    "host": "hostcmds:host", "import": "importcmd:import_cmd", "logs": "logs:logs",
    "notify": "notify:notify", "obligations": "inspect:obligations", "reload": "reloadcmds:reload",
    "restart": "lifecycle:restart", "retry": "lifecycle:retry", "rollout": "rollout:rollout",
    "run": "jobcmds:run", "runs": "jobcmds:runs", "scale": "lifecycle:scale",
    "schedule": "schedule:schedule", "shutdown": "teardown:shutdown",
    "signal": "reloadcmds:signal_cmd", "status": "inspect:status_cmd", "stop": "lifecycle:stop",
    "top": "top:top", "ui": "ui:ui", "wake": "lifecycle:wake",
}


class Commands(click.Group):
    """vigil's group: a command of COMMANDS is loaded the first time it is asked for."""

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in COMMANDS:
            module, _, attr = COMMANDS[cmd_name].partition(":")
            command = getattr(importlib.import_module(f"runners.cli.{module}"), attr)
            if cmd_name == "host":
                from runners.cli.hostedit import attach

                attach(command)  # vigil host show|set
            completion.attach(command, (cmd_name,))  # host names and generations from the store
            self.commands[cmd_name] = command
        return super().get_command(ctx, cmd_name)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self.commands, *COMMANDS})

    def resolve_command(self, ctx: click.Context,
                        args: list[str]) -> tuple[str | None, click.Command | None, list[str]]:
        try:
            return super().resolve_command(ctx, args)
        except click.exceptions.NoSuchCommand as exc:  # "Did you mean": from every name
            raise click.exceptions.NoSuchCommand(exc.command_name, possibilities=COMMANDS,
                                                 ctx=ctx) from None


@click.group(cls=Commands)
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
