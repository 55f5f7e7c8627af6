"""`vigil`: the one command. Everything but `vigil agent` writes intents to the store or
reads it, so it works whether the agent is up or down."""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import click
from sqlalchemy import func, select
from sqlalchemy.exc import DBAPIError

from models import schema
from models.durations import parse_seconds
from models.errors import BadInput, NotFound, VigilError
from models.states import Cause, HostKind, Mode, Outcome
from models.store import Store
from models.tables import Attempt, Event, Generation, Host, Release, Stop, Wake
from runners.cli_rollout import rollout
from runners.doorbell import agent_id, ring, running_agent_pid
from runners.files import stage_build
from runners.retention import keep_of, keep_options, summary
from runners.setup import make_context, open_store
from runners.wakeup import notify
from workflows import crash
from workflows.book import deploying_held, lift
from workflows.builds import collect, unreferenced
from workflows.deploy import last_failed, request_deploy
from workflows.hosts import (
    add_host,
    check_args,
    check_env,
    check_socket_room,
    record_build,
    remove_host,
    status,
)
from workflows.stop import request_stop
from workflows.wake import request_wake


def table(*columns: str) -> Any:
    from rich.table import Table  # rich is imported only when a table is printed

    return Table(*columns)


def show(t: Any) -> None:
    from rich.console import Console

    Console().print(t)


class Seconds(click.ParamType):
    """A duration option: finite, above 0, at most a day (models/durations.py), refused
    with one line before the command does anything."""

    name = "seconds"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        return parse_seconds(str(value), param.opts[0] if param else "a duration")


SECONDS = Seconds()

_opened: list[Store] = []  # disposed when the command ends (main may run in-process)


class Env:
    def __init__(self, state_dir: str, db: str | None) -> None:
        self.state_dir = Path(state_dir).absolute()
        self.db = db
        self._store: Store | None = None

    def store(self, *, create: bool = False, at_head: bool = True,
              lock_wait: float | None = None) -> Store:
        if self._store is None:
            from runners.setup import CLI_LOCK_WAIT

            self._store = open_store(self.state_dir, self.db, create=create,
                                     lock_wait=lock_wait or CLI_LOCK_WAIT)
            _opened.append(self._store)
            if at_head:
                schema.require_head(self._store.engine)
        return self._store


def _ring(env: Env) -> None:
    """A new intent is in the store: ring this box's agent, and every box's on PostgreSQL."""
    ring(env.state_dir)
    notify(env.store())


def _json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, default=str))


@click.group()
@click.option("--state-dir", envvar="VIGIL_HOME", default=".vigil", show_default=True,
              help="State directory (env VIGIL_HOME).")
@click.option("--db", envvar="VIGIL_DB", default=None,
              help="Database URL overriding the SQLite file in the state dir (env VIGIL_DB).")
@click.pass_context
def cli(ctx: click.Context, state_dir: str, db: str | None) -> None:
    """vigil: a crash-safe process activator."""
    ctx.obj = Env(state_dir, db)


cli.add_command(rollout)  # vigil rollout ... (runners/cli_rollout.py)


@cli.group()
def db() -> None:
    """Schema: Alembic owns it."""


@db.command("upgrade")
@click.pass_obj
def db_upgrade(env: Env) -> None:
    """Create the store or move it to the newest schema."""
    store = env.store(create=True, at_head=False)
    before = schema.current_revision(store.engine)
    schema.upgrade(store.engine)
    click.echo(f"database at {schema.HEAD} (was {before or 'empty'})")


@db.command("current")
@click.pass_obj
def db_current(env: Env) -> None:
    store = env.store(at_head=False)
    cur, head = schema.current_revision(store.engine), schema.HEAD
    click.echo(f"{cur or 'empty'} (head {head}{', up to date' if cur == head else ''})")


@cli.group()
def host() -> None:
    """Define the apps vigil runs."""


@host.command("add")
@click.argument("name")
@click.option("--build", "build_path", required=True, help="Executable to stage for the host.")
@click.option("--kind", type=click.Choice([k.value for k in HostKind]), default="instance",
              show_default=True)
