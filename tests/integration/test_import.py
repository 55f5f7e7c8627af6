"""`vigil import` (issue 41 item 1): a supervisord.conf (with [include] and [group:x]), a
Procfile, PM2 ecosystem files and a process-compose.yaml, each of at least 5 programs and
written here in the shapes those projects document, imported into hosts files that `vigil
apply` accepts. supervisord and honcho (installed from PyPI by the test extra) run their
file, then vigil runs the imported one, and what runs is compared by /proc: commands,
the configured environment, users and counts."""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tomllib
import urllib.request
from collections import Counter
from pathlib import Path

import psutil
import pytest

from tests.conftest import FIXTURES, Vigil, pid_dead, wait_for

APP = FIXTURES / "portapp.py"
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


SUPERVISORD_CONF = """\
; supervisord.conf as its docs lay it out
[unix_http_server]
file=%(here)s/supervisor.sock

[supervisord]
logfile=%(here)s/supervisord.log
pidfile=%(here)s/supervisord.pid
childlogdir=%(here)s
nodaemon=true

[rpcinterface:supervisor]
supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface

[include]
files = conf.d/*.conf

[program:api]
command=python3 %(here)s/portapp.py api --port {p1}
directory=%(here)s
environment=APP_ROLE="api",APP_HOME="%(ENV_HOME)s",WHERE=%(here)s
priority=10
startsecs=1
startretries=5
stopsignal=INT
stopwaitsecs=7
stdout_logfile_maxbytes=5MB

[program:worker]
command=python3 portapp.py worker-%(process_num)s
directory=%(here)s
process_name=%(program_name)s_%(process_num)02d
numprocs=2
environment=WORKER_NUM="%(process_num)s"
priority=20
autorestart=unexpected

[program:nightly]
command=python3 portapp.py nightly
directory=%(here)s
priority=5
autostart=false
autorestart=false

[group:web]
programs=api,front
"""


def supervisord_files(d: Path) -> Path:
    d.mkdir(mode=0o755)
    d.parent.chmod(0o711)  # the user= program (nobody) reaches its staged build
    shutil.copy(APP, d / "portapp.py")
    (d / "conf.d").mkdir()
    p1, p2 = free_port(), free_port()
    (d / "supervisord.conf").write_text(SUPERVISORD_CONF.format(p1=p1, p2=p2))
    (d / "conf.d" / "more.conf").write_text(f"""\
[program:front]
command=python3 %(here)s/../portapp.py front --port {p2}
directory=%(here)s/..
environment=APP_ROLE="front"
priority=20

[program:sleeper]
command=sleep 3600
user=nobody
""")
    return d / "supervisord.conf"


def procfile_files(d: Path) -> Path:
    shutil.copy(APP, d / "portapp.py")
    (d / ".env").write_text(f"GREETING='hello there'\nPORT={free_port()}\n")
    (d / "Procfile").write_text(
        "web: python3 portapp.py web\n"
        "api: python3 portapp.py api --flag\n"
        "worker: python3 portapp.py worker --port 0\n"
        "clock: python3 portapp.py clock --port 0\n"
        "release_tasks: exec python3 portapp.py release --port 0\n")
    return d / "Procfile"


PM2_APPS = [
    {"name": "api", "script": "portapp.py", "args": "api --port 0", "interpreter": "python3",
     "env": {"NODE_ENV": "production", "PORT": 0}, "max_restarts": 10, "min_uptime": "5s",
     "kill_timeout": 3000, "out_file": "/var/log/api.out"},
    {"name": "front", "script": "portapp.py", "args": ["front", "--port", "0"],
     "interpreter": "python3", "max_memory_restart": "200M", "watch": True},
    {"name": "workers", "script": "portapp.py", "args": "worker --port 0",
     "interpreter": "python3", "instances": 2, "exec_mode": "fork"},
    {"name": "once", "script": "portapp.py", "args": "once --port 0", "interpreter": "python3",
     "autorestart": False, "cron_restart": "0 3 * * *"},
    {"name": "tool", "script": "/bin/sleep", "interpreter": "none", "args": "3600",
     "env_production": {"NODE_ENV": "production"}},
]


