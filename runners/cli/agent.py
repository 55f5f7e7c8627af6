"""`vigil agent`: run the agent in the foreground, or detached with `agent start`, and
`agent stop|status`."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import click

from models.errors import BadInput, VigilError
from runners.cli.common import SECONDS, Env, echo_json, options, socket_options
from runners.cli.retention import keep_of, keep_options
from workflows.base.paths import AGENT_LOG


class Bytes(click.ParamType):
    """A size: bytes, or with K, M or G (KiB, MiB, GiB); at least 4K."""

    name = "bytes"
    UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        text = str(value).strip().upper().removesuffix("IB").removesuffix("B")
        unit = text[-1:] if text[-1:] in self.UNITS else ""
        try:
            n = int(float(text[:len(text) - len(unit)]) * self.UNITS[unit])
        except ValueError:
            n = -1
        if not 4096 <= n <= 1 << 40:
            raise BadInput(f"--log-max-bytes {value} is not a size from 4K to 1T",
                           "give e.g. --log-max-bytes 10M")
        return n


BYTES = Bytes()


RUN_OPTIONS = [
    click.option("--safety-interval", type=SECONDS, default=30.0, show_default=True,
                 help="Seconds between full scans when nothing rings (the backstop: intents "
                      "ring the agent, exits arrive by pidfd, due rows set a timer)."),
    click.option("--log-level", default="INFO", show_default=True),
    click.option("--box", envvar="VIGIL_BOX", default=None,
                 help="Name this box (its agent id) on the first start (env VIGIL_BOX)."),
    click.option("--lease-ttl", envvar="VIGIL_LEASE_TTL", type=SECONDS, default=30.0,
                 show_default=True, help="Seconds a host lease lasts without renewal."),
    click.option("--converge-budget", type=click.IntRange(min=0), default=1, show_default=True,
                 help="Workers converged onto their live build per sweep, box-wide."),
    click.option("--sweep-interval", type=SECONDS, default=1.0, show_default=True,
                 help="Seconds between sweeps of worker drift and max-run (and of dead "
                      "currents where the kernel has no pidfds; with pidfds an exit is "
                      "handled at once)."),
    click.option("--log-format", type=click.Choice(["text", "json"]), envvar="VIGIL_LOG_FORMAT",
                 default="text", show_default=True,
                 help="One line per event: key=value text or a JSON object (env "
                      "VIGIL_LOG_FORMAT)."),
    click.option("--metrics-listen", default=None, metavar="ADDRESS:PORT",
                 help="Serve Prometheus metrics over HTTP there, e.g. 127.0.0.1:9108."),
    click.option("--socket-group", envvar="VIGIL_SOCKET_GROUP", default=None,
                 help="Group that may connect to every host's socket (env VIGIL_SOCKET_GROUP)."),
    click.option("--socket-mode", envvar="VIGIL_SOCKET_MODE", default=None,
                 help="Mode of those sockets, octal (default 0660; env VIGIL_SOCKET_MODE)."),
    click.option("--log-max-bytes", type=BYTES, default="10M", show_default=True,
                 help="Cap of each file of an app's output (K, M, G: binary units); a "
                      "generation keeps --log-files of them, rotated."),
    click.option("--log-files", type=click.IntRange(1, 100), default=3, show_default=True,
                 help="Files of output kept per generation (the one written included)."),
    click.option("--listen", type=click.Choice(["on", "off"]), envvar="VIGIL_LISTEN",
                 default="on", show_default=True,
                 help="PostgreSQL: hear intents by LISTEN (at once), or off: read them each "
                      "sweep (within --sweep-interval), for a fleet too large for a LISTEN "
                      "session a box (env VIGIL_LISTEN)."),
    keep_options,  # --keep-history, --keep-last: what history the store keeps
]



run_options = options(*RUN_OPTIONS)  # the options of a run of the agent


@click.group(invoke_without_command=True)
@run_options
@click.pass_context
def agent(ctx: click.Context, **options: Any) -> None:
    """Run the agent in the foreground: recover, then keep every obligation moving until it
    is proven done. `vigil agent start` runs it detached; `stop` and `status` find it by its
    lock in the state dir."""
    if ctx.invoked_subcommand is None:
        run(ctx.obj, **options)


def run(env: Env, safety_interval: float, log_level: str, box: str | None,
        lease_ttl: float, converge_budget: int, sweep_interval: float, log_format: str,
        metrics_listen: str | None, socket_group: str | None, socket_mode: str | None,
        log_max_bytes: int, log_files: int, listen: str, keep_history: Any,
        keep_last: int) -> None:
    from sqlalchemy import select

    from models.states import HostKind
    from models.store import LOCK_WAIT, Store
    from models.tables import Host
    from runners.agent import agent_log as logs
    from runners.agent.daemon import AgentDaemon
    from runners.agent.exit_watch import PipeBell
    from runners.backend.cgroups import enter_agent_leaf
    from runners.backend.sockets import SocketAccess
    from runners.base.doorbell import agent_id
    from runners.wiring import make_context
    from workflows.base.context import Context
    from workflows.config.hosts import check_socket_room
    from workflows.leases.placement import check_box

    group, mode = socket_options(socket_group, socket_mode)
    if box is not None:
        check_box(box)
    check_socket_room(env.state_dir)  # its doorbell; each instance's is checked below
    if sweep_interval < 0.05:
        raise BadInput(f"--sweep-interval {sweep_interval:g} is too short", "give at least 0.05 seconds")
    if not 1.0 <= lease_ttl <= 3600:
        raise BadInput(f"--lease-ttl {lease_ttl:g} is out of range",
                       "give between 1 and 3600 seconds (default 30)")
    if metrics_listen is not None:
        from runners.agent.metrics import parse_listen

        parse_listen(metrics_listen)  # a bad value is refused before anything starts
    logs.configure(log_level, log_format)
    store = env.store(lock_wait=LOCK_WAIT)
    enter_agent_leaf()  # under systemd: into its own leaf before it starts anything
    if listen == "off" and store.dialect != "postgresql":
        raise BadInput("--listen off is for a PostgreSQL store",
                       "leave it out: the agent of a SQLite store hears the CLI's doorbell "
                       "and polls its file")
    for name in store.read(lambda s: s.execute(select(Host.name).where(
            Host.kind == HostKind.instance)).scalars().all()):
        check_socket_room(env.state_dir, name)  # e.g. a state dir moved to a longer path
    me = agent_id(env.state_dir, box)
    store.name_connections(f"vigil-{me}")  # pg_stat_activity: vigil-<box>-<purpose>
    started = PipeBell()  # a keeper started on demand: the agent's keeper watch watches it

    def wire(hooked: Store, stopping: threading.Event) -> Context:  # once the state dir is locked
        return make_context(env.state_dir, hooked, me, lease_ttl=lease_ttl,
                            sockets=SocketAccess(env.state_dir, group, mode),
                            log_max_bytes=log_max_bytes, log_files=log_files,
                            keeper_started=started.ring, shutting_down=stopping)

    sys.exit(AgentDaemon(env.state_dir, me, store, wire, started, scan_interval=safety_interval, sweep_interval=sweep_interval,
                         converge_budget=converge_budget, metrics_listen=metrics_listen,
                         db=env.db, keep=keep_of(keep_history, keep_last),
                         listen=listen == "on").run())


@agent.command("start", context_settings={"ignore_unknown_options": True,
                                          "allow_extra_args": True})
@click.option("--timeout", "ready_timeout", type=SECONDS, default=60.0, show_default=True,
              help="How long to wait for the agent to report ready.")
@click.argument("options", nargs=-1, type=click.UNPROCESSED)
@click.pass_obj
def agent_start(env: Env, ready_timeout: float, options: tuple[str, ...]) -> None:
    """Start the agent detached (it takes the options of `vigil agent`), its log in
    <state>/agent.log; return once it is ready (recovery done), or say why it is not."""
    import subprocess
    import uuid

    from runners.base import sd_notify
    from runners.base.doorbell import running_agent_pid

    running = running_agent_pid(env.state_dir)
    if running is not None:
        click.echo(f"agent already running on {env.state_dir} (pid {running})")
        return
    env.store()  # no state dir, no store, a store not at head: one line, nothing started
    log_path = env.state_dir / AGENT_LOG
    # The agent says READY=1 once recovered, as it does to systemd (runners/base/sd_notify.py).
    name = f"vigil-start-{uuid.uuid4().hex}"
    # The name is world-readable in /proc/net/unix: anyone may send to it, so only the
    # child's READY=1 counts (each datagram comes with its sender's pid).
    bell = sd_notify.bind("\0" + name)
    child_env = {**os.environ, "VIGIL_HOME": str(env.state_dir), "NOTIFY_SOCKET": "@" + name}
    for var, value in (("VIGIL_DB", env.db), ("VIGIL_LISTEN_DB", env.listen_db)):
        child_env.pop(var, None)
        if value:
            child_env[var] = value  # in the environment: a password stays out of `ps`
    with open(log_path, "ab", opener=lambda p, f: os.open(p, f, 0o600)) as log:
        offset = log.tell()
        child = subprocess.Popen([sys.executable, "-m", "runners.cli", "agent", *options],
                                 stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                 env=child_env, start_new_session=True, close_fds=True)
    deadline = time.monotonic() + ready_timeout
    try:
        while True:
            bell.settimeout(0.1)
            try:
                if _ready_from(bell, child.pid):
                    break
            except TimeoutError:
                pass
            if child.poll() is not None:
                raise VigilError(f"the agent exited ({child.returncode}) before it was ready: "
                                 f"{_why(log_path, offset)}", f"see {log_path}")
            if time.monotonic() > deadline:
                raise VigilError(f"the agent (pid {child.pid}) did not report ready within "
                                 f"{ready_timeout:g}s; it may still be recovering",
                                 f"see `vigil agent status` and {log_path}")
    finally:
        bell.close()
    click.echo(f"agent started on {env.state_dir} (pid {child.pid}); log {log_path}")


def _ready_from(bell: Any, pid: int) -> bool:
    """One datagram off `bell`: True when it says READY=1 and process `pid` sent it."""
    from runners.base import sd_notify

    data, sender = sd_notify.receive(bell)
    return b"READY=1" in data and sender == pid


def _why(log_path: os.PathLike[str], offset: int) -> str:
    """The line that says why a starting agent exited: its `vigil: error:` line, else the
    last line it wrote."""
    try:
        with open(log_path, "rb") as f:
            f.seek(offset)
            lines = [ln.strip() for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "(its log cannot be read)"
    for ln in reversed(lines):
        if ln.startswith("vigil: error: "):
            return ln.removeprefix("vigil: error: ")
    return lines[-1] if lines else "(it wrote nothing)"


@agent.command("install")
@click.option("--user", is_flag=True,
              help="A user unit (~/.config/systemd/user), run by `systemctl --user`.")
@click.option("--print", "print_only", is_flag=True, help="Print the unit; write nothing.")
@click.pass_obj
def agent_install(env: Env, user: bool, print_only: bool) -> None:
    """Write the systemd unit that runs this install's agent (this venv's vigil, the state
    dir and --db given; Delegate=yes, KillMode=process, Restart=always, LimitNOFILE= for the
    hosts' needs), then enable and start it where systemd runs."""
    from runners.cli.agentunit import install

    install(env, user, print_only)


