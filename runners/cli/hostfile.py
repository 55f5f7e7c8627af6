"""The hosts file `vigil apply` reads: TOML, one table per host.

    [hosts.web]
    build = "../examples/hello/hello.py"   # relative to this file; required
    args = ["--port-from-env"]
    env = { GREETING = "hi" }
    drain_timeout = 15

KEYS below is the one mapping from a TOML key to a host column and its validator; a key
left out gets the column's default. Every error names the file, the line, the key, and the
fix, and is raised before anything is written (tomllib gives no line numbers for keys, so
`line_of`, runners/cli/tomltext.py, finds them in the text: the key inside its host's table,
else the table's header).
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from models.errors import BadInput
from models.states import HostKind
from runners.cli.hostvalues import (
    _catch_up,
    _catch_up_window,
    _count,
    _directory,
    _every,
    _flag,
    _group,
    _health,
    _kind,
    _megabytes,
    _mode,
    _overlap,
    _ready,
    _reload_fail,
    _reload_signal,
    _retries,
    _seconds,
    _start_limit,
    _stop_command,
    _stop_signal,
    _store_loss,
    _str_list,
    _str_table,
    _text,
    _timeout,
    _watchdog,
    _whole,
)
from runners.cli.runopts import (
    LIMIT_KEYS,
    Invalid,
    check_limits,
    file_after,
    file_credentials,
    file_env_files,
    file_limit,
    file_who,
    parse_core,
    parse_count,
    parse_percent,
    parse_size,
)
from runners.cli.tomltext import line_of, nested, too_deep
from workflows.config.hosts import NAME
from workflows.generations.listeners import (
    Listen,
    check_set,
    default_ready,
    overlaps,
    parse_listen,
)
from workflows.generations.slots import check_instances
from workflows.lifecycle.probe import check_probe


@dataclass(frozen=True)
class Key:
    field: str  # the hosts column
    parse: Callable[[Any, Path], Any]  # (TOML value, the file's directory) -> column value
    default: Any  # when the key is left out


KEYS: dict[str, Key] = {
    "kind": Key("kind", _kind, HostKind.instance),
    "args": Key("args", _str_list, []),
    "env": Key("env", _str_table, {}),
    "cwd": Key("cwd", _directory, None),
    "drain_timeout": Key("drain_timeout", _seconds, 10.0),
    "health_timeout": Key("health_timeout", _seconds, 10.0),
    "memory_tier_mb": Key("memory_tier_mb", _megabytes, None),
    "socket_group": Key("socket_group", _group, None),
    "socket_mode": Key("socket_mode", _mode, None),
    "ready": Key("ready", _ready, None),  # with `listen`: "notify" unless given
    # Worker policy (workflows/lifecycle/workers.py); defaults as `vigil host add`'s.
    "one_shot": Key("one_shot", _flag, False),
    "max_run": Key("max_run", _seconds, None),
    "restart_floor": Key("restart_floor", _seconds, 1.0),
    "restart_cap": Key("restart_cap", _seconds, 30.0),
    "restart_reset": Key("restart_reset", _seconds, 60.0),
    "start_limit": Key("start_limit", _start_limit, None),  # "N/SECONDS": then failed
    "converge_grace": Key("converge_grace", _seconds, 60.0),
    # The ongoing health probe of an instance (workflows/lifecycle/probe.py).
    "health_interval": Key("health_interval", _seconds, None),
    # WATCHDOG=1 at least this often, or SIGABRT and a restart (workflows/lifecycle/watchdog.py).
    "watchdog": Key("watchdog", _watchdog, None),
    "unhealthy_after": Key("unhealthy_after", _count, 3),
    "unhealthy_restart": Key("unhealthy_restart", _flag, False),
    "health": Key("health", _health, None),  # what it asks (workflows/generations/probes.py)
    # Who it runs as and what it reads at each start (runners/backend/users.py, envfiles.py).
    "user": Key("run_user", file_who, None),
    "group": Key("run_group", file_who, None),
    "env_file": Key("env_files", file_env_files, "[]"),
    "credentials": Key("credentials", file_credentials, "{}"),
    # Limits on each generation's cgroup and its rlimit (runners/backend/cglimits.py).
    "memory_max": Key("memory_max", file_limit(lambda t: parse_size(t, "")), None),
    "cpu_quota": Key("cpu_quota", file_limit(lambda t: parse_percent(t, "")), None),
    "pids_max": Key("pids_max", file_limit(lambda t: parse_count(t, "")), None),
    "limit_nofile": Key("limit_nofile", file_limit(lambda t: parse_count(t, "")), None),
    "limit_core": Key("limit_core", file_limit(lambda t: parse_core(t, "")), None),
    # The hosts its wake waits for, awake and ready (workflows/lifecycle/order.py).
    "after": Key("start_after", file_after, []),
    # A host placed on several boxes, while its box cannot reach the store (runners/agent/fencing.py).
    "on_store_loss": Key("on_store_loss", _store_loss, "fence"),
    # `vigil reload` (workflows/deploys/reload.py): its signal and the answer to a failed one.
    "reload_signal": Key("reload_signal", _reload_signal, "HUP"),
    "on_reload_fail": Key("on_reload_fail", _reload_fail, "restart"),
    # How a drain asks it to stop (workflows/generations/stopway.py): a signal, or a command.
    "stop_signal": Key("stop_signal", _stop_signal, "TERM"),
    "stop_command": Key("stop_command", _stop_command, None),
    # Processes sharing its listeners (workflows/generations/slots.py); checked with them.
    "instances": Key("instances", _whole, 1),
    # A job's schedule (workflows/lifecycle/jobs.py), with kind = "job": every or schedule.
    "every": Key("every", _every, None),
    "schedule": Key("schedule", _text, None),
    "timezone": Key("timezone", _text, None),
    # A run due while the last one runs (workflows/lifecycle/job_overlap.py), with kind = "job".
    "overlap": Key("overlap", _overlap, "skip"),
    # A job run's bound and second chances (workflows/lifecycle/runpolicy.py).
    "timeout": Key("run_timeout", _timeout, None),
    "retries": Key("run_retries", _retries, 0),
    # The instants missed while no agent ran (workflows/lifecycle/catchup.py), with kind = "job".
    "catch_up": Key("catch_up", _catch_up, "one"),
    "catch_up_window": Key("catch_up_window", _catch_up_window, None),
}
JOB_KEYS = ("every", "schedule", "timezone")
RUN_KEYS = ("timeout", "retries")
CATCH_UP_KEYS = ("catch_up", "catch_up_window")
WORKER_ONLY = ("one_shot", "max_run", "converge_grace")  # the restart policy is every host's
PROBE = ("health_interval", "unhealthy_after", "unhealthy_restart", "health")
BUILD = "build"  # required: the executable, staged like `vigil deploy` does
LISTEN = "listen"  # ["http=tcp:127.0.0.1:8080", ...]: the host's listeners (not a column)
RUNNING = "running"  # true|false: apply wakes or stops the host to it (workflows/config/running.py)


@dataclass(frozen=True)
class HostSpec:
    name: str
    build: str  # absolute path of the source executable
    fields: dict[str, Any]  # every KEYS field, defaults filled in
    listens: list[Listen] = field(default_factory=list)
    running: bool | None = None  # left out: apply neither wakes nor stops it


@dataclass(frozen=True)
class _File:
    """The hosts file being read: where a complaint points (file:line: key)."""
    path: str
    text: str
    base: Path  # relative build paths start here

    def bad(self, host: str | None, key: str | None, reason: str, fix: str) -> BadInput:
        where = ".".join(p for p in ("hosts" if host else None, host, key) if p) or "hosts"
        return BadInput(f"{self.path}:{line_of(self.text, host, key)}: {where}: {reason}", fix)


def _read(path: str) -> tuple[_File, dict[str, Any]]:
    file = Path(path)
    try:
        raw = file.read_bytes()
    except OSError as exc:
        raise BadInput(f"cannot read {path}: {exc.strerror}", "pass the path of a TOML hosts file") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise BadInput(f"{path}:{line}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset "
                       f"{exc.start})", "save the file as UTF-8: TOML files are UTF-8 "
                       "(e.g. `iconv -f latin1 -t utf-8`)") from None
    deep = too_deep(text)
    if deep is not None:
        raise nested(path, deep)
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise BadInput(f"{path}: invalid TOML: {exc}", "correct the syntax at that line") from None
    except RecursionError:  # the scan above missed a nesting (it skips what it takes for strings)
        raise nested(path, None) from None
    return _File(path, text, file.absolute().parent), doc


def load(path: str) -> list[HostSpec]:
    """Read and check the whole file; raises BadInput (file:line: key: reason; fix)."""
    f, doc = _read(path)
    for top in doc:
        if top != "hosts":
            raise f.bad(None, top, "unknown key", "the file holds only [hosts.NAME] tables")
    if not isinstance(doc.get("hosts"), dict):
        raise f.bad(None, None, "no [hosts] table",
                    "add a [hosts.NAME] table per host (an empty [hosts] table removes them all)")
    specs = [_host(f, name, table) for name, table in doc["hosts"].items()]
    seen: dict[str, str] = {}
    for host_spec in specs:
        for a in host_spec.listens:
            other = next((b for b in seen if overlaps(a.address, b)), None)  # resolved paths
            if other is not None:
                raise f.bad(host_spec.name, LISTEN, f"{a.address} is also host "
                            f"{seen[other]}'s listener", "give each host its own address")
            seen[a.address] = host_spec.name
    return specs


def order_refusals(path: str, specs: list[HostSpec]) -> list[tuple[str, BadInput]]:
    """Each `after` that names no host of the file, and a cycle: (host, its file:line)."""
    from workflows.lifecycle.order import problems

    f, _ = _read(path)
    return [(host, f.bad(host, "after", exc.cause, exc.fix or ""))
            for host, exc in problems({h.name: h.fields["start_after"] for h in specs})]


def _host(f: _File, name: str, table: Any) -> HostSpec:
    if not NAME.fullmatch(name):
        raise f.bad(name, None, f"invalid host name {name!r}",
                    "use 1-63 characters: lowercase letters, digits and '-', not starting with '-'")
    if not isinstance(table, dict):
        raise f.bad(name, None, "must be a table", f'write [hosts.{name}] and its keys below it')
    for key in table:
        if key not in (BUILD, LISTEN, RUNNING) and key not in KEYS:
            raise f.bad(name, key, "unknown key",
                        f"the keys are {', '.join([BUILD, LISTEN, RUNNING, *KEYS])}")
    src = _build(f, name, table)
    fields = _fields(f, name, table)
    listens = _listens(f, name, table, fields)
    running = None
    if RUNNING in table:
        try:
            running = _flag(table[RUNNING], f.base)
        except Invalid as exc:
            raise f.bad(name, RUNNING, exc.cause, "write running = true or running = false") from None
    return HostSpec(name=name, build=str(src.absolute()), fields=fields, listens=listens,
                    running=running)


def _build(f: _File, name: str, table: dict[str, Any]) -> Path:
    if BUILD not in table:
        raise f.bad(name, None, f"no {BUILD} key", f'add {BUILD} = "path/to/executable"')
    build = table[BUILD]
    src = f.base / build if isinstance(build, str) else None
    if src is None or not src.is_file() or not os.access(src, os.X_OK):
        what = "is not a string" if src is None else (
            "is not executable" if src.is_file() else "is not an existing file")
        raise f.bad(name, BUILD, f"{json.dumps(build)} {what}",
                    "name an executable file (relative paths start at the file's directory)")
    return src


def _fields(f: _File, name: str, table: dict[str, Any]) -> dict[str, Any]:
    """Every key's value (or its default), then the checks that span several keys."""
    fields = {}
    for key, spec in KEYS.items():
        try:
            fields[spec.field] = spec.parse(table[key], f.base) if key in table else spec.default
        except BadInput as exc:
            raise f.bad(name, key, exc.cause, exc.fix or "") from None
    if fields["kind"] is not HostKind.worker:
        for key in WORKER_ONLY:
            if key in table:
                raise f.bad(name, key, "applies to workers only",
                            'add kind = "worker", or drop the key')
    try:
        check_probe(fields["kind"], fields["health_interval"],
                    table.get("unhealthy_after"), fields["unhealthy_restart"], fields["health"])
    except BadInput as exc:
        raise f.bad(name, next(k for k in PROBE if k in table), exc.cause,
                    exc.fix or "") from None
    if fields["restart_cap"] < fields["restart_floor"]:
        raise f.bad(name, "restart_cap" if "restart_cap" in table else "restart_floor",
                    f"restart_cap {fields['restart_cap']:g} is below restart_floor "
                    f"{fields['restart_floor']:g}", "give a cap at least as large as the floor")
    try:
        from runners.backend.users import check_run_as
        check_run_as(fields["run_user"], fields["run_group"], label="")
    except BadInput as exc:
        raise f.bad(name, "user" if "user" in table else "group", exc.cause,
                    exc.fix or "") from None
    try:
        check_limits({k: fields[k] for k in LIMIT_KEYS})
    except BadInput as exc:
        raise f.bad(name, next((k for k in LIMIT_KEYS if k in table), None), exc.cause,
                    exc.fix or "") from None
    if fields["one_shot"] and fields["max_run"] is not None:
        raise f.bad(name, "max_run", "max_run recycles an always-on worker; this one is one_shot",
                    "drop one of the two")
    _job(f, name, table, fields)
    return fields