@click.option("--arg", "args", multiple=True, help="Argument for the build (repeatable).")
@click.option("--env", "envs", multiple=True, help="K=V environment entry (repeatable).")
@click.option("--cwd", default=None, help="Working directory of the app.")
@click.option("--drain-timeout", type=SECONDS, default=10.0, show_default=True)
@click.option("--health-timeout", type=SECONDS, default=10.0, show_default=True)
@click.option("--box", "boxes", multiple=True,
              help="A box (agent id) that may run the host (repeatable); none: any box.")
@click.option("--socket-group", default=None,
              help="Group that may connect to its socket (overrides the agent's).")
@click.option("--socket-mode", default=None, help="Mode of its socket, octal (default 0660).")
@click.option("--listen", "listens", multiple=True, metavar="[NAME=]tcp:HOST:PORT|unix:/PATH",
              help="A listening socket vigil holds; every generation inherits it as fd 3, 4, "
                   "... (LISTEN_FDS; repeatable).")
@click.option("--ready", default=None, metavar="notify|http|exec:CMD",
              help="How a generation says it is ready (default: http; notify with --listen).")
@click.option("--one-shot", is_flag=True, help="Worker: run once; exit 0 is success, no respawn.")
@click.option("--max-run", type=SECONDS, default=None, help="Worker: recycle after S seconds up.")
@click.option("--restart-floor", type=SECONDS, default=None, help="Worker: first restart delay (1).")
@click.option("--restart-cap", type=SECONDS, default=None, help="Worker: longest restart delay (30).")
@click.option("--restart-reset", type=SECONDS, default=None,
              help="Worker: up this long, the backoff starts again from the floor (60).")
@click.option("--converge-grace", type=SECONDS, default=None,
              help="Worker: how long its live build may differ before it converges (60).")
@click.pass_obj
def host_add(env: Env, name: str, build_path: str, kind: str, args: tuple[str, ...],
             envs: tuple[str, ...], cwd: str | None, drain_timeout: float, health_timeout: float,
             boxes: tuple[str, ...], socket_group: str | None, socket_mode: str | None,
             listens: tuple[str, ...], ready: str | None, **policy: Any) -> None:
    """Add a host and stage its build (copied under <state>/builds, sha256 recorded)."""
    from runners.listen_cli import checked_listeners
    from workflows.hosts import check_name
    from workflows.placement import encode

    check_name(name)
    listeners, ready = checked_listeners(env, name, HostKind(kind), listens, ready)
    placed = encode(boxes)
    group, mode = _socket_options(socket_group, socket_mode)
    pairs: dict[str, str] = {}
    for item in envs:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise BadInput(f"--env {item!r} is not K=V", "write it as --env NAME=value")
        pairs[key] = value
    if cwd is not None and not os.path.isdir(cwd):
        raise BadInput(f"--cwd {cwd} is not a directory", "pass an existing directory")
    if HostKind(kind) is HostKind.instance:
        check_socket_room(env.state_dir, name)
    check_args(list(args), label="--arg ")
    check_env(pairs, label="--env ")
    from workflows.workers import check_policy

    check_policy(HostKind(kind), policy)  # before anything is staged
    store = env.store()
    path, digest = stage_build(build_path, env.state_dir)
    store.write(lambda s: add_host(
        s, name, kind=HostKind(kind), build_path=path, digest=digest,
        source=str(Path(build_path).absolute()), args=list(args), env=pairs,
        cwd=os.path.abspath(cwd) if cwd else None, drain_timeout=drain_timeout,
        health_timeout=health_timeout, box=placed, socket_group=group, socket_mode=mode,
        policy=policy, listeners=listeners, ready=ready))
    click.echo(f"host {name} added: build {digest[:12]} staged at {path}")


def _socket_options(group: str | None, mode: str | None) -> tuple[str | None, int | None]:
    from runners.sockets import check_group, parse_mode

    try:
        if group is not None:
            check_group(group)
    except ValueError as exc:
        raise BadInput(f"--socket-group: {exc}", "name an existing group (see `getent group`)") from None
    try:
        return group, parse_mode(mode) if mode is not None else None
    except ValueError as exc:
        raise BadInput(f"--socket-mode: {exc}", "pass an octal mode such as 0660") from None


@host.command("list")
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
def host_list(env: Env, as_json: bool) -> None:
    rows = env.store().read(lambda s: status(s))
    if as_json:
        _json(rows)
        return
    t = table("host", "kind", "state", "build")
    for r in rows:
        t.add_row(r["host"], r["kind"], r["state"], (r["build_digest"] or "")[:12])
    show(t)


