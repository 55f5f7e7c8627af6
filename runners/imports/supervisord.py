"""supervisord.conf: `[program:x]` sections read with configparser (no interpolation of
its own: supervisord's `%(here)s`, `%(program_name)s`, `%(process_num)s`, `%(group_name)s`,
`%(numprocs)s`, `%(host_node_name)s` and `%(ENV_X)s` are expanded here, as supervisord
does), `[include] files=` globs relative to the file that names them, `[group:x]`."""

from __future__ import annotations

import configparser
import glob
import os
import shlex
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from models.errors import BadInput
from runners.imports.programs import (
    Imported,
    Program,
    command_keys,
    directory,
    host_name,
    seconds,
    start_limit,
    unique,
)

OWN = ("supervisord", "supervisorctl", "unix_http_server", "inet_http_server", "include")
# Keys whose value is taken (mapped below) or that only name a process (process_name).
MAPPED = {"command", "directory", "environment", "user", "autostart", "autorestart",
          "startsecs", "startretries", "stopsignal", "stopwaitsecs", "numprocs",
          "numprocs_start", "priority", "process_name"}
LOGS = ("stdout_logfile_maxbytes", "stdout_logfile_backups", "stderr_logfile_maxbytes",
        "stderr_logfile_backups", "stdout_logfile", "stderr_logfile", "redirect_stderr",
        "stdout_capture_maxbytes", "stderr_capture_maxbytes", "stdout_events_enabled",
        "stderr_events_enabled", "stdout_syslog", "stderr_syslog")
WHY = {
    "exitcodes": "vigil restarts a worker after any exit; it has no list of expected codes",
    "stopasgroup": "vigil signals the app's leader; at the drain timeout it ends its whole "
                   "containment (cgroup), children included",
    "killasgroup": "vigil ends the app's whole containment (cgroup) at the drain timeout",
    "umask": "vigil has no umask key yet",
    "serverurl": "vigil has no XML-RPC server",
    **{k: "vigil caps logs for all hosts (`vigil agent --log-max-bytes/--log-files`), "
          "kept by its log keeper: no per-host log key" for k in LOGS},
}


@dataclass
class _Section:
    name: str  # "program:web"
    values: dict[str, str]
    here: str  # the directory of the file it came from


def _parse(path: Path, seen: set[Path]) -> list[_Section]:
    path = path.resolve()
    if path in seen:
        return []
    seen.add(path)
    parser = configparser.RawConfigParser(inline_comment_prefixes=(";", "#"), strict=False)
    try:
        with open(path, encoding="utf-8") as f:
            parser.read_file(f)
    except (OSError, UnicodeDecodeError) as exc:
        raise BadInput(f"cannot read {path}: {exc}", "pass a readable supervisord.conf") from None
    except configparser.Error as exc:
        raise BadInput(f"{path}: not a supervisord.conf: {str(exc).splitlines()[0]}",
                       "correct the file (INI sections and key = value lines)") from None
    here = str(path.parent)
    out = [_Section(s, dict(parser.items(s)), here) for s in parser.sections()]
    for s in out:
        if s.name == "include":
            for pattern in s.values.get("files", "").split():
                pattern = _expand(pattern, {"here": here}, str(path), "include files")
                for inc in sorted(glob.glob(os.path.join(here, pattern))):
                    out += _parse(Path(inc), seen)
    return out


def _expand(value: str, names: dict[str, Any], source: str, where: str) -> str:
    try:
        return value % names
    except KeyError as exc:
        raise BadInput(f"{source}: {where}: %({exc.args[0]})s names nothing supervisord "
                       "expands", "use here, program_name, process_num, group_name, numprocs, "
                       "host_node_name or ENV_NAME (write %% for a literal %)") from None
    except (ValueError, TypeError) as exc:
        raise BadInput(f"{source}: {where}: bad %-expression in {value!r} ({exc})",
                       "write %(name)s, or %% for a literal %") from None


def environment(text: str, source: str, where: str) -> dict[str, str]:
    """supervisord's `KEY="val",KEY2=val2`, tokenised as supervisord does (shlex)."""
    lexer = shlex.shlex(text)
    lexer.wordchars += "/.+-():"
    tokens = list(lexer)
    out = {}
    for i in range(0, len(tokens), 4):
        k_eq_v = tokens[i:i + 3]
        if len(k_eq_v) != 3 or k_eq_v[1] != "=":
            raise BadInput(f"{source}: {where}: environment {text!r} is not KEY=VALUE pairs",
                           'write environment=KEY="value",OTHER="value"')
        k, v = k_eq_v[0], k_eq_v[2]
        if len(v) >= 2 and v[0] == v[-1] and v[0] in "\"'":
            v = v[1:-1]
        out[k] = v
    return out


def _flag(text: str, source: str, where: str) -> bool:
    if text.lower() in ("true", "yes", "on", "1"):
        return True
    if text.lower() in ("false", "no", "off", "0"):
        return False
    raise BadInput(f"{source}: {where}: {text!r} is not true or false", "write true or false")


