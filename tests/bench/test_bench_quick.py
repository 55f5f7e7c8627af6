"""Each bench/ script once in --quick mode, so none of them rots. These are not timings:
a script passes when it exits 0 and prints its `result:` line. The peers (supervisord,
circus, DBOS) are installed first by bench/install-peers into bench/.peers, so the code
paths that drive them run here too."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.no_db

ROOT = Path(__file__).resolve().parent.parent.parent
BENCH = ROOT / "bench"


@pytest.fixture(scope="module")
def peers() -> None:
    t0 = time.monotonic()
    cp = subprocess.run([str(BENCH / "install-peers")], capture_output=True, text=True, timeout=600)
    assert cp.returncode == 0, f"bench/install-peers failed:\n{cp.stdout}\n{cp.stderr[-3000:]}"
    for name in ("supervisor", "circus", "dbos"):
        assert f"{name} not installed" not in cp.stdout, cp.stdout
    print(f"install-peers: {time.monotonic() - t0:.1f}s\n{cp.stdout}")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("script", ["latency", "downtime", "obligations", "recovery", "exits", "keepers",
                                    "history", "cli", "spawn_user"])
def test_quick(script: str, peers: None) -> None:
    cp = subprocess.run([sys.executable, str(BENCH / f"{script}.py"), "--quick"], cwd=ROOT,
                        capture_output=True, text=True, timeout=600)
    assert cp.returncode == 0, f"bench/{script}.py --quick exited {cp.returncode}:\n{cp.stdout}\n{cp.stderr[-3000:]}"
    assert f"result: {script}" in cp.stdout, cp.stdout
    assert "not installed" not in cp.stdout, cp.stdout
