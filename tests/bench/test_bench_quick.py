"""Each bench/ script once in --quick mode, so none of them rots. These are not timings:
a script passes when it exits 0 and prints its `result:` line, in which every side carries
its durability (see missing_durability). The peers (supervisord, circus, DBOS) are
installed first by bench/install-peers into bench/.peers, so the code paths that drive
them run here too."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
BENCH = ROOT / "bench"


def missing_durability(line: str) -> list[str]:
    """What a `result:` line leaves out: every side named in it (the part before the dot of
    a `side.key=value` field) must say `side.journal=` and `side.synchronous=` (`none` for a
    side with no store), vigil must be a side, and VIGIL_SYNCHRONOUS= must be there (an
    inherited OFF would otherwise go unnoticed)."""
    fields = dict(re.findall(r"(\S+?)=(\S+)", line))
    sides = {k.split(".", 1)[0] for k in fields if "." in k}
    missing = [f"{side}.{what}" for side in sorted(sides | {"vigil"})
               for what in ("journal", "synchronous") if f"{side}.{what}" not in fields]
    return missing + ([] if "VIGIL_SYNCHRONOUS" in fields else ["VIGIL_SYNCHRONOUS"])


def test_a_result_line_without_a_sides_durability_is_caught() -> None:
    good = ("result: x vigil.per_s=1 vigil.journal=wal vigil.synchronous=FULL VIGIL_SYNCHRONOUS=unset "
            "dbos.per_s=2 dbos.journal=delete dbos.synchronous=FULL")
    assert missing_durability(good) == []
    assert missing_durability(good.replace(" dbos.journal=delete", "")) == ["dbos.journal"]
    assert missing_durability(good.replace(" VIGIL_SYNCHRONOUS=unset", "")) == ["VIGIL_SYNCHRONOUS"]
    assert missing_durability("result: x ratio=2") == ["vigil.journal", "vigil.synchronous",
                                                        "VIGIL_SYNCHRONOUS"]


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
                                    "history", "cli", "spawn_user", "top", "ui", "growth",
                                    "startup", "agent_memory", "loops"])
def test_quick(script: str, peers: None, tmp_path: Path) -> None:
    picture = tmp_path / "downtime.svg"  # the docs' picture is drawn in the same run
    extra = ["--plot", str(picture)] if script == "downtime" else []
    cp = subprocess.run([sys.executable, str(BENCH / f"{script}.py"), "--quick", *extra], cwd=ROOT,
                        capture_output=True, text=True, timeout=600)
    assert cp.returncode == 0, f"bench/{script}.py --quick exited {cp.returncode}:\n{cp.stdout}\n{cp.stderr[-3000:]}"
    assert f"result: {script}" in cp.stdout, cp.stdout
    for line in (x for x in cp.stdout.splitlines() if x.startswith("result:")):
        assert not missing_durability(line), f"{line}\nmissing: {missing_durability(line)}"
    assert "not installed" not in cp.stdout, cp.stdout
    if extra:
        svg = picture.read_text()
        assert svg.startswith("<?xml") and "<svg" in svg, svg[:200]
        assert "supervisord" in svg and "circus" in svg, "a panel a supervisor"
