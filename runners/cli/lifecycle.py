"""`vigil wake|stop|deploy|retry|restart|scale`: intents for the agent, and --wait to follow
them. A restart moves each host onto the build it runs now (workflows/deploys/restart.py); a
scale grows or shrinks a host of instances (workflows/lifecycle/scale.py)."""

from __future__ import annotations

import os
import time
from typing import Any

import click

from models.errors import VigilError
from models.states import Cause, Mode
from runners.cli.common import SECONDS, Env, poll, ring_doorbell
from runners.cli.several import Each, resolve, targets

SETTLED = ("done", "failed", "cancelled")
UNPROVEN_GRACE = 3.0  # an unproven wake is usually proven a moment later


def _wait_row(env: Env, kind: str, row_id: int, name: str, timeout: float) -> dict[str, Any]:
    """Until the wake or stop row settles and its host's lease is given back (when owed)."""
    quick = env.quick()
    unproven_at: list[float] = []

    def settled(row: dict[str, Any], elapsed: float) -> bool:
        if row["state"] in SETTLED and not row["release_owed"]:
            return True
        if row["state"] != "unproven":
            unproven_at.clear()
        elif not unproven_at:
            unproven_at.append(elapsed)
        elif elapsed - unproven_at[0] > UNPROVEN_GRACE:
            return True  # reported, not waited for
        return False

    def late(row: dict[str, Any]) -> str:
        return f"{kind} #{row_id} is still {row['state']} ({row['last_error'] or 'no error yet'})"

    said: list[str | None] = [None]  # what the wake was last said to wait on

    def tick(row: dict[str, Any], elapsed: float) -> None:
        """A wake held by its start order says on what at once, then each change."""
        on = row.get("waiting_on")
        if on != said[0]:
            if on:
                click.echo(f"{elapsed:7.2f}s  {name} waits on {on} (its start order: "
                           "each awake and ready)")
            else:
                click.echo(f"{elapsed:7.2f}s  {name} waits no more: {row['state']}")
            said[0] = on

    last: list[dict[str, Any]] = []

    def read() -> dict[str, Any]:
        last[:] = [quick.call("progress", kind=kind, id=row_id)]
        return last[0]

    return poll(read, settled, timeout=timeout, late=late, tick=tick,
                idle=quick.no_agent_guard(f"{kind} #{row_id} of {name}",
                                          lambda: last[0]["state"] if last else None))


@click.command()
@targets
@click.option("--wait", is_flag=True, help="Block until the agent has woken them or they failed.")
@click.option("--timeout", type=SECONDS, default=300.0, show_default=True)
@click.pass_obj
def wake(env: Env, names: tuple[str, ...], every: bool, wait: bool, timeout: float) -> None:
    """Start hosts' current build (HOST..., a glob such as 'web*', or --all)."""
    _each(env, "wake", in_order(env, resolve(env, names, every)), wait, timeout, woken)


def _each(env: Env, kind: str, hosts: list[str], wait: bool, timeout: float,
          follow: Any, **kw: Any) -> None:
    """Queue a wake or stop of each host, then (--wait) follow each row to its end."""
    each = Each(hosts)
    queued = []
    for name in hosts:
        req = each.run(name, env.quick().call, kind, name=name, **kw)
        if req is not None:
            queued += _queued(name, kind, req, wait)
    deadline = time.monotonic() + timeout
    for name, row_id in queued:
        each.run(name, follow, env, name, row_id, max(0.0, deadline - time.monotonic()))
    each.end(kind)


def in_order(env: Env, hosts: list[str], stop: bool = False) -> list[str]:
    """Several hosts in their start order (each after the hosts it names) to wake them, or
    (stop) each before the hosts it names; otherwise as given."""
    return hosts if len(hosts) < 2 else list(env.quick().call("order", names=hosts, stop=stop))


def _queued(name: str, kind: str, req: dict[str, Any], wait: bool) -> list[tuple[str, int]]:
    """The row to wait for, or a line saying it was queued (or that nothing was)."""
    if req["id"] is None:
        click.echo(f"job {name}: its schedule is enabled" if req.get("state") == "enabled"
                   else f"host {name} is already awake")
    elif not wait:
        click.echo(f"{kind} #{req['id']} of {name} queued")
    else:
        return [(name, req["id"])]
    return []