def compose_files(d: Path) -> Path:
    shutil.copy(APP, d / "portapp.py")
    (d / "process-compose.yaml").write_text("""\
version: "0.5"
environment:
  - "STAGE=test"
log_location: ./pc.log
processes:
  db:
    command: "python3 portapp.py db --port 0"
    availability:
      restart: always
      backoff_seconds: 2
    readiness_probe:
      exec:
        command: "true"
  migrate:
    command: "python3 -c 'pass'"  # a migration: exits 0
    depends_on:
      db:
        condition: process_healthy
  api:
    command: "python3 portapp.py api --port 0"
    working_dir: .
    environment:
      - "ROLE=api"
    depends_on:
      migrate:
        condition: process_completed_successfully
    availability:
      restart: on_failure
      max_restarts: 5
    shutdown:
      signal: 2
      timeout_seconds: 5
  workers:
    command: "python3 portapp.py worker --port 0"
    replicas: 2
    depends_on:
      db:
        condition: process_started
  docs:
    command: "python3 portapp.py docs --port 0"
    disabled: true
    namespace: extras
""")
    return d / "process-compose.yaml"


def mapped(doc: dict[str, object], host: str, key: str, value: object, err: str) -> None:
    """`key` mapped to `value`, or, where this vigil's hosts file has no such key (yet),
    listed as not imported with why."""
    from runners.cli.hostfile import KEYS

    if key in KEYS:
        assert doc[host][key] == value, (host, key, doc[host])  # type: ignore[index]
    else:
        assert f"host {host}: {key} = {value}: vigil has no `{key}` key yet" in err, err


def imported(vigil: Vigil, src: Path, *extra: str) -> tuple[Path, str]:
    out = src.parent / "hosts.toml"
    cp = vigil.run("import", str(src), "-o", str(out), *extra)
    return out, cp.stderr


def dry_run_accepts(vigil: Vigil, hosts: Path) -> str:
    cp = vigil.run("apply", "--dry-run", str(hosts), check=False)
    assert cp.returncode == 0 and "! refused" not in cp.stdout, cp.stdout + cp.stderr
    return cp.stdout


# --- what runs --------------------------------------------------------------------------

def apps_up(ran: Counter[tuple[object, ...]]) -> int:
    """The apps themselves (not the shells a Procfile's commands run in)."""
    return sum(n for k, n in ran.items() if k[0] != "sh")


def seen(pids: list[int], keys: set[str]) -> Counter[tuple[object, ...]]:
    """Each app process as (argv0's name, the rest of argv, its uid, the configured env)."""
    out: Counter[tuple[object, ...]] = Counter()
    for pid in pids:
        try:
            p = psutil.Process(pid)
            argv, env, uid = p.cmdline(), p.environ(), p.uids().real
        except psutil.NoSuchProcess:
            continue
        if not any("portapp.py" in a or a == "sleep" or a.endswith("/sleep") for a in argv):
            continue
        out[(Path(argv[0]).name, tuple(argv[1:]), uid,
             tuple(sorted((k, v) for k, v in env.items() if k in keys)))] += 1
    return out


