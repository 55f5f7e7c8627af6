"""Crash points: VIGIL_CRASH_AT=<name>[#k] and *#k (the k-th point of any name), in a real
child process that must die by SIGKILL at the right point and name it in its log."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tests.conftest import ROOT

# Passes a, b, a, b; prints each point after passing it (so a crash shows where it was).
CHILD = """
import logging, sys
logging.basicConfig(stream=sys.stderr, format="logger=%(name)s %(message)s")
from workflows.base.crash import crashpoint, define
for name in ("t.a", "t.b"):
    define(name, "a test point")
for name in ("t.a", "t.b", "t.a", "t.b"):
    crashpoint(name)
    print(name, flush=True)
"""


def run(crash_at: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "VIGIL_CRASH_AT": crash_at}
    return subprocess.run([sys.executable, "-c", CHILD], env=env, cwd=ROOT, text=True,
                          capture_output=True, timeout=30)


@pytest.mark.parametrize(("crash_at", "passed", "died_at"), [
    ("t.b", ["t.a"], "t.b"),
    ("t.a#2", ["t.a", "t.b"], "t.a"),
    ("*", [], "t.a"),
    ("*#2", ["t.a"], "t.b"),
    ("*#3", ["t.a", "t.b"], "t.a"),
])
def test_dies_at_the_named_hit(crash_at: str, passed: list[str], died_at: str) -> None:
    cp = run(crash_at)
    assert cp.returncode == -signal.SIGKILL, (cp.returncode, cp.stderr)
    assert cp.stdout.split() == passed
    assert f"logger=vigil.crash crash point={died_at} at={crash_at}" in cp.stderr


def test_a_point_never_reached_does_not_crash() -> None:
    cp = run("*#5")
    assert cp.returncode == 0, cp.stderr
    assert cp.stdout.split() == ["t.a", "t.b", "t.a", "t.b"]
    assert "crash point" not in cp.stderr
