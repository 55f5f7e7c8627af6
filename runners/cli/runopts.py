"""`host add`'s options for running an app the way production needs: its own user and
group, env files read at each start (and the limits on its cgroup). Each is checked here,
before anything is staged or written; the values become host columns."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from models.errors import BadInput
from runners.cli.common import options

LIMIT_KEYS = ("memory_max", "cpu_quota", "pids_max", "limit_nofile", "limit_core")
_SIZE = re.compile(r"(\d+)([KMGT]?)", re.I)
MAX_INT = 2**31 - 1  # an Integer column
MAX_SIZE = 2**63 - 1  # a BigInteger column (and far above any memory or core limit)


def parse_size(text: str, label: str = "--memory-max ") -> int:
    """'64M' -> 67108864 (K, M, G, T: powers of 1024; no suffix: bytes)."""
    m = _SIZE.fullmatch(text.strip())
    example = " ".join(filter(None, ("write e.g.", label.strip(), "64M")))
    if not m or int(m.group(1)) <= 0:
        raise BadInput(f"{label}{text!r} is not a size", example)
    size = int(m.group(1)) << (10 * " KMGT".index(m.group(2).upper() or " "))
    if size > MAX_SIZE:  # refused here, not by the store's OverflowError after a dry run passed
        raise BadInput(f"{label}{text!r} is too large: at most {MAX_SIZE >> 40}T", example)
    return size


def parse_core(text: object, label: str = "--limit-core ") -> int:
    """A core-file size: 0 (no core file is written) or a size as parse_size takes it."""
    body = "x" if isinstance(text, bool) else str(text).strip()
    if body == "0":
        return 0
    try:
        return parse_size(body, label)
    except BadInput:
        raise BadInput(f"{label}{text!r} is not a core-file size",
                       f"write e.g. {label.strip()} 0 (no core file) or 512M") from None


def parse_percent(text: str, label: str = "--cpu-quota ") -> int:
    """'150%' -> 150: the share of one core."""
    body = text.strip().removesuffix("%")
    if not body.isdigit() or not 1 <= int(body) <= 100 * 1024:
        raise BadInput(f"{label}{text!r} is not a share of one core",
                       f"write e.g. {label.strip()} 20% (150% is one and a half cores)")
    return int(body)


def parse_count(text: object, label: str) -> int:
    if isinstance(text, bool) or not str(text).isdigit() or not 1 <= int(str(text)) <= MAX_INT:
        raise BadInput(f"{label}{text!r} is not a whole number from 1", f"write e.g. {label.strip()} 64")
    return int(str(text))


def check_limits(limits: dict[str, int | None]) -> None:
    """Each limit has a controller on this box to enforce it; one line naming what lacks."""
    wanted: dict[str, int] = {k: v for k, v in limits.items() if v is not None}
    if not wanted:
        return
    from runners.backend.cglimits import CgroupLimits
    from runners.backend.process import detect_cgroup_base

    lacking = CgroupLimits(detect_cgroup_base("auto")).missing(wanted)
    if lacking:
        raise BadInput(f"this box cannot enforce {lacking[0]}", "drop the limit, or run the "
                       "host on a box that mounts that controller")


def env_pairs(items: tuple[str, ...]) -> dict[str, str]:
    """`--env K=V` entries as a mapping (a later K wins)."""
    pairs: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise BadInput(f"--env {item!r} is not K=V", "write it as --env NAME=value")
        pairs[key] = value
    return pairs


run_options = options(
        click.option("--user", "run_user", default=None, metavar="NAME|UID",
                     help="Run the app as this user (its groups, HOME, USER, LOGNAME, SHELL "
                          "from the passwd and group databases); the agent must be root."),
        click.option("--group", "run_group", default=None, metavar="NAME|GID",
                     help="Its primary group instead of the user's own (needs --user)."),
        click.option("--env-file", "env_files", multiple=True, metavar="[-]PATH",
                     help="A systemd EnvironmentFile= file read at each start (repeatable; "
                          "-PATH: skipped when missing); --env wins."),
        click.option("--credential", "credentials", multiple=True, metavar="NAME=PATH",
                     help="A secret file copied at each start to $CREDENTIALS_DIRECTORY/NAME, "
                          "readable by the app's user only (repeatable)."),
        click.option("--memory-max", default=None, metavar="SIZE",
                     help="Memory limit of each generation's cgroup, e.g. 64M (K, M, G)."),
        click.option("--cpu-quota", default=None, metavar="PERCENT",
                     help="CPU time per period as a share of one core, e.g. 20% or 150%."),
        click.option("--pids-max", default=None, metavar="N",
                     help="Most processes and threads its cgroup may hold."),
        click.option("--limit-nofile", default=None, metavar="N",
                     help="Open-files limit (RLIMIT_NOFILE, soft and hard)."),
        click.option("--limit-core", default=None, metavar="SIZE",
                     help="Core-file size limit (RLIMIT_CORE, soft and hard): 0 writes none."),
        click.option("--stop-signal", default="TERM", show_default=True, metavar="SIG",
                     help="Signal that asks it to stop at a stop or drain (TERM, QUIT, 15, ...)."),
        click.option("--stop-command", default=None, metavar="CMD",
                     help="Run instead of the stop signal, as the app's user with its env "
                          "($MAINPID: the leader); the drain timeout still ends in SIGKILL."),
)


def checked_run(opts: dict[str, Any]) -> dict[str, Any]:
    """Takes the run options out of `opts` (the command's keyword arguments); the host columns.
    Raises BadInput (one line) for an unknown user or group, a non-root agent asked for
    another user, or an env file that is missing or has a bad line."""
    from runners.backend.envfiles import check_entries
    from runners.backend.users import check_run_as

    user, group = opts.pop("run_user", None), opts.pop("run_group", None)
    files = list(opts.pop("env_files", ()) or ())
    check_run_as(user, group)
    limits = {"memory_max": _opt(opts.pop("memory_max", None), parse_size),
              "cpu_quota": _opt(opts.pop("cpu_quota", None), parse_percent),
              "pids_max": _opt(opts.pop("pids_max", None),
                               lambda t: parse_count(t, "--pids-max ")),
              "limit_nofile": _opt(opts.pop("limit_nofile", None),
                                   lambda t: parse_count(t, "--limit-nofile ")),
              "limit_core": _opt(opts.pop("limit_core", None), parse_core)}
    check_limits(limits)
    creds = credential_items(opts.pop("credentials", ()) or ())
    env_files = check_entries(files)
    warn_shared(env_files, "--env-file ")
    return {"run_user": user, "run_group": group, "env_files": json.dumps(env_files),
            "credentials": json.dumps(check_credentials(creds)), **limits, **checked_stop(opts)}


def checked_stop(opts: dict[str, Any]) -> dict[str, Any]:
    """Takes --stop-signal and --stop-command out of `opts`: the host columns, checked
    (workflows/generations/stopway.py)."""
    from workflows.generations.stopway import check_command, parse_signal

    return {"stop_signal": parse_signal(opts.pop("stop_signal", None) or "TERM"),
            "stop_command": check_command(opts.pop("stop_command", None))}


def warn_shared(paths: list[str], label: str) -> None:
    """One line for each file in a directory others can write: one of them could swap it
    for a file of theirs (a link, FIFO or device is refused at each start, not that)."""
    import os

    from runners.backend.safefiles import writable_by_others

    for path in paths:
        d = os.path.dirname(path.removeprefix("-"))
        who = writable_by_others(d)
        if who is not None:
            click.echo(f"vigil: warning: {label}{path.removeprefix('-')}: {d} is a directory "
                       f"others can write ({who}), so one of them could replace the file; "
                       "keep it where only its owner can write", err=True)


def credential_items(items: tuple[str, ...] | list[str], label: str = "--credential ") -> dict[str, str]:
    """`NAME=PATH` options as a table (not checked yet). Raises BadInput."""
    creds: dict[str, str] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep:
            raise BadInput(f"{label}{item!r} is not NAME=PATH",
                           "write it as --credential token=/etc/app/token")
        creds[name] = path
    return creds


def check_credentials(creds: dict[str, str], label: str = "--credential ") -> dict[str, str]:
    """Each NAME=PATH a readable file (absolute in the store: the agent reads it later)."""
    import os

    from runners.backend.credentials import check

    out = {}
    for name, path in creds.items():
        why = check(name, path)
        if why is not None:
            raise BadInput(f"{label}{name}: {why}", "name a readable regular file of at most "
                           "1 MiB, not a link: NAME=PATH")
        out[name] = os.path.abspath(path)
    warn_shared(list(out.values()), label or "credential ")
    return out


def _opt(text: str | None, parse: Callable[[str], int]) -> int | None:
    return None if text is None else parse(text)


def limits_line() -> tuple[dict[str, str], str]:
    """Which controller enforces each limit here: for `vigil agent status`."""
    from runners.backend.cglimits import CgroupLimits
    from runners.backend.process import detect_cgroup_base

    where = CgroupLimits(detect_cgroup_base("auto")).describe()
    return where, ", ".join(f"{c} {w}" for c, w in where.items()) + ", nofile rlimit"


# -- the same keys in the hosts file (runners/cli/hostfile.py's KEYS) ----------------------


class Invalid(BadInput):
    """A value of the hosts file refused (its key is named where it is caught, as is that
    of any BadInput a value's check raises)."""


def file_who(v: Any, _: Path) -> str:
    """`user` / `group`: a name or a number of the box's passwd / group database (checked
    together, with the agent's right to switch, in _fields)."""
    if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
        return str(v)
    if not isinstance(v, str) or not v:
        raise Invalid(f"must be a name or a number, not {json.dumps(v)}", 'write user = "app"')
    return v


def file_env_files(v: Any, base: Path) -> str:
    """`env_file`: a path or a list of paths ("-PATH": optional), relative to the file."""
    from runners.backend.envfiles import check_entries

    entries = [v] if isinstance(v, str) else v
    if not isinstance(entries, list) or not all(isinstance(x, str) for x in entries):
        raise Invalid("must be a path or a list of paths", 'write env_file = ["/etc/app.env"]')
    rooted = [("-" if e.startswith("-") else "") + str(base / e.removeprefix("-"))
              for e in entries]
    checked = check_entries(rooted, label="")
    warn_shared(checked, "env file ")
    return json.dumps(checked)


def file_limit(parse: Callable[[str], int]) -> Callable[[Any, Path], int]:
    def checked(v: Any, _: Path) -> int:
        return parse(str(v) if not isinstance(v, bool) else "x")
    return checked


def file_credentials(v: Any, base: Path) -> str:
    """`credentials = { NAME = "path" }`: relative paths start at the file's directory."""
    if not isinstance(v, dict) or not all(isinstance(x, str) for x in v.values()):
        raise Invalid("must be a table of paths", 'write credentials = { token = "token.txt" }')
    return json.dumps(check_credentials({k: str(base / x) for k, x in v.items()}, label=""))


def file_after(v: Any, _: Path) -> list[str]:
    """`after = ["db", ...]`: the hosts a wake of this one waits for (each a host name; that
    each is a host and the order has no cycle is checked over the whole file)."""
    from workflows.config.hosts import NAME

    names = [v] if isinstance(v, str) else v
    if not isinstance(names, list) or not all(isinstance(x, str) for x in names):
        raise Invalid("must be a list of host names", 'write after = ["db"]')
    for n in names:
        if not NAME.fullmatch(n):
            raise Invalid(f"{n!r} is not a host name", "use the names of [hosts.NAME] tables")
    return list(dict.fromkeys(names))
