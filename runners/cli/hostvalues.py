"""The checks of single values in the hosts file (runners/cli/hostfile.py's KEYS): each
takes the TOML value and the file's directory and returns the column's value, or raises
Invalid with the cause and the fix."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from models.durations import check_seconds
from models.errors import BadInput
from models.states import HostKind
from runners.backend.sockets import check_group, parse_mode
from runners.cli.runopts import Invalid
from workflows.config.hosts import check_args, check_env
from workflows.generations.listeners import parse_ready
from workflows.lifecycle.probe import MAX_AFTER


def _kind(v: Any, _: Path) -> HostKind:
    if v == "job":  # a job is stored as a worker whose schedule is set (checked by _fields)
        return HostKind.worker
    if v not in [k.value for k in HostKind]:
        raise Invalid(f"must be \"instance\", \"worker\" or \"job\", not {json.dumps(v)}",
                      'write kind = "instance" (serves HTTP), "worker" or "job" (on a schedule)')
    return HostKind(v)


def _every(v: Any, _: Path) -> float:
    from workflows.lifecycle.jobs import parse_every

    if isinstance(v, bool) or not isinstance(v, int | float | str):
        raise Invalid(f"must be seconds or a period, not {json.dumps(v)}", 'write e.g. every = "10m"')
    try:
        return parse_every(v, "")
    except BadInput as exc:
        raise Invalid(exc.cause, exc.fix or "") from None


def _timeout(v: Any, base: Path) -> float:
    try:
        return _every(v, base)
    except Invalid as exc:
        raise Invalid(exc.cause, 'write e.g. timeout = "30m"') from None


def _catch_up(v: Any, _: Path) -> str:
    from workflows.lifecycle.catchup import POLICIES

    if v not in POLICIES:
        raise Invalid(f"must be one of {', '.join(POLICIES)}, not {json.dumps(v)}",
                      'write catch_up = "all" (none, one or all)')
    return str(v)


def _catch_up_window(v: Any, base: Path) -> float:
    try:
        return _every(v, base)
    except Invalid as exc:
        raise Invalid(exc.cause, 'write e.g. catch_up_window = "1h"') from None


def _retries(v: Any, _: Path) -> int:
    from workflows.lifecycle.runpolicy import MAX_RETRIES

    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_RETRIES:
        raise Invalid(f"must be a count from 0 to {MAX_RETRIES}, not {json.dumps(v)}",
                      "write retries = 2")
    return v


def _text(v: Any, _: Path) -> str:
    if not isinstance(v, str) or not v.strip():
        raise Invalid("must be a non-empty string", 'write e.g. schedule = "30 4 * * *"')
    return v


def _str_list(v: Any, _: Path) -> list[str]:
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise Invalid("must be a list of strings", 'write args = ["--flag", "value"]')
    check_args(v, label="")
    return v


def _str_table(v: Any, _: Path) -> dict[str, str]:
    if not isinstance(v, dict):
        raise Invalid("must be a table of strings", 'write env = { NAME = "value" }')
    for k, x in v.items():
        if not isinstance(x, str):
            raise Invalid(f"{k} must be a string, not {json.dumps(x)}",
                          f"quote it: {k} = {json.dumps(str(x).lower() if isinstance(x, bool) else str(x))}")
    check_env(v, label="")
    return v


def _directory(v: Any, base: Path) -> str:
    if not isinstance(v, str) or not (base / v).is_dir():
        raise Invalid(f"{json.dumps(v)} is not an existing directory",
                      "name a directory (relative paths start at the file's directory)")
    return str((base / v).resolve())


def _watchdog(v: Any, _: Path) -> float | None:
    from workflows.lifecycle.watchdog import check_watchdog

    try:
        return check_watchdog(v, "")
    except BadInput as exc:
        raise Invalid(exc.cause, "write e.g. 10") from None


def _seconds(v: Any, _: Path) -> float:
    try:
        return check_seconds(v, "")
    except BadInput as exc:
        raise Invalid(exc.cause, "write e.g. 10 or 2.5") from None


MAX_MB = 2**31 - 1  # an Integer column: 2 PiB, above any box's memory


def _megabytes(v: Any, _: Path) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= MAX_MB:
        raise Invalid(f"must be a whole number of megabytes from 1 to {MAX_MB}, not "
                      f"{json.dumps(v)}", "write e.g. 256")
    return v


def _group(v: Any, _: Path) -> str:
    try:
        if not isinstance(v, str):
            raise ValueError(f"{json.dumps(v)} is not a group name")
        check_group(v)
    except ValueError as exc:
        raise Invalid(str(exc), "name an existing group (see `getent group`)") from None
    return v


def _mode(v: Any, _: Path) -> int:
    if not isinstance(v, str):
        raise Invalid(f"must be an octal string, not {json.dumps(v)}", 'write socket_mode = "0660"')
    try:
        return parse_mode(v)
    except ValueError as exc:
        raise Invalid(str(exc), 'write socket_mode = "0660"') from None


def _ready(v: Any, _: Path) -> str:
    if not isinstance(v, str):
        raise Invalid(f"must be a string, not {json.dumps(v)}", 'write ready = "notify"')
    return parse_ready(v, label="")


def _reload_signal(v: Any, _: Path) -> str:
    from workflows.deploys.reload import check_reload_signal

    if not isinstance(v, str):
        raise Invalid(f"must be a string, not {json.dumps(v)}", 'write reload_signal = "HUP"')
    try:
        return check_reload_signal(v, label="")
    except BadInput as exc:
        raise Invalid(exc.cause, 'write e.g. reload_signal = "HUP" (a name of `kill -l`)') from None


def _reload_fail(v: Any, _: Path) -> str:
    if v not in ("restart", "keep"):
        raise Invalid(f"must be \"restart\" or \"keep\", not {json.dumps(v)}",
                      'write on_reload_fail = "restart" (an overlap restart of the same build) '
                      'or "keep" (left as it is)')
    return str(v)


def _overlap(v: Any, _: Path) -> str:
    from workflows.lifecycle.job_overlap import OVERLAPS

    if v not in OVERLAPS:
        raise Invalid(f"must be one of {', '.join(OVERLAPS)}, not {json.dumps(v)}",
                      'write overlap = "queue" (skip, queue, replace or allow)')
    return str(v)


def _health(v: Any, _: Path) -> str | None:
    """The health probe's kind; plain "http" (GET / below 500) is stored as NULL."""
    from workflows.generations.probes import HEALTH_KINDS, parse_probe

    if not isinstance(v, str):
        raise Invalid(f"must be a string, not {json.dumps(v)}", 'write health = "http:/healthz"')
    text = parse_probe(v, "", HEALTH_KINDS)
    return None if text == "http" else text