@host.command("rm")
@click.argument("name")
@click.pass_obj
def host_rm(env: Env, name: str) -> None:
    rows = env.store().write(lambda s: remove_host(s, name))
    from runners.listen_cli import close_removed
    from runners.schedules import forget

    forget(env.store(), name)
    close_removed(env.state_dir, rows)
    if rows:
        ring(env.state_dir)  # the agent closes its own copies of the sockets
    click.echo(f"host {name} removed")


@cli.command("apply")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--dry-run", is_flag=True, help="Print the plan; change nothing.")
@click.pass_obj
def apply_cmd(env: Env, file: str, dry_run: bool) -> None:
    """Create, update and remove hosts to match a TOML file (see README: Operating vigil)."""
    from runners.files import LocalFiles, staging_root
    from runners.hostfile import load
    from workflows.apply import Wanted, apply_host, plan, remove_absent

    specs = load(file)  # every key checked first: a bad file changes nothing
    for spec in specs:
        if spec.fields["kind"] is HostKind.instance:
            check_socket_room(env.state_dir, spec.name)
    store = env.store()
    from runners.listen_cli import probe_all, stored_listens

    for spec in specs:  # each new address free now (a port in use, ...): nothing written
        probe_all(spec.listens, stored_listens(store, spec.name), label=f"{file}: {spec.name}: ")

    def wanted(stage: bool) -> list[Wanted]:
        out = []
        for h in specs:
            if stage:
                path, digest = stage_build(h.build, env.state_dir)
            else:
                digest = LocalFiles().digest(h.build)
                path = str(staging_root(env.state_dir) / digest / Path(h.build).name)
            out.append(Wanted(h.name, h.fields, path, digest, h.build, h.listens))
        return out

    changes = store.read(lambda s: plan(s, wanted(stage=False)))  # refusals: nothing changed
    if dry_run:
        for c in changes:
            click.echo(c.line())
        click.echo("dry run: nothing changed")
        return
    keep = {c.host for c in changes if c.action != "remove"}
    done = [store.write(lambda s, w=w: apply_host(s, w)) for w in wanted(stage=True)]
    done += [store.write(lambda s, n=c.host: remove_absent(s, n))
             for c in changes if c.host not in keep]
    for c in done:
        click.echo(c.line())
    if any(c.attempt is not None for c in done):
        ring(env.state_dir)


def _wait_row(env: Env, model: Any, row_id: int, timeout: float) -> Any:
    store = env.store()
    started = time.monotonic()
    deadline = started + timeout
    warned = False
    unproven_at: float | None = None
    while True:
        row = store.read(lambda s: s.get(model, row_id))
        settled = row.state.value in ("done", "failed", "cancelled")
        if settled and not store.read(lambda s, h=row.host: s.execute(
                select(Release.id).where(Release.host == h)).first()):
            return row  # ... and the lease is given back, when it was owed
        # An unproven wake is usually proven a moment later: report it only if it stays.
        if row.state.value != "unproven":
            unproven_at = None
        elif unproven_at is None:
            unproven_at = time.monotonic()
        elif time.monotonic() - unproven_at > 3:
            return row
        if not warned and time.monotonic() - started > 3 and running_agent_pid(env.state_dir) is None:
            click.echo(f"vigil: no agent is running on {env.state_dir}; the intent waits for "
                       "`vigil agent`", err=True)
            warned = True
        if time.monotonic() > deadline:
            raise VigilError(f"timed out after {timeout:.0f}s: {model.__tablename__[:-1]} "
                             f"#{row_id} is still {row.state.value} ({row.last_error or 'no error yet'})",
                             "watch `vigil obligations`; the agent keeps working on it")
        time.sleep(0.05)


