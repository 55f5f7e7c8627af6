"""`vigil host show NAME` and `vigil host set NAME --OPTION ...`: read one host's every
setting, and change some of them without removing and adding it again.

`host set` takes the options of `host add` (and `--unset OPTION` to give one back its
default); the stored host with the changes laid over it is checked by the same rules as
a hosts file (runners/cli/hostfile.py) and then applied by `vigil apply`'s own step
(workflows/config/apply.py): one transaction, refused with one line and nothing written
when a value is bad or the change cannot be made while the host runs (its kind, its
listeners), applied at the host's next start otherwise; a new build of a host that runs
becomes a deploy attempt with cause `config`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from models.errors import BadInput
from models.states import HostKind
from runners.cli.common import SECONDS, Env, echo_json, options

UNSETTABLE = ("reload-signal", "on-reload-fail", "args", "env", "cwd", "socket-group", "socket-mode", "listen", "ready",
              "health-interval", "unhealthy-after", "unhealthy-restart", "health", "max-run",
              "restart-floor", "restart-cap", "restart-reset", "start-limit", "converge-grace", "one-shot",
              "drain-timeout", "health-timeout", "after", "on-store-loss", "env-file", "watchdog",
              "credential", "stop-signal", "stop-command", "overlap", "timeout", "retries",
              "catch-up", "catch-up-window")
KEY_OF = {"credential": "credentials"}  # an option whose hosts-file key is named otherwise


def _options() -> Any:
    """The hosts file's checks, with a bad value named by its option, not by a line of a
    file (made here: the hosts file module imports the store's models, which `vigil
    --help` and the quick commands must not pay for)."""
    from dataclasses import dataclass

    from runners.cli.hostfile import _File

    @dataclass(frozen=True)
    class Options(_File):
        def bad(self, host: str | None, key: str | None, reason: str, fix: str) -> BadInput:
            option = "--" + {v: k for k, v in KEY_OF.items()}.get(key or "", key or "").replace("_", "-")
            return BadInput(f"host set {host}: {option}: {reason}", fix)

    return Options(path="", text="", base=Path.cwd())


def _table(h: Any, listens: list[Any]) -> dict[str, Any]:
    """The stored host as a hosts file would say it: every key that differs from its
    default (a default is left out, so the file's cross-key rules read it as they would)."""
    from runners.cli.hostfile import KEYS
    from workflows.generations.listeners import default_ready

    out: dict[str, Any] = {}
    for key, spec in KEYS.items():
        value = getattr(h, spec.field)
        if key in ("args", "env", "after", "env_file", "credentials"):  # stored as JSON text
            value = json.loads(value)
        elif key == "kind":
            value = "job" if h.every is not None or h.schedule is not None else value.value
        elif key == "socket_mode" and value is not None:
            value = f"0{value:o}"
        elif key == "ready" and value == default_ready(listens):
            continue  # recomputed from the listeners, which may change
        default = spec.default.value if isinstance(spec.default, HostKind) else spec.default
        if value is not None and value != default:
            out[key] = value
    if listens:
        out["listen"] = [f"{a.name}={a.address}" for a in listens]
    return out


def attach(host: click.Group) -> None:
    host.add_command(host_show)
    host.add_command(host_set)


@click.command("show")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
def host_show(env: Env, name: str, as_json: bool) -> None:
    """Every setting of a host, its build (file name and digest), its listeners and its
    last attempt with the outcome."""
    from workflows.config.show import describe

    info = env.store().read(lambda s: describe(s, name))
    if as_json:
        echo_json(info)
        return
    for line in _lines(info):
        click.echo(line)


def _lines(info: dict[str, Any]) -> list[str]:
    def build(b: dict[str, Any] | None) -> str:
        return "-" if b is None else f"{b['file']} {b['digest'][:12]} (from {b['source']})"

    out = [f"host {info['host']}: {info['kind']}, {info['state']} (desired {info['desired']})",
           f"  {'build:':<20}{build(info['build'])}"]
    if info["running"] is not None and info["running"] != info["build"]:
        out.append(f"  {'runs now:':<20}{build(info['running'])}")
    if info["generation"] is not None:
        out.append(f"  {'generation:':<20}g{info['generation']} pid {info['pid']}")
    skip = {"host", "kind", "state", "desired", "build", "running", "generation", "pid",
            "listeners", "last_attempt"}
    for key, value in info.items():
        if key in skip:
            continue
        label = key.replace("_", " ") + (" (names)" if key == "env" else "") + ":"
        out.append(f"  {label:<20}{_shown(key, value)}")
    for r in info["listeners"]:
        out.append(f"  {'listener:':<20}{r['name']}={r['address']} (fd {r['fd']}, {r['state']})"
                   + (f": {r['note']}" if r["note"] else ""))
    a = info["last_attempt"]
    if a is not None:
        end = a["outcome"] or f"at {a['step']}"
        out.append(f"  {'last attempt:':<20}#{a['id']} {a['cause']} {a['mode']} of {a['build']} "
                   f"{end}" + (f": {a['reason']}" if a["reason"] and a["outcome"] != "done" else "")
                   + f" ({a['at']})")
    return out


def _shown(key: str, value: Any) -> str:
    """One setting's value as `host show` prints it (sizes as `64M`, as they are given)."""
    if value in (None, [], {}):
        return "-"
    if key in ("env", "after", "env_file"):
        return ", ".join(value)
    if key == "credentials":
        return ", ".join(f"{name}={path}" for name, path in value.items())
    if key == "args":
        return json.dumps(value)
    if key in ("memory_max", "limit_core") and value:
        unit = next((u for u in "TGMK" if value % (1 << (10 * " KMGT".index(u))) == 0), "")
        return f"{value >> (10 * ' KMGT'.index(unit))}{unit}" if unit else str(value)
    if key == "cpu_quota":
        return f"{value}%"
    return str(value).lower() if isinstance(value, bool) else str(value)


SET_OPTIONS = [
    click.option("--build", "build_path", default=None, help="A new executable (staged now; a "
                  "host that runs is deployed onto it, cause config)."),
    click.option("--kind", type=click.Choice([k.value for k in HostKind]), default=None),
    click.option("--arg", "args", multiple=True, help="Argument for the build (repeatable; "
                  "replaces them all)."),
    click.option("--env", "envs", multiple=True, help="K=V environment entry (repeatable; "
                  "sets K, keeps the others)."),
    click.option("--unset-env", "unset_envs", multiple=True, metavar="K", help="Drop env K."),
    click.option("--cwd", default=None, help="Working directory of the app."),
    click.option("--env-file", "env_files", multiple=True, metavar="[-]PATH",
                 help="A systemd EnvironmentFile= file read at each start (repeatable; "
                      "replaces them all; -PATH: skipped when missing)."),
    click.option("--credential", "credentials", multiple=True, metavar="NAME=PATH",
                 help="A secret file copied at each start to $CREDENTIALS_DIRECTORY/NAME "
                      "(repeatable; replaces them all)."),
    click.option("--drain-timeout", type=SECONDS, default=None),
    click.option("--health-timeout", type=SECONDS, default=None),
    click.option("--socket-group", default=None),
    click.option("--socket-mode", default=None, help="Octal, e.g. 0660."),
    click.option("--listen", "listens", multiple=True, metavar="[NAME=]tcp:HOST:PORT|unix:/PATH",
                  help="Listening sockets (repeatable; replaces them all; only while it does "
                       "not run)."),
    click.option("--ready", default=None, metavar="http[:PATH]|tcp|exec:CMD|notify"),
    click.option("--instances", type=int, default=None, metavar="N",
                  help="Processes sharing its --listen sockets (a running host: `vigil scale`)."),
    click.option("--health-interval", type=SECONDS, default=None),
    click.option("--unhealthy-after", type=int, default=None),
    click.option("--unhealthy-restart/--no-unhealthy-restart", default=None),
    click.option("--health", default=None, metavar="http:PATH|tcp|exec:CMD"),
    click.option("--one-shot/--no-one-shot", default=None),
    click.option("--max-run", type=SECONDS, default=None),
    click.option("--restart-floor", type=SECONDS, default=None),
    click.option("--restart-cap", type=SECONDS, default=None),
    click.option("--restart-reset", type=SECONDS, default=None),
    click.option("--start-limit", default=None, metavar="N/SECONDS"),
    click.option("--converge-grace", type=SECONDS, default=None),
    click.option("--watchdog", type=SECONDS, default=None, metavar="SECONDS",
                 help="WATCHDOG=1 on $NOTIFY_SOCKET at least this often, or SIGABRT and a "
                      "restart (WATCHDOG_USEC, WATCHDOG_PID)."),
    click.option("--after", "after", multiple=True, metavar="HOST",
                  help="A host its wake waits for, awake and ready (repeatable; replaces them "
                       "all)."),
    click.option("--on-store-loss", type=click.Choice(["fence", "keep"]), default=None,
                  help="While its box cannot reach the store: fence (stop it) or keep."),
    click.option("--stop-signal", default=None, metavar="SIG",
                  help="Signal that asks it to stop at a stop or drain (TERM, QUIT, 15, ...)."),
    click.option("--stop-command", default=None, metavar="CMD",
                  help="Run instead of the stop signal, as the app's user with its env "
                       "($MAINPID: the leader); the drain timeout still ends in SIGKILL."),
    click.option("--reload-signal", default=None, metavar="SIG",
                 help="The signal `vigil reload` sends (HUP)."),
    click.option("--on-reload-fail", type=click.Choice(["restart", "keep"]), default=None,
                 help="A reload not back ready in time: restart (overlap, same build) or keep."),
    click.option("--overlap", default=None, metavar="skip|queue|replace|allow",
                 help="Job: a run due while the last one runs is skipped, queued, replaces "
                      "it, or runs beside it (skip)."),
    click.option("--timeout", default=None, metavar="PERIOD",
                 help="Job: a run still running after PERIOD is ended by the stop path and "
                      "failed."),
    click.option("--retries", type=int, default=None, metavar="N",
                 help="Job: a failed run is started again up to N times (restart backoff)."),
    click.option("--catch-up", default=None, metavar="none|one|all",
                 help="Job: the instants missed while no agent ran: none run, the last one "
                      "(one), or each, oldest first (all)."),
    click.option("--catch-up-window", default=None, metavar="PERIOD",
                 help="Job: only instants missed less than PERIOD ago are caught up."),
    click.option("--unset", "unsets", multiple=True, type=click.Choice(UNSETTABLE),
                  help="Give this option back its default (repeatable)."),
    click.option("--dry-run", is_flag=True, help="Print the change; write nothing."),
]


set_options = options(*SET_OPTIONS)


@click.command("set")
@click.argument("name")
@set_options
@click.pass_obj
def host_set(env: Env, name: str, build_path: str | None, envs: tuple[str, ...],
             unset_envs: tuple[str, ...], listens: tuple[str, ...], unsets: tuple[str, ...],
             dry_run: bool, **given: Any) -> None:
    """Change a host's settings (the options of `host add`), applied at its next start as
    `vigil apply` does; refused with one line, nothing written, when a value is bad or the
    change cannot be made while it runs."""
    from functools import partial

    from runners.backend.files import stage_build
    from runners.cli.listenopts import probe_stored
    from workflows.config.apply import Wanted, apply_host, diff
    from workflows.config.hosts import check_socket_room

    store = env.store()
    table, _, build = store.read(lambda s: _stored(s, name))
    _lay_over(table, given, unsets, envs, unset_envs, listens)
    fields, new_listens = _checked(_options(), name, table)
    if fields["kind"] is HostKind.instance:
        check_socket_room(env.state_dir, name)
    probe_stored(env, name, new_listens, label=f"host set {name}: ")
    path, digest, source = build
    if build_path is not None:
        source = str(Path(build_path).absolute())
        path, digest = stage_build(build_path, env.state_dir) if not dry_run else (
            _would_stage(env, build_path))
    w = Wanted(name, fields, path, digest, source, new_listens)
    change = (store.read(partial(_in_order, step=diff, w=w)) if dry_run
              else store.write(partial(_in_order, step=apply_host, w=w)))
    if change.action == "keep":
        click.echo(f"host {name}: nothing to change")
        return
    click.echo(change.line() + (" (dry run: nothing changed)" if dry_run else ""))
    if change.attempt is not None:
        from runners.cli.common import ring

        ring(env)


def _in_order(s: Any, step: Any, w: Any) -> Any:
    """`step` (diff or apply_host), once the stored start order with this host's `after`
    laid over it is checked (every name a host, no cycle) in its own transaction."""
    from workflows.lifecycle.order import check_graph, stored_graph

    check_graph({**stored_graph(s), w.name: w.fields["start_after"]})
    return step(s, w=w)


def _lay_over(table: dict[str, Any], given: dict[str, Any], unsets: tuple[str, ...],
              envs: tuple[str, ...], unset_envs: tuple[str, ...],
              listens: tuple[str, ...]) -> None:
    """The options given, laid over the stored host's keys (an --unset one left out)."""
    from runners.cli.runopts import credential_items

    given = {k: v for k, v in given.items() if v not in (None, ())}
    for key in unsets:
        table.pop(KEY_OF.get(key, key).replace("-", "_"), None)
    for key in ("args", "after"):
        if key in given:
            given[key] = list(given[key])
    if "env_files" in given:  # the hosts file's key; checked there as `host add` checks it
        given["env_file"] = list(given.pop("env_files"))
    if "credentials" in given:
        given["credentials"] = credential_items(given["credentials"])
    if envs or unset_envs:
        given["env"] = _env(dict(table.get("env", {})), envs, unset_envs)
    if listens:
        given["listen"] = list(listens)
    table.update(given)


def _stored(s: Any, name: str) -> tuple[dict[str, Any], list[Any], tuple[str, str, str]]:
    from models.errors import NotFound
    from models.tables import Build, Host
    from workflows.generations.listeners import as_listens, stored

    h = s.get(Host, name)
    if h is None:
        raise NotFound(f"no host named {name!r}", "see `vigil host list`")
    listens = as_listens(stored(s, name))
    b = s.get(Build, h.build_id)
    return _table(h, listens), listens, (b.path, b.digest, b.source)


def _env(current: dict[str, str], envs: tuple[str, ...], drop: tuple[str, ...]) -> dict[str, str]:
    from runners.cli.runopts import env_pairs

    current.update(env_pairs(envs))
    for key in drop:
        current.pop(key, None)
    return current


def _checked(f: Any, name: str, table: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
    """The fields and listeners of the changed host, by the hosts file's own rules."""
    from runners.cli.hostfile import _fields, _listens

    fields = _fields(f, name, table)
    return fields, _listens(f, name, table, fields)


def _would_stage(env: Env, build_path: str) -> tuple[str, str]:
    from runners.backend.files import LocalFiles, staging_root

    digest = LocalFiles().digest(build_path)
    return str(staging_root(env.state_dir) / digest / Path(build_path).name), digest
