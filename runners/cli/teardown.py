"""`vigil shutdown`: the reverse of the quickstart. Every host stopped (its stop signal,
drain, proof, lease given back), then the agent, then the fd holder's listening sockets closed,
then the keepers gone: nothing of vigil runs on this box and no port it held still takes
connections. (`vigil agent stop` keeps the apps and sockets on purpose, for the next agent.)
The hosts stay defined and their listeners declared: `vigil agent start` and `vigil wake`
bring them back (each socket bound again, recorded as `listener_reopened`)."""

from __future__ import annotations

import time
from pathlib import Path

import click

from models.errors import Refused, VigilError
from runners.cli.common import SECONDS, Env, ring
from runners.cli.several import Each

HELPERS = (("fd holder", "listeners.lock"), ("log keeper", "logs.lock"),
           ("fence keeper", "fence.lock"))  # runners/keepers/: their lock files


@click.command("shutdown")
@click.option("--wait", is_flag=True, help="Return once every keeper has exited too "
                                           "(else they exit by themselves within seconds).")
@click.option("--timeout", type=SECONDS, default=300.0, show_default=True)
@click.pass_obj
def shutdown(env: Env, wait: bool, timeout: float) -> None:
    """Stop every host, the agent, the held sockets and the keepers: nothing of vigil left
    running on this box (`vigil agent stop` keeps the apps; this does not)."""
    from runners.base.doorbell import box_of, running_agent_pid
    from runners.cli.lifecycle import stopped
    from workflows.generations.shutdown import hosts_of_box

    deadline = time.monotonic() + timeout
    store = env.store()
    box = box_of(env.state_dir)
    hosts = store.read(lambda s: hosts_of_box(s, box, store.dialect != "postgresql"))
    pid = running_agent_pid(env.state_dir)
    if pid is None:
        leased = store.read(lambda s: hosts_of_box(s, box, False)) if box else []
        if leased:
            raise Refused(f"no agent is running on {env.state_dir}, and {len(leased)} host(s) "
                          f"still hold their lease ({', '.join(leased[:5])})",
                          "start it with `vigil agent start`, then `vigil shutdown` again")
        hosts = []
    from workflows.lifecycle.order import dependents_first, stored_graph

    # Dependents first (each host's stop also waits for the stops of those that start after
    # it); forced: a host another box still runs after is stopped here all the same.
    hosts = store.read(lambda s: dependents_first(hosts, stored_graph(s)))
    each = Each(hosts)
    queued = []
    for name in hosts:
        req = each.run(name, env.quick().call, "stop", name=name, force=True)
        if req is not None:
            queued.append((name, req["id"]))
    for name, row_id in queued:
        each.run(name, stopped, env, name, row_id, max(0.0, deadline - time.monotonic()))
    each.end("shutdown: stop")
    if pid is not None:
        _stop_agent(env.state_dir, pid, deadline)
    closed = _close_sockets(env, box)
    click.echo(f"closed {closed} listening socket(s)")
    _end_standbys(env.state_dir)
    _ask_to_leave(env.state_dir)
    if not wait:
        click.echo("the keepers exit by themselves within seconds (`--wait` waits for them)")
        return
    while running := _running(env.state_dir):
        _end_standbys(env.state_dir)  # one that took its lock after the first ending
        if time.monotonic() > deadline:
            raise VigilError(f"still running {timeout:g}s after shutdown began: "
                             f"{', '.join(running)}", "see <state>/logs/ for why")
        time.sleep(0.02)  # the keepers leave within ms of being asked
    click.echo(f"nothing of vigil runs on {env.state_dir}")
    ring(env)  # a store shared with other boxes: theirs see the stopped hosts at once


def _holder(lock: Path) -> int | None:
    from runners.base.doorbell import lock_holder

    return lock_holder(lock)


def _stop_agent(state_dir: Path, pid: int, deadline: float) -> None:
    from runners.cli.agent import await_agent_exit, signal_agent

    signal_agent(state_dir, pid)
    await_agent_exit(state_dir, pid, deadline,
                     f"`kill -9 {pid}` is safe, then `vigil shutdown` again")
    click.echo(f"agent pid {pid} stopped")


def _close_sockets(env: Env, box: str | None) -> int:
    """Close every socket the fd holder keeps (the agent, gone, kept the only other
    copies), then mark this box's held listeners lost with the reason."""
    from runners.backend.listen import Listeners
    from workflows.generations.shutdown import mark_closed

    if _holder(env.state_dir / "listeners.lock") is not None:
        try:
            Listeners(env.state_dir).peer.ask({"op": "keep", "keys": []}, [], start=False)
        except OSError as exc:
            raise VigilError(f"the fd holder did not close its sockets ({exc})",
                             "run `vigil shutdown` again") from None
    return env.store().write(lambda s: mark_closed(s, box)) if box else 0


def _ask_to_leave(state_dir: Path) -> None:
    """The fd holder and the log keeper exit once they hold nothing, not IDLE seconds after
    their last request (what `--wait` waited on: 5 s with nothing running). One that does
    not answer exits by itself all the same."""
    from runners.backend.listen import Listeners
    from runners.keepers.logpipes import LogPipes

    for peer in (Listeners(state_dir).peer, LogPipes(state_dir).peer):
        try:
            peer.ask({"op": "leave"}, start=False)
        except OSError:
            pass


def _running(state_dir: Path) -> list[str]:
    """The keepers still running, and their standbys (seen once lingering after a shutdown
    that said nothing of vigil ran: a standby that took its lock after the first ending)."""
    from runners.keepers.wire import standby_of

    return [what for what, lock in HELPERS if _holder(state_dir / lock)] + [
        f"{what}'s standby" for what, lock in HELPERS[:2] if _holder(standby_of(state_dir / lock))]


def _end_standbys(state_dir: Path) -> None:
    """A standby keeper holds nothing of its own (it waits to take over a running one's
    things; the log keeper's holds copies of the running one's pipes, which that one keeps):
    ended now, so it does not become the next holder of nothing for another idle period."""
    import psutil

    from runners.keepers.wire import standby_of

    for _, lock in HELPERS[:2]:
        pid = _holder(standby_of(state_dir / lock))
        if pid is None or pid <= 0:
            continue
        try:
            p = psutil.Process(pid)
            if "--standby" in p.cmdline() and "runners.keepers" in " ".join(p.cmdline()):
                p.kill()
        except psutil.Error:
            pass