@cli.command()
@click.argument("name")
@click.option("--wait", is_flag=True, help="Block until the agent has woken it or it failed.")
@click.option("--timeout", type=SECONDS, default=300.0, show_default=True)
@click.pass_obj
def wake(env: Env, name: str, wait: bool, timeout: float) -> None:
    """Start a host's current build."""
    req = env.store().write(lambda s: request_wake(s, name))
    if req.id is None:
        click.echo(f"host {name} is already awake")
        return
    _ring(env)
    if not wait:
        click.echo(f"wake #{req.id} of {name} queued")
        return
    row = _wait_row(env, Wake, req.id, timeout)
    if row.state.value != "done":
        detail = " (its processes are not proven gone yet)" if row.state.value == "unproven" else ""
        raise VigilError(f"wake of {name} {row.state.value}: {row.reason}{detail}",
                         f"see `vigil events {name}` and the app's log {env.state_dir}/logs/{name}.log")
    gen = env.store().read(lambda s: s.get(Generation, row.generation_id))
    click.echo(f"host {name} awake: generation g{gen.id} pid {gen.pid}")


@cli.command()
@click.argument("name")
@click.option("--wait", is_flag=True, help="Block until it is proven stopped.")
@click.option("--timeout", type=SECONDS, default=300.0, show_default=True)
@click.pass_obj
def stop(env: Env, name: str, wait: bool, timeout: float) -> None:
    """Stop a host: SIGTERM, drain, SIGKILL, proof, lease given back."""
    req = env.store().write(lambda s: request_stop(s, name))
    _ring(env)
    if not wait:
        click.echo(f"stop #{req.id} of {name} queued")
        return
    row = _wait_row(env, Stop, req.id, timeout)
    click.echo(f"host {name} stopped ({row.reason or 'proven gone'})")


@cli.command()
@click.argument("name")
@click.argument("build_path", metavar="BUILD")
@click.option("--mode", type=click.Choice([m.value for m in Mode]), default="overlap", show_default=True)
@click.option("--canary", is_flag=True, help="The successor must stay up for the settle window.")
@click.option("--cause", type=click.Choice([c.value for c in Cause if c is not Cause.retry]),
              default="release", show_default=True)
@click.option("--wait", is_flag=True, help="Show the steps as they happen; exit 0 when done.")
@click.option("--timeout", type=SECONDS, default=600.0, show_default=True)
@click.option("--converge", is_flag=True,
              help="Worker: only make BUILD its live build; it converges after its grace.")
@click.pass_obj
def deploy(env: Env, name: str, build_path: str, mode: str, canary: bool, cause: str, wait: bool,
           timeout: float, converge: bool) -> None:
    """Move a host to a new build (overlap: zero downtime; hold: stop, then start)."""
    store = env.store()
    h = store.read(lambda s: s.get(Host, name))
    if h is None:
        raise NotFound(f"no host named {name!r}", "see `vigil host list`")
    if converge:
        from workflows.workers import stage_live

        if h.kind is not HostKind.worker:
            raise BadInput(f"host {name} is an instance: only workers converge",
                           f"drop --converge: `vigil deploy {name} {build_path}`")
        path, digest = stage_build(build_path, env.state_dir)
        store.write(lambda s: stage_live(s, name, record_build(
            s, path, digest, str(Path(build_path).absolute()))))
        click.echo(f"build {digest[:12]} is the live build of {name}; it converges after "
                   f"{h.converge_grace:g}s")
        return
    path, digest = stage_build(build_path, env.state_dir)

    def intent(s):  # type: ignore[no-untyped-def]
        build = record_build(s, path, digest, str(Path(build_path).absolute()))
        a = request_deploy(s, name, build, mode=Mode(mode), canary=canary, cause=Cause(cause))
        return a.id, deploying_held(s, a)

    attempt_id, held_down = store.write(intent)
    if held_down:  # the failure book: an operator's deploy still runs, and says so
        click.echo(f"{held_down}; deploying it as asked")
    _attempt(env, name, attempt_id, wait, timeout)


@cli.command()
@click.argument("name")
@click.option("--wait", is_flag=True)
@click.option("--timeout", type=SECONDS, default=600.0, show_default=True)
@click.pass_obj
def retry(env: Env, name: str, wait: bool, timeout: float) -> None:
    """Re-arm the host's last failed build: a new attempt with cause `retry`."""
    store = env.store()

    def intent(s):  # type: ignore[no-untyped-def]
        build, failed = last_failed(s, name)
        lift(s, name, build.id, "vigil retry")  # the failure book lets it back on the host
        return request_deploy(s, name, build, mode=failed.mode, canary=failed.canary,
                              cause=Cause.retry).id

    _attempt(env, name, store.write(intent), wait, timeout)