def tree(root: int) -> list[int]:
    try:
        return [c.pid for c in psutil.Process(root).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def end(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    wait_for(lambda: all(pid_dead(p) for p in pids), 10, what="the original's processes gone")


def configured_env(hosts: Path) -> set[str]:
    doc = tomllib.loads(hosts.read_text())["hosts"]
    return {k for h in doc.values() for k in h.get("env", {})}


def run_original(argv: list[str], cwd: Path, want: int, keys: set[str]) -> Counter[tuple[object, ...]]:
    """The original tool on its file until `want` app processes run; what ran; all ended."""
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"}
    tool = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for(lambda: apps_up(seen(tree(tool.pid), keys)) >= want, 30,
                 what=f"{argv[0]}'s {want} apps")
        return seen(tree(tool.pid), keys)
    finally:
        kids = tree(tool.pid)
        tool.kill()
        tool.wait(10)
        end(kids)


def run_vigil(vigil: Vigil, hosts: Path, want: int, keys: set[str]) -> Counter[tuple[object, ...]]:
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    vigil.run("apply", str(hosts))

    def apps() -> list[int]:
        return sorted({p for pid in vigil.app_pids() for p in [pid, *tree(pid)]})

    try:
        wait_for(lambda: apps_up(seen(apps(), keys)) >= want, 30, what=f"vigil's {want} apps")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: ran {seen(apps(), keys)}\n{vigil.run('status').stdout}"
                             f"{vigil.run('events').stdout[-3000:]}") from None
    return seen(apps(), keys)


# --- the tests ----------------------------------------------------------------------------

def test_supervisord_file_runs_the_same_under_vigil(vigil: Vigil, short_tmp: Path) -> None:
    conf = supervisord_files(short_tmp / "sv")
    hosts, err = imported(vigil, conf)
    lines = [ln for ln in err.splitlines() if ln.startswith("vigil import: not imported: ")]
    assert any("[group:web]: programs = api,front: vigil has no groups" in ln for ln in lines), err
    assert any("stdout_logfile_maxbytes = 5MB: vigil caps logs" in ln for ln in lines), err
    assert any("[program:worker]: autorestart = unexpected" in ln for ln in lines), err
    text = hosts.read_text()
    assert "#   [group:web]: programs = api,front" in text, text
    doc = tomllib.loads(text)["hosts"]
    assert sorted(doc) == ["api", "front", "nightly", "sleeper", "worker-00", "worker-01"]
    assert doc["api"]["drain_timeout"] == 7 and doc["api"]["restart_reset"] == 1
    mapped(doc, "api", "stop_signal", "INT", err)
    mapped(doc, "api", "start_limit", "6/186", err)
    assert doc["api"]["env"]["WHERE"] == str(conf.parent)
    assert doc["worker-00"]["after"] == ["api"] and "after" not in doc["api"]
    assert doc["worker-01"]["args"] == ["portapp.py", "worker-1"]
    assert doc["nightly"]["running"] is False and doc["nightly"]["one_shot"] is True
    assert "after" not in doc["nightly"] and "after" not in doc["api"]  # not started: no order
    assert doc["sleeper"]["user"] == "nobody"
    dry_run_accepts(vigil, hosts)
    keys = configured_env(hosts)
    before = run_original([str(BIN / "supervisord"), "-n", "-c", str(conf)], conf.parent, 5, keys)
    after = run_vigil(vigil, hosts, 5, keys)
    assert after == before, f"supervisord ran {before}\nvigil ran {after}"
    for host in ("api", "front"):  # and they serve, on their own ports, as before
        port = doc[host]["args"][doc[host]["args"].index("--port") + 1]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10) as r:
            assert r.read().decode().startswith(f"{host} pid=")
    assert any(k[2] == pwd.getpwnam("nobody").pw_uid for k in after), after


def test_procfile_runs_the_same_under_vigil(vigil: Vigil, short_tmp: Path) -> None:
    proc = procfile_files(short_tmp)
    hosts, err = imported(vigil, proc)
    doc = tomllib.loads(hosts.read_text())["hosts"]
    assert sorted(doc) == ["api", "clock", "release-tasks", "web", "worker"]
    assert doc["web"]["args"] == ["-c", "python3 portapp.py web"]
    assert doc["web"]["env"]["GREETING"] == "hello there"
    base = int(doc["web"]["env"]["PORT"])
    assert int(doc["api"]["env"]["PORT"]) == base + 100
    dry_run_accepts(vigil, hosts)
    keys = configured_env(hosts)
    before = run_original([str(BIN / "honcho"), "start"], proc.parent, 5, keys)
    after = run_vigil(vigil, hosts, 5, keys)
    assert after == before, f"honcho ran {before}\nvigil ran {after}"