def _number(text: str, source: str, where: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise BadInput(f"{source}: {where}: {text!r} is not a whole number",
                       "write a whole number, e.g. 3") from None


def read(path: str) -> Imported:
    out = Imported(path, "supervisord")
    sections = _parse(Path(path), set())
    groups = {s.name.split(":", 1)[1]: s for s in sections if s.name.startswith("group:")}
    in_group = {p.strip(): g for g, s in groups.items()
                for p in s.values.get("programs", "").split(",") if p.strip()}
    priorities: dict[str, int] = {}
    for s in sections:
        kind, _, name = s.name.partition(":")
        if kind == "program" and name:
            for prog, prio in _program(s, name, in_group.get(name, name), path, out):
                out.programs.append(prog)
                priorities[prog.name] = prio
        elif kind in ("group",):
            for k, v in s.values.items():
                if k != "programs":
                    out.skip(f"[{s.name}]", k, v, "vigil has no groups")
            out.skip(f"[{s.name}]", "programs", s.values.get("programs", ""),
                     "vigil has no groups: each program is a host of its own (vigil's "
                     "commands take globs, e.g. `vigil stop 'web*'`)")
        elif s.name not in OWN and not kind.startswith("rpcinterface"):
            out.skip(f"[{s.name}]", "section", s.name, "vigil has no such section "
                     "(fcgi-program: `listen` with a build that serves the held socket; "
                     "eventlistener: `vigil notify`)")
    _order(out.programs, priorities)
    unique(out.programs, path)
    return out


def _order(programs: list[Program], priorities: dict[str, int]) -> None:
    """priority (lower starts first) as `after`: each host waits for the started hosts of
    the nearest lower priority (which wait for theirs)."""
    started = {p.name: priorities[p.name] for p in programs if p.keys.get("running")}
    levels = sorted(set(started.values()))  # one not started (autostart=false) orders nothing
    for p in programs:
        lower = [lv for lv in levels if lv < priorities[p.name]]
        if lower:
            p.keys["after"] = sorted(n for n, lv in started.items() if lv == lower[-1])


def _program(s: _Section, name: str, group: str, source: str,
             out: Imported) -> list[tuple[Program, int]]:
    raw = s.values
    where = f"[{s.name}]"
    count = _number(raw.get("numprocs", "1"), source, f"{where} numprocs")
    first = _number(raw.get("numprocs_start", "0"), source, f"{where} numprocs_start")
    if "command" not in raw:
        raise BadInput(f"{source}: {where}: no command", "add command=/path/to/program")
    for k, v in raw.items():
        if k not in MAPPED:
            out.skip(where, k, v, WHY.get(k, "vigil has no such key"))
    if raw.get("autorestart", "").lower() == "unexpected":
        out.skip(where, "autorestart", "unexpected", "vigil restarts a worker after any exit "
                 "(no exitcodes): imported as always restarted")
    progs = []
    for num in range(first, first + count):
        names = {"here": s.here, "program_name": name, "process_num": num, "group_name": group,
                 "numprocs": count, "host_node_name": socket.gethostname(),
                 **{f"ENV_{k}": v for k, v in os.environ.items()}}
        values = {k: _expand(v, names, source, f"{where} {k}") for k, v in raw.items()}
        default = "%(program_name)s" if count == 1 else "%(program_name)s-%(process_num)s"
        pname = values.get("process_name", _expand(default, names, source, where))
        progs.append((_one(values, host_name(pname, source), source, where),
                      _number(values.get("priority", "999"), source, f"{where} priority")))
    return progs


def _one(v: dict[str, str], name: str, source: str, where: str) -> Program:
    keys: dict[str, Any] = {"kind": "worker"}
    cwd = directory(v["directory"], Path(source).parent, source, where) if "directory" in v else None
    env = environment(v["environment"], source, where) if "environment" in v else {}
    keys.update(command_keys(shlex.split(v["command"]), cwd, env, source, f"{where} command"))
    if cwd:
        keys["cwd"] = cwd
    if env:
        keys["env"] = env
    if "user" in v:
        keys["user"] = v["user"]
    keys["running"] = _flag(v.get("autostart", "true"), source, f"{where} autostart")
    if v.get("autorestart", "unexpected").lower() in ("false", "no", "off", "0"):
        keys["one_shot"] = True  # never started again after it exits
    startsecs = _number(v.get("startsecs", "1"), source, f"{where} startsecs")
    if startsecs > 0 and not keys.get("one_shot"):
        keys["restart_reset"] = seconds(startsecs)  # up this long: a start, not a quick exit
        starts = _number(v.get("startretries", "3"), source, f"{where} startretries") + 1
        keys["start_limit"] = start_limit(starts, startsecs)
    if "stopsignal" in v:
        keys["stop_signal"] = v["stopsignal"].upper()
    if "stopwaitsecs" in v:
        keys["drain_timeout"] = seconds(float(v["stopwaitsecs"]))
    return Program(name, keys)