def _attempt(env: Env, name: str, attempt_id: int, wait: bool, timeout: float) -> None:
    _ring(env)
    if not wait:
        click.echo(f"attempt #{attempt_id} of {name} queued")
        return
    store = env.store()
    started = time.monotonic()
    seen = None
    # A fast attempt can pass `switched` between two polls: its event says it did.
    after = store.read(lambda s: s.execute(select(func.coalesce(func.max(Event.id), 0))).scalar())
    switched = False
    while True:
        a = store.read(lambda s: s.get(Attempt, attempt_id))
        if not switched and a.step.value in ("switched", "drained", "ended"):
            switched = a.step.value == "switched" or store.read(lambda s: s.execute(
                select(Event.id).where(Event.id > after, Event.host == name,
                                       Event.kind == "switched")).first()) is not None
            if switched and a.step.value != "switched":
                click.echo(f"{time.monotonic() - started:7.2f}s  switched")
        if a.step.value != seen:
            seen = a.step.value
            click.echo(f"{time.monotonic() - started:7.2f}s  {seen}")
        if a.outcome is not None:
            break
        if time.monotonic() - started > timeout:
            raise VigilError(f"timed out after {timeout:.0f}s: attempt #{attempt_id} is at "
                             f"{a.step.value} ({a.last_error or 'no error yet'})",
                             "watch `vigil obligations`; the agent keeps working on it")
        time.sleep(0.05)
    drain = f", drain {a.drain_seconds:.2f}s" if a.drain_seconds is not None else ""
    line = (f"attempt #{a.id} {a.outcome.value} (mode {a.effective_mode.value}, executed "
            f"{str(a.executed).lower()}{drain}): {a.reason}")
    if a.outcome is not Outcome.done:
        raise VigilError(line, f"see `vigil events {name}` and {env.state_dir}/logs/{name}.log")
    click.echo(line)


@cli.command()
@keep_options
@click.option("--dry-run", is_flag=True, help="Count what would be deleted; change nothing.")
@click.pass_obj
def gc(env: Env, keep_history: Any, keep_last: int, dry_run: bool) -> None:
    """Delete staged builds that no host, live generation or open attempt references, and
    history nothing needs (see --keep-history)."""
    from workflows import history

    keep = keep_of(keep_history, keep_last)
    if dry_run:
        builds = env.store().read(lambda s: len(unreferenced(s)))
        rows = env.store().read(lambda s: history.count(s, keep))
        click.echo(f"dry run: {builds} build(s) and {summary(rows)} row(s) of history would "
                   "be deleted; nothing changed")
        return
    doomed = env.store().write(collect)
    for b in doomed:
        # Only this build's file: builds with the same bytes under another name share the
        # digest directory, and one of them may still be referenced.
        try:
            os.unlink(b.path)
        except FileNotFoundError:
            pass
        try:
            os.rmdir(Path(b.path).parent)  # the digest dir, once nothing else is in it
        except OSError:
            pass
    pruned = history.prune(env.store(), keep)
    click.echo(f"{len(doomed)} build(s) deleted; history pruned: {summary(pruned)}")


@cli.command("status")
@click.argument("name", required=False)
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
def status_cmd(env: Env, name: str | None, as_json: bool) -> None:
    """Each host: state, generation, pid, build and how long it has served."""
    rows = env.store().read(lambda s: status(s, name))
    from runners.storewatch import halted_line

    halted = halted_line(env.state_dir)
    if halted is not None:  # on stderr: --json keeps its shape
        click.echo(f"vigil: warning: the agent has stopped acting: {halted}", err=True)
    if as_json:
        _json(rows)
        return
    from runners.output import status_table

    show(status_table(rows))


@cli.command()
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
def obligations(env: Env, as_json: bool) -> None:
    """Every open obligation (the pending_obligations view)."""
    store = env.store()
    cols = ["kind", "host", "generation", "since", "attempts", "next_attempt_at", "last_error"]
    with store.reading() as conn:
        rows = [dict(zip(cols, r, strict=True)) for r in conn.exec_driver_sql(
            f"SELECT {', '.join(cols)} FROM pending_obligations ORDER BY since")]
    if as_json:
        _json(rows)
        return
    from runners.output import obligations_table

    show(obligations_table(rows))


