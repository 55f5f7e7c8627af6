"""`vigil host add|list|rm` and `vigil apply`: the apps vigil runs."""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path
from typing import Any

import click

from models.errors import BadInput
from models.states import HostKind
from runners.cli.common import SECONDS, Env, echo_json, options, show, socket_options, table
from runners.cli.reloadcmds import checked_reload, reload_options
from runners.cli.runopts import checked_run, env_pairs, run_options

# How an instance's health is probed, and how a host is restarted (workers recycled).
health_options = options(
    click.option("--health-interval", type=SECONDS, default=None,
                 help="Instance: probe GET / on its socket every S seconds while it serves."),
    click.option("--unhealthy-after", type=int, default=None,
                 help="Failed probes in a row that make it unhealthy (3)."),
    click.option("--unhealthy-restart", is_flag=True,
                 help="Restart an unhealthy generation (stop, drain, proof, wake)."),
    click.option("--health", default=None, metavar="http:PATH|tcp|exec:CMD",
                 help="What the probe asks: GET PATH answers 2xx/3xx, a connect to its socket "
                      "is accepted, or CMD exits 0 as its user within the health timeout "
                      "(default: GET / below 500)."),
)
policy_options = options(
    click.option("--one-shot", is_flag=True, help="Worker: run once; exit 0 is success, no respawn."),
    click.option("--max-run", type=SECONDS, default=None, help="Worker: recycle after S seconds up."),
    click.option("--restart-floor", type=SECONDS, default=None, help="Backoff after a second quick exit (1; a worker's first)."),
    click.option("--restart-cap", type=SECONDS, default=None, help="Longest restart delay (30)."),
    click.option("--restart-reset", type=SECONDS, default=None,
                 help="Up this long, the backoff starts again (60)."),
    click.option("--start-limit", default=None, metavar="N/SECONDS",
                 help="N quick exits within SECONDS make it failed: no more restarts until "
                      "`vigil retry` (none)."),
    click.option("--converge-grace", type=SECONDS, default=None,
                 help="Worker: how long its live build may differ before it converges (60)."),
    click.option("--watchdog", type=SECONDS, default=None, metavar="SECONDS",
                 callback=lambda _c, _p, v: _watchdog(v),
                 help="WATCHDOG=1 on $NOTIFY_SOCKET at least this often (WATCHDOG_USEC, "
                      "WATCHDOG_PID), or SIGABRT, a stop and a restart (none)."),
    *reload_options,  # how a reload is sent and answered (runners/cli/reloadcmds.py)
)


# A job (workflows/lifecycle/jobs.py): its kind and schedule.
job_options = options(
    click.option("--kind", type=click.Choice([*(k.value for k in HostKind), "job"]),
                 default="instance", show_default=True,
                 help="A job runs its build on a schedule."),
    click.option("--every", default=None, metavar="PERIOD",
                 help="Job: a run every PERIOD (90, 10m, 1h, 1d), at whole multiples of it "
                      "since the epoch."),
    click.option("--schedule", default=None, metavar="CRON",
                 help="Job: a run at each instant of a five-field cron line."),
    click.option("--timezone", default=None, metavar="TZ",
                 help="Job: the zone its --schedule is read in (an IANA name; default UTC)."),
    click.option("--overlap", default=None, metavar="skip|queue|replace|allow",
                 help="Job: a run due while the last one runs is skipped, queued (one at "
                      "most, run after it), replaces it (stopped, proven gone, then the new "
                      "one), or runs beside it (default skip)."),
    click.option("--timeout", default=None, metavar="PERIOD",
                 help="Job: a run still running after PERIOD is ended by the stop path "
                      "(stop signal, drain timeout, SIGKILL, proof) and failed (none)."),
    click.option("--retries", type=int, default=None, metavar="N",
                 help="Job: a run that failed (non-zero exit, failed start) is started again "
                      "up to N times, with the restart backoff (0)."),
    click.option("--catch-up", default=None, metavar="none|one|all",
                 help="Job: the instants missed while no agent ran: none run, the last one "
                      "runs (one, the default), or each runs, oldest first (all)."),
    click.option("--catch-up-window", default=None, metavar="PERIOD",
                 help="Job: only instants missed less than PERIOD ago are caught up "
                      "(one, all); older ones are recorded missed (no bound)."),
)


