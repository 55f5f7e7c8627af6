"""`vigil agent install`: the systemd unit of this install (this venv's `vigil`, the state
dir and store it was given), written and enabled where systemd runs, or printed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import click

from models.errors import BadInput, VigilError
from runners.cli.common import Env

UNIT = "vigil-agent.service"
SYSTEM_DIR = Path("/etc/systemd/system")
DEFAULT_NOFILE = 524288  # systemd's default hard limit (the agent raises its soft one to it)


@dataclass(frozen=True)
class UnitFacts:
    """What the unit is written from."""

    vigil: str  # the executable ExecStart runs
    state_dir: Path
    db: str | None
    listen_db: str | None
    nofile: int  # LimitNOFILE=
    user: bool  # a user unit (systemctl --user)


def vigil_executable() -> str:
    """This install's `vigil`: beside the running Python (a venv's bin/), else on PATH."""
    beside = Path(os.path.abspath(sys.executable)).parent / "vigil"  # not resolved: the venv's
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("vigil")
    if found:
        return os.path.abspath(found)
    raise BadInput(f"no `vigil` executable beside {sys.executable} nor on PATH",
                   "install vigil (./scripts/install) and run that venv's `bin/vigil agent install`")


def nofile_needed(env: Env) -> int:
    """The largest --limit-nofile of the store's hosts, at least DEFAULT_NOFILE."""
    from sqlalchemy import func, select

    from models.tables import Host

    largest = env.store().read(lambda s: s.execute(select(func.max(Host.limit_nofile))).scalar())
    return max(DEFAULT_NOFILE, int(largest or 0))


def _arg(value: str) -> str:
    """A value as a unit file takes it: `%` doubled (specifiers), quoted when it must be."""
    value = value.replace("%", "%%")
    if any(c in value for c in ' \t"\'\\;'):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return value


def _environment(facts: UnitFacts) -> list[str]:
    env = [("VIGIL_HOME", str(facts.state_dir))]
    env += [(k, v) for k, v in (("VIGIL_DB", facts.db), ("VIGIL_LISTEN_DB", facts.listen_db)) if v]
    return [f"Environment={_arg(f'{k}={v}')}" for k, v in env]


def render(facts: UnitFacts, path: Path) -> str:
    """The unit's text."""
    ctl = "systemctl --user" if facts.user else "systemctl"
    postgres = bool(facts.db and facts.db.startswith("postgres"))
    after = [] if facts.user else [
        "After=network-online.target" + (" postgresql.service" if postgres else ""),
        "Wants=network-online.target"]
    lines = [
        f"# {path}: written by `vigil agent install`{' --user' if facts.user else ''}; "
        "`--print` prints it again",
        "#",
        f"#   {_arg(facts.vigil)} --state-dir {_arg(str(facts.state_dir))} db upgrade"
        "   # after upgrading vigil",
        f"#   {ctl} restart vigil-agent   # apps keep running and are adopted",
        "#",
        "# KillMode=process: stop and restart signal the agent only; its apps and keepers",
        "# keep running, and the next agent adopts them before it says READY=1.",
        "# Delegate=yes: the agent runs in <this unit's cgroup>/agent.leaf and gives each",
        "# generation a cgroup beside it (docs/guides/production.md, \"Under systemd\").",
        "", "[Unit]", "Description=vigil agent (runs and deploys the apps in "
        f"{str(facts.state_dir).replace('%', '%%')})",
        *after,
        "", "[Service]",
        "# READY=1 once recovery is done, STOPPING=1 on shutdown, STATUS= lines",
        "Type=notify", "NotifyAccess=main", *_environment(facts),
        f"ExecStart={_arg(facts.vigil)} agent",
        "KillMode=process", "Delegate=yes", "Restart=always", "RestartSec=1",
        "# systemd's default hard limit, or the largest --limit-nofile of its hosts",
        f"LimitNOFILE={facts.nofile}",
        "# recovery health-checks every adopted app before READY=1",
        "TimeoutStartSec=300", "TimeoutStopSec=30",
        "", "[Install]", f"WantedBy={'default.target' if facts.user else 'multi-user.target'}",
    ]
    return "\n".join(lines) + "\n"


def unit_path(user: bool) -> Path:
    if not user:
        return SYSTEM_DIR / UNIT
    config = os.environ.get("XDG_CONFIG_HOME") or os.path.join(Path.home(), ".config")
    return Path(config) / "systemd" / "user" / UNIT


def _write(path: Path, text: str, private: bool) -> None:
    """Atomically; 0600 when it names a password (VIGIL_DB), else 0644."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as e:
        try:
            tmp.unlink()
        except OSError:
            pass  # never made
        raise VigilError(f"cannot write {path}: {e.strerror}",
                         "run it as root (a system unit), or pass --user") from e


def _systemctl(user: bool, *args: str) -> None:
    argv = ["systemctl", *(["--user"] if user else []), *args]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        why = (done.stderr or done.stdout).strip().splitlines()
        raise VigilError(f"`{' '.join(argv)}` failed: {why[-1] if why else done.returncode}",
                         "see `journalctl -u vigil-agent`; the unit is written, fix and run it again")


def _has_password(url: str | None) -> bool:
    from sqlalchemy.engine import make_url

    return bool(url) and bool(make_url(url).password)  # type: ignore[arg-type]


def install(env: Env, user: bool, print_only: bool) -> None:
    facts = UnitFacts(vigil_executable(), env.state_dir, env.db, env.listen_db,
                      nofile_needed(env), user)
    path = unit_path(user)
    text = render(facts, path)
    if print_only:
        click.echo(text, nl=False)
        return
    _write(path, text, _has_password(env.db) or _has_password(env.listen_db))
    if not os.path.isdir("/run/systemd/system"):
        click.echo(f"systemd is not running here: wrote {path}; where it runs, "
                   f"`{'systemctl --user' if user else 'systemctl'} enable --now vigil-agent`")
        return
    _systemctl(user, "daemon-reload")
    _systemctl(user, "enable", "--now", UNIT)
    click.echo(f"wrote {path}; vigil-agent enabled and started"
               f"{' (start at boot without a login: `loginctl enable-linger`)' if user else ''}")