def _job(f: _File, name: str, table: dict[str, Any], fields: dict[str, Any]) -> None:
    """kind = "job": its schedule checked (every or schedule, timezone); another kind: no
    schedule key."""
    from workflows.lifecycle.jobs import check_job
    from workflows.lifecycle.runpolicy import check_run_policy

    kind = "job" if table.get("kind") == "job" else fields["kind"].value
    try:
        check_job(kind, fields["every"], fields["schedule"], fields["timezone"])
    except BadInput as exc:
        key = next((k for k in JOB_KEYS if k in table), "kind")
        raise f.bad(name, key, exc.cause.replace("--", ""), exc.fix or "") from None
    if kind == "job" and fields["one_shot"]:
        raise f.bad(name, "one_shot", "a job is not one_shot: each of its runs is one",
                    "drop one_shot")
    if "overlap" in table and kind != "job":
        raise f.bad(name, "overlap", f"overlap is for a job; this host is a {kind}",
                    'add kind = "job", or drop overlap')
    _catch_up_of(f, name, table, fields, kind)
    given = [k for k in RUN_KEYS if k in table]
    try:
        check_run_policy(kind, *(fields[KEYS[k].field] if k in given else None for k in RUN_KEYS))
    except BadInput as exc:
        raise f.bad(name, given[0], exc.cause.replace("--", ""), (exc.fix or "").replace(
            "--kind job", 'kind = "job"').replace("--", "")) from None


