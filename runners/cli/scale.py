"""`vigil scale HOST N`: a host of instances grown or shrunk (workflows/lifecycle/scale.py);
--wait follows it until N serve and the removed slots are proven gone."""

from __future__ import annotations

from typing import Any

import click

from models.errors import VigilError
from runners.cli.common import SECONDS, Env, poll, ring_doorbell


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

    def late(row: dict[str, Any]) -> VigilError:
        return VigilError(f"timed out after {timeout:.0f}s: {row['current']} of {instances} "
                          f"instances of {name} serve, {row['beyond']} past slot "
                          f"{instances - 1} still live",
                          "watch `vigil obligations`; the agent keeps working on it")

    poll(lambda: _settled(env, name, instances), settled, timeout=timeout, late=late)
    click.echo(f"host {name}: {instances} instance(s) serving")
