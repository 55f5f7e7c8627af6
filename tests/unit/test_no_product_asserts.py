"""Product code never checks with `assert`: `python -O` removes it. A check that must hold
raises a named error (models/errors.py BrokenInvariant, `present`)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_no_assert_in_models_workflows_runners() -> None:
    found = [f"{path.relative_to(ROOT)}:{node.lineno}"
             for room in ("models", "workflows", "runners")
             for path in sorted((ROOT / room).rglob("*.py"))
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Assert)]
    assert found == [], found