def woken(env: Env, name: str, wake_id: int, timeout: float) -> None:
    """Until wake `wake_id` settles: its host's line, or the error naming why not."""
    row = _wait_row(env, "wake", wake_id, name, timeout)
    if row["state"] != "done":
        detail = " (its processes are not proven gone yet)" if row["state"] == "unproven" else ""
        raise VigilError(f"wake of {name} {row['state']}: {row['reason']}{detail}",
                         f"see `vigil events {name}` and the app's output: `vigil logs {name}`")
    click.echo(f"host {name} awake: generation g{row['generation']} pid {row['pid']}")


@click.command()
@targets
@click.option("--wait", is_flag=True, help="Block until they are proven stopped.")
@click.option("--timeout", type=SECONDS, default=300.0, show_default=True)
@click.option("--force", is_flag=True,
              help="Stop a host even while hosts that start after it (--after) are up.")
@click.pass_obj
def stop(env: Env, names: tuple[str, ...], every: bool, wait: bool, timeout: float,
         force: bool) -> None:
    """Stop hosts: each its stop signal (TERM unless set) or stop command, drain,
    SIGKILL, proof, lease given back (HOST..., a glob such as 'web*', or --all; the hosts
    that start after others first)."""
    hosts = in_order(env, resolve(env, names, every), stop=True)
    _each(env, "stop", hosts, wait, timeout, stopped, force=force)


def stopped(env: Env, name: str, stop_id: int, timeout: float) -> None:
    row = _wait_row(env, "stop", stop_id, name, timeout)
    click.echo(f"host {name} stopped ({row['reason'] or 'proven gone'})")


@click.command()
@click.argument("name")
@click.argument("build_path", metavar="BUILD")
@click.option("--mode", type=click.Choice([m.value for m in Mode]), default="overlap", show_default=True)
@click.option("--canary", is_flag=True, help="The successor must stay up for the settle window.")
@click.option("--cause", type=click.Choice([c.value for c in Cause if c is not Cause.retry]),
              default="release", show_default=True)
@click.option("--wait", is_flag=True, help="Show the steps as they happen; exit 0 when done.")
@click.option("--timeout", type=SECONDS, default=600.0, show_default=True)
@click.option("--converge", is_flag=True,
              help="Worker: only make BUILD its live build; it converges after its grace.")
@click.pass_obj
def deploy(env: Env, name: str, build_path: str, mode: str, canary: bool, cause: str, wait: bool,
           timeout: float, converge: bool) -> None:
    """Move a host to a new build (overlap: zero downtime; hold: stop, then start)."""
    out = env.quick().call("deploy", name=name, build=build_path, cwd=os.getcwd(), mode=mode,
                           canary=canary, cause=cause, converge=converge)
    if out.get("job"):  # a job's deploy sets the build of its next runs, nothing more
        click.echo(f"build {out['converge'][:12]} is the build of {name}'s next runs")
        return
    if converge:
        click.echo(f"build {out['converge'][:12]} is the live build of {name}; it converges "
                   f"after {out['grace']:g}s")
        return
    if out.get("held_down"):
        click.echo(f"{out['held_down']}; deploying it as asked")
    _attempt(env, name, out["attempt"], wait, timeout, canary=canary)


@click.command()
@click.argument("name")
@click.option("--wait", is_flag=True, help="Show the steps as they happen; exit 0 when done.")
@click.option("--timeout", type=SECONDS, default=600.0, show_default=True)
@click.pass_obj
def retry(env: Env, name: str, wait: bool, timeout: float) -> None:
    """Re-arm the host's last failed build: a new attempt with cause `retry`; a host failed
    at its start limit is woken again instead."""
    out = env.quick().call("retry", name=name)
    if "wake" in out:
        click.echo(f"host {name}: failed cleared, wake #{out['wake']} queued")
        if wait:
            woken(env, name, out["wake"], timeout)
        return
    _attempt(env, name, out["attempt"], wait, timeout)


