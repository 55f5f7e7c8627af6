"""`--keep-history` and `--keep-last`, shared by `vigil agent` (its scheduled prune) and
`vigil gc` (a prune now): what history the store keeps (workflows/engine/history.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from models.durations import parse_age
from runners.cli.common import options

if TYPE_CHECKING:
    from workflows.engine.history import Keep

KEEP_DAYS, KEEP_LAST = 30, 20  # as workflows/engine/history.py (a test keeps them equal): --help stays light


class Age(click.ParamType):
    name = "age"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        return parse_age(str(value), param.opts[0] if param else "--keep-history")


keep_options = options(
    click.option("--keep-history", type=Age(), default=f"{KEEP_DAYS}d", show_default=True,
                 help="Delete history (events, ended attempts, proven generations, "
                      "closed wakes and stops) that ended longer ago than this "
                      "(s, m, h, d, w), unless still needed; `forever` keeps it all."),
    click.option("--keep-last", type=click.IntRange(min=1), default=KEEP_LAST, show_default=True,
                 help="Per host, the newest N attempts, generations, wakes and stops are "
                      "kept whatever their age."))


def keep_of(keep_history: Any, keep_last: int) -> Keep:
    from workflows.engine.history import Keep

    return Keep(older_than=keep_history, last=keep_last)


def summary(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {table}" for table, n in counts.items()) or "nothing (kept forever)"
