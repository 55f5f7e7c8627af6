"""`vigil rollout start|status|pause|resume|abort|list`: one build to many hosts in waves.
Each command writes its intent (or reads) and rings the agents, which advance the rollout
(workflows/rollouts/driver.py)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from models.errors import LostRace, VigilError
from models.states import Mode
from runners.base.doorbell import running_agent_pid
from runners.cli.common import SECONDS, poll, ring

DEFAULT_WAVES = "1,25%,100%"  # as workflows/rollouts/waves.py (a test keeps them equal)


def _write(env: Any, fn: Any) -> Any:
    """An intent; on PostgreSQL an agent may move the rollout between our read and our
    write (the move then matches nothing): read again and retry."""
    for _ in range(5):
        try:
            return env.store().write(fn)
        except LostRace:
            time.sleep(0.05)
    return env.store().write(fn)


@click.group()
def rollout() -> None:
    """One build to many hosts in waves, halted (and reverted) on failure."""


@rollout.command("start")
@click.argument("build_path", metavar="BUILD")
@click.option("--host", "names", multiple=True, help="A target host (repeatable), in order.")
@click.option("--hosts", "glob", default=None, help="Target every host matching GLOB (by name).")
@click.option("--waves", default=DEFAULT_WAVES, show_default=True,
              help="Cumulative wave sizes: host counts or percentages.")
@click.option("--mode", type=click.Choice([m.value for m in Mode]), default="overlap",
              show_default=True)
@click.option("--canary", is_flag=True, help="Each successor must stay up for the settle window.")
@click.option("--pause", default=None, type=SECONDS, metavar="SECONDS",
              help="Wait this long after a wave settles before the next one starts.")
@click.option("--max-failures", type=click.IntRange(min=0), default=0, show_default=True,
              help="Failed hosts tolerated before the rollout halts.")
@click.option("--auto-revert", is_flag=True,
              help="On a halt, deploy every moved host back to the build it ran before.")
@click.option("--wait", is_flag=True, help="Show the waves as they go; exit 0 when it is done.")
@click.option("--timeout", default="3600", type=SECONDS, metavar="SECONDS",
              show_default=True)
@click.pass_obj
def start(env: Any, build_path: str, names: tuple[str, ...], glob: str | None, waves: str,
          mode: str, canary: bool, pause: float | None, max_failures: int, auto_revert: bool,
          wait: bool, timeout: float) -> None:
    """Deploy BUILD to the hosts named, wave after wave; prints the rollout's id."""
    from runners.backend.files import stage_build
    from workflows.config.hosts import record_build
    from workflows.rollouts.request import request_rollout, select_hosts
    from workflows.rollouts.waves import parse_waves

    parse_waves(waves)  # bad input is refused before anything is staged
    store = env.store()
    store.read(lambda s: select_hosts(s, list(names), glob))
    path, digest = stage_build(build_path, env.state_dir)

    def intent(s):  # type: ignore[no-untyped-def]
        hosts = select_hosts(s, list(names), glob)
        build = record_build(s, path, digest, str(Path(build_path).absolute()))
        return request_rollout(s, build, hosts, waves=waves, mode=Mode(mode), canary=canary,
                               pause=pause, max_failures=max_failures, auto_revert=auto_revert)

    started = store.write(intent)
    ring(env)
    sizes = ", ".join(str(len(w)) for w in started.waves)
    click.echo(f"rollout #{started.id} of build {digest[:12]}: "
               f"{sum(len(w) for w in started.waves)} host(s) in {len(started.waves)} wave(s) "
               f"({sizes}), mode {mode}")
    for i, hosts in enumerate(started.waves, 1):
        click.echo(f"  wave {i}: {' '.join(hosts)}")
    for host, why in started.skipped:
        click.echo(f"  skipped {host}: {why}")
    if wait:
        _wait(env, started.id, timeout)


