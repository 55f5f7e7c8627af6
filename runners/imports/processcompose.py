"""process-compose.yaml, read with PyYAML: `processes`, each command run by the file's
shell (`shell: {shell_command, shell_argument}`, bash -c unless set) in its working_dir,
with the global and its own `environment`; `depends_on` becomes `after`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from models.errors import BadInput
from runners.imports.programs import (
    Imported,
    Program,
    directory,
    host_name,
    seconds,
    shell_keys,
    unique,
)

MAPPED = {"command", "working_dir", "environment", "depends_on", "availability", "shutdown",
          "disabled", "replicas", "readiness_probe", "liveness_probe"}
WHY = {
    "log_location": "vigil caps logs for all hosts (`vigil agent --log-max-bytes/--log-files`)",
    "log_configuration": "vigil caps logs for all hosts (`vigil agent --log-max-bytes/--log-files`)",
    "namespace": "vigil has no namespaces: host names are global",
    "is_daemon": "vigil supervises the process it starts; a daemon that forks away is lost",
    "description": "vigil keeps no description",
    "is_tty": "vigil gives apps no terminal",
    "env_file": "vigil has `env_file`, but in systemd's format: copy it into environment",
}
PROBES = "vigil has no readiness or health probe for a worker (an app on its own port): " \
         "probes ask an instance's own $VIGIL_SOCKET or a shared listener"


def load(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            doc = yaml.safe_load(f)
    except (OSError, UnicodeDecodeError) as exc:
        raise BadInput(f"cannot read {path}: {exc}", "pass a readable process-compose.yaml") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        raise BadInput(f"{path}{line}: invalid YAML: {getattr(exc, 'problem', exc)}",
                       "correct the syntax at that line") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("processes"), dict):
        raise BadInput(f"{path}: no `processes` table", "is it a process-compose.yaml? "
                       "it lists `processes:` by name")
    return doc


def env_list(value: Any, source: str, where: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, list):
        raise BadInput(f"{source}: {where}: environment must be a list", "write - 'KEY=value'")
    out = {}
    for item in value:
        key, eq, val = str(item).partition("=")
        if not eq:
            raise BadInput(f"{source}: {where}: {item!r} is not KEY=value", "write - 'KEY=value'")
        out[key] = val
    return out


def read(path: str) -> Imported:
    out = Imported(path, "process-compose")
    doc = load(path)
    shell = doc.get("shell") or {}
    sh, flag = str(shell.get("shell_command", "bash")), str(shell.get("shell_argument", "-c"))
    common = env_list(doc.get("environment"), path, "environment")
    for key in doc:
        if key not in ("version", "processes", "environment", "shell"):
            out.skip("top", key, doc[key], WHY.get(key, "vigil has no such setting"))
    names: dict[str, list[str]] = {}
    for raw, proc in doc["processes"].items():
        if not isinstance(proc, dict):
            raise BadInput(f"{path}: process {raw}: must be a table", "give it command: ...")
        count = proc.get("replicas", 1)
        names[raw] = [host_name(str(raw), path)] if count == 1 else [
            host_name(f"{raw}-{i}", path) for i in range(int(count))]
    for raw, proc in doc["processes"].items():
        for i, name in enumerate(names[raw]):
            out.programs.append(_one(raw, proc, name, i if len(names[raw]) > 1 else None,
                                     (sh, flag), common, names, path, out))
    unique(out.programs, path)
    return out


def _one(raw: str, proc: dict[str, Any], name: str, replica: int | None, shell: tuple[str, str],
         common: dict[str, str], names: dict[str, list[str]], source: str,
         out: Imported) -> Program:
    where = f"process {raw}"
    if replica in (None, 0):  # each key said once, not once a replica
        for k, v in proc.items():
            if k not in MAPPED:
                out.skip(where, k, v, WHY.get(k, "vigil has no such key"))
        for probe in ("readiness_probe", "liveness_probe"):
            if probe in proc:
                out.skip(where, probe, proc[probe], PROBES)
    if not isinstance(proc.get("command"), str):
        raise BadInput(f"{source}: {where}: no command", "give it command: ...")
    env = {**common, **env_list(proc.get("environment"), source, where)}
    if replica is not None:
        env["PC_REPLICA_NUM"] = str(replica)
    keys: dict[str, Any] = {"kind": "worker",
                            **shell_keys(shell[0], shell[1], proc["command"], env, source, where)}
    base = Path(source).resolve().parent
    keys["cwd"] = directory(str(proc["working_dir"]), base, source, where) \
        if "working_dir" in proc else str(base)
    if env:
        keys["env"] = env
    keys["running"] = not proc.get("disabled", False)
    keys.update(_availability(proc.get("availability") or {}, where, out, replica))
    down = proc.get("shutdown") or {}
    if "signal" in down:
        keys["stop_signal"] = int(down["signal"])
    if "command" in down:
        keys["stop_command"] = str(down["command"])
    if "timeout_seconds" in down:
        keys["drain_timeout"] = seconds(max(float(down["timeout_seconds"]), 0.001))
    after = [n for dep in (proc.get("depends_on") or {}) for n in names.get(dep, [dep])]
    if after:
        keys["after"] = after
    return Program(name, keys)


def _availability(a: dict[str, Any], where: str, out: Imported, replica: int | None) -> dict[str, Any]:
    keys: dict[str, Any] = {}
    restart = a.get("restart", "no")
    if restart == "no":
        keys["one_shot"] = True  # run once, never started again
    elif restart != "always" and replica in (None, 0):
        out.skip(where, "availability.restart", restart, "vigil restarts a worker after any "
                 "exit: imported as always")
    if a.get("backoff_seconds"):
        keys["restart_floor"] = seconds(float(a["backoff_seconds"]))
        keys["restart_cap"] = max(30, keys["restart_floor"])
    for k in ("max_restarts", "exit_on_end", "exit_on_skipped"):
        if k in a and replica in (None, 0):
            out.skip(where, f"availability.{k}", a[k], "vigil counts quick exits in a window "
                     "(start_limit), not restarts in all" if k == "max_restarts" else
                     "vigil never ends itself because an app ended")
    return keys
