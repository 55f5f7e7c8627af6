"""PM2's ecosystem file: `ecosystem.config.json` read as JSON; `ecosystem.config.js` (or
.cjs) printed as JSON by `node -e` when node is on PATH. Each app of `apps` is run as PM2
runs it in fork mode: its interpreter (from `interpreter`, else the script's extension,
else node; "none": the script itself), `interpreter_args`/`node_args`, the script, `args`."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
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

BY_EXTENSION = {".js": "node", ".cjs": "node", ".mjs": "node", ".py": "python3", ".sh": "bash",
                ".rb": "ruby", ".php": "php", ".pl": "perl", ".coffee": "coffee"}
MAPPED = {"name", "script", "args", "interpreter", "interpreter_args", "node_args", "cwd", "env",
          "instances", "autorestart", "max_restarts", "min_uptime", "kill_timeout",
          "restart_delay", "max_memory_restart", "uid", "user", "gid", "exec_mode"}
LOGS = ("out_file", "error_file", "log_file", "log_date_format", "merge_logs", "combine_logs",
        "log_type", "time", "disable_logs", "pid_file")
WHY = {
    "watch": "vigil does not restart on file changes: deploy a new build (`vigil deploy`)",
    "ignore_watch": "vigil does not watch files",
    "wait_ready": "vigil has no readiness signal for a worker (an app on its own port)",
    "listen_timeout": "vigil has no readiness signal for a worker (an app on its own port)",
    "cron_restart": "not a hosts-file key: `vigil schedule add` keeps scheduled restarts",
    "exp_backoff_restart_delay": "vigil's backoff doubles from restart_floor to restart_cap",
    "instance_var": "vigil sets NODE_APP_INSTANCE per copy, as PM2's default",
    **{k: "vigil caps logs for all hosts (`vigil agent --log-max-bytes/--log-files`), kept "
          "by its log keeper: no per-host log key" for k in LOGS},
}


def load(path: str) -> Any:
    if path.endswith((".js", ".cjs")):
        node = shutil.which("node")
        if node is None:
            raise BadInput(f"{path}: reading a .js ecosystem file needs node, not on PATH",
                           "install node, or write the file as ecosystem.config.json")
        code = "process.stdout.write(JSON.stringify(require(process.argv[1])))"
        cp = subprocess.run([node, "-e", code, os.path.abspath(path)], capture_output=True,
                            text=True, timeout=30)
        if cp.returncode != 0:
            last = (cp.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise BadInput(f"{path}: node could not load it: {last}",
                           "correct the file (`node -e 'require(\"./FILE\")'` shows where)")
        text = cp.stdout
    else:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise BadInput(f"cannot read {path}: {exc}", "pass a readable ecosystem file") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadInput(f"{path}:{exc.lineno}: invalid JSON: {exc.msg}",
                       "correct the syntax at that line") from None


def read(path: str) -> Imported:
    out = Imported(path, "pm2")
    doc = load(path)
    apps = doc.get("apps") if isinstance(doc, dict) else doc
    if not isinstance(apps, list) or not all(isinstance(a, dict) for a in apps):
        raise BadInput(f"{path}: no `apps` list", 'write { "apps": [ { "name": ..., '
                       '"script": ... } ] }')
    for app in apps:
        out.programs += _app(app, path, out)
    unique(out.programs, path)
    return out


def _ms(value: Any, source: str, where: str) -> float:
    """PM2's durations: milliseconds, or a string such as "10s", "2m", "500ms"."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*", str(value))
    if m is None or isinstance(value, bool):
        raise BadInput(f"{source}: {where}: {value!r} is not a duration", "write e.g. 5000 or '5s'")
    scale = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, None: 0.001}[m.group(2)]
    return float(m.group(1)) * scale


def _words(value: Any) -> list[str]:
    if isinstance(value, list):
        return [str(w) for w in value]
    return shlex.split(str(value)) if value else []


def _app(app: dict[str, Any], source: str, out: Imported) -> list[Program]:
    if not isinstance(app.get("script"), str):
        raise BadInput(f"{source}: an app has no script", 'give each app "script": "app.js"')
    raw_name = str(app.get("name") or Path(app["script"]).stem)
    where = f"app {raw_name}"
    for k, v in app.items():
        if k not in MAPPED:
            out.skip(where, k, v, WHY.get(k, "vigil has one env a host (copy env_* into env)"
                                  if k.startswith("env_") else "vigil has no such key"))
    count = app.get("instances", 1)
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        out.skip(where, "instances", count, "vigil needs a count: imported as 1")
        count = 1
    if app.get("exec_mode", "fork") in ("cluster", "cluster_mode"):
        out.skip(where, "exec_mode", app["exec_mode"], "vigil runs each copy as its own "
                 "process (fork mode); copies sharing one port need `listen`")
    names = [raw_name] if count == 1 else [f"{raw_name}-{i}" for i in range(count)]
    return [_one(app, host_name(n, source), i if count > 1 else None, source, where)
            for i, n in enumerate(names)]


def _one(app: dict[str, Any], name: str, copy: int | None, source: str, where: str) -> Program:
    base = Path(source).resolve().parent
    cwd = directory(str(app["cwd"]), base, source, where) if "cwd" in app else str(base)
    env = {str(k): str(v).lower() if isinstance(v, bool) else str(v)
           for k, v in (app.get("env") or {}).items()}
    env["NODE_APP_INSTANCE"] = str(copy or 0)  # PM2 sets it for every app (0 for one copy)
    script = str(app["script"])
    interp = app.get("interpreter") or BY_EXTENSION.get(Path(script).suffix, "node")
    if interp != "none":
        script = os.path.join(cwd, script)  # PM2 hands its interpreter the script's full path
    extra = _words(app.get("interpreter_args") or app.get("node_args"))
    words = [script] if interp == "none" else [interp, *extra, script]
    keys: dict[str, Any] = {"kind": "worker",
                            **command_keys(words + _words(app.get("args")), cwd, env, source,
                                           f"{where} script"),
                            "cwd": cwd}
    if env:
        keys["env"] = env
    if app.get("uid") or app.get("user"):
        keys["user"] = str(app.get("uid") or app.get("user"))
    if app.get("gid"):
        keys["group"] = str(app["gid"])
    keys["running"] = True
    if app.get("autorestart") is False:
        keys["one_shot"] = True
    elif "max_restarts" in app or "min_uptime" in app:
        up = _ms(app.get("min_uptime", 1000), source, f"{where} min_uptime")
        keys["restart_reset"] = seconds(max(up, 0.001))
        keys["start_limit"] = start_limit(int(app.get("max_restarts", 16)) + 1, up)
    if "kill_timeout" in app:
        keys["drain_timeout"] = seconds(max(_ms(app["kill_timeout"], source, where), 0.001))
    if "restart_delay" in app and _ms(app["restart_delay"], source, where) > 0:
        keys["restart_floor"] = seconds(_ms(app["restart_delay"], source, where))
        keys["restart_cap"] = max(30, keys["restart_floor"])  # the cap is not below the floor
    if "max_memory_restart" in app:
        keys["memory_max"] = str(app["max_memory_restart"]).upper().rstrip("B")
    return Program(name, keys)