@dataclass
class _Shown:
    """What a --wait has shown so far."""

    admitted: int = 0  # waves
    settled: int = 0
    state: str = "running"
    warned: bool = False  # that no agent runs


def _wait(env: Any, rollout_id: int, timeout: float) -> None:
    from workflows.rollouts.status import rollout_status

    store = env.store()
    seen = _Shown()

    def tick(st: dict[str, Any], elapsed: float) -> None:
        at = f"{elapsed:7.2f}s"
        for k in range(1, st["wave"] + 1):  # in wave order, whatever happened between polls
            wave = [t for t in st["targets"] if t["wave"] == k]
            if k > seen.admitted:
                click.echo(f"{at}  wave {k} admitted: {' '.join(t['host'] for t in wave)}")
            if seen.settled < k <= st["settled"]:
                counts = ", ".join(f"{sum(1 for t in wave if t['state'] == x)} {x}" for x in
                                   sorted({t["state"] for t in wave}))
                click.echo(f"{at}  wave {k} settled: {counts or 'nothing to deploy'}")
        seen.admitted, seen.settled = st["wave"], st["settled"]
        if st["state"] != seen.state and st["state"] != "ended":
            click.echo(f"{at}  {st['state']}" + (f": {st['reason']}" if st["reason"] else ""))
        seen.state = st["state"]
        if (st["state"] != "ended" and not seen.warned and elapsed > 3
                and running_agent_pid(env.state_dir) is None):
            click.echo(f"vigil: no agent is running on {env.state_dir}; the rollout waits for "
                       "`vigil agent`", err=True)
            seen.warned = True

    st = poll(lambda: store.read(lambda s: rollout_status(s, rollout_id)),
              lambda st, _elapsed: st["state"] == "ended", timeout=timeout, tick=tick,
              late=lambda st: (f"rollout #{rollout_id} is {st['state']} at wave {st['wave']} "
                               f"of {st['wave_count']}"), interval=0.1,
              fix=f"watch `vigil rollout status {rollout_id}`; the agents keep working on it")
    line = f"rollout #{rollout_id} {st['outcome']}: {st['reason']}"
    if st["outcome"] != "done":
        raise VigilError(line, f"see `vigil rollout status {rollout_id}`")
    click.echo(line)


@rollout.command("status")
@click.argument("rollout_id", metavar="[ID]", type=int, required=False)
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
def status(env: Any, rollout_id: int | None, as_json: bool) -> None:
    """A rollout (the newest one without ID): per wave and per host, its attempt, outcome,
    execution and drain time."""
    from workflows.rollouts.status import rollout_status

    st = env.store().read(lambda s: rollout_status(s, rollout_id))
    if as_json:
        click.echo(json.dumps(st, indent=2, default=str))
        return
    from runners.cli.output import show, status_heading, targets_table

    click.echo(status_heading(st))
    show(targets_table(st["targets"]))


@rollout.command("list")
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
def listing(env: Any, as_json: bool) -> None:
    """Every rollout, oldest first."""
    from workflows.rollouts.status import rollout_list

    rows = env.store().read(rollout_list)
    if as_json:
        click.echo(json.dumps(rows, indent=2, default=str))
        return
    from runners.cli.output import rollouts_table, show

    show(rollouts_table(rows))


def _intent(name: str, fn_name: str, doc: str) -> None:
    @rollout.command(name, help=doc)
    @click.argument("rollout_id", metavar="ID", type=int)
    @click.pass_obj
    def command(env: Any, rollout_id: int) -> None:
        from workflows.rollouts import request as intents

        fn = getattr(intents, fn_name)
        line = _write(env, lambda s: fn(s, rollout_id))
        ring(env)
        click.echo(line)


_intent("pause", "pause_rollout", "Let the wave in flight settle; start no new wave until resumed.")
_intent("resume", "resume_rollout", "Start waves again after a pause.")
_intent("abort", "abort_rollout", "End the rollout: no new wave, no revert; attempts not started "
        "are cancelled, those running finish.")