def _catch_up_of(f: _File, name: str, table: dict[str, Any], fields: dict[str, Any],
                 kind: str) -> None:
    """catch_up and catch_up_window: a job's only, and no window with none."""
    from workflows.lifecycle.catchup import check_catch_up

    given = [k for k in CATCH_UP_KEYS if k in table]
    try:
        check_catch_up(kind, *(fields[k] if k in given else None for k in CATCH_UP_KEYS))
    except BadInput as exc:
        raise f.bad(name, given[-1], exc.cause.replace("--", "").replace("-", "_"),
                    (exc.fix or "").replace("--kind job", 'kind = "job"').replace("--", "")
                    .replace("-", "_")) from None


def _listens(f: _File, name: str, table: dict[str, Any], fields: dict[str, Any]) -> list[Any]:
    """The host's listeners; sets its readiness to their default when the file gives none."""
    raw = table.get(LISTEN, [])
    if not isinstance(raw, list) or not all(isinstance(x, str) for x in raw):
        raise f.bad(name, LISTEN, "must be a list of strings",
                    'write listen = ["http=tcp:127.0.0.1:8080"]')
    try:
        listens = [parse_listen(x, name, label="") for x in raw]
        if fields["ready"] is None:
            fields["ready"] = default_ready(listens)
        check_set(listens, fields["kind"], fields["ready"], label=LISTEN)
    except BadInput as exc:
        raise f.bad(name, LISTEN if LISTEN in table else "ready", exc.cause,
                    exc.fix or "") from None
    try:
        check_instances(fields["instances"], listens, fields["kind"], label="instances",
                        tier=fields["memory_tier_mb"])
    except BadInput as exc:
        raise f.bad(name, "instances", exc.cause, exc.fix or "") from None
    return listens
