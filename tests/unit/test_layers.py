"""The layers hold: every module's imports (read with ast, lazy ones included) flow down the
declared order of packages, and no module imports itself back through others (no cycle).

`runners -> workflows -> models`; inside workflows and runners the rooms are ordered below,
lowest first. A room may import its own modules and any room before it, never one after."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ORDER = {
    "models": [],
    "workflows": ["base", "builds", "leases", "generations", "lifecycle", "deploys", "rollouts",
                  "config", "notices", "engine"],
    "runners": ["base", "keepers", "backend", "quick", "agent", "wiring", "imports", "cli",
                "help_text", "entry"],
}
TOPS = list(ORDER)  # models first: each top-level package imports only those before it


def module_names(root: Path = ROOT) -> dict[str, Path]:
    found = {}
    for top in TOPS:
        for path in (root / top).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The vigil modules `name` imports, anywhere in its body (a lazy import is an edge too)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, *([node.module] if node.module else [])])
            # `from pkg import mod` depends on mod; on pkg itself only for names it defines
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known]
            targets = subs if len(subs) == len(node.names) else [base, *subs]
        else:
            continue
        out.update(t for t in targets if t in known and t != name)
    return out


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    known = module_names(root)
    return {name: imports(name, path, known) for name, path in known.items()}


def rank(module: str) -> tuple[int, int]:
    """(top-level layer, room within it); a package's own __init__ ranks lowest in it."""
    parts = module.split(".")
    rooms = ORDER[parts[0]]
    room = rooms.index(parts[1]) if len(parts) > 1 and parts[1] in rooms else -1
    return TOPS.index(parts[0]), room


def back_edges(g: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} imports {b}" for a, deps in g.items() for b in deps
                  if rank(b) > rank(a))


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return found


def test_every_module_is_in_a_declared_room() -> None:
    loose = [m for m in module_names() if len(m.split(".")) > 1 and m.split(".")[0] != "models"
             and m.split(".")[1] not in ORDER[m.split(".")[0]]]
    assert not loose, f"modules outside every declared room: {loose}"


def test_no_import_against_the_order() -> None:
    assert back_edges(graph()) == []


def test_no_import_cycle() -> None:
    assert cycles(graph()) == []


def test_the_checks_catch_a_cycle_and_a_back_edge() -> None:
    """The two checks above fail on a planted cycle and a planted back-edge."""
    g = {"workflows.base.a": {"workflows.engine.b"}, "workflows.engine.b": {"workflows.base.a"}}
    assert cycles(g) == [["workflows.base.a", "workflows.engine.b"]]
    assert back_edges(g) == ["workflows.base.a imports workflows.engine.b"]
    assert back_edges({"models.x": {"runners.cli"}, "runners.cli": set()}) == \
        ["models.x imports runners.cli"]