@cli.command()
@click.argument("name", required=False)
@click.option("--json", "as_json", is_flag=True,
              help="A JSON array; with --follow, one JSON object a line.")
@click.option("--follow", "-f", is_flag=True, help="Keep printing new events (Ctrl-C to end).")
@click.option("--limit", type=int, default=50, show_default=True)
@click.pass_obj
def events(env: Env, name: str | None, as_json: bool, follow: bool, limit: int) -> None:
    """Recent event rows, oldest first: time, host, generation, kind, detail."""
    from runners import output

    store = env.store()
    data = output.events_after(store, name, -1, limit)
    if name is not None and not data and store.read(lambda s: s.get(Host, name)) is None:
        # (A removed host's events still show: its name is in them.)
        raise NotFound(f"no host named {name!r}", "see `vigil host list`")
    if as_json and not follow:
        _json(data)
        return

    def emit(d: dict[str, Any]) -> None:
        click.echo(json.dumps(d, default=str) if as_json else output.event_line(d))

    for d in data:
        emit(d)
    if follow:
        output.follow(store, name, data[-1]["id"] if data else 0, emit)


@cli.group()
def schedule() -> None:
    """Scheduled restarts (cron, UTC), kept in the store; the agent runs them."""


@schedule.command("add")
@click.argument("name")
@click.option("--cron", "expr", required=True, help="Five crontab fields in UTC, e.g. '30 4 * * *'.")
@click.pass_obj
def schedule_add(env: Env, name: str, expr: str) -> None:
    """Restart HOST on a cron schedule: an overlap deploy of the build it runs (cause restart)."""
    from runners import schedules

    job = schedules.add(env.store(), name, expr)
    click.echo(f"restart of {name} scheduled ({expr}); next run {job['next_run']}")


@schedule.command("list")
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
def schedule_list(env: Env, as_json: bool) -> None:
    """Every restart schedule and its next run."""
    from runners import output, schedules

    rows = schedules.listing(env.store())
    if as_json:
        _json(rows)
        return
    t = output.table("host", "cron (UTC)", "next run", "in")
    for r in rows:
        t.add_row(r["host"], r["cron"], r["next_run"] or "paused", output.until(
            datetime.fromisoformat(r["next_run"]).replace(tzinfo=None) if r["next_run"] else None))
    show(t)


@schedule.command("rm")
@click.argument("name")
@click.pass_obj
def schedule_rm(env: Env, name: str) -> None:
    """Remove HOST's restart schedule."""
    from runners import schedules

    schedules.remove(env.store(), name)
    click.echo(f"restart schedule of {name} removed")


@cli.command()
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
def check(env: Env, as_json: bool) -> None:
    """Exit 0 when DESIGN §5's invariants hold; else print each violation and exit 1."""
    from runners.check import run_checks

    store = env.store()
    violations = run_checks(store, env.state_dir)
    if as_json:
        _json([v.__dict__ for v in violations])
    else:
        for v in violations:
            click.echo(f"{v.name}: {v.message}")
        if not violations:
            click.echo("ok: every invariant holds")
    sys.exit(1 if violations else 0)


@cli.command()
def crashpoints() -> None:
    """Every registered crash point, one a line."""
    import workflows.obligations  # noqa: F401  (imports every workflow, registering its points)
    import workflows.recovery  # noqa: F401

    for name in sorted(crash.REGISTERED):
        click.echo(name)


@cli.command()
@click.option("--safety-interval", type=SECONDS, default=30.0, show_default=True,
              help="Seconds between full scans when nothing rings (the backstop: intents "
                   "ring the agent, exits arrive by pidfd, due rows set a timer).")
@click.option("--log-level", default="INFO", show_default=True)
@click.option("--box", envvar="VIGIL_BOX", default=None,
              help="Name this box (its agent id) on the first start (env VIGIL_BOX).")
@click.option("--lease-ttl", envvar="VIGIL_LEASE_TTL", type=SECONDS, default=30.0,
              show_default=True, help="Seconds a host lease lasts without renewal.")
@click.option("--converge-budget", type=click.IntRange(min=0), default=1, show_default=True,
              help="Workers converged onto their live build per sweep, box-wide.")
@click.option("--sweep-interval", type=SECONDS, default=1.0, show_default=True,
              help="Seconds between sweeps of worker drift and max-run (and of dead currents "
                   "where the kernel has no pidfds; with pidfds an exit is handled at once).")