@agent.command("stop")
@click.option("--wait", is_flag=True, help="Return once the agent has exited.")
@click.option("--timeout", type=SECONDS, default=60.0, show_default=True)
@click.pass_obj
def agent_stop(env: Env, wait: bool, timeout: float) -> None:
    """Stop the agent (SIGTERM); the apps keep running, and the next agent adopts them."""
    from runners.base.doorbell import running_agent_pid

    pid = running_agent_pid(env.state_dir)
    if pid is None:
        click.echo(f"no agent is running on {env.state_dir}")
        return
    signal_agent(env.state_dir, pid)
    if not wait:
        click.echo(f"agent pid {pid} stopping (apps keep running)")
        return
    await_agent_exit(env.state_dir, pid, time.monotonic() + timeout,
                     f"see {env.state_dir / AGENT_LOG}; `kill -9 {pid}` is safe: "
                     "the next agent recovers what was in flight")
    click.echo(f"agent pid {pid} stopped (apps keep running)")


def signal_agent(state_dir: Path, pid: int) -> None:
    """SIGTERM to the agent holding the state dir's lock (pid from running_agent_pid)."""
    import signal

    if pid < 0:
        raise VigilError(f"an agent holds the lock of {state_dir} but its pid is unreadable",
                         "find it with `fuser` on agent.lock and stop it with kill")
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass


def await_agent_exit(state_dir: Path, pid: int, deadline: float, fix: str) -> None:
    """Until agent `pid` has exited and let go of the lock; past `deadline`, one line."""
    from runners.base.doorbell import running_agent_pid
    from runners.base.pids import live_status

    while running_agent_pid(state_dir) == pid or live_status(pid) is not None:
        if time.monotonic() > deadline:
            raise VigilError(f"agent pid {pid} is still running after SIGTERM", fix)
        time.sleep(0.05)


@agent.command("status")
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
def agent_status(env: Env, as_json: bool) -> None:
    """Whether an agent runs on the state dir: pid, box, version, up since, last round and
    open obligations. Exit 3 when none runs."""
    from runners.cli.output import age

    info = env.quick().call("agent")
    from runners.cli.runopts import limits_line  # the controllers this box enforces limits on
    info["limits"], line = limits_line()
    if as_json:
        echo_json(info)
    else:
        state = "running" if info["running"] else "not running"
        click.echo(f"agent: {state} on {info['state_dir']}")
        rows = [("pid", info["pid"]), ("box", info["box"]), ("version", info["version"]),
                ("up since", info["up_since"] and f"{info['up_since']} ({age(info['up_since'])})"),
                ("last round", info["last_round"] and f"{age(info['last_round'])} ago"),
                ("open obligations", info["open_obligations"]), ("limits", line)]
        for key, value in rows:
            if value is not None:
                click.echo(f"  {key + ':':<18}{value}")
        if not info["running"]:
            click.echo("  start it with `vigil agent start`")
    if not info["running"]:
        sys.exit(3)