def _attempt(env: Env, name: str, attempt_id: int, wait: bool, timeout: float,
             steps: bool = True, canary: bool = False) -> None:
    """Follow an attempt: each step as it happens (`steps`), then its end as one line."""
    if not wait:
        click.echo(f"attempt #{attempt_id} of {name} queued")
        return
    quick = env.quick()
    after = quick.call("last_event")
    seen: list[str] = []  # steps printed, in order
    passed: list[int] = []  # attempts reported abandoned and written again
    settling: list[float] = [0.0]  # when the step was first seen, then each progress line

    def tick(a: dict[str, Any], elapsed: float) -> None:
        for r in a["resumed"]:  # the agent restarted: the request goes on as a new attempt
            if r["id"] not in passed:
                passed.append(r["id"])
                seen.clear()
                click.echo(f"{elapsed:7.2f}s  attempt #{r['id']} abandoned: {r['reason']}")
        # A fast attempt can pass `switched` between two polls: its event says it did.
        if a["switched"] and "switched" not in seen and a["step"] != "switched":
            seen.append("switched")
            click.echo(f"{elapsed:7.2f}s  switched")
        if not seen or seen[-1] != a["step"]:
            seen.append(a["step"])
            click.echo(f"{elapsed:7.2f}s  {a['step']}")
            settling[:] = [elapsed]
        elif canary and a["step"] == "healthy" and elapsed - settling[-1] >= 1.0:
            settling.append(elapsed)  # the canary's settle: the successor must stay up
            click.echo(f"{elapsed:7.2f}s  settling: the successor is up "
                       f"{elapsed - settling[0]:.0f}s")

    def late(a: dict[str, Any]) -> str:
        return f"attempt #{a['id']} is at {a['step']} ({a['last_error'] or 'no error yet'})"

    commits = [-1]  # the agent's count of commits its last answer carried (none: the store's)
    step: list[str] = []  # the step last read

    def read() -> dict[str, Any]:
        a = quick.call("progress", kind="attempt", id=attempt_id, after=after,
                       changed_after=commits[0])
        commits[0] = a.pop("commits", -1)
        step[:] = [a["step"]]
        return a

    # Through the agent, each read waits there for its next commit: no pause in between.
    a = poll(read, lambda a, _: a["outcome"] is not None, timeout=timeout, late=late,
             tick=tick if steps else None,
             idle=quick.no_agent_guard(f"attempt #{attempt_id} of {name}",
                                       lambda: None if step[:1] in ([], ["queued"]) else f"step {step[0]}"),
             interval=lambda _: 0.0 if commits[0] >= 0 else 0.05)
    drain = f", drain {a['drain_seconds']:.2f}s" if a["drain_seconds"] is not None else ""
    line = (("" if steps else f"host {name}: ") + f"attempt #{a['id']} {a['outcome']} (mode "
            f"{a['effective_mode']}, executed {str(a['executed']).lower()}{drain}): {a['reason']}")
    if a["outcome"] != "done":
        raise VigilError(line, f"see `vigil events {name}` and the app's output: "
                         f"`vigil logs {name}`")
    click.echo(line)


@click.command()
@targets
@click.option("--mode", type=click.Choice([m.value for m in Mode]), default="overlap",
              show_default=True, help="overlap: the successor starts beside the old one "
                                      "(instances); hold: stop, then start.")
@click.option("--wait", is_flag=True, help="Block until each has restarted and settled, or "
                                           "failed; one host: show the steps as they happen.")
@click.option("--settle", type=SECONDS, default=1.0, show_default=True,
              help="With --wait: the new generation must stay current this long.")
@click.option("--timeout", type=SECONDS, default=600.0, show_default=True)
@click.pass_obj
def restart(env: Env, names: tuple[str, ...], every: bool, mode: str, wait: bool,
            settle: float, timeout: float) -> None:
    """Restart hosts on the build they run (HOST..., a glob such as 'web*', or --all)."""
    hosts = resolve(env, names, every)
    each = Each(hosts)
    queued: list[tuple[str, dict[str, Any]]] = []
    for name in hosts:
        req = each.run(name, env.quick().call, "restart", name=name, mode=mode)
        if req is None:
            continue
        if "wake" in req:
            if req["wake"] is None:  # woken meanwhile: nothing to restart from
                click.echo(f"host {name} is already awake")
                continue
            click.echo(f"host {name} is not running: wake #{req['wake']} queued")
        if wait:
            queued.append((name, req))
        elif "attempt" in req:
            click.echo(f"restart of {name}: attempt #{req['attempt']} queued (mode {req['mode']})")
    deadline = time.monotonic() + timeout
    for name, req in queued:
        left = max(0.0, deadline - time.monotonic())
        if each.run(name, _restarted, env, name, req, left, len(hosts) == 1) is not None:
            left = max(0.0, deadline - time.monotonic())
            each.run(name, settled_generation, env, name, settle, left)
    each.end("restart")