@pytest.mark.parametrize("form", ["json", "js"])
def test_pm2_ecosystem_file_is_accepted(vigil: Vigil, short_tmp: Path, form: str) -> None:
    import json

    shutil.copy(APP, short_tmp / "portapp.py")
    if form == "json":
        src = short_tmp / "ecosystem.config.json"
        src.write_text(json.dumps({"apps": PM2_APPS}, indent=2))
    else:
        if shutil.which("node") is None:
            pytest.skip("node is not on PATH (Debian's nodejs package)")
        src = short_tmp / "ecosystem.config.js"
        src.write_text(f"module.exports = {{ apps: {json.dumps(PM2_APPS)} }};\n")
    hosts, err = imported(vigil, src)
    doc = tomllib.loads(hosts.read_text())["hosts"]
    assert sorted(doc) == ["api", "front", "once", "tool", "workers-0", "workers-1"]
    assert doc["api"]["args"] == [str(short_tmp / "portapp.py"), "api", "--port", "0"]
    assert doc["api"]["env"] == {"NODE_ENV": "production", "PORT": "0", "NODE_APP_INSTANCE": "0"}
    assert doc["api"]["drain_timeout"] == 3
    mapped(doc, "api", "start_limit", "11/385", err)
    assert doc["workers-1"]["env"]["NODE_APP_INSTANCE"] == "1"
    assert doc["front"]["memory_max"] == "200M" and doc["once"]["one_shot"] is True
    assert doc["tool"]["build"] == "/bin/sleep" and doc["tool"]["args"] == ["3600"]
    for line in ("app api: out_file = /var/log/api.out: vigil caps logs",
                 "app front: watch = True: vigil does not restart on file changes",
                 "app once: cron_restart = 0 3 * * *: not a hosts-file key",
                 "app tool: env_production = "):
        assert f"vigil import: not imported: {line}" in err, err
    dry_run_accepts(vigil, hosts)


def pm2_command() -> str | None:
    """PM2 from npm (`npm install -g pm2`), or $VIGIL_TEST_PM2: its `pm2`."""
    return os.environ.get("VIGIL_TEST_PM2") or shutil.which("pm2")


def test_pm2_runs_the_same_under_vigil(vigil: Vigil, short_tmp: Path) -> None:
    import json

    pm2 = pm2_command()
    if pm2 is None:
        pytest.skip("PM2 is not installed (npm install -g pm2, or set VIGIL_TEST_PM2)")
    shutil.copy(APP, short_tmp / "portapp.py")
    src = short_tmp / "ecosystem.config.json"
    src.write_text(json.dumps({"apps": PM2_APPS}, indent=2))
    hosts, _ = imported(vigil, src)
    keys = configured_env(hosts)
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "PM2_HOME": str(short_tmp / ".pm2")}
    subprocess.run([pm2, "start", str(src)], cwd=short_tmp, env=env, check=True,
                   capture_output=True, timeout=60)
    daemon = int((short_tmp / ".pm2" / "pm2.pid").read_text())
    try:
        wait_for(lambda: apps_up(seen(tree(daemon), keys)) >= 6, 30, what="PM2's 6 apps")
        before = seen(tree(daemon), keys)
    finally:
        kids = tree(daemon)
        subprocess.run([pm2, "kill"], env=env, capture_output=True, timeout=60)
        end([daemon, *kids])
    after = run_vigil(vigil, hosts, 6, keys)
    assert after == before, f"PM2 ran {before}\nvigil ran {after}"