@click.option("--log-format", type=click.Choice(["text", "json"]), envvar="VIGIL_LOG_FORMAT",
              default="text", show_default=True,
              help="One line per event: key=value text or a JSON object (env VIGIL_LOG_FORMAT).")
@click.option("--metrics-listen", default=None, metavar="ADDRESS:PORT",
              help="Serve Prometheus metrics over HTTP there, e.g. 127.0.0.1:9108.")
@click.option("--socket-group", envvar="VIGIL_SOCKET_GROUP", default=None,
              help="Group that may connect to every host's socket (env VIGIL_SOCKET_GROUP).")
@click.option("--socket-mode", envvar="VIGIL_SOCKET_MODE", default=None,
              help="Mode of those sockets, octal (default 0660; env VIGIL_SOCKET_MODE).")
@keep_options
@click.pass_obj
def agent(env: Env, safety_interval: float, log_level: str, box: str | None,
          lease_ttl: float, converge_budget: int, sweep_interval: float, log_format: str,
          metrics_listen: str | None, socket_group: str | None, socket_mode: str | None,
          keep_history: Any, keep_last: int) -> None:
    """Run the agent: recover, then keep every obligation moving until it is proven done."""
    from runners import logs
    from runners.sockets import SocketAccess

    group, mode = _socket_options(socket_group, socket_mode)
    from runners.agent import AgentDaemon
    from workflows.placement import check_box

    if box is not None:
        check_box(box)
    check_socket_room(env.state_dir)  # its doorbell; each instance's is checked below
    if sweep_interval < 0.05:
        raise BadInput(f"--sweep-interval {sweep_interval:g} is too short", "give at least 0.05 seconds")
    if not 1.0 <= lease_ttl <= 3600:
        raise BadInput(f"--lease-ttl {lease_ttl:g} is out of range",
                       "give between 1 and 3600 seconds (default 30)")
    if metrics_listen is not None:
        from runners.metrics import parse_listen

        parse_listen(metrics_listen)  # a bad value is refused before anything starts
    logs.configure(log_level, log_format)
    from models.store import LOCK_WAIT

    store = env.store(lock_wait=LOCK_WAIT)
    for name in store.read(lambda s: s.execute(select(Host.name).where(
            Host.kind == HostKind.instance)).scalars().all()):
        check_socket_room(env.state_dir, name)  # e.g. a state dir moved to a longer path
    ctx = make_context(env.state_dir, store, agent_id(env.state_dir, box), lease_ttl=lease_ttl,
                       sockets=SocketAccess(env.state_dir, group, mode))
    sys.exit(AgentDaemon(ctx, safety_interval=safety_interval, monitor_interval=sweep_interval,
                         converge_budget=converge_budget, metrics_listen=metrics_listen,
                         keep=keep_of(keep_history, keep_last)).run())


def _store_trouble(exc: BaseException) -> VigilError | None:
    """A failure of the store itself (full, read-only, damaged, unreachable), as one line."""
    from models.trouble import diagnose, explain

    trouble = diagnose(exc)
    if trouble is None:
        return None
    if _opened:
        store = _opened[-1]
        holder = store.lock_holder() if trouble.kind == "locked" else None
        return explain(trouble, store.url, holder=holder)
    env = click.get_current_context(silent=True)
    url = "sqlite:///vigil.db"
    if env is not None and isinstance(env.obj, Env):
        url = env.obj.db or f"sqlite:///{env.obj.state_dir / 'vigil.db'}"
    return explain(trouble, url)


from runners.listen_cli import attach as _attach_listen  # noqa: E402

_attach_listen(host)


def main(argv: list[str] | None = None) -> None:
    try:
        cli.main(args=argv, prog_name="vigil", standalone_mode=False)
    except click.exceptions.Abort:
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except VigilError as exc:
        click.echo(f"vigil: error: {exc.line()}", err=True)
        sys.exit(exc.exit_code)
    except (DBAPIError, OSError) as exc:
        trouble = _store_trouble(exc)
        if trouble is None:
            raise
        click.echo(f"vigil: error: {trouble.line()}", err=True)
        sys.exit(trouble.exit_code)
    finally:
        while _opened:
            _opened.pop().dispose()


if __name__ == "__main__":
    main()
