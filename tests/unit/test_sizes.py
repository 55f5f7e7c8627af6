"""The house rules a reader can count (issue 26): no function over 60 lines and no module over
400 in the product code (scripts/sizes), and the CLI's default waves written as the workflow's."""

from __future__ import annotations

import importlib.machinery
import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def _sizes() -> ModuleType:
    """scripts/sizes as a module (it has no .py suffix: its loader is named)."""
    loader = importlib.machinery.SourceFileLoader("sizes", str(ROOT / "scripts" / "sizes"))
    spec = importlib.util.spec_from_loader("sizes", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def test_no_function_over_60_lines_and_no_module_over_400() -> None:
    assert _sizes().too_long() == []


def test_the_check_sees_a_long_function(tmp_path: Path) -> None:
    pkg = tmp_path / "models"
    pkg.mkdir()
    (pkg / "long.py").write_text("def f():\n" + "    x = 1\n" * 70)
    for other in ("workflows", "runners"):
        (tmp_path / other).mkdir()
    assert _sizes().too_long(tmp_path) == ["function models/long.py:1 f: 71 lines"]


def test_the_cli_default_waves_are_the_workflows() -> None:
    from runners.cli.rollout import DEFAULT_WAVES as CLI
    from workflows.rollouts.waves import DEFAULT_WAVES

    assert CLI == DEFAULT_WAVES
