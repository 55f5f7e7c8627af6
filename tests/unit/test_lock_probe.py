"""A lock file says one helper (or one agent) of its kind runs; `lock_holder` asks by taking
the lock for a moment. A helper that starts while the agent probes (the agent polls every
2 ms while it waits for a new helper) must still get its lock: before take_lock, about one
claim in 25 under a probing process failed and the new log keeper exited at once, so the
agent waited START_BOUND and the spawn failed ("the log keeper did not answer")."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from runners.base.doorbell import lock_holder
from runners.keepers.wire import claim

ROOT = Path(__file__).resolve().parents[2]
PROBER = ("import sys\nfrom pathlib import Path\nfrom runners.base.doorbell import lock_holder\n"
          "print('probing', flush=True)\nwhile True:\n    lock_holder(Path(sys.argv[1]))\n")


@pytest.fixture
def probed(tmp_path: Path) -> Iterator[Path]:
    """A lock file another process probes without pause."""
    path = tmp_path / "helper.lock"
    path.write_text("")
    prober = subprocess.Popen([sys.executable, "-c", PROBER, str(path)], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert prober.stdout is not None and prober.stdout.readline() == "probing\n"
        yield path
    finally:
        prober.kill()
        prober.communicate(timeout=10)


def test_a_helper_gets_its_free_lock_while_another_process_probes_it(probed: Path) -> None:
    refused = 0
    for _ in range(300):
        lock = claim(probed)
        if lock is None:
            refused += 1
        else:
            lock.close()
    assert refused == 0, f"{refused} of 300 claims of a free lock refused by a probe"


def test_a_probe_never_sees_another_probe_as_the_holder(probed: Path) -> None:
    held = [lock_holder(probed) for _ in range(2000)]
    assert held.count(None) == len(held), "a free lock reported held while another process probed"


def test_a_held_lock_is_still_refused_and_names_its_holder(probed: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys\nfrom pathlib import Path\n"
         "from runners.keepers.wire import claim\nlock = claim(Path(sys.argv[1]))\n"
         "print('held' if lock else 'refused', flush=True)\nsys.stdin.read()\n", str(probed)],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        assert claim(probed) is None
        assert lock_holder(probed) == holder.pid
    finally:
        holder.kill()
        holder.communicate(timeout=10)
