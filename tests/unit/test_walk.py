"""The descendant walk (runners/backend/descendants.py): by each process's children files where
the kernel has them, by one scan of every process's parent otherwise; both see the same
tree below a leader (a real one: a shell, its child, its grandchild)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator

import psutil
import pytest

from runners.backend import descendants
from tests.conftest import wait_for
from workflows.base.ports import ProcRef

TREE = "sleep 60 & (sleep 61 & wait) & wait"  # leader -> sleep, subshell -> sleep


@pytest.fixture
def tree() -> Iterator[subprocess.Popen[bytes]]:
    p = subprocess.Popen(["/bin/sh", "-c", TREE], start_new_session=True)
    try:
        yield p
    finally:
        os.killpg(p.pid, signal.SIGKILL)  # its own session: the tree and nothing else
        p.wait(10)


def _below(pid: int) -> set[int]:
    return {c.pid for c in psutil.Process(pid).children(recursive=True)}


def test_children_files_and_the_scan_see_the_same_tree(tree: subprocess.Popen[bytes]) -> None:
    wait_for(lambda: len(_below(tree.pid)) == 3, 10, what="the shell's three descendants")
    ref = ProcRef(generation_uuid="u", pid=tree.pid,
                  create_time=psutil.Process(tree.pid).create_time(), cgroup=None)
    if descendants._children(tree.pid) is None:
        pytest.skip("this kernel has no /proc/<pid>/task/<tid>/children")
    by_files = {pid for pid, _ in descendants.walk([ref])["u"]}
    scan = descendants._by_scan()
    todo, by_scan = [tree.pid], set()
    while todo:
        kids = scan(todo.pop())
        by_scan |= set(kids)
        todo += kids
    assert by_files == by_scan == _below(tree.pid)


def test_a_gone_leader_has_no_children() -> None:
    p = subprocess.Popen(["/bin/true"])
    p.wait(10)
    deadline = time.monotonic() + 10
    while psutil.pid_exists(p.pid) and time.monotonic() < deadline:
        time.sleep(0.01)  # reaped: its pid may linger for a moment in /proc
    assert descendants._children(p.pid) in ([], None)