def _job_of(kind: str, opts: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The kind stored and the job's columns, checked; takes its options out of `opts`."""
    from workflows.lifecycle.catchup import check_catch_up
    from workflows.lifecycle.job_overlap import check_overlap
    from workflows.lifecycle.jobs import check_job, parse_every
    from workflows.lifecycle.runpolicy import check_run_policy

    every = opts.pop("every")
    job = check_job(kind, None if every is None else parse_every(every),
                    *(opts.pop(k) for k in ("schedule", "timezone")))
    timeout = opts.pop("timeout")  # a run's bound and second chances (runpolicy.py)
    job.update(check_run_policy(kind, None if timeout is None else parse_every(
        timeout, "--timeout "), opts.pop("retries")))
    job.update(check_overlap(kind, opts.pop("overlap")))  # workflows/lifecycle/job_overlap.py
    window = opts.pop("catch_up_window")  # instants missed while no agent ran (catchup.py)
    job.update(check_catch_up(kind, opts.pop("catch_up"), None if window is None else parse_every(
        window, "--catch-up-window ")))
    return ("worker" if job else kind), job


def _watchdog(seconds: float | None) -> float | None:
    from workflows.lifecycle.watchdog import check_watchdog

    return check_watchdog(seconds)


@click.group()
def host() -> None:
    """Define the apps vigil runs."""


@host.command("add")
@click.argument("name")
@click.option("--build", "build_path", required=True, help="Executable to stage for the host.")
@job_options
@click.option("--arg", "args", multiple=True, help="Argument for the build (repeatable).")
@click.option("--env", "envs", multiple=True, help="K=V environment entry (repeatable).")
@click.option("--cwd", default=None, help="Working directory of the app.")
@click.option("--drain-timeout", type=SECONDS, default=10.0, show_default=True)
@click.option("--health-timeout", type=SECONDS, default=10.0, show_default=True)
@click.option("--box", "boxes", multiple=True,
              help="A box (agent id) that may run the host (repeatable); none: any box.")
@click.option("--on-store-loss", type=click.Choice(["fence", "keep"]), default="fence", show_default=True,
              help="Placed on several boxes, with the store out of reach: fence stops it, keep leaves it.")
@click.option("--socket-group", default=None,
              help="Group that may connect to its socket (overrides the agent's).")
@click.option("--socket-mode", default=None, help="Mode of its socket, octal (default 0660).")
@click.option("--listen", "listens", multiple=True, metavar="[NAME=]tcp:HOST:PORT|unix:/PATH",
              help="A listening socket vigil holds; every generation inherits it as fd 3, 4, "
                   "... (LISTEN_FDS; repeatable).")
@click.option("--ready", default=None, metavar="http[:PATH]|tcp|exec:CMD|notify",
              help="How a generation says it is ready (default: http; notify with --listen).")
@click.option("--after", "after", multiple=True, metavar="HOST",
              help="A host its wake waits for, awake and ready; stopping HOST waits for "
                   "this one (repeatable).")
@click.option("--instances", type=int, default=1, show_default=True, metavar="N",
              help="Processes of its build sharing its --listen sockets (own pid, restarts).")
@health_options
@policy_options
@run_options
@click.pass_obj
def host_add(env: Env, name: str, build_path: str, kind: str, args: tuple[str, ...],
             envs: tuple[str, ...], cwd: str | None, drain_timeout: float, health_timeout: float,
             boxes: tuple[str, ...], on_store_loss: str, socket_group: str | None, socket_mode: str | None,
             listens: tuple[str, ...], ready: str | None, after: tuple[str, ...],
             instances: int, health_interval: float | None, unhealthy_after: int | None,
             unhealthy_restart: bool, **policy: Any) -> None:
    """Add a host and stage its build (copied under <state>/builds, sha256 recorded)."""
    from runners.backend.files import forget_host_files, stage_build
    from runners.cli.listenopts import checked_listeners
    from workflows.config.hosts import add_host

    kind, job = _job_of(kind, policy)  # a job is stored as a worker whose schedule is set
    placed = _checked_name(env, name, boxes)
    listeners, ready = checked_listeners(env, name, HostKind(kind), listens, ready, placed,
                                         instances)
    group, mode = socket_options(socket_group, socket_mode)
    run = {**checked_run(policy), **checked_reload(policy)}  # --user, --group, --env-file, --reload-*: out of policy first
    probe = _checked_probe(HostKind(kind), health_interval, unhealthy_after, unhealthy_restart,
                           policy)  # likewise
    pairs = _checked_run(env, name, HostKind(kind), args, envs, cwd, policy)
    path, digest = stage_build(build_path, env.state_dir)
    env.store().write(lambda s: add_host(
        s, name, kind=HostKind(kind), build_path=path, digest=digest,
        source=str(Path(build_path).absolute()), args=list(args), env=pairs,
        cwd=os.path.abspath(cwd) if cwd else None, drain_timeout=drain_timeout,
        health_timeout=health_timeout, box=placed, socket_group=group, socket_mode=mode,
        policy=policy, listeners=listeners, ready=ready, probe=probe, run=run,
        after=list(after), on_store_loss=on_store_loss, instances=instances, job=job))
    forget_host_files(env.state_dir, name)  # a removed namesake's, if its rm was cut short
    click.echo(f"host {name} added: build {digest[:12]} staged at {path}")


def _checked_probe(kind: HostKind, interval: float | None, after: int | None, restart: bool,
                   opts: dict[str, Any]) -> dict[str, Any]:
    """The probe's columns, checked; takes --health out of `opts` (not the restart policy)."""
    from workflows.lifecycle.probe import check_probe

    return check_probe(kind, interval, after, restart, opts.pop("health", None))


def _checked_name(env: Env, name: str, boxes: tuple[str, ...]) -> str | None:
    """The name checked and free (before its port is found in use): the host's placement."""
    from workflows.config.hosts import check_name, refuse_taken
    from workflows.leases.placement import encode

    check_name(name)
    env.store().read(lambda s: refuse_taken(s, name))
    return encode(boxes)


def _checked_run(env: Env, name: str, kind: HostKind, args: tuple[str, ...],
                 envs: tuple[str, ...], cwd: str | None, policy: dict[str, Any]) -> dict[str, str]:
    """How the host's process runs, checked before anything is staged: its environment
    (K=V pairs, returned), working dir, socket path, arguments and restart policy."""
    from workflows.config.hosts import check_args, check_env, check_socket_room
    from workflows.lifecycle.workers import check_policy

    pairs = env_pairs(envs)
    if cwd is not None and not os.path.isdir(cwd):
        raise BadInput(f"--cwd {cwd} is not a directory", "pass an existing directory")
    if kind is HostKind.instance:
        check_socket_room(env.state_dir, name)
    check_args(list(args), label="--arg ")
    check_env(pairs, label="--env ")
    check_policy(kind, policy)
    return pairs


@host.command("list")
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
def host_list(env: Env, as_json: bool) -> None:
    """Every host: kind, state and build."""
    from workflows.config.hostrows import status

    rows = env.store().read(lambda s: status(s))
    if as_json:
        echo_json(rows)
        return
    t = table("host", "kind", "state", "build")
    for r in rows:  # the build by its file name beside its digest
        t.add_row(r["host"], r["kind"], r["state"],
                  f"{r['build_file'] or ''} {(r['build_digest'] or '')[:12]}".strip())
    show(t)


@host.command("rm")
@click.argument("name")
@click.pass_obj
def host_rm(env: Env, name: str) -> None:
    """Remove a host that does not run (and its restart schedule)."""
    from runners.agent.jobstore import forget
    from runners.backend.files import forget_host_files
    from runners.base.doorbell import ring
    from runners.cli.listenopts import close_removed
    from runners.cli.logs import set_aside
    from workflows.config.hosts import remove_host

    rows = env.store().write(lambda s: remove_host(s, name))
    set_aside(env.state_dir, name)  # a host added again under the name starts with no output
    forget_host_files(env.state_dir, name)  # its run dir, link and what set_aside left
    forget(env.store(), name)
    close_removed(env.state_dir, rows)
    if rows:
        ring(env.state_dir)  # the agent closes its own copies of the sockets
    click.echo(f"host {name} removed")


@click.command("apply")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--dry-run", is_flag=True, help="Print the plan; change nothing.")
@click.pass_obj
def apply_cmd(env: Env, file: str, dry_run: bool) -> None:
    """Create, update and remove hosts to match a TOML file (see docs/reference/hosts-file.md)."""
    from runners.backend.files import forget_host_files
    from runners.cli.common import ring
    from runners.cli.hostfile import load, order_refusals
    from workflows.config.apply import apply_host, plan, remove_absent
    from workflows.config.hosts import check_socket_room

    specs = load(file)  # every key checked first: a bad file changes nothing
    if dry_run:
        from runners.cli.applyplan import dry_run as show_plan

        show_plan(env, file, specs, _wanted(env, specs, stage=False))
        return
    for _, refusal in order_refusals(file, specs)[:1]:  # an unknown name or a cycle in `after`
        raise refusal
    for spec in specs:
        if spec.fields["kind"] is HostKind.instance:
            check_socket_room(env.state_dir, spec.name)
    store = env.store()
    from runners.cli.applyplan import apply_running, check_running
    from runners.cli.listenopts import probe_stored

    for spec in specs:  # each new address free now (a port in use, ...): nothing written
        probe_stored(env, spec.name, spec.listens, label=f"{file}: {spec.name}: ")
    changes = store.read(lambda s: plan(s, _wanted(env, specs, stage=False)))  # refusals: nothing changed
    check_running(env, specs)  # a wake or stop it cannot make: refused before anything is written
    keep = {c.host for c in changes if c.action != "remove"}
    done = [store.write(partial(apply_host, w=w)) for w in _wanted(env, specs, stage=True)]
    done += [store.write(partial(remove_absent, name=n))
             for n in _dependents_first(store, [c.host for c in changes if c.host not in keep])]
    from runners.cli.logs import set_aside

    for c in done:
        if c.action == "remove":
            set_aside(env.state_dir, c.host)
            forget_host_files(env.state_dir, c.host)
    ran = apply_running(env, specs)
    for c in done + ran:
        if c.action == "add" and c.host in {r.host for r in ran if r.action == "wake"}:
            c.note = ""  # not asleep: woken by its `running = true`
        click.echo(c.line())
    if ran or any(c.attempt is not None for c in done):
        ring(env)


def _dependents_first(store: Any, names: list[str]) -> list[str]:
    """Hosts to remove, each before the hosts it starts after (`host rm` refuses a host
    that others still name)."""
    from workflows.lifecycle.order import dependents_first, stored_graph

    return list(store.read(lambda s: dependents_first(names, stored_graph(s))))


def _wanted(env: Env, specs: list[Any], stage: bool) -> list[Any]:
    from runners.backend.files import LocalFiles, stage_build, staging_root
    from workflows.config.apply import Wanted

    out = []
    for h in specs:
        if stage:
            path, digest = stage_build(h.build, env.state_dir)
        else:
            digest = LocalFiles().digest(h.build)
            path = str(staging_root(env.state_dir) / digest / Path(h.build).name)
        out.append(Wanted(h.name, h.fields, path, digest, h.build, h.listens))
    return out


from runners.cli.listenopts import attach as _attach_listen  # noqa: E402  (vigil host reopen)

_attach_listen(host)