def test_process_compose_file_runs_in_its_order(vigil: Vigil, short_tmp: Path) -> None:
    src = compose_files(short_tmp)
    hosts, err = imported(vigil, src)
    doc = tomllib.loads(hosts.read_text())["hosts"]
    assert sorted(doc) == ["api", "db", "docs", "migrate", "workers-0", "workers-1"]
    assert doc["api"]["after"] == ["migrate"] and doc["workers-1"]["after"] == ["db"]
    assert doc["api"]["args"] == ["-c", "python3 portapp.py api --port 0"]
    assert doc["api"]["env"] == {"STAGE": "test", "ROLE": "api"}
    assert doc["api"]["drain_timeout"] == 5
    mapped(doc, "api", "stop_signal", 2, err)
    assert doc["db"]["restart_floor"] == 2 and "one_shot" not in doc["db"]
    assert doc["migrate"]["one_shot"] is True and doc["docs"]["running"] is False
    assert "process db: readiness_probe = " in err and "vigil has no readiness" in err, err
    assert "process docs: namespace = extras" in err and "top: log_location" in err, err
    dry_run_accepts(vigil, hosts)
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    vigil.run("apply", str(hosts))
    # api starts only after migrate, a one-shot, exited 0 (process_completed_successfully)
    wait_for(lambda: all(vigil.status(h)["state"] == "awake" for h in (
        "db", "api", "workers-0", "workers-1")), 30, what="the composed hosts awake")
    assert vigil.status("docs")["state"] == "asleep"
    events = [ln.split()[2:5:2] for ln in vigil.run("events").stdout.splitlines()]
    order = [events.index(e) for e in (["db", "woke"], ["migrate", "clean_exit"], ["api", "woke"])]
    assert order == sorted(order), events


@pytest.mark.parametrize(("name", "body", "extra", "says"), [
    ("hosts.txt", "x", (), "cannot tell the format of"),
    ("supervisord.conf", "[program:x]\ncommand=no-such-program-here\n", (),
     "'no-such-program-here' is not an executable file here"),
    ("supervisord.conf", "[program:x\n", (), "not a supervisord.conf"),
    ("process-compose.yaml", "processes: [1\n", (), "invalid YAML"),
    ("ecosystem.config.json", "{", (), "invalid JSON"),
    ("Procfile", "web: true\n", ("--apply",), "--apply applies the written file"),
    ("Procfile", "web: true\nWeb: true\n", (), "two programs make host web"),
    ("Procfile", "__: true\n", (), "program name '__' makes no host name"),
    ("Procfile", "web: true\n", ("-o", "/nonexistent/hosts.toml"), "cannot write"),
])
def test_bad_input_is_one_line(vigil: Vigil, short_tmp: Path, name: str, body: str,
                               extra: tuple[str, ...], says: str) -> None:
    src = short_tmp / name
    src.write_text(body)
    cp = vigil.run("import", str(src), *extra, check=False)
    assert cp.returncode == 2 and cp.stdout == "", cp.stdout + cp.stderr
    assert len(cp.stderr.strip().splitlines()) == 1 and says in cp.stderr, cp.stderr


def test_import_with_apply_adds_and_wakes_the_hosts(vigil: Vigil, short_tmp: Path) -> None:
    proc = procfile_files(short_tmp)
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    out = short_tmp / "hosts.toml"
    cp = vigil.run("import", str(proc), "-o", str(out), "--apply")
    assert f"wrote {out}: 5 hosts, 0 keys not imported" in cp.stderr, cp.stderr
    assert "+ add web: worker" in cp.stdout and "~ wake web (running = true" in cp.stdout, cp.stdout
    wait_for(lambda: all(vigil.status(h)["state"] == "awake"
                         for h in ("web", "api", "worker", "clock", "release-tasks")), 30,
             what="the imported hosts awake")
    vigil.check()


def test_a_js_ecosystem_file_without_node_is_one_line(vigil: Vigil, short_tmp: Path) -> None:
    src = short_tmp / "ecosystem.config.js"
    src.write_text("module.exports = { apps: [] };\n")
    cp = vigil.run("import", str(src), check=False, env={"PATH": str(short_tmp)})
    assert cp.returncode == 2 and cp.stdout == "", cp.stdout + cp.stderr
    assert cp.stderr == (f"vigil: error: {src}: reading a .js ecosystem file needs node, not on "
                         "PATH; install node, or write the file as ecosystem.config.json\n")
