"""How rows change (docs/internals/architecture.md): a state column only by `move` with its
`frm` (the transition table consulted), a protocol fact only by a primitive of models/
(`move`, or models/facts.py, each with its guard declared), and by hand in workflows/ and
runners/ only plain bookkeeping: pacing columns, and the agent's own status row."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from models import facts
from models.states import Desired, WakeState
from models.tables import Host, Wake
from models.transition import Unfenced, move, move_many

ROOT = Path(__file__).resolve().parents[2]
BOOKKEEPING_COLUMNS = {"next_attempt_at", "attempts", "last_error"}  # pacing: protects nothing
BOOKKEEPING_TABLES = {"AgentRow"}  # the agent's own status row (heartbeat, start, stop)


def _update_root(node: ast.expr) -> ast.Call | None:
    """The `update(X)` / `X.update()` a chain of calls (`.where(...).values(...)`) starts from."""
    while isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        if node.func.attr == "update" and not node.args and not node.keywords:
            return node  # `table.update()` (a dict's update takes an argument)
        node = node.func.value
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "update":
        return node
    return None


def hand_written_writes(path: Path) -> list[str]:
    """Each UPDATE built in `path` that sets more than bookkeeping: 'line: table {columns}'."""
    out = []
    updates: dict[ast.Call, set[str | None]] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and _update_root(node) is node:
            updates.setdefault(node, set())
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr == "values" and (root := _update_root(node.func.value)):
            cols = updates.setdefault(root, set())
            cols.update(k.arg for k in node.keywords)  # None: a **mapping nobody can read
            for a in node.args:
                cols.update(k.value if isinstance(k, ast.Constant) else None
                            for k in (a.keys if isinstance(a, ast.Dict) else [None]))
    for call, cols in updates.items():
        target = ast.unparse(call.args[0] if call.args else call.func.value)  # type: ignore[attr-defined]
        table = target.removesuffix(".__table__")
        if table in BOOKKEEPING_TABLES or (cols and cols <= BOOKKEEPING_COLUMNS):
            continue
        out.append(f"{call.lineno}: {table} {sorted(map(str, cols))}")
    return out


def test_workflows_and_runners_write_only_bookkeeping_by_hand() -> None:
    found, scanned = {}, set()
    for top in ("workflows", "runners"):
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            scanned.add(path.parent.relative_to(ROOT).as_posix())
            hits = hand_written_writes(path)
            if hits:
                found[rel] = hits
    assert {"workflows/leases", "workflows/engine", "runners/agent"} <= scanned
    assert found == {}, ("a protocol fact or state written by hand: use move() or a primitive "
                         f"of models/facts.py, or say why it is bookkeeping: {found}")


def test_the_scan_sees_a_hand_written_fact(tmp_path: Path) -> None:
    """The scan itself: a lease written by hand is found; pacing is not."""
    probe = tmp_path / "probe.py"
    probe.write_text("x = s.execute(update(Lease).where(Lease.host == h).values(fence=2))\n"
                     "y = Host.__table__.update().where(Host.name == h).values({'raised': True})\n"
                     "z = update(Wake).where(Wake.id == 1).values(next_attempt_at=now)\n")
    assert sorted(hand_written_writes(probe)) == ["1: Lease ['fence']", "2: Host ['raised']"]


def test_a_state_column_moves_only_with_its_frm() -> None:
    """Refused before any SQL (no session needed): the transition table is always consulted."""
    with pytest.raises(TypeError, match="state is a state column"):
        move(None, Wake, {"id": 1}, {"state": WakeState.done}, "probe",  # type: ignore[arg-type]
             fence=Unfenced("probe"))
    with pytest.raises(TypeError, match="desired is a state column"):
        move_many(None, Host, [Host.name == "web"], {"desired": Desired.down},  # type: ignore[arg-type]
                  "probe", fence=Unfenced("probe"))
    with pytest.raises(TypeError, match="state is a state column"):  # col named, frm not
        move(None, Wake, {"id": 1}, {"state": WakeState.done}, "probe",  # type: ignore[arg-type]
             fence=Unfenced("probe"), col="state")


def test_every_fact_primitive_declares_its_guard() -> None:
    for name, fn in inspect.getmembers(facts, inspect.isfunction):
        if fn.__module__ == facts.__name__ and not name.startswith("_") and name != "live":
            assert (fn.__doc__ or "").startswith("Guard:"), f"facts.{name} names no guard"