def _restarted(env: Env, name: str, req: dict[str, Any], timeout: float, steps: bool) -> bool:
    """Follow the restart's wake or attempt to its end (raises when it failed)."""
    if "wake" in req:
        woken(env, name, req["wake"], timeout)
    else:
        _attempt(env, name, req["attempt"], True, timeout, steps)
    return True


def settled_generation(env: Env, name: str, settle: float, timeout: float) -> bool:
    """After a restart is done: its new generation stays current `settle` seconds (say so),
    or it ended first (fail, saying how: `oom`, `exited 3`, failed at its start limit)."""
    seen: dict[str, Any] = {}

    def read() -> dict[str, Any]:
        rows = env.quick().call("status", name=name)
        return rows[0] if rows else {"state": "removed", "generation": None}

    def over(row: dict[str, Any], elapsed: float) -> bool:
        g, ended = row["generation"], row.get("last_exit") or {}
        if g is not None and "g" not in seen:
            seen.update(g=g, at=elapsed)
        gone = "g" in seen and (ended.get("generation") == seen["g"] or g != seen["g"])
        if gone or row["state"] in ("failed", "down", "asleep", "removed"):
            seen["ended"] = ended.get("status") or row["state"]
            return True
        return "g" in seen and elapsed - seen["at"] >= settle

    poll(read, over, timeout=timeout, late=lambda r: f"host {name} is {r['state']}")
    if "ended" in seen:
        which = f"generation g{seen['g']}" if "g" in seen else "its new generation"
        raise VigilError(f"host {name}: {which} did not settle: {seen['ended']}",
                         f"see `vigil events {name}` and the app's output: `vigil logs {name}`")
    click.echo(f"host {name}: generation g{seen['g']} settled (current {settle:g}s)")
    return True


def _settled(env: Env, name: str, n: int) -> dict[str, Any]:
    from sqlalchemy import func, select

    from models.states import LIVE_GEN, OPEN_STOP, GenState
    from models.tables import Generation, Host, Stop

    def read(s: Any) -> dict[str, Any]:
        def count(*where: Any) -> int:
            return int(s.execute(select(func.count()).select_from(Generation).where(
                Generation.host == name, *where)).scalar_one())
        return {"current": count(Generation.state == GenState.current),
                "beyond": count(Generation.state.in_(LIVE_GEN), Generation.slot >= n),
                "stops": s.execute(select(func.count()).select_from(Stop).where(
                    Stop.host == name, Stop.state.in_(OPEN_STOP))).scalar_one(),
                "up": s.get(Host, name).desired.value}
    return env.store().read(read)


@click.command()
@click.argument("name")
@click.argument("instances", type=int)
@click.option("--wait", is_flag=True, help="Block until N serve and the removed ones are gone.")
@click.option("--timeout", type=SECONDS, default=300.0, show_default=True)
@click.pass_obj
def scale(env: Env, name: str, instances: int, wait: bool, timeout: float) -> None:
    """Run N instances of a host on its held listeners: up wakes each new slot, down stops
    the highest slots (each drains and is proven gone); a stopped host starts N at its wake."""
    from workflows.lifecycle.scale import request_scale

    done = env.store().write(lambda s: request_scale(s, name, instances))
    ring_doorbell(env.state_dir)  # its wakes and stops rang their boxes
    click.echo(done.line())
    if not wait or done.was == done.now:
        return

    def settled(row: dict[str, Any], _: float) -> bool:
        serving = row["current"] == instances or row["up"] != "up"
        return serving and not row["beyond"] and not row["stops"]

    def late(row: dict[str, Any]) -> str:
        return (f"{row['current']} of {instances} instances of {name} serve, {row['beyond']} "
                f"past slot {instances - 1} still live")

    poll(lambda: _settled(env, name, instances), settled, timeout=timeout, late=late)
    click.echo(f"host {name}: {instances} instance(s) serving")
