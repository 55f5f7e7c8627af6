"""The harness's own promises: a process a test leaves behind naming its dir is found,
described and killed by pid (tests/conftest.py leftovers), and one naming no dir of the
test, or started before it, is left alone."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import psutil

from tests.conftest import leftovers, pid_dead, wait_for


def test_a_process_naming_the_dir_is_found_and_killed(short_tmp: Path) -> None:
    since = time.time()
    by_cwd = subprocess.Popen(["sleep", "60"], cwd=short_tmp)
    by_env = subprocess.Popen(["sleep", "61"], env={"VIGIL_HOME": str(short_tmp / "state")})
    other = subprocess.Popen(["sleep", "62"], cwd="/")
    try:
        found = leftovers([str(short_tmp)], since)
        assert len(found) == 2, found
        assert any(f"pid {by_cwd.pid} " in f and "sleep 60" in f for f in found), found
        assert any(f"pid {by_env.pid} " in f for f in found), found
        for p in (by_cwd, by_env):
            p.wait(5)  # killed by leftovers
        assert other.poll() is None
    finally:
        for p in (by_cwd, by_env, other):
            p.kill()
            p.wait(5)


def test_a_process_started_before_the_test_is_not_counted(short_tmp: Path) -> None:
    early = subprocess.Popen(["sleep", "60"], cwd=short_tmp)
    try:
        wait_for(lambda: time.time() - early_start(early.pid) > 1.5, 5, what="time to pass")
        assert leftovers([str(short_tmp)], time.time()) == []
        assert not pid_dead(early.pid)
    finally:
        early.kill()
        early.wait(5)


def early_start(pid: int) -> float:
    return psutil.Process(pid).create_time()


def test_test_modules_have_distinct_names() -> None:
    """The tests folders have no __init__.py: pytest imports each module by its file name,
    and a second file of the same name in another folder stops the collection of the run
    that meets both (the PostgreSQL run, which collects every folder in one process)."""
    seen: dict[str, Path] = {}
    twins = []
    for path in sorted(Path(__file__).resolve().parent.parent.rglob("test_*.py")):
        if path.name in seen:
            twins.append(f"{seen[path.name]} and {path}")
        seen.setdefault(path.name, path)
    assert not twins, f"rename one of each: {twins}"