def _flag(v: Any, _: Path) -> bool:
    if not isinstance(v, bool):
        raise Invalid(f"must be true or false, not {json.dumps(v)}", "write true or false")
    return v


def _count(v: Any, _: Path) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_AFTER:
        raise Invalid(f"must be a count from 1 to {MAX_AFTER}, not {json.dumps(v)}",
                      "write unhealthy_after = 3")
    return v


def _start_limit(v: Any, _: Path) -> str:
    from workflows.lifecycle.restarts import parse_start_limit

    try:
        return parse_start_limit(v, label="")
    except BadInput as exc:
        raise Invalid(exc.cause, 'write e.g. start_limit = "5/60" (5 quick exits in 60 s '
                      'make it failed)') from None


def _store_loss(v: Any, _: Path) -> str:
    if v not in ("fence", "keep"):
        raise Invalid(f"must be \"fence\" or \"keep\", not {json.dumps(v)}",
                      'write on_store_loss = "fence" (stopped, never on two boxes) or "keep" '
                      '(left running)')
    return str(v)
def _stop_signal(v: Any, _: Path) -> str:
    from workflows.generations.stopway import parse_signal

    try:
        return parse_signal(v, label="")
    except BadInput as exc:
        raise Invalid(exc.cause, 'write e.g. stop_signal = "QUIT" (a name of `kill -l`)') from None


def _stop_command(v: Any, _: Path) -> str | None:
    from workflows.generations.stopway import check_command

    if not isinstance(v, str):
        raise Invalid(f"must be a string, not {json.dumps(v)}", 'write stop_command = "nginx -s quit"')
    try:
        return check_command(v, label="")
    except BadInput as exc:
        raise Invalid(exc.cause, exc.fix or "") from None


def _whole(v: Any, _: Path) -> Any:
    return v  # checked beside the listeners (check_instances), which it needs
